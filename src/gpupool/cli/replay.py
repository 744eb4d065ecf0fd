"""``gpupool replay [TRACE]``: a Mooncake-format trace on the reference pool, the device pool or both,
the device pool checked against the reference pool (docs/semantics.md section 5). The reports' text
and JSON forms are the replay's own (``gpupool.replay.report``); this module picks the pools, the
requests each replays and what is said between the reports."""
from __future__ import annotations

import argparse
import re
import sys

from ..replay import (
    DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS, DEFAULT_TPOT_MS, TRACE_BLOCK_SIZE, ReplayReport, Trace, TraceError,
    bundled_trace_path, format_comparison, format_report, json_report, mismatched_fields, read_trace, replay,
)
from .machine import device_label, device_replay, make_pool, resolve_device, versions
from .output import check_json_path, count, progress, write_json
from .types import CLIError, CLISubcommand

CPU_DEVICE_DEFAULT_LIMIT = 200  # requests, when the device pool runs on Triton's CPU interpreter
_REF_TITLE = "reference pool: gpupool.ReferenceBlockPool (pure Python, CPU)"


# ---- option types (argparse's type=) ------------------------------------------------------------

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


# ---- the command --------------------------------------------------------------------------------

class ReplaySubcommand(CLISubcommand):
    """``gpupool replay [TRACE] [--pool auto|device|reference|both] ...``; :meth:`validate` replaces
    ``args.device`` by the device the device pool runs on (None when it does not run)."""

    name = "replay"
    help = "replay a Mooncake-format trace on the block pools (docs/semantics.md section 5)"
    description = ("Replay a Mooncake-format JSON-lines trace on a block pool and report prefix-cache hits and the "
                   "final free-queue digest; the device pool is checked against the reference pool "
                   "(docs/semantics.md section 5).")
    epilog = ("--pool auto (the default): with a CUDA device, the device pool replays the whole trace and the "
              "reference pool checks it (and the speed ratio is printed). Without one, the reference pool replays "
              "the whole trace and the device pool, in Triton's CPU interpreter, the first --device-limit "
              "requests, checked against the reference pool on those requests; no speed is compared. Errors exit "
              "2 (docs/errors.md).")

    def add_arguments(self, r) -> None:
        r.add_argument("trace", nargs="?", metavar="TRACE",
                       help="JSON-lines trace (default: the bundled Mooncake conversation trace, 12,031 requests)")
        r.add_argument("--pool", choices=("auto", "device", "reference", "both"), default="auto",
                       help="auto (default, see below); device or reference: that pool alone; both: both pools on "
                            "the same requests, exit 1 unless their reports agree")
        r.add_argument("--num-blocks", type=_positive_int, default=DEFAULT_NUM_BLOCKS,
                       help=f"pool size N, null block included (default {DEFAULT_NUM_BLOCKS:,})")
        r.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                       help=f"tokens per pool block (default {DEFAULT_BLOCK_SIZE}, the bundled trace's); must equal "
                            "--trace-block-size, since pool block i is keyed by the trace's hash id i")
        r.add_argument("--trace-block-size", type=_positive_int, default=TRACE_BLOCK_SIZE,
                       help=f"tokens per hash id in the trace (default {TRACE_BLOCK_SIZE}, Mooncake's): a line needs "
                            "ceil(input_length / this) hash_ids")
        r.add_argument("--lenient", action="store_true",
                       help="accept lines whose hash_ids are too short (kept: the blocks without an id are not "
                            "cached) or too long (cut); the report counts them")
        r.add_argument("--tpot-ms", type=_tpot, default=DEFAULT_TPOT_MS,
                       help=f"time per output token in ms (default {DEFAULT_TPOT_MS:g})")
        r.add_argument("--limit", type=_positive_int, default=None,
                       help="replay only the first LIMIT requests (in time order) on every pool (default: all)")
        r.add_argument("--device-limit", type=_device_limit, default=CPU_DEVICE_DEFAULT_LIMIT, metavar="N",
                       help=f"requests the device pool replays when it runs in Triton's CPU interpreter (default "
                            f"{CPU_DEVICE_DEFAULT_LIMIT}; 'all' for every one; ignored on a GPU)")
        r.add_argument("--device", type=_device_arg, default=None,
                       help="torch device of the device pool: cpu, cuda or cuda:N (default: cuda if available, "
                            "else cpu)")
        r.add_argument("--json", metavar="PATH",
                       help="write the report as JSON to PATH ('-': stdout, and the text report goes to stderr)")
        r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bars on stderr (default: when stderr is a terminal)")

    def validate(self, args) -> None:
        check_json_path(args.json, keep=args.trace if args.trace else bundled_trace_path())
        uses_device = args.pool != "reference"
        if args.device is not None and not uses_device:
            raise CLIError(f"--device {args.device}: --pool reference runs on the host only; drop --device or use "
                           f"--pool device / both")
        if args.block_size != args.trace_block_size:
            # the replay keys pool block i by hash id i (docs/semantics.md section 5): at another block size
            # those ids would name other tokens, and the hit ratios would mean nothing
            raise CLIError(f"--block-size {args.block_size}: the trace has one hash id per {args.trace_block_size} "
                           f"tokens (--trace-block-size), so a pool block must hold {args.trace_block_size} tokens; "
                           f"use --block-size {args.trace_block_size}, or a trace hashed per {args.block_size} tokens "
                           f"with --trace-block-size {args.block_size}")
        args.device = resolve_device(args.device) if uses_device else None

    def kernel_device(self, args) -> str | None:
        return args.device

    def cmd(self, args) -> int:
        run = _Run(args, _read_trace(args))
        run.header()
        if args.pool == "reference":
            result, code = run.reference_alone(), 0
        elif args.pool == "device":
            result, code = run.device_alone(), 0
        else:
            result, code = run.checked()
        write_json(args.json, result)
        return code


