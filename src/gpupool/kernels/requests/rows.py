"""Addressing of the manager state: a slot's block-table row and its request keys."""
import triton
import triton.language as tl



@triton.jit
def row_of(ms, mc: tl.constexpr, g, r):
    """Block table row of group g, slot r."""
    return ms.block_table + (g * mc.R + r).to(tl.int64) * mc.M


@triton.jit
def keys_of(mc: tl.constexpr, g, r):
    """Offset of slot r's keys of group g in ``req_hi / req_lo``."""
    return (r * mc.G + g).to(tl.int64) * (mc.M * mc.K)
