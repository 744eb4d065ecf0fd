"""``gpupool.vllm.GpuPoolScheduler`` (docs/vllm.md, "The scheduler plug-in").

* slow, differential: one request stream (20 requests over 3 shared prefixes, chunked prefill, a pool
  small enough to preempt, aborts, one batch in flight as vLLM's async tests drive it) through vLLM
  0.33's own ``AsyncScheduler`` and through ``GpuPoolScheduler`` over gpupool's reference pool and over
  the device pool (Triton kernels): every step's scheduled requests and token counts, the block ids
  each request gets, preemptions, finished ids, prefix-cache stats, sampled outputs and free-block
  count are equal. The scheduler is built as vLLM's tests/v1/core/utils.py ``create_scheduler`` builds
  it except its ModelConfig (which needs a Hugging Face config): a stand-in with the attributes the
  scheduler reads (tests/vllm_conformance/sched_driver.py). It runs in a subprocess (vLLM's import).
* quick: ``gpupool.vllm`` imports without vLLM and ``GpuPoolScheduler`` is a lazy attribute.
"""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("msgspec", reason="gpupool[vllm] needs msgspec (pip install 'gpupool[vllm]')")

PLUGIN_DIR = Path(__file__).parent / "vllm_conformance"


def test_scheduler_is_lazy_and_needs_vllm():
    """``import gpupool.vllm`` does not import vLLM; reading ``GpuPoolScheduler`` imports the scheduler
    module, which needs vLLM (ImportError without it); an unknown name is an AttributeError."""
    code = ("import sys, gpupool.vllm as g\n"
            "assert 'vllm' not in sys.modules and 'gpupool.vllm.scheduler' not in sys.modules\n"
            "try:\n    g.nope\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no AttributeError')\n"
            "try:\n    g.GpuPoolScheduler\nexcept ImportError as e:\n    print('import', e.name)\n"
            "else:\n    print('loaded')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr
    try:
        import vllm  # noqa: F401
        assert out.stdout.strip() == "loaded"
    except ImportError:
        assert out.stdout.strip() == "import vllm", out.stdout


@pytest.mark.slow
def test_same_decisions_as_vllm_async_scheduler(tmp_path):
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    env = dict(os.environ, GPUPOOL_VLLM_SRC=str(root), TRITON_INTERPRET="1", NUM_BLOCKS="12", NREQ="20",
               BACKENDS="reference,device")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = tmp_path / "sched.json"
    proc = subprocess.run([sys.executable, str(PLUGIN_DIR / "sched_driver.py"), str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["is_async"]
    assert r["sync"] == [True, "gpupool.vllm.block_pool"]
    assert r["holders"] == [], r["holders"]  # nothing of vLLM's refers to its old pool after the swap
    assert r["refused"] == ["InvalidArgumentError", True]
    stock = r["stock"]
    # not vacuous: prefix hits, a preemption, aborts, every request finished
    assert sum(h[2] for s in stock for h in s.get("prefix_cache_stats", [])) > 0
    assert sum(len(s["preempted"]) for s in stock) >= 1
    assert sum(len(s["finished"]) for s in stock) >= 1
    assert len({n[0] for s in stock for n in s["new"]}) == 20
    for backend in ("reference", "device"):
        ours = r[backend]
        assert len(ours) == len(stock)
        for a, b in zip(stock, ours):
            ops = b.pop("gpupool_ops")
            assert a == b, (backend, a["step"])
            b["gpupool_ops"] = ops
    per_step = [sum(v for k, v in s["gpupool_ops"].items() if k not in ("mirror_refresh", "device_check"))
                for s in r["device"]]
    # host synchronisations: each check() waits for the device and reads 2 small tensors; each mirror
    # refresh reads 2; get_new_blocks reads its ids back: a lower bound on device-to-host reads
    syncs = [s["gpupool_ops"].get("device_check", 0) for s in r["device"]]
    reads = [2 * s["gpupool_ops"].get("device_check", 0) + 2 * s["gpupool_ops"].get("mirror_refresh", 0)
             + s["gpupool_ops"].get("get_new_blocks", 0) for s in r["device"]]
    assert sum(syncs) >= sum(per_step)  # every device op waits for the device at least once
    total = Counter()
    for s in r["device"]:
        total.update(s["gpupool_ops"])
    print(f"\n{len(stock)} steps; gpupool device-pool ops per step: max {max(per_step)}, "
          f"mean {sum(per_step) / len(per_step):.2f}; device waits (check) per step: max {max(syncs)}, "
          f"total {sum(syncs)}; device-to-host reads >= {sum(reads)} (max {max(reads)} in a step); "
          f"totals {dict(total)}; "
          f"time stock {r['stock_s']:.2f} s, reference {r['reference_s']:.2f} s, device (interpreter) {r['device_s']:.2f} s")
    # this version makes one gpupool op per vLLM BlockPool call (docs/vllm.md): more than one per step
    assert max(per_step) > 1
