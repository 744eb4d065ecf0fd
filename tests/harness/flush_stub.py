"""A stand-in for the vLLM fast path's device work on a CPU run: ``flush_kernel`` (the one kernel of
``gpupool.BlockPool.apply_predicted``) replaced by :class:`StubFlushKernel`, which applies each launch's
rounds to a reference pool (``gpupool.ReferenceBlockPool``, the oracle) and writes the result into the
device pool's tensors that the fast path reads back (``counters``, ``mirror_rows``, ``free_window``,
``free_queue``, ``block_keys``): ref counts, key counts, covered tokens, key rows, the free queue's ring
and the control words, and the launch's outputs (pops, offsets, confirmation); ``device_keys_kernel``
(a launch's cachings keyed on the device, ``gpupool.pool.DEVICE_KEYS_FROM``) by
:class:`StubDeviceKeysKernel`, the keys made on the host where the kernel writes them. No interpreter runs, so
a CPU run's host time is the host code's alone, as on a GPU where the kernel runs asynchronously
(bench/vllm_host.py's ``--device stub``).

Everything around the kernel stays real: ``apply_predicted``'s host side (arguments, the one
host-to-device copy), ``launch_flush``'s output tensors, and every read of the pool (torch ops on the
state, ``tolist``). The stub counts its launches (``launches``) and the CPU seconds it spent
(``seconds``, process time: a caller leaves them out of a host figure). It is a ``KernelInterface``,
so :class:`gpupool.instrument.Meter` counts its launches as Triton launches (and not its reads).

What it does not model, raised as :class:`StubLimitError` (a PoolError) rather than answered wrongly:
a pool it did not see from its first launch in its initial state, an op the reference refuses (the
fast path checks its ops on the host first, so none is expected; the real kernel would record the
error in the status word), a pop of a block with a reuse watcher, and any other (interpreted) kernel
launched on a pool it follows: the key table (``table``, ``overflow``) is not kept, so a device
lookup, ``validate`` or an eviction would read a stale table (and may write past it).
tests/vllm_plugin/test_vllm_flush_stub.py checks that a fast path over the stub gives the answers and
the whole observable state of the interpreted kernel.
"""
from __future__ import annotations

import contextlib
import struct
import time
import weakref

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import KernelInterface

from gpupool.errors import PoolError
from gpupool.kernels import device_keys as k_keys
from gpupool.kernels import flush as k_flush
from gpupool.kernels.layout import RW, Ctrl, KeyCol, RoundField, Status
from gpupool.keys import device_key_list
from gpupool.reference import ReferenceBlockPool


class StubLimitError(PoolError):
    """A launch the stub does not model (module docstring)."""


def _hash_bytes(hi: int, lo: int) -> bytes:
    """The reference twin's hash for a device key: its two words (the key's identity on the device)."""
    return struct.pack(">qq", hi, lo)


class _Twin:
    """One stubbed pool: its reference pool and the ring bookkeeping (positions as the device keeps
    them: ``head`` and ``tail`` absolute, ``qslot[b]`` the ring slot of a queued block, else -1)."""

    def __init__(self, ps, pc):
        n = pc.N
        ctrl = ps.ctrl.tolist()
        fresh = (ctrl[Ctrl.HEAD] == 0 and ctrl[Ctrl.TAIL] == n - 1 and ctrl[Ctrl.NUM_FREE] == n - 1
                 and ctrl[Ctrl.KEY_SEQ] == 0 and int(ps.ref_cnt.abs().sum()) == 0 and int(ps.num_keys.sum()) == 0)
        if not fresh:
            raise StubLimitError("flush stub", "the stub follows a pool from its initial state only (its first "
                                               "launch came after other device work)")
        self.pool = ReferenceBlockPool(n, enable_caching=pc.CACHING, max_keys_per_block=pc.MK)
        self.n, self.cap, self.mk = n, pc.C, pc.MK
        self.head, self.tail, self.seq = 0, n - 1, 0
        self.qslot = [-1] + list(range(n - 1))


