"""The trace replay's event loop on the device (docs/semantics.md section 5; docs/algorithms.md section 7).

``replay_loop_kernel`` is one program that runs the replay model itself, event by event, for up to
``max_points`` time points per launch, so the host only launches and, now and then, reads the
progress words. Its state lives in device tensors between launches (:class:`LoopState`):

* arrivals come from the sorted trace, uploaded once (:class:`TraceTensors`); the waiting line is
  always the contiguous range ``[line_head, next_arrival)`` of arrival indices, because admission is
  head-of-line and in arrival order (an admitted or rejected request is always the line's head);
* running requests wait in a D-ary min-heap keyed by (finish time, arrival index), which is the
  model's (finish time, admission order): requests are admitted in arrival order. A D-ary heap
  (D = 32 children per node, read as one vector) keeps sift-down to about log_32(running) dependent
  loads;
* each event is applied exactly as the model's single ops would (a completion frees the request's
  blocks tail first, then an admission pass, which runs vLLM's admission steps of
  ``kernels/requests/steps.py`` on the request's one row; an arrival joins the line, then an
  admission pass unless the line was already blocked). Finish times are ``now + dur[r]`` with
  ``dur`` computed on the host as the model computes it (``output_length * tpot_ms`` in float64), so
  one IEEE addition gives the same times and ties;
* the report's counters accumulate in ``words``.

The kernel trusts its trace tensors: ``gpupool.replay.device`` builds them from a checked trace.
"""
from enum import IntEnum
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import status_clear, warps_for
from .layout import BIG, HEAD, NUM_FREE, TAIL, constexprs
from .release import free_checked
from .requests.steps import (admit, allocate_blocks, cache_full_blocks, find_longest_cache_hit,
                             get_num_blocks_to_allocate)


class LoopWord(IntEnum):
    """Slots of ``LoopState.words: int64[NUM_LOOP_WORDS]``: the loop's position, then the report's
    counters (slots COUNTERS.., one vector in the kernel)."""

    NUM_REQUESTS = 0  # R, set by the host
    NEXT_ARRIVAL = 1  # arrivals [0, NEXT_ARRIVAL) have joined the line
    LINE_HEAD = 2  # arrivals [0, LINE_HEAD) have been admitted or rejected
    RUNNING = 3  # entries in the heap
    DONE = 4  # 1 when no event is left
    TIME_POINTS = 5  # distinct event times processed
    ADMITTED = 8
    REJECTED = 9
    PROMPT_BLOCKS = 10
    HIT_BLOCKS = 11
    WAITED = 12
    PEAK_IN_USE = 13
    COMPLETED = 14


NUM_LOOP_WORDS = 16
COUNTERS = tl.constexpr(8)  # words[COUNTERS:COUNTERS + NUM_COUNTERS] are the counters
NUM_COUNTERS = tl.constexpr(8)
(W_NUM_REQUESTS, W_NEXT_ARRIVAL, W_LINE_HEAD, W_RUNNING, W_DONE, W_TIME_POINTS, W_ADMITTED, W_REJECTED,
 W_PROMPT_BLOCKS, W_HIT_BLOCKS, W_WAITED, W_PEAK_IN_USE, W_COMPLETED) = constexprs(LoopWord)

HEAP_D = tl.constexpr(32)  # children per heap node
INF = tl.constexpr(float("inf"))


class TraceTensors(NamedTuple):
    """Every request of a trace once, by arrival index r (sorted by timestamp, ties in trace order):
    ``ts, dur: float64[R]`` arrival time and ``output_length * tpot_ms`` (ms); ``chain_hi, chain_lo:
    int64[K]`` device keys of all full prompt blocks, ``chain_off: int64[R]`` where request r's chain
    starts; ``full, hitcap, total: int32[R]`` (full blocks, positions that may hit, blocks needed);
    ``blk_off: int64[R]`` where r's blocks go in ``LoopState.blocks``."""

    ts: torch.Tensor
    dur: torch.Tensor
    chain_hi: torch.Tensor
    chain_lo: torch.Tensor
    chain_off: torch.Tensor
    full: torch.Tensor
    hitcap: torch.Tensor
    total: torch.Tensor
    blk_off: torch.Tensor


class LoopState(NamedTuple):
    """The loop's device state between launches: ``words: int64[NUM_LOOP_WORDS]`` (``LoopWord``),
    ``now: float64[1]`` (ms; -inf before the first event), the heap ``heap_t: float64[H]`` /
    ``heap_r: int32[H]`` (H >= the most requests that can run at once, N - 1), ``blocks: int32[B]``
    each admitted request's blocks tail first (the order it frees them), scratch ``adm: int32[T]``
    and ``pf: int32[T + 1]`` (T = the largest admissible request's block count)."""

    words: torch.Tensor
    now: torch.Tensor
    heap_t: torch.Tensor
    heap_r: torch.Tensor
    blocks: torch.Tensor
    adm: torch.Tensor
    pf: torch.Tensor


