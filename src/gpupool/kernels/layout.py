"""Every number the host and the kernels must agree on, defined once: control-word slots, the status
word and its causes, op codes, error codes, event kinds and row columns, key-row columns, the key table's chunk
width, the fallback reasons, the flush kernel's round table, sentinels; and the read layouts, what the host
reads of those (``BlockPool.mirror_rows``' rows, ``BlockPool.counters``, a flush's confirmation words).

Each group is an ``IntEnum`` for the host; kernels read the ``tl.constexpr`` mirrors below it (a
kernel cannot read an enum member), unpacked from :func:`constexprs` into names that repeat the
members' (with a prefix). ``tests/project/test_layout.py`` checks that every mirror equals its member.
"""
from enum import IntEnum

import triton.language as tl

from ..errors import ErrorCode


def constexprs(enum: type[IntEnum]) -> tuple:
    """``enum``'s members as ``tl.constexpr`` values, in definition order."""
    return tuple(tl.constexpr(int(m)) for m in enum)


class Ctrl(IntEnum):
    """Slots of the control words ``ctrl: int64[CTRL_SIZE]`` (docs/design.md, device state)."""

    HEAD = 0  # ring position of the queue head (may go below zero)
    TAIL = 1  # one past the last ring position of the live window
    NUM_FREE = 2  # live (non-tombstone) slots in [HEAD, TAIL)
    KEY_SEQ = 3  # next key insertion sequence number (earliest-inserted lookups)
    EV_COUNT = 4  # event rows written since the host last drained
    REUSE_COUNT = 5  # reuse-log entries written since the host last drained
    COMPACTIONS = 6  # ring compactions so far (a statistic)
    ALLOC_PARALLEL = 7  # allocate_slots batches that took the request-parallel path (a statistic)
    ALLOC_FALLBACK = 8  # allocate_slots batches that needed the sequential path from some request on
    ALLOC_SPLIT = 9  # scratch: first request of the current batch left to the sequential path
    FALLBACK_REASONS = 10  # slots 10 .. 10 + len(Fallback) - 1: batches that fell back, per reason


CTRL_SIZE = 16  # Ctrl's slots and spare ones

(HEAD, TAIL, NUM_FREE, KEY_SEQ, EV_COUNT, REUSE_COUNT, COMPACTIONS, ALLOC_PARALLEL, ALLOC_FALLBACK, ALLOC_SPLIT,
 FALLBACK_REASONS) = constexprs(Ctrl)


class Fallback(IntEnum):
    """Why a batch left the request-parallel path (kernels/requests/parallel.py;
    ``ctrl[FALLBACK_REASONS + reason]`` counts them)."""

    OUT_OF_BLOCKS = 0
    SLIDING_WINDOW = 1
    PREFIX = 2
    PARTIAL_KEY = 3
    FORCED = 4


assert Ctrl.FALLBACK_REASONS + len(Fallback) <= CTRL_SIZE
R_OUT_OF_BLOCKS, R_SLIDING_WINDOW, R_PREFIX, R_PARTIAL_KEY, R_FORCED = constexprs(Fallback)


class Status(IntEnum):
    """Slots of the sticky status word ``status: int64[STATUS_SIZE]``: the first error of a batched op,
    every slot written by the op that recorded it (docs/errors.md, "The status word")."""

    CODE = 0  # ErrorCode; 0 = clear
    OP = 1  # Op
    VALUE = 2  # the offending block id, slot, count, token count or position
    CAUSE = 3  # Cause: what was wrong with VALUE (0 where the code says it all)
    EXTRA = 4  # a second value the message names: the slot of a position, length or token count; the
    #            length of the arrays a count passed
    LIMIT = 5  # the upper bound VALUE passed, where the op's bound is the kernel's to know: a window's or
    #            append_tokens' token count (the row, less the lookahead D while steps follow); else 0


STATUS_SIZE = 8  # Status's slots and spare ones
ST_CODE, ST_OP, ST_VALUE, ST_CAUSE, ST_EXTRA, ST_LIMIT = constexprs(Status)


