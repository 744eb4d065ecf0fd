"""The request-level input checks: slot lists (range, repeats, in use), an ``allocate_slots``
batch, and a decode step's inputs, each before anything changes (docs/semantics.md section 6)."""
import triton
import triton.language as tl

from ..common import checked_count, keep_first, keep_first_why, ld, no_error, no_error_why, raw_count, \
    set_status_limit, set_status_why, status_clear, tile_of
from ..layout import (
    BIG, C_COUNT_PAST_ARRAYS, C_FINISHED_PAST_ARRAYS, C_SLOT_LISTED_TWICE, C_SLOT_NOT_IN_USE, C_SLOT_OUT_OF_RANGE,
    C_SLOT_IN_USE, C_TOKEN_COUNT, EV_COUNT, E_BUFFER_FULL, E_INVALID_ARG, E_INVALID_COUNT, OP_ALLOCATE_SLOTS,
)


@triton.jit
def slot_cause(mc: tl.constexpr, r, idle):
    """The ``Cause`` of a bad slot ``r`` that is not a repeat: out of range, else not in use (``idle``)."""
    return tl.where((r < 0) | (r >= mc.R), C_SLOT_OUT_OF_RANGE, tl.where(idle, C_SLOT_NOT_IN_USE, 0))


@triton.jit
def mark_tile(ms, mc: tl.constexpr, slots, i, n, err, val, why, err_i, base, FREE: tl.constexpr = False):
    """Mark each in-range slot of tile ``slots[i:i + BLOCK]`` (of ``n``) in ``s_req`` (BIG minus its
    earliest index, by atomic max) and fold the first bad entry into the running (error, value,
    cause, index): a slot out of range or not in use at its index, a slot listed twice at its first
    index (entry i has index ``base + i``). Of two entries of a slot, the one marked second sees the
    other's index, so one pass finds every repeat, across lists too; :func:`unmark_tile` after a
    barrier. The cause goes by the slot (out of range, else not in use, else listed twice), so
    every entry folded at one index agrees on it. ``FREE``: the slots must be free instead (``admit``;
    cause SLOT_IN_USE)."""
    offs = tl.arange(0, mc.BLOCK)
    idx = base + i + offs
    r, m = tile_of(slots, i + offs, n)
    out = m & ((r < 0) | (r >= mc.R))
    ok = m & ~out
    seen = tl.atomic_max(ms.s_req + r, -idx + BIG, mask=ok)
    rep = ok & (seen > 0)
    if FREE:
        idle = ok & (tl.load(ms.active + r, mask=ok, other=0) != 0)  # here: in use
    else:
        idle = ok & (tl.load(ms.active + r, mask=ok, other=1) == 0)
    at = tl.where(rep, tl.minimum(idx, -seen + BIG), idx)
    cause = tl.where(out, C_SLOT_OUT_OF_RANGE, tl.where(idle, C_SLOT_IN_USE if FREE else C_SLOT_NOT_IN_USE,
                                                        C_SLOT_LISTED_TWICE))
    err, val, why, _, err_i = keep_first_why(err, val, why, tl.zeros([], tl.int64), err_i, new_err=E_INVALID_ARG,
                                             bad=out | idle | rep, idx=at, val=r, cause=cause, ext=r)
    return err, val, why, err_i


@triton.jit
def unmark_tile(ms, mc: tl.constexpr, slots, i, n):
    """Zero the ``s_req`` marks :func:`mark_tile` left (the scratch is idle at 0 between launches)."""
    r, m = tile_of(slots, i + tl.arange(0, mc.BLOCK), n)
    # strict: benign, every lane writes 0 (a slot listed twice)
    tl.store(ms.s_req + r, tl.zeros([mc.BLOCK], tl.int32), mask=m & (r >= 0) & (r < mc.R))


@triton.jit
def check_slots(ms, mc: tl.constexpr, slots, nb, FREE: tl.constexpr = False):
    """(error, value, cause): a slot out of range, listed twice or not in use (in use with ``FREE``);
    ``s_req`` scratch left zeroed."""
    err, val, why, _, err_i = no_error_why()
    i = 0
    while i < nb:
        err, val, why, err_i = mark_tile(ms, mc, slots, i=i, n=nb, err=err, val=val, why=why, err_i=err_i, base=0,
                                         FREE=FREE)
        i += mc.BLOCK
    tl.debug_barrier()
    i = 0
    while i < nb:
        unmark_tile(ms, mc, slots, i=i, n=nb)
        i += mc.BLOCK
    return err, val, why


