"""Releasing and re-acquiring references: the one free path and the one touch path every kernel uses,
and the ``free_blocks`` / ``free_batched`` / ``unpin_blocks`` / ``touch`` kernels with their launchers.

Exact in op order without relying on lane order at one address: per-block counts with
``atomic_add``, last / first occurrence with ``atomic_max`` / ``atomic_min``, then prefix sums
(docs/algorithms.md section 2). Scratch ``s_cnt`` (zeros), ``s_last`` (-1), ``s_first`` (BIG), all
``int32[N]``, are back at their idle values when a kernel ends.

The free path, for ids ``ids[:n]`` in op order cut into segments (each one ``free_blocks`` call):

1. ``count_ids``: occurrence counts and last / first index per block;
2. ``release_scan``: the first id whose count exceeds its ref count (a double free), and per id
   whether it releases its block (its last occurrence, count == ref count) to the front (no key, or
   caching off: F) or the back (hashed: L); ``pf[i]`` = F releases before i;
3. ``release_place``: F element i of segment [s, e) goes to ``head - pf[e] + pf[i] - pf[s]`` (later
   segments land ahead, as later ``free_blocks`` calls prepend in front of earlier ones), L elements
   to the tail in order; ref counts drop by the counts;
4. ``reset_ids``: the scratch back to idle (also on the error path).

Why these ends of the queue (vLLM 0.33 ``BlockPool.free_blocks``): a block without a hash (or with
caching off) can never be a prefix hit, so it goes to the front and is reused first ("LIFO reuse of
non-cached blocks for better GPU locality"); a hashed block is a prefix-cache candidate, so it goes to
the back and pops take the least recently freed or touched one first ("FIFO reuse of cached blocks
for LRU eviction behavior"). A request's blocks are freed tail first (vLLM's ``free``: ``reversed``)
so that, among blocks freed together, the chain's tail (the longest, least shared prefix) is
evicted before its head.
"""
import triton
import triton.language as tl

from .common import (
    batch_config, checked_count, first_bad, keep_first, raw_count, segment_ids, set_status, status_clear, tile_of,
    no_error, warps_for,
)
from .layout import BIG, E_DOUBLE_FREE, E_INVALID_ARG, E_INVALID_ID, E_NULL_BLOCK, HEAD, NUM_FREE, TAIL
from .queue import ring_make_room, ring_put, ring_unlink


