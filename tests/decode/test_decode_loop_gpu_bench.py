"""bench/decode_loop_gpu.py on a CPU (its figures need a GPU; here the pool's kernels run in Triton's
interpreter): bad flags end with a usage message, ``--table`` prints a run's rows, and (slow) a steady
decode run decodes exactly one token a lane and pass without stops, and with ``--stops`` keeps its lanes
full by replacing the requests that stopped. The tokens themselves: tests/gpu/test_window_graph.py."""
from __future__ import annotations

import json
import sys

import pytest

from harness.paths import BENCH

sys.path.insert(0, str(BENCH))
import decode_loop_gpu as bench  # noqa: E402

pytestmark = pytest.mark.strict_gpu_off  # the loop's kernels run under --strict-gpu in their own tests

SMALL = ["--device", "cpu", "--batch", "2", "--iters", "2", "--warmup", "1", "--no-graph", "--hidden", "64",
         "--layers", "1", "--dtype", "float32", "--modes", "host", "window", "--steps", "2"]


@pytest.mark.parametrize("flags", [["--draft", "0"], ["--spec-steps", "65"], ["--hidden", "100"], ["--max-new", "1"],
                                   ["--max-num-reqs", "1"], ["--warmup", "-1"], ["--compile-jobs", "-1"],
                                   ["--table", "/nonexistent/rows.json"], ["--modes", "burst"]])
def test_bad_flags_end_with_a_usage_message(flags, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--no-graph", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_the_table_of_a_run(tmp_path, capsys):
    row = {"mode": "window", "B": 1024, "K": 8, "D": 0, "tokens_per_s": 123456.7, "ms_per_window": 1.5,
           "us_per_step": 187.5, "gpu_ms_per_window": None, "tokens_per_pass": 1.0, "graph": True}
    (tmp_path / "rows.json").write_text(json.dumps({"meta": {}, "rows": [row]}))
    assert bench.main(["--table", str(tmp_path / "rows.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| mode | B | K | D | tokens / s") and len(lines) == 3
    assert lines[2] == "| window | 1,024 | 8 | 0 | 123,457 | 1.500 | 187.5 | - | 1.00 | yes |"


def test_rows_hold_the_longest_request():
    args = bench.parser().parse_args(["--prompt-len", "32", "--block-size", "16", "--iters", "10", "--warmup", "2",
                                      "--batch", "64", "256"])
    runs = bench.cases(args)
    shape = bench.pool_shape(args, runs)
    longest = 32 + 1 + 12 * 4 * 5 + 4  # prompt, prefill token, 12 windows of spec K = 4, D = 4, lookahead
    assert shape.max_blocks_per_req * 16 >= longest and shape.max_num_reqs == 256
    assert shape.num_blocks == 256 * shape.max_blocks_per_req + 1


@pytest.mark.slow
@pytest.mark.parametrize("stops", [False, True])
def test_a_cpu_run_decodes_every_lane(stops, tmp_path, monkeypatch):
    """Without stops every lane gains one token a pass (tokens = windows x K x B); with ``--stops``
    requests stop and are replaced, so that every window (warm-up included) has B lanes."""
    lanes = []
    window = bench.Steady.window
    monkeypatch.setattr(bench.Steady, "window", lambda self: (lanes.append(len(self.running)), window(self))[1])
    out = tmp_path / "rows.json"
    flags = ["--stops", "--max-new", "3"] if stops else []
    assert bench.main([*SMALL, *flags, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["K"]) for r in rows] == [("host", 1), ("window", 2)]
    assert lanes == [2] * 6  # 3 windows a case
    for r in rows:
        assert r["tokens_per_pass"] == 1.0 and r["graph"] is False and r["gpu_ms_per_window"] is None
        if stops:
            assert r["stopped"] > 0 and 0 < r["tokens"] <= 2 * r["K"] * 2
        else:
            assert r["stopped"] == 0 and r["tokens"] == 2 * r["K"] * 2
