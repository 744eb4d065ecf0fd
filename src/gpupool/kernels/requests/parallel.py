"""``allocate_slots`` of a batch, request-parallel (docs/algorithms.md section 6).

One program, lanes over requests (tiles of ``mc.BLOCK``) and over flattened per-request work (tiles of
``pc.BLOCK``): queue positions, key sequence numbers and event rows come from prefix sums in request
order, so the result equals the sequence of per-request calls of the exact path
(``kernels/requests/exact.py``). The exact path is order-dependent where one request's effect changes what a
later one sees; those cases are found on the device and cut the batch at the first request affected
(the *split*). Requests ``[0, split)`` commit here; ``allocate_slots_kernel`` continues from the
split (it returns at once when the split is the whole batch), so one captured graph serves both.

Where the prefix sums stop being exact (the fallback reasons, counted in ``ctrl``):

* ``OUT_OF_BLOCKS``: the first request that does not fit (the running free count depends on which
  earlier requests were admitted, and ``stop_on_failure`` stops there);
* ``SLIDING_WINDOW``: a sliding-window release that a later pop could take (an un-hashed block goes to
  the queue's head), of a block another request shares, or in a batch with prefix hits; pops that
  would reach blocks released to the tail in the same batch;
* ``PREFIX``: a lookup whose first miss an earlier request of the batch caches, or whose zero-ref hit
  an earlier request could pop (a conservative rank test against the queue's head);
* ``PARTIAL_KEY``: a partial-block key (hash blocks finer than blocks);
* ``FORCED``: the caller asked for the exact path (tests).

Scratch (manager state): the per-request, per-(request, group) and item-map fields are named views
of ``s_par`` / ``s_kg`` / ``s_map`` (``parallel_scratch.py``: ``sc.req.slot + k``), and ``s_filter:
int32[FS]`` holds keys cached in the batch (a conservative set: a false hit only costs a fallback).
A call writes every field it reads before reading it and leaves them as they are (a field a path
does not need, say the lookups' offsets in a decode step, keeps an older call's value). The pool's
``s_first`` (idle BIG) and ``s_last`` (idle -1) are back at idle.
"""
from enum import IntEnum

import triton
import triton.language as tl

from ..alloc import claim_tile
from ..common import segment_ids, warps_for
from ..events import write_stored_header, write_stored_item
from ..groups import num_skipped_blocks
from ..keytable import drop_keys, key_home, lookup_blocks, put_key
from ..layout import (
    ALLOC_FALLBACK, ALLOC_PARALLEL, ALLOC_SPLIT, BIG, E_INVALID_ARG, EV_COUNT, FALLBACK_REASONS, HEAD, KEY_SEQ,
    NO_SLOT, NUM_FREE, REUSE_COUNT, TAIL, constexprs,
)
from .checks import check_allocate_batch
from .parallel_scratch import scratch_views
from .rows import keys_of, row_of
from ..queue import ring_make_room, ring_scan_pop
from ..release import count_ids, release_place, release_scan, reset_ids


class Fallback(IntEnum):
    """Why a batch left the request-parallel path (``ctrl[FALLBACK_REASONS + reason]`` counts them)."""

    OUT_OF_BLOCKS = 0
    SLIDING_WINDOW = 1
    PREFIX = 2
    PARTIAL_KEY = 3
    FORCED = 4


R_OUT_OF_BLOCKS, R_SLIDING_WINDOW, R_PREFIX, R_PARTIAL_KEY, R_FORCED = constexprs(Fallback)


@triton.jit
def ld(ptr, m):
    return tl.load(ptr, mask=m, other=0)


@triton.jit
def first_index(cur, bad, k):
    """The lower of ``cur`` and the first lane index where ``bad`` holds."""
    return tl.minimum(cur, tl.min(tl.where(bad, k, BIG), axis=0))


@triton.jit
def leading_nulls(row, n, m, M: tl.constexpr):
    """Null blocks at the start of each lane's ``row[:n]`` (rows are nulls, then blocks: sliding-window
    removal nulls a prefix): a binary search, log2(M) loads."""
    lead = tl.zeros_like(n)
    step = 1
    while step < M:
        step *= 2
    while step > 0:
        cand = lead + step
        ok = m & (cand <= n)
        ok = ok & (tl.load(row + cand - 1, mask=ok, other=1) == 0)
        lead = tl.where(ok, cand, lead)
        step = step // 2
    return lead


# ---- analysis: nothing below changes pool or manager state until ``commit`` ------------------------

