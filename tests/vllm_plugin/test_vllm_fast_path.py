"""``gpupool.vllm.fast_path.DeferredBlockPool`` (docs/vllm.md, "The fast path") and the core op it
needs, ``gpupool.BlockPool.cache_full_blocks_batched``.

* differential: random op lists (allocate with caching, cache, free, prefix hit + touch, evict,
  ``ref_cnt += 1``, reset) applied to the per-call adapter and to the deferred one with NO read in
  between (so ops pile up between synchronisations): every answer the caller reads while the ops
  run (free counts, ref counts and hashes of hit blocks, lookups) and, at the end, every block id
  handed out, the whole mirror and the device state are equal; over the reference backend
  (many lists) and the device pool (Triton's interpreter, few);
* synchronisations: a batch of allocations, caches, touches and frees costs no device-to-host
  transfer (counted by patching torch.Tensor's readers), ids included; ``sync()`` is one and checks
  the host's claims (a corrupted copy of the free queue is caught); a pop past the copy hands out
  placeholders and dirties the mirror; ``end_step`` refills the copy and verifies on schedule;
* errors: a double free raises gpupool's DoubleFreeError with the pool unchanged; get_new_blocks past
  the free count raises OutOfBlocksError at the call;
* the core op: ``cache_full_blocks_batched`` over device ids leaves the state ``cache_full_blocks``
  leaves, and records a bad id in the status word (raised by ``check()``, nothing changed);
* batching (device backend): the ops between launches run as one flush, round after round (free,
  touch, pop, cache); each rule that starts a new round pinned on a sequence, and a decode step of 32
  requests is one flush (one ``apply_batched`` launch, two copies) where the per-call adapter makes
  66 ops;
* errors and placement: a bad caching raises at the call; every device call runs on the pool's stream.
"""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool import BlockPool as DevicePool  # noqa: E402
from gpupool import tensors  # noqa: E402
from gpupool.errors import DoubleFreeError, InvalidBlockIdError, OutOfBlocksError, PoolError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import DRIVER_OPS as OPS  # noqa: E402
from harness.vllm_ops import D2H as _D2H  # noqa: E402

N = 10
BS = driver.BLOCK_SIZE

def lazy_run(pool, ops):
    """Apply ``ops`` (tests/vllm_plugin/conformance/driver.py's) reading only what vLLM's scheduler reads
    while deciding: the free count, and the ref counts and hashes of prefix hits; the ids of the blocks
    handed out are read at the end. Returns (answers while running, every handed-out block's id)."""
    reqs, seen, handed = [], [], []
    for op in ops:
        result = driver._apply(pool, op, reqs, N, ids=False)
        if op[0] in ("alloc", "hit") and result is not None:
            handed.append(result)
            if op[0] == "hit":  # vLLM's evictable count reads these
                seen.append([(b.ref_cnt, b.block_hash) for b in result])
        elif op[0] == "reset":
            seen.append(result)
        seen.append(pool.get_num_free_blocks())
    return seen, [[b.block_id for b in bl] for bl in handed]


def _check_same(ops, caching, backend):
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    per_call = BlockPool(N, caching, BS, **kw)
    deferred = DeferredBlockPool(N, caching, BS, **kw)
    assert deferred.deferred
    assert lazy_run(per_call, ops) == lazy_run(deferred, ops)
    deferred.sync()
    assert not deferred._engine.pending and not any(isinstance(b, PendingBlock) and b._s >= N for b in deferred.blocks)
    assert driver.snapshot(per_call) == driver.snapshot(deferred)  # ref counts, keys, queue order, key map
    assert deferred._ref == per_call._ref and deferred._keys == per_call._keys and deferred._ntok == per_call._ntok
    assert all(b.block_id == i for i, b in enumerate(deferred.blocks))
    if backend == "device":
        deferred.device_pool.validate()
        assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
        assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()
    return deferred


@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=24), caching=st.booleans())
def test_deferred_equals_per_call_reference(ops, caching):
    _check_same(ops, caching, "reference")


