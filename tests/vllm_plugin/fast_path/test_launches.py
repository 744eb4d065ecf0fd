"""How the fast path (``gpupool.vllm.fast_path.DeferredBlockPool``, docs/algorithms.md section 8)
launches its ops on the device pool.

* the core op: ``cache_full_blocks_batched`` over device ids leaves the state ``cache_full_blocks``
  leaves, and records a bad id in the status word (raised by ``check()``, nothing changed);
* batching (device backend): the ops between launches run as one flush, round after round (free,
  touch, pop, cache); each rule that starts a new round pinned on a sequence, and a decode step of 32
  requests is one flush (one ``apply_predicted`` launch) where the per-call adapter makes 66 ops;
* cadence: ``end_step`` launches every few steps, or at once for a big batch;
* placement: every device call of both adapters runs on the pool's stream."""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool import BlockPool as DevicePool, tensors  # noqa: E402
from gpupool.errors import InvalidBlockIdError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import D2H as _D2H  # noqa: E402

N = 10

BS = driver.BLOCK_SIZE


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
