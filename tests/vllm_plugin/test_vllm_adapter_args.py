"""Arguments through the vLLM adapter (``gpupool.vllm.BlockPool`` and ``DeferredBlockPool``): wrong
types, ranges and huge values give gpupool's typed errors (PoolError subclasses), at the call, before
anything is allocated, with every pool unchanged; ``free_blocks`` over several pools is all or nothing;
a bound placeholder does not replace ``pool.blocks[i]``. Each case failed before its check (a raw
TypeError / AttributeError / OverflowError / MemoryError, seconds of work, an answer, or a change).
A hypothesis fuzz throws mixed values (None, floats, strings, bytes, bools, huge and negative ints,
other pools' blocks) at every entry point."""
from harness.paths import CONFORMANCE
import sys
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from gpupool.errors import ArgumentTypeError, DoubleFreeError, PoolError  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.block_pool import KVCacheBlock  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

BS = driver.BLOCK_SIZE
CLASSES = [BlockPool, DeferredBlockPool]


class _LookAlike:
    """Not a block, though ``__class__`` says KVCacheBlock (isinstance believes it)."""
    __class__ = KVCacheBlock
    block_id = 1
    is_null = False


def kw(backend):
    return dict(device="cpu") if backend == "device" else dict(backend="reference")


def setup(cls, backend, **k):
    p = cls(16, True, BS, **kw(backend), **k)
    r = driver.request(driver.tokens_of(1)[: 2 * BS])
    a = p.get_new_blocks(2)
    p.cache_full_blocks(r, a, 0, 1, BS, 0)
    return p, r, a


CASES = {
    "get_new_blocks(None)": lambda p, r, a: p.get_new_blocks(None),
    "get_new_blocks(1.0)": lambda p, r, a: p.get_new_blocks(1.0),
    "get_new_blocks(-1)": lambda p, r, a: p.get_new_blocks(-1),
    "free_blocks(None)": lambda p, r, a: p.free_blocks(None),
    "free_blocks([None])": lambda p, r, a: p.free_blocks([None]),
    "touch(None)": lambda p, r, a: p.touch(None),
    "touch([1])": lambda p, r, a: p.touch([1]),
    "get_cached_block(h, [-1])": lambda p, r, a: p.get_cached_block(r.block_hashes[0], [-1]),
    "get_cached_block(h, ['0'])": lambda p, r, a: p.get_cached_block(r.block_hashes[0], ["0"]),
    "get_cached_block(12345, [0])": lambda p, r, a: p.get_cached_block(12345, [0]),
    "get_cached_block(2**40, [0])": lambda p, r, a: p.get_cached_block(2 ** 40, [0]),
    "get_cached_block(h, 0)": lambda p, r, a: p.get_cached_block(r.block_hashes[0], 0),
    "cache_full_blocks(num_cached=0.5)": lambda p, r, a: p.cache_full_blocks(r, a, 0.5, 2, BS, 0),
    "cache_full_blocks(request=None)": lambda p, r, a: p.cache_full_blocks(None, a, 1, 2, BS, 0),
    "cache_full_blocks(num_cached=10**7)": lambda p, r, a: p.cache_full_blocks(r, a, 10 ** 7, 10 ** 7 + 1, BS, 0),
    "cache_full_blocks(num_full=10**7)": lambda p, r, a: p.cache_full_blocks(r, a, 1, 10 ** 7, BS, 0),
    "cache_full_blocks(block_size='16')": lambda p, r, a: p.cache_full_blocks(r, a, 1, 2, "16", 0),
    "cache_full_blocks(blocks=None)": lambda p, r, a: p.cache_full_blocks(r, None, 1, 2, BS, 0),
    "ref_cnt = 2**40": lambda p, r, a: setattr(a[0], "ref_cnt", 2 ** 40),
    "ref_cnt = 2.0": lambda p, r, a: setattr(a[0], "ref_cnt", 2.0),
    "insert(short key)": lambda p, r, a: p.cached_block_hash_to_block.insert(b"abcd", a[1]),
    "insert(str key)": lambda p, r, a: p.cached_block_hash_to_block.insert("abcdefgh", a[1]),
    # look-alikes: a mock of a block (its attributes all answer) and a class claiming KVCacheBlock as __class__
    "free_blocks([mock block])": lambda p, r, a: p.free_blocks([mock.Mock(spec=KVCacheBlock)]),
    "touch([mock block])": lambda p, r, a: p.touch([mock.Mock(spec=KVCacheBlock)]),
    "free_blocks([look-alike])": lambda p, r, a: p.free_blocks([_LookAlike()]),
    "cache_full_blocks(look-alike)": lambda p, r, a: p.cache_full_blocks(r, [a[0], _LookAlike()], 1, 2, BS, 0),
}