@settings(max_examples=8, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=16), caching=st.just(True))
@pytest.mark.heavy
def test_deferred_equals_per_call_device(ops, caching):
    _check_same(ops, caching, "device")


@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=24), caching=st.booleans(), window=st.sampled_from([1, 2, 3, 5]))
def test_deferred_equals_per_call_small_window(ops, caching, window):
    """The same with the host's copy of the free queue cut to a few ring slots: refills before pops,
    placeholders past the copy, the dirty mirror, copies that are not the whole queue (keyed frees past
    them), all on random op lists."""
    from unittest import mock

    from gpupool.vllm import fast_path
    with mock.patch.object(fast_path, "FREE_WINDOW", window):
        _check_same(ops, caching, "reference")


def test_no_transfer_per_batch(monkeypatch):
    """Requests allocated, cached, hit and freed cost no device read: every answer, the ids included,
    comes from the host (its copy of the free queue), the blocks handed out are the canonical proxies;
    ``sync()`` afterwards is ONE transfer and confirms every claim; the result equals the per-call pool's."""
    pool = DeferredBlockPool(16, True, BS, device="cpu")
    ref = BlockPool(16, True, BS, device="cpu")
    d2h = _D2H(monkeypatch)
    outs = []
    for p in (pool, ref):
        a = p.get_new_blocks(3)
        ra = driver.request(driver.tokens_of(5)[: 3 * BS])
        p.cache_full_blocks(ra, a, 0, 3, BS, 0)
        hit = p.get_cached_block(ra.block_hashes[0], [0])
        p.touch(hit)
        b = p.get_new_blocks(2)
        p.free_blocks(list(reversed(a)))
        p.free_blocks(hit)
        c = p.get_new_blocks(1)  # the queue's head: none of a (keyed, at the back)
        outs.append((a, b, hit, c))
        if p is pool:
            ids = [blk.block_id for blk in a + b + c]
            # three rounds (_cut): the hit touches a block popped in the first, then a is freed while
            # touched in the second; nothing launched yet
            assert d2h.n == 0 and pool.syncs == {} and pool.flushes == 0 and pool._backend.batch.rounds == 3
            assert all(pool.blocks[i] is blk for i, blk in zip(ids, a + b + c)) and hit[0] is a[0]
            assert pool.get_num_free_blocks() == 16 - 1 - 3 and a[1].ref_cnt == 0 and a[0].block_hash is not None
            pool.end_step()  # a small batch: launched at the launch_every-th step
            assert d2h.n == 0 and pool.flushes == 0
            for _ in range(pool.launch_every - 1):
                pool.end_step()  # launches the batch, one launch; the copy holds the whole queue: no refill
            assert d2h.n == 0 and pool.flushes == 1
            pool.sync()
            assert d2h.n == 1 and dict(pool.syncs) == {"sync": 1}
    assert [[x.block_id for x in blks] for blks in outs[0]] == [[x.block_id for x in blks] for blks in outs[1]]
    assert driver.snapshot(pool) == driver.snapshot(ref)
    pool.device_pool.validate()


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


def test_dirty_mirror_syncs_only_for_free_blocks(monkeypatch):
    """A pop past the host's copy of the queue (here a window of 2) hands out placeholders, and may
    evict keys: a lookup that would answer a free block synchronises first (and gets the device's
    answer); a miss or a held block does not."""
    from gpupool.vllm import fast_path
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    pool = DeferredBlockPool(8, True, BS, backend="reference")
    r = driver.request(driver.tokens_of(3)[: 4 * BS])
    a = pool.get_new_blocks(4)  # past the copy even after a refill: placeholders
    assert dict(pool.syncs) == {"free_queue": 1} and isinstance(a[0], PendingBlock) and a[0]._s >= 8
    pool.cache_full_blocks(r, a, 0, 4, BS, 0)
    held = pool.get_new_blocks(1)
    pool.free_blocks(list(reversed(a)))  # 4 keyed blocks at the back, 2 un-keyed in front
    pool.sync()
    assert len(pool.queue_copy.ids) == 2
    pool.syncs.clear()
    pool.get_new_blocks(3)  # 2 un-keyed + the first keyed one (a[3], freed first): past the copy, dirty
    assert pool._engine.dirty and dict(pool.syncs) == {"free_queue": 1}
    assert pool.get_cached_block(b"\x00" * 32, [0]) is None and dict(pool.syncs) == {"free_queue": 1}  # a miss
    assert held[0].ref_cnt == 1 and dict(pool.syncs) == {"free_queue": 1}  # a held block: exact
    assert pool.get_cached_block(r.block_hashes[3], [0]) is None  # a[3] was evicted by the pop
    assert dict(pool.syncs) == {"free_queue": 1, "get_one_block": 1} and not pool._engine.dirty


