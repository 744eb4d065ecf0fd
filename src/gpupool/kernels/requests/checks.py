"""The request-level input checks: slot lists (range, repeats, in use), an ``allocate_slots``
batch, and a decode step's inputs, each before anything changes (docs/semantics.md section 6)."""
import triton
import triton.language as tl

from ..common import checked_count, keep_first, no_error, set_status, status_clear, tile_of
from ..layout import BIG, EV_COUNT, E_BUFFER_FULL, E_INVALID_ARG, E_INVALID_COUNT, OP_ALLOCATE_SLOTS, OP_DECODE_STEP


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
    return keep_first(err, val, err_i, new_err=E_INVALID_ARG, bad=out | idle | rep, idx=at, val=r)


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
        err, val, err_i = mark_tile(ms, mc, slots, i=i, n=nb, err=err, val=val, err_i=err_i, base=0)
        i += mc.BLOCK
    tl.debug_barrier()
    i = 0
    while i < nb:
        unmark_tile(ms, mc, slots, i=i, n=nb)
        i += mc.BLOCK
    return err, val


@triton.jit
def check_batch_counts(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, nb, MIN_TOKENS: tl.constexpr):
    """(error, value, event rows the batch may write) of an ``allocate_slots`` batch whose slots are
    checked apart (:func:`check_slots`): token counts in ``MIN_TOKENS .. M * BS`` (targets from 0);
    the rows bound each request's evictions, keys and headers (0 with events off). Also zeroes
    ``admitted``."""
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
        bad_nt = (nt < MIN_TOKENS) | (nt > mc.M * mc.BS)
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
        i += mc.BLOCK
    tl.debug_barrier()  # strict: before check_batch_counts zeroes the first nb again (other threads)
    if status_clear(ps.status):
        err, err_val = check_slots(ms, mc, slots=batch.slots, nb=nb)
        b_err, b_val, rows = check_batch_counts(ps, pc, ms, mc, batch, nb, MIN_TOKENS=0)
        err_val = tl.where(err == 0, b_val, err_val)  # a bad slot first
        err = tl.where(err == 0, b_err, err)
        err = tl.where(nb_ok, err, E_INVALID_ARG)
        err_val = tl.where(nb_ok, err_val, tl.load(batch.num_reqs).to(tl.int64))
        err, err_val = with_event_room(ps, pc, err, err_val, rows)
        if err != 0:
            set_status(ps.status, code=err, op=OP_ALLOCATE_SLOTS, value=err_val)
        tl.debug_barrier()
    return nb, err


@triton.jit
def check_step(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, finished, num_finished, fcap):
    """A decode step's inputs, checked before any of its ops runs, so that a bad one changes nothing
    (gpupool/graph.py): both counts within their arrays (``batch.num_reqs`` of ``cap``, ``num_finished``
    of ``fcap``); every slot of ``finished[:num_finished]`` and ``batch.slots[:num_reqs]`` in range, in
    use and listed once across both lists; and the allocation batch as ``allocate_slots`` checks it,
    with token counts from 1 (the new token's position is ``num_tokens - 1``) and its event rows.
    The first bad input sets the status word (op DECODE_STEP); nothing else is written but
    ``admitted`` (all ``cap`` entries zeroed on an error) and idle scratch. Run first by
    ``decode_step_kernel`` (``kernels/requests/decode.py``). Returns (whether the step may go on: the status word
    was clear and every input is good, requests, finished requests), a count 0 when it is bad."""
    nb, nb_ok = checked_count(batch.num_reqs, cap)
    nf, nf_ok = checked_count(num_finished, fcap)
    ok = status_clear(ps.status)
    if ok:
        err, val, err_i = no_error()
        i = 0
        while i < tl.maximum(nf, nb):  # both lists in one walk: their marks are order-free
            err, val, err_i = mark_tile(ms, mc, finished, i=i, n=nf, err=err, val=val, err_i=err_i, base=0)
            err, val, err_i = mark_tile(ms, mc, batch.slots, i=i, n=nb, err=err, val=val, err_i=err_i,
                                        base=fcap)
            i += mc.BLOCK
        tl.debug_barrier()
        # the batch's own checks read no marks: issued beside the unmarking, kept if the slots pass
        b_err, b_val, rows = check_batch_counts(ps, pc, ms, mc, batch, nb, MIN_TOKENS=1)
        i = 0
        while i < tl.maximum(nf, nb):
            unmark_tile(ms, mc, finished, i=i, n=nf)
            unmark_tile(ms, mc, batch.slots, i=i, n=nb)
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
            set_status(ps.status, code=err, op=OP_DECODE_STEP, value=val)
            offs = tl.arange(0, mc.BLOCK)
            i = 0
            while i < cap:  # no request admitted
                tl.store(batch.admitted + i + offs, tl.zeros([mc.BLOCK], tl.int32), mask=(i + offs) < cap)
                i += mc.BLOCK
    return ok, nb, nf
