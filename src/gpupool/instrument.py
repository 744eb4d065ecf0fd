"""Counting what a block of code costs the host: host syncs, Triton launches, torch ops and
host-to-device copies, inside ``with Meter() as m: ...``.

- ``syncs``: reads of a tensor's values on the host (``item``, ``tolist``, ``cpu``, ``numpy``,
  ``bool(t)``, ``int(t)``, ``float(t)``, ``operator.index(t)``): on a GPU each one waits for the
  device; on a CPU run, the reads a GPU run would wait for (a CPU-only check reads inside
  :func:`reads_not_synced`).
- ``launches``: Triton kernel launches (``kernel[grid](...)``, compiled or in the interpreter).
- ``torch_ops``: torch operations outside a Triton launch, views excepted (on a GPU each is about one
  kernel launch).
- ``copies``: host-to-device copies: a tensor made from Python data (``torch.tensor(data)``; on a GPU
  a copy from the host), or a copy from a CPU tensor onto another device.

What a Triton launch does inside (the interpreter's own reads and torch work) is not counted. The
decode step's tests (a fixed number of launches and no sync, docs/design.md "Kernel patterns") and
the decode loop's table (examples/decode_loop.py) count with it.

Rules (docs/testing.md, "Counting launches and syncs"):

- A meter counts what the thread that entered it does, and nothing another thread does: two threads
  each inside their own meter count their own work apart. Work a thread hands to another (a
  publisher's socket thread, say) is not counted.
- Meters nest: every meter active in a thread counts each event once. Entering a meter again adds to
  its counts (``with m: ...`` twice counts both blocks); entering it inside itself counts once.
- Each entry of a meter is left by its own exit, in any order, and an exception inside the block is
  passed on. The patches (of ``torch.Tensor``'s read methods and Triton's ``KernelInterface``) are
  put in place when the first meter of the process is entered and removed when the last one is
  left, so the classes are then exactly as before (a patch another tool put over them stays).
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import InvalidArgumentError

#: ``torch.Tensor`` methods that read a tensor's values on the host (one sync each).
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")
_MISSING = object()

_lock = threading.Lock()  # guards _entered and the patches
_entered = 0  # meters active in the process, all threads
_saved: list[tuple[type, str, object, object]] = []  # (class, name, its own attribute or _MISSING, our patch)


class _ThreadState(threading.local):
    """One thread's meters: those active (in entry order), the Triton launch and host read depths, the dispatch mode
    that counts its torch ops (torch's dispatch modes are per thread) while a meter is active."""

    def __init__(self):
        self.meters: list[Meter] = []
        self.in_launch = 0
        self.in_read = 0
        self.mode: _TorchOps | None = None


_thread = _ThreadState()


def _counting() -> list[Meter]:
    """The meters that count an event in this thread now: none inside a Triton launch."""
    return [] if _thread.in_launch else _thread.meters


def _patch(cls: type, name: str, patch) -> None:
    _saved.append((cls, name, vars(cls).get(name, _MISSING), patch))
    setattr(cls, name, patch)


def _install() -> None:
    from triton.runtime.jit import KernelInterface

    getitem = KernelInterface.__getitem__

    def counted_getitem(fn, grid):
        launch = getitem(fn, grid)

        def counted(*args, **kwargs):
            meters = _counting()
            for m in meters:
                m.launches += 1
            _thread.in_launch += 1
            t0 = time.perf_counter()
            try:
                return launch(*args, **kwargs)
            finally:
                _thread.in_launch -= 1
                dt = time.perf_counter() - t0
                for m in meters:
                    m.launch_seconds += dt

        return counted

    _patch(KernelInterface, "__getitem__", counted_getitem)
    for name in SYNC_METHODS:
        read = getattr(torch.Tensor, name)

        def counted_read(t, *args, _read=read, **kwargs):
            if not _thread.in_read:  # one read is one sync, however many of its methods it calls
                for m in _counting():
                    m.syncs += 1
            _thread.in_read += 1
            try:
                return _read(t, *args, **kwargs)
            finally:
                _thread.in_read -= 1

        _patch(torch.Tensor, name, counted_read)


def _uninstall() -> None:
    while _saved:
        cls, name, own, patch = _saved.pop()
        if vars(cls).get(name) is not patch:
            continue  # another tool patched over ours: its patch stays (ours, under it, then counts nothing)
        if own is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


@contextlib.contextmanager
def reads_not_synced():
    """Reads of tensor values inside the block are not counted as ``syncs``: for a check that only a
    CPU run makes (a GPU run skips it: on a GPU it would be a sync), so a CPU run counts the reads a
    GPU run waits for, no more."""
    _thread.in_read += 1
    try:
        yield
    finally:
        _thread.in_read -= 1


class _TorchOps(TorchDispatchMode):
    """Counts the torch ops of one thread (torch's dispatch modes are per thread) for its meters."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for m in _counting():
            if func is torch.ops.aten.lift_fresh.default:
                m.copies += 1  # torch.tensor(data): on a GPU a host-to-device copy
            elif func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
                src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                if src.device.type == "cpu" and out.device.type != "cpu":
                    m.copies += 1
                else:
                    m.torch_ops += 1
            elif not func.is_view and func.__name__ not in ("detach", "alias"):
                m.torch_ops += 1
        return out


class Meter:
    """``with Meter() as m: ...``; then ``m.syncs``, ``m.launches``, ``m.torch_ops``, ``m.copies``
    (ints, what the entering thread did inside the block; module docstring) or ``m.as_dict()``, and
    ``m.launch_seconds`` (float: wall time inside the counted launches, so a driver's own host time is
    the rest).
    Re-entering adds to the counts. Entering a meter that another thread has entered raises
    InvalidArgumentError (its counts would mix two threads)."""

    def __init__(self):
        self.syncs = self.launches = self.torch_ops = self.copies = 0
        self.launch_seconds = 0.0  # wall time inside the counted launches (the interpreter's, on a CPU)
        self._depth = 0  # entries not yet left (a meter entered inside itself counts once)
        self._owner: int | None = None  # the thread that entered it

    def __enter__(self) -> Meter:
        me = threading.get_ident()
        if self._depth:
            if self._owner != me:
                raise InvalidArgumentError("Meter", "this meter is active in another thread; use one meter per thread")
            self._depth += 1
            return self
        _acquire()
        try:
            if not _thread.meters:
                mode = _TorchOps()
                mode.__enter__()
                _thread.mode = mode
        except BaseException:
            _release()
            raise
        _thread.meters.append(self)
        self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc) -> bool:
        if self._depth == 0 or self._owner != threading.get_ident():
            return False  # not entered in this thread: nothing to leave
        self._depth -= 1
        if self._depth:
            return False
        self._owner = None
        _thread.meters.remove(self)
        try:
            if not _thread.meters:
                mode, _thread.mode = _thread.mode, None
                mode.__exit__(None, None, None)
        finally:
            _release()
        return False  # an exception inside the block goes on

    def as_dict(self) -> dict[str, int]:
        """``{"syncs", "launches", "torch_ops", "copies"}``: the counts so far."""
        return {"syncs": self.syncs, "launches": self.launches, "torch_ops": self.torch_ops, "copies": self.copies}

    def __repr__(self) -> str:
        return f"Meter({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


def _acquire() -> None:
    """One more active meter; the first puts the patches in place."""
    global _entered
    with _lock:
        if _entered == 0:
            try:
                _install()
            except BaseException:
                _uninstall()
                raise
        _entered += 1


def _release() -> None:
    """One active meter fewer; the last removes the patches."""
    global _entered
    with _lock:
        _entered -= 1
        if _entered == 0:
            _uninstall()


__all__ = ["Meter", "SYNC_METHODS", "reads_not_synced"]
