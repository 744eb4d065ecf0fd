"""The one whole-state comparison of a reference and a device pool (or manager, or replay), and the
consistency checks of one pool on its own.

Whole state (docs/semantics.md sections 1-4): free-queue order, ref counts, every block's keys and
``hash_num_tokens``, ``num_free``, the number of watchers, the KV events (drained), the reuse-watcher
firings, and, unless ``full=False``, ``validate()`` of both, ``get_usage()`` and a lookup of every
hash asked for; for managers also the block tables, the per-request counters, the pending copies and
the reservations (section 8). A failed assertion's message names the field, both values and
``where`` (the caller's op log).
"""
from __future__ import annotations

from collections.abc import Iterable

import pytest

from harness.state import MANAGER_FIELDS, ints, manager_state, pool_state

BIG = 2**31 - 1  # s_first's idle value


# ---- one pool --------------------------------------------------------------------------------------

def assert_consistent(pool) -> None:
    """``validate()`` plus the cheap section 1 checks anyone can make from outside."""
    pool.validate()
    st = pool_state(pool)
    q, refs = st["free_queue"], st["ref_counts"]
    assert st["num_free"] == len(q)
    assert len(set(q)) == len(q)
    assert 0 not in q
    assert all(r >= 0 for r in refs)
    assert set(q) == {b for b in range(1, len(refs)) if refs[b] == 0}
    assert st["blocks"][0] == ([], None)


