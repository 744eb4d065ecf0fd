"""Other users of a vLLM adapter's device pool (``pool.device_pool``, docs/vllm.md "Other users of the
device pool"): every call goes through the adapter, so the fast path sees another user's change
before it answers from its copies, and answers as the per-call adapter does.

* the case as found: ``sync()``, another user's ``get_new_blocks(2)``, then the adapter's
  ``get_new_blocks(2)``: the adapter gets other blocks, every block is freed once by its holder and
  the pool ends with every block free (over both backends; before, the fast path handed out the other
  user's blocks, and the reference backend popped before refusing);
* a read through ``device_pool`` sees every op the adapter answered; a batched op's recorded error
  is raised at that op's call, nothing changed, and the adapter's next launch runs; ``handle()`` and
  attribute writes are refused, nothing changed;
* a differential soak: vLLM's ops (tests/harness/vllm_ops.py's batch mix, ``end_step``, ``sync``)
  with another user's pops (some keyed), frees, keyed inserts onto the adapter's held blocks and
  touch-and-free of them at random points, on the per-call adapter and on the fast path: every
  answer (the other user's too) and the whole state equal, and each adapter's mirror the pool's.
"""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from gpupool.errors import InvalidArgumentError, InvalidBlockIdError  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

BS = driver.BLOCK_SIZE
BACKENDS = ["reference", "device"]
CLASSES = [BlockPool, DeferredBlockPool]


def make(cls, n, backend, **kw):
    kw.update(device="cpu") if backend == "device" else kw.update(backend="reference")
    return cls(n, True, BS, **kw)


def ids(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_another_users_pop_is_not_handed_out_again(cls, backend):
    p = make(cls, 8, backend)
    if isinstance(p, DeferredBlockPool):
        p.sync()
    theirs = ids(p.device_pool.get_new_blocks(2))
    mine = p.get_new_blocks(2)
    assert not set(theirs) & {b.block_id for b in mine}
    p.end_step()
    p.free_blocks(mine)
    p.device_pool.free_blocks(theirs)
    p.end_step()
    if isinstance(p, DeferredBlockPool):
        p.sync()
    assert p.get_num_free_blocks() == p.device_pool.get_num_free_blocks() == 7
    O.mirror_is_device(p)


def test_a_read_sees_every_op_answered():
    """The fast path's ops wait for a launch; a read through ``device_pool`` launches and checks them
    first."""
    p = make(DeferredBlockPool, 10, "device")
    a = p.get_new_blocks(3)
    p.cache_full_blocks(driver.request(driver.tokens_of(1)[:3 * BS]), a, 0, 2, BS, 0)
    p.free_blocks(a[2:])
    assert p._backend.queued() > 0
    assert p.device_pool.ref_counts() == p._ref
    assert p.device_pool.free_queue()[:1] == [a[2].block_id]
    assert p._backend.queued() == 0


def test_a_batched_error_is_raised_at_its_call():
    """Another user's batched op that fails raises at its call (nothing changed); the adapter's next
    launch runs (it is not made to do nothing by that error)."""
    p = make(DeferredBlockPool, 10, "device")
    a = p.get_new_blocks(2)
    p.end_step()
    p.sync()
    before = (list(p._ref), p.get_num_free_blocks(), p.device_pool.free_queue())
    with pytest.raises(InvalidBlockIdError):
        p.device_pool.free_batched(torch.tensor([13], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    assert (list(p._ref), p.get_num_free_blocks(), p.device_pool.free_queue()) == before
    p.free_blocks(a)
    b = p.get_new_blocks(1)
    p.sync()  # raises nothing: the launch ran
    assert p.device_pool.ref_counts()[b[0].block_id] == 1 and p.syncs.get("op:get_new_blocks", 0) == 0
    O.mirror_is_device(p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_request_manager_and_attribute_writes_are_refused(cls, backend):
    p = make(cls, 6, backend)
    p.get_new_blocks(1)
    before = (list(p._ref), p.get_num_free_blocks())
    with pytest.raises(InvalidArgumentError, match="request manager"):
        p.device_pool.handle()
    with pytest.raises(InvalidArgumentError):
        p.device_pool.num_blocks = 3
    with pytest.raises(AttributeError):
        p.device_pool._lock
    assert (list(p._ref), p.get_num_free_blocks()) == before and p.device_pool.num_blocks == 6


def other_user(p, op, reqs, theirs):
    """One op of another user of ``p.device_pool`` (``theirs``: the blocks it holds, oldest first);
    returns what it read."""
    kind, dp = op[0], p.device_pool
    if kind == "o_pop":
        if dp.get_num_free_blocks() < op[1]:
            return None
        got = ids(dp.get_new_blocks(op[1]))
        theirs += got
        if op[2] is not None:  # keyed: the first block under the chain of a seed
            dp.cache_full_blocks(got[:1], driver.chain(driver.tokens_of(op[2])), 0, 1, BS, 0)
        return got
    if kind == "o_free" and theirs:
        k = op[1] % len(theirs)
        dp.free_blocks([theirs.pop(k)])
        return k
    held = [b.block_id for b in reqs[op[1] % len(reqs)]["blocks"] if not b.is_null] if reqs else []
    held = [b for b in held if p.blocks[b].ref_cnt > 0]
    if kind == "o_key":  # a keyed insert onto a block the adapter holds, not keyed yet
        free_of_keys = [b for b in held if p.blocks[b].block_hash is None]
        if free_of_keys:
            dp.cache_full_blocks(free_of_keys[:1], driver.chain(driver.tokens_of(op[2])), 0, 1, BS, 0)
            return free_of_keys[0]
    elif kind == "o_touchfree" and held:  # a touch and a free of the adapter's held blocks
        dp.touch(held)
        dp.free_blocks(held)
        return held
    return None


OTHER = st.one_of(
    st.tuples(st.just("o_pop"), st.integers(1, 3), st.one_of(st.none(), O.SEED)),
    st.tuples(st.just("o_free"), st.integers(0, 7)),
    st.tuples(st.just("o_key"), O.R, O.SEED),
    st.tuples(st.just("o_touchfree"), O.R),
)
OPS = st.one_of(O.BATCH_OPS, OTHER, OTHER, st.tuples(st.just("end_step")), st.tuples(st.just("sync")))


def soak(p, ops) -> list:
    """``ops`` on ``p``: every answer (PoolError types included), then the whole state and the check
    that the mirror is the pool's."""
    seen, theirs = [], []
    O.run_mixed(p, ops, other_user, [], seen, theirs)
    seen = [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s for s in seen]
    if isinstance(p, DeferredBlockPool):
        p.sync()
    O.mirror_is_device(p)
    return [seen, theirs, driver.snapshot(p)]


def check_soak(ops, n, window, launch, backend):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast_path, "FREE_WINDOW", window)
        mp.setattr(DeferredBlockPool, "launch_every", launch)
        got = [soak(make(cls, n, backend), ops) for cls in CLASSES]
    assert got[0] == got[1]


@settings(max_examples=max(60, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=30), n=st.sampled_from([6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=st.sampled_from([1, 4]))
def test_soak_with_another_user_reference(ops, n, window, launch):
    check_soak(ops, n, window, launch, "reference")


@pytest.mark.slow  # 20 examples, about 40 s
@settings(max_examples=max(20, settings().max_examples // 3), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=24), n=st.sampled_from([6, 12]), window=st.sampled_from([1, 3, 2048]),
       launch=st.sampled_from([1, 4]))
def test_soak_with_another_user_device(ops, n, window, launch):
    check_soak(ops, n, window, launch, "device")
