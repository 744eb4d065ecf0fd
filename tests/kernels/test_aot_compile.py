"""Every kernel the pools launch compiles ahead of time for sm_90 and sm_80 (docs/design.md: interpreter-only
code is a bug). Runs ``tests/kernels/aot_compile.py`` with TRITON_INTERPRET=0, one subprocess per target, a test
each, so ``pytest -n 2`` runs both at once (compiling is single-threaded and takes minutes on a cold
cache); no GPU needed. Each target compiles the cover of aot_compile.py (``--cover``: every
kernel with every signature and every value of each boolean constexpr, about half the variants);
``GPUPOOL_AOT_FULL=1`` compiles every variant (about 10 minutes of CPU for both targets, a cold
cache). The script fails when a kernel of ``gpupool.kernels`` is never launched by its drivers (so
never compiled); the quick test checks that alone, without compiling."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.timeouts import scaled

CCS = (90, 80)
SCRIPT = Path(__file__).with_name("aot_compile.py")
ENV = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")


def test_every_kernel_is_launched_by_the_compile_drivers():
    out = subprocess.run([sys.executable, str(SCRIPT), "--record-only"], env=ENV, capture_output=True, text=True,
                         timeout=scaled(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    launched = set(out.stdout.split("kernels launched by the drivers:")[1].split("\n")[0].split())
    assert {"alloc_kernel", "window_begin_kernel", "window_step_kernel", "admit_kernel", "append_tokens_kernel",
            "replay_loop_kernel"} <= launched


@pytest.mark.slow  # 2 to 3 minutes a target on a cold Triton cache (seconds on a warm one)
@pytest.mark.parametrize("cc", CCS, ids=[f"sm_{cc}" for cc in CCS])
def test_every_kernel_compiles_for_cuda(cc):
    cover = [] if os.environ.get("GPUPOOL_AOT_FULL") == "1" else ["--cover"]
    out = subprocess.run([sys.executable, str(SCRIPT), str(cc), *cover], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=scaled(900))
    log = out.stdout
    assert out.returncode == 0, f"sm_{cc}:\n{log[-4000:]}"
    assert "failures: 0" in log, f"sm_{cc}:\n{log[-4000:]}"
    names = {line.split()[2] for line in log.splitlines() if line.startswith(f"ok   sm_{cc} ")}
    launched = set(log.split("kernels launched by the drivers:")[1].split("\n")[0].split())
    assert launched <= names, f"not compiled for sm_{cc}: {sorted(launched - names)}"
