"""Prefix-cache key changes: ``cache_full_blocks``, ``cache_partial_block``, ``evict_blocks``,
``move_block_hashes`` and ``reset_prefix_cache`` (docs/semantics.md section 2), and ``cache_range``,
the one path that keys a range of blocks (the pool op, the manager, the replay).

Each kernel is one program: it validates its whole input, then commits, so an error changes nothing.
The single ops' scalars come in a small device tensor ``p: int64[...]``, so a new value does not
compile a new kernel.
"""
import triton
import triton.language as tl

from .common import first_bad, set_status, status_clear, warps_for
from .events import write_row, write_stored_header, write_stored_item
from .keytable import drop_keys, put_key, table_delete
from .layout import (
    BIG, CHUNK, E_BUFFER_FULL, E_HASH_CONFLICT, E_INVALID_ARG, E_INVALID_ID, E_KEY_CAPACITY, E_NULL_BLOCK,
    EV_CLEARED, EV_COUNT, K_GROUP, K_HI, K_LO, K_SLOT, KEY_SEQ, KW,
)
from .release import check_ids, reset_ids


@triton.jit
def range_block(ids, mask, nc, nf, idx, HAS_MASK: tl.constexpr):
    """(block, active) of positions ``idx`` of a caching range: in ``[nc, nf)``, not null, not masked."""
    inr = (idx >= nc) & (idx < nf)
    b = tl.load(ids + idx, mask=inr, other=0)
    act = inr & (b != 0)
    if HAS_MASK:
        act = act & (tl.load(mask + idx - nc, mask=inr, other=0) != 0)
    return b, act


@triton.jit
def mark_first(ps, pc: tl.constexpr, ids, n):
    """``s_first[b]`` = the first index of each non-null block ``b`` of ``ids[:n]`` (scratch at BIG
    before, ``reset_ids`` after); ends with a barrier, so every lane can read any block's mark."""
    offs = tl.arange(0, pc.BLOCK)
    i = 0
    while i < n:
        idx = i + offs
        b = tl.load(ids + idx, mask=idx < n, other=0)
        tl.atomic_min(ps.s_first + b, idx, mask=(idx < n) & (b != 0))
        i += pc.BLOCK
    tl.debug_barrier()


@triton.jit
def key_tile_errors(ps, b, act, idx, ntok, err, err_val, bad_i):
    """Fold one tile of a caching into the first error by position: a block listed twice (its first
    occurrence marked in ``s_first``: E_INVALID_ARG, vLLM asserts) or keyed at >= the ``ntok`` tokens
    it would now cover (E_HASH_CONFLICT). Returns the new (err, err_val, bad_i)."""
    dup = act & (tl.load(ps.s_first + b, mask=act, other=0) != idx)
    nk = tl.load(ps.num_keys + b, mask=act, other=0)
    old = tl.load(ps.hash_ntok + b, mask=act, other=0).to(tl.int64)
    conflict = act & (nk > 0) & (old >= ntok)
    anyb, bi, bv = first_bad(dup | conflict, idx, b)
    code_here = tl.where(tl.sum((dup & (idx == bi)).to(tl.int32), axis=0) > 0, E_INVALID_ARG, E_HASH_CONFLICT)
    take = anyb & (bi < bad_i)
    return tl.where(take, code_here, err), tl.where(take, bv, err_val), tl.where(take, bi, bad_i)


@triton.jit
def key_tile(ps, pc: tl.constexpr, b, act, hi, lo, g, seq, ntok):
    """Give each active lane's block (keys already dropped) its one key ``(hi, lo, g)`` covering
    ``ntok`` tokens, insertion seqs from ``seq`` in lane order. Returns (each lane's rank among the
    active ones, how many)."""
    a64 = act.to(tl.int64)
    rank = tl.cumsum(a64, axis=0) - a64
    put_key(ps, pc, b, 0, hi, lo, g, seq + rank, ntok, act)
    tl.store(ps.num_keys + b, tl.full(b.shape, 1, tl.int32), mask=act)
    return rank, tl.sum(a64, axis=0)


