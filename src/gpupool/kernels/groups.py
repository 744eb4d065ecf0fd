"""Device twins of the KV-cache group rules of ``gpupool/groups.py`` (docs/semantics.md section 6):
one hook per rule, the same formulas on tensors, for both request paths (``kernels/requests/exact.py``,
``kernels/requests/parallel.py``) and the lookups. A group reaches a kernel as its word in
``ManagerState.windows`` (``GroupKind.device_word``): the window in tokens for a sliding window, 0 for
full attention. Each hook is the one place that reads a kind from that word, so a new kind is one
branch per hook. tests/pool/test_groups.py checks each twin equals its Python rule."""
import triton
import triton.language as tl


@triton.jit
def group_word(windows, g):
    """Group g's word, ``windows[g]``; 0 (full attention) when ``windows`` is None (a lookup of the
    pool, which knows no kinds)."""
    if windows is None:
        w = tl.zeros([], tl.int32)
    else:
        w = tl.load(windows + g)
    return w


@triton.jit
def releases_blocks(word):
    """``KindSpec.releases_blocks``: whether the group's skip rule can release blocks (a sliding
    window)."""
    return word > 0


@triton.jit
def num_skipped_blocks(num_computed, window, BS: tl.constexpr, num_blocks):
    """``GroupKind.num_skipped_blocks``: ``min(max(0, num_computed - window + 1) // BS, num_blocks)``
    for a sliding window (``window``: the group's word, its window in tokens), else 0. Scalars or
    int32 tiles of one shape."""
    n = tl.minimum(tl.maximum(num_computed - window + 1, 0) // BS, num_blocks)
    return tl.where(releases_blocks(window), n, 0)


@triton.jit
def block_hit(word, blk):
    """``KindSpec.hit_length``'s test of one block: it counts toward the group's hit when it is cached
    (``blk >= 0``), for every kind so far."""
    return blk >= 0
