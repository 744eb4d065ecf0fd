"""The copy-on-write queue's release: after the pending copies ran, one ``free_blocks`` of their
sources."""
import triton
import triton.language as tl

from ..common import checked_count, set_status, status_clear, warps_for
from ..layout import BIG, E_DOUBLE_FREE, E_INVALID_ARG, HEAD, NUM_FREE, OP_RELEASE_COPIES, TAIL
from ..release import check_ids, free_checked


@triton.jit
def release_copies_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr):
    """After the pending copies ran: one ``free_blocks`` of ``copy_release[:num_copies]`` and an empty
    queue, only when the status word is clear, so copies stay pending (and their blocks held) past a
    failed step. A count outside ``0..Q`` or a bad id sets E_INVALID_ARG / E_INVALID_ID instead."""
    n, n_ok = checked_count(ms.num_copies, mc.Q)
    if status_clear(ps.status) & ((n > 0) | ~n_ok):  # nothing pending (the usual step): nothing to do
        err, err_val, _ = check_ids(ps, ms.copy_release, n=n, N=pc.N, NULL_IS_ERROR=False, COUNT=False,
                                   BLOCK=pc.BLOCK)
        err = tl.where(n_ok, err, E_INVALID_ARG)
        err_val = tl.where(n_ok, err_val, tl.load(ms.num_copies).to(tl.int64))
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        released = tl.zeros([], tl.int32)
        if err == 0:
            head, tail, released, dfree_i, dfree_v = free_checked(ps, pc, ms.copy_release, n=n, pf=ms.s_pf,
                                                                        head=head, tail=tail)
            err = tl.where(dfree_i < BIG, E_DOUBLE_FREE, err)
            err_val = tl.where(dfree_i < BIG, dfree_v, err_val)
        if err == 0:
            tl.store(ps.ctrl + HEAD, head)
            tl.store(ps.ctrl + TAIL, tail)
            # strict: benign, one statement; only thread 0 uses the value it loads (its store)
            tl.store(ps.ctrl + NUM_FREE, tl.load(ps.ctrl + NUM_FREE) + released)
            tl.store(ms.num_copies, 0)
        else:
            set_status(ps.status, code=err, op=OP_RELEASE_COPIES, value=err_val)


def launch_release_copies(ps, pc, ms, mc):
    release_copies_kernel[(1,)](ps, pc, ms, mc, num_warps=warps_for(pc.BLOCK))
