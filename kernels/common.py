"""Layout constants and small ``@triton.jit`` helpers shared by every kernel.

The control words (``ctrl: int64[CTRL_SIZE]``) and the status word (``status: int64[4]``) are
described in ``gpupool/state.py``. Every kernel reads ``status[0]`` first and does nothing once it
is set (sticky errors, SPEC.md section 3).
"""
import triton
import triton.language as tl

# ctrl: int64[CTRL_SIZE]
HEAD = tl.constexpr(0)  # ring position of the queue head (may go below zero)
TAIL = tl.constexpr(1)  # one past the last ring position in the live window
NUM_FREE = tl.constexpr(2)  # live (non-tombstone) slots in [HEAD, TAIL)
KEY_SEQ = tl.constexpr(3)  # next key insertion sequence number (earliest-inserted lookups)
EV_COUNT = tl.constexpr(4)  # events written since the host last drained
REUSE_COUNT = tl.constexpr(5)  # reuse-log entries written since the host last drained
WATCH_SEQ = tl.constexpr(6)  # next watcher registration number
COMPACTIONS = tl.constexpr(7)  # ring compactions so far (a statistic)
CTRL_SIZE = 16

# status: int64[4] = (error code, op code, offending value, 0)
ST_CODE = tl.constexpr(0)
ST_OP = tl.constexpr(1)
ST_VALUE = tl.constexpr(2)

# Error codes (gpupool.errors.*.code).
E_OUT_OF_BLOCKS = tl.constexpr(2)
E_INVALID_COUNT = tl.constexpr(3)
E_INVALID_ID = tl.constexpr(4)
E_NULL_BLOCK = tl.constexpr(5)
E_DOUBLE_FREE = tl.constexpr(6)
E_HASH_CONFLICT = tl.constexpr(7)
E_KEY_CAPACITY = tl.constexpr(8)
E_INVALID_ARG = tl.constexpr(9)
E_INVARIANT = tl.constexpr(10)
E_BUFFER_FULL = tl.constexpr(11)

# Event kinds in the device event buffer.
EV_REMOVED = tl.constexpr(1)
EV_STORED = tl.constexpr(2)
EV_CLEARED = tl.constexpr(3)

BIG = tl.constexpr(2147483647)


@triton.jit
def set_status(status, code, op, value):
    """Record the first error (single-program kernels only: no other program races on it)."""
    v = value.to(tl.int64)
    if tl.load(status + ST_CODE) == 0:
        tl.store(status + ST_CODE, v * 0 + code)
        tl.store(status + ST_OP, v * 0 + op)
        tl.store(status + ST_VALUE, v)


@triton.jit
def checked_count(count_ptr, cap):
    """A count read from the device, checked against its array's capacity: (count or 0, ok)."""
    n = tl.load(count_ptr)
    ok = (n >= 0) & (n <= cap)
    return tl.where(ok, n, 0), ok


@triton.jit
def first_bad(bad, idx, val):
    """(any, index, value) of the lowest-index lane where ``bad`` holds; index BIG when none."""
    i = tl.min(tl.where(bad, idx, BIG), axis=0)
    v = tl.sum(tl.where(bad & (idx == i), val.to(tl.int64), 0), axis=0)
    return i < BIG, i, v
