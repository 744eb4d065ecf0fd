"""Drives vLLM 0.33's scheduler and gpupool's over a Gemma 3-style hybrid KV cache config (a sliding-window
group and a full-attention group, so vLLM's HybridKVCacheCoordinator) with prefix caching, and writes
each step's decisions (a subprocess: ``python hybrid_driver.py OUT.json``; vLLM's source and the plugin's
stubs on sys.path; tests/vllm_plugin/test_vllm_hybrid.py reads the file).

The scheduler is sched_driver.py's (``make_scheduler(..., sliding_window=WINDOW)``, KV events and the KV
cache metrics collector recorded) and so is the step loop (``run``). The stream is conversations: first
turns over shared system prefixes, and next turns whose prompt is the previous turn's tokens (prompt
and output) plus a new message, so prefix hits span both groups; the pool is small enough to preempt.
Recorded per step besides ``run``'s record: every running request's block ids in each group after
``schedule()`` (the sliding-window group's freed blocks are the null block there).

Environment: ``MODES`` (comma-separated gpupool backends: ``reference``, ``device``; ``<backend>_g<N>``
with N sliding-window groups of one spec, as vLLM splits a Gemma 3's many sliding-window layers, looked
up together, and N times the blocks), ``SEED``, ``NREQ`` (first turns), ``NUM_BLOCKS``. Stock vLLM's
``AsyncScheduler`` runs first for each group count (``stock``, ``stock_g<N>``), then ``GpuPoolScheduler``
once per mode (the synchronous scheduler: the live engine test).
"""
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from sched_driver import BLOCK, make_scheduler, run  # noqa: E402 - imports vLLM's source and the stubs

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402

WINDOW = 32  # tokens: two blocks of 16


def make_conversations(seed: int, n: int) -> list:
    """sched_driver's stream entries: ``n`` first turns (a system prefix of 1-5 blocks out of 3, a
    private message, arrivals over 10 steps, 3-16 tokens out, a few aborted), then for about two thirds
    of them a second turn (1-30 new tokens, 0-3 steps after the first ends) and for some a third."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(1, 5))] for _ in range(3)]
    out = []
    for i in range(n):
        p = list(rng.choice(systems)) + [rng.randrange(1, 30000) for _ in range(rng.randint(1, 40))]
        abort = rng.randint(2, 10) if rng.random() < 0.1 else None
        out.append((rng.randint(0, 10), f"c{i}t0", p, rng.randint(3, 16), abort))
        parent = f"c{i}t0"
        for t in (1, 2):
            if rng.random() < (0.65 if t == 1 else 0.4):
                tail = [rng.randrange(1, 30000) for _ in range(rng.randint(1, 30))]
                out.append((("after", parent, rng.randint(0, 3)), f"c{i}t{t}", tail, rng.randint(3, 12), None))
                parent = f"c{i}t{t}"
            else:
                break
    return out


def record_tables(sched) -> None:
    """After each ``schedule()``, append ``["tables", {request id: [block ids of each group]}]`` to
    ``sched.observed`` (taken per step by ``run``)."""
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    inner = sched.schedule

    def schedule(*a, **k):
        out = inner(*a, **k)
        rids = sorted(set().union(*(m.req_to_blocks for m in managers)))
        sched.observed.append(["tables", {r: [[b.block_id for b in m.req_to_blocks.get(r, ())] for m in managers]
                                          for r in rids}])
        return out
    sched.schedule = schedule


def build(cls, num_blocks: int, sliding_groups: int = 1):
    s = make_scheduler(cls, num_blocks, observed=True, sliding_window=WINDOW, sliding_groups=sliding_groups)
    record_tables(s)
    return s


def describe(sched) -> list:
    """The scheduler's and its pool's classes, the coordinator and the managers."""
    kvm = sched.kv_cache_manager
    return [type(sched).__name__, type(kvm.block_pool).__name__, getattr(kvm.block_pool, "backend", None),
            type(kvm.coordinator).__name__, [type(m).__name__ for m in kvm.coordinator.single_type_managers]]


def main():
    from gpupool.vllm import GpuPoolScheduler
    out_path = sys.argv[1]
    stream = make_conversations(int(os.environ.get("SEED", "0")), int(os.environ.get("NREQ", "10")))
    num_blocks = int(os.environ.get("NUM_BLOCKS", "20"))
    res = {}
    modes = os.environ.get("MODES", "reference").split(",")
    # "<backend>_g<N>": N sliding-window groups, compared with "stock_g<N>"
    stocks = sorted({"stock" + m[len(m.partition("_g")[0]):] for m in modes})
    for mode in stocks + modes:
        backend, _, groups = mode.partition("_g")
        groups = int(groups or 1)
        os.environ["GPUPOOL_VLLM_BACKEND"] = backend
        t = time.perf_counter()
        s = build(AsyncScheduler if backend == "stock" else GpuPoolScheduler, num_blocks * groups, groups)
        res[mode] = run(s, stream)
        res[mode + "_s"], res[mode + "_is"] = time.perf_counter() - t, describe(s)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
