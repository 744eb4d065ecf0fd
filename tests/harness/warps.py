"""Every one-program kernel launched at a forced warp count inside a block (the warp-count
independence tests, tests/gpu/test_cuda.py). The kernels keep no such setting (docs/design.md,
"Layers"): the test replaces the launchers' ``warps_for`` in each kernel module that imported it."""
from __future__ import annotations

import contextlib
import sys

import gpupool.manager  # noqa: F401 - every launcher module loaded, so each is patched
import gpupool.pool  # noqa: F401
import gpupool.replay.device  # noqa: F401
from gpupool.kernels import common


@contextlib.contextmanager
def forced_warps(num_warps: int):
    """Launch every kernel whose launcher uses ``warps_for`` with ``num_warps`` warps inside."""
    original = common.warps_for
    users = [m for name, m in list(sys.modules.items())
             if name.startswith("gpupool.kernels.") and getattr(m, "warps_for", None) is original]
    for m in users:
        m.warps_for = lambda block: num_warps
    try:
        yield
    finally:
        for m in users:
            m.warps_for = original
