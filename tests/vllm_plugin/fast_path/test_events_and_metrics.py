"""KV events and KV cache metrics on the fast path (``gpupool.vllm.fast_path.DeferredBlockPool``,
docs/algorithms.md section 8, "Events and metrics"): made on the host, equal to the per-call pool's
and to vLLM 0.33's own ``BlockPool``'s.

* random op lists (tests/vllm_plugin/conformance/driver.py's ops) with NO read in between: the event
  stream (vLLM's fields and the msgpack bytes on vLLM's wire) and the metrics collector's calls, op by
  op, equal the per-call adapter's, over the reference backend (many lists, also with the host's copy
  of the free queue cut to a few slots) and the device pool (few lists); the fast path really ran
  (its device pool records no events, pops were predicted);
* slow: the same lists on vLLM 0.33's own BlockPool (its released source, in a subprocess) give the
  same trace, events byte for byte and the metrics calls included, and so does vLLM's scheduler;
* the checks can fail: a BlockRemoved dropped or two events swapped is caught."""
from harness.paths import CONFORMANCE, VLLM_PLUGIN
import json
import sys
from collections import Counter
from unittest import mock

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402
from gpupool.vllm.host_events import HostEvents  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
sys.path.insert(0, str(VLLM_PLUGIN))  # test_vllm_conformance's vllm_tree
import driver  # noqa: E402
from harness.vllm_ops import DRIVER_OPS as OPS, N, driver_trace, scheduler_runs  # noqa: E402

BS = driver.BLOCK_SIZE


def observed_run(pool, ops) -> list:
    """Apply ``ops`` reading only what vLLM's scheduler reads while deciding (no snapshot: nothing that
    synchronises the fast path); per op its events (vLLM's fields and wire bytes) and metrics calls."""
    reqs, out = [], []
    for op in ops:
        driver._apply(pool, op, reqs, N, ids=False)
        ev = pool.take_events()
        out.append({"op": list(op), "events": [driver._event(e) for e in ev], "wire": [driver.encode(e) for e in ev],
                    "metrics": pool.metrics_collector.take()})
    return out


def _pools(caching, backend):
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    return [cls(N, caching, BS, enable_kv_cache_events=True, metrics_collector=driver.MetricsLog(), **kw)
            for cls in (BlockPool, DeferredBlockPool)]


def _check_same(ops, caching, backend):
    per_call, deferred = _pools(caching, backend)
    assert deferred.deferred and isinstance(deferred._engine.events, HostEvents) and not deferred.device_pool.enable_kv_cache_events
    got, want = observed_run(deferred, ops), observed_run(per_call, ops)
    assert got == want, "the events or metrics calls differ"
    deferred.sync()
    assert driver.snapshot(per_call) == driver.snapshot(deferred)
    return deferred, got


@settings(max_examples=max(80, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=24), caching=st.booleans())
def test_events_and_metrics_equal_per_call_reference(ops, caching):
    _check_same(ops, caching, "reference")


@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=24), caching=st.booleans(), window=st.sampled_from([1, 2, 3, 5]))
def test_events_and_metrics_equal_per_call_small_window(ops, caching, window):
    """A pop past the host's copy of the queue runs per call with events or metrics on (its blocks are
    named at the call): the streams stay equal."""
    with mock.patch.object(fast_path, "FREE_WINDOW", window):
        _check_same(ops, caching, "reference")


@settings(max_examples=6, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=14))
@pytest.mark.heavy
def test_events_and_metrics_equal_per_call_device(ops):
    deferred, _ = _check_same(ops, True, "device")
    deferred.device_pool.validate()


def test_the_check_can_fail():
    """The comparison catches a BlockRemoved dropped by the host and two events swapped."""
    ops = [("alloc", 3, 1, 3), ("free", 0), ("alloc", 5, 2, 0), ("alloc", 4, 3, 0)]
    _check_same(ops, True, "reference")  # the evictions occur: two pops take keyed blocks
    orig = HostEvents.popped

    def drop_one(self, slots):
        orig(self, slots)
        gone = [i for i, e in enumerate(self.queue) if type(e).__name__ == "BlockRemoved"]
        if gone:
            del self.queue[gone[0]]
    with mock.patch.object(HostEvents, "popped", drop_one), pytest.raises(AssertionError, match="differ"):
        _check_same(ops, True, "reference")

    def swap(self, slots):
        orig(self, slots)
        if len(self.queue) >= 2:
            self.queue[-1], self.queue[-2] = self.queue[-2], self.queue[-1]
    with mock.patch.object(HostEvents, "popped", swap), pytest.raises(AssertionError, match="differ"):
        _check_same(ops, True, "reference")


