"""Prefix-cache key changes: ``cache_full_blocks``, ``cache_partial_block``, ``evict_blocks``,
``move_block_hashes`` and ``reset_prefix_cache`` (SPEC.md section 2).

Grid (1,) for all: each validates its whole input, then commits, so an error changes nothing.
Parameters that change per call come in a small device tensor ``p: int64[...]`` so a captured
graph can replay the launch with new values.
"""
import triton
import triton.language as tl

from .alloc import RW
from .common import (
    BIG, E_BUFFER_FULL, E_HASH_CONFLICT, E_INVALID_ARG, E_INVALID_ID, E_KEY_CAPACITY, E_NULL_BLOCK, EV_CLEARED,
    EV_COUNT, EV_STORED, KEY_SEQ, REUSE_COUNT, first_bad, set_status,
)
from .events import write_event
from .keytable import K_GROUP, K_HI, K_LO, K_SLOT, KW, drop_keys, put_key, table_delete
from .release import check_ids, count_ids, reset_scratch  # noqa: F401

# p layouts
CF_NC = tl.constexpr(0)  # num_cached_blocks
CF_NF = tl.constexpr(1)  # num_full_blocks
CF_BS = tl.constexpr(2)  # block_size (tokens)
CF_GROUP = tl.constexpr(3)
CF_TAG = tl.constexpr(4)  # host op tag carried by the stored events
CF_NIDS = tl.constexpr(5)  # len(ids), all range-checked


