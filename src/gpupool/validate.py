"""``BlockPool.validate()``: runs the device check (``kernels/validate.py``) and raises the first
violation as an InvariantError with a readable message (docs/semantics.md section 1; docs/algorithms.md
sections 1 and 4)."""
from __future__ import annotations

import torch

from .errors import InvariantError
from . import _backend

_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels import validate as k_validate
from .kernels.validate import Check

CHECKS = {
    Check.WINDOW: "the ring's live window [head, tail) is negative or longer than the ring (R1); length",
    Check.RING_SLOT: "a ring slot in the live window holds a bad id or one whose qslot points elsewhere (R2); slot",
    Check.NUM_FREE: "num_free differs from the live ring slots (R4); num_free",
    Check.NULL: "the null block is queued or has keys; block 0",
    Check.REF_NEG: "a ref count is below zero; block",
    Check.QUEUED_IFF_FREE: "a block is queued but held, or free but not queued (R3); block",
    Check.QSLOT: "a queued block's qslot is outside the live window or its slot holds another id (R3, R5); block",
    Check.NUM_KEYS: "a block has more keys than max_keys_per_block; block",
    Check.NTOK: "a block's keys and hash_num_tokens disagree; block",
    Check.KEY_SLOT: "a key row's table slot does not point back to it; block",
    Check.DUP_KEY: "a block has the same key twice; block",
    Check.TABLE_COUNT: "the table holds a different number of entries than the key rows; entries",
    Check.OVERFLOW: "a chunk's overflow count differs from the probe paths through it; chunk",
    Check.CACHING_OFF: "a block has keys while caching is disabled; block",
}


def validate_pool(pool) -> None:
    """Raise InvariantError naming the first failed check of ``pool``'s device state."""
    out = torch.zeros(2, dtype=torch.int64, device=pool.device)
    s_ovf = torch.zeros(pool.config.NCHUNK, dtype=torch.int32, device=pool.device)
    k_validate.launch_validate(pool.state, pool.config, s_ovf, out)
    code, value = out.tolist()
    if code:
        raise InvariantError("validate", f"{CHECKS.get(code, f'check {code}')} {value}", value)
