"""The trace replay's device kernels (docs/semantics.md section 5): one time point of frees and
arrivals with head-of-line admission in one launch.

``admission_step_kernel`` replays a sequence of events at one time point exactly as the single ops
would: each event is either the free of one finished request's blocks (a ``free_blocks`` call) or
the arrival of a request at the back of the waiting line, and after every event the line is admitted
in order until the first request that does not fit. Admitting request r: longest cached prefix of its
chain (capped), fit check ``new + zero-ref hits <= num_free``, touch of the hits, popleft of ``new``
blocks (evicting their keys), keys for the newly full blocks.

One program walks events, requests and tiles in order, so the result is the sequence of single ops
by construction. Inputs are validated as a whole first (ids, counts, offsets, that the frees never
drive a ref count below zero, room for the events), so an error changes nothing.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .alloc import pop_and_claim
from .cache import cache_range
from .common import checked_count, keep_first, set_status, status_clear, warps_for
from .layout import BIG, E_BUFFER_FULL, E_DOUBLE_FREE, E_INVALID_ARG, EV_COUNT, HEAD, KEY_SEQ, NUM_FREE, OP_REPLAY, TAIL
from .lookup import find_longest_cache_hit
from .release import check_ids, count_ids, first_double_free, free_checked, reset_ids, touch_checked

RES_WAITING = tl.constexpr(0)
RES_ADMITTED = tl.constexpr(1)
RES_REJECTED = tl.constexpr(2)


class TraceTensors(NamedTuple):
    """Every request of a trace once, by arrival index r: ``chain_hi, chain_lo: int64[K]`` device keys
    of all full prompt blocks, ``chain_off: int64[R]`` where request r's chain starts, ``full, hitcap,
    total: int32[R]`` (full blocks, positions that may hit, blocks needed)."""

    chain_hi: torch.Tensor
    chain_lo: torch.Tensor
    chain_off: torch.Tensor
    full: torch.Tensor
    hitcap: torch.Tensor
    total: torch.Tensor


class StepInputs(NamedTuple):
    """One time point: ``line: int32[L]`` request indices in line order, the first ``line_waiting[0]``
    waiting already; ``events: int32[E]`` (``j >= 0`` frees segment j of ``free_ids``, bounds in
    ``free_off: int32[S + 1]``; -1 reveals the next arrival), counts ``num_events, num_free_ids:
    int32[1]``; ``out_off: int64[L]`` where line position k's blocks go in ``blocks``."""

    line: torch.Tensor
    line_waiting: torch.Tensor
    events: torch.Tensor
    num_events: torch.Tensor
    free_ids: torch.Tensor
    free_off: torch.Tensor
    num_free_ids: torch.Tensor
    out_off: torch.Tensor


class StepOutputs(NamedTuple):
    """Per line position: ``result: int32[L]`` (0 waiting, 1 admitted, 2 rejected), ``hits: int32[L]``,
    ``free_after: int64[L]`` (free blocks right after it); ``blocks: int32[cap]`` (hits then new);
    ``pf: int32[F + 1]`` scratch of the frees."""

    result: torch.Tensor
    hits: torch.Tensor
    free_after: torch.Tensor
    blocks: torch.Tensor
    pf: torch.Tensor