@triton.jit
def check_ids(ps, ids, n, N: tl.constexpr, NULL_IS_ERROR: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """(error code, offending id, its index) over ``ids[:n]``: the first out-of-range id, else the
    first null id when NULL_IS_ERROR, else (0, 0, BIG). With COUNT, also ``count_ids`` of the
    in-range ids in the same pass (the common case has no bad id; one read of the list, not two)."""
    offs = tl.arange(0, BLOCK)
    bad_i = tl.full([], BIG, tl.int32)
    bad_v = tl.zeros([], tl.int64)
    null_i = tl.full([], BIG, tl.int32)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        out = (b < 0) | (b >= N)
        anyb, bi, bv = first_bad(m & out, i + offs, b)
        bad_v = tl.where(anyb & (bi < bad_i), bv, bad_v)
        bad_i = tl.where(anyb & (bi < bad_i), bi, bad_i)
        anyn, ni, _ = first_bad(m & (b == 0), i + offs, b)
        null_i = tl.minimum(null_i, tl.where(anyn, ni, BIG))
        if COUNT:
            count_tile(ps, b, i + offs, m & (b > 0) & (b < N))
        i += BLOCK
    code = tl.where(bad_i < BIG, E_INVALID_ID, 0)
    if NULL_IS_ERROR:
        code = tl.where((code == 0) & (null_i < BIG), E_NULL_BLOCK, code)
    return code, bad_v, bad_i


@triton.jit
def count_tile(ps, b, idx, m):
    """Occurrence count and last / first index of block ``b`` at lanes ``m`` (order-free atomics)."""
    tl.atomic_add(ps.s_cnt + b, 1, mask=m)
    tl.atomic_max(ps.s_last + b, idx, mask=m)
    tl.atomic_min(ps.s_first + b, idx, mask=m)


@triton.jit
def count_ids(ps, ids, n, BLOCK: tl.constexpr):
    """Per-block occurrence counts and last / first index of the non-null ids (order-free atomics)."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        count_tile(ps, b, i + offs, m & (b != 0))
        i += BLOCK


@triton.jit
def reset_ids(ps, ids, n, N: tl.constexpr, BLOCK: tl.constexpr):
    """Scratch of the (in-range) ids back to idle."""
    offs = tl.arange(0, BLOCK)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        m = m & (b >= 0) & (b < N)
        tl.store(ps.s_cnt + b, tl.zeros([BLOCK], tl.int32), mask=m)
        tl.store(ps.s_last + b, tl.full([BLOCK], -1, tl.int32), mask=m)
        tl.store(ps.s_first + b, tl.full([BLOCK], BIG, tl.int32), mask=m)
        i += BLOCK


@triton.jit
def to_front(ps, pc: tl.constexpr, b, m):
    """Lanes ``m`` whose released block goes to the queue's front: an un-hashed block (reused first,
    LIFO), every block with caching off; hashed ones go to the back (evicted LRU). vLLM 0.33's
    ``free_blocks`` order (docs/semantics.md section 2)."""
    if pc.CACHING:
        front = m & (tl.load(ps.num_keys + b, mask=m, other=0) == 0)
    else:
        front = m
    return front


@triton.jit
def release_flags(ps, pc: tl.constexpr, b, idx, m, TO_FRONT: tl.constexpr):
    """Per lane: (releases its block, to the front). A lane releases at its block's last occurrence
    when the count equals the ref count; to the front when the block has no key (or caching is off),
    never for unpin (``TO_FRONT`` False)."""
    cnt = tl.load(ps.s_cnt + b, mask=m, other=0)
    # strict: benign, a block listed twice: only its last lane's ref is used
    ref = tl.load(ps.ref_cnt + b, mask=m, other=0)
    last = m & (tl.load(ps.s_last + b, mask=m, other=-1) == idx)
    rel = last & (cnt == ref)
    if TO_FRONT:
        front = rel & to_front(ps, pc, b, m)  # the key count's load needs only m: issued with the others
    else:
        front = rel & False
    return last, rel, front, cnt, ref


@triton.jit
def release_scan(ps, pc: tl.constexpr, ids, n, pf, code, TO_FRONT: tl.constexpr):
    """(F releases, L releases, first double-free index or BIG, its block) of ``ids[:n]``; writes
    ``pf[i]`` = F releases before i, ``pf[n]``. Needs ``count_ids``; the releases and ``pf`` mean
    something only when there is no double free (a count above the ref count), found in this pass
    so that a batch is read once before it commits. ``code: int32[n]`` scratch (or None) keeps each
    lane's flags (front, release, last occurrence) for ``release_place``: one coalesced read there
    instead of four gathers."""
    offs = tl.arange(0, pc.BLOCK)
    nf = tl.zeros([], tl.int32)
    nl = tl.zeros([], tl.int32)
    err, bad_v, bad_i = no_error()
    i = 0
    while i < n:
        idx = i + offs
        b, m = tile_of(ids, idx, n)
        m = m & (b != 0)
        last, rel, front, cnt, ref = release_flags(ps, pc, b, idx, m, TO_FRONT)
        if code is not None:
            flags = front.to(tl.int32) | (rel.to(tl.int32) << 1) | (last.to(tl.int32) << 2)
            tl.store(code + idx, flags, mask=idx < n)
        err, bad_v, bad_i = keep_first(err, bad_v, bad_i, E_DOUBLE_FREE, m & (cnt > ref), idx, b)
        fi = front.to(tl.int32)
        tl.store(pf + idx, nf + tl.cumsum(fi, axis=0) - fi, mask=idx < n)
        nf += tl.sum(fi, axis=0)
        nl += tl.sum((rel & ~front).to(tl.int32), axis=0)
        i += pc.BLOCK
    tl.store(pf + n, nf)
    return nf, nl, bad_i, bad_v


@triton.jit
def segment_of(seg_off, nseg, idx):
    """Segment j of each flat index (``seg_off[j] <= idx < seg_off[j + 1]``; nondecreasing offsets
    from 0): a binary search, log2(nseg) dependent loads."""
    lo = tl.zeros_like(idx)
    hi = tl.zeros_like(idx) + nseg
    step = 1
    while step < nseg:
        step *= 2
    while step > 0:
        mid = lo + step
        go = (mid < hi) & (tl.load(seg_off + mid, mask=mid <= nseg, other=BIG) <= idx)
        lo = tl.where(go, mid, lo)
        step = step // 2
    return lo


@triton.jit
def release_place(ps, pc: tl.constexpr, ids, n, pf, code, seg_off, seg_of, head, tail, nf,
                  TO_FRONT: tl.constexpr, SEGMENTS: tl.constexpr):
    """Commit a checked release of ``ids[:n]`` (see the module docstring); returns the new tail.
    ``code``: the flags ``release_scan`` kept (None: read them again). ``seg_of[i]``: the segment of
    index i (from :func:`segment_ids`). Without ``SEGMENTS`` the whole list is one ``free_blocks``
    call (``pf`` still holds its prefix; ``seg_off``, ``seg_of`` unread)."""
    offs = tl.arange(0, pc.BLOCK)
    lpos = tail
    i = 0
    while i < n:
        idx = i + offs
        b, m = tile_of(ids, idx, n)
        m = m & (b != 0)
        if code is None:
            last, rel, front, cnt, ref = release_flags(ps, pc, b, idx, m, TO_FRONT)
            tl.store(ps.ref_cnt + b, ref - cnt, mask=last)
        else:
            flags = tl.load(code + idx, mask=m, other=0)
            front = m & ((flags & 1) != 0)
            rel = m & ((flags & 2) != 0)
            tl.atomic_add(ps.ref_cnt + b, -1, mask=m)  # one per occurrence: ref - count, order-free
        pf_i = tl.load(pf + idx, mask=m, other=0)
        if SEGMENTS:
            sg = tl.load(seg_of + idx, mask=m, other=0)
            pf_s = tl.load(pf + tl.minimum(tl.load(seg_off + sg, mask=m, other=0), n), mask=m, other=0)
            pf_e = tl.load(pf + tl.minimum(tl.load(seg_off + sg + 1, mask=m, other=0), n), mask=m, other=0)
        else:
            pf_s = tl.zeros_like(pf_i)
            pf_e = tl.zeros_like(pf_i) + nf
        back = rel & ~front
        li = back.to(tl.int64)
        ring_put(ps, pc, head - pf_e + (pf_i - pf_s), b, front)
        ring_put(ps, pc, lpos + tl.cumsum(li, axis=0) - li, b, back)
        lpos += tl.sum(li, axis=0)
        i += pc.BLOCK
    return lpos


@triton.jit
def free_checked(ps, pc: tl.constexpr, ids, n, pf, head, tail):
    """``free_blocks(ids[:n])`` of a list of in-range ids (one segment): counts, placement, scratch
    reset. Returns (new head, new tail, blocks released, first double-free index or BIG, its block);
    the caller stores head and tail. A double free changes nothing (head, tail as given, 0 released)."""
    count_ids(ps, ids, n, pc.BLOCK)
    tl.debug_barrier()
    nf, nl, dfree_i, dfree_v = release_scan(ps, pc, ids, n, pf, None, True)
    tl.debug_barrier()
    if dfree_i == BIG:
        tail = ring_make_room(ps, pc, head, tail, nf + nl)
        tail = release_place(ps, pc, ids, n, pf, None, pf, pf, head, tail, nf, True, False)
        head -= nf
    else:
        nf = tl.zeros([], tl.int32)
        nl = tl.zeros([], tl.int32)
    tl.debug_barrier()
    reset_ids(ps, ids, n, pc.N, pc.BLOCK)
    tl.debug_barrier()
    return head, tail, nf + nl, dfree_i, dfree_v


@triton.jit
def check_segments(seg_off, nseg, n, BLOCK: tl.constexpr):
    """Segment offsets must start at 0, never decrease and reach ``n`` (fixed-capacity inputs may pad
    past the count; segments are cut at ``n``)."""
    offs = tl.arange(0, BLOCK)
    ok = (tl.load(seg_off) == 0) & (tl.load(seg_off + nseg) >= n)
    i = 0
    while i < nseg:
        j = i + offs
        m = j < nseg
        down = m & (tl.load(seg_off + j + 1, mask=m, other=0) < tl.load(seg_off + j, mask=m, other=0))
        ok = ok & (tl.sum(down.to(tl.int32), axis=0) == 0)
        i += BLOCK
    return ok


@triton.jit
def release_kernel(ps, pc: tl.constexpr, ids, num_ids, cap, seg_off, nseg, pf, seg_of, code, OP: tl.constexpr,
                   UNPIN: tl.constexpr):
    """Batched ``free_blocks`` or one ``unpin_blocks``: :func:`release_batch`."""
    release_batch(ps, pc, ids, num_ids, cap, seg_off, nseg, pf, seg_of, code, OP, UNPIN)


@triton.jit
def release_batch(ps, pc: tl.constexpr, ids, num_ids, cap, seg_off, nseg, pf, seg_of, code, OP: tl.constexpr,
                  UNPIN: tl.constexpr):
    """Batched ``free_blocks`` (segments: ``seg_off: int32[nseg + 1]``) or one ``unpin_blocks``.

    Reads the first ``num_ids[0]`` (at most ``cap``) of ``ids: int32[cap]``; ``pf: int32[cap + 1]``
    ``seg_of, code: int32[cap]`` scratch. On success: ref counts, ring, qslot, head / tail / num_free, and for unpin the watched
    flags of the listed blocks (their callbacks live on the host). Errors (bad offsets or count, a
    bad id, the null block in unpin, a decrement below 0) set the status word and change nothing; a
    batch of frees fails where its sequence of ``free_blocks`` calls would: at the segment of the
    first bad id, unless a double free completes in an earlier segment.
    """
    n, n_ok = checked_count(num_ids, cap)
    if status_clear(ps.status):
        seg_ok = n_ok & check_segments(seg_off, nseg, n, pc.BLOCK)
        n = tl.where(seg_ok, n, 0)
        err, err_val, bad_i = check_ids(ps, ids, n, pc.N, UNPIN, True, pc.BLOCK)
        err_val = tl.where(seg_ok, err_val, raw_count(num_ids, cap).to(tl.int64))
        err = tl.where(seg_ok, err, E_INVALID_ARG)
        p_end = n
        if err != 0:  # recount up to the first bad id's segment (a double free there or before comes first)
            if seg_ok & (not UNPIN):
                p_end = tl.minimum(tl.load(seg_off + segment_of(seg_off, nseg, bad_i)), n)
            p_end = tl.where(p_end < n, p_end, 0)
            tl.debug_barrier()
            reset_ids(ps, ids, n, pc.N, pc.BLOCK)  # strict: benign, a block listed twice gets the same idle values
            tl.debug_barrier()
            count_ids(ps, ids, p_end, pc.BLOCK)
        tl.debug_barrier()
        if (err == 0) | (p_end > 0):
            nf, nl, dfree_i, dfree_v = release_scan(ps, pc, ids, p_end, pf, code, not UNPIN)
            err = tl.where(dfree_i < BIG, E_DOUBLE_FREE, err)
            err_val = tl.where(dfree_i < BIG, dfree_v, err_val)
            tl.debug_barrier()
            if err == 0:  # so p_end == n: the scan covered the whole batch
                head = tl.load(ps.ctrl + HEAD)
                tail = ring_make_room(ps, pc, head, tl.load(ps.ctrl + TAIL), nf + nl)
                if not UNPIN:  # unpin is one segment placed at the tail only
                    segment_ids(seg_off, nseg, n, seg_of, pc.BLOCK)
                tail = release_place(ps, pc, ids, n, pf, code, seg_off, seg_of, head, tail, nf, not UNPIN,
                                     not UNPIN)
                if UNPIN:
                    offs = tl.arange(0, pc.BLOCK)
                    i = 0
                    while i < n:
                        m = (i + offs) < n
                        b = tl.load(ids + i + offs, mask=m, other=0)
                        # strict: benign, every lane stores 1 (a block unpinned twice, in two tiles)
                        tl.store(ps.watched + b, tl.full([pc.BLOCK], 1, tl.int8), mask=m)
                        i += pc.BLOCK
                num_free = tl.load(ps.ctrl + NUM_FREE)
                tl.debug_barrier()  # strict: orders the reads of HEAD / TAIL / NUM_FREE above before these stores
                tl.store(ps.ctrl + HEAD, head - nf)
                tl.store(ps.ctrl + TAIL, tail)
                tl.store(ps.ctrl + NUM_FREE, num_free + nf + nl)
            tl.debug_barrier()
            reset_ids(ps, ids, p_end, pc.N, pc.BLOCK)  # strict: benign, a block listed twice gets the same idle values
        if err != 0:
            set_status(ps.status, err, OP, err_val)


def launch_release(ps, pc, ids, num_ids, seg_off, *, unpin: bool, op: int):
    """Launch ``release_kernel``: one program, ``pc.BLOCK`` lanes. ``ids: int32[M]``, ``num_ids:
    int32[1]``, ``seg_off: int32[S + 1]`` on the pool's device."""
    import torch

    pc = batch_config(pc, ids.numel())
    pf = torch.empty(ids.numel() + 1, dtype=torch.int32, device=ids.device)
    seg_of = torch.empty(max(1, ids.numel()), dtype=torch.int32, device=ids.device)
    code = torch.empty_like(seg_of)
    release_kernel[(1,)](ps, pc, ids, num_ids, ids.numel(), seg_off, seg_off.numel() - 1, pf, seg_of, code, OP=op,
                         UNPIN=unpin,
                         num_warps=warps_for(pc.BLOCK))


