"""Host (Python) time per scheduler step: the vLLM fast path (``DeferredBlockPool``) against vLLM 0.33's
own ``BlockPool``, on CPU (docs/vllm.md, "The fast path"; bench/RESULTS.md).

The step: B running requests in decode, B // 16 of them crossing into a new block (``get_new_blocks(1)``
and ``cache_full_blocks`` of the block they filled); one finished request of 32 blocks freed tail first;
one admitted with a 16-block prefix hit (16 ``get_cached_block``, one ``touch``) and 16 new blocks
cached; then ``end_step`` (``GpuPoolScheduler`` calls it after ``schedule()``). Block size 16, a pool
of 100,000 blocks, the pool warmed with the running requests first.

gpupool runs over the device pool on CPU. Its launches (every ``launch_every`` steps, 4 unless
``--launch-every`` says otherwise) run the kernel under Triton's interpreter, which would dominate,
so the time inside ``launch_flush`` is measured apart and left out: the figure is the adapter's host work (the mirror, the host copy of the free queue, the batch, the
launch's arguments and copies, the synchronisations it makes), not Triton's launcher (on a GPU some
tens of microseconds per launch, not measured here) nor the device's work (modelled in RESULTS.md).
vLLM's pool is imported from its sdist (``GPUPOOL_VLLM_SRC``, else the tests' cache of it); without it
only gpupool's figure is printed.

    TRITON_INTERPRET=1 python bench/vllm_host.py [--requests 1024] [--steps 40]

``--scheduler``: vLLM 0.33's own scheduler loop instead (``AsyncScheduler.schedule()`` then
``update_from_output()`` of the batch before, one batch in flight, as vLLM's test_async_scheduler.py
drives it), with vLLM's ``BlockPool`` (stock) and with ``GpuPoolScheduler``'s fast path, on the
workloads of :data:`WORKLOADS`: B requests in decode (B = 256, 1,024, 4,096), a prefix-hit mix and a
preemption mix. The figure is the process CPU time of a whole scheduler step (``time.process_time``,
the garbage collector off for every variant); the variants are interleaved (A, B, A, B, ...: with
``--device stub`` step by step, each first every other step; with ``--device interpreted`` repetition
by repetition) so that a slower period of a shared machine weighs on both. Prints, per workload, the
median over the repetitions of each variant's time per step and of the ratio gpupool / stock (each
repetition's ratio from its own pair of ``--steps`` steps), with the ratios' spread.

``--device stub`` (the default with ``--scheduler``): the fast path's device work is what a GPU does
asynchronously. Its one kernel, the batch's launch, is replaced by a stub that applies the batch to
a reference pool and writes the result into the device pool's tensors
(tests/harness/flush_stub.py; its results are the interpreted kernel's, checked by
tests/vllm_plugin/test_vllm_flush_stub.py), its time left out. Everything else of the fast path runs
as it is: the host's answers, the batch, the launch's arguments and host-to-device copy, each
synchronisation's reads (torch ops on CPU tensors, whose CPU time stands for their host cost on a
GPU). What a GPU adds that a CPU run does not show is then added per step as a model, from the
counts of a third loop that runs the same steps under :class:`gpupool.instrument.Meter`: each
device-to-host read (``--sync-us``), each kernel launch's host side in Triton's launcher
(``--launch-us``) and each host-to-device copy (``--copy-us``). Stock vLLM's step does no device
work: nothing is added to it.

``--device interpreted``: the launch runs the kernel under Triton's interpreter, its time left out.
The interpreted kernel also leaves the CPU's caches full of the interpreter's data, which slows the
host code that runs after it (about 2 ms of a 26 ms step at B = 1,024); a GPU kernel does not. So that
this weighs on both variants alike, the stock variant runs the same interpreted kernel too, on a pool
of its own (the blocks its steps allocated popped, the last launch's freed), its time
left out as gpupool's is, as often as the fast path launches (every ``DeferredBlockPool.launch_every``
steps, or sooner when the blocks popped since name ``launch_ops`` ids: in these workloads a popped
block is also cached, two ids). ``--no-equal-kernel`` leaves it out (then the ratio also holds that
cost).

    TRITON_INTERPRET=1 python bench/vllm_host.py --scheduler --reps 8 [--workloads decode256,prefix] [--sync-us 20] [--launch-us 30] [--copy-us 10] [--torch-op-us 10]
    TRITON_INTERPRET=1 python bench/vllm_host.py --scheduler --device interpreted [--reps 5]

``--per-call``: the decode step's calls one by one, outside the scheduler, on the same warm pools
(B requests, a pool of ``48 B + 4,096`` blocks; the fast path's kernel as the stub above): the median
over ``--steps`` steps of each call's host microseconds, ``get_new_blocks(1)`` and the one-block
``cache_full_blocks`` of the B // 16 requests crossing into a new block, stock and gpupool interleaved;
then the host side of one ``apply_predicted`` of 4 such steps (the launch the fast path makes every 4
steps), the stub's time left out (the cachings keyed on the device, as a GPU pool keys them); and a
step's pool host time: its calls at their medians, gpupool's with a quarter of a launch.

    TRITON_INTERPRET=1 python bench/vllm_host.py --per-call [--requests 1024] [--steps 40]

``--pool-time``: the scheduler loop of ``--scheduler`` (the stub, the same workloads), timing only the
host time inside the block pool's public methods, the outermost call of each (vLLM's calls on
``kv_cache_manager.block_pool``, and gpupool's ``end_step``, where its launches and synchronisations
run), on ``time.perf_counter`` less the stub's time and the timer's own cost per call (calibrated on a
function that does nothing), stock and gpupool interleaved step by step: the part of a step where the
two differ, without the rest of vLLM's step around it. The torch ops on the pool's CPU tensors are in
it, as measured (a GPU pays a launch each instead).

``--by-method`` adds each method's us per step (the mean over every repetition); ``--even-caches`` has
stock run the stub too, untimed, on a pool of its own, as often as gpupool launches (its pops cached),
so that the stub's memory traffic weighs on both variants' host code (a GPU's work leaves none).

    TRITON_INTERPRET=1 python bench/vllm_host.py --pool-time [--reps 16] [--by-method] [--even-caches]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import statistics
import sys
import time
import types
from collections import Counter
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
        sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "vllm_plugin")]
        from test_vllm_conformance import CACHE
        src = str(CACHE / "vllm-0.33.0-src")
    if not (Path(src) / "vllm" / "v1" / "core" / "block_pool.py").is_file():
        return None
    os.environ["GPUPOOL_VLLM_SRC"] = src
    sys.path.insert(0, str(ROOT / "tests" / "vllm_plugin" / "conformance"))
    import plugin  # noqa: F401 - vLLM's source and the stubs
    from vllm.v1.core.block_pool import BlockPool
    return BlockPool(N, True, BS)


# ---- the scheduler loop ---------------------------------------------------------------------------
# name: running requests (in decode, 1 in 16 crossing into a new block each step), their shortest
# prompt, new requests per step with a shared 16-block prefix (6 tokens out each), pool blocks per
# running request (None: room for all; 2.5: preemptions)
WORKLOADS = {
    "decode256": dict(running=256, prompt=17, arrivals=0, blocks=None),
    "decode1024": dict(running=1024, prompt=17, arrivals=0, blocks=None),
    "decode4096": dict(running=4096, prompt=17, arrivals=0, blocks=None),
    "prefix": dict(running=256, prompt=17, arrivals=4, blocks=None),
    "preempt": dict(running=256, prompt=17, arrivals=0, blocks=2.5),
}


class SchedulerLoop:
    """One scheduler (stock or gpupool) on one workload, stepped ``schedule()`` + ``update_from_output()``
    with one batch in flight; :meth:`steps` returns the CPU seconds of n steps, less what ``left_out()``
    (cumulative seconds: the device work's) grew by meanwhile."""

    def __init__(self, variant: str, wl: dict, kernel: list, left_out=None):
        import sched_driver as sd  # vLLM's source, the stubs, make_scheduler
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        self.sd, self.SP, self.Req, self.MRO = sd, SamplingParams, Request, ModelRunnerOutput
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(sd.BLOCK, sha256)
        b = wl["running"]
        per = wl["blocks"]
        nblk = int(b * per) + 64 if per else b * 48 + 4096
        os.environ["GPUPOOL_VLLM_BACKEND"] = "device"
        os.environ["GPUPOOL_VLLM_DEVICE"] = "cpu"
        if variant == "stock":
            cls = AsyncScheduler
        else:
            from gpupool.vllm import GpuPoolScheduler
            cls = GpuPoolScheduler
        self.sched = sd.make_scheduler(cls, nblk, max_model_len=8192, max_num_batched_tokens=max(8192, 2 * b),
                                       max_num_seqs=b + 64)
        if variant != "stock" and left_out is not None:  # the stubbed device: the path a GPU pool takes
            as_on_gpu(self.sched.kv_cache_manager.block_pool)
        self.wl, self.kernel, self.n, self.inflight = wl, kernel, 0, None
        self.left_out = left_out or (lambda: kernel[0])
        self.shared = [7 + (i % 991) for i in range(16 * sd.BLOCK)]
        for j in range(b):  # prompts of 17..32 tokens: 1 in 16 requests crosses into a new block each step
            self._add([1 + (self.n * 131 + i) % 30000 for i in range(wl["prompt"] + j % sd.BLOCK)], 10 ** 6)
        for _ in range(8):  # prefill done: every running request in decode
            self._step()

    def equal_kernel(self, cache: bool = False) -> None:
        """Stock only: after ``schedule()``, as often as gpupool launches, one flush on a pool of its own
        (the interpreted kernel, or the stub under ``stubbed_flush``: ``--even-caches``, which also caches
        the popped blocks, ``cache``), its time counted as the kernel's (module docstring)."""
        from gpupool import BlockPool as DevicePool
        from gpupool.vllm.fast_path import DeferredBlockPool as Fast
        pool = self.sched.kv_cache_manager.block_pool
        shadow = DevicePool(pool.num_gpu_blocks, device="cpu")
        popped, held, steps, launches = [0], [None], [0], [0]
        get_new, schedule = pool.get_new_blocks, self.sched.schedule

        def counted(n):
            popped[0] += n
            return get_new(n)

        def launch():
            prev, n = held[0], min(popped[0], shadow.num_blocks - 1)
            free = dict(free_ids=prev, free_offsets=[0, prev.numel()]) if prev is not None else {}
            if cache and n:  # the pops cached under fresh hashes, as gpupool's launch caches its steps' blocks
                launches[0] += 1
                hashes = [hashlib.sha256(b"%d:%d" % (launches[0], i)).digest() for i in range(n)]
                free.update(cache_ids=[shadow.num_blocks + k for k in range(n)], cache_calls=[(hashes, 0, n, BS, 0)])
            held[0], popped[0] = shadow.apply_batched(demands=[n], **free)[0], 0

        def scheduled(*args, **kwargs):
            out = schedule(*args, **kwargs)
            steps[0] += 1
            if steps[0] < Fast.launch_every and 2 * popped[0] < Fast.launch_ops:
                return out  # the fast path would not launch either
            steps[0] = 0
            k0, t0 = self.kernel[0], time.process_time()
            try:
                launch()
            finally:  # all of it left out (the launch's own host part too), counted once
                self.kernel[0] = k0 + time.process_time() - t0
            return out
        pool.get_new_blocks, self.sched.schedule = counted, scheduled

    def _add(self, prompt, max_tokens):
        sp = self.SP(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, 50256)
        self.sched.add_request(self.Req(request_id=f"r{self.n}", prompt_token_ids=prompt, sampling_params=sp,
                                        pooling_params=None, block_hasher=self.hasher))
        self.n += 1

    def _step(self):
        for _ in range(self.wl["arrivals"]):
            self._add(self.shared + [1 + self.n % 30000, 2], 6)
        out = self.sched.schedule()
        prev, self.inflight = self.inflight, (out if out.num_scheduled_tokens else None)
        if prev is not None:
            ids = list(prev.num_scheduled_tokens)
            mro = self.MRO(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                           sampled_token_ids=[[1000 + len(r)] for r in ids], logprobs=None, prompt_logprobs_dict={},
                           pooler_output=[])
            self.sched.update_from_output(prev, mro)

    def step_time(self) -> float:
        """One step's CPU seconds, less the device work's (the garbage collector left to the caller)."""
        k0, t0 = self.left_out(), time.process_time()
        self._step()
        return time.process_time() - t0 - (self.left_out() - k0)

    def steps(self, n: int) -> float:
        gc.collect()
        gc.disable()
        try:
            k0, t0 = self.left_out(), time.process_time()
            for _ in range(n):
                self._step()
            return time.process_time() - t0 - (self.left_out() - k0)
        finally:
            gc.enable()


def scheduler_main(a) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "vllm_plugin" / "conformance"))
    if vllm_pool() is None:
        print("vLLM 0.33's source is not available (GPUPOOL_VLLM_SRC or the tests' cache): nothing to compare")
        return 1
    if a.pool_time:
        return pool_time_main(a)
    return (stub_main if a.device == "stub" else interpreted_main)(a)


