"""A whole decode step's allocation side in ONE launch (gpupool/graph.py has the step's order and
rules; docs/algorithms.md section 6): every input checked and the finished requests freed, the
request-parallel ``allocate_slots``, its exact continuation from the first order-dependent request,
and the slot of each request's newest token. The steps are the single-op kernels' bodies, separated
by barriers (one program: the global writes of one are seen by the next)."""
import triton
import triton.language as tl

from .common import warps_for
from .manager import allocate_slots_exact, check_step, free_requests
from .parallel_alloc import allocate_slots_parallel


@triton.jit
def decode_step_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, finished, num_finished, fcap,
                       slot_mapping, FORCE_EXACT: tl.constexpr):
    """``batch`` (AllocateBatch, capacity ``cap``): the running requests, ``target = num_tokens``;
    ``finished: int32[fcap]`` with ``num_finished: int32[1]``; ``slot_mapping: int64[cap]`` output.
    A bad input sets the status word (op DECODE_STEP) in the first step and the others do nothing."""
    ok, nb, nf = check_step(ps, pc, ms, mc, batch, cap, finished, num_finished, fcap)
    tl.debug_barrier()
    ok = free_requests(ps, pc, ms, mc, finished, num_finished, fcap, ok, nf)
    tl.debug_barrier()
    split = allocate_slots_parallel(ps, pc, ms, mc, batch, cap, FORCE_EXACT, ok, nb, True)
    tl.debug_barrier()
    allocate_slots_exact(ps, pc, ms, mc, batch, cap, False, slot_mapping, ok, split, nb)


def launch_decode_step(ps, pc, ms, mc, batch, finished, num_finished, slot_mapping, *, force_exact: bool = False):
    """Launch ``decode_step_kernel`` (one program). ``force_exact``: the exact path for every request
    (a manager built with ``parallel=False``)."""
    decode_step_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), finished, num_finished, finished.numel(),
                             slot_mapping, FORCE_EXACT=bool(force_exact), num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
