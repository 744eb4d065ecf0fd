"""Issue #11 (reliability), pool level: each defect's reproduction from the issue, as a test.

1. host memory O(live keys) (the key registry), 2. device inputs bounds-checked
(``longest_prefix_batched``), 4. counters that grow are int64, 5. threads, 6. typed errors,
7. event buffer sizing, and vLLM's ``BlockStored`` stream (docs/semantics.md section 2). The manager and
decode-step items are in ``tests/test_reliability_manager.py``; the soak of distinct keys is
:func:`test_distinct_keys_soak_host_memory_flat` below (``@slow``; ``GPUPOOL_KEY_SOAK=<n>`` keys).
"""
from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import gpupool.registry as registry_mod
from gpupool import BlockPool, ReferenceBlockPool
from gpupool.errors import ArgumentTypeError, BufferFullError, InvalidArgumentError, PoolError
from gpupool.events import BlockStored
from gpupool.kernels.layout import Ctrl
from harness.compare import assert_consistent
from harness.keys import h
from harness.ops import run_in_threads
from harness.state import pool_state

POOLS = [ReferenceBlockPool, BlockPool]
POOL_IDS = ["reference", "device"]


def i32(v):
    return torch.tensor(v, dtype=torch.int32)


# ---- 1. host memory grows with every key ever cached -----------------------------------------

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


# ---- 2. device inputs used without bounds checks -----------------------------------------------

def test_longest_prefix_length_past_its_array():
    """The issue's repro: a length past the chain (100000 for L = 2) reads nothing past the buffers and
    records a typed error; the pool is unchanged."""
    p = BlockPool(16)
    before = pool_state(p)
    k = torch.zeros((2, 1, 2), dtype=torch.int64)
    hits, blocks, zero_ref = p.longest_prefix_batched(k, k, i32([0]), i32([0, 100000]))
    with pytest.raises(InvalidArgumentError):
        p.check()
    assert hits.tolist() == [0, 0] and zero_ref.tolist() == [0, 0]
    assert pool_state(p) == before
    for bad in (-1, 3, -(2**31)):
        p.longest_prefix_batched(k, k, i32([0]), i32([bad, 1]))
        with pytest.raises(InvalidArgumentError):
            p.check()
    assert pool_state(p) == before
    assert_consistent(p)


def test_longest_prefix_group_ids_out_of_range():
    """A group id read from the device that no pool accepts finds nothing (no crash)."""
    p = BlockPool(16)
    b = p.get_new_blocks(1)
    p.cache_full_blocks(b, [h(1)], 0, 1, 16, 0)
    from gpupool.keys import device_key
    hi, lo = device_key(h(1), 0)
    kh = torch.tensor([[[hi]]], dtype=torch.int64)
    kl = torch.tensor([[[lo]]], dtype=torch.int64)
    before = pool_state(p)
    for g in (-1, 2**31 - 1, -(2**31)):
        hits, _, _ = p.longest_prefix_batched(kh, kl, i32([g]), i32([1]))
        try:
            p.check()
        except PoolError:
            pass
        assert hits.tolist() == [0]
    assert pool_state(p) == before


# ---- 4. counters that overflow ---------------------------------------------------------------

def test_event_rows_past_int32_key_sequence():
    """Key sequence numbers are int64: past 2**31 BlockStored still carries parent, block size and
    group, and lookups still return the earliest-inserted block."""
    p = BlockPool(16, enable_kv_cache_events=True)
    p.state.ctrl[Ctrl.KEY_SEQ] = 2**31 - 2
    b = p.get_new_blocks(4).tolist()
    p.cache_full_blocks(b, [h(1), h(2), h(3), h(4)], 0, 4, 16, 1)
    ev = p.take_events()
    assert ev[0] == BlockStored((h(1), h(2), h(3), h(4)), None, 16, 1)
    assert int(p.state.ctrl[Ctrl.KEY_SEQ]) >= 2**31 + 2
    c = p.get_new_blocks(1).tolist()
    p.cache_full_blocks([b[0]] + c, [h(1), h(2)], 1, 2, 16, 1)  # a second holder of h(2), later
    assert p.take_events()[0] == BlockStored((h(2),), h(1), 16, 1)
    assert p.get_cached_block(h(2), [1]) == [b[1]]  # earliest inserted
    assert_consistent(p)


