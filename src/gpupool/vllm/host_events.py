"""KV events and KV cache metrics made on the host (docs/algorithms.md section 8, "Events and metrics").

The fast path (:class:`gpupool.vllm.fast_path.DeferredBlockPool`) knows, when vLLM calls it, every
block a pop takes and the keys it evicts, every key a caching adds and every block a hit touches: the
host mirror holds them exactly. So its KV events come from the host, in the order vLLM's ``BlockPool``
appends them, and its device pool records none (its batched launch writes no events).
:class:`HostEvents` applies gpupool's event rules (docs/semantics.md section 2, the reference pool's
``_emit`` calls) to the mirror as it is *before* the op's changes reach it, giving gpupool's events
(:mod:`gpupool.events`); the adapter converts them to vLLM's as it converts a device pool's.

:func:`metrics_pop` and :func:`metrics_touch` are vLLM's ``KVCacheMetricsCollector`` calls of
``get_new_blocks`` and ``touch`` (the same blocks in the same order as vLLM's ``BlockPool``).
"""
from __future__ import annotations

from ..events import AllBlocksCleared, BlockRemoved, BlockStored
from .host_mirror import HostMirror, get_block_hash, get_group_id, vllm_key


class NoEvents:
    """Where an engine's gpupool events come from (:mod:`gpupool.vllm.engine`): the engine calls these
    hooks at every op, whatever the pool's events, after the op succeeded on the pool and before the
    mirror takes its changes (the mirror then holds the keys the op removes); :meth:`take` hands over
    what was made. This one makes none (KV events off)."""

    __slots__ = ()

    def take(self) -> list:
        return []

    def popped(self, slots) -> None:
        pass

    def evicted(self, slots) -> None:
        pass

    def stored(self, hashes, parent: bytes | None, block_size: int, group: int) -> None:
        pass

    def cached_full(self, ids: list[int], hashes, nc: int, nf: int, block_size: int, group: int, mask) -> None:
        pass

    def cached_partial(self, slot: int, h: bytes, parent: bytes | None, num_tokens: int, group: int,
                       hash_block_size: int, replace_existing: bool) -> None:
        pass

    def cleared(self) -> None:
        pass


class PoolEvents(NoEvents):
    """The pool records the events itself (the per-call adapter over a pool with KV events on): the
    hooks make none, :meth:`take` drains the pool's."""

    __slots__ = ("pool",)

    def __init__(self, pool):
        self.pool = pool

    def take(self) -> list:
        return self.pool.take_events()


class HostEvents(NoEvents):
    """gpupool's KV events of the ops on a host mirror (module docstring), queued until :meth:`take`.
    ``caching``: the pool's ``enable_caching`` (a pop evicts keys only with caching on)."""

    __slots__ = ("mirror", "caching", "queue")

    def __init__(self, mirror: HostMirror, caching: bool):
        self.mirror = mirror
        self.caching = caching
        self.queue: list = []

    def take(self) -> list:
        q, self.queue = self.queue, []
        return q

    def _removed(self, slot: int) -> None:
        """One BlockRemoved per key of ``slot``, primary first (the order the pools remove them)."""
        for key in self.mirror.keys[slot]:
            self.queue.append(BlockRemoved(get_block_hash(key), get_group_id(key)))

    def popped(self, slots) -> None:
        """``get_new_blocks`` took ``slots`` (in pop order): each one's keys are evicted."""
        if self.caching:
            for s in slots:
                self._removed(s)

    def evicted(self, slots) -> None:
        """``evict_blocks``: the keys of each listed block (given order, each block once, null skipped)."""
        seen = set()
        for s in slots:
            if s and s not in seen:
                seen.add(s)
                self._removed(s)

    def stored(self, hashes, parent: bytes | None, block_size: int, group: int) -> None:
        """A caching stored ``hashes`` (block order) after ``parent``."""
        self.queue.append(BlockStored(tuple(hashes), parent, block_size, group))

    def cached_full(self, ids: list[int], hashes, nc: int, nf: int, block_size: int, group: int, mask) -> None:
        """``cache_full_blocks`` of ``ids[nc:nf]`` (``hashes``: at ``block_size``, from block 0): every
        non-null unmasked block's old keys are removed (a promotion replaces them), then one
        BlockStored lists the new hashes, even none (as vLLM); nothing with caching off (a no-op)."""
        if not self.caching or nc >= nf:
            return
        todo = [i for i in range(nc, nf) if ids[i] and (mask is None or mask[i - nc])]
        for i in todo:
            self._removed(ids[i])
        self.stored([hashes[i] for i in todo], hashes[nc - 1] if nc else None, block_size, group)

    def cached_partial(self, slot: int, h: bytes, parent: bytes | None, num_tokens: int, group: int,
                       hash_block_size: int, replace_existing: bool) -> None:
        """``cache_partial_block`` of ``slot`` under ``(h, group)`` covering ``num_tokens``: nothing when
        the block already holds the key (and is not told to replace); else its keys removed first
        when it replaces them (told to, or its primary key covers fewer tokens), then BlockStored."""
        m = self.mirror
        keys = m.keys[slot]
        if vllm_key(h, group) in keys and not replace_existing:
            return
        cur = m.ntok[slot]
        if replace_existing or (keys and cur is not None and cur < num_tokens):
            self._removed(slot)
        self.stored((h,), parent, hash_block_size, group)

    def cleared(self) -> None:
        """A successful ``reset_prefix_cache``."""
        self.queue.append(AllBlocksCleared())


def metrics_pop(mc, blocks, caching: bool) -> None:
    """vLLM's metrics calls of ``get_new_blocks`` (``blocks`` in pop order): per block
    ``on_block_evicted`` (with caching on) then ``on_block_allocated``."""
    for blk in blocks:
        if caching:
            mc.on_block_evicted(blk)
        mc.on_block_allocated(blk)


def metrics_touch(mc, blocks) -> None:
    """vLLM's metrics calls of ``touch``: ``on_block_accessed`` per non-null block, as listed."""
    for blk in blocks:
        if not blk.is_null:
            mc.on_block_accessed(blk)


__all__ = ["NoEvents", "PoolEvents", "HostEvents", "metrics_pop", "metrics_touch"]
