"""Counting what a block of code costs the host: host syncs (reads of tensor values), Triton kernel
launches, torch ops (each one kernel launch on a GPU, views excepted) and host-to-device copies (a
tensor made from Python data, or a copy from a CPU tensor onto a GPU). The decode loop's table
reports them per generated token (examples/decode_loop.py)."""
from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")


class _TorchOps(TorchDispatchMode):
    def __init__(self, meter: "Meter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        if self.meter.in_launch:  # the interpreter's own work, not the program's
            return out
        if func is torch.ops.aten.lift_fresh.default:
            self.meter.copies += 1  # torch.tensor(data): on a GPU a host-to-device copy
        elif func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.device.type == "cpu" and out.device.type != "cpu":
                self.meter.copies += 1
            else:
                self.meter.torch_ops += 1
        elif not func.is_view and name not in ("detach", "alias"):
            self.meter.torch_ops += 1
        return out


class Meter:
    """``with Meter() as m: ...``; then ``m.syncs``, ``m.launches``, ``m.torch_ops``, ``m.copies``.
    Re-entering adds to the counts. Syncs count every read of a tensor's values (on a CPU run the
    reads a GPU run would wait for)."""

    def __init__(self):
        self.syncs = self.launches = self.torch_ops = self.copies = 0
        self.in_launch = 0
        self.launch_seconds = 0.0  # wall time inside kernel launches (the interpreter's, on a CPU)

    def __enter__(self):
        meter = self
        self._getitem = KernelInterface.__getitem__

        def getitem(fn, grid):
            launch = meter._getitem(fn, grid)

            def counted(*args, **kwargs):
                meter.launches += 1
                meter.in_launch += 1
                t0 = time.perf_counter()
                try:
                    return launch(*args, **kwargs)
                finally:
                    meter.in_launch -= 1
                    if not meter.in_launch:
                        meter.launch_seconds += time.perf_counter() - t0

            return counted

        KernelInterface.__getitem__ = getitem
        self._saved = {}
        for name in SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, _orig=orig, **kw):
                meter.syncs += not meter.in_launch
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        self._mode = _TorchOps(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        KernelInterface.__getitem__ = self._getitem
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return False

    def as_dict(self) -> dict:
        return {"syncs": self.syncs, "launches": self.launches, "torch_ops": self.torch_ops, "copies": self.copies}