@triton.jit
def cache_range_needs(ps, pc: tl.constexpr, ids, mask, nc, nf, HAS_MASK: tl.constexpr):
    """(keys removed, keys stored) by ``cache_range``: its event rows are these plus one header."""
    offs = tl.arange(0, pc.BLOCK)
    n_rm = tl.zeros([], tl.int64)
    n_st = tl.zeros([], tl.int64)
    i = nc
    while i < nf:
        b, act = range_block(ids, mask, nc, nf, i + offs, HAS_MASK)
        n_rm += tl.sum(tl.load(ps.num_keys + b, mask=act, other=0).to(tl.int64), axis=0)
        n_st += tl.sum(act.to(tl.int64), axis=0)
        i += pc.BLOCK
    return n_rm, n_st


@triton.jit
def cache_range(ps, pc: tl.constexpr, ids, mask, nc, nf, khi, klo, kbase, kstride, grp, bs,
                has_parent, parent_hi, parent_lo, HAS_MASK: tl.constexpr):
    """``cache_full_blocks`` of a checked range: block ``ids[i]`` for ``i`` in ``[nc, nf)`` (not null,
    not masked) gets key ``(khi[kbase + i * kstride], klo[...], grp)`` covering ``(i + 1) * bs``
    tokens as its only key (old keys removed first: BlockRemoved rows), insertion seqs from ``seq`` in
    block order; then one BlockStored header (parent key when ``has_parent``) and its items. Returns
    the new (ev_pos, seq) (read from ``ctrl``); the caller stores them. No block may be listed twice
    in the range."""
    offs = tl.arange(0, pc.BLOCK)
    ev_pos = tl.load(ps.ctrl + EV_COUNT)
    seq = tl.load(ps.ctrl + KEY_SEQ)
    i = nc
    while i < nf:
        b, act = range_block(ids, mask, nc, nf, i + offs, HAS_MASK)
        ev_pos += drop_keys(ps, pc, b, act, ev_pos)
        tl.debug_barrier()
        i += pc.BLOCK
    if pc.EVENTS:
        write_stored_header(ps.ev, ev_pos, has_parent, parent_hi, parent_lo, grp, bs, True)
        ev_pos += 1
    i = nc
    while i < nf:
        idx = i + offs
        b, act = range_block(ids, mask, nc, nf, idx, HAS_MASK)
        hi = tl.load(khi + kbase + idx.to(tl.int64) * kstride, mask=act, other=0)
        lo = tl.load(klo + kbase + idx.to(tl.int64) * kstride, mask=act, other=0)
        g = tl.zeros([pc.BLOCK], tl.int64) + grp
        rank, count = key_tile(ps, pc, b, act, hi, lo, g, seq, (idx + 1).to(tl.int64) * bs)
        if pc.EVENTS:
            write_stored_item(ps.ev, ev_pos + rank, b, hi, lo, g, act)
        seq += count
        ev_pos += count
        tl.debug_barrier()
        i += pc.BLOCK
    return ev_pos, seq


# p layout of cache_full_kernel
CF_NC = tl.constexpr(0)  # num_cached_blocks
CF_NF = tl.constexpr(1)  # num_full_blocks
CF_BS = tl.constexpr(2)  # block_size (tokens)
CF_GROUP = tl.constexpr(3)
CF_NIDS = tl.constexpr(4)  # len(ids)
CF_HAS_PARENT = tl.constexpr(5)
CF_PARENT_HI = tl.constexpr(6)
CF_PARENT_LO = tl.constexpr(7)


