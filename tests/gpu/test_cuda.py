"""CUDA-only checks (skipped without a GPU; run by bench/gpu_check.sh on a lent machine).

What the interpreter cannot show (docs/algorithms.md section 5): races between warps, same-address
atomics in hardware order, host synchronisation in the batched ops, and CUDA-graph capture.
"""
from __future__ import annotations

import random

import pytest
import torch

from gpupool import BlockPool, ReferenceBlockPool
from harness.warps import forced_warps
from gpupool.errors import OutOfBlocksError
from gpupool.replay import load_trace, replay
from gpupool.replay.device import replay_on_device
from harness.compare import assert_pools_agree, assert_replays_agree
from harness.keys import h
from harness.state import pool_state
from harness.twins import pool_twin
from harness.device import i32

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def random_run(seed, num_warps=None, n=64, steps=150):
    """A seeded op sequence on a device pool and the reference (every kernel at ``num_warps`` warps
    when given); returns both pools."""
    if num_warps:
        with forced_warps(num_warps):
            return random_run(seed, None, n, steps)
    rng = random.Random(seed)
    ref, dev = pool_twin(n, max_keys_per_block=2, device=DEV, ring_capacity=64)
    held: list[int] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 and ref.get_num_free_blocks():
            k = rng.randint(1, min(8, ref.get_num_free_blocks()))
            got = ref.get_new_blocks(k)
            assert dev.get_new_blocks(k).tolist() == got
            held += got
        elif op < 0.55 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            out, held = held[:k], held[k:]
            ref.free_blocks(out)
            dev.free_blocks(out)
        elif op < 0.75 and held:
            blocks = rng.sample(held, min(len(held), 4))
            hashes = [h(rng.randint(0, 30)) for _ in blocks]
            for p in (ref, dev):
                try:
                    p.cache_full_blocks(blocks, hashes, 0, len(blocks), 16, 0)
                except Exception as e:  # both must fail alike
                    assert type(e).__name__ in ("HashConflictError", "InvalidArgumentError")
        elif op < 0.9:
            key = h(rng.randint(0, 30))
            hit = ref.get_cached_block(key, [0])
            assert dev.get_cached_block(key, [0]) == hit
            if hit:
                ref.touch(hit)
                dev.touch(hit)
                held += hit
        else:
            ids = rng.sample(range(1, n), 5)
            ref.evict_blocks(ids)
            dev.evict_blocks(ids)
        assert dev.free_queue() == ref.free_queue()
    assert_pools_agree(ref, dev)
    return dev, ref


@pytest.mark.parametrize("num_warps", [1, 4, 8, 16])
def test_differential_on_cuda_is_bitwise_repeatable(num_warps):
    first = None
    for _ in range(20):
        dev, _ = random_run(seed=7, num_warps=num_warps)
        state = {k: v.cpu().clone() for k, v in dev.state._asdict().items()}
        if first is None:
            first = state
        else:
            for k in first:
                assert torch.equal(first[k], state[k]), k


def test_batched_ops_make_no_host_sync():
    pool = BlockPool(4096, device=DEV)
    demands = i32([3, 5, 0, 7])
    ids = i32(list(range(1, 16)))
    seg = i32([0, 5, 15])
    keys = torch.zeros(4, dtype=torch.int64, device=DEV)
    grp = torch.zeros(4, dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, off = pool.allocate_batched(demands)
        pool.free_batched(ids, seg)
        pool.touch_batched(out[:2])
        pool.lookup_batched(keys, keys, grp)
        pool.longest_prefix_batched(keys.view(1, 1, 4), keys.view(1, 1, 4), grp[:1], i32([4]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pool.check()


def test_graph_capture_replays_like_eager():
    """Capture allocate + free of a fixed-shape batch once; replay with new demands each step."""
    eager = BlockPool(2048, device=DEV)
    graphed = BlockPool(2048, device=DEV)
    demands = i32([0] * 8)
    ids = torch.zeros(64, dtype=torch.int32, device=DEV)
    n_ids = i32([0])
    seg = i32([0, 0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles) outside the graph
        graphed.allocate_batched(demands)
        graphed.free_batched(ids, seg, n_ids)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, off = graphed.allocate_batched(demands)
        graphed.free_batched(ids, seg, n_ids)
    rng = random.Random(3)
    held: list[int] = []
    for step in range(1000):
        d = [rng.randint(0, 3) for _ in range(8)]
        rng.shuffle(held)
        k = rng.randint(0, min(len(held), 64))
        frees, held = held[:k], held[k:]
        # The graph allocates, then frees; the eager pool does the same two single ops.
        demands.copy_(i32(d))
        ids[:k].copy_(i32(frees) if k else ids[:0])
        n_ids.fill_(k)
        seg.copy_(i32([0, k]))
        graph.replay()
        got = eager.get_new_blocks(sum(d)).tolist() if sum(d) else []
        if frees:
            eager.free_blocks(frees)
        o = off.tolist()
        assert out[: o[-1]].tolist() == got, step
        held += got
        if step % 100 == 0:
            assert graphed.free_queue() == eager.free_queue()
    graphed.validate()
    assert graphed.free_queue() == eager.free_queue()


def test_graph_replay_error_changes_nothing_and_later_replays_work():
    pool = BlockPool(64, device=DEV)
    demands = i32([1])
    pool.allocate_batched(demands)
    pool.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.allocate_batched(demands)
    demands.fill_(10_000)  # more than free: the replay must do nothing
    before = pool_state(pool)
    graph.replay()
    with pytest.raises(OutOfBlocksError):
        pool.check()
    assert pool_state(pool) == before
    demands.fill_(2)
    graph.replay()
    pool.check()
    assert pool.get_num_free_blocks() == before["num_free"] - 2


def test_replay_full_trace_matches_reference_on_cuda():
    trace = load_trace()
    ref = replay(ReferenceBlockPool(16384), trace)
    dev = replay_on_device(BlockPool(16384, device=DEV), trace)
    assert_replays_agree(ref, dev)
