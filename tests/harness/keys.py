"""Test block hashes: one 32-byte hash per test key (docs/semantics.md section 5, the trace hash)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from harness.sizes import BLOCK_SIZE


def h(i) -> bytes:
    """The 32-byte block hash of test key ``i``: ``sha256(str(i))`` (the docs/semantics.md section 5 trace hash)."""
    return hashlib.sha256(str(i).encode()).digest()


def hashes(ids: Iterable) -> list[bytes]:
    """``[h(i) for i in ids]``."""
    return [h(i) for i in ids]


def request_hashes(prefix_ids: Sequence, num_tokens: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Hashes of a request's full blocks: one test key per block (``prefix_ids[j]`` names block ``j``'s
    chained content), truncated to the ``num_tokens // block_size`` full blocks."""
    full = num_tokens // block_size
    if len(prefix_ids) < full:
        raise ValueError(f"{num_tokens} tokens need {full} prefix ids, got {len(prefix_ids)}")
    return hashes(prefix_ids[:full])
