"""``allocate_slots`` of a batch, request-parallel (docs/algorithms.md section 6).

One program, lanes over requests (tiles of ``mc.BLOCK``) and over flattened per-request work (tiles of
``pc.BLOCK``): queue positions, key sequence numbers and event rows come from prefix sums in request
order, so the result equals the sequence of per-request calls of the exact path
(``kernels/requests/exact.py``). The exact path is order-dependent where one request's effect changes what a
later one sees; those cases are found on the device and cut the batch at the first request affected
(the *split*). Requests ``[0, split)`` commit here; ``allocate_slots_kernel`` continues from the
split (it returns at once when the split is the whole batch), so one captured graph serves both.

Where the prefix sums stop being exact (the fallback reasons, ``layout.Fallback``, counted in ``ctrl``):

* ``OUT_OF_BLOCKS``: the first request that does not fit (the running free count depends on which
  earlier requests were admitted, and ``stop_on_failure`` stops there);
* ``SLIDING_WINDOW``: a sliding-window release that a later pop could take (an un-hashed block goes to
  the queue's head), of a block another request shares, or in a batch with prefix hits; pops that
  would reach blocks released to the tail in the same batch;
* ``PREFIX``: a lookup whose first miss an earlier request of the batch caches, or whose zero-ref hit
  an earlier request could pop (a conservative rank test against the queue's head);
* ``PARTIAL_KEY``: a partial-block key (hash blocks finer than blocks);
* ``FORCED``: the caller asked for the exact path (tests).

Modules: this one (the entries, the split, the commit's order), ``parallel_scan`` (the analysis:
nothing there changes pool or manager state), ``parallel_commit`` (requests ``[0, split)``) and
``parallel_scratch`` (the scratch as named views: ``sc.req.slot + k``, ``sc.grp.start + j``,
``sc.maps.pop``). Besides those views the analysis uses ``s_filter: int32[FS]``, keys cached in the
batch (a conservative set: a false hit only costs a fallback). The pool's ``s_first`` (idle BIG) and
``s_last`` (idle -1) are back at idle after a call.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..common import segment_ids, segment_ids_pair, warps_for
from ..layout import (
    ALLOC_FALLBACK, ALLOC_PARALLEL, ALLOC_SPLIT, BIG, EV_COUNT, FALLBACK_REASONS, HEAD, KEY_SEQ, NUM_FREE,
    R_FORCED, R_OUT_OF_BLOCKS, R_PARTIAL_KEY, R_PREFIX, R_SLIDING_WINDOW, TAIL,
)
from .checks import check_allocate_batch
from .parallel_commit import allocate_all, cache_all, finish_requests, remove_skipped_all, touch_hits
from .parallel_scan import (
    Plan, count_zero_ref_hits, find_hits, first_cached_miss, first_popped_hit, no_releases, plan_requests,
    scan_cached, scan_requests,
)
from .parallel_scratch import scratch_views


class PoolWords(NamedTuple):
    """The pool's and manager's counters as the call found them (scalars)."""

    num_free: tl.tensor  # ctrl[NUM_FREE] (int64)
    resv_total: tl.tensor  # blocks reserved (ms.num_reserved)
    unreserved: tl.tensor  # num_free less the reserved total: the admission check's room (int64)
    key_seq: tl.tensor
    head: tl.tensor
    tail: tl.tensor


class Analysis(NamedTuple):
    """A batch analysed: its flattened lookups and its :class:`Plan`."""

    num_lookups: tl.tensor
    plan: Plan


@triton.jit
def pool_words(ps, ms):
    num_free = tl.load(ps.ctrl + NUM_FREE)
    resv_total = tl.load(ms.num_reserved)
    return PoolWords(num_free, resv_total, num_free - resv_total.to(tl.int64), tl.load(ps.ctrl + KEY_SEQ),
                     tl.load(ps.ctrl + HEAD), tl.load(ps.ctrl + TAIL))


@triton.jit
def analyse_batch(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb, pw):
    """Every request of an ``allocate_slots`` batch, lookups included: scan, ``find_longest_cache_hit``
    flattened, the zero-ref hits, then :func:`plan_requests` on what the scan stored."""
    num_lookups, rels = scan_requests(ps, pc, ms, mc, sc, batch, nb)
    tl.debug_barrier()
    if num_lookups > 0:
        segment_ids(sc.req.loff, nb, num_lookups, sc.maps.lookup, pc.BLOCK)
        find_hits(ps, pc, ms, mc, sc, nb, num_lookups)
    any_hits = count_zero_ref_hits(ps, pc, ms, mc, sc, nb, num_lookups)
    plan = plan_requests(ps, pc, ms, mc, sc, batch, nb, pw.num_free, pw.unreserved, any_hits, rels, False)
    return Analysis(num_lookups, plan)


@triton.jit
def analyse_decode_batch(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb, pw):
    """A batch whose ``lookup`` flags are all 0 (a decode step's): no hits, so :func:`plan_requests`
    scans each tile itself, one pass over the requests in all."""
    num_lookups = tl.zeros([], tl.int32)
    plan = plan_requests(ps, pc, ms, mc, sc, batch, nb, pw.num_free, pw.unreserved, num_lookups > 0,
                         no_releases(), True)
    return Analysis(num_lookups, plan)


@triton.jit
def find_split(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, nb, an, FORCE_EXACT: tl.constexpr):
    """The first order-dependent request of an analysed batch (``nb`` when none; 0 with
    ``FORCE_EXACT``), counted in ``ctrl`` by reason (module docstring) and left in
    ``ctrl[ALLOC_SPLIT]``. Builds the caching and pop maps (one walk for both). Returns (split, a bound
    on the old keys the caching removes)."""
    plan = an.plan
    tl.debug_barrier()
    segment_ids_pair(sc.grp.coff, nb * mc.G, plan.items, sc.maps.cache, sc.req.popoff, nb, plan.pops, sc.maps.pop,
                     pc.BLOCK)
    sw = tl.minimum(plan.sw, plan.rels.sw_bad)
    if plan.rels.total > 0:  # pops that reach blocks released to the tail in this batch
        sw = tl.minimum(sw, plan.reach)
    pre_first = plan.rels.prepend
    if pre_first < BIG:  # an un-hashed release goes to the head: no pops after it
        if plan.pops > tl.load(sc.req.popoff + pre_first):
            sw = tl.minimum(sw, pre_first)
    prefix = tl.full([], BIG, tl.int32)
    if an.num_lookups > 0:
        offs = tl.arange(0, mc.BLOCK)
        i = 0
        while i < mc.FS:
            tl.store(ms.s_filter + i + offs, tl.full([mc.BLOCK], BIG, tl.int32), mask=(i + offs) < mc.FS)
            i += mc.BLOCK
        tl.debug_barrier()
    removed = scan_cached(ps, pc, ms, mc, sc, nb, plan.items, an.num_lookups > 0)
    if an.num_lookups > 0:
        prefix = first_cached_miss(ms, mc, sc, nb)
        if plan.zref > 0:
            prefix = tl.minimum(prefix, first_popped_hit(ps, pc, ms, mc, sc, nb, an.num_lookups,
                                                         plan.pops + plan.zref))
    split = tl.minimum(tl.minimum(tl.minimum(plan.fail, sw), tl.minimum(prefix, plan.partial)), nb)
    reason = tl.where(split == plan.fail, R_OUT_OF_BLOCKS,
                      tl.where(split == sw, R_SLIDING_WINDOW, tl.where(split == prefix, R_PREFIX, R_PARTIAL_KEY)))
    if FORCE_EXACT:
        split = tl.zeros([], tl.int32)
        reason = R_FORCED
    tl.store(ps.ctrl + ALLOC_SPLIT, split)
    if split < nb:
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ps.ctrl + ALLOC_FALLBACK, tl.load(ps.ctrl + ALLOC_FALLBACK) + 1)
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ps.ctrl + FALLBACK_REASONS + reason, tl.load(ps.ctrl + FALLBACK_REASONS + reason) + 1)
    else:
        # strict: benign, one statement; only thread 0 uses the value it loads (its store)
        tl.store(ps.ctrl + ALLOC_PARALLEL, tl.load(ps.ctrl + ALLOC_PARALLEL) + 1)
    return split, removed


@triton.jit
def commit(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb, pw, an, split, removed):
    """Requests ``[0, split)`` (``0 < split <= nb``) as their sequence of exact calls would leave them:
    hits touched, blocks popped and claimed, sliding-window releases, caching, counters."""
    unlinked = tl.zeros([], tl.int32)
    if an.num_lookups > 0:
        unlinked = touch_hits(ps, pc, ms, mc, sc, tl.load(sc.req.loff + split))
    pops = an.plan.pops
    if split < nb:
        pops = tl.load(sc.req.popoff + split)
    head, removed = allocate_all(ps, pc, ms, mc, sc, split, pops, pw.head, pw.tail, removed)
    tail = pw.tail
    released = tl.zeros([], tl.int32)
    if mc.SW:
        if tl.load(sc.grp.reloff + split * mc.G) > 0:
            head, tail, released = remove_skipped_all(ps, pc, ms, mc, sc, split, head, tail)
    stored = tl.zeros([], tl.int32)
    if pc.CACHING:
        stored = cache_all(ps, pc, ms, mc, sc, split, pw.key_seq, removed)
    drawn = finish_requests(ms, mc, sc, batch, split, pw.resv_total > 0, pc.CACHING)
    tl.store(ms.num_reserved, pw.resv_total - drawn)
    tl.store(ps.ctrl + HEAD, head)
    tl.store(ps.ctrl + TAIL, tail)
    tl.store(ps.ctrl + NUM_FREE, pw.num_free + released - pops - unlinked)
    tl.store(ps.ctrl + KEY_SEQ, pw.key_seq + stored)
    if pc.EVENTS:
        tl.store(ps.ctrl + EV_COUNT, tl.load(sc.req.evbase + split))


@triton.jit
def split_and_commit(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb, pw, an, FORCE_EXACT: tl.constexpr):
    """:func:`find_split`, then :func:`commit` of the requests before it. Returns the split."""
    split, removed = find_split(ps, pc, ms, mc, sc, nb, an, FORCE_EXACT)
    if split > 0:
        commit(ps, pc, ms, mc, sc, batch, nb, pw, an, split, removed)
    return split


@triton.jit
def allocate_slots_parallel_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, FORCE_EXACT: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_parallel`."""
    allocate_slots_parallel(ps, pc, ms, mc, batch, cap, FORCE_EXACT)


@triton.jit
def allocate_slots_parallel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, FORCE_EXACT: tl.constexpr):
    """``allocate_slots`` of ``batch.num_reqs[0]`` requests (AllocateBatch, capacity ``cap``, see
    kernels/requests/exact.py): validate the whole batch (errors set the status word and change
    nothing), analyse every request in parallel, commit requests ``[0, split)`` and leave
    ``ctrl[ALLOC_SPLIT] = split`` for the exact path (module docstring). ``FORCE_EXACT``: split 0
    (tests). Returns the split (0 on an error)."""
    split = tl.zeros([], tl.int32)
    nb, err = check_allocate_batch(ps, pc, ms, mc, batch, cap)
    if err == 0:
        sc = scratch_views(ms, mc)
        pw = pool_words(ps, ms)
        an = analyse_batch(ps, pc, ms, mc, sc, batch, nb, pw)
        split = split_and_commit(ps, pc, ms, mc, sc, batch, nb, pw, an, FORCE_EXACT)
    return split


@triton.jit
def allocate_slots_parallel_checked(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, FORCE_EXACT: tl.constexpr,
                                    ok, num):
    """:func:`allocate_slots_parallel` of a decode step's batch: checked (and ``admitted`` zeroed) by
    ``check_step`` (or a burst step's ``check_batch_counts``) earlier in the same program, ``ok`` (a scalar
    flag) saying whether the step may go on and ``num`` its request count; its ``lookup`` flags are
    all 0, so no pass for lookups runs (:func:`analyse_decode_batch`). Returns the split (0 unless
    ``ok``)."""
    split = tl.zeros([], tl.int32)
    if ok:
        sc = scratch_views(ms, mc)
        pw = pool_words(ps, ms)
        an = analyse_decode_batch(ps, pc, ms, mc, sc, batch, num, pw)
        split = split_and_commit(ps, pc, ms, mc, sc, batch, num, pw, an, FORCE_EXACT)
    return split


def launch_allocate_slots_parallel(ps, pc, ms, mc, batch, *, force_exact: bool = False):
    """Launch ``allocate_slots_parallel_kernel`` (one program)."""
    allocate_slots_parallel_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), FORCE_EXACT=bool(force_exact),
                                         num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
