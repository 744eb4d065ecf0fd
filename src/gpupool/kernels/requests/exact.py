"""``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), from
the split the request-parallel kernel (``parallel.py``) left."""
import triton
import triton.language as tl

from ..common import checked_count, status_clear, warps_for
from ..layout import ALLOC_SPLIT, HEAD, NUM_FREE, TAIL
from ..lookup import find_longest_cache_hit
from ..release import touch_checked
from .rows import keys_of, row_of
from .slot_mapping import slot_mapping
from .steps import allocate_new_blocks, cache_blocks, get_num_blocks_to_allocate, remove_skipped_blocks


@triton.jit
def allocate_slots_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_exact`, after ``allocate_slots_parallel_kernel``."""
    allocate_slots_exact(ps, pc, ms, mc, batch, cap, STOP_ON_FAILURE, None, None, None, None)


@triton.jit
def allocate_slots_exact(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr,
                          step_out, step_ok, step_split, step_num):
    """``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), from
    request ``ctrl[ALLOC_SPLIT]`` of a batch the request-parallel kernel (``kernels/requests/parallel.py``)
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
