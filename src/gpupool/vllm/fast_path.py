"""The fast path: ``DeferredBlockPool``, the drop-in vLLM ``BlockPool`` over :class:`DeferredEngine`, whose
device work is deferred and whose answers are known on the host, so that a vLLM scheduler step needs no
device-to-host synchronisation in the common case and at most one when a step pops up to
``FREE_WINDOW // 2`` blocks. The algorithm, its parts (``HostMirror``, ``FreeQueueCopy``, ``OpBatch``,
the device or reference backend) and when it synchronises: docs/algorithms.md section 8.

``get_new_blocks``, ``touch``, ``free_blocks``, ``cache_full_blocks`` and ``ref_cnt`` raises are
answered from the host mirror and the host's copy of the free queue's head and gathered into a batch
that :meth:`DeferredEngine.end_step` launches as ONE ``gpupool.BlockPool.apply_predicted``;
:meth:`DeferredEngine.sync` is one device-to-host transfer that checks the host's claims, binds
placeholders and relaunches what a recorded error made the device skip. Every other op synchronises
first and runs as the per-call engine runs it.

With KV events or a metrics collector on, the same: the events and the metrics calls come from what
the host knows (:mod:`gpupool.vllm.host_events`), in vLLM's order; only a pop past the host's copy of
the free queue then runs per call (its blocks are named at the call).
"""
from __future__ import annotations

from collections import Counter

from ..args import MAX_GROUP_ID, MAX_TOKENS
from ..errors import PoolError
from .backends import SyncRead, claims_of
from .block_pool import BlockPool, KVCacheBlock, _hashes_at
from .engine import PerCallEngine, on_pool_stream
from .host_events import HostEvents, NoEvents
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


