"""Drives vLLM 0.33's AsyncScheduler and gpupool.vllm.GpuPoolScheduler through one request stream and
writes each step's decisions (a subprocess: ``python sched_driver.py OUT.json``; vLLM's source and the
plugin's stubs on sys.path; tests/vllm_plugin/test_vllm_scheduler.py reads the file).

The scheduler is built as vLLM's tests/v1/core/utils.py ``create_scheduler`` builds it (SchedulerConfig,
CacheConfig, one FullAttentionSpec group, StructuredOutputManager, ``scheduler_cls(...)``), except
the ModelConfig: vLLM's needs a Hugging Face config (``transformers``, stubbed here), so the VllmConfig
is built without one and given a stand-in with the nine attributes the scheduler reads
(``MODEL_CONFIG``).

A mode ending in ``_ev`` (and ``stock_ev``, run when one does) turns on KV events (vLLM's null
publisher, its ``publish`` recorded: each batch's events as msgpack bytes) and the KV cache metrics
collector (sample rate 1, its calls recorded) and records them per step.
"""
import json
import os
import random
import sys
import time
import types
from collections import Counter, deque

sys.path.insert(0, os.path.dirname(__file__))
import plugin  # noqa: E402,F401 - vLLM's source and the stubs

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVEventsConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig, VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16
MODEL_CONFIG = dict(uses_mrope=False, is_encoder_decoder=False, runner_type="generate", is_diffusion=False,
                    supports_multimodal_inputs=False, return_sampling_mask=False, skip_tokenizer_init=True,
                    multimodal_config=None)


def make_scheduler(cls, num_blocks, max_model_len=1024, max_num_batched_tokens=192, max_num_seqs=6,
                   async_scheduling=True, observed=False, sliding_window=None, sliding_groups=1):
    """vLLM's scheduler ``cls`` over ``num_blocks`` blocks: one full-attention KV cache group, or with
    ``sliding_window`` (tokens) a Gemma 3-style hybrid, ``sliding_groups`` sliding-window groups (0, 1, ...)
    then a full-attention group, vLLM's order for such a model (so vLLM builds its
    HybridKVCacheCoordinator; groups of one spec are looked up together)."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, enable_chunked_prefill=True, async_scheduling=async_scheduling,
                         is_encoder_decoder=False, watermark=0.0, policy="fcfs")
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    extra = dict(kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
                 observability_config=ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
                 ) if observed else {}
    vc = VllmConfig(scheduler_config=sc, cache_config=cc, parallel_config=ParallelConfig(),
                    device_config=DeviceConfig(device="cpu"), **extra)
    mc = types.SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: 50272, **MODEL_CONFIG)
    object.__setattr__(vc, "model_config", mc)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer"], spec)]
    if sliding_window:
        swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                sliding_window=sliding_window)
        groups = [KVCacheGroupSpec([f"swa{i}"], swa) for i in range(sliding_groups)] + [KVCacheGroupSpec(["full"], spec)]
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cc.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vc)
    sched = cls(vllm_config=vc, kv_cache_config=kcc, block_size=BLOCK, log_stats=True,
                structured_output_manager=StructuredOutputManager(vc))
    if observed:
        record(sched)
    return sched


def record(sched):
    """Record the scheduler's published KV events (msgpack bytes, hex) and its metrics collector's
    calls (hook, block id) in ``sched.observed``, taken per step by :func:`run`."""
    import msgspec

    log = sched.observed = []
    sched.kv_event_publisher.publish = lambda batch: log.extend(
        ["event", msgspec.msgpack.encode(e).hex()] for e in batch.events)
    mc = sched.kv_metrics_collector
    assert mc is not None and sched.kv_cache_manager.block_pool.metrics_collector is mc
    for hook in ("on_block_allocated", "on_block_accessed", "on_block_evicted"):
        def f(block, _h=hook, _o=getattr(mc, hook)):
            log.append([_h, block.block_id])
            return _o(block)
        setattr(mc, hook, f)


def make_stream(seed, n, decode_heavy=False):
    """(arrival step, request id, prompt, max_tokens, abort step or None): prompts from 3 shared
    prefixes (2-4 blocks) plus a private tail. ``decode_heavy``: all arrive in the first 2 steps, no
    aborts, 40-70 tokens out each (most steps are decode steps of every running request)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(2, 4))] for _ in range(3)]
    out = []
    for i in range(n):
        p = list(prefixes[rng.randrange(3)])[: rng.choice([BLOCK, 2 * BLOCK, 10 ** 6])]
        p += [rng.randrange(1, 30000) for _ in range(rng.randint(1, 40))]
        abort = rng.randint(2, 10) if rng.random() < 0.2 else None
        if decode_heavy:
            out.append((rng.randint(0, 1), f"r{i}", p, rng.randint(40, 70), None))
        else:
            out.append((rng.randint(0, 12), f"r{i}", p, rng.randint(3, 14), abort))
    return out