class Cause(IntEnum):
    """Why the manager's request-level kernels refused an input (``status[CAUSE]``); the host words the
    error by (op, cause) as the reference manager does (``gpupool.manager``, ``gpupool.errors``)."""

    UNKNOWN = 0  # not recorded: the error code's own message
    SLOT_OUT_OF_RANGE = 1  # VALUE: the slot
    SLOT_NOT_IN_USE = 2  # VALUE: the slot
    SLOT_LISTED_TWICE = 3  # VALUE: the slot (at its first entry)
    COUNT_PAST_ARRAYS = 4  # VALUE: the device count (num_reqs, num); EXTRA: its arrays' length
    FINISHED_PAST_ARRAYS = 5  # VALUE: a decode step's num_finished; EXTRA: its array's length
    TOKEN_COUNT = 6  # VALUE: the token count (InvalidCountError); EXTRA: its slot
    POSITION_OUTSIDE_ROW = 7  # VALUE: the position; EXTRA: its slot
    LENGTH_OUTSIDE_ROW = 8  # VALUE: the attention length; EXTRA: its slot
    SLOT_IN_USE = 9  # VALUE: the slot (admit: it must be free)
    ACCEPTED_COUNT = 10  # VALUE: a lane's accepted tokens (1 .. Q); EXTRA: its slot
    TOKEN_ID = 11  # VALUE: a token id outside int32; EXTRA: its slot
    TAIL_LENGTH = 12  # VALUE: a request's tail tokens (admit: < hash_block_size); EXTRA: its slot
    HASH_COUNT = 13  # VALUE: a request's hashes (admit: <= max_blocks_per_req * hashes_per_block); EXTRA: its slot


(C_UNKNOWN, C_SLOT_OUT_OF_RANGE, C_SLOT_NOT_IN_USE, C_SLOT_LISTED_TWICE, C_COUNT_PAST_ARRAYS, C_FINISHED_PAST_ARRAYS,
 C_TOKEN_COUNT, C_POSITION_OUTSIDE_ROW, C_LENGTH_OUTSIDE_ROW, C_SLOT_IN_USE, C_ACCEPTED_COUNT, C_TOKEN_ID,
 C_TAIL_LENGTH, C_HASH_COUNT) = constexprs(Cause)


class Op(IntEnum):
    """The op that recorded an error; ``op_name(code)`` is the op's method name."""

    GET_NEW_BLOCKS = 1
    FREE_BLOCKS = 2
    TOUCH = 3
    UNPIN_BLOCKS = 4
    CACHE_FULL_BLOCKS = 5
    CACHE_PARTIAL_BLOCK = 6
    MOVE_BLOCK_HASHES = 7
    EVICT_BLOCKS = 8
    RESET_PREFIX_CACHE = 9
    ALLOCATE_BATCHED = 10
    FREE_BATCHED = 11
    TOUCH_BATCHED = 12
    LOOKUP_BATCHED = 13
    LONGEST_PREFIX_BATCHED = 14
    ALLOCATE_SLOTS = 15
    FREE = 16
    SLOT_MAPPING = 17
    RELEASE_COPIES = 18
    REPLAY = 19
    DECODE_STEP = 20
    RESERVE = 21
    RELEASE_RESERVATION = 22
    CACHE_BLOCKS_BATCHED = 23
    ATTENTION_VIEWS = 24
    ADMIT = 25
    APPEND_TOKENS = 26
    WINDOW_BEGIN = 27
    WINDOW_STEP = 28
    WINDOW_END = 29


def op_name(code: int) -> str:
    try:
        return Op(code).name.lower()
    except ValueError:
        return f"op {code}"


(OP_GET_NEW_BLOCKS, OP_FREE_BLOCKS, OP_TOUCH, OP_UNPIN_BLOCKS, OP_CACHE_FULL_BLOCKS, OP_CACHE_PARTIAL_BLOCK,
 OP_MOVE_BLOCK_HASHES, OP_EVICT_BLOCKS, OP_RESET_PREFIX_CACHE, OP_ALLOCATE_BATCHED, OP_FREE_BATCHED,
 OP_TOUCH_BATCHED, OP_LOOKUP_BATCHED, OP_LONGEST_PREFIX_BATCHED, OP_ALLOCATE_SLOTS, OP_FREE, OP_SLOT_MAPPING,
 OP_RELEASE_COPIES, OP_REPLAY, OP_DECODE_STEP, OP_RESERVE, OP_RELEASE_RESERVATION,
 OP_CACHE_BLOCKS_BATCHED, OP_ATTENTION_VIEWS, OP_ADMIT, OP_APPEND_TOKENS, OP_WINDOW_BEGIN, OP_WINDOW_STEP,
 OP_WINDOW_END) = constexprs(Op)