@triton.jit
def touch_tile(ps, b, m):
    """vLLM's ``touch`` of one tile of blocks ``b`` (lanes ``m``, non-null, any order): each raises
    its block's ref count by one (an atomic); the lane that finds it at 0 unlinks the block from the
    free queue. Returns the blocks unlinked."""
    was_free = m & (tl.atomic_add(ps.ref_cnt + b, 1, mask=m) == 0)
    ring_unlink(ps, b, was_free)
    return tl.sum(was_free.to(tl.int32), axis=0)


@triton.jit
def touch_checked(ps, pc: tl.constexpr, ids, n):
    """``touch(ids[:n])`` of already validated ids: every non-null occurrence raises its block's ref
    count by one (an atomic); the one lane that finds it at 0 unlinks the block from the ring. One
    random access per id, no scratch, order-free. Returns the blocks unlinked (the caller lowers
    num_free)."""
    offs = tl.arange(0, pc.BLOCK)
    unlinked = tl.zeros([], tl.int32)
    i = 0
    while i < n:
        m = (i + offs) < n
        b = tl.load(ids + i + offs, mask=m, other=0)
        unlinked += touch_tile(ps, b, m & (b != 0))
        i += pc.BLOCK
    tl.debug_barrier()
    return unlinked


@triton.jit
def touch_kernel(ps, pc: tl.constexpr, ids, num_ids, cap, OP: tl.constexpr):
    """Batched ``touch``: :func:`touch_batch`."""
    touch_batch(ps, pc, ids, num_ids, cap, OP)


