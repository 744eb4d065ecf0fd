"""Edge sequences on the fast path with KV events and a metrics collector on
(``gpupool.vllm.fast_path.DeferredBlockPool``, docs/algorithms.md section 8, "Events and metrics"): per
op, the result (or typed error), the events and the metrics calls equal the per-call pool's
(``gpupool.vllm.BlockPool``), and the final state too. The sequences the random op lists rarely make:
``get_new_blocks(0)``, popping every block, ``reset_prefix_cache`` with blocks held, caching 0 blocks,
``evict_blocks`` of the null block and of blocks that hold no key, ``touch`` of the null block,
the same prefix cached on two blocks (two holders of one key), frees past the free count.

Frees over two pools (this pool's blocks and another gpupool pool's, both kinds, either side): all or
nothing, a double free on either side is a DoubleFreeError with no event, no metrics call and both
pools unchanged; another pool's block in ``touch`` or ``cache_full_blocks`` is an ArgumentTypeError.
"""
import itertools
import sys

import pytest

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import PoolError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

from harness.paths import CONFORMANCE  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import prefix_hit  # noqa: E402

BS = driver.BLOCK_SIZE
N = 8  # 7 usable blocks: "pop every block" is cheap
KINDS = (BlockPool, DeferredBlockPool)


def make(cls, backend, caching=True):
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    return cls(N, caching, BS, enable_kv_cache_events=True, metrics_collector=driver.MetricsLog(), **kw)


def drain(*pools) -> list:
    """Each pool's events (vLLM's fields) and metrics calls since the last drain."""
    return [([driver._event(e) for e in p.take_events()], p.metrics_collector.take()) for p in pools]


def synced_snapshot(pool) -> dict:
    if isinstance(pool, DeferredBlockPool):
        pool.sync()
    return driver.snapshot(pool)


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
    "pop every block": [alloc(N - 1, cache=False), get(1), free(), alloc(N - 1, cache=False), free()],
    "pop every block, keys evicted": [alloc(3, 1), alloc(4, 2), free(0), free(), alloc(N - 1, cache=False), free()],
    "reset with blocks held": [alloc(3), lambda p, h: p.reset_prefix_cache(), free(),
                               lambda p, h: p.reset_prefix_cache(), alloc(2, 3), free()],
    "cache 0 blocks": [cache_zero, free()],
    "evict null and keyless": [alloc(3), lambda p, h: p.evict_blocks({0, 1, 2, 7}), free(),
                               lambda p, h: p.evict_blocks(set()), lambda p, h: p.evict_blocks(set(range(N))),
                               alloc(2)],
    "touch null": [alloc(2), lambda p, h: p.touch([p.null_block, p.null_block]), lambda p, h: p.touch([]), free()],
    "free null": [alloc(2), lambda p, h: p.free_blocks([p.null_block]), free()],
    "one key, two holders": [alloc(2, 1), alloc(2, 1), free(), free(), hit(1), alloc(5, cache=False)],
    "one key, two holders, evicted": [alloc(2, 1), alloc(2, 1), lambda p, h: p.evict_blocks({1, 2, 3, 4}),
                                      free(), free(), alloc(N - 1, cache=False)],
    "past the free count": [alloc(2), get(N), get(-1), double_free, alloc(N - 1, cache=False)],
}


def run_sequence(backend, ops):
    per_call, deferred = (make(cls, backend) for cls in KINDS)
    held = {per_call: [], deferred: []}
    for i, f in enumerate(ops):
        want = (outcome(f, per_call, held[per_call]), drain(per_call))
        got = (outcome(f, deferred, held[deferred]), drain(deferred))
        assert got == want, f"op {i}"
    assert synced_snapshot(deferred) == synced_snapshot(per_call)


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_edge_sequence_equals_per_call_reference(name):
    run_sequence("reference", SEQUENCES[name])


@pytest.mark.parametrize("name", ["pop every block, keys evicted", "one key, two holders", "past the free count"])
@pytest.mark.heavy("pop every block, keys evicted", "one key, two holders")
def test_edge_sequence_equals_per_call_device(name):
    run_sequence("device", SEQUENCES[name])


def _two_pools(kind, other_kind, backend):
    """(pool, mine, other pool, theirs): two cached blocks held in each; all events drained."""
    p, o = make(kind, backend), make(other_kind, backend)
    mine, theirs = p.get_new_blocks(2), o.get_new_blocks(2)
    p.cache_full_blocks(driver.request(driver.tokens_of(1)[: 2 * BS]), mine, 0, 2, BS, 0)
    o.cache_full_blocks(driver.request(driver.tokens_of(2)[: 2 * BS]), theirs, 0, 2, BS, 0)
    drain(p, o)
    return p, mine, o, theirs


REFUSED = {  # case: (error, freed by the other pool first, the op)
    "free, the other pool's part a double free": ("DoubleFreeError", True, lambda p, mine, theirs: p.free_blocks(
        list(mine) + list(theirs))),
    "free, this pool's part a double free": ("DoubleFreeError", False, lambda p, mine, theirs: p.free_blocks(
        list(theirs) + list(mine) + list(mine))),
    "touch of another pool's block": ("ArgumentTypeError", False, lambda p, mine, theirs: p.touch(list(theirs))),
    "cache on another pool's block": ("ArgumentTypeError", False, lambda p, mine, theirs: p.cache_full_blocks(
        driver.request(driver.tokens_of(9)[: 2 * BS]), list(theirs), 0, 2, BS, 0)),
}


@pytest.mark.parametrize("kind,other_kind", list(itertools.product(KINDS, KINDS)),
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_op_over_two_pools_changes_and_emits_nothing(case, kind, other_kind):
    error, other_frees_first, f = REFUSED[case]
    p, mine, o, theirs = _two_pools(kind, other_kind, "reference")
    if other_frees_first:
        o.free_blocks(theirs[:1])
        drain(o)
    before = synced_snapshot(p), synced_snapshot(o)
    with pytest.raises(PoolError) as e:
        f(p, mine, theirs)
    assert type(e.value).__name__ == error
    assert drain(p, o) == [([], []), ([], [])]
    assert (synced_snapshot(p), synced_snapshot(o)) == before


@pytest.mark.parametrize("kind,other_kind", list(itertools.product(KINDS, KINDS)),
                         ids=lambda c: c.__name__)
def test_free_over_two_pools_equals_two_frees(kind, other_kind):
    """A free naming both pools' blocks gives each pool the events and metrics of its own free."""
    p, mine, o, theirs = _two_pools(kind, other_kind, "reference")
    q, mine_q, r, theirs_r = _two_pools(BlockPool, BlockPool, "reference")
    p.free_blocks(list(reversed(mine)) + list(reversed(theirs)))
    q.free_blocks(list(reversed(mine_q)))
    r.free_blocks(list(reversed(theirs_r)))
    assert drain(p, o) == drain(q, r)
    assert (synced_snapshot(p), synced_snapshot(o)) == (synced_snapshot(q), synced_snapshot(r))
