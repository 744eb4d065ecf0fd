"""KV-cache group kinds (docs/semantics.md section 6): one spec per kind, chosen through a registry.

A manager's ``groups`` are given as ``"full"``, ``("sliding_window", tokens)`` or
``("chunked_local_attention", tokens)`` and become :class:`GroupKind` values, whose rules call their
kind's spec in :data:`KINDS` (vLLM's ``SingleTypeKVCacheManager`` subclasses, chosen through its spec
registry, ``vllm/v1/core/single_type_kv_cache_manager.py``). The reference manager calls the specs;
the device kernels call each kind's hooks in ``kernels/groups.py``, chosen by the group's
code (``KindSpec.code``, ``ManagerState.kinds``) with its parameter (``ManagerState.windows``). A new kind is
one :class:`KindSpec` subclass here, its code, and its branch in each device hook.

The rules (vLLM 0.33):

- skipped tokens (``get_num_skipped_tokens``): the leading tokens a group no longer needs; the blocks
  wholly inside them leave the group (freed tail first, the null block in their place:
  ``remove_skipped_blocks``). Full attention skips none; a sliding window of ``w`` tokens skips
  ``max(0, num_computed - w + 1)``; chunked local attention of chunk ``c`` skips the chunks before
  the current one, ``num_computed // c * c``.
- cache hits (``find_longest_cache_hit``, :func:`longest_cache_hit`): each kind's hit given a longest
  length, the kinds with a prefix rule first, each later one given the length the earlier ones
  accepted (vLLM's ``HybridKVCacheCoordinator``), until no kind shortens it. Full attention and
  sliding windows accept their leading cached blocks. vLLM's ``SlidingWindowManager`` scans right to
  left instead and needs only the last ``ceil((w - 1) / block_size)`` blocks before the hit's end;
  gpupool's rule is stricter: each block it reports is one vLLM's rule accepts too, so the difference
  is hits missed, never a wrong hit (docs/semantics.md section 6 says why it is kept). Chunked local
  attention is vLLM's rule exactly: given a length of ``n`` blocks, the blocks before the chunk that
  holds block ``n`` are hits without a lookup (the null block), then its cached blocks from that
  chunk's start.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .errors import InvalidArgumentError


class KindSpec:
    """The rules of one attention kind, one hook each; ``param`` is the group's parameter in tokens
    (0 where the kind has none)."""

    name: str
    #: The kind's code on the device (``ManagerState.kinds``): its member of ``kernels/layout.py``
    #: ``KindCode`` (tests/pool/test_groups.py checks they agree).
    code: int
    #: Whether the skip rule can release blocks (the device kernels skip the window passes of a
    #: manager whose groups all say no: ``ManagerConfig.SW``).
    releases_blocks: bool = False
    #: Whether the hit rule depends on the length the prefix kinds accepted (vLLM's hybrid coordinator
    #: asks such a kind after them); the device kernels run its pass only in a manager that has one
    #: (``ManagerConfig.CHUNKED``).
    windowed_hit: bool = False
    #: The spec's form, for messages.
    form: str

    def num_skipped_tokens(self, param: int, num_computed: int) -> int:
        """Leading tokens the group no longer needs (vLLM's ``get_num_skipped_tokens``)."""
        return 0

    def parse_param(self, op: str, spec) -> int | None:
        """The parameter of a group spec of this kind (``GroupKind.parse``), None for another kind's
        spec. Raises InvalidArgumentError / ArgumentTypeError for a bad parameter."""
        raise NotImplementedError

    def hit_length(self, param: int, cached: Sequence[bool], block_size: int) -> int:
        """vLLM's ``find_longest_cache_hit`` of one kind: ``cached[i]`` whether block i's key is
        cached for the group, for the ``len(cached)`` blocks the hit may reach; how many leading
        blocks the group accepts. This default: its leading cached blocks."""
        n = 0
        while n < len(cached) and cached[n]:
            n += 1
        return n

    def hit_start(self, param: int, length: int, block_size: int) -> int:
        """The first of ``length`` accepted blocks the group looks up; the ones before are hits on the
        null block. 0 for every kind but a windowed one."""
        return 0


class FullAttention(KindSpec):
    name = "full"
    code = 0
    form = '"full"'

    def parse_param(self, op: str, spec) -> int | None:
        return 0 if spec == "full" or spec == ("full",) or spec == ("full", 0) else None


class _Windowed(KindSpec):
    """A kind given as ``(name, tokens)`` with ``tokens >= 1``."""

    def parse_param(self, op: str, spec) -> int | None:
        from .args import as_int, check_tokens

        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] == self.name):
            return None
        w = as_int(op, spec[1], self.name)
        if w < 1:
            raise InvalidArgumentError(op, f"{self.name} must be >= 1 token, got {w}", w)
        check_tokens(op, w, self.name)
        return w


