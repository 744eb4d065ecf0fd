"""The KV consumer's device ops as ``torch.library`` custom ops (docs/kv_cache.md section 5), so that
``torch.compile`` and CUDA-graph capture see them as the mutations they are (FlashInfer registers its
``append_paged_kv_cache`` the same way):

* ``torch.ops.gpupool.store_kv(key, value, k_cache, v_cache, slot_mapping, num_tokens=None)``: mutates
  ``k_cache`` and ``v_cache``; :func:`gpupool.kv_cache.store_kv`.
* ``torch.ops.gpupool.attention_views(manager_id, slots, base_len, num_reqs, admitted, group,
  block_table, seqused_k, kv_indptr, kv_indices, kv_last_page_len)``: mutates the five views;
  ``KVCacheManager.attention_views`` of the manager :func:`manager_id` names (an op's arguments are
  tensors and numbers, so a manager is passed by its id).

Both return nothing; their fake (meta) versions do nothing, their errors are the eager functions'.
An argument of the wrong Python type (a list for a tensor, an int past int64) is refused by torch's
dispatcher, which raises RuntimeError naming the schema, before the op runs. Importing this module
registers them.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from .errors import ArgumentTypeError, InvalidArgumentError
from .kv_cache import AttentionViews, store_kv as _store_kv

_MANAGERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def manager_id(manager) -> int:
    """The id under which :func:`attention_views` finds ``manager`` (given once per manager; the
    manager is held weakly: a collected manager's id is refused). Raises ArgumentTypeError for anything
    but a :class:`gpupool.manager.KVCacheManager` (one with device ``state`` and ``attention_views``:
    this layer does not import the manager's)."""
    if not (hasattr(manager, "state") and callable(getattr(manager, "attention_views", None))):
        raise ArgumentTypeError("manager_id", f"manager must be a KVCacheManager, got {type(manager).__name__}")
    mid = getattr(manager, "_custom_op_id", None)
    if mid is None:
        mid = next(_IDS)
        manager._custom_op_id = mid
        _MANAGERS[mid] = manager
    return mid


@torch.library.custom_op("gpupool::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
    _store_kv(key, value, k_cache, v_cache, slot_mapping, num_tokens)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, num_tokens=None) -> None:
    return None


@torch.library.custom_op("gpupool::attention_views",
                         mutates_args=("block_table", "seqused_k", "kv_indptr", "kv_indices", "kv_last_page_len"))
def attention_views(manager_id: int, slots: torch.Tensor, base_len: torch.Tensor, num_reqs: torch.Tensor | None,
                    admitted: torch.Tensor | None, group: int, block_table: torch.Tensor, seqused_k: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor) -> None:
    manager = _MANAGERS.get(manager_id)
    if manager is None:
        raise InvalidArgumentError("attention_views", f"no live manager has id {manager_id} (gpupool.ops.manager_id)",
                                   manager_id)
    manager.attention_views(slots, base_len, num_reqs, admitted, group,
                            out=AttentionViews(block_table, seqused_k, kv_indptr, kv_indices, kv_last_page_len))


@attention_views.register_fake
def _(manager_id, slots, base_len, num_reqs, admitted, group, block_table, seqused_k, kv_indptr, kv_indices,
      kv_last_page_len) -> None:
    return None


__all__ = ["store_kv", "attention_views", "manager_id"]
