"""Attention views of the block table (docs/kv_cache.md): for the requests of a step, or of each step
of a burst, the paged-KV inputs that real attention kernels take, built on the device.

* FlashAttention (``flash_attn_with_kvcache``, vLLM's FlashAttention backend): ``block_table:
  int32[B, M]`` (each lane's row of group ``group``; entries past the row's length, and the rows of
  lanes that take no part in step 0, are 0, the null block) and ``seqused_k: int32[K, B]`` (tokens each lane attends to at step k; 0 for a lane that
  takes no part);
* FlashInfer's paged layout (``BatchDecodeWithPagedKVCacheWrapper.plan``): ``kv_indptr:
  int32[K, B + 1]`` (exclusive prefix sum of the pages), ``kv_indices: int32[K, B * M]`` (the pages of
  lane 0, then lane 1, ...; the tail past ``kv_indptr[k, B]`` is left as it was) and
  ``kv_last_page_len: int32[K, B]`` (``(seq - 1) % block_size + 1``; 1 for an empty lane, FlashInfer's documented range).

Step k's length of lane i is ``base_len[i] + k`` where ``admitted[k, i] != 0`` (every lane ``< num``
without ``admitted``), else 0. Programs over (step, tile of lanes), each writing its lanes' rows at
once, its positions in ``kv_indices`` from a prefix sum (no loop over requests).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..common import checked_count, keep_first_why, no_error_why, set_status_why
from ..layout import C_COUNT_PAST_ARRAYS, C_LENGTH_OUTSIDE_ROW, E_INVALID_ARG, OP_ATTENTION_VIEWS
from .checks import or_count_error, slot_cause

TILE_ELEMS = 4096  # lanes x blocks of one row-copy tile


class LaneLengths(NamedTuple):
    """:func:`lane_lengths` of a tile of lanes at one step: ``live`` (the lane takes part: below the
    count and admitted), its ``slot`` and row length ``nblk`` (blocks), ``slot_ok`` (live, in range,
    in use), ``ok`` (that and a length inside the row), ``seq`` (its length, 0 unless ``ok``) and
    ``pages`` (``ceil(seq / BS)``)."""

    live: tl.tensor
    slot: tl.tensor
    nblk: tl.tensor
    slot_ok: tl.tensor
    ok: tl.tensor
    seq: tl.tensor
    pages: tl.tensor


@triton.jit
def lane_lengths(ms, mc: tl.constexpr, slots, base_len, admitted, n, cap, k, idx, HAS_ADMITTED: tl.constexpr):
    """Lanes ``idx`` at step ``k`` as a :class:`LaneLengths`."""
    live = idx < n
    if HAS_ADMITTED:
        live = live & (tl.load(admitted + k * cap + idx, mask=live, other=0) != 0)
    r = tl.load(slots + idx, mask=live, other=0)
    seq = tl.load(base_len + idx, mask=live, other=0) + k
    okr = live & (r >= 0) & (r < mc.R)
    okr = okr & (tl.load(ms.active + r, mask=okr, other=0) != 0)
    nblk = tl.load(ms.num_blocks + r, mask=okr, other=0)
    ok = okr & (seq >= 0) & (seq <= nblk * mc.BS)
    seq = tl.where(ok, seq, 0)
    return LaneLengths(live=live, slot=r, nblk=nblk, slot_ok=okr, ok=ok, seq=seq, pages=(seq + mc.BS - 1) // mc.BS)


@triton.jit
def attention_views_kernel(ps, ms, mc: tl.constexpr, slots, base_len, admitted, num, cap, group, K, views,
                           HAS_ADMITTED: tl.constexpr, RB: tl.constexpr, MB: tl.constexpr):
    """Grid ``(K, max(1, cdiv(cap, RB)))``: program (k, t) writes step k's views of lanes ``t * RB ..`` of
    ``slots[:num]`` (``int32[cap]``; module docstring) into ``views`` (``AttentionViews``), its ``kv_indices`` offset the pages of the
    lanes before it (a sum over tiles of ``mc.BLOCK`` lanes). Program (0, 0) alone checks every lane
    of every step: a live lane whose slot is out of range or not in use, or whose length passes its
    row (``num_blocks * BS``) or is negative, and a count outside ``0..cap``, set the status word (op
    ATTENTION_VIEWS, the first bad lane's value); such a lane gets length 0 (no page is read
    through it)."""
    k = tl.program_id(0)
    t = tl.program_id(1)
    n, n_ok = checked_count(num, cap)
    lanes = tl.arange(0, mc.BLOCK)
    carry = tl.zeros([], tl.int32)
    for i in range(0, t * RB, mc.BLOCK):
        before = lane_lengths(ms, mc, slots, base_len, admitted, tl.minimum(n, t * RB), cap, k, i + lanes,
                              HAS_ADMITTED=HAS_ADMITTED)
        carry += tl.sum(before.pages, axis=0)
    idx = t * RB + tl.arange(0, RB)
    inb = idx < cap
    lane = lane_lengths(ms, mc, slots, base_len, admitted, n, cap, k, idx, HAS_ADMITTED=HAS_ADMITTED)
    seq, pages = lane.seq, lane.pages
    start = carry + tl.cumsum(pages, axis=0) - pages
    tl.store(views.seqused_k + k * cap + idx, seq, mask=inb)
    tl.store(views.kv_indptr + k * (cap + 1) + idx, start, mask=inb)
    tl.store(views.kv_last_page_len + k * cap + idx, tl.where(seq > 0, (seq - 1) % mc.BS + 1, 1), mask=inb)
    if (t + 1) * RB >= cap:  # the last tile closes the prefix sum
        tl.store(views.kv_indptr + k * (cap + 1) + cap, carry + tl.sum(pages, axis=0))
    row = (group * mc.R + lane.slot).to(tl.int64) * mc.M
    cols = tl.arange(0, MB)
    for j in range(0, mc.M, MB):
        jj = j + cols
        blk = tl.load(ms.block_table + row[:, None] + jj[None, :],
                      mask=lane.slot_ok[:, None] & (jj[None, :] < lane.nblk[:, None]), other=0)
        if k == 0:  # one table for every step: the rows hold the whole burst's blocks
            tl.store(views.block_table + idx[:, None].to(tl.int64) * mc.M + jj[None, :], blk,
                     mask=inb[:, None] & (jj[None, :] < mc.M))
        tl.store(views.kv_indices + k * cap * mc.M + start[:, None] + jj[None, :], blk, mask=jj[None, :] < pages[:, None])
    if (k == 0) & (t == 0):
        err, val, why, extra, err_i = no_error_why()
        err, val, why, extra = or_count_error(err, val, why, extra, n_ok, num, cap, CAUSE=C_COUNT_PAST_ARRAYS)
        for kk in range(0, K):
            for i in range(0, cap, mc.BLOCK):
                idx = i + lanes
                e = lane_lengths(ms, mc, slots, base_len, admitted, n, cap, kk, idx, HAS_ADMITTED=HAS_ADMITTED)
                bad_val = tl.where(e.slot_ok, tl.load(base_len + idx, mask=e.live, other=0) + kk, e.slot)
                idle = e.live & (e.slot >= 0) & (e.slot < mc.R) & ~e.slot_ok
                err, val, why, extra, err_i = keep_first_why(
                    err, val, why, extra, err_i, new_err=E_INVALID_ARG, bad=e.live & ~e.ok, idx=idx + kk * cap,
                    val=bad_val, cause=tl.where(e.slot_ok, C_LENGTH_OUTSIDE_ROW, slot_cause(mc, e.slot, idle)),
                    ext=e.slot)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_ATTENTION_VIEWS, value=val, cause=why, extra=extra)


def launch_attention_views(ps, ms, mc, slots, base_len, admitted, num, group: int, steps: int, views) -> None:
    """Launch :func:`attention_views_kernel` into ``views`` (``gpupool.kv_cache.AttentionViews``)."""
    cap = slots.numel()
    mb = min(triton.next_power_of_2(mc.M), TILE_ELEMS)
    rb = max(1, min(mc.BLOCK, TILE_ELEMS // mb))
    # at least one tile: program (0, 0) checks the count even of an empty batch
    attention_views_kernel[(steps, max(1, triton.cdiv(cap, rb)))](
        ps, ms, mc, slots, base_len, slots if admitted is None else admitted, num, cap, group, steps, views,
        HAS_ADMITTED=admitted is not None, RB=rb, MB=mb, num_warps=4)
