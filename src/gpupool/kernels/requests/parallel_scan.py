"""The request-parallel ``allocate_slots``' analysis (docs/algorithms.md section 6): per request the
slot, lookups, releases, new blocks and blocks to key, their prefix-sum offsets into scratch
(``parallel_scratch``), and the first request of each kind of order dependence. Nothing here changes
pool or manager state (``parallel_commit`` does, for requests ``[0, split)``).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..common import first_index, lanes, ld
from ..groups import block_hit, num_skipped_blocks, windowed, windowed_hit
from ..keytable import key_home, lookup_blocks
from ..layout import BIG, HEAD, TAIL
from ..release import to_front
from .rows import keys_of, row_of
from .steps import get_num_blocks_to_allocate, max_cache_hit_length


class TileScan(NamedTuple):
    """One tile of requests as :func:`scan_tile` reads it (each a tile of ``mc.BLOCK`` lanes)."""

    slot: tl.tensor
    num_tokens: tl.tensor
    target: tl.tensor
    nblk: tl.tensor  # row length
    nhash: tl.tensor  # known hashes
    cap: tl.tensor  # positions the lookup may hit
    rel: tl.tensor  # sliding-window blocks released
    sw_bad: tl.tensor  # a released block another request shares (ref != 1)
    prepend: tl.tensor  # a release that goes to the queue's head (un-hashed)


class Releases(NamedTuple):
    """The batch's sliding-window releases: blocks released, the first request releasing a shared
    block, the first releasing an un-hashed one (BIG: none)."""

    total: tl.tensor
    sw_bad: tl.tensor
    prepend: tl.tensor


class Plan(NamedTuple):
    """:func:`plan_requests`' totals and first conflicts (BIG: none), over the requests planned so far
    (its carry from tile to tile)."""

    pops: tl.tensor  # blocks popped by the requests
    zref: tl.tensor  # zero-ref hits
    items: tl.tensor  # blocks to key
    demand: tl.tensor  # the admission check's demand (int64; admission_check)
    released: tl.tensor  # blocks the skip rules release
    fail: tl.tensor  # first request that does not fit
    sw: tl.tensor  # first release in a batch with hits
    reach: tl.tensor  # first request whose pops could reach blocks released in the batch
    partial: tl.tensor  # first partial-block key
    rels: Releases


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


@triton.jit
def scan_tile(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, k, m, LOOKUP: tl.constexpr):
    """One tile of requests ``k`` (lanes ``m``), read: slot, token count and target, row length, known
    hashes, lookup cap and the sliding-window releases (their fields into scratch). Every load comes
    before any store, so no load waits behind a store of a loaded value (:func:`scan_store` writes
    the rest). Returns a :class:`TileScan`."""
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
        cap = tl.where(look & (nblk == 0), max_cache_hit_length(nt, nhash, BS=mc.BS, K=mc.K), 0)
    rel = tl.zeros_like(k)
    bad = m & False
    pre = m & False
    if mc.SW:
        ncomp = ld(ms.num_computed + r, m)
        for g in tl.static_range(mc.G):
            row = row_of(ms, mc, g, r)
            nskip = tl.where(m, num_skipped_blocks(ncomp, tl.load(ms.kinds + g), tl.load(ms.windows + g), mc.BS, nblk),
                             0)
            lead = leading_nulls(row, nskip, m, mc.M)
            tl.store(sc.grp.nskip + k * mc.G + g, nskip, mask=m)
            tl.store(sc.grp.lead + k * mc.G + g, lead, mask=m)
            rel += nskip - lead
            t = 0
            most = tl.max(nskip - lead, axis=0)
            while t < most:  # the released blocks (usually none or one per request)
                a = m & (lead + t < nskip)
                b = tl.load(row + lead + t, mask=a, other=0)
                bad = bad | (a & (ld(ps.ref_cnt + b, a) != 1))  # shared: release_flags' count != ref
                pre = pre | to_front(ps, pc, b, a)
                t += 1
    return TileScan(r, nt, tg, nblk, nhash, cap, rel, bad, pre)


@triton.jit
def scan_store(mc: tl.constexpr, sc, k, m, r, nblk, cap, rel):
    """The per-request fields of :func:`scan_tile` into scratch; the lookup's fields reset."""
    zero = tl.zeros([mc.BLOCK], tl.int32)
    tl.store(sc.req.slot + k, r, mask=m)
    tl.store(sc.req.nblk + k, nblk, mask=m)
    tl.store(sc.req.cap + k, cap, mask=m)
    tl.store(sc.req.miss + k, tl.full([mc.BLOCK], BIG, tl.int32), mask=m)
    if mc.CHUNKED:
        tl.store(sc.req.cmiss + k, tl.full([mc.BLOCK], BIG, tl.int32), mask=m)
    tl.store(sc.req.zref + k, zero, mask=m)
    tl.store(sc.req.evict + k, zero, mask=m)
    tl.store(sc.req.rel + k, rel, mask=m)
    if not mc.SW:
        for g in tl.static_range(mc.G):
            tl.store(sc.grp.nskip + k * mc.G + g, zero, mask=m)
            tl.store(sc.grp.lead + k * mc.G + g, zero, mask=m)


