"""Release and re-acquire references: batched ``free_blocks``, ``unpin_blocks`` and ``touch``.

Grid (1,). Exact in op order without relying on lane order at one address: per-block counts with
``atomic_add``, last / first occurrence with ``atomic_max`` / ``atomic_min``, then prefix sums
(DESIGN-NOTES.md section 2). Scratch ``s_cnt`` (zeros), ``s_last`` (-1), ``s_first`` (BIG), all
``int32[N]``, and ``s_pf: int32[M + 1]`` are returned to their idle values before the kernel ends.
"""
import triton
import triton.language as tl

from .common import (
    BIG, E_DOUBLE_FREE, E_INVALID_ARG, E_INVALID_ID, E_NULL_BLOCK, HEAD, NUM_FREE, TAIL, WATCH_SEQ, checked_count,
    first_bad, set_status,
)
from .queue import ring_make_room, ring_put, ring_unlink

MODE_FREE = tl.constexpr(0)
MODE_UNPIN = tl.constexpr(1)


@triton.jit
def check_ids(ids, n, N: tl.constexpr, NULL_IS_ERROR: tl.constexpr, BLOCK: tl.constexpr):
    """(error code, offending id) over ``ids[:n]``: the first out-of-range id, else the first null id
    when NULL_IS_ERROR, else (0, 0)."""
    offs = tl.arange(0, BLOCK)
    bad_i = n * 0 + BIG
    bad_v = (n * 0).to(tl.int64)
    null_i = n * 0 + BIG
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        anyb, bi, bv = first_bad(m & ((b < 0) | (b >= N)), i + offs, b)
        bad_v = tl.where(anyb & (bi < bad_i), bv, bad_v)
        bad_i = tl.where(anyb & (bi < bad_i), bi, bad_i)
        anyn, ni, _ = first_bad(m & (b == 0), i + offs, b)
        null_i = tl.minimum(null_i, tl.where(anyn, ni, BIG))
        i += BLOCK
    code = tl.where(bad_i < BIG, E_INVALID_ID, 0)
    if NULL_IS_ERROR:
        code = tl.where((code == 0) & (null_i < BIG), E_NULL_BLOCK, code)
    return code, bad_v


