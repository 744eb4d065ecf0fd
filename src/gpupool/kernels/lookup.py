"""Read-only prefix lookups: many keys at once (``lookup_batched``), and the longest cached prefix of
many hash chains (``longest_prefix_batched``).

These only read pool state and write their own outputs, one disjoint range per program, so any
number of programs run without races. A bad count or length read from a device input looks nothing
up for that program and records E_INVALID_ARG with one compare-and-swap on the status code, so an
earlier error stays first.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .common import checked_count, raw_count
from .groups import block_hit, group_kind, windowed, windowed_hit
from .keytable import lookup_blocks
from .layout import BIG, E_INVALID_ARG, ST_CODE, ST_OP, ST_VALUE


class GroupKinds(NamedTuple):
    """A manager's groups' kinds as the lookups read them: ``kinds, windows: int32[G]`` (their codes and
    parameters, ``ManagerState``)."""

    kinds: tl.tensor
    windows: tl.tensor


@triton.jit
def record_error(status, op: tl.constexpr, value):
    """Record E_INVALID_ARG from one of many programs: only the first writer's record stays."""
    v = tl.cast(value, tl.int64)
    if tl.atomic_cas(status + ST_CODE, tl.zeros([], tl.int64), tl.full([], E_INVALID_ARG, tl.int64)) == 0:
        tl.store(status + ST_OP, tl.full([], op, tl.int64))
        tl.store(status + ST_VALUE, v)


@triton.jit
def lookup_kernel(ps, pc: tl.constexpr, key_hi, key_lo, key_group, num_keys_in, cap, out_block,
                  OP: tl.constexpr, BLOCK: tl.constexpr):
    """``out_block[i]`` = earliest-inserted block under key i, or -1, for ``i < num_keys_in[0]``.
    Grid: cdiv(cap, BLOCK); ``key_hi, key_lo: int64[cap]``, ``key_group: int32[cap]``. A count outside
    ``0..cap`` looks nothing up (program 0 records it)."""
    n, n_ok = checked_count(num_keys_in, cap)
    if (tl.program_id(0) == 0) & (n_ok == 0):
        record_error(ps.status, OP, raw_count(num_keys_in, cap))
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    hi = tl.load(key_hi + idx, mask=m, other=0)
    lo = tl.load(key_lo + idx, mask=m, other=0)
    g = tl.load(key_group + idx, mask=m, other=0)
    tl.store(out_block + idx, lookup_blocks(ps, pc, hi, lo, g, m), mask=m)


