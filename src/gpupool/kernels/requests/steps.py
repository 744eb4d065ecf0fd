"""vLLM's per-request admission steps, as the exact path runs them (``remove_skipped_blocks``,
``get_num_blocks_to_allocate``, ``allocate_new_blocks``, ``cache_blocks``; docs/semantics.md section 6)."""
import triton
import triton.language as tl

from ..alloc import pop_and_claim
from ..cache import add_key, cache_range
from ..groups import num_skipped_blocks
from ..layout import EV_COUNT, KEY_SEQ
from ..release import free_checked
from .rows import keys_of, row_of


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
