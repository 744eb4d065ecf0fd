"""``DeferredBlockPool``: the drop-in vLLM ``BlockPool`` with its device work deferred, so that a vLLM
scheduler step makes at most one device-to-host synchronisation in the common case (docs/vllm.md,
"The fast path").

vLLM's scheduler decides request by request on the pool's answers, but the answers it needs while
deciding depend only on counts and on keys the host already knows:

* ``get_num_free_blocks`` (does ``allocate_slots`` fit; when to preempt) is exact on the host:
  ``get_new_blocks(n)`` takes n, a ``touch`` of a ref-0 block takes 1, a ``free_blocks`` that brings
  a block to 0 gives 1 (docs/semantics.md section 2).
* ``block.ref_cnt`` / ``block_hash`` and ``get_cached_block`` come from the host mirror, which the
  adapter updates on the host for the fast ops (ref counts; a ``cache_full_blocks`` key on an
  un-keyed block). What the host cannot know is *which* blocks ``get_new_blocks`` takes. It takes
  from the free queue's head, and un-hashed blocks are freed to the front, hashed ones to the back
  (docs/semantics.md section 2), so a pop of at most ``U`` blocks, ``U`` the length of the queue's
  leading run of un-keyed blocks, evicts no key and changes no mirrored field of a known block. The
  adapter keeps a lower bound of ``U`` on the host (read on the device at each synchronisation, in
  the first ``UNKEYED_WINDOW`` ring slots). A pop past it may evict keyed blocks: the mirror is then marked *dirty*, and the next read
  of a ref count, a key or a lookup synchronises first (counted).

So ``get_new_blocks`` returns placeholder :class:`PendingBlock` proxies whose ``block_id`` is bound at
the next synchronisation. ``get_new_blocks``, ``touch``, ``free_blocks`` and ``cache_full_blocks`` are
gathered on the host into a batch, launched as one *flush*: ONE non-waiting ``apply_batched`` (one
kernel: ``free_batched`` with a segment per call, ``touch_batched``, ``allocate_batched`` with a
demand per call, ``cache_blocks_batched``, in that order), placeholder ids gathered on the device from
its output. A flush happens at a synchronisation, and before an
op the fixed order would move past one it must follow (:class:`_Batch`); a scheduler step is
typically one flush, a decode step's pops and cachings for every running request included. One
synchronisation (:meth:`DeferredBlockPool.sync`) is ONE device-to-host transfer: the placeholders'
ids, the mirror rows of every block the ops since the last one touched, the free count, the status
word, the reuse and event counters and the leading un-keyed run. It happens when vLLM first reads a
placeholder's ``block_id`` (building the ``SchedulerOutput``), when a read needs the dirty mirror, or
before any other op (``evict_blocks``, ``reset_prefix_cache``, ``cache_partial_block``,
``move_block_hashes``, ``unpin_blocks``, ``ref_cnt`` writes, a ``cache_full_blocks`` onto a keyed
block or with a mask, the free-queue and prefix-cache views), which then runs as in
:class:`gpupool.vllm.BlockPool` (one op, one mirror transfer).

After a synchronisation a placeholder becomes the canonical proxy of its block (``pool.blocks[id]``),
so vLLM's ``is`` comparisons hold: one proxy object per held block. At each synchronisation the
host's predicted free count is compared with the device's (a mismatch raises PoolError: the
prediction is a claim, checked).

Not deferred (the whole pool runs per call, as :class:`gpupool.vllm.BlockPool`): with KV events or a
metrics collector (both need each op's device answer with the request at hand). Over the reference
backend the same code runs with the CPU oracle (ids known at once; the synchronisation is a host
copy), which is how vLLM's tests exercise it without Triton's interpreter.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..errors import OutOfBlocksError, PoolError
from ..kernels.layout import Ctrl
from .block_pool import BlockPool, KVCacheBlock, _hashes_at, make_block_hash_with_group_id

# sync() reads ctrl[NUM_FREE : REUSE_COUNT + 1] as one slice: num_free, key seq, event count, reuse count
if (Ctrl.NUM_FREE, Ctrl.KEY_SEQ, Ctrl.EV_COUNT, Ctrl.REUSE_COUNT) != (2, 3, 4, 5):
    raise ImportError("gpupool.vllm.fast_path: the control-word layout changed (kernels/layout.py Ctrl)")

# insertion sequence numbers of keys predicted on the host: after every device sequence number until
# the next synchronisation replaces them with the device's
_PREDICTED_SEQ = 1 << 62

# ring slots from the head in which the leading un-keyed run is counted at a synchronisation: more than
# a step pops in practice (a pop past the counted run only makes the mirror dirty)
UNKEYED_WINDOW = 4096


class _Batch:
    """The device ops since the last launch, run as one flush (one ``apply_batched``) in the order
    free, touch, pop, cache (``DeferredBlockPool._flush``). The adapter flushes first where this
    order would move an op before one it must follow (``DeferredBlockPool._must_flush``); otherwise
    the order commutes (docs/vllm.md, "The fast path"): a pop takes free blocks and a caching keys
    held ones."""

    __slots__ = ("free", "seg", "touch", "touched", "demands", "cache_slots", "cache_calls", "cached")

    def __init__(self):
        self.free: list[int] = []  # slots, the free calls one after another
        self.seg = [0]  # free call j is free[seg[j]:seg[j + 1]]
        self.touch: list[int] = []
        self.touched: set[int] = set()
        self.demands: list[int] = []  # get_new_blocks counts, in call order
        self.cache_slots: list[int] = []  # each caching call's range, one after another
        self.cache_calls: list[tuple] = []  # (block_hashes, num_cached, num_full, block_size, group)
        self.cached: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.free or self.touch or self.demands or self.cache_calls)


class PendingBlock(KVCacheBlock):
    """A block ``get_new_blocks`` handed out whose id the device has not reported yet. Reading
    ``block_id`` synchronises the pool once (all placeholders are bound together); ``ref_cnt`` and
    ``block_hash`` are answered from the host mirror as for any block."""

    __slots__ = ()

    def __init__(self, pool: "DeferredBlockPool", slot: int):
        self._pool = pool
        self.is_null = False
        self._s = slot

    @property
    def block_id(self) -> int:
        p = self._pool
        if self._s >= p.num_gpu_blocks:
            p.sync("block_id")
        return self._s


class DeferredBlockPool(BlockPool):
    """:class:`gpupool.vllm.BlockPool` with the fast ops deferred (module docstring; docs/vllm.md).

    Same constructor. ``syncs`` counts the synchronisations by reason (``block_id``,
    ``ref_cnt``, ``get_one_block``, ``op:<name>``, ...); ``deferred`` is False when KV events or a
    metrics collector are on (then every call runs as in the base class).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deferred = not (self.enable_kv_cache_events or self.metrics_collector)
        self.syncs: Counter = Counter()
        self._pending: list[PendingBlock] = []
        self._touched: set[int] = set()
        self._unkeyed = 0  # lower bound of the free queue's leading run of un-keyed blocks
        self._pseq = _PREDICTED_SEQ
        self._pend_dev = None  # device: int32 ids of the placeholders of launched pops, in order
        self._pend_ref: list[int] = []  # reference backend: the same, on the host
        self._batch = _Batch()  # device backend: ops not launched yet
        self.flushes = 0  # launches of a batch (one apply_batched each, no synchronisation)
        self._watched = False  # unpin_blocks was called: pops run per call from then on
        self._window = None  # ring offsets 0 .. UNKEYED_WINDOW - 1 on the device (_unkeyed_run_dev)
        if self.deferred:
            self._unkeyed = self._read_unkeyed_run()

    # ---- the hooks of the base class ---------------------------------------------------------------
    def _need_exact(self, why: str) -> None:
        if self._dirty:
            self.sync(why)

    def _need_device(self, why: str) -> None:
        if self._pending or self._touched:
            self.sync(why)

    def _block(self, slot: int) -> KVCacheBlock:
        n = self.num_gpu_blocks
        return self.blocks[slot] if slot < n else self._pending[slot - n]

    # ---- slots -> ids ------------------------------------------------------------------------------
    def _slots(self, blocks) -> list[int]:
        out = []
        for blk in blocks:
            if not isinstance(blk, KVCacheBlock) or blk._pool is not self:
                self._ids([blk])  # raises the base class's ArgumentTypeError
            out.append(blk._s)
        return out

    def _device_ids(self, slots: list[int]) -> torch.Tensor:
        """``int32[len(slots)]`` on the device: known ids as they are, placeholders gathered from the
        launched flushes' pops (no synchronisation)."""
        n = self.num_gpu_blocks
        t = self._h2d(slots, torch.int64)
        if max(slots, default=0) >= n:
            # only placeholders of launched pops are asked for (_Batch's order)
            pend = self._pend_dev.long()
            t = torch.where(t < n, t, pend[(t - n).clamp(0, pend.numel() - 1)])
        return t.to(torch.int32)

    def _h2d(self, values, dtype) -> torch.Tensor:
        """A host list on the device without a stream synchronisation (``gpupool.BlockPool._tensor``:
        pinned and ``non_blocking`` on CUDA)."""
        return self._dev._tensor(values, dtype)

    def _ref_ids(self, slots: list[int]) -> list[int]:
        n = self.num_gpu_blocks
        return [s if s < n else self._pend_ref[s - n] for s in slots]

    # ---- the fast ops --------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's ``get_new_blocks`` as placeholders (ids bound at the next :meth:`sync`), a demand of
        the batch's pop part. Raises OutOfBlocksError past the (exact) free count."""
        if not self.deferred:
            return super().get_new_blocks(num_blocks)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0 or self._watched:
            # a bad count raises the per-call pool's error; with reuse watchers registered (unpin_blocks)
            # a pop must call them at once, as vLLM does, so it runs per call
            self.sync("op:get_new_blocks")
            return super().get_new_blocks(num_blocks)
        if num_blocks > self._num_free:
            raise OutOfBlocksError("get_new_blocks", f"Cannot get {num_blocks} free blocks from the pool", num_blocks)
        if num_blocks == 0:
            return []
        k0 = len(self._pending)
        if self.backend == "device":
            self._batch.demands.append(num_blocks)
        else:
            ids = self._dev.get_new_blocks(num_blocks)
            self._pend_ref.extend(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
        self._num_free -= num_blocks
        if num_blocks <= self._unkeyed:
            self._unkeyed -= num_blocks  # only un-keyed blocks were taken: no known block changed
        else:
            self._unkeyed = 0
            self._dirty = True  # keyed blocks may have been evicted: reads of the mirror wait for a sync
        n = self.num_gpu_blocks
        out = []
        for j in range(num_blocks):
            blk = PendingBlock(self, n + k0 + j)
            self._pending.append(blk)
            self._ref.append(1)
            self._keys.append(())
            self._ntok.append(None)
            out.append(blk)
        return out

    def touch(self, blocks) -> None:
        """A prefix hit, queued in the batch's touch part; ref counts and the free count kept on the host."""
        if not self.deferred:
            return super().touch(blocks)
        blocks = list(blocks)
        slots = [s for s in self._slots(blocks) if s != 0]
        if not slots:
            return
        ref = self._ref
        if self._dirty and any(ref[s] == 0 for s in slots):
            self.sync("touch")  # a ref-0 block may have been taken by a pop since: read it
        front = False  # an un-keyed free block touched: it sits in the queue's leading run
        for s in slots:
            if ref[s] == 0:
                self._num_free -= 1
                if not self._keys[s]:
                    self._unkeyed = max(self._unkeyed - 1, 0)
                    front = True
            ref[s] += 1
        self._queue("touch", slots, front)

    def free_blocks(self, ordered_blocks) -> None:
        """Release one reference per block, a segment of the batch's free part; a release below 0 is checked
        on the device first (synchronising) and raised by the base class, nothing changed."""
        if not self.deferred:
            return super().free_blocks(ordered_blocks)
        mine, others = [], []
        for blk in ordered_blocks:
            if getattr(blk, "is_null", False):
                continue
            owner = getattr(blk, "pool", None)
            (others if owner is not None and owner is not self else mine).append(blk)
        slots = self._slots(mine)
        ref = self._ref
        need = Counter(slots)
        if any(ref[s] < c for s, c in need.items()):
            self.sync("op:free_blocks")
            return super().free_blocks(mine + others)
        front = False
        for s in slots:
            ref[s] -= 1
            if ref[s] == 0:
                self._num_free += 1
                if not self._keys[s]:
                    self._unkeyed += 1  # un-keyed blocks go to the queue's front (docs/semantics.md)
                    front = True
        if slots:
            self._queue("free", slots, front)
        if others:
            super().free_blocks(others)

    def cache_full_blocks(self, request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask=None) -> None:
        """vLLM's ``cache_full_blocks``, queued in the batch's caching part with the keys added
        on the host, when every block in the range is non-null, held, un-keyed and listed once and
        there is no mask; otherwise synchronise and run as the base class."""
        nc, nf = num_cached_blocks, num_full_blocks
        if not self.deferred or nc >= nf:
            return super().cache_full_blocks(request, blocks, nc, nf, block_size, kv_cache_group_id, block_mask)
        if not self.enable_caching:
            return None  # a no-op (docs/semantics.md section 2)
        rng = list(blocks[nc:nf])
        hashes = None
        if block_mask is None and len(rng) == nf - nc and isinstance(block_size, int) and block_size > 0 \
                and all(isinstance(b, KVCacheBlock) and b._pool is self and not b.is_null for b in rng):
            slots = self._slots(rng)
            # held blocks only: a pop may then run before the caching (_Batch)
            if len(set(slots)) == len(slots) and not any(self._keys[s] or self._ref[s] <= 0 for s in slots):
                try:
                    hashes = _hashes_at(request.block_hashes, self.hash_block_size, block_size, nf)
                except PoolError:
                    hashes = None  # the per-call path raises it, as vLLM's assertion
                if hashes is not None and len(hashes) < nf:
                    hashes = None
        if hashes is None:
            self.sync("op:cache_full_blocks")
            return super().cache_full_blocks(request, blocks, nc, nf, block_size, kv_cache_group_id, block_mask)
        g = kv_cache_group_id
        if self.backend == "device":
            b = self._batch
            b.cache_slots += slots
            b.cache_calls.append((hashes, nc, nf, block_size, g))
            b.cached.update(slots)
        else:
            self._dev.cache_full_blocks([0] * nc + self._ref_ids(slots), hashes, nc, nf, block_size, g)
        holders = self._holders
        for i, s in zip(range(nc, nf), slots):
            key = make_block_hash_with_group_id(hashes[i], g)
            self._keys[s] = (key,)
            self._ntok[s] = (i + 1) * block_size
            if self.backend == "device":
                self._pseq += 1
                q = self._pseq
            else:  # the reference mirror orders keys by the adapter's own counter
                self._seq += 1
                q = self._seq
            holders.setdefault(key, {})[s] = q
            if s < self.num_gpu_blocks:
                self._touched.add(s)

    def _queue(self, kind: str, slots: list[int], front: bool) -> None:
        """Queue a touch or a free of ``slots`` (``front``: one of them is, or becomes, an un-keyed
        free block, at the queue's front) in the batch, flushing it first where :meth:`_must_flush`."""
        for s in slots:
            if s < self.num_gpu_blocks:
                self._touched.add(s)
        if self.backend == "device":
            b = self._batch
            if self._must_flush(kind, slots, front):
                self._flush()
                b = self._batch
            if kind == "touch":
                b.touch += slots
                b.touched.update(slots)
            else:
                b.free += slots
                b.seg.append(len(b.free))
        elif kind == "touch":
            self._dev.touch(self._ref_ids(slots))
        else:
            self._dev.free_blocks(self._ref_ids(slots))

    def _must_flush(self, kind: str, slots: list[int], front: bool) -> bool:
        """Whether a touch or free of ``slots`` must wait for the batch to launch, its fixed order
        (free, touch, pop, cache) moving it before an op it follows (docs/vllm.md, "The fast path"):
        a free of a block the batch touches or caches; past the batch's pops, an op on a block they
        took (its id is not known before the launch) or one with ``front``. Otherwise it commutes with
        the pops: a block freed to the queue's back is never among the first n blocks that a pop of
        n takes; a touched free block is keyed, and the pops took only blocks of the queue's leading
        un-keyed run (``touch`` synchronises first when a pop went past it: the mirror dirty)."""
        b = self._batch
        if kind == "free" and not (b.cached.isdisjoint(slots) and b.touched.isdisjoint(slots)):
            return True
        if not b.demands:
            return False
        mine = self.num_gpu_blocks + (0 if self._pend_dev is None else self._pend_dev.numel())
        return front or any(s >= mine for s in slots)

    def _flush(self) -> None:
        """Launch the batch as ONE ``apply_batched`` (free: every call a segment; touch; pop: every
        call a demand; cache), not waiting; the placeholders of its pops get their ids from its
        output, and a caching names them as ``num_blocks + k``."""
        b = self._batch
        if not b:
            return
        self._batch = _Batch()
        self.flushes += 1
        k0 = 0 if self._pend_dev is None else self._pend_dev.numel()
        nf = len(b.free)
        ids = self._device_ids(b.free + b.touch) if nf or b.touch else None  # one copy for both parts
        blocks, _ = self._dev.apply_batched(
            free_ids=ids[:nf] if nf else None, free_offsets=self._h2d(b.seg, torch.int32) if nf else None,
            touch_ids=ids[nf:] if b.touch else None, demands=b.demands,
            cache_ids=self._cache_ids(b.cache_slots, k0) if b.cache_calls else None, cache_calls=b.cache_calls)
        if b.demands:
            self._pend_dev = blocks if self._pend_dev is None else torch.cat([self._pend_dev, blocks])

    def _cache_ids(self, slots: list[int], k0: int) -> torch.Tensor:
        """``int32[len(slots)]`` on the device for the flush's caching: known ids, launched
        placeholders gathered, this flush's k-th pop as ``num_blocks + k`` (``apply_batched``)."""
        n = self.num_gpu_blocks
        if all(s < n + k0 for s in slots):
            return self._device_ids(slots)
        earlier = [s if s < n + k0 else 0 for s in slots]
        t = self._device_ids(earlier) if any(s >= n for s in earlier) else None
        mine = self._h2d([s - k0 if s >= n + k0 else -1 for s in slots], torch.int32)
        base = self._h2d(earlier, torch.int32) if t is None else t
        return torch.where(mine >= 0, mine, base)

    # ---- the synchronisation -----------------------------------------------------------------------
    def _unkeyed_run_dev(self) -> torch.Tensor:
        """``int64[1]`` on the device: how many free blocks at the queue's head have no key, counted in
        the first ``UNKEYED_WINDOW`` ring slots only (a lower bound, as the host needs; the work per
        synchronisation does not grow with the pool)."""
        st, c = self._dev.state, self._dev.config.C
        head, tail = st.ctrl[Ctrl.HEAD].long(), st.ctrl[Ctrl.TAIL].long()
        if self._window is None:
            self._window = torch.arange(min(c, UNKEYED_WINDOW), dtype=torch.int64, device=self._dev.device)
        rel = self._window
        v = st.ring[(head + rel) & (c - 1)].long()
        live = (rel < tail - head) & (v >= 0)
        keyed = live & (st.num_keys[v.clamp(min=0)] > 0)
        return (live & ~keyed & (torch.cumsum(keyed.long(), 0) == 0)).sum().reshape(1)

    def _read_unkeyed_run(self) -> int:
        if self.backend == "device":
            return int(self._unkeyed_run_dev().item())
        order = self._dev.free_queue()
        run = 0
        for b in order:
            if self._dev.keys[b]:
                break
            run += 1
        return run

    def sync(self, why: str = "sync") -> None:
        """Bind the placeholders and make the mirror exact: one device-to-host transfer (module
        docstring). Raises what a launched op recorded (PoolError; not expected: the fast ops are
        checked on the host first) and PoolError if the host's free count disagrees with the device's."""
        if not (self._pending or self._touched or self._dirty):
            return
        self._flush()
        self.syncs[why] += 1
        n = self.num_gpu_blocks
        known = sorted(self._touched)
        npend = len(self._pending)
        if self.backend == "device":
            st = self._dev.state
            pend = self._pend_dev[:npend].long() if npend else torch.zeros(0, dtype=torch.int64, device=self._dev.device)
            idx = torch.cat([self._h2d(known, torch.int64), pend])
            head = torch.cat([st.status[:1].long(), st.ctrl[Ctrl.NUM_FREE:Ctrl.REUSE_COUNT + 1].long(),
                              self._unkeyed_run_dev(), pend])
            flat = torch.cat([head, self._mirror_rows(idx).reshape(-1)]).tolist()  # the one transfer
            status, num_free, _, evc, reuse, run = flat[:6]
            ids = flat[6: 6 + npend]
            w, o = 3 + 3 * self._mk, 6 + npend
            rows = [flat[o + i * w: o + (i + 1) * w] for i in range(len(idx))]
            if status or reuse or (evc and self._dev.enable_kv_cache_events):
                self._dev.check()  # raises a recorded error; fires reuse watchers (more reads, counted by callers)
        else:
            ids = list(self._pend_ref)
            num_free, run = self._dev.get_num_free_blocks(), None
        # placeholders -> their blocks: the bound block's old keys (evicted by the pop) leave the key map,
        # the placeholder's predicted keys move onto the block with their predicted order
        holders = self._holders
        for k, blk in enumerate(self._pending):
            s, b = n + k, ids[k]
            for key in self._keys[b]:
                hs = holders.get(key)
                if hs is not None:
                    hs.pop(b, None)
                    if not hs:
                        del holders[key]
            for key in self._keys[s]:
                hs = holders[key]
                hs[b] = hs.pop(s)
            self._keys[b] = self._keys[s]
            self._ref[b], self._ntok[b] = self._ref[s], self._ntok[s]
            blk._s = b
            self.blocks[b] = blk
        del self._ref[n:], self._keys[n:], self._ntok[n:]
        self._pending, self._pend_dev, self._pend_ref = [], None, []
        self._touched = set()
        predicted = self._num_free
        self._version += 1
        if self.backend == "device":
            self._num_free = num_free
            self._apply_rows(known + ids, rows)
            self._unkeyed = run
        else:
            self._refresh_reference(list(dict.fromkeys(known + ids)))
            self._unkeyed = self._read_unkeyed_run()
        self._dirty = False
        if self.backend == "device":
            self._dev.registry.maybe_sweep()  # check()'s housekeeping (reads the device's keys when it sweeps)
        if predicted != self._num_free:
            raise PoolError(f"DeferredBlockPool: the host predicted {predicted} free blocks, the device has "
                            f"{self._num_free}")

    # ---- everything else: synchronise, then the base class -------------------------------------------
    def _slow(name):  # noqa: N805 - a decorator factory used in the class body
        def wrap(self, *a, **k):
            self.sync("op:" + name)
            try:
                return getattr(BlockPool, name)(self, *a, **k)
            finally:
                self._unkeyed = 0  # the op may reorder the queue: a lower bound until the next sync
        wrap.__name__ = name
        wrap.__doc__ = f"Synchronise, then :meth:`gpupool.vllm.BlockPool.{name}` (one op, one mirror transfer)."
        return wrap

    cache_partial_block = _slow("cache_partial_block")
    move_block_hashes = _slow("move_block_hashes")
    _unpin_blocks = _slow("unpin_blocks")

    def unpin_blocks(self, blocks, on_reuse) -> None:
        """Synchronise, then the per-call ``unpin_blocks``; later pops run per call (their reuse
        callbacks fire at the call, as vLLM's)."""
        self._watched = True
        return self._unpin_blocks(blocks, on_reuse)
    evict_blocks = _slow("evict_blocks")
    reset_prefix_cache = _slow("reset_prefix_cache")
    _insert_key = _slow("_insert_key")
    _maybe_evict_cached_block = _slow("_maybe_evict_cached_block")
    _set_ref_cnt = _slow("_set_ref_cnt")
    del _slow

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        """From the mirror (a hit on a free block while dirty synchronises first, in the key map's
        view); ``device_lookups=True`` synchronises and looks up on the device."""
        if self.device_lookups:
            self.sync("op:get_cached_block")
        return super().get_cached_block(block_hash, kv_cache_group_ids)


__all__ = ["DeferredBlockPool", "PendingBlock"]
