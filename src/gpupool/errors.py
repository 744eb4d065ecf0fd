"""Typed errors of both pools and managers (docs/errors.md; docs/semantics.md section 3).

Every error derives from :class:`PoolError`, names the op and the offending block id or count, and is
raised only when the pool is exactly as it was before the op (all or nothing). Where Python's own
convention has a base class for the situation, the error derives from it too (``OutOfBlocksError``
is a ``ValueError``, ``ArgumentTypeError`` a ``TypeError``, ``InvalidBlockIdError`` an ``IndexError``).

The device records an error as (code, op, value) in its status word; :data:`ErrorCode` numbers the
classes (``kernels/layout.py`` mirrors them for the kernels) and :meth:`PoolError.from_status`
turns a record into an exception with the message below. The manager's kernels record a cause too,
and ``gpupool.manager_errors`` words those records with the message functions here, which the
reference manager uses as well (docs/errors.md, "The status word").
"""
from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Error codes in the device status word (mirrored as ``tl.constexpr`` in ``kernels/layout.py``)."""

    NONE = 0
    UNKNOWN = 1
    OUT_OF_BLOCKS = 2
    INVALID_COUNT = 3
    INVALID_ID = 4
    NULL_BLOCK = 5
    DOUBLE_FREE = 6
    HASH_CONFLICT = 7
    KEY_CAPACITY = 8
    INVALID_ARG = 9
    INVARIANT = 10
    BUFFER_FULL = 11


class PoolError(Exception):
    """Base of every gpupool error. ``op`` is the operation's name; ``value`` the offending id or count."""

    code = ErrorCode.UNKNOWN
    #: What a device-recorded error of this class says: ``{value}`` names the offending id where the
    #: status word's value is one (a block id for the block errors), else the value follows in brackets.
    device_message = "failed"
    #: Per op name, a more precise message where that op's status value has one meaning (the
    #: reference pool's wording: the duplicate block of ``cache_full_blocks``, the destination of
    #: ``move_block_hashes``); other ops use :attr:`device_message`.
    device_message_by_op: dict[str, str] = {}

    def __init__(self, op: str, message: str, value: int | None = None):
        self.op = op
        self.value = value
        super().__init__(f"{op}: {message}")

    @staticmethod
    def from_status(code: int, op: str, value: int) -> "PoolError":
        """The exception for a device status record ``(code, op name, value)``."""
        cls = ERRORS_BY_CODE.get(code, PoolError)
        msg = cls.device_message_by_op.get(op, cls.device_message)
        return cls(op, msg.format(value=value) if "{value}" in msg else f"{msg} ({value})", value)


def out_of_blocks_message(n: int, num_free: int) -> str:
    """Both pools' words for too few free blocks (vLLM's, with the free count)."""
    return f"cannot get {n} free blocks from the pool ({num_free} free)"


def double_free_message(block: int, verb: str, ref_cnt: int) -> str:
    """Both pools' words for a block released more times than it is referenced (``verb``: freed,
    unpinned)."""
    return f"block {block} {verb} more times than it is referenced (ref_cnt {ref_cnt}): a double free"


def slot_range_message(slot: int, num_slots: int) -> str:
    """Both managers' words for a slot outside ``0 .. max_num_reqs - 1``."""
    return f"slot {slot} out of range 0..{num_slots - 1}"


def slot_use_message(slot: int, active: bool = True) -> str:
    """Both managers' words for a slot not in use (``active``: it had to be) or in use."""
    return f"slot {slot} is {'not ' if active else ''}in use"


def slot_twice_message(slot: int) -> str:
    """Both managers' words for a slot listed twice (named at its first entry)."""
    return f"slot {slot} is listed twice"


def token_count_message(n: int, low: int, high: int, slot: int | None = None) -> str:
    """Both managers' words for a token count outside ``low .. high`` (``slot``: whose room it is)."""
    return f"token count {n} outside {low}..{high}" + ("" if slot is None else f" for slot {slot}")


def pending_copy_message(block: int) -> str:
    """Both managers' words for a copy-on-write source that still waits for its own copy."""
    return f"block {block} still waits for a pending copy; run the pending copies first"


def position_message(position: int, slot: int) -> str:
    """Both managers' words for a ``slot_mapping`` position outside its slot's row."""
    return f"position {position} of slot {slot} has no block"


class OutOfBlocksError(PoolError, ValueError):
    """More blocks asked for than are free (``get_new_blocks``)."""

    code = ErrorCode.OUT_OF_BLOCKS
    device_message = "not enough free blocks for the requested total"


