"""Request-level kernels of the KV cache manager: ``allocate_slots`` (the exact sequential path),
``free`` of many requests, ``slot_mapping``, and the steps they are built from, named after vLLM's
(``remove_skipped_blocks``, ``find_longest_cache_hit``, ``get_num_blocks_to_allocate``,
``allocate_new_blocks``, ``cache_blocks``).

Manager state ``ms`` (``gpupool/manager.py`` ManagerState) and sizes ``mc`` (ManagerConfig: G groups,
R request slots, M blocks per row, K hash blocks per block, BS block size, BLOCK lanes): block table
``int32[G, R, M]``, per slot ``num_blocks`` (row length, equal across groups), ``num_computed``,
``num_cached: int32[G, R]``, request keys ``req_hi, req_lo: int64[R, G, M * K]`` (device keys of each
hash block's hash in group g; full block i is keyed by hash ``(i + 1) * K - 1``), ``num_hashes``,
``windows: int32[G]`` (sliding window in tokens, 0 for full attention), ``active: int8[R]``.
The semantics are ``ReferenceKVCacheManager``'s, op for op (docs/semantics.md section 6).
"""
import triton
import triton.language as tl

from .alloc import pop_and_claim
from .cache import add_key, cache_range
from .common import checked_count, keep_first, segment_ids, set_status, status_clear, tile_of, no_error, warps_for
from .groups import num_skipped_blocks
from .layout import (
    ALLOC_SPLIT, BIG, E_BUFFER_FULL, E_DOUBLE_FREE, E_INVALID_ARG, E_INVALID_COUNT, EV_COUNT, HEAD, KEY_SEQ, NUM_FREE, OP_ALLOCATE_SLOTS,
    OP_DECODE_STEP, OP_FREE, OP_RELEASE_COPIES, OP_SLOT_MAPPING, TAIL,
)
from .lookup import find_longest_cache_hit
from .release import (
    check_ids, count_tile, free_checked, release_place, release_scan, reset_ids, touch_checked,
)
from .queue import ring_make_room


@triton.jit
def row_of(ms, mc: tl.constexpr, g, r):
    """Block table row of group g, slot r."""
    return ms.block_table + (g * mc.R + r).to(tl.int64) * mc.M


@triton.jit
def keys_of(mc: tl.constexpr, g, r):
    """Offset of slot r's keys of group g in ``req_hi / req_lo``."""
    return (r * mc.G + g).to(tl.int64) * (mc.M * mc.K)


@triton.jit
def mark_tile(ms, mc: tl.constexpr, slots, i, n, err, val, err_i, base):
    """Mark each in-range slot of tile ``slots[i:i + BLOCK]`` (of ``n``) in ``s_req`` (BIG minus its
    earliest index, by atomic max) and fold the first bad entry into the running (error, value,
    index): a slot out of range or not in use at its index, a slot listed twice at its first index
    (entry i has index ``base + i``). Of two entries of a slot, the one marked second sees the
    other's index, so one pass finds every repeat, across lists too; :func:`unmark_tile` after a
    barrier."""
    offs = tl.arange(0, mc.BLOCK)
    idx = base + i + offs
    r, m = tile_of(slots, i + offs, n)
    out = m & ((r < 0) | (r >= mc.R))
    ok = m & ~out
    seen = tl.atomic_max(ms.s_req + r, -idx + BIG, mask=ok)
    rep = ok & (seen > 0)
    idle = ok & (tl.load(ms.active + r, mask=ok, other=1) == 0)
    at = tl.where(rep, tl.minimum(idx, -seen + BIG), idx)
    return keep_first(err, val, err_i, E_INVALID_ARG, out | idle | rep, at, r)


@triton.jit
def unmark_tile(ms, mc: tl.constexpr, slots, i, n):
    """Zero the ``s_req`` marks :func:`mark_tile` left (the scratch is idle at 0 between launches)."""
    r, m = tile_of(slots, i + tl.arange(0, mc.BLOCK), n)
    # strict: benign, every lane writes 0 (a slot listed twice)
    tl.store(ms.s_req + r, tl.zeros([mc.BLOCK], tl.int32), mask=m & (r >= 0) & (r < mc.R))


