"""Op generators of the vLLM adapter's differential tests (hypothesis strategies over
tests/vllm_plugin/conformance/driver.py's ops) and the runner of the fast path's batch-order mix."""
import json
import os
import subprocess
import sys

import torch
from hypothesis import strategies as st

from .paths import CONFORMANCE
from .timeouts import scaled

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402

N = 10

# conformance/driver.py's op lists (vLLM's pool and the adapter replay the same list)
DRIVER_OPS = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("cache"), st.integers(0, 7), st.integers(0, 6)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("hit"), st.integers(0, 3)),
    st.tuples(st.just("evict"), st.integers(0, N - 1), st.integers(0, N - 1)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("cow"), st.integers(0, 7)),
)

BS = driver.BLOCK_SIZE
R = st.integers(0, 7)  # a request, modulo the live ones
SEED = st.integers(0, 3)  # a request's tokens (driver.tokens_of): few seeds, so hits are frequent
ALLOC = st.tuples(st.just("alloc"), st.integers(1, 3), SEED, st.integers(0, 3))  # get_new_blocks, cache c of them
FREE = st.tuples(st.just("free"), R)  # the request ends
DECODE = st.tuples(st.just("decode"), R)  # one block popped, the one the request filled cached
IDS = st.tuples(st.just("ids"), R)  # block_id, ref_cnt, block_hash of a request's blocks: a synchronisation
BATCH_OPS = st.one_of(  # pops, frees and id reads weighted up: a read between batches gives known un-keyed ids
    ALLOC, ALLOC, ALLOC, FREE, FREE, IDS, IDS,
    st.tuples(st.just("cache"), R, st.integers(1, 3)),  # cache_full_blocks of the next blocks
    st.tuples(st.just("free1"), R, st.integers(0, 3)),  # one block freed, the null block in its place
    st.tuples(st.just("hit"), SEED),  # prefix hit, touch: a new request
    st.tuples(st.just("hitfree"), SEED),  # prefix hit, touch, freed at once
    st.tuples(st.just("share"), R),  # touch of a request's held blocks: a new request sharing them
    st.tuples(st.just("cow"), R),  # ref_cnt += 1 of a request's first block
    st.tuples(st.just("refs"), R),  # ref_cnt, block_hash only
    st.tuples(st.just("evict"), st.integers(0, 40), st.integers(0, 40)),
)


def prefix_hit(pool, seed):
    """The cached blocks of the token chain of ``seed``, up to the first miss (group 0)."""
    hit = []
    for hh in driver.chain(driver.tokens_of(seed)):
        got = pool.get_cached_block(hh, [0])
        if got is None:
            break
        hit.append(got[0])
    return hit


