"""The vLLM adapter's backend: the pool its ops run on and everything specific to that pool
(docs/algorithms.md section 8). :class:`DeviceBackend` runs on :class:`gpupool.BlockPool` (Triton
kernels; the fast path's ops gathered in an ``OpBatch`` and launched as one
``gpupool.BlockPool.apply_predicted``); :class:`ReferenceBackend` on the CPU oracle
:class:`gpupool.reference.ReferenceBlockPool` (every op run at once). :func:`make_backend` picks one
by name; the engines (:mod:`gpupool.vllm.engine`, :mod:`gpupool.vllm.fast_path`) drive them.

Blocks are named by the host mirror's *slots*: block ids, and ``num_blocks + k`` for the fast path's
k-th placeholder (a pop whose id is not known on the host yet). The device pool is read through its
read API only (``counters``, ``mirror_rows``, ``free_window``, ``key_name``, ``host_tensor``,
``apply_predicted``, ``check``, ``sweep_key_names``), its rows as ``gpupool.kernels.layout`` names them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import itemgetter

import torch

from ..errors import InvalidArgumentError, PoolError
from ..kernels.layout import CONFIRM_WIDTH, Confirm, Counter, MirrorCol, mirror_row_width
from ..pool import BlockPool as DevicePool
from ..reference import ReferenceBlockPool
from .host_mirror import HostMirror
from .op_batch import OpBatch

class SyncRead:
    """What a backend reads for :meth:`gpupool.vllm.DeferredBlockPool.sync` (:meth:`PoolBackend.read`).

    ``ids``: the placeholders' block ids, in order; ``num_free``: the pool's free count;
    ``bad_pops``: how many popped ids differ from the host's predictions; ``window``: the free queue's
    first ids (-1 for holes; None when not asked for); ``claims``: three lists over the blocks of
    ``known`` (:func:`claims_of`): ref counts, key counts, covered tokens (None: no key); ``rows``:
    the device's whole mirror rows of ``known`` then of the placeholders' blocks when the read was not
    exact (None otherwise and on the reference backend); ``seqs_ok``: the device's key insertion
    counter is the one the host predicted (so every key's insertion seq on the host is the device's);
    ``recorded``: an error another user of the pool recorded, to raise after the mirror is exact;
    ``failed``: a launch of the fast path itself failed (``ids`` then the raw placeholder outputs,
    ``recorded`` the pool's error, with another user's error taken before a relaunch as its cause)."""

    __slots__ = ("ids", "num_free", "bad_pops", "window", "claims", "rows", "seqs_ok", "recorded", "failed")

    def __init__(self, ids, num_free=0, bad_pops=0, window=None, claims=((), (), ()), rows=None, seqs_ok=True,
                 recorded=None, failed=False):
        self.ids, self.num_free, self.bad_pops, self.window = ids, num_free, bad_pops, window
        self.claims, self.rows, self.seqs_ok, self.recorded, self.failed = claims, rows, seqs_ok, recorded, failed


def claims_of(ref, keys, ntok, known: list[int]) -> tuple[list, list, list]:
    """The host's claims on the blocks ``known`` from its lists (a mirror's ``ref``, ``keys``, ``ntok``),
    as :class:`SyncRead` holds the device's: (ref counts, key counts, covered tokens or None)."""
    if not known:
        return [], [], []
    get = itemgetter(*known)
    if len(known) == 1:
        return [get(ref)], [len(get(keys))], [get(ntok)]
    return list(get(ref)), list(map(len, get(keys))), list(get(ntok))


