"""``DeferredBlockPool``'s batch order (free, touch, pop, cache; docs/vllm.md "The fast path")
against the per-call adapter, on op mixes aimed at the batch: pops then touches of prefix hits, frees
of shared blocks (ref > 1, by a request sharing another's blocks), frees of blocks touched in the same
batch (a hit freed at once), single-block frees (sliding window: the block replaced by the null
block), cachings of fresh placeholders and later ranges, copy-on-write ``ref_cnt += 1``, evictions,
and reads of ref counts, hashes and ids in between. Every answer read while running, every id handed
out, and the whole state at the end (mirror, device ref counts and free queue) are equal.

Cheap by default; the slow variant runs more examples over two pool sizes (60 in CI, 1,000 with
``GPUPOOL_HYPOTHESIS_PROFILE=deep``).
"""
from harness.paths import CONFORMANCE
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import BATCH_OPS, BS, run_ops  # noqa: E402

def _check(ops, n):
    per_call = BlockPool(n, True, BS, device="cpu")
    deferred = DeferredBlockPool(n, True, BS, device="cpu")
    assert run_ops(per_call, ops) == run_ops(deferred, ops)
    deferred.sync()
    assert driver.snapshot(per_call) == driver.snapshot(deferred)  # ref counts, keys, queue order, key map
    assert (deferred._ref, deferred._keys, deferred._ntok) == (per_call._ref, per_call._keys, per_call._ntok)
    deferred.device_pool.validate()
    assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
    assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()


@settings(max_examples=10, deadline=None)
@given(ops=st.lists(BATCH_OPS, min_size=4, max_size=24))
@pytest.mark.heavy
def test_batch_order_equals_call_order(ops):
    _check(ops, 12)


@pytest.mark.slow  # 60 examples in CI (about 30 s); the deep profile runs 1,000
@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(BATCH_OPS, min_size=4, max_size=32), n=st.sampled_from([6, 24]))
def test_batch_order_equals_call_order_many(ops, n):
    _check(ops, n)