@triton.jit
def admission_step_kernel(ps, pc: tl.constexpr, tr, step, out, sizes, group_ids, bs):
    """One time point of the replay model (module docstring). ``sizes: int64[5]`` = (requests R, line
    capacity L, event capacity E, free-id capacity F, segment count S); ``group_ids: int32[1]`` the
    group, ``bs`` the block size in tokens. Bad counts, offsets, request indices or line positions set
    E_INVALID_ARG."""
    if status_clear(ps.status):
        offs = tl.arange(0, pc.BLOCK)
        num_req = tl.load(sizes + 0)
        line_cap = tl.load(sizes + 1)
        ne, ne_ok = checked_count(step.num_events, tl.load(sizes + 2))
        nfi, nfi_ok = checked_count(step.num_free_ids, tl.load(sizes + 3))
        nseg = tl.load(sizes + 4)
        visible = tl.load(step.line_waiting)
        err = tl.where(ne_ok & nfi_ok & (visible >= 0) & (visible <= line_cap), 0, E_INVALID_ARG)
        err_val = tl.zeros([], tl.int64)
        err_i = tl.full([], BIG, tl.int32)
        # events: segment indices in range, segments inside the free ids, arrivals within the line
        arrivals = tl.zeros([], tl.int32)
        i = 0
        while i < ne:
            idx = i + offs
            m = idx < ne
            e = tl.load(step.events + idx, mask=m, other=-1)
            s0 = tl.load(step.free_off + e, mask=m & (e >= 0) & (e < nseg), other=0)
            s1 = tl.load(step.free_off + e + 1, mask=m & (e >= 0) & (e < nseg), other=0)
            bad = m & ((e < -1) | (e >= nseg) | ((e >= 0) & ((s0 < 0) | (s1 < s0) | (s1 > nfi))))
            err, err_val, err_i = keep_first(err, err_val, err_i, E_INVALID_ARG, bad, idx, e)
            arrivals += tl.sum((m & (e == -1)).to(tl.int32), axis=0)
            i += pc.BLOCK
        err = tl.where((err == 0) & (visible + arrivals > line_cap), E_INVALID_ARG, err)
        # line entries: request indices in range; the rows their admissions may write
        rows = tl.zeros([], tl.int64)
        i = 0
        while i < visible + arrivals:
            idx = i + offs
            m = idx < tl.minimum(visible + arrivals, line_cap)
            r = tl.load(step.line + idx, mask=m, other=0)
            bad = m & ((r < 0) | (r >= num_req))
            err, err_val, err_i = keep_first(err, err_val, err_i, E_INVALID_ARG, bad, idx, r)
            ok = m & ~bad
            rows += tl.sum(tl.where(ok, tl.load(tr.total + r, mask=ok, other=0).to(tl.int64) * pc.MK
                                    + tl.load(tr.full + r, mask=ok, other=0) + 1, 0), axis=0)
            i += pc.BLOCK
        if err == 0:
            err, err_val, _ = check_ids(step.free_ids, nfi, pc.N, False, pc.BLOCK)
        if err == 0:
            count_ids(ps, step.free_ids, nfi, pc.BLOCK)
            tl.debug_barrier()
            dfree_i, dfree_v = first_double_free(ps, step.free_ids, nfi, pc.BLOCK)
            err = tl.where(dfree_i < BIG, E_DOUBLE_FREE, err)
            err_val = tl.where(dfree_i < BIG, dfree_v, err_val)
            tl.debug_barrier()
            reset_ids(ps, step.free_ids, nfi, pc.N, pc.BLOCK)
            tl.debug_barrier()
        if pc.EVENTS:  # each admission evicts at most MK keys per new block, stores a header and its items
            ev_full = (err == 0) & (tl.load(ps.ctrl + EV_COUNT) + rows > pc.EV_CAP)
            err = tl.where(ev_full, E_BUFFER_FULL, err)
            err_val = tl.where(ev_full, rows, err_val)
        if err == 0:
            head = tl.load(ps.ctrl + HEAD)
            tail = tl.load(ps.ctrl + TAIL)
            num_free = tl.load(ps.ctrl + NUM_FREE)
            lh = tl.zeros([], tl.int32)  # line head: first request not yet admitted or rejected
            e = 0
            while e < ne:
                ev_kind = tl.load(step.events + e)
                if ev_kind >= 0:
                    s0 = tl.load(step.free_off + ev_kind)
                    s1 = tl.load(step.free_off + ev_kind + 1)
                    head, tail, released = free_checked(ps, pc, step.free_ids + s0, s1 - s0, out.pf, head, tail)
                    num_free += released
                else:
                    visible += 1
                # Admission pass: in line order until the first request that does not fit.
                blocked = tl.zeros([], tl.int32)
                while (lh < visible) & (blocked == 0):
                    r = tl.load(step.line + lh)
                    total = tl.load(tr.total + r)
                    if total > pc.N - 1:
                        tl.store(out.result + lh, RES_REJECTED)
                        lh += 1
                    else:
                        base = tl.load(tr.chain_off + r)
                        full = tl.load(tr.full + r)
                        ob = tl.load(step.out_off + lh)
                        hits, zero_ref = find_longest_cache_hit(ps, pc, tr.chain_hi + base, tr.chain_lo + base, 0, 1,
                                                                group_ids, 1, tl.load(tr.hitcap + r),
                                                                out.blocks + ob, 0, pc.BLOCK)
                        new = total - hits
                        if (new + zero_ref).to(tl.int64) > num_free:
                            blocked = 1
                        else:
                            num_free -= touch_checked(ps, pc, out.blocks + ob, hits)
                            head = pop_and_claim(ps, pc, head, tail, out.blocks, ob + hits, new)
                            num_free -= new
                            if pc.CACHING:
                                pk = base + hits - 1
                                ev_pos, seq = cache_range(
                                    ps, pc, out.blocks + ob, out.blocks, hits, full, tr.chain_hi, tr.chain_lo, base, 1,
                                    tl.load(group_ids), bs, (hits > 0).to(tl.int64),
                                    tl.load(tr.chain_hi + pk, mask=hits > 0, other=0),
                                    tl.load(tr.chain_lo + pk, mask=hits > 0, other=0), False)
                                tl.store(ps.ctrl + KEY_SEQ, seq)
                                tl.store(ps.ctrl + EV_COUNT, ev_pos)
                            tl.store(out.result + lh, RES_ADMITTED)
                            tl.store(out.hits + lh, hits)
                            tl.store(out.free_after + lh, num_free)
                            lh += 1
                e += 1
            tl.store(ps.ctrl + HEAD, head)
            tl.store(ps.ctrl + TAIL, tail)
            tl.store(ps.ctrl + NUM_FREE, num_free)
        else:
            set_status(ps.status, err, OP_REPLAY, err_val)


def launch_admission_step(ps, pc, tr: TraceTensors, step: StepInputs, out: StepOutputs, sizes, group_ids,
                          block_size: int):
    """Launch ``admission_step_kernel`` (one program)."""
    admission_step_kernel[(1,)](ps, pc, tr, step, out, sizes, group_ids, block_size, num_warps=warps_for(pc.BLOCK))