def launch_lookup(ps, pc, key_hi, key_lo, key_group, num_keys, out, *, op: int):
    """Launch ``lookup_kernel`` over ``cdiv(K, 256)`` programs of 256 keys."""
    k = key_hi.numel()
    block = 256
    lookup_kernel[(max(1, -(-k // block)),)](ps, pc, key_hi, key_lo, key_group, num_keys, k, out, OP=op, BLOCK=block,
                                             num_warps=4)


@triton.jit
def find_longest_cache_hit(ps, pc: tl.constexpr, key_hi, key_lo, gstride, pstride, groups, gk, G, length, out_blocks,
                           out_stride, BLOCK: tl.constexpr, BS: tl.constexpr, CHUNKED: tl.constexpr):
    """vLLM's ``find_longest_cache_hit``: the longest prefix of ``length`` chain positions that every
    one of the ``G`` groups accepts (``kernels/groups.py``: group g's kind ``gk.kinds[g]`` and parameter
    ``gk.windows[g]``, :class:`GroupKinds`; ``gk`` None: full attention). The prefix scan ends at the first block on which
    ``block_hit`` fails; with ``CHUNKED`` (a windowed kind among the groups) the windowed scan then
    nulls and checks their blocks (``windowed_hit``). Group g's key at position t is
    ``key_hi/lo[g * gstride + t * pstride]`` (its group id ``groups[g]``); its hit block goes to
    ``out_blocks[g * out_stride + t]`` (positions past the prefix may be written too). Returns (hits,
    hit blocks with ref_cnt 0, counted per position and group, as the admission check counts them;
    null blocks are not counted)."""
    offs = tl.arange(0, BLOCK)
    hits = tl.zeros([], tl.int32)
    t = 0
    done = length <= 0
    while (t < length) & (done == 0):
        pos = t + offs
        inb = pos < length
        ok = inb
        g = 0
        while g < G:
            ka = g.to(tl.int64) * gstride + pos.to(tl.int64) * pstride
            hi = tl.load(key_hi + ka, mask=inb, other=0)
            lo = tl.load(key_lo + ka, mask=inb, other=0)
            grp = tl.zeros([BLOCK], tl.int32) + tl.load(groups + g)
            blk = lookup_blocks(ps, pc, hi, lo, grp, inb)
            tl.store(out_blocks + g * out_stride + pos, blk, mask=inb)
            ok = ok & block_hit(group_kind(gk, g), blk, CHUNKED)
            g += 1
        # Positions before the first miss of this tile extend the prefix.
        miss = tl.min(tl.where(inb & (ok == 0), pos, BIG), axis=0)
        hits += tl.sum((inb & (pos < miss)).to(tl.int32), axis=0)
        done = miss < BIG
        t += BLOCK
    tl.debug_barrier()
    if CHUNKED:
        hits = windowed_scan(out_blocks, out_stride, gk, G, hits, BLOCK, BS)
    zero_ref = tl.zeros([], tl.int32)
    g = 0
    while g < G:
        t = 0
        while t < hits:
            pos = t + offs
            m = pos < hits
            blk = tl.load(out_blocks + g * out_stride + pos, mask=m, other=0)
            if CHUNKED:
                m = m & (blk != 0)
            # strict: benign, counts only rise until the next barrier (touch): a late read lowers zero_ref, same branch
            zero_ref += tl.sum((m & (tl.load(ps.ref_cnt + blk, mask=m, other=1) == 0)).to(tl.int32), axis=0)
            t += BLOCK
        g += 1
    return hits, zero_ref


@triton.jit
def windowed_scan(out_blocks, out_stride, gk, G, length, BLOCK: tl.constexpr, BS: tl.constexpr):
    """The windowed groups' scan over a prefix of ``length`` accepted positions (``kernels/groups.py``
    ``windowed_hit``): their blocks before the hit's start become the null block, and their first miss
    after it ends the hit. Returns the hit."""
    offs = tl.arange(0, BLOCK)
    hits = length
    g = 0
    while g < G:
        kind = tl.load(gk.kinds + g)
        if windowed(kind):
            param = tl.load(gk.windows + g)
            t = 0
            while t < length:
                pos = t + offs
                row = out_blocks + g * out_stride + pos
                null, miss = windowed_hit(kind, param, pos, tl.load(row, mask=pos < length, other=0), length, BS)
                tl.store(row, tl.zeros([BLOCK], tl.int32), mask=null)
                hits = tl.minimum(hits, tl.min(tl.where(miss, pos, BIG), axis=0))
                t += BLOCK
        g += 1
    tl.debug_barrier()
    return hits


@triton.jit
def longest_prefix_kernel(ps, pc: tl.constexpr, key_hi, key_lo, groups, gk, G, lengths, max_len, out_hits, out_blocks,
                          out_zero_ref, OP: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr, CHUNKED: tl.constexpr):
    """``find_longest_cache_hit`` of request r's chain (program r): ``key_hi, key_lo: int64[R, G,
    max_len]``, ``groups: int32[G]``, the groups' :class:`GroupKinds` ``gk`` (None: full attention),
    ``lengths: int32[R]`` (positions to consider, each in ``0..max_len``; another length looks nothing
    up, gives 0 hits and records E_INVALID_ARG). Writes ``out_hits, out_zero_ref: int32[R]`` and
    ``out_blocks: int32[R, G, max_len]``."""
    r = tl.program_id(0)
    length = tl.load(lengths + r)
    ok = (length >= 0) & (length <= max_len)
    if ok == 0:
        record_error(ps.status, OP, length)
    base = r.to(tl.int64) * G * max_len
    hits, zero_ref = find_longest_cache_hit(ps, pc, key_hi + base, key_lo + base, max_len, 1, groups, gk, G,
                                            tl.where(ok, length, 0), out_blocks + base, max_len, BLOCK, BS, CHUNKED)
    tl.store(out_hits + r, hits)
    tl.store(out_zero_ref + r, zero_ref)


def launch_longest_prefix(ps, pc, key_hi, key_lo, groups, lengths, hits, blocks, zero_ref, *, op: int, kinds=None):
    """Launch ``longest_prefix_kernel``: one program per request. ``kinds``: None, or a manager's
    ``(kinds, windows, block_size, windowed)`` (``BlockPool.longest_prefix_batched``)."""
    r, g, length = key_hi.shape
    block = min(256, max(16, 1 << max(0, (length - 1).bit_length())))
    gk, bs, chunked = (GroupKinds(kinds[0], kinds[1]), kinds[2], kinds[3]) if kinds is not None else (None, 1, False)
    longest_prefix_kernel[(r,)](ps, pc, key_hi, key_lo, groups, gk, g, lengths, length, hits, blocks, zero_ref, OP=op,
                                BLOCK=block, BS=bs, CHUNKED=chunked, num_warps=4)
