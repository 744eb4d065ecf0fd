"""Command line: ``gpupool replay [TRACE]`` replays a Mooncake-format trace; ``gpupool bench`` benchmarks.

Examples::

    gpupool replay                                  # bundled trace; see "what runs" below
    gpupool replay --pool reference                 # CPU reference pool, whole trace (a few seconds)
    gpupool replay --pool both --json out.json      # both pools on the same requests; exit 1 unless equal
    gpupool replay my.jsonl --lenient --json -      # a trace of your own; the JSON report on stdout
    gpupool bench --quick                           # benchmarks (bench/), JSON + PNG under bench/out/

What runs by default (``--pool auto``): on a CUDA machine the whole trace on the device pool, checked
against the reference pool, with the speed ratio. Without a GPU the device pool's kernels run in
Triton's interpreter on the CPU (correct but about a thousand times slower), so the whole trace runs
on the reference pool (the result) and the device pool replays the first ``--device-limit`` requests
(default 200), checked against the reference pool on the same requests; no speed is compared.

The model is docs/semantics.md section 5; the errors docs/errors.md. Every failure of the command is
one line ``gpupool: error: ...`` with exit status 2; 1 means the device pool and the reference pool
disagreed (a bug) or benchmarks failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

from .errors import PoolError
from .replay import (
    DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS, DEFAULT_TPOT_MS, TRACE_BLOCK_SIZE, ReplayReport, TraceError, read_trace,
    replay,
)

CPU_DEVICE_DEFAULT_LIMIT = 200  # requests, when the device pool runs on Triton's CPU interpreter
MATCH_FIELDS = ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256")
_REEXEC_ENV = "GPUPOOL_CLI_REEXEC"  # set on the one re-exec that switches the kernels' backend


class CLIError(Exception):
    """A user-facing error: printed as ``gpupool: error: ...`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``gpupool: error: ...``, exit 2) instead of usage + message."""

    def error(self, message):
        self.exit(2, f"gpupool: error: {message} (see '{self.prog} --help')\n")


def _device_replay():
    """The device pool's replay loop: ``f(pool, trace, *, block_size, tpot_ms, progress) -> ReplayReport``.

    The one place the CLI names it."""
    from .replay.device import replay_on_device

    return replay_on_device


def versions() -> dict:
    """Versions of gpupool, torch, triton and Python (for ``--version`` and the JSON report)."""
    import platform

    import torch
    import triton

    from . import __version__

    return {"gpupool": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}


def _version_text() -> str:
    v = versions()
    return f"gpupool {v['gpupool']} (torch {v['torch']}, triton {v['triton']}, python {v['python']})"


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str | None) -> str:
    """The device the device pool runs on: ``requested`` (already ``cpu`` or ``cuda[:N]``) if this
    machine has it, else CLIError saying what to use instead; None picks :func:`default_device`."""
    import torch

    if requested is None:
        return default_device()
    if requested == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise CLIError(f"--device {requested}: torch {torch.__version__} sees no CUDA device on this machine; "
                       f"use --device cpu (the device pool in Triton's interpreter, slow) or leave --device out")
    idx = int(requested.split(":")[1]) if ":" in requested else 0
    if idx >= torch.cuda.device_count():
        raise CLIError(f"--device {requested}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                       f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return requested


def _ensure_backend(device: str, argv: list[str] | None) -> None:
    """Make the kernels run where ``device`` needs them: Triton's interpreter for ``cpu``, compiled for
    CUDA. Triton fixes that when ``gpupool`` is imported (``TRITON_INTERPRET``), so a command-line run
    that needs the other backend re-executes itself once with the variable set."""
    from . import _backend

    want_interp = device == "cpu"
    if want_interp == _backend.interpreted():
        return
    value = "1" if want_interp else "0"
    if argv is not None or os.environ.get(_REEXEC_ENV):
        raise CLIError(f"--device {device} needs TRITON_INTERPRET={value}, but gpupool was imported with the "
                       f"kernels set up for {'the GPU' if want_interp else 'the interpreter'}; "
                       f"run the command with TRITON_INTERPRET={value}")
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, TRITON_INTERPRET=value, **{_REEXEC_ENV: "1"})
    os.execve(sys.executable, [sys.executable, "-m", "gpupool", *sys.argv[1:]], env)


#: Bytes a pool holds per block, about (measured on CPU, 2 M blocks: 145 reference, 272 device in the
#: interpreter); the up-front check allows twice that.
POOL_BYTES_PER_BLOCK = {"reference": 300, "device": 550}


def _available_bytes(device: str | None) -> int | None:
    """Free memory where the pool would live (CUDA: the device's; else the host's), None if unknown."""
    from .memory import available_bytes

    return available_bytes(device)


def _check_pool_memory(kind: str, num_blocks: int, device: str | None) -> None:
    """CLIError (exit 2) before anything is built when the pool cannot fit in free memory."""
    need = POOL_BYTES_PER_BLOCK[kind] * num_blocks
    free = _available_bytes(device if kind == "device" else None)
    if free is not None and need > free:
        raise CLIError(f"--num-blocks {num_blocks:,}: the {kind} pool needs about {need / 2**30:.1f} GiB and "
                       f"{free / 2**30:.1f} GiB is free; choose a smaller pool (about "
                       f"{free // POOL_BYTES_PER_BLOCK[kind]:,} blocks fit)")


def make_pool(kind: str, num_blocks: int, device: str | None = None):
    """A fresh pool: ``"reference"`` (CPU oracle) or ``"device"`` (``gpupool.BlockPool`` on ``device``).

    The device pool is imported here, lazily; when it cannot be imported this raises CLIError.
    """
    if kind == "reference":
        from .reference import ReferenceBlockPool as make
    elif kind == "device":
        if device is None:
            device = default_device()
        try:
            from . import BlockPool
        except ImportError as e:
            raise CLIError(f"the device pool gpupool.BlockPool is not available ({e}); "
                           f"use --pool reference for the CPU reference pool") from None

        def make(n):
            return BlockPool(n, device=device)
    else:
        raise CLIError(f"unknown pool kind {kind!r} (expected 'device' or 'reference')")
    _check_pool_memory(kind, num_blocks, device)
    try:
        return make(num_blocks)
    except PoolError as e:
        raise CLIError(f"--num-blocks {num_blocks:,}: {e}") from None
    except (MemoryError, RuntimeError) as e:  # torch reports an allocation failure as RuntimeError
        raise CLIError(f"--num-blocks {num_blocks:,}: cannot allocate the {kind} pool ({str(e).splitlines()[0][:120]}); "
                       "choose a smaller pool") from None


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


_positive_int = _int_at_least(1)


def _device_limit(text: str):
    return None if text.strip().lower() == "all" else _positive_int(text)


def _device_arg(text: str) -> str:
    t = text.strip().lower()
    if t == "cpu:0":  # torch's name for the one CPU device
        t = "cpu"
    if t == "cpu" or t == "cuda" or re.fullmatch(r"cuda:\d+", t):
        return t
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda or cuda:N")


def _tpot(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpupool", description="A KV-cache block pool whose bookkeeping lives on the GPU "
                                            "(docs: docs/semantics.md, docs/design.md, docs/errors.md).")
    p.add_argument("--version", action="version", version=_version_text())
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    r = sub.add_parser("replay", help="replay a Mooncake-format trace on the block pools (docs/semantics.md section 5)",
                       description="Replay a Mooncake-format JSON-lines trace on a block pool and report prefix-cache "
                                   "hits and the final free-queue digest; the device pool is checked against the "
                                   "reference pool (docs/semantics.md section 5).",
                       epilog="--pool auto (the default): with a CUDA device, the device pool replays the whole trace "
                              "and the reference pool checks it (and the speed ratio is printed). Without one, the "
                              "reference pool replays the whole trace and the device pool, in Triton's CPU "
                              "interpreter, the first --device-limit requests, checked against the reference pool on "
                              "those requests; no speed is compared. Errors exit 2 (docs/errors.md).")
    r.add_argument("trace", nargs="?", metavar="TRACE",
                   help="JSON-lines trace (default: the bundled Mooncake conversation trace, 12,031 requests)")
    r.add_argument("--pool", choices=("auto", "device", "reference", "both"), default="auto",
                   help="auto (default, see below); device or reference: that pool alone; both: both pools on the "
                        "same requests, exit 1 unless their reports agree")
    r.add_argument("--num-blocks", type=_positive_int, default=DEFAULT_NUM_BLOCKS,
                   help=f"pool size N, null block included (default {DEFAULT_NUM_BLOCKS:,})")
    r.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per pool block (default {DEFAULT_BLOCK_SIZE}, the bundled trace's); must equal "
                        "--trace-block-size, since pool block i is keyed by the trace's hash id i")
    r.add_argument("--trace-block-size", type=_positive_int, default=TRACE_BLOCK_SIZE,
                   help=f"tokens per hash id in the trace (default {TRACE_BLOCK_SIZE}, Mooncake's): a line needs "
                        "ceil(input_length / this) hash_ids")
    r.add_argument("--lenient", action="store_true",
                   help="accept lines whose hash_ids are too short (kept: the blocks without an id are not cached) or "
                        "too long (cut); the report counts them")
    r.add_argument("--tpot-ms", type=_tpot, default=DEFAULT_TPOT_MS,
                   help=f"time per output token in ms (default {DEFAULT_TPOT_MS:g})")
    r.add_argument("--limit", type=_positive_int, default=None,
                   help="replay only the first LIMIT requests (in time order) on every pool (default: all)")
    r.add_argument("--device-limit", type=_device_limit, default=CPU_DEVICE_DEFAULT_LIMIT, metavar="N",
                   help=f"requests the device pool replays when it runs in Triton's CPU interpreter (default "
                        f"{CPU_DEVICE_DEFAULT_LIMIT}; 'all' for every one; ignored on a GPU)")
    r.add_argument("--device", type=_device_arg, default=None,
                   help="torch device of the device pool: cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    r.add_argument("--json", metavar="PATH",
                   help="write the report as JSON to PATH ('-': stdout, and the text report goes to stderr)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    r.set_defaults(func=cmd_replay)
    _add_bench_parser(sub)
    return p


# ---- bench ------------------------------------------------------------------------------------------

def _add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="run the benchmark suite (bench/) and plot it",
                       description="Run the pytest-benchmark suite in the repository's bench/ folder (the device pool "
                                   "against the reference pool and, when installed, vLLM's BlockPool), print a "
                                   "summary table, and write PREFIX.json (pytest-benchmark's JSON), PREFIX.png "
                                   "(latency against batch size per op, replay throughput) and PREFIX.log (pytest's "
                                   "full output). The README explains the columns.")
    b.add_argument("--out", metavar="PREFIX", default=None,
                   help="output prefix (default: bench/out/bench in the repository)")
    b.add_argument("--quick", action="store_true",
                   help="the CPU-sized grid (device pool: batch 1 and 64, pool 4096; the default without CUDA)")
    b.add_argument("-k", metavar="EXPR", dest="k", default=None, help="only the benchmarks matching EXPR (pytest -k)")
    b.add_argument("--verbose", action="store_true", help="show pytest's own output (its tables) as it runs")
    b.set_defaults(func=cmd_bench)


def bench_dir() -> Path:
    """The benchmark suite: ``bench/`` at the root of a source checkout (``src/gpupool/cli.py`` is
    two folders below it)."""
    return Path(__file__).resolve().parents[2] / "bench"


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


def cmd_bench(args) -> int:
    import subprocess

    missing = [m for m in ("matplotlib", "pytest", "pytest_benchmark") if importlib.util.find_spec(m) is None]
    if missing:
        raise CLIError(f"gpupool bench needs {', '.join(missing)}: pip install 'gpupool[cli,test]'")
    suite = bench_dir()
    if not (suite / "test_bench_pool.py").is_file() or not (suite / "plot.py").is_file():
        raise CLIError(f"the benchmark suite is not at {suite}: `gpupool bench` runs the bench/ folder of a "
                       f"source checkout (install it with `pip install -e .` from the repository)")
    prefix = Path(args.out) if args.out else suite / "out" / "bench"
    json_path = prefix.with_name(prefix.name + ".json")
    png_path = prefix.with_name(prefix.name + ".png")
    log_path = prefix.with_name(prefix.name + ".log")
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
    interrupted = False
    with log:
        proc = subprocess.Popen(cmd, cwd=str(suite.parent), env=env, stdout=None if args.verbose else log,
                                stderr=subprocess.STDOUT if not args.verbose else None)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # pytest (same process group) got the interrupt too: it stops and still writes the JSON
            # of the benchmarks that finished, which is summarised below.
            interrupted = True
            try:
                rc = proc.wait(timeout=60)
            except (KeyboardInterrupt, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
                raise
    log_text = log_path.read_text(encoding="utf-8", errors="replace") if not args.verbose else ""
    if rc == 5:
        raise CLIError("no benchmark was selected" + (f" by -k {args.k!r}" if args.k else ""))
    if not json_path.is_file():
        tail = "\n".join(log_text.splitlines()[-15:])
        raise CLIError(f"the benchmark run wrote no results (pytest exit status {rc}); the end of {log_path}:\n{tail}",
                       code=1)
    plot = _load_bench_plot(suite)
    plot.plot(json_path, png_path)
    print(plot.table(json_path))
    skips = skip_reasons(log_text)
    if skips:
        print(f"skipped {_count(sum(n for n, _ in skips), 'case')}:")
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


def _load_bench_plot(suite: Path):
    spec = importlib.util.spec_from_file_location("gpupool_bench_plot", suite / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- replay -----------------------------------------------------------------------------------------

def _fmt_int(x: int) -> str:
    return f"{x:,}"


def _count(n: int, noun: str) -> str:
    """``1 request``, ``2 requests``, ``12,031 requests``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def format_report(rep: ReplayReport, speed: bool = True) -> str:
    """The text form of a report; ``speed=False`` leaves out the timing lines (interpreter runs)."""
    lines = [
        f"pool            {rep.pool}: {_fmt_int(rep.num_blocks)} blocks x {rep.block_size} tokens, "
        f"tpot {rep.tpot_ms:g} ms",
        f"requests        {_fmt_int(rep.requests)}",
        f"admitted        {_fmt_int(rep.admitted)} ({_fmt_int(rep.waited)} after waiting)",
        f"rejected        {_fmt_int(rep.rejected)}",
        f"prompt blocks   {_fmt_int(rep.prompt_blocks)}",
        f"hit blocks      {_fmt_int(rep.hit_blocks)}",
        f"hit ratio       {rep.hit_ratio:.4f}",
        f"peak in use     {_fmt_int(rep.peak_blocks_in_use)} blocks",
        f"free queue      sha256 {rep.free_queue_sha256}",
    ]
    if speed:
        lines += [f"wall time       {rep.wall_s:.3f} s", f"requests/s      {rep.requests_per_s:,.0f}"]
    else:
        lines += [f"wall time       {rep.wall_s:.3f} s (Triton interpreter: not a speed measurement)"]
    return "\n".join(lines)


def format_comparison(ref: ReplayReport, dev: ReplayReport) -> str:
    """The two reports' checked fields side by side (device pool first)."""
    rows = [("requests", _fmt_int(dev.requests), _fmt_int(ref.requests)),
            ("admitted", _fmt_int(dev.admitted), _fmt_int(ref.admitted)),
            ("rejected", _fmt_int(dev.rejected), _fmt_int(ref.rejected)),
            ("prompt blocks", _fmt_int(dev.prompt_blocks), _fmt_int(ref.prompt_blocks)),
            ("hit blocks", _fmt_int(dev.hit_blocks), _fmt_int(ref.hit_blocks)),
            ("free queue", dev.free_queue_sha256[:16], ref.free_queue_sha256[:16])]
    lines = [f"{'':<16}{'device pool':<20}reference pool"]
    lines += [f"{name:<16}{d:<20}{r}" + ("" if d == r else "   <- differs") for name, d, r in rows]
    return "\n".join(lines)


class _Lines:
    """A file for tqdm when stderr is not a terminal (a log, a pipe): each refresh of the bar as one
    line, as pip and CI logs show progress, instead of carriage returns that pile up on one line."""

    def __init__(self, f):
        self.f = f

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.f.write(text + "\n")

    def flush(self) -> None:
        self.f.flush()


def _progress(flag: bool | None, desc: str):
    """The ``progress`` argument of a replay, the same rule for every pool: a bar when stderr is a
    terminal; when it is not (output redirected), a line every 10 s once a run has taken 10 s (with
    ``--progress``, from the start); none with ``--no-progress``."""
    if flag is False:
        return False
    if importlib.util.find_spec("tqdm") is None:
        if flag:
            raise CLIError("--progress needs tqdm: pip install 'gpupool[cli]' (or tqdm)")
        return False
    kw = {"desc": desc, "unit": "req", "leave": True}
    if not sys.stderr.isatty():
        kw.update(mininterval=10.0, maxinterval=10.0, delay=0.0 if flag else 10.0, file=_Lines(sys.stderr),
                  ncols=100)
    return kw


def _check_json_path(path: str | None) -> None:
    """Fail before any work when the report could not be written."""
    if path is None or path == "-":
        return
    if not path.strip():
        raise CLIError("--json needs a file name (or '-' for stdout)")
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"--json {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"--json {path}: the folder {parent} does not exist")
    existed = p.exists()
    try:  # open it for appending: the only test that /proc, a read-only mount or ACLs cannot fool
        with open(p, "a"):
            pass
    except OSError as e:
        raise CLIError(f"--json {path}: not writable ({e.strerror}); choose another path or '-' for stdout") from None
    if not existed:
        p.unlink()


def _device_label(device: str | None) -> str | None:
    if device is None:
        return None
    if device == "cpu":
        return "cpu (Triton interpreter)"
    import torch

    idx = int(device.split(":")[1]) if ":" in device else 0
    return f"{device} ({torch.cuda.get_device_name(idx)})"


def _compare(ref: ReplayReport, dev: ReplayReport) -> list[str]:
    return [f for f in MATCH_FIELDS if getattr(ref, f) != getattr(dev, f)]


def _blocks_needed(r, block_size: int) -> int:
    return -(-(r.input_length + r.output_length) // block_size)


def cmd_replay(args, argv: list[str] | None = None) -> int:
    _check_json_path(args.json)
    out = sys.stderr if args.json == "-" else sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    uses_device = args.pool != "reference"
    if args.device is not None and not uses_device:
        raise CLIError(f"--device {args.device}: --pool reference runs on the host only; drop --device or use "
                       f"--pool device / both")
    if args.block_size != args.trace_block_size:
        # the replay keys pool block i by hash id i (docs/semantics.md section 5): at another block size
        # those ids would name other tokens, and the hit ratios would mean nothing
        raise CLIError(f"--block-size {args.block_size}: the trace has one hash id per {args.trace_block_size} "
                       f"tokens (--trace-block-size), so a pool block must hold {args.trace_block_size} tokens; use "
                       f"--block-size {args.trace_block_size}, or a trace hashed per {args.block_size} tokens with "
                       f"--trace-block-size {args.block_size}")
    device = resolve_device(args.device) if uses_device else None
    if device is not None:
        _ensure_backend(device, argv)
    interp = device == "cpu"
    try:
        tr = read_trace(args.trace, limit=args.limit, block_size=args.trace_block_size, lenient=args.lenient)
    except FileNotFoundError:
        raise CLIError(f"trace file not found: {args.trace}") from None
    except TraceError as e:
        raise CLIError(f"bad trace: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read trace {args.trace}: {e}") from None
    trace = tr.requests
    usable = args.num_blocks - 1
    needs = [_blocks_needed(r, args.block_size) for r in trace]
    if min(needs) > usable:
        raise CLIError(f"the pool is too small for any request: {args.num_blocks:,} blocks ({usable:,} usable) but the "
                       f"smallest request needs {min(needs):,} blocks of {args.block_size} tokens; use --num-blocks "
                       f">= {min(needs) + 1:,} (every request fits from {max(needs) + 1:,})")
    label = args.trace or "bundled Mooncake conversation trace"
    say(f"trace           {label}: {_count(len(trace), 'request')}"
        + (f" (--limit {args.limit} of {tr.lines:,})" if args.limit is not None and args.limit < tr.lines else ""))
    for note in tr.notes:
        say(f"note: {note}")
    too_big = sum(1 for n in needs if n > usable)
    if too_big:
        say(f"note: {_count(too_big, 'request')} {'needs' if too_big == 1 else 'need'} more than the pool's {usable:,} usable blocks and {'is' if too_big == 1 else 'are'} rejected "
            f"(--num-blocks {max(needs) + 1:,} admits all)")
    env = {"device": _device_label(device), "interpreter": interp, **versions()}
    meta = {"trace": label, "limit": args.limit, "mode": args.pool, "trace_check": tr.summary(), "environment": env}

    def run(kind: str, reqs, desc: str) -> ReplayReport:
        from .pool import BlockPool

        pool = make_pool(kind, args.num_blocks, device)
        fn = _device_replay() if isinstance(pool, BlockPool) else replay  # tests may stand a pool in
        try:
            return fn(pool, reqs, block_size=args.block_size, tpot_ms=args.tpot_ms,
                      progress=_progress(args.progress, desc))
        except MemoryError:
            raise CLIError(f"--num-blocks {args.num_blocks:,}: out of memory while replaying on the {kind} pool; "
                           "choose a smaller pool") from None

    dev_reqs = trace if not interp or args.device_limit is None else trace[:args.device_limit]
    dev_cut = len(dev_reqs) < len(trace)
    dev_title = f"device pool: gpupool.BlockPool on {_device_label(device)}"
    ref_title = "reference pool: gpupool.ReferenceBlockPool (pure Python, CPU)"
    whole = f"first {_count(len(trace), 'request')}" if len(trace) < tr.lines else "whole trace"
    code = 0
    if args.pool == "reference":
        say(f"--- {ref_title}, {whole}")
        rep = run("reference", trace, "reference pool")
        say(format_report(rep))
        result = _json_result(meta, reference=rep)
    elif args.pool == "device":
        if dev_cut:
            say(f"note: the device pool runs in Triton's CPU interpreter: replaying the first "
                f"{_count(len(dev_reqs), 'request')} (--device-limit)")
        say(f"--- {dev_title}" + (f", first {_count(len(dev_reqs), 'request')}" if dev_cut else f", {whole}"))
        rep = run("device", dev_reqs, "device pool")
        say(format_report(rep, speed=not interp))
        result = _json_result(meta, device=rep)
    else:
        # auto on a GPU and both: the same requests on both pools. auto on the interpreter: the whole
        # trace on the reference pool, and the device pool on a prefix checked against it.
        same = args.pool == "both" or not interp
        if args.pool == "both" and dev_cut:
            say(f"note: the device pool runs in Triton's CPU interpreter: both pools replay the first "
                f"{_count(len(dev_reqs), 'request')} (--device-limit)")
            trace = dev_reqs
            dev_cut = False
        whole = f"first {_count(len(trace), 'request')}" if len(trace) < tr.lines else "whole trace"
        if same:
            say(f"--- result: {dev_title}, {whole}")
            dev = run("device", dev_reqs, "device pool")
            say(format_report(dev, speed=not interp))
            say(f"--- check: the {ref_title}, same requests")
            ref = check_ref = run("reference", trace, "reference pool")
        else:
            say(f"--- result: {ref_title}, {whole}")
            ref = run("reference", trace, "reference pool")
            say(format_report(ref))
            say(f"--- check: {dev_title}, first {_count(len(dev_reqs), 'request')} (slow: the interpreter runs each "
                f"kernel on the CPU; the progress bar shows the rate), against the reference pool on the same requests")
            dev = run("device", dev_reqs, "device pool")
            check_ref = ref if not dev_cut else run("reference", dev_reqs, "reference pool, check")
        mismatched = _compare(check_ref, dev)
        say(format_comparison(check_ref, dev))
        n_checked = len(dev_reqs)
        if mismatched:
            for f in mismatched:
                print(f"MISMATCH {f}: reference {getattr(check_ref, f)!r} != device {getattr(dev, f)!r}", file=sys.stderr)
            print("gpupool: error: the device pool and the reference pool disagree (a bug; please report it with "
                  "the command line)", file=sys.stderr)
            code = 1
        else:
            say(f"identical       yes: the device pool's counts and free-queue digest equal the reference pool's "
                f"on {'the same' if same else 'the first'} {_count(n_checked, 'request')}")
        speedup = None
        if interp:
            say("speed           not compared: the device pool ran in Triton's CPU interpreter, which says nothing "
                "about its speed on a GPU")
        else:
            speedup = ref.wall_s / dev.wall_s if dev.wall_s > 0 else None
            say(f"speed           device {speedup or float('inf'):.2f}x the reference pool "
                f"({dev.requests_per_s:,.0f} vs {ref.requests_per_s:,.0f} requests/s)")
        result = _json_result(meta, reference=ref, device=dev, checked_requests=n_checked, match=not mismatched,
                              mismatched=mismatched, speedup=speedup,
                              reference_on_checked_requests=check_ref if check_ref is not ref else None)
    _write_json(args.json, result)
    return code


def _json_result(meta: dict, *, reference=None, device=None, checked_requests=None, match=None, mismatched=(),
                 speedup=None, reference_on_checked_requests=None) -> dict:
    """The ``--json`` report, one shape in every ``--pool`` mode: the run's metadata, then
    ``reference`` / ``device`` (a pool's report, or null when that pool did not run),
    ``reference_on_checked_requests`` (the reference on the device's prefix when it differs, else
    null), ``checked_requests``, ``match`` (null unless both pools ran), ``mismatched``, ``speedup``."""
    def report(r):
        return None if r is None else r.to_json_dict()
    return {**meta, "reference": report(reference), "device": report(device),
            "reference_on_checked_requests": report(reference_on_checked_requests),
            "checked_requests": checked_requests, "match": match, "mismatched": list(mismatched), "speedup": speedup}


def _write_json(path: str | None, data: dict) -> None:
    if path is None:
        return
    text = json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e}") from None


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(f"not JSON serialisable: {x!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` command; returns the exit status (argparse errors exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        if args.func is cmd_replay:
            return cmd_replay(args, argv)
        return args.func(args)
    except CLIError as e:
        print(f"gpupool: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("gpupool: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (``gpupool replay | head -1``): stop quietly, as cat or yes do,
        # with the shell's status for SIGPIPE; stdout goes to /dev/null so the exit's flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
