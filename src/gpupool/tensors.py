"""Host-tensor plumbing shared by the pool and the request manager: the checks that make a caller's
tensor a kernel argument, and host values copied to the device. Every check raises a typed error
(ArgumentTypeError, InvalidArgumentError) naming the op and the argument; none changes any state.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from array import array
from bisect import bisect_left

import torch

from .args import as_id_list
from .errors import ArgumentTypeError, InvalidArgumentError


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def to_device(values, dtype, device: torch.device) -> torch.Tensor:
    """Host values as a ``dtype`` tensor on ``device``. On CUDA through a pinned buffer with
    ``non_blocking``: a blocking copy from pageable memory makes PyTorch synchronise the stream, which
    the batched ops must not."""
    vals = list(values)
    code = _ARRAY_CODES.get(dtype)
    try:  # through a C array: torch.tensor infers each element of a list (~0.7 us per int)
        t = torch.frombuffer(array(code, vals), dtype=dtype) if vals and code else torch.tensor(vals, dtype=dtype)
    except (TypeError, OverflowError):  # not plain ints, or out of range: torch's own conversion and errors
        t = torch.tensor(vals, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _array(vals, dt) -> array:
    """A part's values as an ``array``: ints, or ``bytes`` taken as the dtype's raw items (native order)."""
    if type(vals) is bytes:
        a = array(_ARRAY_CODES[dt])
        a.frombytes(vals)
        return a
    return array(_ARRAY_CODES[dt], vals)


def to_device_packed(parts, device: torch.device) -> list[torch.Tensor]:
    """Several lists of host ints, each ``(values, dtype)`` (int32 or int64), as 1-D tensors on ``device``
    in ONE host-to-device copy (one buffer, each part a view of it at an 8-byte aligned offset; pinned
    and ``non_blocking`` on CUDA, as :func:`to_device`). A part that is not plain ints in range is
    converted as :func:`to_device` converts it (then one copy per part). A part given as ``bytes`` is
    the dtype's items as raw bytes in native order (a whole number of them; e.g. hashes for a kernel)."""
    try:
        arrays = [_array(vals, dt) for vals, dt in parts]
    except (TypeError, OverflowError, KeyError, ValueError):
        return [to_device(_array(vals, dt) if type(vals) is bytes else vals, dt, device) for vals, dt in parts]
    buf, sizes = bytearray(), []
    for a in arrays:
        buf += a.tobytes()
        pad = -len(buf) % 8
        buf += bytes(pad)
        sizes += [a.itemsize * len(a), pad]
    buf += bytes(8)  # never empty
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
    pieces = t.split_with_sizes(sizes + [8])  # one op for all the parts (not Tensor.split's Python wrapper)
    return [pieces[2 * i].view(dt) for i, (_, dt) in enumerate(parts)]


