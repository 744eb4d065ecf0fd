"""The prefix-key map: a chunked hash table without tombstones over per-block key rows.

Device helpers on a tile of lanes, one key per lane (docs/design.md; docs/algorithms.md section 4).
``table: int64[NCHUNK * CHUNK]`` slot words ``(31-bit tag << 32) | (entry + 1)`` (0 = EMPTY),
``overflow: int32[NCHUNK]`` (entries that probed past the chunk). ``entry = block * MK + j`` indexes
the key rows ``keys: int64[N*MK, KW]`` with columns ``layout.KeyCol`` (hi, lo, group, seq, table
slot). A lookup returns the live entry with the smallest ``seq``.

Races: lanes claim slots with one 64-bit ``atomic_cas`` each (the loser retries the same chunk) and
bump overflow counts with ``atomic_add``, so lanes and programs never overwrite each other; table
words are read ``volatile`` so a retry sees the winner's word. ``atomic_cas`` takes no mask: an
inactive lane compares its own word (lane index) against -1, which no slot word equals, so it never
writes and inactive lanes do not queue on one address.
"""
import triton
import triton.language as tl

from .events import write_removed
from .layout import CHUNK, K_GROUP, K_HI, K_LO, K_SEQ, K_SLOT, KW

SEQ_NONE = tl.constexpr(9223372036854775807)


@triton.jit
def key_home(lo, grp, NCHUNK: tl.constexpr):
    """Home chunk of a key: its low word (a digest, already uniform) mixed with the group."""
    return ((lo ^ (grp.to(tl.int64) * 0x9E3779B1)) & (NCHUNK - 1)).to(tl.int32)


@triton.jit
def key_tag(hi):
    return (hi >> 32) & 0x7FFFFFFF


@triton.jit
def table_insert(table, overflow, hi, lo, grp, entry, active, NCHUNK: tl.constexpr):
    """Claim one slot per active lane for ``entry``; returns the slot index (-1 where not placed)."""
    cols = tl.arange(0, CHUNK)
    home = key_home(lo, grp, NCHUNK)
    lane_word = (tl.cumsum(tl.full(home.shape, 1, tl.int32), axis=0) - 1) & (NCHUNK * CHUNK - 1)
    word = (key_tag(hi) << 32) | (entry.to(tl.int64) + 1)
    step = tl.zeros_like(home)
    slot = tl.full(home.shape, -1, tl.int32)
    pending = active
    it = 0
    # Bounded: each lane either wins, passes a full chunk, or loses a race to another lane.
    while (tl.sum(pending.to(tl.int32), axis=0) > 0) & (it < NCHUNK * (CHUNK + 1) + home.shape[0]):
        c = (home + step) & (NCHUNK - 1)
        # strict: benign, racing other lanes' CAS by design: a stale word only fails the CAS; the lane retries
        w = tl.load(table + c[:, None].to(tl.int64) * CHUNK + cols[None, :], mask=pending[:, None], other=1,
                    volatile=True)
        first_empty = tl.min(tl.where(w == 0, cols[None, :], CHUNK), axis=1)
        has = pending & (first_empty < CHUNK)
        full = pending & (first_empty == CHUNK)
        target = tl.where(has, c * CHUNK + first_empty, lane_word)
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
def table_lookup(table, overflow, keys, hi, lo, grp, active, NCHUNK: tl.constexpr):
    """Earliest-inserted live entry per active lane: (entry, seq); entry -1 on a miss."""
    cols = tl.arange(0, CHUNK)
    home = key_home(lo, grp, NCHUNK)
    tag = key_tag(hi)
    best = tl.full(hi.shape, -1, tl.int64)
    best_seq = tl.full(hi.shape, SEQ_NONE, tl.int64)
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
        s = tl.where(match, ks, SEQ_NONE)
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
def lookup_blocks(ps, pc: tl.constexpr, hi, lo, grp, active):
    """The earliest-inserted block under each active lane's key (``get_cached_block``), -1 on a miss."""
    e, _ = table_lookup(ps.table, ps.overflow, ps.keys, hi, lo, grp, active, pc.NCHUNK)
    return tl.where(e >= 0, e // pc.MK, -1).to(tl.int32)


@triton.jit
def drop_keys(ps, pc: tl.constexpr, b, active, ev_pos):
    """Remove every key of each active lane's block (primary first), writing one BlockRemoved row per
    key at ``ev_pos + (keys of earlier lanes) + j`` when events are on. Returns the keys removed.

    A block appears in at most one active lane (callers deduplicate), so lanes write disjoint rows.
    """
    nk = tl.where(active, tl.load(ps.num_keys + b, mask=active, other=0), 0)
    before = tl.cumsum(nk, axis=0) - nk
    for j in tl.static_range(pc.MK):
        has = active & (j < nk)
        e = b.to(tl.int64) * pc.MK + j
        lo = tl.load(ps.keys + e * KW + K_LO, mask=has, other=0)
        grp = tl.load(ps.keys + e * KW + K_GROUP, mask=has, other=0)
        slot = tl.load(ps.keys + e * KW + K_SLOT, mask=has, other=0)
        table_delete(ps.table, ps.overflow, lo, grp, slot, has, pc.NCHUNK)
        if pc.EVENTS:  # only an event row needs the key's high word
            hi = tl.load(ps.keys + e * KW + K_HI, mask=has, other=0)
            write_removed(ps.ev, ev_pos + before + j, b, hi, lo, grp, has)
    tl.store(ps.num_keys + b, tl.zeros_like(nk), mask=active & (nk > 0))
    tl.store(ps.hash_ntok + b, tl.full(nk.shape, -1, tl.int32), mask=active & (nk > 0))
    return tl.sum(nk, axis=0).to(tl.int64)


@triton.jit
def put_key(ps, pc: tl.constexpr, b, j, hi, lo, grp, seq, ntok, active):
    """Write key row ``(b, j)`` and claim its table slot; row j == 0 also sets the covered tokens.
    The caller sets ``num_keys`` (lanes may share a block).

    Rows are written before the slot is claimed, so a concurrent reader never sees a word whose row
    is stale.
    """
    e = b.to(tl.int64) * pc.MK + j
    tl.store(ps.keys + e * KW + K_HI, hi, mask=active)
    tl.store(ps.keys + e * KW + K_LO, lo, mask=active)
    tl.store(ps.keys + e * KW + K_GROUP, grp.to(tl.int64), mask=active)
    tl.store(ps.keys + e * KW + K_SEQ, seq, mask=active)
    tl.debug_barrier()
    slot = table_insert(ps.table, ps.overflow, hi, lo, grp, e, active, pc.NCHUNK)
    tl.store(ps.keys + e * KW + K_SLOT, slot.to(tl.int64), mask=active)
    tl.store(ps.hash_ntok + b, ntok.to(tl.int32), mask=active & (j == 0))
