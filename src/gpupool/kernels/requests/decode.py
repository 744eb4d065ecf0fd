"""A whole decode step's allocation side in ONE launch (gpupool/graph.py has the step's order and
rules; docs/algorithms.md section 6): every input checked and the finished requests freed, the
request-parallel ``allocate_slots``, its exact continuation from the first order-dependent request,
and the slot of each request's newest token. The steps are the single-op kernels' bodies, separated
by barriers (one program: the global writes of one are seen by the next).

A burst of K steps (``DecodeStep(steps=K)``, docs/semantics.md section "Multi-step decode") is step
0 as above, then K - 1 launches of :func:`decode_burst_kernel`: each builds its step's batch on the
device from the previous one (the admitted requests, in order, one token more), runs the same
allocation and slot mapping, and scatters its results to the step's row of the burst's outputs.
"""
import triton
import triton.language as tl

from ..common import lanes, set_status_why, status_clear, warps_for
from ..layout import OP_DECODE_STEP
from .checks import check_batch_counts, check_step, count_cause, with_event_room
from .exact import allocate_slots_exact_checked
from .free import free_requests_checked
from .parallel import allocate_slots_parallel_checked
from .slot_mapping import slot_mapping_checked


@triton.jit
def new_token_slots(ms, mc: tl.constexpr, batch, nb, cap, out):
    """``out[:cap]``: the slot of each admitted request's newest token (group 0, position
    ``num_tokens - 1``), -1 where not admitted and past ``nb``; the step checked and allocated them."""
    slot_mapping_checked(ms, mc, batch.slots, positions=batch.num_tokens, num=nb, cap=cap, out=out, group=0,
                         offset=-1, admitted=batch.admitted)


@triton.jit
def allocate_decode_batch(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, num, cap, ok, out,
                          FORCE_EXACT: tl.constexpr):
    """A decode step's allocation of its checked batch (``num`` requests of ``cap`` lanes, ``ok`` the
    step's flag): the request-parallel ``allocate_slots`` up to the split, the exact path from there,
    then the slot of each admitted request's newest token into ``out: int64[cap]``, -1 on every other
    lane (:func:`new_token_slots`). Step 0 and every burst step run it."""
    split = allocate_slots_parallel_checked(ps, pc, ms, mc, batch, FORCE_EXACT=FORCE_EXACT, ok=ok, num=num)
    tl.debug_barrier()
    allocate_slots_exact_checked(ps, pc, ms, mc, batch, STOP_ON_FAILURE=False, num=num, split=split, ok=ok)
    tl.debug_barrier()
    new_token_slots(ms, mc, batch, num, cap, out)


@triton.jit
def decode_step_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, finished, num_finished, fcap,
                       slot_mapping, FORCE_EXACT: tl.constexpr):
    """``batch`` (AllocateBatch, capacity ``cap``): the running requests, ``target = num_tokens``;
    ``finished: int32[fcap]`` with ``num_finished: int32[1]``; ``slot_mapping: int64[cap]`` output.
    A bad input sets the status word (op DECODE_STEP) in the first step and the others do nothing.
    Every lane past the count reads admitted 0 and slot -1 afterwards (a padded lane of a captured
    step keeps nothing of an earlier step)."""
    ok, nb, nf = check_step(ps, pc, ms, mc, batch, cap, finished, num_finished, fcap, OP=OP_DECODE_STEP)
    tl.debug_barrier()
    ok = free_requests_checked(ps, pc, ms, mc, finished, num=nf, ok=ok)
    tl.debug_barrier()
    allocate_decode_batch(ps, pc, ms, mc, batch, num=nb, cap=cap, ok=ok, out=slot_mapping, FORCE_EXACT=FORCE_EXACT)


