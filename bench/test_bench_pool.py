"""Pool-op and trace-replay benchmarks: the device pool against host-side pools, side by side.

Run: ``python -m pytest bench -q`` (or ``gpupool bench``, which also plots). The grid and the pools
are described in ``bench/conftest.py``. Each case is one pytest-benchmark group per
(op, pool size, batch), so the table compares the pools directly; ``extra_info`` carries
``op, pool, num_blocks, batch, device`` for ``bench/plot.py``, and on CUDA ``gpu_us``: CUDA-event
time per call over back-to-back calls without a host wait (the GPU time of a captured graph).

Ops (batch = B):

* ``alloc_free``: ``get_new_blocks(B)`` then ``free_blocks`` of those blocks (un-hashed, so they go
  back to the front of the free queue): one round trip. Device: ``allocate_batched([B])`` +
  ``free_batched``.
* ``touch``: prefix hits on B cached free blocks (they leave the free queue, ref_cnt 0 -> 1); only
  the touch is timed, the blocks are freed again between rounds (untimed).
* ``lookup``: B prefix-key lookups that all hit (``get_cached_block(h, [0])`` per key on the host
  pools, as vLLM does it; one ``lookup_batched`` on the device).
* ``decode_step``: the pool work of one decode step for B running requests, in a steady state:
  k = ceil(B / 16) requests crossed a block boundary in the previous step, so their last blocks
  are now full and get cached (one key each), then they are freed as k finished requests; and k
  requests cross a boundary now and get one new block each. Host pools do this per request (as a
  vLLM scheduler does); the device pool with one ``cache_blocks_batched`` launch, ``free_batched``
  (k segments) and ``allocate_batched`` over a demand vector of all B requests (1 for the k that
  cross). Allocation pops the head of the free queue, evicting cached blocks: a warm prefix cache.

Device timings on CUDA include a ``torch.cuda.synchronize()`` inside the timed function, so they
are real wall times; without CUDA the device pool runs in Triton's interpreter and its numbers are
not GPU performance.
"""
from __future__ import annotations

import inspect
import itertools
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from conftest import (  # noqa: E402 - bench/conftest.py (pytest puts bench/ on sys.path)
    BLOCK_SIZE, CUDA, DECODE_CROSS_EVERY, DEVICE_KINDS, MAX_TIME, REPLAY_LIMIT, device_name, make_pool,
    vllm_block_pool,
)

_hash_counter = itertools.count(1)


def fresh_hashes(n: int) -> list[bytes]:
    """``n`` block hashes never used before in this session (32 bytes each)."""
    return [next(_hash_counter).to_bytes(32, "little") for _ in range(n)]


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


# ---- vLLM's BlockPool API (block objects, a request carrying the hashes) ---------------------
def _vllm_request(hashes: list[bytes]):
    """The fields of ``vllm.v1.request.Request`` that ``BlockPool.cache_full_blocks`` reads."""
    return SimpleNamespace(request_id="bench", block_hashes=hashes, lora_request=None, all_token_ids=[],
                           mm_features=[], cache_salt=None)


def _vllm_touch_nested(pool) -> bool:
    """Whether this vLLM's ``touch`` takes one block list per KV-cache group (``tuple[list, ...]``)."""
    ann = str(inspect.signature(pool.touch).parameters.get("blocks", inspect.Parameter(
        "blocks", inspect.Parameter.POSITIONAL_ONLY)).annotation)
    return ann.startswith("tuple") or "list[list" in ann or "Sequence[Sequence" in ann or "Sequence[list" in ann


def _vllm_check_api(pool) -> None:
    names = list(inspect.signature(pool.cache_full_blocks).parameters)
    if names[:2] != ["request", "blocks"] or "hash_fn" in names or "block_hashes" in names:
        pytest.skip(f"this vllm's BlockPool.cache_full_blocks{tuple(names)} is not the API the benchmark drives")