@triton.jit
def no_releases():
    """The start of a :func:`fold_releases`: none released."""
    return Releases(tl.zeros([], tl.int32), tl.full([], BIG, tl.int32), tl.full([], BIG, tl.int32))


@triton.jit
def fold_releases(rels, ts, k):
    """Fold one :func:`scan_tile` ``ts`` of requests ``k`` into :class:`Releases` ``rels``."""
    return Releases(rels.total + tl.sum(ts.rel, axis=0), first_index(rels.sw_bad, ts.sw_bad, k),
                    first_index(rels.prepend, ts.prepend, k))


@triton.jit
def scan_requests(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb):
    """:func:`scan_tile` of every request, and the lookups' offsets. Returns (lookups, :class:`Releases`)."""
    lcarry = tl.zeros([], tl.int32)
    rels = no_releases()
    i = 0
    while i < nb:
        k, m = lanes(i, nb, mc.BLOCK)
        ts = scan_tile(ps, pc, ms, mc, sc, batch, k, m, True)
        scan_store(mc, sc, k, m, ts.slot, ts.nblk, ts.cap, ts.rel)
        tl.store(sc.req.loff + k, lcarry + tl.cumsum(ts.cap, axis=0) - ts.cap, mask=m)
        lcarry += tl.sum(ts.cap, axis=0)
        rels = fold_releases(rels, ts, k)
        i += mc.BLOCK
    tl.store(sc.req.loff + nb, lcarry)
    return lcarry, rels


@triton.jit
def lookup_item(sc, f, m):
    """(request, position, slot) of flattened lookup items ``f``."""
    k = ld(sc.maps.lookup + f, m)
    t = f - ld(sc.req.loff + k, m)
    return k, t, ld(sc.req.slot + k, m)


@triton.jit
def hit_item(sc, num_lookups, f):
    """Lookup item ``f`` as (request k, position t, slot r, whether it is one of k's hits)."""
    m = f < num_lookups
    k, t, r = lookup_item(sc, f, m)
    return k, t, r, m & (t < ld(sc.req.hits + k, m))


@triton.jit
def find_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, nb, num_lookups):
    """``find_longest_cache_hit`` of every request at once, flattened over (request, position): hit
    blocks into the rows, the prefix scan's first miss per request with ``atomic_min``
    (``kernels/groups.py`` ``block_hit``); with ``mc.CHUNKED`` then the windowed scan
    (:func:`find_windowed_hits`)."""
    i = 0
    while i < num_lookups:
        f, m = lanes(i, num_lookups, pc.BLOCK)
        k, t, r = lookup_item(sc, f, m)
        ok = m
        for g in tl.static_range(mc.G):
            ka = keys_of(mc, g, r) + (t + 1).to(tl.int64) * mc.K - 1
            grp = tl.zeros_like(t) + tl.load(ms.group_ids + g)
            blk = lookup_blocks(ps, pc, ld(ms.req_hi + ka, m), ld(ms.req_lo + ka, m), grp, m)
            tl.store(row_of(ms, mc, g, r) + t, blk, mask=m)
            ok = ok & block_hit(tl.load(ms.kinds + g), blk, mc.CHUNKED)
        tl.atomic_min(sc.req.miss + k, t, mask=m & ~ok)
        i += pc.BLOCK
    tl.debug_barrier()
    if mc.CHUNKED:
        find_windowed_hits(pc, ms, mc, sc, num_lookups)


