"""The request-parallel ``allocate_slots``' commit of requests ``[0, split)`` (docs/algorithms.md
section 6): hits touched, one popleft of every new block, the sliding-window releases as one batched
free, ``cache_blocks`` flattened over (request, group, block), then the requests' counters. Offsets
come from the analysis (``parallel_scan``) through scratch (``parallel_scratch``); the pop and
caching maps are built by then.
"""
import triton
import triton.language as tl

from ..alloc import claim_tile
from ..common import lanes, ld, segment_ids
from ..events import write_stored_header, write_stored_item
from ..keytable import drop_keys, put_key
from ..layout import EV_COUNT, REUSE_COUNT
from ..queue import ring_make_room, ring_scan_pop
from ..release import count_ids, release_place, release_scan, reset_ids, touch_tile
from .parallel_scan import cache_item, hit_item
from .rows import keys_of, row_of


@triton.jit
def touch_hits(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, num_lookups):
    """Touch every group's hits: ref += 1 per occurrence; the lane that raised a 0 unlinks the block
    (order-free, as ``touch_checked`` in kernels/release.py). Returns the blocks unlinked."""
    offs = tl.arange(0, pc.BLOCK)
    unlinked = tl.zeros([], tl.int32)
    i = 0
    while i < num_lookups:
        k, t, r, m = hit_item(sc, num_lookups, i + offs)
        for g in tl.static_range(mc.G):
            b = tl.load(row_of(ms, mc, g, r) + t, mask=m, other=0)
            if mc.CHUNKED:  # a windowed group's null blocks are not touched
                unlinked += touch_tile(ps, b, m & (b != 0))
            else:
                unlinked += touch_tile(ps, b, m)
        i += pc.BLOCK
    tl.debug_barrier()
    return unlinked


@triton.jit
def event_layout(mc: tl.constexpr, sc, split, ev0):
    """Event rows in request order: request k's evictions (its pops), then per group the caching's
    removed keys, one BlockStored header and its items. Writes the offsets; returns (the end row,
    the old keys the caching removes)."""
    ecarry = ev0
    qcarry = tl.zeros([], tl.int32)
    rmcarry = tl.zeros([], tl.int32)
    stcarry = tl.zeros([], tl.int32)
    i = 0
    while i < split:
        k, m = lanes(i, split, mc.BLOCK)
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
def pop_item(sc, f, m):
    """(request, group, row position, slot) of popped blocks ``f``."""
    k = ld(sc.maps.pop + f, m)
    o = f - ld(sc.req.popoff + k, m)
    need = tl.maximum(ld(sc.req.need + k, m), 1)
    pos = ld(sc.req.nblk + k, m) + ld(sc.req.hits + k, m) + o % need
    return k, o // need, pos, ld(sc.req.slot + k, m)


