"""Allocation: handing out blocks from the free queue's head (``get_new_blocks``), alone or for many
demands in one launch (docs/semantics.md section 2, batched forms).

Demands in batch order are one popleft of their sum, so the batch equals the sequence of single
calls. ``claim_blocks`` is the one place that hands a popped block out: its keys are evicted
(BlockRemoved rows), its ref count becomes 1, and a watched block goes to the reuse log.
"""
import triton
import triton.language as tl

from .common import batch_config, checked_count, first_bad, raw_count, set_status, status_clear, warps_for
from .keytable import drop_keys
from .layout import (
    E_BUFFER_FULL, E_INVALID_ARG, E_INVALID_COUNT, E_OUT_OF_BLOCKS, EV_COUNT, HEAD, NO_SLOT, NUM_FREE, REUSE_COUNT,
    TAIL,
)
from .queue import ring_scan_pop


@triton.jit
def claim_needs(ps, pc: tl.constexpr, out, base, total):
    """Keys that handing out ``out[base:base+total]`` evicts: the event rows it writes."""
    offs = tl.arange(0, pc.BLOCK)
    nk_sum = tl.zeros([], tl.int64)
    i = 0
    while i < total:
        m = (i + offs) < total
        b = tl.load(out + base + i + offs, mask=m, other=0)
        nk_sum += tl.sum(tl.load(ps.num_keys + b, mask=m, other=0).to(tl.int64), axis=0)
        i += pc.BLOCK
    return nk_sum


@triton.jit
def claim_tile(ps, pc: tl.constexpr, b, m, ev_pos, reuse_pos):
    """Hand out one tile of popped blocks ``b`` (lanes ``m``): evict their keys (BlockRemoved rows from
    ``ev_pos``, a scalar or one base per lane), ref_cnt = 1, not queued, watched blocks logged in lane
    order from ``reuse_pos``. Returns (keys evicted, new reuse_pos)."""
    dropped = tl.zeros([], tl.int64)
    if pc.CACHING:
        dropped = drop_keys(ps, pc, b, m, ev_pos)
    tl.store(ps.ref_cnt + b, tl.full(b.shape, 1, tl.int32), mask=m)
    tl.store(ps.qslot + b, tl.full(b.shape, NO_SLOT, tl.int32), mask=m)
    w = m & (tl.load(ps.watched + b, mask=m, other=0) != 0)
    wi = w.to(tl.int64)
    tl.store(ps.reuse + reuse_pos + tl.cumsum(wi, axis=0) - wi, b, mask=w)
    tl.store(ps.watched + b, tl.zeros(b.shape, tl.int8), mask=w)
    return dropped, reuse_pos + tl.sum(wi, axis=0)


@triton.jit
def claim_blocks(ps, pc: tl.constexpr, out, base, total, ev_pos, reuse_pos):
    """Hand out ``out[base:base+total]`` (already popped) with ``claim_tile``. Returns the new (ev_pos,
    reuse_pos); the caller stores them."""
    offs = tl.arange(0, pc.BLOCK)
    i = 0
    while i < total:
        m = (i + offs) < total
        b = tl.load(out + base + i + offs, mask=m, other=0)
        dropped, reuse_pos = claim_tile(ps, pc, b, m, ev_pos, reuse_pos)
        ev_pos += dropped
        i += pc.BLOCK
    return ev_pos, reuse_pos


@triton.jit
def pop_and_claim(ps, pc: tl.constexpr, head, tail, out, base, total):
    """Pop ``total`` blocks from ``head`` into ``out[base:]`` and hand them out, event and reuse
    positions read from and written back to ``ctrl``. The caller has checked ``total <= num_free``
    and the event room; it stores the returned head and lowers num_free."""
    new_head = ring_scan_pop(ps, pc, head, tail, out, base, total)
    tl.debug_barrier()
    # strict: benign, stored by thread 0 after claim_blocks' cumsum (bar.sync if the tile spans warps, else dead)
    ev_pos, reuse_pos = claim_blocks(ps, pc, out, base, total, tl.load(ps.ctrl + EV_COUNT),
                                     # strict: benign, as EV_COUNT above
                                     tl.load(ps.ctrl + REUSE_COUNT))
    tl.store(ps.ctrl + EV_COUNT, ev_pos)
    tl.store(ps.ctrl + REUSE_COUNT, reuse_pos)
    tl.debug_barrier()
    return new_head