class PoolBackend:
    """The interface both backends share (slots as in the module docstring).

    Attributes: ``name`` (``"device"`` / ``"reference"``, the adapter's ``backend``), ``pool`` (the
    pool), ``num_blocks``, ``stream`` (the pool's own CUDA stream,
    None off CUDA), ``flushes`` (launches of a batch).

    The per-call engine: :meth:`read_rows`. The fast path: :meth:`window`, :meth:`pop_known`,
    :meth:`pop_pending`, :meth:`queue`, :meth:`cache`, :meth:`flush`, :meth:`read`, :meth:`apply`,
    :meth:`bound`.
    """

    name = ""
    stream = None
    flushes = 0

    def __init__(self, pool, num_blocks: int):
        self.pool = pool
        self.num_blocks = num_blocks

    def read_rows(self, ids: list[int], mirror: HostMirror) -> int:
        """Set the mirror of block ``ids`` from the pool (ref count, keys, covered tokens; the key map
        from the difference); returns the pool's free count."""
        raise NotImplementedError

    def window(self, n: int) -> list[int]:
        """The free queue's first ids, from its first ``n`` ring slots (-1 for holes), waiting for them."""
        raise NotImplementedError

    def pop_known(self, n: int, ids: list[int]) -> list[int] | None:
        """A ``get_new_blocks(n)`` the host predicts takes ``ids``: None when taken or queued (checked
        at :meth:`read`); else the pool's first ids, which differ, and nothing taken (the reference
        pool, changed past the adapter)."""
        raise NotImplementedError

    def pop_pending(self, n: int) -> None:
        """A ``get_new_blocks(n)`` past the host's copy of the queue: its blocks are the next ``n``
        placeholders, their ids given by :meth:`read`."""
        raise NotImplementedError

    def queue(self, kind: str, slots: list[int], front: bool) -> None:
        """A ``touch`` or ``free_blocks`` (``kind``) of ``slots``, checked on the host (``front``: a block
        it frees goes to the queue's front)."""
        raise NotImplementedError

    def cache(self, mirror: HostMirror, slots: list[int], hashes: list[bytes], group: int, ntok: list[int],
              nc: int, nf: int, block_size: int, full: Callable[[], list[bytes]]) -> Iterable[int]:
        """A ``cache_full_blocks`` of blocks ``nc .. nf - 1`` (``slots``, held and un-keyed) under
        ``hashes`` in ``group`` covering ``ntok`` tokens (``full()``: the request's hashes at
        ``block_size``, blocks ``0 .. nf - 1``). Returns the keys' insertion seqs for the mirror."""
        raise NotImplementedError

    def flush(self) -> None:
        """Launch what is queued, not waiting."""

    def queued(self) -> int:
        """How many block ids the ops queued and not launched name (0 where ops run at once)."""
        return 0

    def read(self, known: list[int], npend: int, window: int, exact: bool) -> SyncRead:
        """The pool's answers for a synchronisation: the claims of blocks ``known``, the ids of the
        first ``npend`` placeholders, (``window`` > 0) the queue's first ids from that many ring slots;
        ``exact``: the host's rows of ``known`` are claims to check (the device reads less)."""
        raise NotImplementedError

    def apply(self, mirror: HostMirror, r: SyncRead, known: list[int], exact: bool, held: bool) -> int:
        """After :meth:`read` (placeholders bound): make the mirror of ``known`` and the placeholders'
        blocks exact (``held``: the claims held, nothing to change when the insertion seqs are the
        device's too); returns the free count."""
        raise NotImplementedError

    def bound(self) -> None:
        """The placeholders are bound: forget their outputs (and the launches read)."""


