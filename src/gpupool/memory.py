"""Device memory for a pool's or a manager's tensors: free bytes where they would live, and an
allocation that fails as a PoolError (InvalidArgumentError naming the size) instead of torch's
RuntimeError, or the host's out-of-memory killer, for a size that cannot fit."""
from __future__ import annotations

import os

import torch

from .errors import InvalidArgumentError


def available_bytes(device) -> int | None:
    """Free memory where tensors on ``device`` live (CUDA: the device's; else the host's available
    memory, page cache counted as free), None where unknown."""
    try:
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


#: Needs up to this many bytes are not compared with the free memory (no /proc read per call): an
#: allocation that small that still fails is torch's error to report (allocate_checked catches it).
SMALL_BYTES = 64 << 20


def check_fits(op: str, what: str, size: int, need: int, device) -> None:
    """InvalidArgumentError (value ``size``, ``what`` naming it) when ``need`` bytes exceed the free
    memory on ``device`` (:func:`available_bytes`): refused before torch tries, which would raise a
    RuntimeError or wake the host's out-of-memory killer."""
    if need <= SMALL_BYTES:
        return
    free = available_bytes(device)
    if free is not None and need > free:
        raise InvalidArgumentError(op, f"{what} {size:,}: needs {need / 2**30:,.1f} GiB of memory on {device} and "
                                       f"{free / 2**30:,.1f} GiB is free", size)


def allocate_checked(op: str, what: str, size: int, make, device):
    """``make(device)`` (tensors: a NamedTuple, a list), first sized on the meta device:
    InvalidArgumentError (value ``size``) when it needs more than :func:`available_bytes`
    (:func:`check_fits`) or when torch cannot allocate it."""
    need = sum(t.numel() * t.element_size() for t in make(torch.device("meta")))
    check_fits(op, what, size, need, device)
    try:
        return make(device)
    except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation as RuntimeError
        raise InvalidArgumentError(op, f"{what} {size:,}: cannot allocate {need / 2**30:,.1f} GiB on {device} "
                                       f"({str(e).splitlines()[0][:120]})", size) from None