@triton.jit
def cache_full_kernel(ps, pc: tl.constexpr, ids, key_hi, key_lo, mask, p, OP: tl.constexpr,
                      HAS_MASK: tl.constexpr):
    """``cache_full_blocks``: ``cache_range`` of ``ids: int32[p[CF_NIDS]]`` over ``[nc, nf)`` with keys
    ``key_hi, key_lo: int64[nf]`` (by position) and ``mask: int8[nf - nc]``.

    Errors: a bad id; a block keyed at >= the new token count (E_HASH_CONFLICT); a non-null unmasked
    block listed twice in the range (E_INVALID_ARG; vLLM asserts); events that would not fit.
    """
    nids = tl.load(p + CF_NIDS).to(tl.int32)
    if status_clear(ps.status):
        nc = tl.load(p + CF_NC).to(tl.int32)
        nf = tl.load(p + CF_NF).to(tl.int32)
        bs = tl.load(p + CF_BS)
        offs = tl.arange(0, pc.BLOCK)
        err, err_val, _ = check_ids(ps, ids, nids, pc.N, False, False, pc.BLOCK)
        if err == 0:
            i = nc
            while i < nf:  # first active occurrence of each block (masked ones are no duplicates)
                b, act = range_block(ids, mask, nc, nf, i + offs, HAS_MASK)
                tl.atomic_min(ps.s_first + b, i + offs, mask=act)
                i += pc.BLOCK
            tl.debug_barrier()
            bad_i = tl.full([], BIG, tl.int32)
            i = nc
            while i < nf:
                idx = i + offs
                b, act = range_block(ids, mask, nc, nf, idx, HAS_MASK)
                err, err_val, bad_i = key_tile_errors(ps, b, act, idx, (idx + 1).to(tl.int64) * bs, err, err_val,
                                                      bad_i)
                i += pc.BLOCK
            tl.debug_barrier()
            i = nc
            while i < nf:
                b, act = range_block(ids, mask, nc, nf, i + offs, HAS_MASK)
                tl.store(ps.s_first + b, tl.full([pc.BLOCK], BIG, tl.int32), mask=act)
                i += pc.BLOCK
            if pc.EVENTS:
                n_rm, n_st = cache_range_needs(ps, pc, ids, mask, nc, nf, HAS_MASK)
                full = (err == 0) & (tl.load(ps.ctrl + EV_COUNT) + n_rm + n_st + 1 > pc.EV_CAP)
                err = tl.where(full, E_BUFFER_FULL, err)
                err_val = tl.where(full, n_rm + n_st + 1, err_val)
            tl.debug_barrier()
            if err == 0:
                ev_pos, seq = cache_range(ps, pc, ids, mask, nc, nf, key_hi, key_lo, 0, 1, tl.load(p + CF_GROUP), bs,
                                          tl.load(p + CF_HAS_PARENT), tl.load(p + CF_PARENT_HI),
                                          tl.load(p + CF_PARENT_LO), HAS_MASK)
                tl.store(ps.ctrl + KEY_SEQ, seq)
                tl.store(ps.ctrl + EV_COUNT, ev_pos)
        if err != 0:
            set_status(ps.status, err, OP, err_val)


def launch_cache_full(ps, pc, ids, key_hi, key_lo, mask, p, *, op: int):
    """Launch ``cache_full_kernel`` (one program); ``mask`` None when every block is cached."""
    cache_full_kernel[(1,)](ps, pc, ids, key_hi, key_lo, ids if mask is None else mask, p, OP=op,
                            HAS_MASK=mask is not None, num_warps=warps_for(pc.BLOCK))


@triton.jit
def cache_blocks_kernel(ps, pc: tl.constexpr, ids, key_hi, key_lo, key_group, ntok, n, OP: tl.constexpr):
    """Many ``cache_full_blocks`` calls in one launch: :func:`cache_blocks_batch`."""
    cache_blocks_batch(ps, pc, ids, key_hi, key_lo, key_group, ntok, n, OP)


