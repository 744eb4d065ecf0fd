"""How the device manager words the errors its request-level kernels record (docs/errors.md, "The
status word"): by (op, cause) with the offending slot, count, token count or position named, in the
reference manager's words for the same fault (``gpupool.errors``' message functions, which both
managers use), so a device error and a reference error compare equal as text.

A kernel records ``(code, op, value, cause, extra, limit)`` (``kernels/layout.py`` Status, Cause); the
pool raises what :func:`recorded_error` returns for it, or its own wording when this returns None
(a pool op, or a record without a cause). The values a message needs beyond the record (a slot's
``num_computed`` or row length) are read when the error is raised: the failed op, and every op
skipped after it, changed nothing.
"""
from __future__ import annotations

from collections.abc import Callable

from .args import ManagerShape
from .errors import (
    ErrorCode, InvalidArgumentError, InvalidCountError, PoolError, position_message, slot_range_message,
    slot_twice_message, slot_use_message, token_count_message,
)
from .kernels.layout import Cause

#: The name of each op's device count, as its keyword argument (``num_reqs``, ``slot_mapping``'s ``num``).
COUNT_NAMES = {"slot_mapping": "num"}
#: Ops whose token counts start at 1 (the newest token sits at ``num_tokens - 1``) and whose kernels
#: record the count's slot and upper bound (a window's row less its lookahead while steps follow).
STEP_OPS = ("window_begin", "window_step", "window_end", "admit", "append_tokens")


def recorded_error(shape: ManagerShape, read: Callable[[str, int], int], code: int, op: str, value: int,
                   cause: int, extra: int, limit: int = 0) -> PoolError | None:
    """The exception for a manager op's status record, or None (no cause: the pool words it).
    ``read(name, slot)``: the manager's ``num_computed`` / ``num_blocks`` of a slot, read now;
    ``limit``: the record's bound (``Status.LIMIT``), which a step op's token count passed."""
    try:
        cause = Cause(cause)
    except ValueError:
        return None
    if code == ErrorCode.INVALID_COUNT and cause == Cause.TOKEN_COUNT:
        cap = shape.max_tokens
        if op == "reserve":  # the room left in the slot's row
            return InvalidCountError(op, token_count_message(value, 0, cap - read("num_computed", extra), extra), value)
        if op in STEP_OPS:  # the bound the kernel knew (the lookahead D is the window's), and the slot
            return InvalidCountError(op, token_count_message(value, 1, limit, extra), value)
        return InvalidCountError(op, token_count_message(value, 0, cap), value)
    if code == ErrorCode.INVALID_COUNT and cause == Cause.ACCEPTED_COUNT:
        return InvalidCountError(op, f"slot {extra}'s lane accepted {value} tokens; a pass gives 1 .. D + 1", value)
    if code == ErrorCode.INVALID_ARG and cause == Cause.TOKEN_ID:
        return InvalidArgumentError(op, f"token id {value} of slot {extra} is outside int32", value)
    if code != ErrorCode.INVALID_ARG:
        return None
    if cause == Cause.SLOT_OUT_OF_RANGE:
        msg = slot_range_message(value, shape.max_num_reqs)
    elif cause == Cause.SLOT_NOT_IN_USE:
        msg = slot_use_message(value)
    elif cause == Cause.SLOT_IN_USE:
        msg = slot_use_message(value, active=False)
    elif cause == Cause.SLOT_LISTED_TWICE:
        msg = slot_twice_message(value)
    elif cause == Cause.COUNT_PAST_ARRAYS:
        msg = f"{COUNT_NAMES.get(op, 'num_reqs')} {value} is outside 0..{extra}, the length of its arrays"
    elif cause == Cause.FINISHED_PAST_ARRAYS:
        msg = f"num_finished {value} is outside 0..{extra}, the length of finished"
    elif cause == Cause.POSITION_OUTSIDE_ROW:
        msg = position_message(value, extra)
    elif cause == Cause.LENGTH_OUTSIDE_ROW:
        msg = f"length {value} of slot {extra} is outside 0..{read('num_blocks', extra) * shape.block_size}, its row"
    else:
        return None
    return InvalidArgumentError(op, msg, value)
