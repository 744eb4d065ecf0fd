"""The prefix-key map: a chunked hash table without tombstones over per-block key rows.

Device helpers (``@triton.jit``, called from op kernels) on a tile of lanes, one key per lane.
Layout (DESIGN.md, DESIGN-NOTES.md section 4): ``table: int64[NCHUNK * 16 + 1]`` slot words
``(31-bit tag << 32) | (entry + 1)`` (0 = EMPTY; the extra last word is a sink for masked-off
compare-and-swaps, which take no mask), ``overflow: int32[NCHUNK]`` (entries that probed past the
chunk). ``entry = block * MK + j`` indexes the key rows ``keys: int64[N*MK, 5]`` with columns
(hi, lo, group, seq, table slot). A lookup returns the live entry with the smallest ``seq``.

Races: lanes claim slots with one 64-bit ``atomic_cas`` each (the loser retries the same chunk) and
bump overflow counts with ``atomic_add``, so lanes and programs never overwrite each other; table
words are read ``volatile`` so a retry sees the winner's word.
"""
import triton
import triton.language as tl

from .common import EV_REMOVED
from .events import write_event

CHUNK = tl.constexpr(16)
# columns of the key rows
KW = tl.constexpr(5)
K_HI = tl.constexpr(0)
K_LO = tl.constexpr(1)
K_GROUP = tl.constexpr(2)
K_SEQ = tl.constexpr(3)
K_SLOT = tl.constexpr(4)


@triton.jit
def key_home(lo, grp, NCHUNK: tl.constexpr):
    """Home chunk of a key: its low word (a digest, already uniform) mixed with the group."""
    return ((lo ^ (grp.to(tl.int64) * 0x9E3779B1)) & (NCHUNK - 1)).to(tl.int32)


@triton.jit
def key_tag(hi):
    return (hi >> 32) & 0x7FFFFFFF


