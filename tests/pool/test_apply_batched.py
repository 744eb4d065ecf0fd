"""``gpupool.BlockPool.apply_batched``: ``free_batched``, ``touch_batched``, ``allocate_batched`` and
``cache_blocks_batched`` in one launch (docs/semantics.md section 2, batched forms), against the
reference pool making the single calls in that order.

* differential (hypothesis): from a pool with held, keyed-free and un-keyed-free blocks, random parts
  (frees of held blocks in segments, touches of free and held blocks, demands, cachings over held
  blocks and over this call's own pops named ``num_blocks + k``): the same popped blocks and the same
  whole state (free-queue order, ref counts, keys and token counts, lookups);
* a part that fails records its error and the later parts do nothing (a double free: nothing at
  all; a duplicate in the caching: the frees, touches and pops stay), as the single calls stopping
  at the first error would;
* host errors raise at the call with the pool unchanged.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool import BlockPool as DevicePool
from gpupool.kernels.flush import FlushBatch
from gpupool.errors import ArgumentTypeError, DoubleFreeError, InvalidArgumentError, InvalidCountError, OutOfBlocksError, PoolError

from harness.compare import assert_pools_agree
from harness.keys import h
from harness.state import pool_state
from harness.twins import pool_twin
from harness.device import cpu_i32

N = 24
BS = 4


def setup():
    """Both pools: 6 blocks keyed and freed (at the queue's back), 6 held (4 of them keyed)."""
    ref, dev = pool_twin(N, device="cpu")
    for p in (ref, dev):
        old = [int(b) for b in p.get_new_blocks(6)]
        p.cache_full_blocks(old, [h(f"old{i}") for i in range(6)], 0, 6, BS, 0)
        p.free_blocks(old[::-1])
        held = [int(b) for b in p.get_new_blocks(6)]
        p.cache_full_blocks(held, [h(f"held{i}") for i in range(6)], 0, 4, BS, 0)
    assert_pools_agree(ref, dev)
    return ref, dev, old, held


def reference_apply(ref, segments, touches, demands, calls, cache_ids):
    """The single calls in order; returns the popped blocks."""
    for seg in segments:
        ref.free_blocks(seg)
    if touches:
        ref.touch(touches)
    popped = []
    for d in demands:
        popped += [int(b) for b in ref.get_new_blocks(d)]
    ids = [popped[c - N] if c >= N else c for c in cache_ids]
    pos = 0
    for hs, nc, nf, bs, g in calls:
        ref.cache_full_blocks([0] * nc + ids[pos:pos + nf - nc], hs, nc, nf, bs, g)
        pos += nf - nc
    return popped


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.heavy
def test_one_launch_equals_the_single_calls(data):
    ref, dev, old, held = setup()
    nfree = data.draw(st.integers(0, 2), label="held blocks freed")
    segments = [[b] for b in held[:nfree]]
    touches = data.draw(st.lists(st.sampled_from(old + held[nfree:]), max_size=4), label="touches")
    demands = data.draw(st.lists(st.integers(0, 3), max_size=3), label="demands")
    total = sum(demands)
    # cachings: an un-keyed held block (held[4:]) and this call's pops, each listed once
    pool = [c for c in held[4:] if c not in held[:nfree]] + [N + k for k in range(total)]
    chosen = data.draw(st.permutations(pool), label="order")[: data.draw(st.integers(0, len(pool)))]
    calls, cache_ids = [], []
    for j, c in enumerate(chosen):
        calls.append(([h(f"new{j}-{i}") for i in range(2)], 1, 2, BS, 0))
        cache_ids.append(c)
    popped = reference_apply(ref, segments, touches, demands, calls, cache_ids)
    flat = [b for seg in segments for b in seg]
    offsets = [0]
    for seg in segments:
        offsets.append(offsets[-1] + len(seg))
    blocks, offs = dev.apply_batched(free_ids=cpu_i32(flat) if segments else None, free_offsets=cpu_i32(offsets),
                                     touch_ids=cpu_i32(touches) if touches else None, demands=demands,
                                     cache_ids=cpu_i32(cache_ids) if calls else None, cache_calls=calls)
    dev.check()
    assert blocks.tolist() == popped
    assert offs.tolist()[: len(demands) + 1] == [sum(demands[:k]) for k in range(len(demands) + 1)]
    assert_pools_agree(ref, dev, used={x for hs, *_ in calls for x in hs})  # the whole state, lookups included


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.heavy
def test_rounds_equal_the_single_calls_round_after_round(data):
    """``rounds``: up to 3 batches in one launch equal the single calls, round after round: a round
    frees blocks an earlier round popped or touched, touches blocks it popped (held, or popped and
    freed back), pops what earlier rounds freed (to the front), and caches earlier rounds' pops by
    ``num_blocks + k``; the same popped blocks and the whole state."""
    ref, dev, old, held = setup()
    flat, offsets, touches, demands, calls, cache_ids, rounds, popped = [], [], [], [], [], [], [], []
    for r in range(data.draw(st.integers(1, 3), label="rounds")):
        live = [b for b in range(1, N) if ref.ref_cnt[b] > 0]
        frees = data.draw(st.lists(st.sampled_from(live), max_size=2, unique=True), label="frees") if live else []
        segs = [[b] for b in frees]
        for seg in segs:
            ref.free_blocks(seg)
        tch = data.draw(st.lists(st.sampled_from(old + held + popped), max_size=3), label="touches")
        if tch:
            ref.touch(tch)
        dem = data.draw(st.lists(st.integers(0, 2), max_size=2), label="demands")
        dem = dem if sum(dem) <= ref.get_num_free_blocks() else []
        mine = []
        for d in dem:
            mine += [int(b) for b in ref.get_new_blocks(d)]
        k0 = len(popped)
        popped += mine
        # cachings: held un-keyed blocks, this launch's pops named N + k half the time
        cand = [b for b in range(1, N) if ref.ref_cnt[b] > 0 and not ref.keys[b]]
        chosen = data.draw(st.lists(st.sampled_from(cand), max_size=2, unique=True), label="cached") if cand else []
        rcalls = []
        for j, b in enumerate(chosen):
            rcalls.append(([h(f"r{r}-{j}-{i}") for i in range(2)], 1, 2, BS, 0))
            ref.cache_full_blocks([0, b], rcalls[-1][0], 1, 2, BS, 0)
            name = b
            if b in popped and data.draw(st.booleans(), label="by N + k"):
                name = N + popped.index(b)
            cache_ids.append(name)
        offsets += [0] + [sum(len(x) for x in segs[:i + 1]) for i in range(len(segs))]
        flat += frees
        touches += tch
        demands += dem
        calls += rcalls
        rounds.append((len(frees), len(segs), len(tch), len(dem), len(rcalls)))
        assert k0 + sum(dem) == len(popped)
    blocks, offs = dev.apply_batched(free_ids=cpu_i32(flat), free_offsets=cpu_i32(offsets),
                                     touch_ids=cpu_i32(touches) if touches else None, demands=demands,
                                     cache_ids=cpu_i32(cache_ids) if calls else None, cache_calls=calls, rounds=rounds)
    dev.check()
    assert blocks.tolist() == popped
    assert offs.tolist() == [sum(demands[:k]) for k in range(len(demands) + 1)]
    assert_pools_agree(ref, dev, used={x for hs, *_ in calls for x in hs})


def test_rounds_that_do_not_add_up_raise_at_the_call():
    """Round counts that miss or exceed a part's length, a negative count or a short tuple raise at
    the call, nothing changed; counts that add up run the rounds in order: a pop, then a free of an
    un-keyed block (to the queue's front) and a pop that takes it back."""
    ref, dev, old, held = setup()
    before = pool_state(dev)
    for rounds in ([(1, 1, 0, 1, 0)], [(0, 0, 0, 1, 0), (1, 1, 0, 2, 0)], [(1, 1, 0, 2, 0), (0, 0, 0, 0, 0)],
                   [(1, 1, 0, 3, -1)], [(1, 1, 0)], [(1, 0, 0, 2, 0)]):
        with pytest.raises(PoolError):
            dev.apply_batched(free_ids=cpu_i32([held[5]]), free_offsets=cpu_i32([0, 1]), demands=[1, 1], rounds=rounds)
        assert pool_state(dev) == before
    blocks, offs = dev.apply_batched(free_ids=cpu_i32([held[5]]), free_offsets=cpu_i32([0, 0, 1]), demands=[1, 1],
                                     rounds=[(0, 0, 0, 1, 0), (1, 1, 0, 1, 0)])
    dev.check()
    want = [int(b) for b in ref.get_new_blocks(1)]
    ref.free_blocks([held[5]])
    want += [int(b) for b in ref.get_new_blocks(1)]
    assert blocks.tolist() == want and want[1] == held[5] and offs.tolist() == [0, 1, 2]
    assert_pools_agree(ref, dev)


def test_host_parts_and_predicted_launch():
    """The id parts as host ints (one copy with the demands) act as the same tensors;
    ``apply_predicted`` returns the pops and its confirmation (the status before and after); bad host
    parts raise at the call, nothing changed."""
    _, dev, old, held = setup()
    _, twin, old2, held2 = setup()
    assert (old2, held2) == (old, held)
    calls = [([h("c0"), h("c1")], 1, 2, BS, 0)]
    kw = dict(demands=[2, 1], rounds=[(1, 1, 1, 1, 0), (0, 0, 0, 1, 1)])
    batch = FlushBatch()  # the same two rounds, built op by op
    batch.add_free([held[5]])
    batch.add_touch([old[0]])
    batch.add_pop(2)
    batch.cut()
    batch.add_pop(1)
    batch.add_cache([N + 2], [(h("c1"), 0)], [2 * BS])
    assert batch.free_offsets == [0, 1, 0] and batch.rounds == 2
    a, confirm = dev.apply_predicted(batch)
    b, _ = twin.apply_batched(free_ids=cpu_i32([held[5]]), free_offsets=cpu_i32([0, 1, 0]), touch_ids=cpu_i32([old[0]]),
                              cache_ids=cpu_i32([N + 2]), cache_calls=calls, **kw)
    dev.check()
    twin.check()
    assert a.tolist() == b.tolist() and pool_state(dev) == pool_state(twin)
    assert a.tolist()[0] == held[5] and confirm.tolist() == [0, 0]
    before = pool_state(dev)
    for bad in (dict(free_ids=[2**31], free_offsets=[0, 1]), dict(touch_ids=["x"])):
        with pytest.raises(PoolError):
            dev.apply_batched(**bad)
        assert pool_state(dev) == before
    for bad in (dict(pop=1, cache_ids=[1]), dict(pop=-1), dict(pop=1, touch=[2**31]), dict(pop=1, table=[0]),
                dict(pop=2**40), dict(touch=["x"]), dict(free=[old[0]], table=[0] * 12), dict(free=[-2**40]),
                dict(pop=1, table=predicted(pop=1, touch=[old[0]]).table)):
        b = predicted(**bad)
        with pytest.raises(PoolError):
            dev.apply_predicted(b)
        assert pool_state(dev) == before
    for junk in (None, {}, "batch", [1], predicted):  # not a batch: nothing read from it
        with pytest.raises(ArgumentTypeError):
            dev.apply_predicted(junk)
        assert pool_state(dev) == before


def predicted(pop=None, free=None, touch=None, cache_ids=None, table=None) -> FlushBatch:
    """A one-round batch (``cache_ids``, ``table``: set as given, whatever the rest says)."""
    b = FlushBatch()
    if free is not None:
        b.add_free(free)
    if touch is not None:
        b.add_touch(touch)
    if pop is not None:
        b.add_pop(pop)
    if cache_ids is not None:
        b.cache_ids = cache_ids
    if table is not None:
        b.table = table
    return b


def test_a_launch_confirms_whether_it_ran():
    """``apply_predicted``'s confirmation: (0, 0) when it ran; the status before the launch when an
    error recorded earlier made it do nothing (its pops -1); (0, code) when it failed itself."""
    _, dev, old, held = setup()
    _, c = dev.apply_predicted(predicted(pop=1))
    assert c.tolist() == [0, 0]
    before = pool_state(dev)
    dev.free_batched(cpu_i32([old[0]]), cpu_i32([0, 1]))  # a double free: recorded, nothing changed
    blocks, c = dev.apply_predicted(predicted(pop=1))
    code = c.tolist()[0]
    assert code != 0 and c.tolist() == [code, code] and blocks.tolist() == [-1]
    with pytest.raises(DoubleFreeError):
        dev.check()
    assert pool_state(dev) == before
    _, c = dev.apply_predicted(predicted(free=[old[0]]))
    assert c.tolist()[0] == 0 and c.tolist()[1] != 0
    with pytest.raises(DoubleFreeError):
        dev.check()


def test_a_failing_part_stops_the_later_ones():
    ref, dev, old, held = setup()
    before = pool_state(dev)
    # a double free in the free part: nothing at all
    dev.apply_batched(free_ids=cpu_i32([held[0], held[0]]), free_offsets=cpu_i32([0, 2]), touch_ids=cpu_i32([old[0]]),
                      demands=[2])
    with pytest.raises(DoubleFreeError):
        dev.check()
    assert pool_state(dev) == before
    # a block twice in the caching: the free, the touch and the pop stay, the caching does not
    calls = [([h("x0"), h("x1")], 1, 2, BS, 0), ([h("y0"), h("y1")], 1, 2, BS, 0)]
    dev.apply_batched(free_ids=cpu_i32([held[0]]), free_offsets=cpu_i32([0, 1]), touch_ids=cpu_i32([old[0]]), demands=[1],
                      cache_ids=cpu_i32([N, N]), cache_calls=calls)
    with pytest.raises(InvalidArgumentError):
        dev.check()
    reference_apply(ref, [[held[0]]], [old[0]], [1], [], [])
    assert_pools_agree(ref, dev)


def test_host_errors_raise_at_the_call():
    _, dev, old, held = setup()
    before = pool_state(dev)
    with pytest.raises(InvalidCountError):
        dev.apply_batched(demands=[1, -1])
    with pytest.raises(InvalidArgumentError):  # frees without their offsets
        dev.apply_batched(free_ids=cpu_i32([held[0]]))
    with pytest.raises(InvalidArgumentError):  # 1 id, a range of 2
        dev.apply_batched(cache_ids=cpu_i32([held[4]]), cache_calls=[([h("a"), h("b")], 0, 2, BS, 0)])
    with pytest.raises(InvalidArgumentError):
        DevicePool(N, device="cpu", enable_kv_cache_events=True).apply_batched(demands=[1])
    assert pool_state(dev) == before
    dev.check()


def test_skipped_or_failed_pops_return_minus_one():
    """``blocks`` is all -1 when the pop part fails or an earlier part's error skips it, as
    ``allocate_batched``'s (the docstring's promise; was uninitialised memory, which can look like
    valid ids to a caller that reads it before ``check()``)."""
    _, dev, old, held = setup()
    # an earlier part fails (a double free): the pops are skipped
    blocks, _ = dev.apply_batched(free_ids=cpu_i32([held[0], held[0]]), free_offsets=cpu_i32([0, 2]), demands=[3, 2])
    assert blocks.tolist() == [-1] * 5
    with pytest.raises(DoubleFreeError):
        dev.check()
    # the pop part itself fails on the device (more than the free count, within the pool's size)
    free = dev.get_num_free_blocks()
    blocks, _ = dev.apply_batched(demands=[1, free])
    assert blocks.tolist() == [-1] * (free + 1)
    with pytest.raises(OutOfBlocksError):
        dev.check()


def test_demands_past_the_pool_raise_at_the_call():
    """A demands' sum above the pool's ``num_blocks - 1`` blocks can never fit, whatever the frees
    before it: OutOfBlocksError at the call, nothing changed and no output allocated for it (a demand
    past 2**31 - 1 was torch's RuntimeError, a sum past it an int32 offset that wraps, and a huge sum
    allocated its whole output)."""
    _, dev, old, held = setup()
    before = pool_state(dev)
    for demands in ([2**31], [2**30, 2**30], [N], [1, N - 1]):
        with pytest.raises(OutOfBlocksError):
            dev.apply_batched(free_ids=cpu_i32([held[0]]), free_offsets=cpu_i32([0, 1]), demands=demands)
        assert pool_state(dev) == before
    dev.check()


def test_caching_off_runs_no_caching_part():
    """With caching off the caching part is a no-op whatever ids it names (cache_blocks_batched's): the
    launch pops and frees as the single calls do, and keys nothing."""
    ref, dev = pool_twin(N, device="cpu", enable_caching=False)
    held = [int(b) for b in ref.get_new_blocks(2)]
    assert [int(b) for b in dev.get_new_blocks(2)] == held
    calls = [([h("c0"), h("c1")], 0, 2, BS, 0)]
    a, _ = dev.apply_batched(free_ids=cpu_i32(held[:1]), free_offsets=cpu_i32([0, 1]), demands=[1, 1],
                             cache_ids=cpu_i32([N, N + 1]), cache_calls=calls)
    dev.check()
    ref.free_blocks(held[:1])
    b = [int(x) for x in ref.get_new_blocks(1)] + [int(x) for x in ref.get_new_blocks(1)]
    assert a.tolist() == b
    assert_pools_agree(ref, dev)


def test_offsets_of_skipped_or_failed_pops_are_defined():
    """The offsets are never what the memory held: all 0 where an earlier part's error skipped the
    pops (one round, as ``allocate_batched``'s), the demands' prefix sums where the pops failed on the
    device or with rounds (was uninitialised memory where the pops were skipped)."""
    for _ in range(3):  # fresh allocations each time: garbage would differ
        _, dev, old, held = setup()
        torch.randint(1 << 20, (256,), dtype=torch.int32).tolist()  # dirty the allocator's memory
        _, offs = dev.apply_batched(free_ids=cpu_i32([held[0], held[0]]), free_offsets=cpu_i32([0, 2]), demands=[2, 1])
        assert offs.tolist() == [0, 0, 0]
        with pytest.raises(DoubleFreeError):
            dev.check()
        _, offs = dev.apply_batched(free_ids=cpu_i32([held[0], held[0]]), free_offsets=cpu_i32([0, 2, 0]),
                                    demands=[2, 1], rounds=[(2, 1, 0, 1, 0), (0, 0, 0, 1, 0)])
        assert offs.tolist() == [0, 2, 3]
        with pytest.raises(DoubleFreeError):
            dev.check()
