"""The fast path answers as the per-call pool under hard op lists: the per-call ``BlockPool`` and
``DeferredBlockPool`` on random op lists (test_batch_order.py's plus ``end_step``, ``sync``, free-queue
reads, a block freed twice at ref 2, touches of arbitrary blocks, resets) with the host's copy of the
free queue cut to a few ring slots, on tiny pools, at any launch cadence, over both backends; every
answer read, every id and the final state equal (a PoolError raised by both counts as an equal
answer). 100 examples over the reference backend and up to 10 per device test."""
from harness.paths import CONFORMANCE
import sys
from unittest import mock

import pytest

from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402

BS = driver.BLOCK_SIZE
EXTRA = st.one_of(
    st.tuples(st.just("end_step")), st.tuples(st.just("sync")), st.tuples(st.just("queue")),
    st.tuples(st.just("dup"), O.R),  # cow then free listing the block twice
    st.tuples(st.just("touchfree"), st.integers(0, 40)),  # touch of an arbitrary (maybe free) block
)
OPS = st.one_of(O.BATCH_OPS, EXTRA)


def _apply(pool, op, reqs, seen):
    kind = op[0]
    if kind == "end_step":
        pool.end_step()
    elif kind == "sync":
        if hasattr(pool, "sync"):
            pool.sync()
    elif kind == "queue":
        seen.append([b.block_id for b in pool.free_block_queue.get_all_free_blocks()])
    elif kind == "dup" and reqs:
        r = reqs.pop(op[1] % len(reqs))
        held = [b for b in r["blocks"] if not b.is_null]
        if held:
            held[0].ref_cnt += 1
        pool.free_blocks(held[:1] + list(reversed(r["blocks"])) + r["extra"])
    elif kind == "touchfree":
        b = pool.blocks[op[1] % pool.num_gpu_blocks]
        if not b.is_null:
            pool.touch([b])
            reqs.append({"req": driver.request([]), "blocks": [b], "cached": 1, "extra": []})
    else:
        O.apply_op(pool, op, reqs, seen)
        return
    seen.append(pool.get_num_free_blocks())


_apply_base = _apply


def _run(pool, ops):
    reqs, seen = [], []
    for op in ops:
        try:
            globals()["_apply"](pool, op, reqs, seen)
        except PoolError as e:  # e.g. a shared request caching a block already cached: must match
            seen.append(type(e).__name__)
    return [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s
            for s in seen]


def check(ops, n, window, backend="device", caching=True, launch=(4, 1024), events=False):
    """``launch``: the fast path's (``launch_every``, ``launch_ops``); ``events``: KV events and a
    metrics collector on (their bytes and calls compared too)."""
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    if events:
        kw.update(enable_kv_cache_events=True)
    with mock.patch.object(fast_path, "FREE_WINDOW", window), \
            mock.patch.multiple(DeferredBlockPool, launch_every=launch[0], launch_ops=launch[1]):
        mc = (lambda: driver.MetricsLog()) if events else (lambda: None)
        per_call = BlockPool(n, caching, BS, metrics_collector=mc(), **kw)
        deferred = DeferredBlockPool(n, caching, BS, metrics_collector=mc(), **kw)
        assert _run(per_call, ops) == _run(deferred, ops)
        deferred.sync()
        assert driver.snapshot(per_call, wire=events) == driver.snapshot(deferred, wire=events)
        assert (deferred._ref, deferred._keys, deferred._ntok) == (per_call._ref, per_call._keys, per_call._ntok)
        if backend == "device":
            assert deferred.mirror.holders == per_call.mirror.holders  # the device's insertion seqs, predicted
            deferred.device_pool.validate()
            assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
            assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()


@settings(max_examples=max(100, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=30), n=st.sampled_from([2, 3, 4, 6, 10]),
       window=st.sampled_from([1, 2, 3, 4, 8]), caching=st.booleans())
def test_reference_small_window(ops, n, window, caching):
    check(ops, n, window, "reference", caching)


@settings(max_examples=min(10, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=24), n=st.sampled_from([3, 6, 12]),
       window=st.sampled_from([1, 2, 3, 5]))
@pytest.mark.heavy
def test_device_small_window(ops, n, window):
    check(ops, n, window, "device")


BIG = st.tuples(st.just("alloc"), st.integers(2, 6), O.SEED, st.integers(0, 6))
OPS2 = st.one_of(BIG, BIG, O.BATCH_OPS, EXTRA, st.tuples(st.just("end_step")))


@settings(max_examples=min(10, settings().max_examples), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS2, min_size=6, max_size=30), n=st.sampled_from([4, 8, 12]),
       window=st.sampled_from([1, 2, 3, 4]))
@pytest.mark.heavy
def test_device_small_window_big_pops(ops, n, window):
    check(ops, n, window, "device")


OPS3 = st.one_of(BIG, O.BATCH_OPS, EXTRA, st.tuples(st.just("reset")))


def _apply3(pool, op, reqs, seen):
    if op[0] == "reset":
        seen.append(pool.reset_prefix_cache())
        seen.append(pool.get_num_free_blocks())
    else:
        _apply_base(pool, op, reqs, seen)


@settings(max_examples=min(10, settings().max_examples), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS3, min_size=6, max_size=30), n=st.sampled_from([2, 3, 5, 9]),
       window=st.sampled_from([1, 2, 3, 2048]), caching=st.booleans())
@pytest.mark.heavy
def test_device_reset_tiny_pools(ops, n, window, caching):
    with mock.patch(__name__ + "._apply", _apply3):
        check(ops, n, window, "device", caching)


LAUNCH = st.tuples(st.sampled_from([1, 2, 4, 7]), st.sampled_from([1, 2, 5, 1024]))  # launch_every, launch_ops
OPS4 = st.one_of(OPS, BIG, st.tuples(st.just("end_step")))


@settings(max_examples=max(100, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS4, min_size=4, max_size=30), n=st.sampled_from([3, 6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=LAUNCH, caching=st.booleans(), events=st.booleans())
def test_reference_launch_cadence(ops, n, window, launch, caching, events):
    """Batches spanning several steps (``launch_every``) or cut by ``launch_ops``, events on or off."""
    check(ops, n, window, "reference", caching, launch, events)


@settings(max_examples=min(3, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS4, min_size=4, max_size=20), n=st.sampled_from([3, 6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=LAUNCH, caching=st.booleans(), events=st.booleans())
def test_device_launch_cadence(ops, n, window, launch, caching, events):
    check(ops, n, window, "device", caching, launch, events)


@pytest.mark.slow  # 60 examples (about 36 s)
@settings(max_examples=max(60, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS4, min_size=4, max_size=30), n=st.sampled_from([3, 6, 12]),
       window=st.sampled_from([1, 2, 3, 5, 2048]), launch=LAUNCH, caching=st.booleans(), events=st.booleans())
def test_device_launch_cadence_many(ops, n, window, launch, caching, events):
    check(ops, n, window, "device", caching, launch, events)
