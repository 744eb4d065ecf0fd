"""The host key registry (gpupool/registry.py: a device key's full hash, for events and
``block_keys``) stays O(live keys), not O(keys ever cached): emptied by ``reset_prefix_cache``,
swept past twice its size at the last sweep with events on and off, for the pool and for the
manager's request hashes (README, "Threads and host memory"; docs/design.md, "Device state"). The soak of distinct keys is
:func:`test_distinct_keys_soak_host_memory_flat` (``@slow``; ``GPUPOOL_KEY_SOAK=<n>`` keys).
"""
from __future__ import annotations

import gc
import os
import time

import pytest

import gpupool.registry as registry_mod
from gpupool import BlockPool
from harness.compare import assert_consistent
from harness.keys import h
from harness.twins import small_manager


@pytest.mark.slow
def test_registry_empty_after_reset_prefix_cache():
    """The issue's repro (100 distinct keys here, 300 there: the registry sweeps only past
    ``MIN_SWEEP`` entries, so either count tests the reset alone): cached and freed, then reset: no
    entry left."""
    p = BlockPool(8)
    for i in range(100):
        b = p.get_new_blocks(1)
        p.cache_full_blocks(b, [h(i)], 0, 1, 16, 0)
        p.free_blocks(b)
    assert p.reset_prefix_cache()
    assert len(p.registry) == 0


@pytest.mark.slow
@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
def test_registry_bounded_by_live_keys(monkeypatch, events):
    """Without a reset: the registry stays O(live keys) (swept past twice its size at the last sweep),
    with KV events on or off; every live key is still named."""
    monkeypatch.setattr(registry_mod, "MIN_SWEEP", 16)
    p = BlockPool(8, enable_kv_cache_events=events)
    p.registry._sweep_at = 16
    peak = 0
    for i in range(60):
        b = p.get_new_blocks(1)
        p.cache_full_blocks(b, [h(i)], 0, 1, 16, 0)
        p.free_blocks(b)
        p.take_events()
        peak = max(peak, len(p.registry))
    assert peak <= 2 * 16 + 1, peak
    for b in range(1, 8):  # live keys still have their names
        p.block_keys(b)
    assert_consistent(p)


def test_manager_registry_bounded_by_live_keys(monkeypatch):
    monkeypatch.setattr(registry_mod, "MIN_SWEEP", 16)
    m = small_manager()
    m.pool.registry._sweep_at = 16
    peak = 0
    for i in range(40):
        m.add_request(i % 4, [h(1000 + 3 * i + j) for j in range(3)])  # never admitted
        if i % 4 == 3:
            m.free([0, 1, 2, 3])
        m.pool.check()
        peak = max(peak, len(m.pool.registry))
    assert peak <= 2 * 16 + 12, peak
    m.validate()


KEY_SOAK = int(os.environ.get("GPUPOOL_KEY_SOAK") or 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_distinct_keys_soak_host_memory_flat(monkeypatch):
    """Churn distinct keys through an 8-block device pool with KV events on (two new keys per round:
    get, cache, free, drain): the key registry, the count of live Python objects and the resident
    set stay flat. Default: as many
    rounds as fit in about 20 s of the interpreter, with the registry's sweep threshold lowered to 64
    so that it sweeps many times; ``GPUPOOL_KEY_SOAK=100000`` churns that many keys at the real
    threshold (``gpupool.registry.MIN_SWEEP``)."""
    if not KEY_SOAK:
        monkeypatch.setattr(registry_mod, "MIN_SWEEP", 64)
    floor = registry_mod.MIN_SWEEP
    p = BlockPool(8, enable_kv_cache_events=True, event_capacity=64)
    p.registry._sweep_at = floor
    rounds = KEY_SOAK // 2 if KEY_SOAK else 10**9
    budget_s = None if KEY_SOAK else 20.0
    every = 25 if not KEY_SOAK else 1000
    samples = []  # (round, registry entries, live Python objects, resident bytes)
    start = time.monotonic()
    i = 0
    while i < rounds:
        b = p.get_new_blocks(2)
        p.cache_full_blocks(b, [h(2 * i), h(2 * i + 1)], 0, 2, 16, 0)
        p.free_blocks(b)
        p.take_events()
        i += 1
        if i % every == 0:
            gc.collect()
            samples.append((i, len(p.registry), len(gc.get_objects()), rss_bytes()))
            if budget_s is not None and time.monotonic() - start > budget_s and 2 * i > 6 * floor:
                break  # the time is up and the registry has swept several times
    print(f"\n{2 * i} distinct keys in {time.monotonic() - start:.1f} s (sweep threshold {floor}); "
          f"(round, registry, objects, rss) samples: {samples[::max(1, len(samples) // 6)]}")
    assert 2 * i > 4 * floor, "too few keys to sweep the registry several times"
    assert max(s[1] for s in samples) <= 2 * floor + 2
    # flat: once the registry has swept (twice its threshold in keys), nothing grows per key
    settled = [s for s in samples if 2 * s[0] >= 2 * floor]
    assert len(settled) >= 2
    assert settled[-1][2] - min(s[2] for s in settled) <= 4 * floor + 200, samples  # live objects
    assert settled[-1][3] - min(s[3] for s in settled) < 64 * 2**20, samples  # resident set (loose)
    assert_consistent(p)