@triton.jit
def cache_blocks_batch(ps, pc: tl.constexpr, ids, key_hi, key_lo, key_group, ntok, n, OP: tl.constexpr):
    """Many ``cache_full_blocks`` calls, flattened (``BlockPool.cache_blocks_batched``):
    item ``i < n`` keys block ``ids[i]`` (``int32``; null: skipped) under ``(key_hi[i], key_lo[i],
    key_group[i])`` (``int64``) covering ``ntok[i]`` tokens (``int64``) as its only key (old keys
    dropped), insertion seqs in item order. No events: the host refuses a pool that records them.

    Errors, then nothing changes: a bad id (E_INVALID_ID); a non-null block listed twice
    (E_INVALID_ARG); a block keyed at >= its new token count (E_HASH_CONFLICT).
    """
    if status_clear(ps.status):
        offs = tl.arange(0, pc.BLOCK)
        err, err_val, _bad_at = check_ids(ps, ids, n, pc.N, False, False, pc.BLOCK)
        if err == 0:
            mark_first(ps, pc, ids, n)
            bad_i = tl.full([], BIG, tl.int32)
            i = 0
            while i < n:
                idx = i + offs
                b, act = range_block(ids, ids, 0, n, idx, False)
                err, err_val, bad_i = key_tile_errors(ps, b, act, idx, tl.load(ntok + idx, mask=act, other=0),
                                                      err, err_val, bad_i)
                i += pc.BLOCK
            tl.debug_barrier()
            reset_ids(ps, ids, n, pc.N, pc.BLOCK)
            tl.debug_barrier()
            if err == 0:
                i = 0
                while i < n:
                    b, act = range_block(ids, ids, 0, n, i + offs, False)
                    drop_keys(ps, pc, b, act, 0)
                    i += pc.BLOCK
                tl.debug_barrier()
                # strict: benign, read by every thread before any store (the barrier above)
                seq = tl.load(ps.ctrl + KEY_SEQ)
                i = 0
                while i < n:
                    idx = i + offs
                    b, act = range_block(ids, ids, 0, n, idx, False)
                    rank, count = key_tile(ps, pc, b, act, tl.load(key_hi + idx, mask=act, other=0),
                                        tl.load(key_lo + idx, mask=act, other=0),
                                        tl.load(key_group + idx, mask=act, other=0), seq,
                                        tl.load(ntok + idx, mask=act, other=0))
                    seq += count
                    tl.debug_barrier()
                    i += pc.BLOCK
                tl.store(ps.ctrl + KEY_SEQ, seq)
        if err != 0:
            set_status(ps.status, err, OP, err_val)


def launch_cache_blocks(ps, pc, ids, key_hi, key_lo, key_group, ntok, *, op: int):
    """Launch ``cache_blocks_kernel`` (one program) over all of ``ids``; the pool has no KV events
    (``pc.EVENTS`` off)."""
    if pc.EVENTS:
        raise ValueError("cache_blocks_kernel writes no events")
    cache_blocks_kernel[(1,)](ps, pc, ids, key_hi, key_lo, key_group, ntok, ids.numel(), OP=op,
                              num_warps=warps_for(pc.BLOCK))


