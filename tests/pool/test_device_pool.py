"""Differential tests: the device ``BlockPool`` against the reference pool, op by op (docs/semantics.md).

Every single op and every batched op of :class:`gpupool.BlockPool` is run side by side with
:class:`gpupool.ReferenceBlockPool` on hypothesis-generated op sequences (small pools, caching and
events on and off, small rings that force compaction, key tables of one or two chunks), and after
every op the whole observable state is compared: free-queue order, ref counts, every block's keys
and covered tokens, ``num_free``, the number of watchers, a lookup of every hash used so far in
both groups, the events (``take_events()``), the reuse-watcher firings, ``validate()`` of both (the
device's, a kernel, every few ops; every op under the deep profile) and a host-side check of the
device layout (ring, key table, overflow counts, idle scratch). Errors must have the same class on
both sides; a batched device op raises at ``check()``.

A batched op is checked against the sequence of single reference calls it replaces (docs/semantics.md,
"Batched forms"): applied as a whole when none of them fails, else nothing, and the error is that
of the first failing call.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
The default hypothesis profile keeps this file to a couple of minutes on two CPU cores;
``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs many more examples.

The side-by-side comparison is :func:`harness.compare.assert_pools_agree` (plus the host-side layout
check, ``harness.compare.host_check_layout``); scenario tests follow the property tests, and at the
end, watchers as per-block flags (many ``unpin_blocks`` calls).
"""
from __future__ import annotations


import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool import BlockPool
from gpupool.errors import (
    DoubleFreeError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError, OutOfBlocksError, PoolError,
)

from harness.compare import assert_consistent
from harness.ops import flat_segments
from harness.device import DEVICE, i32
from harness.sizes import pow2_at_least, sized
from harness.strategies import note
from harness.twins import pool_twin
from harness.state import ints, pool_state
from harness.pool_pair import (  # noqa: E402
    BS, check_longest_prefix, check_lookup_batched, CTRL_COMPACTIONS, CTRL_HEAD, H, HASHES, NUM_HASHES,
    OP_TABLE, pool_configs, PoolPair,
)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
          deadline=None, max_examples=3 * settings.default.max_examples // 2)  # ci: 37 sequences of up to 40 ops
@given(cfg=pool_configs(), data=st.data())
def test_random_op_sequences_match_reference(cfg, data):
    note(f"config: {cfg}")
    pair = PoolPair(cfg["n"], caching=cfg["caching"], events=cfg["events"], mk=cfg["mk"], ring=cfg["ring"],
                chunks=cfg["chunks"])
    num_ops = data.draw(st.integers(5, 40), label="num_ops")
    for _ in range(num_ops):
        # Bias toward keeping blocks held, so frees, unpins and caching have something to work on.
        op = data.draw(st.sampled_from(OP_TABLE), label="op")
        op(data, pair)
    pair.dev.validate()


# =================================================================================================
# Hand-written cases
# =================================================================================================

def noop(_b):
    pass


@pytest.mark.slow
def test_ring_compaction_many_touch_free_cycles():
    """Ring of the smallest power of two >= N: touch / free cycles leave tombstones and grow the window
    (hashed blocks go to the back, un-hashed to the front) until the kernels compact it; the order stays
    the reference's throughout."""
    n = 12
    pair = PoolPair(n, ring=pow2_at_least(n), check_lookups=True)
    blocks = ints(pair.dev.get_new_blocks(n - 1))
    pair.ref.get_new_blocks(n - 1)
    hs = [H(100 + i) for i in range(n - 1)]
    pair.used.update(hs[:6])
    pair.do("cache_full_blocks(first 6)", lambda: pair.ref.cache_full_blocks(blocks, hs, 0, 6, BS),
            lambda: pair.dev.cache_full_blocks(blocks, hs, 0, 6, BS))
    pair.do("free all", lambda: pair.ref.free_blocks(blocks[::-1]), lambda: pair.dev.free_blocks(blocks[::-1]))
    rng = random.Random(7)
    heads = []
    for step in range(60):
        q = pair.ref.free_queue()
        pick = rng.sample(q, rng.randint(1, 3))
        pair.do(f"touch({pick})", lambda: pair.ref.touch(pick), lambda: pair.dev.touch(pick))
        order = pick[:]
        rng.shuffle(order)
        pair.do(f"free({order})", lambda: pair.ref.free_blocks(order), lambda: pair.dev.free_blocks(order))
        heads.append(int(pair.dev.state.ctrl[CTRL_HEAD]))
        if step % 10 == 9:
            k = rng.randint(1, 4)
            got = pair.do(f"get_new_blocks({k})", lambda: pair.ref.get_new_blocks(k),
                          lambda: pair.dev.get_new_blocks(k), norm=ints)
            pair.do(f"free({got})", lambda: pair.ref.free_blocks(got), lambda: pair.dev.free_blocks(got))
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0
    assert min(heads) < 0