@triton.jit
def table_insert(table, overflow, hi, lo, grp, entry, active, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Claim one slot per active lane for ``entry``; returns the slot index (-1 where not placed)."""
    cols = tl.arange(0, CHUNK)
    sink = NCHUNK * CHUNK
    home = key_home(lo, grp, NCHUNK)
    word = (key_tag(hi) << 32) | (entry.to(tl.int64) + 1)
    step = tl.zeros([BLOCK], dtype=tl.int32)
    slot = tl.full([BLOCK], -1, dtype=tl.int32)
    pending = active
    it = 0
    # Bounded: each lane either wins, passes a full chunk, or loses a race to another lane.
    while (tl.sum(pending.to(tl.int32), axis=0) > 0) & (it < NCHUNK * (CHUNK + 1) + BLOCK):
        c = (home + step) & (NCHUNK - 1)
        w = tl.load(table + c[:, None].to(tl.int64) * CHUNK + cols[None, :], mask=pending[:, None], other=1,
                    volatile=True)
        first_empty = tl.min(tl.where(w == 0, cols[None, :], CHUNK), axis=1)
        has = pending & (first_empty < CHUNK)
        full = pending & (first_empty == CHUNK)
        target = tl.where(has, c * CHUNK + first_empty, sink)
        old = tl.atomic_cas(table + target, tl.where(has, 0, -1).to(tl.int64), tl.where(has, word, -1))
        won = has & (old == 0)
        slot = tl.where(won, target, slot)
        tl.atomic_add(overflow + c, 1, mask=full)
        step = tl.where(full, step + 1, step)
        pending = pending & (~won) & (step < NCHUNK)
        it += 1
    return slot


@triton.jit
def table_delete(table, overflow, lo, grp, slot, active, NCHUNK: tl.constexpr):
    """Empty each active lane's slot and undo the overflow counts on its probe path."""
    tl.store(table + slot, tl.zeros_like(lo), mask=active)
    home = key_home(lo, grp, NCHUNK)
    dist = tl.where(active, ((slot // CHUNK) - home) & (NCHUNK - 1), 0)
    maxd = tl.max(dist, axis=0)
    s = 0
    while s < maxd:
        tl.atomic_add(overflow + ((home + s) & (NCHUNK - 1)), -1, mask=active & (s < dist))
        s += 1


@triton.jit
def table_lookup(table, overflow, keys, hi, lo, grp, active,
                 NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Earliest-inserted live entry per active lane: (entry, seq); entry -1 on a miss."""
    cols = tl.arange(0, CHUNK)
    home = key_home(lo, grp, NCHUNK)
    tag = key_tag(hi)
    best = tl.full([BLOCK], -1, dtype=tl.int64)
    best_seq = tl.full([BLOCK], 9223372036854775807, dtype=tl.int64)
    live = active
    step = 0
    while (tl.sum(live.to(tl.int32), axis=0) > 0) & (step < NCHUNK):
        c = (home + step) & (NCHUNK - 1)
        w = tl.load(table + c[:, None].to(tl.int64) * CHUNK + cols[None, :], mask=live[:, None], other=0,
                    volatile=True)
        m = live[:, None] & (w != 0) & ((w >> 32) == tag[:, None])
        e = tl.where(m, (w & 0xFFFFFFFF) - 1, 0)
        khi = tl.load(keys + e * KW + K_HI, mask=m, other=0)
        klo = tl.load(keys + e * KW + K_LO, mask=m, other=0)
        kg = tl.load(keys + e * KW + K_GROUP, mask=m, other=-1)
        ks = tl.load(keys + e * KW + K_SEQ, mask=m, other=0)
        match = m & (khi == hi[:, None]) & (klo == lo[:, None]) & (kg == grp.to(tl.int64)[:, None])
        s = tl.where(match, ks, 9223372036854775807)
        row_min = tl.min(s, axis=1)
        row_e = tl.max(tl.where(match & (s == row_min[:, None]), e, -1), axis=1)
        better = live & (row_e >= 0) & (row_min < best_seq)
        best = tl.where(better, row_e, best)
        best_seq = tl.where(better, row_min, best_seq)
        ov = tl.load(overflow + c, mask=live, other=0)
        live = live & (ov != 0)
        step += 1
    return best, best_seq


@triton.jit
def drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, b, active,
              MK: tl.constexpr, NCHUNK: tl.constexpr, EVENTS: tl.constexpr, op_tag):
    """Remove every key of each active lane's block (primary first), recording one removal event per
    key at ``ev_pos + (keys of earlier lanes) + j`` when EVENTS. Returns how many keys were removed.

    A block appears in at most one active lane (callers deduplicate), so lanes write disjoint rows.
    """
    nk = tl.load(num_keys + b, mask=active, other=0)
    nk = tl.where(active, nk, 0)
    before = tl.cumsum(nk, axis=0) - nk
    for j in tl.static_range(MK):
        has = active & (j < nk)
        e = b.to(tl.int64) * MK + j
        hi = tl.load(keys + e * KW + K_HI, mask=has, other=0)
        lo = tl.load(keys + e * KW + K_LO, mask=has, other=0)
        grp = tl.load(keys + e * KW + K_GROUP, mask=has, other=0)
        slot = tl.load(keys + e * KW + K_SLOT, mask=has, other=0)
        table_delete(table, overflow, lo, grp, slot, has, NCHUNK)
        if EVENTS:
            write_event(ev, ev_pos + before + j, EV_REMOVED, b, hi, lo, grp, op_tag, has)
    tl.store(num_keys + b, tl.zeros_like(nk), mask=active & (nk > 0))
    tl.store(hash_ntok + b, tl.full(nk.shape, -1, tl.int32), mask=active & (nk > 0))
    return tl.sum(nk, axis=0)


@triton.jit
def put_key(table, overflow, keys, hash_ntok, b, j, hi, lo, grp, seq, ntok, active,
            MK: tl.constexpr, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Write key row ``(b, j)`` and claim its table slot; row j == 0 also sets the covered tokens.
    The caller sets ``num_keys`` (lanes may share a block).

    Rows are written before the slot is claimed, so a concurrent reader never sees a word whose row
    is stale.
    """
    e = b.to(tl.int64) * MK + j
    tl.store(keys + e * KW + K_HI, hi, mask=active)
    tl.store(keys + e * KW + K_LO, lo, mask=active)
    tl.store(keys + e * KW + K_GROUP, grp.to(tl.int64), mask=active)
    tl.store(keys + e * KW + K_SEQ, seq, mask=active)
    tl.debug_barrier()
    slot = table_insert(table, overflow, hi, lo, grp, e, active, NCHUNK, BLOCK)
    tl.store(keys + e * KW + K_SLOT, slot.to(tl.int64), mask=active)
    tl.store(hash_ntok + b, ntok.to(tl.int32), mask=active & (j == 0))