@triton.jit
def find_windowed_hits(pc: tl.constexpr, ms, mc: tl.constexpr, sc, num_lookups):
    """The windowed groups' scan (``kernels/groups.py`` ``windowed_hit``) of every request at once over
    the positions its prefix scan accepted: their blocks before the hit's start become the null block
    in the rows, and their first miss after it goes to ``cmiss`` (``atomic_min``)."""
    i = 0
    while i < num_lookups:
        f, m = lanes(i, num_lookups, pc.BLOCK)
        k, t, r = lookup_item(sc, f, m)
        length = tl.minimum(ld(sc.req.miss + k, m), ld(sc.req.cap + k, m))
        for g in tl.static_range(mc.G):
            kind = tl.load(ms.kinds + g)
            if windowed(kind):
                row = row_of(ms, mc, g, r) + t
                null, miss = windowed_hit(kind, tl.load(ms.windows + g), t, ld(row, m), length, mc.BS)
                tl.store(row, tl.zeros_like(t), mask=m & null)
                tl.atomic_min(sc.req.cmiss + k, t, mask=m & miss)
        i += pc.BLOCK
    tl.debug_barrier()


@triton.jit
def first_miss(mc: tl.constexpr, sc, k, m):
    """Where request ``k``'s hit ends (``find_hits``): its prefix scan's first miss, or its windowed
    scan's (BIG: none)."""
    miss = ld(sc.req.miss + k, m)
    if mc.CHUNKED:
        miss = tl.minimum(miss, ld(sc.req.cmiss + k, m))
    return miss


@triton.jit
def count_zero_ref_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, nb, num_lookups):
    """Hits per request, and the zero-ref hits each request's admission check counts: hits on a
    block with ref 0 that no earlier request of the batch hits (its touch raises the count)."""
    offs = tl.arange(0, mc.BLOCK)
    any_hits = tl.zeros([], tl.int32)
    i = 0
    while i < nb:
        k = i + offs
        m = k < nb
        hits = tl.minimum(first_miss(mc, sc, k, m), ld(sc.req.cap + k, m))
        tl.store(sc.req.hits + k, hits, mask=m)
        any_hits += tl.sum(hits, axis=0)
        i += mc.BLOCK
    tl.debug_barrier()
    offs = tl.arange(0, pc.BLOCK)
    for phase in tl.static_range(3):  # first hitter; count; scratch back to idle
        if any_hits > 0:
            i = 0
            while i < num_lookups:
                k, t, r, m = hit_item(sc, num_lookups, i + offs)
                for g in tl.static_range(mc.G):
                    b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
                    mb = m
                    if mc.CHUNKED:  # a windowed group's null blocks are no hit blocks
                        mb = m & (b != 0)
                    if phase == 0:
                        tl.atomic_min(ps.s_first + b, k, mask=mb)
                    elif phase == 1:
                        z = mb & (ld(ps.ref_cnt + b, mb) == 0) & (ld(ps.s_first + b, mb) == k)
                        tl.atomic_add(sc.req.zref + k, 1, mask=z)
                    else:
                        tl.store(ps.s_first + b, tl.full([pc.BLOCK], BIG, tl.int32), mask=mb)
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
def group_released(sc, j, m):
    """Blocks that left the window of (request, group) ``j``: ``row[lead:nskip]`` (scan_tile)."""
    return ld(sc.grp.nskip + j, m) - ld(sc.grp.lead + j, m)


