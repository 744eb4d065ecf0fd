"""The decode loop's throughput (examples/decode_loop.py's ``Engine``; docs/kv_cache.md section 4): B
running requests in steady decode, tokens per second and time per window of each mode.

* ``host``: the reference pool on the host, one pool step per window; the step's block table, lengths,
  slot mapping and positions uploaded in one copy, the model's forward pass a CUDA graph captured over
  static inputs (the upload copied into them), one read of the tokens per step (vLLM's pattern);
* ``window`` (K = ``--steps``): a ``DecodeWindow`` and the model's K forward passes captured as ONE CUDA
  graph per window (``DecodeWindow.capture``); per window one ``set_inputs`` copy, one replay, one read;
* ``spec`` (D = ``--draft``, K = ``--spec-steps``): the same window with D prompt-lookup draft tokens per
  lane, verified in each pass on the device (1 to D + 1 tokens a lane and pass).

    python bench/decode_loop_gpu.py                          # CUDA: B in 64 256 1024, every mode
    python bench/decode_loop_gpu.py --device cpu --batch 2 --steps 2 --iters 2 --no-graph   # a smoke run

The requests are admitted in one op and prefilled once (the engine's own admission and prefill), then
decode: with budgets too large to end (no stops) unless ``--stops``, which gives them budgets of
``--max-new / 2`` to ``--max-new`` tokens, so that requests stop at different passes of a window (the
window frees them inside it), and replaces each stopped request by a new one (admitted, its admission
read at once, and prefilled) before the next window, so that every window has B lanes; with
``--stops`` the time includes those admissions and prefills. Every case of a run shares one pool
configuration (``--max-num-reqs``, default the largest B), so that the pool's kernels are compiled
once for all of them.

Prints one row per (mode, B, K, D) as it ends and, with ``--json``, rewrites the file after each row
(an interrupted run keeps the rows it made). Without CUDA the figures are the interpreter's and say
nothing about a GPU (the output says so).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import decode_loop as dl  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

from gpupool.args import device_arg  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.window import DecodeWindow  # noqa: E402

HUGE_BUDGET = 1 << 40  # tokens: a request that never stops


@dataclass(frozen=True)
class PoolShape:
    """The pool configuration every case of a run shares: ``max_num_reqs`` request slots, rows of
    ``max_blocks_per_req`` blocks, ``num_blocks`` blocks (each slot's full row, and the null block)."""

    max_num_reqs: int
    max_blocks_per_req: int
    num_blocks: int


def pool_shape(args, runs: list[tuple[str, int, int]]) -> PoolShape:
    """Rows long enough for the longest request any case makes: its prompt and prefill token, then
    every window (warm-up and timed) of the case that gains the most tokens a window (K x (D + 1)),
    and the next window's lookahead."""
    per_window = max(K * (D + 1) for _, K, D in runs)
    longest = args.prompt_len + 1 + (args.warmup + args.iters) * per_window + max(D for _, _, D in runs)
    M = -(-longest // args.block_size) + 1
    R = args.max_num_reqs or max(args.batch)
    return PoolShape(R, M, R * M + 1)


def make_model(args) -> Llama:
    """The random model of a run: heads of 64, half as many KV heads (grouped-query attention)."""
    heads = args.hidden // 64
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                      num_kv_heads=heads // 2 if heads % 2 == 0 else heads, head_dim=64,
                      intermediate_size=2 * args.hidden)
    return Llama.random(cfg, seed=args.seed, dtype=getattr(torch, args.dtype), device=args.device)


# ---- CUDA graphs around the engine's own window and pass ----------------------------------------
class Timer:
    """CUDA events around each replay (the GPU time of the captured work), kept per window."""

    def __init__(self, cuda: bool):
        self.cuda, self.pairs = cuda, []  # cuda: the replays are CUDA graphs

    def __call__(self, replay) -> None:
        if not self.cuda:
            replay()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        self.pairs.append((start, end))

    def ms(self) -> float | None:
        """Milliseconds of the replays since the last :meth:`reset` (after a synchronize), or None."""
        return sum(s.elapsed_time(e) for s, e in self.pairs) if self.cuda and self.pairs else None

    def reset(self) -> None:
        self.pairs = []


class GraphedWindow:
    """The engine's ``DecodeWindow`` (``Engine.win``) whose :meth:`run` is captured, with the engine's
    forward passes, as ONE CUDA graph the first time (``DecodeWindow.capture``) and replayed from then
    on; every other attribute is the window's. The lanes must stay as many as at the capture."""

    def __init__(self, win, timer: Timer):
        self._win, self._timer = win, timer

    def __getattr__(self, name):
        return getattr(self._win, name)

    def run(self, forward=None) -> None:
        if self._win.graph is None:
            self._win.capture(forward)
        self._timer(self._win.replay)


class GraphedPass:
    """The host mode's forward pass (``Engine._decode_pass``) as a CUDA graph over static inputs: each
    call copies the step's uploaded inputs into the graph's buffers and replays it; the outputs are
    the graph's (read before the next call). Captured at the first call, after an eager warm-up in
    which no lane is live and no slot is written (the engine's state is left as it was)."""

    def __init__(self, eng: dl.Engine, timer: Timer):
        self._pass, self._timer = eng._decode_pass, timer
        self.graph = None

    def __call__(self, *inputs: torch.Tensor):
        if self.graph is None:
            self._static = [t.clone() for t in inputs]
            slots, live, positions, slot_mapping = self._static[:4]
            live.zero_()
            slot_mapping.fill_(-1)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._pass(*self._static)
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._out = self._pass(*self._static)
        for dst, src in zip(self._static, inputs):
            dst.copy_(src)
        self._timer(self.graph.replay)
        return self._out


# ---- the steady-decode driver ------------------------------------------------------------------------
class Steady:
    """B requests of ``prompt_len`` random tokens in steady decode on ``eng``: admitted in one op and
    prefilled once (``Engine._admit`` / ``Engine._start``), then windows (``Engine._window_host`` /
    ``_window_device``, settled by ``Engine._settle``). ``budget()``: each new request's budget. With
    stops, :meth:`refill` admits new requests into the freed slots so that every window has B lanes."""

    def __init__(self, eng: dl.Engine, B: int, prompt_len: int, seed: int, budget):
        self.eng, self.B, self.prompt_len, self.budget = eng, B, prompt_len, budget
        self.gen = torch.Generator().manual_seed(seed)
        self.next_rid = 0
        self.requests: dict[int, dl.Request] = {}
        self.running: list[dl.Seq] = []
        self.out: dict[int, list[int]] = {}
        eng.free_slots = list(range(eng.R))
        self.admit(B)
        pending = [s for s in self.running if s.pending_first]  # the device's prefill tokens, read once here
        if pending:
            idx = torch.tensor([s.slot for s in pending], device=eng.dev)
            self._first_tokens(pending, eng.first_tok[idx].tolist())

    def _new(self) -> dl.Seq:
        prompt = torch.randint(1, self.eng.model.cfg.vocab_size, (self.prompt_len,), generator=self.gen).tolist()
        self.next_rid += 1
        req = self.requests[self.next_rid] = dl.Request(self.next_rid, prompt, self.budget())
        return dl.Seq(req, list(prompt), len(prompt))

    def admit(self, n: int) -> None:
        """``n`` new requests admitted in one op (its outcome read at once) and prefilled."""
        eng = self.eng
        batch = [self._new() for _ in range(n)]
        slots = eng.free_slots[:n]
        admitted, hits = eng._admit(batch, slots)
        if not eng.host:
            both = torch.cat([admitted[:n], hits[:n]]).tolist()
            admitted, hits = both[:n], both[n:]
        if not all(admitted[:n]):
            raise RuntimeError(f"the pool admitted {sum(map(bool, admitted[:n]))} of {n} requests (pool too small)")
        for s, slot, hit in zip(batch, slots, hits):
            eng.free_slots.remove(slot)
            eng._start(s, slot, hit)
        self.running += batch

    @staticmethod
    def _first_tokens(seqs: list[dl.Seq], tokens: list[int]) -> None:
        for s, t in zip(seqs, tokens):  # as Engine.run takes a prefill's token read with a window
            s.tokens.append(t)
            s.generated += 1
            s.pending_first = False

    def window(self) -> tuple[int, int]:
        """One window over the running requests; returns (tokens the lanes gained, requests stopped)."""
        eng = self.eng
        lanes = list(self.running)
        firsts = [s for s in lanes if s.pending_first]  # replacements prefilled since the last read
        extra = [eng.first_tok[torch.tensor([s.slot for s in firsts], device=eng.dev)]] if firsts else []
        res = eng._window_host(lanes, [], extra) if eng.host else eng._window_device(lanes, [], extra)
        ex = list(res.extra)
        toks, accs = ex.pop(0), ex.pop(0)
        if firsts:
            self._first_tokens(firsts, ex.pop(0))
        before = eng.stats.accepted
        waiting: list[dl.Seq] = []
        eng._settle(lanes, res, toks, accs, self.running, waiting, self.out)
        if waiting:
            raise RuntimeError(f"{len(waiting)} requests were preempted: the pool is too small for the benchmark")
        return eng.stats.accepted - before, len(lanes) - len(self.running)

    def refill(self) -> None:
        """New requests in the slots of those that stopped (none without stops)."""
        if len(self.running) < self.B:
            self.admit(self.B - len(self.running))


def make_engine(model: Llama, mode: str, B: int, K: int, D: int, shape: PoolShape, block_size: int,
                graph: bool) -> tuple[dl.Engine, Timer]:
    """The engine of one case, its window of exactly B lanes (the engine's own holds ``max_num_reqs``),
    with ``graph`` (CUDA only) its window, or the host mode's pass, captured as a CUDA graph; and the
    timer of the graph's replays."""
    eng = dl.Engine(model, mode, num_blocks=shape.num_blocks, block_size=block_size,
                    max_num_reqs=shape.max_num_reqs, max_blocks_per_req=shape.max_blocks_per_req, steps=K, draft=D,
                    count_evictions=False)
    graph = graph and eng.dev.type == "cuda"
    timer = Timer(graph)
    if not eng.host:
        eng.win = DecodeWindow(eng.m, B, eng.K, eng.D, kv_caches=eng.kv.layers())
    if graph:
        if eng.host:
            eng._decode_pass = GraphedPass(eng, timer)
        else:
            eng.win = GraphedWindow(eng.win, timer)
    return eng, timer


def bench_one(model: Llama, mode: str, B: int, K: int, D: int, args, shape: PoolShape) -> dict:
    eng, timer = make_engine(model, mode, B, K, D, shape, args.block_size, args.graph)
    cuda, graph = eng.dev.type == "cuda", timer.cuda
    gen = torch.Generator().manual_seed(args.seed + 7 * B + K + 100 * D)
    if args.stops:
        lo = max(2, args.max_new // 2)
        budget = lambda: int(torch.randint(lo, args.max_new + 1, (1,), generator=gen))  # noqa: E731
    else:
        budget = lambda: HUGE_BUDGET  # noqa: E731
    drv = Steady(eng, B, args.prompt_len, args.seed + B, budget)
    for _ in range(args.warmup):  # the first one compiles the kernels and captures the graph
        drv.window()
        drv.refill()
    if cuda:
        torch.cuda.synchronize()
    timer.reset()
    passes0 = eng.stats.passes
    tokens = stopped = 0
    t0 = time.perf_counter()
    for _ in range(args.iters):
        got, stops = drv.window()
        tokens += got
        stopped += stops
        drv.refill()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gpu_ms = timer.ms()
    ms = 1e3 * dt / args.iters
    passes = eng.stats.passes - passes0
    return {"mode": mode, "B": B, "K": K, "D": D, "windows": args.iters, "tokens": tokens, "seconds": dt,
            "tokens_per_s": tokens / dt, "ms_per_window": ms, "us_per_step": 1e3 * ms / K,
            "gpu_ms_per_window": None if gpu_ms is None else gpu_ms / args.iters,
            "tokens_per_pass": tokens / max(passes, 1), "stopped": stopped, "graph": graph, "device": str(eng.dev),
            "max_num_reqs": shape.max_num_reqs, "max_blocks_per_req": shape.max_blocks_per_req,
            "num_blocks": shape.num_blocks}


def _compile_case(job: tuple) -> float:
    """A worker of :func:`compile_kernels`: one eager window of one case; returns its seconds."""
    args, (mode, K, D), shape = job
    t0 = time.perf_counter()
    model = make_model(args)
    eng, _ = make_engine(model, mode, min(args.batch), K, D, shape, args.block_size, graph=False)
    Steady(eng, min(args.batch), args.prompt_len, args.seed, lambda: HUGE_BUDGET).window()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def compile_kernels(args, runs: list[tuple[str, int, int]], shape: PoolShape, jobs: int, progress) -> None:
    """Every case's kernels compiled into Triton's cache by ``jobs`` processes at once, each running one
    case's admission, prefill and first window eagerly at the smallest B (the cases share the pool's
    configuration, and the launches their arguments' alignments, so each finds its kernels there).
    Triton compiles a kernel at its first launch, one at a time, and a window's pool step compiles once
    for each K and D."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    with ProcessPoolExecutor(min(jobs, len(runs)), mp_context=multiprocessing.get_context("spawn")) as ex:
        futures = [ex.submit(_compile_case, (args, case, shape)) for case in runs]
        for (mode, K, D), f in zip(runs, futures):
            try:
                progress(f"compiled {mode} K={K} D={D} in {f.result():.1f} s")
            except Exception as e:  # noqa: BLE001 - reported; the case reports it again when it runs
                progress(f"compiling {mode} K={K} D={D} failed: {type(e).__name__}: {str(e).splitlines()[-1:]}")
    progress(f"kernels of {len(runs)} cases compiled in {time.perf_counter() - t0:.1f} s ({jobs} processes)")


def format_row(r: dict) -> str:
    gpu = "-" if r["gpu_ms_per_window"] is None else f"{r['gpu_ms_per_window']:.3f}"
    tps = r["tokens_per_s"]
    rate = f"{tps:12,.0f}" if tps >= 100 else f"{tps:12.2f}"
    return (f"{r['mode']:>6} B={r['B']:<5} K={r['K']} D={r['D']}  {rate} tok/s  {r['ms_per_window']:9.3f} ms/window  "
            f"{r['us_per_step']:9.1f} us/step  gpu {gpu} ms/window  {r['tokens_per_pass']:.2f} tok/pass  "
            f"stopped {r['stopped']}  graph={'yes' if r['graph'] else 'no'}")


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (``bench/RESULTS.md``'s decode-loop table)."""
    out = ["| mode | B | K | D | tokens / s | ms / window | us / step | GPU ms / window | tokens / pass | graph |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        gpu = "-" if r["gpu_ms_per_window"] is None else f"{r['gpu_ms_per_window']:.3f}"
        out.append(f"| {r['mode']} | {r['B']:,} | {r['K']} | {r['D']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['ms_per_window']:.3f} | {r['us_per_step']:,.1f} | {gpu} | {r['tokens_per_pass']:.2f} | "
                   f"{'yes' if r['graph'] else 'no'} |")
    return "\n".join(out)


#: Largest sizes the command accepts (each case builds host lists of the pool's size).
LIMITS = {"batch": 4096, "steps": 64, "draft": 32, "spec_steps": 64, "iters": 100_000, "prompt_len": 65536,
          "block_size": 4096, "hidden": 8192, "layers": 256, "vocab": 1 << 20, "max_new": 1 << 20,
          "max_num_reqs": 4096}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Columns: tokens per second (decoded tokens over the wall time of the timed windows), ms per "
               "window (wall), us per pool step (a window's time over K), the GPU time of a window's replays "
               "(CUDA events; '-' without a graph), tokens a lane gained per forward pass (above 1: drafts "
               "accepted), requests stopped. Without CUDA the pool's kernels run in Triton's interpreter: the "
               "times say nothing about a GPU.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024], help="running requests B, one case each")
    p.add_argument("--modes", nargs="+", default=list(dl.MODES), choices=dl.MODES, help="modes to run (default: all)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8], help="K of the window mode, one case each")
    p.add_argument("--draft", type=int, nargs="+", default=[1, 2, 4], help="D of the spec mode, one case each")
    p.add_argument("--spec-steps", type=int, default=4, help="K of the spec mode's windows")
    p.add_argument("--iters", type=int, default=10, help="timed windows per case")
    p.add_argument("--warmup", type=int, default=2, help="windows before the timed ones (the first compiles and captures)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--max-num-reqs", type=int, default=None,
                   help="request slots of the pool, shared by every case (default: the largest --batch)")
    p.add_argument("--stops", action="store_true",
                   help="budgets of --max-new / 2 to --max-new tokens (requests stop inside windows and are replaced)")
    p.add_argument("--max-new", type=int, default=32, help="largest budget with --stops")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the random model (a multiple of 64)")
    p.add_argument("--layers", type=int, default=2, help="layers of the random model")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary of the random model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"],
                   help="weights and KV")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the prompts")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="run every window eagerly (no CUDA graph)")
    p.add_argument("--compile-jobs", type=int, default=0,
                   help="CUDA: first compile every case's kernels in this many processes at once (Triton compiles a "
                        "kernel at its first launch, one at a time; default 0: each case compiles its own)")
    p.add_argument("--compile-only", action="store_true",
                   help="CUDA: only compile every case's kernels into Triton's cache (with --compile-jobs processes, "
                        "at least 1), so that a later run with the same flags finds them there; no timing")
    p.add_argument("--json", help="write the rows here (rewritten after each row)")
    p.add_argument("--table", metavar="JSON", help="print the rows of a --json file as a markdown table, and exit")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Sizes the benchmark can run with, else ``p.error`` (a usage message, exit 2)."""
    for name, lo in (("batch", 1), ("steps", 1), ("draft", 1), ("spec_steps", 1), ("iters", 1), ("prompt_len", 1),
                     ("block_size", 1), ("hidden", 64), ("layers", 1), ("vocab", 2), ("max_new", 2),
                     ("max_num_reqs", 1)):
        v = getattr(args, name)
        for x in v if isinstance(v, list) else [] if v is None else [v]:
            if not lo <= x <= LIMITS[name]:
                p.error(f"--{name.replace('_', '-')} must be in {lo}..{LIMITS[name]}, got {x}")
    if args.warmup < 0 or args.compile_jobs < 0:
        p.error(f"--warmup and --compile-jobs must be >= 0, got {args.warmup} and {args.compile_jobs}")
    if args.hidden % 64:
        p.error(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    if args.max_num_reqs is not None and args.max_num_reqs < max(args.batch):
        p.error(f"--max-num-reqs ({args.max_num_reqs}) is below the largest --batch ({max(args.batch)})")
    try:
        device_arg("decode_loop_gpu", args.device)
    except PoolError as e:
        p.error(str(e))


def cases(args) -> list[tuple[str, int, int]]:
    """(mode, K, D) of every case, for each B."""
    runs = [("host", 1, 0)] if "host" in args.modes else []
    runs += [("window", K, 0) for K in args.steps] if "window" in args.modes else []
    runs += [("spec", args.spec_steps, D) for D in args.draft] if "spec" in args.modes else []
    return runs


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.table:
        try:
            with open(args.table) as f:
                print(markdown(json.load(f)["rows"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--table {args.table}: not a file of this script's rows ({type(e).__name__}: {e})")
        return 0
    check_args(p, args)
    runs = cases(args)
    shape = pool_shape(args, runs)
    if torch.device(args.device).type == "cpu":
        print("note: on a CPU the pool's kernels run in Triton's interpreter: these times say nothing about a GPU")
    model = make_model(args)
    print(f"pool: {shape.num_blocks} blocks of {args.block_size} tokens, {shape.max_num_reqs} request slots, rows of "
          f"{shape.max_blocks_per_req} blocks; model: {args.layers} layers, hidden {args.hidden}, {args.dtype}", flush=True)
    rows: list[dict] = []
    failed: list[str] = []
    meta = {"device": torch.cuda.get_device_name(torch.device(args.device)) if torch.device(args.device).type == "cuda"
            else "cpu (Triton interpreter)", "argv": sys.argv if argv is None else argv,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

    started = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    try:
        if (args.compile_jobs or args.compile_only) and torch.device(args.device).type == "cuda":
            compile_kernels(args, runs, shape, max(1, args.compile_jobs), progress)
        if args.compile_only:
            return 0
        for mode, K, D in runs:  # a mode's rows at every B before the next mode compiles its kernels
            for B in args.batch:
                progress(f"{mode} B={B} K={K} D={D} ...")
                try:
                    rows.append(bench_one(model, mode, B, K, D, args, shape))
                except Exception as e:  # noqa: BLE001 - a case that fails (a kernel that does not compile, say) is
                    # reported and the other cases still run
                    failed.append(f"{mode} B={B} K={K} D={D}")
                    progress(f"{failed[-1]} FAILED: {type(e).__name__}: {(str(e).splitlines() or [''])[-1][:500]}")
                    continue
                finally:
                    gc.collect()  # the case's engine and graph (reference cycles) before the next one's
                print(format_row(rows[-1]), flush=True)
                save()
    except KeyboardInterrupt:  # a stage's timeout (SIGINT): keep the rows made
        save()
        print(f"interrupted after {len(rows)} cases", file=sys.stderr)
        return 1
    if failed:
        print(f"{len(failed)} cases failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
