"""Read-only prefix lookups: many keys at once, and the longest cached prefix of many hash chains.

These only read pool state and write their own outputs, one disjoint range per program, so any
number of programs run without races.
"""
import triton
import triton.language as tl

from .common import E_INVALID_ARG, ST_OP, ST_VALUE, checked_count
from .keytable import table_lookup

BIG_POS = tl.constexpr(2147483647)


@triton.jit
def lookup_kernel(table, overflow, keys, key_hi, key_lo, key_group, num_keys_in, cap, out_block, status,
                  MK: tl.constexpr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``out_block[i]`` = earliest-inserted block under key i, or -1, for ``i < num_keys_in[0]``.
    Grid: cdiv(cap, BLOCK); ``key_hi, key_lo: int64[cap]``, ``key_group: int32[cap]``. A count outside
    ``0..cap`` looks nothing up; program 0 records it in the status word with one compare-and-swap
    (so an earlier error stays first; no other program writes there)."""
    n, n_ok = checked_count(num_keys_in, cap)
    if (tl.program_id(0) == 0) & (n_ok == 0):
        zero = tl.load(num_keys_in).to(tl.int64) * 0
        if tl.atomic_cas(status, zero, zero + E_INVALID_ARG) == 0:
            tl.store(status + ST_OP, 16)
            tl.store(status + ST_VALUE, tl.load(num_keys_in).to(tl.int64))
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    hi = tl.load(key_hi + idx, mask=m, other=0)
    lo = tl.load(key_lo + idx, mask=m, other=0)
    g = tl.load(key_group + idx, mask=m, other=0)
    e, _ = table_lookup(table, overflow, keys, hi, lo, g, m, NCHUNK, BLOCK)
    tl.store(out_block + idx, tl.where(e >= 0, e // MK, -1).to(tl.int32), mask=m)


@triton.jit
def longest_prefix_kernel(table, overflow, keys, ref_cnt, key_hi, key_lo, groups, num_groups, lengths,
                          num_reqs, max_len, out_hits, out_blocks, out_zero_ref,
                          MK: tl.constexpr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Longest cached prefix of request r's chain, all groups hitting at each position.

    ``key_hi, key_lo: int64[R, G, max_len]`` (request r, group g, position t), ``groups: int32[G]``,
    ``lengths: int32[R]`` (positions to consider), counts in ``num_groups, num_reqs: int32[1]``.
    Writes ``out_hits: int32[R]``, ``out_blocks: int32[R, G, max_len]`` (the first out_hits[r]
    positions valid) and ``out_zero_ref: int32[R]``, the hit blocks with ref_cnt 0 (what admitting
    the hit takes from the free count). Grid: (R capacity,), program r handles request r.
    """
    r = tl.program_id(0)
    if r < tl.load(num_reqs):
        G = tl.load(num_groups)
        L = tl.load(lengths + r)
        offs = tl.arange(0, BLOCK)
        hits = L * 0
        zero_ref = L * 0
        t = 0
        done = L <= 0
        while (t < L) & (done == 0):
            pos = t + offs
            inb = pos < L
            ok = inb
            g = 0
            while g < G:
                base = (r.to(tl.int64) * G + g) * max_len
                hi = tl.load(key_hi + base + pos, mask=inb, other=0)
                lo = tl.load(key_lo + base + pos, mask=inb, other=0)
                grp = tl.zeros([BLOCK], tl.int32) + tl.load(groups + g)
                e, _ = table_lookup(table, overflow, keys, hi, lo, grp, inb, NCHUNK, BLOCK)
                blk = tl.where(e >= 0, e // MK, -1).to(tl.int32)
                tl.store(out_blocks + base + pos, blk, mask=inb)
                ok = ok & (e >= 0)
                g += 1
            # Positions before the first miss of this tile extend the prefix.
            miss = tl.min(tl.where(inb & (ok == 0), pos, BIG_POS), axis=0)
            run = inb & (pos < miss)
            hits += tl.sum(run.to(tl.int32), axis=0)
            done = miss < BIG_POS
            t += BLOCK
        tl.store(out_hits + r, hits)
        # Zero-ref hit blocks (each group's chain holds its own blocks).
        g = 0
        while g < G:
            base = (r.to(tl.int64) * G + g) * max_len
            t = 0
            while t < hits:
                pos = t + offs
                m = pos < hits
                blk = tl.load(out_blocks + base + pos, mask=m, other=0)
                zero_ref += tl.sum((m & (tl.load(ref_cnt + blk, mask=m, other=1) == 0)).to(tl.int32), axis=0)
                t += BLOCK
            g += 1
        tl.store(out_zero_ref + r, zero_ref)

