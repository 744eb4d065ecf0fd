"""A decode window's pool steps (gpupool/window.py; docs/semantics.md section 9), one launch each:

* :func:`window_begin_kernel`: every input checked (``check_step``), the finished requests freed, the
  lanes set up (lane i is the request ``slots[i]`` for the whole window);
* :func:`window_step_kernel` with ``ADVANCE`` (pool steps k >= 1, and the window's end): what forward
  pass k - 1 wrote, checked first: the lanes that stopped are freed (one batched free, lane order), the
  others gain their accepted tokens, which a request that hashes its own tokens appends, hashing the
  hash blocks they fill on the device (``kernels/block_hash.py``) and logging the digests for the
  host to name;
* the same kernel with ``ALLOCATE`` (every pool step): vLLM's scheduler over the live lanes, in lane
  order: blocks for ``num_tokens + D`` tokens (D lookahead positions for draft tokens), keys as far
  as ``num_tokens``, the request-parallel path up to the first lane that does not fit, then the exact
  loop that preempts the last lanes (``exact.allocate_running_exact``); then the step's outputs by
  lane, every lane of the row written (-1 / 0 where a lane takes no part, padding included).

:func:`append_tokens_kernel` is the append alone (``KVCacheManager.append_tokens``: a prefill's
sampled token). The attention views of a step are the views kernel's (``views.py``), one launch per
group after the step.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..block_hash import block_hash, device_key, store_digest
from ..common import (
    checked_count, keep_first_why, lanes, ld, no_error_why, set_status_limit, set_status_why, status_clear, warps_for,
)
from ..layout import (
    BIG, C_ACCEPTED_COUNT, C_COUNT_PAST_ARRAYS, C_SLOT_NOT_IN_USE, C_TOKEN_COUNT, C_TOKEN_ID, DW, E_BUFFER_FULL, E_INVALID_ARG,
    E_INVALID_COUNT, OP_APPEND_TOKENS, OP_WINDOW_BEGIN, OP_WINDOW_STEP, Op,
)
from .checks import check_batch_counts, check_slots, check_step, count_cause, or_count_error, with_event_room
from .exact import allocate_running_exact
from .free import free_requests_checked
from .parallel import allocate_slots_parallel_checked
from .slot_mapping import slot_of


class WindowBuffers(NamedTuple):
    """A window's device tensors (``B`` lanes, ``K`` steps, ``Q = D + 1`` queries a lane, ``G`` groups),
    owned by ``gpupool.window.DecodeWindow``.

    Inputs (the host, once a window): ``slots, num_tokens, finished: int32[B]``, ``num_reqs,
    num_finished: int32[1]``. What forward pass k - 1 decided (the model writes them): ``stopped:
    int32[B]`` (nonzero: the lane stopped), ``accepted: int32[B]`` (tokens it gained, 1 .. Q),
    ``tokens: int32 or int64[B, Q]`` (those tokens, first ``accepted[i]`` of row i). Lane state:
    ``lane_tokens, live, stop_step, preempt_step: int32[B]``, ``flags: int32[2]`` (``[0]``: a lane was
    preempted). Outputs: ``seq, admitted: int32[K, B]`` (a lane's attention length ``num_tokens + D``
    and whether it takes part in step k), ``slot_mapping: int64[G, K, B * Q]``. Scratch: ``lane,
    preempted, stop_list: int32[B]`` (the allocation batch's lanes and preemptions, the stops)."""

    slots: object
    num_tokens: object
    num_reqs: object
    finished: object
    num_finished: object
    stopped: object
    accepted: object
    tokens: object
    lane_tokens: object
    live: object
    stop_step: object
    preempt_step: object
    flags: object
    seq: object
    admitted: object
    slot_mapping: object
    lane: object
    preempted: object
    stop_list: object


@triton.jit
def window_begin_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, wb, work, cap, OP: tl.constexpr,
                        D: tl.constexpr):
    """The window's inputs into the allocation batch ``work`` (targets ``num_tokens + D``), checked by
    ``check_step`` (op ``OP``; token counts ``1 .. M * BS - D``, so targets within the row); the finished requests
    freed; lanes ``< num_reqs`` live with their token counts, the others idle. On an error nothing but
    idle lanes and scratch is written."""
    offs = tl.arange(0, mc.BLOCK)
    n, _ = checked_count(wb.num_reqs, cap)
    i = 0
    while i < cap:
        idx = i + offs
        m = idx < n
        nt = tl.load(wb.num_tokens + idx, mask=m, other=0)
        tl.store(work.slots + idx, tl.load(wb.slots + idx, mask=m, other=0), mask=idx < cap)
        tl.store(work.num_tokens + idx, nt, mask=idx < cap)
        tl.store(work.target + idx, nt + D, mask=idx < cap)
        i += mc.BLOCK
    # strict: benign, one statement; only thread 0 uses the value it loads (its store)
    tl.store(work.num_reqs, tl.load(wb.num_reqs))
    tl.debug_barrier()
    ok, nb, nf = check_step(ps, pc, ms, mc, work, cap, wb.finished, wb.num_finished, cap, OP=OP, D=D)
    tl.debug_barrier()
    if nf > 0:
        ok = free_requests_checked(ps, pc, ms, mc, wb.finished, num=nf, ok=ok)
    i = 0
    while i < cap:
        idx = i + offs
        m = idx < tl.where(ok, nb, 0)  # (a scalar flag and a tile mixed by & lose their dtype in the interpreter)
        tl.store(wb.live + idx, m.to(tl.int32), mask=idx < cap)
        tl.store(wb.lane_tokens + idx, tl.load(wb.num_tokens + idx, mask=m, other=0), mask=idx < cap)
        tl.store(wb.stop_step + idx, tl.full([mc.BLOCK], -1, tl.int32), mask=idx < cap)
        tl.store(wb.preempt_step + idx, tl.full([mc.BLOCK], -1, tl.int32), mask=idx < cap)
        i += mc.BLOCK
    tl.store(wb.flags, 0)


