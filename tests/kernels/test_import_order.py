"""How the kernels' backend is chosen (src/gpupool/_backend.py): ``import gpupool`` alone defines no
kernel and sets nothing; ``gpupool.use_interpreter`` chooses before the first kernel and is refused
after it; gpupool works in a process that imported triton first (any vLLM process does): the kernels
and triton.language's own ``@jit`` helpers run in the interpreter without a GPU."""
from __future__ import annotations

from harness.paths import ROOT
from harness.timeouts import scaled
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only chosen without CUDA")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["GPUPOOL_HYPOTHESIS_PROFILE"] = "dev"  # the import order is the subject, not the example count
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(600))


def _refused(call: str) -> str:
    """Code that runs ``call`` and prints ``refused: <message>`` for an InvalidArgumentError."""
    return f"try:\n    {call}\nexcept gpupool.InvalidArgumentError as e:\n    print('refused:', e)\n"


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


@pytest.mark.heavy
def test_differential_tests_pass_after_importing_triton_first():
    """The decode step's differential test (two groups, KV events on, against the reference manager)
    in a process that imported triton before gpupool."""
    p = _run("import sys, triton, triton.language, pytest\n"
             "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', 'tests/manager/test_decode_step.py::"
             "test_eager_decode_step_equals_reference[groups1-events]']))\n")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "1 passed" in p.stdout


def test_import_defines_no_kernel_and_sets_nothing():
    p = _run("import os, sys, gpupool\n"
             "print('gpupool.kernels' in sys.modules, 'triton' in sys.modules, os.environ.get('TRITON_INTERPRET'))\n")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["False", "False", "None"]


def test_use_interpreter_chooses_before_the_first_kernel_and_only_then():
    p = _run("import os, triton, gpupool\n"
             "gpupool.use_interpreter(False)\n"  # compiled kernels: they can be defined without a GPU
             "from gpupool.kernels import alloc\n"
             "print(isinstance(alloc.alloc_kernel, triton.runtime.JITFunction), os.environ.get('TRITON_INTERPRET'))\n"
             "gpupool.use_interpreter(False)\n"  # the same choice: nothing to do
             + _refused("gpupool.use_interpreter(True)"))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "True None", lines
    assert lines[1].startswith("refused:") and "already defined for CUDA" in lines[1], lines


def test_importing_the_kernels_sets_nothing_and_the_pool_follows_kernels_already_defined():
    """``gpupool.kernels`` is plain Triton: importing it (a kernel module too) leaves the process as it
    was, its kernels follow ``TRITON_INTERPRET`` as it stands (unset: compiled); a pool built after it
    keeps that choice rather than mixing backends, so on a CPU it is a typed error, not a crash."""
    p = _run("import os, gpupool.kernels, gpupool.kernels.layout, gpupool.kernels.alloc as a, gpupool._backend as b\n"
             "print(os.environ.get('TRITON_INTERPRET'), type(a.alloc_kernel).__name__, b._chosen)\n"
             "import gpupool\n"
             + _refused("gpupool.BlockPool(8)")
             + "print(os.environ.get('TRITON_INTERPRET'), b._chosen)\n")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "None JITFunction None", lines
    assert lines[1].startswith("refused:") and "set up for the GPU" in lines[1], lines
    assert lines[2] == "None False", lines
