"""Typed errors of both pools (SPEC.md section 3).

Every error derives from :class:`PoolError`, names the op and the offending block id or count,
and is raised only when the pool is exactly as it was before the op (all or nothing).
"""
from __future__ import annotations


class PoolError(Exception):
    """Base of every gpupool error. ``op`` is the operation's name; ``value`` the offending id or count."""

    code = 1

    def __init__(self, op: str, message: str, value: int | None = None):
        self.op = op
        self.value = value
        super().__init__(f"{op}: {message}")


class OutOfBlocksError(PoolError, ValueError):
    """More blocks asked for than are free (``get_new_blocks``)."""

    code = 2


class InvalidCountError(PoolError, ValueError):
    """A negative or otherwise impossible count (``get_new_blocks(-1)``, bad token counts)."""

    code = 3


class InvalidBlockIdError(PoolError, IndexError):
    """A block id outside ``0 .. num_blocks-1``."""

    code = 4


class NullBlockError(PoolError, ValueError):
    """The null block (id 0) where it is not allowed (``unpin_blocks``, ``move_block_hashes`` target)."""

    code = 5


class DoubleFreeError(PoolError, ValueError):
    """A ref-count decrement below zero (``free_blocks``, ``unpin_blocks`` of a free block)."""

    code = 6


class HashConflictError(PoolError, ValueError):
    """Re-caching a block at the same or a longer token count, or moving keys onto a hashed block."""

    code = 7


class KeyCapacityError(PoolError, RuntimeError):
    """A block would exceed ``max_keys_per_block`` keys, or the device key table is full."""

    code = 8


class InvalidArgumentError(PoolError, ValueError):
    """Mismatched lengths, bad block sizes, wrong dtype or device of a tensor argument."""

    code = 9


class InvariantError(PoolError, AssertionError):
    """``validate()`` found a broken invariant of SPEC.md section 1."""

    code = 10


class BufferFullError(PoolError, RuntimeError):
    """The device event buffer or reuse log would overflow: drain them (``take_events()`` / ``check()``)
    more often between batched ops."""

    code = 11


ERRORS_BY_CODE = {
    cls.code: cls
    for cls in (
        PoolError, OutOfBlocksError, InvalidCountError, InvalidBlockIdError, NullBlockError,
        DoubleFreeError, HashConflictError, KeyCapacityError, InvalidArgumentError, InvariantError, BufferFullError,
    )
}