class D2HCounter:
    """Counts device-to-host reads made outside Triton and torch while ``on``: every way a tensor's
    values reach Python (``tolist``, ``item``, ``cpu``, ``numpy``, ``int()`` / ``float()`` / ``bool()``
    / index use) is patched on ``torch.Tensor``, so the adapter cannot read the device uncounted.
    Triton's interpreter and torch read tensors themselves (kernel arguments); those frames are not
    the adapter's and are skipped. On a GPU each counted call is one synchronising transfer."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        self.on = False
        self.n = 0
        self.where = Counter()
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(orig, name))

    def _wrap(self, orig, name):
        counter = self

        def f(t, *a, **k):
            if counter.on:
                mod = sys._getframe(1).f_globals.get("__name__", "")
                if not (mod.startswith("triton") or mod.startswith("torch")):
                    counter.n += 1
                    counter.where[f"{mod}:{sys._getframe(1).f_code.co_name}:{name}"] += 1
            return orig(t, *a, **k)
        return f


# the device pool's reads (its read API for the host mirror), not ops
READS = ("get_num_free_blocks", "mirror_rows", "free_window", "counters", "key_name", "host_tensor",
         "sweep_key_names")


class Counting:
    """Forwards to gpupool's device pool, counting each op by name (reads left out)."""

    def __init__(self, dev, counts):
        self._d, self._c = dev, counts

    def __getattr__(self, n):
        v = getattr(self._d, n)
        if callable(v) and not n.startswith("_") and n not in READS:
            def f(*a, **k):
                self._c[n] += 1
                return v(*a, **k)
            return f
        return v


