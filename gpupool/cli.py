"""Command line: ``gpupool replay [TRACE]`` replays a Mooncake-format trace on a block pool.

Examples::

    gpupool replay                                  # bundled trace, device pool
    gpupool replay --pool reference                 # CPU reference pool, whole trace
    gpupool replay --pool both --json out.json      # both pools; exit 1 unless they agree
    gpupool bench --quick                           # benchmarks (bench/), JSON + PNG under bench/out/

The model is docs/semantics.md section 5 (see :mod:`gpupool.replay`). With ``--pool both`` the two reports
must agree on every count and on the free-queue digest; the speed ratio is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .replay import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS, DEFAULT_TPOT_MS, ReplayReport, load_trace, replay

CPU_DEVICE_DEFAULT_LIMIT = 200  # requests, when the device pool runs on Triton's CPU interpreter
MATCH_FIELDS = ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256")


class CLIError(Exception):
    """A user-facing error: printed as ``gpupool: error: ...`` with exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def default_device() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(kind: str, num_blocks: int, device: str | None = None):
    """A fresh pool: ``"reference"`` (CPU oracle) or ``"device"`` (``gpupool.BlockPool`` on ``device``).

    The device pool is imported here, lazily; when it cannot be imported this raises CLIError. On
    ``device="cpu"`` Triton's interpreter is selected (``TRITON_INTERPRET=1``) unless the environment
    already says otherwise.
    """
    if kind == "reference":
        from .reference import ReferenceBlockPool

        return ReferenceBlockPool(num_blocks)
    if kind == "device":
        if device is None:
            device = default_device()
        if str(device).startswith("cpu"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            from . import BlockPool
        except ImportError as e:
            raise CLIError(f"the device pool gpupool.BlockPool is not available ({e}); "
                           f"use --pool reference for the CPU reference pool") from None
        return BlockPool(num_blocks, device=device)
    raise CLIError(f"unknown pool kind {kind!r} (expected 'device' or 'reference')")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _tpot(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool", description="A KV-cache block pool whose bookkeeping lives on the GPU.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    r = sub.add_parser("replay", help="replay a Mooncake-format trace on a block pool (docs/semantics.md section 5)",
                       description="Replay a Mooncake-format JSON-lines trace on a block pool and report "
                                   "prefix-cache hits, the final free-queue digest and the speed.")
    r.add_argument("trace", nargs="?", metavar="TRACE",
                   help="JSON-lines trace (default: the bundled Mooncake conversation trace, 12,031 requests)")
    r.add_argument("--num-blocks", type=_positive_int, default=DEFAULT_NUM_BLOCKS,
                   help=f"pool size N, null block included (default {DEFAULT_NUM_BLOCKS})")
    r.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per block (default {DEFAULT_BLOCK_SIZE}, the bundled trace's)")
    r.add_argument("--tpot-ms", type=_tpot, default=DEFAULT_TPOT_MS,
                   help=f"time per output token in ms (default {DEFAULT_TPOT_MS:g})")
    r.add_argument("--pool", choices=("device", "reference", "both"), default="device",
                   help="which pool to drive (default device; 'both' checks that they agree)")
    r.add_argument("--limit", type=_non_negative_int, default=None,
                   help="replay only the first LIMIT requests (default: all; "
                        f"{CPU_DEVICE_DEFAULT_LIMIT} when the device pool runs on the CPU interpreter)")
    r.add_argument("--json", metavar="PATH", help="write the report(s) as JSON to PATH")
    r.add_argument("--device", default=None,
                   help="torch device of the device pool (default: cuda if available, else cpu)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar on stderr (default: when stderr is a terminal, "
                        "or every 10 s for the device pool on the CPU interpreter)")
    r.set_defaults(func=cmd_replay)
    _add_bench_parser(sub)
    return p


def _add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="run the benchmark suite (bench/) and plot it",
                       description="Run the pytest-benchmark suite in the repository's bench/ folder (the "
                                   "device pool against the reference pool and, when installed, vLLM's "
                                   "BlockPool), then write PREFIX.json (pytest-benchmark's JSON) and "
                                   "PREFIX.png (latency against batch size per op, replay throughput).")
    b.add_argument("--out", metavar="PREFIX", default=None,
                   help="output prefix (default: bench/out/bench in the repository)")
    b.add_argument("--quick", action="store_true",
                   help="the CPU-sized grid (device pool: batch 1 and 64, pool 4096; the default without CUDA)")
    b.add_argument("-k", metavar="EXPR", dest="k", default=None, help="only the benchmarks matching EXPR (pytest -k)")
    b.set_defaults(func=cmd_bench)


def bench_dir() -> Path:
    """The benchmark suite: ``bench/`` next to the package in a source checkout."""
    return Path(__file__).resolve().parents[1] / "bench"


def cmd_bench(args) -> int:
    import subprocess

    suite = bench_dir()
    if not (suite / "test_bench_pool.py").is_file() or not (suite / "plot.py").is_file():
        raise CLIError(f"the benchmark suite is not at {suite}: `gpupool bench` runs the bench/ folder of a "
                       f"source checkout (install it with `pip install -e .` from the repository)")
    prefix = Path(args.out) if args.out else suite / "out" / "bench"
    json_path = prefix.with_name(prefix.name + ".json")
    png_path = prefix.with_name(prefix.name + ".png")
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot create {json_path.parent}: {e}") from None
    if json_path.exists():
        json_path.unlink()
    env = dict(os.environ)
    if args.quick:
        env["GPUPOOL_BENCH_GRID"] = "quick"
    cmd = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
           f"--benchmark-json={json_path}", "--benchmark-columns=min,median,max,rounds"]
    if args.k:
        cmd += ["-k", args.k]
    print("running: " + " ".join(cmd), flush=True)
    interrupted = False
    proc = subprocess.Popen(cmd, cwd=str(suite.parent), env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        # pytest (same process group) got the interrupt too: it stops and still writes the JSON
        # of the benchmarks that finished, which is plotted below.
        interrupted = True
        try:
            rc = proc.wait(timeout=60)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            raise
    if rc == 5:
        raise CLIError("no benchmark was selected" + (f" by -k {args.k!r}" if args.k else ""))
    if not json_path.is_file():
        raise CLIError(f"the benchmark run wrote no results (pytest exit status {rc})", code=1)
    plot = _load_bench_plot(suite)
    plot.plot(json_path, png_path)
    print(plot.table(json_path))
    print(f"wrote {json_path}\nwrote {png_path}")
    if interrupted:
        raise CLIError("interrupted: the results above are partial", code=130)
    if rc != 0:
        raise CLIError(f"some benchmarks failed (pytest exit status {rc}); see the output above", code=1)
    return 0


def _load_bench_plot(suite: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpupool_bench_plot", suite / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fmt_int(x: int) -> str:
    return f"{x:,}"


def format_report(rep: ReplayReport) -> str:
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
        f"wall time       {rep.wall_s:.3f} s",
        f"requests/s      {rep.requests_per_s:,.0f}",
    ]
    return "\n".join(lines)


def _progress_setting(flag: bool | None, device_on_cpu: bool):
    if flag is False:
        return False
    if flag is True or sys.stderr.isatty():
        return True
    if device_on_cpu:  # a long run writing to a log: one line every 10 s
        return {"mininterval": 10.0, "maxinterval": 60.0}
    return False


def cmd_replay(args) -> int:
    kinds = ["reference", "device"] if args.pool == "both" else [args.pool]
    device = None
    if "device" in kinds:
        device = args.device or default_device()
    device_on_cpu = device is not None and str(device).startswith("cpu")
    limit, note = args.limit, None
    if limit is None and device_on_cpu:
        limit = CPU_DEVICE_DEFAULT_LIMIT
        note = (f"note: the device pool runs on the CPU (Triton interpreter): replaying the first {limit} "
                f"requests; pass --limit to change that")
    # Build the pools first, so a missing device pool fails before any work.
    pools = {k: make_pool(k, args.num_blocks, device) for k in kinds}
    try:
        trace = load_trace(args.trace, limit)
    except FileNotFoundError:
        raise CLIError(f"trace file not found: {args.trace}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read trace {args.trace}: {e}") from None
    except ValueError as e:
        raise CLIError(f"bad trace: {e}") from None
    label = args.trace or "bundled Mooncake conversation trace"
    print(f"trace           {label}: {_fmt_int(len(trace))} requests"
          + (f" (--limit {limit})" if limit is not None and note is None else ""))
    if note:
        print(note)
    progress = _progress_setting(args.progress, device_on_cpu)
    reports: dict[str, ReplayReport] = {}
    for k in kinds:
        from .pool import BlockPool

        if isinstance(pools[k], BlockPool):
            from .replay.device import replay_on_device as run  # the device loop
        else:
            run = replay
        rep = run(pools[k], trace, block_size=args.block_size, tpot_ms=args.tpot_ms, progress=progress)
        reports[k] = rep
        print(f"--- {k} pool" + (f" on {device}" if k == "device" else ""))
        print(format_report(rep))
    meta = {"trace": label, "limit": limit}
    code = 0
    if args.pool == "both":
        ref, dev = reports["reference"], reports["device"]
        mismatched = [f for f in MATCH_FIELDS if getattr(ref, f) != getattr(dev, f)]
        speedup = ref.wall_s / dev.wall_s if dev.wall_s > 0 else float("inf")
        out = {**meta, "reference": ref.to_json_dict(), "device": dev.to_json_dict(), "match": not mismatched,
               "mismatched": mismatched, "speedup": speedup}
        print("---")
        if mismatched:
            for f in mismatched:
                print(f"MISMATCH {f}: reference {getattr(ref, f)!r} != device {getattr(dev, f)!r}", file=sys.stderr)
            print("gpupool: error: the device pool and the reference pool disagree", file=sys.stderr)
            code = 1
        else:
            print("match           yes: hit counts and free-queue digests are identical")
        print(f"speed           device {speedup:.2f}x the reference pool "
              f"({dev.requests_per_s:,.0f} vs {ref.requests_per_s:,.0f} requests/s)")
    else:
        out = {**meta, **reports[kinds[0]].to_json_dict()}
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise CLIError(f"cannot write {args.json}: {e}") from None
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpupool`` command; returns the exit status (argparse errors exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"gpupool: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
