"""The device checks the fast path's claims (``gpupool.vllm.fast_path.DeferredBlockPool``,
docs/algorithms.md section 8): nothing the host answered is kept unless the device ran it.

* a corrupted host copy of the free queue is caught at the next synchronisation; reuse watchers fire
  at the pop that hands their block out again;
* a release the host cannot confirm (a block of ref 0 on the host, which a placeholder's pop took on
  the device) synchronises and then frees the blocks the binding names, as the per-call pool does
  (not the placeholders' old slots, and not the null block, which is skipped);
* another user of the device pool that keys a block the adapter holds or pops and keys its own
  block: after the next synchronisation every row of the mirror is the device's (ref counts, keys,
  the holder a lookup answers), whatever launch cadence, and later ops agree with it; an error
  recorded past the adapter beside a disagreement, or before a relaunch that fails, is raised with it
  (as its cause), not dropped; slow: random op lists mixed with such other users' ops, any launch
  cadence: after the synchronisations, the mirror is the device's;
* an error recorded in the status word that the host did not predict: the launches it made do
  nothing are launched again at the next synchronisation, which then raises it with the mirror
  exact, so no block is handed out twice (the scenario as found, and a differential run with such
  errors recorded at random points against the per-call adapter without them)."""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import InvalidBlockIdError, PoolError  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402

BS = driver.BLOCK_SIZE


@pytest.mark.parametrize("backend", ["reference", "device"])
def test_a_wrong_prediction_is_caught(backend):
    """The host's ids are claims the pool checks: with the host's copy of the queue corrupted (two ids
    swapped), the reference pool is seen to differ at the call (nothing taken: the mirror and the
    copy read again, then the pool's head handed out, as the per-call pool); the device's pops are
    read back at the next synchronisation and compared on the host (PoolError); either way the copy
    is then the device's again."""
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    pool = DeferredBlockPool(8, True, BS, **kw)
    first = list(pool.queue_copy.ids)
    pool.queue_copy.ids = type(pool.queue_copy.ids).fromkeys([first[1], first[0]] + first[2:])
    if backend == "reference":
        assert [b.block_id for b in pool.get_new_blocks(1)] == first[:1]
    else:
        with pytest.raises(PoolError, match="pop"):
            pool.get_new_blocks(1)
            pool.sync()
    pool.sync("again", window=True)
    assert list(pool.queue_copy.ids) == pool.device_pool.free_queue()[: len(pool.queue_copy.ids)]


@pytest.mark.parametrize("backend", ["reference", "device"])
def test_reuse_watchers_fire_at_the_pop(backend):
    """After ``unpin_blocks`` a pop runs per call, so the reuse callback fires inside
    ``get_new_blocks`` (vLLM's timing), not at a later synchronisation."""
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    pool = DeferredBlockPool(4, True, BS, **kw)
    a = pool.get_new_blocks(3)
    reused = []
    pool.unpin_blocks(a[:1], reused.append)
    got = pool.get_new_blocks(1)
    assert reused == [pool.blocks[a[0].block_id]] and got[0].block_id == a[0].block_id
    with pytest.raises(PoolError):
        pool.get_new_blocks(-1)


