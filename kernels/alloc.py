"""Allocation: ``get_new_blocks`` for many demands in one launch (SPEC.md section 2, batched forms).

Grid (1,): one program walks the demands, then the ring, in tiles. Demands in batch order are one
popleft of their sum, so the batch equals the sequence of single calls.
"""
import triton
import triton.language as tl

from .common import (
    E_BUFFER_FULL, E_INVALID_ARG, E_INVALID_COUNT, E_OUT_OF_BLOCKS, EV_COUNT, HEAD, NUM_FREE, REUSE_COUNT,
    checked_count, first_bad, set_status,
)
from .keytable import drop_keys
from .queue import ring_scan_pop

RW = tl.constexpr(3)  # reuse log row: (block, watcher id, watch seq)


@triton.jit
def claim_blocks(ref_cnt, qslot, num_keys, hash_ntok, keys, table, overflow, watcher_id, watch_seq, reuse, ev,
                 ctrl, out, base, total, op_tag,
                 MK: tl.constexpr, NCHUNK: tl.constexpr, CACHING: tl.constexpr, EVENTS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Hand out ``out[base:base+total]`` (already popped): evict their keys, ref_cnt = 1, log watchers."""
    offs = tl.arange(0, BLOCK)
    ev_pos = tl.load(ctrl + EV_COUNT)
    ru_pos = tl.load(ctrl + REUSE_COUNT)
    i = 0
    while i < total:
        m = (i + offs) < total
        b = tl.load(out + base + i + offs, mask=m, other=0)
        if CACHING:
            ev_pos += drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, b, m,
                                MK, NCHUNK, EVENTS, op_tag)
        tl.store(ref_cnt + b, tl.full([BLOCK], 1, tl.int32), mask=m)
        tl.store(qslot + b, tl.full([BLOCK], -1, tl.int32), mask=m)
        w = tl.load(watcher_id + b, mask=m, other=-1)
        hw = m & (w >= 0)
        r = ru_pos + tl.cumsum(hw.to(tl.int64), axis=0) - hw.to(tl.int64)
        tl.store(reuse + r * RW + 0, b.to(tl.int64), mask=hw)
        tl.store(reuse + r * RW + 1, w.to(tl.int64), mask=hw)
        tl.store(reuse + r * RW + 2, tl.load(watch_seq + b, mask=hw, other=0), mask=hw)
        tl.store(watcher_id + b, tl.full([BLOCK], -1, tl.int32), mask=hw)
        ru_pos += tl.sum(hw.to(tl.int64), axis=0)
        i += BLOCK
    tl.store(ctrl + EV_COUNT, ev_pos)
    tl.store(ctrl + REUSE_COUNT, ru_pos)


@triton.jit
def claim_needs(num_keys, watcher_id, out, base, total, BLOCK: tl.constexpr):
    """(keys to evict, watchers to fire) of ``out[base:base+total]``: sizes the event and reuse writes."""
    offs = tl.arange(0, BLOCK)
    nk_sum = total.to(tl.int64) * 0
    nw_sum = total.to(tl.int64) * 0
    i = 0
    while i < total:
        m = (i + offs) < total
        b = tl.load(out + base + i + offs, mask=m, other=0)
        nk_sum += tl.sum(tl.load(num_keys + b, mask=m, other=0).to(tl.int64), axis=0)
        nw_sum += tl.sum((m & (tl.load(watcher_id + b, mask=m, other=-1) >= 0)).to(tl.int64), axis=0)
        i += BLOCK
    return nk_sum, nw_sum


@triton.jit
def alloc_kernel(ctrl, status, ring, qslot, ref_cnt, num_keys, hash_ntok, keys, table, overflow,
                 watcher_id, watch_seq, reuse, ev,
                 demands, num_demands, cap, out_blocks, out_offsets, op_tag,
                 OP: tl.constexpr, C: tl.constexpr, MK: tl.constexpr, NCHUNK: tl.constexpr,
                 CACHING: tl.constexpr, EVENTS: tl.constexpr, EV_CAP: tl.constexpr, REUSE_CAP: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Batched ``get_new_blocks``.

    Reads the first ``num_demands[0]`` (at most ``cap``) of ``demands: int32[cap]`` (blocks per demand,
    in batch order; a count outside ``0..cap`` is E_INVALID_ARG). Writes
    ``out_offsets: int32[num_demands + 1]`` (demand k's blocks are ``out_blocks[off[k]:off[k+1]]``)
    and ``out_blocks: int32[N]``; on success also ring head, ``num_free``, ref counts, key rows and
    table (eviction of the taken blocks' keys), events and the reuse log. All or nothing: a negative
    demand, a sum above ``num_free`` or a full event / reuse buffer sets the status word instead.
    """
    if tl.load(status) == 0:
        offs = tl.arange(0, BLOCK)
        nd, nd_ok = checked_count(num_demands, cap)
        free = tl.load(ctrl + NUM_FREE)
        total = (nd * 0).to(tl.int64)
        err = tl.where(nd_ok, 0, E_INVALID_ARG)
        err_val = tl.where(nd_ok, 0, tl.load(num_demands)).to(tl.int64)
        tl.store(out_offsets, 0)
        i = 0
        while i < nd:
            # The batch is the sequence of single calls: its error is that of the first demand that
            # fails, a negative one (InvalidCount) or the first whose running sum exceeds num_free.
            idx = i + offs
            m = idx < nd
            d = tl.load(demands + idx, mask=m, other=0)
            cum = tl.cumsum(tl.maximum(d, 0).to(tl.int64), axis=0) + total
            anyn, ni, nv = first_bad(m & (d < 0), idx, d)
            anyo, oi, ov = first_bad(m & (cum > free), idx, cum)
            new_err = (err == 0) & (anyn | anyo)
            neg_first = ni < oi
            err = tl.where(new_err, tl.where(neg_first, E_INVALID_COUNT, E_OUT_OF_BLOCKS), err)
            err_val = tl.where(new_err, tl.where(neg_first, nv, ov), err_val)
            tl.store(out_offsets + 1 + idx, cum.to(tl.int32), mask=m)
            total += tl.sum(tl.maximum(d, 0).to(tl.int64), axis=0)
            i += BLOCK
        if err == 0:
            new_head = ring_scan_pop(ring, ctrl, out_blocks, 0, total, C, BLOCK)
            tl.debug_barrier()
            nk, nw = claim_needs(num_keys, watcher_id, out_blocks, 0, total, BLOCK)
            full = (tl.load(ctrl + REUSE_COUNT) + nw > REUSE_CAP)
            if EVENTS and CACHING:
                full = full | (tl.load(ctrl + EV_COUNT) + nk > EV_CAP)
            err = tl.where(full, E_BUFFER_FULL, err)
            err_val = tl.where(full, nk + nw, err_val)
            if err == 0:
                claim_blocks(ref_cnt, qslot, num_keys, hash_ntok, keys, table, overflow, watcher_id, watch_seq,
                             reuse, ev, ctrl, out_blocks, 0, total, op_tag, MK, NCHUNK, CACHING, EVENTS, BLOCK)
                tl.store(ctrl + HEAD, new_head)
                tl.store(ctrl + NUM_FREE, tl.load(ctrl + NUM_FREE) - total)
        if err != 0:
            set_status(status, err, OP, err_val)
