"""Request-level kernels of the KV cache manager: ``allocate_slots`` and ``free`` of many requests.

Grid (1,): one program walks the requests in order, so a batch equals the sequence of per-request
calls of ``ReferenceKVCacheManager`` by construction. Manager state (``gpupool/manager.py``):
``block_table: int32[G, R, M]``, ``num_blocks: int32[R]`` (row length, equal for all groups),
``num_computed: int32[R]``, ``num_cached: int32[G, R]``, request keys ``req_hi, req_lo:
int64[R, G, M * K]`` (device keys of each hash block's hash in group g; K hash blocks per block, full
block i keyed by hash ``(i + 1) * K - 1``), ``num_hashes: int32[R]`` (hash blocks known),
``windows: int32[G]`` (sliding window in tokens, 0 for full attention).
"""
import triton
import triton.language as tl

from .admit import free_segment, touch_counted
from .alloc import claim_blocks
from .common import (
    BIG, E_BUFFER_FULL, E_INVALID_ARG, E_INVALID_COUNT, EV_COUNT, EV_STORED, HEAD, KEY_SEQ,
    NUM_FREE, checked_count, first_bad, set_status,
)
from .events import write_event
from .keytable import K_GROUP, K_HI, K_LO, KW, drop_keys, put_key, table_lookup
from .queue import ring_scan_pop

OP_ALLOCATE_SLOTS = tl.constexpr(14)
OP_FREE_REQUESTS = tl.constexpr(15)


@triton.jit
def check_slots(slots, nb, s_req, active, R: tl.constexpr, BLOCK: tl.constexpr):
    """(error, value): a slot out of range, listed twice or not in use (``active: int8[R]``);
    ``s_req: int32[R]`` scratch left zeroed."""
    offs = tl.arange(0, BLOCK)
    err = nb * 0
    val = (nb * 0).to(tl.int64)
    i = 0
    while i < nb:
        m = (i + offs) < nb
        r = tl.load(slots + i + offs, mask=m, other=0)
        bad = m & ((r < 0) | (r >= R))
        anyb, _, v = first_bad(bad, i + offs, r)
        new = (err == 0) & anyb
        err = tl.where(new, E_INVALID_ARG, err)
        val = tl.where(new, v, val)
        tl.atomic_add(s_req + r, 1, mask=m & ~bad)
        i += BLOCK
    tl.debug_barrier()
    i = 0
    while i < nb:
        m = (i + offs) < nb
        r = tl.load(slots + i + offs, mask=m, other=0)
        ok = m & (r >= 0) & (r < R)
        anyb, _, v = first_bad(ok & ((tl.load(s_req + r, mask=ok, other=0) > 1) |
                                     (tl.load(active + r, mask=ok, other=1) == 0)), i + offs, r)
        new = (err == 0) & anyb
        err = tl.where(new, E_INVALID_ARG, err)
        val = tl.where(new, v, val)
        i += BLOCK
    tl.debug_barrier()
    i = 0
    while i < nb:
        m = (i + offs) < nb
        r = tl.load(slots + i + offs, mask=m, other=0)
        tl.store(s_req + r, tl.zeros([BLOCK], tl.int32), mask=m & (r >= 0) & (r < R))
        i += BLOCK
    return err, val


@triton.jit
def free_row_range(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, row, lo, hi, scratch,
                   C: tl.constexpr, CACHING: tl.constexpr, BLOCK: tl.constexpr):
    """``free_blocks(reversed(row[lo:hi]))`` (the tail first), through ``scratch: int32[M]``."""
    offs = tl.arange(0, BLOCK)
    n = hi - lo
    i = 0
    while i < n:
        m = (i + offs) < n
        tl.store(scratch + i + offs, tl.load(row + hi - 1 - i - offs, mask=m, other=0), mask=m)
        i += BLOCK
    tl.debug_barrier()
    free_segment(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, scratch, n, C, CACHING, BLOCK)


