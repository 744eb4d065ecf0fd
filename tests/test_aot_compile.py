"""Every kernel the pools launch compiles ahead of time for sm_90 and sm_80 (docs/design.md: interpreter-only
code is a bug). Runs ``tests/aot_compile.py`` in a subprocess with TRITON_INTERPRET=0; no GPU needed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("cc", [90, 80])
def test_every_kernel_compiles_for_cuda(cc):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("aot_compile.py")
    res = subprocess.run([sys.executable, str(script), str(cc)], env=env, capture_output=True, text=True,
                         timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "failures: 0" in out
    compiled = [line for line in res.stdout.splitlines() if line.startswith(f"ok   sm_{cc} ")]
    names = {line.split()[2] for line in compiled}
    # Each op kernel of the pool is among them.
    for name in ("alloc_kernel", "release_kernel", "touch_kernel", "cache_full_kernel", "cache_partial_kernel",
                 "move_kernel", "evict_kernel", "reset_kernel", "lookup_kernel", "longest_prefix_kernel",
                 "replay_loop_kernel", "validate_kernel", "copy_blocks_kernel", "allocate_slots_kernel",
                 "free_requests_kernel", "slot_mapping_kernel", "release_copies_kernel",
                 "allocate_slots_parallel_kernel", "decode_step_kernel"):
        assert name in names, f"{name} was not compiled for sm_{cc}"
