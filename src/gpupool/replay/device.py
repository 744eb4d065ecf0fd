"""Trace replay with its event loop on the device (docs/semantics.md section 5; docs/algorithms.md section 7).

The sorted trace goes to the device once; ``kernels/replay.py`` then runs the whole model (arrivals,
completions in (finish time, admission order), head-of-line admission, the report's counters) in one
program, ``time_points_per_launch`` time points per launch. The host only launches and reads the
progress words once per ``launches_per_sync`` launches (progress bar, sticky errors), and once at the
end, so the report is the model's, exactly (same hits, admissions and final free-queue digest as
:func:`gpupool.replay.replay` on the reference pool), every trace included: equal timestamps,
zero-length outputs, pools that make requests wait or reject them.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from .. import _backend

_backend.select()  # the kernels' backend, before the kernels below are defined
from ..kernels.replay import NUM_LOOP_WORDS, LoopState, LoopWord, TraceTensors, launch_replay_loop
from ..keys import trace_block_hash
from ..pool import BlockPool
from .model import (DEFAULT_BLOCK_SIZE, DEFAULT_TPOT_MS, ReplayReport, check_replay_args, free_queue_digest,
                    progress_bar)
from .trace import TraceRequest

DEFAULT_TIME_POINTS_PER_LAUNCH = 1024
DEFAULT_LAUNCHES_PER_SYNC = 4
#: in Triton's interpreter a time point costs milliseconds, not microseconds: short launches and a
#: sync after each, so the progress bar moves every second or so instead of once per 1,000 requests
INTERPRETER_TIME_POINTS_PER_LAUNCH = 16
INTERPRETER_LAUNCHES_PER_SYNC = 1


def upload_trace(trace: list[TraceRequest], num_blocks: int, block_size: int, tpot_ms: float, device,
                 registry) -> tuple[TraceTensors, int, int]:
    """The trace's per-request tensors in arrival order (by timestamp, ties in trace order), with the
    model's numbers: ``full``, ``hitcap``, ``total`` as docs/semantics.md section 5 defines them and
    ``dur = output_length * tpot_ms`` (Python float, as the model adds it). Each distinct hash id is
    hashed once and registered with the pool's key ``registry`` (group 0). Returns the tensors, the
    blocks all admissible requests hold together (``blk_off`` are their running sums) and the largest
    admissible request's blocks (at least 1)."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].timestamp)
    keys: dict = {}
    his, los, off, full, hitcap, total, ts, dur, blk_off = [], [], [], [], [], [], [], [], []
    blocks, biggest = 0, 1
    for i in order:
        tr = trace[i]
        f = min(tr.input_length // block_size, len(tr.hash_ids))
        off.append(len(his))
        for h in tr.hash_ids[:f]:
            k = keys.get(h)
            if k is None:
                k = keys[h] = registry.register(trace_block_hash(h), 0)
            his.append(k[0])
            los.append(k[1])
        t = -(-(tr.input_length + tr.output_length) // block_size)
        t = min(t, num_blocks)  # any total above N - 1 is rejected; int32 on the device
        full.append(f)
        hitcap.append(min(f, (tr.input_length - 1) // block_size))
        total.append(t)
        ts.append(float(tr.timestamp))
        dur.append(tr.output_length * tpot_ms)
        blk_off.append(blocks)
        if t <= num_blocks - 1:  # a rejected request holds no blocks
            blocks += t
            biggest = max(biggest, t)
    i64, i32, f64 = torch.int64, torch.int32, torch.float64

    def dev(xs, dtype):
        return torch.tensor(xs or [0], dtype=dtype, device=device)

    return TraceTensors(ts=dev(ts, f64), dur=dev(dur, f64), chain_hi=dev(his, i64), chain_lo=dev(los, i64),
                        chain_off=dev(off, i64), full=dev(full, i32), hitcap=dev(hitcap, i32),
                        total=dev(total, i32), blk_off=dev(blk_off, i64)), blocks, biggest


def new_loop_state(num_requests: int, num_blocks: int, blocks: int, biggest: int, device) -> LoopState:
    """A loop before its first event (every word 0 but ``NUM_REQUESTS``, ``now = -inf``) for a pool of
    ``num_blocks``: room for ``blocks`` stored blocks and scratch for a request of ``biggest`` blocks
    (both from :func:`upload_trace`)."""
    words = torch.zeros(NUM_LOOP_WORDS, dtype=torch.int64)
    words[LoopWord.NUM_REQUESTS] = num_requests
    return LoopState(words=words.to(device), now=torch.full((1,), -math.inf, dtype=torch.float64, device=device),
                     heap_t=torch.zeros(num_blocks, dtype=torch.float64, device=device),
                     heap_r=torch.zeros(num_blocks, dtype=torch.int32, device=device),
                     blocks=torch.zeros(max(blocks, 1), dtype=torch.int32, device=device),
                     adm=torch.zeros(biggest + 1, dtype=torch.int32, device=device),
                     pf=torch.zeros(biggest + 1, dtype=torch.int32, device=device))


def replay_on_device(pool, trace: list[TraceRequest], *, block_size: int = DEFAULT_BLOCK_SIZE,
                     tpot_ms: float = DEFAULT_TPOT_MS, progress: bool | Mapping = False,
                     time_points_per_launch: int | None = None,
                     launches_per_sync: int | None = None) -> ReplayReport:
    """Replay ``trace`` on a device ``BlockPool`` with the event loop on the device (module docstring).

    Same model, arguments, checks and report as :func:`gpupool.replay.replay`; the report's ``pool``
    is ``"BlockPool (device loop)"``. ``time_points_per_launch`` (>= 1) bounds one launch's work;
    the host waits for the device once per ``launches_per_sync`` (>= 1) launches (None: 1,024 and 4 on
    a GPU; 16 and 1 in Triton's interpreter, so that ``progress`` moves as the work is done). The pool must have
    KV events off (the loop has no consumer for them). Raises TypeError for a pool that is not a
    ``BlockPool``; ValueError (TraceError) for bad arguments or requests, a pool with blocks in use or
    with KV events on; the pool's errors (``check()``) if a kernel recorded one.
    """
    if not isinstance(pool, BlockPool):
        raise TypeError(f"replay_on_device needs a gpupool.BlockPool, got {type(pool).__name__}")
    trace = check_replay_args(pool, trace, block_size, tpot_ms)
    interp = pool.device.type == "cpu"
    if time_points_per_launch is None:
        time_points_per_launch = INTERPRETER_TIME_POINTS_PER_LAUNCH if interp else DEFAULT_TIME_POINTS_PER_LAUNCH
    if launches_per_sync is None:
        launches_per_sync = INTERPRETER_LAUNCHES_PER_SYNC if interp else DEFAULT_LAUNCHES_PER_SYNC
    for name, v in (("time_points_per_launch", time_points_per_launch), ("launches_per_sync", launches_per_sync)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    h = pool.handle()
    if h.config.EVENTS:
        raise ValueError("replay_on_device needs a pool with enable_kv_cache_events=False")
    n = int(pool.num_blocks)
    rep = ReplayReport(pool="BlockPool (device loop)", num_blocks=n, block_size=block_size, tpot_ms=float(tpot_ms),
                       requests=len(trace))
    bar = progress_bar(progress, len(trace), "replay BlockPool (device loop)")
    try:
        start = time.perf_counter()
        dev = pool.device
        tr, blocks, biggest = upload_trace(trace, n, block_size, float(tpot_ms), dev, h.registry)
        lp = new_loop_state(len(trace), n, blocks, biggest, dev)
        group_ids = torch.zeros(1, dtype=torch.int32, device=dev)
        shown, words = 0, None
        while True:
            for _ in range(launches_per_sync):
                launch_replay_loop(h.state, h.config, tr, lp, group_ids, block_size, time_points_per_launch)
            pool.check()
            before, words = words, lp.words.tolist()
            if words == before:  # every launch advances at least one time point until DONE
                raise RuntimeError("replay: the device loop made no progress")
            finished = words[LoopWord.COMPLETED] + words[LoopWord.REJECTED]
            if bar is not None:
                bar.update(finished - shown)
            shown = finished
            if words[LoopWord.DONE]:
                break
        if words[LoopWord.LINE_HEAD] != len(trace):
            raise RuntimeError(f"replay: {len(trace) - words[LoopWord.LINE_HEAD]} requests still waiting at the end")
        rep.free_queue_sha256 = free_queue_digest(pool.free_queue())
        rep.wall_s = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
    rep.admitted = words[LoopWord.ADMITTED]
    rep.rejected = words[LoopWord.REJECTED]
    rep.prompt_blocks = words[LoopWord.PROMPT_BLOCKS]
    rep.hit_blocks = words[LoopWord.HIT_BLOCKS]
    rep.waited = words[LoopWord.WAITED]
    rep.peak_blocks_in_use = words[LoopWord.PEAK_IN_USE]
    rep.time_points = words[LoopWord.TIME_POINTS]
    now = float(lp.now.item())
    rep.end_time_ms = now if math.isfinite(now) else 0.0
    rep.hit_ratio = rep.hit_blocks / rep.prompt_blocks if rep.prompt_blocks else 0.0
    rep.requests_per_s = rep.requests / rep.wall_s if rep.wall_s > 0 else 0.0
    return rep