def apply_op(pool, op, reqs, seen):
    """One op (OPS' comments); what it reads goes to ``seen`` (blocks handed out as lists of blocks)."""
    kind, n = op[0], pool.num_gpu_blocks
    r = (reqs[op[1] % len(reqs)] if reqs and kind in ("cache", "decode", "free1", "share", "cow", "ids", "refs")
         else None)
    if kind == "alloc" and op[1] <= pool.get_num_free_blocks():
        blocks = pool.get_new_blocks(op[1])
        r = {"req": driver.request(driver.tokens_of(op[2])[: op[1] * BS]), "blocks": blocks, "cached": 0,
             "extra": [], "seed": op[2]}
        reqs.append(r)
        seen.append(blocks)
        if op[3] > 0:
            r["cached"] = min(op[3], op[1])
            pool.cache_full_blocks(r["req"], blocks, 0, r["cached"], BS, 0)
    elif kind == "decode" and r is not None and "seed" in r and 1 <= pool.get_num_free_blocks():
        # a decode step crossing into a new block: one block popped, the block the request filled cached
        r["blocks"] += pool.get_new_blocks(1)
        seen.append(r["blocks"][-1:])
        full = min(len(r["blocks"]) - 1, driver.MAX_BLOCKS)
        r["req"].block_hashes = driver.chain(driver.tokens_of(r["seed"])[: full * BS])
        if r["cached"] < full and not any(b.is_null for b in r["blocks"][r["cached"]:full]):
            pool.cache_full_blocks(r["req"], r["blocks"], r["cached"], full, BS, 0)
            r["cached"] = full
    elif kind == "cache" and r is not None:
        full = min(r["cached"] + op[2], len(r["blocks"]), len(r["req"].block_hashes))
        if full > r["cached"] and not any(b.is_null for b in r["blocks"][r["cached"]:full]):
            pool.cache_full_blocks(r["req"], r["blocks"], r["cached"], full, BS, 0)
            r["cached"] = full
    elif kind == "free" and reqs:
        r = reqs.pop(op[1] % len(reqs))
        pool.free_blocks(list(reversed(r["blocks"])) + r["extra"])
    elif kind == "free1" and r is not None and r["blocks"]:
        j = op[2] % len(r["blocks"])
        b = r["blocks"][j]
        if not b.is_null and b not in r["extra"]:
            pool.free_blocks([b])
            r["blocks"][j] = pool.null_block
    elif kind in ("hit", "hitfree"):
        hit = prefix_hit(pool, op[1])
        seen.append([(b.ref_cnt, b.block_hash) for b in hit])  # vLLM's evictable count reads these
        pool.touch(hit)
        seen.append(hit)
        if kind == "hitfree":
            pool.free_blocks(list(reversed(hit)))
        else:
            reqs.append({"req": driver.request(driver.tokens_of(op[1])[: len(hit) * BS]), "blocks": hit,
                         "cached": len(hit), "extra": [], "seed": op[1]})
    elif kind == "share" and r is not None:
        held = [b for b in r["blocks"] if not b.is_null]
        pool.touch(held)
        r.pop("seed", None)  # no decode of shared blocks: the sharer would cache them again
        # the sharer caches none of them (its owner may): a block is cached once, as in vLLM
        reqs.append({"req": r["req"], "blocks": list(r["blocks"]), "cached": len(r["blocks"]), "extra": []})
    elif kind == "cow" and r is not None:
        held = [b for b in r["blocks"] if not b.is_null]
        if held:
            held[0].ref_cnt += 1
            r["extra"].append(held[0])
    elif kind == "ids" and r is not None:
        seen.append([(b.block_id, b.ref_cnt, b.block_hash) for b in r["blocks"]])
    elif kind == "refs" and r is not None:
        seen.append([(b.ref_cnt, b.block_hash) for b in r["blocks"]])
    elif kind == "evict":
        pool.evict_blocks({op[1] % n, op[2] % n})
    seen.append(pool.get_num_free_blocks())


def run_ops(pool, ops):
    reqs, seen = [], []
    for op in ops:
        apply_op(pool, op, reqs, seen)
    # the ids of the blocks handed out, read at the end (as vLLM builds its SchedulerOutput)
    return [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s
            for s in seen]


def run_stepped(pool, ops) -> list:
    """:func:`run_ops` of a fast path's pool with its own ops too: ``("end_step",)`` and ``("sync",)``;
    then an ``end_step`` and a synchronisation that refills the host's copy of the free queue."""
    reqs, seen = [], []
    for op in ops:
        if op[0] == "end_step":
            pool.end_step()
        elif op[0] == "sync":
            pool.sync()
        else:
            apply_op(pool, op, reqs, seen)
    out = [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s for s in seen]
    pool.end_step()
    pool.sync("test", window=True)
    return out


def whole_state(pool) -> dict:
    """A fast path's whole observable state: the device pool's, its key insertion counter, vLLM's view,
    the mirror, the synchronisations and launches, the host's copy of the free queue."""
    from harness.state import pool_state
    dev = pool._dev
    return {"device": pool_state(dev), "key_seq": int(dev.counters()[2]), "view": driver.snapshot(pool),
            "mirror": (pool._ref, pool._keys, pool._ntok, pool.mirror.holders), "syncs": dict(pool.syncs),
            "flushes": pool.flushes, "window": pool.queue_copy.ids and list(pool.queue_copy.ids)}


