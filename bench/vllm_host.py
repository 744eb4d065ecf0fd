"""Host (Python) time per scheduler step: the vLLM fast path (``DeferredBlockPool``) against vLLM 0.33's
own ``BlockPool``, on CPU (docs/vllm.md, "The fast path"; bench/RESULTS.md).

The step: B running requests in decode, B // 16 of them crossing into a new block (``get_new_blocks(1)``
and ``cache_full_blocks`` of the block they filled); one finished request of 32 blocks freed tail first;
one admitted with a 16-block prefix hit (16 ``get_cached_block``, one ``touch``) and 16 new blocks
cached; then ``end_step`` (``GpuPoolScheduler`` calls it after ``schedule()``). Block size 16, a pool
of 100,000 blocks, the pool warmed with the running requests first.

gpupool runs over the device pool on CPU. Its one launch per step runs the kernel under Triton's
interpreter, which would dominate, so the time inside ``launch_flush`` is measured apart and left out:
the figure is the adapter's host work (the mirror, the host copy of the free queue, the batch, the
launch's arguments and copies, the synchronisations it makes), not Triton's launcher (on a GPU some
tens of microseconds per launch, not measured here) nor the device's work (modelled in RESULTS.md).
vLLM's pool is imported from its sdist (``GPUPOOL_VLLM_SRC``, else the tests' cache of it); without it
only gpupool's figure is printed.

    TRITON_INTERPRET=1 python bench/vllm_host.py [--requests 1024] [--steps 40]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time
import types
from pathlib import Path

BS = 16
N = 100_000
ROOT = Path(__file__).resolve().parent.parent


def _request(i: int, nblocks: int):
    hs, parent = [], b"r%d" % i
    for k in range(nblocks):
        parent = hashlib.sha256(parent + bytes([k % 256])).digest()
        hs.append(parent)
    return types.SimpleNamespace(block_hashes=hs, all_token_ids=[0] * (nblocks * BS), lora_request=None,
                                 session_id=None, mm_features=[], request_id=str(i), cache_salt=None,
                                 prompt_embeds=None)


def run(pool, n_req: int, steps: int, end_step) -> float:
    """Mean host seconds per step (the workload in the module docstring)."""
    return run_steps(pool, warm(pool, n_req, end_step), steps, end_step)


def warm(pool, n_req: int, end_step):
    """The running requests and the shared prefix, cached: the state :func:`run_steps` starts from."""
    reqs = []
    for i in range(n_req):  # warm: each running request holds 32 blocks, the first 31 cached
        r = _request(i, 64)
        blocks = pool.get_new_blocks(32)
        pool.cache_full_blocks(r, blocks, 0, 31, BS, 0)
        reqs.append([r, blocks, 31])
    end_step()
    shared = _request(-1, 64)  # an admitted request's prefix, cached once
    sb = pool.get_new_blocks(16)
    pool.cache_full_blocks(shared, sb, 0, 16, BS, 0)
    pool.free_blocks(list(reversed(sb)))
    end_step()
    return [reqs, shared, n_req]


def run_steps(pool, state, steps: int, end_step) -> float:
    """Mean host seconds per step; the garbage collector off while timing (the interpreted kernel leaves
    many objects behind, whose collections would land in the host figure), for both pools alike."""
    reqs, shared, nxt = state
    t_total = 0.0
    gc.collect()
    gc.disable()
    try:
        return _steps(pool, reqs, shared, state, steps, end_step)
    finally:
        gc.enable()


def _steps(pool, reqs, shared, state, steps, end_step):
    nxt, t_total = state[2], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        done = reqs.pop(0)  # update_from_output: a request finished
        pool.free_blocks(list(reversed(done[1])))
        hit = []
        for h in shared.block_hashes[:16]:  # schedule(): a new request, its prefix hit
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hit.append(got[0])
        pool.touch(hit)
        new = pool.get_new_blocks(16)
        r = _request(nxt, 64)
        nxt += 1
        r.block_hashes[:16] = shared.block_hashes[:16]
        pool.cache_full_blocks(r, hit + new, len(hit), 32, BS, 0)
        reqs.append([r, hit + new, 32])
        for k in range(step % 16, len(reqs), 16):  # the requests crossing into a new block this step
            q = reqs[k]
            q[1] += pool.get_new_blocks(1)
            if q[2] + 1 < len(q[1]) and q[2] + 1 <= len(q[0].block_hashes):
                pool.cache_full_blocks(q[0], q[1], q[2], q[2] + 1, BS, 0)
                q[2] += 1
        [b.block_id for q in reqs for b in q[1][-1:]]  # the SchedulerOutput's new block ids
        end_step()
        t_total += time.perf_counter() - t0
    state[2] = nxt
    return t_total / steps


def vllm_pool():
    src = os.environ.get("GPUPOOL_VLLM_SRC")
    if not src:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_vllm_conformance import CACHE
        src = str(CACHE / "vllm-0.33.0-src")
    if not (Path(src) / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        return None
    os.environ["GPUPOOL_VLLM_SRC"] = src
    sys.path.insert(0, str(ROOT / "tests" / "vllm_conformance"))
    import plugin  # noqa: F401 - vLLM's source and the stubs
    from vllm.v1.core.block_pool import BlockPool
    return BlockPool(N, True, BS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from gpupool.kernels import flush as k_flush
    from gpupool.vllm.fast_path import DeferredBlockPool

    launch, spent = k_flush.launch_flush, [0.0, 0]

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return launch(*args, **kw)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
    k_flush.launch_flush = timed
    pool = DeferredBlockPool(N, True, BS, device="cpu")
    spent0 = []

    def end_step():
        pool.end_step()
        spent0.append(spent[0])
    t0 = time.perf_counter()
    per = run(pool, a.requests, a.steps, end_step)
    kernel = (spent0[-1] - spent0[1]) / a.steps  # the launches of the timed steps
    ours = per - kernel
    print(f"gpupool DeferredBlockPool: {ours * 1e6:,.0f} us host per step (B={a.requests}, {a.steps} steps; "
          f"the interpreted kernel, {kernel * 1e3:,.0f} ms per step, left out); launches {spent[1]}, syncs "
          f"{dict(pool.syncs)} ({time.perf_counter() - t0:.0f} s)")
    stock = vllm_pool()
    if stock is not None:
        t = run(stock, a.requests, a.steps, lambda: None)
        print(f"vLLM 0.33 BlockPool:       {t * 1e6:,.0f} us host per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