@triton.jit
def heap_push(heap_t, heap_r, n, t, r):
    """Insert (t, r) into the D-ary min-heap of ``n`` entries; returns n + 1."""
    pos = n.to(tl.int64)
    go = pos > 0
    while go:
        parent = (pos - 1) // HEAP_D
        # strict: benign, other threads' values only steer their own loop (no barrier); thread 0 stores
        pt = tl.load(heap_t + parent)
        # strict: benign, other threads' values only steer their own loop (no barrier); thread 0 stores
        pr = tl.load(heap_r + parent)
        up = (t < pt) | ((t == pt) & (r < pr))
        tl.store(heap_t + pos, pt, mask=up)
        tl.store(heap_r + pos, pr, mask=up)
        pos = tl.where(up, parent, pos)
        go = up & (pos > 0)
    tl.store(heap_t + pos, t)
    tl.store(heap_r + pos, r)
    tl.debug_barrier()
    return n + 1


@triton.jit
def heap_pop(heap_t, heap_r, n):
    """Remove the root of the D-ary min-heap of ``n > 0`` entries; returns n - 1. Each level reads
    the D children as one vector; r is unique, so (t, r) names one child."""
    offs = tl.arange(0, HEAP_D)
    n -= 1
    t = tl.load(heap_t + n)  # the last entry sinks from the root
    r = tl.load(heap_r + n)
    pos = tl.zeros([], tl.int64)
    go = n > 0
    while go:
        c = pos * HEAP_D + 1 + offs
        m = c < n
        # strict: benign, other threads' values only steer their own loop (no barrier); thread 0 stores
        ct = tl.load(heap_t + c, mask=m, other=INF)
        # strict: benign, other threads' values only steer their own loop (no barrier); thread 0 stores
        cr = tl.load(heap_r + c, mask=m, other=BIG)
        tmin = tl.min(ct, axis=0)
        rmin = tl.min(tl.where(m & (ct == tmin), cr, BIG), axis=0)
        cmin = tl.min(tl.where(m & (ct == tmin) & (cr == rmin), c, n), axis=0)
        down = (cmin < n) & ((tmin < t) | ((tmin == t) & (rmin < r)))
        tl.store(heap_t + pos, tmin, mask=down)
        tl.store(heap_r + pos, rmin, mask=down)
        pos = tl.where(down, cmin, pos)
        go = down
    tl.store(heap_t + pos, t, mask=n > 0)
    tl.store(heap_r + pos, r, mask=n > 0)
    tl.debug_barrier()
    return n


@triton.jit
def store_reversed(src, dst, n, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n][::-1]``: a request frees its blocks tail first."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        tl.store(dst + (n - 1 - idx), tl.load(src + idx, mask=m, other=0), mask=m)
        i += BLOCK


