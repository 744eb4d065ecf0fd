"""The device event buffer ``ev: int64[EV_CAP, EVW]`` (row layouts: ``kernels/layout.py`` Event).

Kernels write rows at ``ctrl[EV_COUNT] + (index in op order)`` and store the new count once; the host
drains them (``BlockPool.take_events``) into vLLM's KV events. A batched op checks that its rows fit
before it commits anything (BufferFullError otherwise).
"""
import triton
import triton.language as tl

from .layout import EC_A, EC_B, EC_GROUP, EC_HI, EC_KIND, EC_LO, EV_REMOVED, EV_STORED, EV_STORED_ITEM, EVW


@triton.jit
def write_row(ev, idx, kind, a, hi, lo, grp, b, active):
    """Row ``idx`` of each active lane: ``(kind, a, hi, lo, grp, b)`` (columns ``layout.EventCol``)."""
    row = ev + idx.to(tl.int64) * EVW
    zero = tl.zeros_like(hi)
    tl.store(row + EC_KIND, zero + kind, mask=active)
    tl.store(row + EC_A, zero + a, mask=active)
    tl.store(row + EC_HI, hi, mask=active)
    tl.store(row + EC_LO, lo, mask=active)
    tl.store(row + EC_GROUP, zero + grp, mask=active)
    tl.store(row + EC_B, zero + b, mask=active)


@triton.jit
def write_removed(ev, idx, block, hi, lo, grp, active):
    write_row(ev, idx, EV_REMOVED, block, hi, lo, grp, 0, active)


@triton.jit
def write_stored_item(ev, idx, block, hi, lo, grp, active):
    write_row(ev, idx, EV_STORED_ITEM, block, hi, lo, grp, 0, active)


@triton.jit
def write_stored_header(ev, idx, has_parent, parent_hi, parent_lo, grp, block_size, active):
    """The header of one BlockStored; its items are the STORED_ITEM rows right after it."""
    write_row(ev, idx, EV_STORED, has_parent, parent_hi, parent_lo, grp, block_size, active)
