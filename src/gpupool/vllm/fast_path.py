"""``DeferredBlockPool``: the drop-in vLLM ``BlockPool`` with its device work deferred and its answers
known on the host, so that a vLLM scheduler step needs no device-to-host synchronisation in the
common case and at most one when a step pops up to ``FREE_WINDOW // 2`` blocks. The algorithm, its
parts (``HostMirror``, ``FreeQueueCopy``, ``OpBatch``, the device or reference backend:
:mod:`gpupool.vllm.backends`' ``DeviceBackend`` / ``ReferenceBackend``) and when it synchronises:
docs/algorithms.md section 8.

``get_new_blocks``, ``touch``, ``free_blocks`` and ``cache_full_blocks`` are answered from the host
mirror and the host's copy of the free queue's head and gathered into a batch that
:meth:`DeferredBlockPool.end_step` launches as ONE ``gpupool.BlockPool.apply_predicted``;
:meth:`DeferredBlockPool.sync` is one device-to-host transfer that checks the host's claims, binds
placeholders and relaunches what a recorded error made the device skip. Every other op synchronises
first and runs as in :class:`gpupool.vllm.BlockPool`.

With KV events or a metrics collector on, the same: the events and the metrics calls come from what
the host knows (:mod:`gpupool.vllm.host_events`), in vLLM's order; only a pop past the host's copy of
the free queue then runs per call (its blocks are named at the call).
"""
from __future__ import annotations

from collections import Counter

from ..args import MAX_GROUP_ID, MAX_TOKENS, as_host_list
from ..errors import OutOfBlocksError, PoolError
from .backends import SyncRead, claims_of
from .block_pool import BlockPool, KVCacheBlock, _hashes_at, count_arg
from .host_events import metrics_pop, metrics_touch
from .queue_copy import FreeQueueCopy

# ring slots from the head read into the host's copy of the free queue at a refill: a step pops fewer
# in practice (vLLM's default 8,192-token budget is 512 blocks of 16); the work per refill does not
# grow with the pool
FREE_WINDOW = 2048