@triton.jit
def cache_full_kernel(ctrl, status, num_keys, hash_ntok, keys, table, overflow, ev, s_cnt, s_last, s_first,
                      ids, key_hi, key_lo, mask, p,
                      OP: tl.constexpr, N: tl.constexpr, MK: tl.constexpr, NCHUNK: tl.constexpr,
                      EVENTS: tl.constexpr, EV_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """``cache_full_blocks``: key block ``ids[i]`` as ``(key_hi[i], key_lo[i], group)`` covering
    ``(i + 1) * block_size`` tokens, for ``i`` in ``[nc, nf)`` where ``mask[i - nc] != 0`` and the block
    is not null. ``ids: int32[nids]``, ``key_hi, key_lo: int64[nf]``, ``mask: int8[nf - nc]``.

    Errors: a bad id; a block keyed at >= the new token count (E_HASH_CONFLICT); a block listed twice
    (E_INVALID_ARG; vLLM asserts); a full event buffer. A promoted block's old keys are removed
    first (removal events), then one stored-item event per key, all tagged ``p[CF_TAG]``.
    """
    nids = tl.load(p + CF_NIDS).to(tl.int32)
    if tl.load(status) == 0:
        nc = tl.load(p + CF_NC).to(tl.int32)
        nf = tl.load(p + CF_NF).to(tl.int32)
        bs = tl.load(p + CF_BS)
        grp = tl.load(p + CF_GROUP)
        tag = tl.load(p + CF_TAG)
        offs = tl.arange(0, BLOCK)
        err, err_val = check_ids(ids, nids, N, False, BLOCK)
        if err == 0:
            i = nc
            while i < nf:  # first active occurrence of each block (masked ones are no duplicates)
                idx = i + offs
                b = tl.load(ids + idx, mask=idx < nf, other=0)
                act = (idx < nf) & (b != 0) & (tl.load(mask + idx - nc, mask=idx < nf, other=0) != 0)
                tl.atomic_min(s_first + b, idx - nc, mask=act)
                i += BLOCK
            tl.debug_barrier()
            bad_i = nids * 0 + BIG
            n_rm = (nids * 0).to(tl.int64)
            n_st = (nids * 0).to(tl.int64)
            i = nc
            while i < nf:
                idx = i + offs
                b = tl.load(ids + idx, mask=idx < nf, other=0)
                act = (idx < nf) & (b != 0) & (tl.load(mask + idx - nc, mask=idx < nf, other=0) != 0)
                dup = act & (tl.load(s_first + b, mask=act, other=0) != idx - nc)
                nk = tl.load(num_keys + b, mask=act, other=0)
                conflict = act & (nk > 0) & (tl.load(hash_ntok + b, mask=act, other=0).to(tl.int64) >= (idx + 1) * bs)
                anyb, bi, bv = first_bad(dup | conflict, idx, b)
                code_here = tl.where(tl.sum((dup & (idx == bi)).to(tl.int32), axis=0) > 0, E_INVALID_ARG,
                                     E_HASH_CONFLICT)
                take = anyb & (bi < bad_i)
                err = tl.where(take, code_here, err)
                err_val = tl.where(take, bv, err_val)
                bad_i = tl.where(take, bi, bad_i)
                n_rm += tl.sum(tl.where(act, nk, 0).to(tl.int64), axis=0)
                n_st += tl.sum(act.to(tl.int64), axis=0)
                i += BLOCK
            if EVENTS:
                full = (err == 0) & (tl.load(ctrl + EV_COUNT) + n_rm + n_st > EV_CAP)
                err = tl.where(full, E_BUFFER_FULL, err)
                err_val = tl.where(full, n_rm + n_st, err_val)
            tl.debug_barrier()
            if err == 0:
                ev_pos = tl.load(ctrl + EV_COUNT)
                i = nc
                while i < nf:
                    idx = i + offs
                    b = tl.load(ids + idx, mask=idx < nf, other=0)
                    act = (idx < nf) & (b != 0) & (tl.load(mask + idx - nc, mask=idx < nf, other=0) != 0)
                    ev_pos += drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, b, act,
                                        MK, NCHUNK, EVENTS, tag)
                    tl.debug_barrier()
                    i += BLOCK
                seq = tl.load(ctrl + KEY_SEQ)
                i = nc
                while i < nf:
                    idx = i + offs
                    b = tl.load(ids + idx, mask=idx < nf, other=0)
                    act = (idx < nf) & (b != 0) & (tl.load(mask + idx - nc, mask=idx < nf, other=0) != 0)
                    hi = tl.load(key_hi + idx, mask=act, other=0)
                    lo = tl.load(key_lo + idx, mask=act, other=0)
                    a64 = act.to(tl.int64)
                    rank = tl.cumsum(a64, axis=0) - a64
                    g = tl.zeros([BLOCK], tl.int64) + grp
                    put_key(table, overflow, keys, hash_ntok, b, 0, hi, lo, g, seq + rank, (idx + 1) * bs, act,
                            MK, NCHUNK, BLOCK)
                    tl.store(num_keys + b, tl.full([BLOCK], 1, tl.int32), mask=act)
                    if EVENTS:
                        write_event(ev, ev_pos + rank, EV_STORED, b, hi, lo, g, tag, act)
                    seq += tl.sum(a64, axis=0)
                    ev_pos += tl.sum(a64, axis=0)
                    tl.debug_barrier()
                    i += BLOCK
                tl.store(ctrl + KEY_SEQ, seq)
                tl.store(ctrl + EV_COUNT, ev_pos)
            tl.debug_barrier()
            reset_scratch(ids + nc, nf - nc, s_cnt, s_last, s_first, N, BLOCK)
        if err != 0:
            set_status(status, err, OP, err_val)


# p layout of cache_partial_kernel
CP_BLOCK = tl.constexpr(0)
CP_NTOK = tl.constexpr(1)
CP_GROUP = tl.constexpr(2)
CP_TAG = tl.constexpr(3)
CP_REPLACE = tl.constexpr(4)
CP_HI = tl.constexpr(5)
CP_LO = tl.constexpr(6)


