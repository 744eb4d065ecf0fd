"""The machine a command runs on: the library versions, the torch device, free memory, and the pools
built there (the reference pool on the host, the device pool on a torch device)."""
from __future__ import annotations

from ..errors import PoolError
from .types import CLIError

#: Bytes a pool holds per block, about (measured on CPU, 2 M blocks: 145 reference, 272 device in the
#: interpreter); the up-front check allows twice that.
POOL_BYTES_PER_BLOCK = {"reference": 300, "device": 550}


def versions() -> dict:
    """Versions of gpupool, torch, triton and Python (for ``--version`` and the JSON report)."""
    import platform

    import torch
    import triton

    from .. import __version__

    return {"gpupool": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def version_text() -> str:
    """The ``--version`` line."""
    v = versions()
    return f"gpupool {v['gpupool']} (torch {v['torch']}, triton {v['triton']}, python {v['python']})"


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device the device pool runs on: ``requested`` (already ``cpu`` or ``cuda[:N]``) if this
    machine has it, else CLIError saying what to use instead; None picks :func:`default_device`."""
    import torch

    if requested is None:
        return default_device()
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise CLIError(f"--device {requested}: torch {torch.__version__} sees no CUDA device on this machine; "
                       f"use --device cpu (the device pool in Triton's interpreter, slow) or leave --device out")
    idx = int(requested.split(":")[1]) if ":" in requested else 0
    if idx >= torch.cuda.device_count():
        raise CLIError(f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                       f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return requested


def device_label(device: str | None) -> str | None:
    """``cpu (Triton interpreter)`` or ``cuda:0 (<the GPU's name>)``, as the reports name the device."""
    if device is None:
        return None
    if device == "cpu":
        return "cpu (Triton interpreter)"
    import torch

    idx = int(device.split(":")[1]) if ":" in device else 0
    return f"{device} ({torch.cuda.get_device_name(idx)})"


def _available_bytes(device: str | None) -> int | None:
    """Free memory where the pool would live (CUDA: the device's; else the host's), None if unknown."""
    from ..memory import available_bytes

    return available_bytes(device)


def _check_pool_memory(kind: str, num_blocks: int, device: str | None) -> None:
    """CLIError (exit 2) before anything is built when the pool cannot fit in free memory."""
    need = POOL_BYTES_PER_BLOCK[kind] * num_blocks
    free = _available_bytes(device if kind == "device" else None)
    if free is not None and need > free:
        raise CLIError(f"--num-blocks {num_blocks:,}: the {kind} pool needs about {need / 2**30:.1f} GiB and "
                       f"{free / 2**30:.1f} GiB is free; choose a smaller pool (about "
                       f"{free // POOL_BYTES_PER_BLOCK[kind]:,} blocks fit)")


def make_pool(kind: str, num_blocks: int, device: str | None = None):
    """A fresh pool: ``"reference"`` (CPU oracle) or ``"device"`` (``gpupool.BlockPool`` on ``device``).

    The device pool is imported here, lazily; when it cannot be imported this raises CLIError.
    """
    if kind == "reference":
        from ..reference import ReferenceBlockPool as make
    elif kind == "device":
        if device is None:
            device = default_device()
        try:
            from .. import BlockPool
        except ImportError as e:
            raise CLIError(f"the device pool gpupool.BlockPool is not available ({e}); "
                           f"use --pool reference for the CPU reference pool") from None

        def make(n):
            return BlockPool(n, device=device)
    else:
        raise CLIError(f"unknown pool kind {kind!r} (expected 'device' or 'reference')")
    _check_pool_memory(kind, num_blocks, device)
    try:
        return make(num_blocks)
    except PoolError as e:
        raise CLIError(f"--num-blocks {num_blocks:,}: {e}") from None
    except (MemoryError, RuntimeError) as e:  # torch reports an allocation failure as RuntimeError
        raise CLIError(f"--num-blocks {num_blocks:,}: cannot allocate the {kind} pool "
                       f"({str(e).splitlines()[0][:120]}); choose a smaller pool") from None


def device_replay():
    """The device pool's replay loop: ``f(pool, trace, *, block_size, tpot_ms, progress) -> ReplayReport``.

    The one place the command names it."""
    from ..replay.device import replay_on_device

    return replay_on_device
