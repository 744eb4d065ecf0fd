"""``gpupool.BlockPool.cache_blocks_batched``: many ``cache_full_blocks`` calls in one launch
(docs/semantics.md section 2, batched forms), against the reference pool making the calls one by one.

* differential (hypothesis): a pool with some blocks held, some keyed (earlier calls), some free and
  keyed; a batch of calls over held blocks (fresh ranges, ranges past an earlier caching, null blocks
  in a range, no-op calls); the device's one launch and the reference's calls in order leave the same
  whole state (free-queue order, ref counts, every block's keys and token count) and the same lookups;
* errors: a block listed twice, a hash conflict and a bad id go to the status word (``check()``
  raises, the state unchanged); bad host values raise at the call; a pool with KV events refuses.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool import BlockPool as DevicePool
from gpupool.errors import (
    ArgumentTypeError, HashConflictError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError,
)

from harness.compare import assert_pools_agree
from harness.keys import h
from harness.state import pool_state
from harness.twins import pool_twin

N = 24
BS = 4


def twins():
    return pool_twin(N, device="cpu")


def both(ref, dev, fn):
    fn(ref)
    fn(dev)


def held_blocks(ref, dev, n):
    a = ref.get_new_blocks(n)
    b = dev.get_new_blocks(n)
    assert list(a) == [int(x) for x in b]
    return [int(x) for x in a]


def hashes(tag, n):
    return [h(f"{tag}-{i}") for i in range(n)]


@settings(max_examples=12, deadline=None)
@given(data=st.data())
@pytest.mark.heavy
def test_one_launch_equals_the_calls_in_order(data):
    ref, dev = twins()
    # earlier history: a request cached and freed (keyed free blocks at the queue's back), one held
    old = held_blocks(ref, dev, 4)
    both(ref, dev, lambda p: p.cache_full_blocks(old, hashes("old", 4), 0, 4, BS, 0))
    both(ref, dev, lambda p: p.free_blocks(old[::-1]))
    nreq = data.draw(st.integers(1, 4), label="requests")
    calls, ids = [], []
    for r in range(nreq):
        nblk = data.draw(st.integers(0, 4), label="blocks")
        row = held_blocks(ref, dev, nblk)
        nc = data.draw(st.integers(0, nblk), label="num_cached")
        if nc:  # blocks [0, nc) cached by an earlier call
            both(ref, dev, lambda p: p.cache_full_blocks(row, hashes(r, nblk), 0, nc, BS, 0))
        nf = data.draw(st.integers(nc, nblk), label="num_full")
        if nf > nc and data.draw(st.booleans(), label="null in range"):
            row[data.draw(st.integers(nc, nf - 1))] = 0
        group = data.draw(st.integers(0, 1), label="group")
        calls.append((hashes(r, nblk), nc, nf, BS, group))
        ids += row[nc:nf]
    pos = 0  # the reference: the calls one by one
    for hs, nc, nf, bs, g in calls:
        ref.cache_full_blocks([0] * nc + ids[pos:pos + nf - nc], hs, nc, nf, bs, g)
        pos += nf - nc
    dev.cache_blocks_batched(torch.tensor(ids, dtype=torch.int32), calls)
    dev.check()
    assert_pools_agree(ref, dev, used={x for hs, *_ in calls for x in hs})  # the whole state, lookups included
    for r, (hs, nc, nf, bs, g) in enumerate(calls):
        for x in hs:
            a, b = ref.get_cached_block(x, [g]), dev.get_cached_block(x, [g])
            assert (None if a is None else [int(v) for v in a]) == (None if b is None else [int(v) for v in b])


def _unchanged_after(dev, fn, exc):
    before = pool_state(dev)
    fn()
    with pytest.raises(exc):
        dev.check()
    assert pool_state(dev) == before
    dev.check()  # the status word was cleared


def test_device_errors_leave_the_state_unchanged():
    dev = DevicePool(N, device="cpu")
    row = [int(b) for b in dev.get_new_blocks(4)]
    dev.cache_full_blocks(row, hashes("a", 2), 0, 2, BS, 0)
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    # the same block in two calls
    _unchanged_after(dev, lambda: dev.cache_blocks_batched(t([row[2], row[2]]), [(hashes("b", 3), 2, 3, BS, 0),
                                                                              (hashes("c", 1), 0, 1, BS, 0)]),
                     InvalidArgumentError)
    # a block keyed at >= the tokens it would cover
    _unchanged_after(dev, lambda: dev.cache_blocks_batched(t([row[3], row[1]]), [(hashes("d", 1), 0, 1, BS, 0),
                                                                              (hashes("e", 1), 0, 1, BS, 0)]),
                     HashConflictError)
    _unchanged_after(dev, lambda: dev.cache_blocks_batched(t([row[3], N + 5]), [(hashes("f", 2), 0, 2, BS, 0)]),
                     InvalidBlockIdError)


def test_host_errors_raise_at_the_call():
    dev = DevicePool(N, device="cpu")
    row = [int(b) for b in dev.get_new_blocks(2)]
    before = pool_state(dev)
    t = torch.tensor(row, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError):  # 2 ids, a range of 1
        dev.cache_blocks_batched(t, [(hashes("a", 1), 0, 1, BS, 0)])
    with pytest.raises(InvalidArgumentError):  # more full blocks than hashes
        dev.cache_blocks_batched(t, [(hashes("a", 1), 0, 2, BS, 0)])
    with pytest.raises(ArgumentTypeError):
        dev.cache_blocks_batched(t, [(hashes("a", 2), 0, 2)])
    with pytest.raises(InvalidArgumentError):
        DevicePool(N, device="cpu", enable_kv_cache_events=True).cache_blocks_batched(t[:0], [])
    assert pool_state(dev) == before
    dev.check()


def test_host_values_are_checked_with_caching_off():
    """With caching off every call is a no-op, but its host values are still checked, as
    ``cache_full_blocks`` checks them on such a pool (the docstring's promise; a bad block size or a
    negative count was accepted by the batched forms); ``calls`` that are not a sequence of tuples and
    ``demands`` that are not a sequence are ArgumentTypeError (was Python's TypeError)."""
    pool = DevicePool(N, device="cpu", enable_caching=False)
    before = pool_state(pool)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError):
        pool.cache_full_blocks([1], [h("a")], 0, 1, 0)  # block size 0: the single op
    with pytest.raises(InvalidArgumentError):
        pool.cache_blocks_batched(one, [([h("a")], 0, 1, 0, 0)])
    with pytest.raises(InvalidCountError):
        pool.cache_blocks_batched(one, [([h("a")], -1, 1, BS, 0)])
    with pytest.raises(InvalidArgumentError):
        pool.apply_batched(cache_ids=one, cache_calls=[([h("a")], 0, 1, 0, 0)])
    with pytest.raises(ArgumentTypeError):
        pool.cache_blocks_batched(one, 5)
    with pytest.raises(ArgumentTypeError):
        DevicePool(N, device="cpu").cache_blocks_batched(one, 5)
    with pytest.raises(ArgumentTypeError):
        pool.apply_batched(demands=None)
    assert pool_state(pool) == before
    pool.check()
