"""Fuzz of every entry point of the KV consumer API (gpupool.kv_cache, ``KVCacheManager.attention_views``;
docs/kv_cache.md): each argument is either a good value or one drawn from a pool of wrong ones (other
types, bools, numpy scalars and arrays, out-of-range and huge ints, nan / inf, tensors of other
dtypes, shapes, devices and layouts, another manager's views, views that overlap, another argument's
tensor). Whatever comes out must be a PoolError (from the call, or recorded and raised at
``check()``), and a call that raised must have changed nothing: no cache, view, input, manager or
pool tensor."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from gpupool.errors import PoolError
from gpupool.kv_cache import (AttentionViews, PagedKVCache, attention, paged_attention, paged_attention_flashinfer,
                              store_kv)
from gpupool.manager import KVCacheManager

BS, M = 4, 8
i32, i64 = torch.int32, torch.int64
#: Dtypes of a key, value or cache other than the good arguments' float32.
OTHER_DTYPES = (torch.float16, torch.bfloat16, torch.float64, i32, i64)
#: Entries whose key and value go into caches: what they stored must share the caches' dtype.
STORES = {"store_kv": lambda a: (a["key"], a["value"], a["k_cache"], a["v_cache"]),
          "PagedKVCache.store": lambda a: (a["key"], a["value"], *a["cache"].layers())}


@functools.cache
def managers():
    """This file's manager (slot 0 holds 5 tokens) and another one, larger, with views of its own."""
    m = KVCacheManager(16, block_size=BS, max_num_reqs=4, max_blocks_per_req=M)
    m.add_request(0, [])
    m.allocate_slots([0], [5], [5])
    other = KVCacheManager(64, block_size=BS, max_num_reqs=4, max_blocks_per_req=3)
    for r in range(3):
        other.add_request(r, [])
    other.allocate_slots([0, 1, 2], [12, 12, 12], [12, 12, 12])
    m.pool.check()
    other.pool.check()
    return m, other, other.attention_views([0, 1, 2], [12, 12, 12])


def good_args() -> dict:
    """Fresh good arguments of every entry point."""
    z = torch.zeros
    return dict(
        num_layers=1, num_blocks=4, block_size=BS, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
        max_batch=2, max_blocks_per_req=M, steps=1,
        key=torch.randn(3, 1, 2), value=torch.randn(3, 1, 2), k_cache=z(6, BS, 1, 2), v_cache=z(6, BS, 1, 2),
        slot_mapping=torch.tensor([0, 5, 9]), num_tokens=torch.tensor([2], dtype=i32), layer=0,
        q=torch.randn(2, 1, 2, 2), k=torch.randn(2, 5, 1, 2), v=torch.randn(2, 5, 1, 2),
        seq_lens=torch.tensor([5, 3], dtype=i32), scale=None,
        block_table=torch.tensor([[1, 2], [3, 0]], dtype=i32), seqused_k=torch.tensor([5, 3], dtype=i32),
        q1=torch.randn(2, 2, 2), kv_indptr=torch.tensor([0, 2, 3], dtype=i32),
        kv_indices=torch.tensor([1, 2, 3, 0], dtype=i32), kv_last_page_len=torch.tensor([1, 3], dtype=i32),
        max_pages=2,
        slots=[0], base_len=[5], num_reqs=None, admitted=None, group=0, out=AttentionViews.empty(1, M),
        cache=PagedKVCache(1, 6, BS, 1, 2, torch.float32),
    )


def wrong_values(args: dict, other_views: AttentionViews) -> list:
    """The pool of wrong values (fresh tensors; a few are the good arguments' own tensors)."""
    buf = torch.zeros(64, dtype=i32)
    shapes = AttentionViews.shapes(1, M)
    overlapping = AttentionViews(*(buf[3 * j:3 * j + math.prod(s)].view(s) for j, s in enumerate(shapes)))
    return [
        None, True, False, np.int64(2), np.int32(-3), np.float64(1.5), 2**40, 2**63, -1, 0, 1, 3, 1.5, float("nan"),
        float("inf"), "x", "cuda", "meta", "bogus", b"ab", [1, 2], (0,), [[1]], object(), torch.float16, torch.int8,
        torch.zeros(2, dtype=i64), torch.ones(2, 2), torch.zeros(0, dtype=i32), torch.tensor(3),
        torch.zeros(3, device="meta"), torch.zeros(4, 2)[:, 0], torch.tensor([True, False]),
        torch.tensor([2**31 - 1, -2**31], dtype=i32), torch.tensor([[1, 0]], dtype=i32), torch.zeros(2, 1, 2),
        torch.zeros(2, 2, 2, dtype=torch.float64), torch.zeros(6, BS, 1, 3), np.array([0, 1]),
        other_views, other_views.block_table, other_views.seqused_k[0], other_views.kv_indices[0],
        overlapping, args["k_cache"], args["slot_mapping"], args["out"].seqused_k, args["out"].kv_indptr[0],
        args["out"]._replace(kv_last_page_len=args["out"].seqused_k),
        # a key, value or cache of the right shape in another dtype (no cast: vLLM's reshape_and_cache),
        # or on the meta device
        *(torch.ones(3, 1, 2, dtype=d) for d in OTHER_DTYPES), *(torch.zeros(6, BS, 1, 2, dtype=d) for d in OTHER_DTYPES),
        torch.ones(3, 1, 2, device="meta"), torch.zeros(6, BS, 1, 2, device="meta"),
    ]


