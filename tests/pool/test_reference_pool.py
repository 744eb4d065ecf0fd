"""Tests of the CPU reference pool (gpupool.reference.ReferenceBlockPool) against docs/semantics.md.

Block size 16 throughout the scenarios; free queues are written head to tail.
"""
from __future__ import annotations

import copy

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpupool import ReferenceBlockPool
from gpupool.errors import (
    DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError,
    KeyCapacityError, NullBlockError, OutOfBlocksError, PoolError,
)
from gpupool.events import AllBlocksCleared, BlockRemoved, BlockStored

from harness.compare import assert_consistent
from harness.keys import h, hashes, request_hashes
from harness.ops import admit, expect_error, free_request
from harness.sizes import BLOCK_SIZE
from harness.state import lookup, pool_state, state_digest
from harness.watchers import WatcherLog

BS = BLOCK_SIZE


def make(n, **kw) -> ReferenceBlockPool:
    pool = ReferenceBlockPool(n, **kw)
    assert_consistent(pool)
    return pool


def noop(_b):
    pass


# =================================================================================================
# Worked scenarios: shared prefixes, free-queue order, one key on two blocks
# =================================================================================================

def test_initial_state():
    pool = make(6)
    st_ = pool_state(pool)
    assert st_["free_queue"] == [1, 2, 3, 4, 5]
    assert st_["ref_counts"] == [0] * 6
    assert st_["blocks"] == [([], None)] * 6
    assert st_["num_free"] == 5 and st_["num_watchers"] == 0
    assert pool.take_events() == []


