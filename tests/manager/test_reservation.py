"""Reservations (docs/semantics.md section 8): ``reserve(slots, num_tokens)`` books blocks for a
request's next tokens as a count held against the free blocks (nothing popped, nothing evicted),
``release_reservation(slots)`` and ``free`` give it back, and every allocation of the request draws
from it first while the other requests' admissions see ``num_free - reserved``.

Hand-written scenarios pin exact behaviour on the reference and the device manager side by side
(``harness.manager_pair.ManagerPair`` compares the whole state after every op: block
tables, counters, reservations, pending copies, free queue, ref counts, keys, events); a hypothesis
workload mixes reservations with every manager op, decode steps and bursts (``DecodeStep(steps=K)``).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from gpupool.errors import InvalidArgumentError, InvalidCountError, OutOfBlocksError
from gpupool.events import BlockRemoved
from gpupool.graph import DecodeStep
from harness.device import i32
from harness.ops import call_both, fill_step, reference_decode_step
from harness.state import pool_state
from harness.strategies import draw_batch, note, rare
from harness.manager_pair import (
    add, admitted_norm, alloc, append_hashes, free_both, GROUP_KINDS, HASH, ManagerPair, op_add,
    OPS as MANAGER_OPS,
)


def pair(groups=("full",), *, num_blocks=14, block_size=4, events=True, **kw) -> ManagerPair:
    return ManagerPair(num_blocks, block_size=block_size, max_num_reqs=4, max_blocks_per_req=8, groups=groups,
                caching=True, events=events, **kw)


def reserve(p: ManagerPair, slots, nts, tensors: bool = False):
    """``reserve`` on both managers (the device's with tensors or lists); the booked flags."""
    def dev_fn():
        return p.dev.reserve(i32(slots), i32(nts)) if tensors else p.dev.reserve(slots, nts)

    return p.do(f"reserve({slots}, {nts}, tensors={tensors})", lambda: p.ref.reserve(slots, nts), dev_fn,
                admitted_norm)


def release(p: ManagerPair, slots, tensors: bool = False) -> None:
    p.do(f"release_reservation({slots})", lambda: p.ref.release_reservation(slots),
         lambda: p.dev.release_reservation(i32(slots) if tensors else slots))


def reservations(p: ManagerPair) -> tuple[list[int], int]:
    """(per-slot reservations, total), equal on both sides."""
    ref = (p.ref.reservations(), p.ref.get_num_reserved_blocks())
    dev = (p.dev.reservations(), p.dev.get_num_reserved_blocks())
    assert ref == dev, (ref, dev)
    return ref


def validate(p: ManagerPair) -> None:
    p.ref.validate()
    p.dev.validate()


def expect_error(p: ManagerPair, exc: type, desc: str, ref_fn, dev_fn) -> None:
    """Both managers raise exactly ``exc`` (the device's at ``pool.check()``) and change nothing."""
    before_ref, before_dev = pool_state(p.ref.pool), pool_state(p.dev.pool)
    before = reservations(p)
    r_val, r_err, d_val, d_err = call_both(ref_fn, dev_fn, p.dev.pool.check)
    assert type(r_err) is exc and type(d_err) is exc, (desc, r_err, d_err)
    assert r_err.op == d_err.op
    assert pool_state(p.ref.pool) == before_ref and pool_state(p.dev.pool) == before_dev, desc
    assert reservations(p) == before, desc
    p.compare()
    validate(p)


# =================================================================================================
# Hand-written scenarios
# =================================================================================================

BOTH_PATHS = pytest.mark.parametrize("parallel", [True, pytest.param(False, marks=pytest.mark.slow)],
                                     ids=["parallel", "exact"])  # the exact path's twin: slow (quick budget)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "exact"])
@pytest.mark.heavy("exact")
def test_reserve_holds_blocks_against_other_requests(parallel):
    """11 usable blocks. Request 0 (1 block, 4 tokens) reserves 8 more tokens: 2 blocks, none taken
    off the queue. Request 1 takes 7 of the 8 unreserved; request 2 then gets 1 block but not 3
    (though 3 are free) and not a second one; request 0's growth to 12 tokens comes out of its
    reservation, which then is 0."""
    p = pair(num_blocks=12)
    p.dev.parallel = parallel
    add(p, 0, [], 0)
    assert alloc(p, [0], [4], [4]) == [True]
    assert reserve(p, [0], [8]) == [True]
    assert reservations(p) == ([2, 0, 0, 0], 2)
    assert p.ref.pool.get_num_free_blocks() == 10  # nothing taken off the queue
    add(p, 1, [], 0)
    assert alloc(p, [1], [28], [28]) == [True]  # 7 blocks of the 8 unreserved
    add(p, 2, [], 0)
    assert alloc(p, [2], [12], [12]) == [False]  # 3 blocks: 3 free, but 2 of them are reserved
    assert alloc(p, [2], [4], [4]) == [True]
    assert alloc(p, [2], [5], [5]) == [False]  # the last 2 free blocks are request 0's
    assert p.ref.pool.get_num_free_blocks() == 2
    assert alloc(p, [0], [12], [12]) == [True]  # its reservation covers both
    assert reservations(p) == ([0, 0, 0, 0], 0)
    assert p.ref.pool.get_num_free_blocks() == 0
    validate(p)


@BOTH_PATHS
def test_batch_of_other_requests_sees_the_reservation(parallel):
    """One allocate_slots batch of three other requests, ``stop_on_failure=False``: the third does not
    fit the unreserved blocks although the free queue holds enough."""
    p = pair()
    p.dev.parallel = parallel
    for r in range(4):
        add(p, r, [], 0)
    assert alloc(p, [0], [4], [4]) == [True]
    assert reserve(p, [0], [12]) == [True]  # 16 tokens: 3 blocks more
    assert reservations(p) == ([3, 0, 0, 0], 3)
    # 12 free, 9 unreserved: 4 + 4 fit, the next 4 do not (4 are free), then 1 does
    assert alloc(p, [1, 2, 3], [16, 16, 16], [16, 16, 16], sof=False) == [True, True, False]
    assert p.ref.pool.get_num_free_blocks() == 4
    assert alloc(p, [3], [4], [4]) == [True]
    assert alloc(p, [0], [16], [16]) == [True]
    assert reservations(p) == ([0, 0, 0, 0], 0)
    assert p.ref.pool.get_num_free_blocks() == 0
    validate(p)


def _cached_pool(p: ManagerPair) -> None:
    """8 usable blocks. Requests 0 and 1 ran and finished: their 5 keyed blocks sit in the free queue
    behind the 3 never used ones (queue 6 7 8 5 4 3 2 1); request 2 takes block 6. 7 free, 5 keyed."""
    add(p, 0, [1, 2, 3], 12)
    add(p, 1, [7, 8], 8)
    assert alloc(p, [0, 1], [12, 8], [12, 8]) == [True, True]
    free_both(p, [1], False, "free")
    free_both(p, [0], False, "free")
    add(p, 2, [], 0)
    add(p, 3, [], 0)
    assert alloc(p, [2], [3], [3]) == [True]
    assert pool_state(p.ref.pool)["free_queue"] == [7, 8, 5, 4, 3, 2, 1]


def test_reserve_evicts_nothing_and_keeps_the_queue_order():
    """Reservations as large as every free block: the free queue (order included), the keys and the
    ref counts are as before, and no KV event is written; a further growth is refused."""
    p = pair(num_blocks=9)
    _cached_pool(p)
    before = pool_state(p.ref.pool)
    assert before == pool_state(p.dev.pool)
    assert sum(1 for keys, _ in before["blocks"] if keys) == 5
    assert reserve(p, [2, 3], [17, 8]) == [True, True]  # 20 tokens: 5 - 1 = 4; 8 tokens: 2
    assert reservations(p) == ([0, 0, 4, 2], 6)
    assert reserve(p, [3], [12]) == [True]  # 3: every free block reserved
    assert reservations(p) == ([0, 0, 4, 3], 7)
    assert p.ref.pool.take_events() == [] and p.dev.pool.take_events() == []
    assert pool_state(p.ref.pool) == before and pool_state(p.dev.pool) == before
    assert reserve(p, [2], [21]) == [False]  # 5 blocks: a growth of 1, nothing unreserved
    assert reservations(p) == ([0, 0, 4, 3], 7)
    assert pool_state(p.ref.pool) == before and pool_state(p.dev.pool) == before
    validate(p)


@BOTH_PATHS
@pytest.mark.heavy("parallel")
def test_allocation_inside_a_reservation_evicts_in_lru_order(parallel):
    """Two twin pairs, one with a reservation for request 2, one without: the same allocations pop
    the same blocks from the queue's head (7, 8, then the cached 5, 4, 3: their keys evicted only
    now) with the same events; only the reservation counters differ."""
    with_r, without = pair(num_blocks=9), pair(num_blocks=9)
    for p in (with_r, without):
        p.dev.parallel = parallel
        _cached_pool(p)
    assert reserve(with_r, [2], [21]) == [True]  # 24 tokens: 6 - 1 = 5 blocks
    assert reservations(with_r) == ([0, 0, 5, 0], 5)
    for n, left in ((6, 4), (13, 2), (17, 1), (24, 0)):  # growth by 1, 2, 1 and 1 blocks
        evs = []
        for p in (with_r, without):
            assert alloc(p, [2], [n], [n]) == [True]
        for p in (with_r, without):
            p.compare()  # drains the events: equal on both sides of each pair
        assert pool_state(with_r.ref.pool) == pool_state(without.ref.pool), n
        assert with_r.dev.rows(0) == without.dev.rows(0), n
        assert reservations(with_r) == ([0, 0, left, 0], left)
    assert with_r.ref.block_table(0)[2] == [6, 7, 8, 5, 4, 3]
    assert all(not keys for keys, _ in pool_state(with_r.ref.pool)["blocks"][3:6])  # evicted
    validate(with_r)


def test_eviction_events_come_with_the_allocation_not_the_reservation():
    """Events on: ``reserve`` writes none; the allocation that pops the cached block 5 (hash 8)
    removes its key then, on both managers."""
    p = pair(num_blocks=9)
    _cached_pool(p)
    p.compare()
    assert reserve(p, [2], [21]) == [True]
    assert p.ref.pool.take_events() == [] == p.dev.pool.take_events()
    ops = (lambda: p.ref.allocate_slots([2], [13], [13]), lambda: p.dev.allocate_slots([2], [13], [13]))
    r_adm, _, d_adm, _ = call_both(*ops, p.dev.pool.check)
    assert list(r_adm) == [True] and d_adm.tolist() == [1]
    ev = p.ref.pool.take_events()
    assert ev == p.dev.pool.take_events() == [BlockRemoved(HASH[8], 0)]
    assert p.ref.block_table(0)[2] == [6, 7, 8, 5]
    assert reservations(p) == ([0, 0, 2, 0], 2)
    p.compare()
    validate(p)


def test_release_and_free_give_the_reservation_back():
    p = pair()
    for r in range(3):
        add(p, r, [], 0)
    assert alloc(p, [0, 1], [4, 4], [4, 4]) == [True, True]  # 11 free
    assert reserve(p, [0, 1], [8, 20]) == [True, True]  # 2 and 5 blocks
    assert reservations(p) == ([2, 5, 0, 0], 7)
    assert alloc(p, [2], [20], [20]) == [False]  # 5 blocks > 11 - 7
    release(p, [1])
    assert reservations(p) == ([2, 0, 0, 0], 2)
    assert alloc(p, [2], [32], [32]) == [True]  # 8 of the 9 unreserved
    assert reserve(p, [1], [8]) == [False]  # 2 blocks > 3 free - 2 reserved
    assert reserve(p, [1], [4]) == [True]  # 1 block
    assert reservations(p) == ([2, 1, 0, 0], 3)
    validate(p)
    free_both(p, [0], False, "free")
    assert reservations(p) == ([0, 1, 0, 0], 1)
    free_both(p, [1, 2], True, "free")
    assert reservations(p) == ([0, 0, 0, 0], 0)
    validate(p)


@BOTH_PATHS
def test_reserve_grows_never_shrinks_and_stops_at_the_first_failure(parallel):
    """A reservation is ``max(reserved, need)``: a smaller reserve keeps it. In a batch the first
    request whose growth does not fit is not booked, nor are the ones after it (even one whose
    growth is 0). Then one batch of reserved requests draws exactly its reservations."""
    p = pair()
    p.dev.parallel = parallel
    for r in range(4):
        add(p, r, [], 0)
    assert alloc(p, [0, 1, 2, 3], [4, 4, 4, 4], [4, 4, 4, 4]) == [True] * 4  # 9 free
    assert reserve(p, [0], [12]) == [True]  # 16 tokens: 3
    assert reserve(p, [0], [4]) == [True]  # needs 1 <= 3: kept
    assert reservations(p) == ([3, 0, 0, 0], 3)
    # 6 unreserved: 2 (12 tokens) + 3 (16) fit, 4 (20) does not, request 0 (growth 0) after it neither
    assert reserve(p, [1, 2, 3, 0], [8, 12, 16, 4]) == [True, True, False, False]
    assert reservations(p) == ([3, 2, 3, 0], 8)
    assert reserve(p, [3], [4]) == [True]  # 1 block: 9 - 8 = 1
    assert reserve(p, [3], [8]) == [False]
    assert reservations(p) == ([3, 2, 3, 1], 9)
    assert alloc(p, [1, 2, 3], [12, 16, 8], [12, 16, 8], sof=False) == [True, True, True]
    assert reservations(p) == ([3, 0, 0, 0], 3)
    assert p.ref.pool.get_num_free_blocks() == 3
    validate(p)


def test_reserve_counts_every_group():
    """Two groups: a block per group per block of tokens. Sliding window: the row length (with its
    null blocks) is what the request holds."""
    p = pair(("full", "full"), num_blocks=20)
    add(p, 0, [], 0)
    assert alloc(p, [0], [5], [5]) == [True]  # 2 blocks per group
    assert reserve(p, [0], [7]) == [True]  # 12 tokens: 3 - 2 = 1 per group
    assert reservations(p) == ([2, 0, 0, 0], 2)
    q = pair(("full", ("sliding_window", 4)), num_blocks=20)
    add(q, 0, [], 0)
    assert alloc(q, [0], [13], [13]) == [True]  # 4 per group
    assert alloc(q, [0], [14], [14]) == [True]  # the window frees 2 blocks: nulls in the row
    assert q.ref.block_table(1)[0][:2] == [0, 0]
    assert reserve(q, [0], [6]) == [True]  # 20 tokens: 5 - 4 = 1 per group
    assert reservations(q) == ([2, 0, 0, 0], 2)
    assert alloc(q, [0], [17], [17]) == [True]
    assert reservations(q) == ([0, 0, 0, 0], 0)
    validate(q)


@pytest.mark.heavy
def test_bad_input_is_a_typed_error_and_changes_nothing():
    p = pair()
    add(p, 0, [], 0)
    add(p, 1, [], 0)
    assert alloc(p, [0, 1], [4, 8], [4, 8]) == [True, True]
    assert reserve(p, [0], [4]) == [True]
    T = 8 * 4
    cases = [
        (InvalidArgumentError, "slot out of range", [0, 4], [1, 1]),
        (InvalidArgumentError, "negative slot", [-1], [1]),
        (InvalidArgumentError, "slot not in use", [1, 2], [1, 1]),
        (InvalidArgumentError, "slot listed twice", [1, 0, 1], [1, 1, 1]),
        (InvalidCountError, "negative tokens", [1, 0], [4, -1]),
        (InvalidCountError, "past the row", [1], [T - 8 + 1]),
        (InvalidArgumentError, "lengths differ", [0, 1], [1]),
    ]
    for exc, desc, slots, nts in cases:
        for tensors in (False, True):
            expect_error(p, exc, desc, lambda: p.ref.reserve(slots, nts),
                         lambda: p.dev.reserve(i32(slots), i32(nts)) if tensors else p.dev.reserve(slots, nts))
    for desc, slots in (("out of range", [4]), ("not in use", [3]), ("twice", [0, 0])):
        for tensors in (False, True):
            expect_error(p, InvalidArgumentError, desc, lambda: p.ref.release_reservation(slots),
                         lambda: p.dev.release_reservation(i32(slots) if tensors else slots))
    with pytest.raises(InvalidArgumentError):  # a device count past its array
        p.dev.reserve(i32([0]), i32([1]), num_reqs=i32([2]))
        p.dev.pool.check()
    assert reservations(p) == ([1, 0, 0, 0], 1)
    assert reserve(p, [1], [T - 8]) == [True]  # up to the row's end: 6 blocks
    assert reservations(p) == ([1, 6, 0, 0], 7)
    validate(p)


def test_values_past_int32_are_typed_errors_as_on_the_reference():
    """A token count whose sum with ``num_computed`` passes int32 (``reserve([0, 1], [2**31 - 1, 4])``:
    the device once wrapped and booked slot 1 with nothing reserved) and values past int32 in the
    lists of ``reserve``, ``release_reservation``, ``allocate_slots`` and ``slot_mapping``: the
    reference's error class, nothing changed (no torch RuntimeError)."""
    p = pair()
    add(p, 0, [], 0)
    add(p, 1, [], 0)
    assert alloc(p, [0, 1], [4, 8], [4, 8]) == [True, True]
    big = 2 ** 40
    for tensors in (False, True):  # fits int32: a device tensor too
        expect_error(p, InvalidCountError, "int32 wrap", lambda: p.ref.reserve([0, 1], [2**31 - 1, 4]),
                     lambda: p.dev.reserve(i32([0, 1]), i32([2**31 - 1, 4])) if tensors
                     else p.dev.reserve([0, 1], [2**31 - 1, 4]))
    cases = [
        (InvalidCountError, "reserve tokens", lambda m: m.reserve([0, 1], [1, big])),
        (InvalidArgumentError, "reserve slot", lambda m: m.reserve([big], [1])),
        (InvalidArgumentError, "release slot", lambda m: m.release_reservation([0, -big])),
        (InvalidCountError, "allocate_slots tokens", lambda m: m.allocate_slots([0], [big], [big], [False])),
        (InvalidCountError, "allocate_slots target", lambda m: m.allocate_slots([0], [4], [big], [False])),
        (InvalidArgumentError, "allocate_slots slot", lambda m: m.allocate_slots([big], [4], [4], [False])),
        (InvalidArgumentError, "slot_mapping position", lambda m: m.slot_mapping([0], [big])),
        (InvalidArgumentError, "slot_mapping slot", lambda m: m.slot_mapping([big], [0])),
    ]
    for exc, desc, fn in cases:
        expect_error(p, exc, desc, lambda: fn(p.ref), lambda: fn(p.dev))
    assert reservations(p) == ([0, 0, 0, 0], 0)


def test_cow_ops_respect_reservations():
    """cow_move of another request may not take a reserved block; the reserved request's own
    cow_move draws from its reservation."""
    p = pair(num_blocks=8)
    add(p, 0, [1], 4)
    add(p, 1, [], 0)
    assert alloc(p, [0, 1], [4, 4], [4, 4]) == [True, True]  # block 0 of request 0 keyed
    assert reserve(p, [0], [20]) == [True]  # 24 tokens: 6 - 1 = 5 = every free block
    assert reservations(p) == ([5, 0, 0, 0], 5)
    expect_error(p, OutOfBlocksError, "cow_move of another request", lambda: p.ref.cow_move(1, 0),
                 lambda: p.dev.cow_move(1, 0))
    assert p.do("cow_move(0, 0)", lambda: p.ref.cow_move(0, 0), lambda: p.dev.cow_move(0, 0), list) is not None
    assert reservations(p) == ([4, 0, 0, 0], 4)
    validate(p)


# ---- bursts --------------------------------------------------------------------------------------

def _burst_setup(p: ManagerPair, reserve_first: bool, K: int) -> None:
    """11 usable blocks; requests 0 and 1 hold 1 block each (4 tokens); request 0 maybe reserves K
    tokens (2 blocks); request 2 then takes 7 blocks, leaving 2 free."""
    for r in range(3):
        add(p, r, [], 0)
    assert alloc(p, [0, 1], [4, 4], [4, 4]) == [True, True]
    if reserve_first:
        assert reserve(p, [0], [K]) == [True]
        assert reservations(p) == ([2, 0, 0, 0], 2)
    assert alloc(p, [2], [28], [28]) == [True]
    assert p.ref.pool.get_num_free_blocks() == 2


def _run_burst(p: ManagerPair, dec, ntok, K: int, fin=()):
    """A burst of K steps over the lanes ``dec`` (token counts ``ntok``) on both managers: the device's
    DecodeStep and the reference window (harness.ops.reference_decode_step); each step's admitted flags
    and slot mapping agree. Returns the reference's outcome."""
    want = reference_decode_step(p.ref, dec, ntok, fin, K)
    assert want.error is None, f"{want.error}; {p.where()}"
    steps = p.__dict__.setdefault("bursts", {})
    if K not in steps:
        steps[K] = DecodeStep(p.dev, max_batch=p.R, steps=K)
    burst = steps[K]
    fill_step(burst, dec, ntok, fin)
    burst.run()
    p.dev.pool.check()
    B = len(dec)
    assert burst.admitted_steps[:, :B].tolist() == want.admitted, p.where()
    assert burst.slot_mapping_steps[:, :B].tolist() == want.slot_mapping, p.where()
    for r in list(fin) + [r for r, k in zip(dec, want.preempt_step) if k >= 0]:  # freed by the burst
        p.chain[r] = None
        p.known[r] = 0
    return want


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "unreserved"])
def test_burst_within_a_reservation_never_fails(reserved):
    """A burst of 8 steps over requests [0, 1] (the booked request first, as the engine orders its
    running requests), 2 free blocks. With request 0's reservation of 8 tokens it is admitted at all 8
    steps (crossing 2 block boundaries, both blocks from its reservation) and request 1 can take
    neither block: it preempts itself at step 0. Without it, request 1 takes a block at step 0 and is
    preempted at step 4, when request 0 needs the block it would have reserved. Device burst,
    reference window and the whole state agree."""
    K = 8
    p = pair(num_blocks=12)
    _burst_setup(p, reserved, K)
    want = _run_burst(p, [0, 1], [5, 5], K)
    assert [row[0] for row in want.admitted] == [1] * K
    if reserved:
        assert [row[1] for row in want.admitted] == [0] * K and want.preempt_step == [-1, 0]
        assert reservations(p) == ([0, 0, 0, 0], 0)
    else:
        assert [row[1] for row in want.admitted] == [1] * 4 + [0] * 4  # tokens 5..8 in its second block
        assert want.preempt_step == [-1, 4]
    p.compare()
    validate(p)


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "unreserved"])
def test_a_reservation_does_not_stop_an_earlier_lane_preempting(reserved):
    """The same burst over requests [1, 0] (the booked request last): request 1 may not take request
    0's reserved blocks, so at step 0 it does not fit and preempts the last lane, request 0, whose
    blocks and reservation go back (vLLM's preemption, docs/semantics.md section 9); without the
    reservation both share the free blocks until step 4, when request 1 preempts request 0."""
    K = 8
    p = pair(num_blocks=12)
    _burst_setup(p, reserved, K)
    want = _run_burst(p, [1, 0], [5, 5], K)
    assert [row[0] for row in want.admitted] == [1] * K
    pre = 0 if reserved else 4
    assert [row[1] for row in want.admitted] == [1] * pre + [0] * (K - pre) and want.preempt_step == [-1, pre]
    assert reservations(p) == ([0, 0, 0, 0], 0)
    p.compare()
    validate(p)


