"""The device replay loop (``replay_on_device``: the model's event loop in one program, many time
points per launch) equals the request-by-request model on the reference pool (docs/semantics.md
section 5), and the CLI's ``--pool both``."""
from __future__ import annotations

import json

import pytest

from hypothesis import given, settings, strategies as st

from gpupool import BlockPool, ReferenceBlockPool, cli
from gpupool.replay import TraceRequest, load_trace, replay
from gpupool.replay.trace import TraceError
from gpupool.replay.device import replay_on_device
from harness.compare import assert_replays_agree
from harness.sizes import sized
from harness.twins import pool_twin


def both(trace, num_blocks, block_size=4, tpot_ms=1.0, points=3, launches=2, **pool_kw):
    """Reference and device replays of ``trace``; the device loop stops every ``points`` time points
    and syncs every ``launches`` launches, so resuming from saved state is exercised too."""
    ref_pool, pool = pool_twin(num_blocks, **pool_kw)
    ref = replay(ref_pool, trace, block_size=block_size, tpot_ms=tpot_ms)
    dev = replay_on_device(pool, trace, block_size=block_size, tpot_ms=tpot_ms, time_points_per_launch=points,
                           launches_per_sync=launches)
    pool.validate()
    return ref, dev


def test_hand_made_trace_with_hits_waits_and_a_rejection():
    trace = [
        TraceRequest(0, 9, 4, (1, 2, 3)),      # 3 blocks, caches 2
        TraceRequest(0, 9, 4, (1, 2, 4)),      # same timestamp: hits what the first cached
        TraceRequest(1, 40, 1, tuple(range(10, 20))),  # total 11 > N-1 = 9: rejected
        TraceRequest(1, 13, 8, (1, 2, 5, 6)),  # must wait for a completion
        TraceRequest(2, 5, 2, (1, 7)),
    ]
    ref, dev = both(trace, 10)
    assert ref.rejected == 1 and ref.hit_blocks > 0 and ref.waited > 0
    assert_replays_agree(ref, dev)
    assert dev.pool == "BlockPool (device loop)" and dev.end_time_ms == ref.end_time_ms