@triton.jit
def no_plan(rels):
    """The carry of :func:`plan_requests` before its first request: nothing planned, no conflict;
    ``rels``: the batch's releases so far (:class:`Releases`)."""
    zero = tl.zeros([], tl.int32)
    none = tl.full([], BIG, tl.int32)
    return Plan(zero, zero, zero, tl.zeros([], tl.int64), zero, none, none, none, none, rels)


@triton.jit
def plan_inputs(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, k, m, rels, SCAN: tl.constexpr):
    """A tile of requests ``k`` as :func:`plan_requests` reads it: scanned here with ``SCAN``
    (:func:`scan_tile`, no hits; its releases folded into ``rels``), else read back from
    ``scan_requests``' scratch (the scan's own fields, ``cap`` and the conflicts, left 0). Returns
    (the :class:`TileScan`, hits, zero-ref hits, rels)."""
    if SCAN:
        ts = scan_tile(ps, pc, ms, mc, sc, batch, k, m, False)
        hits = tl.zeros_like(k)
        zref = tl.zeros_like(k)
        if mc.SW:
            rels = fold_releases(rels, ts, k)
            tl.debug_barrier()  # the windows' fields are read back below
    else:
        r = ld(sc.req.slot + k, m)
        nt = ld(batch.num_tokens + k, m)
        tg = ld(batch.target + k, m)
        hits = ld(sc.req.hits + k, m)
        nblk = ld(sc.req.nblk + k, m)
        rel = ld(sc.req.rel + k, m)
        zref = ld(sc.req.zref + k, m)
        no = m & False
        ts = TileScan(r, nt, tg, nblk, ld(ms.num_hashes + r, m), tl.zeros_like(k), rel, no, no)
    return ts, hits, zref, rels


@triton.jit
def admission_check(plan, k, m, pops, cpops, zref, own, rel, hits, num_free, unreserved, any_reserved,
                    NO_HITS_NOR_RELEASES: tl.constexpr):
    """The admission check of a tile, every earlier request admitted (docs/semantics.md section 8):
    what each takes off the free queue beyond its own reservation, less its releases, summed, fits
    the free blocks nobody reserved: ``sum(max(pops + zref - own, 0) - rel) <= unreserved``. Without
    hits and releases the demand is the pops (and without reservations the check is on the pops'
    sum, ``num_free`` being ``unreserved``). Returns the first request that does not fit, the demand
    so far (int64) and the first whose pops could reach blocks released in the batch, or that hits."""
    fail = plan.fail
    demand = plan.demand
    reach_first = plan.reach
    if NO_HITS_NOR_RELEASES:
        if any_reserved:
            x = tl.maximum(pops - own, 0).to(tl.int64)
            fail = first_index(fail, m & (demand + tl.cumsum(x, axis=0) > unreserved), k)
            demand += tl.sum(x, axis=0)
        else:  # own == 0: the same check without the reservations' pass
            fail = first_index(fail, m & ((plan.pops + cpops).to(tl.int64) > num_free), k)
    else:
        d = (tl.maximum(pops + zref - own, 0) - rel).to(tl.int64)
        fail = first_index(fail, m & (demand + tl.cumsum(d, axis=0) > unreserved), k)
        demand += tl.sum(d, axis=0)
        # pops never reach blocks released to the tail in this batch (a conflict only if any is)
        reach = (plan.pops + plan.zref + tl.cumsum(pops + zref, axis=0)).to(tl.int64) > num_free
        reach_first = first_index(reach_first, m & (reach | (hits > 0)), k)
    return fail, demand, reach_first