def run_in_vllm_tree(root, script: str, out, env: dict, args=()) -> None:
    """Run ``conformance/<script>`` in a subprocess inside vLLM's source tree ``root`` (vLLM's own
    classes on its path), writing ``out``; fail with the end of its stderr."""
    env = dict(os.environ, GPUPOOL_VLLM_SRC=str(root), **env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # vLLM's tree keeps its bytecode between runs
    proc = subprocess.run([sys.executable, str(CONFORMANCE / script), *map(str, args), str(out)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]


def driver_trace(root, cases: list, tmp_path) -> list:
    """vLLM's own ``BlockPool`` over ``cases`` (``driver.py``'s op lists): its observable trace per case."""
    (tmp_path / "ops.json").write_text(json.dumps(cases))
    run_in_vllm_tree(root, "driver.py", tmp_path / "out.json", {"PYTHONPATH": str(CONFORMANCE)},
                     [tmp_path / "ops.json"])
    return json.loads((tmp_path / "out.json").read_text())


def scheduler_runs(root, backends: str, tmp_path) -> dict:
    """``sched_driver.py``'s runs of vLLM's scheduler, stock and over gpupool's ``backends``, on the
    differential stream (20 requests, 12 blocks) and the decode-heavy one (6 requests, 40 blocks)."""
    env = {"TRITON_INTERPRET": "1", "NUM_BLOCKS": "12", "NREQ": "20", "BACKENDS": backends, "DECODE_HEAVY": "6,40"}
    out = tmp_path / "sched.json"
    run_in_vllm_tree(root, "sched_driver.py", out, env)
    return json.loads(out.read_text())


class D2H:
    """Counts reads of tensor values into Python outside Triton / torch (``n``), with ``monkeypatch``
    (as sched_driver.D2HCounter)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def f(t, *a, _o=orig, **k):
                mod = sys._getframe(1).f_globals.get("__name__", "")
                if not (mod.startswith("triton") or mod.startswith("torch")):
                    self.n += 1
                return _o(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, f)


def mirror_is_device(p) -> None:
    """A fast-path pool's mirror as its device pool has it: every block's ref count and keys, the free
    count and every key's lookup."""
    from gpupool.vllm.host_mirror import get_block_hash, get_group_id

    dp = p.device_pool
    dp.validate()
    assert p._ref == dp.ref_counts()
    assert p.get_num_free_blocks() == dp.get_num_free_blocks()
    for b in range(1, p.num_gpu_blocks):
        assert [tuple(k) for k in dp.block_keys(b)] == [(get_block_hash(k), get_group_id(k)) for k in p._keys[b]], b
    for key in p.mirror.holders:
        assert dp.get_cached_block(get_block_hash(key), [get_group_id(key)]) == [p.mirror.earliest(key)], key


def adapter_pair(n: int, backend: str, caching: bool = True, **kw):
    """(the per-call adapter, the fast path) of ``n`` blocks over ``backend`` (``"device"``: on the CPU)."""
    from gpupool.vllm import BlockPool
    from gpupool.vllm.fast_path import DeferredBlockPool

    kw.update(device="cpu") if backend == "device" else kw.update(backend="reference")
    return BlockPool(n, caching, BS, **kw), DeferredBlockPool(n, caching, BS, **kw)


def observed_pool(cls, n: int, backend: str, caching: bool = True):
    """An adapter of class ``cls`` with KV events and a metrics log (``driver.MetricsLog``) on."""
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    return cls(n, caching, BS, enable_kv_cache_events=True, metrics_collector=driver.MetricsLog(), **kw)


def drain(*pools) -> list:
    """Each pool's events (vLLM's fields) and metrics calls since the last drain."""
    return [([driver._event(e) for e in p.take_events()], p.metrics_collector.take()) for p in pools]


def synced_snapshot(p) -> dict:
    """The whole state vLLM's callers read (``driver.snapshot``), the fast path synchronised first."""
    if hasattr(p, "sync"):
        p.sync()
    return driver.snapshot(p)


def run_mixed(p, ops, other, reqs: list, seen: list, theirs: list) -> None:
    """``ops`` on the adapter ``p``: vLLM's (:func:`apply_op`), ``("end_step",)``, ``("sync",)`` (the fast
    path's) and another user's (``("o_...", ...)``: ``other(p, op, reqs, theirs)``, what it returns
    appended to ``seen``); a PoolError raised is an answer too (its type appended)."""
    from gpupool.errors import PoolError

    for op in ops:
        try:
            if op[0] == "end_step":
                p.end_step()
            elif op[0] == "sync":
                if hasattr(p, "sync"):
                    p.sync()
            elif op[0].startswith("o_"):
                seen.append(other(p, op, reqs, theirs))
            else:
                apply_op(p, op, reqs, seen)
        except PoolError as e:
            seen.append(type(e).__name__)
