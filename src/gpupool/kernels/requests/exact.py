"""``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), from
the split the request-parallel kernel (``parallel.py``) left: a loop over the requests, each one
vLLM's steps in order (``steps.py``)."""
import triton
import triton.language as tl

from ..common import checked_count, status_clear, warps_for
from ..layout import ALLOC_SPLIT, HEAD, NUM_FREE, TAIL
from .rows import row_of
from .steps import (admit, allocate_blocks, cache_blocks, get_computed_blocks, get_num_blocks_to_allocate,
                    remove_skipped_blocks)


@triton.jit
def allocate_slots_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr):
    """Grid (1,): :func:`allocate_slots_exact`, after ``allocate_slots_parallel_kernel``."""
    allocate_slots_exact(ps, pc, ms, mc, batch, cap=cap, STOP_ON_FAILURE=STOP_ON_FAILURE)


@triton.jit
def allocate_slots_exact(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, cap, STOP_ON_FAILURE: tl.constexpr):
    """:func:`allocate_slots_exact_checked` of a batch of ``batch.num_reqs[0]`` requests (at most
    ``cap``; a count out of range reads as 0, the parallel kernel's check having set the status
    word), from request ``ctrl[ALLOC_SPLIT]``, only while the status word is clear."""
    nb, _ = checked_count(batch.num_reqs, cap)
    allocate_slots_exact_checked(ps, pc, ms, mc, batch, STOP_ON_FAILURE=STOP_ON_FAILURE, num=nb,
                                 split=tl.load(ps.ctrl + ALLOC_SPLIT).to(tl.int32), ok=status_clear(ps.status))


@triton.jit
def allocate_slots_exact_checked(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, STOP_ON_FAILURE: tl.constexpr,
                                 num, split, ok):
    """``allocate_slots``, the exact sequential path (``ReferenceKVCacheManager.allocate_slots``), of
    requests ``split .. num`` of a batch the request-parallel kernel (``kernels/requests/parallel.py``)
    validated and committed up to ``split``; nothing unless ``ok`` (the status word clear) and
    ``split < num``. Per request, vLLM's steps (``steps.py``): remove the skipped sliding-window blocks,
    take the longest cache hit (``lookup`` and an empty row), and if ``need * G + zero-ref hits <=
    num_free - (num_reserved - reserved[r])`` (the other requests' reservations are held back;
    docs/semantics.md section 8) touch the hits, allocate the new blocks and cache the full ones,
    those blocks drawn from ``reserved[r]`` first; else skip it (or stop, ``STOP_ON_FAILURE``).

    ``batch`` (AllocateBatch): ``slots, num_tokens, target: int32[cap]``, ``lookup: int8[cap]``,
    output ``admitted: int32[cap]`` (1 where admitted; the caller zeroed it). ``num``, ``split``:
    int32 scalars, already checked (``0 <= split <= num <= cap``), ``ok`` a scalar flag."""
    k = split
    if ok & (k < num):
        head = tl.load(ps.ctrl + HEAD)
        tail = tl.load(ps.ctrl + TAIL)
        num_free = tl.load(ps.ctrl + NUM_FREE)
        resv_total = tl.load(ms.num_reserved)
        stop = tl.zeros([], tl.int32)
        while (k < num) & (stop == 0):
            r = tl.load(batch.slots + k)
            nt = tl.load(batch.num_tokens + k)
            rel = remove_skipped_blocks(ps, pc, ms, mc, r, head, tail)
            head = rel.head
            tail = rel.tail
            num_free += rel.num_released
            nblk = tl.load(ms.num_blocks + r)
            hit = get_computed_blocks(ps, pc, ms, mc, r, num_tokens=nt, lookup=tl.load(batch.lookup + k), nblk=nblk)
            blocks = get_num_blocks_to_allocate(tl.load(batch.target + k), hits=hit.hits, zero_ref=hit.zero_ref,
                                                num_blocks=nblk, G=mc.G, BS=mc.BS)
            own = tl.load(ms.reserved + r)
            adm = admit(blocks.demand, num_free=num_free, num_reserved=resv_total, reserved=own)
            if adm.fits:
                resv_total -= adm.take
                got = allocate_blocks(ps, pc, row_of(ms, mc, 0, r), ROW_STRIDE=mc.R * mc.M, G=mc.G, nblk=nblk,
                                      hits=hit.hits, need=blocks.need, head=head, tail=tail, num_free=num_free)
                head = got.head
                num_free = got.num_free
                nrow = nblk + hit.hits + blocks.need
                if pc.CACHING:
                    cache_blocks(ps, pc, ms, mc, r, known=tl.minimum(blocks.eff, nt), hits=hit.hits, nrow=nrow)
                else:
                    g = 0
                    while g < mc.G:
                        tl.store(ms.num_cached + g * mc.R + r,
                                 # strict: benign, one statement; only thread 0 uses the value it loads (its store)
                                 tl.maximum(tl.load(ms.num_cached + g * mc.R + r), hit.hits))
                        g += 1
                tl.store(ms.num_blocks + r, nrow)
                tl.store(ms.reserved + r, own - adm.take)
                tl.store(ms.num_computed + r, blocks.eff)
                tl.store(batch.admitted + k, 1)
            elif STOP_ON_FAILURE:
                stop = 1
            k += 1
        tl.debug_barrier()  # strict: orders the reads of HEAD / TAIL / NUM_FREE above before these stores
        tl.store(ps.ctrl + HEAD, head)
        tl.store(ps.ctrl + TAIL, tail)
        tl.store(ps.ctrl + NUM_FREE, num_free)
        tl.store(ms.num_reserved, resv_total)


def launch_allocate_slots(ps, pc, ms, mc, batch, *, stop_on_failure: bool):
    """Launch ``allocate_slots_kernel`` (one program), after ``launch_allocate_slots_parallel``."""
    allocate_slots_kernel[(1,)](ps, pc, ms, mc, batch, batch.slots.numel(), STOP_ON_FAILURE=bool(stop_on_failure),
                                num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