@triton.jit
def cache_partial_kernel(ctrl, status, num_keys, hash_ntok, keys, table, overflow, ev, p,
                         OP: tl.constexpr, N: tl.constexpr, MK: tl.constexpr, MKP: tl.constexpr,
                         NCHUNK: tl.constexpr, EVENTS: tl.constexpr, EV_CAP: tl.constexpr):
    """``cache_partial_block`` of block ``p[CP_BLOCK]`` (non-null, in range: checked by the host) under
    key ``(p[CP_HI], p[CP_LO], p[CP_GROUP])`` covering ``p[CP_NTOK]`` tokens. Nothing when the block
    already answers to the key and replace is off; old keys removed first on replace or when the
    primary covers fewer tokens; E_KEY_CAPACITY when a secondary key would not fit."""
    if tl.load(status) == 0:
        js = tl.arange(0, MKP)
        lane0 = js == 0
        b = tl.load(p + CP_BLOCK).to(tl.int32)
        nt = tl.load(p + CP_NTOK)
        grp = tl.load(p + CP_GROUP)
        tag = tl.load(p + CP_TAG)
        replace = tl.load(p + CP_REPLACE) != 0
        hi = tl.load(p + CP_HI)
        lo = tl.load(p + CP_LO)
        nk = tl.load(num_keys + b)
        e = b.to(tl.int64) * MK + js
        rowm = js < nk
        same = rowm & (tl.load(keys + e * KW + K_HI, mask=rowm, other=0) == hi) \
            & (tl.load(keys + e * KW + K_LO, mask=rowm, other=0) == lo) \
            & (tl.load(keys + e * KW + K_GROUP, mask=rowm, other=0) == grp)
        answers = tl.sum(same.to(tl.int32), axis=0) > 0
        if (answers == 0) | replace:
            drop_all = replace | ((nk > 0) & (tl.load(hash_ntok + b).to(tl.int64) < nt))
            err = tl.where((drop_all == 0) & (nk >= MK), E_KEY_CAPACITY, 0)
            n_ev = tl.where(drop_all, nk, 0).to(tl.int64) + 1
            if EVENTS:
                err = tl.where((err == 0) & (tl.load(ctrl + EV_COUNT) + n_ev > EV_CAP), E_BUFFER_FULL, err)
            if err == 0:
                ev_pos = tl.load(ctrl + EV_COUNT)
                bv = tl.zeros([MKP], tl.int32) + b
                # Scalars are broadcast to the lane vector explicitly: the interpreter rejects a mask made
                # of a vector and a scalar bool (ValueError 'mask has unsupported dtype').
                drop_v = (tl.zeros([MKP], tl.int32) + drop_all.to(tl.int32)) != 0
                ev_pos += drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, bv, lane0 & drop_v,
                                    MK, NCHUNK, EVENTS, tag)
                tl.debug_barrier()
                j = tl.where(drop_all, 0, nk)
                jv = tl.zeros([MKP], tl.int32) + j
                hv = tl.zeros([MKP], tl.int64) + hi
                lv = tl.zeros([MKP], tl.int64) + lo
                gv = tl.zeros([MKP], tl.int64) + grp
                seq = tl.load(ctrl + KEY_SEQ)
                put_key(table, overflow, keys, hash_ntok, bv, jv, hv, lv, gv, tl.zeros([MKP], tl.int64) + seq,
                        tl.zeros([MKP], tl.int64) + nt, lane0, MK, NCHUNK, MKP)
                tl.store(num_keys + b, j + 1)
                if EVENTS:
                    write_event(ev, tl.zeros([MKP], tl.int64) + ev_pos, EV_STORED, bv, hv, lv, gv, tag, lane0)
                tl.store(ctrl + KEY_SEQ, seq + 1)
                tl.store(ctrl + EV_COUNT, ev_pos + 1)
            else:
                set_status(status, err, OP, b)


