"""Drive any pool with vLLM 0.33's ``BlockPool`` interface (vLLM's own or ``gpupool.vllm.BlockPool``)
through an abstract op list and record what vLLM's callers can observe after every op
(tests/vllm_plugin/test_vllm_block_pool.py). Imports nothing of gpupool or vLLM, so a subprocess with vLLM on its
path can replay the same list on vLLM's pool.

Ops (tuples of ints, so hypothesis can draw them and json can carry them):
  ("alloc", n, seed, c)   get_new_blocks(n) if n are free: a new request whose tokens come from seed;
                          then, with c > 0, cache_full_blocks of its first min(c, n) blocks
  ("cache", r, upto)      cache_full_blocks of request r up to min(upto, its full blocks)
  ("free", r)             free_blocks(reversed(request r's blocks)); the request ends
  ("hit", seed)           longest prefix hit of seed's chain by get_cached_block, touch it: a new request
  ("evict", a, b)         evict_blocks({a % N, b % N})
  ("reset",)              reset_prefix_cache()
  ("cow", r)              ref_cnt += 1 on request r's first held block, as vLLM's copy-on-write does
                          (released again with one extra free_blocks of it when r is freed)
"""
from __future__ import annotations

import hashlib
import types

BLOCK_SIZE = 4
MAX_BLOCKS = 6


def tokens_of(seed: int) -> list[int]:
    """A request's tokens: few distinct values, so requests share prefixes."""
    return [(seed >> (2 * i)) & 1 for i in range(BLOCK_SIZE * MAX_BLOCKS)]


def chain(tokens: list[int]) -> list[bytes]:
    """Block hashes of full blocks, each over the whole prefix (as vLLM's chain)."""
    out, parent = [], b"root"
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = hashlib.sha256(parent + bytes(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])).digest()
        out.append(parent)
    return out


def request(tokens):
    return types.SimpleNamespace(block_hashes=chain(tokens), all_token_ids=list(tokens), lora_request=None,
                                 session_id=None, mm_features=[], request_id="r", cache_salt=None,
                                 prompt_embeds=None)


class MetricsLog:
    """A ``KVCacheMetricsCollector`` that records its calls: ``(hook, block id)``, ``("reset",)``."""

    def __init__(self):
        self.calls: list = []

    def on_block_allocated(self, block):
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block):
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block):
        self.calls.append(("evicted", block.block_id))

    def reset(self):
        self.calls.append(("reset",))

    def take(self) -> list:
        out, self.calls = self.calls, []
        return [list(c) for c in out]


def encode(e) -> str:
    """The event's msgpack bytes (hex) as vLLM's publisher encodes it."""
    import msgspec

    return msgspec.msgpack.encode(e).hex()


def _event(e) -> list:
    name = type(e).__name__
    if name == "BlockStored":
        return [name, list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.group_idx,
                e.medium]
    if name == "BlockRemoved":
        return [name, list(e.block_hashes), e.group_idx, e.medium]
    return [name]


def snapshot(pool, wire: bool = False) -> dict:
    """What vLLM's callers read: per-block fields, the free queue, the prefix cache, the free count,
    the events (``wire``: their msgpack bytes too) and a :class:`MetricsLog`'s calls."""
    events = pool.take_events()
    cache = {}
    for k, v in pool.cached_block_hash_to_block._cache.items():
        cache[k.hex()] = [v.block_id] if hasattr(v, "block_id") else list(v)
    return {
        "ref_cnt": [b.ref_cnt for b in pool.blocks[1:]],
        "block_hash": [None if b.block_hash is None else b.block_hash.hex() for b in pool.blocks],
        "ntok": [b.block_hash_num_tokens for b in pool.blocks],
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num_free": pool.get_num_free_blocks(),
        "usage": round(pool.get_usage(), 9),
        "cache": cache,
        "events": [_event(e) for e in events],
        **({"wire": [encode(e) for e in events]} if wire else {}),
        **_metrics(pool),
    }