class SlidingWindow(_Windowed):
    """A window of ``param >= 1`` tokens."""

    name = "sliding_window"
    code = 1
    form = '("sliding_window", tokens)'
    releases_blocks = True

    def num_skipped_tokens(self, param: int, num_computed: int) -> int:
        return max(0, num_computed - param + 1)


class ChunkedLocalAttention(_Windowed):
    """vLLM's ``ChunkedLocalAttentionManager`` (Llama 4's local layers): attention within chunks of
    ``param >= 1`` tokens (``attention_chunk_size``), a multiple of the block size."""

    name = "chunked_local_attention"
    code = 2
    form = '("chunked_local_attention", tokens)'
    releases_blocks = True
    windowed_hit = True

    def num_skipped_tokens(self, param: int, num_computed: int) -> int:
        return num_computed // param * param

    def hit_start(self, param: int, length: int, block_size: int) -> int:
        return length * block_size // param * param // block_size

    def hit_length(self, param: int, cached: Sequence[bool], block_size: int) -> int:
        n = self.hit_start(param, len(cached), block_size)
        return n + super().hit_length(param, cached[n:], block_size)


#: The kinds by name (vLLM's spec registry).
KINDS: dict[str, KindSpec] = {k.name: k for k in (FullAttention(), SlidingWindow(), ChunkedLocalAttention())}


class GroupKind(NamedTuple):
    """One KV-cache group: ``kind``, a name in :data:`KINDS`, and ``window``, its parameter in tokens
    (the sliding window, the attention chunk; 0 for full attention)."""

    kind: str
    window: int

    @classmethod
    def parse(cls, op: str, spec) -> "GroupKind":
        """From ``"full"`` / ``("full",)`` / ``("sliding_window", tokens)`` /
        ``("chunked_local_attention", tokens)``. Raises InvalidArgumentError (unknown spec, a
        parameter below 1 token), ArgumentTypeError (a parameter that is not an int)."""
        for kind in KINDS.values():
            param = kind.parse_param(op, spec)
            if param is not None:
                return cls(kind.name, param)
        forms = ", ".join(k.form for k in KINDS.values())
        raise InvalidArgumentError(op, f"unknown KV-cache group spec {spec!r} ({forms})")

    @property
    def spec(self) -> KindSpec:
        return KINDS[self.kind]

    def num_skipped_tokens(self, num_computed: int) -> int:
        """Tokens the group no longer needs (``KindSpec.num_skipped_tokens``)."""
        return self.spec.num_skipped_tokens(self.window, num_computed)

    def hit_length(self, cached: Sequence[bool], block_size: int) -> int:
        """Leading blocks the group accepts as a cache hit (``KindSpec.hit_length``)."""
        return self.spec.hit_length(self.window, cached, block_size)

    def num_skipped_blocks(self, num_computed: int, block_size: int, num_blocks: int) -> int:
        """Blocks wholly inside the skipped tokens, of a row of ``num_blocks``: the first
        ``min(num_skipped_tokens // block_size, num_blocks)`` (``kernels/groups.py`` has the twin)."""
        return min(self.num_skipped_tokens(num_computed) // block_size, num_blocks)


def check_groups(op: str, groups: Sequence[GroupKind], block_size: int) -> None:
    """The combinations of kinds a manager takes: every attention chunk a multiple of ``block_size``
    and one chunk for all chunked-local groups (as Llama 4 has; vLLM's hybrid coordinator would
    otherwise need its fixed point over several windowed kinds, and the hit's start would fall
    inside a block). Raises InvalidArgumentError."""
    chunks = {g.window for g in groups if g.spec.windowed_hit}
    for c in sorted(chunks):
        if c % block_size:
            raise InvalidArgumentError(op, f"attention chunk {c} must be a multiple of block_size {block_size}", c)
    if len(chunks) > 1:
        raise InvalidArgumentError(op, f"chunked local attention groups must share one chunk, got {sorted(chunks)}")


def longest_cache_hit(groups: Sequence[GroupKind], cached: Sequence[Sequence[bool]], block_size: int) -> int:
    """The request's hit in blocks (vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``):
    ``cached[g][i]`` whether block i's key is cached for group g, for the ``len(cached[g])`` (all
    equal) blocks the hit may reach. The kinds with a prefix rule first, then the windowed ones, each
    given the length so far, until none shortens it."""
    order = sorted(range(len(groups)), key=lambda g: groups[g].spec.windowed_hit)
    n = min((len(c) for c in cached), default=0)
    while True:
        m = n
        for g in order:
            m = groups[g].hit_length(cached[g][:m], block_size)
        if m >= n:
            return n
        n = m