def _read_trace(args) -> Trace:
    """The trace of ``args``, every way it can fail a CLIError."""
    try:
        return read_trace(args.trace, limit=args.limit, block_size=args.trace_block_size, lenient=args.lenient)
    except FileNotFoundError:
        raise CLIError(f"trace file not found: {args.trace}") from None
    except TraceError as e:
        raise CLIError(f"bad trace: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read trace {args.trace}: {e}") from None


def _blocks_needed(r, block_size: int) -> int:
    return -(-(r.input_length + r.output_length) // block_size)


class _Run:
    """One replay run: the requests each pool replays, the text report (stdout, or stderr when the JSON
    goes to stdout) and the JSON report's metadata."""

    def __init__(self, args, tr: Trace):
        self.args, self.tr, self.trace = args, tr, tr.requests
        self.device = args.device
        self.interp = self.device == "cpu"
        self.out = sys.stderr if args.json == "-" else sys.stdout
        self.label = args.trace or "bundled Mooncake conversation trace"
        env = {"device": device_label(self.device), "interpreter": self.interp, **versions()}
        self.meta = {"trace": self.label, "limit": args.limit, "mode": args.pool, "trace_check": tr.summary(),
                     "environment": env}
        self.dev_reqs = (self.trace if not self.interp or args.device_limit is None
                         else self.trace[:args.device_limit])
        self.dev_cut = len(self.dev_reqs) < len(self.trace)
        self.dev_title = f"device pool: gpupool.BlockPool on {device_label(self.device)}"

    def header(self) -> None:
        """CLIError when no request fits the pool; else the trace's lines: its size, the reader's notes,
        the requests the pool rejects for their size."""
        args, tr = self.args, self.tr
        usable = args.num_blocks - 1
        needs = [_blocks_needed(r, args.block_size) for r in self.trace]
        if min(needs) > usable:
            raise CLIError(f"the pool is too small for any request: {args.num_blocks:,} blocks ({usable:,} usable) "
                           f"but the smallest request needs {min(needs):,} blocks of {args.block_size} tokens; use "
                           f"--num-blocks >= {min(needs) + 1:,} (every request fits from {max(needs) + 1:,})")
        self.say(f"trace           {self.label}: {count(len(self.trace), 'request')}"
                 + (f" (--limit {args.limit} of {tr.lines:,})" if args.limit is not None and args.limit < tr.lines
                    else ""))
        for note in tr.notes:
            self.say(f"note: {note}")
        too_big = sum(1 for n in needs if n > usable)
        if too_big:
            self.say(f"note: {count(too_big, 'request')} {'needs' if too_big == 1 else 'need'} more than the pool's "
                     f"{usable:,} usable blocks and {'is' if too_big == 1 else 'are'} rejected "
                     f"(--num-blocks {max(needs) + 1:,} admits all)")

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def span(self, reqs) -> str:
        """``whole trace``, or ``first N requests`` when ``reqs`` is a part of the trace's lines."""
        return f"first {count(len(reqs), 'request')}" if len(reqs) < self.tr.lines else "whole trace"

    def replay(self, kind: str, reqs, desc: str) -> ReplayReport:
        """``reqs`` on a fresh pool of ``kind`` (``reference`` or ``device``)."""
        from ..pool import BlockPool

        args = self.args
        pool = make_pool(kind, args.num_blocks, self.device)
        fn = device_replay() if isinstance(pool, BlockPool) else replay  # tests may stand a pool in
        try:
            return fn(pool, reqs, block_size=args.block_size, tpot_ms=args.tpot_ms,
                      progress=progress(args.progress, desc))
        except MemoryError:
            raise CLIError(f"--num-blocks {args.num_blocks:,}: out of memory while replaying on the {kind} pool; "
                           "choose a smaller pool") from None

    def note_device_limit(self, what: str) -> None:
        self.say(f"note: the device pool runs in Triton's CPU interpreter: {what} the first "
                 f"{count(len(self.dev_reqs), 'request')} (--device-limit)")

    def reference_alone(self) -> dict:
        """``--pool reference``: the JSON report."""
        self.say(f"--- {_REF_TITLE}, {self.span(self.trace)}")
        rep = self.replay("reference", self.trace, "reference pool")
        self.say(format_report(rep))
        return json_report(self.meta, reference=rep)

    def device_alone(self) -> dict:
        """``--pool device``: the JSON report."""
        if self.dev_cut:
            self.note_device_limit("replaying")
        self.say(f"--- {self.dev_title}, " + (f"first {count(len(self.dev_reqs), 'request')}" if self.dev_cut
                                               else self.span(self.trace)))
        rep = self.replay("device", self.dev_reqs, "device pool")
        self.say(format_report(rep, speed=not self.interp))
        return json_report(self.meta, device=rep)

    def checked(self) -> tuple[dict, int]:
        """``--pool auto`` and ``both``: the device pool checked against the reference pool; the JSON
        report and the exit status (1 when they disagree).

        auto on a GPU and both: the same requests on both pools. auto on the interpreter: the whole
        trace on the reference pool, and the device pool on a prefix checked against it."""
        same = self.args.pool == "both" or not self.interp
        if self.args.pool == "both" and self.dev_cut:
            self.note_device_limit("both pools replay")
            self.trace, self.dev_cut = self.dev_reqs, False
        whole = self.span(self.trace)
        if same:
            self.say(f"--- result: {self.dev_title}, {whole}")
            dev = self.replay("device", self.dev_reqs, "device pool")
            self.say(format_report(dev, speed=not self.interp))
            self.say(f"--- check: the {_REF_TITLE}, same requests")
            ref = check_ref = self.replay("reference", self.trace, "reference pool")
        else:
            self.say(f"--- result: {_REF_TITLE}, {whole}")
            ref = self.replay("reference", self.trace, "reference pool")
            self.say(format_report(ref))
            self.say(f"--- check: {self.dev_title}, first {count(len(self.dev_reqs), 'request')} (slow: the "
                     f"interpreter runs each kernel on the CPU; the progress bar shows the rate), against the "
                     f"reference pool on the same requests")
            dev = self.replay("device", self.dev_reqs, "device pool")
            check_ref = ref if not self.dev_cut else self.replay("reference", self.dev_reqs, "reference pool, check")
        return self.verdict(ref, dev, check_ref, same)

    def verdict(self, ref: ReplayReport, dev: ReplayReport, check_ref: ReplayReport, same: bool) -> tuple[dict, int]:
        """Whether ``dev`` equals ``check_ref`` (the reference pool on the device pool's requests), side by
        side, and the speed ratio of ``dev`` and ``ref`` (on the same requests) where it means one."""
        mismatched = mismatched_fields(check_ref, dev)
        self.say(format_comparison(check_ref, dev))
        n_checked = len(self.dev_reqs)
        if mismatched:
            for f in mismatched:
                print(f"MISMATCH {f}: reference {getattr(check_ref, f)!r} != device {getattr(dev, f)!r}",
                      file=sys.stderr)
            print("gpupool: error: the device pool and the reference pool disagree (a bug; please report it with "
                  "the command line)", file=sys.stderr)
        else:
            self.say(f"identical       yes: the device pool's counts and free-queue digest equal the reference "
                     f"pool's on {'the same' if same else 'the first'} {count(n_checked, 'request')}")
        speedup = None
        if self.interp:
            self.say("speed           not compared: the device pool ran in Triton's CPU interpreter, which says "
                     "nothing about its speed on a GPU")
        else:
            speedup = ref.wall_s / dev.wall_s if dev.wall_s > 0 else None
            self.say(f"speed           device {speedup or float('inf'):.2f}x the reference pool "
                     f"({dev.requests_per_s:,.0f} vs {ref.requests_per_s:,.0f} requests/s)")
        result = json_report(self.meta, reference=ref, device=dev, checked_requests=n_checked,
                             match=not mismatched, mismatched=mismatched, speedup=speedup,
                             reference_on_checked_requests=check_ref if check_ref is not ref else None)
        return result, 1 if mismatched else 0


def cmd_init() -> list[CLISubcommand]:
    return [ReplaySubcommand()]