def _metrics(pool) -> dict:
    mc = getattr(pool, "metrics_collector", None)
    return {"metrics": mc.take()} if isinstance(mc, MetricsLog) else {}


def run(pool, ops, after=None, wire: bool = False) -> list:
    """Apply ``ops`` to ``pool``; one snapshot (plus the op's result) per op; ``after(pool)`` after each.
    ``wire``: the snapshot's events as their msgpack bytes (hex) too."""
    reqs: list[dict] = []
    trace = []
    n = pool.num_gpu_blocks
    for op in ops:
        try:
            result = _apply(pool, op, reqs, n)
        except Exception as e:  # noqa: BLE001 - recorded; vLLM may leave partial state, so the run ends
            trace.append({"op": list(op), "error": [isinstance(e, AssertionError), isinstance(e, ValueError)]})
            break
        trace.append({"op": list(op), "result": result, **snapshot(pool, wire)})
        if after is not None:
            after(pool)
    return trace


def _apply(pool, op, reqs, n, ids=True):
    """One op (module doc); its result (ids of the blocks handed out, or with ``ids=False`` the blocks
    themselves, unread; reset's bool) or None."""
    kind, result = op[0], None
    if kind == "alloc":
        if op[1] <= pool.get_num_free_blocks():
            toks = tokens_of(op[2])
            blocks = pool.get_new_blocks(op[1])
            r = {"req": request(toks[: op[1] * BLOCK_SIZE]), "blocks": blocks, "cached": 0, "extra": []}
            reqs.append(r)
            result = [b.block_id for b in blocks] if ids else blocks
            if len(op) > 3 and op[3] > 0 and pool.enable_caching:
                r["cached"] = min(op[3], op[1])
                pool.cache_full_blocks(r["req"], blocks, 0, r["cached"], BLOCK_SIZE, 0)
    elif kind == "cache" and reqs and pool.enable_caching:  # vLLM's callers cache only with caching on
        r = reqs[op[1] % len(reqs)]
        full = min(op[2], len(r["blocks"]))
        pool.cache_full_blocks(r["req"], r["blocks"], r["cached"], full, BLOCK_SIZE, 0)
        r["cached"] = max(r["cached"], full)
    elif kind == "free" and reqs:
        r = reqs.pop(op[1] % len(reqs))
        pool.free_blocks(list(reversed(r["blocks"])) + r["extra"])
    elif kind == "hit":
        toks = tokens_of(op[1])
        hit = []
        for hh in chain(toks):
            got = pool.get_cached_block(hh, [0])
            if got is None:
                break
            hit.append(got[0])
        pool.touch(hit)
        reqs.append({"req": request(toks[: len(hit) * BLOCK_SIZE]), "blocks": hit, "cached": len(hit),
                     "extra": []})
        result = [b.block_id for b in hit] if ids else hit
    elif kind == "evict":
        pool.evict_blocks({op[1] % n, op[2] % n})
    elif kind == "reset":
        result = pool.reset_prefix_cache()
    elif kind == "cow" and reqs:
        r = reqs[op[1] % len(reqs)]
        if r["blocks"]:
            b = r["blocks"][0]
            b.ref_cnt += 1
            r["extra"].append(b)
    return result


def main():  # a subprocess: python driver.py OPS.json OUT.json (vLLM's pool; plugin on sys.path)
    import json
    import sys

    import plugin  # noqa: F401 - vLLM's source and the stubs
    from vllm.v1.core.block_pool import BlockPool

    cases = json.load(open(sys.argv[1]))
    out = []
    for c in cases:
        pool = BlockPool(c["num_blocks"], c["caching"], BLOCK_SIZE, enable_kv_cache_events=True,
                         metrics_collector=MetricsLog() if c.get("metrics") else None)
        out.append(run(pool, [tuple(o) for o in c["ops"]], wire=c.get("wire", False)))
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