@settings(max_examples=sized(25, 5), deadline=None)
@given(st.data())
def test_random_traces_match_the_reference(data):
    n = data.draw(st.integers(4, 24), label="num_blocks")
    k = data.draw(st.integers(1, 12), label="requests")
    trace, t = [], 0
    for _ in range(k):
        t += data.draw(st.integers(0, 3))
        inp = data.draw(st.integers(1, 20))
        ids = tuple(data.draw(st.lists(st.integers(0, 5), min_size=-(-inp // 4), max_size=-(-inp // 4))))
        trace.append(TraceRequest(t, inp, data.draw(st.integers(0, 12)), ids))
    small_ring = data.draw(st.booleans())
    kw = {"ring_capacity": 1 << max(1, (n - 1).bit_length())} if small_ring else {}
    tpot = data.draw(st.sampled_from([0.0, 0.5, 1.0, 0.1]), label="tpot_ms")  # 0.1: inexact float sums
    ref, dev = both(trace, n, tpot_ms=tpot, points=data.draw(st.integers(1, 8)), **kw)
    assert_replays_agree(ref, dev)
    assert dev.end_time_ms == ref.end_time_ms


@pytest.mark.slow
def test_bundled_trace_prefix_on_a_small_pool_matches():
    trace = load_trace(limit=60)
    ref, dev = both(trace, 300, block_size=512, tpot_ms=20.0)
    assert ref.waited > 0  # the pool is small enough to make requests wait
    assert_replays_agree(ref, dev)


def test_zero_output_and_zero_tpot_finish_at_their_admission_time():
    # A request that finishes when it is admitted completes before the next arrival at that time.
    trace = [TraceRequest(0, 8, 0, (1, 2)), TraceRequest(0, 8, 3, (1, 2)), TraceRequest(0, 9, 0, (1, 2, 3))]
    for tpot in (1.0, 0.0):
        ref, dev = both(trace, 8, tpot_ms=tpot)
        assert_replays_agree(ref, dev)
        assert ref.hit_blocks > 0


@pytest.mark.slow
def test_equal_timestamps_and_heavy_eviction():
    # Many requests at few timestamps through a pool that evicts on nearly every admission.
    trace = [TraceRequest(t // 5, 4 * (1 + t % 4) + 1, 1 + t % 3, tuple(range(t % 6, t % 6 + 1 + t % 4)))
             for t in range(40)]
    ref, dev = both(trace, 9, points=1, launches=1)
    assert ref.waited > 0 and ref.hit_blocks > 0
    assert_replays_agree(ref, dev)


def test_one_launch_runs_the_whole_trace():
    trace = [TraceRequest(t, 9, 2, (t % 3, 7)) for t in range(12)]
    pool = BlockPool(16)
    rep = replay_on_device(pool, trace, block_size=4, tpot_ms=1.0, time_points_per_launch=10_000,
                           launches_per_sync=1)
    assert rep.admitted == 12
    assert rep.free_queue_sha256 == replay(ReferenceBlockPool(16), trace, block_size=4, tpot_ms=1.0).free_queue_sha256


def test_bad_arguments_and_pools_are_refused():
    trace = [TraceRequest(0, 8, 1, (1, 2))]
    for kw in ({"time_points_per_launch": 0}, {"launches_per_sync": 0}, {"block_size": 0},
               {"tpot_ms": float("nan")}):
        with pytest.raises(ValueError):
            replay_on_device(BlockPool(8), trace, **kw)
    with pytest.raises(ValueError, match="events"):
        replay_on_device(BlockPool(8, enable_kv_cache_events=True), trace)
    busy = BlockPool(8)
    busy.get_new_blocks(1)
    with pytest.raises(ValueError, match="in use"):
        replay_on_device(busy, trace)


@pytest.mark.slow
def test_cli_both_on_the_interpreter(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli.main(["replay", "--pool", "both", "--limit", "120", "--json", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["match"] is True and data["mismatched"] == []
    assert data["device"]["requests"] == 120 and data["device"]["hit_blocks"] == data["reference"]["hit_blocks"]
    assert data["device"]["free_queue_sha256"] == data["reference"]["free_queue_sha256"]


@pytest.mark.parametrize("bad", [TraceRequest(float("nan"), 8, 1, (1,)), TraceRequest(float("inf"), 8, 1, (1,)),
                                 TraceRequest(0.0, -5, 1, (1,)), TraceRequest(0.0, 8, -1, (1,)),
                                 TraceRequest(0.0, 8, 1, (1.5,))])
def test_requests_are_checked_like_trace_lines(bad):
    """A TraceRequest the trace loader would refuse is a TraceError (a ValueError) on both replays,
    naming its index: no endless loop on a NaN time, no negative lengths."""
    trace = [TraceRequest(0.0, 8, 1, (1, 2)), bad]
    with pytest.raises(TraceError, match=r"trace\[1\]"):
        replay(ReferenceBlockPool(8), trace, block_size=4)
    with pytest.raises(TraceError, match=r"trace\[1\]"):
        replay_on_device(BlockPool(8), trace, block_size=4)
    with pytest.raises(TypeError):
        replay_on_device(ReferenceBlockPool(8), trace[:1], block_size=4)


def test_a_request_too_large_for_int32_is_rejected_on_both():
    trace = [TraceRequest(0.0, 2**40, 0, ()), TraceRequest(1.0, 8, 1, (1, 2))]
    ref, dev = both(trace, 8)
    assert ref.rejected == dev.rejected == 1
    assert_replays_agree(ref, dev)


def test_progress_moves_as_the_interpreter_works(monkeypatch):
    """In Triton's interpreter the loop syncs after short launches, so the bar moves during the run
    (it once sat at 0 until a single launch had replayed 1,000 time points)."""
    from gpupool.replay import device as dev_mod
    from gpupool.replay.trace import TraceRequest

    seen = []

    class Bar:
        def update(self, n):
            seen.append(n)

        def close(self):
            pass
    monkeypatch.setattr(dev_mod, "progress_bar", lambda progress, total, desc: Bar() if progress else None)
    trace = [TraceRequest(float(i), 8, 1 + i % 3, (i % 4,)) for i in range(24)]
    rep = dev_mod.replay_on_device(BlockPool(64), trace, block_size=4, tpot_ms=1.0, progress=True)
    assert sum(seen) == 24 == rep.requests
    assert len([n for n in seen if n > 0]) >= 2, seen  # in steps, not one jump at the end