@triton.jit
def fold_append_errors(ms, mc: tl.constexpr, fold, idx, r, acc, nt, going, tok_row, Q: tl.constexpr, LIMIT,
                       TOKENS: tl.constexpr, MIN_ACC: tl.constexpr):
    """Fold a tile of appends into the running first error ``fold`` (``keep_first_why``'s (error,
    value, cause, extra, index)): lanes ``going`` of
    request ``r`` gain ``acc`` tokens (MIN_ACC .. Q, else InvalidCountError, cause ACCEPTED_COUNT), which
    take them to ``nt`` tokens (at most ``LIMIT``, else TOKEN_COUNT); with ``TOKENS`` the tokens at
    ``tok_row`` (per-lane pointers) must be int32 (InvalidArgumentError, TOKEN_ID). Returns the fold
    and the hash blocks the appends fill for requests that hash their tokens (the name log's need)."""
    err, val, why, extra, err_i = fold
    bad_acc = going & ((acc < MIN_ACC) | (acc > Q))
    bad_nt = going & ~bad_acc & (nt > LIMIT)
    err, val, why, extra, err_i = keep_first_why(
        err, val, why, extra, err_i, new_err=E_INVALID_COUNT, bad=bad_acc | bad_nt, idx=idx,
        val=tl.where(bad_acc, acc, nt), cause=tl.where(bad_acc, C_ACCEPTED_COUNT, C_TOKEN_COUNT), ext=r)
    fills = tl.zeros([], tl.int32)
    if TOKENS:
        for q in tl.static_range(Q):
            tok = tl.load(tok_row + q, mask=going & (q < acc), other=0)
            bad_tok = going & (q < acc) & ((tok < -2147483648) | (tok > 2147483647))
            err, val, why, extra, err_i = keep_first_why(
                err, val, why, extra, err_i, new_err=E_INVALID_ARG, bad=bad_tok, idx=idx, val=tok, cause=C_TOKEN_ID,
                ext=r)
        hashes = going & (ld(ms.hashing + r, going) != 0)
        f = (ld(ms.num_tail + r, hashes) + acc) // mc.HBS
        f = tl.minimum(f, mc.M * mc.K - ld(ms.num_hashes + r, hashes))
        fills = tl.sum(tl.where(hashes, tl.maximum(f, 0), 0), axis=0)
    return (err, val, why, extra, err_i), fills


