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

from typing import NamedTuple

import torch

from . import kv_args
from .args import as_int
from .errors import ArgumentTypeError, InvalidArgumentError
from . import _backend

_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels.kv_store import launch_store_kv
from .instrument import reads_not_synced
from .memory import allocate_checked
from .tensors import check_disjoint


class AttentionViews(NamedTuple):
    """The paged-KV inputs of attention kernels for ``B`` lanes over ``K`` steps (docs/kv_cache.md).

    ``block_table: int32[B, M]`` (FlashAttention's; shared by the K steps), ``seqused_k: int32[K, B]``
    (tokens in the cache each lane attends to, 0 for a lane that takes no part), ``kv_indptr:
    int32[K, B + 1]``, ``kv_indices: int32[K, B * M]`` and ``kv_last_page_len: int32[K, B]``
    (FlashInfer's paged layout). :meth:`step` gives step k's one-step views; :meth:`shapes` is the
    one statement of these shapes, which :meth:`empty` allocates and :meth:`check_out` checks."""

    block_table: torch.Tensor
    seqused_k: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor

    @staticmethod
    def shapes(max_batch: int, max_blocks_per_req: int, steps: int = 1,
               op: str = "AttentionViews.shapes") -> "AttentionViews":
        """The five tensors' shapes (tuples, as an ``AttentionViews``) for ``B = max_batch`` lanes,
        ``M = max_blocks_per_req`` blocks per row and ``K = steps`` steps. Raises ArgumentTypeError for
        a size that is not an int, InvalidArgumentError for one below 1 (below 0 for ``max_batch``: an
        empty batch has empty views) or for views past int32 (``K * B * M`` or ``K * (B + 1)``
        entries: FlashInfer's ``kv_indptr`` and the kernel's offsets are int32)."""
        (B,) = kv_args.sizes(op, (max_batch, "max_batch"), low=0)
        M, K = kv_args.sizes(op, (max_blocks_per_req, "max_blocks_per_req"), (steps, "steps"))
        shapes = AttentionViews((B, M), (K, B), (K, B + 1), (K, B * M), (K, B))
        big = max(a * b for a, b in shapes)
        if big > kv_args.MAX_INT32:
            raise InvalidArgumentError(op, f"views of {B} lanes, {M} blocks a row and {K} steps need {big:,} int32 "
                                           f"entries in one tensor, more than {kv_args.MAX_INT32:,}", big)
        return shapes

    @staticmethod
    def empty(max_batch: int, max_blocks_per_req: int, steps: int = 1, device=None) -> "AttentionViews":
        """Zeroed views of :meth:`shapes` on ``device`` (None: torch's default). Raises what
        :meth:`shapes` raises, InvalidArgumentError for an unknown or absent device
        (``args.device_arg``) and for views larger than the free memory there."""
        op = "AttentionViews.empty"
        shapes = AttentionViews.shapes(max_batch, max_blocks_per_req, steps, op=op)
        dev = kv_args.device(op, device)
        return AttentionViews(*allocate_checked(
            op, "max_batch", shapes.block_table[0],
            lambda d: [torch.zeros(sh, dtype=torch.int32, device=d) for sh in shapes], dev))

    @staticmethod
    def check_out(op: str, views, shapes: "AttentionViews", device: torch.device) -> None:
        """``views`` are views of ``shapes`` (:meth:`shapes`) an op may fill: contiguous int32
        tensors on ``device`` (ArgumentTypeError: not an ``AttentionViews`` of tensors;
        InvalidArgumentError: a shape, dtype, device or layout that differs)."""
        if not isinstance(views, AttentionViews):
            raise ArgumentTypeError(op, "out must be an AttentionViews (AttentionViews.empty)")
        for name, t, shape in zip(AttentionViews._fields, views, shapes):
            kv_args.tensor(op, t, f"out.{name}")
            if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
                raise InvalidArgumentError(op, f"out.{name} must be a contiguous int32 tensor {list(shape)} on "
                                               f"{device}, got {tuple(t.shape)} {t.dtype} on {t.device}")

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
    ``dtype`` (a float dtype) on ``device``, zeroed. Raises ArgumentTypeError for a size that is not
    an int or a dtype that is not a ``torch.dtype``, InvalidArgumentError for a size below 1 (or past
    int32; ``num_layers`` past ``kv_args.MAX_LAYERS``), a dtype that is not a float, an unknown or
    absent device, or caches larger than the free memory there."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device=None):
        op = "PagedKVCache"
        sizes = kv_args.sizes(op, (num_layers, "num_layers"), high=kv_args.MAX_LAYERS)
        sizes += kv_args.sizes(op, (num_blocks, "num_blocks"), (block_size, "block_size"),
                               (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"))
        dtype = kv_args.float_dtype(op, dtype)
        device = kv_args.device(op, device)
        self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = sizes
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        caches = allocate_checked(op, "num_blocks", self.num_blocks,
                                  lambda d: [torch.zeros(shape, dtype=dtype, device=d) for _ in range(2 * self.num_layers)],
                                  device)
        self.key_caches, self.value_caches = caches[0::2], caches[1::2]

    def layers(self) -> list[torch.Tensor]:
        """Every cache tensor, ``[k_0, v_0, k_1, v_1, ...]``: what ``DecodeStep(kv_caches=)`` and
        ``copy_blocks`` take, so a copy-on-write copy moves a block of every layer's K and V."""
        return [t for pair in zip(self.key_caches, self.value_caches) for t in pair]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              num_tokens: torch.Tensor | None = None) -> None:
        """:func:`store_kv` into layer ``layer``'s caches (InvalidArgumentError for a layer outside
        ``0..num_layers - 1``, ArgumentTypeError for one that is not an int)."""
        (layer,) = kv_args.sizes("PagedKVCache.store", (layer, "layer"), low=0, high=self.num_layers - 1)
        store_kv(key, value, self.key_caches[layer], self.value_caches[layer], slot_mapping, num_tokens)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
    """Write token t's ``key[t], value[t]: [H, D]`` into row ``slot % block_size`` of block ``slot //
    block_size`` of ``k_cache, v_cache: [num_blocks, block_size, H, D]`` (vLLM's ``reshape_and_cache``;
    docs/kv_cache.md section 1), ``slot = slot_mapping[t]`` (``int64`` or ``int32[T]``), for ``t <
    num_tokens[0]`` (``int32[1]`` on the device; all T without it). All four of one float dtype: as
    vLLM's ``reshape_and_cache``, nothing is cast. A negative slot, or one past the cache, writes
    nothing. One launch, no host sync. Raises ArgumentTypeError / InvalidArgumentError (shapes,
    dtypes, devices, caches sharing memory with each other or with an input; checked on the host from
    the shapes) before anything is written."""
    op = "store_kv"
    kv_args.float_tensors(op, 4, (k_cache, "k_cache"), (v_cache, "v_cache"))
    kv_args.float_tensors(op, 3, (key, "key"), (value, "value"), device=k_cache.device)
    kv_args.same_dtype(op, (key, "key"), (value, "value"), (k_cache, "k_cache"), (v_cache, "v_cache"))
    if key.shape[1:] != k_cache.shape[2:]:
        raise InvalidArgumentError(op, f"key and value must both be [T, H, D] with [H, D] = {tuple(k_cache.shape[2:])}, "
                                       f"got {tuple(key.shape)}")
    if k_cache.device.type == "meta":
        raise InvalidArgumentError(op, "the caches are on the meta device, which holds no memory to write")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InvalidArgumentError(op, "k_cache and v_cache must be contiguous")
    kv_args.index_tensor(op, slot_mapping, "slot_mapping", k_cache.device, (key.shape[0],), at_least=True)
    inputs = [(key, "key"), (value, "value"), (slot_mapping, "slot_mapping")]
    if num_tokens is not None:
        kv_args.tensor(op, num_tokens, "num_tokens")
        if num_tokens.dtype != torch.int32 or num_tokens.numel() < 1 or num_tokens.device != k_cache.device:
            raise InvalidArgumentError(op, f"num_tokens must be an int32[1] tensor on {k_cache.device}")
        inputs.append((num_tokens, "num_tokens"))
    check_disjoint(op, [(k_cache, "k_cache"), (v_cache, "v_cache")], inputs)
    launch_store_kv(key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping.contiguous(), num_tokens)


def _check_work(op: str, what: str, size: int, nbytes: int, device) -> None:
    """The allocation bound of the reference attention's temporaries (``kv_args.fits``)."""
    kv_args.fits(op, what, size, nbytes, device)


def _attention_bytes(B: int, Sq: int, Hq: int, D: int, L: int, itemsize: int) -> int:
    """What :func:`attention` allocates for ``B`` lanes of ``L`` keys: K and V repeated to the query
    heads, and the scores and weights ``[B, Hq, Sq, L]``."""
    return (2 * B * L * Hq * D + 2 * B * Hq * Sq * L) * itemsize


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention over contiguous, padded K/V: ``q: [B, Sq, Hq, D]``, ``k, v: [B,
    L, Hk, D]`` (``Hq`` a multiple of ``Hk``), ``seq_lens: int[B]`` tokens of lane b's K/V that count.
    Query j of lane b sits at position ``seq_lens[b] - Sq + j`` and attends to the keys at positions up
    to its own (FlashAttention's ``causal=True`` with a KV cache). A lane with no key gives zeros.
    ``scale``: the softmax scale, a finite real number (default ``1 / sqrt(D)``). Returns ``[B, Sq,
    Hq, D]`` in ``q``'s dtype. Plain torch, fixed shapes, no host sync. Raises ArgumentTypeError /
    InvalidArgumentError (``gpupool.kv_args``: types, shapes, dtypes, devices, the scale, temporaries
    past the free memory) before any work."""
    op = "attention"
    kv_args.float_tensors(op, 4, (q, "q"))
    kv_args.float_tensors(op, 4, (k, "k"), (v, "v"), device=q.device)
    B, Sq, Hq, D = q.shape
    L, Hk = k.shape[1], k.shape[2]
    kv_args.index_tensor(op, seq_lens, "seq_lens", q.device, (B,))
    if k.shape[0] != B or k.shape[3] != D:
        raise InvalidArgumentError(op, f"k and v must be [{B}, L, Hk, {D}] for q {tuple(q.shape)}, got "
                                       f"{tuple(k.shape)}")
    if Hk < 1 or Hq % Hk:
        raise InvalidArgumentError(op, f"{Hq} query heads are not a multiple of {Hk} KV heads")
    scale = kv_args.scale(op, scale, D)
    _check_work(op, "keys per lane", L, _attention_bytes(B, Sq, Hq, D, L, q.dtype.itemsize), q.device)
    return _attend(q, k, v, seq_lens, scale)


def _attend(q, k, v, seq_lens, scale: float) -> torch.Tensor:
    """:func:`attention` of checked arguments."""
    Sq, Hq = q.shape[1], q.shape[2]
    L, Hk = k.shape[1], k.shape[2]
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, dim=2)
        v = v.repeat_interleave(Hq // Hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.to(q.dtype)) * scale
    qpos = seq_lens.to(torch.int64)[:, None] - Sq + torch.arange(Sq, device=q.device)[None, :]  # [B, Sq]
    visible = torch.arange(L, device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, Sq, L]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: zeros, not NaN
    return torch.einsum("bhqk,bkhd->bqhd", p, v.to(q.dtype))


def _check_paged(op: str, q, q_dims: int, k_cache, v_cache, scale) -> float:
    """The checks both paged references share; returns the scale."""
    kv_args.float_tensors(op, q_dims, (q, "q"))
    kv_args.float_tensors(op, 4, (k_cache, "k_cache"), (v_cache, "v_cache"), device=q.device)
    if k_cache.shape[3] != q.shape[-1] or k_cache.shape[2] < 1 or q.shape[-2] % k_cache.shape[2]:
        raise InvalidArgumentError(op, f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}: the head "
                                       "dims must agree and the query heads be a multiple of the KV heads")
    return kv_args.scale(op, scale, q.shape[-1])


def _paged_bytes(q, k_cache, B: int, Sq: int, P: int) -> int:
    """What a paged reference allocates for ``B`` lanes of ``P`` pages: page ids and masks, the
    gathered K and V, then :func:`attention`'s temporaries."""
    _, bs, Hk, D = k_cache.shape
    L = P * bs
    return 4 * 8 * B * P + 8 * P + 2 * B * L * Hk * D * k_cache.dtype.itemsize \
        + _attention_bytes(B, Sq, q.shape[-2], D, L, q.dtype.itemsize)


def _check_read(op: str, q, bad: torch.Tensor, what: str) -> None:
    """On a CPU, where reading the views costs no sync, InvalidArgumentError when any of ``bad``
    holds (a page id or a length the real kernels would read out of bounds); on a GPU the values are
    not read (no host sync: the caller's to keep in range, as with the real kernels)."""
    if q.device.type == "cpu":
        with reads_not_synced():
            found = bool(bad.any())
        if found:
            raise InvalidArgumentError(op, what)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache: [num_blocks, bs, H, D]`` read through ``pages: int[B, P]`` (block ids): ``[B, P * bs, H, D]``."""
    B, P = pages.shape
    return cache[pages.long()].reshape(B, P * cache.shape[1], *cache.shape[2:])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seqused_k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FlashAttention's ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqused_k,
    block_table=block_table, causal=True)`` in plain torch: ``q: [B, Sq, Hq, D]``, caches ``[num_blocks,
    bs, Hk, D]``, ``block_table: int32[B, M]``, ``seqused_k: int32[B]``; only the first
    ``ceil(seqused_k[b] / bs)`` entries of a row are read. Returns ``[B, Sq, Hq, D]``. Raises
    InvalidArgumentError / ArgumentTypeError (``gpupool.kv_args``) for wrong types, shapes, dtypes,
    devices, scale or temporaries past the free memory, and on a CPU for a read block id outside the
    cache or a length past the row (docs/kv_cache.md section 3; on a GPU those are not read)."""
    op = "paged_attention"
    scale = _check_paged(op, q, 4, k_cache, v_cache, scale)
    B, Sq = q.shape[0], q.shape[1]
    kv_args.index_tensor(op, block_table, "block_table", q.device, (B, 0), at_least=True)
    kv_args.index_tensor(op, seqused_k, "seqused_k", q.device, (B,))
    block_table = block_table[:B]  # rows past the batch are not read
    M, bs = block_table.shape[1], k_cache.shape[1]
    _check_work(op, "blocks per row", M, _paged_bytes(q, k_cache, B, Sq, M), q.device)
    read = torch.arange(M, device=q.device)[None, :] < (seqused_k.long()[:, None] + bs - 1) // bs  # [B, M]
    _check_read(op, q, (seqused_k < 0) | (seqused_k.long() > M * bs),
                f"a length in seqused_k is negative or passes the {M * bs} tokens of a row")
    _check_read(op, q, read & ((block_table < 0) | (block_table >= k_cache.shape[0])),
                f"block_table reads a block outside the cache's 0..{k_cache.shape[0] - 1}")
    pages = torch.where(read, block_table.long(), 0)
    return _attend(q, gather_pages(k_cache, pages), gather_pages(v_cache, pages), seqused_k, scale)


def flashinfer_pages(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                     max_pages: int, page_size: int):
    """FlashInfer's paged layout read back for ``B`` lanes (``kv_indptr: int[B + 1]``,
    ``kv_last_page_len: int[B]``, ``kv_indices: int[n]``): ``(pages:
    int64[B, max_pages], lengths: int64[B], read: bool[B, max_pages], index: int64[B, max_pages])``,
    lane b's pages ``kv_indices[kv_indptr[b] + j]`` (0 past its pages), its length as FlashInfer's
    ``paged_kv_t::get_length`` reads it (``(pages - 1) * page_size + kv_last_page_len``, 0 for a lane
    without pages whatever its ``kv_last_page_len``), which entries are pages and where in ``kv_indices``
    they are. An
    empty ``kv_indices`` (no lane has a page) reads nothing. Arguments checked by the caller."""
    B = kv_last_page_len.shape[0]  # kv_indptr: [B + 1]
    start = kv_indptr[:B].long()
    npages = kv_indptr[1:B + 1].long() - start
    j = torch.arange(max_pages, device=kv_indptr.device)[None, :]
    read = j < npages[:, None]
    n = kv_indices.shape[0]
    index = torch.where(read, start[:, None] + j, n)  # n: the padding entry below
    padded = torch.cat([kv_indices.long(), kv_indices.new_zeros(1, dtype=torch.int64)])
    pages = padded[index.clamp(0, n)]
    lengths = torch.where(npages > 0, (npages - 1) * page_size + kv_last_page_len[:B].long(), 0)
    return pages, lengths, read, index


def paged_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                               max_pages: int, scale: float | None = None) -> torch.Tensor:
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD layout) in plain torch:
    ``q: [B, Hq, D]`` (one query per lane, the newest token), ``kv_indptr: int32[B + 1]``,
    ``kv_indices: int32[>= kv_indptr[B]]`` (empty when no lane has a page), ``kv_last_page_len:
    int32[B]`` (``1..page_size``; not read for a lane without pages, which gives zeros); ``max_pages`` bounds the pages of a lane
    (fixed shapes: the block table's width). Returns ``[B, Hq, D]``. Raises InvalidArgumentError /
    ArgumentTypeError (``gpupool.kv_args``) for wrong types, shapes, dtypes, devices, scale, a
    ``max_pages`` below 0 or temporaries past the free memory, and on a CPU for a page or
    ``kv_indptr`` entry the real kernel would read out of bounds, or a lane with more than
    ``max_pages`` pages (docs/kv_cache.md section 3; on a GPU those are not read)."""
    op = "paged_attention_flashinfer"
    scale = _check_paged(op, q, 3, k_cache, v_cache, scale)
    B = q.shape[0]
    (max_pages,) = kv_args.sizes(op, (max_pages, "max_pages"), low=0, high=2**62)
    kv_args.index_tensor(op, kv_indptr, "kv_indptr", q.device, (B + 1,), at_least=True)
    kv_args.index_tensor(op, kv_indices, "kv_indices", q.device, (0,), at_least=True)
    kv_args.index_tensor(op, kv_last_page_len, "kv_last_page_len", q.device, (B,), at_least=True)
    _check_work(op, "max_pages", max_pages, _paged_bytes(q, k_cache, B, 1, max_pages), q.device)
    bs = k_cache.shape[1]
    pages, seq, read, index = flashinfer_pages(kv_indptr[:B + 1], kv_indices, kv_last_page_len[:B], max_pages, bs)
    npages = kv_indptr[1:B + 1].long() - kv_indptr[:B].long()
    last = kv_last_page_len[:B]
    _check_read(op, q, npages > max_pages, f"a lane has more than max_pages = {max_pages} pages")
    _check_read(op, q, (npages > 0) & ((last < 1) | (last > bs)),
                f"kv_last_page_len must be in 1..{bs} for a lane with pages")
    _check_read(op, q, read & ((index < 0) | (index >= kv_indices.shape[0])),
                f"kv_indptr points outside kv_indices' {kv_indices.shape[0]} entries")
    _check_read(op, q, read & ((pages < 0) | (pages >= k_cache.shape[0])),
                f"kv_indices holds a block outside the cache's 0..{k_cache.shape[0] - 1}")
    return _attend(q[:, None], gather_pages(k_cache, pages), gather_pages(v_cache, pages), seq, scale)[:, 0]


__all__ = ["AttentionViews", "PagedKVCache", "store_kv", "attention", "gather_pages", "flashinfer_pages",
           "paged_attention", "paged_attention_flashinfer"]