def test_decode_step_frees_the_finished_requests_reservations():
    """A single DecodeStep whose finished request held a reservation: the step's free releases it
    and the same step's allocation may use the blocks."""
    p = pair()
    for r in range(3):
        add(p, r, [], 0)
    assert alloc(p, [0, 1], [4, 4], [4, 4]) == [True, True]
    assert alloc(p, [2], [32], [32]) == [True]  # 3 free
    assert reserve(p, [0], [12]) == [True]  # all 3
    assert alloc(p, [1], [5], [5]) == [False]
    step = DecodeStep(p.dev, max_batch=4)
    fill_step(step, [1], [5], [0])
    want = reference_decode_step(p.ref, [1], [5], [0])
    step.run()
    p.dev.pool.check()
    assert want.admitted == [[1]] and want.error is None and step.admitted[:1].tolist() == [1]
    p.chain[0] = None
    assert reservations(p) == ([0, 0, 0, 0], 0)
    p.compare()
    validate(p)


# =================================================================================================
# Differential workload
# =================================================================================================

def op_reserve(data, p: ManagerPair) -> None:
    slots = draw_batch(data, p)
    if not slots:
        return
    nts = []
    for r in slots:
        left = p.max_tokens - p.ref.num_computed[r]
        n = data.draw(st.sampled_from([0, 1, 2, p.bs, 2 * p.bs, 5 * p.bs]), label="tokens") \
            if not rare(data, "any tokens", 4) else data.draw(st.integers(0, left), label="tokens")
        nts.append(min(n, left))
    got = reserve(p, slots, nts, data.draw(st.booleans(), label="tensor args"))
    if currently_in_test_context() and got is not None:
        _event("reserve: booked " + "".join("1" if x else "0" for x in got))