def test_end_step_refills_and_verifies(monkeypatch):
    """``end_step`` launches the batch; it synchronises when the host's copy of the queue fell below
    half of its last refill (and is not the whole queue), or when ``verify_every`` steps passed with
    ops to check, and not otherwise."""
    from gpupool.vllm import fast_path
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 8)
    pool = DeferredBlockPool(20, True, BS, backend="reference")
    assert len(pool.queue_copy.ids) == 8 and pool.queue_copy.low_mark == 4
    pool.get_new_blocks(4)
    pool.end_step()
    assert pool.syncs == {} and len(pool.queue_copy.ids) == 4
    pool.get_new_blocks(1)
    pool.end_step()  # 3 < 4 and 14 free: refill
    assert dict(pool.syncs) == {"end_step": 1} and list(pool.queue_copy.ids) == list(range(6, 14))
    pool.verify_every = 3
    got = pool.get_new_blocks(1)
    pool.free_blocks(got)  # back at the front: the copy is unchanged
    pool.end_step()
    pool.end_step()
    assert dict(pool.syncs) == {"end_step": 1} and list(pool.queue_copy.ids) == list(range(6, 14))
    pool.end_step()  # the third step since the last synchronisation: verify
    assert dict(pool.syncs) == {"end_step": 2}
    for step in range(4):
        pool.end_step()  # nothing to check: no synchronisation
    assert dict(pool.syncs) == {"end_step": 2}
    pool.get_new_blocks(len(pool.queue_copy.ids))  # empties the copy (not the queue): the next pop refills first
    pool.get_new_blocks(1)
    assert dict(pool.syncs) == {"end_step": 2, "free_queue": 1}


def test_errors_leave_the_pool_unchanged():
    pool = DeferredBlockPool(4, True, BS, device="cpu")
    b = pool.get_new_blocks(2)
    with pytest.raises(OutOfBlocksError):
        pool.get_new_blocks(2)
    pool.free_blocks([b[0]])
    before = driver.snapshot(pool)
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([b[1], b[0]])
    assert driver.snapshot(pool) == before
    pool.device_pool.validate()


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


def test_cache_full_blocks_batched_equals_cache_full_blocks():
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    pools = [DevicePool(8, max_keys_per_block=4, device="cpu") for _ in range(2)]
    for p in pools:
        p.get_new_blocks(1)  # block 1 held: the ids below are 2, 3, 4
    got = pools[1].allocate_batched(torch.tensor([3], dtype=torch.int32))[0]
    ids = pools[0].get_new_blocks(3).tolist()
    pools[0].cache_full_blocks([0] + ids, hashes, 1, 4, 16, 0)
    pools[1].cache_full_blocks_batched(torch.cat([torch.zeros(1, dtype=torch.int32), got[:3]]), hashes, 1, 4, 16, 0)
    pools[1].check()
    for p in pools:
        p.validate()
    assert [pools[0].block_keys(b) for b in range(8)] == [pools[1].block_keys(b) for b in range(8)]
    assert pools[0].ref_counts() == pools[1].ref_counts() and pools[0].free_queue() == pools[1].free_queue()
    keys = [pools[1].block_keys(b) for b in range(8)]
    pools[1].cache_full_blocks_batched(torch.tensor([0, 99], dtype=torch.int32), hashes, 1, 2, 16, 0)
    with pytest.raises(InvalidBlockIdError):
        pools[1].check()
    assert [pools[1].block_keys(b) for b in range(8)] == keys
    with pytest.raises(Exception):  # host-checked arguments raise at once
        pools[1].cache_full_blocks_batched(torch.tensor([2], dtype=torch.int64), hashes, 0, 1, 16, 0)


