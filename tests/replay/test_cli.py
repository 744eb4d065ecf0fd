"""The ``gpupool`` command's errors, options and reports (docs/errors.md, command-line errors).

Every failure is one line ``gpupool: error: ...`` on stderr with exit status 2, and nothing is
replayed first. Traces here are tiny files; the device pool runs only where a test says so.
"""
from __future__ import annotations

from harness.paths import ROOT
from harness.timeouts import scaled
import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from gpupool import cli
from gpupool.cli import bench, machine, output
from gpupool.cli import replay as replay_cmd
from gpupool.cli.main import _REEXEC_ENV
from gpupool.replay import TraceError, mismatched_fields, read_trace

LINE = '{{"timestamp": {t}, "input_length": {i}, "output_length": {o}, "hash_ids": {ids}}}'


def line(t=0, i=600, o=10, ids=(1, 2)):
    return LINE.format(t=t, i=i, o=o, ids=json.dumps(list(ids)))


def write(tmp_path, *lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join(x + "\n" for x in lines))
    return str(p)


def fails(capsys, argv, *needles):
    """Run the command; it must exit 2 with one ``gpupool: error:`` line naming ``needles``."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpupool: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in err
    return lines[0]


# ---- invocation errors --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    (["replay", "--device", "foo"], ["--device", "foo", "cpu, cuda or cuda:N"]),
    (["replay", "--num-blocks", "0"], ["--num-blocks", ">= 1"]),
    (["replay", "--num-blocks", "many"], ["--num-blocks", "integer"]),
    (["replay", "--tpot-ms", "-1"], ["--tpot-ms"]),
    (["replay", "--pool", "gpu"], ["--pool", "gpu"]),
    (["replay", "--limit", "0"], ["--limit"]),
    (["replay", "--device-limit", "x"], ["--device-limit"]),
    (["replay", "--no-such-option"], ["--no-such-option"]),
    (["frobnicate"], ["frobnicate"]),
    ([], ["COMMAND"]),
])
def test_bad_invocations_are_one_line_errors(capsys, argv, needles):
    fails(capsys, argv, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("dev", ["cuda", "cuda:1"])
def test_device_cuda_without_a_gpu(capsys, dev):
    msg = fails(capsys, ["replay", "--device", dev, "--limit", "2"], f"--device {dev}", "no CUDA device",
                "--device cpu")
    assert "TRITON_INTERPRET" not in msg


def test_device_cpu_with_kernels_set_up_for_the_gpu(capsys, monkeypatch):
    """In-process the backend cannot be switched: a clear error, not a traceback (the command line
    re-executes itself with TRITON_INTERPRET=1 instead; see the next test)."""
    from gpupool import _backend

    monkeypatch.setattr(_backend, "interpreted", lambda: False)
    fails(capsys, ["replay", "--device", "cpu", "--limit", "2"], "TRITON_INTERPRET=1")


def test_device_cpu_reexecs_with_the_interpreter(monkeypatch):
    from gpupool import _backend

    monkeypatch.setattr(_backend, "interpreted", lambda: False)
    monkeypatch.delenv(_REEXEC_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["gpupool", "replay", "--device", "cpu"])
    seen = {}

    def fake_execve(path, args, env):
        seen.update(path=path, args=args, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(SystemExit):
        cli.main()
    assert seen["args"][1:] == ["-m", "gpupool", "replay", "--device", "cpu"]
    assert seen["env"]["TRITON_INTERPRET"] == "1" and seen["env"][_REEXEC_ENV] == "1"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("gpupool ") and "torch" in out and "triton" in out


# ---- trace errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, needles", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1}', ["line 2", "hash_ids"]),
    (line(i=600, ids=[1]), ["line 2", "hash_ids has 1 ids", "needs 2", "--lenient"]),
    (line(i=600, ids=[1, 2, 3]), ["line 2", "hash_ids has 3 ids"]),
    (line(i=600, ids=[]), ["line 2", "hash_ids has empty"]),
    (line(i=0), ["line 2", "input_length"]),
    (line(o=-1), ["line 2", "output_length"]),
    (line(t=-5), ["line 2", "timestamp"]),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, null]}', ["line 2", "hash_ids[1]"]),
    ("not json", ["line 2", "not valid JSON"]),
    pytest.param("[" * 100_000 + "]" * 100_000, ["line 2", "nested too deeply"], id="nested-100000-deep"),
    pytest.param(line().replace('"input_length": 600', '"input_length": ' + "9" * 5000),
                 ["line 2", "number too long", "4300 digits"], id="int-of-5000-digits"),
    # valid JSON whose strings have no UTF-8 form (a lone surrogate, either half, or a reversed pair)
    pytest.param(line(ids=["X", 2]).replace("X", "\\ud800"), ["line 2", "hash_ids[0]", "lone surrogate", "\\ud800"],
                 id="lone-high-surrogate"),
    pytest.param(line(ids=[1, "aX"]).replace("X", "\\udfff\\ud800"), ["line 2", "hash_ids[1]", "character 1"],
                 id="reversed-surrogate-pair"),
    pytest.param(line().replace('"timestamp": 0', '"timestamp": 1' + "0" * 400), ["line 2", "timestamp", "401 characters"],
                 id="int-timestamp-past-float-range"),
    pytest.param(line().replace('"timestamp": 0', '"timestamp": "' + "x" * 100_000 + '"'),
                 ["line 2", "timestamp", "100,002 characters"], id="long-string-value-cut"),
    pytest.param(line(ids=["X", 2]).replace('"X"', "[" * 900 + "1" + "]" * 900), ["line 2", "hash_ids[0]", "integer or a string"],
                 id="nested-list-id"),
    pytest.param(line(ids=[{"a": 1}, 2]), ["line 2", "hash_ids[0]"], id="object-id"),
    pytest.param(line(ids=[1.0, 2]), ["line 2", "hash_ids[0]", "1.0"], id="float-id"),
    pytest.param(line(ids=[True, 2]), ["line 2", "hash_ids[0]", "True"], id="bool-id"),
    pytest.param(line(o="true"), ["line 2", "output_length", "True"], id="bool-length"),
])
def test_bad_trace_lines_name_line_and_field(tmp_path, capsys, bad, needles):
    path = write(tmp_path, line(), bad)
    msg = fails(capsys, ["replay", path, "--pool", "reference"], path, *needles)
    assert len(msg) < 300 + len(path), msg  # an offending value is cut, not printed whole


@pytest.mark.parametrize("ids", [["\u00e9t\u00e9", "\U0001f600"], ["\x00", "a\nb"], [-1, 10**4000]],
                         ids=["non-ascii", "control-chars", "huge-int"])
def test_odd_but_valid_hash_ids_replay(tmp_path, capsys, ids):
    """Strings with a UTF-8 form (accents, emoji, NUL, newlines) and integers of any size JSON holds are ids."""
    path = write(tmp_path, line(ids=ids), line(t=1, ids=ids))
    assert cli.main(["replay", path, "--pool", "reference", "--no-progress"]) == 0
    assert "hit blocks      1" in capsys.readouterr().out  # the second request hits the first full block


def test_library_trace_with_an_id_too_long_to_hash():
    """A TraceRequest built in Python (not read from JSON) may hold an int past Python's str() digit
    limit: the replay refuses it with a TraceError naming it, before any pool op."""
    from gpupool import ReferenceBlockPool
    from gpupool.replay import TraceRequest, replay

    huge = 10**5000
    pool = ReferenceBlockPool(16)
    with pytest.raises(TraceError, match=r"trace\[0\]: field hash_ids\[1\] is an integer of about 5,000 digits"):
        replay(pool, [TraceRequest(0, 600, 1, (1, huge))])
    with pytest.raises(TraceError, match=r"hash_ids\[0\] must be valid Unicode"):
        replay(pool, [TraceRequest(0, 1, 1, ("\ud800",))])
    assert pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_empty_or_blank_trace(tmp_path, capsys, text):
    p = tmp_path / "empty.jsonl"
    p.write_text(text)
    fails(capsys, ["replay", str(p), "--pool", "reference"], "no requests")


def test_missing_trace_and_directory(tmp_path, capsys):
    fails(capsys, ["replay", str(tmp_path / "nope.jsonl"), "--pool", "reference"], "not found")
    fails(capsys, ["replay", str(tmp_path), "--pool", "reference"], "directory")


def test_pool_too_small_for_any_request(tmp_path, capsys):
    path = write(tmp_path, line(i=600, o=10), line(t=1, i=1000, o=100))  # 2 and 3 blocks of 512
    fails(capsys, ["replay", path, "--pool", "reference", "--num-blocks", "2"], "too small", "--num-blocks >= 3")
    # One request fits: it runs, and the report says how many are rejected.
    assert cli.main(["replay", path, "--pool", "reference", "--num-blocks", "3", "--no-progress"]) == 0
    assert "1 request needs more than" in capsys.readouterr().out


def test_lenient_clamps_and_counts(tmp_path, capsys):
    path = write(tmp_path, line(i=600, ids=[1]), line(t=1, i=600, ids=[1, 2, 3, 4]), line(t=2, i=600, ids=[1, 2]))
    fails(capsys, ["replay", path, "--pool", "reference"], "line 1", "hash_ids")
    out = tmp_path / "r.json"
    assert cli.main(["replay", path, "--pool", "reference", "--lenient", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "2 of 3 lines had hash_ids of the wrong length (1 short" in text and "1 long: cut" in text
    check = json.loads(out.read_text())["trace_check"]
    assert (check["clamped_short_hash_ids"], check["clamped_long_hash_ids"]) == (1, 1)
    t = read_trace(path, lenient=True)
    assert [r.hash_ids for r in t.requests] == [(1,), (1, 2), (1, 2)]


def test_string_hash_ids_equal_their_integer_spelling(tmp_path):
    ints = write(tmp_path, line(ids=[7, 8]), line(t=5, ids=[7, 9]), name="i.jsonl")
    strs = write(tmp_path, line(ids=["7", "8"]), line(t=5, ids=["7", "9"]), name="s.jsonl")
    other = write(tmp_path, line(ids=["conv_17:0", "conv_17:1"]), line(t=5, ids=["conv_17:0", "x"]), name="o.jsonl")
    from gpupool import ReferenceBlockPool
    from gpupool.replay import replay

    reps = [replay(ReferenceBlockPool(64), read_trace(p).requests) for p in (ints, strs, other)]
    assert reps[0].free_queue_sha256 == reps[1].free_queue_sha256 and reps[0].hit_blocks == reps[1].hit_blocks == 1
    assert reps[2].hit_blocks == 1


def test_unsorted_timestamps_are_sorted_and_reported(tmp_path, capsys):
    path = write(tmp_path, line(t=5, ids=[1, 2]), line(t=0, ids=[3, 4]), line(t=5, ids=[5, 6]), line(t=1, ids=[7, 8]))
    t = read_trace(path)
    assert [r.timestamp for r in t.requests] == [0, 1, 5, 5] and t.out_of_order == 2
    assert [r.hash_ids[0] for r in t.requests] == [3, 7, 1, 5]  # ties keep file order
    out = tmp_path / "r.json"
    assert cli.main(["replay", path, "--pool", "reference", "--no-progress", "--json", str(out)]) == 0
    assert "2 lines were out of timestamp order: sorted" in capsys.readouterr().out
    check = json.loads(out.read_text())["trace_check"]
    assert check["reordered_by_timestamp"] is True and check["out_of_order"] == 2
    with pytest.raises(TraceError):
        read_trace(write(tmp_path, "", name="e.jsonl"))


def test_trace_block_size_option(tmp_path, capsys):
    path = write(tmp_path, line(i=40, ids=[1, 2, 3]))  # 3 ids of 16 tokens
    fails(capsys, ["replay", path, "--pool", "reference"], "--trace-block-size")
    assert cli.main(["replay", path, "--pool", "reference", "--trace-block-size", "16", "--block-size", "16",
                     "--no-progress"]) == 0


# ---- outputs ------------------------------------------------------------------------------------

def test_unwritable_json_is_found_before_the_replay(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(replay_cmd, "read_trace", lambda *a, **k: calls.append(1))
    fails(capsys, ["replay", "--json", str(tmp_path / "no" / "dir" / "r.json")], "does not exist")
    fails(capsys, ["replay", "--json", str(tmp_path)], "directory")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        fails(capsys, ["replay", "--json", str(ro / "r.json")], "not writable")
    fails(capsys, ["replay", "--json", ""], "needs a file name")
    if Path("/proc/self").is_dir():  # a folder that passes os.access but takes no new file, even as root
        fails(capsys, ["replay", "--json", "/proc/gpupool-report.json"], "not writable")
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    output.check_json_path(str(kept))  # an existing file is only tested, not emptied
    assert kept.read_text() == "old"
    output.check_json_path(str(tmp_path / "new.json"))  # nor is a trial file left behind
    assert not (tmp_path / "new.json").exists()
    assert calls == []


def test_device_with_the_reference_pool_is_an_error(capsys):
    fails(capsys, ["replay", "--pool", "reference", "--device", "cpu"], "--pool reference", "drop --device")


def test_cpu_0_is_cpu():
    assert replay_cmd._device_arg("cpu:0") == "cpu"


def test_json_to_stdout(tmp_path, capsys):
    path = write(tmp_path, line(), line(t=1, ids=[1, 3]))
    assert cli.main(["replay", path, "--pool", "reference", "--json", "-", "--no-progress"]) == 0
    cap = capsys.readouterr()
    data = json.loads(cap.out)  # stdout is only the JSON; the text report went to stderr
    assert data["reference"]["requests"] == 2 and data["reference"]["hit_blocks"] == 1 and "hit ratio" in cap.err
    assert data["device"] is None and data["match"] is None
    assert not os.path.exists("-")
    env = data["environment"]
    assert set(env) >= {"gpupool", "torch", "triton", "device", "interpreter"}
    assert env["device"] is None and env["interpreter"] is False  # the reference pool alone: no device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (no GPU)")
def test_default_replay_on_cpu_is_reference_whole_plus_device_prefix(tmp_path, capsys):
    """``gpupool replay`` without a GPU: the reference pool's whole-trace result, the device pool on a
    prefix checked against the reference pool on that prefix, and no speed comparison."""
    lines = [line(t=i, i=600 + 100 * (i % 3), o=5, ids=[i % 4, 10 + i % 2]) for i in range(12)]
    path = write(tmp_path, *lines)
    out = tmp_path / "r.json"
    assert cli.main(["replay", path, "--device-limit", "5", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "--- result: reference pool" in text and "whole trace" in text
    assert "--- check: device pool" in text and "first 5 requests" in text
    assert "identical       yes" in text and "speed           not compared" in text and "x the reference" not in text
    data = json.loads(out.read_text())
    assert data["reference"]["requests"] == 12 and data["device"]["requests"] == 5
    assert data["reference_on_checked_requests"]["requests"] == 5
    assert data["match"] is True and data["speedup"] is None
    assert data["environment"]["interpreter"] is True and data["environment"]["device"] == "cpu (Triton interpreter)"
    assert data["device"]["free_queue_sha256"] == data["reference_on_checked_requests"]["free_queue_sha256"]
    assert data["device"]["pool"].startswith("BlockPool")
    assert data["environment"]["gpupool"] == machine.versions()["gpupool"]


def test_device_replay_is_named_in_one_place():
    """The device loop is imported only by ``device_replay`` (so it can be switched in one line)."""
    srcs = [p.read_text(encoding="utf-8") for p in Path(cli.__file__).parent.glob("*.py")]
    assert sum(src.count("replay.device import") for src in srcs) == 1
    assert "from ..replay.device import" in Path(machine.__file__).read_text(encoding="utf-8")
    assert callable(machine.device_replay())


def test_bench_skip_reasons_are_merged():
    log = ("...\nSKIPPED [3] bench/test_bench_pool.py:12: vllm is not installed (import vllm fails)\n"
           "SKIPPED [2] bench/test_bench_pool.py:40: CUDA graphs need a CUDA device\n"
           "SKIPPED [1] bench/conftest.py:9: vllm is not installed (import vllm fails)\n")
    assert bench.skip_reasons(log) == [(4, "vllm is not installed (import vllm fails)"),
                                     (2, "CUDA graphs need a CUDA device")]


def test_module_entry_point_runs():
    """``python -m gpupool`` (what the console script does) exits 2 with one line on a bad option."""
    p = subprocess.run([sys.executable, "-m", "gpupool", "replay", "--device", "foo"], capture_output=True, text=True,
                       timeout=scaled(120))
    assert p.returncode == 2 and p.stderr.strip().startswith("gpupool: error:") and len(p.stderr.splitlines()) == 1


def test_string_hash_ids_on_the_device_pool(tmp_path):
    """The device loop keys string ids the same way (a few requests, so the interpreter is quick)."""
    from gpupool import BlockPool, ReferenceBlockPool
    from gpupool.replay import replay

    path = write(tmp_path, line(ids=["a:0", "a:1"]), line(t=1, ids=["a:0", "b"]), line(t=2, i=1100, ids=["a:0", 7, "x"]))
    reqs = read_trace(path).requests
    ref = replay(ReferenceBlockPool(16), reqs)
    dev = machine.device_replay()(BlockPool(16), reqs, block_size=512, tpot_ms=20.0, progress=False)
    assert ref.hit_blocks == 2
    assert mismatched_fields(ref, dev) == []


@pytest.mark.parametrize("mode", ["reference", "device", "both", "auto"])
def test_json_report_has_one_shape_in_every_mode(tmp_path, capsys, mode):
    path = write(tmp_path, line(), line(t=1, ids=[1, 3]))
    assert cli.main(["replay", path, "--pool", mode, "--json", "-", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["trace", "limit", "mode", "trace_check", "environment", "reference", "device",
                          "reference_on_checked_requests", "checked_requests", "match", "mismatched", "speedup"]
    ran = {"reference": ["reference"], "device": ["device"]}.get(mode, ["reference", "device"])
    assert [k for k in ("reference", "device") if data[k] is not None] == ran
    assert all(data[k]["requests"] == 2 for k in ran)
    assert (data["match"] is None) == (len(ran) == 1)


def test_block_size_other_than_the_traces_is_refused(tmp_path, capsys):
    path = write(tmp_path, line(), line(t=1, ids=[1, 3]))
    fails(capsys, ["replay", path, "--pool", "reference", "--block-size", "16"], "one hash id per 512 tokens")
    out = tmp_path / "r.json"
    assert cli.main(["replay", path, "--pool", "reference", "--block-size", "16", "--trace-block-size", "16",
                     "--lenient", "--no-progress", "--json", str(out)]) == 0


def test_a_pool_too_big_for_memory_is_one_line_before_anything_is_built(capsys, monkeypatch):
    monkeypatch.setattr(machine, "_available_bytes", lambda device: 10**9)
    for kind in ("reference", "device"):
        with pytest.raises(cli.CLIError, match="needs about .* GiB and 0.9 GiB is free"):
            machine.make_pool(kind, 100_000_000, "cpu")


def test_library_and_cli_work_without_tqdm_and_matplotlib(tmp_path, monkeypatch, capsys):
    """tqdm and matplotlib are extras (``cli``): without them the replay runs with no bar,
    ``--progress`` and ``gpupool bench`` say what to install."""
    import importlib.util as iu
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a, **k: None if name in ("tqdm", "matplotlib") else real(name, *a, **k))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    path = write(tmp_path, line(), line(t=1, ids=[1, 3]))
    assert cli.main(["replay", path, "--pool", "reference", "--no-progress"]) == 0
    capsys.readouterr()
    fails(capsys, ["replay", path, "--pool", "reference", "--progress"], "needs tqdm", "pip install -e '.[cli]'")
    fails(capsys, ["bench"], "needs matplotlib", "pip install -e '.[cli,test]'")
    from gpupool.replay.model import progress_bar
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[cli\]'"):
        progress_bar(True, 3, "x")


def test_core_dependencies_are_only_torch_triton_numpy():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch", "triton", "numpy"]
    assert set(project["optional-dependencies"]["cli"]) == {"tqdm", "matplotlib"}


def test_bench_dir_is_the_checkouts_bench_folder():
    """``gpupool bench`` finds the suite at the checkout's ``bench/`` (src/ layout: three folders up)."""
    assert bench.bench_dir() == ROOT / "bench"
    assert (bench.bench_dir() / "test_bench_pool.py").is_file() and (bench.bench_dir() / "plot.py").is_file()