BACKENDS = ["reference", "device"]



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_null", [False, True])
def test_free_of_a_block_a_placeholder_took(monkeypatch, backend, with_null):
    """A pop past the host's copy of the queue (placeholders), then a free naming a block the host
    has at ref 0 that the pop took (a stale reference), beside a placeholder or the null block."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 1)
    out = []
    for p in O.adapter_pair(6, backend):
        got = p.get_new_blocks(3)
        assert isinstance(got[0], PendingBlock) == isinstance(p, DeferredBlockPool)
        first = p.null_block if with_null else got[0]
        p.free_blocks([first, p.blocks[2]])
        out.append(([b.block_id for b in got], O.synced_snapshot(p)))
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

OTHER_USER_OPS = st.one_of(O.BATCH_OPS, OTHER, st.tuples(st.just("end_step")), st.tuples(st.just("sync")))


@pytest.mark.slow  # 30 examples, about 16 s
@settings(max_examples=max(30, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OTHER_USER_OPS, min_size=4, max_size=30), n=st.sampled_from([6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=st.tuples(st.sampled_from([1, 2, 4, 7]), st.sampled_from([1, 3, 1024])))
def test_other_users_leave_the_mirror_the_devices(ops, n, window, launch):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_path, "FREE_WINDOW", window)
        mp.setattr(DeferredBlockPool, "launch_every", launch[0])
        mp.setattr(DeferredBlockPool, "launch_ops", launch[1])
        p = DeferredBlockPool(n, True, BS, device="cpu")
        # a PoolError raised (what a synchronisation found, another user's doing, or a refused op) is kept
        # as an answer and the ops go on
        O.run_mixed(p, ops, other_user, [], [], [])
        for _ in range(2):  # the first may raise what it finds
            try:
                p.sync("final", window=True)
                break
            except PoolError:
                pass
        O.mirror_is_device(p)


def record_error(pool) -> None:
    """A batched op that fails on the device (an id out of range), made on the pool past the adapter
    (``device_pool`` would raise it at the call): its error recorded in the status word, nothing changed."""
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    pool._backend.pool.free_batched(i32([pool.num_gpu_blocks + 3]), i32([0, 1]))


def test_no_block_handed_out_twice():
    p = DeferredBlockPool(16, True, BS, device="cpu")
    record_error(p)
    a = p.get_new_blocks(2)
    p.end_step()  # launched after the recorded error: did nothing on the device
    with pytest.raises(InvalidBlockIdError):
        p.sync()  # launched again, then the recorded error raised, once
    p.sync()
    b = p.get_new_blocks(2)
    p.sync()
    ids_a, ids_b = [x.block_id for x in a], [x.block_id for x in b]
    assert not set(ids_a) & set(ids_b), (ids_a, ids_b)
    assert [p.device_pool.ref_counts()[i] for i in ids_a + ids_b] == [1] * 4
    assert p._ref[:16] == p.device_pool.ref_counts()
    p.device_pool.validate()


def test_placeholders_and_cachings_are_launched_again(monkeypatch):
    """Pops past the host's copy of the queue (placeholders) and a caching of them, launched after the
    recorded error: launched again, bound to the same blocks as the per-call pool's."""
    from gpupool.vllm import fast_path
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    out = []
    for p in (BlockPool(12, True, BS, device="cpu"), DeferredBlockPool(12, True, BS, device="cpu")):
        r = driver.request(driver.tokens_of(1)[:4 * BS])
        first = p.get_new_blocks(1)
        p.end_step()
        blocks = first + p.get_new_blocks(3)  # deferred: placeholders
        if isinstance(p, DeferredBlockPool):
            record_error(p)
        p.cache_full_blocks(r, blocks, 0, 4, BS, 0)
        if isinstance(p, DeferredBlockPool):
            with pytest.raises(InvalidBlockIdError):
                p.sync()
        out.append(([b.block_id for b in blocks], driver.snapshot(p)))
    assert out[0] == out[1]


RECORDED = st.tuples(st.just("recorded"))

RECORDED_OPS = st.one_of(O.BATCH_OPS, RECORDED, RECORDED, st.tuples(st.just("end_step")))


def _run(pool, ops):
    reqs, seen = [], []
    for op in ops:
        if op[0] == "end_step":
            pool.end_step()
        elif op[0] == "recorded":
            if isinstance(pool, DeferredBlockPool):  # the per-call pool never sees it
                record_error(pool)
                try:
                    pool.sync()
                except InvalidBlockIdError:
                    continue
                with pytest.raises(InvalidBlockIdError):  # nothing to synchronise: still recorded
                    pool._backend.pool.check()
        else:
            O.apply_op(pool, op, reqs, seen)
    return [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s
            for s in seen]


@settings(max_examples=min(8, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(RECORDED_OPS, min_size=4, max_size=24), n=st.sampled_from([6, 12]))
def test_recorded_errors_lose_nothing(ops, n):
    per_call = BlockPool(n, True, BS, device="cpu")
    deferred = DeferredBlockPool(n, True, BS, device="cpu")
    assert _run(per_call, ops) == _run(deferred, ops)
    deferred.sync()
    assert driver.snapshot(per_call) == driver.snapshot(deferred)
    assert (deferred._ref, deferred._keys, deferred._ntok) == (per_call._ref, per_call._keys, per_call._ntok)
    deferred.device_pool.validate()
    assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
    assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()
