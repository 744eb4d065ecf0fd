"""``gpupool.vllm.GpuPoolScheduler`` (docs/vllm.md, "The scheduler plug-in").

* slow, differential: one request stream (20 requests over 3 shared prefixes, chunked prefill, a pool
  small enough to preempt, aborts, one batch in flight as vLLM's async tests drive it) through vLLM
  0.33's own ``AsyncScheduler`` and through ``GpuPoolScheduler`` over gpupool's reference pool and over
  the device pool (Triton kernels): every step's scheduled requests and token counts, the block ids
  each request gets, preemptions, finished ids, prefix-cache stats, sampled outputs and free-block
  count are equal. The scheduler is built as vLLM's tests/v1/core/utils.py ``create_scheduler`` builds
  it except its ModelConfig (which needs a Hugging Face config): a stand-in with the attributes the
  scheduler reads (tests/vllm_plugin/conformance/sched_driver.py). It runs in a subprocess (vLLM's import).
  Run over the fast path (``DeferredBlockPool``) on both backends and over the per-call path on the
  device pool, plus a decode-heavy stream on the fast path; device-to-host reads are counted per step
  (every ``torch.Tensor`` reader patched) and the fast path's bound, at most one per step, asserted.
* quick: ``gpupool.vllm`` imports without vLLM and ``GpuPoolScheduler`` is a lazy attribute.
"""
from harness.vllm_ops import scheduler_runs  # noqa: E402
from harness.timeouts import scaled
import os
import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")



