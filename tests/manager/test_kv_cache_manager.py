"""Differential tests: the device ``KVCacheManager`` against ``ReferenceKVCacheManager``, op for op.

Random multi-request workloads (hypothesis ``st.data()``) drive both managers side by side: small
pools (8..48 blocks), block size 4 or 16, 4..6 request slots of 8..16 blocks, KV-cache groups
("full",), ("full", "full") and ("full", ("sliding_window", w)), hash blocks equal to or finer
than blocks (``hash_block_size``: partial-block keys), prefix caching and KV events on and off. Requests draw their block hashes from a few shared templates and a small alphabet, so
prefixes are shared and hashes repeat (within a request too). Ops: ``add_request``, batched
``allocate_slots`` (prefill with lookup, chunked prefill, decode of one or more tokens with
``append_block_hashes`` when a block fills, lookahead, arbitrary counts, ``stop_on_failure`` on and
off, list and tensor arguments), batched ``free`` (list and tensor form), preemption (free and
re-add), ``get_computed_blocks``, ``slot_mapping``, copy-on-write (``cow_append`` with sources from
``get_computed_blocks`` / ``pool.get_cached_block`` / null / any block, ``cow_move``), draining the
copy queue (``take_pending_copies`` + ``release_copied``, or ``run_pending_copies`` on real KV-cache
tensors) and bad calls (slot out of range or listed twice, token counts out of range, ...).

After every op: results (admitted flags, hits, dsts, copies), each group's block-table rows,
``num_computed`` / ``num_cached``, the pending copies, the pool's free queue, ref counts, every
block's keys and ``hash_num_tokens``, the KV events, and ``validate()`` of both pools. An op that
raises must raise the same error class on both sides (a batched device op raises at
``pool.check()``) and change nothing.

Deterministic tests cover ``get_computed_blocks``, ``slot_mapping`` against the reference table,
``run_pending_copies`` on fp16 and fp32 caches ``[num_blocks, 2, block_size, 8]``, the sticky status
word of the batched ops, and stop_on_failure with preemption. The tests at the end pin the defects
these tests found once (BlockStored parents after a leading null block, tensor slots with events,
slots not in use, copies chained through the queue, unchecked get_computed_blocks slots, partial
keys past max_keys_per_block), now fixed; the last ones show that a recorded error (the sticky
status word) loses nothing: pending copies stay pending, ``free(list)`` changes nothing until it
succeeds.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
the default hypothesis profile keeps this file near a minute on two CPU cores.
``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs many more examples.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.errors import (
    InvalidArgumentError, InvalidCountError, PoolError,
)
from harness.device import DEVICE, i32
from harness.keys import h
from harness.ops import fail_a_batched_op
from harness.state import ints, manager_snapshot, manager_state, raw_state, same_raw_state
from harness.strategies import note, rare
from harness.twins import SW, small_manager


# =================================================================================================
# Hashes and small helpers
# =================================================================================================
from harness.manager_pair import (  # noqa: E402
    _EXAMPLES, add, admitted_norm, alloc, computed_norm, copies_norm, free_both, GROUP_KINDS, has_chain, HASH,
    ManagerPair, OP_CHOICES, op_drain, OPS, preemption_and_stop_on_failure, run_copies, small_pair,
)


@pytest.mark.parametrize("parallel", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["parallel", "exact"])
# full+full and chunked in the slow run only (quick budget): full+sliding covers two groups and
# full+chunked the windowed hit in the quick run
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in ("full+full", "chunked") else k
                                  for k in GROUP_KINDS])
@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.heavy("full+sliding-parallel", "full+chunked-parallel")
def test_manager_matches_reference(kind, parallel, data):
    """Random workloads; ``parallel``: allocate_slots takes the request-parallel path where it is exact
    (kernels/requests/parallel.py), else every batch takes the exact sequential path."""
    bs = data.draw(st.sampled_from([4, 16]), label="block_size")
    hbs = bs if data.draw(st.booleans(), label="hash blocks = blocks") else data.draw(
        st.sampled_from([2] if bs == 4 else [4, 8]), label="hash_block_size")
    groups = GROUP_KINDS[kind](data, bs)
    p = ManagerPair(data.draw(st.integers(8, 48), label="num_blocks"), block_size=bs,
             max_num_reqs=data.draw(st.integers(4, 6), label="max_num_reqs"),
             max_blocks_per_req=data.draw(st.integers(8, 16), label="max_blocks_per_req"), groups=groups,
             caching=not rare(data, "caching off", 4), events=data.draw(st.booleans(), label="events"),
             hash_block_size=hbs, kv_caches=True)
    p.dev.parallel = parallel
    note(f"config: N={p.N} bs={bs} hbs={hbs} R={p.R} M={p.M} groups={groups} caching={p.caching} "
         f"events={p.events}")
    num_ops = data.draw(st.integers(6, 24), label="num ops")
    for _ in range(num_ops):
        name = data.draw(st.sampled_from(OP_CHOICES), label="op")
        OPS[name][0](data, p)
    # Finish everything: every block back in the queue, nothing held.
    if p.ref.pending_copies:
        op_drain(data, p)
    if p.active():
        free_both(p, p.active(), False, "free all")
    assert p.ref.pool.get_num_free_blocks() == p.N - 1


# =================================================================================================
# Deterministic scenarios
# =================================================================================================

@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "exact"])
def test_chunked_local_hit_nulls_and_chunk_miss(parallel):
    """Full + chunked local attention (chunks of 2 blocks), vLLM's hit (docs/semantics.md section 6):
    a 22-token request whose 5 blocks are cached hits all 5, the chunked group's first 4 null (not
    touched, not counted as zero-ref: the admission fits the free blocks nobody reserved exactly);
    with the chunked group's block 4 evicted, the hit ends there, 4 blocks, all null in that group."""
    p = small_pair(("full", ("chunked_local_attention", 8)), num_blocks=13)
    p.dev.parallel = parallel
    chain = [0, 1, 2, 3, 4, 5]
    add(p, 0, chain, 24)
    assert alloc(p, [0], [24], [24]) == [True]  # 12 blocks, keyed in both groups
    free_both(p, [0], False, "free 0")  # all 12 cached, ref 0
    add(p, 2, [40], 0)
    p.do("reserve 4", lambda: p.ref.reserve([2], [8]), lambda: p.dev.reserve([2], [8]), admitted_norm)
    add(p, 1, chain, 24)
    # demand: 1 new block per group + 6 zero-ref hits (5 full, 1 chunked) = 8 = 12 free - 4 reserved
    assert alloc(p, [1], [22], [22], [True]) == [True]
    assert p.ref.tables[1][1][:5] == [0, 0, 0, 0, p.ref.tables[1][1][4]] and p.ref.tables[1][1][4] != 0
    b4 = p.ref.tables[1][1][4]
    free_both(p, [1], False, "free 1")
    p.do(f"evict {b4}", lambda: p.ref.pool.evict_blocks([b4]), lambda: p.dev.pool.evict_blocks([b4]))
    add(p, 3, chain, 24)
    assert alloc(p, [3], [22], [22], [True]) == [True]
    assert p.ref.tables[1][3][:4] == [0, 0, 0, 0] and p.ref.tables[0][3][:4] != [0, 0, 0, 0]
    assert p.ref.prefix_cache_stats.hits == 20 + 16


