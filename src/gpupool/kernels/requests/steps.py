"""vLLM's per-request admission steps, written once (docs/semantics.md sections 6 and 8), each a
``@triton.jit`` function; those with more than one result return a NamedTuple of this module. The
exact path (``exact.py``, ``allocate_slots_exact_checked``) and the trace replay's event loop
(``kernels/replay.py``) are loops over them:

1. :func:`remove_skipped_blocks` -> :class:`Released` (the groups whose kind releases blocks);
2. :func:`max_cache_hit_length`, then :func:`find_longest_cache_hit` (or :func:`get_computed_blocks`,
   the manager's row layout) -> :class:`CacheHit`;
3. :func:`get_num_blocks_to_allocate` -> :class:`BlocksToAllocate`;
4. :func:`admit` (the fit check against the free blocks nobody else reserved, and the reservation
   draw) -> :class:`Admission`;
5. :func:`allocate_blocks` (touch every group's hits, then ``allocate_new_blocks`` group by group)
   -> :class:`Allocated`;
6. :func:`cache_blocks` (manager rows; :func:`cache_full_blocks` for one row of full blocks).

The pure-arithmetic steps (2's length, 3, 4) are elementwise: scalars or int32 tiles of one shape.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from ..alloc import pop_and_claim
from ..cache import add_key, cache_range
from ..groups import num_skipped_blocks, releases_blocks
from ..layout import EV_COUNT, KEY_SEQ
from ..lookup import GroupKinds, find_longest_cache_hit as lookup_longest_prefix
from ..release import free_checked, touch_checked
from .rows import keys_of, row_of


class Released(NamedTuple):
    """:func:`remove_skipped_blocks`: the free queue's new ``head`` and ``tail`` and the blocks it
    put back on the queue (``num_released``; the caller raises num_free by it)."""

    head: tl.tensor
    tail: tl.tensor
    num_released: tl.tensor


class CacheHit(NamedTuple):
    """:func:`find_longest_cache_hit`: ``hits`` (blocks per group, a prefix of the request's full
    blocks) and ``zero_ref`` (hit blocks with ref_cnt 0, counted per position and group: touching
    takes each off the free queue)."""

    hits: tl.tensor
    zero_ref: tl.tensor


class BlocksToAllocate(NamedTuple):
    """:func:`get_num_blocks_to_allocate`: ``eff`` tokens with slots after the step, ``need`` new
    blocks per group, ``demand`` blocks taken off the free queue (``need * G + zero_ref``)."""

    eff: tl.tensor
    need: tl.tensor
    demand: tl.tensor


class Admission(NamedTuple):
    """:func:`admit`: whether the request ``fits``, and the blocks it would ``take`` from its own
    reservation (docs/semantics.md section 8)."""

    fits: tl.tensor
    take: tl.tensor


class Allocated(NamedTuple):
    """:func:`allocate_blocks`: the free queue's new ``head`` and ``num_free``."""

    head: tl.tensor
    num_free: tl.tensor


@triton.jit
def remove_skipped_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, head, tail):
    """vLLM's ``remove_skipped_blocks`` for slot r: in every group whose kind releases blocks, the
    blocks its skip rule skips (by ``num_computed`` before the step; ``kernels/groups.py``) are freed
    tail first, down to the first null block, and replaced by the null block. Returns :class:`Released`."""
    offs = tl.arange(0, pc.BLOCK)
    released = tl.zeros([], tl.int32)
    ncomp = tl.load(ms.num_computed + r)
    nblk = tl.load(ms.num_blocks + r)
    g = 0
    while g < mc.G:
        kind = tl.load(ms.kinds + g)
        if releases_blocks(kind):
            row = row_of(ms, mc, g, r)
            nskip = num_skipped_blocks(ncomp, kind, tl.load(ms.windows + g), BS=mc.BS, num_blocks=nblk)
            last_null = tl.full([], -1, tl.int32)
            t = 0
            while t < nskip:
                pos = t + offs
                v = tl.load(row + pos, mask=pos < nskip, other=1)
                last_null = tl.maximum(last_null, tl.max(tl.where((pos < nskip) & (v == 0), pos, -1), axis=0))
                t += pc.BLOCK
            n = nskip - last_null - 1
            t = 0
            # Reversed into the scratch list: vLLM frees a request's blocks tail first, so the
            # queue evicts a chain's later blocks (the least reusable prefix) first.
            while t < n:
                pos = t + offs
                tl.store(ms.s_ids + pos, tl.load(row + nskip - 1 - pos, mask=pos < n, other=0), mask=pos < n)
                t += pc.BLOCK
            tl.debug_barrier()
            head, tail, rel, _, _ = free_checked(ps, pc, ms.s_ids, n=n, pf=ms.s_pf, head=head, tail=tail)
            released += rel
            t = last_null + 1
            while t < nskip:
                pos = t + offs
                tl.store(row + pos, tl.zeros([pc.BLOCK], tl.int32), mask=pos < nskip)
                t += pc.BLOCK
            tl.debug_barrier()
        g += 1
    return Released(head=head, tail=tail, num_released=released)


