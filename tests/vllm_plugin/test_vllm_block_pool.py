"""``gpupool.vllm.BlockPool`` (vLLM 0.33's interface over gpupool's pool; docs/vllm.md).

* differential: random op lists (tests/vllm_plugin/conformance/driver.py) give the same observable trace
  (ref counts, hashes, covered tokens, free-queue order, prefix-cache map, free count, events, op
  results) over the device pool and over the reference pool, and, slow, the same as vLLM 0.33's own
  BlockPool (its released source, run in a subprocess);
* the host mirror equals the device state after every op;
* hand-written scenarios: canonical proxies, exact free orders, read-only views, errors, watchers,
  metrics.
"""
from harness.paths import CONFORMANCE
import json
import os
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import InvalidArgumentError, OutOfBlocksError, PoolError  # noqa: E402
from gpupool.vllm import BlockPool, KVCacheBlock  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import DRIVER_OPS as OPS, N, driver_trace  # noqa: E402
from harness.timeouts import scaled

def check_mirror(pool: BlockPool) -> None:
    """The host mirror equals the pool behind it: ref counts, keys (primary first), covered tokens,
    the free count and the prefix-cache map."""
    dev = pool.device_pool
    assert [b.ref_cnt for b in pool.blocks] == list(dev.ref_counts())
    for b in pool.blocks:
        keys = [k[0] + k[1].to_bytes(4, "big") for k in dev.block_keys(b.block_id)]
        assert list(pool._keys[b.block_id]) == keys
        assert b.block_hash == (keys[0] if keys else None)
        assert b.block_hash_num_tokens == dev.block_hash_num_tokens(b.block_id)
    assert pool.get_num_free_blocks() == dev.get_num_free_blocks() == len(dev.free_queue())
    assert [b.block_id for b in pool.free_block_queue] == list(dev.free_queue())
    for key, v in pool.cached_block_hash_to_block._cache.items():
        first = v if isinstance(v, KVCacheBlock) else next(iter(v.values()))
        assert dev.get_cached_block(key[:-4], [int.from_bytes(key[-4:], "big")]) == [first.block_id]


@settings(max_examples=max(3, settings().max_examples))
@given(ops=st.lists(OPS, min_size=1, max_size=12), caching=st.booleans())
def test_device_and_reference_backends_agree(ops, caching):
    dev = BlockPool(N, caching, driver.BLOCK_SIZE, enable_kv_cache_events=True, device="cpu")
    ref = BlockPool(N, caching, driver.BLOCK_SIZE, enable_kv_cache_events=True, backend="reference")
    assert driver.run(dev, ops) == driver.run(ref, ops)
    check_mirror(dev)
    dev.device_pool.validate()


def test_mirror_exact_after_every_op_kind():
    pool = BlockPool(N, True, driver.BLOCK_SIZE, enable_kv_cache_events=True, device="cpu")
    ops = [("alloc", 3, 5), ("cache", 0, 3), ("cow", 0), ("hit", 5), ("alloc", 2, 9, 1), ("cache", 2, 2),
           ("free", 0), ("evict", 1, 7), ("free", 0), ("alloc", 5, 1), ("free", 0), ("free", 0), ("reset",)]
    seen = []
    driver.run(pool, ops, after=lambda p: (check_mirror(p), seen.append(1)))
    assert len(seen) == len(ops)


def _req(tokens):
    return driver.request(tokens)


def test_free_orders_and_views():
    """vLLM's orders: un-hashed blocks freed go to the head (LIFO), hashed ones to the tail (FIFO)."""
    pool = BlockPool(8, True, 4, device="cpu")
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert [b.block_id for b in pool.free_block_queue] == list(range(1, 8))
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3] and all(b is pool.blocks[b.block_id] for b in a)
    req = _req([1] * 8 + [2] * 4)
    pool.cache_full_blocks(req, a, 0, 2, 4, 0)
    pool.free_blocks(reversed(a))  # 3 (un-hashed) to the head; 2 then 1 (hashed) to the tail
    q = pool.free_block_queue
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 4, 5, 6, 7, 2, 1]
    assert q.num_free_blocks == 7 == pool.get_num_free_blocks() == len(q)
    assert q.fake_free_list_head.next_free_block is pool.blocks[3]
    assert pool.blocks[1].next_free_block is q.fake_free_list_tail
    assert pool.blocks[2].prev_free_block is pool.blocks[7] and pool.blocks[2].next_free_block is pool.blocks[1]
    key = req.block_hashes[0] + (0).to_bytes(4, "big")
    assert pool.blocks[1].block_hash == key and pool.blocks[1].block_hash_num_tokens == 4
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [pool.blocks[2]]
    assert pool.cached_block_hash_to_block.get_one_block(key) is pool.blocks[1]
    assert pool.cached_block_hash_to_block.contain(key, 1) and len(pool.cached_block_hash_to_block) == 2
    pool.touch([pool.blocks[2], pool.null_block])  # a hit leaves the queue; the null block is skipped
    assert pool.blocks[2].ref_cnt == 1 and pool.blocks[2].prev_free_block is None
    for bad in (lambda: q.popleft(), lambda: q.remove(pool.blocks[3]), lambda: pool.cached_block_hash_to_block.pop(key, 1),
                lambda: pool.blocks[1].reset_hash()):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert pool.get_usage() == pytest.approx(1 / 7)


