"""``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), from
the split the request-parallel kernel (``parallel.py``) left: a loop over the requests, each one
vLLM's steps in order (``steps.py``); and the same loop with vLLM's preemption (``allocate_running``,
docs/semantics.md section 9), which a decode window's steps run."""
from typing import NamedTuple

import triton
import triton.language as tl

from ..common import checked_count, lanes, ld, status_clear, warps_for
from ..layout import ALLOC_SPLIT, HEAD, NUM_FREE, TAIL
from .free import free_requests_checked
from .parallel_scratch import scratch_views
from .rows import row_of
from .steps import (admit, allocate_blocks, cache_blocks, get_computed_blocks, get_num_blocks_to_allocate,
                    remove_skipped_blocks)


class QueueWords(NamedTuple):
    """The free queue's ``head``, ``tail`` and ``num_free`` and the reserved total, carried in registers
    through a sequential loop (stored back once at its end)."""

    head: tl.tensor
    tail: tl.tensor
    num_free: tl.tensor
    resv_total: tl.tensor


@triton.jit
def load_queue_words(ps, ms):
    return QueueWords(tl.load(ps.ctrl + HEAD), tl.load(ps.ctrl + TAIL), tl.load(ps.ctrl + NUM_FREE),
                      tl.load(ms.num_reserved))


@triton.jit
def store_queue_words(ps, ms, q):
    tl.debug_barrier()  # strict: orders every thread's reads of the words before these stores
    tl.store(ps.ctrl + HEAD, q.head)
    tl.store(ps.ctrl + TAIL, q.tail)
    tl.store(ps.ctrl + NUM_FREE, q.num_free)
    tl.store(ms.num_reserved, q.resv_total)


class Attempt(NamedTuple):
    """:func:`allocate_one`: whether the request ``fits`` (and was admitted), and the words after it."""

    fits: tl.tensor
    q: QueueWords


@triton.jit
def allocate_one(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, k, q):
    """``allocate_slots`` of request ``k`` of ``batch`` (``ReferenceKVCacheManager._allocate_one``):
    remove the skipped sliding-window blocks, take the longest cache hit (``lookup`` and an empty row),
    and if ``need * G + zero-ref hits <= num_free - (num_reserved - reserved[r])`` (the other requests'
    reservations are held back; docs/semantics.md section 8) touch the hits, allocate the new blocks
    and cache the full ones, those blocks drawn from ``reserved[r]`` first, and set ``admitted[k]``
    and ``hits[k]`` (tokens). Returns an :class:`Attempt` (the words in registers, ``q`` before)."""
    r = tl.load(batch.slots + k)
    nt = tl.load(batch.num_tokens + k)
    rel = remove_skipped_blocks(ps, pc, ms, mc, r, q.head, q.tail)
    head = rel.head
    tail = rel.tail
    num_free = q.num_free + rel.num_released
    resv_total = q.resv_total
    nblk = tl.load(ms.num_blocks + r)
    hit = get_computed_blocks(ps, pc, ms, mc, r, num_tokens=nt, lookup=tl.load(batch.lookup + k), nblk=nblk)
    blocks = get_num_blocks_to_allocate(tl.load(batch.target + k), hits=hit.hits, zero_ref=hit.zero_ref,
                                        num_blocks=nblk, G=mc.G, BS=mc.BS)
    own = tl.load(ms.reserved + r)
    adm = admit(blocks.demand, num_free=num_free, num_reserved=resv_total, reserved=own)
    if adm.fits:
        resv_total -= adm.take
        got = allocate_blocks(ps, pc, row_of(ms, mc, 0, r), ROW_STRIDE=mc.R * mc.M, G=mc.G, nblk=nblk,
                              hits=hit.hits, need=blocks.need, head=head, tail=tail, num_free=num_free)
        head = got.head
        num_free = got.num_free
        nrow = nblk + hit.hits + blocks.need
        if pc.CACHING:
            cache_blocks(ps, pc, ms, mc, r, known=tl.minimum(blocks.eff, nt), hits=hit.hits, nrow=nrow)
        else:
            g = 0
            while g < mc.G:
                tl.store(ms.num_cached + g * mc.R + r,
                         # strict: benign, one statement; only thread 0 uses the value it loads (its store)
                         tl.maximum(tl.load(ms.num_cached + g * mc.R + r), hit.hits))
                g += 1
        tl.store(ms.num_blocks + r, nrow)
        tl.store(ms.reserved + r, own - adm.take)
        tl.store(ms.num_computed + r, blocks.eff)
        tl.store(batch.admitted + k, 1)
        tl.store(batch.hits + k, hit.hits * mc.BS)
    return Attempt(adm.fits, QueueWords(head, tail, num_free, resv_total))


