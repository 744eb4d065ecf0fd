"""Tests of gpupool.replay (docs/semantics.md section 5) and the ``gpupool replay`` command.

The small traces use block_size 4 and tpot 1 ms; every expected op sequence, free queue and count
below was worked out by hand from docs/semantics.md sections 2 and 5 (the comments show the steps).
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest

import gpupool
from gpupool import ReferenceBlockPool
from gpupool import cli
from gpupool.cli import replay as replay_cmd
from gpupool.replay import (
    DEFAULT_NUM_BLOCKS, ReplayReport, TraceRequest, free_queue_digest, load_trace, replay,
)

ALLOWED = {"get_cached_block", "touch", "get_new_blocks", "cache_full_blocks", "free_blocks",
           "get_num_free_blocks", "free_queue", "ref_counts", "num_blocks"}


class RecordingPool:
    """A reference pool that exposes only the conformance names replay may use and logs the changes."""

    def __init__(self, num_blocks: int):
        self._pool = ReferenceBlockPool(num_blocks)
        self.log: list[tuple] = []

    def __getattr__(self, name):
        if name not in ALLOWED:
            raise AttributeError(f"replay used {name!r}, which is not a conformance name it may use")
        return getattr(self._pool, name)

    def get_new_blocks(self, n):
        got = self._pool.get_new_blocks(n)
        self.log.append(("new", n, list(got)))
        return got

    def free_blocks(self, ids):
        ids = list(ids)
        self.log.append(("free", ids))
        return self._pool.free_blocks(ids)

    def touch(self, ids):
        ids = list(ids)
        self.log.append(("touch", ids))
        return self._pool.touch(ids)


def req(t, inp, out, ids):
    return TraceRequest(t, inp, out, tuple(ids))


def digest(ids):
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def run(n, trace, **kw):
    pool = RecordingPool(n)
    rep = replay(pool, trace, block_size=4, tpot_ms=1.0, **kw)
    pool._pool.validate()
    return pool, rep


def test_prefix_hit_and_last_token_rule():
    # N=10: queue [1..9]. A (t=0, 9 tokens: full 2, ids 1,2,3; total ceil(12/4)=3) -> new(3)=[1,2,3],
    # blocks 1,2 cached; done at 3: free [3,2,1] -> 3 front, 2,1 back: [3,4,5,6,7,8,9,2,1].
    # B (t=10, 9 tokens, ids 1,2,7): candidates min(2, 8//4)=2, both hit (blocks 1,2) -> touch [1,2],
    # new(1)=[3]; done at 13 -> [3,4,...,9,2,1] again.
    # C (t=20, 8 tokens, ids 1,2, output 1): candidates (8-1)//4 = 1, so only block 1 hits although
    # block 2 holds hash 2; total ceil(9/4)=3 -> touch [1], new(2)=[3,4]; block 3 is cached under
    # hash 2 too. Done at 21: free [4,3,1] -> 4 front, 3,1 back: [4,5,6,7,8,9,2,3,1].
    trace = [req(0, 9, 3, [1, 2, 3]), req(10, 9, 3, [1, 2, 7]), req(20, 8, 1, [1, 2])]
    pool, rep = run(10, trace)
    assert pool.log == [
        ("new", 3, [1, 2, 3]), ("free", [3, 2, 1]),
        ("touch", [1, 2]), ("new", 1, [3]), ("free", [3, 2, 1]),
        ("touch", [1]), ("new", 2, [3, 4]), ("free", [4, 3, 1]),
    ]
    assert (rep.requests, rep.admitted, rep.rejected, rep.waited) == (3, 3, 0, 0)
    assert (rep.prompt_blocks, rep.hit_blocks) == (6, 3)
    assert rep.hit_ratio == pytest.approx(0.5)
    assert pool.free_queue() == [4, 5, 6, 7, 8, 9, 2, 3, 1]
    assert rep.free_queue_sha256 == digest([4, 5, 6, 7, 8, 9, 2, 3, 1])
    # hash 2 now maps to blocks 2 and 3; the earliest inserted (2) answers.
    assert pool.get_cached_block(hashlib.sha256(b"2").digest(), [0]) == [2]
    assert rep.end_time_ms == 21.0


def test_head_of_line_blocking():
    # N=6: queue [1..5]. A (t=0, 12 tokens, out 4: total 4) -> new(4)=[1,2,3,4], done at 4.
    # B (t=1, total ceil(12/4)=3) does not fit (1 free) and waits; C (t=2, total 1) would fit in the
    # one free block but waits behind B. At 4: free [4,3,2,1] -> [4,5,3,2,1]; B: new(3)=[4,5,3]
    # (done at 8), then C: new(1)=[2] (done at 5). At 5: free [2] -> [2,1]. At 8: free [3,5,4]:
    # 3 un-hashed (its full blocks are 4,5) to the front, 5,4 to the back -> [3,2,1,5,4].
    trace = [req(0, 12, 4, [10, 11, 12]), req(1, 8, 4, [20, 21]), req(2, 1, 1, [30])]
    pool, rep = run(6, trace)
    assert pool.log == [
        ("new", 4, [1, 2, 3, 4]), ("free", [4, 3, 2, 1]),
        ("new", 3, [4, 5, 3]), ("new", 1, [2]),
        ("free", [2]), ("free", [3, 5, 4]),
    ]
    assert (rep.admitted, rep.rejected, rep.waited) == (3, 0, 2)
    assert (rep.prompt_blocks, rep.hit_blocks, rep.hit_ratio) == (5, 0, 0.0)
    assert rep.peak_blocks_in_use == 4
    assert rep.free_queue_sha256 == digest([3, 2, 1, 5, 4])


def test_rejection_does_not_block_and_total_n_minus_1_fits():
    # N=4 (3 usable). A (t=0, total ceil(17/4)=5 > 3) is rejected and does not block B (t=0,
    # total 2): new(2)=[1,2], block 1 cached; done at 4. C (t=1, total ceil(12/4)=3 = N-1) waits
    # until 4: free [2,1] -> [2,3,1]; new(3)=[2,3,1]; done at 8: free [1,3,2] -> 1 front -> [1,3,2].
    trace = [req(0, 16, 1, [1, 2, 3, 4]), req(0, 4, 4, [5]), req(1, 8, 4, [40, 41])]
    pool, rep = run(4, trace)
    assert pool.log == [("new", 2, [1, 2]), ("free", [2, 1]), ("new", 3, [2, 3, 1]), ("free", [1, 3, 2])]
    assert (rep.requests, rep.admitted, rep.rejected, rep.waited) == (3, 2, 1, 1)
    assert rep.prompt_blocks == 1 + 2  # the rejected request's 4 full blocks do not count
    assert rep.free_queue_sha256 == digest([1, 3, 2])


def test_completions_before_arrivals_at_equal_times():
    # N=5: queue [1..4]. A (t=0, 4 tokens, ids [1], out 4: total 2) -> new(2)=[1,2], block 1 cached
    # under hash 1; done at 4. B arrives at 4 (8 tokens, ids [1,2], out 1): candidates 7//4 = 1.
    # Completion first: free [2,1] -> [2,3,4,1]; B hits block 1 (ref 0): touch [1], new(2)=[2,3];
    # block 2 cached under hash 2; done at 5: free [3,2,1] -> 3 front, 2,1 back: [3,4,2,1].
    # (Arrival first would have taken new(2)=[3,4] while A still held block 2.)
    trace = [req(0, 4, 4, [1]), req(4, 8, 1, [1, 2])]
    pool, rep = run(5, trace)
    assert pool.log == [("new", 2, [1, 2]), ("free", [2, 1]), ("touch", [1]), ("new", 2, [2, 3]),
                        ("free", [3, 2, 1])]
    assert (rep.hit_blocks, rep.prompt_blocks, rep.waited) == (1, 3, 0)
    assert rep.free_queue_sha256 == digest([3, 4, 2, 1])


def test_free_hit_blocks_count_against_the_free_blocks():
    # N=5. A (t=0, 4 tokens, ids [1], out 1: total 2) -> [1,2], block 1 cached; done at 1:
    # free [2,1] -> [2,3,4,1]. C (t=2, 1 token, out 4: total 2) -> new(2)=[2,3], done at 6: queue [4,1].
    # B (t=3, 8 tokens, ids [1,5], out 4: total 3) hits block 1 (ref 0): new 2 <= 2 free, but block 1
    # is one of those 2, so new + 1 > 2 and B waits. At 6: free [3,2] -> [3,2,4,1]; B: touch [1],
    # new(2)=[3,2], block 3 cached under hash 5; done at 10: free [2,3,1] -> [2,4,3,1].
    trace = [req(0, 4, 1, [1]), req(2, 1, 4, [9]), req(3, 8, 4, [1, 5])]
    pool, rep = run(5, trace)
    assert pool.log == [("new", 2, [1, 2]), ("free", [2, 1]), ("new", 2, [2, 3]), ("free", [3, 2]),
                        ("touch", [1]), ("new", 2, [3, 2]), ("free", [2, 3, 1])]
    assert (rep.waited, rep.hit_blocks, rep.prompt_blocks) == (1, 1, 3)
    assert rep.free_queue_sha256 == digest([2, 4, 3, 1])


def test_equal_finish_times_free_in_admission_order():
    # N=5. X (t=0, 1 token, out 4: total 2, no full block) -> [1,2], done at 4. Y (t=2, out 2:
    # total 1) -> [3], done at 4 too. (finish, admission order): X first: free [2,1] -> [2,1,4],
    # then Y: free [3] -> [3,2,1,4] (un-hashed blocks are prepended, LIFO).
    trace = [req(0, 1, 4, [7]), req(2, 1, 2, [8])]
    pool, rep = run(5, trace)
    assert [e for e in pool.log if e[0] == "free"] == [("free", [2, 1]), ("free", [3])]
    assert pool.free_queue() == [3, 2, 1, 4]
    assert rep.free_queue_sha256 == digest([3, 2, 1, 4])
    assert (rep.prompt_blocks, rep.hit_ratio) == (0, 0.0)


def test_zero_output_finishes_before_a_later_arrival_at_the_same_time():
    # A (t=0, 4 tokens, ids [9], out 0: total 1) is admitted and finishes at t=0; that completion
    # comes before B's arrival at t=0, so B (8 tokens, ids [9,10]) hits the freed block 1.
    trace = [req(0, 4, 0, [9]), req(0, 8, 1, [9, 10])]
    pool, rep = run(4, trace)
    assert pool.log[:3] == [("new", 1, [1]), ("free", [1]), ("touch", [1])]
    assert rep.hit_blocks == 1


def test_short_hash_ids_clamp_full_blocks():
    # 12 tokens at block size 4 would be 3 full blocks, but the line has one id: full = 1.
    trace = [req(0, 12, 1, [5]), req(1, 12, 1, [5])]
    pool, rep = run(8, trace)
    assert (rep.prompt_blocks, rep.hit_blocks) == (2, 1)


def test_replay_arguments_and_busy_pool_are_rejected():
    pool = ReferenceBlockPool(8)
    with pytest.raises(ValueError, match="block_size"):
        replay(pool, [], block_size=0)
    with pytest.raises(ValueError, match="tpot_ms"):
        replay(pool, [], tpot_ms=-1.0)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="no block in use"):
        replay(pool, [req(0, 4, 1, [1])])
    empty = replay(ReferenceBlockPool(4), [])
    assert (empty.requests, empty.hit_ratio) == (0, 0.0)
    assert empty.free_queue_sha256 == free_queue_digest([1, 2, 3])


def test_load_bundled_trace_and_limit():
    trace = load_trace()
    assert len(trace) == 12031
    assert trace[0] == TraceRequest(0, 6758, 500, tuple(range(14)))
    assert all(trace[i].timestamp <= trace[i + 1].timestamp for i in range(len(trace) - 1))
    first = load_trace(limit=5)
    assert first == trace[:5]
    assert load_trace(limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_trace(limit=-1)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 1, "input_length": 4, "output_length": 1}', "missing field.*hash_ids"),
    ('{"timestamp": 1, "input_length": -4, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 1, "input_length": 4, "output_length": 1.5, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1.5]}', r"hash_ids\[0\]"),
    ('{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": []}', "hash_ids has empty"),
    ('{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids has 1 ids"),
    ("[1, 2]", "JSON object"),
])
def test_load_trace_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        load_trace(path)
    assert "line 3" in str(e.value)


@pytest.mark.slow
def test_full_bundled_trace_on_the_reference_pool():
    """Golden numbers of the whole bundled trace at the defaults (block 512, tpot 20 ms)."""
    rep = replay(ReferenceBlockPool(DEFAULT_NUM_BLOCKS), load_trace())
    assert (rep.requests, rep.admitted, rep.rejected, rep.waited) == (12031, 12031, 0, 0)
    assert (rep.prompt_blocks, rep.hit_blocks, rep.peak_blocks_in_use) == (276491, 77994, 1697)
    assert rep.free_queue_sha256 == "6f106d12b4095888e826395f397026ad2471bfa29e63df8042c1bfb182a94baa"
    assert rep.wall_s < 30


def test_cli_replay_reference_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli.main(["replay", "--pool", "reference", "--limit", "300", "--json", str(out), "--no-progress"])
    assert rc == 0
    whole = json.loads(out.read_text())
    assert whole["device"] is None and whole["limit"] == 300
    data = whole["reference"]
    expect = replay(ReferenceBlockPool(DEFAULT_NUM_BLOCKS), load_trace(limit=300))
    for name in ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256"):
        assert data[name] == getattr(expect, name), name
    assert data["requests"] == 300 and data["admitted"] + data["rejected"] == 300
    assert data["hit_ratio"] == pytest.approx(data["hit_blocks"] / data["prompt_blocks"])
    assert (data["pool"], data["num_blocks"], data["block_size"], data["tpot_ms"]) == \
        ("ReferenceBlockPool", DEFAULT_NUM_BLOCKS, 512, 20.0)
    assert data["wall_s"] > 0 and data["requests_per_s"] > 0
    text = capsys.readouterr().out
    assert "hit ratio" in text and data["free_queue_sha256"] in text


def test_cli_errors(tmp_path, capsys, monkeypatch):
    assert cli.main(["replay", str(tmp_path / "missing.jsonl"), "--pool", "reference"]) != 0
    assert "trace file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert cli.main(["replay", str(bad), "--pool", "reference"]) != 0
    assert "line 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--num-blocks", "0"])
    assert e.value.code == 2
    def missing(name):  # as if the device pool were missing (gpupool resolves BlockPool on first use)
        raise AttributeError(name)

    monkeypatch.setattr(gpupool, "__getattr__", missing)
    # make_pool may set TRITON_INTERPRET for a CPU device; keep that from leaking into other tests.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    assert cli.main(["replay", "--pool", "device", "--device", "cpu", "--limit", "5"]) == 2
    assert "gpupool.BlockPool is not available" in capsys.readouterr().err


class _NoHitPool(ReferenceBlockPool):
    def get_cached_block(self, block_hash, group_ids):
        return None


@pytest.mark.parametrize("device_cls, rc", [(ReferenceBlockPool, 0), (_NoHitPool, 1)])
def test_cli_both_compares_the_pools(tmp_path, capsys, monkeypatch, device_cls, rc):
    real = replay_cmd.make_pool

    def fake_make_pool(kind, num_blocks, device=None):
        return device_cls(num_blocks) if kind == "device" else real(kind, num_blocks, device)

    monkeypatch.setattr(replay_cmd, "make_pool", fake_make_pool)
    out = tmp_path / "both.json"
    assert cli.main(["replay", "--pool", "both", "--device", "cpu", "--json", str(out), "--no-progress"]) == rc
    data = json.loads(out.read_text())
    assert data["checked_requests"] == replay_cmd.CPU_DEVICE_DEFAULT_LIMIT  # the CPU-interpreter default limit applied
    assert data["reference"]["requests"] == data["device"]["requests"] == replay_cmd.CPU_DEVICE_DEFAULT_LIMIT
    assert data["match"] is (rc == 0) and data["speedup"] is None  # no speed from the interpreter
    captured = capsys.readouterr()
    assert "replay the first 200 requests" in captured.out and "speed           not compared" in captured.out
    if rc:
        assert "hit_blocks" in data["mismatched"] and "MISMATCH hit_blocks" in captured.err
        assert data["device"]["hit_blocks"] == 0 < data["reference"]["hit_blocks"]
    else:
        assert data["reference"]["free_queue_sha256"] == data["device"]["free_queue_sha256"]


def test_report_json_names():
    d = ReplayReport("P", 8, 4, 1.0).to_json_dict()
    for name in ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "hit_ratio",
                 "free_queue_sha256", "wall_s", "requests_per_s", "num_blocks", "block_size", "tpot_ms", "pool"):
        assert name in d
