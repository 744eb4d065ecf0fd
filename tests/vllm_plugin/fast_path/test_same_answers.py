"""The fast path (``gpupool.vllm.fast_path.DeferredBlockPool``, docs/vllm.md "The fast path") answers
as the per-call ``gpupool.vllm.BlockPool``.

* random op lists (allocate with caching, cache, free, prefix hit + touch, evict, ``ref_cnt += 1``,
  reset) applied to both with NO read in between (so ops pile up between synchronisations): every
  answer the caller reads while the ops run (free counts, ref counts and hashes of hit blocks,
  lookups) and, at the end, every block id handed out, the whole mirror and the device state are
  equal; over the reference backend (many lists, also with the host's copy of the free queue cut to a
  few slots) and the device pool (Triton's interpreter, few);
* sequences the random lists rarely make, with KV events and a metrics collector on: per op the
  result (or typed error), the events and the metrics calls equal, and the final state too:
  ``get_new_blocks(0)``, popping every block, ``reset_prefix_cache`` with blocks held, caching 0
  blocks, ``evict_blocks`` of the null block and of blocks that hold no key, ``touch`` of the null
  block, the same prefix cached on two blocks (two holders of one key), frees past the free count."""
from harness.paths import CONFORMANCE
import sys

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from harness.vllm_ops import DRIVER_OPS as OPS, prefix_hit  # noqa: E402

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


EDGE_N = 8  # 7 usable blocks: "pop every block" is cheap

KINDS = (BlockPool, DeferredBlockPool)


def make(cls, backend, caching=True):
    return O.observed_pool(cls, EDGE_N, backend, caching)


def outcome(f, pool, held):
    """``f``'s result (block ids, or a value) or its error's class; a raw exception fails the test."""
    try:
        r = f(pool, held)
    except PoolError as e:
        return type(e).__name__
    return [b.block_id for b in r] if isinstance(r, list) else r


# ---- ops: f(pool, held) with ``held`` this pool's list of block lists, as a request holds them -----------
def alloc(n, seed=1, cache=True, group=0):
    def f(p, held):
        blocks = p.get_new_blocks(n)
        held.append(blocks)
        if cache and n:
            p.cache_full_blocks(driver.request(driver.tokens_of(seed)[: n * BS]), blocks, 0, n, BS, group)
        return blocks
    return f


def free(index=-1):
    def f(p, held):
        p.free_blocks(list(reversed(held.pop(index))))
    return f


def hit(seed):
    def f(p, held):
        got = prefix_hit(p, seed)
        p.touch(got)
        held.append(got)
        return got
    return f


def cache_zero(p, held):
    blocks = p.get_new_blocks(2)
    held.append(blocks)
    req = driver.request(driver.tokens_of(5)[: 2 * BS])
    p.cache_full_blocks(req, blocks, 0, 0, BS, 0)
    p.cache_full_blocks(req, blocks, 1, 1, BS, 0)
    p.cache_full_blocks(req, [], 0, 0, BS, 0)


def double_free(p, held):
    blocks = held.pop()
    p.free_blocks(list(blocks))
    p.free_blocks(list(blocks))  # DoubleFreeError, nothing changed


def get(n):
    return lambda p, held: p.get_new_blocks(n)


SEQUENCES = {
    "get 0": [get(0), alloc(2), get(0), free(), get(0)],
    "pop every block": [alloc(EDGE_N - 1, cache=False), get(1), free(), alloc(EDGE_N - 1, cache=False), free()],
    "pop every block, keys evicted": [alloc(3, 1), alloc(4, 2), free(0), free(), alloc(EDGE_N - 1, cache=False), free()],
    "reset with blocks held": [alloc(3), lambda p, h: p.reset_prefix_cache(), free(),
                               lambda p, h: p.reset_prefix_cache(), alloc(2, 3), free()],
    "cache 0 blocks": [cache_zero, free()],
    "evict null and keyless": [alloc(3), lambda p, h: p.evict_blocks({0, 1, 2, 7}), free(),
                               lambda p, h: p.evict_blocks(set()), lambda p, h: p.evict_blocks(set(range(EDGE_N))),
                               alloc(2)],
    "touch null": [alloc(2), lambda p, h: p.touch([p.null_block, p.null_block]), lambda p, h: p.touch([]), free()],
    "free null": [alloc(2), lambda p, h: p.free_blocks([p.null_block]), free()],
    "one key, two holders": [alloc(2, 1), alloc(2, 1), free(), free(), hit(1), alloc(5, cache=False)],
    "one key, two holders, evicted": [alloc(2, 1), alloc(2, 1), lambda p, h: p.evict_blocks({1, 2, 3, 4}),
                                      free(), free(), alloc(EDGE_N - 1, cache=False)],
    "past the free count": [alloc(2), get(EDGE_N), get(-1), double_free, alloc(EDGE_N - 1, cache=False)],
}


def run_sequence(backend, ops):
    per_call, deferred = (make(cls, backend) for cls in KINDS)
    held = {per_call: [], deferred: []}
    for i, f in enumerate(ops):
        want = (outcome(f, per_call, held[per_call]), O.drain(per_call))
        got = (outcome(f, deferred, held[deferred]), O.drain(deferred))
        assert got == want, f"op {i}"
    assert O.synced_snapshot(deferred) == O.synced_snapshot(per_call)


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_edge_sequence_equals_per_call_reference(name):
    run_sequence("reference", SEQUENCES[name])


@pytest.mark.parametrize("name", ["pop every block, keys evicted", "one key, two holders", "past the free count"])
@pytest.mark.heavy("pop every block, keys evicted", "one key, two holders")
def test_edge_sequence_equals_per_call_device(name):
    run_sequence("device", SEQUENCES[name])