@triton.jit
def demand_sum(num_demands, cap, demands, BLOCK: tl.constexpr):
    """Sum of the non-negative demands among the first ``num_demands[0]`` (0 for a bad count)."""
    offs = tl.arange(0, BLOCK)
    nd, _ = checked_count(num_demands, cap)
    total = tl.zeros([], tl.int64)
    i = 0
    while i < nd:
        d = tl.load(demands + i + offs, mask=(i + offs) < nd, other=0)
        total += tl.sum(tl.maximum(d, 0).to(tl.int64), axis=0)
        i += BLOCK
    return total


@triton.jit
def fill_minus_one(out, lo, hi, start, FILL: tl.constexpr):
    """``out[i] = -1`` for ``i`` in ``[start, start + FILL)`` and in ``[lo, hi)``."""
    idx = start + tl.arange(0, FILL)
    # strict: benign, programs >= 1 fill -1; program 0 writes -1 there too whenever they overlap
    tl.store(out + idx, tl.full([FILL], -1, tl.int32), mask=(idx >= lo) & (idx < hi))


@triton.jit
def fill_head_minus_one(out, n, BLOCK: tl.constexpr):
    """``out[:n] = -1`` (the blocks of a failed or skipped pop), one tile after another."""
    i = 0
    while i < n:
        fill_minus_one(out, 0, n, i, BLOCK)
        i += BLOCK


@triton.jit
def alloc_kernel(ps, pc: tl.constexpr, demands, num_demands, cap, out_blocks, out_offsets, OP: tl.constexpr,
                 FILL: tl.constexpr):
    """Batched ``get_new_blocks``.

    Reads the first ``num_demands[0]`` (at most ``cap``; else E_INVALID_ARG) of ``demands: int32[cap]``
    (blocks per demand, in batch order). Program 0 writes ``out_offsets: int32[num_demands + 1]``
    (demand k's blocks are ``out_blocks[off[k]:off[k+1]]``) and the blocks; on success also the ring
    head, num_free, ref counts, evicted keys, events and the reuse log. All or nothing: a negative
    demand (E_INVALID_COUNT), a running sum above num_free (E_OUT_OF_BLOCKS, the first demand that
    fails, as the sequence of calls) or events that would not fit (E_BUFFER_FULL) set the status word
    instead; then (or when an earlier error is pending and the op is skipped) every entry of
    ``out_offsets: int32[cap + 1]`` is 0. With ``FILL > 0`` every entry of ``out_blocks: int32[N + 1]`` past the last offset is -1
    (all of it when the op does nothing): programs 1.. fill ``FILL`` entries each past the demands'
    sum, in parallel with program 0, which fills the rest itself when the op fails.
    """
    pid = tl.program_id(0)
    if pid > 0:
        if FILL > 0:
            used = tl.where(status_clear(ps.status), demand_sum(num_demands, cap, demands, 1024), 0)
            fill_minus_one(out_blocks, used, pc.N + 1, (pid - 1).to(tl.int64) * FILL, FILL)
    elif status_clear(ps.status):
        err, total = alloc_batch(ps, pc, demands, num_demands, cap, out_blocks, out_offsets, OP)
        if err != 0:
            if FILL > 0:  # the other programs filled from the demands' sum on
                fill_head_minus_one(out_blocks, tl.minimum(total, pc.N + 1), pc.BLOCK)
            tl.debug_barrier()  # strict: after alloc_batch's stores of the running sums, from other threads
            zero_offsets(out_offsets, cap, pc.BLOCK)
    else:  # skipped (an earlier error is pending): no demand got a block
        zero_offsets(out_offsets, cap, pc.BLOCK)