@triton.jit
def check_slots(ms, mc: tl.constexpr, slots, nb):
    """(error, value): a slot out of range, listed twice or not in use; ``s_req`` scratch left zeroed."""
    err, val, err_i = no_error()
    i = 0
    while i < nb:
        err, val, err_i = mark_tile(ms, mc, slots, i, nb, err, val, err_i, 0)
        i += mc.BLOCK
    tl.debug_barrier()
    i = 0
    while i < nb:
        unmark_tile(ms, mc, slots, i, nb)
        i += mc.BLOCK
    return err, val


@triton.jit
def remove_skipped_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, head, tail):
    """vLLM's ``remove_skipped_blocks`` for slot r: in every sliding-window group, the blocks that left
    the window (by ``num_computed`` before the step) are freed tail first, down to the first null
    block, and replaced by the null block. Returns (head, tail, blocks released)."""
    offs = tl.arange(0, pc.BLOCK)
    released = tl.zeros([], tl.int32)
    ncomp = tl.load(ms.num_computed + r)
    nblk = tl.load(ms.num_blocks + r)
    g = 0
    while g < mc.G:
        w = tl.load(ms.windows + g)
        if w > 0:
            row = row_of(ms, mc, g, r)
            nskip = num_skipped_blocks(ncomp, w, mc.BS, nblk)
            last_null = tl.full([], -1, tl.int32)
            t = 0
            while t < nskip:
                pos = t + offs
                v = tl.load(row + pos, mask=pos < nskip, other=1)
                last_null = tl.maximum(last_null, tl.max(tl.where((pos < nskip) & (v == 0), pos, -1), axis=0))
                t += pc.BLOCK
            n = nskip - last_null - 1
            t = 0
            while t < n:  # reversed into the scratch list: the tail is freed first
                pos = t + offs
                tl.store(ms.s_ids + pos, tl.load(row + nskip - 1 - pos, mask=pos < n, other=0), mask=pos < n)
                t += pc.BLOCK
            tl.debug_barrier()
            head, tail, rel, _, _ = free_checked(ps, pc, ms.s_ids, n, ms.s_pf, head, tail)
            released += rel
            t = last_null + 1
            while t < nskip:
                pos = t + offs
                tl.store(row + pos, tl.zeros([pc.BLOCK], tl.int32), mask=pos < nskip)
                t += pc.BLOCK
            tl.debug_barrier()
        g += 1
    return head, tail, released


@triton.jit
def get_num_blocks_to_allocate(target, hits, nblk, BS: tl.constexpr):
    """(tokens with slots after the step, new blocks per group): ``eff = max(target, hits * BS)``,
    ``need = ceil(eff / BS) - table length - hits``, at least 0."""
    eff = tl.maximum(target, hits * BS)
    return eff, tl.maximum((eff + BS - 1) // BS - nblk - hits, 0)


@triton.jit
def allocate_new_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, base, need, head, tail):
    """vLLM's ``allocate_new_blocks``: each group in order gets ``need`` blocks from the queue's head at
    ``row[base:]`` (evicting their keys). Returns the new head."""
    g = 0
    while g < mc.G:
        head = pop_and_claim(ps, pc, head, tail, row_of(ms, mc, g, r), base, need)
        g += 1
    return head


