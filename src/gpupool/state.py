"""The device pool's state: one ``PoolState`` of tensors and one ``PoolConfig`` of sizes, both made at
construction (docs/design.md, device state). Kernels take the state as ONE argument and the config
as ONE ``tl.constexpr`` argument.

With N blocks, MK = ``max_keys_per_block``, ring capacity C (power of two >= 2N), NCHUNK table
chunks of CHUNK_SLOTS = 16 slots (power of two, 16 * NCHUNK >= (N - 1) * MK) and EV_CAP event rows
(every width below is named in ``kernels/layout.py``):

| tensor | dtype, shape | meaning |
|---|---|---|
| ``ctrl`` | int64[CTRL_SIZE = 16] | head, tail, num_free, key seq, event / reuse counts, statistics (Ctrl) |
| ``status`` | int64[STATUS_SIZE = 8] | sticky first error: (code, op, offending value, cause, second value, bound, 0, 0); 0 = clear (Status) |
| ``ref_cnt`` | int32[N] | reference counts |
| ``ring`` | int32[C] | free queue: block id or -1 (tombstone) per slot |
| ``qslot`` | int32[N] | each queued block's ring slot, else -1 |
| ``num_keys`` | int32[N] | keys per block (primary + secondaries) |
| ``hash_ntok`` | int32[N] | tokens covered by the primary key, -1 when none |
| ``keys`` | int64[N*MK, KEY_WIDTH = 5] | key rows (KeyCol: hi, lo, group, insertion seq, table slot), ``b*MK + j`` |
| ``table`` | int64[NCHUNK*CHUNK_SLOTS + 1] | slot words ``(tag << 32) | (entry + 1)``, 0 empty; last word a CAS sink |
| ``overflow`` | int32[NCHUNK] | entries that probed past each chunk |
| ``watched`` | int8[N] | 1 while the block has a reuse watcher (the callbacks live on the host) |
| ``reuse`` | int32[N] | reuse log: watched blocks handed out since the host last drained |
| ``ev`` | int64[EV_CAP, EVENT_WIDTH = 6] | event rows (Event, EventCol), drained by the host |
| ``s_cnt, s_last, s_first`` | int32[N] | kernel scratch, idle at 0 / -1 / 2**31-1 between launches |

Bytes per block: metadata 33 (eight int32 fields and ``watched``) + ring 8 (C = 2N) = 41; key rows
40 * MK; table 16 * MK (+ overflow); events 48 per row, EV_CAP rows only with KV events on.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels.layout import CHUNK_SLOTS, CTRL_SIZE, EVENT_WIDTH, INT32_MAX, KEY_WIDTH, STATUS_SIZE, Ctrl

#: Event rows a pool keeps by default with KV events on (3 MiB): room for many decode steps of a
#: large batch between drains (a step of 1,024 requests writes about 200).
DEFAULT_EVENT_CAPACITY = 65536


def pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


class PoolState(NamedTuple):
    """The device tensors of one pool (table in the module docstring)."""

    ctrl: torch.Tensor
    status: torch.Tensor
    ref_cnt: torch.Tensor
    ring: torch.Tensor
    qslot: torch.Tensor
    num_keys: torch.Tensor
    hash_ntok: torch.Tensor
    keys: torch.Tensor
    table: torch.Tensor
    overflow: torch.Tensor
    watched: torch.Tensor
    reuse: torch.Tensor
    ev: torch.Tensor
    s_cnt: torch.Tensor
    s_last: torch.Tensor
    s_first: torch.Tensor


class PoolConfig(NamedTuple):
    """Sizes and switches of one pool, a ``tl.constexpr`` argument of every kernel.

    ``N`` blocks, ring capacity ``C``, ``MK`` keys per block (``MKP``: next power of two), ``NCHUNK``
    table chunks, ``CACHING`` / ``EVENTS`` switches, ``EV_CAP`` event rows, ``BLOCK`` lanes per tile of
    the kernels that walk block lists (launchers may pass a copy with another ``BLOCK``)."""

    N: int
    C: int
    MK: int
    MKP: int
    NCHUNK: int
    CACHING: bool
    EVENTS: bool
    EV_CAP: int
    BLOCK: int


def make_config(num_blocks: int, max_keys_per_block: int, *, caching: bool, events: bool,
                ring_capacity: int | None = None, num_chunks: int | None = None,
                event_capacity: int | None = None) -> PoolConfig:
    n, mk = num_blocks, max_keys_per_block
    return PoolConfig(
        N=n, C=ring_capacity or pow2_at_least(max(2 * n, 2)), MK=mk, MKP=pow2_at_least(mk),
        NCHUNK=num_chunks or pow2_at_least(max(2 * n * mk // CHUNK_SLOTS, 1)),
        CACHING=bool(caching), EVENTS=bool(events),
        EV_CAP=(event_capacity or DEFAULT_EVENT_CAPACITY) if events else 1,
        BLOCK=min(1024, max(16, pow2_at_least(n))))


def allocate_state(cfg: PoolConfig, device) -> PoolState:
    """Tensors for ``cfg.N`` blocks, initial queue ``[1, ..., N-1]`` (block 0 is the null block)."""
    n = cfg.N
    i32, i64 = torch.int32, torch.int64
    ctrl = torch.zeros(CTRL_SIZE, dtype=i64, device=device)
    ctrl[Ctrl.TAIL] = n - 1
    ctrl[Ctrl.NUM_FREE] = n - 1
    ring = torch.full((cfg.C,), -1, dtype=i32, device=device)
    ring[: n - 1] = torch.arange(1, n, dtype=i32, device=device)
    qslot = torch.full((n,), -1, dtype=i32, device=device)
    qslot[1:] = torch.arange(0, n - 1, dtype=i32, device=device)
    return PoolState(
        ctrl=ctrl, status=torch.zeros(STATUS_SIZE, dtype=i64, device=device),
        ref_cnt=torch.zeros(n, dtype=i32, device=device), ring=ring, qslot=qslot,
        num_keys=torch.zeros(n, dtype=i32, device=device),
        hash_ntok=torch.full((n,), -1, dtype=i32, device=device),
        keys=torch.zeros((n * cfg.MK, KEY_WIDTH), dtype=i64, device=device),
        table=torch.zeros(cfg.NCHUNK * CHUNK_SLOTS + 1, dtype=i64, device=device),
        overflow=torch.zeros(cfg.NCHUNK, dtype=i32, device=device),
        watched=torch.zeros(n, dtype=torch.int8, device=device),
        reuse=torch.zeros(n, dtype=i32, device=device),
        ev=torch.zeros((cfg.EV_CAP, EVENT_WIDTH), dtype=i64, device=device),
        s_cnt=torch.zeros(n, dtype=i32, device=device),
        s_last=torch.full((n,), -1, dtype=i32, device=device),
        s_first=torch.full((n,), INT32_MAX, dtype=i32, device=device),
    )


def metadata_bytes(state: PoolState) -> dict[str, int]:
    """Bytes of device memory: per-block metadata, key rows + table, event buffer."""
    size = {k: v.numel() * v.element_size() for k, v in state._asdict().items()}
    keyed = size["keys"] + size["table"] + size["overflow"]
    return {"metadata": sum(size.values()) - keyed - size["ev"], "keys_and_table": keyed, "buffers": size["ev"]}