@pytest.mark.slow
def test_ring_wraparound_negative_head_caching_off():
    """Caching off: every free prepends, so touch / free of a block in the middle pushes the head
    further below zero (several times around the ring) and compacts when the window is full."""
    n = 6
    c = pow2_at_least(n)
    pair = PoolPair(n, caching=False, ring=c, check_lookups=False)
    rng = random.Random(3)
    for step in range(8 * c):
        q = pair.ref.free_queue()
        b = q[rng.randrange(len(q))]
        pair.do(f"touch([{b}])", lambda: pair.ref.touch([b]), lambda: pair.dev.touch([b]))
        pair.do(f"free([{b}])", lambda: pair.ref.free_blocks([b]), lambda: pair.dev.free_blocks([b]))
    head = int(pair.dev.state.ctrl[CTRL_HEAD])
    assert head < -2 * c, head
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0
    # Allocation across the wrapped window still takes the reference's blocks.
    pair.do("get_new_blocks(5)", lambda: pair.ref.get_new_blocks(5), lambda: pair.dev.get_new_blocks(5), norm=ints)
    pair.do("free", lambda: pair.ref.free_blocks([5, 1, 3, 2, 4]), lambda: pair.dev.free_blocks([5, 1, 3, 2, 4]))


@pytest.mark.slow
def test_ring_compaction_in_free_batched_and_unpin():
    """Compaction triggered from inside the batched free and from unpin (appends), smallest ring."""
    n = 8
    pair = PoolPair(n, ring=pow2_at_least(n), events=True)
    rng = random.Random(11)
    for it in range(sized(25, 10)):
        free = pair.ref.get_num_free_blocks()
        demands = [rng.randint(0, free // 3) for _ in range(3)]
        pair.batched(f"allocate_batched({demands})", None,
                     lambda: [ints(pair.ref.get_new_blocks(d)) for d in demands],
                     lambda: pair.dev.allocate_batched(i32(demands)),
                     lambda out: [ints(out[0])[ints(out[1])[k]:ints(out[1])[k + 1]] for k in range(3)])
        held = sorted({b for b, c in enumerate(pair.ref.ref_counts()) if b and c})
        if held:
            hs = [H(rng.randint(0, 5)) for _ in held]
            pair.used.update(hs)
            cut = rng.randint(0, len(held))
            pair.do("cache_full", lambda: pair.ref.cache_full_blocks(held, hs, 0, cut, BS),
                    lambda: pair.dev.cache_full_blocks(held, hs, 0, cut, BS))
        rng.shuffle(held)
        if it % 3 == 0 and held:
            cr, cd = pair.callbacks()
            part = held[: len(held) // 2]
            pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
            held = held[len(held) // 2:]
        cut = rng.randint(0, len(held))
        segs = [held[:cut], held[cut:]]
        flat = segs[0] + segs[1]

        def ref_apply():
            for s in segs:
                pair.ref.free_blocks(s)
        pair.batched(f"free_batched({segs})", None, ref_apply,
                     lambda: pair.dev.free_batched(i32(flat), i32([0, cut, len(flat)])))
        # touch something in the middle: a tombstone
        for _ in range(2):
            q = pair.ref.free_queue()
            if len(q) > 2:
                mid = [q[len(q) // 2]]
                pair.do(f"touch({mid})", lambda: pair.ref.touch(mid), lambda: pair.dev.touch(mid))
                pair.do(f"free({mid})", lambda: pair.ref.free_blocks(mid), lambda: pair.dev.free_blocks(mid))
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0


@pytest.mark.parametrize("chunks,n,mk", [(1, 5, 4), pytest.param(1, 17, 1, marks=pytest.mark.slow),
                                         pytest.param(2, 9, 4, marks=pytest.mark.slow),
                                         pytest.param(2, 17, 2, marks=pytest.mark.slow)])
@pytest.mark.heavy("1-5-4")
def test_key_table_near_its_limit(chunks, n, mk):
    """Tables sized so every key slot can be in use at once ((N-1)*MK == 16*chunks): inserts, deletes,
    moves and lookups stay exact, and validate() checks the overflow counts along every probe path."""
    assert (n - 1) * mk == 16 * chunks
    pair = PoolPair(n, mk=mk, chunks=chunks, events=True)
    rng = random.Random(chunks * 100 + n)
    universe = [H(f"t{i}") for i in range(3 * n)]
    blocks = ints(pair.dev.get_new_blocks(n - 1))
    pair.ref.get_new_blocks(n - 1)
    for rnd in range(4):
        # Fill every block's row: a full key (primary) and partial secondaries, up to MK keys.
        for b in blocks:
            for j in range(mk - len(pair.ref.block_keys(b))):
                hh = rng.choice(universe)
                g = rng.randint(0, 1)
                pair.used.add(hh)
                # num_tokens below the primary's 16 so the key is added as a secondary
                pair.do(f"partial({b}, g={g})",
                        lambda: pair.ref.cache_partial_block(b, [hh], 4, g, 16, 4),
                        lambda: pair.dev.cache_partial_block(b, [hh], 4, g, 16, 4), norm=lambda x: x)
        assert sum(len(pair.ref.block_keys(b)) for b in blocks) <= 16 * chunks
        # The table is now (nearly) full. Delete some, move some, re-add.
        victims = rng.sample(blocks, len(blocks) // 3)
        pair.do(f"evict({victims})", lambda: pair.ref.evict_blocks(victims), lambda: pair.dev.evict_blocks(victims))
        keyed = [b for b in blocks if pair.ref.block_keys(b)]
        empty = [b for b in blocks if not pair.ref.block_keys(b)]
        if keyed and empty:
            s, d = rng.choice(keyed), rng.choice(empty)
            pair.do(f"move({s}, {d})", lambda: pair.ref.move_block_hashes(s, d),
                    lambda: pair.dev.move_block_hashes(s, d))
        # Primary keys via cache_full (promotion of partial keys: old keys removed).
        order = blocks[:]
        rng.shuffle(order)
        hs = [rng.choice(universe) for _ in order]
        pair.used.update(hs)
        nc = rng.randint(0, len(order) - 1)
        try_ids = order[: nc + 3]
        pair.do("cache_full", lambda: pair.ref.cache_full_blocks(try_ids, hs, nc, len(try_ids), 16, 0),
                lambda: pair.dev.cache_full_blocks(try_ids, hs, nc, len(try_ids), 16, 0))
    pair.do("reset refused", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    pair.do("free all", lambda: pair.ref.free_blocks(blocks), lambda: pair.dev.free_blocks(blocks))
    pair.do("reset", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)


def test_free_batched_a_then_b_puts_b_ahead_of_a():
    """docs/semantics.md, batched forms: freeing A then B in one call puts B's un-hashed blocks ahead of A's;
    hashed blocks go to the back in the order they reach zero."""
    pair = PoolPair(12)
    a = ints(pair.dev.get_new_blocks(4))
    b = ints(pair.dev.get_new_blocks(4))
    assert a == ints(pair.ref.get_new_blocks(4)) and b == ints(pair.ref.get_new_blocks(4))
    hs = [H(f"a{i}") for i in range(4)]
    pair.used.update(hs[:1])
    pair.do("cache A[0]", lambda: pair.ref.cache_full_blocks(a, hs, 0, 1, BS),
            lambda: pair.dev.cache_full_blocks(a, hs, 0, 1, BS))
    rest = pair.ref.free_queue()
    segs = [a[::-1], b[::-1]]

    def ref_apply():
        for s in segs:
            pair.ref.free_blocks(s)
    pair.batched("free_batched(A, B)", None, ref_apply,
                 lambda: pair.dev.free_batched(i32(segs[0] + segs[1]), i32([0, 4, 8])))
    assert pair.dev.free_queue() == b[::-1] + a[:0:-1] + rest + [a[0]]


def test_free_batched_one_block_in_many_segments():
    """A block held several times, released across segments: it joins the queue once, at the segment
    where it reaches zero (the last occurrence)."""
    pair = PoolPair(8)
    blocks = ints(pair.dev.get_new_blocks(3))
    pair.ref.get_new_blocks(3)
    pair.do("touch", lambda: pair.ref.touch([blocks[0]] * 3), lambda: pair.dev.touch([blocks[0]] * 3))
    segs = [[blocks[0], blocks[1]], [blocks[0]], [], [blocks[2], blocks[0]], [blocks[0]]]
    flat, offs = flat_segments(segs)

    def ref_apply():
        for s in segs:
            pair.ref.free_blocks(s)
    pair.batched("free_batched", None, ref_apply, lambda: pair.dev.free_batched(i32(flat), i32(offs)))
    assert pair.dev.free_queue()[:3] == [blocks[0], blocks[2], blocks[1]]


@pytest.mark.parametrize("failing", ["free_double", "free_bad_id", "alloc_negative", "alloc_too_many",
                                     "touch_bad_id"])
def test_sticky_status_after_failing_batched_op(failing):
    """After a failing batched op, later batched ops (and single ops) do nothing until check() raises
    and clears the status word."""
    pair = PoolPair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(3))
    pair.ref.get_new_blocks(3)
    pair.used.update([H(1), H(2)])
    pair.do("cache", lambda: pair.ref.cache_full_blocks(blocks, [H(1), H(2)], 0, 2, BS),
            lambda: pair.dev.cache_full_blocks(blocks, [H(1), H(2)], 0, 2, BS))
    before = pool_state(pair.dev)
    dev = pair.dev
    launch, exc = {
        "free_double": (lambda: dev.free_batched(i32([blocks[0], blocks[0]]), i32([0, 1, 2])), DoubleFreeError),
        "free_bad_id": (lambda: dev.free_batched(i32([blocks[0], 8]), i32([0, 1, 2])), InvalidBlockIdError),
        "alloc_negative": (lambda: dev.allocate_batched(i32([1, -2])), InvalidCountError),
        "alloc_too_many": (lambda: dev.allocate_batched(i32([3, 3])), OutOfBlocksError),
        "touch_bad_id": (lambda: dev.touch_batched(i32([1, -1])), InvalidBlockIdError),
    }[failing]
    launch()
    # These would all succeed on their own.
    dev.allocate_batched(i32([1]))
    dev.free_batched(i32(blocks[:1]), i32([0, 1]))
    dev.touch_batched(i32([blocks[1]]))
    with pytest.raises(exc):
        dev.check()
    dev.check()  # cleared
    assert pool_state(dev) == before
    pair.compare()
    # A single op after a failing batched op raises that error and is not applied either.
    launch()
    with pytest.raises(exc):
        dev.free_blocks([blocks[2]])
    assert pool_state(dev) == before
    pair.compare()
    # And the pool works normally afterwards.
    pair.batched("allocate_batched([2])", None, lambda: [ints(pair.ref.get_new_blocks(2))],
                 lambda: dev.allocate_batched(i32([2])), lambda out: [ints(out[0])[:ints(out[1])[1]]])


def test_batched_error_is_that_of_the_first_failing_call():
    """A batch that would fail in two ways reports the first single call's error."""
    pair = PoolPair(6)
    # demand 0 asks for too many, demand 1 is negative: the sequence fails at demand 0.
    pair.batched("allocate_batched([9, -1])", OutOfBlocksError, None,
                 lambda: pair.dev.allocate_batched(i32([9, -1])))
    blocks = ints(pair.dev.get_new_blocks(2))
    pair.ref.get_new_blocks(2)
    # segment 0 double-frees, segment 1 has a bad id: the sequence fails at segment 0.
    pair.batched("free_batched([[b0, b0], [99]])", DoubleFreeError, None,
                 lambda: pair.dev.free_batched(i32([blocks[0], blocks[0], 99]), i32([0, 2, 3])))


def test_watchers_fire_in_handout_order_across_batched_demands():
    pair = PoolPair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(5))
    pair.ref.get_new_blocks(5)
    hs = [H(f"w{i}") for i in range(5)]
    pair.used.update(hs)
    pair.do("cache", lambda: pair.ref.cache_full_blocks(blocks, hs, 0, 5, BS),
            lambda: pair.dev.cache_full_blocks(blocks, hs, 0, 5, BS))
    for part in ([blocks[3], blocks[1]], [blocks[0], blocks[4], blocks[2]]):
        cr, cd = pair.callbacks()
        pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
    demands = [1, 3, 3]
    pair.batched(f"allocate_batched({demands})", None, lambda: [ints(pair.ref.get_new_blocks(d)) for d in demands],
                 lambda: pair.dev.allocate_batched(i32(demands)),
                 lambda out: [ints(out[0])[ints(out[1])[k]:ints(out[1])[k + 1]] for k in range(3)])
    assert len(pair.fired["ref"]) == 5


def test_lookup_and_longest_prefix_batched_against_reference():
    """Chains cached in two groups, a duplicate key on a second block (earliest inserted wins), some
    hit blocks free (zero_ref counts them)."""
    pair = PoolPair(16, mk=2)
    blocks = ints(pair.dev.get_new_blocks(8))
    pair.ref.get_new_blocks(8)
    chain = HASHES[:8]
    pair.used.update(chain)
    pair.do("cache g0", lambda: pair.ref.cache_full_blocks(blocks[:5], chain, 0, 5, BS),
            lambda: pair.dev.cache_full_blocks(blocks[:5], chain, 0, 5, BS))
    pair.do("cache g1", lambda: pair.ref.cache_full_blocks(blocks[5:8], chain, 0, 3, BS, 1),
            lambda: pair.dev.cache_full_blocks(blocks[5:8], chain, 0, 3, BS, 1))
    pair.do("partial g1", lambda: pair.ref.cache_partial_block(blocks[0], chain, 16, 1, 16, 4),
            lambda: pair.dev.cache_partial_block(blocks[0], chain, 16, 1, 16, 4))
    more = ints(pair.dev.get_new_blocks(2))
    pair.ref.get_new_blocks(2)
    pair.do("dup", lambda: pair.ref.cache_full_blocks(more, chain, 0, 2, BS),
            lambda: pair.dev.cache_full_blocks(more, chain, 0, 2, BS))
    pair.do("free some", lambda: pair.ref.free_blocks(blocks[:3][::-1]),
            lambda: pair.dev.free_blocks(blocks[:3][::-1]))
    check_lookup_batched(pair, [(i, g) for i in range(NUM_HASHES) for g in (0, 1, 2)])
    chains = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 9, 3, 4, 5, 6], [3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    for groups in ([0], [1], [0, 1], [1, 0]):
        check_longest_prefix(pair, chains, groups, [7, 7, 7, 2])
    # Long chains: more than one tile of positions.
    long_chain = [[i % 5 for i in range(300)]]
    check_longest_prefix(pair, long_chain, [0], [300])


def test_reset_fires_watchers_in_registration_order_after_reregistration():
    """Re-registering a watcher replaces the callback but keeps the block's place in the order."""
    pair = PoolPair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(5))
    pair.ref.get_new_blocks(5)
    pair.do("touch", lambda: pair.ref.touch(blocks), lambda: pair.dev.touch(blocks))  # ref 2 each
    for part in ([blocks[2], blocks[0]], [blocks[4], blocks[2]], [blocks[1], blocks[0], blocks[3]]):
        cr, cd = pair.callbacks()
        pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
    pair.do("reset refused", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    rest = [b for b, c in enumerate(pair.ref.ref_counts()) for _ in range(c) if b]
    pair.do(f"free({rest})", lambda: pair.ref.free_blocks(rest), lambda: pair.dev.free_blocks(rest))
    pair.do("reset", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    assert [b for _, b in pair.fired["ref"]] == [blocks[2], blocks[0], blocks[4], blocks[1], blocks[3]]


def test_cache_full_blocks_error_precedence_with_tensor_ids():
    pair = PoolPair(6)
    pair.ref.get_new_blocks(2)
    pair.dev.get_new_blocks(2)
    bad = [1, 6]
    pair.do("cache_full_blocks(tensor [1, 6], block_size=0)",
            lambda: pair.ref.cache_full_blocks(i32(bad), [H(0), H(1)], 0, 2, 0),
            lambda: pair.dev.cache_full_blocks(i32(bad), [H(0), H(1)], 0, 2, 0))


def test_key_table_too_small_is_refused():
    """A table with fewer slots than (N-1)*MK live keys could fill (an insert would find no slot):
    the constructor refuses it; the exact limit is accepted (test_key_table_near_its_limit)."""
    with pytest.raises(InvalidArgumentError):
        BlockPool(6, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 20 keys, 16 slots
    BlockPool(5, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 16 keys, 16 slots


def test_allocate_batched_fills_the_unused_tail_with_minus_one():
    """``blocks`` is ``int32[N + 1]``: past the last offset every entry is -1 (the kernel writes it, no
    extra launch); a failed or skipped batch leaves all of it -1."""
    n = 9
    dev = BlockPool(n, device=DEVICE)
    blocks, offsets = dev.allocate_batched(i32([2, 0, 3]))
    dev.check()
    assert blocks.shape == (n + 1,) and ints(offsets) == [0, 2, 2, 5]
    assert ints(blocks)[:5] == list(range(1, 6))
    assert ints(blocks)[5:] == [-1] * (n + 1 - 5)
    # A padded batch: only the first num_demands count; the tail starts at their sum.
    blocks, offsets = dev.allocate_batched(i32([1, 7]), torch.tensor([1], dtype=torch.int32, device=DEVICE))
    dev.check()
    assert ints(offsets)[:2] == [0, 1] and ints(blocks)[1:] == [-1] * n
    # Too many: nothing is allocated, every entry is -1, and so is a batch skipped by the sticky status.
    blocks, _ = dev.allocate_batched(i32([2, 9]))
    skipped, _ = dev.allocate_batched(i32([1]))
    assert ints(blocks) == [-1] * (n + 1) and ints(skipped) == [-1] * (n + 1)
    with pytest.raises(OutOfBlocksError):
        dev.check()
    blocks, _ = dev.allocate_batched(i32([2, -1]))  # a negative demand: nothing popped, all -1
    assert ints(blocks) == [-1] * (n + 1)
    with pytest.raises(InvalidCountError):
        dev.check()
    # A pool wider than one tile: the fill programs cover several tiles.
    big = BlockPool(5000, device=DEVICE)
    blocks, _ = big.allocate_batched(i32([3]))
    big.check()
    got = ints(blocks)
    assert got[:3] == [1, 2, 3] and got[3:] == [-1] * (5001 - 3)


@pytest.mark.parametrize("device, says", [
    ("foo", "unknown device 'foo'"),
    ("meta", "device meta is not supported"),
    pytest.param("cuda", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    pytest.param("cuda:0", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_device_is_one_clear_error(device, says):
    from gpupool.manager import KVCacheManager
    with pytest.raises(InvalidArgumentError, match=says):
        BlockPool(8, device=device)
    with pytest.raises(InvalidArgumentError, match=says):
        KVCacheManager(16, block_size=4, max_num_reqs=2, max_blocks_per_req=4, device=device)


def _meta_i32(values):
    return torch.tensor(values, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("case", ["allocate_2d", "free_2d", "touch_2d", "free_blocks_meta", "get_new_blocks_meta",
                                  "touch_meta"])
def test_wrong_rank_or_meta_inputs_are_pool_errors_and_change_nothing(case):
    p = BlockPool(16, enable_caching=True)
    held = p.get_new_blocks(3)
    before = (p.free_queue(), p.ref_counts())
    calls = {
        "allocate_2d": lambda: p.allocate_batched(torch.tensor([[1, 2]], dtype=torch.int32)),
        "free_2d": lambda: p.free_batched(held.reshape(1, 3).to(torch.int32), torch.tensor([3], dtype=torch.int32)),
        "touch_2d": lambda: p.touch_batched(held.reshape(3, 1).to(torch.int32)),
        "free_blocks_meta": lambda: p.free_blocks(_meta_i32([1])),
        "get_new_blocks_meta": lambda: p.get_new_blocks(torch.tensor(2, device="meta")),
        "touch_meta": lambda: p.touch(_meta_i32([1])),
    }
    with pytest.raises(PoolError):
        calls[case]()
        p.check()
    assert (p.free_queue(), p.ref_counts()) == before


def _named_block(msg: str) -> str | None:
    import re
    m = re.search(r"\bblock (?:id )?(-?\d+)", msg)
    return m.group(1) if m else None


_H = [bytes([i]) * 32 for i in range(8)]  # distinct block hashes

# Each bad-input class of the pool's device-recorded errors: (setup, the failing op). The setup
# leaves the pool in a state both pools share; the failing op must raise the same class, name the
# same block, and leave the pool as the setup left it.
_BAD_INPUTS = {
    "double_free_in_one_call": (lambda p: p.get_new_blocks(3), lambda p: p.free_blocks([2, 2])),
    "double_free_across_calls": (lambda p: (p.get_new_blocks(3), p.free_blocks([3])), lambda p: p.free_blocks([3])),
    "free_out_of_range": (lambda p: p.get_new_blocks(3), lambda p: p.free_blocks([1, 40])),
    "touch_out_of_range": (lambda p: p.get_new_blocks(3), lambda p: p.touch([2, 99])),
    "unpin_free_block": (lambda p: p.get_new_blocks(3), lambda p: p.unpin_blocks([5], lambda b: None)),
    "cache_listed_twice": (lambda p: p.get_new_blocks(3), lambda p: p.cache_full_blocks([1, 1], _H[:2], 0, 2, 4)),
    "cache_already_cached": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1, 2], _H[:2], 0, 2, 4)),
                             lambda p: p.cache_full_blocks([3, 2], _H[2:4], 0, 2, 4)),
    "move_onto_keyed": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1, 2], _H[:2], 0, 2, 4)),
                        lambda p: p.move_block_hashes(1, 2)),
    "move_onto_null": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1], _H[:1], 0, 1, 4)),
                       lambda p: p.move_block_hashes(1, 0)),
    "key_capacity": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1], _H[:1], 0, 1, 4)),
                     lambda p: p.cache_partial_block(1, _H[:3], 2, 1, 4, 2)),
}


