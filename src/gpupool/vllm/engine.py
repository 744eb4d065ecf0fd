"""The per-call engine of the vLLM adapter (docs/vllm.md, "The per-call path"): one pool op per vLLM
call, then one mirror read of exactly the blocks the op could change.

An engine owns its backend (the pool, :mod:`gpupool.vllm.backends`) and its :class:`HostMirror`, the
only writer of the mirror's lists; ``gpupool.vllm.BlockPool`` (vLLM's interface: proxies, views,
argument checks, error re-typing, vLLM's events and metrics calls) checks every argument and then
delegates here, block ids (mirror slots) in, block ids out. The fast path's engine,
:class:`gpupool.vllm.fast_path.DeferredEngine`, answers the common ops on the host and runs the others
through this one's. Device work runs on the pool's CUDA stream (:func:`on_pool_stream`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from ..args import partial_block_args
from .backends import PoolBackend
from .host_events import NoEvents
from .host_mirror import HostMirror


def on_pool_stream(method):
    """``method`` (an engine's device work: ops, mirror reads, launches, synchronisations) run with the
    engine's CUDA stream (``self.stream``) current, so it waits for the pool's kernels only, not for
    the caller's stream (vLLM's forward pass, docs/vllm.md "TP > 1"); as it is off CUDA."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        s = self.stream
        if s is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(s):
            return method(self, *args, **kwargs)
    return run