class VllmIdPool:
    """vLLM's ``BlockPool`` behind the integer-id names that ``gpupool.replay`` drives (docs/semantics.md
    section 4): a thin translation between block ids and vLLM's ``KVCacheBlock`` objects."""

    def __init__(self, pool):
        _vllm_check_api(pool)
        self.pool = pool
        self.blocks = pool.blocks
        self.num_blocks = pool.num_gpu_blocks
        self._nested = _vllm_touch_nested(pool)
        self._req = _vllm_request([])

    def get_cached_block(self, block_hash, group_ids):
        got = self.pool.get_cached_block(block_hash, list(group_ids))
        return None if got is None else [b.block_id for b in got]

    def touch(self, ids):
        blocks = [self.blocks[i] for i in ids]
        self.pool.touch((blocks,) if self._nested else blocks)

    def get_new_blocks(self, n):
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def cache_full_blocks(self, ids, hashes, num_cached, num_full, block_size, group_id=0):
        self._req.block_hashes = list(hashes)
        self.pool.cache_full_blocks(self._req, [self.blocks[i] for i in ids], num_cached, num_full, block_size,
                                    group_id)

    def free_blocks(self, ids):
        self.pool.free_blocks([self.blocks[i] for i in ids])

    def get_num_free_blocks(self):
        return self.pool.get_num_free_blocks()

    def free_queue(self):
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def ref_counts(self, ids):
        return [self.blocks[i].ref_cnt for i in ids]


# ---- one case: what is timed, and how to put the pool back --------------------------------
@dataclass
class Case:
    step: Callable[[], object]  # the op, without waiting for the device
    close: Callable[[], None] = lambda: None  # release everything the case holds
    undo: Callable[[], None] | None = None  # pedantic mode: untimed, before each timed round
    held: list[bool] | None = None  # pedantic mode: [True] once a timed round has run (undo clears it)


