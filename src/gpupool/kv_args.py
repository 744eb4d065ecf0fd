"""The argument checks of the KV consumer API (docs/kv_cache.md), written once: ``PagedKVCache``,
``AttentionViews.empty``, ``store_kv``, ``attention``, ``paged_attention``,
``paged_attention_flashinfer`` and ``KVCacheManager.attention_views`` check here, on the host and
before anything is allocated or written.

Each check raises ArgumentTypeError for an argument of the wrong Python type (a float for a size, a
string for a scale, a list for a tensor) and InvalidArgumentError for a wrong value: a size out of
range, a shape, dtype or device that does not fit, a non-finite scale, or an allocation larger than
the free memory where it would live (``gpupool.memory``). None of them reads a device value.
"""
from __future__ import annotations

import math
from numbers import Real

import torch

from .args import as_int, device_arg
from .errors import ArgumentTypeError, InvalidArgumentError
from .memory import check_fits

#: The cache and query dtypes (any float dtype torch computes attention in).
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Integer views and lengths: what the manager writes (int32) and what a caller may hold (int64).
INDICES = (torch.int32, torch.int64)
#: Entries of one int32-indexed view (FlashInfer's ``kv_indptr`` sums pages in int32).
MAX_INT32 = 2**31 - 1
#: Layers of a PagedKVCache: two tensors each, as Python objects (sized on the meta device first), so
#: a count in the billions would exhaust the host before any memory check could answer.
MAX_LAYERS = 1 << 16


def sizes(op: str, *named, low: int = 1, high: int = MAX_INT32) -> list[int]:
    """Each ``(value, name)`` as an int in ``low .. high`` (ArgumentTypeError for a value that is not
    an integer, bools included; InvalidArgumentError out of range)."""
    out = []
    for v, name in named:
        v = as_int(op, v, name)
        if not low <= v <= high:
            raise InvalidArgumentError(op, f"{name} must be in {low}..{high}, got {v}", v)
        out.append(v)
    return out


def device(op: str, device) -> torch.device | None:
    """``None`` (torch's default device) or a device the pool's kernels run on (``args.device_arg``:
    InvalidArgumentError for an unknown string, a device type other than cpu / cuda, CUDA without
    CUDA)."""
    return None if device is None else device_arg(op, device)


def float_dtype(op: str, dtype) -> torch.dtype:
    """A cache dtype: one of :data:`FLOATS` (ArgumentTypeError: not a ``torch.dtype``)."""
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(op, f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if dtype not in FLOATS:
        raise InvalidArgumentError(op, f"dtype must be one of {FLOATS}, got {dtype}")
    return dtype


def scale(op: str, scale, head_dim: int) -> float:
    """The softmax scale: ``1 / sqrt(head_dim)`` for None, else a finite real number (an int, a float,
    a numpy scalar; ArgumentTypeError for anything else, bools included; InvalidArgumentError for
    nan or an infinity, which would make every output nan)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise ArgumentTypeError(op, f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s):
        raise InvalidArgumentError(op, f"scale must be finite, got {s}")
    return s


def tensor(op: str, t, what: str) -> torch.Tensor:
    """``t`` itself when it is a tensor (ArgumentTypeError otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(op, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t


def float_tensors(op: str, dims: int, *named, device=None) -> None:
    """Each ``(tensor, name)`` a float tensor (:data:`FLOATS`) of ``dims`` dimensions, all on the first
    one's device (or ``device``) and, past the first, of the first one's shape."""
    first, first_name = named[0]
    for t, what in named:
        tensor(op, t, what)
        where = first.device if device is None else device
        same = t is first or t.shape == first.shape
        if t.dtype not in FLOATS or t.dim() != dims or not same or t.device != where:
            shape = "" if t is first else f" of the shape of {first_name} {tuple(first.shape)}"
            raise InvalidArgumentError(op, f"{what} must be a {dims}-D float tensor on {where}{shape}, got "
                                           f"{tuple(t.shape)} {t.dtype} on {t.device}")


def same_dtype(op: str, *named) -> None:
    """Each ``(tensor, name)`` of the first one's dtype (InvalidArgumentError naming every dtype
    otherwise): tensors one kernel copies between, which it does not cast (vLLM's
    ``reshape_and_cache`` refuses a key or value whose dtype is not the cache's)."""
    first = named[0][0].dtype
    if any(t.dtype != first for t, _ in named):
        names = ", ".join(n for _, n in named)
        got = ", ".join(f"{n} {t.dtype}" for t, n in named)
        raise InvalidArgumentError(op, f"{names} must share one dtype (no cast), got {got}")


def index_tensor(op: str, t, what: str, device, shape: tuple, at_least: bool = False) -> torch.Tensor:
    """``t`` an int32 / int64 tensor on ``device`` of ``shape`` (as many dimensions, each at least
    ``shape``'s with ``at_least``)."""
    tensor(op, t, what)
    ok = t.dim() == len(shape) and all((a >= b) if at_least else a == b for a, b in zip(t.shape, shape))
    if not ok or t.dtype not in INDICES or t.device != device:
        longer = " or longer" if at_least else ""
        raise InvalidArgumentError(op, f"{what} must be an int32/int64 tensor {list(shape)}{longer} on {device}, got"
                                       f" {tuple(t.shape)} {t.dtype} on {t.device}")
    return t


def fits(op: str, what: str, size: int, nbytes: int, device) -> None:
    """The allocation bound: the ``nbytes`` the op would allocate on ``device`` (None: the CPU) must
    fit its free memory (InvalidArgumentError naming ``what`` = ``size`` otherwise)."""
    check_fits(op, what, size, nbytes, torch.device("cpu") if device is None else device)


__all__ = ["FLOATS", "INDICES", "MAX_INT32", "MAX_LAYERS", "sizes", "device", "float_dtype", "scale", "tensor", "float_tensors",
           "same_dtype", "index_tensor", "fits"]