# full+full in the slow run only (quick budget): full+sw covers two groups in the quick run
@pytest.mark.parametrize("groups", [("full",), pytest.param(("full", "full"), marks=pytest.mark.slow), ("full", SW)],
                         ids=["full", "full+full", "full+sw"])
@pytest.mark.heavy("full+sw")
def test_get_computed_blocks_agree(groups):
    """Shared prefixes, a repeated hash (one block hit twice), every num_tokens cap, any slot order."""
    p = small_pair(groups)
    add(p, 0, [0, 1, 2, 3, 4], 21)
    add(p, 1, [30, 30, 30], 13)
    assert alloc(p, [0, 1], [21, 13], [21, 13], [True, True]) == [True, True]
    add(p, 2, [0, 1, 2, 9, 4], 20)
    add(p, 3, [30, 30, 30, 30], 16)
    for nt in [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 32]:
        out = p.do(f"get_computed_blocks(nt={nt})",
                   lambda: p.ref.get_computed_blocks([3, 2, 0], [nt] * 3),
                   lambda: p.dev.get_computed_blocks(i32([3, 2, 0]), i32([nt] * 3)),
                   lambda o: computed_norm(o, p.G))
        assert out[1][0] == min(max(nt - 1, 0) // 4, 3)  # request 2 shares 3 blocks with request 0
    (hits, blocks), = p.ref.get_computed_blocks([3], [16])
    assert hits == 3 and len(set(blocks[0])) == 1  # the one block keyed by hash 30 at position 0, 3 times
    # Admitting with lookup takes exactly those hits.
    assert alloc(p, [2, 3], [20, 16], [20, 16], [True, True]) == [True, True]
    assert p.ref.block_table(0)[2][:3] == p.ref.block_table(0)[0][:3]
    p.do("free all", lambda: p.ref.free([0, 1, 2, 3]), lambda: p.dev.free([0, 1, 2, 3]))
    # Caching off: never a hit.
    q = small_pair(groups, caching=False)
    add(q, 0, [0, 1, 2], 12)
    alloc(q, [0], [12], [12])
    add(q, 1, [0, 1, 2], 12)
    q.do("get_computed_blocks", lambda: q.ref.get_computed_blocks([1], [12]),
         lambda: q.dev.get_computed_blocks(i32([1]), i32([12])), lambda o: computed_norm(o, q.G))


@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_slot_mapping_matches_reference_table(groups):
    """Every valid (slot, position) of every group, against block_id * bs + pos % bs from the
    reference table (null blocks of the sliding window included)."""
    p = small_pair(groups)
    add(p, 0, [0, 1, 2, 3, 4, 5], 22)
    add(p, 1, [0, 1, 7], 9)
    alloc(p, [0, 1], [22, 9], [22, 9], [True, True])
    for nt in (23, 24, 25, 26):  # decode past the window: sliding-window blocks become null
        alloc(p, [1, 0], [10, nt], [10, nt])
    bs = p.bs
    for g in range(p.G):
        table = p.ref.block_table(g)
        toks = [(r, q) for r in (1, 0) for q in range(len(table[r]) * bs)]
        want = [table[r][q // bs] * bs + q % bs for r, q in toks]
        assert p.ref.slot_mapping([t[0] for t in toks], [t[1] for t in toks], g) == want
        for dt in (torch.int32, torch.int64):
            got = p.dev.slot_mapping(torch.tensor([t[0] for t in toks], dtype=dt, device=DEVICE),
                                     torch.tensor([t[1] for t in toks], dtype=dt, device=DEVICE), g)
            assert got.dtype == torch.int64 and ints(got) == want
    if p.G == 2:
        assert 0 in p.ref.block_table(1)[0]  # the window freed blocks


@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_run_pending_copies_moves_kv_data(groups):
    """cow_append (a partial hit copied into a private block) and cow_move (a cached block the request
    keeps writing) queue copies; run_pending_copies copies them in fp16 and fp32 caches shaped
    [num_blocks, 2, block_size, 8] and releases them; the pool then matches the reference."""
    p = small_pair(groups, kv_caches=True)
    add(p, 0, [0, 1, 2, 3], 16)
    assert alloc(p, [0], [16], [16], [True]) == [True]
    add(p, 1, [0, 1, 7, 8], 15)
    assert alloc(p, [1], [15], [8], [True]) == [True]  # hits blocks 0, 1
    src = p.ref.pool.get_cached_block(HASH[2], list(range(p.G)))  # a partial match of its next block
    assert src is not None
    dsts = p.do(f"cow_append(1, {src})", lambda: p.ref.cow_append(1, src), lambda: p.dev.cow_append(1, src), ints)
    p.do("cow_move(0, 3)", lambda: p.ref.cow_move(0, 3), lambda: p.dev.cow_move(0, 3), ints)
    pend = copies_norm(p.ref.pending_copies)
    assert len(pend) == 2 * p.G and not has_chain(pend)
    assert [d for _, d, _ in pend[: p.G]] == dsts
    assert run_copies(p) == pend
    assert p.dev.take_pending_copies()[0].numel() == 0
    # The moved key now answers from the copy, which is free (hashed, at the back of the queue).
    moved = p.ref.pool.get_cached_block(HASH[3], [0])
    assert moved == [pend[p.G][1]] and p.ref.pool.ref_counts(moved) == [0]
    assert run_copies(p) == []  # nothing pending: no launch, nothing changes
    p.do("free", lambda: p.ref.free([0, 1]), lambda: p.dev.free([0, 1]))
    assert p.ref.pool.get_num_free_blocks() == p.N - 1


def test_batched_errors_raise_at_check_sticky_and_change_nothing():
    """A bad batched call does nothing and raises at check(); until then later batched calls do
    nothing either (sticky status word); afterwards the manager works on."""
    p = small_pair(("full", SW))
    add(p, 0, [0, 1, 2], 12)
    add(p, 1, [0, 1, 5], 12)
    alloc(p, [0], [12], [12], [True])
    T = p.max_tokens
    cases = [
        (InvalidArgumentError, [0, 4], [12, 12], [12, 12]),  # slot out of range
        (InvalidArgumentError, [-1], [1], [1]),
        (InvalidArgumentError, [1, 0, 1], [12, 13, 12], [12, 13, 12]),  # listed twice
        (InvalidCountError, [1, 0], [12, T + 1], [12, 13]),
        (InvalidCountError, [1, 0], [12, 13], [-1, 13]),
    ]
    for exc, slots, nts, tgs in cases:
        before_ref, before_dev = manager_state(p.ref), manager_state(p.dev)
        with pytest.raises(exc):
            p.ref.allocate_slots(slots, nts, tgs, [True] * len(slots))
        out = p.dev.allocate_slots(slots, nts, tgs, [True] * len(slots))  # no raise: no host sync
        # sticky: a valid call before check() does nothing
        p.dev.allocate_slots([1], [12], [12], [True])
        p.dev.free(i32([1]))
        with pytest.raises(exc):
            p.dev.pool.check()
        assert ints(out) == [0] * len(slots)
        p.dev.pool.check()  # cleared
        assert manager_state(p.ref) == before_ref and manager_state(p.dev) == before_dev
        p.compare()
    for slots in ([0, 0], [4], [-1]):
        before = manager_state(p.dev)
        p.dev.free(i32(slots))
        with pytest.raises(InvalidArgumentError):
            p.dev.pool.check()
        assert manager_state(p.dev) == before
        with pytest.raises(InvalidArgumentError):  # lists are checked on the host, at once
            p.dev.free(slots)
        with pytest.raises(InvalidArgumentError):
            p.ref.free(slots)
        p.compare()
    assert alloc(p, [1, 0], [12, 13], [12, 13], [True, False]) == [True, True]


def test_preemption_and_stop_on_failure():
    """harness.manager_pair.preemption_and_stop_on_failure (also run under the strict checker by
    tests/kernels/test_kernel_barriers.py)."""
    preemption_and_stop_on_failure()


# =================================================================================================
# Regression tests for the defects these tests found (all fixed)
# =================================================================================================

def _events_pair(groups=("full",)) -> ManagerPair:
    return small_pair(groups, num_blocks=16, events=True)


def _raw_events(p: ManagerPair):
    return p.ref.pool.take_events(), p.dev.pool.take_events()


def test_blockstored_parent_after_leading_null_block():
    p = _events_pair()
    add(p, 0, [0, 1], 8)
    p.ref.cow_append(0, [0])  # a null entry at index 0 (a partial hit in no group)
    p.dev.cow_append(0, [0])
    p.ref.allocate_slots([0], [9], [9])
    p.dev.allocate_slots([0], [9], [9])
    ref_ev, dev_ev = _raw_events(p)
    assert ref_ev[0].parent_block_hash is None  # docs/semantics.md: parent = block_hashes[num_cached_blocks - 1], none at 0
    assert dev_ev == ref_ev


def test_blockstored_parent_sliding_window_late_hashes():
    p = _events_pair(("full", ("sliding_window", 4)))
    add(p, 0, [0, 1, 2], 0, nhashes=0)
    for m in (p.ref, p.dev):
        m.allocate_slots([0], [12], [12])
        m.allocate_slots([0], [13], [13])  # the window drops blocks 0 and 1 of group 1
        m.append_block_hashes(0, [HASH[0], HASH[1], HASH[2]])
    _raw_events(p)
    for m in (p.ref, p.dev):
        m.allocate_slots([0], [14], [14])
    ref_ev, dev_ev = _raw_events(p)
    assert dev_ev == ref_ev


def test_allocate_tensor_slots_events():
    p = _events_pair(("full", "full"))
    add(p, 0, [0, 1], 8)
    p.ref.allocate_slots([0], [9], [9])
    p.dev.allocate_slots(i32([0]), i32([9]), i32([9]))
    ref_ev, dev_ev = _raw_events(p)
    assert dev_ev == ref_ev


def test_allocate_slots_rejects_slot_not_in_use():
    p = small_pair()
    with pytest.raises(InvalidArgumentError):
        p.ref.allocate_slots([1], [4], [4])
    before = manager_state(p.dev)
    with pytest.raises(InvalidArgumentError):
        p.dev.allocate_slots([1], [4], [4])
        p.dev.pool.check()
    assert manager_state(p.dev) == before


def test_copy_from_a_block_still_waiting_for_its_copy_is_refused():
    """cow_move puts block 1's key on a fresh block D (copy 1 -> D pending); a request hitting that key
    in the same step would copy from D before D has its data (one launch runs every copy at once).
    Both managers refuse that cow_append (InvalidArgumentError, nothing changed); after the copies run
    it is fine, and the copied data is block 1's."""
    p = small_pair(num_blocks=16, kv_caches=True)
    add(p, 0, [0, 1], 8)
    alloc(p, [0], [9], [9])
    add(p, 1, [0], 4)
    (d,) = p.do("cow_move(0, 0)", lambda: p.ref.cow_move(0, 0), lambda: p.dev.cow_move(0, 0), ints)
    src = p.ref.pool.get_cached_block(HASH[0], [0])
    assert src == [d]
    # p.do: both refuse in the same words (the two once differed) and change nothing
    assert p.do(f"cow_append(1, {src})", lambda: p.ref.cow_append(1, src), lambda: p.dev.cow_append(1, src)) is None
    with pytest.raises(InvalidArgumentError, match="pending copy"):
        p.dev.cow_append(1, src)
    old = [c.clone() for c in p.caches]
    assert p.dev.run_pending_copies(p.caches) == 1
    for c, o in zip(p.caches, old):
        assert torch.equal(c[d], o[1])
    p.ref.release_copied(p.ref.take_pending_copies())
    p.compare()
    p.do(f"cow_append(1, {src})", lambda: p.ref.cow_append(1, src), lambda: p.dev.cow_append(1, src), ints)
    p.compare()


@pytest.mark.parametrize("parallel", [False, True], ids=["exact", "parallel"])
def test_a_lookup_on_a_row_holding_blocks_is_not_counted(parallel):
    """vLLM counts a new request's lookup only (``get_computed_blocks`` of an empty row): a row that
    holds only null entries (``cow_append`` of null sources) holds blocks, so a lookup flag on it
    finds nothing and records nothing in the prefix-cache statistics, beside a new request's that
    does (the device once counted both)."""
    p = small_pair(("full", "full"), num_blocks=32)
    add(p, 0, [0, 1, 2, 3], 16)
    alloc(p, [0], [16], [16], [True])
    p.dev.parallel = parallel
    add(p, 1, [0, 1, 2], 12)
    add(p, 2, [0, 1, 2, 3, 4], 20)
    for m in (p.ref, p.dev):
        m.cow_append(2, [0, 0])
    p.compare()
    assert alloc(p, [1, 2], [12, 20], [12, 20], [True, True]) == [True, True]
    assert manager_state(p.ref)["stats"][:3] == [2, 12 + 16, 8 + 0]  # requests, queried, hit tokens


def test_get_computed_blocks_slot_out_of_range():
    p = small_pair()
    add(p, 0, [0], 4)
    with pytest.raises(InvalidArgumentError):
        p.ref.get_computed_blocks([4], [5])
    with pytest.raises(InvalidArgumentError):
        p.dev.get_computed_blocks(i32([4]), i32([5]))
        p.dev.pool.check()


def test_get_computed_blocks_slot_twice_or_free():
    p = small_pair()
    add(p, 0, [0], 4)
    for slots in ([0, 0], [1]):
        with pytest.raises(InvalidArgumentError):
            p.ref.get_computed_blocks(slots, [5] * len(slots))
        with pytest.raises(InvalidArgumentError):
            p.dev.get_computed_blocks(i32(slots), i32([5] * len(slots)))
            p.dev.pool.check()


def test_partial_key_that_does_not_fit_is_skipped():
    """hash_block_size 4 < block_size 16, max_keys_per_block 1: block 0 is keyed at 12 tokens; a step
    that knows only 8 tokens would add a second (secondary) partial key, which does not fit: both
    managers skip it (the pool op would raise KeyCapacityError) and the allocation goes on."""
    p = ManagerPair(16, block_size=16, max_num_reqs=4, max_blocks_per_req=4, groups=("full",), caching=True, events=False,
             hash_block_size=4, max_keys_per_block=1)
    add(p, 0, [0, 1, 2], 12)
    assert alloc(p, [0], [12], [12]) == [True]
    assert alloc(p, [0], [8], [40]) == [True]
    p.compare()


# ---- a recorded error (the sticky status word) loses nothing ------------------------------------

def test_run_pending_copies_keeps_copies_past_a_recorded_error():
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    src = m.rows(0)[0][0]
    m.add_request(1, [])
    m.allocate_slots([1], [1], [1])
    m.cow_append(1, [src])
    fail_a_batched_op(m)
    with pytest.raises(PoolError):
        m.run_pending_copies([])
    assert int(m.num_copies[0]) == 1
    m.validate()
    assert m.run_pending_copies([]) == 1
    m.free([0, 1])
    assert m.pool.get_num_free_blocks() == 31
    m.validate()


def test_free_list_after_a_recorded_error_keeps_the_slot():
    """``free(list)`` while an error is recorded raises it and changes nothing on host or device; the
    slot is then freed and reused normally."""
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    before = manager_snapshot(m)
    fail_a_batched_op(m)
    raw = raw_state(m.pool, m)
    with pytest.raises(PoolError):
        m.free([0])
    assert same_raw_state(raw, raw_state(m.pool, m)) == []
    assert manager_snapshot(m) == before
    m.free([0])
    m.add_request(0, [h(2)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    m.validate()