class PerCallEngine:
    """One pool op per call, then one mirror transfer of the blocks it could change (module docstring).

    Args: ``backend`` (its ``pool``'s ops are called), ``events`` (a factory of the events source from
    the mirror: :class:`gpupool.vllm.host_events.NoEvents` and its kinds). Attributes: ``mirror``,
    ``num_free`` (the pool's free count), ``version`` (bumped at every change the mirror takes),
    ``stream``, ``dirty`` (False: every mirror field is exact). Block ids in and out; the arguments
    are the adapter's, checked."""

    dirty = False
    quick = False  # the fast path's pop_one / cache_one answer, and its one-group lookup (DeferredEngine)

    def __init__(self, backend: PoolBackend, events: Callable[[HostMirror], NoEvents] = lambda m: NoEvents()):
        self.backend = backend
        self.n = backend.num_blocks
        self.caching = self.pool.enable_caching
        self.mirror = HostMirror(self.n)
        self.events = events(self.mirror)
        self.num_free = 0
        self.version = 0
        self.refresh(range(self.n))

    @property
    def pool(self):
        """The backend's pool (:class:`gpupool.BlockPool` or the reference pool)."""
        return self.backend.pool

    @property
    def stream(self):
        """The backend's CUDA stream (None off CUDA): :func:`on_pool_stream` runs device work on it."""
        return self.backend.stream

    # ---- hooks: the fast path's engine waits or synchronises in these --------------------------------
    def need_exact(self, why: str) -> None:
        """A read that needs every mirror field exact."""

    def need_device(self, why: str) -> None:
        """A read or op that needs the pool's state current (every op answered run on it)."""

    def before_op(self, name: str) -> None:
        """vLLM's op ``name`` is about to run on the pool, one op per call (the fast path's engine
        synchronises first, whatever the op's arguments)."""

    def end_step(self) -> None:
        """The end of a scheduler step: nothing waits here."""

    def take_events(self) -> list:
        """gpupool's events of the ops since the last take."""
        return self.events.take()

    # ---- the mirror -------------------------------------------------------------------------------
    @on_pool_stream
    def refresh(self, ids: Iterable[int]) -> None:
        """The mirror of ``ids`` (and the free count) read from the pool: one transfer on the device."""
        self.version += 1
        ids = list(dict.fromkeys(int(b) for b in ids))
        self.num_free = self.backend.read_rows(ids, self.mirror)

    # ---- vLLM's ops, block ids in -------------------------------------------------------------------
    @on_pool_stream
    def get_new_blocks(self, n: int) -> list[int]:
        ids = self.pool.get_new_blocks(n)
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self.events.popped(ids)
        self.refresh(ids)
        return ids

    @on_pool_stream
    def free_blocks(self, ids: list[int]) -> None:
        self.pool.free_blocks(ids)
        self.refresh(ids)

    @on_pool_stream
    def touch(self, ids: list[int]) -> None:
        self.pool.touch(ids)
        self.refresh(ids)

    def raise_refs(self, b: int, k: int) -> None:
        """``k`` more references of held block ``b`` (vLLM's ``block.ref_cnt += k``): touches."""
        self.touch([b] * k)

    @on_pool_stream
    def unpin_blocks(self, ids: list[int], on_reuse: Callable[[int], None]) -> None:
        self.pool.unpin_blocks(ids, on_reuse)
        self.refresh(ids)

    def cache_fast(self, request, blocks, nc: int, nf: int, block_size: int, group: int, mask,
                   hash_block_size: int) -> bool:
        """A ``cache_full_blocks`` answered on the host where it can be: never here."""
        return False

    @on_pool_stream
    def cache_full_blocks(self, ids: list[int], hashes: list[bytes], nc: int, nf: int, block_size: int,
                          group: int, mask) -> None:
        """``ids[nc:nf]`` under ``hashes`` (at ``block_size``, from block 0), checked by the adapter."""
        self.pool.cache_full_blocks(ids, hashes, nc, nf, block_size, group, mask)
        self.events.cached_full(ids, hashes, nc, nf, block_size, group, mask)
        self.refresh(ids[nc:nf])

    @on_pool_stream
    def cache_partial_block(self, b: int, block_hashes, num_tokens: int, group: int, block_size: int,
                            hash_block_size: int, replace: bool):
        """gpupool's ``cache_partial_block``; returns its key ``(hash, group)`` or None."""
        key = self.pool.cache_partial_block(b, block_hashes, num_tokens, group, block_size, hash_block_size, replace)
        if key is not None:
            _, nt, g, hbs, h, parent = partial_block_args("cache_partial_block", self.n, b, block_hashes,
                                                          num_tokens, group, block_size, hash_block_size)
            self.events.cached_partial(b, h, parent, nt, g, hbs, replace)
        self.refresh([b])
        return key

    @on_pool_stream
    def move_block_hashes(self, s: int, d: int) -> None:
        self.pool.move_block_hashes(s, d)
        self.refresh([s, d])

    @on_pool_stream
    def evict_blocks(self, ids: list[int], evicted: Callable[[list[int]], None] | None = None) -> None:
        """Every key of ``ids`` removed; ``evicted(ids)`` (vLLM's metrics calls) after the pool's op,
        while the mirror still holds the keys, as vLLM calls it before it drops them."""
        self.pool.evict_blocks(ids)
        self.events.evicted(ids)
        if evicted is not None:
            evicted(ids)
        self.refresh(ids)

    @on_pool_stream
    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.events.cleared()
        self.refresh(range(self.n))
        return True

    @on_pool_stream
    def device_lookup(self, block_hash: bytes, groups: list[int]) -> list[int] | None:
        """One lookup on the pool (``device_lookups=True``)."""
        return self.pool.get_cached_block(block_hash, groups)

    @on_pool_stream
    def free_queue(self) -> list[int]:
        return list(self.pool.free_queue())

    # ---- other users of the pool (gpupool.vllm.device_access) ----------------------------------------
    @on_pool_stream
    def other_user_reads(self, fn, args, kwargs):
        """``fn`` (a read of the pool) after every op answered has run on the pool."""
        self.need_device("device_pool")
        return fn(*args, **kwargs)

    @on_pool_stream
    def other_user_changes(self, name: str, fn, args, kwargs):
        """``fn`` (a change of the pool by another user): after every op answered has run, waited for
        (its recorded error raised at once), then the whole mirror read again (:meth:`after_other_user`)."""
        self.need_device("device_pool")
        out = fn(*args, **kwargs)
        check = getattr(self.pool, "check", None)
        if check is not None:
            check()  # a batched op's recorded error raised to its caller, not to a later launch of ours
        self.after_other_user(name)
        return out

    def after_other_user(self, name: str) -> None:
        """Another user changed the pool (``name``): the whole mirror from the pool; the pool's KV events
        of it are not vLLM's (they describe no call of vLLM's), so they are dropped."""
        if self.pool.enable_kv_cache_events:
            self.pool.take_events()
        self.refresh(range(self.n))


__all__ = ["PerCallEngine", "on_pool_stream"]