def run(sched, stream, counts=None, d2h=None):
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    # an arrival step, or ("after", parent id, delay): the conversation's next turn, arriving ``delay``
    # steps after its parent is seen finished, its prompt the parent's tokens (prompt and output) + its own
    pending = sorted(s for s in stream if type(s[0]) is int)
    turns = [s for s in stream if type(s[0]) is not int]
    finished_at = {}
    reqs = {}
    steps = []
    queue: deque = deque()
    step = 0
    while step < 200:
        if counts is not None:
            counts.clear()
        pool = sched.kv_cache_manager.block_pool
        syncs0 = Counter(getattr(pool, "syncs", {}))
        flushes0 = getattr(pool, "flushes", 0)
        if d2h is not None:  # the step: arrivals, aborts, schedule(), update_from_output()
            d2h.on, n0 = True, d2h.n
        for (_, parent, delay), rid, tail, mt, abort in list(turns):
            if parent in reqs and reqs[parent][0].is_finished():
                finished_at.setdefault(parent, step)
                if step >= finished_at[parent] + delay:
                    turns.remove(((_, parent, delay), rid, tail, mt, abort))
                    pending.append((step, rid, list(reqs[parent][0].all_token_ids) + tail, mt, abort))
        for arr, rid, prompt, mt, abort in [s for s in pending if s[0] <= step]:
            pending.remove((arr, rid, prompt, mt, abort))
            sp = SamplingParams(max_tokens=mt, ignore_eos=True)
            sp.update_from_generation_config({}, 50256)
            r = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                        block_hasher=hasher)
            reqs[rid] = (r, abort)
            sched.add_request(r)
        for rid, (r, abort) in reqs.items():
            if abort == step and not r.is_finished():
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        rec = {"step": step,
               "new": [(n.req_id, [list(b) for b in n.block_ids], n.num_computed_tokens) for n in out.scheduled_new_reqs],
               "cached": [(rid, rid in out.scheduled_cached_reqs.resumed_req_ids,
                           None if nb is None else [list(b) for b in nb], nc)
                          for rid, nb, nc in zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_block_ids,
                                                 out.scheduled_cached_reqs.num_computed_tokens)],
               "num_scheduled_tokens": sorted(out.num_scheduled_tokens.items()),
               "preempted": sorted(out.preempted_req_ids or ()), "finished": sorted(out.finished_req_ids)}
        if out.num_scheduled_tokens:
            queue.append(out)
        # async: one batch in flight, as vLLM's test_async_scheduler.py drives it
        if len(queue) > 1 or (queue and not out.num_scheduled_tokens):
            prev = queue.popleft()
            ids = list(prev.num_scheduled_tokens)
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[1000 + (sum(map(ord, r)) % 7) + step] for r in ids], logprobs=None,
                                    prompt_logprobs_dict={}, pooler_output=[])
            eco = sched.update_from_output(prev, mro)
            hits = []
            for o in eco.values():
                st_ = o.scheduler_stats
                if st_ is not None and st_.prefix_cache_stats is not None:
                    pcs = st_.prefix_cache_stats
                    hits.append((pcs.requests, pcs.queries, pcs.hits, pcs.preempted_requests, pcs.preempted_hits))
            rec["prefix_cache_stats"] = hits
            rec["outputs"] = sorted((o_.request_id, list(o_.new_token_ids)) for o in eco.values() for o_ in o.outputs)
        if d2h is not None:
            d2h.on = False
        rec["num_free_blocks"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        if hasattr(sched, "observed"):
            rec["observed"], sched.observed[:] = list(sched.observed), []
        if counts is not None:
            rec["gpupool_ops"] = dict(counts)
            rec["gpupool_ops"]["syncs"] = dict(Counter(getattr(pool, "syncs", {})) - syncs0)
            rec["gpupool_ops"]["flushes"] = getattr(pool, "flushes", 0) - flushes0
            if d2h is not None:
                rec["gpupool_ops"]["d2h"] = d2h.n - n0
        steps.append(rec)
        step += 1
        if not pending and not turns and not queue and sched.get_num_unfinished_requests() == 0:
            break
    return steps


def old_pool_holders(num_blocks):
    """After install_gpupool_block_pool on a stock scheduler, what still refers to vLLM's old pool or
    its null block (besides this frame): type names, expected empty."""
    import gc
    from gpupool.vllm import install_gpupool_block_pool
    s = make_scheduler(AsyncScheduler, num_blocks)
    old = s.kv_cache_manager.block_pool
    old_null = old.null_block
    install_gpupool_block_pool(s, backend="reference")
    gc.collect()
    out = []
    blocks = old.blocks
    queue = old.free_block_queue
    inside = set()  # plain loops: a comprehension would hold old / old_null in a closure cell
    for b in blocks:
        inside.add(id(b))
        if hasattr(b, "__dict__"):
            inside.add(id(b.__dict__))
    for o in (blocks, old.__dict__, queue, getattr(queue, "__dict__", None)):
        inside.add(id(o))
    for name in ("old", "old_null"):
        target = old if name == "old" else old_null
        for r in gc.get_referrers(target):
            if isinstance(r, types.FrameType) or id(r) in inside:
                continue
            keys = []
            if isinstance(r, dict):
                for k in r:
                    if r[k] is target:
                        keys.append(k)
            out.append(f"{name} <- {type(r).__name__} {keys}")
    return out


def refuse_after_first_request(num_blocks, stream):
    """install_gpupool_block_pool on a scheduler that already holds blocks raises InvalidArgumentError
    and leaves vLLM's pool in place: (error class, pool unchanged)."""
    from gpupool.errors import InvalidArgumentError
    from gpupool.vllm import install_gpupool_block_pool
    init_none_hash(sha256)
    s = make_scheduler(AsyncScheduler, num_blocks)
    old = s.kv_cache_manager.block_pool
    _, rid, prompt, mt, _ = stream[0]
    sp = SamplingParams(max_tokens=mt, ignore_eos=True)
    sp.update_from_generation_config({}, 50256)
    s.add_request(Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                          block_hasher=get_request_block_hasher(BLOCK, sha256)))
    s.schedule()
    try:
        install_gpupool_block_pool(s, backend="reference")
        err = None
    except InvalidArgumentError as e:
        err = type(e).__name__
    mgrs = s.kv_cache_manager.coordinator.single_type_managers
    same = (s.kv_cache_manager.block_pool is old and s.kv_cache_manager.coordinator.block_pool is old
            and all(m.block_pool is old for m in mgrs))
    return [err, same]