def test_errors_and_pool_unchanged():
    pool = BlockPool(4, True, 4, device="cpu")
    with pytest.raises(ValueError, match="Cannot get 4 free blocks") as e:
        pool.get_new_blocks(4)
    assert isinstance(e.value, OutOfBlocksError)
    b = pool.get_new_blocks(1)[0]
    before = driver.snapshot(pool)
    with pytest.raises(AssertionError) as e:  # vLLM asserts here: gpupool's error is also an AssertionError
        pool.cache_partial_block(_req([0, 0, 1, 1]), b, 3, 0, 4)
    assert isinstance(e.value, PoolError)
    with pytest.raises(AssertionError):
        pool.evict_blocks({7})
    pool.free_blocks([b])
    with pytest.raises(PoolError):  # a double free: gpupool's DoubleFreeError
        pool.free_blocks([b])
    with pytest.raises(AssertionError):  # ref_cnt may only be raised on a held block
        b.ref_cnt += 1
    other = BlockPool(4, True, 4, device="cpu")
    with pytest.raises(PoolError):
        pool.touch([other.blocks[1]])
    before["free"] = [1, 2, 3]
    before["num_free"], before["usage"] = 3, 0.0
    before["ref_cnt"] = [0, 0, 0]
    assert driver.snapshot(pool) == before
    check_mirror(pool)
    with pytest.raises(AssertionError):
        BlockPool(0, True, 4)


def test_unpin_watchers_and_metrics():
    calls = []
    mc = types.SimpleNamespace(on_block_allocated=lambda b: calls.append(("alloc", b.block_id)),
                               on_block_evicted=lambda b: calls.append(("evict", b.block_id)),
                               on_block_accessed=lambda b: calls.append(("access", b.block_id)),
                               reset=lambda: calls.append(("reset",)))
    pool = BlockPool(4, True, 4, metrics_collector=mc, device="cpu")
    a = pool.get_new_blocks(2)
    assert calls == [("evict", 1), ("alloc", 1), ("evict", 2), ("alloc", 2)]
    reused = []
    pool.unpin_blocks(a[:1], reused.append)
    assert [b.block_id for b in pool.free_block_queue] == [3, 1] and reused == []
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 1] and reused == [pool.blocks[1]]
    pool.touch([a[1]])
    assert calls[-1] == ("access", 2) and a[1].ref_cnt == 2
    pool.free_blocks(got + [a[1], a[1]])
    assert pool.reset_prefix_cache() and calls[-1] == ("reset",)
    check_mirror(pool)


def test_events_are_vllm_shaped():
    pool = BlockPool(6, True, 4, enable_kv_cache_events=True, device="cpu")
    blocks = pool.get_new_blocks(2)
    req = _req([1, 2, 3, 4, 5, 6, 7, 8])
    pool.cache_full_blocks(req, blocks, 0, 1, 4, 0)
    pool.cache_full_blocks(req, blocks, 1, 2, 4, 0)
    pool.evict_blocks({blocks[0].block_id})
    ev = pool.take_events()
    assert [type(e).__name__ for e in ev] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert ev[0].token_ids == [1, 2, 3, 4] and ev[0].parent_block_hash is None and ev[0].block_size == 4
    assert ev[1].token_ids == [5, 6, 7, 8] and ev[1].parent_block_hash == ev[0].block_hashes[0]
    assert ev[2].block_hashes == ev[0].block_hashes and ev[2].medium == "GPU" and pool.take_events() == []


def test_gpupool_vllm_imports_without_vllm():
    code = ("import sys; import gpupool; assert 'gpupool.vllm' not in sys.modules; "
            "import gpupool.vllm; p = gpupool.vllm.BlockPool(4, True, 4, device='cpu'); "
            "assert p._ku is None or 'vllm' in sys.modules; print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled(120))
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_same_trace_as_vllm_block_pool(tmp_path):
    """The op lists of a seeded hypothesis run give the same trace on vLLM 0.33's own BlockPool (its
    released source, in a subprocess) as on gpupool's adapter over the device pool."""
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    cases = []

    @settings(max_examples=max(30, settings().max_examples), database=None, derandomize=True)
    @given(ops=st.lists(OPS, min_size=4, max_size=20), caching=st.booleans())
    def draw(ops, caching):
        cases.append({"num_blocks": N, "caching": caching, "ops": [list(o) for o in ops]})

    draw()
    theirs = driver_trace(root, cases, tmp_path)
    steps = [st_ for t in theirs for st_ in t]
    # not vacuous: prefix hits, cached keys, shared keys, evictions and every event kind occur
    assert any(s_["op"][0] == "hit" and s_["result"] for s_ in steps)
    assert any(s_["cache"] for s_ in steps) and any(s_["op"][0] == "reset" and s_["result"] for s_ in steps)
    kinds = {e[0] for s_ in steps for e in s_["events"]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    for c, t in zip(cases, theirs):
        ours = BlockPool(c["num_blocks"], c["caching"], driver.BLOCK_SIZE, enable_kv_cache_events=True, device="cpu")
        got = json.loads(json.dumps(driver.run(ours, [tuple(o) for o in c["ops"]])))
        assert got == t, c