@pytest.mark.slow
def test_unpin_many_watchers():
    """Watchers are flags, not counted ids: many unpin calls keep working."""
    p = BlockPool(4)
    fired = []
    for _ in range(50):
        b = p.get_new_blocks(1)
        p.unpin_blocks(b, fired.append)
    assert p.num_watchers() <= 3
    assert_consistent(p)


# ---- 5. threads ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_two_threads_share_a_pool(cls):
    """A scheduler thread (allocate / cache / free) and a transfer thread (lookups, touch / free of
    hits) on one pool: every op serialises; the pool validates and nothing leaks."""
    p = cls(24)
    errors = []
    ops = 25 if cls is BlockPool else 300

    def scheduler():
        try:
            for i in range(ops):
                b = p.get_new_blocks(2)
                p.cache_full_blocks(b, [h(i % 7), h(100 + i % 5)], 0, 2, 16, 0)
                p.free_blocks(list(reversed([int(x) for x in b])))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def transfer():
        try:
            for i in range(ops):
                got = p.get_cached_block(h(i % 7), [0])
                if got is not None:
                    try:
                        p.touch(got)
                    except PoolError:
                        continue
                    p.free_blocks(got)
                p.get_num_free_blocks()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    run_in_threads(errors, scheduler, transfer)
    assert_consistent(p)
    assert p.get_num_free_blocks() == 23


# ---- 6. typed errors everywhere -----------------------------------------------------------------

@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_typed_errors_for_bad_python_arguments(cls):
    p = cls(8)
    b = [int(x) for x in p.get_new_blocks(2)]
    before = pool_state(p)
    cases = [
        lambda: p.cache_full_blocks(b, None, 0, 2, 16, 0),
        lambda: p.cache_full_blocks(b, [h(1), None], 0, 2, 16, 0),
        lambda: p.get_cached_block(h(1), None),
        lambda: p.get_cached_block(h(1), 0),
        lambda: p.get_cached_block(None, [0]),
        lambda: p.get_new_blocks(None),
        lambda: p.get_new_blocks(1.5),
        lambda: p.free_blocks(None),
        lambda: p.touch([None]),
        lambda: p.cache_partial_block(b[0], None, 16, 0, 16, 16),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, (TypeError, ValueError)), (i, info.value)
        assert isinstance(info.value, ArgumentTypeError) or not isinstance(info.value, TypeError), i
    assert pool_state(p) == before


def test_both_pools_accept_int64_id_tensors():
    ref, dev = ReferenceBlockPool(8), BlockPool(8)
    for p in (ref, dev):
        b = p.get_new_blocks(3)
        ids = torch.tensor([int(x) for x in b], dtype=torch.int64)
        p.touch(ids)
        p.free_blocks(ids)
        p.cache_full_blocks(ids, [h(1), h(2), h(3)], 0, 3, 16, 0)
        p.free_blocks(torch.flip(ids, [0]))
        p.evict_blocks(ids[:1])
    assert pool_state(ref) == pool_state(dev)


# ---- 7. memory sizing -------------------------------------------------------------------------------

def test_event_capacity_argument_and_overflow():
    """Event rows are a constructor argument (not sized for the worst op); a batched op that could
    overflow them records BufferFullError and changes nothing."""
    small, big = BlockPool(64, enable_kv_cache_events=True), BlockPool(4096, enable_kv_cache_events=True)
    assert small.metadata_bytes()["buffers"] == big.metadata_bytes()["buffers"]  # not O(worst op per block)
    assert BlockPool(64, enable_kv_cache_events=True, event_capacity=4).metadata_bytes()["buffers"] == 4 * 6 * 8
    p = BlockPool(16, enable_kv_cache_events=True, event_capacity=5)
    b = p.get_new_blocks(6).tolist()
    p.cache_full_blocks(b[:3], [h(i) for i in range(3)], 0, 3, 16, 0)  # 4 rows each
    p.take_events()
    p.cache_full_blocks(b[3:], [h(i) for i in range(3, 6)], 0, 3, 16, 0)
    p.take_events()
    p.free_blocks(b)
    p.get_new_blocks(15 - 6)  # leave only the six keyed blocks free
    before = pool_state(p)
    p.allocate_batched(i32([6]))  # evicting 6 keys needs 6 rows > 5
    with pytest.raises(BufferFullError):
        p.check()
    assert pool_state(p) == before
    assert p.take_events() == []
    with pytest.raises(InvalidArgumentError):
        BlockPool(4, enable_kv_cache_events=True, event_capacity=0)


