"""Every command the documentation tells a user to run, run as a user would: a subprocess from the
repository root, at a tiny size where the documented size takes minutes (the same command, with a
``--limit`` / ``-k`` / ``--sizes`` that shrinks it). Sources: README.md's ``bash`` blocks, the
backticked commands of README.md, docs/ and bench/RESULTS.md, RESULTS.md's code blocks, the examples
in ``gpupool --help`` (src/gpupool/cli/__init__.py's docstring) and the ``Run`` lines of the bench scripts.

A command this file cannot shrink or run fails ``test_every_documented_command_is_run`` (add it to
``tiny`` below). ``pip install`` and the test suite's own pytest commands are not run here (they
would install or recurse): tests/project/test_readme.py checks their extras, markers and paths, and
tests/vllm_plugin/test_vllm_conformance.py checks that the test extra holds what the vLLM tests need.
"""
from __future__ import annotations

from harness.paths import ROOT
from harness.timeouts import scaled
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
TICK = re.compile(r"`((?:gpupool|python3?|bash|TRITON_INTERPRET=1) [^`]+)`")
PROGS = ("gpupool", "python", "python3", "bash")
# the documented pytest runs of the test suite and installs: checked by tests/project/test_readme.py, not run here
# and the commands of an installed vLLM (docs/vllm.md): tests/vllm_plugin/test_vllm_live.py builds that environment
# (tests/vllm_plugin/live/env.py) and runs them there, tests/vllm_plugin/test_vllm_drift.py the drift check
NOT_RUN = re.compile(r"^(pip |python3? -m pytest .*\btests\b|\.ci/run|vllm serve|python3? -m vllm\.|"
                     r"python3? -m gpupool\.vllm\.compat|python3? tests/vllm_plugin/live/env\.py)")


def _split(text: str) -> list[str]:
    """The simple commands of a shell snippet (split at &&, ;, |), comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        for part in re.split(r"&&|\|\||;|\|", line):
            part = part.strip()
            if part and not part.startswith("#"):
                out.append(part)
    return out


def documented_commands() -> list[str]:
    cmds: list[str] = []
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cmds += [c for kind, body in FENCE.findall(readme) if kind == "bash" for c in _split(body)]
    results = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    cmds += [c for kind, body in FENCE.findall(results) for c in _split(body)]
    for doc in [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        cmds += TICK.findall(doc.read_text(encoding="utf-8"))
    from gpupool import cli

    cmds += [c for c in _split(cli.__doc__) if c.startswith("gpupool ")]
    for script in ("model_cases.py", "fallback_mix.py", "vllm_host.py"):
        doc = (ROOT / "bench" / script).read_text(encoding="utf-8").split('"""')[1]
        cmds += [c for c in _split(doc) if c.startswith("TRITON_INTERPRET=1 python bench/")]
    out = []
    for c in cmds:
        c = re.sub(r"\s*\[[^\]]*\]", "", c).strip()  # optional arguments shown as [--x N] / [TRACE]
        if NOT_RUN.match(c) or c in out:
            continue
        words = c.split()
        if words[0] == "gpupool" and (len(words) < 2 or words[-1].startswith("--") and words[-1] in VALUED):
            continue  # an option named in prose ("`gpupool replay --block-size`"), not a command
        out.append(c)
    return out


VALUED = {"--block-size", "--trace-block-size", "--num-blocks", "--json", "--limit", "--device-limit", "--out",
          "--tpot-ms", "--device"}


def _set(argv: list[str], opt: str, value: str) -> list[str]:
    """``argv`` with ``opt value`` replacing the documented one (or added)."""
    if opt in argv:
        i = argv.index(opt)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [opt, value]