def _graph(step: Callable[[], object], warmup: int = 2) -> Callable[[], None]:
    """Capture ``step`` (already run eagerly at least once) in a CUDA graph; returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    return g.replay


def _i32(values, dev) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=dev)


# ---- alloc_free ------------------------------------------------------------------------------
def case_alloc_free(kind: str, pool, batch: int) -> Case:
    n = batch
    if kind in ("reference", "vllm", "device-single"):
        return Case(step=lambda: pool.free_blocks(pool.get_new_blocks(n)))
    dev = pool.device
    demands, seg = _i32([n], dev), _i32([0, n], dev)

    def step():
        out, _ = pool.allocate_batched(demands)
        pool.free_batched(out[:n], seg)
    return Case(step=step)


# ---- touch -----------------------------------------------------------------------------------
def _cached_free_blocks(kind: str, pool, n: int, hold: bool):
    """``n`` blocks keyed under fresh hashes; freed again (ref_cnt 0, at the queue's tail) unless
    ``hold``. Returns (ids or block objects, hashes)."""
    hashes = fresh_hashes(n)
    if kind == "vllm":
        _vllm_check_api(pool)
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(_vllm_request(hashes), blocks, 0, n, BLOCK_SIZE, 0)
    else:
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(blocks, hashes, 0, n, BLOCK_SIZE, 0)
    if not hold:
        pool.free_blocks(blocks)
    return blocks, hashes


def case_touch(kind: str, pool, batch: int) -> Case:
    blocks, _ = _cached_free_blocks(kind, pool, batch, hold=False)
    held = [False]
    if kind == "vllm":
        arg = (blocks,) if _vllm_touch_nested(pool) else blocks

        def step():
            pool.touch(arg)
    elif kind in ("reference", "device-single"):
        def step():
            pool.touch(blocks)
    else:
        def step():
            pool.touch_batched(blocks)

    def undo():
        if held[0]:
            sync()
            pool.free_blocks(blocks)  # device: the single op (waits, raises a recorded error)
            held[0] = False

    return Case(step=step, undo=undo, close=undo, held=held)


# ---- lookup ----------------------------------------------------------------------------------
def case_lookup(kind: str, pool, batch: int) -> Case:
    m = min(batch, (pool_size(kind, pool) - 1) // 2)
    blocks, hashes = _cached_free_blocks(kind, pool, m, hold=True)
    queries = [hashes[i % m] for i in range(batch)]
    if kind == "vllm":
        expect = [b.block_id for b in blocks]
        got = [pool.get_cached_block(h, [0])[0].block_id for h in hashes]
        assert got == expect

        def step():
            for h in queries:
                pool.get_cached_block(h, [0])
    elif kind == "reference":
        assert [pool.get_cached_block(h, [0])[0] for h in hashes] == list(blocks)

        def step():
            for h in queries:
                pool.get_cached_block(h, [0])
    else:
        from gpupool.keys import device_key

        dev = pool.device
        keys = [device_key(h, 0) for h in queries]
        khi = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=dev)
        klo = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=dev)
        kgrp = torch.zeros(batch, dtype=torch.int32, device=dev)
        got = pool.lookup_batched(khi, klo, kgrp)
        ids = blocks.tolist()
        assert got.tolist() == [ids[i % m] for i in range(batch)]

        def step():
            return pool.lookup_batched(khi, klo, kgrp)

    return Case(step=step, close=lambda: pool.free_blocks(blocks))


def pool_size(kind: str, pool) -> int:
    return pool.num_gpu_blocks if kind == "vllm" else pool.num_blocks


# ---- decode_step -----------------------------------------------------------------------------
def case_decode_step(kind: str, pool, batch: int) -> Case:
    k = math.ceil(batch / DECODE_CROSS_EVERY)
    held = pool.get_new_blocks(batch)  # the running requests' other blocks (not touched again)
    if kind in ("reference", "vllm"):
        state = {"prev": pool.get_new_blocks(k)}
        if kind == "vllm":
            _vllm_check_api(pool)
            req = _vllm_request([])

            def cache_one(b, h):
                req.block_hashes = [h]
                pool.cache_full_blocks(req, [b], 0, 1, BLOCK_SIZE, 0)
        else:
            def cache_one(b, h):
                pool.cache_full_blocks([b], [h], 0, 1, BLOCK_SIZE, 0)
        counter = _hash_counter

        def step():
            prev = state["prev"]
            for b in prev:  # each crossing request caches its newly full block
                cache_one(b, next(counter).to_bytes(32, "little"))
            for b in prev:  # finished requests, freed one by one
                pool.free_blocks([b])
            state["prev"] = [pool.get_new_blocks(1)[0] for _ in range(k)]

        def close():
            pool.free_blocks(list(held) + list(state["prev"]))
        return Case(step=step, close=close)

    dev = pool.device
    prev = pool.get_new_blocks(k).clone()
    demands = torch.zeros(batch, dtype=torch.int32, device=dev)
    demands[::DECODE_CROSS_EVERY] = 1
    seg = torch.arange(k + 1, dtype=torch.int32, device=dev)

    def step():
        # the k full blocks get new keys, as one cache_full_blocks call of k blocks would key them
        # (a captured graph replays the keys it captured: the same each replay)
        pool.cache_blocks_batched(prev, [(fresh_hashes(k), 0, k, BLOCK_SIZE, 0)])
        pool.free_batched(prev, seg)
        out, _ = pool.allocate_batched(demands)
        prev.copy_(out[:k])

    def close():
        sync()
        pool.free_blocks(torch.cat([held, prev]))
    return Case(step=step, close=close)


CASES = {"alloc_free": case_alloc_free, "touch": case_touch, "lookup": case_lookup, "decode_step": case_decode_step}


# ---- the runner ------------------------------------------------------------------------------
def _rounds_for(fn: Callable[[], None], undo) -> int:
    if undo:
        undo()
    t = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t, 1e-7)
    return int(min(2000, max(3, MAX_TIME / dt)))


def run_case(benchmark, pools, op: str, kind: str, num_blocks: int, batch: int) -> None:
    pool = pools.get(kind, num_blocks)
    benchmark.group = f"{op} N={num_blocks} B={batch}"
    benchmark.extra_info.update(op=op, pool=kind, num_blocks=num_blocks, batch=batch,
                                device=device_name() if kind in DEVICE_KINDS else "cpu (host)")
    if kind in DEVICE_KINDS:
        pool.check()
    case = CASES[op](kind, pool, batch)
    try:
        step = case.step
        if case.undo:
            case.undo()
        step()  # warm up (on CUDA: compiles the kernels)
        if case.held:
            case.held[0] = True
        sync()
        if kind == "device-graph":
            if case.undo:
                case.undo()
            step = _graph(case.step, warmup=0 if case.undo else 2)
        if case.held is not None:
            inner, held = step, case.held

            def step():
                inner()
                held[0] = True
        if kind in DEVICE_KINDS and CUDA:
            timed = step

            def fn():
                timed()
                torch.cuda.synchronize()
        else:
            fn = step
        if case.undo:
            rounds = _rounds_for(fn, case.undo)
            benchmark.pedantic(fn, setup=case.undo, rounds=rounds, iterations=1)
        else:
            benchmark(fn)
            if kind in DEVICE_KINDS and CUDA:
                benchmark.extra_info["gpu_us"] = _cuda_event_us(step)
    finally:
        case.close()
    if kind in DEVICE_KINDS:
        pool.check()  # a batched op that failed would have recorded it: the numbers would be void
    assert pool.get_num_free_blocks() == num_blocks - 1, "the case leaked blocks"


def _cuda_event_us(step: Callable[[], object], iters: int = 50) -> float:
    """Microseconds per ``step`` over ``iters`` back-to-back calls, by CUDA events (no host wait
    between calls: for a captured graph this is its GPU time)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


@pytest.mark.bench_op
def test_pool_op(benchmark, pools, op, kind, num_blocks, batch):
    run_case(benchmark, pools, op, kind, num_blocks, batch)


# ---- trace replay ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [
    "reference",
    pytest.param("vllm", marks=pytest.mark.skipif(vllm_block_pool() is None,
                                                  reason="vllm is not installed (import vllm fails)")),
    "device",
])
def test_replay(benchmark, kind):
    """The bundled Mooncake trace (docs/semantics.md section 5): the reference pool and vLLM with
    ``gpupool.replay.replay`` on the whole trace, the device pool with ``replay_on_device`` (the
    event loop on the device) on ``GPUPOOL_BENCH_REPLAY_LIMIT`` requests (default: all with CUDA, 50
    without). Requests per second = requests / median wall time."""
    from gpupool.replay import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS, load_trace, replay

    limit = REPLAY_LIMIT if kind == "device" else None
    trace = load_trace(None, limit)
    benchmark.group = "replay"
    if kind == "device":
        from gpupool.replay.device import replay_on_device as run
        if CUDA:  # compile the step kernel outside the timing
            run(make_pool("device", DEFAULT_NUM_BLOCKS), trace[:20])
    else:
        run = replay

    def new_pool():
        if kind == "vllm":
            cls = vllm_block_pool()
            params = inspect.signature(cls.__init__).parameters
            kw = {"hash_block_size": DEFAULT_BLOCK_SIZE} if "hash_block_size" in params else {}
            return (VllmIdPool(cls(DEFAULT_NUM_BLOCKS, True, **kw)),), {}
        return (make_pool(kind, DEFAULT_NUM_BLOCKS),), {}

    reports = []

    def target(pool):
        rep = run(pool, trace)
        reports.append(rep)
        return rep

    rounds = 1 if (kind == "device" and not CUDA) else 3
    benchmark.pedantic(target, setup=new_pool, rounds=rounds, iterations=1)
    rep = reports[-1]
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        op="replay", pool=kind, device=device_name() if kind == "device" else "cpu (host)",
        requests=rep.requests, limit=limit, num_blocks=rep.num_blocks, block_size=rep.block_size,
        requests_per_s=rep.requests / median if median > 0 else 0.0, hit_blocks=rep.hit_blocks,
        prompt_blocks=rep.prompt_blocks, free_queue_sha256=rep.free_queue_sha256)
    assert rep.admitted + rep.rejected == rep.requests
