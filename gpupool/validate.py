"""``BlockPool.validate()``: runs the device check (``kernels/validate.py``) and raises the first
violation as an InvariantError with a readable message (docs/semantics.md section 1; docs/algorithms.md
sections 1 and 4)."""
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
    12: "the table holds a different number of entries than the key rows; entries",
    13: "a chunk's overflow count differs from the probe paths through it; chunk",
    14: "a block has keys while caching is disabled; block",
}


def validate_pool(pool) -> None:
    """Raise InvariantError naming the first failed check of ``pool``'s device state."""
    out = torch.zeros(2, dtype=torch.int64, device=pool.device)
    s_ovf = torch.zeros(pool.config.NCHUNK, dtype=torch.int32, device=pool.device)
    k_validate.launch_validate(pool.state, pool.config, s_ovf, out)
    code, value = out.tolist()
    if code:
        raise InvariantError("validate", f"{CHECKS.get(code, f'check {code}')} {value}", value)