@triton.jit
def max_cache_hit_length(num_tokens, num_hashes, BS: tl.constexpr, K: tl.constexpr):
    """Full blocks a lookup may hit: ``min(max(num_tokens - 1, 0) // BS, num_hashes // K)``. vLLM's
    ``get_computed_blocks`` stops one token short: when every token hits, the last one is still
    computed to get its logits."""
    return tl.minimum(tl.maximum(num_tokens - 1, 0) // BS, num_hashes // K)


@triton.jit
def find_longest_cache_hit(ps, pc: tl.constexpr, key_hi, key_lo, gstride, pstride, groups, gk, G, length,
                           out_blocks, out_stride, BS: tl.constexpr, CHUNKED: tl.constexpr):
    """vLLM's ``find_longest_cache_hit`` (``lookup.find_longest_cache_hit``: the key and output
    layout, the groups' kinds and parameters ``gk``) as a :class:`CacheHit`."""
    hits, zero_ref = lookup_longest_prefix(ps, pc, key_hi, key_lo, gstride=gstride, pstride=pstride, groups=groups,
                                           gk=gk, G=G, length=length, out_blocks=out_blocks, out_stride=out_stride,
                                           BLOCK=pc.BLOCK, BS=BS, CHUNKED=CHUNKED)
    return CacheHit(hits=hits, zero_ref=zero_ref)


@triton.jit
def get_computed_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, num_tokens, lookup, nblk):
    """vLLM's ``get_computed_blocks`` for slot r with ``num_tokens`` tokens: the longest hit of its
    full-block keys over every group, into its rows (a :class:`CacheHit`); none unless ``lookup``,
    caching is on and the row is empty."""
    hit = CacheHit(hits=tl.zeros([], tl.int32), zero_ref=tl.zeros([], tl.int32))
    if pc.CACHING:
        if (lookup != 0) & (nblk == 0):
            keys = keys_of(mc, 0, r) + mc.K - 1  # full block i: hash (i + 1) * K - 1
            hit = find_longest_cache_hit(ps, pc, ms.req_hi + keys, ms.req_lo + keys, gstride=mc.M * mc.K,
                                         pstride=mc.K, groups=ms.group_ids, gk=GroupKinds(ms.kinds, ms.windows), G=mc.G,
                                         length=max_cache_hit_length(num_tokens, tl.load(ms.num_hashes + r),
                                                                     BS=mc.BS, K=mc.K),
                                         out_blocks=row_of(ms, mc, 0, r), out_stride=mc.R * mc.M, BS=mc.BS,
                                         CHUNKED=mc.CHUNKED)
    return hit