class InvalidCountError(PoolError, ValueError):
    """A negative or otherwise impossible count (``get_new_blocks(-1)``, bad token counts)."""

    code = ErrorCode.INVALID_COUNT
    device_message = "a negative block count or a token count outside the table"
    _TOKENS = "token count {value} is negative or past max_blocks_per_req * block_size"
    device_message_by_op = {
        "get_new_blocks": "cannot allocate a negative number of blocks ({value})",
        "allocate_batched": "demand {value} is negative",
        "allocate_slots": _TOKENS,
        "reserve": "token count {value} is negative or takes its request past max_blocks_per_req * block_size",
        "window_begin": _TOKENS, "window_step": _TOKENS, "window_end": _TOKENS,
        "admit": _TOKENS, "append_tokens": "a token count outside its request's row, or an accepted count outside "
                                           "1 .. D + 1 ({value})",
    }


class InvalidBlockIdError(PoolError, IndexError):
    """A block id outside ``0 .. num_blocks-1``."""

    code = ErrorCode.INVALID_ID
    device_message = "block id {value} out of range"


class NullBlockError(PoolError, ValueError):
    """The null block (id 0) where it is not allowed (``unpin_blocks``, ``move_block_hashes`` target)."""

    code = ErrorCode.NULL_BLOCK
    device_message = "block {value} is the null block, which is not allowed here"


class DoubleFreeError(PoolError, ValueError):
    """A ref-count decrement below zero (``free_blocks``, ``unpin_blocks`` of a free block)."""

    code = ErrorCode.DOUBLE_FREE
    device_message = "block {value} freed more times than it is referenced (double free)"
    device_message_by_op = {"unpin_blocks": "block {value} unpinned more times than it is referenced"}


class HashConflictError(PoolError, ValueError):
    """Re-caching a block at the same or a longer token count, or moving keys onto a hashed block."""

    code = ErrorCode.HASH_CONFLICT
    device_message = "block {value} already cached at >= this many tokens, or already keyed as a destination"
    device_message_by_op = {
        "cache_full_blocks": "block {value} is already cached covering >= this many tokens",
        "move_block_hashes": "destination block {value} already has keys",
    }


class KeyCapacityError(PoolError, RuntimeError):
    """A block would exceed ``max_keys_per_block`` keys."""

    code = ErrorCode.KEY_CAPACITY
    device_message = "block {value} would exceed max_keys_per_block keys"


class InvalidArgumentError(PoolError, ValueError):
    """Mismatched lengths, bad sizes, a slot or block listed twice, a count, offset, slot or position
    read from a device input that does not fit its array, wrong dtype or device of a tensor."""

    code = ErrorCode.INVALID_ARG
    device_message = ("invalid argument: a block or slot listed twice or not in use, or a count, offset, slot "
                      "or position that does not fit its array")
    # a manager op's record without a cause (gpupool/manager_errors.py words the others)
    _SLOTS = ("slot {value} is out of range, not in use (add_request first) or listed twice; or the batch's "
              "count, {value}, is past its arrays")
    device_message_by_op = {
        "cache_full_blocks": "block {value} is listed twice",
        "allocate_slots": _SLOTS, "free": _SLOTS, "reserve": _SLOTS, "release_reservation": _SLOTS,
        "window_begin": _SLOTS, "window_step": _SLOTS, "admit": _SLOTS, "append_tokens": _SLOTS,
        "slot_mapping": ("slot or position {value}: a slot out of range or not in use, or a position outside its "
                         "slot's row; or the count, {value}, is past the arrays"),
    }


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong Python type (``None`` for a hash list, a float for an id, ...)."""


class InvariantError(PoolError, AssertionError):
    """``validate()`` found a broken invariant (docs/semantics.md section 1, docs/design.md)."""

    code = ErrorCode.INVARIANT
    device_message = "invariant violated"


class BufferFullError(PoolError, RuntimeError):
    """The device event buffer or a device queue would overflow: drain it (``take_events()`` /
    ``check()``) more often, or construct the pool with a larger ``event_capacity``."""

    code = ErrorCode.BUFFER_FULL
    device_message = "device event buffer full; drain it (take_events / check) between batched ops"


ERRORS_BY_CODE = {
    cls.code: cls
    for cls in (
        PoolError, OutOfBlocksError, InvalidCountError, InvalidBlockIdError, NullBlockError,
        DoubleFreeError, HashConflictError, KeyCapacityError, InvalidArgumentError, InvariantError, BufferFullError,
    )
}

__all__ = [
    "ErrorCode", "PoolError", "OutOfBlocksError", "InvalidCountError", "InvalidBlockIdError", "NullBlockError",
    "DoubleFreeError", "HashConflictError", "KeyCapacityError", "InvalidArgumentError", "ArgumentTypeError",
    "InvariantError", "BufferFullError", "ERRORS_BY_CODE", "out_of_blocks_message", "double_free_message",
    "slot_range_message", "slot_use_message", "slot_twice_message", "token_count_message", "position_message",
]