class PendingBlock(KVCacheBlock):
    """A block ``get_new_blocks`` handed out past the host's copy of the free queue, whose id the device
    has not reported yet. Reading ``block_id`` synchronises the pool once (all placeholders are bound
    together); ``ref_cnt`` and ``block_hash`` are answered from the host mirror as for any block."""

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
    """:class:`gpupool.vllm.BlockPool` with the fast ops deferred and predicted (module docstring;
    docs/algorithms.md section 8).

    Same constructor. ``syncs`` counts the synchronisations by reason (``end_step``, ``free_queue``
    (a refill before a pop), ``block_id``, ``ref_cnt``, ``get_one_block``, ``op:<name>``, ...);
    ``flushes`` the launches; ``deferred`` is True (KV events and metrics are made on the host,
    :mod:`gpupool.vllm.host_events`). ``verify_every`` (default 64): :meth:`end_step`
    synchronises at least every this many steps while ops wait to be checked. ``launch_every``
    (default 4) and ``launch_ops`` (default 1,024): :meth:`end_step` launches the batch every this
    many steps, or sooner once its ops name this many block ids.
    """

    verify_every = 64
    # a launch's host cost is mostly fixed (Python and torch around the kernel), so small steps share one;
    # the device then runs a few steps behind the host, which vLLM does not see (its answers are the
    # host's) and every read of the device synchronises first, which launches first
    launch_every = 4
    launch_ops = 1024
    deferred = True  # always, since KV events and metrics are made on the host (kept for callers that ask)
    _events_on_host = True  # the device pool records no events: HostEvents makes them

    # answered on the host: not wrapped in the pool's stream context (a few microseconds a call on
    # CUDA); their device work runs in methods that are (sync, _flush, the base class's ops)
    _HOST_ANSWERED = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "get_cached_block")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # KV events or metrics on: each pop names its blocks at the call (no placeholders)
        self._observed = self.enable_kv_cache_events or self.metrics_collector is not None
        self.syncs: Counter = Counter()
        self.steps_since_sync = 0
        self.steps_since_launch = 0
        self._pending: list[PendingBlock] = []
        self._touched: set[int] = set()  # blocks the ops since the last synchronisation changed
        self.queue_copy = FreeQueueCopy()  # the free queue's first ids, exactly
        self._watched = False  # unpin_blocks was called: pops run per call from then on
        self._reread = False  # a pop re-reading the pool after it disagreed with the copy
        self.queue_copy.fill(self._read_window())

    @property
    def flushes(self) -> int:
        """Launches of a batch (one ``apply_predicted`` each, no synchronisation; 0 on the reference)."""
        return self._backend.flushes

    @property
    def _batch(self):
        """The device backend's ops not launched yet (``OpBatch``; None on the reference backend)."""
        return getattr(self._backend, "batch", None)

    # ---- the hooks of the base class ---------------------------------------------------------------
    def _need_exact(self, why: str) -> None:
        if self._dirty:
            self.sync(why)

    def _need_device(self, why: str) -> None:
        if self._pending or self._touched:
            self.sync(why)

    def _after_other_user(self, name: str) -> None:
        super()._after_other_user(name)
        self.queue_copy.forget()  # refilled from the device at the next pop or end_step
        if name == "unpin_blocks":
            self._watched = True  # its reuse watchers fire at a pop: pops run per call from then on

    def _block(self, slot: int) -> KVCacheBlock:
        n = self.num_gpu_blocks
        return self.blocks[slot] if slot < n else self._pending[slot - n]

    # ---- slots -> ids ------------------------------------------------------------------------------
    def _own_slots(self, blocks: list) -> list[int] | None:
        """The slots of ``blocks`` but the null block when every one is a known block of this pool (the
        common case, one pass), else None (placeholders, other pools' blocks, other types)."""
        out = []
        for blk in blocks:
            if blk.__class__ is not KVCacheBlock or blk._pool is not self:
                return None
            if not blk.is_null:
                out.append(blk._s)
        return out

    def _slots(self, blocks) -> list[int]:
        out = []
        for blk in blocks:
            if not isinstance(blk, KVCacheBlock) or blk._pool is not self:
                self._ids([blk])  # raises the base class's ArgumentTypeError
            out.append(blk._s)
        return out

    # ---- the host's copy of the free queue ----------------------------------------------------------
    def _read_window(self) -> list[int]:
        """The free queue's first ids from its first ``FREE_WINDOW`` ring slots, -1 for holes."""
        return self._backend.window(FREE_WINDOW)

    # ---- the fast ops --------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's ``get_new_blocks``: the first ``num_blocks`` blocks of the host's copy of the free
        queue (their keys leave the mirror), a demand of the batch's pop part; past the copy (after
        refilling it with one synchronisation when nothing is pending), placeholders bound at the next
        :meth:`sync`. Raises OutOfBlocksError past the (exact) free count."""
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = count_arg("get_new_blocks", num_blocks, "num_blocks")
        if self._watched:
            # with reuse watchers registered (unpin_blocks) a pop must call them at once, as vLLM does,
            # so it runs per call
            return self._pop_per_call(num_blocks)
        if num_blocks > self._num_free:
            raise OutOfBlocksError("get_new_blocks", f"Cannot get {num_blocks} free blocks from the pool", num_blocks)
        if num_blocks == 0:
            return []
        qc = self.queue_copy
        if not qc.fits(num_blocks):
            if not self._pending:
                self.sync("free_queue", window=True)
                if self._observed and not qc.fits(num_blocks):
                    return self._pop_per_call(num_blocks)  # events and metrics name the blocks at the call
            if not qc.fits(num_blocks):
                self._num_free -= num_blocks
                return self._pop_pending(num_blocks)
        self._num_free -= num_blocks
        return self._pop_known(num_blocks)

    def _pop_per_call(self, num_blocks: int) -> list[KVCacheBlock]:
        """Synchronise, then the per-call pop (its events and metrics calls too); the host's copy of the
        queue follows."""
        self.sync("op:get_new_blocks")
        out = super().get_new_blocks(num_blocks)
        qc = self.queue_copy
        if qc.fits(num_blocks):
            qc.take(num_blocks)
        else:
            qc.forget()
        return out

    def _pop_known(self, num_blocks: int) -> list[KVCacheBlock]:
        ids = self.queue_copy.take(num_blocks)
        if self._backend.pop_known(num_blocks, ids) is not None:
            return self._pop_after_change(num_blocks)
        if self.host_events is not None:  # the keys the pop evicts, before they leave the mirror
            self.host_events.popped(ids)
            self._drain_events()
        keys, ntok, ref = self._keys, self._ntok, self._ref
        for x in ids:
            if keys[x]:
                self.mirror.drop_keys(x)  # evicted by the pop (docs/semantics.md section 2)
                keys[x] = ()
            ntok[x] = None
            ref[x] = 1
        self._touched.update(ids)
        out = list(map(self.blocks.__getitem__, ids))
        if self.metrics_collector:
            metrics_pop(self.metrics_collector, out, self.enable_caching)
        return out

    def _pop_after_change(self, num_blocks: int) -> list[KVCacheBlock]:
        """The reference pool's first free blocks are not the copy's (it was changed past the adapter),
        nothing taken: the whole mirror and the copy read again, then the pop answered from them, as
        the per-call pool answers it (a second disagreement raises PoolError)."""
        self._num_free += num_blocks
        self._refresh(range(self.num_gpu_blocks))
        self.queue_copy.fill(self._read_window())
        if self._reread:
            raise PoolError("DeferredBlockPool.get_new_blocks", "the pool's free queue is not the one it reads back")
        self._reread = True
        try:
            return self.get_new_blocks(num_blocks)
        finally:
            self._reread = False

    def _pop_pending(self, num_blocks: int) -> list[KVCacheBlock]:
        k0 = len(self._pending)
        self._backend.pop_pending(num_blocks)
        self.queue_copy.forget()
        self._dirty = True  # keyed blocks may have been evicted: reads of free blocks wait for a sync
        n = self.num_gpu_blocks
        out = []
        for j in range(num_blocks):
            blk = PendingBlock(self, n + k0 + j)
            self._pending.append(blk)
            self.mirror.add_placeholder()
            out.append(blk)
        return out

    def touch(self, blocks) -> None:
        """A prefix hit, queued in the batch's touch part; ref counts, the free count and the host's
        copy of the queue (a free block unlinked) kept on the host."""
        if type(blocks) is not list:
            blocks = as_host_list("touch", blocks, "blocks")
        slots = self._own_slots(blocks)
        if slots is None:
            slots = [s for s in self._slots(blocks) if s != 0]
        if not slots:
            return
        ref = self._ref
        if self._dirty and any(ref[s] == 0 for s in slots):
            self.sync("touch")  # a ref-0 block may have been taken by a pop since: read it
            ref = self._ref
            slots = [s for s in self._slots(blocks) if s != 0]  # placeholders bound: their ids now
        self._touch(slots)
        if self.metrics_collector:
            metrics_touch(self.metrics_collector, blocks)

    def _touch(self, slots: list[int]) -> None:
        """A touch of ``slots`` (non-null, exact on the host) answered on the host and queued."""
        ref, unlink = self._ref, self.queue_copy.unlink
        for s in slots:
            if ref[s] == 0:
                self._num_free -= 1
                unlink(s)
            ref[s] += 1
        self._queue("touch", slots, False)

    def free_blocks(self, ordered_blocks) -> None:
        """Release one reference per block, a segment of the batch's free part (the blocks that reach
        0 requeued in the host's copy); a release below 0 is checked on the device first
        (synchronising) and raised by the base class, nothing changed."""
        blocks = ordered_blocks if type(ordered_blocks) is list else as_host_list(
            "free_blocks", ordered_blocks, "ordered_blocks")
        own = self._own_slots(blocks)
        if own is None:  # placeholders, other pools' blocks or wrong types among them
            mine, others = self._split_by_pool(blocks)
            for owner, blks in others.values():  # all or nothing: every pool's blocks checked first
                owner._check_release(blks)
            slots = self._check_release(mine)
        else:
            mine, others, slots = blocks, {}, self._check_release(blocks, own)
        ref = self._ref
        front, back = [], []
        for s in slots:
            ref[s] -= 1
            if ref[s] == 0:
                (back if self._keys[s] else front).append(s)
        nf0 = self._num_free
        self._num_free += len(front) + len(back)
        self.queue_copy.requeue(front, back, nf0, self.num_gpu_blocks)
        if slots:
            self._queue("free", slots, bool(front))
        for owner, blks in others.values():
            owner.free_blocks(blks)

    def _check_release(self, blocks, slots: list[int] | None = None) -> list[int]:
        """The mirror slots of ``blocks`` (``slots`` when the caller has them), checked to be this pool's
        and held as often as listed; a release below 0 is checked on the device first (synchronising)
        and raised by the base class."""
        if slots is None:
            slots = self._slots(blocks)
        ref = self._ref
        if len(set(slots)) == len(slots):
            short = any(ref[s] < 1 for s in slots)
        else:
            short = any(ref[s] < c for s, c in Counter(slots).items())
        if short:
            self.sync("op:free_blocks")
            # raises DoubleFreeError, the mirror exact; else (a block a placeholder's pop took on the
            # device) the ids after the binding: the slots read before it may name placeholders
            return super()._check_release([b for b in blocks if not b.is_null])
        return slots

    def cache_full_blocks(self, request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask=None) -> None:
        """vLLM's ``cache_full_blocks``, queued in the batch's caching part with the keys added
        on the host, when every block in the range is non-null, held, un-keyed and listed once and
        there is no mask; otherwise synchronise and run as the base class."""
        nc, nf = num_cached_blocks, num_full_blocks
        if type(nc) is not int or type(nf) is not int:  # the common case skips the full checks
            nc, nf = self._cache_counts(request, blocks, nc, nf, block_size)
        if nc >= nf:
            return None
        # caching off: a no-op (docs/semantics.md section 2) that checks its arguments, per call
        fast = self.enable_caching and self._fast_cache(request, blocks, nc, nf, block_size, kv_cache_group_id,
                                                        block_mask)
        if not fast:
            self.sync("op:cache_full_blocks")
            return super().cache_full_blocks(request, blocks, nc, nf, block_size, kv_cache_group_id, block_mask)
        hashes, slots = fast
        g = kv_cache_group_id
        ntok = list(range((nc + 1) * block_size, (nf + 1) * block_size, block_size))
        m, suffix = self.mirror, g.to_bytes(4, "big")
        seqs = self._backend.cache(m, slots, hashes, g, ntok, nc, nf, block_size,
                                   lambda: _hashes_at(request.block_hashes, self.hash_block_size, block_size, nf))
        ntoks = self._ntok
        for h, s, t, q in zip(hashes, slots, ntok, seqs):
            m.add_key(s, h + suffix, q)  # vLLM's BlockHashWithGroupId
            ntoks[s] = t
        self._mark_changed(slots)
        if self.host_events is not None:
            self._cache_events(request, blocks, nc, nf, block_size, g, hashes)

    def _cache_events(self, request, blocks, nc: int, nf: int, block_size: int, group: int, hashes) -> None:
        """The BlockStored of a fast ``cache_full_blocks`` (its blocks are un-keyed: nothing removed)."""
        parent = request.block_hashes[nc * (block_size // self.hash_block_size) - 1] if nc else None
        self.host_events.stored(hashes, parent, block_size, group)
        self._drain_events(self._full_stored(request, blocks, nc, nf, block_size, group, None))

    def _fast_cache(self, request, blocks, nc, nf, block_size, group, block_mask):
        """(the hashes of blocks ``nc .. nf - 1`` at ``block_size``, their slots) when a
        ``cache_full_blocks`` call can be queued (the docstring's conditions, and every argument as
        ``gpupool.args.cache_full_args`` would accept it, so the launch cannot fail on it), else None
        (the per-call path then runs it, or raises its error). Reads only those hashes (and the
        parent's), not the request's whole list."""
        if not (block_mask is None and type(block_size) is int and type(group) is int and 0 <= nc
                and block_size > 0 and 0 <= group <= MAX_GROUP_ID and nf * block_size <= MAX_TOKENS):
            return None
        if type(blocks) is not list:
            return None
        rng = blocks[nc:nf]
        if len(rng) != nf - nc:
            return None
        keys, ref, slots = self._keys, self._ref, []
        for blk in rng:  # held, un-keyed, listed once: a pop may then run before the caching (OpBatch)
            if not isinstance(blk, KVCacheBlock) or blk._pool is not self or blk.is_null:
                return None
            s = blk._s
            if keys[s] or ref[s] <= 0:
                return None
            slots.append(s)
        if len(slots) > 1 and len(set(slots)) < len(slots):
            return None
        bh = getattr(request, "block_hashes", None)
        if bh is None:
            return None
        if block_size == self.hash_block_size:
            if len(bh) < nf:
                return None
            hashes = bh[max(nc - 1, 0):nf]
        else:
            try:
                hashes = _hashes_at(bh, self.hash_block_size, block_size, nf)[max(nc - 1, 0):]
            except PoolError:
                return None  # the per-call path raises it, as vLLM's assertion
            if len(hashes) < nf - max(nc - 1, 0):
                return None
        for h in hashes:  # the parent's too, as the per-call pool checks it
            if type(h) is not bytes:
                return None
        return (hashes[1:] if nc else hashes), slots

    def _queue(self, kind: str, slots: list[int], front: bool) -> None:
        """Queue a touch or a free of ``slots`` (``front``: a block it frees goes to the queue's
        front) in the batch, in a new round or after a launch where ``OpBatch.placement`` says so."""
        self._mark_changed(slots)
        self._backend.queue(kind, slots, front)

    def _mark_changed(self, slots: list[int]) -> None:
        """The blocks of ``slots`` are checked at the next synchronisation (placeholders' slots are not
        block ids: their blocks are read as the placeholders are bound)."""
        if self._pending:
            self._touched.update(s for s in slots if s < self.num_gpu_blocks)
        else:
            self._touched.update(slots)

    def _flush(self) -> None:
        """Launch the queued ops, not waiting (the device backend's batch, as ONE ``apply_predicted``)."""
        self.steps_since_launch = 0
        self._backend.flush()

    # ---- the synchronisation -----------------------------------------------------------------------
    def end_step(self) -> None:
        """The end of a scheduler step (``GpuPoolScheduler`` calls it after each ``schedule()``):
        launch the batch, not waiting, every ``launch_every`` steps or once it names ``launch_ops``
        block ids; synchronise only when the host's copy of the free queue is low (refill) or
        ``verify_every`` steps passed with ops to check."""
        self.steps_since_launch += 1
        if self.steps_since_launch >= self.launch_every or self._backend.queued() >= self.launch_ops:
            self._flush()
        self.steps_since_sync += 1
        low = self.queue_copy.low(self._num_free)
        if low or self.steps_since_sync >= self.verify_every:
            self.sync("end_step", window=low)

    def sync(self, why: str = "sync", window: bool = False) -> None:
        """Bind the placeholders, make the mirror exact, check the host's claims and (``window`` or when
        low) refill the host's copy of the free queue: one device-to-host transfer (module docstring).

        The host never keeps an op the device did not run: each launch's confirmation is read here,
        and launches that an error recorded before them (by another user of the device pool, say)
        made do nothing are launched again, after that error is taken from the status word, before
        the mirror is read (a second transfer). That error is then raised, the mirror exact.

        Raises what the device recorded (PoolError: another user's error, as above; a launch's own
        failure, not expected since the fast ops are checked on the host first, after re-reading the
        whole mirror) and PoolError where the device disagrees with the host (free count, popped ids,
        ref and key counts of the blocks changed, the queue's first ids), the whole mirror read again
        first, with a recorded error as its cause (and named in its message); a key insertion counter
        other than the host's (another user keyed blocks) reads the whole mirror too."""
        if not (self._pending or self._touched or self._dirty or window):
            return
        self._flush()
        self.syncs[why] += 1
        self.steps_since_sync = 0
        refill = window or self.queue_copy.low(self._num_free)
        known = sorted(self._touched)
        npend = len(self._pending)
        exact = not (self._pending or self._dirty)  # the host's rows of `known` are claims to check
        r = self._backend.read(known, npend, FREE_WINDOW if refill else 0, exact)
        if r.failed:
            return self._own_failure(r)
        num_free, win = r.num_free, r.window
        wrong = []
        if r.bad_pops:
            wrong.append(f"{r.bad_pops} popped ids differ from the host's")
        if self._num_free != num_free:
            wrong.append(f"the host predicted {self._num_free} free blocks, the device has {num_free}")
        if exact and r.claims != claims_of(self._ref, self._keys, self._ntok, known):
            wrong.append("ref counts, key counts or covered tokens of the blocks changed differ from the host's")
        if win is not None and not self.queue_copy.agrees(win):
            wrong.append("the free queue's first ids differ from the host's copy")
        self._bind(r.ids)
        self._touched = set()
        self._version += 1
        if wrong or not r.seqs_ok:
            # another user of the device pool popped, freed or keyed blocks, maybe blocks the host did not
            # change since the last synchronisation: every row read again (one transfer, rare)
            self._refresh(range(self.num_gpu_blocks))
        else:  # the claims held (if checked): the backend makes the rest of the mirror exact
            self._num_free = self._backend.apply(self.mirror, r, known, exact, exact)
        if win is not None:
            self.queue_copy.fill(win)
        self._dirty = False
        if wrong:
            self.queue_copy.forget()  # refilled from the device at the next synchronisation
            rec = r.recorded  # taken from the status word: raised with the disagreement, not lost
            if rec is not None:
                wrong.append(f"and an error recorded on the device: {type(rec).__name__}: {rec}")
            raise PoolError("DeferredBlockPool.sync", "; ".join(wrong)) from rec
        if r.recorded is not None:
            raise r.recorded

    def _bind(self, ids: list[int]) -> None:
        """Placeholders -> their blocks (``ids``, in order): the bound block's old keys (evicted by the
        pop) leave the key map, the placeholder's predicted keys move onto the block with their
        predicted order. ``pool.blocks`` is not changed (one object per block id for the pool's life):
        the placeholder reads its block's slot from then on."""
        self.mirror.bind(self.num_gpu_blocks, ids[:len(self._pending)])
        for blk, b in zip(self._pending, ids):
            blk._s = b  # pool.blocks[b] stays the canonical proxy: this one reads the same slot
            if b == 0:
                blk.is_null = True
        self._pending = []
        self._backend.bound()

    def _own_failure(self, r: SyncRead) -> None:
        """A launch of the fast path failed on the device (not expected: its ops are checked on the
        host first), some of its ops run: the whole mirror is read again from the device, each
        placeholder of a pop that did not run is bound to the null block, and the error is raised."""
        n = self.num_gpu_blocks
        ids = [b if 0 < b < n else 0 for b in r.ids]
        self.mirror.forget_placeholder_keys(n)
        self._bind(ids)
        self._touched, self._dirty = set(), False
        self.queue_copy.forget()
        self._refresh(range(n))
        raise r.recorded if r.recorded is not None else PoolError("DeferredBlockPool.sync", "a launch failed")

    # ---- everything else: synchronise, then the base class -------------------------------------------
    def _slow(name, moves_queue=False):  # noqa: N805 - a decorator factory used in the class body
        def wrap(self, *a, **k):
            self.sync("op:" + name)
            out = getattr(BlockPool, name)(self, *a, **k)
            if moves_queue:  # a refused call changed nothing: the copy stays
                self.queue_copy.forget()  # refilled at the next pop or end_step
            return out
        wrap.__name__ = name
        wrap.__doc__ = f"Synchronise, then :meth:`gpupool.vllm.BlockPool.{name}` (one op, one mirror transfer)."
        return wrap

    # these change keys only (docs/semantics.md section 2): the host's copy of the queue stays exact
    cache_partial_block = _slow("cache_partial_block")
    move_block_hashes = _slow("move_block_hashes")
    evict_blocks = _slow("evict_blocks")
    _reset_prefix_cache = _slow("reset_prefix_cache")
    _insert_key = _slow("_insert_key")
    _maybe_evict_cached_block = _slow("_maybe_evict_cached_block")
    # this one moves blocks in the queue
    _unpin_blocks = _slow("unpin_blocks", moves_queue=True)
    del _slow

    def reset_prefix_cache(self) -> bool:
        """False at once while a block is held (the host's free count is exact); else synchronise and
        reset as the per-call pool."""
        if self._num_free != self.num_gpu_blocks - 1:
            return False
        return self._reset_prefix_cache()

    def unpin_blocks(self, blocks, on_reuse) -> None:
        """Synchronise, then the per-call ``unpin_blocks``; later pops run per call (their reuse
        callbacks fire at the call, as vLLM's). A refused call changes nothing: its arguments are
        checked on the host first (a block at ref 0 on the host while the mirror is dirty is the
        device's to check)."""
        self._unpin_args(blocks, on_reuse)
        self._unpin_blocks(blocks, on_reuse)
        self._watched = True

    def _set_ref_cnt(self, blk: KVCacheBlock, value: int) -> None:
        """``blk.ref_cnt = value``, a raise of a held block checked on the host: that many touches,
        answered on the host and queued as :meth:`touch` (a held block is in no queue)."""
        if not isinstance(blk, PendingBlock) and self._dirty and self._ref[blk._s] == 0:
            self.sync("ref_cnt")  # a ref-0 block may have been taken by a placeholder's pop since
        k = self._ref_raise(blk, value)
        if k:
            self._touch(self._slots([blk]) * k)  # no metrics call: vLLM's write makes none

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        """From the mirror (a hit on a free block while dirty synchronises first, in the key map's
        view); ``device_lookups=True`` synchronises and looks up on the device."""
        if self.device_lookups:
            self.sync("op:get_cached_block")
            return super().get_cached_block(block_hash, kv_cache_group_ids)
        return _mirror_lookup(self, block_hash, kv_cache_group_ids)  # host only: no stream context


_mirror_lookup = BlockPool.get_cached_block.__wrapped__  # the base class's method without its stream wrapper


__all__ = ["DeferredBlockPool", "PendingBlock", "FREE_WINDOW"]