@triton.jit
def or_count_error(err, val, why, extra, n_ok, count_ptr, cap, CAUSE: tl.constexpr):
    """(error, value, cause, extra), replaced by a device count outside ``0..cap`` where ``n_ok`` is
    false (E_INVALID_ARG, the count, ``CAUSE``, ``cap``): a count past its arrays reads no entry."""
    return (tl.where(n_ok, err, E_INVALID_ARG), tl.where(n_ok, val, raw_count(count_ptr, cap).to(tl.int64)),
            tl.where(n_ok, why, CAUSE), tl.where(n_ok, extra, cap))


@triton.jit
def count_cause(err, why):
    """``why``, or TOKEN_COUNT for a token count's E_INVALID_COUNT (:func:`check_batch_counts`)."""
    return tl.where(err == E_INVALID_COUNT, C_TOKEN_COUNT, why)


@triton.jit
def check_batch_counts(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, nb, MIN_TOKENS: tl.constexpr,
                       ROOM: tl.constexpr = 0):
    """(error, value, its request's slot, event rows the batch may write) of an ``allocate_slots``
    batch whose slots are checked apart (:func:`check_slots`): token counts in ``MIN_TOKENS .. M * BS
    - ROOM`` (a window's, whose targets are ``num_tokens + D``: ``ROOM = D``, so the count the caller
    gave is named), targets in ``0 .. M * BS``; the rows bound each request's evictions, keys and
    headers (0 with events off). Also zeroes ``admitted``."""
    offs = tl.arange(0, mc.BLOCK)
    err, err_val, _ = no_error()
    err_i = tl.full([], BIG, tl.int32)
    rows = tl.zeros([], tl.int64)
    i = 0
    while i < nb:
        idx = i + offs
        m = idx < nb
        nt = tl.load(batch.num_tokens + idx, mask=m, other=0)
        tg = tl.load(batch.target + idx, mask=m, other=0)
        bad_nt = (nt < MIN_TOKENS) | (nt > mc.M * mc.BS - ROOM)
        bad = m & (bad_nt | (tg < 0) | (tg > mc.M * mc.BS))
        if err == 0:
            err, err_val, err_i = keep_first(err, err_val, err_i, new_err=E_INVALID_COUNT, bad=bad, idx=idx,
                                             val=tl.where(bad_nt, nt, tg))
        if pc.EVENTS:
            r = tl.load(batch.slots + idx, mask=m, other=0)
            ok = m & ~bad & (r >= 0) & (r < mc.R)
            nblk = tl.load(ms.num_blocks + r, mask=ok, other=0)
            need = tl.maximum((tg + mc.BS - 1) // mc.BS - nblk, 0)
            per = need.to(tl.int64) * pc.MK + (nt // mc.BS).to(tl.int64) * (pc.MK + 1) + pc.MK + 3
            rows += tl.sum(tl.where(ok, per * mc.G, 0), axis=0)
        tl.store(batch.admitted + idx, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        tl.store(batch.hits + idx, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        i += mc.BLOCK
    slot = ld(batch.slots + tl.minimum(err_i, nb - 1), err != 0)  # one load, only on an error
    return err, err_val, slot, rows


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
    set the status word (the error is then nonzero). Also zeroes ``admitted: int32[cap]``, all of
    it, the op skipped or not."""
    nb, nb_ok = checked_count(batch.num_reqs, cap)
    err = tl.full([], E_INVALID_ARG, tl.int32)
    # every flag 0 first: a failed or skipped batch (or a count past the array) admits nobody, whatever
    # the buffer held (a captured step's reused ``admitted``)
    offs = tl.arange(0, mc.BLOCK)
    i = 0
    while i < cap:
        tl.store(batch.admitted + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
        tl.store(batch.hits + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
        i += mc.BLOCK
    tl.debug_barrier()  # strict: before check_batch_counts zeroes the first nb again (other threads)
    if status_clear(ps.status):
        err, err_val, why = check_slots(ms, mc, slots=batch.slots, nb=nb)
        b_err, b_val, _, rows = check_batch_counts(ps, pc, ms, mc, batch, nb, MIN_TOKENS=0)
        err_val = tl.where(err == 0, b_val, err_val)  # a bad slot first
        err = tl.where(err == 0, b_err, err)
        err, err_val, why, extra = or_count_error(err, err_val, count_cause(err, why), 0, nb_ok, batch.num_reqs, cap,
                                                  CAUSE=C_COUNT_PAST_ARRAYS)
        err, err_val = with_event_room(ps, pc, err, err_val, rows)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_ALLOCATE_SLOTS, value=err_val, cause=why, extra=extra)
        tl.debug_barrier()
    return nb, err


@triton.jit
def check_step(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, finished, num_finished, fcap,
               OP: tl.constexpr, D: tl.constexpr):
    """A decode step's inputs, checked before any of its ops runs, so that a bad one changes nothing
    (gpupool/graph.py): both counts within their arrays (``batch.num_reqs`` of ``cap``, ``num_finished``
    of ``fcap``); every slot of ``finished[:num_finished]`` and ``batch.slots[:num_reqs]`` in range, in
    use and listed once across both lists; and the allocation batch as ``allocate_slots`` checks it,
    with token counts ``1 .. M * BS - D`` (the new token's position is ``num_tokens - 1``; D lookahead
    positions past it, the targets) and its event rows. The first bad input sets the status word (op
    ``OP``: WINDOW_BEGIN; a token count's slot and bound with it); nothing else is written but
    ``admitted`` (all ``cap`` entries zeroed on an error) and idle scratch. Run first by
    ``window_begin_kernel`` (``kernels/requests/window.py``). Returns (whether the step may go on: the status word
    was clear and every input is good, requests, finished requests), a count 0 when it is bad."""
    nb, nb_ok = checked_count(batch.num_reqs, cap)
    nf, nf_ok = checked_count(num_finished, fcap)
    ok = status_clear(ps.status)
    # no lane past the count is admitted, and none at all once the status word is set (the step does
    # nothing): a captured step's ``admitted`` keeps no flag of an earlier step. The lanes below the
    # count are zeroed by check_batch_counts (other addresses: no barrier between the two).
    offs = tl.arange(0, mc.BLOCK)
    i = tl.where(ok, nb, 0)
    while i < cap:
        tl.store(batch.admitted + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
        i += mc.BLOCK
    if ok:
        err, val, why, extra, err_i = no_error_why()
        i = 0
        while i < tl.maximum(nf, nb):  # both lists in one walk: their marks are order-free
            err, val, why, err_i = mark_tile(ms, mc, finished, i=i, n=nf, err=err, val=val, why=why, err_i=err_i,
                                             base=0)
            err, val, why, err_i = mark_tile(ms, mc, batch.slots, i=i, n=nb, err=err, val=val, why=why,
                                             err_i=err_i, base=fcap)
            i += mc.BLOCK
        tl.debug_barrier()
        # the batch's own checks read no marks: issued beside the unmarking, kept if the slots pass
        b_err, b_val, b_slot, rows = check_batch_counts(ps, pc, ms, mc, batch, nb, MIN_TOKENS=1, ROOM=D)
        i = 0
        while i < tl.maximum(nf, nb):
            unmark_tile(ms, mc, finished, i=i, n=nf)
            unmark_tile(ms, mc, batch.slots, i=i, n=nb)
            i += mc.BLOCK
        b_err, b_val = with_event_room(ps, pc, b_err, b_val, rows)
        val = tl.where(err == 0, b_val, val)
        extra = tl.where(err == 0, b_slot, extra)
        err = tl.where(err == 0, b_err, err)
        why = count_cause(err, why)
        err, val, why, extra = or_count_error(err, val, why, extra, nf_ok, num_finished, fcap,
                                              CAUSE=C_FINISHED_PAST_ARRAYS)
        err, val, why, extra = or_count_error(err, val, why, extra, nb_ok, batch.num_reqs, cap,
                                              CAUSE=C_COUNT_PAST_ARRAYS)
        ok = err == 0
        if err != 0:  # no request admitted: check_batch_counts zeroed the flags below the count
            set_status_limit(ps.status, code=err, op=OP, value=val, cause=why, extra=extra, limit=mc.M * mc.BS - D)
    return ok, nb, nf
