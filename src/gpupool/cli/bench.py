"""``gpupool bench``: the pytest-benchmark suite in a source checkout's ``bench/`` folder, its summary
table, plot and skip reasons."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from .output import count
from .types import CLIError, CLISubcommand


def bench_dir() -> Path:
    """The benchmark suite: ``bench/`` at the root of a source checkout (``src/gpupool/cli/bench.py`` is
    three folders below it)."""
    return Path(__file__).resolve().parents[3] / "bench"


_SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)$")


def skip_reasons(log_text: str) -> list[tuple[int, str]]:
    """``(count, reason)`` from the ``SKIPPED [n] file:line: reason`` lines of pytest's ``-rs`` summary,
    merged by reason, most frequent first."""
    merged: dict[str, int] = {}
    for line in log_text.splitlines():
        m = _SKIP_LINE.match(line.strip())
        if m:
            merged[m.group(2)] = merged.get(m.group(2), 0) + int(m.group(1))
    return sorted(((n, r) for r, n in merged.items()), key=lambda x: (-x[0], x[1]))


class BenchSubcommand(CLISubcommand):
    """``gpupool bench [--out PREFIX] [--quick] [-k EXPR] [--verbose]``."""

    name = "bench"
    help = "run the benchmark suite (bench/) and plot it"
    description = ("Run the pytest-benchmark suite in the repository's bench/ folder (the device pool against the "
                   "reference pool and, when installed, vLLM's BlockPool), print a summary table, and write "
                   "PREFIX.json (pytest-benchmark's JSON), PREFIX.png (latency against batch size per op, replay "
                   "throughput) and PREFIX.log (pytest's full output). The README explains the columns.")

    def add_arguments(self, b) -> None:
        b.add_argument("--out", metavar="PREFIX", default=None,
                       help="output prefix (default: bench/out/bench in the repository)")
        b.add_argument("--quick", action="store_true",
                       help="the CPU-sized grid (device pool: batch 1 and 64, pool 4096; the default without CUDA)")
        b.add_argument("-k", metavar="EXPR", dest="k", default=None,
                       help="only the benchmarks matching EXPR (pytest -k)")
        b.add_argument("--verbose", action="store_true", help="show pytest's own output (its tables) as it runs")

    def validate(self, args) -> None:
        missing = [m for m in ("matplotlib", "pytest", "pytest_benchmark") if importlib.util.find_spec(m) is None]
        if missing:
            raise CLIError(f"gpupool bench needs {', '.join(missing)}: pip install -e '.[cli,test]' in the repository")
        suite = bench_dir()
        if not (suite / "test_bench_pool.py").is_file() or not (suite / "plot.py").is_file():
            raise CLIError(f"the benchmark suite is not at {suite}: `gpupool bench` runs the bench/ folder of a "
                           f"source checkout (install it with `pip install -e .` from the repository)")

    def cmd(self, args) -> int:
        suite = bench_dir()
        # absolute: pytest runs in the checkout, the caller's relative --out names the caller's folder
        prefix = Path(args.out).absolute() if args.out else suite / "out" / "bench"
        json_path, png_path, log_path = (prefix.with_name(prefix.name + ext) for ext in (".json", ".png", ".log"))
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            if json_path.exists():
                json_path.unlink()
            log = open(log_path, "w", encoding="utf-8")
        except OSError as e:
            raise CLIError(f"cannot write under {json_path.parent}: {e}") from None
        env = dict(os.environ)
        if args.quick:
            env["GPUPOOL_BENCH_GRID"] = "quick"
        cmd = [sys.executable, "-m", "pytest", str(suite), "-q", "-rs", "-p", "no:cacheprovider",
               f"--benchmark-json={json_path}", "--benchmark-columns=min,median,max,rounds"]
        if args.k:
            cmd += ["-k", args.k]
        print(f"running the benchmarks in {suite} (pytest's output: {log_path}; this takes minutes)", flush=True)
        with log:
            rc, interrupted = _run_pytest(cmd, suite.parent, env, None if args.verbose else log)
        log_text = log_path.read_text(encoding="utf-8", errors="replace") if not args.verbose else ""
        if rc == 5:
            raise CLIError("no benchmark was selected" + (f" by -k {args.k!r}" if args.k else ""))
        if not json_path.is_file():
            tail = "\n".join(log_text.splitlines()[-15:])
            raise CLIError(f"the benchmark run wrote no results (pytest exit status {rc}); the end of {log_path}:\n"
                           f"{tail}", code=1)
        plot = _load_bench_plot(suite)
        plot.plot(json_path, png_path)
        print(plot.table(json_path))
        skips = skip_reasons(log_text)
        if skips:
            print(f"skipped {count(sum(n for n, _ in skips), 'case')}:")
            for n, reason in skips:
                print(f"  {n:>4}  {reason}")
        size = json_path.stat().st_size / 1e6
        print(f"wrote {json_path} ({size:.1f} MB, pytest-benchmark's JSON)\nwrote {png_path} (the plot)"
              + ("" if args.verbose else f"\nwrote {log_path} (pytest's full output)"))
        if interrupted:
            raise CLIError("interrupted: the results above are partial", code=130)
        if rc != 0:
            raise CLIError(f"some benchmarks failed (pytest exit status {rc}); see {log_path}", code=1)
        return 0


def _run_pytest(cmd: list[str], cwd: Path, env: dict, log) -> tuple[int, bool]:
    """Run ``cmd`` (its output to ``log``, or to the terminal when None); ``(exit status, interrupted)``."""
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=log,
                            stderr=subprocess.STDOUT if log is not None else None)
    try:
        return proc.wait(), False
    except KeyboardInterrupt:
        # pytest (same process group) got the interrupt too: it stops and still writes the JSON of the
        # benchmarks that finished, which the command summarises.
        try:
            return proc.wait(timeout=60), True
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            raise


def _load_bench_plot(suite: Path):
    spec = importlib.util.spec_from_file_location("gpupool_bench_plot", suite / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_init() -> list[CLISubcommand]:
    return [BenchSubcommand()]
