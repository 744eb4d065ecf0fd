"""KV-cache group kinds (docs/semantics.md section 6): each kind's per-request rules, written once.

A manager's ``groups`` are given as ``"full"`` or ``("sliding_window", tokens)`` and become
:class:`GroupKind` values. The reference manager calls the rules here; the device kernels call
their twins in ``kernels/groups.py`` (same formula, tested equal in tests/test_groups.py), with the
windows in ``ManagerState.windows`` (0 for full attention).

Rules and where they come from (vLLM 0.33, ``vllm/v1/core/single_type_kv_cache_manager.py``):

- skipped blocks (``get_num_skipped_tokens``): a sliding window of ``w`` tokens no longer needs the
  first ``max(0, num_computed - w + 1)`` tokens; the blocks wholly inside them leave the window
  (freed tail first, the null block in their place: ``remove_skipped_blocks``). Full attention
  skips none.
- cache hits: gpupool takes the longest prefix on which *every* group hits *every* block (left to
  right, one scan for all groups). vLLM's ``SlidingWindowManager.find_longest_cache_hit`` scans
  right to left and needs only the last ``ceil((w - 1) / block_size)`` blocks before the hit's end
  cached. gpupool's rule is stricter: each block it reports is one vLLM's rule accepts too, so the
  difference is hits missed (a sliding-window block evicted early in the prefix ends the hit), never
  a wrong hit; docs/semantics.md section 6 says why it is kept.
"""
from __future__ import annotations

from typing import NamedTuple

from .errors import InvalidArgumentError


class GroupKind(NamedTuple):
    """One KV-cache group: ``kind`` ``"full"`` (``window`` 0) or ``"sliding_window"`` (``window``
    tokens, >= 1)."""

    kind: str
    window: int

    @classmethod
    def parse(cls, op: str, spec) -> "GroupKind":
        """From ``"full"`` / ``("full",)`` / ``("sliding_window", tokens)``. Raises
        InvalidArgumentError (unknown spec, window below 1 token), ArgumentTypeError (a window that
        is not an int)."""
        from .args import as_int

        if spec == "full" or spec == ("full",) or spec == ("full", 0):
            return cls("full", 0)
        if isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] == "sliding_window":
            w = as_int(op, spec[1], "sliding window")
            if w < 1:
                raise InvalidArgumentError(op, f"sliding window must be >= 1 token, got {w}", w)
            return cls("sliding_window", w)
        raise InvalidArgumentError(op, f"unknown KV-cache group spec {spec!r} (\"full\" or (\"sliding_window\", tokens))")

    def num_skipped_tokens(self, num_computed: int) -> int:
        """Tokens the group no longer needs: ``max(0, num_computed - window + 1)`` for a sliding
        window (vLLM's ``get_num_skipped_tokens``), 0 for full attention."""
        return max(0, num_computed - self.window + 1) if self.window > 0 else 0

    def num_skipped_blocks(self, num_computed: int, block_size: int, num_blocks: int) -> int:
        """Blocks wholly outside the window, of a row of ``num_blocks``: the first
        ``min(num_skipped_tokens // block_size, num_blocks)`` (``kernels/groups.py`` has the twin)."""
        return min(self.num_skipped_tokens(num_computed) // block_size, num_blocks)
