"""Device twins of the KV-cache group kinds of ``gpupool/groups.py`` (docs/semantics.md section 6):
one hook per rule, each kind's branch beside the others', for both request paths
(``kernels/requests/exact.py``, ``kernels/requests/parallel.py``) and the lookups. A group reaches a
kernel as its kind code in ``ManagerState.kinds`` (``KindSpec.code``) and its parameter in tokens in
``ManagerState.windows`` (the sliding window, the attention chunk; 0 for full attention). These hooks
are the only code that reads a kind, so a new kind is one branch per hook.
tests/pool/test_groups.py checks each twin equals its Python rule.

The hit rule is two scans (``lookup.find_longest_cache_hit``, ``parallel_scan.find_hits``): the
prefix scan over every group's keys ends at the first block on which :func:`block_hit` fails; then,
in a manager with a windowed kind (``ManagerConfig.CHUNKED``), :func:`windowed_hit` over the
positions the prefix scan accepted: the blocks that become the null block, and the first miss that
shortens the hit.
"""
import triton
import triton.language as tl

from .layout import KIND_CHUNKED_LOCAL, KIND_FULL, KIND_SLIDING_WINDOW


@triton.jit
def group_kind(gk, g):
    """Group g's kind code, ``gk.kinds[g]`` (``lookup.GroupKinds``); full attention when ``gk`` is None
    (a lookup of the pool, which knows no kinds)."""
    if gk is None:
        k = tl.full([], KIND_FULL, tl.int32)
    else:
        k = tl.load(gk.kinds + g)
    return k


@triton.jit
def releases_blocks(kind):
    """``KindSpec.releases_blocks``: whether the group's skip rule can release blocks."""
    return kind != KIND_FULL


@triton.jit
def windowed(kind):
    """``KindSpec.windowed_hit``: whether the group's hit needs :func:`windowed_hit`."""
    return kind == KIND_CHUNKED_LOCAL


@triton.jit
def num_skipped_blocks(num_computed, kind, param, BS: tl.constexpr, num_blocks):
    """``GroupKind.num_skipped_blocks``: ``min(skipped tokens // BS, num_blocks)``, the skipped tokens
    ``max(0, num_computed - param + 1)`` for a sliding window, ``num_computed // param * param`` for
    chunked local attention, 0 for full attention. Scalars or int32 tiles of one shape."""
    sw = tl.maximum(num_computed - param + 1, 0)
    cl = num_computed // tl.maximum(param, 1) * param
    skipped = tl.where(kind == KIND_SLIDING_WINDOW, sw, tl.where(kind == KIND_CHUNKED_LOCAL, cl, 0))
    return tl.minimum(skipped // BS, num_blocks)


@triton.jit
def block_hit(kind, blk, WINDOWED: tl.constexpr):
    """The prefix scan's test of one block (``blk``: the lookup, -1 for a miss): a cached block lets the
    scan go on; a windowed kind never ends it (:func:`windowed_hit` checks its blocks after).
    ``WINDOWED``: whether the manager has a windowed kind (``ManagerConfig.CHUNKED``; else ``kind``
    is not read)."""
    hit = blk >= 0
    if WINDOWED:
        hit = hit | windowed(tl.zeros_like(blk) + kind)  # a tile's mask (a scalar's | is not one)
    return hit


@triton.jit
def hit_start(kind, param, length, BS: tl.constexpr):
    """``KindSpec.hit_start``: the first of ``length`` accepted blocks the group looks up, for chunked
    local attention the start of the chunk that holds block ``length``; 0 for the other kinds."""
    return tl.where(kind == KIND_CHUNKED_LOCAL, length * BS // tl.maximum(param, 1) * param // BS, 0)


@triton.jit
def windowed_hit(kind, param, pos, blk, length, BS: tl.constexpr):
    """The windowed scan's test of positions ``pos`` (lookups ``blk``) of a hit of ``length`` blocks
    (vLLM's ``ChunkedLocalAttentionManager.find_longest_cache_hit``): (``null``: the group's block
    there is the null block; ``miss``: the position ends the hit). Tiles of one shape."""
    start = hit_start(kind, param, length, BS)
    inside = pos < length
    return inside & (pos < start), inside & (pos >= start) & (blk < 0)
