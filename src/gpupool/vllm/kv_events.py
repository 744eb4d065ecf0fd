"""KV cache events on vLLM 0.33's wire (``vllm/distributed/kv_events.py``), converted from gpupool's.

The Struct classes below copy vLLM 0.33's field names, types, order, defaults and Struct options
(``EventBatch``: ``array_like=True, omit_defaults=True, gc=False``; events: ``omit_defaults=True,
gc=False, tag=True``, so each event is a msgpack map tagged ``"type": "<class name>"`` and a batch is
the array ``[ts, [events], data_parallel_rank]``). tests/vllm_plugin/test_vllm_events.py checks the msgpack bytes
equal vLLM's own classes' for the events of a real pool op sequence.

Mapping gpupool event (``gpupool.events``, from ``BlockPool.take_events()``) -> vLLM wire event:

=============================  =================================================================
gpupool                        vLLM 0.33 wire
=============================  =================================================================
``BlockStored.block_hashes``   ``block_hashes``: each hash through :func:`wire_block_hash`, as
  (bytes)                      vLLM's ``maybe_convert_block_hash``: with
                               ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (vLLM's default ``1``) the
                               int ``int.from_bytes(h, "big") & (2**64 - 1)``, else the bytes.
``parent_block_hash``          ``parent_block_hash``: same conversion; None stays None (first block
                               of a request).
``block_size``                 ``block_size`` (tokens; for ``cache_partial_block`` the hash block
                               size, the span of the one hash block stored, as vLLM's event has it:
                               ``num_tokens - (num_tokens // hbs - 1) * hbs`` with ``num_tokens`` a
                               multiple of ``hbs``).
``group_id``                   ``group_idx`` (the KV-cache group).
``BlockRemoved(hash, group)``  ``BlockRemoved(block_hashes=[wire hash], medium, group_idx=group)``,
                               one event per removed key, as vLLM emits them.
``AllBlocksCleared()``         ``AllBlocksCleared()`` (encodes as ``{"type": "AllBlocksCleared"}``).
=============================  =================================================================

What gpupool cannot know (it sees block ids and hashes, never a ``Request``) and sends as vLLM's
default or None: ``token_ids`` is ``[]`` unless the caller passes ``token_ids=`` (a function of the
gpupool ``BlockStored``); ``lora_id`` / ``lora_name`` None (no LoRA); ``extra_keys`` one None per
stored block, which is what vLLM's ``to_event_extra_keys`` publishes for blocks without LoRA /
multimodal / cache-salt keys (so not the field's default None); ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` /
``locality`` / ``ownership`` / ``session_id`` / ``lookahead_token_ids`` None (omitted on the wire).
``medium`` is ``"GPU"`` (vLLM's ``BlockPool`` default) unless given. vLLM also emits BlockStored
for blocks reused from the prefix cache (``emit_cached_block_events``); gpupool's pool has no such
event, so neither does this wire.
"""

import os
from collections.abc import Callable, Iterable
from typing import Any, Union

import msgspec

from .. import events as _gp

# vLLM 0.33: vllm/v1/core/kv_cache_utils.py `ExternalBlockHash: TypeAlias = bytes | int`
ExternalBlockHash = Union[bytes, int]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int_block_hashes_default() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (vllm/envs.py: ``bool(int(os.getenv(..., "1")))``)."""
    return bool(int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def wire_block_hash(block_hash: bytes, int_block_hashes: bool | None = None) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the big-endian int, or the bytes.

    ``int_block_hashes`` None reads ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` as vLLM does.
    """
    if int_block_hashes is None:
        int_block_hashes = int_block_hashes_default()
    if not int_block_hashes:
        return bytes(block_hash)
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


def to_vllm_events(events: Iterable, *, medium: str | None = MEDIUM_GPU, int_block_hashes: bool | None = None,
                   token_ids: Callable[[_gp.BlockStored], list[int]] | None = None) -> list[KVCacheEvent]:
    """gpupool's events (``gpupool.events``, in order) -> vLLM 0.33 wire events (mapping: module doc).

    Raises TypeError for an object that is not a gpupool event.
    """
    if int_block_hashes is None:
        int_block_hashes = int_block_hashes_default()

    def h(x):
        return None if x is None else wire_block_hash(x, int_block_hashes)

    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, _gp.BlockStored):
            out.append(BlockStored(
                block_hashes=[h(x) for x in e.block_hashes], parent_block_hash=h(e.parent_block_hash),
                token_ids=list(token_ids(e)) if token_ids is not None else [], block_size=e.block_size,
                lora_id=None, medium=medium, lora_name=None, extra_keys=[None] * len(e.block_hashes),
                group_idx=e.group_id))
        elif isinstance(e, _gp.BlockRemoved):
            out.append(BlockRemoved(block_hashes=[h(e.block_hash)], medium=medium, group_idx=e.group_id))
        elif isinstance(e, _gp.AllBlocksCleared):
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"not a gpupool KV event: {e!r}")
    return out