def test_batch_rounds_where_the_order_requires():
    """The device backend's batch (gpupool.vllm.op_batch.OpBatch) runs free, touch, pop, cache in that order, round
    after round, all rounds in ONE launch (``OpBatch.placement``): pops and cachings pile up in
    one round, and so do touches of free blocks and frees of keyed blocks after pops; a free of a
    block cached in the round, an un-keyed block freed (to the front) after a pop, and a touch or free
    of a block popped in the round start a new one. The sequence runs on the per-call pool too: same
    ids, same final state; the round counts are the ones the rules give, and the whole sequence is
    one launch."""
    pools = [DeferredBlockPool(16, True, BS, device="cpu"), BlockPool(16, True, BS, device="cpu")]
    got = []
    for p in pools:
        ra, rb, rc = (driver.request(driver.tokens_of(i)[: 2 * BS]) for i in (1, 2, 3))
        flushes = []

        def mark():  # rounds so far
            flushes.append(p._backend.batch.rounds - p._backend.batch.round_empty() - 1 if isinstance(p, DeferredBlockPool) else 0)
        a = p.get_new_blocks(2)
        p.cache_full_blocks(ra, a, 0, 2, BS, 0)
        b = p.get_new_blocks(2)
        p.cache_full_blocks(rb, b, 0, 1, BS, 0)
        d = p.get_new_blocks(1)
        mark()  # 0: pops and cachings, one batch
        p.free_blocks(list(reversed(a)))
        mark()  # 1: a free after a pop (of blocks cached in the batch, too)
        hit = [p.get_cached_block(hh, [0])[0] for hh in ra.block_hashes[:2]]
        p.touch(hit[:1])
        c = p.get_new_blocks(1)
        mark()  # 1: the touch and the pop join the free
        p.touch(hit[1:])
        mark()  # 1: a touch of a free block after a pop: same batch
        p.free_blocks(d)
        mark()  # 2: an un-keyed block freed (to the front) after a pop
        e = p.get_new_blocks(1)
        p.free_blocks(b[:1])
        mark()  # 2: a keyed block freed (to the back) after a pop: same batch
        p.free_blocks(b[1:])
        mark()  # 3: an un-keyed block freed after a pop
        ids = [x.block_id for x in a + b + d + hit + c + e]
        mark()  # 3: the ids are known on the host: no synchronisation, no new round
        x = p.get_new_blocks(1)
        ids.append(x[0].block_id)
        p.cache_full_blocks(rb, b[:1] + x, 1, 2, BS, 0)
        p.free_blocks(x)
        mark()  # 4: a free of a block cached (and popped) in the batch
        y = p.get_new_blocks(1)
        p.touch(y)
        mark()  # 5: a touch of a block popped in the batch
        p.free_blocks(y)
        p.free_blocks(y)
        mark()  # 6: a free of a block touched in the batch
        ids.append(y[0].block_id)
        if isinstance(p, DeferredBlockPool):
            assert p.syncs == {}
            assert p.flushes == 0
            p.sync()  # 7
            assert flushes == [0, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6] and p.flushes == 1, (flushes, p.flushes)
            p.device_pool.validate()
        got.append((ids, driver.snapshot(p)))
    assert got[0] == got[1]