@triton.jit
def partial_key(ctrl, num_keys, hash_ntok, keys, table, overflow, ev, b, hi, lo, grp, ntok, tag, aux,
                MK: tl.constexpr, NCHUNK: tl.constexpr, EVENTS: tl.constexpr, EV_CAP: tl.constexpr,
                BLOCK: tl.constexpr):
    """``cache_partial_block`` of block ``b`` (non-null) under ``(hi, lo, grp)`` covering ``ntok``
    tokens, without replace_existing_hashes: nothing if the block already answers to the key; its keys
    are replaced if its primary covers fewer tokens; else a secondary key, only if the block has room
    (the manager skips a partial key that would not fit; the pool op would raise KeyCapacityError).
    Returns E_BUFFER_FULL instead of changing anything, or 0."""
    offs = tl.arange(0, BLOCK)
    lane0 = offs == 0
    nk = tl.load(num_keys + b)
    answers = nk * 0
    for j in tl.static_range(MK):
        e = b.to(tl.int64) * MK + j
        same = (j < nk) & (tl.load(keys + e * KW + K_HI) == hi) & (tl.load(keys + e * KW + K_LO) == lo) & \
            (tl.load(keys + e * KW + K_GROUP) == grp)
        answers = answers | same.to(tl.int32)
    err = nk * 0
    if answers == 0:
        drop_all = (nk > 0) & (tl.load(hash_ntok + b).to(tl.int64) < ntok)
        fits = drop_all | (nk < MK)
        if EVENTS:
            err = tl.where(fits & (tl.load(ctrl + EV_COUNT) + nk + 1 > EV_CAP), E_BUFFER_FULL, err)
        if fits & (err == 0):
            ev_pos = tl.load(ctrl + EV_COUNT)
            bv = tl.zeros([BLOCK], tl.int32) + b
            drop_lanes = lane0 & ((tl.zeros([BLOCK], tl.int32) + drop_all.to(tl.int32)) != 0)
            ev_pos += drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, bv, drop_lanes,
                                MK, NCHUNK, EVENTS, tag)
            tl.debug_barrier()
            j = tl.zeros([BLOCK], tl.int32) + nk * (1 - drop_all.to(tl.int32))
            hv = tl.zeros([BLOCK], tl.int64) + hi
            lv = tl.zeros([BLOCK], tl.int64) + lo
            gv = tl.zeros([BLOCK], tl.int64) + grp
            seq = tl.load(ctrl + KEY_SEQ)
            put_key(table, overflow, keys, hash_ntok, bv, j, hv, lv, gv, tl.zeros([BLOCK], tl.int64) + seq,
                    tl.zeros([BLOCK], tl.int64) + ntok, lane0, MK, NCHUNK, BLOCK)
            tl.store(num_keys + bv, j + 1, mask=lane0)
            if EVENTS:
                write_event(ev, tl.zeros([BLOCK], tl.int64) + ev_pos, EV_STORED, bv, hv, lv, gv, tag, lane0, aux)
                tl.store(ctrl + EV_COUNT, ev_pos + 1)
            tl.store(ctrl + KEY_SEQ, seq + 1)
            tl.debug_barrier()
    return err