def test_scheduler_is_lazy_and_needs_vllm():
    """``import gpupool.vllm`` does not import vLLM; reading ``GpuPoolScheduler`` imports the scheduler
    module, which needs vLLM (ImportError without it); an unknown name is an AttributeError."""
    code = ("import sys, gpupool.vllm as g\n"
            "assert 'vllm' not in sys.modules and 'gpupool.vllm.scheduler' not in sys.modules\n"
            "try:\n    g.nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
            "try:\n    g.GpuPoolScheduler\nexcept ImportError as e:\n    print('import', e.name)\n"
            "else:\n    print('loaded')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr
    try:
        import vllm  # noqa: F401
        assert out.stdout.strip() == "loaded"
    except ImportError:
        assert out.stdout.strip() == "import vllm", out.stdout


def _distribution(steps, what="d2h"):
    """{device-to-host reads (or another count of ``gpupool_ops``) in a step: number of steps}."""
    return dict(sorted(Counter(s["gpupool_ops"][what] for s in steps).items()))




@pytest.mark.slow
def test_same_decisions_as_vllm_async_scheduler(tmp_path):
    """The differential run (module docstring) over the fast path (``DeferredBlockPool``: reference and
    device pool) and the per-call path (device pool), plus a decode-heavy stream (6 requests of 40-70
    output tokens, 40 blocks) over the fast path on the device pool; every step equal to vLLM's. Host
    synchronisations: every read of a tensor's values into Python outside Triton and torch is counted
    per step (arrivals, aborts, ``schedule()``, ``update_from_output()``); the fast path makes at most
    ONE per step on both streams, the per-call path many."""
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    r = scheduler_runs(root, "reference,device,device_percall,device_w4", tmp_path)
    assert r["is_async"]
    assert r["sync"] == [True, "gpupool.vllm.fast_path"]  # the synchronous scheduler gets the fast path too
    assert r["async_off"] == ["GpuPoolSyncScheduler", "DeferredBlockPool", True]
    assert r["holders"] == [], r["holders"]  # nothing of vLLM's refers to its old pool after the swap
    assert r["refused"] == ["InvalidArgumentError", True]
    stock = r["stock"]
    # not vacuous: prefix hits, a preemption, aborts, every request finished
    assert sum(h[2] for s in stock for h in s.get("prefix_cache_stats", [])) > 0
    assert sum(len(s["preempted"]) for s in stock) >= 1
    assert sum(len(s["finished"]) for s in stock) >= 1
    assert len({n[0] for s in stock for n in s["new"]}) == 20
    heavy = r["heavy_stock"]
    assert len({n[0] for s in heavy for n in s["new"]}) == 6 and len(heavy) > 60
    for mode, base in (("reference", stock), ("device", stock), ("device_percall", stock), ("device_w4", stock),
                       ("heavy_device", heavy)):
        ours = r[mode]
        assert len(ours) == len(base)
        for a, b in zip(base, ours):
            ops = b.pop("gpupool_ops")
            assert a == b, (mode, a["step"])
            b["gpupool_ops"] = ops
    # the fast path's synchronisations, by reason: with the default window the host's copy of the free
    # queue holds the whole queue, so only end_step's verification every verify_every (64) steps
    fast_syncs = Counter()
    for mode in ("reference", "device", "heavy_device"):
        for s in r[mode]:
            fast_syncs.update(s["gpupool_ops"]["syncs"])
            assert sum(s["gpupool_ops"]["syncs"].values()) <= 1, (mode, s["step"], s["gpupool_ops"])
        assert sum(sum(s["gpupool_ops"]["syncs"].values()) for s in r[mode]) <= len(r[mode]) // 64 + 1, mode
    assert set(fast_syncs) <= {"end_step"}, fast_syncs
    # a window of 4 ring slots: refills at end_step and before pops, placeholders past it (then block_id
    # reads and lookups of free blocks synchronise); the decisions above stay vLLM's
    small = Counter()
    for s in r["device_w4"]:
        small.update(s["gpupool_ops"]["syncs"])
    assert small["free_queue"] > 0 and small["end_step"] > 0, small
    for mode in ("device", "heavy_device", "device_w4"):
        for s in r[mode]:  # each read is one sync() of the pool (nothing else reads the device)
            assert s["gpupool_ops"]["d2h"] == sum(s["gpupool_ops"]["syncs"].values()), s
    for mode in ("device", "heavy_device", "device_w4"):  # the only device op: one apply_predicted launch per flush
        for s in r[mode]:
            o = s["gpupool_ops"]
            assert set(o) <= {"apply_predicted", "flushes", "syncs", "d2h"}, o
            assert o.get("apply_predicted", 0) == o["flushes"], o
            if mode != "device_w4":  # one launch per step (its rounds); placeholders can need more
                assert o["flushes"] <= 1, (mode, s["step"], o)
    per_call = r["device_percall"]
    assert max(_distribution(per_call)) > 1  # the per-call path: one op + check() + mirror copy per call
    ops = Counter()
    for s in per_call:
        ops.update({k: v for k, v in s["gpupool_ops"].items() if k not in ("syncs", "d2h")})
    fast_ops = Counter()
    for s in r["device"]:
        fast_ops.update({k: v for k, v in s["gpupool_ops"].items() if k not in ("syncs", "d2h")})
    print(f"\n{len(stock)} steps (differential stream), {len(heavy)} (decode-heavy). Device-to-host reads per "
          f"step, {{reads: steps}}: fast path {_distribution(r['device'])} (total "
          f"{sum(s['gpupool_ops']['d2h'] for s in r['device'])}), decode-heavy fast path "
          f"{_distribution(r['heavy_device'])}, window-4 fast path {_distribution(r['device_w4'])} (reasons "
          f"{dict(small)}), per-call path {_distribution(per_call)} (total "
          f"{sum(s['gpupool_ops']['d2h'] for s in per_call)}); fast-path sync reasons {dict(fast_syncs)}; "
          f"gpupool ops: fast {dict(fast_ops)}, per-call {dict(ops)}; flushes per step {{flushes: steps}}: fast "
          f"{_distribution(r['device'], 'flushes')}, decode-heavy {_distribution(r['heavy_device'], 'flushes')}; reads by caller {r['d2h_where']}; time "
          f"stock {r['stock_s']:.2f} s, reference {r['reference_s']:.2f} s, device (interpreter) {r['device_s']:.2f} s, "
          f"per-call device {r['device_percall_s']:.2f} s, decode-heavy device {r['heavy_device_s']:.2f} s")
