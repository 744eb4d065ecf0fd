"""The batched device replay (one ``admission_step`` launch per time point) equals the
request-by-request model on the reference pool (docs/semantics.md section 5), and the CLI's ``--pool both``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from gpupool import BlockPool, ReferenceBlockPool, cli
from gpupool.replay import TraceRequest, load_trace, replay
from gpupool.replay.device import replay_batched
from pool_helpers import sized

FIELDS = ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256", "waited",
          "peak_blocks_in_use")


def both(trace, num_blocks, block_size=4, tpot_ms=1.0, **pool_kw):
    ref = replay(ReferenceBlockPool(num_blocks), trace, block_size=block_size, tpot_ms=tpot_ms)
    pool = BlockPool(num_blocks, **pool_kw)
    dev = replay_batched(pool, trace, block_size=block_size, tpot_ms=tpot_ms)
    pool.validate()
    return ref, dev


def assert_same(ref, dev):
    for f in FIELDS:
        assert getattr(ref, f) == getattr(dev, f), f


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
    assert_same(ref, dev)
    assert dev.pool == "BlockPool (batched)"


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
        trace.append(TraceRequest(t, inp, data.draw(st.integers(1, 12)), ids))
    small_ring = data.draw(st.booleans())
    kw = {"ring_capacity": 1 << max(1, (n - 1).bit_length())} if small_ring else {}
    ref, dev = both(trace, n, **kw)
    assert_same(ref, dev)


def test_bundled_trace_prefix_on_a_small_pool_matches():
    trace = load_trace(limit=60)
    ref, dev = both(trace, 300, block_size=512, tpot_ms=20.0)
    assert ref.waited > 0  # the pool is small enough to make requests wait
    assert_same(ref, dev)


def test_zero_output_falls_back_to_the_request_model():
    trace = [TraceRequest(0, 8, 0, (1, 2)), TraceRequest(0, 8, 3, (1, 2))]
    ref, dev = both(trace, 8)
    assert_same(ref, dev)
    assert dev.pool == "BlockPool"  # the fallback drives the single ops


@pytest.mark.slow
def test_cli_both_on_the_interpreter(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli.main(["replay", "--pool", "both", "--limit", "200", "--json", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["match"] is True and data["mismatched"] == []
    assert data["device"]["requests"] == 200 and data["device"]["hit_blocks"] == data["reference"]["hit_blocks"]
    assert data["device"]["free_queue_sha256"] == data["reference"]["free_queue_sha256"]
