"""The decode step's quick ops (``DeferredEngine.pop_one`` / ``cache_one``: ``get_new_blocks(1)`` and a
``cache_full_blocks`` of one block, docs/algorithms.md section 8) answer as the general path: the same
ops on a pool with them and on one without (``quick`` off) read the same answers, launch the same
batches and end in the same whole state; every argument the quick ops could misread gives the general
path's result or error, nothing changed by a refused call. The launches run on the flush stub
(tests/harness/flush_stub.py, tested equal to the kernel), so many op lists are cheap."""
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import PoolError  # noqa: E402
from gpupool.vllm import fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from harness.flush_stub import stubbed_flush  # noqa: E402

import driver  # noqa: E402  (tests/vllm_plugin/conformance, on the path through harness.vllm_ops)

OPS = st.one_of(O.DECODE, O.DECODE, O.DECODE, O.ALLOC, O.ALLOC, O.FREE, O.IDS,
                st.tuples(st.just("cache"), O.R, st.integers(1, 3)), st.tuples(st.just("free1"), O.R, st.integers(0, 3)),
                st.tuples(st.just("hit"), O.SEED), st.tuples(st.just("hitfree"), O.SEED), st.tuples(st.just("share"), O.R),
                st.tuples(st.just("cow"), O.R), st.tuples(st.just("refs"), O.R),
                st.tuples(st.just("end_step")), st.tuples(st.just("sync")))


def _pair(n: int):
    """Two fast-path pools, the second with the quick ops off."""
    quick, general = DeferredBlockPool(n, True, O.BS, device="cpu"), DeferredBlockPool(n, True, O.BS, device="cpu")
    general._engine.quick = False
    return quick, general


def _counted(pool) -> dict:
    """Counts of the quick ops' answers on ``pool`` (pops, cachings)."""
    e, seen = pool._engine, {"pop": 0, "cache": 0}
    pop_one, cache_one = e.pop_one, e.cache_one

    def pop():
        s = pop_one()
        seen["pop"] += s is not None
        return s

    def cache(*a):
        ok = cache_one(*a)
        seen["cache"] += ok
        return ok
    e.pop_one, e.cache_one = pop, cache
    return seen


@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=40), n=st.sampled_from([6, 24, 64]))
@example(ops=[("alloc", 1, 0, 0), ("decode", 0), ("decode", 0), ("free", 0), ("decode", 0), ("alloc", 1, 1, 1),
              ("decode", 0), ("end_step",), ("hit", 1), ("decode", 1)], n=6)  # evicting pops, quick cachings
@example(ops=[("alloc", 2, 1, 2), ("free", 0), ("hit", 1), ("alloc", 1, 2, 1), ("free", 1), ("alloc", 3, 3, 0),
              ("end_step",), ("sync",)], n=6)  # a touch of free blocks unlinks them: later pops pass them by
def test_quick_ops_equal_the_general_path(ops, n):
    with stubbed_flush(check=True):
        quick, general = _pair(n)
        assert O.run_stepped(quick, ops) == O.run_stepped(general, ops)
        assert O.whole_state(quick) == O.whole_state(general)


@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=40), n=st.sampled_from([6, 24]), window=st.sampled_from([1, 2]))
@example(ops=[("alloc", 2, 1, 2), ("free", 0), ("alloc", 3, 2, 0), ("hit", 1), ("end_step",)], n=6, window=1)
def test_quick_ops_equal_the_general_path_with_placeholders(ops, n, window):
    """A host copy of the free queue of ``window`` ids: pops past it hand out placeholders, and the
    quick lookups, touches and frees then meet a dirty mirror (a free block a placeholder's pop may
    have taken)."""
    with mock.patch.object(fast_path, "FREE_WINDOW", window), stubbed_flush(check=True):
        quick, general = _pair(n)
        assert O.run_stepped(quick, ops) == O.run_stepped(general, ops)
        assert O.whole_state(quick) == O.whole_state(general)


@settings(max_examples=max(20, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=40), n=st.sampled_from([6, 24, 64]))
def test_keys_made_on_the_device_name_as_the_hosts(ops, n):
    """Every launch's cachings keyed on the device (a GPU pool's path from ``device_keys_from``
    cachings; the stub makes them) give the answers and whole state of keys made on the host: the
    names the mirror reads back at a sync among them."""
    with stubbed_flush(check=True):
        on_device, on_host = DeferredBlockPool(n, True, O.BS, device="cpu"), DeferredBlockPool(n, True, O.BS, device="cpu")
        on_device._engine.backend.pool.device_keys_from = 1
        assert O.run_stepped(on_device, ops) == O.run_stepped(on_host, ops)
        assert O.whole_state(on_device) == O.whole_state(on_host)