def _spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


@contextlib.contextmanager
def counted_copies(count: Counter):
    """``count["copies"]``: the host-to-device copies the pool makes inside (``gpupool.tensors.to_device``
    and ``to_device_packed``, the outermost call of each: on CUDA one copy each, through a pinned buffer;
    on CPU no copy, which ``Meter`` then does not count)."""
    from gpupool import tensors
    saved, depth = (tensors.to_device, tensors.to_device_packed), [0]

    def counted(fn):
        def wrap(*args, **kwargs):
            if not depth[0]:
                count["copies"] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrap
    tensors.to_device, tensors.to_device_packed = map(counted, saved)
    try:
        yield count
    finally:
        tensors.to_device, tensors.to_device_packed = saved


def torch_op_time(stub):
    """A torch dispatch mode that adds up the CPU seconds of the torch ops run inside it (``seconds``),
    not those of the stub's own launch. Entered before a ``Meter`` (below it on the mode stack), it
    times the ops themselves, not the meter's counting."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class TorchOpTime(TorchDispatchMode):
        seconds = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if stub.active:
                return func(*args, **(kwargs or {}))
            t0 = time.process_time()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.seconds += time.process_time() - t0
    return TorchOpTime()


def stub_main(a) -> int:
    """The headline (module docstring, ``--device stub``): per workload, stock and gpupool timed in
    interleaved repetitions, a third loop counting the same steps' syncs, launches and copies."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.flush_stub import stubbed_flush
    from gpupool.instrument import Meter

    model = dict(sync=a.sync_us, launch=a.launch_us, copy=a.copy_us, op=a.torch_op_us)
    print(f"device work: the kernel as a stub and the torch ops' CPU time left out; GPU model per step: "
          f"{a.sync_us:g} us per device-to-host read (--sync-us), {a.launch_us:g} us per kernel launch "
          f"(--launch-us), {a.copy_us:g} us per host-to-device copy (--copy-us), {a.torch_op_us:g} us per torch op "
          f"(--torch-op-us); {a.reps} repetitions x {a.steps} steps per variant, interleaved; "
          f"median (min-max) over the repetitions")
    print("columns, us per step: stock vLLM; gpupool's host time (the stub's and the torch ops' CPU time, left "
          "out of it, in their own columns); the GPU model's addition; gpupool's total")
    print(f"{'workload':<12} {'stock':>9} {'gpupool':>9} {'(stub)':>8} {'(torch)':>8} {'+GPU':>6} {'total':>9} "
          f"{'ratio median (min-max)':>24}  per step: syncs launches copies torch-ops")
    for name in a.workloads.split(","):
        wl = WORKLOADS[name]
        with stubbed_flush() as stub:
            loops = {"stock": SchedulerLoop("stock", wl, [0.0]),
                     "gpupool": SchedulerLoop("gpupool", wl, [0.0], lambda: stub.seconds),
                     "count": SchedulerLoop("gpupool", wl, [0.0], lambda: stub.seconds)}
            if a.even_caches:
                loops["stock"].equal_kernel(cache=True)
            pools = {v: loops[v].sched.kv_cache_manager.block_pool for v in ("gpupool", "count")}
            per = {"stock": [], "gpupool": [], "torch": [], "stub": [], "gpu": [], "total": [], "ratio": []}
            counts = Counter()
            for _ in range(a.reps):
                st, gp, s0 = 0.0, 0.0, stub.seconds
                gc.collect()
                gc.disable()
                try:  # interleaved step by step, each variant first every other step
                    for k in range(a.steps):
                        for v in (("stock", "gpupool") if k % 2 == 0 else ("gpupool", "stock")):
                            t = loops[v].step_time()
                            if v == "stock":
                                st += t
                            else:
                                gp += t
                finally:
                    gc.enable()
                st, gp, stub_cpu = st / a.steps, gp / a.steps, (stub.seconds - s0) / a.steps
                h2d, ops = Counter(), torch_op_time(stub)
                with ops, Meter() as m, counted_copies(h2d):
                    launches0 = stub.launches
                    loops["count"].steps(a.steps)
                m.copies = h2d["copies"]  # Meter's count misses them on CPU (counted_copies)
                # the torch ops' CPU time (the same steps' ops, timed in the counting loop) is the device's
                # work on a GPU: left out, each op counted as a launch instead (--torch-op-us)
                torch_cpu = ops.seconds / a.steps
                gp -= torch_cpu
                real = m.launches - (stub.launches - launches0)
                if real:
                    raise SystemExit(f"{name}: {real} Triton launches besides the stub's ran on the stubbed pool")
                if (pools["gpupool"].syncs, pools["gpupool"].flushes) != (pools["count"].syncs, pools["count"].flushes):
                    raise SystemExit(f"{name}: the counting loop's steps are not the timed loop's")
                gpu = (m.syncs * model["sync"] + m.launches * model["launch"] + m.copies * model["copy"]
                       + m.torch_ops * model["op"]) / a.steps * 1e-6
                counts.update(m.as_dict())
                for k, v in (("stock", st), ("gpupool", gp), ("torch", torch_cpu), ("stub", stub_cpu), ("gpu", gpu),
                             ("total", gp + gpu),
                             ("ratio", (gp + gpu) / st)):
                    per[k].append(v)
        med = {k: statistics.median(v) for k, v in per.items()}
        r, lo, hi = _spread(per["ratio"])
        n = a.reps * a.steps
        print(f"{name:<12} {med['stock'] * 1e6:>9,.0f} {med['gpupool'] * 1e6:>9,.0f} {med['stub'] * 1e6:>8,.0f} "
              f"{med['torch'] * 1e6:>8,.0f} {med['gpu'] * 1e6:>6,.0f} "
              f"{med['total'] * 1e6:>9,.0f} {r:>10.3f}x ({lo:.3f}-{hi:.3f})  {counts['syncs'] / n:.3f} "
              f"{counts['launches'] / n:.3f} {counts['copies'] / n:.3f} {counts['torch_ops'] / n:.1f}"
              f"   (syncs by reason {dict(pools['gpupool'].syncs)})", flush=True)
    return 0


