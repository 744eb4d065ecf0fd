"""One launch for a batch of the four batched pool ops, in the order free, touch, pop, cache
(``BlockPool.apply_batched``; the vLLM fast path's flush, docs/vllm.md "The fast path").

Each part is the op's own body (``release_batch``, ``touch_batch``, ``alloc_batch``,
``cache_blocks_batch``), all or nothing; a part that fails records its error in the status word, which
makes every later part do nothing (docs/semantics.md section 3), as four launches would. The caching's
ids may name blocks this launch pops: ``N + k`` is the k-th popped block.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .alloc import alloc_batch, fill_head_minus_one
from .cache import cache_blocks_batch
from .common import batch_config, status_clear, warps_for
from .layout import OP_ALLOCATE_BATCHED, OP_CACHE_BLOCKS_BATCHED, OP_FREE_BATCHED, OP_TOUCH_BATCHED
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


@triton.jit
def flush_kernel(ps, pc: tl.constexpr, fr, touch_ids, pop, ca, n_free, nseg, n_touch, n_demands, n_cache,
                 want):
    """``free_batched`` of ``fr.ids[:n_free]`` (``nseg`` segments), ``touch_batched`` of
    ``touch_ids[:n_touch]``, ``allocate_batched`` of ``pop.demands[:n_demands]`` (their sum ``want``)
    and ``cache_blocks_batched`` of ``ca``'s first ``n_cache`` items, in that order (module
    docstring). ``pop.blocks[:want]`` is -1 when the pops fail or are skipped (as ``allocate_batched``)."""
    release_batch(ps, pc, fr.ids, None, n_free, fr.seg_off, nseg, fr.pf, fr.seg_of, fr.code, OP_FREE_BATCHED,
                  False)
    tl.debug_barrier()
    touch_batch(ps, pc, touch_ids, None, n_touch, OP_TOUCH_BATCHED)
    tl.debug_barrier()
    err_pop = tl.full([], 1, tl.int32)  # not run
    total = tl.zeros([], tl.int64)
    if status_clear(ps.status):
        err_pop, total = alloc_batch(ps, pc, pop.demands, None, n_demands, pop.blocks, pop.offsets,
                                     OP_ALLOCATE_BATCHED)
    total = tl.where(err_pop == 0, total, 0)  # blocks popped: none when the part failed (nothing to resolve)
    if err_pop != 0:
        fill_head_minus_one(pop.blocks, want, pc.BLOCK)
    tl.debug_barrier()
    resolve_popped(pc, ca.ids, ca.resolved, n_cache, pop.blocks, total)
    tl.debug_barrier()
    cache_blocks_batch(ps, pc, ca.resolved, ca.key_hi, ca.key_lo, ca.key_group, ca.ntok, n_cache,
                       OP_CACHE_BLOCKS_BATCHED)


def launch_flush(ps, pc, free_ids, seg_off, touch_ids, demands, cache_ids, key_hi, key_lo, key_group, ntok, *,
                 n_free: int, n_touch: int, n_demands: int, n_cache: int, total: int):
    """Launch ``flush_kernel`` (one program; the pool has no KV events). Every argument is a device
    tensor with at least one entry, of which the first ``n_*`` count (``seg_off``: all of it, the
    free calls' offsets); ``total``: the demands' sum, checked on the host (sizes the output).
    Returns ``(blocks: int32[total], offsets: int32[n_demands + 1])``; ``blocks`` all -1 when the pops
    fail or are skipped."""
    import torch

    if pc.EVENTS:
        raise ValueError("flush_kernel's caching writes no events")
    dev = free_ids.device
    pc = batch_config(pc, max(n_free, n_touch, total, n_cache))
    blocks = torch.empty(total + 1, dtype=torch.int32, device=dev)
    offsets = torch.empty(n_demands + 1, dtype=torch.int32, device=dev)
    nf, nc = max(n_free, 1), max(n_cache, 1)
    scratch = torch.empty(3 * nf + 1 + nc, dtype=torch.int32, device=dev)
    fr = FreePart(free_ids, seg_off, scratch[: nf + 1], scratch[nf + 1: 2 * nf + 1], scratch[2 * nf + 1: 3 * nf + 1])
    ca = CachePart(cache_ids, scratch[3 * nf + 1:], key_hi, key_lo, key_group, ntok)
    flush_kernel[(1,)](ps, pc, fr, touch_ids, PopPart(demands, blocks, offsets), ca, n_free, seg_off.numel() - 1,
                       n_touch, n_demands, n_cache, total, num_warps=warps_for(pc.BLOCK))
    return blocks[:total], offsets
