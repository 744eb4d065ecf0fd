"""``free`` of many requests as one batched free (docs/algorithms.md section 2)."""
import triton
import triton.language as tl

from ..common import checked_count, segment_ids, set_status, set_status_why, status_clear, warps_for
from ..layout import BIG, C_COUNT_PAST_ARRAYS, E_DOUBLE_FREE, HEAD, NUM_FREE, OP_FREE, TAIL
from ..queue import ring_make_room
from ..release import count_tile, release_place, release_scan, reset_ids
from .checks import check_slots, or_count_error


@triton.jit
def gather_rows(ps, ms, mc: tl.constexpr, slots, nb):
    """The ids of a ``free`` of requests ``slots[:nb]``, flattened into ``s_ids``: segment (k, g) is
    request k's group-g row reversed (``free_blocks`` of it), segments request-major; offsets in
    ``s_seg: int32[nb * G + 1]``, the segment of each id in ``s_map[0]``; each id counted as
    ``count_ids`` does, in the same pass. Returns the number of ids."""
    offs = tl.arange(0, mc.BLOCK)
    total = tl.zeros([], tl.int32)
    i = 0
    while i < nb:  # segment offsets: base_k + g * nblk_k
        idx = i + offs
        m = idx < nb
        r = tl.load(slots + idx, mask=m, other=0)
        n = tl.where(m, tl.load(ms.num_blocks + r, mask=m, other=0), 0)
        base = total + (tl.cumsum(n, axis=0) - n) * mc.G
        for g in tl.static_range(mc.G):
            tl.store(ms.s_seg + idx * mc.G + g, base + g * n, mask=m)
        total += tl.sum(n, axis=0) * mc.G
        i += mc.BLOCK
    tl.store(ms.s_seg + nb * mc.G, total)
    tl.debug_barrier()
    segment_ids(ms.s_seg, nseg=nb * mc.G, total=total, out=ms.s_map, BLOCK=mc.BLOCK)
    i = 0
    while i < total:
        idx = i + offs
        m = idx < total
        j = tl.load(ms.s_map + idx, mask=m, other=0)
        k = j // mc.G
        g = j % mc.G
        s1 = tl.load(ms.s_seg + j + 1, mask=m, other=0)
        r = tl.load(slots + k, mask=m, other=0)
        b = tl.load(ms.block_table + (g * mc.R + r).to(tl.int64) * mc.M + (s1 - 1 - idx), mask=m, other=0)
        tl.store(ms.s_ids + idx, b, mask=m)
        count_tile(ps, b, idx=idx, m=m & (b != 0))
        i += mc.BLOCK
    tl.debug_barrier()
    return total


@triton.jit
def free_requests_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num_reqs, cap):
    """Grid (1,): :func:`check_free_requests`, then :func:`free_requests_checked`."""
    nb, ok = check_free_requests(ps, ms, mc, slots, num_reqs, cap=cap)
    free_requests_checked(ps, pc, ms, mc, slots, num=nb, ok=ok)


@triton.jit
def check_free_requests(ps, ms, mc: tl.constexpr, slots, num_reqs, cap):
    """(requests, whether the free may go on) of a ``free`` of ``slots[:num_reqs[0]]``: a count
    outside ``0..cap`` or a slot out of range, listed twice or not in use sets the status word
    (op FREE) before anything changes; a status word already set gives False too."""
    nb, nb_ok = checked_count(num_reqs, cap)
    ok = status_clear(ps.status)
    if ok:
        err, err_val, why = check_slots(ms, mc, slots=slots, nb=nb)
        err, err_val, why, extra = or_count_error(err, err_val, why, 0, nb_ok, num_reqs, cap,
                                                  CAUSE=C_COUNT_PAST_ARRAYS)
        ok = err == 0
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_FREE, value=err_val, cause=why, extra=extra)
    return nb, ok


@triton.jit
def free_requests_checked(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num, ok):
    """``free`` of ``num`` already checked requests ``slots[:num]`` (:func:`check_free_requests`, or a
    decode step's ``check_step``) as ONE batched free (docs/algorithms.md section 2), nothing unless
    ``ok``: every group's row of each request, tail first (vLLM frees a request's blocks in reverse,
    so the queue evicts the least reusable end of a prefix first), segments in request order, then
    the requests' counts reset and their reservations released (docs/semantics.md section 8).
    Returns whether the status word is clear after the free (what a decode step's later ops would
    read): False when ``ok`` is, or on a double free (a corrupt state: E_DOUBLE_FREE)."""
    nb = num
    if ok:
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        num_free = tl.load(ps.ctrl + NUM_FREE)
        num_reserved = tl.load(ms.num_reserved)  # read before the barrier below, stored after it
        n = gather_rows(ps, ms, mc, slots=slots, nb=nb)
        nf, nl, dfree_i, dfree_v = release_scan(ps, pc, ms.s_ids, n=n, pf=ms.s_pf, code=ms.s_map + mc.MAPS,
                                                  TO_FRONT=True)
        ok = dfree_i == BIG
        tl.debug_barrier()
        if dfree_i == BIG:  # always, unless the state is corrupt
            tail = ring_make_room(ps, pc, head, tail, k=nf + nl)
            tail = release_place(ps, pc, ms.s_ids, n=n, pf=ms.s_pf, code=ms.s_map + mc.MAPS, seg_off=ms.s_seg,
                                 seg_of=ms.s_map, head=head, tail=tail, nf=nf, TO_FRONT=True, SEGMENTS=True)
            tl.store(ps.ctrl + HEAD, head - nf)
            tl.store(ps.ctrl + TAIL, tail)
            tl.store(ps.ctrl + NUM_FREE, num_free + nf + nl)
            offs = tl.arange(0, mc.BLOCK)
            unreserved = tl.zeros([], tl.int32)
            any_reserved = num_reserved > 0  # else no reservation to release (skip the pass)
            i = 0
            while i < nb:
                m = (i + offs) < nb
                r = tl.load(slots + i + offs, mask=m, other=0)
                zero = tl.zeros([mc.BLOCK], tl.int32)
                if any_reserved:
                    unreserved += tl.sum(tl.load(ms.reserved + r, mask=m, other=0), axis=0)
                    tl.store(ms.reserved + r, zero, mask=m)
                tl.store(ms.num_blocks + r, zero, mask=m)
                tl.store(ms.num_computed + r, zero, mask=m)
                tl.store(ms.num_hashes + r, zero, mask=m)
                tl.store(ms.active + r, zero.to(tl.int8), mask=m)
                tl.store(ms.hashing + r, zero.to(tl.int8), mask=m)
                for g in tl.static_range(mc.G):
                    tl.store(ms.num_cached + g * mc.R + r, zero, mask=m)
                i += mc.BLOCK
            if any_reserved:
                tl.store(ms.num_reserved, num_reserved - unreserved)
        else:
            set_status(ps.status, code=E_DOUBLE_FREE, op=OP_FREE, value=dfree_v)
        tl.debug_barrier()
        # strict: benign, a block listed twice gets the same idle values
        reset_ids(ps, ms.s_ids, n=n, N=pc.N, BLOCK=pc.BLOCK)
    return ok


def launch_free_requests(ps, pc, ms, mc, slots, num_reqs):
    """Launch ``free_requests_kernel`` (one program)."""
    free_requests_kernel[(1,)](ps, pc, ms, mc, slots, num_reqs, slots.numel(),
                               num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