@triton.jit
def replay_loop_kernel(ps, pc: tl.constexpr, tr, lp, group_ids, bs, max_points):
    """Run the replay model (module docstring) for at most ``max_points`` more time points, or to the
    end (``words[DONE] = 1``). ``group_ids: int32[1]`` the group of the trace's keys, ``bs`` the block
    size in tokens. Does nothing while the pool's status word holds an error."""
    if status_clear(ps.status):
        R = tl.load(lp.words + W_NUM_REQUESTS)
        nxt = tl.load(lp.words + W_NEXT_ARRIVAL)
        lh = tl.load(lp.words + W_LINE_HEAD)
        running = tl.load(lp.words + W_RUNNING)
        points = tl.load(lp.words + W_TIME_POINTS)
        done = tl.load(lp.words + W_DONE)
        slot = COUNTERS + tl.arange(0, NUM_COUNTERS)
        counts = tl.load(lp.words + slot)  # the report's counters, one vector
        now = tl.load(lp.now)
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        num_free = tl.load(ps.ctrl + NUM_FREE)
        stop_at = points + max_points
        no_resv = tl.zeros([], tl.int32)  # the replay model books no reservations
        go = done == 0
        ct = tl.load(lp.heap_t, mask=running > 0, other=INF)  # next completion time (kept in step)
        at = tl.load(tr.ts + nxt, mask=nxt < R, other=INF)  # next arrival time
        while go:
            admitting = tl.full([], 0, tl.int1)
            if ct <= now:  # a completion: free its blocks tail first
                r = tl.load(lp.heap_r)
                tl.debug_barrier()  # strict: orders every thread's read of the root before heap_pop's overwrite
                running = heap_pop(lp.heap_t, lp.heap_r, n=running)
                ct = tl.load(lp.heap_t, mask=running > 0, other=INF)
                head, tail, released, _, _ = free_checked(ps, pc, lp.blocks + tl.load(tr.blk_off + r),
                                                          n=tl.load(tr.total + r), pf=lp.pf, head=head, tail=tail)
                num_free += released
                counts += (slot == W_COMPLETED).to(tl.int64)
                admitting = tl.full([], 1, tl.int1)
            elif at <= now:  # an arrival joins the line
                admitting = lh == nxt  # a non-empty line is blocked at its head: an arrival changes nothing
                nxt += 1
                at = tl.load(tr.ts + nxt, mask=nxt < R, other=INF)
            elif (running == 0) & (nxt >= R):
                done += 1
                go = tl.full([], 0, tl.int1)
            elif points >= stop_at:
                go = tl.full([], 0, tl.int1)
            else:  # the next time point: completions before arrivals at equal times
                now = tl.minimum(ct, at)
                points += 1
            # Admission pass: in line order until the first request that does not fit.
            grp = tl.load(group_ids)
            while admitting & (lh < nxt):
                # The request's numbers, loaded together (independent loads overlap).
                total = tl.load(tr.total + lh)
                base = tl.load(tr.chain_off + lh)
                full = tl.load(tr.full + lh)
                hitcap = tl.load(tr.hitcap + lh)
                boff = tl.load(tr.blk_off + lh)
                finish = now + tl.load(tr.dur + lh)
                late = now > tl.load(tr.ts + lh)
                if total > pc.N - 1:
                    counts += (slot == W_REJECTED).to(tl.int64)
                    lh += 1
                else:  # vLLM's steps (kernels/requests/steps.py) on a new request's one row, G = 1
                    hit = find_longest_cache_hit(ps, pc, tr.chain_hi + base, tr.chain_lo + base, gstride=0, pstride=1,
                                                 groups=group_ids, gk=None, G=1, length=hitcap,
                                                 out_blocks=lp.adm, out_stride=0, BS=1, CHUNKED=False)
                    # in blocks (BS = 1): the request's total blocks; no reservations
                    blocks = get_num_blocks_to_allocate(total, hits=hit.hits, zero_ref=hit.zero_ref, num_blocks=0,
                                                        G=1, BS=1)
                    adm = admit(blocks.demand, num_free=num_free, num_reserved=no_resv, reserved=no_resv)
                    if adm.fits:
                        hits = hit.hits
                        got = allocate_blocks(ps, pc, lp.adm, ROW_STRIDE=0, G=1, nblk=0, hits=hits, need=blocks.need,
                                              head=head, tail=tail, num_free=num_free)
                        head = got.head
                        num_free = got.num_free
                        if pc.CACHING:
                            cache_full_blocks(ps, pc, lp.adm, hits, full, tr.chain_hi, tr.chain_lo, key0=base,
                                              kstride=1, group=grp, bs=bs)
                        store_reversed(lp.adm, dst=lp.blocks + boff, n=total, BLOCK=pc.BLOCK)
                        tl.debug_barrier()
                        running = heap_push(lp.heap_t, lp.heap_r, n=running, t=finish, r=lh.to(tl.int32))
                        ct = tl.minimum(ct, finish)
                        counts += (tl.where(slot == W_ADMITTED, 1, 0) + tl.where(slot == W_WAITED, late, 0)
                                   + tl.where(slot == W_PROMPT_BLOCKS, full, 0)
                                   + tl.where(slot == W_HIT_BLOCKS, hits, 0)).to(tl.int64)
                        counts = tl.where(slot == W_PEAK_IN_USE, tl.maximum(counts, pc.N - 1 - num_free), counts)
                        lh += 1
                    else:
                        admitting = tl.full([], 0, tl.int1)
        tl.debug_barrier()  # strict: orders the loop's first reads of these words before the stores
        tl.store(ps.ctrl + HEAD, head)
        tl.store(ps.ctrl + TAIL, tail)
        tl.store(ps.ctrl + NUM_FREE, num_free)
        tl.store(lp.now, now)
        tl.store(lp.words + W_NEXT_ARRIVAL, nxt)
        tl.store(lp.words + W_LINE_HEAD, lh)
        tl.store(lp.words + W_RUNNING, running)
        tl.store(lp.words + W_DONE, done)
        tl.store(lp.words + W_TIME_POINTS, points)
        tl.store(lp.words + slot, counts)

def launch_replay_loop(ps, pc, tr: TraceTensors, lp: LoopState, group_ids, block_size: int, max_points: int):
    """Launch ``replay_loop_kernel`` (one program) for at most ``max_points`` time points."""
    replay_loop_kernel[(1,)](ps, pc, tr, lp, group_ids, block_size, max_points, num_warps=warps_for(pc.BLOCK))