@triton.jit
def allocate_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, split, num_pops, head, tail, removed):
    """vLLM's ``allocate_new_blocks`` for requests [0, split): one popleft of all their blocks, the
    evictions' rows per request (events on), claims, and the blocks scattered into the rows.
    ``removed``: a bound on the old keys ``cache_all`` removes (``scan_cached``). The pop map
    (``sc.maps.pop``) is built, for the whole batch (its first ``num_pops`` items are these requests').
    Returns (the head, the old keys ``cache_all`` removes: exact with events on (``event_layout``),
    else ``removed``)."""
    new_head = ring_scan_pop(ps, pc, head, tail, ms.s_ids, 0, num_pops)
    tl.debug_barrier()  # the popped ids are read below by other lanes
    if pc.EVENTS:
        if pc.CACHING:
            i = 0
            while i < num_pops:
                f, m = lanes(i, num_pops, pc.BLOCK)
                b = tl.load(ms.s_ids + f, mask=m, other=0)
                k = ld(sc.maps.pop + f, m)
                tl.atomic_add(sc.req.evict + k, ld(ps.num_keys + b, m), mask=m)
                i += pc.BLOCK
            tl.debug_barrier()
        _, removed = event_layout(mc, sc, split, tl.load(ps.ctrl + EV_COUNT).to(tl.int32))
    carry = tl.zeros([], tl.int32)
    reuse_pos = tl.load(ps.ctrl + REUSE_COUNT)
    i = 0
    while i < num_pops:
        f, m = lanes(i, num_pops, pc.BLOCK)
        b = tl.load(ms.s_ids + f, mask=m, other=0)
        k, g, pos, r = pop_item(sc, f, m)
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
def released_item(ms, mc: tl.constexpr, sc, f, m):
    """Row pointer of flattened released blocks ``f``: segment (k, g) is ``row[lead:nskip]`` reversed
    (segments of the items in the lookup map, free once lookups are done)."""
    j = ld(sc.maps.lookup + f, m)
    r = ld(sc.req.slot + j // mc.G, m)
    pos = ld(sc.grp.nskip + j, m) - 1 - (f - ld(sc.grp.reloff + j, m))
    return row_of(ms, mc, j % mc.G, r) + pos


@triton.jit
def remove_skipped_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, split, head, tail):
    """vLLM's ``remove_skipped_blocks`` for requests [0, split) as one batched free: segment (k, g)
    is the blocks that left group g's window, tail first; then nulls in the rows. Returns (head, tail,
    released)."""
    nseg = split * mc.G
    n = tl.load(sc.grp.reloff + nseg)
    segment_ids(sc.grp.reloff, nseg, n, sc.maps.lookup, pc.BLOCK)
    i = 0
    while i < n:
        f, m = lanes(i, n, pc.BLOCK)
        tl.store(ms.s_ids + f, tl.load(released_item(ms, mc, sc, f, m), mask=m, other=0), mask=m)
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
        f, m = lanes(i, n, pc.BLOCK)
        tl.store(released_item(ms, mc, sc, f, m), tl.zeros([pc.BLOCK], tl.int32), mask=m)
        i += pc.BLOCK
    tl.debug_barrier()
    return head - nf, tail, nf + nl


@triton.jit
def cache_all(ps, pc: tl.constexpr, ms, mc: tl.constexpr, sc, split, seq0, removed):
    """vLLM's ``cache_blocks`` for requests [0, split), flattened over (request, group, block): old
    keys removed, one BlockStored header per range, keys with sequence numbers in request order.
    ``removed``: the old keys (``event_layout``, or a bound from ``scan_cached`` with events off);
    with none, as in a decode step whose newly full blocks were never keyed, the removal pass is
    skipped. Returns the keys stored."""
    nseg = split * mc.G
    n = tl.load(sc.grp.coff + nseg)
    if pc.EVENTS:
        i = 0
        while i < nseg:  # headers, also of ranges holding only null blocks
            j, m = lanes(i, nseg, pc.BLOCK)
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
            f, m = lanes(i, n, pc.BLOCK)
            j, k, g, r, pos = cache_item(mc, sc, f, m)
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
def finish_requests(ms, mc: tl.constexpr, sc, batch, split, any_reserved, CACHING: tl.constexpr):
    """Row lengths, computed and cached counts, ``admitted`` and ``hits`` (tokens) of requests [0,
    split), and, when ``any_reserved`` (a scalar flag: some reservation held, so ``plan_requests`` stored the fields),
    each one's reservation less the blocks it took off the free queue (pops and zero-ref hits, drawn
    from it first). Returns the blocks drawn from reservations."""
    drawn = tl.zeros([], tl.int32)
    i = 0
    while i < split:
        k, m = lanes(i, split, mc.BLOCK)
        r = ld(sc.req.slot + k, m)
        hits = ld(sc.req.hits + k, m)
        nf = ld(sc.req.nf + k, m)
        nblk = ld(sc.req.nblk + k, m)
        need = ld(sc.req.need + k, m)
        eff = ld(sc.req.eff + k, m)
        tl.store(ms.num_blocks + r, nblk + hits + need, mask=m)
        tl.store(ms.num_computed + r, eff, mask=m)
        tl.store(batch.admitted + k, tl.full([mc.BLOCK], 1, tl.int32), mask=m)
        tl.store(batch.hits + k, hits * mc.BS, mask=m)
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