class DeviceBackend(PoolBackend):
    """:class:`gpupool.BlockPool`: the fast path's ops gathered in an :class:`OpBatch` (``batch``) and
    launched as ONE ``apply_predicted`` (:meth:`flush`); the per-call engine's mirror read in one
    transfer. Args as :class:`gpupool.BlockPool`'s; on CUDA the backend makes its own ``stream``."""

    name = "device"

    def __init__(self, num_blocks: int, *, enable_caching: bool, enable_kv_cache_events: bool,
                 max_keys_per_block: int, device=None):
        pool = DevicePool(num_blocks, enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events,
                          max_keys_per_block=max_keys_per_block, device=device)
        super().__init__(pool, num_blocks)
        if pool.device.type == "cuda":
            # its own stream: a synchronisation then waits for the pool's kernels only, not for the
            # model's forward pass queued on the default stream by a worker in this process (TP = 1)
            self.stream = torch.cuda.Stream(device=pool.device)
            self.stream.wait_stream(torch.cuda.current_stream(pool.device))  # the state's initialisation
        self._mk = pool.max_keys_per_block
        self.batch = OpBatch()  # ops not launched yet
        # the device's key insertion counter as the host predicts it: the k-th key the batch caches gets
        # this plus k, as the kernel numbers them (in item order); read back at every synchronisation
        self.next_seq = 0
        self.pend: torch.Tensor | None = None  # int32 ids of the placeholders of launched pops, in order
        # the launches since the last synchronisation, (batch, confirmation, placeholders it added, its
        # pops when it predicted some: compared with the batch's predictions at the synchronisation)
        self.flights: list[tuple[OpBatch, torch.Tensor, int, torch.Tensor | None]] = []
        self.flushes = 0

    # ---- the per-call engine ----------------------------------------------------------------------
    def read_rows(self, ids: list[int], mirror: HostMirror) -> int:
        """One transfer: the free count, the key insertion counter and ``mirror_rows`` of ``ids``."""
        dev = self.pool
        idx = dev.host_tensor(ids, torch.int64)
        flat = torch.cat([dev.counters(), dev.mirror_rows(idx).reshape(-1)]).tolist()  # one transfer
        counts = flat[:len(Counter)]
        mirror.apply_rows(ids, self._rows(flat, len(Counter), len(ids)), dev.key_name)
        self.next_seq = counts[Counter.KEY_SEQ]
        return counts[Counter.NUM_FREE]

    def _rows(self, flat: list[int], o: int, n: int) -> list[list[int]]:
        """``n`` whole ``mirror_rows`` rows from ``flat[o:]``."""
        w = mirror_row_width(self._mk)
        return [flat[o + i * w: o + (i + 1) * w] for i in range(n)]

    # ---- slots -> device ids -------------------------------------------------------------------------
    def _h2d(self, values, dtype) -> torch.Tensor:
        """A host list on the device without a stream synchronisation (``gpupool.BlockPool.host_tensor``)."""
        return self.pool.host_tensor(values, dtype)

    def _device_ids(self, slots: list[int]) -> torch.Tensor:
        """``int32[len(slots)]`` on the device: known ids as they are, placeholders gathered from the
        launched flushes' pops (no synchronisation)."""
        n = self.num_blocks
        t = self._h2d(slots, torch.int64)
        if max(slots, default=0) >= n:
            # only placeholders of launched pops are asked for (OpBatch's order)
            pend = self.pend.long()
            t = torch.where(t < n, t, pend[(t - n).clamp(0, pend.numel() - 1)])
        return t.to(torch.int32)

    def _cache_ids(self, slots: list[int], k0: int, npred: int) -> torch.Tensor:
        """``int32[len(slots)]`` on the device for a flush's caching: known ids, launched
        placeholders gathered, this flush's k-th placeholder as ``num_blocks + npred + k`` (its
        place in ``apply_batched``'s pops, after the ``npred`` predicted ones)."""
        n = self.num_blocks
        if all(s < n + k0 for s in slots):
            return self._device_ids(slots)
        earlier = [s if s < n + k0 else 0 for s in slots]
        t = self._device_ids(earlier) if any(s >= n for s in earlier) else None
        mine = self._h2d([s - k0 + npred if s >= n + k0 else -1 for s in slots], torch.int32)
        base = self._h2d(earlier, torch.int32) if t is None else t
        return torch.where(mine >= 0, mine, base)

    # ---- the fast path's ops: into the batch ---------------------------------------------------------
    def window(self, n: int) -> list[int]:
        return self.pool.free_window(n).tolist()

    def pop_known(self, n: int, ids: list[int]) -> None:
        self.batch.add_pop(n, ids)

    def pop_pending(self, n: int) -> None:
        self.batch.add_pop(n, None)
        self.batch.placeholders = True

    def queue(self, kind: str, slots: list[int], front: bool) -> None:
        """Into the batch, in a new round or after a launch where ``OpBatch.placement`` says so."""
        n = self.num_blocks
        launched = n + (0 if self.pend is None else self.pend.numel())
        where = self.batch.placement(kind, slots, front, launched)
        if where == "launch":
            if self.stream is None:
                self.flush()
            else:
                with torch.cuda.stream(self.stream):
                    self.flush()
        elif where == "round":
            self.batch.cut()
        b = self.batch
        if kind == "touch":
            b.add_touch(slots)
        else:
            b.add_free(slots)
        if max(slots) >= n:
            b.placeholders = True

    def pop_one(self, slot: int) -> None:
        """:meth:`pop_known` of one block (``slot``, a block id), in fewer steps."""
        self.batch.add_pop_one(slot)

    def cache_one(self, slot: int, block_hash: bytes, group: int, ntok: int) -> int:
        """:meth:`cache` of one held block id ``slot`` in fewer steps; returns its key's insertion seq."""
        self.batch.add_cache_one(slot, (block_hash, group), ntok)
        q = self.next_seq
        self.next_seq = q + 1
        return q

    def cache(self, mirror, slots, hashes, group, ntok, nc, nf, block_size, full) -> range:
        """Into the batch; the keys take the insertion seqs the device will give them (the kernel
        numbers a launch's keys in item order from its counter), checked at the next synchronisation."""
        b = self.batch
        b.add_cache(slots, [(h, group) for h in hashes], ntok)
        if max(slots) >= self.num_blocks:
            b.placeholders = True
        q = self.next_seq
        self.next_seq = q + len(slots)
        return range(q, q + len(slots))

    def queued(self) -> int:
        return self.batch.size

    def flush(self) -> None:
        """Launch the batch (:meth:`_launch`) and start a new one."""
        b = self.batch
        if not b:
            return
        self.batch = OpBatch()
        self.flushes += 1
        self._launch(b)

    def _launch(self, b: OpBatch) -> None:
        """Launch ``b`` as ONE ``gpupool.BlockPool.apply_predicted``, not waiting; the placeholders get
        their ids from its output. Where ``b`` names placeholders its id parts are given as device ids
        (a copy of ``b``; ``b`` is kept in slots for a relaunch): a launched pop's from the earlier
        launches' outputs, this launch's k-th placeholder as ``num_blocks + npred + k`` in a caching
        (its place among the launch's pops). The launch's confirmation and its pops (compared with the
        host's predictions) are read at the next :meth:`read`."""
        k0 = 0 if self.pend is None else self.pend.numel()
        npred = len(b.pred)
        batch = b
        if b.placeholders:
            n = self.num_blocks
            free, touch, cache = b.free_ids, b.touch_ids, b.cache_ids
            if k0 and any(n <= s < n + k0 for s in free + touch + cache):
                # a launched placeholder's id is on the device only: the id parts gathered there
                ids = self._device_ids(free + touch) if free or touch else None
                batch = b.with_ids(ids[:len(free)] if free else [], ids[len(free):] if touch else [],
                                   self._cache_ids(cache, k0, npred) if cache else [])
            else:  # host ints: this launch's k-th placeholder is its (npred + k)-th pop
                batch = b.with_ids(free, touch, [s if s < n else s - k0 + npred for s in cache])
        blocks, confirm = self.pool.apply_predicted(batch)
        added = blocks.numel() - npred
        if added > 0:
            rest = blocks[npred:]
            self.pend = rest if self.pend is None else torch.cat([self.pend, rest])
        self.flights.append((b, confirm, max(added, 0), blocks if npred else None))

    # ---- the synchronisation -------------------------------------------------------------------------
    def read(self, known: list[int], npend: int, window: int, exact: bool) -> SyncRead:
        """ONE transfer (:meth:`_read_device`); launches that an error recorded before them (by another
        user of the pool) made do nothing are launched again after that error is taken from the status
        word (:meth:`_relaunch`), then read again (a second transfer). A launch's own failure: ``failed``."""
        recorded = None
        while True:
            flat, nw = self._read_device(known, npend, window, narrow=exact)
            counts = flat[:len(Counter)]
            conf, nbad, o = [], 0, len(Counter)
            for b, _, _, blocks in self.flights:  # its confirmation words, then its pops if it predicted
                words = flat[o: o + CONFIRM_WIDTH]
                conf.append((words[Confirm.BEFORE], words[Confirm.AFTER]))
                o += CONFIRM_WIDTH
                if blocks is not None:
                    got, pred = flat[o: o + len(b.pred)], b.pred
                    if got != pred:
                        nbad += sum(x != y for x, y in zip(got, pred))
                    o += blocks.numel()
            skipped = next((k for k in range(len(conf)) if conf[k][0]), None)
            if any(bf == 0 and af for bf, af in conf):
                own = self._take_recorded()
                if own is not None and recorded is not None:
                    own.__cause__ = recorded  # another user's error, taken before the relaunch: not lost
                recorded = own or recorded
                return SyncRead(self.pend[:npend].tolist() if npend else [], recorded=recorded, failed=True)
            if skipped is None:
                break
            recorded = self._take_recorded() or recorded
            self._relaunch(skipped)
        ids = flat[o: o + npend]
        o += npend
        win = None
        if window:
            win, o = flat[o: o + nw], o + nw
        nk = len(known)
        claimed = (MirrorCol.REF_CNT, MirrorCol.NUM_KEYS, MirrorCol.HASH_NTOK)
        if exact:  # the claims only, column by column (mirror_rows without key slots, transposed)
            rows, cols = None, {c: flat[o + c * nk: o + (c + 1) * nk] for c in claimed}
        else:
            rows = self._rows(flat, o, nk + npend)
            cols = {c: [r[c] for r in rows[:nk]] for c in claimed}
        claims = (cols[MirrorCol.REF_CNT], cols[MirrorCol.NUM_KEYS],
                  [None if t < 0 else t for t in cols[MirrorCol.HASH_NTOK]])
        key_seq = counts[Counter.KEY_SEQ]
        seqs_ok, self.next_seq = key_seq == self.next_seq, key_seq
        if counts[Counter.ERROR_CODE] or counts[Counter.REUSE_COUNT] or (
                counts[Counter.EV_COUNT] and self.pool.enable_kv_cache_events):
            # fires reuse watchers (more reads, counted by callers); an error here is another user's
            recorded = self._take_recorded() or recorded
        return SyncRead(ids, counts[Counter.NUM_FREE], nbad, win, claims, rows, seqs_ok, recorded)

    def _read_device(self, known: list[int], npend: int, window: int, narrow: bool) -> tuple[list[int], int]:
        """ONE device-to-host transfer: the pool's counters, each launch's confirmation (and its pops
        when it predicted some), the placeholders' ids, (``window``) the queue window and the mirror
        rows of ``known`` and the placeholders' blocks (``narrow``: no placeholders; ``known``'s rows
        without key slots, column after column). Returns (the values flat, the window's length)."""
        dev = self.pool
        pend = self.pend[:npend].long() if npend else torch.zeros(0, dtype=torch.int64, device=dev.device)
        idx = torch.cat([self._h2d(known, torch.int64), pend])
        parts = [dev.counters()]
        for _, c, _, blocks in self.flights:
            parts.append(c)
            if blocks is not None:
                parts.append(blocks)
        parts.append(pend)
        nw = 0
        if window:
            win = dev.free_window(window)
            nw = win.numel()
            parts.append(win)
        rows = dev.mirror_rows(idx, 0).t() if narrow else dev.mirror_rows(idx)
        flat = torch.cat(parts + [rows.reshape(-1)]).tolist()
        return flat, nw

    def _take_recorded(self) -> PoolError | None:
        """The pool's recorded error, taken from its status word (``check``), or None."""
        try:
            self.pool.check()
        except PoolError as e:
            return e
        return None

    def _relaunch(self, first: int) -> None:
        """Launch again the batches from launch ``first`` on, which a recorded error made do nothing
        (their placeholders' outputs dropped: the new launches give them)."""
        redo = self.flights[first:]
        self.flights = self.flights[:first]
        keep = sum(a for _, _, a, _ in self.flights)
        self.pend = self.pend[:keep] if keep else None
        for b, _, _, _ in redo:
            self._launch(b)

    def apply(self, mirror, r, known, exact, held) -> int:
        """``held`` (the claims held) and the key counter as predicted: the mirror is the device's
        already; else the whole rows (``exact``: read again, a second transfer, on this path only).
        Then the pool's housekeeping of key names (``sweep_key_names``)."""
        if not (held and r.seqs_ok):
            if exact:  # only the claims were read (no placeholders): the whole rows now
                self.read_rows(known, mirror)
            else:
                mirror.apply_rows(known + r.ids, r.rows, self.pool.key_name)
        self.pool.sweep_key_names()  # reads the device's keys when it sweeps
        return r.num_free

    def bound(self) -> None:
        self.pend, self.flights = None, []


