"""``GpuPoolScheduler``: vLLM 0.33's ``AsyncScheduler`` with its KV-cache block pool replaced by
``gpupool.vllm.BlockPool`` (docs/vllm.md, "The scheduler plug-in").

Use::

    vllm serve MODEL --scheduler-cls gpupool.vllm.GpuPoolScheduler

vLLM 0.33's ``SchedulerConfig.get_scheduler_cls`` accepts a dotted string and loads it with
``resolve_obj_by_qualname`` (it logs a warning for any class outside ``vllm.``); the class subclasses
``AsyncScheduler``, so async scheduling stays on.

This module imports vLLM; ``gpupool.vllm`` does not import it until ``gpupool.vllm.GpuPoolScheduler``
is first read (a module ``__getattr__``).

vLLM builds its scheduler (and its own ``BlockPool``, unused, with no block handed out), then
:func:`install_gpupool_block_pool` puts a gpupool pool with the same arguments everywhere vLLM 0.33
holds the pool: ``KVCacheManager.block_pool``, ``coordinator.block_pool``, every single-type manager's
``block_pool`` and ``_null_block``, and the KV connector's binding (rebound with
``bind_kv_cache_manager``). The pool is the fast path's
:class:`gpupool.vllm.fast_path.DeferredBlockPool` where :func:`fast_path_eligible` (one full-attention
group, no connector; KV events and metrics made on the host too: answers from the host, device work launched without
waiting, a synchronisation only to refill the host's copy of the free queue or to verify), else :class:`gpupool.vllm.BlockPool` (one
gpupool op plus one mirror transfer per vLLM call). The scheduling policy, ``Request`` objects and the
``SchedulerOutput`` are vLLM's.

Environment (vLLM passes a scheduler no extra arguments):
    ``GPUPOOL_VLLM_DEVICE``: the pool's torch device (default ``cuda`` when ``torch.cuda.is_available()``
    in the scheduler's process, else ``cpu``, where gpupool's kernels need ``TRITON_INTERPRET=1``);
    ``GPUPOOL_VLLM_BACKEND``: ``device`` (default) or ``reference`` (gpupool's CPU oracle, same semantics);
    ``GPUPOOL_VLLM_MAX_KEYS_PER_BLOCK``: the pool's ``max_keys_per_block`` (default 8);
    ``GPUPOOL_VLLM_FAST_PATH``: ``0`` keeps the per-call pool even where the fast path applies.
"""
from __future__ import annotations

import logging
import os

import torch
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..errors import InvalidArgumentError
from .block_pool import BlockPool
from .compat import lookahead_tokens
from .fast_path import DeferredBlockPool


def default_device() -> str:
    """``$GPUPOOL_VLLM_DEVICE``, else ``"cuda"`` when CUDA is available in this process, else ``"cpu"``."""
    dev = os.environ.get("GPUPOOL_VLLM_DEVICE")
    if dev:
        return dev
    return "cuda" if torch.cuda.is_available() else "cpu"


