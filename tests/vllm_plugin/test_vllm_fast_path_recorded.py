"""``DeferredBlockPool`` when the device pool's status word holds an error the host did not predict
(another user of the device pool made a batched op fail): the launches that error made do nothing are
launched again at the next synchronisation, which then raises it with the mirror exact, so no op is
kept on the host that the device did not run and no block is handed out twice.

* the scenario as found: a failed batched op, a pop, syncs, another pop: the second pop's blocks
  differ from the first's, which stay held (ref 1 on the device);
* differential (hypothesis): tests/vllm_plugin/test_vllm_fast_path_orders.py's op mix with such errors recorded
  at random points (each followed by a ``sync``, which raises it once, or by the device pool's own
  ``check`` where nothing waits to be synchronised) against the per-call adapter
  without them: every answer, every id and the whole state equal.
"""
from harness.paths import CONFORMANCE
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from gpupool.errors import InvalidBlockIdError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

BS = driver.BLOCK_SIZE


def record_error(pool) -> None:
    """A batched op that fails on the device (an id out of range), made on the pool past the adapter
    (``device_pool`` would raise it at the call): its error recorded in the status word, nothing changed."""
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    pool._backend.pool.free_batched(i32([pool.num_gpu_blocks + 3]), i32([0, 1]))


def test_no_block_handed_out_twice():
    p = DeferredBlockPool(16, True, BS, device="cpu")
    record_error(p)
    a = p.get_new_blocks(2)
    p.end_step()  # launched after the recorded error: did nothing on the device
    with pytest.raises(InvalidBlockIdError):
        p.sync()  # launched again, then the recorded error raised, once
    p.sync()
    b = p.get_new_blocks(2)
    p.sync()
    ids_a, ids_b = [x.block_id for x in a], [x.block_id for x in b]
    assert not set(ids_a) & set(ids_b), (ids_a, ids_b)
    assert [p.device_pool.ref_counts()[i] for i in ids_a + ids_b] == [1] * 4
    assert p._ref[:16] == p.device_pool.ref_counts()
    p.device_pool.validate()


def test_placeholders_and_cachings_are_launched_again(monkeypatch):
    """Pops past the host's copy of the queue (placeholders) and a caching of them, launched after the
    recorded error: launched again, bound to the same blocks as the per-call pool's."""
    from gpupool.vllm import fast_path
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    out = []
    for p in (BlockPool(12, True, BS, device="cpu"), DeferredBlockPool(12, True, BS, device="cpu")):
        r = driver.request(driver.tokens_of(1)[:4 * BS])
        first = p.get_new_blocks(1)
        p.end_step()
        blocks = first + p.get_new_blocks(3)  # deferred: placeholders
        if isinstance(p, DeferredBlockPool):
            record_error(p)
        p.cache_full_blocks(r, blocks, 0, 4, BS, 0)
        if isinstance(p, DeferredBlockPool):
            with pytest.raises(InvalidBlockIdError):
                p.sync()
        out.append(([b.block_id for b in blocks], driver.snapshot(p)))
    assert out[0] == out[1]


RECORDED = st.tuples(st.just("recorded"))
OPS = st.one_of(O.BATCH_OPS, RECORDED, RECORDED, st.tuples(st.just("end_step")))


def _run(pool, ops):
    reqs, seen = [], []
    for op in ops:
        if op[0] == "end_step":
            pool.end_step()
        elif op[0] == "recorded":
            if isinstance(pool, DeferredBlockPool):  # the per-call pool never sees it
                record_error(pool)
                try:
                    pool.sync()
                except InvalidBlockIdError:
                    continue
                with pytest.raises(InvalidBlockIdError):  # nothing to synchronise: still recorded
                    pool._backend.pool.check()
        else:
            O.apply_op(pool, op, reqs, seen)
    return [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s
            for s in seen]


@settings(max_examples=min(8, settings().max_examples), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=24), n=st.sampled_from([6, 12]))
def test_recorded_errors_lose_nothing(ops, n):
    per_call = BlockPool(n, True, BS, device="cpu")
    deferred = DeferredBlockPool(n, True, BS, device="cpu")
    assert _run(per_call, ops) == _run(deferred, ops)
    deferred.sync()
    assert driver.snapshot(per_call) == driver.snapshot(deferred)
    assert (deferred._ref, deferred._keys, deferred._ntok) == (per_call._ref, per_call._keys, per_call._ntok)
    deferred.device_pool.validate()
    assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
    assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()