# ---- reading the file: bytes, lines, pipes -------------------------------------------------------

def test_non_utf8_is_reported_by_line(tmp_path, capsys):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes((line() + "\n").encode() + line(ids=["cafX", 2]).encode().replace(b"X", b"\xe9") + b"\n")
    fails(capsys, ["replay", str(p), "--pool", "reference"], "line 2", "not UTF-8", "0xe9")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path, capsys):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (line() + "\n" + line(t=1) + "\n").encode())
    assert cli.main(["replay", str(p), "--pool", "reference"]) == 0
    assert "requests        2" in capsys.readouterr().out


def test_a_line_without_end_is_refused_at_the_cap(tmp_path, capsys, monkeypatch):
    """``/dev/zero`` (no newline, ever) is one line error at MAX_LINE_BYTES, not a read until MemoryError."""
    from gpupool.replay import trace as trace_mod

    monkeypatch.setattr(trace_mod, "MAX_LINE_BYTES", 1 << 20)
    src = "/dev/zero" if Path("/dev/zero").exists() else write(tmp_path, "x" * (2 << 20))
    fails(capsys, ["replay", src, "--pool", "reference"], "line 1", "longer than 1 MiB")


@pytest.mark.heavy
def test_a_closed_pipe_on_stdout_exits_quietly():
    """``gpupool replay | head -1``: no traceback, the shell's SIGPIPE status (141), not 1 ("disagree")."""
    p = subprocess.run(f"{sys.executable} -m gpupool replay --pool reference | head -1; exit ${{PIPESTATUS[0]}}",
                       shell=True, executable="bash", capture_output=True, text=True, timeout=scaled(300))
    assert p.stdout.startswith("trace ") and p.stdout.count("\n") == 1
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_a_closed_pipe_is_noticed_before_the_work():
    """``gpupool replay ... | head -1`` stops when the reader goes, not at its next write: here the device
    pool on 3,000 requests in the interpreter (many minutes) prints nothing between its header and its
    report, so only a command that watches stdout ends within the time limit."""
    import signal

    cmd = (f"{sys.executable} -m gpupool replay --pool device --device cpu --device-limit all --limit 3000 "
           f"--no-progress | head -1; exit ${{PIPESTATUS[0]}}")
    p = subprocess.Popen(cmd, shell=True, executable="bash", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=scaled(120))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the shell and the replay under it
        p.communicate()
        pytest.fail("the replay went on after the reader of its stdout had gone")
    assert out.startswith("trace ") and out.count("\n") == 1
    assert p.returncode == 141 and err == "", err