class PoolTimer:
    """The seconds (``time.perf_counter``: a cheap clock, as the calls are short) a scheduler loop spends
    inside its block pool's public methods (vLLM's calls on ``kv_cache_manager.block_pool`` and, for
    gpupool, ``end_step``), outermost calls only, less ``left_out()``'s growth meanwhile (the stub's)
    and the timer's own cost per call (calibrated)."""

    def __init__(self, pool, left_out=lambda: 0.0):
        self.seconds, self.calls, self.depth, self.left_out = 0.0, 0, 0, left_out
        self.by_method: dict[str, list] = {}  # name -> [seconds, calls], the timer's own cost not taken off
        for name in dir(type(pool)):
            f = getattr(pool, name, None)
            if not name.startswith("_") and callable(f) and not isinstance(f, type):
                setattr(pool, name, self._wrap(f, name))
        self.overhead = self._calibrate()

    def _wrap(self, f, name: str = ""):
        clock = time.perf_counter
        tally = self.by_method.setdefault(name, [0.0, 0])

        def timed(*args, **kwargs):
            if self.depth:
                return f(*args, **kwargs)
            self.depth = 1
            k0, t0 = self.left_out(), clock()
            try:
                return f(*args, **kwargs)
            finally:
                dt = clock() - t0 - (self.left_out() - k0)
                self.seconds += dt
                self.calls += 1
                tally[0] += dt
                tally[1] += 1
                self.depth = 0
        return timed

    def _calibrate(self, n: int = 20000) -> float:
        """The seconds one timed call adds to ``seconds`` around a function that does nothing."""
        timed = self._wrap(lambda: None, "")
        s0, c0 = self.seconds, self.calls
        for _ in range(n):
            timed()
        per = (self.seconds - s0) / n
        self.seconds, self.calls = s0, c0
        del self.by_method[""]
        return per

    def methods(self, steps: int) -> dict[str, tuple[float, float]]:
        """Per method: (us per step, the timer's own cost taken off; calls per step) over ``steps``."""
        return {k: ((sec - n * self.overhead) / steps * 1e6, n / steps)
                for k, (sec, n) in self.by_method.items() if n}

    def take(self) -> tuple[float, int]:
        """(seconds less the timer's own, calls) since the last take."""
        out = self.seconds - self.calls * self.overhead, self.calls
        self.seconds, self.calls = 0.0, 0
        return out


