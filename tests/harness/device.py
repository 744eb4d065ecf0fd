"""The device the tests run on (CUDA when present, else the CPU under Triton's interpreter, which
tests/conftest.py turns on) and id tensors on it."""
from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def i32(values) -> torch.Tensor:
    """``values`` as an int32 tensor on :data:`DEVICE`."""
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


def i64(values) -> torch.Tensor:
    """``values`` as an int64 tensor on :data:`DEVICE`."""
    return torch.tensor(list(values), dtype=torch.int64, device=DEVICE)


def cpu_i32(values) -> torch.Tensor:
    """``values`` as an int32 tensor on the CPU (host-side inputs, whatever the pool's device)."""
    return torch.tensor(values, dtype=torch.int32)