SWALLOWS_ONE = r"""
import sys, time
from gpupool.cli.main import _PipeWatch
w, seen = _PipeWatch(), 0
with w:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and seen < 2:
        try:
            time.sleep(0.01)
        except KeyboardInterrupt:  # the first one lost, as C code testing an attribute loses it
            seen += 1
print("interrupts", seen, "closed", w.closed, file=sys.stderr)
"""


def _ignore_sigint():
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_an_interrupt_the_command_lost_is_sent_again(sigint):
    """The pipe watch interrupts the main thread again while the command goes on (an interrupt that lands
    in C code testing an attribute is cleared there), also where SIGINT is ignored (a shell's background
    job, nohup: Python's interrupt would then do nothing)."""
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", SWALLOWS_ONE], stdout=w, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    os.close(w)
    os.close(r)  # the reader has gone before the command starts
    _, err = p.communicate(timeout=scaled(60))
    assert "interrupts 2 closed True" in err, err


@pytest.mark.parametrize("argv", [["replay", "--bogus"], ["replay", "--help"], ["--help"], ["bench", "--nope"]])
def test_arguments_are_parsed_before_torch_is_imported(argv):
    """A usage error or ``--help`` answers without importing torch or triton (seconds each)."""
    code = ("import sys\nfrom gpupool.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, sorted(m for m in ('torch', 'triton') if m in sys.modules), file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=scaled(120))
    assert p.stderr.splitlines()[-1] in ("exit 0 []", "exit 2 []"), p.stderr


def test_a_file_name_that_is_not_utf8_prints_on_a_strict_stdout(tmp_path, monkeypatch):
    """On Linux a file name's non-UTF-8 bytes reach Python as surrogates; a stdout with strict errors
    (``PYTHONIOENCODING=utf-8``) shows them escaped instead of failing on the report's first line."""
    import io

    path = write(tmp_path, line(), name="odd\udcffname.jsonl")
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["replay", path, "--pool", "reference", "--no-progress"]) == 0
    out.flush()
    assert b"odd\\udcffname.jsonl: 1 request" in out.buffer.getvalue()


