"""Adversarial inputs to ``DeferredBlockPool`` (docs/algorithms.md section 8) against the per-call
``gpupool.vllm.BlockPool``: the same answer, error type and state, and nothing changed by an error.

* a release the host cannot confirm (a block of ref 0 on the host, which a placeholder's pop took on
  the device) synchronises and then frees the blocks the binding names, as the per-call pool does
  (not the placeholders' old slots, and not the null block, which is skipped);
* another user of the device pool that keys a block the adapter holds or pops and keys its own
  block: after the next synchronisation every row of the mirror is the device's (ref counts, keys,
  the holder a lookup answers), whatever launch cadence, and later ops agree with it; past the
  adapter (on the pool itself), an error recorded beside a disagreement, or before a relaunch that
  fails, is raised with it (as its cause), not dropped;
* slow: random op lists (tests/harness/vllm_ops.py's) mixed with such other users' ops (touch and
  free of the adapter's blocks, pops, cachings, frees, a failing batched op), any launch cadence:
  after the synchronisations, the mirror is the device's;
* ``free_blocks``, ``touch`` and ``cache_full_blocks`` given iterators, tuples, generators, null
  blocks, duplicates, other pools' blocks and wrong types: the per-call pool's outcome (its typed
  error), and after an error the host's state (mirror, key map, free count, the host's copy of the
  queue, placeholders) as before it.
"""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402

BS = driver.BLOCK_SIZE
BACKENDS = ["reference", "device"]


def pools(n, backend, caching=True, **kw):
    """(per-call, deferred) over ``backend``."""
    kw.update(device="cpu") if backend == "device" else kw.update(backend="reference")
    return BlockPool(n, caching, BS, **kw), DeferredBlockPool(n, caching, BS, **kw)


