"""The free queue as a ring with tombstones (docs/design.md; docs/algorithms.md section 1).

``ring: int32[C]`` (C a power of two >= 2N), live window ``[head, tail)`` with slot = pos & (C-1),
``qslot: int32[N]`` each queued block's slot or -1. Tombstones are -1. The live slots in position
order are vLLM's free list, head to tail.

Helpers for single-program kernels: tiles are walked in position order, phases that re-read what
other lanes wrote are separated by ``tl.debug_barrier()``. Callers pass head and tail as values
(loaded once, kept in registers) and store the new ones once the op is known to be valid.
"""
import triton
import triton.language as tl

from .layout import COMPACTIONS, NO_SLOT, TAIL


@triton.jit
def ring_scan_pop(ps, pc: tl.constexpr, head, tail, out, out_base, total):
    """Copy the first ``total`` live blocks from ``head`` into ``out[out_base:]``; returns the new head.

    Reads only: the caller commits the head once the whole op is known to be valid.
    """
    offs = tl.arange(0, pc.BLOCK)
    taken = tl.zeros([], tl.int64)
    new_head = head
    p = head
    while (taken < total) & (p < tail):
        pos = p + offs
        v = tl.load(ps.ring + (pos & (pc.C - 1)), mask=pos < tail, other=-1)
        live = v >= 0
        cum = tl.cumsum(live.to(tl.int64), axis=0) + taken
        take = live & (cum <= total)
        tl.store(out + out_base + cum - 1, v, mask=take)
        taken += tl.sum(take.to(tl.int64), axis=0)
        new_head = tl.maximum(new_head, tl.max(tl.where(take, pos + 1, head), axis=0))
        p += pc.BLOCK
    return new_head


@triton.jit
def ring_compact(ps, pc: tl.constexpr, head, tail):
    """Move the live slots to ``[head, head + live)`` in place; stores and returns the new tail.

    Destinations never pass sources, and each tile's loads finish (barrier) before its stores, so no
    unread slot is overwritten (docs/algorithms.md section 1).
    """
    offs = tl.arange(0, pc.BLOCK)
    live_count = tl.zeros([], tl.int64)
    p = head
    while p < tail:
        pos = p + offs
        v = tl.load(ps.ring + (pos & (pc.C - 1)), mask=pos < tail, other=-1)
        live = v >= 0
        dest = head + live_count + tl.cumsum(live.to(tl.int64), axis=0) - live.to(tl.int64)
        tl.debug_barrier()
        tl.store(ps.ring + (dest & (pc.C - 1)), v, mask=live)
        tl.store(ps.qslot + v, (dest & (pc.C - 1)).to(tl.int32), mask=live)
        live_count += tl.sum(live.to(tl.int64), axis=0)
        p += pc.BLOCK
        tl.debug_barrier()
    new_tail = head + live_count
    tl.store(ps.ctrl + TAIL, new_tail)
    # strict: benign, one statement; only thread 0 uses the value it loads (its store)
    tl.store(ps.ctrl + COMPACTIONS, tl.load(ps.ctrl + COMPACTIONS) + 1)
    return new_tail


@triton.jit
def ring_make_room(ps, pc: tl.constexpr, head, tail, k):
    """The tail after compacting, if writing ``k`` more slots would overflow the ring (live + k < C
    always fits)."""
    if tail - head + k > pc.C:
        tail = ring_compact(ps, pc, head, tail)
        tl.debug_barrier()
    return tail


@triton.jit
def ring_unlink(ps, b, active):
    """Tombstone each active lane's block (touch); the other slots keep their order."""
    s = tl.load(ps.qslot + b, mask=active, other=0)
    tl.store(ps.ring + s, tl.full(b.shape, NO_SLOT, tl.int32), mask=active)
    tl.store(ps.qslot + b, tl.full(b.shape, NO_SLOT, tl.int32), mask=active)


@triton.jit
def ring_put(ps, pc: tl.constexpr, pos, b, active):
    """Write block ``b`` at ring position ``pos`` (prepend or append)."""
    s = (pos & (pc.C - 1)).to(tl.int32)
    tl.store(ps.ring + s, b, mask=active)
    tl.store(ps.qslot + b, s, mask=active)
