"""The fast path's arguments (``gpupool.vllm.fast_path.DeferredBlockPool``) answered as the per-call
``gpupool.vllm.BlockPool`` answers them: the same answer, typed error and state, and nothing changed
by an error.

* a double free raises DoubleFreeError with the pool unchanged; ``get_new_blocks`` past the free count
  raises OutOfBlocksError at the call; a bad caching raises at the call, not at a later launch;
* ``free_blocks``, ``touch`` and ``cache_full_blocks`` given iterators, tuples, generators, null
  blocks, duplicates, other pools' blocks and wrong types: the per-call pool's outcome, and after an
  error the host's state (mirror, key map, free count, the host's copy of the queue, placeholders)
  as before it;
* a touch of a placeholder and a free block while the mirror is dirty (the placeholders bound
  mid-call); ``cache_full_blocks`` arguments the per-call pool rejects (bad groups, bool or numpy
  counts, int hashes) raised at the call and never queued; argument checks with caching disabled;
  ``cached_block_hashes_by_block`` while dirty; ``block_size`` 0;
* frees over two pools (this pool's blocks and another gpupool pool's, both kinds, either side): all
  or nothing, a double free on either side is a DoubleFreeError with no event, no metrics call and
  both pools unchanged; another pool's block in ``touch`` or ``cache_full_blocks`` is an
  ArgumentTypeError."""
from harness.paths import CONFORMANCE
import sys
import types
import itertools

import pytest
import numpy as np

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import DoubleFreeError, OutOfBlocksError, PoolError  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402

BS = driver.BLOCK_SIZE


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
    return outcome, O.synced_snapshot(p), other.blocks[o[0].block_id].ref_cnt


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_inputs_as_the_per_call_pool(case):
    """Over the reference backend (each case's device launches are those of the cases above)."""
    got = [run_input(p, type(p)(4, True, BS, backend="reference"), case) for p in O.adapter_pair(8, "reference")]
    assert got[0] == got[1]


@pytest.mark.slow  # 31 cases, about 25 s
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_inputs_as_the_per_call_pool_device(case):
    got = []
    for p in O.adapter_pair(8, "device"):
        got.append(run_input(p, type(p)(4, True, BS, device="cpu"), case))
        if isinstance(p, DeferredBlockPool):
            O.mirror_is_device(p)
    assert got[0] == got[1]


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("backend", ["reference", "device"])
def test_touch_placeholder_with_free_block(monkeypatch, backend, first):
    """D1: touch([placeholder, ref-0 block]) while dirty: IndexError (per-call: fine)."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    out = []
    for p in (BlockPool(10, True, BS, **kw), DeferredBlockPool(10, True, BS, **kw)):
        a = p.get_new_blocks(2)
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, 2, BS, 0)
        p.free_blocks(a)
        pp = p.get_new_blocks(4)  # deferred: placeholders
        p.touch([pp[0], a[0]] if first == 0 else [a[0], pp[0]])
        if hasattr(p, 'sync'):
            p.sync()
        out.append(([b.block_id for b in pp], driver.snapshot(p)))
    assert out[0] == out[1]


BAD_CACHE = {  # (nc, nf, group, hashes): rejected by the per-call pool at the call, unchanged
    "group 2**31": (0, 2, 2 ** 31, None),
    "group -1": (0, 2, -1, None),
    "group True": (0, 2, True, None),
    "nf True": (0, True, 0, None),
    "int hashes": (0, 2, 0, [1, 2]),
}


@pytest.mark.parametrize("case", list(BAD_CACHE))
def test_bad_cache_args_poison_the_batch(case):
    """D2: a cache_full_blocks the per-call pool rejects is queued; the flush (end_step) raises and drops
    the WHOLE batch on the device, the pop of `a` included; the held blocks end up free."""
    nc, nf, g, hashes = BAD_CACHE[case]
    snaps = []
    for p in (BlockPool(8, True, BS, device="cpu"), DeferredBlockPool(8, True, BS, device="cpu")):
        a = p.get_new_blocks(2)
        r = driver.request(driver.tokens_of(1)[:2 * BS]) if hashes is None else types.SimpleNamespace(block_hashes=hashes)
        with pytest.raises(PoolError):
            p.cache_full_blocks(r, a, nc, nf, BS, g)
        p.end_step()
        snaps.append(driver.snapshot(p))
    assert snaps[0] == snaps[1]


def test_numpy_count_poisons_the_batch():
    """D3: num_full_blocks as numpy.int64 (valid for the per-call pool) is queued and the flush fails."""
    snaps = []
    for p in (BlockPool(8, True, BS, device="cpu"), DeferredBlockPool(8, True, BS, device="cpu")):
        a = p.get_new_blocks(2)
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, np.int64(2), BS, 0)
        p.end_step()
        snaps.append(driver.snapshot(p))
    assert snaps[0] == snaps[1]


@pytest.mark.parametrize("kw", [dict(block_mask=[True]), dict(kv_cache_group_id=-1), dict(blocks=[1, 2])])
def test_caching_off_skips_checks(kw):
    """D4: caching disabled: deferred returns None for arguments the per-call pool rejects."""
    errs = []
    for p in (BlockPool(6, False, BS, backend="reference"), DeferredBlockPool(6, False, BS, backend="reference")):
        a = p.get_new_blocks(2)
        args = dict(request=driver.request(driver.tokens_of(1)[:2 * BS]), blocks=a, num_cached_blocks=0,
                    num_full_blocks=2, block_size=BS, kv_cache_group_id=0)
        args.update(kw)
        try:
            p.cache_full_blocks(**args)
            errs.append(None)
        except PoolError as e:
            errs.append(type(e).__name__)
    assert errs[0] == errs[1]


def test_secondary_keys_read_stale_when_dirty(monkeypatch):
    """D5: cached_block_hashes_by_block reads the mirror without synchronising while it is dirty."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 1)
    outs = []
    for p in (BlockPool(4, True, BS, backend="reference"), DeferredBlockPool(4, True, BS, backend="reference")):
        a = p.get_new_blocks(1)
        r = driver.request(driver.tokens_of(1)[:3 * BS])
        p.cache_partial_block(r, a[0], 8, 0, 8)
        p.cache_partial_block(r, a[0], 4, 1, 8)  # a secondary key (group 1)
        p.free_blocks(a)
        p.get_new_blocks(3)  # every free block, a[0] included: its keys are evicted
        outs.append(p.cached_block_hashes_by_block)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("cls", [BlockPool, DeferredBlockPool])