def state(p) -> dict:
    """The whole state vLLM's callers read, after a synchronisation."""
    if isinstance(p, DeferredBlockPool):
        p.sync()
    return driver.snapshot(p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_null", [False, True])
def test_free_of_a_block_a_placeholder_took(monkeypatch, backend, with_null):
    """A pop past the host's copy of the queue (placeholders), then a free naming a block the host
    has at ref 0 that the pop took (a stale reference), beside a placeholder or the null block."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 1)
    out = []
    for p in pools(6, backend):
        got = p.get_new_blocks(3)
        assert isinstance(got[0], PendingBlock) == isinstance(p, DeferredBlockPool)
        first = p.null_block if with_null else got[0]
        p.free_blocks([first, p.blocks[2]])
        out.append(([b.block_id for b in got], state(p)))
    assert out[0] == out[1]


@pytest.mark.parametrize("launch_every", [1, 4])
def test_another_user_keys_a_held_block(monkeypatch, launch_every):
    """Another user caches a key on a held block the adapter did not change since its last
    synchronisation; the adapter then caches the same key on its own block: the device's lookup
    answers the other user's (earlier) holder, and so does the mirror after the next sync."""
    monkeypatch.setattr(DeferredBlockPool, "launch_every", launch_every)
    p = DeferredBlockPool(10, True, BS, device="cpu")
    r = driver.request(driver.tokens_of(2)[:2 * BS])
    a = p.get_new_blocks(1)
    b = p.get_new_blocks(2)
    p.end_step()
    p.sync()
    p.device_pool.cache_full_blocks([a[0].block_id], r.block_hashes, 0, 1, BS, 0)
    p.cache_full_blocks(r, b, 0, 2, BS, 0)
    p.end_step()
    p.sync()
    O.mirror_is_device(p)
    assert p.get_cached_block(r.block_hashes[0], [0]) == [a[0]]


@pytest.mark.parametrize("launch_every", [1, 4])
def test_another_user_pops_and_keys(monkeypatch, launch_every):
    """Another user pops a block and keys it; the adapter caches the same key on a block it holds:
    the adapter sees the change at the other user's call (no disagreement at the next sync), the whole
    mirror is the device's, and later pops and frees agree with the device."""
    monkeypatch.setattr(DeferredBlockPool, "launch_every", launch_every)
    p = DeferredBlockPool(10, True, BS, device="cpu")
    dp = p.device_pool
    r = driver.request(driver.tokens_of(2)[:2 * BS])
    a = p.get_new_blocks(3)
    p.end_step()
    p.sync()
    theirs = dp.get_new_blocks(1).tolist()
    dp.cache_full_blocks(theirs, r.block_hashes, 0, 1, BS, 0)
    p.cache_full_blocks(r, a, 0, 1, BS, 0)
    p.end_step()
    p.sync()
    O.mirror_is_device(p)
    assert p.get_cached_block(r.block_hashes[0], [0]) == [p.blocks[theirs[0]]]
    c = p.get_new_blocks(3)
    p.free_blocks(a)
    p.end_step()
    p.sync()
    O.mirror_is_device(p)
    assert theirs[0] not in [x.block_id for x in c]


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_recorded_error_beside_a_disagreement_is_raised():
    """Another user pops a block (the free count moves) and then makes a batched op fail (its error
    recorded in the status word), past the adapter (``device_pool`` would see both at their calls):
    the next sync raises the disagreement with the recorded error as its cause, once; it is not
    dropped from the status word unseen."""
    from gpupool.errors import InvalidBlockIdError
    p = DeferredBlockPool(10, True, BS, device="cpu")
    dp = p._backend.pool
    a = p.get_new_blocks(2)
    p.end_step()
    p.sync()
    dp.get_new_blocks(1)
    dp.free_batched(_i32([p.num_gpu_blocks + 3]), _i32([0, 1]))
    p.free_blocks(a[:1])
    p.end_step()
    with pytest.raises(PoolError, match="free blocks.*InvalidBlockIdError") as got:
        p.sync()
    assert isinstance(got.value.__cause__, InvalidBlockIdError)
    p.sync()
    dp.check()  # taken from the status word, raised once
    O.mirror_is_device(p)


def test_recorded_error_before_a_relaunch_that_fails_is_raised():
    """Another user frees a block the adapter holds and makes a batched op fail; the adapter's free of
    that block, launched after the recorded error, did nothing, and fails when launched again (a
    double free on the device): the launch's error is raised with the other user's as its cause (the
    other user past the adapter, as above)."""
    from gpupool.errors import DoubleFreeError, InvalidBlockIdError
    p = DeferredBlockPool(6, True, BS, device="cpu")
    dp = p._backend.pool
    a = p.get_new_blocks(1)
    p.end_step()
    p.sync()
    dp.free_blocks([a[0].block_id])
    dp.free_batched(_i32([9]), _i32([0, 1]))
    p.free_blocks(a)
    p.end_step()
    with pytest.raises(DoubleFreeError) as got:
        p.sync()
    assert isinstance(got.value.__cause__, InvalidBlockIdError)
    dp.check()
    p.sync()
    O.mirror_is_device(p)


def _gen(xs):
    yield from xs


def _req(seed, n):
    return driver.request(driver.tokens_of(seed)[:n * BS])


# (a, b, o): a request's 3 blocks (the first 2 cached), 2 fresh held blocks, another pool's held block
INPUTS = {
    "free_reversed": lambda p, a, b, o: p.free_blocks(reversed(b)),
    "free_tuple": lambda p, a, b, o: p.free_blocks(tuple(b)),
    "free_generator": lambda p, a, b, o: p.free_blocks(_gen(b)),
    "free_none_inside": lambda p, a, b, o: p.free_blocks([b[0], None]),
    "free_int_inside": lambda p, a, b, o: p.free_blocks([b[0], 3]),
    "free_str": lambda p, a, b, o: p.free_blocks("ab"),
    "free_none": lambda p, a, b, o: p.free_blocks(None),
    "free_duplicate": lambda p, a, b, o: p.free_blocks([b[0], b[1], b[0]]),
    "free_other_pool": lambda p, a, b, o: p.free_blocks([b[0], o[0]]),
    "free_other_pool_twice": lambda p, a, b, o: p.free_blocks([o[0], o[0], b[0]]),
    "free_other_pool_and_int": lambda p, a, b, o: p.free_blocks([b[0], o[0], 5]),
    "free_nulls": lambda p, a, b, o: p.free_blocks([p.null_block, b[0], p.null_block]),
    "free_a_free_block": lambda p, a, b, o: p.free_blocks([b[0], p.blocks[7]]),
    "touch_reversed": lambda p, a, b, o: p.touch(reversed(a)),
    "touch_generator": lambda p, a, b, o: p.touch(_gen(a)),
    "touch_none_inside": lambda p, a, b, o: p.touch([a[0], None]),
    "touch_str": lambda p, a, b, o: p.touch("x"),
    "touch_other_pool": lambda p, a, b, o: p.touch([a[0], o[0]]),
    "touch_duplicate": lambda p, a, b, o: p.touch([a[0], a[0], p.null_block]),
    "touch_a_free_block_twice": lambda p, a, b, o: p.touch([p.blocks[7], p.blocks[7]]),
    "cache_tuple": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), tuple(b), 0, 2, BS, 0),
    "cache_generator": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), _gen(b), 0, 2, BS, 0),
    "cache_int_inside": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), [b[0], 4], 0, 2, BS, 0),
    "cache_other_pool": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), [b[0], o[0]], 0, 2, BS, 0),
    "cache_duplicate": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), [b[0], b[0]], 0, 2, BS, 0),
    "cache_null": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), [b[0], p.null_block], 0, 2, BS, 0),
    "cache_a_keyed_block": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), [b[0], a[0]], 0, 2, BS, 0),
    "cache_too_few_hashes": lambda p, a, b, o: p.cache_full_blocks(_req(2, 1), b, 0, 2, BS, 0),
    "cache_group_out_of_range": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), b, 0, 2, BS, 2**40),
    "cache_half_block_size": lambda p, a, b, o: p.cache_full_blocks(_req(2, 2), b, 0, 2, BS // 2, 0),
    "cache_after_cached": lambda p, a, b, o: p.cache_full_blocks(_req(1, 4), a[:2] + b, 2, 4, BS, 0),
}