@triton.jit
def with_name_room(ms, mc: tl.constexpr, err, val, fills):
    """(err, val) with BufferFullError (value: the entries) when there is no earlier error and
    ``fills`` more digests would not fit the name log."""
    full = (err == 0) & (tl.load(ms.num_names) + fills > mc.NLOG)
    return tl.where(full, E_BUFFER_FULL, err), tl.where(full, fills, val)


@triton.jit
def check_lanes_in_use(ms, mc: tl.constexpr, wb, n):
    """(error, value, cause, extra) of the first live lane whose request is no longer in use (the host
    freed it between the window's launches): InvalidArgumentError, cause SLOT_NOT_IN_USE, its slot."""
    err, val, why, extra, err_i = no_error_why()
    i = 0
    while i < n:
        idx, m = lanes(i, n, mc.BLOCK)
        live = m & (ld(wb.live + idx, m) != 0)
        r = ld(wb.slots + idx, m)
        bad = live & (ld(ms.active + r, live) == 0)
        err, val, why, extra, err_i = keep_first_why(err, val, why, extra, err_i, new_err=E_INVALID_ARG, bad=bad,
                                                     idx=idx, val=r, cause=C_SLOT_NOT_IN_USE, ext=r)
        i += mc.BLOCK
    return err, val, why, extra


@triton.jit
def check_advance(ps, pc: tl.constexpr, ms, mc: tl.constexpr, wb, n, Q: tl.constexpr, ROOM: tl.constexpr,
                  TOKENS: tl.constexpr, TOK_STRIDE: tl.constexpr):
    """(error, value, cause, extra) of what a forward pass wrote, the first bad lane's
    (:func:`fold_append_errors` of every live lane that did not stop, its token count at most
    ``M * BS - ROOM`` after), then the name log's room (:func:`with_name_room`)."""
    fold = no_error_why()
    fills = tl.zeros([], tl.int32)
    i = 0
    while i < n:
        idx, m = lanes(i, n, mc.BLOCK)
        going = m & (ld(wb.live + idx, m) != 0) & (ld(wb.stopped + idx, m) == 0)
        acc = ld(wb.accepted + idx, going)
        fold, f = fold_append_errors(ms, mc, fold, idx, ld(wb.slots + idx, m), acc,
                                     ld(wb.lane_tokens + idx, going) + acc, going,
                                     wb.tokens + idx.to(tl.int64) * TOK_STRIDE, Q=Q, LIMIT=mc.M * mc.BS - ROOM,
                                     TOKENS=TOKENS, MIN_ACC=1)
        fills += f
        i += mc.BLOCK
    err, val, why, extra, _ = fold
    err, val = with_name_room(ms, mc, err, val, fills)
    return err, val, why, extra


