"""gpupool on vLLM's interfaces (optional extra ``gpupool[vllm]``: msgspec, pyzmq; docs/vllm.md).

Done: KV events on vLLM 0.33's wire (:mod:`gpupool.vllm.kv_events`) and a publisher compatible with
vLLM's ``ZmqEventPublisher`` (:mod:`gpupool.vllm.publisher`), and a drop-in for vLLM 0.33's ``BlockPool``
(:mod:`gpupool.vllm.block_pool`; its deferred form for the scheduler's fast path,
:mod:`gpupool.vllm.fast_path`), and ``GpuPoolScheduler`` for ``vllm serve ... --scheduler-cls
gpupool.vllm.GpuPoolScheduler`` (:mod:`gpupool.vllm.scheduler`, the only module here that imports vLLM:
it is loaded on first access of the attribute). The core package never imports this one.
"""
from .kv_events import (  # noqa: F401
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    to_vllm_events,
    wire_block_hash,
)
from .publisher import ZmqEventPublisher  # noqa: F401
from .block_pool import BlockPool, KVCacheBlock  # noqa: F401,E402


def __getattr__(name: str):
    """``GpuPoolScheduler`` (and the scheduler module's helpers) load vLLM, so only on first access."""
    if name in ("GpuPoolScheduler", "GpuPoolSyncScheduler", "install_gpupool_block_pool"):
        from . import scheduler
        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