@triton.jit
def count_ids(ids, n, s_cnt, s_last, s_first, BLOCK: tl.constexpr):
    """Per-block occurrence counts and last / first index of the non-null ids (order-free atomics)."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        m = m & (b != 0)
        tl.atomic_add(s_cnt + b, 1, mask=m)
        tl.atomic_max(s_last + b, i + offs, mask=m)
        tl.atomic_min(s_first + b, i + offs, mask=m)
        i += BLOCK


@triton.jit
def first_bad_id_index(ids, n, N: tl.constexpr, BLOCK: tl.constexpr):
    """Index of the first id of ``ids[:n]`` outside ``0 .. N-1`` (BIG when none)."""
    offs = tl.arange(0, BLOCK)
    bad_i = n * 0 + BIG
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        b = tl.load(ids + idx, mask=m, other=0)
        anyb, bi, _ = first_bad(m & ((b < 0) | (b >= N)), idx, b)
        bad_i = tl.minimum(bad_i, tl.where(anyb, bi, BIG))
        i += BLOCK
    return bad_i


@triton.jit
def first_over_ref(ids, n, s_cnt, ref_cnt, BLOCK: tl.constexpr):
    """(any, block) of the first non-null id of ``ids[:n]`` whose count in ``s_cnt`` exceeds its ref count."""
    offs = tl.arange(0, BLOCK)
    bad_i = n * 0 + BIG
    bad_v = (n * 0).to(tl.int64)
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        b = tl.load(ids + idx, mask=m, other=0)
        m = m & (b != 0)
        cnt = tl.load(s_cnt + b, mask=m, other=0)
        ref = tl.load(ref_cnt + b, mask=m, other=0)
        anyb, bi, bv = first_bad(m & (cnt > ref), idx, b)
        bad_v = tl.where(anyb & (bi < bad_i), bv, bad_v)
        bad_i = tl.where(anyb & (bi < bad_i), bi, bad_i)
        i += BLOCK
    return bad_i < BIG, bad_v


@triton.jit
def reset_scratch(ids, n, s_cnt, s_last, s_first, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        m = m & (b >= 0) & (b < N)
        tl.store(s_cnt + b, tl.zeros([BLOCK], tl.int32), mask=m)
        tl.store(s_last + b, tl.full([BLOCK], -1, tl.int32), mask=m)
        tl.store(s_first + b, tl.full([BLOCK], BIG, tl.int32), mask=m)
        i += BLOCK


@triton.jit
def release_kernel(ctrl, status, ring, qslot, ref_cnt, num_keys, watcher_id, watch_seq,
                   s_cnt, s_last, s_first, s_pf,
                   ids, num_ids, cap, seg, seg_off, nseg, cb_id,
                   OP: tl.constexpr, MODE: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
                   CACHING: tl.constexpr, BLOCK: tl.constexpr):
    """Batched ``free_blocks`` (MODE_FREE) or one ``unpin_blocks`` (MODE_UNPIN).

    Reads the first ``num_ids[0]`` (at most ``cap``) of ``ids: int32[cap]`` in op order, ``seg: int32``
    (each id's segment, i.e. which ``free_blocks`` call it belongs to) and ``seg_off: int32[nseg+1]``
    (segment j is ``[off[j], off[j+1])``, cut at num_ids[0]; the offsets must start at 0, never
    decrease and reach num_ids[0], else E_INVALID_ARG: fixed-capacity inputs may pad past the count),
    and for unpin ``cb_id: int32[1]`` (the watcher to register). Writes on success: ref counts, ring
    and qslot (un-hashed blocks that reach 0 are prepended, later segments ahead of earlier ones;
    hashed ones, and every unpinned one, appended), head / tail / num_free, watchers. Errors (a bad
    id, the null block in unpin, a decrement below 0) set the status word and change nothing.
    """
    n, n_ok = checked_count(num_ids, cap)
    offs = tl.arange(0, BLOCK)
    if tl.load(status) == 0:
        seg_ok = n_ok & (tl.load(seg_off) == 0) & (tl.load(seg_off + nseg) >= n)
        i = 0
        while i < nseg:
            j = i + offs
            m = j < nseg
            down = m & (tl.load(seg_off + j + 1, mask=m, other=0) < tl.load(seg_off + j, mask=m, other=0))
            seg_ok = seg_ok & (tl.sum(down.to(tl.int32), axis=0) == 0)
            i += BLOCK
        n = tl.where(seg_ok, n, 0)
        err, err_val = check_ids(ids, n, N, MODE == MODE_UNPIN, BLOCK)
        err_val = tl.where(seg_ok, err_val, tl.load(num_ids).to(tl.int64))
        err = tl.where(seg_ok, err, E_INVALID_ARG)
        if MODE == MODE_FREE:
            if (err != 0) & seg_ok:
                # The batch fails where the sequence of free_blocks calls would: at the segment of the
                # first bad id, unless a double free completes in an earlier segment.
                p_end = tl.minimum(tl.load(seg_off + tl.load(seg + first_bad_id_index(ids, n, N, BLOCK))), n)
                count_ids(ids, p_end, s_cnt, s_last, s_first, BLOCK)
                tl.debug_barrier()
                dfree, dval = first_over_ref(ids, p_end, s_cnt, ref_cnt, BLOCK)
                err = tl.where(dfree, E_DOUBLE_FREE, err)
                err_val = tl.where(dfree, dval, err_val)
                tl.debug_barrier()
        if err == 0:
            count_ids(ids, n, s_cnt, s_last, s_first, BLOCK)
            tl.debug_barrier()
            # Validate (first offending occurrence) and mark releases; s_pf[i] = F's before i.
            nf = n * 0
            nl = n * 0
            bad_i = n * 0 + BIG
            i = 0
            while i < n:
                idx = i + offs
                m = idx < n
                b = tl.load(ids + idx, mask=m, other=0)
                m = m & (b != 0)
                cnt = tl.load(s_cnt + b, mask=m, other=0)
                ref = tl.load(ref_cnt + b, mask=m, other=0)
                anyb, bi, bv = first_bad(m & (cnt > ref), idx, b)
                err_val = tl.where(anyb & (bi < bad_i), bv, err_val)
                bad_i = tl.where(anyb & (bi < bad_i), bi, bad_i)
                rel = m & (tl.load(s_last + b, mask=m, other=-1) == idx) & (cnt == ref)
                if MODE == MODE_FREE:
                    if CACHING:
                        is_f = rel & (tl.load(num_keys + b, mask=m, other=0) == 0)
                    else:
                        is_f = rel
                else:
                    is_f = rel & False
                fi = is_f.to(tl.int32)
                tl.store(s_pf + idx, nf + tl.cumsum(fi, axis=0) - fi, mask=idx < n)
                nf += tl.sum(fi, axis=0)
                nl += tl.sum((rel & ~is_f).to(tl.int32), axis=0)
                i += BLOCK
            tl.store(s_pf + n, nf)
            err = tl.where(bad_i < BIG, E_DOUBLE_FREE, 0)
            tl.debug_barrier()
            if err == 0:
                ring_make_room(ring, qslot, ctrl, nf + nl, C, BLOCK)
                head = tl.load(ctrl + HEAD)
                tail = tl.load(ctrl + TAIL)
                wseq = tl.load(ctrl + WATCH_SEQ)
                cb = tl.load(cb_id)
                lpos = tail
                i = 0
                while i < n:
                    idx = i + offs
                    m = idx < n
                    b = tl.load(ids + idx, mask=m, other=0)
                    m = m & (b != 0)
                    cnt = tl.load(s_cnt + b, mask=m, other=0)
                    ref = tl.load(ref_cnt + b, mask=m, other=0)
                    is_last = m & (tl.load(s_last + b, mask=m, other=-1) == idx)
                    rel = is_last & (cnt == ref)
                    pf_i = tl.load(s_pf + idx, mask=m, other=0)
                    if MODE == MODE_FREE:
                        sg = tl.load(seg + idx, mask=m, other=0)
                        # Segments are cut at num_ids (s_pf is written only up to n).
                        s_lo = tl.minimum(tl.load(seg_off + sg, mask=m, other=0), n)
                        s_hi = tl.minimum(tl.load(seg_off + sg + 1, mask=m, other=0), n)
                        pf_s = tl.load(s_pf + s_lo, mask=m, other=0)
                        pf_e = tl.load(s_pf + s_hi, mask=m, other=0)
                        is_f = rel & (tl.load(s_pf + idx + 1, mask=m, other=0) > pf_i)
                    else:
                        pf_s = pf_i
                        pf_e = pf_i
                        is_f = rel & False
                    is_l = rel & ~is_f
                    li = is_l.to(tl.int64)
                    ring_put(ring, qslot, head - pf_e + (pf_i - pf_s), b, is_f, C)
                    ring_put(ring, qslot, lpos + tl.cumsum(li, axis=0) - li, b, is_l, C)
                    lpos += tl.sum(li, axis=0)
                    tl.store(ref_cnt + b, ref - cnt, mask=is_last)
                    if MODE == MODE_UNPIN:
                        is_first = m & (tl.load(s_first + b, mask=m, other=-1) == idx)
                        new_w = is_first & (tl.load(watcher_id + b, mask=m, other=0) < 0)
                        nw = new_w.to(tl.int64)
                        tl.store(watch_seq + b, wseq + tl.cumsum(nw, axis=0) - nw, mask=new_w)
                        wseq += tl.sum(nw, axis=0)
                        tl.store(watcher_id + b, tl.zeros([BLOCK], tl.int32) + cb, mask=is_first)
                    i += BLOCK
                tl.store(ctrl + HEAD, head - nf)
                tl.store(ctrl + TAIL, lpos)
                tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) + nf + nl)
                tl.store(ctrl + WATCH_SEQ, wseq)
            tl.debug_barrier()
        reset_scratch(ids, n, s_cnt, s_last, s_first, N, BLOCK)
        if err != 0:
            set_status(status, err, OP, err_val)


@triton.jit
def touch_kernel(ctrl, status, ring, qslot, ref_cnt, s_cnt, s_last, s_first, ids, num_ids, cap,
                 OP: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """``touch``: for each distinct non-null block, unlink it from the ring if its ref_cnt is 0, then
    add its occurrence count. Reads the first ``num_ids[0]`` of ``ids: int32[cap]``; an out-of-range id
    or count sets the status word and changes nothing. Unlinking leaves tombstones, so the other
    blocks keep their order."""
    n, n_ok = checked_count(num_ids, cap)
    offs = tl.arange(0, BLOCK)
    if tl.load(status) == 0:
        err, err_val = check_ids(ids, n, N, False, BLOCK)
        err_val = tl.where(n_ok, err_val, tl.load(num_ids).to(tl.int64))
        err = tl.where(n_ok, err, E_INVALID_ARG)
        if err == 0:
            count_ids(ids, n, s_cnt, s_last, s_first, BLOCK)
            tl.debug_barrier()
            unlinked = n * 0
            i = 0
            while i < n:
                idx = i + offs
                m = idx < n
                b = tl.load(ids + idx, mask=m, other=0)
                first = m & (b != 0) & (tl.load(s_first + b, mask=m & (b != 0), other=-1) == idx)
                ref = tl.load(ref_cnt + b, mask=first, other=1)
                ring_unlink(ring, qslot, b, first & (ref == 0))
                tl.store(ref_cnt + b, ref + tl.load(s_cnt + b, mask=first, other=0), mask=first)
                unlinked += tl.sum((first & (ref == 0)).to(tl.int32), axis=0)
                i += BLOCK
            tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) - unlinked)
            tl.debug_barrier()
        reset_scratch(ids, n, s_cnt, s_last, s_first, N, BLOCK)
        if err != 0:
            set_status(status, err, OP, err_val)
