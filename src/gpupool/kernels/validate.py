"""``validate()`` on the device: every invariant of docs/semantics.md section 1 and of the device layout
(ring R1-R5 of docs/algorithms.md section 1; key rows, table words and overflow counts of section 4).

Grid (1,). Reads the whole state, writes only ``out: int64[2]`` = (first failed check, offending
value; 0 = all hold) and the scratch ``s_ovf: int32[NCHUNK]`` (expected overflow counts), which it
zeroes again. Checks run in a fixed order; the first failing one is reported.
"""
from enum import IntEnum

import triton
import triton.language as tl

from .common import warps_for
from .keytable import key_home, key_tag
from .layout import BIG, CHUNK, HEAD, K_GROUP, K_HI, K_LO, K_SLOT, KW, NUM_FREE, TAIL, constexprs


class Check(IntEnum):
    """The checks, in the order they run (``gpupool.validate.CHECKS`` has their messages)."""

    WINDOW = 1
    RING_SLOT = 2
    NUM_FREE = 3
    NULL = 4
    REF_NEG = 5
    QUEUED_IFF_FREE = 6
    QSLOT = 7
    NUM_KEYS = 8
    NTOK = 9
    KEY_SLOT = 10
    DUP_KEY = 11
    TABLE_COUNT = 12
    OVERFLOW = 13
    CACHING_OFF = 14


(V_WINDOW, V_RING_SLOT, V_NUM_FREE, V_NULL, V_REF_NEG, V_QUEUED_IFF_FREE, V_QSLOT, V_NUM_KEYS, V_NTOK,
 V_KEY_SLOT, V_DUP_KEY, V_TABLE_COUNT, V_OVERFLOW, V_CACHING_OFF) = constexprs(Check)


@triton.jit
def _note(code, val, bad, idx, check):
    """Keep the first failure: ``check`` at the lowest-index bad lane, if none was found before."""
    i = tl.min(tl.where(bad, idx, BIG), axis=0)
    v = tl.sum(tl.where(bad & (idx == i), idx, 0).to(tl.int64), axis=0)
    new = (code == 0) & (i < BIG)
    return tl.where(new, check, code), tl.where(new, v, val)


@triton.jit
def validate_kernel(ps, pc: tl.constexpr, s_ovf, out):
    """The checks above, in order; ``out: int64[2]`` = (first failed check, offending value)."""
    validate_state(ps, s_ovf, out, pc.N, pc.C, pc.MK, pc.NCHUNK, pc.CACHING, pc.BLOCK)