def device_i32(op: str, t, what: str, device: torch.device) -> torch.Tensor:
    """``t`` as a contiguous ``int32[n]`` kernel argument: a 1-D int32 tensor on ``device`` (another
    shape is an error, not flattened, so a batch of lists cannot be read as one list)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(op, f"{what} must be a torch.Tensor on {device}")
    if t.dtype != torch.int32:
        raise InvalidArgumentError(op, f"{what} must be int32, got {t.dtype}")
    if t.device != device:
        raise InvalidArgumentError(op, f"{what} is on {t.device}, the pool on {device}")
    if t.dim() != 1:
        raise InvalidArgumentError(op, f"{what} must be 1-D (int32[n]), got shape {tuple(t.shape)}")
    return t.contiguous()


def i32(op: str, x, what: str, device: torch.device, error=InvalidArgumentError) -> torch.Tensor:
    """:func:`device_i32` of a tensor; a sequence of ints becomes a new ``int32`` tensor on ``device``
    (a value outside int32 raises ``error`` first)."""
    if isinstance(x, torch.Tensor):
        return device_i32(op, x, what, device)
    vals = as_id_list(op, x)
    check_int32(op, vals, what, error)
    return torch.tensor(vals, dtype=torch.int32, device=device)


def check_int32(op: str, vals: list[int], what: str, error=InvalidArgumentError) -> None:
    """Raise ``error`` naming the first of ``vals`` outside int32 (before any tensor is made of them)."""
    bad = next((v for v in vals if not -(1 << 31) <= v < 1 << 31), None)
    if bad is not None:
        raise error(op, f"{what}: {bad} is outside int32", bad)


def device_count(op: str, count, device: torch.device) -> torch.Tensor | None:
    """A count read on the device: the first entry of an ``int32`` tensor (``int32[1]`` view), or None
    when ``count`` is None (the kernel then counts the whole array)."""
    if count is None:
        return None
    c = device_i32(op, count, "the count", device)
    if c.numel() < 1:
        raise InvalidArgumentError(op, "the count tensor is empty (it needs one int32 entry)")
    return c[:1]


def out_buffer(op: str, t, dtype, n: int, what: str, device: torch.device) -> torch.Tensor:
    """An output buffer a kernel writes in place: ``dtype``, on ``device``, contiguous, with room for
    ``n`` entries (checked on the host from its shape: no out-of-bounds write, no lost copy); flat."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(op, f"{what} must be a torch.Tensor")
    if t.dtype != dtype or t.device != device or not t.is_contiguous() or t.numel() < n:
        raise InvalidArgumentError(op, f"{what} must be a contiguous {dtype} tensor on {device} with at "
                                       f"least {n} entries, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.reshape(-1)


def check_tensors(op: str, specs, dims: int, device: torch.device) -> None:
    """Each ``(tensor, dtype, what)`` of ``specs`` is a ``dims``-D ``dtype`` tensor on ``device``."""
    for t, dt, what in specs:
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(op, f"{what} must be a torch.Tensor")
        if t.dtype != dt or t.device != device or t.dim() != dims:
            raise InvalidArgumentError(op, f"{what} must be a {dims}-D {dt} tensor on {device}, got "
                                           f"{tuple(t.shape)} {t.dtype} on {t.device}")


# ---- memory that outputs must not share ----------------------------------------------------------

def memory_span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """The bytes ``t`` can reach: ``(device, first address, past the last)``, from its storage's
    address, its offset, sizes and strides (every element between its first and last one, so two
    views that interleave in one storage overlap too); None for a tensor with no elements."""
    if t.numel() == 0:
        return None
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # torch strides are >= 0
    lo = t.data_ptr()
    return str(t.device), lo, lo + (reach + 1) * t.element_size()


def _reach_index(spans) -> tuple[list[int], list[tuple]]:
    """Sorted ``(lo, hi, *what)`` spans as ``(starts, reach)``: ``reach[i]`` is the furthest-reaching
    of spans ``0 .. i`` (its ``(hi, *what)``), so one bisection finds whether any span overlaps a
    range (:func:`_overlap`)."""
    reach, best = [], None
    for lo, hi, *what in spans:
        if best is None or hi > best[0]:
            best = (hi, *what)
        reach.append(best)
    return [sp[0] for sp in spans], reach


def _overlap(index, span):
    """The ``reach`` entry of an indexed span sharing a byte with ``span`` (``lo, hi``), or None."""
    starts, reach = index
    i = bisect_left(starts, span[1]) - 1  # the last indexed span starting before span's end
    return reach[i] if i >= 0 and reach[i][0] > span[0] else None


class _LiveSpans:
    """The spans of every live :class:`HeldMemory` (held weakly: they leave with it), indexed per
    device (:func:`_reach_index`), so that an output is checked against all of them with one
    bisection, whatever the number of managers and windows. The index is rebuilt under the lock when
    an object registers or dies (rare); a check reads the current one without copying."""

    def __init__(self):
        self._lock = threading.Lock()  # register / unregister from any thread
        self._spans: dict[str, list[tuple]] = {}  # device: sorted (lo, hi, name, owner, token)
        self._index: dict[str, tuple] = {}  # device: _reach_index of _spans[device], replaced whole
        self._refs: dict[int, weakref.ref] = {}  # token: its HeldMemory, weakly
        self._dead: list[int] = []  # tokens of objects that died, appended by weakref callbacks
        self._tokens = itertools.count()

    def register(self, held: "HeldMemory", spans) -> None:
        """Index ``held``'s ``(device, lo, hi, name)`` spans until it dies."""
        token = next(self._tokens)
        dead = self._dead  # the callback may run during a collection inside the lock: it only appends
        ref = weakref.ref(held, lambda _, t=token: dead.append(t))
        with self._lock:
            self._refs[token] = ref
            self._purge()
            for dev in {sp[0] for sp in spans}:
                mine = [(lo, hi, name, held.owner, token) for d, lo, hi, name in spans if d == dev]
                self._spans[dev] = sorted(self._spans.get(dev, []) + mine)
                self._index[dev] = _reach_index(self._spans[dev])

    def _purge(self) -> None:
        """Drop the dead objects' spans (under the lock)."""
        if not self._dead:
            return
        gone = set()
        while self._dead:
            gone.add(self._dead.pop())
        for t in gone:
            self._refs.pop(t, None)
        for dev, spans in list(self._spans.items()):
            kept = [sp for sp in spans if sp[4] not in gone]
            if len(kept) != len(spans):
                self._spans[dev] = kept
                self._index[dev] = _reach_index(kept)

    def overlap(self, span) -> tuple | None:
        """``(hi, name, owner, token)`` of a live object's span sharing a byte with ``span``
        (:func:`memory_span`), or None."""
        if self._dead:
            with self._lock:
                self._purge()
        index = self._index.get(span[0])
        return None if index is None else _overlap(index, span[1:])


_LIVE = _LiveSpans()


class HeldMemory:
    """The spans of tensors an object owns (a manager's device state; ``named``: ``(tensor, name)``
    pairs, each name as an error should say it), indexed per device, so that a caller's output is
    checked against them, and against every other live ``HeldMemory``, with one bisection each.
    ``owner`` names the object in errors raised for another object's op ("a manager's state (the
    manager's rows)")."""

    def __init__(self, named, owner: str = "a manager"):
        self.owner = owner
        spans = []  # (device, lo, hi, name)
        for t, name in named:
            s = memory_span(t)
            if s is not None:
                spans.append((*s, name))
        by_dev: dict[str, list] = {}
        for dev, lo, hi, name in spans:
            by_dev.setdefault(dev, []).append((lo, hi, name))
        self._by_dev = {dev: _reach_index(sorted(sp)) for dev, sp in by_dev.items()}
        _LIVE.register(self, spans)

    def overlap(self, span) -> str | None:
        """The name of a held tensor sharing a byte with ``span`` (:func:`memory_span`), or None."""
        index = self._by_dev.get(span[0])
        hit = None if index is None else _overlap(index, span[1:])
        return None if hit is None else hit[1]


def _check_held(op: str, name: str, span, held: HeldMemory | None) -> None:
    """InvalidArgumentError when the output ``name`` (its ``span``) overlaps ``held`` or any other live
    :class:`HeldMemory`."""
    own = None if held is None else held.overlap(span)
    if own is not None:
        raise InvalidArgumentError(op, f"{name} shares memory with {own}: an output must be a buffer of its own")
    hit = _LIVE.overlap(span)  # not held's: it does not overlap span
    if hit is not None:
        raise InvalidArgumentError(op, f"{name} shares memory with {hit[2]}'s state ({hit[1]}): an output must "
                                       "be a buffer of its own")


def check_disjoint(op: str, outputs, inputs=(), held: HeldMemory | None = None) -> None:
    """Raise InvalidArgumentError (naming both) unless no output shares a byte of memory with another
    output, with an input, or with ``held`` (the op's own state): a kernel writing an output that
    another argument also occupies garbles one of them. ``outputs``, ``inputs``: ``(tensor, name)``
    pairs (tensors already checked to be tensors); inputs may share memory with each other. Compares
    the bytes each tensor reaches (:func:`memory_span`), so views of one buffer at different
    offsets are caught as well as the same tensor twice. Every other live ``HeldMemory`` (another
    manager's, a decode window's) is held too: an output there would change another object's state."""
    spans = []
    for kind, named in ((True, outputs), (False, inputs)):
        for t, name in named:
            s = memory_span(t)
            if s is not None:
                spans.append((s, kind, name))
                if kind:
                    _check_held(op, name, s, held)
    spans.sort(key=lambda x: x[0])
    reach: dict[tuple[str, bool], tuple[int, str]] = {}  # per (device, is output): furthest end so far
    for (dev, lo, hi), is_out, name in spans:
        for other_is_out in (True, False) if is_out else (True,):
            end, other = reach.get((dev, other_is_out), (0, ""))
            if end > lo:
                raise InvalidArgumentError(op, f"{other} and {name} share memory: an output must not overlap "
                                               "another output or an input")
        key = (dev, is_out)
        if hi > reach.get(key, (0, ""))[0]:
            reach[key] = (hi, name)