class StubFlushKernel(KernelInterface):
    """``flush_kernel``'s stand-in (module docstring). ``check``: after each launch compare the whole
    ring with the reference's free queue (slow: tests only)."""

    def __init__(self, check: bool = False):
        self.check = check
        self.launches = 0  # its own and the device-keys stand-in's (Meter counts both)
        self.key_launches = 0  # the device-keys stand-in's
        self.seconds = 0.0
        self.active = False  # inside a launch (a caller timing torch ops leaves the stub's own out)
        self._twins: dict[int, tuple] = {}  # id(ps.ctrl) -> (a weak reference to it, _Twin)

    def _twin_of(self, ctrl) -> "_Twin | None":
        """The twin of the pool whose control words are ``ctrl``, or None (not followed, or a new pool
        at a freed one's address)."""
        ref, twin = self._twins.get(id(ctrl), (None, None))
        return twin if ref is not None and ref() is ctrl else None

    def stubbed_state(self, args) -> bool:
        """Whether a launch's ``args`` hold a pool state (``ps``) this stub follows (its key table is not
        kept: any other kernel on it would read stale slots, and may write past them)."""
        return any(isinstance(a, tuple) and getattr(a, "ctrl", None) is not None
                   and self._twin_of(a.ctrl) is not None for a in args)

    def run(self, ps, pc, fr, touch_ids, pop, ca, rounds, n_rounds, *, grid, warmup, **_launch_options):
        t0 = time.process_time()
        self.active = True
        try:
            self.launches += 1
            twin = self._twin_of(ps.ctrl)
            if twin is None:
                twin = _Twin(ps, pc)
                self._twins[id(ps.ctrl)] = (weakref.ref(ps.ctrl), twin)
            _Launch(twin, ps, fr, touch_ids, pop, ca, rounds.tolist()[: n_rounds * RW]).run()
            if self.check:
                check_ring(twin, ps)
        finally:
            self.active = False
            self.seconds += time.process_time() - t0