@triton.jit
def next_batch(mc: tl.constexpr, src, src_orig, n_src, SRC_IS_STEP0: tl.constexpr, dst, dst_orig):
    """The next step's batch: the requests ``src`` admitted (of its first ``n_src``), in order, with
    one token more, into ``dst`` (its ``admitted`` zeroed) and their burst lanes into ``dst_orig``
    (``src_orig``, or the lane itself for step 0's batch). Returns its request count. Positions come
    from a prefix count over the tiles, in order (no loop over requests)."""
    n = tl.zeros([], tl.int32)
    i = 0
    while i < n_src:
        idx, m = lanes(i, n_src, mc.BLOCK)
        a = m & (tl.load(src.admitted + idx, mask=m, other=0) != 0)
        r = tl.load(src.slots + idx, mask=m, other=0)
        nt = tl.load(src.num_tokens + idx, mask=m, other=0)
        if SRC_IS_STEP0:
            o = idx
        else:
            o = tl.load(src_orig + idx, mask=m, other=0)
        ai = a.to(tl.int32)
        pos = n + tl.cumsum(ai, axis=0) - ai
        tl.store(dst.slots + pos, r, mask=a)
        tl.store(dst.num_tokens + pos, nt + 1, mask=a)  # dst.target is the same buffer
        tl.store(dst.admitted + pos, tl.zeros([mc.BLOCK], tl.int32), mask=a)
        tl.store(dst_orig + pos, o, mask=a)
        n += tl.sum(ai, axis=0)
        i += mc.BLOCK
    tl.store(dst.num_reqs, n)
    return n


@triton.jit
def decode_burst_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, src, src_orig, dst, dst_orig, dst_map,
                        cap, out_admitted, out_map, SRC_IS_STEP0: tl.constexpr, FORCE_EXACT: tl.constexpr):
    """Step k >= 1 of a burst. ``src``: step k - 1's batch (AllocateBatch; step 0's own, then
    ``SRC_IS_STEP0``, else a work batch with burst lanes ``src_orig: int32[cap]``); ``dst`` /
    ``dst_orig`` / ``dst_map: int64[cap]``: this step's work batch; ``out_admitted: int32[cap]``,
    ``out_map: int64[cap]``: row k of the burst's outputs, by burst lane (0 / -1 on every lane that
    takes no part: not admitted, or past step 0's count). No free and no slot check: the slots are a
    subset of step 0's, checked there, and nothing freed them since; the token counts and event
    rows are checked as a step checks them (op DECODE_STEP). The allocation is step 0's, on the
    derived batch; once the status word is set, nothing but the outputs is written."""
    offs = tl.arange(0, mc.BLOCK)
    n_src = tl.minimum(tl.maximum(tl.load(src.num_reqs), 0), cap)
    i = 0
    while i < cap:  # every lane, the padded ones too: a captured burst's row keeps nothing of an earlier one
        idx = i + offs
        m = idx < cap
        tl.store(out_admitted + idx, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        tl.store(out_map + idx, tl.full([mc.BLOCK], -1, tl.int64), mask=m)
        i += mc.BLOCK
    nb = next_batch(mc, src, src_orig, n_src, SRC_IS_STEP0, dst, dst_orig)
    tl.debug_barrier()
    ok = status_clear(ps.status)
    if ok:
        err, val, rows = check_batch_counts(ps, pc, ms, mc, dst, nb, MIN_TOKENS=1)
        err, val = with_event_room(ps, pc, err, val, rows)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_DECODE_STEP, value=val, cause=count_cause(err, 0), extra=0)
        ok = err == 0
    tl.debug_barrier()
    allocate_decode_batch(ps, pc, ms, mc, dst, num=nb, cap=cap, ok=ok, out=dst_map, FORCE_EXACT=FORCE_EXACT)
    tl.debug_barrier()
    i = 0
    while i < nb:
        idx = i + offs
        m = idx < nb
        o = tl.load(dst_orig + idx, mask=m, other=0)
        a = tl.load(dst.admitted + idx, mask=m, other=0)
        s = tl.load(dst_map + idx, mask=m, other=0)
        tl.store(out_admitted + o, a, mask=m)
        tl.store(out_map + o, s, mask=m)
        i += mc.BLOCK


def launch_decode_step(ps, pc, ms, mc, batch, finished, num_finished, slot_mapping, *, force_exact: bool = False):
    """Launch ``decode_step_kernel`` (one program). ``force_exact``: the exact path for every request
    (a manager built with ``parallel=False``)."""
    decode_step_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), finished, num_finished, finished.numel(),
                             slot_mapping, FORCE_EXACT=bool(force_exact), num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))


def launch_decode_burst(ps, pc, ms, mc, src, src_orig, dst, dst_orig, dst_map, out_admitted, out_map, *,
                        src_is_step0: bool, force_exact: bool = False):
    """Launch ``decode_burst_kernel`` (one program): one step k >= 1 of a burst."""
    decode_burst_kernel[(1,)](ps, pc, ms, mc, src, src_orig, dst, dst_orig, dst_map, dst.slots.numel(),
                              out_admitted, out_map, SRC_IS_STEP0=bool(src_is_step0),
                              FORCE_EXACT=bool(force_exact), num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