@pytest.mark.heavy
def test_a_decode_step_is_one_flush():
    """vLLM's decode step over 32 running requests, each crossing into a new block (``get_new_blocks(1)``)
    and caching the block it filled (``cache_full_blocks``), after the frees of 2 finished requests:
    one flush at ``end_step``, ONE ``apply_predicted`` launch with one host-to-device copy and no
    synchronisation, where the per-call adapter launches 66 ops; ids and state equal."""
    n, nreq = 80, 32
    pools = [DeferredBlockPool(n, True, BS, device="cpu"), BlockPool(n, True, BS, device="cpu")]
    pools[0].launch_every = 1  # each step's batch launched at its end_step
    got = []
    for p in pools:
        reqs = [driver.request(driver.tokens_of(i)[: 2 * BS]) for i in range(nreq + 2)]
        rows = [p.get_new_blocks(1) for _ in reqs]
        [blk.block_id for row in rows for blk in row]
        p.end_step()  # the step before (launched)
        if isinstance(p, DeferredBlockPool):
            flushes0 = p.flushes
            counts = {}
            dev = p._dev
            for name in ("apply_predicted", "apply_batched", "allocate_batched", "free_batched", "touch_batched",
                         "cache_blocks_batched", "_tensor"):
                def counted(*a, _f=getattr(dev, name), _n=name, **k):
                    counts[_n] = counts.get(_n, 0) + 1
                    return _f(*a, **k)
                setattr(dev, name, counted)
            packed = tensors.to_device_packed

            def counted_packed(*a, **k):
                counts["to_device_packed"] = counts.get("to_device_packed", 0) + 1
                return packed(*a, **k)
            tensors.to_device_packed = counted_packed
        for row in rows[nreq:]:  # update_from_output: two requests finished
            p.free_blocks(list(reversed(row)))
        for r, row in zip(reqs, rows[:nreq]):  # schedule(): allocate_slots per running request
            row += p.get_new_blocks(1)
            p.cache_full_blocks(r, row, 0, 1, BS, 0)
        ids = [[blk.block_id for blk in row] for row in rows[:nreq]]
        try:
            p.end_step()  # GpuPoolScheduler's, after schedule(): launches the step's batch
        finally:
            if isinstance(p, DeferredBlockPool):
                tensors.to_device_packed = packed
        if isinstance(p, DeferredBlockPool):
            # ONE host-to-device copy: ids, offsets, demands, rounds, expected pops and the keys
            assert p.flushes - flushes0 == 1 and counts == {"apply_predicted": 1, "to_device_packed": 1}, \
                (p.flushes, counts)
            assert p.syncs == {}
            p.device_pool.validate()
        got.append((ids, driver.snapshot(p)))
    assert got[0] == got[1]


def test_the_free_queue_copy_is_a_window():
    """The host's copy of the free queue is read from the first ``FREE_WINDOW`` ring slots only (the
    work per refill does not grow with the pool): a fresh pool larger than the window starts with
    exactly the window; pops within it need no synchronisation, one past it refills the copy first
    (one synchronisation, the rest of the queue now whole), and the ids match the per-call pool's."""
    from gpupool.vllm.fast_path import FREE_WINDOW
    n = FREE_WINDOW + 64
    pool, ref = DeferredBlockPool(n, True, BS, device="cpu"), BlockPool(n, True, BS, device="cpu")
    assert list(pool.queue_copy.ids) == list(range(1, FREE_WINDOW + 1))
    a = pool.get_new_blocks(FREE_WINDOW - 1)
    assert pool.syncs == {} and not pool._engine.dirty
    b = pool.get_new_blocks(2)
    assert dict(pool.syncs) == {"free_queue": 1} and not pool._engine.dirty
    want = ref.get_new_blocks(FREE_WINDOW - 1) + ref.get_new_blocks(2)
    assert [x.block_id for x in a + b] == [x.block_id for x in want]
    assert len(pool.queue_copy.ids) == pool.get_num_free_blocks() == n - 1 - (FREE_WINDOW + 1)
    pool.sync()
    pool.device_pool.validate()