@triton.jit
def scan_tile(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, k, m, LOOKUP: tl.constexpr):
    """One tile of requests ``k`` (lanes ``m``), read: slot, token count and target, row length, known
    hashes, lookup cap and the sliding-window releases (their fields into scratch). Every load comes
    before any store, so no load waits behind a store of a loaded value (:func:`scan_store` writes
    the rest). Returns (slot, num_tokens, target, row length, hashes, cap, released, SW conflict
    flags, prepend flags)."""
    sc = scratch_views(ms, mc)
    r = ld(batch.slots + k, m)
    nt = ld(batch.num_tokens + k, m)
    tg = ld(batch.target + k, m)
    look = m
    if LOOKUP:
        look = m & (ld(batch.lookup + k, m) != 0)
    nblk = ld(ms.num_blocks + r, m)
    nhash = ld(ms.num_hashes + r, m)
    cap = tl.zeros_like(k)
    if LOOKUP and pc.CACHING:
        cap = tl.where(look & (nblk == 0), tl.minimum(tl.maximum(nt - 1, 0) // mc.BS, nhash // mc.K), 0)
    rel = tl.zeros_like(k)
    bad = m & False
    pre = m & False
    if mc.SW:
        ncomp = ld(ms.num_computed + r, m)
        for g in tl.static_range(mc.G):
            w = tl.load(ms.windows + g)
            row = row_of(ms, mc, g, r)
            nskip = tl.where(m, num_skipped_blocks(ncomp, w, mc.BS, nblk), 0)
            lead = leading_nulls(row, nskip, m, mc.M)
            tl.store(sc.grp.nskip + k * mc.G + g, nskip, mask=m)
            tl.store(sc.grp.lead + k * mc.G + g, lead, mask=m)
            rel += nskip - lead
            t = 0
            most = tl.max(nskip - lead, axis=0)
            while t < most:  # the released blocks (usually none or one per request)
                a = m & (lead + t < nskip)
                b = tl.load(row + lead + t, mask=a, other=0)
                bad = bad | (a & (ld(ps.ref_cnt + b, a) != 1))
                if pc.CACHING:
                    pre = pre | (a & (ld(ps.num_keys + b, a) == 0))
                else:
                    pre = pre | a
                t += 1
    return r, nt, tg, nblk, nhash, cap, rel, bad, pre


@triton.jit
def scan_store(ms, mc: tl.constexpr, k, m, r, nblk, cap, rel):
    """The per-request fields of :func:`scan_tile` into scratch; the lookup's fields reset."""
    sc = scratch_views(ms, mc)
    zero = tl.zeros([mc.BLOCK], tl.int32)
    tl.store(sc.req.slot + k, r, mask=m)
    tl.store(sc.req.nblk + k, nblk, mask=m)
    tl.store(sc.req.cap + k, cap, mask=m)
    tl.store(sc.req.miss + k, tl.full([mc.BLOCK], BIG, tl.int32), mask=m)
    tl.store(sc.req.zref + k, zero, mask=m)
    tl.store(sc.req.evict + k, zero, mask=m)
    tl.store(sc.req.rel + k, rel, mask=m)
    if not mc.SW:
        for g in tl.static_range(mc.G):
            tl.store(sc.grp.nskip + k * mc.G + g, zero, mask=m)
            tl.store(sc.grp.lead + k * mc.G + g, zero, mask=m)


@triton.jit
def no_releases():
    """The start of a :func:`fold_releases`: (released, first SW conflict, first prepend request)."""
    return tl.zeros([], tl.int32), tl.full([], BIG, tl.int32), tl.full([], BIG, tl.int32)


@triton.jit
def fold_releases(rel_total, sw_bad, pre_first, rel, bad, pre, k):
    """Fold one :func:`scan_tile`'s releases and flags of requests ``k`` into the running three."""
    return rel_total + tl.sum(rel, axis=0), first_index(sw_bad, bad, k), first_index(pre_first, pre, k)


@triton.jit
def scan_requests(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, nb):
    """:func:`scan_tile` of every request, and the lookups' offsets. Returns (lookups, released, first
    SW conflict, first prepend request)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    lcarry = tl.zeros([], tl.int32)
    rel_total, sw_bad, pre_first = no_releases()
    i = 0
    while i < nb:
        k = i + offs
        m = k < nb
        r, _, _, nblk, _, cap, rel, bad, pre = scan_tile(ps, pc, ms, mc, batch, k, m, True)
        scan_store(ms, mc, k, m, r, nblk, cap, rel)
        tl.store(sc.req.loff + k, lcarry + tl.cumsum(cap, axis=0) - cap, mask=m)
        lcarry += tl.sum(cap, axis=0)
        rel_total, sw_bad, pre_first = fold_releases(rel_total, sw_bad, pre_first, rel, bad, pre, k)
        i += mc.BLOCK
    tl.store(sc.req.loff + nb, lcarry)
    return lcarry, rel_total, sw_bad, pre_first


@triton.jit
def lookup_item(ms, mc: tl.constexpr, nb, f, m):
    """(request, position, slot) of flattened lookup items ``f``."""
    sc = scratch_views(ms, mc)
    k = ld(sc.maps.lookup + f, m)
    t = f - ld(sc.req.loff + k, m)
    return k, t, ld(sc.req.slot + k, m)


@triton.jit
def hit_item(ms, mc: tl.constexpr, nb, num_lookups, f):
    """Lookup item ``f`` as (request k, position t, slot r, whether it is one of k's hits)."""
    sc = scratch_views(ms, mc)
    m = f < num_lookups
    k, t, r = lookup_item(ms, mc, nb, f, m)
    return k, t, r, m & (t < ld(sc.req.hits + k, m))


@triton.jit
def find_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, nb, num_lookups):
    """``find_longest_cache_hit`` of every request at once, flattened over (request, position): hit
    blocks into the rows, the first miss per request with ``atomic_min``."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    i = 0
    while i < num_lookups:
        f = i + offs
        m = f < num_lookups
        k, t, r = lookup_item(ms, mc, nb, f, m)
        ok = m
        for g in tl.static_range(mc.G):
            ka = keys_of(mc, g, r) + (t + 1).to(tl.int64) * mc.K - 1
            grp = tl.zeros_like(t) + tl.load(ms.group_ids + g)
            blk = lookup_blocks(ps, pc, ld(ms.req_hi + ka, m), ld(ms.req_lo + ka, m), grp, m)
            tl.store(row_of(ms, mc, g, r) + t, blk, mask=m)
            ok = ok & (blk >= 0)
        tl.atomic_min(sc.req.miss + k, t, mask=m & ~ok)
        i += pc.BLOCK
    tl.debug_barrier()


@triton.jit
def count_zero_ref_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, nb, num_lookups):
    """Hits per request, and the zero-ref hits each request's admission check counts: hits on a
    block with ref 0 that no earlier request of the batch hits (its touch raises the count)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    any_hits = tl.zeros([], tl.int32)
    i = 0
    while i < nb:
        k = i + offs
        m = k < nb
        hits = tl.minimum(ld(sc.req.miss + k, m), ld(sc.req.cap + k, m))
        tl.store(sc.req.hits + k, hits, mask=m)
        any_hits += tl.sum(hits, axis=0)
        i += mc.BLOCK
    tl.debug_barrier()
    offs = tl.arange(0, pc.BLOCK)
    for phase in tl.static_range(3):  # first hitter; count; scratch back to idle
        if any_hits > 0:
            i = 0
            while i < num_lookups:
                k, t, r, m = hit_item(ms, mc, nb, num_lookups, i + offs)
                for g in tl.static_range(mc.G):
                    b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
                    if phase == 0:
                        tl.atomic_min(ps.s_first + b, k, mask=m)
                    elif phase == 1:
                        z = m & (ld(ps.ref_cnt + b, m) == 0) & (ld(ps.s_first + b, m) == k)
                        tl.atomic_add(sc.req.zref + k, 1, mask=z)
                    else:
                        tl.store(ps.s_first + b, tl.full([pc.BLOCK], BIG, tl.int32), mask=m)
                i += pc.BLOCK
            tl.debug_barrier()
    return any_hits > 0


@triton.jit
def group_start(ms, mc: tl.constexpr, g: tl.constexpr, r, m, cached0, hits):
    """The first block of group ``g`` that ``cache_blocks`` keys: its cached count (group 0's read
    already, as ``cached0``), at least the hits."""
    if g == 0:
        cached = cached0
    else:
        cached = ld(ms.num_cached + g * mc.R + r, m)
    return tl.maximum(cached, hits)


@triton.jit
def group_released(ms, mc: tl.constexpr, j, m):
    """Blocks that left the window of (request, group) ``j``: ``row[lead:nskip]`` (scan_tile)."""
    sc = scratch_views(ms, mc)
    return ld(sc.grp.nskip + j, m) - ld(sc.grp.lead + j, m)


@triton.jit
def plan_requests(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, nb, num_free, unreserved, any_hits,
                  SCAN: tl.constexpr):
    """Per request: tokens and new blocks (``get_num_blocks_to_allocate``), pop and zero-ref offsets,
    the blocks ``cache_blocks`` keys per group (offsets of the flattened caching), and the first
    request of each conflict kind. ``SCAN`` (a batch without lookups: no hits): each tile is scanned
    here (:func:`scan_tile`) instead of read back from ``scan_requests``' scratch, one pass fewer.
    Returns (pops, zero-ref hits, keyed blocks, first failure, first SW conflict, first request whose
    pops could reach blocks released in the batch, first partial key, released, first SW release
    conflict, first prepend request); the last three only with ``SCAN`` (else 0 and BIG).
    ``unreserved``: ``num_free`` less the reserved total (the admission check's room)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    pcarry = tl.zeros([], tl.int32)
    zcarry = tl.zeros([], tl.int32)
    dcarry = tl.zeros([], tl.int64)
    xcarry = tl.zeros([], tl.int64)
    any_reserved = unreserved < num_free  # some reservation held (a decode step without any skips their pass)
    ccarry = tl.zeros([], tl.int32)
    rcarry = tl.zeros([], tl.int32)
    fail = tl.full([], BIG, tl.int32)
    sw = tl.full([], BIG, tl.int32)
    reach_first = tl.full([], BIG, tl.int32)
    partial = tl.full([], BIG, tl.int32)
    rel_total, sw_bad, pre_first = no_releases()
    i = 0
    while i < nb:
        k = i + offs
        m = k < nb
        if SCAN:
            r, nt, tg, nblk, nhash, _, rel, bad, pre = scan_tile(ps, pc, ms, mc, batch, k, m, False)
            hits = tl.zeros_like(k)
            zref = tl.zeros_like(k)
            if mc.SW:
                rel_total, sw_bad, pre_first = fold_releases(rel_total, sw_bad, pre_first, rel, bad, pre, k)
                tl.debug_barrier()  # the windows' fields are read back below
        else:
            r = ld(sc.req.slot + k, m)
            nt = ld(batch.num_tokens + k, m)
            tg = ld(batch.target + k, m)
            hits = ld(sc.req.hits + k, m)
            nblk = ld(sc.req.nblk + k, m)
            rel = ld(sc.req.rel + k, m)
            zref = ld(sc.req.zref + k, m)
            nhash = ld(ms.num_hashes + r, m)
        cached0 = ld(ms.num_cached + r, m)  # group 0's, read beside the others (loads before stores)
        own = tl.zeros([mc.BLOCK], tl.int32)
        if any_reserved:
            own = ld(ms.reserved + r, m)
        eff = tl.maximum(tg, hits * mc.BS)
        need = tl.where(m, tl.maximum((eff + mc.BS - 1) // mc.BS - nblk - hits, 0), 0)
        pops = need * mc.G
        cpops = tl.cumsum(pops, axis=0)
        # the admission check, every earlier request admitted: what each takes off the free queue
        # beyond its own reservation (docs/semantics.md section 8), less the releases, summed, fits
        # the free blocks nobody reserved: sum(max(demand - reserved, 0) - released) <= unreserved
        if SCAN and (not mc.SW):  # no hits and no releases: the demand is the pops
            if any_reserved:
                x = tl.maximum(pops - own, 0).to(tl.int64)
                fail = first_index(fail, m & (xcarry + tl.cumsum(x, axis=0) > unreserved), k)
                xcarry += tl.sum(x, axis=0)
            else:  # own == 0: the same check without the reservations' pass
                fail = first_index(fail, m & ((pcarry + cpops).to(tl.int64) > num_free), k)
        else:
            d = (tl.maximum(pops + zref - own, 0) - rel).to(tl.int64)
            fail = first_index(fail, m & (dcarry + tl.cumsum(d, axis=0) > unreserved), k)
            dcarry += tl.sum(d, axis=0)
            # pops never reach blocks released to the tail in this batch (a conflict only if any is)
            reach = (pcarry + zcarry + tl.cumsum(pops + zref, axis=0)).to(tl.int64) > num_free
            reach_first = first_index(reach_first, m & (reach | (hits > 0)), k)
        if not SCAN:
            sw = first_index(sw, m & (rel > 0) & any_hits, k)
            tl.store(sc.req.zoff + k, zcarry + tl.cumsum(zref, axis=0) - zref, mask=m)
            zcarry += tl.sum(zref, axis=0)
        # cache_blocks: per group blocks [start, nf) get keys
        known = tl.minimum(eff, nt)
        nf = tl.minimum(known // mc.BS, nhash // mc.K)
        csize = tl.zeros_like(k)
        rsize = tl.zeros_like(k)
        for g in tl.static_range(mc.G):
            start = group_start(ms, mc, g, r, m, cached0, hits)
            tl.store(sc.grp.start + k * mc.G + g, start, mask=m)
            if pc.CACHING:
                csize += tl.where(m, tl.maximum(nf - start, 0), 0)
            if mc.SW:
                rsize += group_released(ms, mc, k * mc.G + g, m)
        if pc.CACHING and (mc.K > 1):
            hbs = mc.BS // mc.K
            nh = tl.minimum(known // hbs, nhash)
            partial = first_index(partial, m & (nh * hbs > nf * mc.BS) & (nf < nblk + hits + need), k)
        # per (request, group) offsets: earlier requests' totals, then earlier groups'
        cbase = ccarry + tl.cumsum(csize, axis=0) - csize
        rbase = rcarry
        if mc.SW:
            rbase += tl.cumsum(rsize, axis=0) - rsize
        for g in tl.static_range(mc.G):
            j = k * mc.G + g
            tl.store(sc.grp.coff + j, cbase, mask=m)
            tl.store(sc.grp.reloff + j, rbase, mask=m)
            tl.store(sc.grp.rm + j, tl.zeros_like(k), mask=m)
            tl.store(sc.grp.st + j, tl.zeros_like(k), mask=m)
            if pc.CACHING:
                cbase += tl.where(m, tl.maximum(nf - group_start(ms, mc, g, r, m, cached0, hits), 0), 0)
            if mc.SW:
                rbase += group_released(ms, mc, j, m)
        if SCAN:
            scan_store(ms, mc, k, m, r, nblk, tl.zeros_like(k), rel)
            tl.store(sc.req.hits + k, hits, mask=m)
        tl.store(sc.req.need + k, need, mask=m)
        tl.store(sc.req.eff + k, eff, mask=m)
        tl.store(sc.req.popoff + k, pcarry + cpops - pops, mask=m)
        tl.store(sc.req.nf + k, nf, mask=m)
        if any_reserved:
            take = tl.minimum(own, pops + zref)  # drawn from its own reservation first, if admitted
            tl.store(sc.req.rleft + k, own - take, mask=m)
            tl.store(sc.req.take + k, take, mask=m)
        pcarry += tl.sum(pops, axis=0)
        ccarry += tl.sum(csize, axis=0)
        if mc.SW:
            rcarry += tl.sum(rsize, axis=0)
        i += mc.BLOCK
    tl.store(sc.req.popoff + nb, pcarry)
    tl.store(sc.grp.coff + nb * mc.G, ccarry)
    tl.store(sc.grp.reloff + nb * mc.G, rcarry)
    return pcarry, zcarry, ccarry, fail, sw, reach_first, partial, rel_total, sw_bad, pre_first


@triton.jit
def cache_item(ms, mc: tl.constexpr, nseg, f, m):
    """(segment, request, group, slot, block position) of flattened caching items ``f``."""
    sc = scratch_views(ms, mc)
    j = ld(sc.maps.cache + f, m)
    k = j // mc.G
    g = j % mc.G
    pos = ld(sc.grp.start + j, m) + f - ld(sc.grp.coff + j, m)
    return j, k, g, ld(sc.req.slot + k, m), pos


@triton.jit
def scan_cached(ps, pc: tl.constexpr, ms, mc: tl.constexpr, nb, num_items, use_filter):
    """Per (request, group): the old keys that caching removes and the keys it stores (event rows);
    with ``use_filter``, each stored key's request into the batch's key filter (``atomic_min``).
    Returns the old keys removed by all ``nb`` requests (a bound for any prefix of them)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    removed = tl.zeros([], tl.int32)
    i = 0
    while i < num_items:
        f = i + offs
        m = f < num_items
        j, k, g, r, pos = cache_item(ms, mc, nb * mc.G, f, m)
        pre = m & (pos < ld(sc.req.nblk + k, m))  # blocks the row held before (else: popped now)
        b = tl.load(row_of(ms, mc, g, r) + pos, mask=pre, other=0)
        act = m & ((pre == 0) | ((b != 0) & (pos >= ld(sc.grp.nskip + j, m))))
        tl.atomic_add(sc.grp.st + j, 1, mask=act)
        nk = ld(ps.num_keys + b, act & pre)
        tl.atomic_add(sc.grp.rm + j, nk, mask=act & pre)
        removed += tl.sum(nk, axis=0)
        if use_filter:
            ka = keys_of(mc, g, r) + (pos + 1).to(tl.int64) * mc.K - 1
            tl.atomic_min(ms.s_filter + key_home(ld(ms.req_lo + ka, act), g, mc.FS), k, mask=act)
        i += pc.BLOCK
    tl.debug_barrier()
    return removed


@triton.jit
def first_cached_miss(ms, mc: tl.constexpr, nb):
    """The first request whose first lookup miss is a key an earlier request of the batch caches
    (then its sequential lookup would hit further)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    first = tl.full([], BIG, tl.int32)
    i = 0
    while i < nb:
        k = i + offs
        m = k < nb
        t = ld(sc.req.miss + k, m)
        m = m & (t < ld(sc.req.cap + k, m))
        r = ld(sc.req.slot + k, m)
        for g in tl.static_range(mc.G):
            ka = keys_of(mc, g, r) + (t + 1).to(tl.int64) * mc.K - 1
            s = ld(ms.s_filter + key_home(ld(ms.req_lo + ka, m), tl.zeros_like(k) + g, mc.FS), m)
            first = first_index(first, m & (s < k), k)
        i += mc.BLOCK
    return first


@triton.jit
def first_popped_hit(ps, pc: tl.constexpr, ms, mc: tl.constexpr, nb, num_lookups, limit):
    """The first request with a zero-ref hit that an earlier request's pops could take: the block's
    rank among the queue's live blocks is below that request's earlier pops plus earlier unlinks
    (conservative). Ranks of the first ``limit`` live blocks go to ``s_last`` and back to -1."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    head = tl.load(ps.ctrl + HEAD)
    tail = tl.load(ps.ctrl + TAIL)
    first = tl.full([], BIG, tl.int32)
    for phase in tl.static_range(2):
        taken = tl.zeros([], tl.int64)
        p = head
        while (taken < limit) & (p < tail):
            pos = p + offs
            v = tl.load(ps.ring + (pos & (pc.C - 1)), mask=pos < tail, other=-1)
            live = v >= 0
            rank = tl.cumsum(live.to(tl.int64), axis=0) + taken - 1
            keep = live & (rank < limit)
            if phase == 0:
                tl.store(ps.s_last + v, rank.to(tl.int32), mask=keep)
            else:
                tl.store(ps.s_last + v, tl.full([pc.BLOCK], -1, tl.int32), mask=keep)
            taken += tl.sum(live.to(tl.int64), axis=0)
            p += pc.BLOCK
        tl.debug_barrier()
        if phase == 0:
            i = 0
            while i < num_lookups:
                f = i + offs
                m = f < num_lookups
                k, t, r = lookup_item(ms, mc, nb, f, m)
                m = m & (t < ld(sc.req.hits + k, m))
                before = ld(sc.req.popoff + k, m) + ld(sc.req.zoff + k, m)
                for g in tl.static_range(mc.G):
                    b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
                    rank = tl.load(ps.s_last + b, mask=m, other=-1)
                    first = first_index(first, m & (rank >= 0) & (rank < before), k)
                i += pc.BLOCK
            tl.debug_barrier()
    return first


# ---- commit of requests [0, split) -------------------------------------------------------------

@triton.jit
def touch_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, nb, num_lookups):
    """Touch every group's hits: ref += 1 per occurrence; the lane that raised a 0 unlinks the block
    (order-free, like ``touch``). Returns the blocks unlinked."""
    offs = tl.arange(0, pc.BLOCK)
    unlinked = tl.zeros([], tl.int32)
    i = 0
    while i < num_lookups:
        k, t, r, m = hit_item(ms, mc, nb, num_lookups, i + offs)
        for g in tl.static_range(mc.G):
            b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
            old = tl.atomic_add(ps.ref_cnt + b, 1, mask=m)
            first = m & (old == 0)
            s = tl.load(ps.qslot + b, mask=first, other=0)
            tl.store(ps.ring + s, tl.full([pc.BLOCK], NO_SLOT, tl.int32), mask=first)
            tl.store(ps.qslot + b, tl.full([pc.BLOCK], NO_SLOT, tl.int32), mask=first)
            unlinked += tl.sum(first.to(tl.int32), axis=0)
        i += pc.BLOCK
    tl.debug_barrier()
    return unlinked


@triton.jit
def event_layout(ms, mc: tl.constexpr, split, ev0):
    """Event rows in request order: request k's evictions (its pops), then per group the caching's
    removed keys, one BlockStored header and its items. Writes the offsets; returns (the end row,
    the old keys the caching removes)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    ecarry = ev0
    qcarry = tl.zeros([], tl.int32)
    rmcarry = tl.zeros([], tl.int32)
    stcarry = tl.zeros([], tl.int32)
    i = 0
    while i < split:
        k = i + offs
        m = k < split
        evict = ld(sc.req.evict + k, m)
        nf = ld(sc.req.nf + k, m)
        rows = evict
        rm_k = tl.zeros_like(k)
        st_k = tl.zeros_like(k)
        for g in tl.static_range(mc.G):
            j = k * mc.G + g
            rm = ld(sc.grp.rm + j, m)
            st = ld(sc.grp.st + j, m)
            rows += tl.where(m & (nf > ld(sc.grp.start + j, m)), 1 + rm + st, 0)
            rm_k += rm
            st_k += st
        base = ecarry + tl.cumsum(rows, axis=0) - rows
        rmb = rmcarry + tl.cumsum(rm_k, axis=0) - rm_k
        stb = stcarry + tl.cumsum(st_k, axis=0) - st_k
        tl.store(sc.req.evbase + k, base, mask=m)
        tl.store(sc.req.qoff + k, qcarry + tl.cumsum(evict, axis=0) - evict, mask=m)
        base += evict
        for g in tl.static_range(mc.G):
            j = k * mc.G + g
            rm = ld(sc.grp.rm + j, m)
            st = ld(sc.grp.st + j, m)
            tl.store(sc.grp.ev + j, base, mask=m)
            tl.store(sc.grp.rmoff + j, rmb, mask=m)
            tl.store(sc.grp.stoff + j, stb, mask=m)
            base += tl.where(m & (nf > ld(sc.grp.start + j, m)), 1 + rm + st, 0)
            rmb += rm
            stb += st
        ecarry += tl.sum(rows, axis=0)
        qcarry += tl.sum(evict, axis=0)
        rmcarry += tl.sum(rm_k, axis=0)
        stcarry += tl.sum(st_k, axis=0)
        i += mc.BLOCK
    tl.store(sc.req.evbase + split, ecarry)
    tl.debug_barrier()
    return ecarry, rmcarry


@triton.jit
def pop_item(ms, mc: tl.constexpr, split, f, m):
    """(request, group, row position, slot) of popped blocks ``f``."""
    sc = scratch_views(ms, mc)
    k = ld(sc.maps.pop + f, m)
    o = f - ld(sc.req.popoff + k, m)
    need = tl.maximum(ld(sc.req.need + k, m), 1)
    pos = ld(sc.req.nblk + k, m) + ld(sc.req.hits + k, m) + o % need
    return k, o // need, pos, ld(sc.req.slot + k, m)


@triton.jit
def allocate_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, split, num_pops, head, tail, removed):
    """vLLM's ``allocate_new_blocks`` for requests [0, split): one popleft of all their blocks, the
    evictions' rows per request (events on), claims, and the blocks scattered into the rows.
    ``removed``: a bound on the old keys ``cache_all`` removes (``scan_cached``). Returns (the head,
    the old keys ``cache_all`` removes: exact with events on (``event_layout``), else ``removed``)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    new_head = ring_scan_pop(ps, pc, head, tail, ms.s_ids, 0, num_pops)
    segment_ids(sc.req.popoff, split, num_pops, sc.maps.pop, pc.BLOCK)
    if pc.EVENTS:
        if pc.CACHING:
            i = 0
            while i < num_pops:
                f = i + offs
                m = f < num_pops
                b = tl.load(ms.s_ids + f, mask=m, other=0)
                k = ld(sc.maps.pop + f, m)
                tl.atomic_add(sc.req.evict + k, ld(ps.num_keys + b, m), mask=m)
                i += pc.BLOCK
            tl.debug_barrier()
        _, removed = event_layout(ms, mc, split, tl.load(ps.ctrl + EV_COUNT).to(tl.int32))
    carry = tl.zeros([], tl.int32)
    reuse_pos = tl.load(ps.ctrl + REUSE_COUNT)
    i = 0
    while i < num_pops:
        f = i + offs
        m = f < num_pops
        b = tl.load(ms.s_ids + f, mask=m, other=0)
        k, g, pos, r = pop_item(ms, mc, split, f, m)
        ev = tl.zeros_like(f)
        if pc.EVENTS:
            ev = ld(sc.req.evbase + k, m) - ld(sc.req.qoff + k, m) + carry
        dropped, reuse_pos = claim_tile(ps, pc, b, m, ev, reuse_pos)
        carry += dropped.to(tl.int32)
        tl.store(row_of(ms, mc, g, r) + pos, b, mask=m)
        i += pc.BLOCK
    tl.debug_barrier()  # strict: orders the read of REUSE_COUNT above before this store
    tl.store(ps.ctrl + REUSE_COUNT, reuse_pos)
    tl.debug_barrier()
    return new_head, removed


@triton.jit
def released_item(ms, mc: tl.constexpr, f, m):
    """Row pointer of flattened released blocks ``f``: segment (k, g) is ``row[lead:nskip]`` reversed
    (segments of the items in the lookup map, free once lookups are done)."""
    sc = scratch_views(ms, mc)
    j = ld(sc.maps.lookup + f, m)
    r = ld(sc.req.slot + j // mc.G, m)
    pos = ld(sc.grp.nskip + j, m) - 1 - (f - ld(sc.grp.reloff + j, m))
    return row_of(ms, mc, j % mc.G, r) + pos


@triton.jit
def remove_skipped_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, split, head, tail):
    """vLLM's ``remove_skipped_blocks`` for requests [0, split) as one batched free: segment (k, g)
    is the blocks that left group g's window, tail first; then nulls in the rows. Returns (head, tail,
    released)."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    nseg = split * mc.G
    n = tl.load(sc.grp.reloff + nseg)
    segment_ids(sc.grp.reloff, nseg, n, sc.maps.lookup, pc.BLOCK)
    i = 0
    while i < n:
        f = i + offs
        m = f < n
        tl.store(ms.s_ids + f, tl.load(released_item(ms, mc, f, m), mask=m, other=0), mask=m)
        i += pc.BLOCK
    tl.debug_barrier()
    count_ids(ps, ms.s_ids, n, pc.BLOCK)
    tl.debug_barrier()
    nf, nl, _, _ = release_scan(ps, pc, ms.s_ids, n, ms.s_pf, sc.maps.pop, True)
    tl.debug_barrier()
    tail = ring_make_room(ps, pc, head, tail, nf + nl)
    tail = release_place(ps, pc, ms.s_ids, n, ms.s_pf, sc.maps.pop, sc.grp.reloff,
                         sc.maps.lookup, head, tail, nf, True, True)
    tl.debug_barrier()
    reset_ids(ps, ms.s_ids, n, pc.N, pc.BLOCK)
    i = 0
    while i < n:
        f = i + offs
        m = f < n
        tl.store(released_item(ms, mc, f, m), tl.zeros([pc.BLOCK], tl.int32), mask=m)
        i += pc.BLOCK
    tl.debug_barrier()
    return head - nf, tail, nf + nl


@triton.jit
def cache_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, split, seq0, removed):
    """vLLM's ``cache_blocks`` for requests [0, split), flattened over (request, group, block): old
    keys removed, one BlockStored header per range, keys with sequence numbers in request order.
    ``removed``: the old keys (``event_layout``, or a bound from ``scan_cached`` with events off);
    with none, as in a decode step whose newly full blocks were never keyed, the removal pass is
    skipped. Returns the keys stored."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, pc.BLOCK)
    nseg = split * mc.G
    n = tl.load(sc.grp.coff + nseg)
    if pc.EVENTS:
        i = 0
        while i < nseg:  # headers, also of ranges holding only null blocks
            j = i + offs
            m = j < nseg
            k = j // mc.G
            g = j % mc.G
            r = ld(sc.req.slot + k, m)
            start = ld(sc.grp.start + j, m)
            m = m & (ld(sc.req.nf + k, m) > start)
            pa = m & (start > 0)
            ka = keys_of(mc, g, r) + start.to(tl.int64) * mc.K - 1
            write_stored_header(ps.ev, ld(sc.grp.ev + j, m) + ld(sc.grp.rm + j, m), pa.to(tl.int64),
                                ld(ms.req_hi + ka, pa), ld(ms.req_lo + ka, pa), g.to(tl.int64), mc.BS, m)
            i += pc.BLOCK
    stored = tl.zeros([], tl.int32)
    for phase in tl.static_range(2):  # old keys out, then new keys in
        carry = tl.zeros([], tl.int32)
        n_phase = n
        if phase == 0:
            n_phase = tl.where(removed > 0, n, 0)
        i = 0
        while i < n_phase:
            f = i + offs
            m = f < n
            j, k, g, r, pos = cache_item(ms, mc, nseg, f, m)
            b = tl.load(row_of(ms, mc, g, r) + pos, mask=m, other=0)
            act = m & (b != 0)
            if phase == 0:
                ev = tl.zeros_like(f)
                if pc.EVENTS:
                    ev = ld(sc.grp.ev + j, m) - ld(sc.grp.rmoff + j, m) + carry
                carry += drop_keys(ps, pc, b, act, ev).to(tl.int32)
            else:
                a = act.to(tl.int32)
                rank = carry + tl.cumsum(a, axis=0) - a
                ka = keys_of(mc, g, r) + (pos + 1).to(tl.int64) * mc.K - 1
                hi = ld(ms.req_hi + ka, act)
                lo = ld(ms.req_lo + ka, act)
                g64 = g.to(tl.int64)
                put_key(ps, pc, b, 0, hi, lo, g64, seq0 + rank, (pos + 1).to(tl.int64) * mc.BS, act)
                tl.store(ps.num_keys + b, tl.full([pc.BLOCK], 1, tl.int32), mask=act)
                if pc.EVENTS:
                    ev = ld(sc.grp.ev + j, m) + ld(sc.grp.rm + j, m) + 1 + rank - \
                        ld(sc.grp.stoff + j, m)
                    write_stored_item(ps.ev, ev, b, hi, lo, g64, act)
                carry += tl.sum(a, axis=0)
            i += pc.BLOCK
        tl.debug_barrier()
        stored = carry
    return stored


@triton.jit
def finish_requests(ms, mc: tl.constexpr, batch, split, any_reserved, CACHING: tl.constexpr):
    """Row lengths, computed and cached counts and ``admitted`` of requests [0, split), and, when
    ``any_reserved`` (a scalar flag: some reservation held, so ``plan_requests`` stored the fields),
    each one's reservation less the blocks it took off the free queue (pops and zero-ref hits, drawn
    from it first). Returns the blocks drawn from reservations."""
    sc = scratch_views(ms, mc)
    offs = tl.arange(0, mc.BLOCK)
    drawn = tl.zeros([], tl.int32)
    i = 0
    while i < split:
        k = i + offs
        m = k < split
        r = ld(sc.req.slot + k, m)
        hits = ld(sc.req.hits + k, m)
        nf = ld(sc.req.nf + k, m)
        nblk = ld(sc.req.nblk + k, m)
        need = ld(sc.req.need + k, m)
        eff = ld(sc.req.eff + k, m)
        tl.store(ms.num_blocks + r, nblk + hits + need, mask=m)
        tl.store(ms.num_computed + r, eff, mask=m)
        tl.store(batch.admitted + k, tl.full([mc.BLOCK], 1, tl.int32), mask=m)
        if any_reserved:
            tl.store(ms.reserved + r, ld(sc.req.rleft + k, m), mask=m)
            drawn += tl.sum(ld(sc.req.take + k, m), axis=0)
        for g in tl.static_range(mc.G):
            start = ld(sc.grp.start + k * mc.G + g, m)
            if CACHING:
                start = tl.maximum(start, nf)
            tl.store(ms.num_cached + g * mc.R + r, start, mask=m)
        i += mc.BLOCK
    return drawn


@triton.jit
def allocate_slots_parallel_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, FORCE_EXACT: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_parallel` of a batch it checks itself."""
    allocate_slots_parallel(ps, pc, ms, mc, batch, cap, FORCE_EXACT, None, 0, False)


@triton.jit
def allocate_slots_parallel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, FORCE_EXACT: tl.constexpr,
                            checked, num, NO_LOOKUP: tl.constexpr):
    """``allocate_slots`` of ``batch.num_reqs[0]`` requests (AllocateBatch, see kernels/requests/exact.py):
    validate the whole batch (errors set the status word and change nothing), analyse every request
    in parallel, commit requests ``[0, split)`` and leave ``ctrl[ALLOC_SPLIT] = split`` for the exact
    path (module docstring). ``FORCE_EXACT``: split 0 (tests). ``checked`` (None, or a scalar flag): a
    decode step's batch, already checked (and ``admitted`` zeroed) by ``check_step`` earlier in the
    same program, the flag saying whether the step may go on and ``num`` its request count.
    ``NO_LOOKUP``: the batch's ``lookup`` flags are all 0 (a decode step), so no pass for lookups
    runs. Returns the split (0 on an error)."""
    sc = scratch_views(ms, mc)
    split = tl.zeros([], tl.int32)
    if checked is None:
        nb, err = check_allocate_batch(ps, pc, ms, mc, batch, cap)
    else:
        nb = num
        err = tl.where(checked, 0, E_INVALID_ARG)
    if err == 0:
        num_free = tl.load(ps.ctrl + NUM_FREE)
        resv_total = tl.load(ms.num_reserved)
        unreserved = num_free - resv_total.to(tl.int64)
        key_seq = tl.load(ps.ctrl + KEY_SEQ)
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        if NO_LOOKUP:
            num_lookups = tl.zeros([], tl.int32)
            any_hits = num_lookups > 0
            num_pops, num_zref, num_items, fail, sw, reach, partial, rel_total, sw_bad, pre_first = \
                plan_requests(ps, pc, ms, mc, batch, nb, num_free, unreserved, any_hits, True)
        else:
            num_lookups, rel_total, sw_bad, pre_first = scan_requests(ps, pc, ms, mc, batch, nb)
            tl.debug_barrier()
            if num_lookups > 0:
                segment_ids(sc.req.loff, nb, num_lookups, sc.maps.lookup, pc.BLOCK)
                find_hits(ps, pc, ms, mc, nb, num_lookups)
            any_hits = count_zero_ref_hits(ps, pc, ms, mc, nb, num_lookups)
            num_pops, num_zref, num_items, fail, sw, reach, partial, _, _, _ = \
                plan_requests(ps, pc, ms, mc, batch, nb, num_free, unreserved, any_hits, False)
        tl.debug_barrier()
        segment_ids(sc.grp.coff, nb * mc.G, num_items, sc.maps.cache, pc.BLOCK)
        sw = tl.minimum(sw, sw_bad)
        if rel_total > 0:  # pops that reach blocks released to the tail in this batch
            sw = tl.minimum(sw, reach)
        if pre_first < BIG:  # an un-hashed release goes to the head: no pops after it
            if num_pops > tl.load(sc.req.popoff + pre_first):
                sw = tl.minimum(sw, pre_first)
        prefix = tl.full([], BIG, tl.int32)
        if num_lookups > 0:
            offs = tl.arange(0, mc.BLOCK)
            i = 0
            while i < mc.FS:
                tl.store(ms.s_filter + i + offs, tl.full([mc.BLOCK], BIG, tl.int32), mask=(i + offs) < mc.FS)
                i += mc.BLOCK
            tl.debug_barrier()
        removed = scan_cached(ps, pc, ms, mc, nb, num_items, num_lookups > 0)
        if num_lookups > 0:
            prefix = first_cached_miss(ms, mc, nb)
            if num_zref > 0:
                prefix = tl.minimum(prefix, first_popped_hit(ps, pc, ms, mc, nb, num_lookups, num_pops + num_zref))
        split = tl.minimum(tl.minimum(tl.minimum(fail, sw), tl.minimum(prefix, partial)), nb)
        reason = tl.where(split == fail, R_OUT_OF_BLOCKS,
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
        if split > 0:
            unlinked = tl.zeros([], tl.int32)
            if num_lookups > 0:
                unlinked = touch_hits(ps, pc, ms, mc, split, tl.load(sc.req.loff + split))
            pops = num_pops
            if split < nb:
                pops = tl.load(sc.req.popoff + split)
            head, removed = allocate_all(ps, pc, ms, mc, split, pops, head, tail, removed)
            released = tl.zeros([], tl.int32)
            if mc.SW:
                if tl.load(sc.grp.reloff + split * mc.G) > 0:
                    head, tail, released = remove_skipped_all(ps, pc, ms, mc, split, head, tail)
            stored = tl.zeros([], tl.int32)
            if pc.CACHING:
                stored = cache_all(ps, pc, ms, mc, split, key_seq, removed)
            drawn = finish_requests(ms, mc, batch, split, resv_total > 0, pc.CACHING)
            tl.store(ms.num_reserved, resv_total - drawn)
            tl.store(ps.ctrl + HEAD, head)
            tl.store(ps.ctrl + TAIL, tail)
            tl.store(ps.ctrl + NUM_FREE, num_free + released - pops - unlinked)
            tl.store(ps.ctrl + KEY_SEQ, key_seq + stored)
            if pc.EVENTS:
                tl.store(ps.ctrl + EV_COUNT, tl.load(sc.req.evbase + split))
    return split


def launch_allocate_slots_parallel(ps, pc, ms, mc, batch, *, force_exact: bool = False):
    """Launch ``allocate_slots_parallel_kernel`` (one program)."""
    allocate_slots_parallel_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), FORCE_EXACT=bool(force_exact),
                                         num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