def main():
    from gpupool.vllm import GpuPoolScheduler
    out_path = sys.argv[1]
    stream = make_stream(int(os.environ.get("SEED", "0")), int(os.environ.get("NREQ", "14")))
    num_blocks = int(os.environ.get("NUM_BLOCKS", "24"))
    res = {}
    t = time.perf_counter()
    res["stock"] = run(make_scheduler(AsyncScheduler, num_blocks), stream)
    res["stock_s"] = time.perf_counter() - t
    d2h = D2HCounter()
    runs = [(mode, stream, num_blocks) for mode in os.environ.get("BACKENDS", "reference,device").split(",")]
    observed_any = any(m.endswith("_ev") for m, _, _ in runs)
    if observed_any:
        res["stock_ev"] = run(make_scheduler(AsyncScheduler, num_blocks, observed=True), stream)
    if os.environ.get("DECODE_HEAVY"):  # (requests, blocks): device fast path and stock on it
        nreq, nblk = map(int, os.environ["DECODE_HEAVY"].split(","))
        heavy = make_stream(1, nreq, decode_heavy=True)
        t = time.perf_counter()
        res["heavy_stock"] = run(make_scheduler(AsyncScheduler, nblk), heavy)
        res["heavy_stock_s"] = time.perf_counter() - t
        runs.append(("heavy_device", heavy, nblk))
        if observed_any:
            res["heavy_stock_ev"] = run(make_scheduler(AsyncScheduler, nblk, observed=True), heavy)
            runs.append(("heavy_device_ev", heavy, nblk))
    from gpupool.vllm import fast_path
    default_window = fast_path.FREE_WINDOW
    for mode, stream_, nblk in runs:
        backend = "reference" if mode.startswith("reference") else "device"
        fast = not mode.endswith("percall")
        observed = mode.endswith("_ev")
        # "_w<W>": the host's copy of the free queue only W ring slots long (refills, placeholders)
        fast_path.FREE_WINDOW = int(mode.rsplit("_w", 1)[1]) if "_w" in mode else default_window
        os.environ["GPUPOOL_VLLM_BACKEND"] = backend
        os.environ["GPUPOOL_VLLM_FAST_PATH"] = "1" if fast else "0"
        counts = Counter()
        s = make_scheduler(GpuPoolScheduler, nblk, observed=observed)
        pool = s.kv_cache_manager.block_pool
        want = "DeferredBlockPool" if fast else "BlockPool"
        assert type(pool).__name__ == want and pool.backend == backend, (type(pool), mode)
        held = [s.kv_cache_manager.coordinator.block_pool] + [m.block_pool for m in s.kv_cache_manager.coordinator.single_type_managers]
        assert all(p is pool for p in held)
        assert all(m._null_block is pool.null_block for m in s.kv_cache_manager.coordinator.single_type_managers)
        if backend == "device":  # the device pool's own calls to check(): one device wait + 2 reads each
            dev, dev_check = pool._dev, pool._dev.check

            def check(_c=dev_check):
                counts["device_check"] += 1
                return _c()
            dev.check = check
        engine = pool._engine
        engine.backend.pool = Counting(pool._dev, counts)
        orig = engine.refresh

        def refresh(ids, _o=orig):
            counts["mirror_refresh"] += 1
            return _o(ids)
        engine.refresh = refresh
        t = time.perf_counter()
        res[mode] = run(s, stream_, counts, d2h if backend == "device" else None)
        res[mode + "_s"] = time.perf_counter() - t
    res["d2h_where"] = dict(d2h.where)
    res["is_async"] = issubclass(GpuPoolScheduler, AsyncScheduler)
    from gpupool.vllm import GpuPoolSyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    sync = make_scheduler(GpuPoolSyncScheduler, num_blocks)
    res["sync"] = [not isinstance(sync, AsyncScheduler) and isinstance(sync, Scheduler),
                   type(sync.kv_cache_manager.block_pool).__module__]
    # GpuPoolScheduler where async scheduling is off: vLLM's choice there is its synchronous Scheduler
    off = make_scheduler(GpuPoolScheduler, num_blocks, async_scheduling=False)
    res["async_off"] = [type(off).__name__, type(off.kv_cache_manager.block_pool).__name__,
                        off.kv_cache_manager.block_pool is off.gpupool_block_pool]
    res["holders"] = old_pool_holders(num_blocks)
    res["refused"] = refuse_after_first_request(num_blocks, stream)
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
