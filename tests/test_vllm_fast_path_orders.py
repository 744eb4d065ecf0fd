"""``DeferredBlockPool``'s batch order (free, touch, pop, cache; docs/vllm.md "The fast path")
against the per-call adapter, on op mixes aimed at the batch: pops then touches of prefix hits, frees
of shared blocks (ref > 1, by a request sharing another's blocks), frees of blocks touched in the same
batch (a hit freed at once), single-block frees (sliding window: the block replaced by the null
block), cachings of fresh placeholders and later ranges, copy-on-write ``ref_cnt += 1``, evictions,
and reads of ref counts, hashes and ids in between. Every answer read while running, every id handed
out, and the whole state at the end (mirror, device ref counts and free queue) are equal.

Cheap by default; the slow variant runs more examples over two pool sizes (60 in CI, 1,000 with
``GPUPOOL_HYPOTHESIS_PROFILE=deep``).
"""
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool[vllm] needs msgspec (pip install 'gpupool[vllm]')")

from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "vllm_conformance"))
import driver  # noqa: E402

BS = driver.BLOCK_SIZE
R = st.integers(0, 7)  # a request, modulo the live ones
SEED = st.integers(0, 3)  # a request's tokens (driver.tokens_of): few seeds, so hits are frequent
ALLOC = st.tuples(st.just("alloc"), st.integers(1, 3), SEED, st.integers(0, 3))  # get_new_blocks, cache c of them
FREE = st.tuples(st.just("free"), R)  # the request ends
IDS = st.tuples(st.just("ids"), R)  # block_id, ref_cnt, block_hash of a request's blocks: a synchronisation
OPS = st.one_of(  # pops, frees and id reads weighted up: a read between batches gives known un-keyed ids
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


def _hit(pool, seed):
    hit = []
    for hh in driver.chain(driver.tokens_of(seed)):
        got = pool.get_cached_block(hh, [0])
        if got is None:
            break
        hit.append(got[0])
    return hit


def _apply(pool, op, reqs, seen):
    """One op (OPS' comments); what it reads goes to ``seen`` (blocks handed out as lists of blocks)."""
    kind, n = op[0], pool.num_gpu_blocks
    r = reqs[op[1] % len(reqs)] if reqs and kind in ("cache", "free1", "share", "cow", "ids", "refs") else None
    if kind == "alloc" and op[1] <= pool.get_num_free_blocks():
        blocks = pool.get_new_blocks(op[1])
        r = {"req": driver.request(driver.tokens_of(op[2])[: op[1] * BS]), "blocks": blocks, "cached": 0,
             "extra": []}
        reqs.append(r)
        seen.append(blocks)
        if op[3] > 0:
            r["cached"] = min(op[3], op[1])
            pool.cache_full_blocks(r["req"], blocks, 0, r["cached"], BS, 0)
    elif kind == "cache" and r is not None:
        full = min(r["cached"] + op[2], len(r["blocks"]))
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
        hit = _hit(pool, op[1])
        seen.append([(b.ref_cnt, b.block_hash) for b in hit])  # vLLM's evictable count reads these
        pool.touch(hit)
        seen.append(hit)
        if kind == "hitfree":
            pool.free_blocks(list(reversed(hit)))
        else:
            reqs.append({"req": driver.request(driver.tokens_of(op[1])[: len(hit) * BS]), "blocks": hit,
                         "cached": len(hit), "extra": []})
    elif kind == "share" and r is not None:
        held = [b for b in r["blocks"] if not b.is_null]
        pool.touch(held)
        reqs.append({"req": r["req"], "blocks": list(r["blocks"]), "cached": r["cached"], "extra": []})
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


def _run(pool, ops):
    reqs, seen = [], []
    for op in ops:
        _apply(pool, op, reqs, seen)
    # the ids of the blocks handed out, read at the end (as vLLM builds its SchedulerOutput)
    return [[b.block_id for b in s] if isinstance(s, list) and s and hasattr(s[0], "block_id") else s
            for s in seen]


def _check(ops, n):
    per_call = BlockPool(n, True, BS, device="cpu")
    deferred = DeferredBlockPool(n, True, BS, device="cpu")
    assert _run(per_call, ops) == _run(deferred, ops)
    deferred.sync()
    assert driver.snapshot(per_call) == driver.snapshot(deferred)  # ref counts, keys, queue order, key map
    assert (deferred._ref, deferred._keys, deferred._ntok) == (per_call._ref, per_call._keys, per_call._ntok)
    deferred.device_pool.validate()
    assert deferred.device_pool.ref_counts() == per_call.device_pool.ref_counts()
    assert deferred.device_pool.free_queue() == per_call.device_pool.free_queue()


@settings(max_examples=10, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=24))
def test_batch_order_equals_call_order(ops):
    _check(ops, 12)


@pytest.mark.slow  # 60 examples in CI (about 30 s); the deep profile runs 1,000
@settings(max_examples=max(60, settings().max_examples), deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=32), n=st.sampled_from([6, 24]))
def test_batch_order_equals_call_order_many(ops, n):
    _check(ops, n)