@triton.jit
def get_num_blocks_to_allocate(num_tokens, hits, zero_ref, num_blocks, G: tl.constexpr, BS: tl.constexpr):
    """vLLM's ``get_num_blocks_to_allocate`` (:class:`BlocksToAllocate`): ``eff = max(num_tokens,
    hits * BS)``, ``need = max(ceil(eff / BS) - num_blocks - hits, 0)`` per group, ``demand = need *
    G + zero_ref``. vLLM counts a zero-ref hit as allocated: touching it takes it off the free queue."""
    eff = tl.maximum(num_tokens, hits * BS)
    need = tl.maximum((eff + BS - 1) // BS - num_blocks - hits, 0)
    return BlocksToAllocate(eff=eff, need=need, demand=need * G + zero_ref)


@triton.jit
def admit(demand, num_free, num_reserved, reserved):
    """The admission check (docs/semantics.md section 8) as an :class:`Admission`: a request fits if
    ``demand <= num_free - (num_reserved - reserved)`` (the other requests' reservations are held
    back; ``num_free`` int64), and then takes ``min(reserved, demand)`` from its own reservation
    (drawn first)."""
    fits = demand.to(tl.int64) <= num_free - (num_reserved - reserved).to(tl.int64)
    return Admission(fits=fits, take=tl.minimum(reserved, demand))


@triton.jit
def allocate_blocks(ps, pc: tl.constexpr, rows, ROW_STRIDE: tl.constexpr, G: tl.constexpr, nblk, hits, need, head,
                    tail, num_free):
    """An admitted request's blocks (an :class:`Allocated`): every group's ``hits`` at ``rows + g *
    ROW_STRIDE`` touched, then vLLM's ``allocate_new_blocks``: each group in order gets ``need``
    blocks from the queue's head at ``row[nblk + hits:]`` (evicting their keys). The caller has
    checked the demand (:func:`admit`) and the event room."""
    g = tl.zeros([], tl.int64)
    # Every group's hits first (vLLM touches the computed blocks so they won't be evicted): a zero-ref
    # hit still on the free queue could otherwise be popped by an earlier group's allocation.
    while g < G:
        num_free -= touch_checked(ps, pc, rows + g * ROW_STRIDE, n=hits)
        g += 1
    g = tl.zeros([], tl.int64)
    while g < G:
        head = pop_and_claim(ps, pc, head, tail, out=rows + g * ROW_STRIDE, base=nblk + hits, total=need)
        g += 1
    return Allocated(head=head, num_free=num_free - need * G)


@triton.jit
def cache_full_blocks(ps, pc: tl.constexpr, row, start, nf, key_hi, key_lo, key0, kstride, group, bs):
    """vLLM's ``cache_full_blocks`` of ``row[start:nf]`` (one BlockStored, possibly empty): block i's
    key is ``key_hi/lo[key0 + i * kstride]`` (group ``group``, ``(i + 1) * bs`` tokens), the parent
    the key of block ``start - 1`` when ``start > 0``; ``KEY_SEQ`` and ``EV_COUNT`` stored (thread 0),
    then a barrier."""
    pk = key0 + (start - 1).to(tl.int64) * kstride
    ev_pos, seq = cache_range(ps, pc, row, mask=row, nc=start, nf=nf, khi=key_hi, klo=key_lo, kbase=key0,
                              kstride=kstride, grp=group, bs=bs, has_parent=(start > 0).to(tl.int64),
                              parent_hi=tl.load(key_hi + pk, mask=start > 0, other=0),
                              parent_lo=tl.load(key_lo + pk, mask=start > 0, other=0), HAS_MASK=False)
    if nf <= start:  # nothing cached, so no barrier in cache_range orders its reads of these words
        tl.debug_barrier()
    tl.store(ps.ctrl + KEY_SEQ, seq)
    tl.store(ps.ctrl + EV_COUNT, ev_pos)
    tl.debug_barrier()  # strict: orders KEY_SEQ / EV_COUNT (thread 0) before the caller's next reads


@triton.jit
def cache_blocks(ps, pc: tl.constexpr, ms, mc: tl.constexpr, r, known, hits, nrow):
    """vLLM's ``cache_blocks`` after an admission of slot r with ``known`` tokens written: per group,
    :func:`cache_full_blocks` of ``row[max(num_cached, hits):nf]`` when ``nf`` (full blocks known) is
    past it, then with K > 1 the block after them keyed up to its last complete hash block
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
            cache_full_blocks(ps, pc, row, start, nf, ms.req_hi, ms.req_lo, key0=kb + mc.K - 1, kstride=mc.K, group=g,
                              bs=mc.BS)
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
                    _, rows = add_key(ps, pc, b, hi=tl.load(ms.req_hi + ka), lo=tl.load(ms.req_lo + ka), grp=g,
                                      ntok=(nh * hbs).to(tl.int64), has_parent=(nh > 1).to(tl.int64),
                                      parent_hi=tl.load(ms.req_hi + ka - 1, mask=nh > 1, other=0),
                                      parent_lo=tl.load(ms.req_lo + ka - 1, mask=nh > 1, other=0), block_size=hbs,
                                      ev_pos=ev_pos, REPLACE=False)
                    tl.debug_barrier()  # strict: orders the read of EV_COUNT above before this store
                    tl.store(ps.ctrl + EV_COUNT, ev_pos + rows)
                    tl.debug_barrier()  # strict: orders EV_COUNT (thread 0) before the next group's reads (all)
        g += 1
