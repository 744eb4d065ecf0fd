"""KV-cache group kinds (docs/semantics.md section 6): one spec per kind, one hook per rule.

A manager's ``groups`` are given as ``"full"`` or ``("sliding_window", tokens)`` and become
:class:`GroupKind` values, whose rules call their kind's spec in :data:`KINDS`. The reference manager
calls them; the device kernels call their twins in ``kernels/groups.py`` (same formula, tested equal
in tests/pool/test_groups.py), which read a group's kind from its word in ``ManagerState.windows``
(:meth:`GroupKind.device_word`: the window for a sliding window, 0 for full attention). A new kind is
one :class:`KindSpec` subclass here and its branch in each hook there (vLLM's
``SingleTypeKVCacheManager`` subclasses, ``vllm/v1/core/single_type_kv_cache_manager.py``).

The rules (vLLM 0.33):

- skipped tokens (``get_num_skipped_tokens``): a sliding window of ``w`` tokens no longer needs the
  first ``max(0, num_computed - w + 1)`` tokens; the blocks wholly inside them leave the window
  (freed tail first, the null block in their place: ``remove_skipped_blocks``). Full attention
  skips none.
- cache hits (``find_longest_cache_hit``): each group accepts the longest prefix on which it hits
  every block, and the request's hit is the shortest of the groups' (so every group hits every
  block of it, one scan left to right). vLLM's ``SlidingWindowManager.find_longest_cache_hit`` scans
  right to left and needs only the last ``ceil((w - 1) / block_size)`` blocks before the hit's end
  cached. gpupool's rule is stricter: each block it reports is one vLLM's rule accepts too, so the
  difference is hits missed (a sliding-window block evicted early in the prefix ends the hit), never
  a wrong hit; docs/semantics.md section 6 says why it is kept.

Chunked local attention (vLLM's ``ChunkedLocalAttentionManager``) would be a third spec; it is not
offered yet because the device reads a kind from the group's window word only.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .errors import InvalidArgumentError


class KindSpec:
    """The rules of one attention kind, one hook each; ``param`` is the group's parameter (a window
    in tokens; 0 where the kind has none)."""

    name: str
    #: Whether the skip rule can release blocks (the device kernels skip the window passes of a
    #: manager whose groups all say no: ``ManagerConfig.SW``).
    releases_blocks: bool = False

    def num_skipped_tokens(self, param: int, num_computed: int) -> int:
        """Leading tokens the group no longer needs (vLLM's ``get_num_skipped_tokens``)."""
        return 0

    def parse_param(self, op: str, spec) -> int | None:
        """The parameter of a group spec of this kind (``GroupKind.parse``), None for another kind's
        spec. Raises InvalidArgumentError / ArgumentTypeError for a bad parameter."""
        raise NotImplementedError

    def hit_length(self, param: int, cached: Sequence[bool]) -> int:
        """Of a request's leading full blocks, ``cached[i]`` whether block i's key is cached for this
        group: how many leading blocks the group accepts as a hit (every one cached)."""
        n = 0
        while n < len(cached) and cached[n]:
            n += 1
        return n


class FullAttention(KindSpec):
    name = "full"

    def parse_param(self, op: str, spec) -> int | None:
        return 0 if spec == "full" or spec == ("full",) or spec == ("full", 0) else None


class SlidingWindow(KindSpec):
    """A window of ``param >= 1`` tokens."""

    name = "sliding_window"
    releases_blocks = True

    def parse_param(self, op: str, spec) -> int | None:
        from .args import as_int

        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] == "sliding_window"):
            return None
        w = as_int(op, spec[1], "sliding window")
        if w < 1:
            raise InvalidArgumentError(op, f"sliding window must be >= 1 token, got {w}", w)
        return w

    def num_skipped_tokens(self, param: int, num_computed: int) -> int:
        return max(0, num_computed - param + 1)


#: The kinds by name.
KINDS: dict[str, KindSpec] = {k.name: k for k in (FullAttention(), SlidingWindow())}


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
        for kind in KINDS.values():
            param = kind.parse_param(op, spec)
            if param is not None:
                return cls(kind.name, param)
        raise InvalidArgumentError(op, f"unknown KV-cache group spec {spec!r} (\"full\" or (\"sliding_window\", tokens))")

    @property
    def spec(self) -> KindSpec:
        return KINDS[self.kind]

    def device_word(self) -> int:
        """The group's word in ``ManagerState.windows`` that ``kernels/groups.py`` reads."""
        return self.window

    def num_skipped_tokens(self, num_computed: int) -> int:
        """Tokens the group no longer needs: ``max(0, num_computed - window + 1)`` for a sliding
        window (vLLM's ``get_num_skipped_tokens``), 0 for full attention."""
        return self.spec.num_skipped_tokens(self.window, num_computed)

    def hit_length(self, cached: Sequence[bool]) -> int:
        """Leading blocks the group accepts as a cache hit (``KindSpec.hit_length``)."""
        return self.spec.hit_length(self.window, cached)

    def num_skipped_blocks(self, num_computed: int, block_size: int, num_blocks: int) -> int:
        """Blocks wholly outside the window, of a row of ``num_blocks``: the first
        ``min(num_skipped_tokens // block_size, num_blocks)`` (``kernels/groups.py`` has the twin)."""
        return min(self.num_skipped_tokens(num_computed) // block_size, num_blocks)
