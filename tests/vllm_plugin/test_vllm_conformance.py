"""vLLM 0.33's own tests of its BlockPool and KVCacheManager, run against ``gpupool.vllm.BlockPool``
(docs/vllm.md, "Conformance").

vLLM's released source (never a copy in this repo) is the 0.33.0 sdist, downloaded once into
``~/.cache/gpupool`` and its ``vllm/`` and ``tests/`` unpacked beside it; without it (no network) the
tests skip with the reason. All of vLLM's tests run in ONE pytest subprocess in the unpacked tree with
the plugin ``tests/vllm_plugin/conformance/plugin.py`` (what it stubs is in its docstring), which runs each
test once with vLLM's own ``BlockPool`` (the baseline: what passes in this harness at all) and then
once with gpupool's swapped in everywhere vLLM imported it, so vLLM is imported once (~20 s). Every
test's outcome must equal the baseline's, except the tests in ``KNOWN`` (each with the reason the
adapter differs on purpose).

The full files run against the adapter over the reference backend (``backend="reference"``: the
same adapter over gpupool's CPU oracle; Triton's interpreter would take ~3 s per test); one file
(``test_partial_prefix_cache_primitives.py``) also runs over the device pool, in the same subprocess.
Both tests are slow and share that subprocess (a module fixture).
"""
from harness.paths import CONFORMANCE
from harness import vllm_source
from harness.timeouts import scaled
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: set by .ci/run: a skip of these claimed results is a failure there
REQUIRED = os.environ.get("GPUPOOL_REQUIRE_VLLM") == "1"