class _Launch:
    """One launch applied to a twin and written into the state (:meth:`run`)."""

    def __init__(self, twin: _Twin, ps, fr, touch_ids, pop, ca, table: list[int]):
        self.t, self.ps, self.pop = twin, ps, pop
        self.rows = [table[r * RW:(r + 1) * RW] for r in range(len(table) // RW)]
        last = self.rows[-1] if self.rows else [0] * RW
        F = RoundField
        nf = last[F.FREE_START] + last[F.FREE_IDS]
        ns = last[F.FREE_OFFSETS_START] + last[F.FREE_CALLS] + 1
        nt = last[F.TOUCH_START] + last[F.TOUCHES]
        nd = last[F.DEMANDS_START] + last[F.DEMANDS]
        nc = last[F.CACHE_START] + last[F.CACHINGS]
        self.free = fr.ids[:nf].tolist() if nf else []
        self.seg = fr.seg_off[:ns].tolist() if nf else []
        self.touch = touch_ids[:nt].tolist() if nt else []
        self.demands = pop.demands[:nd].tolist() if nd else []
        self.cache = (list(zip(ca.ids[:nc].tolist(), ca.key_hi[:nc].tolist(), ca.key_lo[:nc].tolist(),
                               ca.key_group[:nc].tolist(), ca.ntok[:nc].tolist())) if nc else [])
        self.ring: dict[int, int] = {}  # ring slot -> value, written at the end
        self.changed: set[int] = set()  # blocks whose rows are written at the end
        self.key_rows: dict[int, tuple] = {}  # block -> its primary key row
        self.popped: list[int] = []  # the launch's pops, every round's, in order

    def run(self) -> None:
        code = int(self.ps.status[Status.CODE])
        if code:  # a recorded error: every part does nothing, the pops read -1 (as the kernel)
            total = sum(r[RoundField.POPPED] for r in self.rows)
            self.pop.blocks[:total] = -1
            self.pop.confirm[:] = code
            return
        out_offsets = {}
        for r, row in enumerate(self.rows):
            self._free(row)
            self._touch(row)
            out_offsets.update(self._pops(row, r))
            self._cache(row)
        self._write(out_offsets)

    # ---- the parts, in the kernel's order -----------------------------------------------------------
    def _free(self, row) -> None:
        F, p = RoundField, self.t.pool
        f0, s0 = row[F.FREE_START], row[F.FREE_OFFSETS_START]
        for j in range(row[F.FREE_CALLS]):
            ids = self.free[f0 + self.seg[s0 + j]: f0 + self.seg[s0 + j + 1]]
            left, front, back = {}, [], []
            for b in ids:  # the reference's rule (docs/semantics.md section 2), to place them in the ring
                if b == 0:
                    continue
                left[b] = left.get(b, p.ref_cnt[b]) - 1
                if left[b] == 0:
                    (back if (p.enable_caching and p.keys[b]) else front).append(b)
            self._ref_op(p.free_blocks, ids)
            self.changed.update(b for b in ids if b)
            t = self.t
            if (t.tail + len(back)) - (t.head - len(front)) > t.cap:
                self._rebuild()  # no room in the ring window: the queue rewritten from its head (compaction)
                continue
            for k, b in enumerate(front):
                self._place(b, t.head - len(front) + k)
            t.head -= len(front)
            for k, b in enumerate(back):
                self._place(b, t.tail + k)
            t.tail += len(back)

    def _touch(self, row) -> None:
        F, p = RoundField, self.t.pool
        ids = self.touch[row[F.TOUCH_START]: row[F.TOUCH_START] + row[F.TOUCHES]]
        held = {}
        for b in ids:
            if b == 0:
                continue
            if held.get(b, p.ref_cnt[b]) == 0:
                self._unlink(b)
            held[b] = held.get(b, p.ref_cnt[b]) + 1
        self._ref_op(p.touch, ids)
        self.changed.update(held)

    def _pops(self, row, r: int) -> dict[int, int]:
        F, t = RoundField, self.t
        d0, nd, b0 = row[F.DEMANDS_START], row[F.DEMANDS], row[F.POPPED_START]
        offsets, o = {d0 + r: 0}, 0
        for k, d in enumerate(self.demands[d0: d0 + nd]):
            got = self._ref_op(t.pool.get_new_blocks, d)
            for b in got:
                pos = t.head + ((t.qslot[b] - t.head) & (t.cap - 1))
                self._unlink(b)
                t.head = pos + 1  # the pops are the queue's first live blocks: the head moves past the last
                self.key_rows.pop(b, None)
            self.changed.update(got)
            self.popped += got
            o += d
            offsets[d0 + r + k + 1] = o
        assert len(self.popped) == b0 + sum(self.demands[d0: d0 + nd]), "the round table's pop starts"
        return offsets

    def _cache(self, row) -> None:
        F, t = RoundField, self.t
        n = t.n
        for v, hi, lo, group, ntok in self.cache[row[F.CACHE_START]: row[F.CACHE_START] + row[F.CACHINGS]]:
            b = self.popped[v - n] if n <= v < n + len(self.popped) else v
            if not 0 < b < n or ntok <= 0:
                raise StubLimitError("flush stub", f"a caching of block {v} covering {ntok} tokens is not modelled")
            p = t.pool
            if p.keys[b] and p.hash_num_tokens[b] is not None and p.hash_num_tokens[b] >= ntok:
                raise StubLimitError("flush stub", f"block {b} is cached covering {p.hash_num_tokens[b]} tokens "
                                                   f"(>= {ntok}): the kernel records a conflict; not modelled")
            # the reference's cache_full_blocks of one block, without its argument checks (the host checked
            # them before queueing; fewer cycles off the timed path)
            p._remove_keys(b, emit=False)
            p._insert_key(b, (_hash_bytes(hi, lo), group), ntok)
            self.key_rows[b] = (hi, lo, group, t.seq, -1)  # KeyCol's order; the table slot is not kept
            t.seq += 1  # the kernel numbers a launch's keys in item order from the key counter
            self.changed.add(b)

    # ---- ring and state ---------------------------------------------------------------------------------
    def _place(self, b: int, pos: int) -> None:
        s = pos & (self.t.cap - 1)
        self.ring[s] = b
        self.t.qslot[b] = s

    def _unlink(self, b: int) -> None:
        s = self.t.qslot[b]
        self.ring[s] = -1
        self.t.qslot[b] = -1

    def _rebuild(self) -> None:
        t, ring = self.t, self.ps.ring
        q = t.pool.free_queue()
        ring.fill_(-1)
        self.ring = {}
        t.qslot = [-1] * t.n
        for k, b in enumerate(q):
            t.qslot[b] = k
        if q:
            ring[: len(q)] = torch.tensor(q, dtype=ring.dtype)
        t.head, t.tail = 0, len(q)
        self.ps.qslot.copy_(torch.tensor(t.qslot, dtype=self.ps.qslot.dtype))

    @staticmethod
    def _ref_op(fn, *args):
        try:
            return fn(*args)
        except PoolError as e:
            raise StubLimitError("flush stub", f"the reference refused {fn.__name__}: {e} (the real kernel "
                                               "records it in the status word; not modelled)") from e

    def _write(self, out_offsets: dict[int, int]) -> None:
        ps, t, p = self.ps, self.t, self.t.pool
        if self.popped and bool(ps.watched[torch.tensor(self.popped)].any()):
            raise StubLimitError("flush stub", "a pop of a block with a reuse watcher is not modelled")
        if self.popped:
            self.pop.blocks[: len(self.popped)] = torch.tensor(self.popped, dtype=self.pop.blocks.dtype)
        if out_offsets:
            idx = torch.tensor(list(out_offsets), dtype=torch.int64)
            self.pop.offsets[idx] = torch.tensor(list(out_offsets.values()), dtype=self.pop.offsets.dtype)
        if self.ring:
            ps.ring[torch.tensor(list(self.ring), dtype=torch.int64)] = torch.tensor(list(self.ring.values()),
                                                                                    dtype=ps.ring.dtype)
        if self.changed:
            ch = sorted(self.changed)
            idx = torch.tensor(ch, dtype=torch.int64)
            ps.ref_cnt[idx] = torch.tensor([p.ref_cnt[b] for b in ch], dtype=ps.ref_cnt.dtype)
            ps.num_keys[idx] = torch.tensor([len(p.keys[b]) for b in ch], dtype=ps.num_keys.dtype)
            ps.hash_ntok[idx] = torch.tensor([-1 if p.hash_num_tokens[b] is None else p.hash_num_tokens[b]
                                              for b in ch], dtype=ps.hash_ntok.dtype)
            ps.qslot[idx] = torch.tensor([t.qslot[b] for b in ch], dtype=ps.qslot.dtype)
        if self.key_rows:
            rows = torch.tensor([b * t.mk for b in self.key_rows], dtype=torch.int64)
            ps.keys[rows] = torch.tensor(list(self.key_rows.values()), dtype=ps.keys.dtype)
        ps.ctrl[Ctrl.HEAD], ps.ctrl[Ctrl.TAIL] = t.head, t.tail
        ps.ctrl[Ctrl.NUM_FREE], ps.ctrl[Ctrl.KEY_SEQ] = p.get_num_free_blocks(), t.seq
        self.pop.confirm[:] = 0
        assert KeyCol.HI == 0 and KeyCol.SLOT == 4, "key_rows' order is KeyCol's"


def check_ring(twin: _Twin, ps) -> None:
    """The stubbed ring read as the device pool reads it equals the reference's free queue (and the
    counters match)."""
    head, tail, num_free = (int(ps.ctrl[Ctrl.HEAD]), int(ps.ctrl[Ctrl.TAIL]), int(ps.ctrl[Ctrl.NUM_FREE]))
    pos = torch.arange(head, tail, dtype=torch.int64) & (twin.cap - 1)
    got = [v for v in ps.ring[pos].tolist() if v >= 0]
    want = twin.pool.free_queue()
    if got != want or num_free != len(want):
        raise StubLimitError("flush stub", f"the stubbed ring ({len(got)} blocks) is not the reference's free "
                                           f"queue ({len(want)})")


class StubDeviceKeysKernel(KernelInterface):
    """``device_keys_kernel``'s stand-in (``apply_predicted``'s cachings keyed on the device): the keys
    made on the host (``gpupool.keys.device_key_list``) and written where the kernel writes them; its
    launches and CPU time counted in the :class:`StubFlushKernel`'s, so a caller leaves them out too."""

    def __init__(self, flush: StubFlushKernel):
        self.flush = flush

    def run(self, digests, groups, hi, lo, n, k_table, *, grid, warmup, **_launch_options):
        t0 = time.process_time()
        f = self.flush
        f.active = True
        try:
            f.launches += 1
            f.key_launches += 1
            w = k_keys.HASH_BYTES
            raw = digests[: n * w // 4].numpy().tobytes()  # int32 words
            made = device_key_list(zip((raw[w * i: w * (i + 1)] for i in range(n)), groups[:n].tolist()))
            hi[:n] = torch.tensor([k[0] for k in made], dtype=torch.int64)
            lo[:n] = torch.tensor([k[1] for k in made], dtype=torch.int64)
        finally:
            f.active = False
            f.seconds += time.process_time() - t0


@contextlib.contextmanager
def stubbed_flush(check: bool = False):
    """``with stubbed_flush() as stub: ...``: ``gpupool.kernels.flush.flush_kernel`` is a
    :class:`StubFlushKernel` inside, ``gpupool.kernels.device_keys.device_keys_kernel`` a
    :class:`StubDeviceKeysKernel` counted in it (pools made inside; module docstring); the real
    kernels after."""
    stub, real, real_keys = StubFlushKernel(check), k_flush.flush_kernel, k_keys.device_keys_kernel
    k_flush.flush_kernel = stub
    k_keys.device_keys_kernel = StubDeviceKeysKernel(stub)
    interpreted = InterpretedFunction.run

    def refused(self, *args, **kwargs):  # another kernel on a stubbed pool: refused, not run on a stale table
        if stub.stubbed_state(args):
            raise StubLimitError("flush stub", f"{self.__name__} launched on a pool the stub follows (the stub "
                                               "does not keep its key table)")
        return interpreted(self, *args, **kwargs)
    InterpretedFunction.run = refused
    try:
        yield stub
    finally:
        InterpretedFunction.run = interpreted
        k_flush.flush_kernel = real
        k_keys.device_keys_kernel = real_keys


__all__ = ["StubDeviceKeysKernel", "StubFlushKernel", "StubLimitError", "stubbed_flush", "check_ring"]