def fast_path_eligible(scheduler) -> tuple[bool, str]:
    """Whether :class:`gpupool.vllm.fast_path.DeferredBlockPool` serves ``scheduler`` (docs/vllm.md,
    "The fast path"): ``$GPUPOOL_VLLM_FAST_PATH`` not ``0``, one KV cache group served by vLLM's
    ``FullAttentionManager`` (block size equal to the hash block size), no KV connector (KV events
    and KV cache metrics run on it too). Returns (eligible, the reason when not)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if os.environ.get("GPUPOOL_VLLM_FAST_PATH", "1") == "0":
        return False, "GPUPOOL_VLLM_FAST_PATH=0"
    kvm = scheduler.kv_cache_manager
    managers = kvm.coordinator.single_type_managers
    old = kvm.block_pool
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return False, f"KV cache managers {[type(m).__name__ for m in managers]} (the fast path: one FullAttentionManager)"
    if managers[0].block_size != old.hash_block_size:
        return False, "block size differs from the hash block size (partial-block caching)"
    if getattr(scheduler, "connector", None) is not None:
        return False, "a KV connector"
    return True, ""


def install_gpupool_block_pool(scheduler, *, device: str | torch.device | None = None,
                               backend: str | None = None, max_keys_per_block: int | None = None,
                               pool_cls: type | None = None) -> BlockPool:
    """Replace the block pool of ``scheduler.kv_cache_manager`` (a freshly built vLLM 0.33 scheduler)
    by a ``pool_cls`` (default: :class:`gpupool.vllm.fast_path.DeferredBlockPool` where
    :func:`fast_path_eligible`, else :class:`gpupool.vllm.BlockPool`) built with the old pool's
    ``num_gpu_blocks``, ``enable_caching``, ``hash_block_size``, ``enable_kv_cache_events``,
    ``metrics_collector``, ``num_hash_lookahead_tokens`` and ``medium``; returns the new pool.

    Every holder of the old pool in vLLM 0.33 is rewritten: the KV cache manager, its coordinator,
    each single-type manager (``block_pool``, ``_null_block``) and the KV connector (rebound with
    ``bind_kv_cache_manager``). ``device`` / ``backend`` / ``max_keys_per_block`` default to
    :func:`default_device`, ``$GPUPOOL_VLLM_BACKEND`` (``"device"``), ``$GPUPOOL_VLLM_MAX_KEYS_PER_BLOCK`` (8).

    Raises InvalidArgumentError (the scheduler left unchanged) when the old pool is not vLLM's own
    ``BlockPool``, already hands out a block, or a single-type manager holds a different pool (vLLM's
    HiSparse host tier, whose host pool takes vLLM's pool as its event owner: not supported).
    """
    kvm = scheduler.kv_cache_manager
    coord = kvm.coordinator
    old = coord.block_pool
    if kvm.block_pool is not old or type(old) is not VllmBlockPool:
        raise InvalidArgumentError("GpuPoolScheduler", f"expected vLLM's own BlockPool in the KV cache manager, "
                                                       f"got {type(old).__name__}")
    if old.get_num_free_blocks() != old.num_gpu_blocks - 1:
        raise InvalidArgumentError("GpuPoolScheduler", "the block pool already hands out blocks; the pool is "
                                                       "replaced only before the first request")
    managers = coord.single_type_managers
    for m in managers:
        if m.block_pool is not old:
            raise InvalidArgumentError("GpuPoolScheduler", f"{type(m).__name__} (KV cache group "
                                       f"{m.kv_cache_group_id}) holds its own block pool "
                                       f"({type(m.block_pool).__name__}); not supported")
    if backend is None:
        backend = os.environ.get("GPUPOOL_VLLM_BACKEND", "device")
    if max_keys_per_block is None:
        max_keys_per_block = int(os.environ.get("GPUPOOL_VLLM_MAX_KEYS_PER_BLOCK", "8"))
    if device is None and backend == "device":
        device = default_device()
    if pool_cls is None:
        fast, why = fast_path_eligible(scheduler)
        pool_cls = DeferredBlockPool if fast else BlockPool
        if not fast:
            _log.info("gpupool.vllm: per-call block pool (%s)", why)
    new = pool_cls(old.num_gpu_blocks, old.enable_caching, old.hash_block_size,
                   enable_kv_cache_events=old.enable_kv_cache_events, metrics_collector=old.metrics_collector,
                   num_hash_lookahead_tokens=lookahead_tokens(old), medium=old.medium,
                   device=device, backend=backend, max_keys_per_block=max_keys_per_block)
    coord.block_pool = new
    kvm.block_pool = new
    for m in managers:
        m.block_pool = new
        if getattr(m, "_null_block", None) is old.null_block:
            m._null_block = new.null_block
    connector = getattr(scheduler, "connector", None)
    if connector is not None:
        connector.bind_kv_cache_manager(kvm)
    _log.info("gpupool.vllm: %s.%s (backend %s, device %s, %d blocks) replaces vLLM's BlockPool in %s",
              type(new).__module__, type(new).__name__, backend, device, new.num_gpu_blocks,
              type(scheduler).__name__)
    return new


# under vLLM's logger, so these lines appear in vLLM's log output with its format and level
_log = logging.getLogger("vllm.gpupool")


class _EndStep:
    """``schedule()`` then the pool's ``end_step()``: the fast path launches the step's batch there (and
    synchronises only to refill its copy of the free queue or to verify, docs/vllm.md)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        self.gpupool_block_pool.end_step()
        return out


class GpuPoolScheduler(_EndStep, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` whose KV-cache block pool is a :class:`gpupool.vllm.BlockPool`
    (the bookkeeping in gpupool's device pool on ``default_device()``); everything else is vLLM's.

    Same constructor as vLLM's scheduler. Raises what :func:`install_gpupool_block_pool` raises.
    The pool is ``self.gpupool_block_pool`` (also ``self.kv_cache_manager.block_pool``). vLLM decides
    async scheduling from ``scheduler_config.async_scheduling``, not from the class; where it is off
    (vLLM's CPU platform, ``--no-async-scheduling``, pipeline parallelism, pooling models) vLLM's own
    choice is the synchronous ``Scheduler``, so constructing this class then returns a
    :class:`GpuPoolSyncScheduler` (logged), and ``--scheduler-cls gpupool.vllm.GpuPoolScheduler``
    serves both cases.
    """

    def __new__(cls, *args, **kwargs):
        cfg = kwargs.get("vllm_config", args[0] if args else None)
        if cls is GpuPoolScheduler and cfg is not None and not cfg.scheduler_config.async_scheduling:
            _log.info("gpupool.vllm: async scheduling is off; using GpuPoolSyncScheduler (vLLM's Scheduler)")
            return GpuPoolSyncScheduler(*args, **kwargs)  # not a GpuPoolScheduler: __init__ below is skipped
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpupool_block_pool = install_gpupool_block_pool(self)


class GpuPoolSyncScheduler(_EndStep, Scheduler):
    """vLLM's synchronous ``Scheduler`` with the gpupool block pool (as :class:`GpuPoolScheduler`),
    for engines that run without async scheduling (``GpuPoolScheduler`` becomes this one there)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gpupool_block_pool = install_gpupool_block_pool(self)


__all__ = ["GpuPoolScheduler", "GpuPoolSyncScheduler", "install_gpupool_block_pool", "default_device",
           "fast_path_eligible"]