def test_both_with_a_device_limit_labels_the_requests_that_ran(tmp_path, capsys):
    """``--pool both --device-limit N`` on the interpreter replays the first N requests on both pools,
    and says so (it once said "whole trace")."""
    path = write(tmp_path, *[line(t=i) for i in range(5)])
    assert cli.main(["replay", path, "--pool", "both", "--device-limit", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "first 2 requests" in out and "whole trace" not in out


def test_progress_is_lines_when_stderr_is_not_a_terminal(monkeypatch):
    """Redirected (a log, CI): tqdm writes a line per refresh, every 10 s once a run has taken 10 s
    (at once with --progress), as pip does, instead of nothing."""
    import io

    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    kw = output.progress(None, "reference pool")
    assert kw["delay"] == 10.0 and kw["mininterval"] == 10.0
    assert output.progress(True, "x")["delay"] == 0.0 and output.progress(False, "x") is False
    from tqdm import tqdm

    bar = tqdm(total=3, **{**kw, "delay": 0, "mininterval": 0})
    for _ in range(3):
        bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert len(lines) >= 3 and "\r" not in err.getvalue() and lines[-1].startswith("reference pool: 100%")


def test_singular_counts(tmp_path, capsys):
    """``1 request``, not ``1 requests`` (and ``1 line was`` out of order)."""
    path = write(tmp_path, line(t=5), line(t=1))
    assert cli.main(["replay", path, "--pool", "both", "--device-limit", "1", "--limit", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1 request " in out + " " and "1 requests" not in out and "1 line was out of" in out, out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("extra", [[], ["--json", "-"]])
@pytest.mark.heavy("extra1")
def test_stdout_on_a_full_disk_is_a_one_line_error(tmp_path, extra):
    """``gpupool replay > /dev/full``: stdout cannot be written (no space left); one line on stderr,
    exit 2, no traceback (it once ended in ``OSError: [Errno 28]``). With ``--json -`` the text goes to
    stderr before it."""
    path = write(tmp_path, line())
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "gpupool", "replay", path, "--pool", "reference", *extra],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=scaled(300))
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    last = p.stderr.splitlines()[-1]
    assert p.returncode == 2 and last.startswith("gpupool: error: ") and "No space left on device" in last, p.stderr
    assert p.stderr.count("gpupool: error") == 1 and (extra or p.stderr.count("\n") == 1), p.stderr


def test_bench_out_relative_is_the_callers_folder(tmp_path, monkeypatch, capsys):
    """``gpupool bench --out rel/x`` writes rel/x.json, .log and .png under the caller's folder: the
    benchmarks run with the checkout as their folder, so the JSON path must reach them absolute (it once
    landed in the checkout while the log was in the caller's folder, and the run ended "wrote no results")."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("pytest_benchmark")
    seen = {}

    def fake_run(cmd, cwd, env, log):
        seen["json"] = Path(cwd) / next(a.split("=", 1)[1] for a in cmd if a.startswith("--benchmark-json="))
        return 5, False  # "no benchmark was selected": stops before the plot

    monkeypatch.setattr(bench, "_run_pytest", fake_run)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--out", "rel/x"]) == 2
    assert seen["json"].resolve() == (tmp_path / "rel" / "x.json").resolve()
    assert (tmp_path / "rel" / "x.log").is_file()


def test_json_onto_the_trace_is_refused(tmp_path, capsys):
    """``--json`` naming the trace file (or a link to it) is refused before the replay: the report
    would overwrite the input (it once did, silently, exit 0)."""
    path = write(tmp_path, line())
    before = Path(path).read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(path)
    for target in (path, str(link)):
        fails(capsys, ["replay", path, "--pool", "reference", "--json", target], "--json", "is the trace file")
        assert Path(path).read_bytes() == before