def test_the_decode_ops_take_the_quick_path():
    """The example's pops and cachings are answered by the quick ops (else the test above compares the
    general path with itself); evicting pops among them."""
    with stubbed_flush(check=True):
        quick, _ = _pair(6)
        seen = _counted(quick)
        ops = [("alloc", 2, 0, 2), ("free", 0), ("alloc", 1, 1, 0)] + [("decode", 0)] * 4 + [("hit", 1), ("free", 0)]
        O.run_stepped(quick, ops)
    assert seen["pop"] >= 4 and seen["cache"] >= 3, seen


# ---- arguments: whatever the quick ops are given, the general path's outcome --------------------------
def _outcome(f):
    try:
        r = f()
    except PoolError as e:
        return type(e).__name__, str(e)
    return [b.block_id for b in r] if isinstance(r, list) else r


class _Hashes:
    def __init__(self, hashes):
        self.block_hashes = hashes


def _cases(p, other):
    """(name, call) pairs on pool ``p`` holding a request's 3 blocks (2 cached) and a free keyed block."""
    req, blocks = p._case_req, p._case_blocks
    h = list(req.block_hashes)
    return [
        ("pop one", lambda: p.get_new_blocks(1)),
        ("pop True", lambda: p.get_new_blocks(True)),
        ("pop 1.0", lambda: p.get_new_blocks(1.0)),
        ("cache", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, 0)),
        ("cache True", lambda: p.cache_full_blocks(req, blocks, True, 2, O.BS, 0)),
        ("cache 2.0", lambda: p.cache_full_blocks(req, blocks, 2.0, 3, O.BS, 0)),
        ("cache -1", lambda: p.cache_full_blocks(req, blocks, -1, 0, O.BS, 0)),
        ("cache huge", lambda: p.cache_full_blocks(req, blocks, 2 ** 70, 2 ** 70 + 1, O.BS, 0)),
        ("cache past blocks", lambda: p.cache_full_blocks(req, blocks, 3, 4, O.BS, 0)),
        ("cache tuple", lambda: p.cache_full_blocks(req, tuple(blocks), 2, 3, O.BS, 0)),
        ("cache block size True", lambda: p.cache_full_blocks(req, blocks, 2, 3, True, 0)),
        ("cache block size float", lambda: p.cache_full_blocks(req, blocks, 2, 3, float(O.BS), 0)),
        ("cache block size 2x", lambda: p.cache_full_blocks(req, blocks, 1, 2, 2 * O.BS, 0)),
        ("cache group -1", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, -1)),
        ("cache group 2**31", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, 2 ** 31)),
        ("cache group True", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, True)),
        ("cache group str", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, "0")),
        ("cache mask", lambda: p.cache_full_blocks(req, blocks, 2, 3, O.BS, 0, [True])),
        ("cache keyed", lambda: p.cache_full_blocks(req, blocks, 1, 2, O.BS, 0)),
        ("cache null", lambda: p.cache_full_blocks(req, blocks[:2] + [p.null_block], 2, 3, O.BS, 0)),
        ("cache free block", lambda: p.cache_full_blocks(req, blocks[:2] + [p.blocks[p._case_free]], 2, 3,
                                                         O.BS, 0)),
        ("cache other pool's", lambda: p.cache_full_blocks(req, blocks[:2] + [other.blocks[1]], 2, 3, O.BS, 0)),
        ("cache not a block", lambda: p.cache_full_blocks(req, blocks[:2] + [3], 2, 3, O.BS, 0)),
        ("cache placeholder", lambda: p.cache_full_blocks(req, blocks[:2] + [PendingBlock(p, 1)], 2, 3, O.BS, 0)),
        ("cache no hashes", lambda: p.cache_full_blocks(object(), blocks, 2, 3, O.BS, 0)),
        ("cache hashes tuple", lambda: p.cache_full_blocks(_Hashes(tuple(h)), blocks, 2, 3, O.BS, 0)),
        ("cache hashes short", lambda: p.cache_full_blocks(_Hashes(h[:2]), blocks, 2, 3, O.BS, 0)),
        ("cache hash str", lambda: p.cache_full_blocks(_Hashes(h[:2] + ["x"]), blocks, 2, 3, O.BS, 0)),
        ("cache parent str", lambda: p.cache_full_blocks(_Hashes(h[:1] + ["x", h[2]]), blocks, 2, 3, O.BS, 0)),
        ("cache hash bytearray", lambda: p.cache_full_blocks(_Hashes(h[:2] + [bytearray(h[2])]), blocks, 2, 3,
                                                             O.BS, 0)),
        ("free", lambda: p.free_blocks(blocks[::-1])),
        ("free twice", lambda: p.free_blocks(blocks + blocks[:1])),
        ("free with null", lambda: p.free_blocks([p.null_block] + blocks)),
        ("free a free block", lambda: p.free_blocks(blocks[:1] + [p.blocks[p._case_free]])),
        ("free other pool's", lambda: p.free_blocks(blocks[:1] + [other.blocks[1]])),
        ("free not a block", lambda: p.free_blocks(blocks[:1] + [3])),
        ("free placeholder", lambda: p.free_blocks(blocks[:1] + [PendingBlock(p, 1)])),
        ("free tuple", lambda: p.free_blocks(tuple(blocks))),
        ("touch", lambda: p.touch(blocks + [p.blocks[p._case_free]])),
        ("touch null", lambda: p.touch([p.null_block])),
        ("touch twice", lambda: p.touch([p.blocks[p._case_free]] * 2)),
        ("touch other pool's", lambda: p.touch(blocks[:1] + [other.blocks[1]])),
        ("touch not a block", lambda: p.touch(blocks[:1] + ["x"])),
        ("touch placeholder", lambda: p.touch(blocks[:1] + [PendingBlock(p, 1)])),
        ("lookup hit", lambda: p.get_cached_block(h[0], [0])),
        ("lookup free hit", lambda: p.get_cached_block(driver.request(driver.tokens_of(2)[: O.BS]).block_hashes[0],
                                                       [0])),
        ("lookup miss", lambda: p.get_cached_block(h[2], [0])),
        ("lookup other group", lambda: p.get_cached_block(h[0], [1])),
        ("lookup group True", lambda: p.get_cached_block(h[0], [True])),
        ("lookup group 2**31", lambda: p.get_cached_block(h[0], [2 ** 31])),
        ("lookup groups tuple", lambda: p.get_cached_block(h[0], (0,))),
        ("lookup two groups", lambda: p.get_cached_block(h[0], [0, 0])),
        ("lookup hash str", lambda: p.get_cached_block("x", [0])),
        ("lookup hash bytearray", lambda: p.get_cached_block(bytearray(h[0]), [0])),
    ]


