"""What the fast path (``gpupool.vllm.fast_path.DeferredBlockPool``, docs/algorithms.md section 8) reads
from the device, and when: a batch of allocations, caches, touches and frees costs no device-to-host
transfer (counted by patching torch.Tensor's readers), ids included; ``sync()`` is one and checks the
host's claims; a pop past the host's copy of the free queue hands out placeholders and dirties the
mirror, after which only reads of free blocks synchronise; ``end_step`` refills the copy and verifies
on schedule; the copy is a window of the queue's first ring slots; with KV events and a metrics
collector on, the fast ops stay fast and a decode step reads no more than with them off."""
from harness.paths import CONFORMANCE
import sys

import pytest

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import D2H as _D2H  # noqa: E402

BS = driver.BLOCK_SIZE


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


def test_fast_ops_stay_fast_with_events():
    """Allocations, cachings (with a parent), hits and frees with events and metrics on: no
    synchronisation, one launch at end_step, and the events and calls vLLM's pool makes."""
    pool = DeferredBlockPool(8, True, BS, enable_kv_cache_events=True, metrics_collector=driver.MetricsLog(),
                             device="cpu")
    r = driver.request(driver.tokens_of(5)[: 3 * BS])
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(r, a, 0, 1, BS, 0)
    pool.cache_full_blocks(r, a, 1, 3, BS, 0)
    hit = pool.get_cached_block(r.block_hashes[0], [0])
    pool.touch(hit)
    pool.free_blocks(list(reversed(a)) + hit)
    b = pool.get_new_blocks(5)  # 4 un-keyed blocks, then a[2]: its key evicted
    ev = pool.take_events()
    assert [type(e).__name__ for e in ev] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert ev[1].parent_block_hash == ev[0].block_hashes[0] and ev[1].token_ids == list(r.all_token_ids[BS:])
    assert ev[2].block_hashes == [ev[1].block_hashes[1]] and b[-1] is a[2]
    calls = pool.metrics_collector.take()
    assert calls[:6] == [[k, i] for i in (1, 2, 3) for k in ("evicted", "allocated")]
    assert calls[6] == ["accessed", a[0].block_id] and len(calls) == 7 + 10
    assert dict(pool.syncs) == {} and pool.flushes == 0
    for _ in range(pool.launch_every):
        pool.end_step()
    assert pool.flushes == 1 and dict(pool.syncs) == {}


def test_decode_step_reads_no_more_with_events(monkeypatch):
    """A steady decode (32 requests, one block each crossed per step, cachings of the full ones, one
    request finishing per step) makes the same device reads per step with events and metrics on as
    with them off (sched_driver's counter: every way a tensor's values reach Python)."""
    from harness.vllm_ops import D2H as _D2H

    def steps(observed):
        kw = dict(enable_kv_cache_events=True, metrics_collector=driver.MetricsLog()) if observed else {}
        pool = DeferredBlockPool(200, True, BS, device="cpu", **kw)
        pool.launch_every = 1  # a launch per step, with events as without
        reqs = [(driver.request(driver.tokens_of(i * 7 + 1)), pool.get_new_blocks(1)) for i in range(32)]
        pool.end_step()
        pool.sync()
        d2h = _D2H(monkeypatch)
        per_step = []
        for _ in range(3):
            n0 = d2h.n
            for r, bl in reqs:  # each request crosses a block: the full one is cached
                bl += pool.get_new_blocks(1)
                pool.cache_full_blocks(r, bl, len(bl) - 2, len(bl) - 1, BS, 0)
            pool.free_blocks(list(reversed(reqs.pop()[1])))
            pool.end_step()
            per_step.append(d2h.n - n0)
            assert bool(pool.take_events()) == observed
        monkeypatch.undo()
        return per_step, pool.flushes

    off, on = steps(False), steps(True)
    assert on == off and on[1] == 4 and max(on[0]) <= 1, (on, off)  # a launch per step
