"""Every kernel the pools launch compiles ahead of time for sm_90 and sm_80 (docs/design.md: interpreter-only
code is a bug). Runs ``tests/aot_compile.py`` with TRITON_INTERPRET=0, one subprocess per target, both at
once (compiling is single-threaded and takes minutes on a cold cache); no GPU needed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CCS = (90, 80)
KERNELS = ("alloc_kernel", "release_kernel", "touch_kernel", "cache_full_kernel", "cache_partial_kernel",
           "move_kernel", "evict_kernel", "reset_kernel", "lookup_kernel", "longest_prefix_kernel",
           "replay_loop_kernel", "validate_kernel", "copy_blocks_kernel", "allocate_slots_kernel",
           "free_requests_kernel", "slot_mapping_kernel", "release_copies_kernel",
           "allocate_slots_parallel_kernel", "decode_step_kernel", "decode_burst_kernel", "reserve_kernel",
           "release_reservation_kernel")


@pytest.mark.slow  # about 3 minutes on a cold Triton cache (seconds on a warm one)
def test_every_kernel_compiles_for_cuda():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("aot_compile.py")
    procs = {cc: subprocess.Popen([sys.executable, str(script), str(cc)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for cc in CCS}
    try:
        outs = {cc: p.communicate(timeout=900)[0] for cc, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for cc, p in procs.items():
        out = outs[cc]
        assert p.returncode == 0, f"sm_{cc}:\n{out[-4000:]}"
        assert "failures: 0" in out, f"sm_{cc}:\n{out[-4000:]}"
        names = {line.split()[2] for line in out.splitlines() if line.startswith(f"ok   sm_{cc} ")}
        for name in KERNELS:  # each op kernel of the pool is among them
            assert name in names, f"{name} was not compiled for sm_{cc}"