@triton.jit
def add_key(ps, pc: tl.constexpr, b, hi, lo, grp, ntok, has_parent, parent_hi, parent_lo, block_size, ev_pos,
            REPLACE: tl.constexpr):
    """``cache_partial_block`` of block ``b`` (non-null) under ``(hi, lo, grp)`` covering ``ntok``
    tokens: nothing when the block already answers to the key (unless ``REPLACE``); its keys are
    removed first when ``REPLACE`` or its primary covers fewer tokens; else a secondary key. Returns
    (error, event rows written): E_KEY_CAPACITY when a secondary key would not fit, E_BUFFER_FULL when
    the rows would not fit; then nothing changes. Stores num_keys, KEY_SEQ; the caller stores EV_COUNT."""
    js = tl.arange(0, pc.MKP)
    lane0 = js == 0
    nk = tl.load(ps.num_keys + b)
    e = b.to(tl.int64) * pc.MK + js
    rowm = js < nk
    same = rowm & (tl.load(ps.keys + e * KW + K_HI, mask=rowm, other=0) == hi) \
        & (tl.load(ps.keys + e * KW + K_LO, mask=rowm, other=0) == lo) \
        & (tl.load(ps.keys + e * KW + K_GROUP, mask=rowm, other=0) == grp)
    answers = tl.sum(same.to(tl.int32), axis=0) > 0
    err = tl.zeros([], tl.int32)
    rows = tl.zeros([], tl.int64)
    if (answers == 0) | REPLACE:
        drop_all = REPLACE | ((nk > 0) & (tl.load(ps.hash_ntok + b).to(tl.int64) < ntok))
        err = tl.where((drop_all == 0) & (nk >= pc.MK), E_KEY_CAPACITY, err)
        need = tl.where(drop_all, nk, 0).to(tl.int64) + 2
        if pc.EVENTS:
            err = tl.where((err == 0) & (ev_pos + need > pc.EV_CAP), E_BUFFER_FULL, err)
        if err == 0:
            bv = tl.zeros([pc.MKP], tl.int32) + b
            # Scalars are broadcast to the lane vector explicitly: the interpreter rejects a mask made
            # of a vector and a scalar bool.
            drop_v = lane0 & ((tl.zeros([pc.MKP], tl.int32) + drop_all.to(tl.int32)) != 0)
            rows = drop_keys(ps, pc, bv, drop_v, ev_pos)
            tl.debug_barrier()
            j = tl.where(drop_all, 0, nk)
            jv = tl.zeros([pc.MKP], tl.int32) + j
            hv = tl.zeros([pc.MKP], tl.int64) + hi
            lv = tl.zeros([pc.MKP], tl.int64) + lo
            gv = tl.zeros([pc.MKP], tl.int64) + grp
            seq = tl.load(ps.ctrl + KEY_SEQ)
            put_key(ps, pc, bv, jv, hv, lv, gv, tl.zeros([pc.MKP], tl.int64) + seq,
                    tl.zeros([pc.MKP], tl.int64) + ntok, lane0)
            tl.store(ps.num_keys + b, j + 1)
            tl.store(ps.ctrl + KEY_SEQ, seq + 1)
            if pc.EVENTS:
                write_stored_header(ps.ev, ev_pos + rows, has_parent, parent_hi, parent_lo, grp, block_size, True)
                write_stored_item(ps.ev, tl.zeros([pc.MKP], tl.int64) + ev_pos + rows + 1, bv, hv, lv, gv, lane0)
                rows += 2
            tl.debug_barrier()
    return err, rows


# p layout of cache_partial_kernel
CP_BLOCK = tl.constexpr(0)
CP_NTOK = tl.constexpr(1)
CP_GROUP = tl.constexpr(2)
CP_HBS = tl.constexpr(3)  # hash_block_size: the BlockStored's block_size
CP_HI = tl.constexpr(4)
CP_LO = tl.constexpr(5)
CP_HAS_PARENT = tl.constexpr(6)
CP_PARENT_HI = tl.constexpr(7)
CP_PARENT_LO = tl.constexpr(8)


@triton.jit
def cache_partial_kernel(ps, pc: tl.constexpr, p, OP: tl.constexpr, REPLACE: tl.constexpr):
    """``cache_partial_block`` of block ``p[CP_BLOCK]`` (non-null, in range: checked by the host) under
    key ``(p[CP_HI], p[CP_LO], p[CP_GROUP])`` covering ``p[CP_NTOK]`` tokens (``add_key``)."""
    if status_clear(ps.status):
        b = tl.load(p + CP_BLOCK).to(tl.int32)
        ev_pos = tl.load(ps.ctrl + EV_COUNT)  # strict: benign, cache_partial_kernel runs one warp (num_warps = 1)
        # strict: benign, cache_partial_kernel runs one warp (num_warps = 1)
        err, rows = add_key(ps, pc, b, tl.load(p + CP_HI), tl.load(p + CP_LO), tl.load(p + CP_GROUP),
                            tl.load(p + CP_NTOK), tl.load(p + CP_HAS_PARENT), tl.load(p + CP_PARENT_HI),
                            tl.load(p + CP_PARENT_LO), tl.load(p + CP_HBS), ev_pos, REPLACE)
        tl.store(ps.ctrl + EV_COUNT, ev_pos + rows)
        if err != 0:
            set_status(ps.status, err, OP, b)


