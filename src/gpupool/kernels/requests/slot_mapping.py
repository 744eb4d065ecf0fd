"""``slot_mapping``: the KV slot of each (request, position)."""
import triton
import triton.language as tl

from ..common import checked_count, keep_first_why, no_error_why, set_status_why, warps_for
from ..layout import C_COUNT_PAST_ARRAYS, C_POSITION_OUTSIDE_ROW, E_INVALID_ARG, OP_SLOT_MAPPING
from .checks import or_count_error, slot_cause


@triton.jit
def slot_mapping_kernel(ps, ms, mc: tl.constexpr, slots, positions, num, cap, out, group, offset, admitted,
                        HAS_ADMITTED: tl.constexpr):
    """Grid (1,): :func:`slot_mapping`."""
    slot_mapping(ps, ms, mc, slots, positions, num, cap=cap, out=out, group=group, offset=offset, admitted=admitted,
                 HAS_ADMITTED=HAS_ADMITTED)


@triton.jit
def slot_of(ms, mc: tl.constexpr, group, r, p, ok):
    """``block_table[group, r, p // BS] * BS + p % BS`` (int64 lanes) where ``ok``, else -1."""
    blk = tl.load(ms.block_table + (group * mc.R + r).to(tl.int64) * mc.M + p // mc.BS, mask=ok, other=0)
    return tl.where(ok, blk.to(tl.int64) * mc.BS + p % mc.BS, -1)


@triton.jit
def slot_mapping(ps, ms, mc: tl.constexpr, slots, positions, num, cap, out, group, offset, admitted,
                 HAS_ADMITTED: tl.constexpr):
    """``out[t] = block_table[group, slots[t], p // BS] * BS + p % BS`` with ``p = positions[t] + offset``
    for ``t < num[0]`` (at most ``cap``): each slot in use and each position inside its row; else -1
    there and E_INVALID_ARG in the status word (the first bad entry: its slot, or its position with
    the slot as the second value). With ``HAS_ADMITTED``, entries whose ``admitted[t]`` is 0 give -1
    and are no error. Entries ``num[0] .. cap - 1`` are -1 (all of ``out[:cap]`` for a count outside
    ``0..cap``)."""
    n, n_ok = checked_count(num, cap)
    err, err_val, why, extra, err_i = no_error_why()
    err, err_val, why, extra = or_count_error(err, err_val, why, extra, n_ok, num, cap, CAUSE=C_COUNT_PAST_ARRAYS)
    offs = tl.arange(0, mc.BLOCK)
    i = 0
    while i < cap:  # to cap: entries past the count are -1 too (all of them for a count past the arrays)
        idx = i + offs
        inb = idx < n
        m = inb
        if HAS_ADMITTED:
            m = m & (tl.load(admitted + idx, mask=inb, other=0) != 0)
        r = tl.load(slots + idx, mask=inb, other=0)  # not masked by ``admitted``: one wait, not two
        p = tl.load(positions + idx, mask=inb, other=0).to(tl.int64) + offset
        okr = m & (r >= 0) & (r < mc.R)
        idle = okr & (tl.load(ms.active + r, mask=okr, other=0) == 0)
        okr = okr & ~idle
        nblk = tl.load(ms.num_blocks + r, mask=okr, other=0)
        ok = okr & (p >= 0) & (p < nblk.to(tl.int64) * mc.BS)
        tl.store(out + idx, slot_of(ms, mc, group=group, r=r, p=p, ok=ok), mask=idx < cap)
        err, err_val, why, extra, err_i = keep_first_why(
            err, err_val, why, extra, err_i, new_err=E_INVALID_ARG, bad=m & ~ok, idx=idx, val=tl.where(okr, p, r),
            cause=tl.where(okr, C_POSITION_OUTSIDE_ROW, slot_cause(mc, r, idle)), ext=r)
        i += mc.BLOCK
    if err != 0:
        set_status_why(ps.status, code=err, op=OP_SLOT_MAPPING, value=err_val, cause=why, extra=extra)


def launch_slot_mapping(ps, ms, mc, slots, positions, num, out, group: int, offset: int, admitted):
    slot_mapping_kernel[(1,)](ps, ms, mc, slots, positions, num, slots.numel(), out, group, offset,
                              slots if admitted is None else admitted, HAS_ADMITTED=admitted is not None,
                              num_warps=warps_for(mc.BLOCK))
