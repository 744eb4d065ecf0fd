"""Reservations of the KV cache manager (docs/semantics.md section 8): ``reserve`` books blocks for
requests' next tokens as a count held against the pool's free blocks, nothing taken off the free
queue; ``release_reservation`` gives the unused part back. One program each, lanes over requests
(tiles of ``mc.BLOCK``), positions in the batch from prefix sums (no loop over requests).

Manager state ``ms`` (``gpupool/manager.py`` ManagerState): ``reserved: int32[R]`` per slot,
``num_reserved: int32[1]`` their sum; the admission paths (``kernels/requests/exact.py``,
``kernels/requests/parallel.py``) read them and draw an admitted request's blocks from its own
reservation first, and ``free_requests_checked`` releases the freed requests' reservations.
"""
import triton
import triton.language as tl

from ..common import checked_count, keep_first_why, set_status_why, status_clear, warps_for
from ..layout import (
    BIG, C_COUNT_PAST_ARRAYS, C_TOKEN_COUNT, E_INVALID_COUNT, NUM_FREE, OP_RELEASE_RESERVATION, OP_RESERVE,
)
from .checks import check_slots, or_count_error


@triton.jit
def request_tile(ms, mc: tl.constexpr, slots, num_tokens, k, m):
    """Lanes ``k`` (mask ``m``) of a reserve batch: slot, token count, in-range mask, ``num_computed``."""
    r = tl.load(slots + k, mask=m, other=0)
    n = tl.load(num_tokens + k, mask=m, other=0)
    okr = m & (r >= 0) & (r < mc.R)
    return r, n, okr, tl.load(ms.num_computed + r, mask=okr, other=0)


@triton.jit
def reserve_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num_tokens, num_reqs, cap, ok_out):
    """``reserve`` of requests ``slots[:num_reqs]`` (``int32[cap]``; ``num_reqs`` None: all ``cap``) for ``num_tokens: int32[cap]``
    more tokens each: ``need = G * max(0, ceil((num_computed + n) / BS) - num_blocks)``, the request's
    reservation grows by ``max(0, need - reserved)``; request k is booked iff the growths of requests
    ``0..k`` fit ``NUM_FREE - num_reserved`` (growths are >= 0, so the booked requests are a prefix:
    the first that does not fit stops the batch). ``ok_out: int32[cap]``: 1 where booked. A count
    outside ``0..cap``, a slot out of range, listed twice or not in use, or ``n < 0`` /
    ``num_computed + n > M * BS`` set the status word (op RESERVE) and change nothing."""
    offs = tl.arange(0, mc.BLOCK)
    i = 0
    while i < cap:
        tl.store(ok_out + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
        i += mc.BLOCK
    nb, nb_ok = checked_count(num_reqs, cap)
    if status_clear(ps.status):
        err, val, why = check_slots(ms, mc, slots=slots, nb=nb)
        extra = tl.zeros([], tl.int64)
        err_i = tl.full([], BIG, tl.int32)
        i = 0
        while i < nb:
            k = i + offs
            m = k < nb
            r, n, okr, nc = request_tile(ms, mc, slots=slots, num_tokens=num_tokens, k=k, m=m)
            bad = okr & ((n < 0) | (nc.to(tl.int64) + n > mc.M * mc.BS))  # int64: nc + n can pass int32
            if err == 0:  # the message names the slot: its room is M * BS - num_computed
                err, val, why, extra, err_i = keep_first_why(err, val, why, extra, err_i, new_err=E_INVALID_COUNT,
                                                             bad=bad, idx=k, val=n, cause=C_TOKEN_COUNT, ext=r)
            i += mc.BLOCK
        err, val, why, extra = or_count_error(err, val, why, extra, nb_ok, num_reqs, cap, CAUSE=C_COUNT_PAST_ARRAYS)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_RESERVE, value=val, cause=why, extra=extra)
        else:
            total = tl.load(ms.num_reserved)
            room = tl.load(ps.ctrl + NUM_FREE) - total.to(tl.int64)
            carry = tl.zeros([], tl.int64)
            added = tl.zeros([], tl.int32)
            i = 0
            while i < nb:
                k = i + offs
                m = k < nb
                # slots checked: in range
                r, n, _, nc = request_tile(ms, mc, slots=slots, num_tokens=num_tokens, k=k, m=m)
                nblk = tl.load(ms.num_blocks + r, mask=m, other=0)
                v = tl.load(ms.reserved + r, mask=m, other=0)
                need = mc.G * tl.maximum((nc + n + mc.BS - 1) // mc.BS - nblk, 0)
                grow = tl.where(m, tl.maximum(need - v, 0), 0)
                ok = m & (carry + tl.cumsum(grow.to(tl.int64), axis=0) <= room)
                tl.store(ms.reserved + r, v + grow, mask=ok)
                tl.store(ok_out + k, ok.to(tl.int32), mask=m)
                added += tl.sum(tl.where(ok, grow, 0), axis=0)
                carry += tl.sum(grow.to(tl.int64), axis=0)
                i += mc.BLOCK
            tl.debug_barrier()  # strict: orders every thread's read of num_reserved (room) before this store
            tl.store(ms.num_reserved, total + added)


@triton.jit
def release_reservation_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num_reqs, cap):
    """``release_reservation`` of ``slots[:num_reqs]``: each reservation back to 0, the total less
    their sum. A count outside ``0..cap`` or a slot out of range, listed twice or not in use sets
    the status word (op RELEASE_RESERVATION) and changes nothing."""
    offs = tl.arange(0, mc.BLOCK)
    nb, nb_ok = checked_count(num_reqs, cap)
    if status_clear(ps.status):
        err, val, why = check_slots(ms, mc, slots=slots, nb=nb)
        err, val, why, extra = or_count_error(err, val, why, 0, nb_ok, num_reqs, cap, CAUSE=C_COUNT_PAST_ARRAYS)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_RELEASE_RESERVATION, value=val, cause=why, extra=extra)
        else:
            released = tl.zeros([], tl.int32)
            i = 0
            while i < nb:
                k = i + offs
                m = k < nb
                r = tl.load(slots + k, mask=m, other=0)
                released += tl.sum(tl.load(ms.reserved + r, mask=m, other=0), axis=0)
                tl.store(ms.reserved + r, tl.zeros([mc.BLOCK], tl.int32), mask=m)
                i += mc.BLOCK
            # strict: benign, one statement; only thread 0 uses the value it loads (its store)
            tl.store(ms.num_reserved, tl.load(ms.num_reserved) - released)


def launch_reserve(ps, pc, ms, mc, slots, num_tokens, num_reqs, ok_out):
    """Launch ``reserve_kernel`` (one program)."""
    reserve_kernel[(1,)](ps, pc, ms, mc, slots, num_tokens, num_reqs, slots.numel(), ok_out,
                         num_warps=warps_for(mc.BLOCK))


def launch_release_reservation(ps, pc, ms, mc, slots, num_reqs):
    """Launch ``release_reservation_kernel`` (one program)."""
    release_reservation_kernel[(1,)](ps, pc, ms, mc, slots, num_reqs, slots.numel(), num_warps=warps_for(mc.BLOCK))
