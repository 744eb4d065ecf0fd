"""Bad inputs to the KV consumer contract's entry points (gpupool.kv_cache, docs/kv_cache.md): each is
a typed error (a PoolError), raised before anything is written, never a raw TypeError, IndexError,
RuntimeError or a silently broadcast answer."""
from __future__ import annotations

import pytest
import torch

from gpupool.errors import ArgumentTypeError, InvalidArgumentError, PoolError
from gpupool.kv_cache import (AttentionViews, PagedKVCache, attention, paged_attention, paged_attention_flashinfer,
                              store_kv)

BS = 4
i32 = torch.int32


@pytest.mark.parametrize("layer", [1, -1, 0.5, None])
def test_store_rejects_a_layer_outside_the_cache(layer):
    c = PagedKVCache(1, 4, BS, 1, 2, dtype=torch.float32)
    k = torch.ones(2, 1, 2)
    with pytest.raises(PoolError):
        c.store(layer, k, k, torch.tensor([0, 1]))
    assert all(t.abs().sum() == 0 for t in c.layers())  # -1 used to write layer 0 (Python's last item)


@pytest.mark.parametrize("bad", [dict(device="bogus"), dict(device="meta"), dict(num_blocks=10 ** 13)])
def test_paged_kv_cache_rejects_a_bad_device_or_a_size_past_memory(bad):
    with pytest.raises(InvalidArgumentError):
        PagedKVCache(**(dict(num_layers=1, num_blocks=4, block_size=BS, num_kv_heads=1, head_dim=2) | bad))


def test_store_kv_rejects_caches_on_the_meta_device():
    k = torch.ones(2, 1, 2, device="meta")
    with pytest.raises(InvalidArgumentError):
        store_kv(k, k, torch.zeros(4, BS, 1, 2, device="meta"), torch.zeros(4, BS, 1, 2, device="meta"),
                 torch.tensor([0, 1], device="meta"))


@pytest.mark.parametrize("call", [lambda: AttentionViews.empty(-1, 2), lambda: AttentionViews.empty(1.5, 2),
                                  lambda: AttentionViews.empty(2, None), lambda: AttentionViews.empty(2, 2).step(1),
                                  lambda: AttentionViews.empty(2, 2).step(-1),
                                  lambda: AttentionViews.empty(2, 2).step(0.5)])
def test_attention_views_sizes_and_steps_are_checked(call):
    with pytest.raises(PoolError):
        call()


q = torch.randn(2, 1, 2, 2)
kv = torch.randn(2, 5, 1, 2)
kc = torch.randn(4, BS, 1, 2)
bt = torch.tensor([[1, 2], [3, 0]], dtype=i32)
seq = torch.tensor([5, 3], dtype=i32)
q1 = torch.randn(2, 2, 2)
ip, ix, lp = torch.tensor([0, 2, 3], dtype=i32), torch.tensor([1, 2, 3, 0], dtype=i32), torch.tensor([1, 3], dtype=i32)


@pytest.mark.parametrize("call", [
    lambda: attention(None, kv, kv, seq), lambda: attention(q, kv, kv, [3, 5]),
    lambda: attention(q, torch.randn(2, 5, 0, 2), torch.randn(2, 5, 0, 2), seq),  # no KV heads: was ZeroDivisionError
    lambda: attention(q[0], kv, kv, seq), lambda: attention(q, torch.randn(2, 5, 1, 3), torch.randn(2, 5, 1, 3), seq),
    lambda: attention(q, kv, kv, seq[:1]),  # was broadcast: lane 1 silently got lane 0's length
    lambda: paged_attention(q, kc, kc, bt[0], seq), lambda: paged_attention(q, kc, kc, bt.float(), seq),
    lambda: paged_attention(q, kc, kc, bt[:1], seq[:1]),  # one row for two lanes: was broadcast
    lambda: paged_attention(q, kc, torch.randn(4, BS, 1, 3), bt, seq),
    lambda: paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, -1),
    lambda: paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, 1.5),
    lambda: paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, None),
    lambda: paged_attention_flashinfer(q1, kc, kc, ip[:2], ix, lp, 2),  # was broadcast
    lambda: paged_attention_flashinfer(q, kc, kc, ip, ix, lp, 2),
])
def test_attention_entry_points_reject_bad_input(call):
    with pytest.raises(PoolError):
        call()


def test_attention_entry_points_still_take_good_input():
    assert paged_attention(q, kc, kc, bt, seq).shape == q.shape
    assert paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, 2).shape == q1.shape
    assert attention(q, kv, kv, seq).shape == q.shape


def _manager():
    from gpupool.manager import KVCacheManager
    m = KVCacheManager(16, block_size=BS, max_num_reqs=4, max_blocks_per_req=8, device="cpu")
    m.add_request(0, [])
    return m


def test_attention_views_of_an_empty_batch_are_empty():
    m = _manager()
    v = m.attention_views(slots=[], base_len=[])
    assert v.block_table.shape == (0, 8) and v.kv_indptr.tolist() == [[0]]
    m.pool.check()


def test_attention_views_reject_admitted_of_three_dims_and_aliased_out():
    m = _manager()
    with pytest.raises(InvalidArgumentError):  # was flattened to [2, 1] and taken as two steps
        m.attention_views(slots=[0], base_len=[1], admitted=torch.ones(2, 1, 1, dtype=i32))
    o = AttentionViews.empty(1, 8)
    shared = o._replace(kv_last_page_len=o.seqused_k)  # one step's lengths written over by its last pages
    with pytest.raises(InvalidArgumentError):
        m.attention_views(slots=[0], base_len=[1], out=shared)
    m.pool.check()


@pytest.mark.parametrize("views", ["no", 1, None])
def test_decode_step_views_must_be_a_bool(views):
    from gpupool.graph import DecodeStep
    with pytest.raises(ArgumentTypeError):  # "no" used to build the views
        DecodeStep(_manager(), 2, views=views)


@pytest.mark.parametrize("args,word", [((None, [1]), "slots"), (([0], [0.5]), "num_tokens"),
                                       (([0], [1], "ab"), "finished")])
def test_set_inputs_names_the_argument_at_fault(args, word):
    from gpupool.graph import DecodeStep
    with pytest.raises(ArgumentTypeError, match=word):  # every error used to say "block ids"
        DecodeStep(_manager(), 2).set_inputs(*args)