def launch_cache_partial(ps, pc, p, *, replace: bool, op: int):
    cache_partial_kernel[(1,)](ps, pc, p, OP=op, REPLACE=bool(replace), num_warps=1)


@triton.jit
def evict_kernel(ps, pc: tl.constexpr, ids, n, OP: tl.constexpr):
    """``evict_blocks``: remove every key of each distinct non-null block of ``ids: int32[n]`` (first
    occurrence order, one BlockRemoved row per key). Ref counts and the ring never change."""
    if status_clear(ps.status):
        offs = tl.arange(0, pc.BLOCK)
        err, err_val, _ = check_ids(ps, ids, n, pc.N, False, False, pc.BLOCK)
        if err == 0:
            mark_first(ps, pc, ids, n)  # first occurrences only
            n_rm = tl.zeros([], tl.int64)
            i = 0
            while i < n:
                idx = i + offs
                b = tl.load(ids + idx, mask=idx < n, other=0)
                act = (idx < n) & (b != 0) & (tl.load(ps.s_first + b, mask=(idx < n) & (b != 0), other=-1) == idx)
                n_rm += tl.sum(tl.load(ps.num_keys + b, mask=act, other=0).to(tl.int64), axis=0)
                i += pc.BLOCK
            if pc.EVENTS:
                full = tl.load(ps.ctrl + EV_COUNT) + n_rm > pc.EV_CAP
                err = tl.where(full, E_BUFFER_FULL, err)
                err_val = tl.where(full, n_rm, err_val)
            if err == 0:
                ev_pos = tl.load(ps.ctrl + EV_COUNT)
                i = 0
                while i < n:
                    idx = i + offs
                    b = tl.load(ids + idx, mask=idx < n, other=0)
                    act = (idx < n) & (b != 0) & (tl.load(ps.s_first + b, mask=(idx < n) & (b != 0), other=-1) == idx)
                    ev_pos += drop_keys(ps, pc, b, act, ev_pos)
                    tl.debug_barrier()
                    i += pc.BLOCK
                tl.debug_barrier()  # strict: orders the reads of EV_COUNT above before this store (also when n = 0)
                tl.store(ps.ctrl + EV_COUNT, ev_pos)
            tl.debug_barrier()
            reset_ids(ps, ids, n, pc.N, pc.BLOCK)
        if err != 0:
            set_status(ps.status, err, OP, err_val)


def launch_evict(ps, pc, ids, *, op: int):
    evict_kernel[(1,)](ps, pc, ids, ids.numel(), OP=op, num_warps=warps_for(pc.BLOCK))


@triton.jit
def move_kernel(ps, pc: tl.constexpr, p, OP: tl.constexpr):
    """``move_block_hashes(p[0], p[1])``: every key row of src moves to dst (new seqs, so they count as
    newly inserted), src ends un-hashed. Errors: ids out of range, dst null, dst already keyed."""
    if status_clear(ps.status):
        src64 = tl.load(p + 0)  # checked as int64: a cast first would wrap 2**31 into range
        dst64 = tl.load(p + 1)
        err = tl.where((src64 < 0) | (src64 >= pc.N), E_INVALID_ID, 0)
        val = src64
        bad_dst = (err == 0) & ((dst64 < 0) | (dst64 >= pc.N))
        err = tl.where(bad_dst, E_INVALID_ID, err)
        val = tl.where(bad_dst, dst64, val)
        null_dst = (err == 0) & (dst64 == 0)
        err = tl.where(null_dst, E_NULL_BLOCK, err)
        val = tl.where(null_dst, dst64, val)
        src = src64.to(tl.int32)
        dst = dst64.to(tl.int32)
        if err == 0:
            keyed = tl.load(ps.num_keys + dst) > 0
            err = tl.where(keyed, E_HASH_CONFLICT, err)
            val = tl.where(keyed, dst.to(tl.int64), val)
        if err == 0:
            if src != dst:
                js = tl.arange(0, pc.MKP)
                nk = tl.load(ps.num_keys + src)
                m = js < nk
                es = src.to(tl.int64) * pc.MK + js
                hi = tl.load(ps.keys + es * KW + K_HI, mask=m, other=0)
                lo = tl.load(ps.keys + es * KW + K_LO, mask=m, other=0)
                g = tl.load(ps.keys + es * KW + K_GROUP, mask=m, other=0)
                slot = tl.load(ps.keys + es * KW + K_SLOT, mask=m, other=0)
                table_delete(ps.table, ps.overflow, lo, g, slot, m, pc.NCHUNK)
                tl.debug_barrier()
                seq = tl.load(ps.ctrl + KEY_SEQ)
                ntok = tl.load(ps.hash_ntok + src)
                put_key(ps, pc, tl.zeros([pc.MKP], tl.int32) + dst, js, hi, lo, g, seq + js,
                        tl.zeros([pc.MKP], tl.int32) + ntok, m)
                tl.store(ps.num_keys + dst, nk)
                tl.store(ps.num_keys + src, 0)
                tl.store(ps.hash_ntok + src, -1)
                tl.store(ps.ctrl + KEY_SEQ, seq + nk)
        else:
            set_status(ps.status, err, OP, val)