@pytest.mark.parametrize("cls", [BlockPool, DeferredBlockPool])
def test_device_work_runs_on_the_pool_stream(monkeypatch, cls):
    """On CUDA the adapter runs every device call on its own stream (``BlockPool.stream``): with a
    stand-in stream and ``torch.cuda.stream`` recording the depth, a random op list (ops, reads,
    synchronisations, the free-queue view) calls the device pool only inside the stream's context,
    for both the per-call and the deferred pool. (Without a GPU the real stream is not exercised.)"""
    import contextlib

    depth = [0]
    outside = []

    @contextlib.contextmanager
    def stream(s):
        assert s is pool.stream
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1
    monkeypatch.setattr(torch.cuda, "stream", stream)
    pool = cls(N, True, BS, device="cpu")
    pool._backend.stream = object()  # the engine's and the adapter's stream: the backend's

    class Watch:
        def __init__(self, dev):
            self._d = dev

        def __getattr__(self, name):
            v = getattr(self._d, name)
            if callable(v):
                def f(*a, **k):
                    if depth[0] == 0:
                        outside.append(name)
                    return v(*a, **k)
                return f
            if depth[0] == 0 and name == "state":
                outside.append(name)
            return v
    pool._engine.backend.pool = Watch(pool._dev)
    ops = [("alloc", 3, 1, 2), ("alloc", 2, 2, 0), ("hit", 1), ("cow", 1), ("free", 0), ("alloc", 4, 1, 4),
           ("free", 1), ("hit", 1), ("evict", 3, 4), ("free", 0), ("reset",)]
    reqs = []
    for op in ops:
        driver._apply(pool, op, reqs, N, ids=False)
        for r in reqs:  # what vLLM reads: ids, ref counts, hashes (synchronising where it must)
            [(b.block_id, b.ref_cnt, b.block_hash) for b in r["blocks"]]
        pool.end_step()
    assert list(pool.free_block_queue) and pool.get_num_free_blocks() > 0
    if cls is DeferredBlockPool:
        pool.sync("end", window=True)
        assert pool.flushes > 0
    assert depth[0] == 0 and outside == [], outside


def test_a_bad_caching_raises_at_the_call():
    """A ``cache_full_blocks`` the device would refuse (a hash that is not bytes, a negative group) raises
    at the call with the per-call pool's error and changes nothing, so the batch's flush cannot fail on
    it; the pools stay equal after more ops and the flush."""
    pools = [BlockPool(8, True, BS, device="cpu"), DeferredBlockPool(8, True, BS, device="cpu")]
    errors, states = [], []
    for p in pools:
        a = p.get_new_blocks(2)
        good = driver.request(driver.tokens_of(1)[: 2 * BS])
        bad = driver.request(driver.tokens_of(1)[: 2 * BS])
        bad.block_hashes = [bad.block_hashes[0], "not bytes"]
        got = []
        for args in ((bad, a, 0, 2, BS, 0), (good, a, 0, 2, BS, -1)):
            with pytest.raises(PoolError) as e:
                p.cache_full_blocks(*args)
            got.append(type(e.value).__name__)
        errors.append(got)
        p.cache_full_blocks(good, a, 0, 1, BS, 0)
        p.free_blocks(list(reversed(a)))
        p.end_step()
        b = p.get_new_blocks(3)
        states.append(([x.block_id for x in b], driver.snapshot(p)))
        p.device_pool.validate()
    assert errors[0] == errors[1] and states[0] == states[1]


def test_end_step_launches_every_few_steps_or_a_big_batch(monkeypatch):
    """``end_step`` launches every ``launch_every`` steps, or at once when the batch names
    ``launch_ops`` block ids; a synchronisation in between launches first, so the device has run every
    op it checks; no device read on the way."""
    pool = DeferredBlockPool(64, True, BS, device="cpu")
    d2h = _D2H(monkeypatch)
    pool.launch_every, pool.launch_ops = 3, 8
    launched = []
    for step in range(7):
        pool.get_new_blocks(1)
        pool.end_step()
        launched.append(pool.flushes)
    assert launched == [0, 0, 1, 1, 1, 2, 2] and d2h.n == 0
    pool.get_new_blocks(8)  # 9 ids queued: past launch_ops
    pool.end_step()
    assert pool.flushes == 3 and pool._backend.batch.size == 0
    pool.get_new_blocks(2)
    pool.sync()  # launches the 2 pops first: the device agrees with the host
    assert pool.flushes == 4 and d2h.n == 1 and pool.get_num_free_blocks() == 63 - 7 - 8 - 2
    pool.device_pool.validate()