def host_check_layout(pool) -> None:
    """An independent host-side check of the device layout (docs/algorithms.md sections 1 and 4), read
    from the tensors: ring R1-R5, key rows against table words, overflow counts along every probe
    path, the kernels' scratch back at its idle values, the status word clear and the event /
    reuse buffers drained (the caller has called an inspection method first)."""
    from gpupool.kernels.layout import Ctrl

    s = pool.state
    n, mk, c, nch = pool.num_blocks, pool.max_keys_per_block, pool.config.C, pool.config.NCHUNK
    ctrl = s.ctrl.tolist()
    head, tail, num_free = ctrl[Ctrl.HEAD], ctrl[Ctrl.TAIL], ctrl[2]
    assert s.status.tolist()[0] == 0, "status word left set"
    assert ctrl[4] == 0 and ctrl[5] == 0, f"event / reuse counts not drained: {ctrl[4]}, {ctrl[5]}"
    ring, qslot, ref = s.ring.tolist(), s.qslot.tolist(), s.ref_cnt.tolist()
    assert 0 <= tail - head <= c, f"R1: window [{head}, {tail}) vs capacity {c}"
    live = 0
    for p in range(head, tail):
        v = ring[p & (c - 1)]
        if v == -1:
            continue
        assert 0 < v < n and qslot[v] == (p & (c - 1)), f"R2: slot {p & (c - 1)} holds {v}"
        live += 1
    assert live == num_free, f"R4: num_free {num_free} != live slots {live}"
    assert qslot[0] == -1
    for b in range(1, n):
        assert ref[b] >= 0
        assert (qslot[b] != -1) == (ref[b] == 0), f"R3: block {b} qslot {qslot[b]} ref {ref[b]}"
        if qslot[b] != -1:
            assert ((qslot[b] - head) & (c - 1)) < tail - head, f"R5: block {b} slot outside the window"
    assert s.s_cnt.tolist() == [0] * n, "scratch s_cnt not reset"
    assert s.s_last.tolist() == [-1] * n, "scratch s_last not reset"
    assert s.s_first.tolist() == [BIG] * n, "scratch s_first not reset"
    nk, ntok = s.num_keys.tolist(), s.hash_ntok.tolist()
    keys, table, overflow = s.keys.tolist(), s.table.tolist(), s.overflow.tolist()
    assert nk[0] == 0
    seen = set()
    expect_overflow = [0] * nch
    for b in range(n):
        assert 0 <= nk[b] <= mk
        assert (nk[b] > 0) == (ntok[b] >= 0), f"block {b}: {nk[b]} keys, hash_num_tokens {ntok[b]}"
        for j in range(nk[b]):
            hi, lo, grp, _seq, slot = keys[b * mk + j]
            e = b * mk + j
            assert 0 <= slot < nch * 16 and table[slot] & 0xFFFFFFFF == e + 1, f"block {b} key {j}: slot {slot}"
            assert table[slot] >> 32 == (hi >> 32) & 0x7FFFFFFF, f"block {b} key {j}: tag"
            seen.add(slot)
            home = (lo ^ (grp * 0x9E3779B1)) & (nch - 1)
            for d in range(((slot // 16) - home) & (nch - 1)):
                expect_overflow[(home + d) & (nch - 1)] += 1
    occupied = sum(1 for w in table[: nch * 16] if w != 0)
    assert occupied == len(seen), f"table holds {occupied} words, key rows {len(seen)}"
    assert overflow == expect_overflow, f"overflow counts {overflow} != probe paths {expect_overflow}"


# ---- a reference and a device pool ---------------------------------------------------------------

def assert_lookups_agree(ref, dev, hashes: Iterable[bytes], where: str = "") -> None:
    """``lookup_batched`` on the device pool of every hash in groups 0 and 1 equals the reference's
    ``get_cached_block`` (-1 for a miss)."""
    import torch

    from gpupool.keys import device_key
    keys = [(hh, g) for hh in sorted(hashes) for g in (0, 1)]
    dk = [device_key(hh, g) for hh, g in keys]
    t64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev.device)  # noqa: E731
    got = ints(dev.lookup_batched(t64([k[0] for k in dk]), t64([k[1] for k in dk]),
                                  torch.tensor([g for _, g in keys], dtype=torch.int32, device=dev.device)))
    want = []
    for hh, g in keys:
        r = ref.get_cached_block(hh, [g])
        want.append(-1 if r is None else r[0])
    assert got == want, f"lookups differ: device {got} != reference {want}; {where}"


def assert_pools_agree(ref, dev, fired: dict | None = None, where: str = "", *, full: bool = True,
                       dev_validate: bool = True, layout: bool = False, used: Iterable[bytes] | None = None,
                       events: list | None = None) -> list:
    """The whole state of ``ref`` (a reference pool) and ``dev`` (a device pool, or a second reference)
    is equal: ``pool_state`` field by field, the drained events (``events``: the reference's, already
    drained, e.g. when one reference is compared with several devices) and, given ``fired``
    (``{"ref": [...], "dev": [...]}``), the watcher firings. With ``full``: ``validate()`` of the
    reference, :func:`host_check_layout` of the device (``layout``), the device's ``validate()``
    (``dev_validate``), ``get_usage()``, and the lookups of every hash in ``used``.
    Returns the reference's drained events."""
    rs, ds = pool_state(ref), pool_state(dev)
    for k in rs:
        assert ds[k] == rs[k], f"{k} differs: device {ds[k]} != reference {rs[k]}; {where}"
    rev = ref.take_events() if events is None else events
    dev_ev = dev.take_events()
    assert dev_ev == rev, f"events differ:\n device    {dev_ev}\n reference {rev}\n{where}"
    if fired is not None:
        assert fired["dev"] == fired["ref"], (
            f"watcher firings differ: device {fired['dev']} != reference {fired['ref']}; {where}")
    if full:
        ref.validate()
        if layout:
            host_check_layout(dev)
        if dev_validate:
            dev.validate()
        assert dev.get_usage() == pytest.approx(ref.get_usage()), where
        if used:
            assert_lookups_agree(ref, dev, used, where)
    return rev


# ---- a reference and device managers ---------------------------------------------------------------

def assert_managers_agree(ref, *devs, where: str = "", full: bool = True) -> list:
    """Each device manager in ``devs`` has the reference manager's whole state: block tables, counters,
    pending copies, reservations (:data:`harness.state.MANAGER_FIELDS`), then its pool's
    (:func:`assert_pools_agree`: the pool state, the events, with ``full`` ``validate()`` of both pools
    and usage). Returns the reference pool's drained events."""
    rs = manager_state(ref)
    rev = ref.pool.take_events()
    for dev in devs:
        ds = manager_state(dev)
        for k in MANAGER_FIELDS:
            assert ds[k] == rs[k], f"{k} differs: device {ds[k]} != reference {rs[k]}; {where}"
        assert_pools_agree(ref.pool, dev.pool, where=where, full=full, events=rev)
    return rev


# ---- replays -------------------------------------------------------------------------------------------

REPLAY_FIELDS = ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256", "waited",
                 "peak_blocks_in_use", "time_points")


def assert_replays_agree(ref, dev) -> None:
    """Two replay reports (gpupool.replay, docs/semantics.md section 5) agree on every counted field,
    the final free queue's digest included."""
    for f in REPLAY_FIELDS:
        assert getattr(ref, f) == getattr(dev, f), f"{f}: device {getattr(dev, f)!r} != reference {getattr(ref, f)!r}"