@triton.jit
def append_tile(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, acc, tok_row, going, names, Q: tl.constexpr,
                QP: tl.constexpr):
    """Lanes ``going`` of a tile: request ``r`` (hashing its own tokens) appends ``acc`` tokens from
    ``tok_row`` (per-lane pointers, token q at ``tok_row + q``) to its tail, hashing every hash block
    they fill (``block_hash`` chained on ``last_digest``), its device key per group into the request's
    keys (``req_hi / req_lo[r, g, num_hashes]``), ``num_hashes`` + 1 and the digest into ``name_log``
    at ``names`` on (in lane order). A request whose hashes would pass its row stops hashing. Returns
    the entries logged. ``QP``: the power of two at or above Q (a tile of tokens). Every thread calls it
    (``block_hash`` has barriers)."""
    NR: tl.constexpr = (Q + 2 * mc.HBS - 2) // mc.HBS  # rounds: blocks the tokens can fill, and a last partial one
    cols = tl.arange(0, QP)
    hashes = going & (ld(ms.hashing + r, going) != 0)
    t = ld(ms.num_tail + r, hashes)
    nh = ld(ms.num_hashes + r, hashes)
    pos = tl.zeros_like(t)
    logged = tl.zeros([], tl.int32)
    tail_row = ms.tail_tok + r.to(tl.int64) * mc.HBS
    digest_row = ms.last_digest + r.to(tl.int64) * DW
    scratch_rows = ms.s_hash + tl.arange(0, mc.BLOCK).to(tl.int64) * mc.HW
    for _ in range(NR):  # a loop, not unrolled: each round's hash is three SHA-256 compressions of code
        take = tl.maximum(tl.minimum(acc - pos, mc.HBS - t), 0)
        cm = hashes[:, None] & (cols[None, :] < take[:, None])
        tok = tl.load(tok_row[:, None] + (pos[:, None] + cols[None, :]), mask=cm, other=0)
        tl.store(tail_row[:, None] + (t[:, None] + cols[None, :]), tok.to(tl.int32), mask=cm)
        t += take
        pos += take
        full = hashes & (t == mc.HBS)
        room = nh < mc.M * mc.K
        hashed = full & room
        if tl.max(hashed.to(tl.int32), axis=0) > 0:
            h0, h1, h2, h3, h4, h5, h6, h7 = block_hash(digest_row, tail_row, hashed, digest_row, scratch_rows,
                                                        ms.k_table, mc.HBS, mc.BLOCK)
            for g in range(mc.G):
                hi, lo = device_key(h0, h1, h2, h3, h4, h5, h6, h7, tl.zeros([mc.BLOCK], tl.int32) + g, ms.k_table)
                at = (r * mc.G + g).to(tl.int64) * (mc.M * mc.K) + nh
                tl.store(ms.req_hi + at, hi, mask=hashed)
                tl.store(ms.req_lo + at, lo, mask=hashed)
            hv = hashed.to(tl.int32)
            store_digest(ms.name_log + (names + logged + tl.cumsum(hv, axis=0) - hv).to(tl.int64) * DW,
                         h0, h1, h2, h3, h4, h5, h6, h7, hashed)
            logged += tl.sum(hv, axis=0)
            nh += hv
            tl.debug_barrier()  # the next round's tail stores follow this round's hash reads (other threads)
        tl.store(ms.hashing + r, tl.zeros_like(r).to(tl.int8), mask=full & ~room)
        hashes = hashes & ~(full & ~room)
        t = tl.where(full, 0, t)
    tl.store(ms.num_tail + r, t, mask=hashes)
    tl.store(ms.num_hashes + r, nh, mask=hashes)
    return logged


@triton.jit
def advance_lanes(ps, pc: tl.constexpr, ms, mc: tl.constexpr, wb, k, n, ok, OP: tl.constexpr, Q: tl.constexpr,
                  QP: tl.constexpr, ROOM: tl.constexpr, TOKENS: tl.constexpr, TOK_STRIDE: tl.constexpr):
    """What forward pass k - 1 decided (module docstring), all or nothing: checked
    (:func:`check_advance`, op ``OP``), then the stopped lanes freed in lane order as one batched free
    (``stop_step = k - 1``), then every other live lane's tokens appended (:func:`append_tile`; without
    ``TOKENS`` the tokens are unknown: its request stops hashing). Returns whether the step goes on."""
    if ok:
        err, val, why, extra = check_advance(ps, pc, ms, mc, wb, n, Q=Q, ROOM=ROOM, TOKENS=TOKENS,
                                             TOK_STRIDE=TOK_STRIDE)
        if err != 0:  # the bound a token count passed: the row less the room the step books after
            set_status_limit(ps.status, code=err, op=OP, value=val, cause=why, extra=extra, limit=mc.M * mc.BS - ROOM)
        ok = err == 0
    tl.debug_barrier()
    if ok:
        nst = tl.zeros([], tl.int32)
        i = 0
        while i < n:
            idx, m = lanes(i, n, mc.BLOCK)
            s = m & (ld(wb.live + idx, m) != 0) & (ld(wb.stopped + idx, m) != 0)
            sv = s.to(tl.int32)
            tl.store(wb.stop_list + nst + tl.cumsum(sv, axis=0) - sv, ld(wb.slots + idx, m), mask=s)
            tl.store(wb.stop_step + idx, tl.full([mc.BLOCK], k - 1, tl.int32), mask=s)
            tl.store(wb.live + idx, tl.zeros([mc.BLOCK], tl.int32), mask=s)
            nst += tl.sum(sv, axis=0)
            i += mc.BLOCK
        tl.debug_barrier()
        if nst > 0:
            ok = free_requests_checked(ps, pc, ms, mc, wb.stop_list, num=nst, ok=ok)
            tl.debug_barrier()
    if ok:
        names = tl.load(ms.num_names)
        i = 0
        while i < n:
            idx, m = lanes(i, n, mc.BLOCK)
            going = m & (ld(wb.live + idx, m) != 0)  # the stopped lanes are no longer live
            r = ld(wb.slots + idx, m)
            acc = ld(wb.accepted + idx, going)
            tl.store(wb.lane_tokens + idx, ld(wb.lane_tokens + idx, going) + acc, mask=going)
            if TOKENS:
                names += append_tile(ps, pc, ms, mc, r, acc, wb.tokens + idx.to(tl.int64) * TOK_STRIDE, going,
                                     names, Q=Q, QP=QP)
            else:
                tl.store(ms.hashing + r, tl.zeros([mc.BLOCK], tl.int8), mask=going)
            i += mc.BLOCK
        tl.debug_barrier()  # strict: orders every thread's read of num_names before thread 0's store
        tl.store(ms.num_names, names)
    return ok