class KindCode(IntEnum):
    """A group's attention kind in ``ManagerState.kinds`` (``gpupool.groups``' ``KindSpec.code``)."""

    FULL = 0
    SLIDING_WINDOW = 1
    CHUNKED_LOCAL = 2


KIND_FULL, KIND_SLIDING_WINDOW, KIND_CHUNKED_LOCAL = constexprs(KindCode)

# Error codes (gpupool.errors.ErrorCode; the messages live with the error classes).
(E_NONE, E_UNKNOWN, E_OUT_OF_BLOCKS, E_INVALID_COUNT, E_INVALID_ID, E_NULL_BLOCK, E_DOUBLE_FREE,
 E_HASH_CONFLICT, E_KEY_CAPACITY, E_INVALID_ARG, E_INVARIANT, E_BUFFER_FULL) = constexprs(ErrorCode)


class Event(IntEnum):
    """Kinds of the device event rows ``ev: int64[EV_CAP, EVW]``.

    Row layouts (columns): REMOVED and STORED_ITEM ``(kind, block, key hi, key lo, group, 0)``;
    STORED, the header of one BlockStored whose items follow it, ``(kind, has_parent, parent hi,
    parent lo, group, block_size)``; CLEARED ``(kind, 0, ...)``. Rows carry device keys; the host
    names them through its key registry (gpupool/registry.py)."""

    REMOVED = 1
    STORED = 2
    STORED_ITEM = 3
    CLEARED = 4


class EventCol(IntEnum):
    """Columns of an event row (``Event`` gives each kind's use of ``A`` and ``B``)."""

    KIND = 0
    A = 1  # the block (REMOVED, STORED_ITEM); has_parent (STORED)
    HI = 2  # the key's (or the parent's) high word
    LO = 3
    GROUP = 4
    B = 5  # block_size (STORED); 0 otherwise


EVENT_WIDTH = len(EventCol)
EVW = tl.constexpr(EVENT_WIDTH)
EV_REMOVED, EV_STORED, EV_STORED_ITEM, EV_CLEARED = constexprs(Event)
EC_KIND, EC_A, EC_HI, EC_LO, EC_GROUP, EC_B = constexprs(EventCol)


class KeyCol(IntEnum):
    """Columns of the key rows ``keys: int64[N*MK, KEY_WIDTH]`` (row ``block * MK + j``;
    kernels/keytable.py)."""

    HI = 0  # the device key (gpupool.keys.device_key): high word
    LO = 1
    GROUP = 2
    SEQ = 3  # insertion sequence number (lookups return the earliest)
    SLOT = 4  # the key's slot in the table


KEY_WIDTH = len(KeyCol)
KW = tl.constexpr(KEY_WIDTH)
K_HI, K_LO, K_GROUP, K_SEQ, K_SLOT = constexprs(KeyCol)


class MirrorCol(IntEnum):
    """Columns of ``BlockPool.mirror_rows``' rows ``int64[n, KEYS + MIRROR_KEY_WIDTH * k]`` (the host
    reads them, no kernel): per block, then its first ``k`` key slots, primary first, each
    ``MIRROR_KEY_WIDTH`` columns in MirrorKey's order from ``KEYS + MIRROR_KEY_WIDTH * slot``."""

    REF_CNT = 0
    NUM_KEYS = 1
    HASH_NTOK = 2  # tokens the primary key covers (-1: none)
    KEYS = 3  # the first key slot's first column


class MirrorKey(IntEnum):
    """One key slot's columns in ``BlockPool.mirror_rows`` (MirrorCol): KeyCol's HI, LO and SEQ."""

    HI = 0
    LO = 1
    SEQ = 2


MIRROR_KEY_WIDTH = len(MirrorKey)


def mirror_row_width(key_slots: int) -> int:
    """Columns of a ``BlockPool.mirror_rows`` row with ``key_slots`` key slots."""
    return MirrorCol.KEYS + MIRROR_KEY_WIDTH * key_slots


