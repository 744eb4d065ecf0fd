"""Batched admission with head-of-line blocking: one scheduler step of many events in one launch.

``admission_step_kernel`` replays a sequence of events at one time point exactly as the single ops
would (SPEC.md section 5; DESIGN-NOTES.md section 3, the sequential baseline): each event is either
the free of one finished request's blocks (a ``free_blocks`` segment) or the arrival of a request at
the back of the waiting line, and after every event the line is admitted in order until the first
request that does not fit. Admitting request r: longest cached prefix of its chain (capped), fit
check ``new + zero-ref hits <= num_free``, touch of the hits, popleft of ``new`` blocks (evicting
their keys), and keys for the newly full blocks.

Grid (1,): a single program walks events, requests and tiles in order, so the result is the
sequence of single ops by construction. Inputs are validated as a whole first (ids, and that the
frees never drive a ref count below zero, and room for the step's worst-case events), so an error
changes nothing.
"""
import triton
import triton.language as tl

from .alloc import claim_blocks
from .common import (
    BIG, E_BUFFER_FULL, E_DOUBLE_FREE, EV_COUNT, EV_STORED, HEAD, KEY_SEQ, NUM_FREE, TAIL,
    first_bad, set_status,
)
from .events import write_event
from .keytable import put_key, table_lookup
from .queue import ring_make_room, ring_put, ring_scan_pop, ring_unlink
from .release import check_ids, count_ids, reset_scratch

OP_ADMISSION_STEP = tl.constexpr(13)  # gpupool.pool.OPS
RES_WAITING = tl.constexpr(0)
RES_ADMITTED = tl.constexpr(1)
RES_REJECTED = tl.constexpr(2)


