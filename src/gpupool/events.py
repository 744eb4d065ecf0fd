"""KV cache events (docs/semantics.md section 2, `take_events`), as vLLM publishes them for external KV indexes.

Both pools emit the same event objects; hashes are ``bytes``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly registered in the prefix cache by one ``cache_full_blocks`` / ``cache_partial_block`` call.

    ``block_hashes`` lists the stored hashes in block order; ``parent_block_hash`` is the hash before
    the first of them (None at the start of a request); ``block_size`` in tokens; ``group_id`` the
    KV-cache group.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    block_size: int
    group_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """One key ``(block_hash, group_id)`` removed from the prefix cache (eviction or re-caching)."""

    block_hash: bytes
    group_id: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """A successful ``reset_prefix_cache()``."""

    marker: bool = field(default=True, repr=False)


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