@triton.jit
def touch_batch(ps, pc: tl.constexpr, ids, num_ids, cap, OP: tl.constexpr):
    """``touch`` of the first ``num_ids[0]`` (at most ``cap``) of ``ids: int32[cap]`` (order-free: one
    launch equals any sequence of touches). An out-of-range id or count sets the status word and
    changes nothing; the other blocks keep their queue order (tombstones)."""
    n, n_ok = checked_count(num_ids, cap)
    if status_clear(ps.status):
        err, err_val, _ = check_ids(ps, ids, n, pc.N, False, False, pc.BLOCK)
        err_val = tl.where(n_ok, err_val, raw_count(num_ids, cap).to(tl.int64))
        err = tl.where(n_ok, err, E_INVALID_ARG)
        if err == 0:
            num_free = tl.load(ps.ctrl + NUM_FREE)  # read before touch_checked's barrier, stored after it
            unlinked = touch_checked(ps, pc, ids, n)
            tl.store(ps.ctrl + NUM_FREE, num_free - unlinked)
        else:
            set_status(ps.status, err, OP, err_val)


def launch_touch(ps, pc, ids, num_ids, *, op: int):
    """Launch ``touch_kernel``: one program. ``ids: int32[M]``, ``num_ids: int32[1]``."""
    pc = batch_config(pc, ids.numel())
    touch_kernel[(1,)](ps, pc, ids, num_ids, ids.numel(), OP=op, num_warps=warps_for(pc.BLOCK))