@triton.jit
def free_segment(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, ids, n,
                 C: tl.constexpr, CACHING: tl.constexpr, BLOCK: tl.constexpr):
    """One already-validated ``free_blocks(ids[:n])``: un-hashed releases prepended (first to reach 0
    at the head), hashed ones appended, in release order. Leaves s_cnt / s_last idle."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        m = m & (b != 0)
        tl.atomic_add(s_cnt + b, 1, mask=m)
        tl.atomic_max(s_last + b, i + offs, mask=m)
        i += BLOCK
    tl.debug_barrier()
    nf = n * 0
    nl = n * 0
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        b = tl.load(ids + idx, mask=m, other=0)
        m = m & (b != 0)
        rel = m & (tl.load(s_last + b, mask=m, other=-1) == idx) & \
            (tl.load(s_cnt + b, mask=m, other=0) == tl.load(ref_cnt + b, mask=m, other=0))
        if CACHING:
            is_f = rel & (tl.load(num_keys + b, mask=m, other=0) == 0)
        else:
            is_f = rel
        nf += tl.sum(is_f.to(tl.int32), axis=0)
        nl += tl.sum((rel & ~is_f).to(tl.int32), axis=0)
        i += BLOCK
    ring_make_room(ring, qslot, ctrl, nf + nl, C, BLOCK)
    head = tl.load(ctrl + HEAD)
    fpos = head - nf
    lpos = tl.load(ctrl + TAIL)
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
        if CACHING:
            is_f = rel & (tl.load(num_keys + b, mask=m, other=0) == 0)
        else:
            is_f = rel
        is_l = rel & ~is_f
        fi = is_f.to(tl.int64)
        li = is_l.to(tl.int64)
        ring_put(ring, qslot, fpos + tl.cumsum(fi, axis=0) - fi, b, is_f, C)
        ring_put(ring, qslot, lpos + tl.cumsum(li, axis=0) - li, b, is_l, C)
        fpos += tl.sum(fi, axis=0)
        lpos += tl.sum(li, axis=0)
        tl.store(ref_cnt + b, ref - cnt, mask=is_last)
        i += BLOCK
    tl.debug_barrier()
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        tl.store(s_cnt + b, tl.zeros([BLOCK], tl.int32), mask=m)
        tl.store(s_last + b, tl.full([BLOCK], -1, tl.int32), mask=m)
        i += BLOCK
    tl.store(ctrl + HEAD, head - nf)
    tl.store(ctrl + TAIL, lpos)
    tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) + nf + nl)
    tl.debug_barrier()


@triton.jit
def touch_counted(ctrl, ring, qslot, ref_cnt, s_cnt, s_last, s_first, ids, n, N: tl.constexpr,
                  BLOCK: tl.constexpr):
    """An already-validated ``touch(ids[:n])`` of non-null blocks: each distinct block unlinked from
    the ring if its ref count was 0, then raised by its occurrence count. Leaves the scratch idle."""
    offs = tl.arange(0, BLOCK)
    count_ids(ids, n, s_cnt, s_last, s_first, BLOCK)
    tl.debug_barrier()
    unlinked = n * 0
    t = 0
    while t < n:
        pos = t + offs
        m = pos < n
        blk = tl.load(ids + pos, mask=m, other=0)
        first = m & (tl.load(s_first + blk, mask=m, other=-1) == pos)
        ref = tl.load(ref_cnt + blk, mask=first, other=1)
        ring_unlink(ring, qslot, blk, first & (ref == 0))
        tl.store(ref_cnt + blk, ref + tl.load(s_cnt + blk, mask=first, other=0), mask=first)
        unlinked += tl.sum((first & (ref == 0)).to(tl.int32), axis=0)
        t += BLOCK
    tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) - unlinked)
    tl.debug_barrier()
    reset_scratch(ids, n, s_cnt, s_last, s_first, N, BLOCK)
    tl.debug_barrier()


@triton.jit
def admission_step_kernel(ctrl, status, ring, qslot, ref_cnt, num_keys, hash_ntok, keys, table, overflow,
                          watcher_id, watch_seq, reuse, ev, s_cnt, s_last, s_first,
                          chain_hi, chain_lo, chain_off, req_full, req_hitcap, req_total,
                          line, line_waiting, events, num_events, free_ids, free_off, num_free_ids,
                          res, res_hits, out_off, out_blocks, res_free, bs, grp, tag0,
                          N: tl.constexpr, C: tl.constexpr, MK: tl.constexpr, NCHUNK: tl.constexpr,
                          CACHING: tl.constexpr, EVENTS: tl.constexpr, EV_CAP: tl.constexpr,
                          BLOCK: tl.constexpr):
    """One time point of the replay model (SPEC.md section 5), as one op.

    Requests (index r): chain ``chain_hi/lo[chain_off[r] : chain_off[r] + req_full[r]]`` (int64 device
    keys of the full prompt blocks, group ``p[1]``), ``req_hitcap: int32`` (positions that may hit),
    ``req_total: int32`` (blocks needed). ``line: int32[L]`` lists request indices in line order: the
    first ``line_waiting[0]`` were waiting already, each arrival event reveals the next.
    ``events: int32[num_events[0]]``: ``j >= 0`` frees segment j of ``free_ids`` (``free_off: int32[S+1]``),
    ``-1`` is an arrival. Per line position k, writes ``res`` (0 waiting, 1 admitted, 2 rejected),
    ``res_hits``, ``res_free`` (free blocks right after it) and, when admitted, its blocks (hits then
    new) at ``out_blocks[out_off[k]:]``.
    Scalars: ``bs`` block size in tokens, ``grp`` the group, ``tag0`` the first op tag (events of
    request r carry ``tag0 + r``).
    """
    if tl.load(status) == 0:
        offs = tl.arange(0, BLOCK)
        nfi = tl.load(num_free_ids)
        # Validate all frees up front: admissions in between only add references to other blocks.
        err, err_val = check_ids(free_ids, nfi, N, False, BLOCK)
        if err == 0:
            count_ids(free_ids, nfi, s_cnt, s_last, s_first, BLOCK)
            tl.debug_barrier()
            bad_i = nfi * 0 + BIG
            i = 0
            while i < nfi:
                idx = i + offs
                m = idx < nfi
                b = tl.load(free_ids + idx, mask=m, other=0)
                m = m & (b != 0)
                anyb, bi, bv = first_bad(m & (tl.load(s_cnt + b, mask=m, other=0) >
                                              tl.load(ref_cnt + b, mask=m, other=0)), idx, b)
                err_val = tl.where(anyb & (bi < bad_i), bv, err_val)
                bad_i = tl.where(anyb & (bi < bad_i), bi, bad_i)
                i += BLOCK
            err = tl.where(bad_i < BIG, E_DOUBLE_FREE, 0)
            tl.debug_barrier()
        reset_scratch(free_ids, nfi, s_cnt, s_last, s_first, N, BLOCK)
        if EVENTS:  # a step pops (and keys) at most 2N blocks: 2N(MK + 1) events (gpupool/state.py)
            ev_full = (err == 0) & (tl.load(ctrl + EV_COUNT) + 2 * N * (MK + 1) > EV_CAP)
            err = tl.where(ev_full, E_BUFFER_FULL, err)
            err_val = tl.where(ev_full, tl.load(ctrl + EV_COUNT), err_val)
        tl.debug_barrier()
        if err == 0:
            ne = tl.load(num_events)
            visible = tl.load(line_waiting)
            lh = visible * 0  # line head: first request not yet admitted or rejected
            blocked = lh * 0
            e = 0
            while (e < ne) & (tl.load(status) == 0):
                ev_kind = tl.load(events + e)
                if ev_kind >= 0:
                    s0 = tl.load(free_off + ev_kind)
                    s1 = tl.load(free_off + ev_kind + 1)
                    free_segment(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, free_ids + s0, s1 - s0,
                                 C, CACHING, BLOCK)
                else:
                    visible += 1
                # Admission pass: in line order until the first request that does not fit.
                blocked = 0
                while (lh < visible) & (blocked == 0):
                    r = tl.load(line + lh)
                    total = tl.load(req_total + r)
                    if total > N - 1:
                        tl.store(res + lh, RES_REJECTED)
                        lh += 1
                    else:
                        base = tl.load(chain_off + r)
                        cap = tl.load(req_hitcap + r)
                        full = tl.load(req_full + r)
                        ob = tl.load(out_off + lh)
                        hits = cap * 0
                        zero_ref = cap * 0
                        t = 0
                        miss = cap * 0
                        while (t < cap) & (miss == 0):
                            pos = t + offs
                            inb = pos < cap
                            hi = tl.load(chain_hi + base + pos, mask=inb, other=0)
                            lo = tl.load(chain_lo + base + pos, mask=inb, other=0)
                            g = (tl.zeros([BLOCK], tl.int64) + grp).to(tl.int32)
                            ent, _ = table_lookup(table, overflow, keys, hi, lo, g, inb, NCHUNK, BLOCK)
                            first_miss = tl.min(tl.where(inb & (ent < 0), pos, BIG), axis=0)
                            run = inb & (pos < first_miss)
                            blk = (ent // MK).to(tl.int32)
                            tl.store(out_blocks + ob + pos, blk, mask=run)
                            zero_ref += tl.sum((run & (tl.load(ref_cnt + blk, mask=run, other=1) == 0)).to(tl.int32),
                                               axis=0)
                            hits += tl.sum(run.to(tl.int32), axis=0)
                            miss = (first_miss < BIG).to(tl.int32)
                            t += BLOCK
                        new = total - hits
                        if (new + zero_ref).to(tl.int64) > tl.load(ctrl + NUM_FREE):
                            blocked = 1
                        else:
                            tl.debug_barrier()
                            # touch(hits): per distinct block (a chain may repeat a hash, so a block).
                            touch_counted(ctrl, ring, qslot, ref_cnt, s_cnt, s_last, s_first, out_blocks + ob, hits,
                                          N, BLOCK)
                            new_head = ring_scan_pop(ring, ctrl, out_blocks, ob + hits, new, C, BLOCK)
                            tl.debug_barrier()
                            if tl.load(status) == 0:
                                claim_blocks(ref_cnt, qslot, num_keys, hash_ntok, keys, table, overflow, watcher_id,
                                             watch_seq, reuse, ev, ctrl, out_blocks, ob + hits, new, tag0 + r,
                                             MK, NCHUNK, CACHING, EVENTS, BLOCK)
                                tl.store(ctrl + HEAD, new_head)
                                tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) - new)
                                tl.debug_barrier()
                                # cache_full_blocks(blocks, chain, hits, full): fresh blocks, no conflicts.
                                if CACHING:
                                    seq = tl.load(ctrl + KEY_SEQ)
                                    ev_pos = tl.load(ctrl + EV_COUNT)
                                    t = hits
                                    while t < full:
                                        pos = t + offs
                                        m = pos < full
                                        blk = tl.load(out_blocks + ob + pos, mask=m, other=0)
                                        hi = tl.load(chain_hi + base + pos, mask=m, other=0)
                                        lo = tl.load(chain_lo + base + pos, mask=m, other=0)
                                        g64 = tl.zeros([BLOCK], tl.int64) + grp
                                        rank = (pos - hits).to(tl.int64)
                                        put_key(table, overflow, keys, hash_ntok, blk, 0, hi, lo, g64, seq + rank,
                                                (pos + 1).to(tl.int64) * bs, m, MK, NCHUNK, BLOCK)
                                        tl.store(num_keys + blk, tl.full([BLOCK], 1, tl.int32), mask=m)
                                        if EVENTS:
                                            write_event(ev, ev_pos + rank, EV_STORED, blk, hi, lo, g64, tag0 + r, m)
                                        tl.debug_barrier()
                                        t += BLOCK
                                    tl.store(ctrl + KEY_SEQ, seq + tl.maximum(full - hits, 0))
                                    if EVENTS:
                                        tl.store(ctrl + EV_COUNT, ev_pos + tl.maximum(full - hits, 0))
                                tl.store(res + lh, RES_ADMITTED)
                                tl.store(res_hits + lh, hits)
                                tl.store(res_free + lh, tl.load(ctrl + NUM_FREE))
                                lh += 1
                            else:
                                blocked = 1
                e += 1
        if err != 0:
            set_status(status, err, OP_ADMISSION_STEP, err_val)