def test_scenario_shared_prefix_lru_then_lifo():
    """A (55 tokens) and B (53 tokens) share 48 tokens."""
    pool = make(11)
    prefix = ["p0", "p1", "p2"]
    hits_a, new_a = admit(pool, prefix + ["a3"], 55)
    assert hits_a == [] and new_a == [1, 2, 3, 4]
    a = hits_a + new_a
    for i, b in enumerate([1, 2, 3]):
        assert pool.block_keys(b) == [(h(prefix[i]), 0)]
        assert pool.block_hash_num_tokens(b) == (i + 1) * BS
    assert pool.block_keys(4) == []  # 55 tokens: 3 full blocks only

    hits_b, new_b = admit(pool, prefix + ["b3"], 53)
    assert hits_b == [1, 2, 3] and new_b == [5]
    b_ = hits_b + new_b
    assert pool.ref_counts([1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert pool.free_queue() == [6, 7, 8, 9, 10]

    free_request(pool, a)
    assert pool.free_queue() == [4, 6, 7, 8, 9, 10]
    free_request(pool, b_)
    assert pool.free_queue() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert_consistent(pool)

    hits_c, new_c = admit(pool, prefix + ["c3"], 53)
    assert hits_c == [1, 2, 3] and new_c == [5]
    assert pool.free_queue() == [4, 6, 7, 8, 9, 10]
    free_request(pool, hits_c + new_c)
    assert pool.free_queue() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    hits_d, new_d = admit(pool, [f"u{i}" for i in range(10)], 160)
    assert hits_d == []
    assert new_d == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.free_queue() == [] and pool.get_num_free_blocks() == 0
    # the old prefix was evicted by the allocation, the new one cached
    assert lookup(pool, h("p0")) is None
    assert lookup(pool, h("u0")) == [5]
    assert_consistent(pool)


def test_scenario_two_requests_lru_order():
    """A (87 tokens, 6 blocks, 5 full) and B (48 tokens, 3 full blocks), different hashes."""
    pool = make(11)
    a_ids = [f"a{i}" for i in range(5)]
    b_ids = [f"b{i}" for i in range(3)]
    hits_a, a = admit(pool, a_ids, 87)
    hits_b, b_ = admit(pool, b_ids, 48)
    assert hits_a == [] and a == [1, 2, 3, 4, 5, 6]
    assert hits_b == [] and b_ == [7, 8, 9]
    assert [pool.block_keys(b) != [] for b in range(1, 11)] == [True] * 5 + [False] + [True] * 3 + [False]

    pool.free_blocks(reversed(a))  # any iterable of ids
    assert pool.free_queue() == [6, 10, 5, 4, 3, 2, 1]
    free_request(pool, b_)
    assert pool.free_queue() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    hits_c, new_c = admit(pool, a_ids[:2], 35)
    assert hits_c == [1, 2] and new_c == [6]
    assert pool.free_queue() == [10, 5, 4, 3, 9, 8, 7]
    assert pool.ref_counts([1, 2, 6]) == [1, 1, 1]
    assert_consistent(pool)


def test_scenario_free_in_allocation_order_and_eviction_events():
    """un-hashed blocks go to the front, hashed to the back; reallocation evicts the 2 keys."""
    pool = make(5, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4)
    assert blocks == [1, 2, 3, 4]
    pool.cache_full_blocks(blocks, hashes(["x0", "x1"]), 0, 2, BS, 0)
    assert pool.take_events() == [BlockStored((h("x0"), h("x1")), None, BS, 0)]
    pool.free_blocks(blocks)
    assert pool.free_queue() == [3, 4, 1, 2]
    again = pool.get_new_blocks(4)
    assert again == [3, 4, 1, 2]
    assert pool.take_events() == [BlockRemoved(h("x0"), 0), BlockRemoved(h("x1"), 0)]
    assert all(pool.block_keys(b) == [] for b in range(5))
    assert lookup(pool, h("x0")) is None
    assert_consistent(pool)


def test_duplicate_keys_lookup_earliest_then_next():
    """two blocks under one key; lookup returns the earlier; evictions fall through."""
    pool = make(6, enable_kv_cache_events=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], [h("k")], 0, 1, BS, 0)
    pool.cache_full_blocks([b2], [h("k")], 0, 1, BS, 0)
    assert pool.block_keys(b1) == pool.block_keys(b2) == [(h("k"), 0)]
    assert lookup(pool, h("k")) == [b1]
    pool.take_events()
    pool.evict_blocks([b1])
    assert pool.take_events() == [BlockRemoved(h("k"), 0)]
    assert lookup(pool, h("k")) == [b2]
    pool.evict_blocks([b2])
    assert lookup(pool, h("k")) is None
    assert pool.block_keys(b1) == pool.block_keys(b2) == []
    assert pool_state(pool)["blocks"] == [([], None)] * 6
    assert_consistent(pool)


def test_duplicate_keys_eviction_by_reallocation():
    pool = make(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    for b in (b1, b2):
        pool.cache_full_blocks([b], [h("k")], 0, 1, BS, 0)
    pool.free_blocks([b3, b1, b2])  # b3 un-hashed -> front; b1, b2 hashed -> back
    assert pool.free_queue() == [b3, b1, b2]
    assert pool.get_new_blocks(2) == [b3, b1]
    assert lookup(pool, h("k")) == [b2]
    pool.touch([b2])
    assert pool.ref_counts([b2]) == [1]
    assert lookup(pool, h("k")) == [b2]
    assert_consistent(pool)


def test_caching_disabled():
    """freed blocks are all prepended; no block ever gets a key."""
    pool = make(8, enable_caching=False, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4)
    assert blocks == [1, 2, 3, 4]
    pool.cache_full_blocks(blocks, hashes(range(4)), 0, 4, BS, 0)
    assert pool.cache_partial_block(blocks[0], hashes(range(4)), 8, 0, BS, 4) is None
    assert all(pool.block_keys(b) == [] and pool.block_hash_num_tokens(b) is None for b in range(8))
    assert lookup(pool, h(0)) is None
    assert pool.take_events() == []
    pool.free_blocks([4, 3, 2, 1])
    assert pool.free_queue() == [4, 3, 2, 1, 5, 6, 7]
    x = pool.get_new_blocks(2)
    assert x == [4, 3]
    pool.free_blocks([x[0]])
    pool.free_blocks([x[1]])  # LIFO across calls: the newest freed is handed out first
    assert pool.free_queue() == [3, 4, 2, 1, 5, 6, 7]
    assert pool.get_new_blocks(1) == [3]
    assert pool.take_events() == []
    assert_consistent(pool)


def test_caching_disabled_unpin_appends():
    pool = make(5, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.unpin_blocks([blocks[1]], noop)
    assert pool.free_queue() == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert pool.free_queue() == [1, 3, 4, 2]


# -------------------------------------------------------------------------------------------------
# unpin_blocks and reuse watchers
# -------------------------------------------------------------------------------------------------

def test_unpin_blocks_tail_keeps_keys_and_watcher_fires_once_after_op():
    pool = make(6)
    log = WatcherLog(pool)
    blocks = pool.get_new_blocks(4)  # queue [5]
    pool.cache_full_blocks(blocks, [h("k0")], 0, 1, BS, 0)  # block 1 hashed
    pool.unpin_blocks([2], log.cb("w2"))  # un-hashed, still goes to the tail
    pool.unpin_blocks([1], log.cb("w1"))
    assert pool.free_queue() == [5, 2, 1]
    assert pool.block_keys(1) == [(h("k0"), 0)] and pool.block_hash_num_tokens(1) == BS
    assert lookup(pool, h("k0")) == [1]  # still hits
    assert pool.get_num_free_blocks() == 3  # and counts as free
    assert pool.num_watchers() == 2
    assert log.calls == []

    assert pool.get_new_blocks(1) == [5]
    assert log.calls == []
    got = pool.get_new_blocks(2)
    assert got == [2, 1]
    # fired once each, in hand-out order, after the op completed (the callback sees the final state)
    assert log.tagged() == [("w2", 2), ("w1", 1)]
    final = state_digest(pool)
    assert [d for _, _, d in log.calls] == [final, final]
    assert pool.ref_counts([1, 2]) == [1, 1]
    assert pool.block_keys(1) == []
    assert pool.num_watchers() == 0
    pool.free_blocks([2, 1])
    pool.get_new_blocks(2)
    assert len(log.calls) == 2  # never again
    assert_consistent(pool)


def test_unpin_with_ref_still_positive_and_touch_keeps_watcher():
    pool = make(5)
    log = WatcherLog(pool)
    b = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([b], [h("k")], 0, 1, BS, 0)
    pool.touch([b])
    assert pool.ref_counts([b]) == [2]
    pool.unpin_blocks([b], log.cb("w"))
    assert pool.ref_counts([b]) == [1]
    assert b not in pool.free_queue()
    assert pool.num_watchers() == 1
    pool.unpin_blocks([b], log.cb("w"))
    assert pool.free_queue()[-1] == b and pool.num_watchers() == 1
    # touch neither fires nor clears the watcher
    pool.touch([b])
    assert log.calls == [] and pool.num_watchers() == 1 and pool.ref_counts([b]) == [1]
    pool.free_blocks([b])
    assert pool.free_queue()[-1] == b  # hashed: back
    assert pool.reset_prefix_cache() is True
    assert log.tagged() == [("w", b)]
    assert pool.num_watchers() == 0
    assert_consistent(pool)


def test_watcher_reregistration_keeps_order_on_reset():
    pool = make(6)
    log = WatcherLog(pool)
    x, y, z = pool.get_new_blocks(3)
    pool.touch([x])
    pool.unpin_blocks([x], log.cb("x-a"))
    pool.unpin_blocks([y], log.cb("y"))
    pool.unpin_blocks([z], log.cb("z"))
    pool.unpin_blocks([x], log.cb("x-b"))  # replaces x's callback, keeps x first
    assert pool.num_watchers() == 3
    assert pool.reset_prefix_cache() is True
    assert log.tagged() == [("x-b", x), ("y", y), ("z", z)]
    final = state_digest(pool)
    assert all(d == final for _, _, d in log.calls)
    assert pool.num_watchers() == 0
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert len(log.calls) == 3  # fired once, not again on hand-out


def test_watcher_replaced_fires_new_callback_on_handout():
    pool = make(3)
    log = WatcherLog(pool)
    b = pool.get_new_blocks(1)[0]
    pool.touch([b])
    pool.unpin_blocks([b], log.cb("old"))
    pool.unpin_blocks([b], log.cb("new"))
    assert pool.free_queue() == [2, 1]
    assert pool.get_new_blocks(2) == [2, 1]
    assert log.tagged() == [("new", 1)]


def test_unpin_same_block_twice_in_one_call():
    pool = make(4)
    log = WatcherLog(pool)
    b = pool.get_new_blocks(1)[0]
    pool.touch([b])
    pool.unpin_blocks([b, b], log.cb("w"))
    assert pool.ref_counts([b]) == [0]
    assert pool.free_queue() == [2, 3, b]  # queued once
    assert pool.num_watchers() == 1
    assert_consistent(pool)


# -------------------------------------------------------------------------------------------------
# reset_prefix_cache
# -------------------------------------------------------------------------------------------------

def test_reset_prefix_cache_refused_while_held_then_succeeds():
    pool = make(6, enable_kv_cache_events=True)
    log = WatcherLog(pool)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, hashes(["r0", "r1"]), 0, 2, BS, 0)
    pool.cache_partial_block(a[2], hashes(["f0", "f1", "f2", "f3", "r2"]), 40, 0, BS, 8)
    pool.unpin_blocks([a[0]], log.cb("w"))  # block 1 free (and hashed) but blocks 2, 3 held
    pool.take_events()
    before = state_digest(pool)
    assert pool.reset_prefix_cache() is False
    assert state_digest(pool) == before
    assert pool.take_events() == []
    assert log.calls == []

    pool.free_blocks([a[2], a[1]])
    assert pool.free_queue() == [4, 5, 1, 3, 2]
    q = pool.free_queue()
    assert pool.reset_prefix_cache() is True
    assert pool.free_queue() == q
    assert pool.take_events() == [AllBlocksCleared()]
    assert all(pool.block_keys(b) == [] and pool.block_hash_num_tokens(b) is None for b in range(6))
    assert lookup(pool, h("r0")) is None and lookup(pool, h("r2")) is None
    assert log.tagged() == [("w", 1)]
    assert pool.ref_counts() == [0] * 6
    # nothing cached: still succeeds and still emits the event
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.free_queue() == q
    assert_consistent(pool)


def test_reset_counts_unpinned_as_free_and_refuses_partially_unpinned():
    pool = make(4)
    b = pool.get_new_blocks(1)[0]
    pool.touch([b])
    pool.unpin_blocks([b], noop)
    assert pool.reset_prefix_cache() is False
    assert pool.num_watchers() == 1
    pool.unpin_blocks([b], noop)
    assert pool.reset_prefix_cache() is True
    assert pool.num_watchers() == 0


def test_reset_single_block_pool():
    pool = make(1, enable_kv_cache_events=True)
    assert pool.free_queue() == [] and pool.get_usage() == 0.0
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_new_blocks(0) == []


# =================================================================================================
# Errors (docs/semantics.md section 3) leave the pool exactly as it was
# =================================================================================================

def _busy_pool(**kw) -> ReferenceBlockPool:
    """N=10: held blocks 1 (hashed, ref 2), 2 (hashed), 3 (un-hashed), 7 (partial, secondary key);
    free hashed 4, 5; a watcher on 5; queue [6, 8, 9, 4, 5]."""
    kw.setdefault("enable_kv_cache_events", True)
    pool = make(10, **kw)
    blocks = pool.get_new_blocks(5)  # 1..5
    pool.cache_full_blocks(blocks, hashes(["e0", "e1"]), 0, 2, BS, 0)
    pool.touch([1])
    pool.cache_full_blocks([0, 0, 0, 4, 5], hashes(["q0", "q1", "q2", "q3", "q4"]), 3, 5, BS, 1)
    pool.free_blocks([4])
    pool.unpin_blocks([5], noop)
    assert pool.get_new_blocks(2) == [6, 7]
    pool.free_blocks([6])
    pool.cache_partial_block(7, hashes(["p0", "p1"]), 8, 0, BS, 4)
    pool.cache_partial_block(7, hashes(["p0"]), 4, 0, BS, 4)
    assert pool.free_queue() == [6, 8, 9, 4, 5]
    assert pool.ref_counts() == [0, 2, 1, 1, 0, 0, 0, 1, 0, 0]
    assert pool.block_keys(7) == [(h("p1"), 0), (h("p0"), 0)]
    assert pool.num_watchers() == 1
    pool.take_events()
    assert_consistent(pool)
    return pool


def _partial_z(block: int, num_tokens: int, hash_block_size: int):
    """``cache_partial_block`` of ``block`` with the "z" chain, block size 16 (the bad-size cases)."""
    return lambda p: p.cache_partial_block(block, _h("z"), num_tokens, 0, 16, hash_block_size)


def _h(tag):
    return hashes([f"{tag}{i}" for i in range(4)])


ERROR_CASES = [
    # double free
    ("free-ref0", DoubleFreeError, "free_blocks", lambda p: p.free_blocks([8])),
    ("free-twice-ref1", DoubleFreeError, "free_blocks", lambda p: p.free_blocks([3, 3])),
    ("free-ok-then-bad", DoubleFreeError, "free_blocks", lambda p: p.free_blocks([1, 2, 3, 4])),
    ("free-thrice-ref2", DoubleFreeError, "free_blocks", lambda p: p.free_blocks([1, 1, 1])),
    # out-of-range ids
    ("free-range", InvalidBlockIdError, "free_blocks", lambda p: p.free_blocks([2, 10])),
    ("free-neg", InvalidBlockIdError, "free_blocks", lambda p: p.free_blocks([2, -1])),
    ("touch-range", InvalidBlockIdError, "touch", lambda p: p.touch([6, 10])),
    ("touch-neg", InvalidBlockIdError, "touch", lambda p: p.touch([6, -1])),
    ("evict-range", InvalidBlockIdError, "evict_blocks", lambda p: p.evict_blocks([1, 10])),
    ("evict-neg", InvalidBlockIdError, "evict_blocks", lambda p: p.evict_blocks([1, -9])),
    ("unpin-range", InvalidBlockIdError, "unpin_blocks", lambda p: p.unpin_blocks([3, 10], noop)),
    ("unpin-neg", InvalidBlockIdError, "unpin_blocks", lambda p: p.unpin_blocks([3, -1], noop)),
    ("cache-full-range", InvalidBlockIdError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3, 10], _h("z"), 0, 2, BS, 0)),
    ("cache-full-neg", InvalidBlockIdError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3, -2], _h("z"), 0, 2, BS, 0)),
    ("cache-partial-range", InvalidBlockIdError, "cache_partial_block",
     lambda p: p.cache_partial_block(10, _h("z"), 4, 0, BS, 4)),
    ("cache-partial-neg", InvalidBlockIdError, "cache_partial_block",
     lambda p: p.cache_partial_block(-1, _h("z"), 4, 0, BS, 4)),
    ("move-src-range", InvalidBlockIdError, "move_block_hashes", lambda p: p.move_block_hashes(10, 3)),
    ("move-dst-neg", InvalidBlockIdError, "move_block_hashes", lambda p: p.move_block_hashes(1, -1)),
    # counts
    ("get-negative", InvalidCountError, "get_new_blocks", lambda p: p.get_new_blocks(-1)),
    ("get-too-many", OutOfBlocksError, "get_new_blocks", lambda p: p.get_new_blocks(6)),
    ("get-way-too-many", OutOfBlocksError, "get_new_blocks", lambda p: p.get_new_blocks(100)),
    # re-caching at the same or a longer length
    ("recache-same-length", HashConflictError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([1, 2], hashes(["e0", "e1"]), 0, 2, BS, 0)),
    ("recache-other-hash", HashConflictError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([1, 2, 3], hashes(["n0", "n1", "n2"]), 1, 3, BS, 0)),
    ("recache-shorter", HashConflictError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([2], hashes(["n0"]), 0, 1, BS, 0)),
    ("recache-later-in-call", HashConflictError, "cache_full_blocks",  # block 3 fine, block 2 not
     lambda p: p.cache_full_blocks([3, 2], hashes(["n0", "n1"]), 0, 2, 8, 0)),
    # null block
    ("unpin-null", NullBlockError, "unpin_blocks", lambda p: p.unpin_blocks([3, 0], noop)),
    ("move-onto-null", NullBlockError, "move_block_hashes", lambda p: p.move_block_hashes(1, 0)),
    ("unpin-ref0", DoubleFreeError, "unpin_blocks", lambda p: p.unpin_blocks([8], noop)),
    ("unpin-twice-ref1", DoubleFreeError, "unpin_blocks", lambda p: p.unpin_blocks([3, 3], noop)),
    # move onto a hashed block
    ("move-onto-hashed", HashConflictError, "move_block_hashes", lambda p: p.move_block_hashes(1, 2)),
    ("move-onto-free-hashed", HashConflictError, "move_block_hashes", lambda p: p.move_block_hashes(3, 4)),
    ("move-onto-self-hashed", HashConflictError, "move_block_hashes", lambda p: p.move_block_hashes(1, 1)),
    # cache_partial_block with bad sizes
    ("partial-bs-not-multiple", InvalidArgumentError, "cache_partial_block", _partial_z(3, 6, 6)),
    ("partial-tokens-not-multiple", InvalidArgumentError, "cache_partial_block", _partial_z(3, 6, 4)),
    ("partial-zero-tokens", InvalidArgumentError, "cache_partial_block", _partial_z(3, 0, 4)),
    ("partial-negative-tokens", InvalidArgumentError, "cache_partial_block", _partial_z(3, -4, 4)),
    ("partial-too-few-hashes", InvalidArgumentError, "cache_partial_block", _partial_z(3, 20, 4)),
    ("partial-zero-hbs", InvalidArgumentError, "cache_partial_block", _partial_z(3, 4, 0)),
    ("partial-null-bad-sizes", InvalidArgumentError, "cache_partial_block", _partial_z(0, 6, 4)),
    # key capacity (the fixture block 7 has 2 keys; max_keys_per_block=2 for these cases)
    ("capacity-secondary", KeyCapacityError, "cache_partial_block",
     lambda p: p.cache_partial_block(7, hashes(["c0", "c1"]), 8, 0, BS, 4)),
    ("capacity-secondary-other-group", KeyCapacityError, "cache_partial_block",
     lambda p: p.cache_partial_block(7, hashes(["p0"]), 4, 1, BS, 4)),
    # malformed cache_full_blocks arguments
    ("full-too-few-ids", InvalidArgumentError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3], _h("z"), 0, 2, BS, 0)),
    ("full-too-few-hashes", InvalidArgumentError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3, 6], _h("z")[:1], 0, 2, BS, 0)),
    ("full-short-mask", InvalidArgumentError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3, 6], _h("z"), 0, 2, BS, 0, block_mask=[True])),
    ("full-hash-not-bytes", InvalidArgumentError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3], ["e0"], 0, 1, BS, 0)),
    # a non-null, unmasked block listed twice in one cache_full_blocks call: vLLM asserts; both pools
    # reject the call (docs/semantics.md's per-i wording would read it as a promotion; see the report)
    ("full-block-listed-twice", InvalidArgumentError, "cache_full_blocks",
     lambda p: p.cache_full_blocks([3, 3], _h("z"), 0, 2, BS, 0)),
]