@triton.jit
def allocate_slots_kernel(ctrl, status, ring, qslot, ref_cnt, num_keys, hash_ntok, keys, table, overflow,
                          watcher_id, watch_seq, reuse, ev, s_cnt, s_last, s_first,
                          block_table, num_blocks, num_computed, num_cached, req_hi, req_lo, num_hashes, windows,
                          active, s_req, scratch, slots, num_tokens, target, lookup, num_reqs, cap, admitted, bs, tag0,
                          G: tl.constexpr, R: tl.constexpr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                          C: tl.constexpr,
                          MK: tl.constexpr, NCHUNK: tl.constexpr, CACHING: tl.constexpr, EVENTS: tl.constexpr,
                          EV_CAP: tl.constexpr, STOP_ON_FAILURE: tl.constexpr, BLOCK: tl.constexpr):
    """``allocate_slots`` of ``num_reqs[0]`` requests in order (``ReferenceKVCacheManager.allocate_slots``).

    Inputs per request k < ``num_reqs[0]`` (at most ``cap``, the arrays' length): ``slots,
    num_tokens, target: int32``, ``lookup: int8``; output
    ``admitted: int32`` (1 admitted). Errors (a slot out of range or repeated, a token count outside
    ``0 .. M * bs``) set the status word before anything changes. Event tags: slot r's full blocks of
    group g carry ``tag0 + r * G + g`` with aux = the first block index of the caching range (the
    parent is the full hash before it), its partial key ``tag0 + (R + r) * G + g`` with aux = the
    hash-block index of the key.
    """
    offs = tl.arange(0, BLOCK)
    nb, nb_ok = checked_count(num_reqs, cap)
    if tl.load(status) == 0:
        err, err_val = check_slots(slots, nb, s_req, active, R, BLOCK)
        err_val = tl.where(nb_ok, err_val, tl.load(num_reqs).to(tl.int64))
        err = tl.where(nb_ok, err, E_INVALID_ARG)
        i = 0
        while i < nb:
            m = (i + offs) < nb
            nt = tl.load(num_tokens + i + offs, mask=m, other=0)
            tg = tl.load(target + i + offs, mask=m, other=0)
            bad = m & ((nt < 0) | (nt > M * bs) | (tg < 0) | (tg > M * bs))
            anyb, _, v = first_bad(bad, i + offs, tl.where((nt < 0) | (nt > M * bs), nt, tg))
            new = (err == 0) & anyb
            err = tl.where(new, E_INVALID_COUNT, err)
            err_val = tl.where(new, v, err_val)
            tl.store(admitted + i + offs, tl.zeros([BLOCK], tl.int32), mask=m)
            i += BLOCK
        if EVENTS:  # a batch pops (and keys) at most 2N blocks: 2N(MK + 1) events (gpupool/state.py)
            full = (err == 0) & (tl.load(ctrl + EV_COUNT) + 2 * N * (MK + 1) > EV_CAP)
            err = tl.where(full, E_BUFFER_FULL, err)
            err_val = tl.where(full, tl.load(ctrl + EV_COUNT), err_val)
        tl.debug_barrier()
        if err == 0:
            k = 0
            stop = 0
            while (k < nb) & (stop == 0) & (tl.load(status) == 0):
                r = tl.load(slots + k)
                nt = tl.load(num_tokens + k)
                tg = tl.load(target + k)
                ncomp = tl.load(num_computed + r)
                nblk = tl.load(num_blocks + r)
                # Sliding-window blocks that left the window: freed tail first, replaced by the null block.
                g = 0
                while g < G:
                    w = tl.load(windows + g)
                    row = block_table + (g * R + r).to(tl.int64) * M
                    if w > 0:
                        nskip = tl.minimum(tl.maximum(ncomp - w + 1, 0) // bs, nblk)
                        last_null = nskip * 0 - 1
                        t = 0
                        while t < nskip:
                            pos = t + offs
                            mm = pos < nskip
                            v = tl.load(row + pos, mask=mm, other=1)
                            last_null = tl.maximum(last_null, tl.max(tl.where(mm & (v == 0), pos, -1), axis=0))
                            t += BLOCK
                        free_row_range(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, row, last_null + 1,
                                       nskip, scratch, C, CACHING, BLOCK)
                        t = last_null + 1
                        while t < nskip:
                            pos = t + offs
                            tl.store(row + pos, tl.zeros([BLOCK], tl.int32), mask=pos < nskip)
                            t += BLOCK
                        tl.debug_barrier()
                    g += 1
                # Hits (new requests only): the longest prefix on which every group hits.
                hits = nt * 0
                zero_ref = nt * 0
                if CACHING:
                    if (tl.load(lookup + k) != 0) & (nblk == 0):
                        cap = tl.minimum(tl.maximum(nt - 1, 0) // bs, tl.load(num_hashes + r) // K)
                        miss = cap * 0
                        t = 0
                        while (t < cap) & (miss == 0):
                            pos = t + offs
                            inb = pos < cap
                            ok = inb
                            g = 0
                            while g < G:
                                kb = (r * G + g).to(tl.int64) * (M * K) + K - 1
                                hi = tl.load(req_hi + kb + pos * K, mask=inb, other=0)
                                lo = tl.load(req_lo + kb + pos * K, mask=inb, other=0)
                                gv = tl.zeros([BLOCK], tl.int32) + g
                                ent, _ = table_lookup(table, overflow, keys, hi, lo, gv, inb, NCHUNK, BLOCK)
                                tl.store(block_table + (g * R + r).to(tl.int64) * M + pos, (ent // MK).to(tl.int32),
                                         mask=inb & (ent >= 0))
                                ok = ok & (ent >= 0)
                                g += 1
                            first_miss = tl.min(tl.where(inb & ~ok, pos, BIG), axis=0)
                            hits += tl.sum((inb & (pos < first_miss)).to(tl.int32), axis=0)
                            miss = (first_miss < BIG).to(tl.int32)
                            t += BLOCK
                        tl.debug_barrier()
                        g = 0
                        while g < G:
                            row = block_table + (g * R + r).to(tl.int64) * M
                            t = 0
                            while t < hits:
                                pos = t + offs
                                mm = pos < hits
                                blk = tl.load(row + pos, mask=mm, other=0)
                                zero_ref += tl.sum((mm & (tl.load(ref_cnt + blk, mask=mm, other=1) == 0)).to(tl.int32),
                                                   axis=0)
                                t += BLOCK
                            g += 1
                eff = tl.maximum(tg, hits * bs)
                need = tl.maximum((eff + bs - 1) // bs - nblk - hits, 0)
                if (need * G + zero_ref).to(tl.int64) > tl.load(ctrl + NUM_FREE):
                    if STOP_ON_FAILURE:
                        stop = 1
                else:
                    # Touch every group's hits before any group allocates.
                    g = 0
                    while g < G:
                        touch_counted(ctrl, ring, qslot, ref_cnt, s_cnt, s_last, s_first,
                                      block_table + (g * R + r).to(tl.int64) * M, hits, N, BLOCK)
                        g += 1
                    # Then each group in order gets its new blocks (evicting their keys).
                    g = 0
                    while g < G:
                        row = block_table + (g * R + r).to(tl.int64) * M
                        new_head = ring_scan_pop(ring, ctrl, row, nblk + hits, need, C, BLOCK)
                        tl.debug_barrier()
                        claim_blocks(ref_cnt, qslot, num_keys, hash_ntok, keys, table, overflow, watcher_id,
                                     watch_seq, reuse, ev, ctrl, row, nblk + hits, need, tag0 + r * G + g,
                                     MK, NCHUNK, CACHING, EVENTS, BLOCK)
                        tl.store(ctrl + HEAD, new_head)
                        tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) - need)
                        tl.debug_barrier()
                        g += 1
                    # Cache the blocks that became full: cache_full_blocks(row, hashes, num_cached, nf).
                    if CACHING:
                        known = tl.minimum(eff, nt)
                        nhash = tl.load(num_hashes + r)
                        nf = tl.minimum(known // bs, nhash // K)
                        g = 0
                        while g < G:
                            row = block_table + (g * R + r).to(tl.int64) * M
                            nc_ptr = num_cached + g * R + r
                            start = tl.maximum(tl.load(nc_ptr), hits)
                            kb = (r * G + g).to(tl.int64) * (M * K)
                            t = start
                            while t < nf:
                                pos = t + offs
                                mm = pos < nf
                                blk = tl.load(row + pos, mask=mm, other=0)
                                act = mm & (blk != 0)
                                ev_pos = tl.load(ctrl + EV_COUNT)
                                n_rm = drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, blk, act,
                                                 MK, NCHUNK, EVENTS, tag0 + r * G + g)
                                tl.debug_barrier()
                                hi = tl.load(req_hi + kb + (pos + 1) * K - 1, mask=act, other=0)
                                lo = tl.load(req_lo + kb + (pos + 1) * K - 1, mask=act, other=0)
                                a64 = act.to(tl.int64)
                                rank = tl.cumsum(a64, axis=0) - a64
                                seq = tl.load(ctrl + KEY_SEQ)
                                gv = tl.zeros([BLOCK], tl.int64) + g
                                put_key(table, overflow, keys, hash_ntok, blk, 0, hi, lo, gv, seq + rank,
                                        (pos + 1).to(tl.int64) * bs, act, MK, NCHUNK, BLOCK)
                                tl.store(num_keys + blk, tl.full([BLOCK], 1, tl.int32), mask=act)
                                n_st = tl.sum(a64, axis=0)
                                if EVENTS:
                                    write_event(ev, ev_pos + n_rm + rank, EV_STORED, blk, hi, lo, gv, tag0 + r * G + g, act,
                                                start.to(tl.int64))
                                    tl.store(ctrl + EV_COUNT, ev_pos + n_rm + n_st)
                                tl.store(ctrl + KEY_SEQ, seq + n_st)
                                tl.debug_barrier()
                                t += BLOCK
                            tl.store(nc_ptr, tl.maximum(start, nf))
                            if K > 1:  # the block after them, written up to a hash-block boundary
                                nh = tl.minimum(known // (bs // K), nhash)
                                if (nh * (bs // K) > nf * bs) & (nf < nblk + hits + need):
                                    blk = tl.load(row + nf)
                                    if blk != 0:
                                        perr = partial_key(ctrl, num_keys, hash_ntok, keys, table, overflow, ev, blk,
                                                           tl.load(req_hi + kb + nh - 1), tl.load(req_lo + kb + nh - 1),
                                                           g, (nh * (bs // K)).to(tl.int64), tag0 + (R + r) * G + g,
                                                           (nh - 1).to(tl.int64), MK, NCHUNK, EVENTS, EV_CAP, BLOCK)
                                        if perr != 0:
                                            set_status(status, perr, OP_ALLOCATE_SLOTS, blk)
                            g += 1
                    else:
                        g = 0
                        while g < G:
                            tl.store(num_cached + g * R + r, tl.maximum(tl.load(num_cached + g * R + r), hits))
                            g += 1
                    tl.store(num_blocks + r, nblk + hits + need)
                    tl.store(num_computed + r, eff)
                    tl.store(admitted + k, 1)
                k += 1
        if err != 0:
            set_status(status, err, OP_ALLOCATE_SLOTS, err_val)


@triton.jit
def free_requests_kernel(ctrl, status, ring, qslot, ref_cnt, num_keys, s_cnt, s_last,
                         block_table, num_blocks, num_computed, num_cached, num_hashes, active, s_req, scratch,
                         slots, num_reqs, cap, G: tl.constexpr, R: tl.constexpr, M: tl.constexpr, C: tl.constexpr,
                         CACHING: tl.constexpr, BLOCK: tl.constexpr):
    """``free`` of ``num_reqs[0]`` requests in order: for each, every group's row freed tail first (one
    ``free_blocks`` per group), then the request's counts reset. A slot out of range or listed twice
    sets the status word before anything changes."""
    nb, nb_ok = checked_count(num_reqs, cap)
    if tl.load(status) == 0:
        err, err_val = check_slots(slots, nb, s_req, active, R, BLOCK)
        err_val = tl.where(nb_ok, err_val, tl.load(num_reqs).to(tl.int64))
        err = tl.where(nb_ok, err, E_INVALID_ARG)
        if err == 0:
            k = 0
            while k < nb:
                r = tl.load(slots + k)
                n = tl.load(num_blocks + r)
                g = 0
                while g < G:
                    row = block_table + (g * R + r).to(tl.int64) * M
                    free_row_range(ctrl, ring, qslot, ref_cnt, num_keys, s_cnt, s_last, row, n * 0, n, scratch,
                                   C, CACHING, BLOCK)
                    tl.store(num_cached + g * R + r, 0)
                    g += 1
                tl.store(num_blocks + r, 0)
                tl.store(num_computed + r, 0)
                tl.store(num_hashes + r, 0)
                tl.store(active + r, 0)
                k += 1
        else:
            set_status(status, err, OP_FREE_REQUESTS, err_val)
