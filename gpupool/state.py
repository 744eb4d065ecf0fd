"""The device pool's state: one ``PoolState`` of tensors, all allocated at construction (DESIGN.md).

With N blocks, MK = ``max_keys_per_block``, ring capacity C (power of two >= 2N), NCHUNK table
chunks of 16 slots (power of two, >= 2 * N * MK / 16):

| tensor | dtype, shape | meaning |
|---|---|---|
| ``ctrl`` | int64[16] | head, tail (ring positions), num_free, key seq, event / reuse counts, ... (kernels/common.py) |
| ``status`` | int64[4] | sticky first error: (code, op, offending value, 0); 0 = clear |
| ``ref_cnt`` | int32[N] | reference counts |
| ``ring`` | int32[C] | free queue: block id or -1 (tombstone) per slot |
| ``qslot`` | int32[N] | each queued block's ring slot, else -1 |
| ``num_keys`` | int32[N] | keys per block (primary + secondaries) |
| ``hash_ntok`` | int32[N] | tokens covered by the primary key, -1 when none |
| ``keys`` | int64[N*MK, 5] | key rows (hi, lo, group, insertion seq, table slot); row ``b*MK + j`` |
| ``table`` | int64[NCHUNK*16 + 1] | slot words ``(tag << 32) | (entry + 1)``, 0 empty; last word a CAS sink |
| ``overflow`` | int32[NCHUNK] | entries that probed past each chunk |
| ``watcher_id`` | int32[N] | reuse watcher (index into the host's callback table) or -1 |
| ``watch_seq`` | int64[N] | watcher registration order |
| ``reuse`` | int64[REUSE_CAP, 3] | reuse log (block, watcher, seq), drained by the host |
| ``ev`` | int64[EV_CAP, 7] | event buffer (kind, block, hi, lo, group, op tag, aux), drained by the host |
| ``s_cnt, s_last, s_first`` | int32[N] | kernel scratch, idle at 0 / -1 / 2**31-1 between launches |

Bytes per block: metadata 40 (six int32 fields, watch_seq) + ring 8 (C = 2N) = 48; key rows 40 * MK;
table 8 * 2 * MK (+ overflow); reuse log 24; event buffer 112 * (MK + 1) only with KV events on.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .kernels.common import CTRL_SIZE

BIG = 2**31 - 1


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass
class PoolState:
    num_blocks: int
    max_keys_per_block: int
    ring_capacity: int
    num_chunks: int
    ev_capacity: int
    reuse_capacity: int
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
    watcher_id: torch.Tensor
    watch_seq: torch.Tensor
    reuse: torch.Tensor
    ev: torch.Tensor
    s_cnt: torch.Tensor
    s_last: torch.Tensor
    s_first: torch.Tensor

    @classmethod
    def allocate(cls, num_blocks: int, max_keys_per_block: int, device, *, ring_capacity: int | None = None,
                 num_chunks: int | None = None, events: bool = False) -> "PoolState":
        """Tensors for ``num_blocks`` blocks, initial queue ``[1, ..., N-1]`` (block 0 is the null block).

        ``ring_capacity`` (power of two >= 2N) and ``num_chunks`` (power of two) may be set smaller for
        tests of compaction and of a nearly full table. ``events``: size the event buffer for KV events.
        """
        n, mk = num_blocks, max_keys_per_block
        c = ring_capacity or _pow2_at_least(max(2 * n, 2))
        nch = num_chunks or _pow2_at_least(max(2 * n * mk // 16, 1))
        # One batched op pops at most 2N blocks (N free plus N freed inside it) and stores a key for
        # at most as many: 2N(MK + 1) events. Without events the buffer is a stub.
        ev_cap = 2 * n * (mk + 1) + 16 if events else 16
        # Watchers are registered only by unpin (a single op, which drains), one per block: < N entries.
        reuse_cap = n + 16
        i32, i64 = torch.int32, torch.int64
        ctrl = torch.zeros(CTRL_SIZE, dtype=i64, device=device)
        ctrl[1] = n - 1  # tail
        ctrl[2] = n - 1  # num_free
        ring = torch.full((c,), -1, dtype=i32, device=device)
        ring[: n - 1] = torch.arange(1, n, dtype=i32, device=device)
        qslot = torch.full((n,), -1, dtype=i32, device=device)
        qslot[1:] = torch.arange(0, n - 1, dtype=i32, device=device)
        return cls(
            num_blocks=n, max_keys_per_block=mk, ring_capacity=c, num_chunks=nch,
            ev_capacity=ev_cap, reuse_capacity=reuse_cap,
            ctrl=ctrl, status=torch.zeros(4, dtype=i64, device=device),
            ref_cnt=torch.zeros(n, dtype=i32, device=device), ring=ring, qslot=qslot,
            num_keys=torch.zeros(n, dtype=i32, device=device),
            hash_ntok=torch.full((n,), -1, dtype=i32, device=device),
            keys=torch.zeros((n * mk, 5), dtype=i64, device=device),
            table=torch.zeros(nch * 16 + 1, dtype=i64, device=device),
            overflow=torch.zeros(nch, dtype=i32, device=device),
            watcher_id=torch.full((n,), -1, dtype=i32, device=device),
            watch_seq=torch.zeros(n, dtype=i64, device=device),
            reuse=torch.zeros((reuse_cap, 3), dtype=i64, device=device),
            ev=torch.zeros((ev_cap, 7), dtype=i64, device=device),
            s_cnt=torch.zeros(n, dtype=i32, device=device),
            s_last=torch.full((n,), -1, dtype=i32, device=device),
            s_first=torch.full((n,), BIG, dtype=i32, device=device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def metadata_bytes(self) -> dict[str, int]:
        """Bytes of device memory: per-block metadata, key rows + table, buffers."""
        t = self.tensors()
        size = {k: v.numel() * v.element_size() for k, v in t.items()}
        keyed = size["keys"] + size["table"] + size["overflow"]
        buffers = size["reuse"] + size["ev"]
        return {"metadata": sum(size.values()) - keyed - buffers, "keys_and_table": keyed, "buffers": buffers}