@triton.jit
def caching_plan(pc: tl.constexpr, ms, mc: tl.constexpr, sc, k, m, r, cached0, hits, nf, items, released):
    """Per (request, group) of a tile: the first block ``cache_blocks`` keys (``start``), and the
    offsets of its blocks to key ``[start, nf)`` and of its released blocks into the flattened caching
    and release, after the earlier requests' ``items`` and ``released`` (request-major, group-minor).
    Returns the tile's blocks to key and released blocks per lane."""
    csize = tl.zeros_like(k)
    rsize = tl.zeros_like(k)
    for g in tl.static_range(mc.G):
        start = group_start(ms, mc, g, r, m, cached0, hits)
        tl.store(sc.grp.start + k * mc.G + g, start, mask=m)
        if pc.CACHING:
            csize += tl.where(m, tl.maximum(nf - start, 0), 0)
        if mc.SW:
            rsize += group_released(sc, k * mc.G + g, m)
    # per (request, group) offsets: earlier requests' totals, then earlier groups'
    cbase = items + tl.cumsum(csize, axis=0) - csize
    rbase = released
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
            rbase += group_released(sc, j, m)
    return csize, rsize


@triton.jit
def plan_requests(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, batch, nb, num_free, unreserved, any_hits,
                  rels, SCAN: tl.constexpr):
    """Per request: tokens and new blocks (``get_num_blocks_to_allocate``), pop and zero-ref offsets,
    the blocks ``cache_blocks`` keys per group (offsets of the flattened caching), and the first
    request of each conflict kind, tile by tile with the :class:`Plan` so far as the carry. ``SCAN`` (a
    batch without lookups: no hits): each tile is scanned here (:func:`plan_inputs`) instead of read
    back from ``scan_requests``' scratch, one pass fewer, and its releases folded into ``rels``
    (:class:`Releases`: ``scan_requests``' without ``SCAN``). ``unreserved``: ``num_free`` less the
    reserved total (the admission check's room). Returns the :class:`Plan` of all ``nb``."""
    any_reserved = unreserved < num_free  # some reservation held (a decode step without any skips their pass)
    plan = no_plan(rels)
    i = 0
    while i < nb:
        k, m = lanes(i, nb, mc.BLOCK)
        tile, hits, zref, rels = plan_inputs(ps, pc, ms, mc, sc, batch, k, m, plan.rels, SCAN)
        r = tile.slot
        cached0 = ld(ms.num_cached + r, m)  # group 0's, read beside the others (loads before stores)
        own = tl.zeros([mc.BLOCK], tl.int32)
        if any_reserved:
            own = ld(ms.reserved + r, m)
        alloc = get_num_blocks_to_allocate(tile.target, hits, zero_ref=zref, num_blocks=tile.nblk, G=mc.G,
                                           BS=mc.BS)
        need = tl.where(m, alloc.need, 0)
        pops = need * mc.G
        cpops = tl.cumsum(pops, axis=0)
        fail, demand, reach = admission_check(plan, k, m, pops, cpops, zref, own, tile.rel, hits, num_free,
                                              unreserved, any_reserved, SCAN and (not mc.SW))
        sw = plan.sw
        zcarry = plan.zref
        if not SCAN:
            sw = first_index(sw, m & (tile.rel > 0) & any_hits, k)
            tl.store(sc.req.zoff + k, zcarry + tl.cumsum(zref, axis=0) - zref, mask=m)
            zcarry += tl.sum(zref, axis=0)
        # cache_blocks: per group blocks [start, nf) get keys
        known = tl.minimum(alloc.eff, tile.num_tokens)
        nf = tl.minimum(known // mc.BS, tile.nhash // mc.K)
        partial = plan.partial
        if pc.CACHING and (mc.K > 1):
            hbs = mc.BS // mc.K
            nh = tl.minimum(known // hbs, tile.nhash)
            partial = first_index(partial, m & (nh * hbs > nf * mc.BS) & (nf < tile.nblk + hits + need), k)
        csize, rsize = caching_plan(pc, ms, mc, sc, k, m, r, cached0, hits, nf, plan.items, plan.released)
        if SCAN:
            scan_store(mc, sc, k, m, r, tile.nblk, tl.zeros_like(k), tile.rel)
            tl.store(sc.req.hits + k, hits, mask=m)
        tl.store(sc.req.need + k, need, mask=m)
        tl.store(sc.req.eff + k, alloc.eff, mask=m)
        tl.store(sc.req.popoff + k, plan.pops + cpops - pops, mask=m)
        tl.store(sc.req.nf + k, nf, mask=m)
        if any_reserved:
            take = tl.minimum(own, pops + zref)  # drawn from its own reservation first, if admitted
            tl.store(sc.req.rleft + k, own - take, mask=m)
            tl.store(sc.req.take + k, take, mask=m)
        released = plan.released
        if mc.SW:
            released += tl.sum(rsize, axis=0)
        plan = Plan(plan.pops + tl.sum(pops, axis=0), zcarry, plan.items + tl.sum(csize, axis=0), demand, released,
                    fail, sw, reach, partial, rels)
        i += mc.BLOCK
    tl.store(sc.req.popoff + nb, plan.pops)
    tl.store(sc.grp.coff + nb * mc.G, plan.items)
    tl.store(sc.grp.reloff + nb * mc.G, plan.released)
    return plan


@triton.jit
def cache_item(mc: tl.constexpr, sc, f, m):
    """(segment, request, group, slot, block position) of flattened caching items ``f``."""
    j = ld(sc.maps.cache + f, m)
    k = j // mc.G
    g = j % mc.G
    pos = ld(sc.grp.start + j, m) + f - ld(sc.grp.coff + j, m)
    return j, k, g, ld(sc.req.slot + k, m), pos


@triton.jit
def scan_cached(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, nb, num_items, use_filter):
    """Per (request, group): the old keys that caching removes and the keys it stores (event rows);
    with ``use_filter``, each stored key's request into the batch's key filter (``atomic_min``).
    Returns the old keys removed by all ``nb`` requests (a bound for any prefix of them)."""
    removed = tl.zeros([], tl.int32)
    i = 0
    while i < num_items:
        f, m = lanes(i, num_items, pc.BLOCK)
        j, k, g, r, pos = cache_item(mc, sc, f, m)
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
def first_cached_miss(ms, mc: tl.constexpr, sc, nb):
    """The first request whose first lookup miss (the prefix scan's, and with ``mc.CHUNKED`` the
    windowed scan's too) is a key an earlier request of the batch caches (then its sequential lookup
    would hit further)."""
    first = tl.full([], BIG, tl.int32)
    i = 0
    while i < nb:
        k, m = lanes(i, nb, mc.BLOCK)
        cap = ld(sc.req.cap + k, m)
        r = ld(sc.req.slot + k, m)
        for scan in tl.static_range(1 + mc.CHUNKED):
            if scan == 0:
                t = ld(sc.req.miss + k, m)
            else:
                t = ld(sc.req.cmiss + k, m)
            mt = m & (t < cap)
            for g in tl.static_range(mc.G):
                ka = keys_of(mc, g, r) + (t + 1).to(tl.int64) * mc.K - 1
                s = ld(ms.s_filter + key_home(ld(ms.req_lo + ka, mt), tl.zeros_like(k) + g, mc.FS), mt)
                first = first_index(first, mt & (s < k), k)
        i += mc.BLOCK
    return first


@triton.jit
def first_popped_hit(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, nb, num_lookups, limit):
    """The first request with a zero-ref hit that an earlier request's pops could take: the block's
    rank among the queue's live blocks is below that request's earlier pops plus earlier unlinks
    (conservative). Ranks of the first ``limit`` live blocks go to ``s_last`` and back to -1."""
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
                f, m = lanes(i, num_lookups, pc.BLOCK)
                k, t, r = lookup_item(sc, f, m)
                m = m & (t < ld(sc.req.hits + k, m))
                before = ld(sc.req.popoff + k, m) + ld(sc.req.zoff + k, m)
                for g in tl.static_range(mc.G):
                    b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
                    rank = tl.load(ps.s_last + b, mask=m, other=-1)
                    first = first_index(first, m & (rank >= 0) & (rank < before), k)
                i += pc.BLOCK
            tl.debug_barrier()
    return first