# ---- vLLM's event stream (docs/semantics.md section 2) -----------------------------------------------------

@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_partial_block_stored_reports_hash_block_size(cls):
    p = cls(4, enable_kv_cache_events=True)
    b = int(p.get_new_blocks(1)[0])
    p.take_events()
    p.cache_partial_block(b, [b"h0" * 16, b"h1" * 16], num_tokens=8, group_id=0, block_size=12, hash_block_size=4)
    assert p.take_events() == [BlockStored((b"h1" * 16,), b"h0" * 16, 4, 0)]


@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_cache_full_blocks_of_null_or_masked_blocks_emits_empty_stored(cls):
    p = cls(4, enable_kv_cache_events=True)
    p.cache_full_blocks([0, 0], [h(0), h(1)], 0, 2, 4, 0)
    assert p.take_events() == [BlockStored((), None, 4, 0)]
    b = [int(x) for x in p.get_new_blocks(2)]
    p.take_events()
    p.cache_full_blocks(b, [h(0), h(1)], 1, 2, 4, 1, block_mask=[False])
    assert p.take_events() == [BlockStored((), h(0), 4, 1)]
    assert p.get_cached_block(h(1), [1]) is None


# ---- Done when: distinct keys through a small device pool, host memory flat ------------------------

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


def test_empty_count_tensors_are_refused():
    """A device count must have its one entry (the kernel reads ``count[0]``)."""
    p = BlockPool(8)
    empty = torch.zeros(0, dtype=torch.int32)
    before = pool_state(p)
    for fn in (lambda: p.allocate_batched(i32([1]), empty), lambda: p.free_batched(i32([1]), i32([0, 1]), empty),
               lambda: p.touch_batched(i32([1]), empty),
               lambda: p.lookup_batched(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                        i32([0]), empty)):
        with pytest.raises(InvalidArgumentError):
            fn()
    p.check()
    assert pool_state(p) == before


def test_unchecked_copy_blocks_never_touches_memory_outside_the_caches():
    """``copy_blocks(check=False)`` (the captured step's path) skips a pair with an id outside the
    caches instead of reading or writing past them; the valid pairs are copied."""
    from gpupool.kernels.copy_blocks import copy_blocks

    big = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    layer, guard = big[:4], big[4:].clone()
    src, dst = i32([1, 2, -1, 3]), i32([6, 3, 0, 0])  # 1 -> 6 and -1 -> 0: out of range; 3 -> 0 valid
    want = layer.clone()
    want[0] = layer[3]
    copy_blocks([layer], src[[0, 2, 3]].contiguous(), dst[[0, 2, 3]].contiguous(), check=False)
    assert torch.equal(big[4:], guard)
    assert torch.equal(layer, want)
    copy_blocks([layer], i32([2**31 - 1]), i32([1]), num_copies=i32([1]), check=False)
    assert torch.equal(big[4:], guard) and torch.equal(layer, want)


@pytest.mark.parametrize("cls", [ReferenceBlockPool, BlockPool])
def test_pool_size_is_bounded_by_int32_ids(cls):
    """Block ids are int32 on the device: both pools refuse more than 2**31 - 1 blocks before
    allocating anything (a typed error, not a MemoryError or an overflow later)."""
    for n in (2**31, 10**11, 0, -1):
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            cls(n)
    with pytest.raises(ArgumentTypeError):
        cls(16.0)