def _pool_state(pool):
    return pool.free_queue(), pool.ref_counts(), [sorted(pool.block_keys(b)) for b in range(pool.num_blocks)]


@pytest.mark.parametrize("case", sorted(_BAD_INPUTS))
def test_device_errors_name_the_same_block_as_the_reference(case):
    """A device-recorded error names the offending block from the status word's value, as the
    reference pool's message does (same class, same block id), and changes nothing."""
    setup, fail = _BAD_INPUTS[case]
    errs = []
    for pool in pool_twin(16, enable_caching=True, max_keys_per_block=1):
        setup(pool)
        before = _pool_state(pool)
        with pytest.raises(PoolError) as e:
            fail(pool)
            if isinstance(pool, BlockPool):
                pool.check()
        errs.append(e.value)
        assert _pool_state(pool) == before
    ref, dev = errs
    assert type(dev) is type(ref)
    assert dev.value == ref.value, (str(ref), str(dev))
    named = _named_block(str(dev))
    assert named is not None and int(named) == ref.value, (str(ref), str(dev))


# =================================================================================================
# Watchers are flags
# =================================================================================================

@pytest.mark.slow
def test_unpin_many_watchers():
    """Watchers are flags, not counted ids: many unpin calls keep working."""
    p = BlockPool(4)
    fired = []
    for _ in range(50):
        b = p.get_new_blocks(1)
        p.unpin_blocks(b, fired.append)
    assert p.num_watchers() <= 3
    assert_consistent(p)



@pytest.mark.parametrize("case", ["out_of_blocks", "out_of_blocks_past_the_pool", "double_free", "double_unpin"])
def test_both_pools_word_the_same_error_the_same_way(case):
    """Out of blocks names the free count, a double free the block's ref count, in both pools and in
    the same words (the device's read at ``check()``, which the failed op left unchanged)."""
    msgs = []
    for pool in pool_twin(8):
        b = pool.get_new_blocks(2)
        try:
            if case == "out_of_blocks":
                pool.get_new_blocks(7)
            elif case == "out_of_blocks_past_the_pool":
                pool.get_new_blocks(9)
            elif case == "double_free":
                pool.free_blocks(b)
                pool.free_blocks(b[:1])
            else:
                pool.free_blocks(b[:1])
                pool.unpin_blocks(b[:1], lambda blk: None)
            if isinstance(pool, BlockPool):
                pool.check()
        except PoolError as e:
            msgs.append(str(e))
    assert len(msgs) == 2 and msgs[0] == msgs[1], msgs
    assert "(5 free)" in msgs[0] if case.startswith("out_of") else "ref_cnt 0" in msgs[0]