def launch_move(ps, pc, p, *, op: int):
    move_kernel[(1,)](ps, pc, p, OP=op, num_warps=1)


@triton.jit
def reset_kernel(ps, pc: tl.constexpr, out, OP: tl.constexpr):
    """``reset_prefix_cache``: ``out[0] = 1`` and every key, the table and every watched flag cleared
    (the host fires the callbacks in registration order) if no non-null block is held, else
    ``out[0] = 0`` and nothing changes. The ring is untouched."""
    tl.store(out, 0)
    if status_clear(ps.status):
        offs = tl.arange(0, pc.BLOCK)
        held = tl.zeros([], tl.int32)
        i = 0
        while i < pc.N:
            idx = i + offs
            m = (idx < pc.N) & (idx > 0)
            held += tl.sum((m & (tl.load(ps.ref_cnt + idx, mask=m, other=0) > 0)).to(tl.int32), axis=0)
            i += pc.BLOCK
        full = tl.load(ps.ctrl + EV_COUNT) + 1 > pc.EV_CAP  # never with events off (no rows, EV_CAP 1)
        if (held == 0) & (full == 0):
            i = 0
            while i < pc.N:
                idx = i + offs
                m = idx < pc.N
                tl.store(ps.num_keys + idx, tl.zeros([pc.BLOCK], tl.int32), mask=m)
                tl.store(ps.hash_ntok + idx, tl.full([pc.BLOCK], -1, tl.int32), mask=m)
                tl.store(ps.watched + idx, tl.zeros([pc.BLOCK], tl.int8), mask=m)
                i += pc.BLOCK
            i = 0
            while i < pc.NCHUNK * CHUNK:
                idx = i + offs
                tl.store(ps.table + idx, tl.zeros([pc.BLOCK], tl.int64), mask=idx < pc.NCHUNK * CHUNK)
                tl.store(ps.overflow + idx, tl.zeros([pc.BLOCK], tl.int32), mask=idx < pc.NCHUNK)
                i += pc.BLOCK
            if pc.EVENTS:
                e0 = tl.load(ps.ctrl + EV_COUNT)
                zero = tl.zeros([pc.BLOCK], tl.int64)
                write_row(ps.ev, zero + e0, EV_CLEARED, zero, zero, zero, zero, zero, offs == 0)
                tl.debug_barrier()  # strict: orders the reads of EV_COUNT above before this store
                tl.store(ps.ctrl + EV_COUNT, e0 + 1)
            tl.store(out, 1)
        if (held == 0) & (full != 0):
            set_status(ps.status, E_BUFFER_FULL, OP, 1)


def launch_reset(ps, pc, out, *, op: int):
    reset_kernel[(1,)](ps, pc, out, OP=op, num_warps=warps_for(pc.BLOCK))