def host_state(p) -> dict:
    """What an error must leave unchanged on the host (the fast path's queue copy and placeholders too;
    a synchronisation on the error's path may check the blocks changed since the last one)."""
    out = dict(ref=list(p._ref), keys=list(p._keys), ntok=list(p._ntok), num_free=p._engine.num_free,
               holders={k: dict(v) for k, v in p.mirror.holders.items()})
    if isinstance(p, DeferredBlockPool):
        out.update(queue=None if p.queue_copy.ids is None else list(p.queue_copy.ids), pending=len(p._engine.pending))
    return out


def run_input(p, other, case):
    a = p.get_new_blocks(3)
    p.cache_full_blocks(_req(1, 3), a, 0, 2, BS, 0)
    b = p.get_new_blocks(2)
    o = other.get_new_blocks(1)
    before = host_state(p)
    try:
        INPUTS[case](p, a, b, o)
        outcome = "ok"
    except (PoolError, AssertionError) as e:
        outcome = type(e).__name__
        assert host_state(p) == before
    return outcome, state(p), other.blocks[o[0].block_id].ref_cnt


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_inputs_as_the_per_call_pool(case):
    """Over the reference backend (each case's device launches are those of the cases above)."""
    got = [run_input(p, type(p)(4, True, BS, backend="reference"), case) for p in pools(8, "reference")]
    assert got[0] == got[1]


@pytest.mark.slow  # 31 cases, about 25 s
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_inputs_as_the_per_call_pool_device(case):
    got = []
    for p in pools(8, "device"):
        got.append(run_input(p, type(p)(4, True, BS, device="cpu"), case))
        if isinstance(p, DeferredBlockPool):
            O.mirror_is_device(p)
    assert got[0] == got[1]


def other_user(p, op, reqs, theirs) -> None:
    """One op of another user of ``p.device_pool`` (``theirs``: the blocks it holds)."""
    kind, dp = op[0], p.device_pool
    held = []
    if reqs and kind in ("o_touchfree", "o_key"):
        held = [b.block_id for b in reqs[op[1] % len(reqs)]["blocks"] if not b.is_null and b.ref_cnt > 0
                and (kind == "o_touchfree" or b.block_hash is None)]
    if kind == "o_touchfree" and held:  # a touch and a free of the adapter's held blocks: nothing changes
        dp.touch_batched(_i32(held))
        dp.free_batched(_i32(held), _i32([0, len(held)]))
    elif kind == "o_key" and held:  # keys a block the adapter holds
        dp.cache_full_blocks(held[:1], driver.chain(driver.tokens_of(op[2])), 0, 1, BS, 0)
    elif kind == "o_pop" and dp.get_num_free_blocks() > 0:
        theirs += dp.get_new_blocks(1).tolist()
        if op[1]:
            dp.cache_full_blocks(theirs[-1:], driver.chain(driver.tokens_of(op[2])), 0, 1, BS, 0)
    elif kind == "o_free" and theirs:
        dp.free_blocks([theirs.pop(0)])
    elif kind == "o_rec":
        dp.free_batched(_i32([p.num_gpu_blocks + 3]), _i32([0, 1]))  # fails: its error recorded


OTHER = st.one_of(st.tuples(st.just("o_touchfree"), O.R), st.tuples(st.just("o_pop"), st.booleans(), O.SEED),
                  st.tuples(st.just("o_free")), st.tuples(st.just("o_key"), O.R, O.SEED), st.tuples(st.just("o_rec")))
OPS = st.one_of(O.BATCH_OPS, OTHER, st.tuples(st.just("end_step")), st.tuples(st.just("sync")))


@pytest.mark.slow  # 30 examples, about 16 s
@settings(max_examples=max(30, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=30), n=st.sampled_from([6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=st.tuples(st.sampled_from([1, 2, 4, 7]), st.sampled_from([1, 3, 1024])))
def test_other_users_leave_the_mirror_the_devices(ops, n, window, launch):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_path, "FREE_WINDOW", window)
        mp.setattr(DeferredBlockPool, "launch_every", launch[0])
        mp.setattr(DeferredBlockPool, "launch_ops", launch[1])
        p = DeferredBlockPool(n, True, BS, device="cpu")
        reqs, seen, theirs = [], [], []
        for op in ops:
            try:
                if op[0] == "end_step":
                    p.end_step()
                elif op[0] == "sync":
                    p.sync()
                elif op[0].startswith("o_"):
                    other_user(p, op, reqs, theirs)
                else:
                    O.apply_op(p, op, reqs, seen)
            except PoolError:  # what a synchronisation found (another user's doing), or a refused op
                pass
        for _ in range(2):  # the first may raise what it finds
            try:
                p.sync("final", window=True)
                break
            except PoolError:
                pass
        O.mirror_is_device(p)