def _prepared(n=8):
    p = DeferredBlockPool(n, True, O.BS, device="cpu")
    toks = driver.tokens_of(3)
    p._case_req = driver.request(toks[: 3 * O.BS])
    gone = p.get_new_blocks(1)
    p.cache_full_blocks(driver.request(driver.tokens_of(2)[: O.BS]), gone, 0, 1, O.BS, 0)
    p.free_blocks(gone)  # a free keyed block
    p._case_free = gone[0].block_id
    p._case_blocks = p.get_new_blocks(3)
    p.cache_full_blocks(p._case_req, p._case_blocks, 0, 2, O.BS, 0)
    return p


QUICK_CASES = (0, 3, 4, 14, 18, 23, 30, 31, 33, 38, 41, 44, 45, 46)  # the rest run with the slow tests (tests/conftest.py, heavy)


@pytest.mark.heavy(*(str(i) for i in range(len(_cases(*[_prepared()] * 2))) if i not in QUICK_CASES))
@pytest.mark.parametrize("case", range(len(_cases(*[_prepared()] * 2))))
def test_quick_ops_take_any_argument_as_the_general_path(case):
    """On the interpreted kernel: a refused quick op falls to the general path, which may run per call (a
    real kernel, which reads the key table the stub does not keep)."""
    other = DeferredBlockPool(4, True, O.BS, device="cpu")
    pools = []
    for quick in (True, False):
        p = _prepared()
        p._engine.quick = quick
        name, call = _cases(p, other)[case]
        pools.append((_outcome(call), p))
    (got, pq), (want, pg) = pools
    assert got == want, name
    for p in (pq, pg):
        p.end_step()
        p.sync("test", window=True)
    assert O.whole_state(pq) == O.whole_state(pg), name


def test_a_pop_from_an_empty_pool_is_refused_quickly_as_generally():
    with stubbed_flush(check=True):
        quick, general = _pair(3)
        for p in (quick, general):
            p.get_new_blocks(2)
        assert _outcome(lambda: quick.get_new_blocks(1)) == _outcome(lambda: general.get_new_blocks(1))
        assert O.whole_state(quick) == O.whole_state(general)


def test_a_touch_of_a_free_block_waits_for_the_placeholders_pops():
    """Placeholders pending (pops past a one-id copy of the free queue), a touch of a free keyed block
    that one of their pops may have taken: the touch synchronises first, so both pools end in the
    same state and read the same block ids."""
    got = []
    with mock.patch.object(fast_path, "FREE_WINDOW", 1), stubbed_flush(check=True):
        for p in _pair(6):
            req = driver.request(driver.tokens_of(1)[: 2 * O.BS])
            kept = [p.blocks[b.block_id] for b in p.get_new_blocks(2)]  # the blocks' own objects, bound
            p.cache_full_blocks(req, kept, 0, 2, O.BS, 0)
            p.free_blocks(kept[::-1])  # two free keyed blocks, at the queue's back
            popped = p.get_new_blocks(4)  # past the copy: placeholders, one of them takes a keyed block
            assert p._engine.dirty
            p.touch(kept)
            got.append(([b.block_id for b in popped], [b.ref_cnt for b in kept], O.whole_state(p)))
    assert got[0] == got[1]
