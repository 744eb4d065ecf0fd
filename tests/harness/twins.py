"""Twins: a reference and a device pool (or manager) built from one configuration, the pair every
differential test drives op for op (docs/semantics.md: the reference is the oracle)."""
from __future__ import annotations

from gpupool import BlockPool, ReferenceBlockPool
from harness.device import DEVICE

POOLS = [ReferenceBlockPool, BlockPool]  # for tests parametrized over both pools
POOL_IDS = ["reference", "device"]


def pool_twin(num_blocks: int, *, ring_capacity: int | None = None, num_chunks: int | None = None,
              device=DEVICE, **config):
    """``(ReferenceBlockPool, BlockPool)`` with the same ``config`` (``enable_caching``,
    ``enable_kv_cache_events``, ``max_keys_per_block``, ...); ``ring_capacity``, ``num_chunks`` and
    ``device`` size the device pool only (the reference has no ring or key table)."""
    return (ReferenceBlockPool(num_blocks, **config),
            BlockPool(num_blocks, **config, device=device, ring_capacity=ring_capacity, num_chunks=num_chunks))


def manager_twin(num_blocks: int, *, device=None, **config):
    """``(ReferenceKVCacheManager, KVCacheManager)`` with the same ``config`` (``block_size``,
    ``max_num_reqs``, ``max_blocks_per_req``, ``groups``, ``enable_caching``, ...); ``device``, given,
    places the device manager (else the pool's default device)."""
    from gpupool.manager import KVCacheManager
    from gpupool.reference import ReferenceKVCacheManager

    dev_kw = {} if device is None else {"device": device}
    return ReferenceKVCacheManager(num_blocks, **config), KVCacheManager(num_blocks, **config, **dev_kw)


# ---- the small manager of the single-scenario tests ---------------------------------------------------

SMALL_BS = 4
SMALL_MANAGER = dict(block_size=SMALL_BS, max_num_reqs=4, max_blocks_per_req=8)
SMALL_TOKENS = 8 * SMALL_BS  # a request's most tokens: max_blocks_per_req * block_size
SW = ("sliding_window", 8)
SMALL_GROUPS = [("full",), ("full", "full"), ("full", SW)]
SMALL_GROUP_IDS = ["full", "full+full", "full+sw"]


def small_manager(cls=None, groups=("full",), n=32, **kw):
    """A manager (``cls``: the device ``KVCacheManager`` by default, or ``ReferenceKVCacheManager``)
    of :data:`SMALL_MANAGER`'s shape: blocks of 4 tokens, 4 request slots of 8 blocks, 32 blocks."""
    from gpupool.manager import KVCacheManager

    return (cls or KVCacheManager)(n, groups=groups, **SMALL_MANAGER, **kw)


def small_manager_twin(groups=("full",), n=32, **kw):
    """:func:`manager_twin` of :data:`SMALL_MANAGER`'s shape."""
    return manager_twin(n, groups=groups, **SMALL_MANAGER, **kw)
