"""The flush stub of bench/vllm_host.py's host-time headline (tests/harness/flush_stub.py) gives what
the interpreted kernel gives: a fast path over it and one over the real kernel, on the same ops, read
the same answers while running (ids handed out, ref counts, hashes, free counts), synchronise for the
same reasons as often, and end in the same whole state (the device pool's free queue, ref counts, keys
and covered tokens; the mirror; the key insertion counter; vLLM's view of the pool); and the stubbed
ring is the reference's free queue after every launch. No Triton launch but the stub's runs on a
stubbed pool (its key table is not kept).
"""
from harness.paths import CONFORMANCE
import os
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.instrument import Meter  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness import vllm_ops as O  # noqa: E402
from harness.flush_stub import StubLimitError, stubbed_flush  # noqa: E402

# the batch's ops, end_step (a launch) and a sync; not evict (a per-call op: a real kernel)
OPS = st.one_of(O.ALLOC, O.ALLOC, O.ALLOC, O.FREE, O.FREE, O.IDS,
                st.tuples(st.just("cache"), O.R, st.integers(1, 3)), st.tuples(st.just("free1"), O.R, st.integers(0, 3)),
                st.tuples(st.just("hit"), O.SEED), st.tuples(st.just("hitfree"), O.SEED), st.tuples(st.just("share"), O.R),
                st.tuples(st.just("cow"), O.R), st.tuples(st.just("refs"), O.R),
                st.tuples(st.just("end_step")), st.tuples(st.just("end_step")), st.tuples(st.just("sync")))


def _both(ops, n, keys_from=None):
    """The op list on the interpreted kernels and on the stub (``keys_from``: cachings keyed on the
    device from this many a launch, as a GPU pool keys them; None: on the host, a CPU pool's way)."""
    real = DeferredBlockPool(n, True, O.BS, device="cpu")
    real._engine.backend.pool.device_keys_from = keys_from
    want = O.run_stepped(real, ops), O.whole_state(real)
    if keys_from is not None:  # the device's keys are the host's: every key the mirror holds is found there
        O.mirror_is_device(real)
    with Meter() as m, stubbed_flush(check=True) as stub:
        stubbed = DeferredBlockPool(n, True, O.BS, device="cpu")
        stubbed._engine.backend.pool.device_keys_from = keys_from
        got = O.run_stepped(stubbed, ops), O.whole_state(stubbed)
    assert m.launches == stub.launches, "a real kernel ran on a stubbed pool"
    assert stub.launches - stub.key_launches == stubbed.flushes
    assert got == want
    return stub.key_launches


@settings(max_examples=10, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=30), n=st.sampled_from([8, 24]))
@example(ops=[("alloc", 3, 0, 0), ("free", 0), ("end_step",), ("alloc", 2, 0, 0), ("sync",)], n=8)  # front frees
@example(ops=[("alloc", 3, 1, 3), ("free", 0), ("sync",), ("hit", 1), ("alloc", 2, 0, 0), ("sync",)], n=8)  # hit unlinks
def test_stub_equals_kernel(ops, n):
    _both(ops, n)


@pytest.mark.slow
@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=60), n=st.sampled_from([6, 24, 64]))
def test_stub_equals_kernel_many(ops, n):
    _both(ops, n)


@pytest.mark.slow
@settings(max_examples=4, deadline=None)  # the interpreted keys kernel: about 0.2 s a launch
@given(ops=st.lists(OPS, min_size=4, max_size=20), n=st.sampled_from([8, 24]))
@example(ops=[("alloc", 3, 1, 3), ("alloc", 2, 0, 2), ("end_step",), ("hit", 1), ("cache", 0, 2), ("free", 1),
              ("end_step",), ("alloc", 2, 2, 0), ("sync",)], n=24)  # keys named at a sync, a hit on one
def test_stub_equals_kernel_keys_on_the_device(ops, n):
    """Every caching keyed on the device (the device-keys kernel interpreted against its stand-in)."""
    _both(ops, n, keys_from=1)


def test_the_example_keys_on_the_device():
    """The example above launches the device-keys kernel (else it compares nothing new)."""
    assert _both([("alloc", 3, 1, 3), ("alloc", 2, 0, 2), ("end_step",)], 24, keys_from=1) >= 1