@triton.jit
def allocate_slots_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr,
                          STATS: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_exact`, after ``allocate_slots_parallel_kernel``; then, with
    ``STATS`` (a batch with lookups), :func:`record_prefix_stats`."""
    allocate_slots_exact(ps, pc, ms, mc, batch, cap=cap, STOP_ON_FAILURE=STOP_ON_FAILURE)
    if STATS:
        tl.debug_barrier()
        nb, _ = checked_count(batch.num_reqs, cap)
        record_prefix_stats(ps, pc, ms, mc, batch, nb)


@triton.jit
def allocate_slots_exact(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr):
    """:func:`allocate_slots_exact_checked` of a batch of ``batch.num_reqs[0]`` requests (at most
    ``cap``; a count out of range reads as 0, the parallel kernel's check having set the status
    word), from request ``ctrl[ALLOC_SPLIT]``, only while the status word is clear."""
    nb, _ = checked_count(batch.num_reqs, cap)
    allocate_slots_exact_checked(ps, pc, ms, mc, batch, STOP_ON_FAILURE=STOP_ON_FAILURE, num=nb,
                                 split=tl.load(ps.ctrl + ALLOC_SPLIT).to(tl.int32), ok=status_clear(ps.status))


@triton.jit
def allocate_slots_exact_checked(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, STOP_ON_FAILURE: tl.constexpr,
                                 num, split, ok):
    """``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), of
    requests ``split .. num`` of a batch the request-parallel kernel (``kernels/requests/parallel.py``)
    validated and committed up to ``split``; nothing unless ``ok`` (the status word clear) and
    ``split < num``. Per request :func:`allocate_one`; a request that does not fit is skipped (or,
    ``STOP_ON_FAILURE``, ends the loop).

    ``batch`` (AllocateBatch): ``slots, num_tokens, target: int32[cap]``, ``lookup: int8[cap]``,
    outputs ``admitted, hits: int32[cap]`` (the caller zeroed them). ``num``, ``split``: int32
    scalars, already checked (``0 <= split <= num <= cap``), ``ok`` a scalar flag."""
    k = split
    if ok & (k < num):
        q = load_queue_words(ps, ms)
        stop = tl.zeros([], tl.int32)
        while (k < num) & (stop == 0):
            att = allocate_one(ps, pc, ms, mc, batch, k, q)
            q = att.q
            if STOP_ON_FAILURE:
                stop = (~att.fits).to(tl.int32)
            k += 1
        store_queue_words(ps, ms, q)


@triton.jit
def allocate_running_exact(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, preempted, num, split, ok):
    """vLLM's scheduler loop over running requests from ``split`` on (``ReferenceKVCacheManager.
    allocate_running``; docs/semantics.md section 9): request k tries :func:`allocate_one`; when it
    does not fit, the last request still in the batch is preempted (``free``: its rows back to the
    queue tail first, its reservation released; ``preempted[last] = 1``) and k tries again; a request
    that had to preempt itself ends the loop. Requests ``[0, split)`` were admitted by the parallel
    path, which stops at the first that does not fit. ``preempted: int32[cap]`` (zeroed by the
    caller). Nothing unless ``ok`` and ``split < num``. The loop runs once per preemption and per
    request from the split: the parallel path takes every batch that fits."""
    k = split
    last = num - 1
    if ok & (k < num):
        q = load_queue_words(ps, ms)
        while k <= last:
            att = allocate_one(ps, pc, ms, mc, batch, k, q)
            q = att.q
            if att.fits:
                k += 1
            else:
                store_queue_words(ps, ms, q)
                tl.debug_barrier()
                free_requests_checked(ps, pc, ms, mc, batch.slots + last, num=1, ok=ok)
                tl.store(preempted + last, 1)
                tl.debug_barrier()
                q = load_queue_words(ps, ms)
                if last == k:
                    k = num
                last -= 1
        store_queue_words(ps, ms, q)


@triton.jit
def record_prefix_stats(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, num):
    """vLLM's ``PrefixCacheStats.record`` of every admitted request of ``batch[:num]`` that looked up:
    a lookup flag (2: resumed after a preemption) on a row that held no blocks before the call (the
    row length the request-parallel scan left in ``sc.req.nblk`` for every request of the batch; a
    flag on a row that holds blocks looks nothing up, docs/semantics.md section 9), into ``ms.stats:
    int64[6]`` (gpupool/stats.py order: requests, queries, hits, then the preempted ones'), with
    caching on; only while the status word is clear. Sums over tiles (no loop over requests)."""
    if pc.CACHING & status_clear(ps.status):
        sc = scratch_views(ms, mc)
        new = tl.zeros([], tl.int64)
        new_q = tl.zeros([], tl.int64)
        new_h = tl.zeros([], tl.int64)
        old = tl.zeros([], tl.int64)
        old_q = tl.zeros([], tl.int64)
        old_h = tl.zeros([], tl.int64)
        i = 0
        while i < num:
            k, m = lanes(i, num, mc.BLOCK)
            lk = ld(batch.lookup + k, m)
            on = m & (ld(batch.admitted + k, m) != 0) & (lk != 0) & (ld(sc.req.nblk + k, m) == 0)
            nt = ld(batch.num_tokens + k, m).to(tl.int64)
            h = ld(batch.hits + k, m).to(tl.int64)
            fresh = on & (lk == 1)
            again = on & (lk != 1)
            new += tl.sum(fresh.to(tl.int64), axis=0)
            new_q += tl.sum(tl.where(fresh, nt, 0), axis=0)
            new_h += tl.sum(tl.where(fresh, h, 0), axis=0)
            old += tl.sum(again.to(tl.int64), axis=0)
            old_q += tl.sum(tl.where(again, nt, 0), axis=0)
            old_h += tl.sum(tl.where(again, h, 0), axis=0)
            i += mc.BLOCK
        tl.debug_barrier()  # strict: orders every thread's reads of the counters below before thread 0's stores
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 0, tl.load(ms.stats + 0) + new)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 1, tl.load(ms.stats + 1) + new_q)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 2, tl.load(ms.stats + 2) + new_h)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 3, tl.load(ms.stats + 3) + old)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 4, tl.load(ms.stats + 4) + old_q)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ms.stats + 5, tl.load(ms.stats + 5) + old_h)


def launch_allocate_slots(ps, pc, ms, mc, batch, *, stop_on_failure: bool, stats: bool = False):
    """Launch ``allocate_slots_kernel`` (one program), after ``launch_allocate_slots_parallel``;
    ``stats``: the batch may have lookups (record them)."""
    allocate_slots_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), STOP_ON_FAILURE=bool(stop_on_failure),
                                STATS=bool(stats), num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