def _clocked(run, spent: list):
    """``run`` adding its ``time.perf_counter`` seconds to ``spent[0]`` and its calls to ``spent[1]``."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
    return timed


def pool_time_main(a) -> int:
    """``--pool-time`` (module docstring)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.flush_stub import stubbed_flush
    from gpupool.kernels import device_keys as k_keys
    print(f"host time inside the block pool's methods per scheduler step, us (wall clock, on a quiet machine; the "
          f"stub's time and the timer's own left out; {a.reps} repetitions x {a.steps} steps, interleaved; median (min-max) over the repetitions)")
    print(f"{'workload':<12} {'stock':>9} {'gpupool':>9} {'ratio median (min-max)':>24}  calls per step: stock gpupool")
    for name in a.workloads.split(","):
        wl = WORKLOADS[name]
        with stubbed_flush() as stub:
            loops = {"stock": SchedulerLoop("stock", wl, [0.0]),
                     "gpupool": SchedulerLoop("gpupool", wl, [0.0], lambda: stub.seconds)}
            if a.even_caches:
                loops["stock"].equal_kernel(cache=True)
            spent = [0.0, 0]  # the stub's seconds on the timer's clock, its launches
            for kernel in (stub, k_keys.device_keys_kernel):
                kernel.run = _clocked(kernel.run, spent)
            timers = {"stock": PoolTimer(loops["stock"].sched.kv_cache_manager.block_pool),
                      "gpupool": PoolTimer(loops["gpupool"].sched.kv_cache_manager.block_pool, lambda: spent[0])}
            per = {"stock": [], "gpupool": [], "ratio": []}
            calls = Counter()
            for _ in range(a.reps):
                gc.collect()
                gc.disable()
                try:
                    for k in range(a.steps):
                        for v in (("stock", "gpupool") if k % 2 == 0 else ("gpupool", "stock")):
                            loops[v].step_time()
                finally:
                    gc.enable()
                got = {v: t.take() for v, t in timers.items()}
                for v, (sec, n) in got.items():
                    per[v].append(sec / a.steps)
                    calls[v] += n
                per["ratio"].append(per["gpupool"][-1] / per["stock"][-1])
        r, lo, hi = _spread(per["ratio"])
        n = a.reps * a.steps
        print(f"{name:<12} {statistics.median(per['stock']) * 1e6:>9,.0f} {statistics.median(per['gpupool']) * 1e6:>9,.0f} "
              f"{r:>10.3f}x ({lo:.3f}-{hi:.3f})  {calls['stock'] / n:,.0f} {calls['gpupool'] / n:,.0f}", flush=True)
        if a.by_method:
            got = {v: t.methods(n) for v, t in timers.items()}
            for m in sorted(set(got["stock"]) | set(got["gpupool"]),
                            key=lambda m: -max(got["stock"].get(m, (0, 0))[0], got["gpupool"].get(m, (0, 0))[0])):
                (ts, cs), (tg, cg) = got["stock"].get(m, (0.0, 0)), got["gpupool"].get(m, (0.0, 0))
                print(f"  {m:<26} {ts:>9,.1f} {tg:>9,.1f} us/step   calls {cs:,.1f} {cg:,.1f}")
    return 0