def op_release(data, p: ManagerPair) -> None:
    act = p.active()
    if not act:
        return
    slots = data.draw(st.lists(st.sampled_from(act), unique=True, min_size=1), label="slots")
    release(p, slots, data.draw(st.booleans(), label="tensor args"))


def op_reserve_error(data, p: ManagerPair) -> None:
    act = p.active()
    R, T = p.R, p.max_tokens
    kind = data.draw(st.sampled_from(["range", "idle", "twice", "negative", "past row", "release range",
                                      "release twice"]), label="reserve error")
    slots = list(data.draw(st.permutations(act), label="order")[:2]) if act else []
    nts = [1] * len(slots)
    if kind in ("range", "release range") or not slots:
        slots.append(data.draw(st.sampled_from([R, -1]), label="bad slot"))
        nts.append(1)
    elif kind == "idle" and p.free_slots():
        slots.append(p.free_slots()[0])
        nts.append(1)
    elif kind in ("twice", "release twice"):
        slots.append(slots[0])
        nts.append(1)
    elif kind == "negative":
        nts[-1] = -1
    else:
        nts[-1] = T - p.ref.num_computed[slots[-1]] + 1
    tensors = data.draw(st.booleans(), label="tensor args")
    if kind.startswith("release"):
        release(p, slots, tensors)
    else:
        reserve(p, slots, nts, tensors)