@triton.jit
def zero_offsets(out_offsets, cap, BLOCK: tl.constexpr):
    """``out_offsets[0 : cap + 1] = 0``: the offsets of an op that failed or was skipped (every demand
    got ``blocks[0:0]``, nothing)."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < cap + 1:
        tl.store(out_offsets + i + offs, tl.zeros([BLOCK], tl.int32), mask=(i + offs) < cap + 1)
        i += BLOCK


@triton.jit
def alloc_batch(ps, pc: tl.constexpr, demands, num_demands, cap, out_blocks, out_offsets, OP: tl.constexpr):
    """Program 0's part of ``alloc_kernel`` (its docstring), the status word clear: the offsets, the
    pops and their claims, or the error in the status word. Returns (error code, demands' sum)."""
    offs = tl.arange(0, pc.BLOCK)
    nd, nd_ok = checked_count(num_demands, cap)
    free = tl.load(ps.ctrl + NUM_FREE)
    total = tl.zeros([], tl.int64)
    err = tl.where(nd_ok, 0, E_INVALID_ARG)
    err_val = tl.where(nd_ok, 0, raw_count(num_demands, cap)).to(tl.int64)
    tl.store(out_offsets, 0)
    i = 0
    while i < nd:
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
        i += pc.BLOCK
    if err == 0:
        head = tl.load(ps.ctrl + HEAD)
        new_head = ring_scan_pop(ps, pc, head, tl.load(ps.ctrl + TAIL), out_blocks, 0, total)
        tl.debug_barrier()
        if pc.EVENTS and pc.CACHING:
            nk = claim_needs(ps, pc, out_blocks, 0, total)
            full = tl.load(ps.ctrl + EV_COUNT) + nk > pc.EV_CAP
            err = tl.where(full, E_BUFFER_FULL, err)
            err_val = tl.where(full, nk, err_val)
        if err == 0:
            ev_pos, reuse_pos = claim_blocks(ps, pc, out_blocks, 0, total, tl.load(ps.ctrl + EV_COUNT),
                                             tl.load(ps.ctrl + REUSE_COUNT))
            tl.debug_barrier()  # strict: orders the reads of EV_COUNT / REUSE_COUNT above before these stores
            tl.store(ps.ctrl + EV_COUNT, ev_pos)
            tl.store(ps.ctrl + REUSE_COUNT, reuse_pos)
            tl.store(ps.ctrl + HEAD, new_head)
            tl.store(ps.ctrl + NUM_FREE, free - total)
    if err != 0:
        set_status(ps.status, err, OP, err_val)
    return err, total


FILL_PER_PROGRAM = 1024


def launch_alloc(ps, pc, demands, num_demands, *, op: int, max_total: int | None = None, fill_tail: bool = True):
    """Launch ``alloc_kernel``: one program, plus ``ceil((N + 1) / FILL_PER_PROGRAM)`` that fill the
    unused tail of ``blocks`` with -1 when ``fill_tail`` (off for callers that slice it).
    ``demands: int32[B]``, ``num_demands: int32[1]``. ``max_total``: an upper bound of the demands'
    sum when the host knows it (sizes the tiles). Returns ``(blocks: int32[N + 1], offsets: int32[B + 1])``."""
    import torch

    offsets = torch.empty(demands.numel() + 1, dtype=torch.int32, device=demands.device)
    out = torch.empty(pc.N + 1, dtype=torch.int32, device=demands.device)
    fill = FILL_PER_PROGRAM if fill_tail else 0
    grid = 1 + (triton.cdiv(pc.N + 1, fill) if fill else 0)
    pc = batch_config(pc, pc.N if max_total is None else max_total)  # tiles as wide as the blocks it may pop
    alloc_kernel[(grid,)](ps, pc, demands, num_demands, demands.numel(), out, offsets, OP=op, FILL=fill,
                          num_warps=warps_for(pc.BLOCK))
    return out, offsets
