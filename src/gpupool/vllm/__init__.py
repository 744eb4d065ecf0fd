"""gpupool on vLLM's interfaces (optional extra ``gpupool[vllm]``: msgspec, pyzmq; docs/vllm.md).

Done: KV events on vLLM 0.33's wire (:mod:`gpupool.vllm.kv_events`) and a publisher compatible with
vLLM's ``ZmqEventPublisher`` (:mod:`gpupool.vllm.publisher`), and a drop-in for vLLM 0.33's ``BlockPool``
(:mod:`gpupool.vllm.block_pool`). The core package never imports this one.
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