@triton.jit
def cache_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, known, hits, nrow):
    """vLLM's ``cache_blocks`` after an admission of slot r with ``known`` tokens written: per group,
    ``cache_full_blocks(row, full hashes, num_cached, nf)`` when ``nf > num_cached`` (one BlockStored,
    possibly empty), then with K > 1 the block after them keyed up to its last complete hash block
    (``cache_partial_block``, skipped when the key would not fit). ``nrow``: the row's length now."""
    nhash = tl.load(ms.num_hashes + r)
    nf = tl.minimum(known // mc.BS, nhash // mc.K)
    g = 0
    while g < mc.G:
        row = row_of(ms, mc, g, r)
        kb = keys_of(mc, g, r)
        # strict: benign, racing the store below only when nf <= start, which stores start back
        start = tl.maximum(tl.load(ms.num_cached + g * mc.R + r), hits)
        if nf > start:
            pk = kb + start.to(tl.int64) * mc.K - 1
            ev_pos, seq = cache_range(ps, pc, row, row, start, nf, ms.req_hi, ms.req_lo, kb + mc.K - 1, mc.K, g,
                                      mc.BS, (start > 0).to(tl.int64),
                                      tl.load(ms.req_hi + pk, mask=start > 0, other=0),
                                      tl.load(ms.req_lo + pk, mask=start > 0, other=0), False)
            tl.store(ps.ctrl + KEY_SEQ, seq)
            tl.store(ps.ctrl + EV_COUNT, ev_pos)
            tl.debug_barrier()  # strict: orders KEY_SEQ / EV_COUNT (thread 0) before the next group's reads
        tl.store(ms.num_cached + g * mc.R + r, tl.maximum(start, nf))
        if mc.K > 1:
            hbs = mc.BS // mc.K
            nh = tl.minimum(known // hbs, nhash)
            if (nh * hbs > nf * mc.BS) & (nf < nrow):
                b = tl.load(row + nf)
                nk = tl.load(ps.num_keys + b)
                fits = (nk == 0) | (tl.load(ps.hash_ntok + b) < nh * hbs) | (nk < pc.MK)
                if (b != 0) & fits:
                    ka = kb + nh - 1
                    ev_pos = tl.load(ps.ctrl + EV_COUNT)
                    _, rows = add_key(ps, pc, b, tl.load(ms.req_hi + ka), tl.load(ms.req_lo + ka), g,
                                      (nh * hbs).to(tl.int64), (nh > 1).to(tl.int64),
                                      tl.load(ms.req_hi + ka - 1, mask=nh > 1, other=0),
                                      tl.load(ms.req_lo + ka - 1, mask=nh > 1, other=0), hbs, ev_pos, False)
                    tl.debug_barrier()  # strict: orders the read of EV_COUNT above before this store
                    tl.store(ps.ctrl + EV_COUNT, ev_pos + rows)
                    tl.debug_barrier()  # strict: orders EV_COUNT (thread 0) before the next group's reads (all)
        g += 1


@triton.jit
def check_batch(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, nb, MIN_TOKENS: tl.constexpr,
                CHECK_SLOTS: tl.constexpr):
    """(error, value, event rows the batch may write) of an ``allocate_slots`` batch: slots (range,
    repeats, in use), token counts in ``MIN_TOKENS .. M * BS`` (targets from 0); the rows bound each
    request's evictions, keys and headers (0 with events off). Also zeroes ``admitted``."""
    offs = tl.arange(0, mc.BLOCK)
    if CHECK_SLOTS:
        err, err_val = check_slots(ms, mc, batch.slots, nb)
    else:  # the caller checked them
        err, err_val, _ = no_error()
    err_i = tl.full([], BIG, tl.int32)
    rows = tl.zeros([], tl.int64)
    i = 0
    while i < nb:
        idx = i + offs
        m = idx < nb
        nt = tl.load(batch.num_tokens + idx, mask=m, other=0)
        tg = tl.load(batch.target + idx, mask=m, other=0)
        bad_nt = (nt < MIN_TOKENS) | (nt > mc.M * mc.BS)
        bad = m & (bad_nt | (tg < 0) | (tg > mc.M * mc.BS))
        if err == 0:
            err, err_val, err_i = keep_first(err, err_val, err_i, E_INVALID_COUNT, bad, idx, tl.where(bad_nt, nt, tg))
        if pc.EVENTS:
            r = tl.load(batch.slots + idx, mask=m, other=0)
            ok = m & ~bad & (r >= 0) & (r < mc.R)
            nblk = tl.load(ms.num_blocks + r, mask=ok, other=0)
            need = tl.maximum((tg + mc.BS - 1) // mc.BS - nblk, 0)
            per = need.to(tl.int64) * pc.MK + (nt // mc.BS).to(tl.int64) * (pc.MK + 1) + pc.MK + 3
            rows += tl.sum(tl.where(ok, per * mc.G, 0), axis=0)
        tl.store(batch.admitted + idx, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        i += mc.BLOCK
    return err, err_val, rows


@triton.jit
def with_event_room(ps, pc: tl.constexpr, err, val, rows):
    """(err, val) with E_BUFFER_FULL (value: the rows) when there is no earlier error and ``rows``
    more event rows would not fit the buffer; unchanged with KV events off."""
    if pc.EVENTS:
        full = (err == 0) & (tl.load(ps.ctrl + EV_COUNT) + rows > pc.EV_CAP)
        err = tl.where(full, E_BUFFER_FULL, err)
        val = tl.where(full, rows, val)
    return err, val


@triton.jit
def check_allocate_batch(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap):
    """(requests, error) of an ``allocate_slots`` batch: a count outside ``0..cap``, a slot out of
    range, repeated or not in use, a token count outside ``0 .. M * BS`` or events that might not fit
    set the status word (the error is then nonzero). Also zeroes ``admitted``."""
    nb, nb_ok = checked_count(batch.num_reqs, cap)
    err = tl.full([], E_INVALID_ARG, tl.int32)
    if status_clear(ps.status):
        err, err_val, rows = check_batch(ps, pc, ms, mc, batch, nb, 0, True)
        err = tl.where(nb_ok, err, E_INVALID_ARG)
        err_val = tl.where(nb_ok, err_val, tl.load(batch.num_reqs).to(tl.int64))
        err, err_val = with_event_room(ps, pc, err, err_val, rows)
        if err != 0:
            set_status(ps.status, err, OP_ALLOCATE_SLOTS, err_val)
        tl.debug_barrier()
    return nb, err


@triton.jit
def allocate_slots_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_exact`, after ``allocate_slots_parallel_kernel``."""
    allocate_slots_exact(ps, pc, ms, mc, batch, cap, STOP_ON_FAILURE, None, None, None, None)


@triton.jit
def allocate_slots_exact(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr,
                          step_out, step_ok, step_split, step_num):
    """``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), from
    request ``ctrl[ALLOC_SPLIT]`` of a batch the request-parallel kernel (``kernels/parallel_alloc.py``)
    validated and committed up to there; returns at once when that is the whole batch. Per request:
    remove the skipped sliding-window blocks, take the longest cache hit (``lookup`` and an empty
    row), and if ``need * G + zero-ref hits <= num_free - (num_reserved - reserved[r])`` (the other
    requests' reservations are held back; docs/semantics.md section 8) touch the hits, allocate the
    new blocks and cache the full ones, those blocks drawn from ``reserved[r]`` first; else skip it
    (or stop, ``STOP_ON_FAILURE``).

    ``batch`` (AllocateBatch): ``slots, num_tokens, target: int32[cap]``, ``lookup: int8[cap]``,
    ``num_reqs: int32[1]`` (at most ``cap``), output ``admitted: int32[cap]``. ``step_out`` (a decode
    step's ``int64[cap]``, or None): then also the slot of each request's newest token, as
    ``slot_mapping`` of group 0 at ``num_tokens - 1`` (-1 where not admitted), in the same launch;
    ``step_ok``, ``step_split`` and ``step_num`` are then the step's flag, split and request count,
    passed in registers instead of read back from the status word, ``ctrl`` and ``num_reqs``.
    """
    if step_out is None:
        nb, _ = checked_count(batch.num_reqs, cap)
        k = tl.load(ps.ctrl + ALLOC_SPLIT).to(tl.int32)
        go = status_clear(ps.status)
    else:
        nb = step_num
        k = step_split
        go = step_ok
    if go & (k < nb):
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        num_free = tl.load(ps.ctrl + NUM_FREE)
        resv_total = tl.load(ms.num_reserved)
        stop = tl.zeros([], tl.int32)
        while (k < nb) & (stop == 0):
            r = tl.load(batch.slots + k)
            nt = tl.load(batch.num_tokens + k)
            head, tail, released = remove_skipped_blocks(ps, pc, ms, mc, r, head, tail)
            num_free += released
            nblk = tl.load(ms.num_blocks + r)
            hits = tl.zeros([], tl.int32)
            zero_ref = tl.zeros([], tl.int32)
            if pc.CACHING:
                if (tl.load(batch.lookup + k) != 0) & (nblk == 0):
                    cap_hits = tl.minimum(tl.maximum(nt - 1, 0) // mc.BS, tl.load(ms.num_hashes + r) // mc.K)
                    hits, zero_ref = find_longest_cache_hit(ps, pc, ms.req_hi + keys_of(mc, 0, r) + mc.K - 1,
                                                            ms.req_lo + keys_of(mc, 0, r) + mc.K - 1, mc.M * mc.K,
                                                            mc.K, ms.group_ids, mc.G, cap_hits,
                                                            row_of(ms, mc, 0, r), mc.R * mc.M, pc.BLOCK)
            eff, need = get_num_blocks_to_allocate(tl.load(batch.target + k), hits, nblk, mc.BS)
            own = tl.load(ms.reserved + r)
            demand = need * mc.G + zero_ref  # blocks it takes off the free queue
            if demand.to(tl.int64) > num_free - (resv_total - own).to(tl.int64):  # others' reservations held
                if STOP_ON_FAILURE:
                    stop = 1
            else:
                take = tl.minimum(own, demand)  # drawn from its own reservation first
                resv_total -= take
                g = 0
                while g < mc.G:  # every group's hits are touched before any group allocates
                    num_free -= touch_checked(ps, pc, row_of(ms, mc, g, r), hits)
                    g += 1
                head = allocate_new_blocks(ps, pc, ms, mc, r, nblk + hits, need, head, tail)
                num_free -= need * mc.G
                if pc.CACHING:
                    cache_blocks(ps, pc, ms, mc, r, tl.minimum(eff, nt), hits, nblk + hits + need)
                else:
                    g = 0
                    while g < mc.G:
                        tl.store(ms.num_cached + g * mc.R + r,
                                 # strict: benign, one statement; only thread 0 uses the value it loads (its store)
                                 tl.maximum(tl.load(ms.num_cached + g * mc.R + r), hits))
                        g += 1
                tl.store(ms.num_blocks + r, nblk + hits + need)
                tl.store(ms.reserved + r, own - take)
                tl.store(ms.num_computed + r, eff)
                tl.store(batch.admitted + k, 1)
            k += 1
        tl.debug_barrier()  # strict: orders the reads of HEAD / TAIL / NUM_FREE above before these stores
        tl.store(ps.ctrl + HEAD, head)
        tl.store(ps.ctrl + TAIL, tail)
        tl.store(ps.ctrl + NUM_FREE, num_free)
        tl.store(ms.num_reserved, resv_total)
    if step_out is not None:
        tl.debug_barrier()
        slot_mapping(ps, ms, mc, batch.slots, batch.num_tokens, nb, cap, step_out, 0, -1, batch.admitted, True, True)


def launch_allocate_slots(ps, pc, ms, mc, batch, *, stop_on_failure: bool):
    """Launch ``allocate_slots_kernel`` (one program), after ``launch_allocate_slots_parallel``."""
    allocate_slots_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), STOP_ON_FAILURE=bool(stop_on_failure),
                                num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))


@triton.jit
def check_step(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, finished, num_finished, fcap):
    """A decode step's inputs, checked before any of its ops runs, so that a bad one changes nothing
    (gpupool/graph.py): both counts within their arrays (``batch.num_reqs`` of ``cap``, ``num_finished``
    of ``fcap``); every slot of ``finished[:num_finished]`` and ``batch.slots[:num_reqs]`` in range, in
    use and listed once across both lists; and the allocation batch as ``allocate_slots`` checks it,
    with token counts from 1 (the new token's position is ``num_tokens - 1``) and its event rows.
    The first bad input sets the status word (op DECODE_STEP); nothing else is written but
    ``admitted`` (all ``cap`` entries zeroed on an error) and idle scratch. Run first by
    ``decode_step_kernel`` (``kernels/step.py``). Returns (whether the step may go on: the status word
    was clear and every input is good, requests, finished requests), a count 0 when it is bad."""
    nb, nb_ok = checked_count(batch.num_reqs, cap)
    nf, nf_ok = checked_count(num_finished, fcap)
    ok = status_clear(ps.status)
    if ok:
        err, val, err_i = no_error()
        i = 0
        while i < tl.maximum(nf, nb):  # both lists in one walk: their marks are order-free
            err, val, err_i = mark_tile(ms, mc, finished, i, nf, err, val, err_i, 0)
            err, val, err_i = mark_tile(ms, mc, batch.slots, i, nb, err, val, err_i, fcap)
            i += mc.BLOCK
        tl.debug_barrier()
        # the batch's own checks read no marks: issued beside the unmarking, kept if the slots pass
        b_err, b_val, rows = check_batch(ps, pc, ms, mc, batch, nb, 1, False)
        i = 0
        while i < tl.maximum(nf, nb):
            unmark_tile(ms, mc, finished, i, nf)
            unmark_tile(ms, mc, batch.slots, i, nb)
            i += mc.BLOCK
        b_err, b_val = with_event_room(ps, pc, b_err, b_val, rows)
        val = tl.where(err == 0, b_val, val)
        err = tl.where(err == 0, b_err, err)
        err = tl.where(nf_ok, err, E_INVALID_ARG)
        val = tl.where(nf_ok, val, tl.load(num_finished).to(tl.int64))
        err = tl.where(nb_ok, err, E_INVALID_ARG)
        val = tl.where(nb_ok, val, tl.load(batch.num_reqs).to(tl.int64))
        ok = err == 0
        if err != 0:
            set_status(ps.status, err, OP_DECODE_STEP, val)
            offs = tl.arange(0, mc.BLOCK)
            i = 0
            while i < cap:  # no request admitted
                tl.store(batch.admitted + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
                i += mc.BLOCK
    return ok, nb, nf


@triton.jit
def gather_rows(ps, ms, mc: tl.constexpr, slots, nb):
    """The ids of a ``free`` of requests ``slots[:nb]``, flattened into ``s_ids``: segment (k, g) is
    request k's group-g row reversed (``free_blocks`` of it), segments request-major; offsets in
    ``s_seg: int32[nb * G + 1]``, the segment of each id in ``s_map[0]``; each id counted as
    ``count_ids`` does, in the same pass. Returns the number of ids."""
    offs = tl.arange(0, mc.BLOCK)
    total = tl.zeros([], tl.int32)
    i = 0
    while i < nb:  # segment offsets: base_k + g * nblk_k
        idx = i + offs
        m = idx < nb
        r = tl.load(slots + idx, mask=m, other=0)
        n = tl.where(m, tl.load(ms.num_blocks + r, mask=m, other=0), 0)
        base = total + (tl.cumsum(n, axis=0) - n) * mc.G
        for g in tl.static_range(mc.G):
            tl.store(ms.s_seg + idx * mc.G + g, base + g * n, mask=m)
        total += tl.sum(n, axis=0) * mc.G
        i += mc.BLOCK
    tl.store(ms.s_seg + nb * mc.G, total)
    tl.debug_barrier()
    segment_ids(ms.s_seg, nb * mc.G, total, ms.s_map, mc.BLOCK)
    i = 0
    while i < total:
        idx = i + offs
        m = idx < total
        j = tl.load(ms.s_map + idx, mask=m, other=0)
        k = j // mc.G
        g = j % mc.G
        s1 = tl.load(ms.s_seg + j + 1, mask=m, other=0)
        r = tl.load(slots + k, mask=m, other=0)
        b = tl.load(ms.block_table + (g * mc.R + r).to(tl.int64) * mc.M + (s1 - 1 - idx), mask=m, other=0)
        tl.store(ms.s_ids + idx, b, mask=m)
        count_tile(ps, b, idx, m & (b != 0))
        i += mc.BLOCK
    tl.debug_barrier()
    return total


@triton.jit
def free_requests_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num_reqs, cap):
    """Grid (1,): :func:`free_requests` alone."""
    free_requests(ps, pc, ms, mc, slots, num_reqs, cap, None, 0)


@triton.jit
def free_requests(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, num_reqs, cap, checked, num):
    """``free`` of ``num_reqs[0]`` requests as ONE batched free (docs/algorithms.md section 2): every
    group's row of each request, tail first, segments in request order, then the requests' counts
    reset and their reservations released (docs/semantics.md section 8). A count outside
    ``0..cap``, a slot out of range, listed twice or not in use sets the status word before
    anything changes. ``checked`` (None, or a scalar flag): a decode step, whose
    ``check_step`` checked every input first and passes its flag and the count ``num``, so nothing is
    read or checked again. Returns whether the status word is clear after the free (what a decode
    step's later ops would read)."""
    if checked is None:
        nb, nb_ok = checked_count(num_reqs, cap)
        clear = status_clear(ps.status)
    else:
        nb = num
        clear = checked
    ok = clear
    if clear:
        if checked is None:
            err, err_val = check_slots(ms, mc, slots, nb)
            err_val = tl.where(nb_ok, err_val, tl.load(num_reqs).to(tl.int64))
            err = tl.where(nb_ok, err, E_INVALID_ARG)
        else:
            err, err_val, _ = no_error()
        ok = err == 0
        if err == 0:
            head = tl.load(ps.ctrl + HEAD)
            tail = tl.load(ps.ctrl + TAIL)
            num_free = tl.load(ps.ctrl + NUM_FREE)
            num_reserved = tl.load(ms.num_reserved)  # read before the barrier below, stored after it
            n = gather_rows(ps, ms, mc, slots, nb)
            nf, nl, dfree_i, dfree_v = release_scan(ps, pc, ms.s_ids, n, ms.s_pf, ms.s_map + mc.MAPS, True)
            ok = dfree_i == BIG
            tl.debug_barrier()
            if dfree_i == BIG:  # always, unless the state is corrupt
                tail = ring_make_room(ps, pc, head, tail, nf + nl)
                tail = release_place(ps, pc, ms.s_ids, n, ms.s_pf, ms.s_map + mc.MAPS, ms.s_seg, ms.s_map, head,
                                     tail, nf, True, True)
                tl.store(ps.ctrl + HEAD, head - nf)
                tl.store(ps.ctrl + TAIL, tail)
                tl.store(ps.ctrl + NUM_FREE, num_free + nf + nl)
                offs = tl.arange(0, mc.BLOCK)
                unreserved = tl.zeros([], tl.int32)
                any_reserved = num_reserved > 0  # else no reservation to release (skip the pass)
                i = 0
                while i < nb:
                    m = (i + offs) < nb
                    r = tl.load(slots + i + offs, mask=m, other=0)
                    zero = tl.zeros([mc.BLOCK], tl.int32)
                    if any_reserved:
                        unreserved += tl.sum(tl.load(ms.reserved + r, mask=m, other=0), axis=0)
                        tl.store(ms.reserved + r, zero, mask=m)
                    tl.store(ms.num_blocks + r, zero, mask=m)
                    tl.store(ms.num_computed + r, zero, mask=m)
                    tl.store(ms.num_hashes + r, zero, mask=m)
                    tl.store(ms.active + r, zero.to(tl.int8), mask=m)
                    for g in tl.static_range(mc.G):
                        tl.store(ms.num_cached + g * mc.R + r, zero, mask=m)
                    i += mc.BLOCK
                if any_reserved:
                    tl.store(ms.num_reserved, num_reserved - unreserved)
            else:
                set_status(ps.status, E_DOUBLE_FREE, OP_FREE, dfree_v)
            tl.debug_barrier()
            reset_ids(ps, ms.s_ids, n, pc.N, pc.BLOCK)  # strict: benign, a block listed twice gets the same idle values
        else:
            set_status(ps.status, err, OP_FREE, err_val)
    return ok


def launch_free_requests(ps, pc, ms, mc, slots, num_reqs):
    """Launch ``free_requests_kernel`` (one program)."""
    free_requests_kernel[(1,)](ps, pc, ms, mc, slots, num_reqs, slots.numel(),
                               num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))


@triton.jit
def slot_mapping_kernel(ps, ms, mc: tl.constexpr, slots, positions, num, cap, out, group, offset, admitted,
                        HAS_ADMITTED: tl.constexpr):
    """Grid (1,): :func:`slot_mapping`."""
    slot_mapping(ps, ms, mc, slots, positions, num, cap, out, group, offset, admitted, HAS_ADMITTED, False)


@triton.jit
def slot_mapping(ps, ms, mc: tl.constexpr, slots, positions, num, cap, out, group, offset, admitted,
                 HAS_ADMITTED: tl.constexpr, TRUSTED: tl.constexpr):
    """``out[t] = block_table[group, slots[t], p // BS] * BS + p % BS`` with ``p = positions[t] + offset``
    for ``t < num[0]`` (at most ``cap``): each slot in use and each position inside its row; else -1
    there and E_INVALID_ARG in the status word (the first bad entry). With ``HAS_ADMITTED``, entries
    whose ``admitted[t]`` is 0 give -1 and are no error. ``TRUSTED`` (a decode step, with
    ``HAS_ADMITTED``): ``num`` is the step's checked count (a value, not a pointer), and an admitted
    entry's slot is in use and its position inside its row, as the step checked and allocated them,
    so neither is read again."""
    if TRUSTED:
        n = num
        err = tl.zeros([], tl.int32)
        err_val = tl.zeros([], tl.int64)
    else:
        n, n_ok = checked_count(num, cap)
        err = tl.where(n_ok, 0, E_INVALID_ARG)
        err_val = tl.where(n_ok, 0, tl.load(num)).to(tl.int64)
    offs = tl.arange(0, mc.BLOCK)
    err_i = tl.full([], BIG, tl.int32)
    i = 0
    while i < n:
        idx = i + offs
        inb = idx < n
        m = inb
        if HAS_ADMITTED:
            m = m & (tl.load(admitted + idx, mask=inb, other=0) != 0)
        r = tl.load(slots + idx, mask=inb, other=0)  # not masked by ``admitted``: one wait, not two
        p = tl.load(positions + idx, mask=inb, other=0).to(tl.int64) + offset
        if TRUSTED:
            okr = m
            ok = m
        else:
            okr = m & (r >= 0) & (r < mc.R)
            okr = okr & (tl.load(ms.active + r, mask=okr, other=0) != 0)
            nblk = tl.load(ms.num_blocks + r, mask=okr, other=0)
            ok = okr & (p >= 0) & (p < nblk.to(tl.int64) * mc.BS)
        blk = tl.load(ms.block_table + (group * mc.R + r).to(tl.int64) * mc.M + p // mc.BS, mask=ok, other=0)
        tl.store(out + idx, tl.where(ok, blk.to(tl.int64) * mc.BS + p % mc.BS, -1), mask=inb)
        err, err_val, err_i = keep_first(err, err_val, err_i, E_INVALID_ARG, m & ~ok, idx, tl.where(okr, p, r))
        i += mc.BLOCK
    if err != 0:
        set_status(ps.status, err, OP_SLOT_MAPPING, err_val)


def launch_slot_mapping(ps, ms, mc, slots, positions, num, out, group: int, offset: int, admitted):
    slot_mapping_kernel[(1,)](ps, ms, mc, slots, positions, num, slots.numel(), out, group, offset,
                              slots if admitted is None else admitted, HAS_ADMITTED=admitted is not None,
                              num_warps=warps_for(mc.BLOCK))


@triton.jit
def release_copies_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr):
    """After the pending copies ran: one ``free_blocks`` of ``copy_release[:num_copies]`` and an empty
    queue, only when the status word is clear, so copies stay pending (and their blocks held) past a
    failed step. A count outside ``0..Q`` or a bad id sets E_INVALID_ARG / E_INVALID_ID instead."""
    n, n_ok = checked_count(ms.num_copies, mc.Q)
    if status_clear(ps.status) & ((n > 0) | ~n_ok):  # nothing pending (the usual step): nothing to do
        err, err_val, _ = check_ids(ps, ms.copy_release, n, pc.N, False, False, pc.BLOCK)
        err = tl.where(n_ok, err, E_INVALID_ARG)
        err_val = tl.where(n_ok, err_val, tl.load(ms.num_copies).to(tl.int64))
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        released = tl.zeros([], tl.int32)
        if err == 0:
            head, tail, released, dfree_i, dfree_v = free_checked(ps, pc, ms.copy_release, n, ms.s_pf, head, tail)
            err = tl.where(dfree_i < BIG, E_DOUBLE_FREE, err)
            err_val = tl.where(dfree_i < BIG, dfree_v, err_val)
        if err == 0:
            tl.store(ps.ctrl + HEAD, head)
            tl.store(ps.ctrl + TAIL, tail)
            # strict: benign, one statement; only thread 0 uses the value it loads (its store)
            tl.store(ps.ctrl + NUM_FREE, tl.load(ps.ctrl + NUM_FREE) + released)
            tl.store(ms.num_copies, 0)
        else:
            set_status(ps.status, err, OP_RELEASE_COPIES, err_val)


def launch_release_copies(ps, pc, ms, mc):
    release_copies_kernel[(1,)](ps, pc, ms, mc, num_warps=warps_for(pc.BLOCK))