def tiny(cmd: str, tmp: Path) -> tuple[list[str], dict, int | None]:
    """(argv, extra environment, expected exit status or None for "0") of the documented ``cmd`` at a size
    that runs in seconds on a CPU; raises KeyError for a command this file does not know."""
    if cmd.startswith("gpupool replay") and "|" in cmd:  # a pipeline (docs/errors.md: a closed pipe exits quietly)
        head, tail = cmd.split("|", 1)
        small = shlex.join([sys.executable, "-m", "gpupool", *shlex.split(head)[1:], "--limit", "20",
                            "--device-limit", "3"])
        return ["bash", "-c", f"{small} | {tail.strip()}"], {}, None
    argv = shlex.split(cmd)
    env = {}
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    prog, rest = argv[0], argv[1:]
    if prog == "gpupool" and rest == ["--version"]:
        return [sys.executable, "-m", "gpupool", *rest], env, None
    if prog == "gpupool" and rest[:1] == ["replay"]:
        rest = [("-" if a == "-" else str(tmp / "out.json")) if k and rest[k - 1] == "--json" else a
                for k, a in enumerate(rest)]
        if "my.jsonl" in rest:
            lines = (ROOT / "src/gpupool/data/mooncake").glob("*.jsonl")
            text = next(iter(lines)).read_text(encoding="utf-8").splitlines()[:20]
            (tmp / "my.jsonl").write_text("\n".join(text) + "\n", encoding="utf-8")
            rest[rest.index("my.jsonl")] = str(tmp / "my.jsonl")
        if "--pool" not in rest or rest[rest.index("--pool") + 1] != "reference":
            rest = _set(rest, "--device-limit", "3")
            rest = _set(rest, "--limit", "20")
        return [sys.executable, "-m", "gpupool", *rest], env, None
    if prog == "gpupool" and rest[:1] == ["bench"]:
        rest = _set(rest, "-k", "alloc_free-reference-N4096-B64 or alloc_free-device-eager-N4096-B64")
        rest = _set(rest, "--out", str(tmp / "bench"))
        return [sys.executable, "-m", "gpupool", *rest], {**env, "GPUPOOL_BENCH_MAX_TIME": "0.005"}, None
    if prog in ("python", "python3") and rest[:3] == ["-m", "pytest", "bench"]:
        return ([sys.executable, "-m", "pytest", "bench", "-q", "-p", "no:cacheprovider", "-k",
                 "alloc_free-reference-N4096-B64", f"--benchmark-json={tmp / 'b.json'}"],
                {**env, "GPUPOOL_BENCH_MAX_TIME": "0.005"}, None)
    if prog in ("python", "python3") and rest[:1] == ["bench/model_cases.py"]:
        if "--measure" not in rest and not gpucost_available():
            return [sys.executable, *rest], env, 2  # needs the latency model, absent: one line, exit 2
        rest = _set(_set(_set(rest, "--cases", "alloc_64x64"), "--sizes", "64"), "--num-blocks", "8192")
        rest = [a for a in rest if a != "--report"] + (["--reps", "2"] if "--measure" in rest else [])
        rest = [str(tmp / "m.json") if k and rest[k - 1] == "--json" else a for k, a in enumerate(rest)]
        return [sys.executable, *rest], env, None
    if prog in ("python", "python3") and rest[:1] == ["bench/vllm_host.py"]:
        rest = _set(_set(rest, "--requests", "32"), "--steps", "2")
        timed_loop = "--scheduler" in rest or "--pool-time" in rest
        return [sys.executable, *(_set(rest, "--reps", "1") if timed_loop else rest)], env, None
    if prog in ("python", "python3") and rest[:1] == ["examples/decode_loop.py"]:
        small = ["--modes", "host", "window", "--steps", "2", "--requests", "2", "--max-new", "3", "--prompt-len", "6",
                 "--prefix-len", "4", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1",
                 "--vocab", "32"]
        return [sys.executable, *[a for a in rest if a != "--quick"], *small], env, None
    if prog in ("python", "python3") and rest[:1] == ["bench/decode_loop_gpu.py"]:
        small = ["--device", "cpu", "--batch", "2", "--steps", "2", "--iters", "1", "--no-graph", "--hidden", "64",
                 "--layers", "1", "--dtype", "float32", "--modes", "host", "window", "--warmup", "1"]
        return [sys.executable, *rest, *small], env, None
    if prog in ("python", "python3") and rest[:1] == ["bench/fallback_mix.py"]:
        return [sys.executable, *_set(_set(rest, "--batch", "4"), "--steps", "2")], env, None
    if prog == "bash" and rest == ["bench/gpu_check.sh"]:
        return (["bash", "bench/gpu_check.sh"],
                {**env, "GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_TINY": "1", "OUT": str(tmp / "gc")}, None)
    raise KeyError(cmd)


def gpucost_available() -> bool:
    return bool(os.environ.get("GPUCOST")) or (ROOT.parent / "shared" / "tools" / "gpucost.py").is_file()


# in the quick run: the README's main job (tiny), --version and the scripts that stop at once; the rest
# (5-60 s each on 2 cores) in the slow run
QUICK = ("gpupool replay", "gpupool --version", "TRITON_INTERPRET=1 python bench/model_cases.py")
COMMANDS = documented_commands()


def test_every_documented_command_is_run(tmp_path):
    assert len(COMMANDS) >= 8, COMMANDS
    unknown = []
    for c in COMMANDS:
        try:
            tiny(c, tmp_path)
        except KeyError:
            unknown.append(c)
    assert not unknown, f"documented commands no test runs (teach tiny() to shrink them): {unknown}"


def _run(argv, env, cwd=ROOT, timeout=600):
    full = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    full["PATH"] = str(Path(sys.executable).parent) + os.pathsep + full.get("PATH", "")
    full.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=scaled(timeout))


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=[] if c in QUICK or c.startswith(QUICK[2]) and not gpucost_available() else [pytest.mark.slow])
                                 for c in COMMANDS])
@pytest.mark.heavy("TRITON_INTERPRET=1 python bench/model_cases.py")
def test_documented_command_runs(cmd, tmp_path):
    argv, env, expect = tiny(cmd, tmp_path)
    p = _run(argv, env)
    out = p.stdout + p.stderr
    if expect is None:
        assert p.returncode == 0, f"{cmd} -> {argv}: exit {p.returncode}\n{out[-3000:]}"
        assert "Traceback" not in out, out[-3000:]
        if cmd == "bash bench/gpu_check.sh" and "no CUDA device" in out:  # the CUDA-only stage: skipped, said so
            assert "cuda_tests: SKIPPED (no CUDA device" in out and "stages failed: none" in out, out[-3000:]
    else:
        assert p.returncode == expect, f"{cmd}: exit {p.returncode}\n{out[-3000:]}"
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_the_main_job_runs_as_documented():
    """``gpupool replay`` exactly as the README's quick start runs it (31-63 s on 2 cores)."""
    p = _run([sys.executable, "-m", "gpupool", "replay"], {})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "identical       yes" in p.stdout and "hit ratio       0.2821" in p.stdout


def test_gpu_check_without_a_gpu_is_one_line_naming_its_dry_run(tmp_path):
    """``bash bench/gpu_check.sh`` on a machine without CUDA: one line saying so and giving the CPU dry
    run's command, exit 2 (not ``nvidia-smi: command not found`` and exit 1)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    p = _run(["bash", "bench/gpu_check.sh"], {"OUT": str(tmp_path / "gc"), "GPU_CHECK_ALLOW_CPU": "0"})
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert "no CUDA device" in lines[0] and "GPU_CHECK_ALLOW_CPU=1 bash bench/gpu_check.sh" in lines[0]