def _skip(reason: str):
    if REQUIRED:
        pytest.fail(f"{reason} (GPUPOOL_REQUIRE_VLLM=1: these results are required)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


for _mod, _why in (("msgspec", "gpupool.vllm needs msgspec"), ("pydantic", "vLLM's config classes need pydantic"),
                   ("yaml", "vLLM imports yaml (pyyaml)")):
    try:
        __import__(_mod)
    except ImportError:
        _skip(f"{_why} (pip install -e '.[test]' installs it)")

CACHE = vllm_source.CACHE

# vLLM's test files that build a BlockPool or a KVCacheManager (tests/v1/core; the prefix_cache
# directory without test_hybrid_prefix_cache_hit_rate.py, which starts an OpenAI server)
FILES = ("tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_kv_cache_utils.py",
         "tests/v1/core/test_single_type_kv_cache_manager.py",
         "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
         "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
         "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py")

_FOREIGN = "builds its own vllm KVCacheBlock objects (not the pool's) and hands them to the pool / reads their fields"
_INTERNALS = "writes the pool's internals directly (cached_block_hash_to_block._cache / .insert on a keyed block / set_block_hash)"
#: test id -> why the adapter's outcome differs from vLLM's pool (each is a failure with gpupool's pool)
KNOWN = {
    "tests/v1/core/test_prefix_caching.py::test_cache_blocks[sha256]": _FOREIGN,
    "tests/v1/core/test_prefix_caching.py::test_cache_blocks_multi_group": _FOREIGN,
    "tests/v1/core/test_single_type_kv_cache_manager.py::test_chunked_local_attention_remove_skipped_blocks": _FOREIGN,
    "tests/v1/core/test_single_type_kv_cache_manager.py::test_sliding_window_remove_skipped_blocks": _FOREIGN,
    "tests/v1/core/test_single_type_kv_cache_manager.py::test_rswa_remove_skipped_blocks_gap_range": _FOREIGN,
    "tests/v1/core/test_prefix_caching.py::test_maybe_evict_cached_block": _INTERNALS,
    "tests/v1/core/test_prefix_caching.py::test_prefill_hybrid_model": _INTERNALS,
    "tests/v1/core/test_prefix_caching.py::test_prefill_hybrid_model_eagle": _INTERNALS,
    "tests/v1/core/test_prefix_caching.py::test_eagle_with_sliding_window": _INTERNALS,
    "tests/v1/core/test_prefix_caching.py::test_different_block_size": _INTERNALS,
    "tests/v1/core/test_single_type_kv_cache_manager.py::test_chunked_local_attention_possible_cached_prefix": _INTERNALS,
    "tests/v1/core/test_single_type_kv_cache_manager.py::test_sliding_window_possible_cached_prefix": _INTERNALS,
    # one free_blocks over this pool's blocks and those of vLLM's HiSparse host pool (vLLM's own
    # KVCacheBlock objects): gpupool's free_blocks is all or nothing and refuses a block it does not
    # own (the plug-in does not swap a HiSparse pool: docs/vllm.md)
    "tests/v1/core/test_prefix_caching.py::test_hisparse_deferred_free_retains_host_blocks_until_fence": _FOREIGN,
}


def vllm_tree() -> Path:
    """vLLM 0.33.0's ``vllm/`` and ``tests/``, unpacked from the sdist (downloaded once:
    ``harness.vllm_source``); skips without it (fails under GPUPOOL_REQUIRE_VLLM=1)."""
    try:
        return vllm_source.tree(FILES[0])
    except vllm_source.SourceUnavailable as e:
        _skip(str(e))


DEVICE_FILES = ("tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",)


def run_vllm_tests(files=FILES, modes=("stock", "reference"), device_files=(), timeout: int = 600):
    """Run vLLM's ``files`` in ONE pytest subprocess, each test once per mode (``stock``: vLLM's
    ``BlockPool``; ``reference`` / ``device``: ``gpupool.vllm.BlockPool`` with that backend), and the
    tests of ``device_files`` also in mode ``device``. Returns (mode -> test id -> outcome, mode ->
    gpupool pools built)."""
    root = vllm_tree()
    out = CACHE / f"conformance-{os.getpid()}.json"
    paths = [str(CONFORMANCE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = dict(os.environ, GPUPOOL_VLLM_SRC=str(root), GPUPOOL_VLLM_MODES=",".join(modes),
               GPUPOOL_VLLM_DEVICE_FILES=",".join(device_files), GPUPOOL_VLLM_RESULTS=str(out),
               PYTHONPATH=os.pathsep.join(paths))
    env.setdefault("TRITON_INTERPRET", "1")
    # a vLLM test that builds a model config asks the Hugging Face hub; offline it fails at once in every
    # mode alike (the modes are compared), where without a network it retried with backoff past the limit
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # vLLM's tree (and pytest's assertion-rewritten test modules) is byte-compiled in place on the first
    # run, as an installed package would be, so later runs skip ~12 s of compiling even where
    # PYTHONDONTWRITEBYTECODE is set
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "plugin", "--noconftest", "-q", "-p", "no:cacheprovider",
           "-W", "ignore", "--rootdir", str(root), *files]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=scaled(timeout))
    if not out.is_file():
        raise AssertionError(f"vLLM's tests did not run ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    out.unlink()
    outcomes, built = res["outcomes"], res["built"]
    if set(modes) - set(outcomes):  # nothing ran in a mode: vLLM's tests were not collected (a missing module, say)
        missing = sorted(set(re.findall(r"No module named '([\w.]+)'", proc.stdout + proc.stderr)))
        raise AssertionError(
            f"vLLM's tests did not run in mode(s) {sorted(set(modes) - set(outcomes))}"
            + (f": missing module(s) {', '.join(missing)} (pip install -e '.[test]' installs what they need)"
               if missing else "") + f"; pytest's output:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    print(f"\nvLLM conformance subprocess: {res['process_s']:.1f} s (plugin + vLLM import {res['import_s']:.1f} s), "
          f"tests per mode: " + ", ".join(f"{m} {t:.1f} s" for m, t in res["seconds"].items()))
    assert built.get("stock", 0) == 0
    for m in set(outcomes) - {"stock"}:
        assert built.get(m, 0) > 0, f"no gpupool BlockPool was built in mode {m}: the swap did not take"
    return outcomes, built


@pytest.fixture(scope="module")
def vllm_runs():
    """The one subprocess the tests below read: every file in modes stock, reference and deferred,
    the primitives file also in mode device."""
    return run_vllm_tests(FILES, ("stock", "reference", "deferred"), DEVICE_FILES)


def _counts(outcomes: dict[str, str], prefix: str = "") -> dict[str, int]:
    c: dict[str, int] = {}
    for tid, k in outcomes.items():
        if tid.startswith(prefix):
            c[k] = c.get(k, 0) + 1
    return c


def _compare(stock: dict[str, str], ours: dict[str, str], known: dict[str, str]) -> list[str]:
    assert set(stock) == set(ours), "the two runs collected different tests"
    bad = []
    for tid, k in sorted(stock.items()):
        if ours[tid] == k:
            if tid in known:
                bad.append(f"{tid}: listed in KNOWN but now {k} as vLLM's (remove it from KNOWN)")
            continue
        if tid in known and k == "passed" and ours[tid] in ("failed", "error"):
            continue
        bad.append(f"{tid}: vLLM's pool {k}, gpupool's {ours[tid]}")
    return bad


def _report(stock, ours, label):
    lines = [f"{label}: file  vLLM's pool (passed/failed/error)  gpupool's"]
    for f in FILES:
        s, o = _counts(stock, f), _counts(ours, f)
        lines.append(f"  {f}: {s.get('passed', 0)}/{s.get('failed', 0)}/{s.get('error', 0)}  "
                     f"{o.get('passed', 0)}/{o.get('failed', 0)}/{o.get('error', 0)}")
    print("\n".join(lines))


@pytest.mark.slow
def test_partial_prefix_primitives_on_the_device_pool(vllm_runs):
    """vLLM's partial-prefix BlockPool primitives file, gpupool's adapter over the device pool (Triton
    kernels) against vLLM's pool: the same outcome for every test."""
    outcomes, built = vllm_runs
    stock = {t: k for t, k in outcomes["stock"].items() if t.startswith(DEVICE_FILES)}
    ours = outcomes["device"]
    _report(stock, ours, "device backend")
    assert _counts(stock).get("passed", 0) >= 10
    assert not _compare(stock, ours, KNOWN)


@pytest.mark.slow
def test_vllm_core_tests_on_gpupool_block_pool(vllm_runs):
    """Every test of ``FILES``: gpupool's adapter (reference backend) has vLLM's pool's outcome, except
    ``KNOWN``."""
    outcomes, built = vllm_runs
    stock, ours = outcomes["stock"], outcomes["reference"]
    _report(stock, ours, "reference backend")
    print(f"gpupool pools built: {built}")
    assert _counts(stock).get("passed", 0) >= 500
    bad = _compare(stock, ours, KNOWN)
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_vllm_core_tests_on_deferred_block_pool(vllm_runs):
    """Every test of ``FILES`` over the scheduler's fast path (``DeferredBlockPool``, reference
    backend): vLLM's pool's outcome, except ``KNOWN`` (the same list as the per-call adapter's)."""
    outcomes, built = vllm_runs
    stock, ours = outcomes["stock"], outcomes["deferred"]
    _report(stock, ours, "deferred (fast path), reference backend")
    assert built.get("deferred", 0) > 0
    assert built.get("deferred+host_events", 0) > 0  # vLLM's KV event tests ran on the fast path
    bad = _compare(stock, ours, KNOWN)
    assert not bad, "\n".join(bad)