def test_block_size_zero_is_a_pool_error(cls):
    """``cache_full_blocks(block_size=0)`` raises InvalidArgumentError (was ZeroDivisionError), nothing changed."""
    p = cls(6, True, BS, backend="reference")
    a = p.get_new_blocks(2)
    before = driver.snapshot(p)
    with pytest.raises(PoolError):
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, 2, 0, 0)
    assert driver.snapshot(p) == before


EDGE_N = 8  # 7 usable blocks: "pop every block" is cheap

KINDS = (BlockPool, DeferredBlockPool)


def make(cls, backend, caching=True):
    return O.observed_pool(cls, EDGE_N, backend, caching)


def _two_pools(kind, other_kind, backend):
    """(pool, mine, other pool, theirs): two cached blocks held in each; all events drained."""
    p, o = make(kind, backend), make(other_kind, backend)
    mine, theirs = p.get_new_blocks(2), o.get_new_blocks(2)
    p.cache_full_blocks(driver.request(driver.tokens_of(1)[: 2 * BS]), mine, 0, 2, BS, 0)
    o.cache_full_blocks(driver.request(driver.tokens_of(2)[: 2 * BS]), theirs, 0, 2, BS, 0)
    O.drain(p, o)
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
        O.drain(o)
    before = O.synced_snapshot(p), O.synced_snapshot(o)
    with pytest.raises(PoolError) as e:
        f(p, mine, theirs)
    assert type(e.value).__name__ == error
    assert O.drain(p, o) == [([], []), ([], [])]
    assert (O.synced_snapshot(p), O.synced_snapshot(o)) == before


@pytest.mark.parametrize("kind,other_kind", list(itertools.product(KINDS, KINDS)),
                         ids=lambda c: c.__name__)
def test_free_over_two_pools_equals_two_frees(kind, other_kind):
    """A free naming both pools' blocks gives each pool the events and metrics of its own free."""
    p, mine, o, theirs = _two_pools(kind, other_kind, "reference")
    q, mine_q, r, theirs_r = _two_pools(BlockPool, BlockPool, "reference")
    p.free_blocks(list(reversed(mine)) + list(reversed(theirs)))
    q.free_blocks(list(reversed(mine_q)))
    r.free_blocks(list(reversed(theirs_r)))
    assert O.drain(p, o) == O.drain(q, r)
    assert (O.synced_snapshot(p), O.synced_snapshot(o)) == (O.synced_snapshot(q), O.synced_snapshot(r))