def mirror_key_col(slot: int, col: "MirrorKey") -> int:
    """The column of key slot ``slot``'s ``col`` in a ``BlockPool.mirror_rows`` row."""
    return MirrorCol.KEYS + MIRROR_KEY_WIDTH * slot + col


class Counter(IntEnum):
    """Entries of ``BlockPool.counters()``: ``int64[len(Counter)]`` (the host reads them, no kernel):
    the status word's error code, then the control words from NUM_FREE to REUSE_COUNT (Ctrl)."""

    ERROR_CODE = 0
    NUM_FREE = 1
    KEY_SEQ = 2
    EV_COUNT = 3
    REUSE_COUNT = 4


class Confirm(IntEnum):
    """A flush's confirmation words ``int32[CONFIRM_WIDTH]`` (``BlockPool.apply_predicted``'s second
    output; kernels/flush.py writes them): the status word's error code before the launch and after it."""

    BEFORE = 0  # not 0: an error recorded before made the launch do nothing
    AFTER = 1  # not 0 with BEFORE 0: the launch itself failed


CONFIRM_WIDTH = len(Confirm)
CF_BEFORE, CF_AFTER = constexprs(Confirm)


#: Slots per chunk of the prefix-key table ``table: int64[NCHUNK * CHUNK_SLOTS + 1]`` (kernels/keytable.py).
CHUNK_SLOTS = 16
CHUNK = tl.constexpr(CHUNK_SLOTS)


class RoundField(IntEnum):
    """One round's entries in the flush kernel's round table ``rounds: int32[n_rounds * ROUND_WIDTH]``
    (kernels/flush.py ``FlushBatch.table``): where each part starts in its flattened array, and its
    count."""

    FREE_START = 0  # free ids
    FREE_OFFSETS_START = 1  # the round's own free offsets (from 0)
    FREE_CALLS = 2
    FREE_IDS = 3
    TOUCH_START = 4
    TOUCHES = 5
    DEMANDS_START = 6
    DEMANDS = 7
    POPPED_START = 8  # the round's first popped block in the output
    POPPED = 9  # blocks the round's demands want
    CACHE_START = 10
    CACHINGS = 11


ROUND_WIDTH = len(RoundField)
RW = tl.constexpr(ROUND_WIDTH)
# the table's last round, each field as a negative index, plain ints: the host's batch methods run once
# per vLLM call, and an IntEnum member costs ~70 ns a use
(LAST_FREE_START, LAST_FREE_OFFSETS_START, LAST_FREE_CALLS, LAST_FREE_IDS, LAST_TOUCH_START, LAST_TOUCHES,
 LAST_DEMANDS_START, LAST_DEMANDS, LAST_POPPED_START, LAST_POPPED, LAST_CACHE_START,
 LAST_CACHINGS) = (int(f) - ROUND_WIDTH for f in RoundField)
# (start, count) field pairs of a round's parts, plain ints: a new round's starts are the last's ends
ROUND_PARTS = tuple((int(a), int(b)) for a, b in (
    (RoundField.FREE_START, RoundField.FREE_IDS), (RoundField.TOUCH_START, RoundField.TOUCHES),
    (RoundField.DEMANDS_START, RoundField.DEMANDS), (RoundField.POPPED_START, RoundField.POPPED),
    (RoundField.CACHE_START, RoundField.CACHINGS)))
(RF_FREE_START, RF_FREE_OFFSETS_START, RF_FREE_CALLS, RF_FREE_IDS, RF_TOUCH_START, RF_TOUCHES, RF_DEMANDS_START,
 RF_DEMANDS, RF_POPPED_START, RF_POPPED, RF_CACHE_START, RF_CACHINGS) = constexprs(RoundField)

#: A block hash on the device (a SHA-256 digest): 8 int32 words, word j the big-endian bytes 4j..4j+3.
DIGEST_WORDS = 8
DW = tl.constexpr(DIGEST_WORDS)

# Sentinels.
BIG = tl.constexpr(2147483647)  # "no index" in min-reductions; int32 maximum
INT32_MAX = 2147483647  # the same, for the host
NO_SLOT = tl.constexpr(-1)  # qslot of a block that is not queued; a tombstone ring slot