@triton.jit
def allocate_lanes(ps, pc: tl.constexpr, ms, mc: tl.constexpr, wb, work, k, n, cap, ok, K: tl.constexpr,
                   Q: tl.constexpr, D: tl.constexpr, FORCE_EXACT: tl.constexpr):
    """Pool step k's allocation (module docstring): row k of every output cleared, the live lanes as
    the batch ``work`` in lane order, checked (``check_batch_counts``, op WINDOW_STEP), allocated with
    vLLM's preemption, and the results scattered back by lane: ``admitted``, ``seq``, the slot of each
    lane's Q queries (positions ``num_tokens - 1 .. num_tokens - 1 + D``) in every group, and the
    preempted lanes no longer live (``preempt_step = k``, ``flags[0] = 1``)."""
    offs = tl.arange(0, mc.BLOCK)
    i = 0
    while i < cap:
        idx = i + offs
        c = idx < cap
        tl.store(wb.admitted + k * cap + idx, tl.zeros([mc.BLOCK], tl.int32), mask=c)
        tl.store(wb.seq + k * cap + idx, tl.zeros([mc.BLOCK], tl.int32), mask=c)
        for g in tl.static_range(mc.G):
            for q in tl.static_range(Q):
                tl.store(wb.slot_mapping + ((g * K + k) * cap + idx).to(tl.int64) * Q + q,
                         tl.full([mc.BLOCK], -1, tl.int64), mask=c)
        i += mc.BLOCK
    nb = tl.zeros([], tl.int32)
    i = 0
    while i < n:
        idx, m = lanes(i, n, mc.BLOCK)
        a = m & (ld(wb.live + idx, m) != 0)
        av = a.to(tl.int32)
        pos = nb + tl.cumsum(av, axis=0) - av
        nt = ld(wb.lane_tokens + idx, a)
        tl.store(work.slots + pos, ld(wb.slots + idx, a), mask=a)
        tl.store(work.num_tokens + pos, nt, mask=a)
        tl.store(work.target + pos, nt + D, mask=a)
        tl.store(wb.lane + pos, idx, mask=a)
        tl.store(wb.preempted + pos, tl.zeros([mc.BLOCK], tl.int32), mask=a)
        nb += tl.sum(av, axis=0)
        i += mc.BLOCK
    tl.store(work.num_reqs, nb)
    tl.debug_barrier()
    if ok:
        err, val, slot, rows = check_batch_counts(ps, pc, ms, mc, work, nb, MIN_TOKENS=1, ROOM=D)
        err, val = with_event_room(ps, pc, err, val, rows)
        if err != 0:
            set_status_limit(ps.status, code=err, op=OP_WINDOW_STEP, value=val, cause=count_cause(err, 0),
                             extra=slot, limit=mc.M * mc.BS - D)
        ok = err == 0
    tl.debug_barrier()
    split = allocate_slots_parallel_checked(ps, pc, ms, mc, work, FORCE_EXACT=FORCE_EXACT, ok=ok, num=nb)
    tl.debug_barrier()
    allocate_running_exact(ps, pc, ms, mc, work, wb.preempted, num=nb, split=split, ok=ok)
    tl.debug_barrier()
    any_pre = tl.zeros([], tl.int32)
    i = 0
    while i < nb:
        j, m = lanes(i, nb, mc.BLOCK)
        lane = ld(wb.lane + j, m)
        adm = ld(work.admitted + j, m)
        pre = m & (ld(wb.preempted + j, m) != 0)
        r = ld(work.slots + j, m)
        nt = ld(work.num_tokens + j, m)
        tl.store(wb.admitted + k * cap + lane, adm, mask=m)
        tl.store(wb.seq + k * cap + lane, tl.where(adm != 0, nt + D, 0), mask=m)
        tl.store(wb.live + lane, tl.zeros([mc.BLOCK], tl.int32), mask=pre)
        tl.store(wb.preempt_step + lane, tl.full([mc.BLOCK], k, tl.int32), mask=pre)
        any_pre = tl.maximum(any_pre, tl.max(pre.to(tl.int32), axis=0))
        for g in tl.static_range(mc.G):
            for q in tl.static_range(Q):
                tl.store(wb.slot_mapping + ((g * K + k) * cap + lane).to(tl.int64) * Q + q,
                         slot_of(ms, mc, group=g, r=r, p=nt - 1 + q, ok=m & (adm != 0)), mask=m)
        i += mc.BLOCK
    if any_pre > 0:
        tl.store(wb.flags, 1)