def as_on_gpu(adapter) -> None:
    """A stubbed CPU pool takes a GPU pool's path: its launches key many cachings on the device
    (``gpupool.pool.DEVICE_KEYS_FROM``; the stub makes those keys, its time left out)."""
    from gpupool.pool import DEVICE_KEYS_FROM
    adapter._engine.backend.pool.device_keys_from = DEVICE_KEYS_FROM


def per_call_main(n_req: int, steps: int) -> int:
    """``--per-call`` (module docstring)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.flush_stub import stubbed_flush
    from gpupool.vllm.fast_path import DeferredBlockPool
    stock_pool = vllm_pool()
    if stock_pool is None:
        print("vLLM 0.33's source is not available (GPUPOOL_VLLM_SRC or the tests' cache): nothing to compare")
        return 1
    from vllm.v1.core.block_pool import BlockPool as VllmPool
    n = n_req * 48 + 4096
    pc = time.perf_counter
    with stubbed_flush() as stub:
        pools = {"stock": VllmPool(n, True, BS), "gpupool": DeferredBlockPool(n, True, BS, device="cpu")}
        pools["gpupool"].launch_every = 10 ** 9  # launched below, timed apart
        as_on_gpu(pools["gpupool"])
        ends = {"stock": lambda: None, "gpupool": pools["gpupool"].end_step}
        state = {k: warm(p, n_req, ends[k]) for k, p in pools.items()}
        per = {k: {"pop": [], "cache": []} for k in pools}
        launch = []
        gc.disable()
        try:
            for step in range(steps):
                for k in (("stock", "gpupool") if step % 2 else ("gpupool", "stock")):
                    p, reqs = pools[k], state[k][0]
                    for j in range(step % 16, len(reqs), 16):
                        q = reqs[j]
                        t0 = pc()
                        q[1] += p.get_new_blocks(1)
                        t1 = pc()
                        if q[2] + 1 < len(q[1]):
                            p.cache_full_blocks(q[0], q[1], q[2], q[2] + 1, BS, 0)
                            per[k]["cache"].append(pc() - t1)
                            q[2] += 1
                        per[k]["pop"].append(t1 - t0)
                if step % 4 == 3:
                    e, s0, t0 = pools["gpupool"]._engine, stub.seconds, time.process_time()
                    e.flush()
                    launch.append(time.process_time() - t0 - (stub.seconds - s0))
        finally:
            gc.enable()
    med = {k: {op: statistics.median(v) * 1e6 for op, v in d.items()} for k, d in per.items()}
    print(f"per call, us (median of {steps} steps, {n_req} requests, {len(range(0, n_req, 16))} crossing a block "
          f"each step): get_new_blocks(1) gpupool {med['gpupool']['pop']:.2f} / vLLM {med['stock']['pop']:.2f}; "
          f"cache_full_blocks of one block gpupool {med['gpupool']['cache']:.2f} / vLLM {med['stock']['cache']:.2f}")
    if launch:
        print(f"a launch's host side (4 steps' pops and cachings, the stub's time left out): median "
              f"{statistics.median(launch) * 1e6:,.0f} us, least {min(launch) * 1e6:,.0f} us")
        calls = {k: sum(statistics.median(v) * len(v) for v in per[k].values()) / steps * 1e6 for k in per}
        print(f"a step's pool host time, us (its calls at the medians, gpupool's with a quarter launch): "
              f"gpupool {calls['gpupool'] + statistics.median(launch) / 4 * 1e6:,.0f} / vLLM {calls['stock']:,.0f}")
    return 0


def interpreted_main(a) -> int:
    """``--device interpreted`` (module docstring)."""
    from gpupool.kernels import flush as k_flush
    launch, kernel = k_flush.launch_flush, [0.0]

    def timed(*args, **kw):  # the interpreted kernel's CPU time, left out of gpupool's figure
        t0 = time.process_time()
        try:
            return launch(*args, **kw)
        finally:
            kernel[0] += time.process_time() - t0
    k_flush.launch_flush = timed
    print(f"{'workload':<12} {'stock us/step':>14} {'gpupool us/step':>16} {'ratio':>7}   (CPU time, {a.reps} x "
          f"{a.steps} steps each, interleaved; stock runs an equal interpreted kernel as often: "
          f"{'yes' if a.equal_kernel else 'no'}; medians, the ratio's min-max)")
    for name in a.workloads.split(","):
        wl = WORKLOADS[name]
        loops = {v: SchedulerLoop(v, wl, kernel) for v in ("stock", "gpupool")}
        if a.equal_kernel:
            loops["stock"].equal_kernel()
        per = {v: [] for v in loops}
        for _ in range(a.reps):
            for v, lp in loops.items():
                per[v].append(lp.steps(a.steps) / a.steps)
        r, lo, hi = _spread([g / s for g, s in zip(per["gpupool"], per["stock"])])
        pool = loops["gpupool"].sched.kv_cache_manager.block_pool
        print(f"{name:<12} {statistics.median(per['stock']) * 1e6:>14,.0f} "
              f"{statistics.median(per['gpupool']) * 1e6:>16,.0f} {r:>6.2f}x ({lo:.2f}-{hi:.2f})   "
              f"({type(pool).__name__}, syncs {dict(pool.syncs)})", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (per repetition with --scheduler)")
    ap.add_argument("--scheduler", action="store_true", help="vLLM's scheduler loop, stock against gpupool")
    ap.add_argument("--per-call", action="store_true", help="a decode step's calls timed one by one (module docstring)")
    ap.add_argument("--pool-time", action="store_true",
                    help="vLLM's scheduler loop, the host time inside the block pool per step (module docstring)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--by-method", action="store_true", help="with --pool-time: each method's us per step, "
                    "mean over every repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("stub", "interpreted"), default="stub",
                    help="with --scheduler: the fast path's kernel as a stub, its GPU costs modelled (the "
                         "default), or run under Triton's interpreter (module docstring)")
    ap.add_argument("--sync-us", type=float, default=20.0,
                    help="with --device stub: host microseconds a GPU adds per device-to-host read (default 20)")
    ap.add_argument("--launch-us", type=float, default=30.0,
                    help="with --device stub: host microseconds of Triton's launcher per kernel launch (default 30)")
    ap.add_argument("--copy-us", type=float, default=10.0,
                    help="with --device stub: host microseconds per host-to-device copy (default 10)")
    ap.add_argument("--torch-op-us", type=float, default=10.0,
                    help="with --device stub: host microseconds per torch op on the pool's tensors, a kernel "
                         "launch on a GPU (default 10); their CPU time is left out")
    ap.add_argument("--no-equal-kernel", dest="equal_kernel", action="store_false",
                    help="with --device interpreted: stock runs no interpreted kernel per step (module docstring)")
    ap.add_argument("--launch-every", type=int, default=None,
                    help="the fast path's DeferredBlockPool.launch_every (default: its own, 4)")
    ap.add_argument("--even-caches", action="store_true",
                    help="with the stub: stock runs the stub too, on a pool of its own, untimed, as often as "
                         "gpupool launches (module docstring)")
    ap.add_argument("--launch-ops", type=int, default=None,
                    help="the fast path's DeferredBlockPool.launch_ops (default: its own, 1,024)")
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if min(a.sync_us, a.launch_us, a.copy_us, a.torch_op_us) < 0:
        ap.error("--sync-us, --launch-us, --copy-us and --torch-op-us must be >= 0")
    if a.launch_every is not None:
        from gpupool.vllm.fast_path import DeferredBlockPool
        if a.launch_every < 1:
            ap.error("--launch-every must be >= 1")
        DeferredBlockPool.launch_every = a.launch_every
    if a.launch_ops is not None:
        from gpupool.vllm.fast_path import DeferredBlockPool
        if a.launch_ops < 1:
            ap.error("--launch-ops must be >= 1")
        DeferredBlockPool.launch_ops = a.launch_ops
    if a.per_call:
        return per_call_main(a.requests, a.steps or 40)
    if a.scheduler or a.pool_time:
        a.steps = a.steps or 8
        return scheduler_main(a)
    a.steps = a.steps or 40
    from gpupool.kernels import flush as k_flush
    from gpupool.vllm.fast_path import DeferredBlockPool

    spent = [0.0, 0]
    k_flush.launch_flush = _clocked(k_flush.launch_flush, spent)
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
