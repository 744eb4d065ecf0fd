"""The KV consumer contract (docs/kv_cache.md): a paged KV cache that a model writes through the
manager's ``slot_mapping`` and reads through its block table, in the formats real attention kernels
take.

* :class:`PagedKVCache`: per layer a key and a value cache ``[num_blocks, block_size, num_kv_heads,
  head_dim]`` (vLLM's per-layer layout, K and V apart), any float dtype; :meth:`PagedKVCache.layers`
  is the list ``DecodeStep`` / ``copy_blocks`` take, so copy-on-write copies move real KV.
* :func:`store_kv`: a step's new K/V into the caches through ``slot_mapping`` (vLLM's
  ``reshape_and_cache``: a token whose slot is -1 writes nothing), one Triton launch, graph-safe.
* :class:`AttentionViews`: FlashAttention's ``block_table`` + ``seqused_k`` and FlashInfer's
  ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``, for a step or for each step of a burst,
  built on the device by ``KVCacheManager.attention_views`` (or inside a ``DecodeStep``).
* :func:`paged_attention` (FlashAttention's format) and :func:`paged_attention_flashinfer`: a
  reference paged attention in plain torch that reads the caches only through those views (runs on
  CPU; fixed shapes, no host sync, so it can be captured in a CUDA graph). :func:`attention` is the
  math they share with a contiguous cache.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .args import as_int, device_arg
from .errors import ArgumentTypeError, InvalidArgumentError
from . import _backend

_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels.kv_store import launch_store_kv

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _sizes(op: str, *named, low: int = 1) -> list[int]:
    """Each ``(value, name)`` as an int >= ``low`` (ArgumentTypeError / InvalidArgumentError)."""
    out = []
    for v, name in named:
        v = as_int(op, v, name)
        if v < low:
            raise InvalidArgumentError(op, f"{name} must be >= {low}, got {v}", v)
        out.append(v)
    return out


class AttentionViews(NamedTuple):
    """The paged-KV inputs of attention kernels for ``B`` lanes over ``K`` steps (docs/kv_cache.md).

    ``block_table: int32[B, M]`` (FlashAttention's; shared by the K steps), ``seqused_k: int32[K, B]``
    (tokens in the cache each lane attends to, 0 for a lane that takes no part), ``kv_indptr:
    int32[K, B + 1]``, ``kv_indices: int32[K, B * M]`` and ``kv_last_page_len: int32[K, B]``
    (FlashInfer's paged layout). :meth:`step` gives step k's one-step views."""

    block_table: torch.Tensor
    seqused_k: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor

    @staticmethod
    def empty(max_batch: int, max_blocks_per_req: int, steps: int = 1, device=None) -> "AttentionViews":
        """Zeroed views for ``max_batch`` lanes, rows of ``max_blocks_per_req`` blocks, ``steps`` steps.
        Raises ArgumentTypeError for a size that is not an int, InvalidArgumentError for one below 1
        (below 0 for ``max_batch``: an empty batch has empty views)."""
        op = "AttentionViews.empty"
        (B,) = _sizes(op, (max_batch, "max_batch"), low=0)
        M, K = _sizes(op, (max_blocks_per_req, "max_blocks_per_req"), (steps, "steps"))
        z = dict(dtype=torch.int32, device=device)
        return AttentionViews(torch.zeros((B, M), **z), torch.zeros((K, B), **z), torch.zeros((K, B + 1), **z),
                              torch.zeros((K, B * M), **z), torch.zeros((K, B), **z))

    @property
    def steps(self) -> int:
        return self.seqused_k.shape[0]

    def step(self, k: int) -> "AttentionViews":
        """Step ``k``'s views (the same tensors, row k: ``seqused_k: int32[B]``, ...; no copy). Raises
        InvalidArgumentError for ``k`` outside ``0..steps - 1`` (ArgumentTypeError: not an int)."""
        k = as_int("AttentionViews.step", k, "k")
        if not 0 <= k < self.steps:
            raise InvalidArgumentError("AttentionViews.step", f"step {k} out of range 0..{self.steps - 1}", k)
        return AttentionViews(self.block_table, self.seqused_k[k], self.kv_indptr[k], self.kv_indices[k],
                              self.kv_last_page_len[k])


class PagedKVCache:
    """Per layer a key and a value cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` of
    ``dtype`` (a float dtype) on ``device``, zeroed. Raises InvalidArgumentError for a size below 1 or
    a dtype that is not a float."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device=None):
        op = "PagedKVCache"
        sizes = _sizes(op, (num_layers, "num_layers"), (num_blocks, "num_blocks"), (block_size, "block_size"),
                       (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"))
        if dtype not in _FLOATS:
            raise InvalidArgumentError(op, f"dtype must be one of {_FLOATS}, got {dtype}")
        device = None if device is None else device_arg(op, device)
        self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = sizes
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        try:
            self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
            self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InvalidArgumentError(op, f"cannot allocate {2 * self.num_layers} caches of {list(shape)} {dtype}: "
                                           f"{str(e).splitlines()[0][:120]}") from e

    def layers(self) -> list[torch.Tensor]:
        """Every cache tensor, ``[k_0, v_0, k_1, v_1, ...]``: what ``DecodeStep(kv_caches=)`` and
        ``copy_blocks`` take, so a copy-on-write copy moves a block of every layer's K and V."""
        return [t for pair in zip(self.key_caches, self.value_caches) for t in pair]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              num_tokens: torch.Tensor | None = None) -> None:
        """:func:`store_kv` into layer ``layer``'s caches (InvalidArgumentError for a layer outside
        ``0..num_layers - 1``, ArgumentTypeError for one that is not an int)."""
        layer = as_int("PagedKVCache.store", layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError("PagedKVCache.store", f"layer {layer} out of range 0..{self.num_layers - 1}",
                                       layer)
        store_kv(key, value, self.key_caches[layer], self.value_caches[layer], slot_mapping, num_tokens)


def _check_tensor(op: str, t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(op, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
    """Write token t's ``key[t], value[t]: [H, D]`` into row ``slot % block_size`` of block ``slot //
    block_size`` of ``k_cache, v_cache: [num_blocks, block_size, H, D]`` (vLLM's ``reshape_and_cache``;
    docs/kv_cache.md section 1), ``slot = slot_mapping[t]`` (``int64`` or ``int32[T]``), for ``t <
    num_tokens[0]`` (``int32[1]`` on the device; all T without it). A negative slot, or one past the
    cache, writes nothing. One launch, no host sync. Raises ArgumentTypeError / InvalidArgumentError
    (shapes, dtypes, devices; checked on the host from the shapes) before anything is written."""
    op = "store_kv"
    for t, what in ((key, "key"), (value, "value"), (k_cache, "k_cache"), (v_cache, "v_cache"),
                    (slot_mapping, "slot_mapping")):
        _check_tensor(op, t, what)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(op, f"k_cache and v_cache must both be [num_blocks, block_size, H, D], got "
                                       f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if key.dim() != 3 or value.shape != key.shape or key.shape[1:] != k_cache.shape[2:]:
        raise InvalidArgumentError(op, f"key and value must both be [T, H, D] with [H, D] = {tuple(k_cache.shape[2:])}, "
                                       f"got {tuple(key.shape)} and {tuple(value.shape)}")
    for t, what in ((key, "key"), (value, "value"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.dtype not in _FLOATS:
            raise InvalidArgumentError(op, f"{what} must be a float tensor, got {t.dtype}")
        if t.device != k_cache.device:
            raise InvalidArgumentError(op, f"{what} is on {t.device}, k_cache on {k_cache.device}")
    if k_cache.device.type == "meta":
        raise InvalidArgumentError(op, "the caches are on the meta device, which holds no memory to write")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InvalidArgumentError(op, "k_cache and v_cache must be contiguous")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1 \
            or slot_mapping.device != k_cache.device or slot_mapping.numel() < key.shape[0]:
        raise InvalidArgumentError(op, f"slot_mapping must be a 1-D int32/int64 tensor on {k_cache.device} with at "
                                       f"least {key.shape[0]} entries, got {tuple(slot_mapping.shape)} "
                                       f"{slot_mapping.dtype} on {slot_mapping.device}")
    if num_tokens is not None:
        _check_tensor(op, num_tokens, "num_tokens")
        if num_tokens.dtype != torch.int32 or num_tokens.numel() < 1 or num_tokens.device != k_cache.device:
            raise InvalidArgumentError(op, f"num_tokens must be an int32[1] tensor on {k_cache.device}")
    launch_store_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping.contiguous(), num_tokens)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention over contiguous, padded K/V: ``q: [B, Sq, Hq, D]``, ``k, v: [B,
    L, Hk, D]`` (``Hq`` a multiple of ``Hk``), ``seq_lens: int[B]`` tokens of lane b's K/V that count.
    Query j of lane b sits at position ``seq_lens[b] - Sq + j`` and attends to the keys at positions up
    to its own (FlashAttention's ``causal=True`` with a KV cache). A lane with no key gives zeros.
    Returns ``[B, Sq, Hq, D]`` in ``q``'s dtype. Plain torch, fixed shapes, no host sync."""
    _check_attention("attention", q, 4, (k, "k"), (v, "v"))
    B, Sq, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    _check_index("attention", seq_lens, "seq_lens", q.device, (B,))
    if k.shape[0] != B or k.shape[3] != D:
        raise InvalidArgumentError("attention", f"k and v must be [{B}, L, Hk, {D}] for q {tuple(q.shape)}, got "
                                                f"{tuple(k.shape)}")
    if Hk < 1 or Hq % Hk:
        raise InvalidArgumentError("attention", f"{Hq} query heads are not a multiple of {Hk} KV heads")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, dim=2)
        v = v.repeat_interleave(Hq // Hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.to(q.dtype)) * scale
    qpos = seq_lens.to(torch.int64)[:, None] - Sq + torch.arange(Sq, device=q.device)[None, :]  # [B, Sq]
    visible = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, Sq, L]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: zeros, not NaN
    return torch.einsum("bhqk,bkhd->bqhd", p, v.to(q.dtype))


def _check_attention(op: str, q, q_dims: int, *caches) -> None:
    """``q`` a float tensor of ``q_dims`` dimensions; each ``(cache, name)`` a 4-D float tensor on
    ``q``'s device, all of one shape (host checks from the shapes: no sync)."""
    _check_tensor(op, q, "q")
    if q.dtype not in _FLOATS or q.dim() != q_dims:
        raise InvalidArgumentError(op, f"q must be a {q_dims}-D float tensor, got {tuple(q.shape)} {q.dtype}")
    for t, what in caches:
        _check_tensor(op, t, what)
        if t.dtype not in _FLOATS or t.dim() != 4 or t.shape != caches[0][0].shape or t.device != q.device:
            raise InvalidArgumentError(op, f"{what} must be a 4-D float tensor on {q.device} of the shape of "
                                           f"{caches[0][1]}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def _check_index(op: str, t, what: str, device, shape: tuple, at_least: bool = False) -> None:
    """``t`` an integer tensor on ``device`` of ``shape`` (of ``len(shape)`` dims, each at least
    ``shape``'s with ``at_least``)."""
    _check_tensor(op, t, what)
    ok = t.dim() == len(shape) and all((a >= b) if at_least else a == b for a, b in zip(t.shape, shape))
    if not ok or t.dtype not in (torch.int32, torch.int64) or t.device != device:
        longer = " or longer" if at_least else ""
        raise InvalidArgumentError(op, f"{what} must be an int32/int64 tensor {list(shape)}{longer} on {device}, got"
                                       f" {tuple(t.shape)} {t.dtype} on {t.device}")


def _check_paged(op: str, q, q_dims: int, k_cache, v_cache) -> None:
    _check_attention(op, q, q_dims, (k_cache, "k_cache"), (v_cache, "v_cache"))
    if k_cache.shape[3] != q.shape[-1] or k_cache.shape[2] < 1 or q.shape[-2] % k_cache.shape[2]:
        raise InvalidArgumentError(op, f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}: the head "
                                       "dims must agree and the query heads be a multiple of the KV heads")


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache: [num_blocks, bs, H, D]`` read through ``pages: int[B, P]`` (block ids): ``[B, P * bs, H, D]``."""
    B, P = pages.shape
    return cache[pages.long()].reshape(B, P * cache.shape[1], *cache.shape[2:])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seqused_k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FlashAttention's ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqused_k,
    block_table=block_table, causal=True)`` in plain torch: ``q: [B, Sq, Hq, D]``, caches ``[num_blocks,
    bs, Hk, D]``, ``block_table: int32[B, M]``, ``seqused_k: int32[B]``; only the first
    ``ceil(seqused_k[b] / bs)`` entries of a row are used. Returns ``[B, Sq, Hq, D]``. Raises
    InvalidArgumentError / ArgumentTypeError for wrong types, shapes, dtypes or devices (from the
    shapes: the block ids themselves are not read on the host)."""
    op = "paged_attention"
    _check_paged(op, q, 4, k_cache, v_cache)
    _check_index(op, block_table, "block_table", q.device, (q.shape[0], 0), at_least=True)
    return attention(q, gather_pages(k_cache, block_table), gather_pages(v_cache, block_table), seqused_k, scale)


def paged_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                               max_pages: int, scale: float | None = None) -> torch.Tensor:
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD layout) in plain torch:
    ``q: [B, Hq, D]`` (one query per lane, the newest token), ``kv_indptr: int32[B + 1]``,
    ``kv_indices: int32[>= kv_indptr[B]]``, ``kv_last_page_len: int32[B]``; ``max_pages`` bounds the
    pages of a lane (fixed shapes: the block table's width). Returns ``[B, Hq, D]``. Raises
    InvalidArgumentError / ArgumentTypeError for wrong types, shapes, dtypes, devices or a
    ``max_pages`` below 0 (from the shapes: the page ids themselves are not read on the host)."""
    op = "paged_attention_flashinfer"
    _check_paged(op, q, 3, k_cache, v_cache)
    B = q.shape[0]
    max_pages = as_int(op, max_pages, "max_pages")
    if max_pages < 0:
        raise InvalidArgumentError(op, f"max_pages must be >= 0, got {max_pages}", max_pages)
    _check_index(op, kv_indptr, "kv_indptr", q.device, (B + 1,), at_least=True)
    _check_index(op, kv_indices, "kv_indices", q.device, (0,), at_least=True)
    _check_index(op, kv_last_page_len, "kv_last_page_len", q.device, (B,), at_least=True)
    start = kv_indptr[:B].long()
    npages = kv_indptr[1:B + 1].long() - start
    j = torch.arange(max_pages, device=q.device)[None, :]
    idx = torch.where(j < npages[:, None], start[:, None] + j, 0)
    pages = torch.where(j < npages[:, None], kv_indices.long()[idx], 0)
    bs = k_cache.shape[1]
    seq = torch.where(npages > 0, (npages - 1) * bs + kv_last_page_len.long(), 0)
    return attention(q[:, None], gather_pages(k_cache, pages), gather_pages(v_cache, pages), seq, scale)[:, 0]


__all__ = ["AttentionViews", "PagedKVCache", "store_kv", "attention", "gather_pages", "paged_attention",
           "paged_attention_flashinfer"]
