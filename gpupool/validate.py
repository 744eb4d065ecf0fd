"""``BlockPool.validate()``: runs the device check (``kernels/validate.py``) and raises the first
violation as an InvariantError with a readable message (SPEC.md section 1; DESIGN-NOTES.md 1 and 4)."""
from __future__ import annotations

import torch

from .errors import InvariantError
from .kernels import validate as k_validate

CHECKS = {
    1: "the ring's live window [head, tail) is negative or longer than the ring (R1); length",
    2: "a ring slot in the live window holds a bad id or one whose qslot points elsewhere (R2); slot",
    3: "num_free differs from the live ring slots (R4); num_free",
    4: "the null block is queued or has keys; block 0",
    5: "a ref count is below zero; block",
    6: "a block is queued but held, or free but not queued (R3); block",
    7: "a queued block's qslot is outside the live window or its slot holds another id (R3, R5); block",
    8: "a block has more keys than max_keys_per_block; block",
    9: "a block's keys and hash_num_tokens disagree; block",
    10: "a key row's table slot does not point back to it; block",
    11: "a block has the same key twice; block",
    12: "the table holds a different number of entries than the key rows (or its CAS sink was written); entries",
    13: "a chunk's overflow count differs from the probe paths through it; chunk",
    14: "a block has keys while caching is disabled; block",
}


def validate_state(pool) -> None:
    s = pool.state
    out = torch.zeros(2, dtype=torch.int64, device=pool.device)
    s_ovf = torch.zeros(s.num_chunks, dtype=torch.int32, device=pool.device)
    k_validate.validate_kernel[(1,)](s.ctrl, s.ring, s.qslot, s.ref_cnt, s.num_keys, s.hash_ntok, s.keys, s.table,
                                     s.overflow, s_ovf, out, N=pool.num_blocks, C=s.ring_capacity,
                                     MK=pool.max_keys_per_block, NCHUNK=s.num_chunks, CACHING=pool.enable_caching,
                                     BLOCK=pool._block, num_warps=pool._warps)
    code, value = out.tolist()
    if code:
        raise InvariantError("validate", f"{CHECKS.get(code, f'check {code}')} {value}", value)