class StepConfig(NamedTuple):
    """A window launch's constants (one ``tl.constexpr`` argument): the op its errors name (``OP``),
    ``K`` steps, ``Q = D + 1`` queries a lane (``QP`` the power of two at or above), ``D`` lookahead
    tokens, whether it takes a pass's decisions (``ADVANCE``) and allocates (``ALLOCATE``), whether the
    pass gives its tokens (``TOKENS``), the exact path for every lane (``FORCE_EXACT``)."""

    OP: int
    K: int
    Q: int
    QP: int
    D: int
    ADVANCE: bool
    ALLOCATE: bool
    TOKENS: bool
    FORCE_EXACT: bool


@triton.jit
def window_step_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, wb, work, k, cap, wc: tl.constexpr):
    """Pool step ``k`` (``wc.ALLOCATE``; after forward pass k - 1 with ``wc.ADVANCE``), or the window's
    end (``ADVANCE`` alone); ``wc``: a :class:`StepConfig`. Every live lane's request must still be in
    use (:func:`check_lanes_in_use`). Errors go to the status word as op ``wc.OP``; a step after an
    error clears its output rows and does nothing else."""
    n, _ = checked_count(wb.num_reqs, cap)
    ok = status_clear(ps.status)
    if ok:  # the lanes' requests first: the host may have freed one since the last launch
        err, val, why, extra = check_lanes_in_use(ms, mc, wb, n)
        if err != 0:
            set_status_why(ps.status, code=err, op=wc.OP, value=val, cause=why, extra=extra)
        ok = err == 0
    tl.debug_barrier()
    if wc.ADVANCE:
        ok = advance_lanes(ps, pc, ms, mc, wb, k, n, ok, OP=wc.OP, Q=wc.Q, QP=wc.QP,
                           ROOM=wc.D if wc.ALLOCATE else 0, TOKENS=wc.TOKENS, TOK_STRIDE=wc.Q)
        tl.debug_barrier()
    if wc.ALLOCATE:
        allocate_lanes(ps, pc, ms, mc, wb, work, k, n, cap, ok, K=wc.K, Q=wc.Q, D=wc.D, FORCE_EXACT=wc.FORCE_EXACT)


