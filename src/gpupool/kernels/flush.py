"""One launch for a batch of the four batched pool ops, in the order free, touch, pop, cache, in one
round or several one after another (``BlockPool.apply_batched``; the vLLM fast path's flush,
docs/vllm.md "The fast path").

Each part is the op's own body (``release_batch``, ``touch_batch``, ``alloc_batch``,
``cache_blocks_batch``), all or nothing; a part that fails records its error in the status word, which
makes every later part do nothing (docs/semantics.md section 3), as four launches would. The caching's
ids may name blocks this launch pops: ``N + k`` is the k-th popped block (in this round or an earlier one).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .alloc import alloc_batch, fill_head_minus_one
from .cache import cache_blocks_batch
from .common import batch_config, status_clear, warps_for
from .layout import (
    CF_AFTER, CF_BEFORE, CONFIRM_WIDTH, OP_ALLOCATE_BATCHED, OP_CACHE_BLOCKS_BATCHED, OP_FREE_BATCHED,
    OP_TOUCH_BATCHED, RF_CACHE_START, RF_CACHINGS, RF_DEMANDS, RF_DEMANDS_START, RF_FREE_CALLS, RF_FREE_IDS,
    RF_FREE_OFFSETS_START, RF_FREE_START, RF_POPPED, RF_POPPED_START, RF_TOUCH_START, RF_TOUCHES, RW, RoundField,
)
from .release import release_batch, touch_batch


class FreePart(NamedTuple):
    ids: object  # int32[>= n_free]: the frees' ids, call after call
    seg_off: object  # int32[nseg + 1]: call j is ids[seg_off[j]:seg_off[j + 1]]
    pf: object  # int32[n_free + 1] scratch
    seg_of: object  # int32[>= n_free] scratch
    code: object  # int32[>= n_free] scratch


class PopPart(NamedTuple):
    demands: object  # int32[>= n_demands]
    blocks: object  # int32[>= total + 1] out: the popped blocks
    offsets: object  # int32[n_demands + 1] out
    confirm: object  # int32[CONFIRM_WIDTH] out: the launch's confirmation words (layout.Confirm)


class CachePart(NamedTuple):
    ids: object  # int32[>= n_cache]: block ids, or N + k for the k-th popped block
    resolved: object  # int32[>= n_cache] scratch: the block ids
    key_hi: object  # int64[>= n_cache]
    key_lo: object
    key_group: object
    ntok: object


@triton.jit
def resolve_popped(pc: tl.constexpr, ids, out, n, popped, total):
    """``out[i] = ids[i]``, except ``popped[ids[i] - N]`` for ``N <= ids[i] < N + total``."""
    offs = tl.arange(0, pc.BLOCK)
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        v = tl.load(ids + idx, mask=m, other=0)
        mine = m & (v >= pc.N) & (v < pc.N + total)
        v = tl.where(mine, tl.load(popped + (v - pc.N), mask=mine, other=0), v)
        tl.store(out + idx, v, mask=m)
        i += pc.BLOCK


# round_table writes a row's fields in this order, which must be RoundField's
_ROW_ORDER = ("FREE_START", "FREE_OFFSETS_START", "FREE_CALLS", "FREE_IDS", "TOUCH_START", "TOUCHES", "DEMANDS_START",
              "DEMANDS", "POPPED_START", "POPPED", "CACHE_START", "CACHINGS")
assert _ROW_ORDER == tuple(f.name for f in sorted(RoundField)), "round_table's order is RoundField's"


def round_table(rounds, has_free: bool) -> list[int]:
    """The kernel's round table (``layout.RoundField`` per round) from per-round counts ``(free ids,
    free calls, touches, demands as a list, cachings)``: where each part starts in its flattened array
    (a round's free offsets are its own, from 0, ``free calls + 1`` entries; without frees every round
    reads the one entry 0)."""
    out, f0, s0, t0, d0, b0, c0 = [], 0, 0, 0, 0, 0, 0
    for nfi, nfc, nt, dem, nc in rounds:
        want = sum(dem)
        out += (f0, s0, nfc, nfi, t0, nt, d0, len(dem), b0, want, c0, nc)  # _ROW_ORDER
        f0, t0, d0, b0, c0 = f0 + nfi, t0 + nt, d0 + len(dem), b0 + want, c0 + nc
        s0 += nfc + 1 if has_free else 0
    return out


@triton.jit
def flush_kernel(ps, pc: tl.constexpr, fr, touch_ids, pop, ca, rounds, n_rounds):
    """Round after round (``rounds``: ``round_table``'s entries): ``free_batched`` of the round's
    frees (its segments), ``touch_batched`` of its touches, ``allocate_batched`` of its demands and
    ``cache_blocks_batched`` of its cachings, in that order (module docstring). ``pop.blocks`` holds
    every round's pops one after another, -1 for a round whose pops fail or are skipped (as
    ``allocate_batched``); ``pop.offsets``: round r's offsets at ``demands start + r``;
    ``pop.confirm``: the status code before the rounds and after them (layout.Confirm)."""
    # strict: benign, every thread stores the one value it read before any store of this launch
    tl.store(pop.confirm + CF_BEFORE, tl.load(ps.status))
    r = 0
    while r < n_rounds:
        m = rounds + r * RW
        f0, s0 = tl.load(m + RF_FREE_START), tl.load(m + RF_FREE_OFFSETS_START)
        nseg, n_free = tl.load(m + RF_FREE_CALLS), tl.load(m + RF_FREE_IDS)
        t0, n_touch = tl.load(m + RF_TOUCH_START), tl.load(m + RF_TOUCHES)
        d0, n_demands = tl.load(m + RF_DEMANDS_START), tl.load(m + RF_DEMANDS)
        b0, want = tl.load(m + RF_POPPED_START), tl.load(m + RF_POPPED)
        c0, n_cache = tl.load(m + RF_CACHE_START), tl.load(m + RF_CACHINGS)
        release_batch(ps, pc, fr.ids + f0, None, n_free, fr.seg_off + s0, nseg, fr.pf, fr.seg_of, fr.code,
                      OP_FREE_BATCHED, False)
        tl.debug_barrier()
        touch_batch(ps, pc, touch_ids + t0, None, n_touch, OP_TOUCH_BATCHED)
        tl.debug_barrier()
        err_pop = tl.full([], 1, tl.int32)  # not run
        total = tl.zeros([], tl.int64)
        if status_clear(ps.status):
            err_pop, total = alloc_batch(ps, pc, pop.demands + d0, None, n_demands, pop.blocks + b0,
                                         pop.offsets + d0 + r, OP_ALLOCATE_BATCHED)
        total = tl.where(err_pop == 0, total, 0)  # blocks popped: none when the part failed (nothing to resolve)
        if err_pop != 0:
            fill_head_minus_one(pop.blocks + b0, want, pc.BLOCK)
        tl.debug_barrier()
        # N + k names the launch's k-th pop: those of this round and the earlier ones
        resolve_popped(pc, ca.ids + c0, ca.resolved + c0, n_cache, pop.blocks, b0 + total)
        tl.debug_barrier()
        cache_blocks_batch(ps, pc, ca.resolved + c0, ca.key_hi + c0, ca.key_lo + c0, ca.key_group + c0,
                           ca.ntok + c0, n_cache, OP_CACHE_BLOCKS_BATCHED)
        tl.debug_barrier()
        r += 1
    tl.store(pop.confirm + CF_AFTER, tl.load(ps.status))


def launch_flush(ps, pc, free_ids, seg_off, touch_ids, demands, rounds, cache_ids, key_hi, key_lo, key_group, ntok,
                 *, n_rounds: int, n_free: int, n_touch: int, n_demands: int, n_cache: int, total: int):
    """Launch ``flush_kernel`` (one program; the pool has no KV events). Every argument is a device
    tensor with at least one entry, of which the first ``n_*`` count (``seg_off``: every round's
    offsets; ``rounds``: ``round_table``'s ``n_rounds * ROUND_WIDTH`` entries, int32); ``total``:
    the demands' sum, checked on the host (sizes the output). Returns ``(blocks: int32[total],
    offsets: int32[n_demands + 1], confirm: int32[CONFIRM_WIDTH])``, the offsets over all rounds'
    demands; ``blocks`` -1 where a round's pops fail or are skipped; ``confirm`` the status code
    before the launch and after it (not 0 before: a recorded error made it do nothing)."""
    import torch

    if pc.EVENTS:
        raise ValueError("flush_kernel's caching writes no events")
    dev = free_ids.device
    pc = batch_config(pc, max(n_free, n_touch, total, n_cache))
    blocks = torch.empty(total + 1, dtype=torch.int32, device=dev)
    out = torch.empty(n_demands + n_rounds + CONFIRM_WIDTH, dtype=torch.int32, device=dev)
    offsets, confirm = out[: n_demands + n_rounds], out[n_demands + n_rounds:]
    nf, nc = max(n_free, 1), max(n_cache, 1)
    scratch = torch.empty(3 * nf + 1 + nc, dtype=torch.int32, device=dev)
    fr = FreePart(free_ids, seg_off, scratch[: nf + 1], scratch[nf + 1: 2 * nf + 1], scratch[2 * nf + 1: 3 * nf + 1])
    ca = CachePart(cache_ids, scratch[3 * nf + 1:], key_hi, key_lo, key_group, ntok)
    flush_kernel[(1,)](ps, pc, fr, touch_ids, PopPart(demands, blocks, offsets, confirm), ca, rounds, n_rounds,
                       num_warps=warps_for(pc.BLOCK))
    if n_rounds > 1:  # each round wrote its own offsets, from 0: the demands' prefix sums over all of them
        offsets = torch.cat([offsets[:1], torch.cumsum(demands[:n_demands], 0).to(torch.int32)])
    return blocks[:total], offsets[: n_demands + 1], confirm
