"""Invariant checks of the device pool's state (SPEC.md section 1; DESIGN-NOTES.md sections 1 and 4).

Reads the tensors once (one host copy) and reports the first violation as an InvariantError.
"""
from __future__ import annotations

from .errors import InvariantError
from .kernels import common as _c

HEAD, TAIL, NUM_FREE = _c.HEAD.value, _c.TAIL.value, _c.NUM_FREE.value
EV_COUNT, REUSE_COUNT = _c.EV_COUNT.value, _c.REUSE_COUNT.value

_CHUNK = 16


def _fail(msg: str, value=None):
    raise InvariantError("validate", msg, value)


def validate_state(s, enable_caching: bool = True) -> None:
    n, mk, c, nch = s.num_blocks, s.max_keys_per_block, s.ring_capacity, s.num_chunks
    ctrl = s.ctrl.tolist()
    head, tail, num_free = ctrl[HEAD], ctrl[TAIL], ctrl[NUM_FREE]
    ring, qslot, ref = s.ring.tolist(), s.qslot.tolist(), s.ref_cnt.tolist()
    if not 0 <= tail - head <= c:
        _fail(f"ring window [{head}, {tail}) is outside 0..{c} slots (R1)", tail - head)
    live = 0
    for p in range(head, tail):
        v = ring[p & (c - 1)]
        if v == -1:
            continue
        if not 0 < v < n or qslot[v] != (p & (c - 1)):
            _fail(f"ring slot {p & (c - 1)} holds {v}, whose qslot is {qslot[v] if 0 <= v < n else '?'} (R2)", v)
        live += 1
    if live != num_free:
        _fail(f"num_free {num_free} != live ring slots {live} (R4)", num_free)
    if qslot[0] != -1:
        _fail("the null block is in the free queue", 0)
    for b in range(1, n):
        if ref[b] < 0:
            _fail(f"block {b} has ref_cnt {ref[b]} < 0", b)
        if (qslot[b] != -1) != (ref[b] == 0):
            _fail(f"block {b}: queued={qslot[b] != -1} but ref_cnt={ref[b]} (R3)", b)
        if qslot[b] != -1 and not 0 <= ((qslot[b] - head) & (c - 1)) < tail - head:
            _fail(f"block {b}'s slot {qslot[b]} is outside the live window (R5)", b)
    # Key rows against the table.
    nk, ntok = s.num_keys.tolist(), s.hash_ntok.tolist()
    keys, table, overflow = s.keys.tolist(), s.table.tolist(), s.overflow.tolist()
    if nk[0] != 0:
        _fail("the null block has keys", 0)
    seen_slots = {}
    expect_overflow = [0] * nch
    for b in range(n):
        if not 0 <= nk[b] <= mk:
            _fail(f"block {b} has {nk[b]} keys (max {mk})", b)
        if (nk[b] > 0) != (ntok[b] >= 0):
            _fail(f"block {b}: {nk[b]} keys but hash_num_tokens {ntok[b]}", b)
        if nk[b] and not enable_caching:
            _fail(f"block {b} has keys with caching disabled", b)
        rows = [tuple(keys[b * mk + j]) for j in range(nk[b])]
        if len({(r[0], r[1], r[2]) for r in rows}) != len(rows):
            _fail(f"block {b} has a duplicate key", b)
        for j, (hi, lo, grp, _seq, slot) in enumerate(rows):
            e = b * mk + j
            if not 0 <= slot < nch * _CHUNK or table[slot] & 0xFFFFFFFF != e + 1:
                _fail(f"block {b} key {j}: table slot {slot} does not point back to it", b)
            if (table[slot] >> 32) != ((hi >> 32) & 0x7FFFFFFF):
                _fail(f"block {b} key {j}: table tag mismatch", b)
            seen_slots[slot] = e
            home = (lo ^ (grp * 0x9E3779B1)) & (nch - 1)
            for d in range(((slot // _CHUNK) - home) & (nch - 1)):
                expect_overflow[(home + d) & (nch - 1)] += 1
    occupied = sum(1 for w in table[: nch * _CHUNK] if w != 0)
    if occupied != len(seen_slots):
        _fail(f"the table holds {occupied} entries but the key rows {len(seen_slots)}", occupied)
    if table[nch * _CHUNK] != 0:
        _fail("the table's CAS sink word was written", table[nch * _CHUNK])
    if overflow != expect_overflow:
        c0 = next(i for i in range(nch) if overflow[i] != expect_overflow[i])
        _fail(f"chunk {c0}: overflow count {overflow[c0]} != {expect_overflow[c0]} probe paths through it", c0)