class ReferenceBackend(PoolBackend):
    """:class:`gpupool.reference.ReferenceBlockPool`, the CPU oracle: every op runs at once, the
    placeholders' ids known at their pop (``pend``); keys ordered by the mirror's own counter
    (``HostMirror.seq``). Args as the reference pool's (no device)."""

    name = "reference"

    def __init__(self, num_blocks: int, *, enable_caching: bool, enable_kv_cache_events: bool,
                 max_keys_per_block: int, device=None):
        super().__init__(ReferenceBlockPool(num_blocks, enable_caching=enable_caching,
                                            enable_kv_cache_events=enable_kv_cache_events,
                                            max_keys_per_block=max_keys_per_block), num_blocks)
        self.pend: list[int] = []  # the placeholders' ids, in order

    def read_rows(self, ids: list[int], mirror: HostMirror) -> int:
        """From the pool's lists (new keys ordered by the mirror's counter)."""
        num_free = self.pool.get_num_free_blocks()
        mirror.apply_reference(ids, self.pool)
        return num_free

    def _ids(self, slots: list[int]) -> list[int]:
        n = self.num_blocks
        return [s if s < n else self.pend[s - n] for s in slots]

    def window(self, n: int) -> list[int]:
        return list(self.pool.free_queue())[:n]

    def pop_known(self, n: int, ids: list[int]) -> list[int] | None:
        """Pops only when the pool's first ``n`` free blocks are ``ids`` (else returns those, nothing
        taken: the pool was changed past the adapter)."""
        q, head = self.pool.free_block_queue, []
        b = q.head
        while len(head) < n and b >= 0:
            head.append(b)
            b = q.next[b]
        if head != ids:
            return head
        self.pool.get_new_blocks(n)
        return None

    def pop_pending(self, n: int) -> None:
        ids = self.pool.get_new_blocks(n)
        self.pend.extend(ids.tolist() if isinstance(ids, torch.Tensor) else ids)

    def queue(self, kind: str, slots: list[int], front: bool) -> None:
        if kind == "touch":
            self.pool.touch(self._ids(slots))
        else:
            self.pool.free_blocks(self._ids(slots))

    def cache(self, mirror, slots, hashes, group, ntok, nc, nf, block_size, full) -> range:
        self.pool.cache_full_blocks([0] * nc + self._ids(slots), full(), nc, nf, block_size, group)
        return mirror.next_seqs(len(slots))

    def read(self, known: list[int], npend: int, window: int, exact: bool) -> SyncRead:
        p = self.pool
        claims = claims_of(p.ref_cnt, p.keys, p.hash_num_tokens, known)
        return SyncRead(list(self.pend), p.get_num_free_blocks(), 0, self.window(window) if window else None, claims)

    def apply(self, mirror, r, known, exact, held) -> int:
        return self.read_rows(list(dict.fromkeys(known + r.ids)), mirror)

    def bound(self) -> None:
        self.pend = []


BACKENDS = {"device": DeviceBackend, "reference": ReferenceBackend}


def make_backend(name: str, num_blocks: int, *, enable_caching: bool, enable_kv_cache_events: bool,
                 max_keys_per_block: int, device=None) -> PoolBackend:
    """The backend called ``name`` (``"device"``, ``"reference"``) over a new pool of ``num_blocks``
    blocks (``device``: the device pool's; the reference pool has none). Raises InvalidArgumentError
    for another name, and what the pool's constructor raises."""
    cls = BACKENDS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError("BlockPool", f"backend must be 'device' or 'reference', got {name!r}")
    return cls(num_blocks, enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events,
               max_keys_per_block=max_keys_per_block, device=device)


__all__ = ["PoolBackend", "DeviceBackend", "ReferenceBackend", "SyncRead", "make_backend", "claims_of"]