@pytest.mark.parametrize("backend", ["reference", "device"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_are_typed_errors(case, cls, backend):
    p, r, a = setup(cls, backend)
    before = driver.snapshot(p)
    t0 = time.perf_counter()
    with pytest.raises(PoolError):
        CASES[case](p, r, a)
    assert time.perf_counter() - t0 < 2.0  # checked before anything is allocated
    assert driver.snapshot(p) == before


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [0, -4, "4", None, 2.0, True])
def test_hash_block_size_checked_at_construction(cls, value):
    with pytest.raises(PoolError):
        cls(8, True, value, backend="reference")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("case", ["get_cached_block(12345, [0])", "get_cached_block(h, ['0'])",
                                  "get_cached_block(h, [-1])"])
def test_lookups_refuse_alike_with_device_lookups(cls, case):
    errs = []
    for lookups in (False, True):
        p, r, a = setup(cls, "device", device_lookups=lookups)
        with pytest.raises(PoolError) as e:
            CASES[case](p, r, a)
        errs.append(type(e.value))
    assert errs[0] is errs[1]


@pytest.mark.parametrize("backend", ["reference", "device"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_free_blocks_over_two_pools_is_all_or_nothing(cls, backend):
    p, _, a = setup(cls, backend)
    q, _, b = setup(cls, backend)
    q.free_blocks(b[1:])  # b[1] is free now: freeing it again is a double free in q
    before = (driver.snapshot(p), driver.snapshot(q))
    with pytest.raises(DoubleFreeError):
        p.free_blocks([a[1], b[1]])
    with pytest.raises(ArgumentTypeError):
        p.free_blocks([a[1], object()])
    assert (driver.snapshot(p), driver.snapshot(q)) == before
    p.free_blocks([a[1], b[0]])  # both pools' blocks released
    if isinstance(p, DeferredBlockPool):
        p.sync(), q.sync()
    assert (p.blocks[a[1].block_id].ref_cnt, q.blocks[b[0].block_id].ref_cnt) == (0, 0)


def test_a_bound_placeholder_does_not_replace_the_pool_block(monkeypatch):
    """One object per block id for the pool's life (docs/vllm.md): ``pool.blocks`` keeps its proxies
    when placeholders are bound; the placeholder reads the same block."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    p = DeferredBlockPool(12, True, BS, device="cpu")
    objs = list(p.blocks)
    first = p.get_new_blocks(1)
    p.end_step()
    pend = p.get_new_blocks(4)
    assert any(isinstance(b, fast_path.PendingBlock) for b in pend)
    p.sync()
    assert all(x is y for x, y in zip(objs, p.blocks)) and len(objs) == len(p.blocks)
    for blk in first + pend:
        assert p.blocks[blk.block_id].ref_cnt == blk.ref_cnt == 1


# ---- the fuzz ------------------------------------------------------------------------------------------
ODD = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=6),
                st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, 2, -1, 2 ** 31, 2 ** 40, 10 ** 7]),
                st.just("own"), st.just("other"), st.just("hash"))
ARGS = st.lists(st.one_of(ODD, st.lists(ODD, max_size=3)), min_size=1, max_size=6)
ENTRY = st.sampled_from(["get_new_blocks", "free_blocks", "touch", "get_cached_block", "cache_full_blocks",
                         "ref_cnt", "insert", "evict_blocks", "is_block_writable", "move_block_hashes"])


def _value(v, p, q, r, a):
    """Stand-ins: this pool's blocks, another pool's block, a real hash."""
    if isinstance(v, list):
        return [_value(x, p, q, r, a) for x in v]
    return {"own": a[0], "other": q.blocks[1], "hash": r.block_hashes[0]}.get(v, v) if isinstance(v, str) else v


@settings(max_examples=300, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(entry=ENTRY, args=ARGS, cls=st.sampled_from(CLASSES))
@pytest.mark.heavy
def test_fuzz_entry_points(entry, args, cls):
    p, r, a = setup(cls, "reference")
    q = cls(4, True, BS, backend="reference")
    q.get_new_blocks(1)
    vals = [_value(v, p, q, r, a) for v in args]
    before = driver.snapshot(p)
    t0 = time.perf_counter()
    try:
        if entry == "ref_cnt":
            a[0].ref_cnt = vals[0]
        elif entry == "insert":
            p.cached_block_hash_to_block.insert(*(vals + [a[1]])[:2])
        else:
            default = {"cache_full_blocks": [r, a, 0, 2, BS, 0], "get_cached_block": [r.block_hashes[0], [0]],
                       "move_block_hashes": [a[0], a[1]]}.get(entry, [None])
            getattr(p, entry)(*(vals + default[len(vals):])[:len(default)])
    except PoolError:
        assert driver.snapshot(p) == before  # nothing changed
    assert time.perf_counter() - t0 < 2.0
    if isinstance(p, DeferredBlockPool):
        p.sync()
    assert p._ref[:16] == p._dev.ref_cnt  # the mirror equals the pool


@pytest.mark.parametrize("cls", CLASSES)
def test_a_block_made_by_hand_is_a_block_of_the_pool_or_refused(cls):
    """``KVCacheBlock(pool, block_id)`` made by hand stands for that block (freed, touched as the pool's
    own object), or is refused at once, typed: an id outside the pool, not an int (a float, a bool), a
    wrong ``is_null``, no gpupool pool (each made an IndexError, a TypeError or a wrong free count at a
    later call before)."""
    p = cls(8, True, BS, **kw("device"))
    held = p.get_new_blocks(2)
    for args in [(p, 8), (p, 10 ** 6), (p, -1), (p, 2.0), (p, True), (p, 0), (p, 1, True), ("pool", 1)]:
        with pytest.raises(PoolError):
            KVCacheBlock(*args)
    assert KVCacheBlock(p, 0, True).is_null
    alias = KVCacheBlock(p, held[0].block_id)
    p.touch([alias])
    assert held[0].ref_cnt == 2
    p.free_blocks([alias, held[0], held[1]])
    assert p.get_num_free_blocks() == 7
