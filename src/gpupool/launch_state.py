"""The Python state the kernel launchers read, kept out of ``gpupool.kernels`` (whose modules hold
none): a warp count that tests force, and the copy kernel's per-layer offset tables.
"""
from __future__ import annotations

import contextlib

import torch

_forced_warps: int | None = None

#: ``kernels/copy_blocks.py``'s offset tables by (device, unit, vec, layer addresses); never evicted:
#: a captured graph reads its table for the life of the process (a few bytes per layer).
offset_tables: dict[tuple, torch.Tensor] = {}


def forced_num_warps() -> int | None:
    """The warp count :func:`forced_warps` set, or None."""
    return _forced_warps


@contextlib.contextmanager
def forced_warps(num_warps: int):
    """Launch every one-program kernel with ``num_warps`` warps inside (tests of warp-count independence)."""
    global _forced_warps
    old, _forced_warps = _forced_warps, num_warps
    try:
        yield
    finally:
        _forced_warps = old