@triton.jit
def evict_kernel(ctrl, status, num_keys, hash_ntok, keys, table, overflow, ev, s_cnt, s_last, s_first,
                 ids, num_ids, tag, OP: tl.constexpr, N: tl.constexpr, MK: tl.constexpr, NCHUNK: tl.constexpr,
                 EVENTS: tl.constexpr, EV_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """``evict_blocks``: remove every key of each distinct non-null block of ``ids: int32[num_ids[0]]``
    (first occurrence order, removal events in that order). Ref counts and the ring never change."""
    n = tl.load(num_ids)
    if tl.load(status) == 0:
        offs = tl.arange(0, BLOCK)
        err, err_val = check_ids(ids, n, N, False, BLOCK)
        if err == 0:
            count_ids(ids, n, s_cnt, s_last, s_first, BLOCK)
            tl.debug_barrier()
            n_rm = (n * 0).to(tl.int64)
            i = 0
            while i < n:
                idx = i + offs
                b = tl.load(ids + idx, mask=idx < n, other=0)
                act = (idx < n) & (b != 0) & (tl.load(s_first + b, mask=(idx < n) & (b != 0), other=-1) == idx)
                n_rm += tl.sum(tl.load(num_keys + b, mask=act, other=0).to(tl.int64), axis=0)
                i += BLOCK
            if EVENTS:
                full = tl.load(ctrl + EV_COUNT) + n_rm > EV_CAP
                err = tl.where(full, E_BUFFER_FULL, err)
                err_val = tl.where(full, n_rm, err_val)
            if err == 0:
                ev_pos = tl.load(ctrl + EV_COUNT)
                i = 0
                while i < n:
                    idx = i + offs
                    b = tl.load(ids + idx, mask=idx < n, other=0)
                    act = (idx < n) & (b != 0) & (tl.load(s_first + b, mask=(idx < n) & (b != 0), other=-1) == idx)
                    ev_pos += drop_keys(table, overflow, keys, num_keys, hash_ntok, ev, ev_pos, b, act,
                                        MK, NCHUNK, EVENTS, tag)
                    tl.debug_barrier()
                    i += BLOCK
                tl.store(ctrl + EV_COUNT, ev_pos)
            tl.debug_barrier()
        reset_scratch(ids, n, s_cnt, s_last, s_first, N, BLOCK)
        if err != 0:
            set_status(status, err, OP, err_val)


@triton.jit
def move_kernel(ctrl, status, num_keys, hash_ntok, keys, table, overflow, p,
                OP: tl.constexpr, N: tl.constexpr, MK: tl.constexpr, MKP: tl.constexpr, NCHUNK: tl.constexpr):
    """``move_block_hashes(p[0], p[1])``: every key row of src moves to dst (new seqs, so they count as
    newly inserted), src ends un-hashed. Errors: ids out of range, dst null, dst already keyed."""
    if tl.load(status) == 0:
        src = tl.load(p + 0).to(tl.int32)
        dst = tl.load(p + 1).to(tl.int32)
        err = tl.where((src < 0) | (src >= N), E_INVALID_ID, 0)
        val = src.to(tl.int64)
        bad_dst = (err == 0) & ((dst < 0) | (dst >= N))
        err = tl.where(bad_dst, E_INVALID_ID, err)
        val = tl.where(bad_dst, dst.to(tl.int64), val)
        null_dst = (err == 0) & (dst == 0)
        err = tl.where(null_dst, E_NULL_BLOCK, err)
        val = tl.where(null_dst, dst.to(tl.int64), val)
        if err == 0:
            keyed = tl.load(num_keys + dst) > 0
            err = tl.where(keyed, E_HASH_CONFLICT, err)
            val = tl.where(keyed, dst.to(tl.int64), val)
        if err == 0:
            if src != dst:
                js = tl.arange(0, MKP)
                nk = tl.load(num_keys + src)
                m = js < nk
                es = src.to(tl.int64) * MK + js
                hi = tl.load(keys + es * KW + K_HI, mask=m, other=0)
                lo = tl.load(keys + es * KW + K_LO, mask=m, other=0)
                g = tl.load(keys + es * KW + K_GROUP, mask=m, other=0)
                slot = tl.load(keys + es * KW + K_SLOT, mask=m, other=0)
                table_delete(table, overflow, lo, g, slot, m, NCHUNK)
                tl.debug_barrier()
                seq = tl.load(ctrl + KEY_SEQ)
                ntok = tl.load(hash_ntok + src)
                put_key(table, overflow, keys, hash_ntok, tl.zeros([MKP], tl.int32) + dst, js, hi, lo, g,
                        seq + js, tl.zeros([MKP], tl.int32) + ntok, m, MK, NCHUNK, MKP)
                tl.store(num_keys + dst, nk)
                tl.store(num_keys + src, 0)
                tl.store(hash_ntok + src, -1)
                tl.store(ctrl + KEY_SEQ, seq + nk)
        else:
            set_status(status, err, OP, val)


@triton.jit
def reset_kernel(ctrl, status, ref_cnt, num_keys, hash_ntok, table, overflow, watcher_id, watch_seq, reuse, ev,
                 out, OP: tl.constexpr, N: tl.constexpr, NCHUNK: tl.constexpr, EVENTS: tl.constexpr,
                 EV_CAP: tl.constexpr, REUSE_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """``reset_prefix_cache``: ``out[0] = 1`` and every key, the table and all watchers cleared (watchers
    go to the reuse log; the host fires them in registration order) if no non-null block is held,
    else ``out[0] = 0`` and nothing changes. The ring is untouched."""
    tl.store(out, 0)
    if tl.load(status) == 0:
        offs = tl.arange(0, BLOCK)
        held = 0
        nw = 0
        i = 0
        while i < N:
            idx = i + offs
            m = (idx < N) & (idx > 0)
            held += tl.sum((m & (tl.load(ref_cnt + idx, mask=m, other=0) > 0)).to(tl.int32), axis=0)
            nw += tl.sum((m & (tl.load(watcher_id + idx, mask=m, other=-1) >= 0)).to(tl.int32), axis=0)
            i += BLOCK
        err = tl.where(tl.load(ctrl + REUSE_COUNT) + nw > REUSE_CAP, E_BUFFER_FULL, 0)
        if EVENTS:
            err = tl.where(tl.load(ctrl + EV_COUNT) + 1 > EV_CAP, E_BUFFER_FULL, err)
        if (held == 0) & (err == 0):
            ru = tl.load(ctrl + REUSE_COUNT)
            i = 0
            while i < N:
                idx = i + offs
                m = idx < N
                tl.store(num_keys + idx, tl.zeros([BLOCK], tl.int32), mask=m)
                tl.store(hash_ntok + idx, tl.full([BLOCK], -1, tl.int32), mask=m)
                w = tl.load(watcher_id + idx, mask=m, other=-1)
                hw = m & (w >= 0)
                r = ru + tl.cumsum(hw.to(tl.int64), axis=0) - hw.to(tl.int64)
                tl.store(reuse + r * RW + 0, idx.to(tl.int64), mask=hw)
                tl.store(reuse + r * RW + 1, w.to(tl.int64), mask=hw)
                tl.store(reuse + r * RW + 2, tl.load(watch_seq + idx, mask=hw, other=0), mask=hw)
                tl.store(watcher_id + idx, tl.full([BLOCK], -1, tl.int32), mask=hw)
                ru += tl.sum(hw.to(tl.int64), axis=0)
                i += BLOCK
            i = 0
            while i < NCHUNK * 16 + 1:
                idx = i + offs
                tl.store(table + idx, tl.zeros([BLOCK], tl.int64), mask=idx < NCHUNK * 16 + 1)
                tl.store(overflow + idx, tl.zeros([BLOCK], tl.int32), mask=idx < NCHUNK)
                i += BLOCK
            tl.store(ctrl + REUSE_COUNT, ru)
            if EVENTS:
                e0 = tl.load(ctrl + EV_COUNT)
                lane0 = offs == 0
                zero = tl.zeros([BLOCK], tl.int64)
                write_event(ev, zero + e0, EV_CLEARED, zero, zero, zero, zero, 0, lane0)
                tl.store(ctrl + EV_COUNT, e0 + 1)
            tl.store(out, 1)
        if (held == 0) & (err != 0):
            set_status(status, err, OP, err.to(tl.int64) * 0)
