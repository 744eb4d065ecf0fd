"""gpupool works in a process that imported triton first (any vLLM process does): the kernels and
triton.language's own ``@jit`` helpers run in the interpreter without a GPU (src/gpupool/_backend.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only chosen without CUDA")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["GPUPOOL_HYPOTHESIS_PROFILE"] = "dev"  # the import order is the subject, not the example count
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_pool_and_manager_ops_after_importing_triton_first():
    p = _run("import triton, triton.language\n"
             "import gpupool\n"
             "from gpupool.manager import KVCacheManager\n"
             "p = gpupool.BlockPool(8)\n"
             "print(p.get_new_blocks(2).tolist())\n"
             "m = KVCacheManager(64, block_size=4, max_num_reqs=4, max_blocks_per_req=8)\n"
             "m.add_request(0)\n"
             "m.allocate_slots([0], [0], [9])\n"
             "print(m.rows())\n")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["[1, 2]", "[[1, 2, 3], [], [], []]"]


def test_differential_tests_pass_after_importing_triton_first():
    """The decode step's differential test (two groups, KV events on, against the reference manager)
    in a process that imported triton before gpupool."""
    p = _run("import sys, triton, triton.language, pytest\n"
             "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', 'tests/test_decode_step.py::"
             "test_eager_decode_step_equals_reference[groups1-events]']))\n")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "1 passed" in p.stdout