@pytest.mark.slow  # the interpreted kernel on a pool of 6,000 blocks: about 10 s
def test_stub_decode_workload():
    """bench/vllm_host.py's pool-level step (pops, frees, a prefix hit, cachings), long enough for
    refills of the host's copy of the free queue."""
    sys.path.insert(0, str(CONFORMANCE.parents[2] / "bench"))
    import vllm_host

    def drive(pool):
        ids = []
        state = vllm_host.warm(pool, 24, pool.end_step)
        vllm_host._steps(pool, state[0], state[1], state, 20, lambda: (pool.end_step(), ids.append(
            [b.block_id for q in state[0] for b in q[1]])))
        pool.sync("test", window=True)
        return ids, O.whole_state(pool)

    want = drive(DeferredBlockPool(6000, True, vllm_host.BS, device="cpu"))
    with stubbed_flush(check=True):
        got = drive(DeferredBlockPool(6000, True, vllm_host.BS, device="cpu"))
    assert got == want
    assert want[1]["syncs"], "the workload refills the copy of the free queue"


def test_stub_refuses_what_it_does_not_model():
    """A pool that ran device work before the stub saw it, and an op the reference refuses, raise
    StubLimitError (a PoolError), not a wrong answer."""
    pool = DeferredBlockPool(8, True, O.BS, device="cpu")
    pool.get_new_blocks(2)
    pool.end_step()
    pool.sync()  # launched on the real kernel
    with stubbed_flush():
        pool.get_new_blocks(1)
        with pytest.raises(StubLimitError):
            pool.sync()


SCHEDULER_RUN = r'''
import contextlib, json, os, sys
sys.path[:0] = [sys.argv[1] + "/bench", sys.argv[1] + "/tests"]
import vllm_host as vh
if vh.vllm_pool() is None:
    print(json.dumps(None))
    raise SystemExit(0)
from harness.flush_stub import stubbed_flush
from harness.state import pool_state
from gpupool.instrument import Meter


def run(stubbed):
    with (stubbed_flush(check=True) if stubbed else contextlib.nullcontext()) as stub, Meter() as m:
        # bench/vllm_host.py's scheduler loop: arrivals with a shared prefix (hits) and a pool short
        # enough to preempt
        lp = vh.SchedulerLoop("gpupool", dict(running=40, prompt=17, arrivals=1, blocks=1.2), [0.0])
        outs, schedule = [], lp.sched.schedule

        def recorded(*a, **k):
            out = schedule(*a, **k)
            outs.append([[(n.req_id, [list(b) for b in n.block_ids]) for n in out.scheduled_new_reqs],
                         [(r, None if nb is None else [list(b) for b in nb]) for r, nb in
                          zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_block_ids)],
                         sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids or ())])
            return out
        lp.sched.schedule = recorded
        lp.steps(int(sys.argv[2]))
        pool = lp.sched.kv_cache_manager.block_pool
        pool.sync("test", window=True)
        state = [pool_state(pool._dev), int(pool._dev.counters()[2]), pool._ref,
                 [[k.hex() for k in ks] for ks in pool._keys], pool._ntok, sorted((k.hex(), sorted(v.items())) for k, v in pool.mirror.holders.items()),
                 dict(pool.syncs), pool.flushes]
    if stubbed and m.launches != stub.launches:
        raise SystemExit("a real kernel ran on a stubbed pool")
    return outs, state, pool.flushes


want, got = run(False), run(True)
print(json.dumps({"equal": want[:2] == got[:2], "flushes": want[2], "preempted": sum(len(o[3]) for o in want[0])}))
'''


@pytest.mark.slow
def test_stub_equals_kernel_in_vllms_scheduler(tmp_path):
    """vLLM 0.33's scheduler over the fast path, stubbed and interpreted, on bench/vllm_host.py's loop
    with prefix hits and preemptions: every step's SchedulerOutput (new requests' blocks, running
    requests' new blocks, tokens, preemptions) and the whole state at the end are equal."""
    import json
    import subprocess

    from harness.timeouts import scaled

    root = CONFORMANCE.parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    proc = subprocess.run([sys.executable, "-c", SCHEDULER_RUN, str(root), "24"], capture_output=True, text=True,
                          env=env, timeout=scaled(900), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("vLLM 0.33's source is not available (GPUPOOL_VLLM_SRC or the tests' cache)")
    assert out["equal"]
    assert out["flushes"] >= 4 and out["preempted"] > 0, out