class DeferredEngine(PerCallEngine):
    """The fast path's engine (module docstring; docs/algorithms.md section 8): the per-call engine
    with ``get_new_blocks``, ``touch``, ``free_blocks``, ``cache_full_blocks`` (where
    :meth:`cache_fast` takes it) and ``ref_cnt`` raises answered on the host and queued, and every other
    op synchronising first.

    Args as :class:`PerCallEngine`'s, and ``placeholder`` (makes the proxy of a placeholder slot),
    ``observed`` (KV events or a metrics collector on: each pop names its blocks at the call) and
    ``cadence``, whose ``verify_every``, ``launch_every`` and ``launch_ops`` :meth:`end_step` reads
    (the adapter: settable per pool). Attributes:
    ``syncs`` (synchronisations by reason), ``pending`` (the placeholders' proxies, in order),
    ``dirty`` (placeholders pending: only held blocks' fields are exact), ``queue_copy``."""

    def __init__(self, backend, events, *, placeholder, observed: bool, cadence):
        super().__init__(backend, events)
        self.placeholder = placeholder
        self.observed = observed
        self.cadence = cadence
        self.syncs: Counter = Counter()
        self.steps_since_sync = 0
        self.steps_since_launch = 0
        self.pending: list[PendingBlock] = []
        self.touched: set[int] = set()  # blocks the ops since the last synchronisation changed
        self.dirty = False
        self.watched = False  # a reuse watcher was registered: pops run per call from then on
        # the decode step's pops and cachings take pop_one / cache_one: the device backend, no events or
        # metrics to make, pops not run per call
        self.quick = backend.name == "device" and not observed
        self.reread = False  # a pop re-reading the pool after it disagreed with the copy
        self.queue_copy = FreeQueueCopy()  # the free queue's first ids, exactly
        self.queue_copy.fill(self.read_window())

    # ---- hooks ---------------------------------------------------------------------------------------
    def need_exact(self, why: str) -> None:
        if self.dirty:
            self.sync(why)

    def need_device(self, why: str) -> None:
        if self.pending or self.touched:
            self.sync(why)

    @on_pool_stream
    def read_window(self) -> list[int]:
        """The free queue's first ids from its first ``FREE_WINDOW`` ring slots, -1 for holes."""
        return self.backend.window(FREE_WINDOW)

    # ---- the fast ops --------------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        """The first ``n`` blocks of the host's copy of the free queue (their keys leave the mirror), a
        demand of the batch; past the copy (after refilling it with one synchronisation when nothing
        is pending), placeholders bound at the next :meth:`sync` (slots ``n_blocks + k``, their proxies
        in ``pending``). ``n`` is at most the (exact) free count."""
        if self.watched:
            # with reuse watchers registered (unpin_blocks) a pop must call them at once, as vLLM does
            return self._pop_per_call(n)
        if n == 0:
            return []
        qc = self.queue_copy
        if not qc.fits(n):
            if not self.pending:
                self.sync("free_queue", window=True)
                if self.observed and not qc.fits(n):
                    return self._pop_per_call(n)  # events and metrics name the blocks at the call
            if not qc.fits(n):
                self.num_free -= n
                return self._pop_pending(n)
        self.num_free -= n
        ids = qc.take(n)
        if self.backend.pop_known(n, ids) is not None:
            return self._pop_after_change(n)
        self.events.popped(ids)  # the keys the pop evicts, before they leave the mirror
        self.mirror.pop(ids)
        self.touched.update(ids)
        return ids

    def pop_one(self) -> int | None:
        """``get_new_blocks(1)`` where :attr:`quick` and the host's copy of the queue is not empty: its
        first id (the pool has a free block: the caller checked), else None (the caller takes the
        general path). The same answer and batch as :meth:`get_new_blocks`, in fewer steps."""
        q = self.queue_copy.ids
        if not q:
            return None
        s = q.popitem(False)[0]
        self.num_free -= 1
        m = self.mirror
        if m.keys[s]:
            m.evict(s)
        m.ref[s] = 1
        self.backend.pop_one(s)
        self.touched.add(s)
        return s

    def cache_one(self, request, blk, nc: int, block_size: int, group: int) -> bool:
        """``cache_full_blocks`` of the one block ``blk`` (index ``nc`` of the request's blocks; vLLM's
        ``hash_block_size`` is ``block_size``, an int; no mask) where :attr:`quick`: as :meth:`cache_fast`
        takes it (caching on, ``blk`` this pool's, held and un-keyed, the request's hashes there as
        bytes), in fewer steps; returns whether it was (else the caller takes the general path)."""
        m = self.mirror
        if type(blk) is not KVCacheBlock or blk._pool._engine is not self or blk.is_null:
            return False
        s = blk._s
        if m.keys[s] or m.ref[s] <= 0 or not self.caching:
            return False
        bh = getattr(request, "block_hashes", None)
        if type(bh) is not list or len(bh) <= nc or nc < 0:
            return False
        h = bh[nc]
        t = (nc + 1) * block_size
        if (type(h) is not bytes or nc and type(bh[nc - 1]) is not bytes or type(group) is not int
                or not 0 <= group <= MAX_GROUP_ID or t > MAX_TOKENS):
            return False
        key = h + group.to_bytes(4, "big")  # vLLM's BlockHashWithGroupId
        m.keys[s] = (key,)
        m.holders.setdefault(key, {})[s] = self.backend.cache_one(s, h, group, t)
        m.ntok[s] = t
        self.touched.add(s)
        return True

    def _pop_per_call(self, n: int) -> list[int]:
        """Synchronise, then the per-call pop (its events too); the host's copy of the queue follows."""
        self.sync("op:get_new_blocks")
        out = super().get_new_blocks(n)
        qc = self.queue_copy
        if qc.fits(n):
            qc.take(n)
        else:
            qc.forget()
        return out

    def _pop_after_change(self, n: int) -> list[int]:
        """The reference pool's first free blocks are not the copy's (it was changed past the adapter),
        nothing taken: the whole mirror and the copy read again, then the pop answered from them, as
        the per-call engine answers it (a second disagreement raises PoolError)."""
        self.num_free += n
        self.refresh(range(self.n))
        self.queue_copy.fill(self.read_window())
        if self.reread:
            raise PoolError("DeferredBlockPool.get_new_blocks", "the pool's free queue is not the one it reads back")
        self.reread = True
        try:
            return self.get_new_blocks(n)
        finally:
            self.reread = False

    def _pop_pending(self, n: int) -> list[int]:
        k0 = len(self.pending)
        self.backend.pop_pending(n)
        self.queue_copy.forget()
        self.dirty = True  # keyed blocks may have been evicted: reads of free blocks wait for a sync
        first = self.n + k0
        for s in range(first, first + n):
            self.pending.append(self.placeholder(s))
            self.mirror.add_placeholder()
        return list(range(first, first + n))

    def touch(self, slots: list[int]) -> None:
        """A touch of ``slots`` (non-null, exact on the host: the adapter synchronises first where a
        ref-0 block may have been taken by a placeholder's pop) answered on the host and queued."""
        unlink = self.queue_copy.unlink
        for s in self.mirror.touch(slots):
            self.num_free -= 1
            unlink(s)
        self._queue("touch", slots, False)

    def raise_refs(self, b: int, k: int) -> None:
        self.touch([b] * k)

    def free_blocks(self, slots: list[int]) -> None:
        """One reference less per slot (each held often enough), a segment of the batch's free part;
        the blocks that reach 0 requeued in the host's copy."""
        front, back = self.mirror.release(slots)
        nf0 = self.num_free
        self.num_free += len(front) + len(back)
        self.queue_copy.requeue(front, back, nf0, self.n)
        self._queue("free", slots, bool(front))

    def cache_fast(self, request, blocks, nc, nf, block_size, group, mask, hash_block_size) -> bool:
        """A ``cache_full_blocks`` queued in the batch's caching part with the keys added on the host,
        when caching is on, every block in the range is non-null, held, un-keyed and listed once and
        there is no mask (the arguments as ``gpupool.args.cache_full_args`` would accept them, so the
        launch cannot fail on them); its events made. Returns whether it was (else the adapter runs it
        per call, or raises its error). Reads only the hashes of the range (and the parent's)."""
        if not (self.caching and mask is None and type(block_size) is int and type(group) is int and 0 <= nc
                and block_size > 0 and 0 <= group <= MAX_GROUP_ID and nf * block_size <= MAX_TOKENS):
            return False
        if type(blocks) is not list:
            return False
        rng = blocks[nc:nf]
        if len(rng) != nf - nc:
            return False
        m = self.mirror
        keys, ref, slots = m.keys, m.ref, []
        for blk in rng:  # held, un-keyed, listed once: a pop may then run before the caching (OpBatch)
            if not issubclass(type(blk), KVCacheBlock) or blk.is_null or blk._pool._engine is not self:
                return False
            s = blk._s
            if keys[s] or ref[s] <= 0:
                return False
            slots.append(s)
        if len(slots) > 1 and len(set(slots)) < len(slots):
            return False
        bh = getattr(request, "block_hashes", None)
        if bh is None:
            return False
        if block_size == hash_block_size:
            if len(bh) < nf:
                return False
            hashes = bh[max(nc - 1, 0):nf]
        else:
            try:
                hashes = _hashes_at(bh, hash_block_size, block_size, nf)[max(nc - 1, 0):]
            except PoolError:
                return False  # the per-call path raises it, as vLLM's assertion
            if len(hashes) < nf - max(nc - 1, 0):
                return False
        for h in hashes:  # the parent's too, as the per-call path checks it
            if type(h) is not bytes:
                return False
        parent = hashes[0] if nc else None
        if nc:
            hashes = hashes[1:]
        ntok = list(range((nc + 1) * block_size, (nf + 1) * block_size, block_size))
        seqs = self.backend.cache(m, slots, hashes, group, ntok, nc, nf, block_size,
                                  lambda: _hashes_at(bh, hash_block_size, block_size, nf))
        suffix = group.to_bytes(4, "big")
        m.add_keys(slots, [h + suffix for h in hashes], seqs, ntok)  # vLLM's BlockHashWithGroupId
        self._mark_changed(slots)
        self.events.stored(hashes, parent, block_size, group)  # its blocks are un-keyed: nothing removed
        return True

    def _queue(self, kind: str, slots: list[int], front: bool) -> None:
        """Queue a touch or a free of ``slots`` (``front``: a block it frees goes to the queue's front)
        in the batch, in a new round or after a launch where ``OpBatch.placement`` says so."""
        if slots:
            self._mark_changed(slots)
            self.backend.queue(kind, slots, front)

    def _mark_changed(self, slots: list[int]) -> None:
        """The blocks of ``slots`` are checked at the next synchronisation (placeholders' slots are not
        block ids: their blocks are read as the placeholders are bound)."""
        if self.pending:
            self.touched.update(s for s in slots if s < self.n)
        else:
            self.touched.update(slots)

    @on_pool_stream
    def flush(self) -> None:
        """Launch the queued ops, not waiting (the device backend's batch, as ONE ``apply_predicted``)."""
        self.steps_since_launch = 0
        self.backend.flush()

    # ---- the synchronisation -----------------------------------------------------------------------
    def end_step(self) -> None:
        """The end of a scheduler step: launch the batch, not waiting, every ``launch_every`` steps or
        once it names ``launch_ops`` block ids; synchronise only when the host's copy of the free queue
        is low (refill) or ``verify_every`` steps passed with ops to check."""
        c = self.cadence
        self.steps_since_launch += 1
        if self.steps_since_launch >= c.launch_every or self.backend.queued() >= c.launch_ops:
            self.flush()
        self.steps_since_sync += 1
        low = self.queue_copy.low(self.num_free)
        if low or self.steps_since_sync >= c.verify_every:
            self.sync("end_step", window=low)

    @on_pool_stream
    def sync(self, why: str = "sync", window: bool = False) -> None:
        """Bind the placeholders, make the mirror exact, check the host's claims and (``window`` or when
        low) refill the host's copy of the free queue: one device-to-host transfer.

        The host never keeps an op the device did not run: each launch's confirmation is read here,
        and launches that an error recorded before them (past the adapter) made do nothing are
        launched again, after that error is taken from the status word, before the mirror is read (a
        second transfer). That error is then raised, the mirror exact.

        Raises what the device recorded (PoolError: as above; a launch's own failure, not expected since
        the fast ops are checked on the host first, after re-reading the whole mirror) and PoolError
        where the device disagrees with the host (free count, popped ids, ref and key counts of the
        blocks changed, the queue's first ids), the whole mirror read again first, with a recorded
        error as its cause (and named in its message); a key insertion counter other than the host's
        (keys made past the adapter) reads the whole mirror too."""
        if not (self.pending or self.touched or self.dirty or window):
            return
        self.flush()
        self.syncs[why] += 1
        self.steps_since_sync = 0
        refill = window or self.queue_copy.low(self.num_free)
        known = sorted(self.touched)
        npend = len(self.pending)
        exact = not (self.pending or self.dirty)  # the host's rows of `known` are claims to check
        r = self.backend.read(known, npend, FREE_WINDOW if refill else 0, exact)
        if r.failed:
            return self._own_failure(r)
        m, win = self.mirror, r.window
        wrong = []
        if r.bad_pops:
            wrong.append(f"{r.bad_pops} popped ids differ from the host's")
        if self.num_free != r.num_free:
            wrong.append(f"the host predicted {self.num_free} free blocks, the device has {r.num_free}")
        if exact and r.claims != claims_of(m.ref, m.keys, m.ntok, known):
            wrong.append("ref counts, key counts or covered tokens of the blocks changed differ from the host's")
        if win is not None and not self.queue_copy.agrees(win):
            wrong.append("the free queue's first ids differ from the host's copy")
        self._bind(r.ids)
        self.touched = set()
        self.version += 1
        if wrong or not r.seqs_ok:
            # the pool was changed past the adapter, maybe blocks the host did not change since the last
            # synchronisation: every row read again (one transfer, rare)
            self.refresh(range(self.n))
        else:  # the claims held (if checked): the backend makes the rest of the mirror exact
            self.num_free = self.backend.apply(m, r, known, exact, exact)
        if win is not None:
            self.queue_copy.fill(win)
        self.dirty = False
        if wrong:
            self.queue_copy.forget()  # refilled from the device at the next synchronisation
            rec = r.recorded  # taken from the status word: raised with the disagreement, not lost
            if rec is not None:
                wrong.append(f"and an error recorded on the device: {type(rec).__name__}: {rec}")
            raise PoolError("DeferredBlockPool.sync", "; ".join(wrong)) from rec
        if r.recorded is not None:
            raise r.recorded

    def _bind(self, ids: list[int]) -> None:
        """Placeholders -> their blocks (``ids``, in order): the mirror's placeholder slots move onto the
        blocks; each proxy reads its block's slot from then on (``pool.blocks`` is not changed: one
        object per block id for the pool's life)."""
        self.mirror.bind(self.n, ids[:len(self.pending)])
        self._bind_proxies(ids)

    def _bind_proxies(self, ids: list[int]) -> None:
        for blk, b in zip(self.pending, ids):
            blk._s = b
            if b == 0:
                blk.is_null = True
        self.pending = []
        self.backend.bound()

    def _own_failure(self, r: SyncRead) -> None:
        """A launch of the fast path failed on the device (not expected: its ops are checked on the
        host first), some of its ops run: the whole mirror is read again from the device, each
        placeholder of a pop that did not run is bound to the null block, and the error is raised."""
        n = self.n
        self.mirror.drop_placeholders(n)
        self._bind_proxies([b if 0 < b < n else 0 for b in r.ids])
        self.touched, self.dirty = set(), False
        self.queue_copy.forget()
        self.refresh(range(n))
        raise r.recorded if r.recorded is not None else PoolError("DeferredBlockPool.sync", "a launch failed")

    # ---- everything else: synchronise (here or in before_op), then the per-call engine ------------------
    def before_op(self, name: str) -> None:
        """Synchronise before an op the host does not answer (``cache_partial_block``,
        ``move_block_hashes``, ``evict_blocks``, a ``cache_full_blocks`` :meth:`cache_fast` did not
        take, a device lookup, the views' key writes): it runs as the per-call engine runs it (these
        change keys only, so the host's copy of the queue stays exact)."""
        self.sync("op:" + name)

    def reset_prefix_cache(self) -> bool:
        """False at once while a block is held (the host's free count is exact); else synchronise and
        reset."""
        if self.num_free != self.n - 1:
            return False
        self.sync("op:reset_prefix_cache")
        return super().reset_prefix_cache()

    def unpin_blocks(self, ids, on_reuse) -> None:
        """Synchronise, then the per-call ``unpin_blocks``; later pops run per call (their reuse
        callbacks fire at the call, as vLLM's). A refused call changes nothing."""
        self.sync("op:unpin_blocks")
        super().unpin_blocks(ids, on_reuse)
        self.queue_copy.forget()  # its blocks went to the back: refilled at the next pop or end_step
        self.watched, self.quick = True, False

    def after_other_user(self, name: str) -> None:
        super().after_other_user(name)
        self.queue_copy.forget()  # refilled from the device at the next pop or end_step
        if name == "unpin_blocks":
            # its reuse watchers fire at a pop: pops run per call from then on
            self.watched, self.quick = True, False


