"""gpupool on vLLM's interfaces (docs/vllm.md). Optional: it needs msgspec and pyzmq, the ``vllm`` extra
(``pip install -e '.[vllm]'`` in the repository); vLLM itself only for the scheduler plug-in and
:mod:`gpupool.vllm.compat`.

* :mod:`gpupool.vllm.kv_events`: KV events on vLLM 0.33's wire, and :mod:`gpupool.vllm.publisher`, a
  publisher compatible with vLLM's ``ZmqEventPublisher``;
* :mod:`gpupool.vllm.block_pool`: a drop-in for vLLM 0.33's ``BlockPool`` (its deferred form for the
  scheduler's fast path: :mod:`gpupool.vllm.fast_path`);
* ``GpuPoolScheduler``, for ``vllm serve MODEL --scheduler-cls gpupool.vllm.GpuPoolScheduler``
  (:mod:`gpupool.vllm.scheduler`, the only module here that imports vLLM: it is loaded on first access
  of the attribute);
* ``python -m gpupool.vllm.compat``: every vLLM name the plug-in touches, checked on the installed vLLM.

The core package never imports this one.
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