@pytest.mark.slow
def test_same_events_as_vllm_block_pool(tmp_path):
    """The op lists of a seeded hypothesis run give the same trace on vLLM 0.33's own BlockPool (its
    released source, in a subprocess) as on the fast path with KV events and a metrics collector:
    every event's msgpack bytes and every metrics call, op by op (over the reference backend; a few
    lists over the device pool)."""
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    cases = []

    @settings(max_examples=max(40, settings().max_examples), database=None, derandomize=True)
    @given(ops=st.lists(OPS, min_size=4, max_size=20), caching=st.booleans())
    def draw(ops, caching):
        cases.append({"num_blocks": N, "caching": caching, "ops": [list(o) for o in ops], "metrics": True,
                      "wire": True})

    draw()
    theirs = driver_trace(root, cases, tmp_path)
    steps = [s for t in theirs for s in t]
    kinds = {e[0] for s in steps for e in s["events"]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds  # not vacuous
    assert {m[0] for s in steps for m in s["metrics"]} == {"allocated", "accessed", "evicted", "reset"}
    for k, (c, t) in enumerate(zip(cases, theirs)):
        kw = dict(device="cpu") if k < 3 else dict(backend="reference")
        ours = DeferredBlockPool(N, c["caching"], BS, enable_kv_cache_events=True,
                                 metrics_collector=driver.MetricsLog(), **kw)
        got = json.loads(json.dumps(driver.run(ours, [tuple(o) for o in c["ops"]], wire=True)))
        assert got == t, c


@pytest.mark.slow
def test_scheduler_with_events_and_metrics(tmp_path):
    """vLLM 0.33's AsyncScheduler with KV events (null publisher, each published batch recorded) and
    the KV cache metrics collector (sample rate 1, its calls recorded), stock and with gpupool's
    scheduler on the fast path (reference and device backends), on the differential stream and the
    decode-heavy one (tests/vllm_plugin/test_vllm_scheduler.py's): every step's decisions, its published events
    (msgpack bytes) and metrics calls equal stock vLLM's; the pool is ``DeferredBlockPool``; each step
    makes at most the device reads and synchronisations it makes with events and metrics off."""
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    r = scheduler_runs(root, "reference_ev,device,device_ev", tmp_path)
    for mode, base in (("reference_ev", "stock_ev"), ("device_ev", "stock_ev"), ("heavy_device_ev", "heavy_stock_ev")):
        theirs = r[base]
        kinds = {json.dumps(o[0]) for s in theirs for o in s["observed"]}
        assert len(kinds) >= 3 and sum(len(s["observed"]) for s in theirs) > 50, kinds  # not vacuous
        assert len(r[mode]) == len(theirs)
        for a, b in zip(theirs, r[mode]):
            ops = b.pop("gpupool_ops")
            assert a == b, (mode, a["step"])  # decisions, events (bytes) and metrics calls
            b["gpupool_ops"] = ops
    assert any(o[0] == "event" for s in r["stock_ev"] for o in s["observed"])
    for on, off in (("device_ev", "device"), ("heavy_device_ev", "heavy_device")):
        for a, b in zip(r[off], r[on]):  # step by step: events and metrics add no read, sync or launch
            x, y = a["gpupool_ops"], b["gpupool_ops"]
            assert y["d2h"] <= x["d2h"] and sum(y["syncs"].values()) <= sum(x["syncs"].values()), (on, a["step"], x, y)
            assert y["flushes"] <= 1 and set(y) <= {"apply_predicted", "flushes", "syncs", "d2h"}, y
    print("\nreads per step with events and metrics on, {reads: steps}: "
          + ", ".join(f"{m} {dict(sorted(Counter(s['gpupool_ops']['d2h'] for s in r[m]).items()))}"
                      for m in ("device", "device_ev", "heavy_device", "heavy_device_ev")))