class DeferredBlockPool(BlockPool):
    """:class:`gpupool.vllm.BlockPool` over the fast path's :class:`DeferredEngine` (module docstring;
    docs/algorithms.md section 8). Same constructor.

    ``syncs`` counts the synchronisations by reason (``end_step``, ``free_queue`` (a refill before a
    pop), ``block_id``, ``ref_cnt``, ``get_one_block``, ``op:<name>``, ...); ``flushes`` the launches;
    ``deferred`` is True (KV events and metrics are made on the host, :mod:`gpupool.vllm.host_events`).
    The cadence (class attributes, settable per pool): ``verify_every`` (default 64): :meth:`end_step`
    synchronises at least every this many steps while ops wait to be checked; ``launch_every``
    (default 4) and ``launch_ops`` (default 1,024): it launches the batch every this many steps, or
    sooner once its ops name this many block ids.
    """

    verify_every = 64
    # a launch's host cost is mostly fixed (Python and torch around the kernel), so small steps share one;
    # the device then runs a few steps behind the host, which vLLM does not see (its answers are the
    # host's) and every read of the device synchronises first, which launches first
    launch_every = 4
    launch_ops = 1024
    deferred = True  # always, since KV events and metrics are made on the host (kept for callers that ask)

    def _make_engine(self, backend) -> DeferredEngine:
        caching = backend.pool.enable_caching
        return DeferredEngine(
            backend, (lambda m: HostEvents(m, caching)) if self.enable_kv_cache_events else (lambda m: NoEvents()),
            placeholder=lambda slot: PendingBlock(self, slot),
            observed=self.enable_kv_cache_events or self.metrics_collector is not None, cadence=self)

    def _device_events(self) -> bool:
        return False  # made on the host: the device pool records none (its batched launch writes none)

    def sync(self, why: str = "sync", window: bool = False) -> None:
        """:meth:`DeferredEngine.sync`: launch, bind the placeholders, make the mirror exact and check
        the host's claims (and refill the copy of the free queue with ``window``); one transfer."""
        self._engine.sync(why, window)

    @property
    def syncs(self) -> Counter:
        return self._engine.syncs

    @property
    def flushes(self) -> int:
        """Launches of a batch (one ``apply_predicted`` each, no synchronisation; 0 on the reference)."""
        return self._engine.backend.flushes

    @property
    def queue_copy(self) -> FreeQueueCopy:
        return self._engine.queue_copy


__all__ = ["DeferredBlockPool", "DeferredEngine", "PendingBlock", "FREE_WINDOW"]