def op_burst(data, p: ManagerPair, K: int | None = None, first=()) -> None:
    """A burst of K decode steps (DecodeStep(steps=K)) over the running requests whose tokens are all
    computed (``first`` leading, then the others in slot order); some finish at step 0. The reference:
    the same burst on a reference window (:func:`_run_burst`). A request whose reservation covers the
    burst always fits: it is admitted at every step unless an earlier lane that did not fit preempted
    it (vLLM preempts the last lane), so the booked requests that lead the lane order are admitted at
    every step."""
    if K is None:
        K = data.draw(st.sampled_from([2, 3, 5]), label="K")
    run = [r for r in p.active() if p.row_len(r) and p.ref.num_computed[r] >= p.known[r]]
    if not run:
        return
    fin = data.draw(st.lists(st.sampled_from(run), unique=True, max_size=max(1, len(run) // 2)), label="finished")
    dec = [r for r in run if r not in fin and p.known[r] + K <= p.max_tokens]
    dec = [r for r in first if r in dec] + [r for r in dec if r not in first]
    if not dec and not fin:
        return
    ntok = [p.known[r] + 1 for r in dec]
    for r, n in zip(dec, ntok):
        append_hashes(p, r, (n + K - 1) // p.hbs)
    p.ops.append(f"burst K={K} (decode {dec}, nt={ntok}, finished {fin})")
    note(p.ops[-1])
    held = [p.ref.reserved[r] for r in dec]
    # blocks for ntok - 1 + K tokens (the burst's last count) beyond the row: within its reservation
    covered = [h >= p.G * max(0, -(-(n - 1 + K) // p.bs) - p.row_len(r)) for h, n, r in zip(held, ntok, dec)]
    want = _run_burst(p, dec, ntok, K, fin)
    pre = want.preempt_step
    for i, r in enumerate(dec):
        last = max((k for k in range(K) if want.admitted[k][i]), default=-1)
        if last >= 0 and pre[i] < 0:
            p.known[r] = ntok[i] + last
        if covered[i] and pre[i] >= 0:  # only an earlier lane, live at that step and not covered, preempts it
            assert any(not covered[j] and (pre[j] < 0 or pre[j] >= pre[i]) for j in range(i)), (
                f"slot {r} reserved {held[i]} blocks but was preempted at step {pre[i]}; {p.where()}")
        if covered[i] and all(covered[:i]):
            assert last == K - 1, f"slot {r} reserved {held[i]} blocks but failed at step {last + 1}; {p.where()}"
    if currently_in_test_context():
        _event(f"burst: {sum(c and h > 0 for c, h in zip(covered, held))} covered by a reservation")
    p.compare()


def op_reserved_burst(data, p: ManagerPair) -> None:
    """The engine's pattern: reserve K tokens for some running requests (in a drawn order), then a
    burst of K steps whose lanes they lead; the booked ones must be admitted at every step (checked in
    :func:`op_burst`)."""
    K = data.draw(st.sampled_from([2, 3, 5, 8]), label="K")
    run = [r for r in p.active() if p.row_len(r) and p.ref.num_computed[r] >= p.known[r]
           and p.known[r] + K <= p.max_tokens]
    slots = []
    if run:
        slots = data.draw(st.permutations(run), label="order")[: data.draw(st.integers(1, len(run)), label="n")]
        # the burst's last count is known + K: K tokens beyond num_computed (= known here)
        reserve(p, slots, [p.known[r] + K - p.ref.num_computed[r] for r in slots])
    op_burst(data, p, K, first=slots)


def op_join(data, p: ManagerPair) -> None:
    """A request joins and is prefilled at once (lookup on), so that bursts have running requests."""
    free = p.free_slots()
    if not free:
        return
    op_add(data, p)
    r = next(x for x in free if p.chain[x] is not None)
    n = p.known[r]
    got = alloc(p, [r], [n], [n], [True])
    if got == [False] and data.draw(st.booleans(), label="drop it"):
        free_both(p, [r], False, "free")
        p.chain[r] = None
        p.known[r] = 0


OPS = {name: MANAGER_OPS[name] for name in ("add", "allocate", "decode_steps", "decode_step", "free", "preempt",
                                            "cow_append", "cow_move", "drain", "error")}
OPS.update(add=(op_add, 2), join=(op_join, 5), reserve=(op_reserve, 5), release=(op_release, 2), burst=(op_burst, 2),
           reserved_burst=(op_reserved_burst, 4), reserve_error=(op_reserve_error, 1))
OP_CHOICES = [name for name, (_, w) in OPS.items() for _ in range(w)]


def run_workload(data, kind: str, parallel: bool) -> None:
    bs = data.draw(st.sampled_from([4, 16]), label="block_size")
    groups = GROUP_KINDS[kind](data, bs)
    p = ManagerPair(data.draw(st.integers(8, 40), label="num_blocks"), block_size=bs,
             max_num_reqs=data.draw(st.integers(3, 5), label="max_num_reqs"),
             max_blocks_per_req=data.draw(st.integers(6, 12), label="max_blocks_per_req"), groups=groups,
             caching=not rare(data, "caching off", 5), events=data.draw(st.booleans(), label="events"))
    p.dev.parallel = parallel
    note(f"config: N={p.N} bs={bs} R={p.R} M={p.M} groups={groups} caching={p.caching} events={p.events}")
    for _ in range(data.draw(st.integers(6, 22), label="num ops")):
        name = data.draw(st.sampled_from(OP_CHOICES), label="op")
        OPS[name][0](data, p)
        p.ref.validate()
    p.dev.validate()
    if p.ref.pending_copies:
        p.ref.release_copied(p.ref.take_pending_copies())
        p.dev.release_copied(p.dev.take_pending_copies()[2])
        p.compare()
    if p.active():
        free_both(p, p.active(), False, "free all")
    assert reservations(p) == ([0] * p.R, 0)
    assert p.ref.pool.get_num_free_blocks() == p.N - 1


_SLOW_EXAMPLES = max(2, settings().max_examples // 10)  # dev: 2, ci: 5


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_reservations_match_reference_quick(data):
    """The differential workload, a couple of examples in the quick suite (one group, parallel)."""
    run_workload(data, "full", True)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "exact"])
@pytest.mark.parametrize("kind", list(GROUP_KINDS))
@settings(max_examples=_SLOW_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_reservations_match_reference(kind, parallel, data):
    """Random workloads of every manager op plus reserve / release / bursts / bad reservations, the
    whole state compared after each op (both paths of allocate_slots)."""
    run_workload(data, kind, parallel)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reserve_and_release_capture_in_a_cuda_graph():
    """reserve / release_reservation with device inputs and an output buffer, captured in one CUDA
    graph with no host sync; replays equal eager calls on a twin manager."""
    from gpupool.manager import KVCacheManager
    ms = [KVCacheManager(32, block_size=4, max_num_reqs=4, max_blocks_per_req=8, device="cuda") for _ in range(2)]
    for m in ms:
        for r in range(3):
            m.add_request(r, [])
        m.allocate_slots([0, 1, 2], [4, 4, 4], [4, 4, 4])
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
    tokens = torch.tensor([8, 20, 4], dtype=torch.int32, device="cuda")
    outs = [torch.zeros(3, dtype=torch.int32, device="cuda") for _ in ms]
    ms[0].reserve(slots, tokens, out=outs[0])  # warm-up (compiles)
    ms[0].release_reservation(slots)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ms[0].reserve(slots, tokens, out=outs[0])
        ms[0].release_reservation(slots[:1])
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ms[1].reserve(slots, tokens, out=outs[1])
    ms[1].release_reservation(slots[:1])
    for m in ms:
        m.pool.check()
    assert torch.equal(outs[0], outs[1])
    assert ms[0].reservations() == ms[1].reservations() == [5, 1, 0, 0]
    assert ms[0].get_num_reserved_blocks() == 6