CALLS = {
    "PagedKVCache": (lambda a: PagedKVCache(a["num_layers"], a["num_blocks"], a["block_size"], a["num_kv_heads"],
                                            a["head_dim"], a["dtype"], a["device"]),
                     ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype", "device"]),
    "PagedKVCache.store": (lambda a: a["cache"].store(a["layer"], a["key"], a["value"], a["slot_mapping"],
                                                       a["num_tokens"]),
        ["layer", "key", "value", "slot_mapping", "num_tokens"]),
    "AttentionViews.empty": (lambda a: AttentionViews.empty(a["max_batch"], a["max_blocks_per_req"], a["steps"],
                                                            a["device"]),
                             ["max_batch", "max_blocks_per_req", "steps", "device"]),
    "store_kv": (lambda a: store_kv(a["key"], a["value"], a["k_cache"], a["v_cache"], a["slot_mapping"],
                                    a["num_tokens"]),
                 ["key", "value", "k_cache", "v_cache", "slot_mapping", "num_tokens"]),
    "attention": (lambda a: attention(a["q"], a["k"], a["v"], a["seq_lens"], a["scale"]),
                  ["q", "k", "v", "seq_lens", "scale"]),
    "paged_attention": (lambda a: paged_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                                                  a["seqused_k"], a["scale"]),
                        ["q", "k_cache", "v_cache", "block_table", "seqused_k", "scale"]),
    "paged_attention_flashinfer": (lambda a: paged_attention_flashinfer(
        a["q1"], a["k_cache"], a["v_cache"], a["kv_indptr"], a["kv_indices"], a["kv_last_page_len"], a["max_pages"],
        a["scale"]), ["q1", "k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_last_page_len", "max_pages", "scale"]),
    "attention_views": (lambda a: managers()[0].attention_views(a["slots"], a["base_len"], a["num_reqs"],
                                                                 a["admitted"], a["group"], a["out"]),
                        ["slots", "base_len", "num_reqs", "admitted", "group", "out"]),
}


def tensors_of(x) -> list[torch.Tensor]:
    """Every tensor in ``x`` (nested lists, tuples, dicts), but those on the meta device (no values)."""
    if isinstance(x, torch.Tensor):
        return [x] if x.device.type != "meta" else []
    if isinstance(x, (tuple, list, dict)):
        return [t for y in (x.values() if isinstance(x, dict) else x) for t in tensors_of(y)]
    return []


@pytest.mark.parametrize("entry", list(CALLS))
@given(data=st.data())
def test_fuzz_consumer_entry_points(entry, data):
    m, _, other_views = managers()
    call, params = CALLS[entry]
    held = list(m.state) + list(m.pool.state)
    for _ in range(3):  # three calls an example: cheap on the host, and shrinking still works per draw
        args = good_args()
        wrong = wrong_values(args, other_views)
        # one or two arguments wrong at a time (more would mostly test the first check)
        bad = data.draw(st.lists(st.sampled_from(params), max_size=2, unique=True), label="wrong arguments")
        for p in bad:
            args[p] = wrong[data.draw(st.integers(0, len(wrong) - 1), label=p)]
        world = tensors_of(args) + tensors_of(wrong) + args["cache"].layers() + held
        before = [t.clone() for t in world]
        try:
            call(args)
        except PoolError:  # raised on the host: nothing written anywhere
            assert bad, f"{entry} refused its good arguments"
            assert all(torch.equal(a, b) for a, b in zip(before, world)), entry
            continue
        except Exception as e:  # noqa: BLE001 - the point: nothing but a PoolError comes out
            pytest.fail(f"{entry} raised {type(e).__name__}, not a PoolError: {e!r}")
        if entry in STORES:  # a store that went through cast nothing
            assert len({t.dtype for t in STORES[entry](args)}) == 1, (entry, bad)
        if entry == "attention_views":
            try:
                m.pool.check()  # a bad slot, length or count is recorded, not raised at once
            except PoolError:
                assert bad, "attention_views recorded an error for its good arguments"
            # recorded or not, the manager and its pool are as they were (the views are outputs)
            assert all(torch.equal(a, b) for a, b in zip(before[-len(held):], held)), entry