@triton.jit
def validate_state(ps, s_ovf, out, N: tl.constexpr, C: tl.constexpr, MK: tl.constexpr, NCHUNK: tl.constexpr,
                   CACHING: tl.constexpr, BLOCK: tl.constexpr):
    # (the sizes come as separate constexprs: fields unpacked from a constexpr tuple are not constexpr)
    ctrl, ring, qslot, ref_cnt, num_keys = ps.ctrl, ps.ring, ps.qslot, ps.ref_cnt, ps.num_keys
    hash_ntok, keys, table, overflow = ps.hash_ntok, ps.keys, ps.table, ps.overflow
    offs = tl.arange(0, BLOCK)
    head = tl.load(ctrl + HEAD)
    tail = tl.load(ctrl + TAIL)
    code = tl.zeros([], tl.int32)
    val = tl.zeros([], tl.int64)
    win = tail - head
    code = tl.where((win < 0) | (win > C), V_WINDOW, code)
    val = tl.where(code == V_WINDOW, win, val)
    live = tl.zeros([], tl.int64)
    if code == 0:
        p = head
        while p < tail:
            pos = p + offs
            inw = pos < tail
            s = (pos & (C - 1)).to(tl.int32)
            v = tl.load(ring + s, mask=inw, other=-1)
            used = inw & (v != -1)
            okv = (v > 0) & (v < N)
            q = tl.load(qslot + v, mask=used & okv, other=-1)
            code, val = _note(code, val, used & (~okv | (q != s)), s, V_RING_SLOT)
            live += tl.sum(used.to(tl.int64), axis=0)
            p += BLOCK
        nf = tl.load(ctrl + NUM_FREE)
        code = tl.where((code == 0) & (live != nf), V_NUM_FREE, code)
        val = tl.where(code == V_NUM_FREE, nf, val)
    null_bad = (tl.load(qslot) != -1) | (tl.load(num_keys) != 0)
    code = tl.where((code == 0) & null_bad, V_NULL, code)
    total_keys = tl.zeros([], tl.int64)
    i = 0
    while i < N:
        b = i + offs
        m = (b < N) & (b > 0)
        ref = tl.load(ref_cnt + b, mask=m, other=0)
        q = tl.load(qslot + b, mask=m, other=-1)
        code, val = _note(code, val, m & (ref < 0), b, V_REF_NEG)
        code, val = _note(code, val, m & ((q != -1) != (ref == 0)), b, V_QUEUED_IFF_FREE)
        inq = m & (q != -1)
        back = tl.load(ring + q, mask=inq, other=-1)
        inwin = ((q.to(tl.int64) - head) & (C - 1)) < win
        code, val = _note(code, val, inq & ((back != b) | ~inwin | (q < 0) | (q >= C)), b, V_QSLOT)
        nk = tl.load(num_keys + b, mask=m, other=0)
        code, val = _note(code, val, m & ((nk < 0) | (nk > MK)), b, V_NUM_KEYS)
        if not CACHING:
            code, val = _note(code, val, m & (nk != 0), b, V_CACHING_OFF)
        ntok = tl.load(hash_ntok + b, mask=m, other=-1)
        code, val = _note(code, val, m & ((nk > 0) != (ntok >= 0)), b, V_NTOK)
        total_keys += tl.sum(tl.where(m, nk, 0).to(tl.int64), axis=0)
        for j in tl.static_range(MK):
            has = m & (j < nk)
            e = b.to(tl.int64) * MK + j
            hi = tl.load(keys + e * KW + K_HI, mask=has, other=0)
            lo = tl.load(keys + e * KW + K_LO, mask=has, other=0)
            grp = tl.load(keys + e * KW + K_GROUP, mask=has, other=0)
            slot = tl.load(keys + e * KW + K_SLOT, mask=has, other=0)
            slot_ok = (slot >= 0) & (slot < NCHUNK * CHUNK)
            w = tl.load(table + slot, mask=has & slot_ok, other=0)
            good = slot_ok & ((w & 0xFFFFFFFF) == e + 1) & ((w >> 32) == key_tag(hi))
            code, val = _note(code, val, has & ~good, b, V_KEY_SLOT)
            for j2 in tl.static_range(MK):
                if j2 < j:
                    e2 = b.to(tl.int64) * MK + j2
                    same = (tl.load(keys + e2 * KW + K_HI, mask=has, other=1) == hi) & \
                        (tl.load(keys + e2 * KW + K_LO, mask=has, other=1) == lo) & \
                        (tl.load(keys + e2 * KW + K_GROUP, mask=has, other=1) == grp)
                    code, val = _note(code, val, has & same, b, V_DUP_KEY)
            # Expected overflow: every chunk from the key's home up to (not incl.) its slot's chunk.
            home = key_home(lo, grp, NCHUNK)
            dist = tl.where(has & good, ((slot // CHUNK).to(tl.int32) - home) & (NCHUNK - 1), 0)
            d = 0
            while d < tl.max(dist, axis=0):
                tl.atomic_add(s_ovf + ((home + d) & (NCHUNK - 1)), 1, mask=d < dist)
                d += 1
        i += BLOCK
    tl.debug_barrier()
    used_words = tl.zeros([], tl.int64)
    i = 0
    while i < NCHUNK * CHUNK:
        idx = i + offs
        used_words += tl.sum((tl.load(table + idx, mask=idx < NCHUNK * CHUNK, other=0) != 0).to(tl.int64), axis=0)
        i += BLOCK
    bad_count = used_words != total_keys
    code = tl.where((code == 0) & bad_count, V_TABLE_COUNT, code)
    val = tl.where(code == V_TABLE_COUNT, used_words, val)
    i = 0
    while i < NCHUNK:
        c = i + offs
        m = c < NCHUNK
        code, val = _note(code, val, m & (tl.load(overflow + c, mask=m, other=0) != tl.load(s_ovf + c, mask=m, other=0)),
                          c, V_OVERFLOW)
        tl.store(s_ovf + c, tl.zeros([BLOCK], tl.int32), mask=m)
        i += BLOCK
    tl.store(out, code.to(tl.int64))
    tl.store(out + 1, val)


def launch_validate(ps, pc, s_ovf, out):
    validate_kernel[(1,)](ps, pc, s_ovf, out, num_warps=warps_for(pc.BLOCK))
