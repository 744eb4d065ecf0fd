"""Offline generation in one process with the engine core in-process, recording every scheduler step
(tests/vllm_plugin/test_vllm_live.py): ``python offline.py MODEL_DIR MODES OUT_JSON [NUM_BLOCKS]`` with MODES
comma-separated, each ``stock`` (vLLM's ``Scheduler``) or ``reference`` / ``device``
(``gpupool.vllm.GpuPoolSyncScheduler`` over that backend; the CPU platform turns async scheduling off),
and NUM_BLOCKS the pool's size (default 10).

Recorded per step: each new request's block ids (per KV cache group) and computed (prefix-hit) tokens,
each running request's new block ids and whether it resumed, the preempted and finished requests and
the scheduled tokens, and the KV events the scheduler published (KV events on, vLLM's null publisher;
``ts`` left out); at the end the generated token ids and text, the prefix-hit tokens of each request,
the pool's class, its free count and the KV cache groups' spec classes. Also written, under
``"drift"``: :func:`gpupool.vllm.compat.drift` on this vLLM. Request ids are replaced
by their order of first appearance (vLLM adds a random suffix to them).
"""
import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # gpupool's kernels on the CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model: never ask a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BLOCK_SIZE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
PREFIX = "The quick brown fox jumps over the lazy dog; a tiny model says: "  # 64 bytes = 2 blocks
PROMPTS = [PREFIX + s for s in ("one two three", "four five", "six seven eight nine", "ten")] + \
          ["An unrelated prompt that shares no block with the others at all.",
           PREFIX + PREFIX + "twice"]
ENGINE = dict(dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=True, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=96, enable_chunked_prefill=True, enforce_eager=True, seed=0)


def scheduler_cls(mode: str):
    if mode == "stock":
        return None
    os.environ["GPUPOOL_VLLM_BACKEND"] = mode
    os.environ["GPUPOOL_VLLM_DEVICE"] = "cpu"
    return "gpupool.vllm.GpuPoolSyncScheduler"


class Recorder:
    """Wraps ``scheduler.schedule`` and records each ``SchedulerOutput`` (ids by first appearance), and
    the scheduler's KV event publisher: each published batch's events, under the step that made them."""

    def __init__(self, scheduler):
        import msgspec

        self.steps, self.ids = [], {}
        inner = scheduler.schedule

        def schedule(*a, **k):
            out = inner(*a, **k)
            self.steps.append(self.record(out))
            return out

        def publish(batch):
            self.steps[-1]["events"] += [json.loads(msgspec.json.encode(e)) | {"type": type(e).__name__}
                                         for e in batch.events]

        scheduler.schedule = schedule
        scheduler.kv_event_publisher.publish = publish

    def rid(self, r: str) -> int:
        return self.ids.setdefault(r, len(self.ids))

    def record(self, out) -> dict:
        c = out.scheduled_cached_reqs
        return {
            "new": [[self.rid(n.req_id), [list(g) for g in n.block_ids], n.num_computed_tokens]
                    for n in out.scheduled_new_reqs],
            "cached": [[self.rid(r), None if b is None else [list(g) for g in b], r in c.resumed_req_ids]
                       for r, b in zip(c.req_ids, c.new_block_ids)],
            "tokens": sorted([self.rid(r), n] for r, n in out.num_scheduled_tokens.items()),
            "preempted": sorted(self.rid(r) for r in (out.preempted_req_ids or ())),
            "finished": sorted(self.rid(r) for r in out.finished_req_ids),
            "events": [],
        }


def run(model: str, mode: str, num_blocks: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    t0 = time.perf_counter()
    cls = scheduler_cls(mode)
    llm = LLM(model=model, tokenizer=model, **ENGINE, num_gpu_blocks_override=num_blocks,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
              **({"scheduler_cls": cls} if cls else {}))
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    rec = Recorder(sched)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = []
    for _ in range(2):  # the second round hits the blocks the first cached (those not evicted)
        for o in llm.generate(PROMPTS, params, use_tqdm=False):
            outputs.append({"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
                            "prompt_tokens": len(o.prompt_token_ids), "cached_tokens": o.num_cached_tokens})
    pool = sched.kv_cache_manager.block_pool
    result = {"mode": mode, "scheduler": type(sched).__name__, "pool": type(pool).__name__,
              "outputs": outputs, "steps": rec.steps, "free_blocks": pool.get_num_free_blocks(),
              "num_gpu_blocks": pool.num_gpu_blocks, "seconds": round(time.perf_counter() - t0, 1),
              "groups": [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]}
    del llm, core, sched, pool, rec
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
    return result


def main(model: str, modes: str, out_path: str, num_blocks: str = "10") -> None:
    results = {m: run(model, m, int(num_blocks)) for m in modes.split(",")}
    from gpupool.vllm.compat import drift
    results["drift"] = drift()  # this vLLM is imported already: its drift report (tests/vllm_plugin/test_vllm_drift.py)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
