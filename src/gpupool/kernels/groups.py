"""Device twins of the KV-cache group rules of ``gpupool/groups.py`` (docs/semantics.md section 6):
the same formulas on tensors, for both request paths (``kernels/requests/exact.py``,
``kernels/requests/parallel.py``). tests/test_groups.py checks each twin equals its Python rule."""
import triton
import triton.language as tl


@triton.jit
def num_skipped_blocks(num_computed, window, BS: tl.constexpr, num_blocks):
    """``GroupKind.num_skipped_blocks``: ``min(max(0, num_computed - window + 1) // BS, num_blocks)``
    where ``window > 0`` (a sliding window, in tokens), else 0. Scalars or int32 tiles of one shape."""
    n = tl.minimum(tl.maximum(num_computed - window + 1, 0) // BS, num_blocks)
    return tl.where(window > 0, n, 0)
