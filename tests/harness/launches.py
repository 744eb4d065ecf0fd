"""Counting what a block of code launches and where it waits: Triton launches in the interpreter, and
host reads of device tensors (each one a synchronisation on a GPU). The decode step's and the
burst's tests use it: a fixed sequence of launches whatever the batch size (docs/design.md, "Kernel
patterns": parallel over requests) and no host sync."""
from __future__ import annotations

import torch


class LaunchCounter:
    """Counts Triton launches (interpreter) and host reads of device tensors inside the block."""

    SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__")

    def __enter__(self):
        import triton.runtime.interpreter as interp

        self.launches = self.syncs = 0
        self._cls = interp.InterpretedFunction
        self._getitem = self._cls.__getitem__
        counter = self

        def getitem(fn, grid):
            counter.launches += 1
            return counter._getitem(fn, grid)

        self._cls.__getitem__ = getitem
        self._saved = {}
        for name in self.SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, _orig=orig, **kw):
                counter.syncs += 1
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        self._cls.__getitem__ = self._getitem
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return False