NO_VALUE_CASES = {"full-hash-not-bytes"}  # a wrong hash type has no block id or count to name


@pytest.mark.parametrize("name,exc,op,fn", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_are_typed_and_change_nothing(name, exc, op, fn):
    pool = _busy_pool(max_keys_per_block=2)
    err = expect_error(pool, exc, op, lambda: fn(pool))
    assert isinstance(err, PoolError)
    if name not in NO_VALUE_CASES:
        assert err.value is not None  # names the offending block or count
    assert_consistent(pool)


def test_out_of_blocks_is_value_error_and_names_count():
    pool = _busy_pool()
    err = expect_error(pool, OutOfBlocksError, "get_new_blocks", lambda: pool.get_new_blocks(7))
    assert isinstance(err, ValueError)
    assert "7" in str(err)
    err = expect_error(pool, InvalidCountError, "get_new_blocks", lambda: pool.get_new_blocks(-3))
    assert "-3" in str(err)
    # exactly num_free still works
    assert len(pool.get_new_blocks(5)) == 5 and pool.free_queue() == []


def test_double_free_names_the_block():
    pool = _busy_pool()
    err = expect_error(pool, DoubleFreeError, "free_blocks", lambda: pool.free_blocks([2, 9]))
    assert err.value == 9 and "9" in str(err)
    err = expect_error(pool, InvalidBlockIdError, "touch", lambda: pool.touch([123]))
    assert err.value == 123


def test_key_capacity_via_partial_secondaries_from_scratch():
    pool = make(4, max_keys_per_block=2, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)[0]
    hs = hashes(["s0", "s1", "s2"])
    assert pool.cache_partial_block(b, hs, 8, 0, BS, 4) == (hs[1], 0)  # primary, 8 tokens
    assert pool.cache_partial_block(b, hs, 4, 0, BS, 4) == (hs[0], 0)  # fewer tokens: secondary
    assert pool.block_keys(b) == [(hs[1], 0), (hs[0], 0)]
    assert pool.block_hash_num_tokens(b) == 8
    # the same key again is a no-op even at capacity
    pool.take_events()
    assert pool.cache_partial_block(b, hs, 4, 0, BS, 4) == (hs[0], 0)
    assert pool.take_events() == []
    expect_error(pool, KeyCapacityError, "cache_partial_block",
                 lambda: pool.cache_partial_block(b, hashes(["t0", "t1"]), 8, 0, BS, 4))
    # promotion (more tokens) replaces the keys, so it is allowed at capacity
    assert pool.cache_partial_block(b, hs, 12, 0, BS, 4) == (hs[2], 0)
    assert pool.block_keys(b) == [(hs[2], 0)]
    assert pool.take_events() == [BlockRemoved(hs[1], 0), BlockRemoved(hs[0], 0),
                                  BlockStored((hs[2],), hs[1], 4, 0)]


def test_default_max_keys_per_block_is_4():
    pool = make(3)
    b = pool.get_new_blocks(1)[0]
    hs = hashes(range(4))
    for nt in (16, 12, 8, 4):  # primary, then 3 secondaries (fewer tokens each)
        pool.cache_partial_block(b, hs, nt, 0, BS, 4)
    assert pool.block_keys(b) == [(hs[3], 0), (hs[2], 0), (hs[1], 0), (hs[0], 0)]
    expect_error(pool, KeyCapacityError, "cache_partial_block",
                 lambda: pool.cache_partial_block(b, hs, 4, 1, BS, 4))


def test_constructor_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        ReferenceBlockPool(0)
    with pytest.raises(InvalidArgumentError):
        ReferenceBlockPool(4, max_keys_per_block=0)


# =================================================================================================
# cache_partial_block, cache_full_blocks, move_block_hashes
# =================================================================================================

def test_partial_then_full_promotion():
    pool = make(5, enable_kv_cache_events=True)
    b0, b1 = pool.get_new_blocks(2)
    hs = hashes(["f0", "f1"])
    pool.cache_full_blocks([b0], hs, 0, 1, BS, 0)
    fine = hashes(["g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7"])  # hash_block_size 4
    # block b1 partly written: 24 tokens of the prefix (8 of its own) at hash granularity 4
    assert pool.cache_partial_block(b1, fine, 24, 0, BS, 4) == (fine[5], 0)
    assert pool.cache_partial_block(b1, fine, 20, 0, BS, 4) == (fine[4], 0)  # secondary
    assert pool.block_keys(b1) == [(fine[5], 0), (fine[4], 0)]
    assert pool.block_hash_num_tokens(b1) == 24
    assert pool.take_events() == [
        BlockStored((hs[0],), None, BS, 0),
        BlockStored((fine[5],), fine[4], 4, 0),
        BlockStored((fine[4],), fine[3], 4, 0),
    ]
    assert lookup(pool, fine[5]) == [b1] and lookup(pool, fine[4]) == [b1]
    # now full: cache_full_blocks promotes it (old keys removed, new key primary)
    pool.cache_full_blocks([b0, b1], hs, 1, 2, BS, 0)
    assert pool.block_keys(b1) == [(hs[1], 0)]
    assert pool.block_hash_num_tokens(b1) == 32
    assert pool.take_events() == [
        BlockRemoved(fine[5], 0), BlockRemoved(fine[4], 0),
        BlockStored((hs[1],), hs[0], BS, 0),
    ]
    assert lookup(pool, fine[5]) is None and lookup(pool, fine[4]) is None
    assert lookup(pool, hs[1]) == [b1]
    assert pool.ref_counts([b0, b1]) == [1, 1] and pool.free_queue() == [3, 4]
    assert_consistent(pool)


def test_partial_promotion_to_longer_partial_and_equal_length_secondary():
    pool = make(3, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)[0]
    hs = hashes(range(4))
    pool.cache_partial_block(b, hs, 8, 0, BS, 8)        # key hs[0], 8 tokens
    pool.cache_partial_block(b, hashes(["o"]), 8, 0, BS, 8)  # equal length: secondary
    assert pool.block_keys(b) == [(hs[0], 0), (h("o"), 0)]
    pool.take_events()
    pool.cache_partial_block(b, hs, 16, 0, BS, 8)       # more tokens: replaces both
    assert pool.block_keys(b) == [(hs[1], 0)] and pool.block_hash_num_tokens(b) == 16
    assert pool.take_events() == [BlockRemoved(hs[0], 0), BlockRemoved(h("o"), 0),
                                  BlockStored((hs[1],), hs[0], 8, 0)]


def test_partial_replace_existing_hashes():
    pool = make(3, enable_kv_cache_events=True)
    b = pool.get_new_blocks(1)[0]
    hs = hashes(range(4))
    pool.cache_partial_block(b, hs, 16, 0, BS, 4)  # hs[3], 16
    pool.cache_partial_block(b, hs, 8, 0, BS, 4)   # hs[1], secondary
    pool.cache_partial_block(b, hs, 4, 1, BS, 4)   # (hs[0], 1), secondary
    assert pool.block_keys(b) == [(hs[3], 0), (hs[1], 0), (hs[0], 1)]
    pool.take_events()
    # replacing with a shorter key: all old keys go (primary first, then secondaries in order)
    assert pool.cache_partial_block(b, hs, 8, 0, BS, 4, replace_existing_hashes=True) == (hs[1], 0)
    assert pool.block_keys(b) == [(hs[1], 0)]
    assert pool.block_hash_num_tokens(b) == 8
    assert pool.take_events() == [BlockRemoved(hs[3], 0), BlockRemoved(hs[1], 0), BlockRemoved(hs[0], 1),
                                  BlockStored((hs[1],), hs[0], 4, 0)]
    assert lookup(pool, hs[3]) is None and lookup(pool, hs[0], [1]) is None
    # the same key without replace: nothing happens; with replace: removed and re-stored
    assert pool.cache_partial_block(b, hs, 8, 0, BS, 4) == (hs[1], 0)
    assert pool.take_events() == []
    pool.cache_partial_block(b, hs, 8, 0, BS, 4, replace_existing_hashes=True)
    assert pool.take_events() == [BlockRemoved(hs[1], 0), BlockStored((hs[1],), hs[0], 4, 0)]
    assert pool.block_keys(b) == [(hs[1], 0)]
    assert_consistent(pool)


def test_partial_null_block_returns_none():
    pool = make(3, enable_kv_cache_events=True)
    before = state_digest(pool)
    assert pool.cache_partial_block(0, hashes([0]), 4, 0, BS, 4) is None
    assert state_digest(pool) == before and pool.take_events() == []


def test_partial_on_free_block_does_not_touch_queue():
    pool = make(4)
    assert pool.cache_partial_block(2, hashes([0]), 8, 0, BS, 8) == (h(0), 0)
    assert pool.free_queue() == [1, 2, 3] and pool.ref_counts() == [0] * 4
    assert lookup(pool, h(0)) == [2]
    assert pool.get_new_blocks(2) == [1, 2]
    assert lookup(pool, h(0)) is None


def test_move_block_hashes_copy_on_write():
    pool = make(6, enable_kv_cache_events=True)
    other, src, dst = pool.get_new_blocks(3)
    hs = hashes(["m0", "m1"])
    pool.cache_full_blocks([src], hs, 0, 1, BS, 0)                # src primary (m0, 0), 16 tokens
    pool.cache_partial_block(src, hashes(["m0", "x"]), 4, 2, BS, 4)  # src secondary (m0, 2)
    pool.cache_full_blocks([other], hs, 0, 1, BS, 0)              # other also answers to (m0, 0)
    assert lookup(pool, hs[0]) == [src]
    pool.take_events()
    before = pool_state(pool)
    pool.move_block_hashes(src, dst)
    assert pool.block_keys(dst) == [(hs[0], 0), (hs[0], 2)]
    assert pool.block_hash_num_tokens(dst) == BS
    assert pool.block_keys(src) == [] and pool.block_hash_num_tokens(src) is None
    # moved entries are newly inserted: the other holder of (m0, 0) now comes first
    assert lookup(pool, hs[0]) == [other]
    assert lookup(pool, hs[0], [2]) == [dst]
    assert pool.take_events() == []
    after = pool_state(pool)
    assert after["free_queue"] == before["free_queue"] and after["ref_counts"] == before["ref_counts"]
    pool.evict_blocks([other])
    assert lookup(pool, hs[0]) == [dst]
    assert_consistent(pool)


def test_move_block_hashes_from_unhashed_and_null_src_is_noop():
    pool = make(4)
    a, b = pool.get_new_blocks(2)
    before = state_digest(pool)
    pool.move_block_hashes(a, b)
    pool.move_block_hashes(0, b)
    pool.move_block_hashes(b, b)
    assert state_digest(pool) == before


def test_cache_full_blocks_events_parent_mask_and_null():
    pool = make(8, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(5)
    hs = hashes(["c0", "c1", "c2", "c3", "c4"])
    pool.cache_full_blocks(blocks, hs, 0, 1, BS, 3)
    assert pool.take_events() == [BlockStored((hs[0],), None, BS, 3)]
    # null block and masked-out blocks are skipped
    ids = [blocks[0], 0, blocks[2], blocks[3], blocks[4]]
    pool.cache_full_blocks(ids, hs, 1, 5, BS, 3, block_mask=[True, False, True, True])
    # i=1: null (mask True), i=2: masked out, i=3, i=4 stored
    assert pool.take_events() == [BlockStored((hs[3], hs[4]), hs[0], BS, 3)]
    assert pool.block_keys(blocks[2]) == []  # masked out
    assert pool.block_keys(blocks[3]) == [(hs[3], 3)] and pool.block_hash_num_tokens(blocks[3]) == 4 * BS
    assert pool.block_keys(blocks[4]) == [(hs[4], 3)] and pool.block_hash_num_tokens(blocks[4]) == 5 * BS
    assert pool.block_keys(0) == []
    # nothing stored -> an empty BlockStored (as vLLM); num_cached >= num_full -> no-op
    pool.cache_full_blocks(ids, hs, 1, 2, BS, 3)
    pool.cache_full_blocks(ids, hs, 4, 4, BS, 3)
    pool.cache_full_blocks(ids, hs, 5, 2, BS, 3)
    assert pool.take_events() == [BlockStored((), hs[0], BS, 3)]
    assert pool.ref_counts(blocks) == [1] * 5 and pool.free_queue() == [6, 7]
    assert_consistent(pool)


def test_cache_full_blocks_block_size_multiple_of_hash_block_size():
    pool = make(4)
    blocks = pool.get_new_blocks(2)
    fine = hashes(range(8))  # hash block size 8, block size 32: every 4th hash... caller picks
    coarse = fine[3::4]
    pool.cache_full_blocks(blocks, coarse, 0, 2, 32, 0)
    assert [pool.block_hash_num_tokens(b) for b in blocks] == [32, 64]
    assert [pool.block_keys(b) for b in blocks] == [[(fine[3], 0)], [(fine[7], 0)]]


def test_get_new_blocks_event_order_primary_then_secondaries():
    pool = make(3, enable_kv_cache_events=True)
    a, b = pool.get_new_blocks(2)
    hs = hashes(range(4))
    pool.cache_partial_block(a, hs, 16, 0, BS, 4)
    pool.cache_partial_block(a, hs, 4, 0, BS, 4)
    pool.cache_partial_block(a, hs, 12, 0, BS, 4)
    pool.cache_full_blocks([b], [h("b")], 0, 1, BS, 1)
    pool.free_blocks([b, a])
    assert pool.free_queue() == [b, a]
    pool.take_events()
    assert pool.get_new_blocks(2) == [b, a]
    assert pool.take_events() == [BlockRemoved(h("b"), 1),
                                  BlockRemoved(hs[3], 0), BlockRemoved(hs[0], 0), BlockRemoved(hs[2], 0)]


def test_events_disabled_records_nothing():
    pool = make(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes(range(2)), 0, 2, BS, 0)
    pool.evict_blocks(blocks)
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.take_events() == []


def test_evict_blocks_in_use_then_prepended_on_free():
    pool = make(6, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    hs = hashes(range(3))
    pool.cache_full_blocks(blocks, hs, 0, 3, BS, 0)
    pool.take_events()
    pool.evict_blocks([blocks[2], 0, blocks[0], blocks[2]])  # null is a no-op, duplicates once
    assert pool.take_events() == [BlockRemoved(hs[2], 0), BlockRemoved(hs[0], 0)]
    assert pool.ref_counts(blocks) == [1, 1, 1] and pool.free_queue() == [4, 5]
    assert lookup(pool, hs[0]) is None and lookup(pool, hs[1]) == [blocks[1]]
    free_request(pool, blocks)
    assert pool.free_queue() == [blocks[2], blocks[0], 4, 5, blocks[1]]
    pool.evict_blocks([blocks[1]])  # a free hashed block: stays where it is
    assert pool.free_queue() == [blocks[2], blocks[0], 4, 5, blocks[1]]
    assert_consistent(pool)


# =================================================================================================
# lookups, touch, free, usage, writability
# =================================================================================================

def test_get_cached_block_multi_group():
    pool = make(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [h("g")], 0, 1, BS, 0)
    pool.cache_full_blocks([b], [h("g")], 0, 1, BS, 1)
    pool.cache_full_blocks([c], [h("g")], 0, 1, BS, 1)
    before = state_digest(pool)
    assert lookup(pool, h("g"), [0, 1]) == [a, b]
    assert lookup(pool, h("g"), [1, 0]) == [b, a]
    assert lookup(pool, h("g"), [1, 1]) == [b, b]
    assert lookup(pool, h("g"), [0, 2]) is None
    assert lookup(pool, h("g"), [2]) is None
    assert lookup(pool, h("nope"), [0]) is None
    assert pool.get_cached_block(h("g"), []) == []
    assert pool.get_cached_block(h("nope"), []) == []
    assert state_digest(pool) == before  # pure


def test_touch_unlinks_free_blocks_keeping_order():
    pool = make(8)
    blocks = pool.get_new_blocks(7)
    pool.cache_full_blocks(blocks, hashes(range(7)), 0, 7, BS, 0)
    pool.free_blocks(blocks)
    assert pool.free_queue() == [1, 2, 3, 4, 5, 6, 7]
    pool.touch([4, 0, 1, 7])
    assert pool.free_queue() == [2, 3, 5, 6]
    assert pool.ref_counts() == [0, 1, 0, 0, 1, 0, 0, 1]
    pool.touch([4])  # held: just ref += 1
    assert pool.ref_counts([4]) == [2] and pool.free_queue() == [2, 3, 5, 6]
    pool.touch([2, 2])
    assert pool.ref_counts([2]) == [2] and pool.free_queue() == [3, 5, 6]
    pool.touch([])
    assert_consistent(pool)


def test_free_block_listed_twice_with_ref2_is_queued_once():
    pool = make(4)
    b = pool.get_new_blocks(1)[0]
    pool.touch([b])
    pool.free_blocks([b, b])
    assert pool.free_queue() == [b, 2, 3]
    assert pool.ref_counts([b]) == [0] and pool.get_num_free_blocks() == 3
    c = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([c], [h(0)], 0, 1, BS, 0)
    pool.touch([c])
    pool.free_blocks([c, c])
    assert pool.free_queue() == [2, 3, c]
    assert_consistent(pool)


def test_free_skips_null_block_and_keeps_reach_zero_order():
    pool = make(8)
    blocks = pool.get_new_blocks(6)  # 1..6
    pool.cache_full_blocks(blocks, hashes(range(3)), 0, 3, BS, 0)  # 1, 2, 3 hashed
    pool.touch([2, 5])
    pool.free_blocks([0, 0, 5, 2, 6, 1, 0, 4, 3, 2, 5])
    # reach-0 order: 6, 1, 4, 3, 2, 5 -> F = [6, 4, 5], L = [1, 3, 2]
    assert pool.free_queue() == [6, 4, 5, 7, 1, 3, 2]
    assert pool.ref_counts() == [0] * 8
    pool.free_blocks([0])
    pool.free_blocks([])
    assert pool.free_queue() == [6, 4, 5, 7, 1, 3, 2]
    assert_consistent(pool)


def test_get_new_blocks_zero_and_all():
    pool = make(4)
    before = state_digest(pool)
    assert pool.get_new_blocks(0) == []
    assert state_digest(pool) == before
    assert pool.get_new_blocks(3) == [1, 2, 3]
    assert pool.get_new_blocks(0) == []
    expect_error(pool, OutOfBlocksError, "get_new_blocks", lambda: pool.get_new_blocks(1))


def test_get_usage():
    assert make(1).get_usage() == 0.0
    pool = make(5)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.cache_full_blocks(blocks, hashes(range(2)), 0, 2, BS, 0)
    pool.free_blocks([blocks[0]])
    assert pool.get_usage() == pytest.approx(0.25)  # a free hashed block counts as free
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)


def test_is_block_writable():
    pool = make(6)
    assert pool.is_block_writable(0) is False
    a, b, c = pool.get_new_blocks(3)
    assert pool.is_block_writable(a) is True
    pool.touch([b])
    assert pool.is_block_writable(b) is False  # ref 2
    pool.cache_full_blocks([c], [h(0)], 0, 1, BS, 0)
    assert pool.is_block_writable(c) is False  # hashed
    pool.evict_blocks([c])
    assert pool.is_block_writable(c) is True
    assert pool.is_block_writable(4) is False  # free
    pool.free_blocks([b])
    assert pool.is_block_writable(b) is True
    with pytest.raises(InvalidBlockIdError):
        pool.is_block_writable(6)


def test_tensor_and_numpy_ids_accepted():
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    pool = make(6)
    blocks = pool.get_new_blocks(3)
    pool.touch(torch.tensor(blocks))
    pool.free_blocks(np.array(blocks[::-1], dtype=np.int64))
    assert pool.ref_counts(blocks) == [1, 1, 1]
    pool.free_blocks(torch.tensor(blocks, dtype=torch.int32))
    assert pool.free_queue() == [1, 2, 3, 4, 5]
    with pytest.raises(InvalidArgumentError):
        pool.free_blocks(torch.tensor([1.0]))


def test_helpers_request_hashes_and_digest():
    assert h(1) == h("1") and len(h(1)) == 32 and h(1) != h(2)
    assert request_hashes([5, 6, 7], 47) == [h(5), h(6)]
    with pytest.raises(ValueError):
        request_hashes([5], 40)
    a, b = make(4), make(4)
    assert state_digest(a) == state_digest(b)
    a.get_new_blocks(1)
    assert state_digest(a) != state_digest(b)


# =================================================================================================
# Property tests: an independent model written from docs/semantics.md section 2, checked op for op.
# =================================================================================================

class SpecModel:
    """docs/semantics.md section 2 as the simplest possible Python (lists, no links). Watchers are tags."""

    def __init__(self, n: int, caching: bool, max_keys: int):
        self.n, self.caching, self.max_keys = n, caching, max_keys
        self.ref = [0] * n
        self.queue = list(range(1, n))
        self.keys: list[list] = [[] for _ in range(n)]
        self.ntok: list = [None] * n
        self.map: dict = {}
        self.watchers: dict = {}
        self.events: list = []

    # helpers
    def _check(self, op, ids):
        for b in ids:
            if not 0 <= b < self.n:
                raise InvalidBlockIdError(op, f"block id {b}", b)

    def _remove_keys(self, b, emit=True):
        out = self.keys[b]
        for k in out:
            self.map[k].remove(b)
            if not self.map[k]:
                del self.map[k]
            if emit:
                self.events.append(BlockRemoved(*k))
        self.keys[b], self.ntok[b] = [], None
        return out

    def _insert(self, b, key, ntok):
        if not self.keys[b]:
            self.ntok[b] = ntok
        self.keys[b].append(key)
        self.map.setdefault(key, []).append(b)

    def lookup(self, hh, groups):
        out = []
        for g in groups:
            if not self.map.get((hh, g)):
                return None
            out.append(self.map[(hh, g)][0])
        return out

    # ops (each raises before changing anything, or the caller restores a copy)
    def get_new_blocks(self, n):
        if n < 0:
            raise InvalidCountError("get_new_blocks", "neg", n)
        if n > len(self.queue):
            raise OutOfBlocksError("get_new_blocks", "too many", n)
        taken, self.queue = self.queue[:n], self.queue[n:]
        for b in taken:
            if self.caching:
                self._remove_keys(b)
            self.ref[b] = 1
        fired = [(self.watchers.pop(b), b) for b in taken if b in self.watchers]
        return taken, fired

    def free_blocks(self, ids):
        self._check("free_blocks", ids)
        for b in set(ids) - {0}:
            if ids.count(b) > self.ref[b]:
                raise DoubleFreeError("free_blocks", "double free", b)
        front, back = [], []
        for b in ids:
            if b == 0:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (back if self.caching and self.keys[b] else front).append(b)
        self.queue = front + self.queue + back

    def touch(self, ids):
        self._check("touch", ids)
        for b in ids:
            if b == 0:
                continue
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def unpin_blocks(self, ids, tag):
        self._check("unpin_blocks", ids)
        if 0 in ids:
            raise NullBlockError("unpin_blocks", "null", 0)
        for b in set(ids):
            if ids.count(b) > self.ref[b]:
                raise DoubleFreeError("unpin_blocks", "unpin", b)
        for b in ids:
            self.ref[b] -= 1
            self.watchers[b] = tag
            if self.ref[b] == 0:
                self.queue.append(b)

    def cache_full_blocks(self, ids, hs, nc, nf, bs, g, mask):
        self._check("cache_full_blocks", ids)
        if nc >= nf or not self.caching:
            return
        stored, seen = [], set()
        for i in range(nc, nf):
            b = ids[i]
            if b == 0 or (mask is not None and not mask[i - nc]):
                continue
            # Not in docs/semantics.md's text (which would read a repeat as a promotion): the pools reject a
            # non-null unmasked block listed twice, where vLLM asserts.
            if b in seen:
                raise InvalidArgumentError("cache_full_blocks", "listed twice", b)
            seen.add(b)
            key, nt = (hs[i], g), (i + 1) * bs
            if self.keys[b]:
                if self.ntok[b] >= nt:
                    raise HashConflictError("cache_full_blocks", "recache", b)
                self._remove_keys(b)
            if key in self.keys[b]:
                continue
            if len(self.keys[b]) >= self.max_keys:
                raise KeyCapacityError("cache_full_blocks", "cap", b)
            self._insert(b, key, nt)
            stored.append(hs[i])
        # one BlockStored per call past the no-op checks, even an empty one (as vLLM)
        self.events.append(BlockStored(tuple(stored), hs[nc - 1] if nc > 0 else None, bs, g))

    def cache_partial_block(self, b, hs, nt, g, bs, hbs, replace):
        self._check("cache_partial_block", [b])
        k = nt // hbs
        assert bs % hbs == 0 and nt % hbs == 0 and 0 < k <= len(hs)  # the machine only makes valid sizes
        if b == 0 or not self.caching:
            return None
        key = (hs[k - 1], g)
        if key in self.keys[b] and not replace:
            return key
        if replace or (self.keys[b] and self.ntok[b] < nt):
            self._remove_keys(b)
        if len(self.keys[b]) >= self.max_keys:
            raise KeyCapacityError("cache_partial_block", "cap", b)
        self._insert(b, key, nt)
        self.events.append(BlockStored((hs[k - 1],), hs[k - 2] if k >= 2 else None, hbs, g))
        return key

    def move_block_hashes(self, s, d):
        self._check("move_block_hashes", [s, d])
        if d == 0:
            raise NullBlockError("move_block_hashes", "null", d)
        if self.keys[d]:
            raise HashConflictError("move_block_hashes", "hashed", d)
        nt = self.ntok[s]
        for key in self._remove_keys(s, emit=False):
            self._insert(d, key, nt)

    def evict_blocks(self, ids):
        self._check("evict_blocks", ids)
        for b in dict.fromkeys(ids):
            if b != 0:
                self._remove_keys(b)

    def reset_prefix_cache(self):
        if any(self.ref[1:]):
            return False, []
        self.keys = [[] for _ in range(self.n)]
        self.ntok = [None] * self.n
        self.map.clear()
        self.events.append(AllBlocksCleared())
        fired = [(tag, b) for b, tag in self.watchers.items()]
        self.watchers.clear()
        return True, fired


HASH_UNIVERSE = hashes(range(6))
GROUPS = [0, 1]


class PoolMachine(RuleBasedStateMachine):
    """Random valid (and some invalid) op sequences; the reference must match SpecModel op for op
    and pass validate() after every op."""

    @initialize(n=st.integers(1, 10), caching=st.sampled_from([True, True, True, False]),
                max_keys=st.integers(1, 4))
    def setup(self, n, caching, max_keys):
        self.pool = ReferenceBlockPool(n, enable_caching=caching, enable_kv_cache_events=True,
                                       max_keys_per_block=max_keys)
        self.model = SpecModel(n, caching, max_keys)
        self.fired: list = []
        self.tag = 0

    # ---- plumbing ------------------------------------------------------------------------------
    def _cb(self):
        self.tag += 1
        tag = self.tag

        def on_reuse(b):
            self.fired.append((tag, b, state_digest(self.pool)))
        return tag, on_reuse

    def _run(self, op, pool_fn, model_fn):
        """Apply the op to both; errors must agree in type and leave the pool unchanged.
        Returns (pool result, model result) or None on error."""
        saved = copy.deepcopy(self.model)
        self.model.events = []
        before = state_digest(self.pool)
        self.fired = []
        exp_err = got_err = None
        try:
            exp = model_fn()
        except PoolError as e:
            exp_err, self.model = e, saved
            self.model.events = []
        try:
            got = pool_fn()
        except PoolError as e:
            got_err = e
        if exp_err is not None:
            assert type(got_err) is type(exp_err), f"{op}: expected {type(exp_err).__name__}, got {got_err!r}"
            assert op in str(got_err)
            assert state_digest(self.pool) == before
            assert self.pool.take_events() == []
            assert self.fired == []
            return None
        assert got_err is None, f"{op}: unexpected {got_err!r}"
        assert self.pool.take_events() == self.model.events, op
        self.model.events = []
        return got, exp

    def _held(self):
        return [b for b in range(1, self.model.n) for _ in range(self.model.ref[b])]

    def _cached_blocks(self):
        return sorted({bs[0] for bs in self.model.map.values()})

    # ---- rules -------------------------------------------------------------------------------------
    @rule(data=st.data())
    def get_new_blocks(self, data):
        n = data.draw(st.integers(0, len(self.model.queue)))
        res = self._run("get_new_blocks", lambda: self.pool.get_new_blocks(n),
                        lambda: self.model.get_new_blocks(n))
        got, (taken, fired) = res
        assert got == taken
        final = state_digest(self.pool)
        assert [(t, b) for t, b, _ in self.fired] == fired
        assert all(d == final for _, _, d in self.fired)
        for b in got:
            assert self.pool.block_keys(b) == [] and self.pool.ref_counts([b]) == [1]

    @precondition(lambda self: any(self.model.ref[1:]))
    @rule(data=st.data())
    def free_blocks(self, data):
        held = self._held()
        ids = data.draw(st.permutations(held))[: data.draw(st.integers(1, len(held)))]
        if data.draw(st.booleans()):
            ids.insert(data.draw(st.integers(0, len(ids))), 0)
        self._run("free_blocks", lambda: self.pool.free_blocks(ids), lambda: self.model.free_blocks(ids))

    @rule(data=st.data())
    def touch(self, data):
        cands = sorted(set(self._cached_blocks()) | set(self._held()) | {0})
        ids = data.draw(st.lists(st.sampled_from(cands), max_size=4))
        self._run("touch", lambda: self.pool.touch(ids), lambda: self.model.touch(ids))

    @rule(data=st.data())
    def touch_lookup_hit(self, data):
        hh, g = data.draw(st.sampled_from(HASH_UNIVERSE)), data.draw(st.sampled_from(GROUPS))
        hit = self.pool.get_cached_block(hh, [g])
        assert hit == self.model.lookup(hh, [g])
        if hit is not None:
            self._run("touch", lambda: self.pool.touch(hit), lambda: self.model.touch(hit))

    @precondition(lambda self: self.model.n > 1)
    @rule(data=st.data())
    def cache_full_blocks(self, data):
        held = sorted(set(self._held()))
        pool_ids = held if held and data.draw(st.booleans()) else list(range(self.model.n))
        ids = data.draw(st.lists(st.sampled_from(pool_ids), min_size=1, max_size=4))
        hs = data.draw(st.lists(st.sampled_from(HASH_UNIVERSE), min_size=len(ids), max_size=len(ids)))
        nc = data.draw(st.integers(0, len(ids)))
        nf = data.draw(st.integers(0, len(ids)))
        bs = data.draw(st.sampled_from([4, 16]))
        g = data.draw(st.sampled_from(GROUPS))
        mask = data.draw(st.none() | st.lists(st.booleans(), min_size=max(nf - nc, 0), max_size=max(nf - nc, 0)))
        self._run("cache_full_blocks", lambda: self.pool.cache_full_blocks(ids, hs, nc, nf, bs, g, mask),
                  lambda: self.model.cache_full_blocks(ids, hs, nc, nf, bs, g, mask))

    @rule(data=st.data())
    def cache_partial_block(self, data):
        b = data.draw(st.integers(0, self.model.n - 1))
        hs = data.draw(st.lists(st.sampled_from(HASH_UNIVERSE), min_size=1, max_size=4))
        hbs = data.draw(st.sampled_from([4, 8]))
        bs = hbs * data.draw(st.sampled_from([1, 2, 4]))
        nt = hbs * data.draw(st.integers(1, len(hs)))
        g = data.draw(st.sampled_from(GROUPS))
        replace = data.draw(st.booleans())
        res = self._run("cache_partial_block",
                        lambda: self.pool.cache_partial_block(b, hs, nt, g, bs, hbs, replace),
                        lambda: self.model.cache_partial_block(b, hs, nt, g, bs, hbs, replace))
        if res is not None:
            assert res[0] == res[1]

    @rule(data=st.data())
    def evict_blocks(self, data):
        ids = data.draw(st.lists(st.integers(0, self.model.n - 1), max_size=4))
        self._run("evict_blocks", lambda: self.pool.evict_blocks(ids), lambda: self.model.evict_blocks(ids))

    @precondition(lambda self: any(self.model.ref[1:]))
    @rule(data=st.data())
    def unpin_blocks(self, data):
        held = self._held()
        ids = data.draw(st.permutations(held))[: data.draw(st.integers(1, len(held)))]
        tag, cb = self._cb()
        self._run("unpin_blocks", lambda: self.pool.unpin_blocks(ids, cb),
                  lambda: self.model.unpin_blocks(ids, tag))

    @precondition(lambda self: self.model.n > 1)
    @rule(data=st.data())
    def move_block_hashes(self, data):
        keyless = [b for b in range(1, self.model.n) if not self.model.keys[b]]
        dst = data.draw(st.sampled_from(keyless)) if keyless and data.draw(st.integers(0, 4)) else \
            data.draw(st.integers(0, self.model.n - 1))
        src = data.draw(st.sampled_from(self._cached_blocks() or [0])) if data.draw(st.booleans()) else \
            data.draw(st.integers(0, self.model.n - 1))
        self._run("move_block_hashes", lambda: self.pool.move_block_hashes(src, dst),
                  lambda: self.model.move_block_hashes(src, dst))

    @rule()
    def reset_prefix_cache(self):
        got, (ok, fired) = self._run("reset_prefix_cache", self.pool.reset_prefix_cache,
                                     self.model.reset_prefix_cache)
        assert got is ok
        assert [(t, b) for t, b, _ in self.fired] == fired
        final = state_digest(self.pool)
        assert all(d == final for _, _, d in self.fired)

    @rule(data=st.data())
    def invalid_op(self, data):
        """One deliberately invalid call; it must raise the model's error and change nothing."""
        n, m = self.model.n, self.model
        bad_id = data.draw(st.sampled_from([n, n + 5, -1, -n]))
        free = [b for b in range(1, n) if m.ref[b] == 0]
        kind = data.draw(st.sampled_from(
            ["get_neg", "get_many", "free_range", "touch_range", "evict_range", "unpin_range", "move_range"]
            + (["free_double", "unpin_double"] if free else []) + (["unpin_null"] if any(m.ref[1:]) else [])
            + (["move_null"] if n > 1 else [])
            + (["partial_range"] if m.caching else [])))
        held = self._held()
        tag, cb = self._cb()
        cases = {
            "get_neg": ("get_new_blocks", lambda p: p.get_new_blocks(-1), lambda: m.get_new_blocks(-1)),
            "get_many": ("get_new_blocks", lambda p: p.get_new_blocks(len(m.queue) + 1),
                         lambda: m.get_new_blocks(len(m.queue) + 1)),
            "free_range": ("free_blocks", lambda p: p.free_blocks(held + [bad_id]),
                           lambda: m.free_blocks(held + [bad_id])),
            "touch_range": ("touch", lambda p: p.touch(held + [bad_id]), lambda: m.touch(held + [bad_id])),
            "evict_range": ("evict_blocks", lambda p: p.evict_blocks([1 % n, bad_id]),
                            lambda: m.evict_blocks([1 % n, bad_id])),
            "unpin_range": ("unpin_blocks", lambda p: p.unpin_blocks([bad_id], cb),
                            lambda: m.unpin_blocks([bad_id], tag)),
            "move_range": ("move_block_hashes", lambda p: p.move_block_hashes(bad_id, n - 1),
                           lambda: m.move_block_hashes(bad_id, n - 1)),
            "free_double": ("free_blocks", lambda p: p.free_blocks(held + free[:1]),
                            lambda: m.free_blocks(held + free[:1])),
            "unpin_double": ("unpin_blocks", lambda p: p.unpin_blocks(held + free[:1], cb),
                             lambda: m.unpin_blocks(held + free[:1], tag)),
            "unpin_null": ("unpin_blocks", lambda p: p.unpin_blocks(held[:1] + [0], cb),
                           lambda: m.unpin_blocks(held[:1] + [0], tag)),
            "move_null": ("move_block_hashes", lambda p: p.move_block_hashes(n - 1, 0),
                          lambda: m.move_block_hashes(n - 1, 0)),
            "partial_range": ("cache_partial_block", lambda p: p.cache_partial_block(bad_id, [h(0)], 4, 0, 4, 4),
                              lambda: m.cache_partial_block(bad_id, [h(0)], 4, 0, 4, 4, False)),
        }
        op, pool_fn, model_fn = cases[kind]
        res = self._run(op, lambda: pool_fn(self.pool), model_fn)
        assert res is None, f"{kind} did not fail"

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        pool, m = self.pool, self.model
        assert_consistent(pool)  # includes validate()
        assert pool.free_queue() == m.queue
        assert pool.ref_counts() == m.ref
        assert sum(pool.ref_counts()[1:]) == len(self._held())
        assert pool.get_num_free_blocks() == len(pool.free_queue())
        for b in range(m.n):
            assert pool.block_keys(b) == m.keys[b]
            assert pool.block_hash_num_tokens(b) == m.ntok[b]
            assert pool.is_block_writable(b) == (b != 0 and m.ref[b] == 1 and not m.keys[b])
        assert pool.num_watchers() == len(m.watchers)
        for hh in HASH_UNIVERSE:
            for groups in ([0], [1], [0, 1]):
                assert pool.get_cached_block(hh, groups) == m.lookup(hh, groups)
        expect_usage = 0.0 if m.n == 1 else 1 - len(m.queue) / (m.n - 1)
        assert pool.get_usage() == pytest.approx(expect_usage)
        if not m.caching:
            assert all(not k for k in m.keys)


TestPoolMachine = PoolMachine.TestCase
