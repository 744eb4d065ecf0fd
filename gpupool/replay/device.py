"""Batched trace replay on the device pool: one ``admission_step`` launch per time point.

Every completion and arrival that shares a timestamp goes through one ``BlockPool.admission_step``
call, which applies them exactly as the request-by-request model of docs/semantics.md section 5 does
(``gpupool.replay``), so the reports are identical. The host waits for the device once per time point
(to learn who was admitted and with which blocks, i.e. when they finish).

The step assumes that no request finishes at the time it is admitted (``output_length * tpot_ms > 0``
for all): otherwise a completion would be created inside a step. Such traces fall back to the
request-by-request model over the same pool (still exact; slower).
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Mapping

import torch

from ..kernels.replay import StepInputs, StepOutputs, TraceTensors, launch_admission_step
from ..keys import trace_block_hash
from .model import DEFAULT_BLOCK_SIZE, DEFAULT_TPOT_MS, ReplayReport, free_queue_digest, replay
from .trace import TraceRequest


def _prepare(trace: list[TraceRequest], block_size: int, device, registry) -> tuple[list[int], TraceTensors]:
    """Arrival order and the per-request device tensors the admission step reads."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].timestamp)
    keys: dict[int, tuple[int, int]] = {}
    his, los, off, full, hitcap, total = [], [], [], [], [], []
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
        full.append(f)
        hitcap.append(min(f, (tr.input_length - 1) // block_size))
        total.append(-(-(tr.input_length + tr.output_length) // block_size))
    i64, i32 = torch.int64, torch.int32
    req = TraceTensors(
        chain_hi=torch.tensor(his or [0], dtype=i64, device=device),
        chain_lo=torch.tensor(los or [0], dtype=i64, device=device),
        chain_off=torch.tensor(off or [0], dtype=i64, device=device),
        full=torch.tensor(full or [0], dtype=i32, device=device),
        hitcap=torch.tensor(hitcap or [0], dtype=i32, device=device),
        total=torch.tensor(total or [0], dtype=i32, device=device),
    )
    return order, req


def replay_batched(pool, trace: list[TraceRequest], *, block_size: int = DEFAULT_BLOCK_SIZE,
                   tpot_ms: float = DEFAULT_TPOT_MS, progress: bool | Mapping = False) -> ReplayReport:
    """Replay ``trace`` on a device ``BlockPool`` with one batched step per time point.

    Same model, arguments, checks and report as :func:`gpupool.replay.replay`; the report's ``pool``
    is ``"BlockPool (batched)"``. Raises what ``replay`` raises, and the pool's errors.
    """
    trace = list(trace)
    if tpot_ms <= 0 or any(t.output_length == 0 for t in trace):
        return replay(pool, trace, block_size=block_size, tpot_ms=tpot_ms, progress=progress)
    n = int(pool.num_blocks)
    if int(pool.get_num_free_blocks()) != n - 1:
        raise ValueError("replay needs a pool with no block in use")
    bar = None
    if progress:
        from tqdm import tqdm

        kw = {"total": len(trace), "desc": "replay BlockPool (batched)", "unit": "req"}
        if isinstance(progress, Mapping):
            kw.update(progress)
        bar = tqdm(**kw)
    dev = pool.device
    rep = ReplayReport(pool="BlockPool (batched)", num_blocks=n, block_size=block_size, tpot_ms=float(tpot_ms),
                       requests=len(trace))
    start = time.perf_counter()
    h = pool.handle()
    order, req = _prepare(trace, block_size, dev, h.registry)
    totals = req.total.tolist()
    group_ids = torch.zeros(1, dtype=torch.int32, device=dev)
    waiting: list[int] = []  # request indices (arrival order)
    running: list[tuple[float, int, list[int]]] = []
    seq = 0
    nxt = 0
    now = 0.0
    i32, i64 = torch.int32, torch.int64
    try:
        while running or nxt < len(order):
            c = running[0][0] if running else None
            a = trace[order[nxt]].timestamp if nxt < len(order) else None
            now = c if a is None or (c is not None and c <= a) else a
            comps = []
            while running and running[0][0] <= now:
                comps.append(heapq.heappop(running)[2])
            arrivals = []
            while nxt < len(order) and trace[order[nxt]].timestamp <= now:
                arrivals.append(nxt)
                nxt += 1
            line = waiting + arrivals
            free_flat = [b for blocks in comps for b in reversed(blocks)]
            free_off = [0]
            for blocks in comps:
                free_off.append(free_off[-1] + len(blocks))
            out_off = [0]
            for r in line:
                out_off.append(out_off[-1] + totals[r])
            L = len(line)
            step = StepInputs(
                line=torch.tensor(line or [0], dtype=i32, device=dev),
                line_waiting=torch.tensor([len(waiting)], dtype=i32, device=dev),
                events=torch.tensor(list(range(len(comps))) + [-1] * len(arrivals) or [0], dtype=i32, device=dev),
                num_events=torch.tensor([len(comps) + len(arrivals)], dtype=i32, device=dev),
                free_ids=torch.tensor(free_flat or [0], dtype=i32, device=dev),
                free_off=torch.tensor(free_off, dtype=i32, device=dev),
                num_free_ids=torch.tensor([len(free_flat)], dtype=i32, device=dev),
                out_off=torch.tensor(out_off[:-1] or [0], dtype=i64, device=dev))
            out = StepOutputs(result=torch.zeros(max(L, 1), dtype=i32, device=dev),
                              hits=torch.zeros(max(L, 1), dtype=i32, device=dev),
                              free_after=torch.zeros(max(L, 1), dtype=i64, device=dev),
                              blocks=torch.zeros(max(out_off[-1], 1), dtype=i32, device=dev),
                              pf=torch.zeros(len(free_flat) + 1, dtype=i32, device=dev))
            sizes = torch.tensor([len(order), max(L, 1), max(len(comps) + len(arrivals), 1), max(len(free_flat), 1),
                                  len(comps)], dtype=i64, device=dev)
            launch_admission_step(h.state, h.config, req, step, out, sizes, group_ids, block_size)
            pool.check()
            result, hits, free_after = out.result.tolist(), out.hits.tolist(), out.free_after.tolist()
            blocks_all = out.blocks.tolist()
            waiting = []
            for k, r in enumerate(line):
                if result[k] == 1:
                    tr = trace[order[r]]
                    blocks = blocks_all[out_off[k]: out_off[k] + totals[r]]
                    heapq.heappush(running, (now + tr.output_length * float(tpot_ms), seq, blocks))
                    seq += 1
                    rep.admitted += 1
                    rep.waited += now > tr.timestamp
                    rep.prompt_blocks += min(tr.input_length // block_size, len(tr.hash_ids))
                    rep.hit_blocks += hits[k]
                    rep.peak_blocks_in_use = max(rep.peak_blocks_in_use, n - 1 - free_after[k])
                elif result[k] == 2:
                    rep.rejected += 1
                    if bar is not None:
                        bar.update(1)
                else:
                    waiting.append(r)
            if bar is not None and comps:
                bar.update(len(comps))
        if waiting:
            raise RuntimeError(f"replay: {len(waiting)} requests still waiting at the end")
        rep.free_queue_sha256 = free_queue_digest(pool.free_queue())
    finally:
        if bar is not None:
            bar.close()
    rep.wall_s = time.perf_counter() - start
    rep.end_time_ms = float(now)
    rep.hit_ratio = rep.hit_blocks / rep.prompt_blocks if rep.prompt_blocks else 0.0
    rep.requests_per_s = rep.requests / rep.wall_s if rep.wall_s > 0 else 0.0
    return rep
