"""The free queue as a ring with tombstones (DESIGN.md; DESIGN-NOTES.md section 1).

``ring: int32[C]`` (C a power of two >= 2N), live window ``[ctrl[HEAD], ctrl[TAIL])`` with
slot = pos & (C-1), ``qslot: int32[N]`` each queued block's slot or -1. Tombstones are -1. The
live slots in position order are vLLM's free list, head to tail.

Helpers here run inside single-program kernels (grid (1,)): tiles are walked in position order and
phases that re-read what other lanes wrote are separated by ``tl.debug_barrier()``.
"""
import triton
import triton.language as tl

from .common import COMPACTIONS, HEAD, TAIL


@triton.jit
def ring_scan_pop(ring, ctrl, out, out_base, total, C: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the first ``total`` live blocks from the head into ``out[out_base:]``; returns the new head.

    Reads only; the caller commits the new head once the whole op is known to be valid.
    """
    head = tl.load(ctrl + HEAD)
    tail = tl.load(ctrl + TAIL)
    offs = tl.arange(0, BLOCK)
    taken = total * 0
    new_head = head
    p = head
    while (taken < total) & (p < tail):
        pos = p + offs
        inw = pos < tail
        v = tl.load(ring + (pos & (C - 1)), mask=inw, other=-1)
        live = v >= 0
        cum = tl.cumsum(live.to(tl.int32), axis=0) + taken
        take = live & (cum <= total)
        tl.store(out + out_base + cum - 1, v, mask=take)
        ntake = tl.sum(take.to(tl.int32), axis=0)
        last = tl.max(tl.where(take, pos, head - 1), axis=0)
        new_head = tl.where(ntake > 0, last + 1, new_head)
        taken += ntake
        p += BLOCK
    return new_head


@triton.jit
def ring_compact(ring, qslot, ctrl, C: tl.constexpr, BLOCK: tl.constexpr):
    """Move the live slots to ``[head, head + live)`` in place and set the tail there.

    Destinations never pass sources, and each tile's loads finish (barrier) before its stores, so no
    unread slot is overwritten (DESIGN-NOTES.md section 1).
    """
    head = tl.load(ctrl + HEAD)
    tail = tl.load(ctrl + TAIL)
    offs = tl.arange(0, BLOCK)
    live_count = head * 0
    p = head
    while p < tail:
        pos = p + offs
        v = tl.load(ring + (pos & (C - 1)), mask=pos < tail, other=-1)
        live = v >= 0
        dest = head + live_count + tl.cumsum(live.to(tl.int64), axis=0) - live.to(tl.int64)
        tl.debug_barrier()
        tl.store(ring + (dest & (C - 1)), v, mask=live)
        tl.store(qslot + v, (dest & (C - 1)).to(tl.int32), mask=live)
        live_count += tl.sum(live.to(tl.int64), axis=0)
        p += BLOCK
        tl.debug_barrier()
    tl.store(ctrl + TAIL, head + live_count)
    tl.store(ctrl + COMPACTIONS, tl.load(ctrl + COMPACTIONS) + 1)


@triton.jit
def ring_make_room(ring, qslot, ctrl, k, C: tl.constexpr, BLOCK: tl.constexpr):
    """Compact first if writing ``k`` more slots would overflow the ring (live + k < C always fits)."""
    if tl.load(ctrl + TAIL) - tl.load(ctrl + HEAD) + k > C:
        ring_compact(ring, qslot, ctrl, C, BLOCK)
        tl.debug_barrier()


@triton.jit
def ring_unlink(ring, qslot, b, active):
    """Tombstone each active lane's block (touch); the other slots keep their order."""
    s = tl.load(qslot + b, mask=active, other=0)
    tl.store(ring + s, tl.full(b.shape, -1, tl.int32), mask=active)
    tl.store(qslot + b, tl.full(b.shape, -1, tl.int32), mask=active)


@triton.jit
def ring_put(ring, qslot, pos, b, active, C: tl.constexpr):
    """Write block ``b`` at ring position ``pos`` (prepend or append)."""
    s = (pos & (C - 1)).to(tl.int32)
    tl.store(ring + s, b, mask=active)
    tl.store(qslot + b, s, mask=active)