@triton.jit
def append_tokens_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, slots, counts, tokens, num, cap,
                         T: tl.constexpr, TP: tl.constexpr):
    """``KVCacheManager.append_tokens``: requests ``slots[:num[0]]`` (``int32[cap]``) gain ``counts[k]``
    tokens each (0 .. T) from row k of ``tokens: int32 or int64[cap, T]``, in order (:func:`append_tile`).
    Checked first, all or nothing (op APPEND_TOKENS): the count within its arrays, every slot in range,
    in use and listed once, every count in 0 .. T, the tokens in int32, a hashing request's tokens at
    most ``M * BS``, room in the name log."""
    n, n_ok = checked_count(num, cap)
    ok = status_clear(ps.status)
    if ok:
        err, val, why = check_slots(ms, mc, slots=slots, nb=n)
        extra = tl.zeros([], tl.int64)
        err, val, why, extra = or_count_error(err, val, why, extra, n_ok, num, cap, CAUSE=C_COUNT_PAST_ARRAYS)
        if err == 0:
            fold = (err, val, why, extra, tl.full([], BIG, tl.int32))
            fills = tl.zeros([], tl.int32)
            i = 0
            while i < n:
                idx, m = lanes(i, n, mc.BLOCK)
                r = ld(slots + idx, m)
                c = ld(counts + idx, m)
                hashes = m & (ld(ms.hashing + r, m) != 0)
                known = ld(ms.num_hashes + r, hashes) * mc.HBS + ld(ms.num_tail + r, hashes) + c
                fold, f = fold_append_errors(ms, mc, fold, idx, r, c, tl.where(hashes, known, 0), m,
                                             tokens + idx.to(tl.int64) * T, Q=T, LIMIT=mc.M * mc.BS, TOKENS=True,
                                             MIN_ACC=0)
                fills += f
                i += mc.BLOCK
            err, val, why, extra, _ = fold
            err, val = with_name_room(ms, mc, err, val, fills)
        if err != 0:
            set_status_limit(ps.status, code=err, op=OP_APPEND_TOKENS, value=val, cause=why, extra=extra,
                             limit=mc.M * mc.BS)
        ok = err == 0
    tl.debug_barrier()
    if ok:
        names = tl.load(ms.num_names)
        i = 0
        while i < n:
            idx, m = lanes(i, n, mc.BLOCK)
            names += append_tile(ps, pc, ms, mc, ld(slots + idx, m), ld(counts + idx, m),
                                 tokens + idx.to(tl.int64) * T, m, names, Q=T, QP=TP)
            i += mc.BLOCK
        tl.debug_barrier()  # strict: orders every thread's read of num_names before thread 0's store
        tl.store(ms.num_names, names)


def _warps(pc, mc) -> int:
    return warps_for(max(pc.BLOCK, mc.BLOCK))


def launch_window_begin(ps, pc, ms, mc, wb, work, *, lookahead: int) -> None:
    """Launch :func:`window_begin_kernel` (one program)."""
    window_begin_kernel[(1,)](ps, pc, ms, mc, wb, work, wb.slots.numel(), OP=OP_WINDOW_BEGIN, D=lookahead,
                              num_warps=_warps(pc, mc))


def launch_window_step(ps, pc, ms, mc, wb, work, k: int, *, steps: int, lookahead: int, advance: bool,
                       allocate: bool, tokens: bool, force_exact: bool = False) -> None:
    """Launch :func:`window_step_kernel` (one program): pool step ``k`` (``allocate``; after a forward
    pass with ``advance``), or the window's end (``advance`` alone, ``k = steps``)."""
    wc = StepConfig(OP=int(Op.WINDOW_STEP if allocate else Op.WINDOW_END), K=steps, Q=lookahead + 1,
                    QP=triton.next_power_of_2(lookahead + 1), D=lookahead, ADVANCE=bool(advance),
                    ALLOCATE=bool(allocate), TOKENS=bool(tokens), FORCE_EXACT=bool(force_exact))
    window_step_kernel[(1,)](ps, pc, ms, mc, wb, work, k, wb.slots.numel(), wc, num_warps=_warps(pc, mc))


def launch_append_tokens(ps, pc, ms, mc, slots, counts, tokens, num) -> None:
    """Launch :func:`append_tokens_kernel` (one program); ``tokens: [cap, T]``."""
    append_tokens_kernel[(1,)](ps, pc, ms, mc, slots, counts, tokens, num, slots.numel(), T=tokens.shape[1],
                               TP=triton.next_power_of_2(tokens.shape[1]),
                               num_warps=_warps(pc, mc))
