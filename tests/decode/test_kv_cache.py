"""The KV consumer contract (gpupool.kv_cache, docs/kv_cache.md): ``store_kv`` against a plain torch
scatter (negative and out-of-range slots write nothing), the attention views against the host
rows of the reference manager (one step and a burst against the reference window, random states), the reference paged attention
in both formats against attention over contiguous KV, and the typed errors of each entry point."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from gpupool.errors import ArgumentTypeError, InvalidArgumentError, PoolError
from gpupool.graph import DecodeStep
from gpupool.kv_cache import (AttentionViews, PagedKVCache, attention, paged_attention, paged_attention_flashinfer,
                              store_kv)
from gpupool.manager import KVCacheManager
from gpupool.reference.window import ReferenceDecodeWindow
from harness.compare import assert_managers_agree
from harness.keys import hashes
from gpupool.instrument import Meter
from harness.ops import fail_a_batched_op, fill_step
from harness.twins import small_manager_twin

BS, R, M = 4, 4, 8


# ---- store_kv ----------------------------------------------------------------------------------------
@given(data=st.data())
def test_store_kv_equals_a_scatter(data):
    N, H, D = 6, 2, 3
    T = data.draw(st.integers(0, 20), label="T")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.float16]), label="dtype")
    slots = data.draw(st.lists(st.integers(-2, N * BS + 3), min_size=T, max_size=T, unique=True), label="slots")
    key = torch.randn(T, H, D).to(dtype)  # the caches' dtype: store_kv casts nothing (reshape_and_cache)
    value = torch.randn(T, H, D).to(dtype)
    kc = torch.randn(N, BS, H, D).to(dtype)
    vc = torch.randn(N, BS, H, D).to(dtype)
    want_k, want_v = kc.clone().view(-1, H, D), vc.clone().view(-1, H, D)
    for t, s in enumerate(slots):
        if 0 <= s < N * BS:
            want_k[s], want_v[s] = key[t], value[t]
    store_kv(key, value, kc, vc, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(kc.view(-1, H, D), want_k) and torch.equal(vc.view(-1, H, D), want_v)


def test_store_kv_device_count_and_int32_slots():
    kc, vc = torch.zeros(4, BS, 1, 2), torch.zeros(4, BS, 1, 2)
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    store_kv(key, -key, kc, vc, torch.tensor([5, 6, 7], dtype=torch.int32), num_tokens=torch.tensor([2], dtype=torch.int32))
    flat = kc.view(-1, 1, 2)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[6], key[1]) and flat[7].abs().sum() == 0
    assert torch.equal(vc.view(-1, 1, 2)[6], -key[1])


@pytest.mark.parametrize("bad", [
    dict(key=None), dict(slot_mapping=[1, 2]), dict(key=torch.zeros(2, 2, 3)), dict(value=torch.zeros(2, 1, 3)),
    dict(slot_mapping=torch.zeros(1, dtype=torch.int64)), dict(slot_mapping=torch.zeros(2, dtype=torch.float32)),
    dict(k_cache=torch.zeros(4, BS, 1, 2, dtype=torch.int32)), dict(num_tokens=torch.zeros(1, dtype=torch.int64)),
    dict(num_tokens=5), dict(v_cache=torch.zeros(3, BS, 1, 2)), dict(k_cache=torch.zeros(BS, 4, 1, 2).transpose(0, 1)),
])
def test_store_kv_rejects_bad_input_and_writes_nothing(bad):
    args = dict(key=torch.ones(2, 1, 2), value=torch.ones(2, 1, 2), k_cache=torch.zeros(4, BS, 1, 2),
                v_cache=torch.zeros(4, BS, 1, 2), slot_mapping=torch.tensor([0, 1]), num_tokens=None)
    args.update(bad)
    before = [t.clone() for t in (args["k_cache"], args["v_cache"]) if isinstance(t, torch.Tensor)]
    with pytest.raises(PoolError):
        store_kv(**args)
    after = [t for t in (args["k_cache"], args["v_cache"]) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_paged_kv_cache_shapes_and_errors():
    kv = PagedKVCache(2, 5, BS, 3, 8, dtype=torch.bfloat16)
    assert [tuple(t.shape) for t in kv.layers()] == [(5, BS, 3, 8)] * 4
    assert kv.layers()[1] is kv.value_caches[0]
    for bad in (dict(num_layers=0), dict(head_dim=-1), dict(dtype=torch.int8)):
        args = dict(num_layers=1, num_blocks=2, block_size=BS, num_kv_heads=1, head_dim=2) | bad
        with pytest.raises(InvalidArgumentError):
            PagedKVCache(**args)
    with pytest.raises(ArgumentTypeError):
        PagedKVCache("2", 2, BS, 1, 2)


# ---- attention views ------------------------------------------------------------------------------------
def host_views(rows_at, slots, lens, K=1, admitted=None):
    """The views from the reference manager's rows, built on the host (the oracle): ``rows_at[k]``, the
    reference's group-0 rows after step k (row k of the views; the block table is the last step's)."""
    rows = rows_at[K - 1]
    table = [(rows[r] + [0] * M)[:M] if admitted is None or admitted[K - 1][i] else [0] * M
             for i, r in enumerate(slots)]
    seq, indptr, indices, last = [], [], [], []
    for k in range(K):
        rows = rows_at[k]
        s = [(n + k) if (admitted is None or admitted[k][i]) else 0 for i, n in enumerate(lens)]
        pages = [-(-x // BS) for x in s]
        ptr = [0]
        for p in pages:
            ptr.append(ptr[-1] + p)
        idx = [b for r, p in zip(slots, pages) for b in rows[r][:p]]
        seq.append(s)
        indptr.append(ptr)
        indices.append(idx)
        last.append([(x - 1) % BS + 1 if x else 1 for x in s])
    return table, seq, indptr, indices, last


def assert_views(v: AttentionViews, want, B):
    table, seq, indptr, indices, last = want
    assert v.block_table[:B].tolist() == table
    assert v.seqused_k[:, :B].tolist() == seq
    assert v.kv_indptr[:, :B].tolist() == [p[:-1] for p in indptr]
    assert v.kv_indptr[:, -1].tolist() == [p[-1] for p in indptr]
    assert [v.kv_indices[k, :len(i)].tolist() for k, i in enumerate(indices)] == indices
    assert v.kv_last_page_len[:, :B].tolist() == last


@given(data=st.data())
@pytest.mark.heavy
def test_attention_views_equal_the_host_rows(data):
    ref, dev = small_manager_twin(n=data.draw(st.integers(8, 32), label="n"))
    lens = []
    slots = data.draw(st.permutations(range(R)), label="order")[:data.draw(st.integers(1, R), label="B")]
    for r in slots:
        n = data.draw(st.integers(1, M * BS - 4), label="tokens")
        hs = hashes([(r % 2, i) for i in range(n // BS)])
        ref.add_request(r, hs)
        dev.add_request(r, hs)
        ok = ref.allocate_slots([r], [n], [n], lookup=[True])[0]
        assert bool(dev.allocate_slots([r], [n], [n], lookup=[True])[0]) == ok
        lens.append(n if ok else 0)
    live = [r for r, n in zip(slots, lens) if n]
    live_lens = [n for n in lens if n]
    v = dev.attention_views(live, live_lens)
    dev.pool.check()
    assert_views(v, host_views([ref.block_table(0)], live, live_lens), len(live))
    # one page past a row is an error: length 0 there, InvalidArgumentError at check()
    if live:
        over = [n + (BS if i == 0 else 0) for i, n in enumerate(live_lens)]
        over[0] = max(over[0], len(ref.block_table(0)[live[0]]) * BS + 1)
        v = dev.attention_views(live, over)
        assert v.seqused_k[0, 0].item() == 0
        with pytest.raises(InvalidArgumentError, match="attention_views"):
            dev.pool.check()


@pytest.mark.parametrize("K", [1, 3])
def test_decode_step_views_follow_the_burst(K):
    """A DecodeStep's views (``views=True``): row k is built at step k from the rows after step k's
    allocation, the block table is the last step's; the reference window driven step by step (one
    token a step) gives the same admitted flags and rows. The pool is small: the last lane is
    preempted at step 0 and reads 0 everywhere."""
    ref, dev = small_manager_twin(n=7)  # small: the last request does not fit
    lens = [4, 8, 4]
    for r, n in enumerate(lens):
        for m in (ref, dev):
            m.add_request(r, hashes([(r, i) for i in range(n // BS)]))
        assert ref.allocate_slots([r], [n], [n])[0] and dev.allocate_slots([r], [n], [n])[0]
    ntok = [n + 1 for n in lens]
    rw = ReferenceDecodeWindow(ref, R, K)
    rw.begin([0, 1, 2], ntok)
    want_adm, rows_at = [], []
    for k in range(K):
        want_adm.append([int(a) for a in rw.step(k).admitted])
        rows_at.append(ref.block_table(0))
    step = DecodeStep(dev, R, steps=K, views=True)
    fill_step(step, [0, 1, 2], ntok)
    with Meter() as c:
        step.run()
    assert c.syncs == 0
    dev.pool.check()
    adm = step.admitted_steps[:, :3].tolist()
    assert adm == want_adm and rw.preempt_step == [-1, -1, 0]  # the pool ran out at step 0
    assert_views(step.views, host_views(rows_at, [0, 1, 2], ntok, K, adm), 3)
    assert_managers_agree(ref, dev)


def test_attention_views_argument_errors():
    m = KVCacheManager(16, block_size=BS, max_num_reqs=R, max_blocks_per_req=M)
    m.add_request(0, [])
    i32 = torch.int32
    for kw in (dict(slots=[0], base_len=[1, 2]), dict(slots=[0], base_len=[1], group=1),
               dict(slots=[0], base_len=[1], admitted=torch.zeros(2, 2, dtype=i32)),
               dict(slots=[0], base_len=[1], admitted=torch.zeros(1, 1, dtype=torch.int64)),
               dict(slots=[0], base_len=[1], out=AttentionViews.empty(2, M)),
               dict(slots=torch.zeros(1, dtype=torch.int64), base_len=[1])):
        with pytest.raises(InvalidArgumentError):
            m.attention_views(**kw)
    with pytest.raises(PoolError):  # past int32
        m.attention_views(slots=[0], base_len=[2 ** 40])
    for kw in (dict(slots=None, base_len=[1]), dict(slots=[0], base_len=[1], admitted=[[1]]),
               dict(slots=[0], base_len=[1], out=(1, 2))):
        with pytest.raises(ArgumentTypeError):
            m.attention_views(**kw)
    m.pool.check()  # nothing recorded


# ---- attention over the views ---------------------------------------------------------------------------
@given(data=st.data())
def test_paged_attention_equals_contiguous(data):
    """Both formats read exactly the tokens the contiguous cache holds (GQA, several queries per lane)."""
    torch.manual_seed(data.draw(st.integers(0, 99), label="seed"))
    B, Hk, g, D, P = 3, 2, 2, 4, 5
    N = B * P + 1
    lens = data.draw(st.lists(st.integers(0, P * BS), min_size=B, max_size=B), label="lens")
    perm = torch.randperm(N - 1)[:B * P].view(B, P) + 1  # distinct blocks, never the null block
    kc, vc = torch.randn(N, BS, Hk, D, dtype=torch.float64), torch.randn(N, BS, Hk, D, dtype=torch.float64)
    kcont = kc[perm].reshape(B, P * BS, Hk, D)
    vcont = vc[perm].reshape(B, P * BS, Hk, D)
    seq = torch.tensor(lens, dtype=torch.int32)
    Sq = data.draw(st.integers(1, 3), label="Sq")
    q = torch.randn(B, Sq, Hk * g, D, dtype=torch.float64)
    fa = paged_attention(q, kc, vc, perm.to(torch.int32), seq)
    want = torch.stack([attention(q[b:b + 1], kcont[b:b + 1, :lens[b]], vcont[b:b + 1, :lens[b]], seq[b:b + 1])[0]
                        for b in range(B)])
    assert torch.allclose(fa, want, atol=1e-12)
    pages = [-(-n // BS) for n in lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.cat([perm[b, :pages[b]] for b in range(B)] + [torch.zeros(1, dtype=torch.int64)]).to(torch.int32)
    last = torch.tensor([(n - 1) % BS + 1 if n else 0 for n in lens], dtype=torch.int32)
    fi = paged_attention_flashinfer(q[:, -1], kc, vc, indptr, indices, last, max_pages=P)
    assert torch.allclose(fi, want[:, -1], atol=1e-12)
    # a wrong page changes the output (the check can fail)
    if lens[0] > BS:
        bad = perm.clone()
        bad[0, 0] = perm[1, 0]
        assert not torch.allclose(paged_attention(q, kc, vc, bad.to(torch.int32), seq)[0], want[0])


# ---- padded lanes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 2])
def test_padded_lanes_map_nothing_after_a_shrinking_batch(K):
    """A step over 3 requests, then one over 2 in another order: lane 2 kept the first step's slots
    and admitted flags, and (K = 2) its step-1 slot was the one the new step gave request 1's token,
    so a store over the full padded width (what a captured graph replays) overwrote request 1's K/V.
    Every lane past the count reads -1 / 0 after every step."""
    m = KVCacheManager(32, block_size=BS, max_num_reqs=R, max_blocks_per_req=M)
    for r in range(3):
        m.add_request(r, [])
    m.allocate_slots([0, 1, 2], [3, 3, 3], [3, 3, 3])
    step = DecodeStep(m, R, steps=K, views=True)
    kv = PagedKVCache(1, 32, BS, 1, 2, dtype=torch.float64)
    fill_step(step, [0, 1, 2], [4, 4, 4])
    step.run()
    m.pool.check()
    assert step.admitted_steps[:, :3].tolist() == [[1, 1, 1]] * K
    fill_step(step, [2, 1], [4 + K, 4 + K], finished=[0])
    step.run()
    m.pool.check()
    assert step.admitted_steps[:, 2:].tolist() == [[0] * (R - 2)] * K
    assert step.slot_mapping_steps[:, 2:].tolist() == [[-1] * (R - 2)] * K
    for k in range(K):  # the model's store over the whole width: the padding must land nowhere
        key = torch.full((R, 1, 2), float(k + 1), dtype=torch.float64)
        key[2:] = -7.0
        kv.store(0, key, -key, step.slot_mapping_steps[k])
    assert not (kv.key_caches[0] == -7.0).any() and not (kv.value_caches[0] == 7.0).any()
    # a step that does not run (the status word set by an earlier op) admits and maps no lane
    fail_a_batched_op(m)
    fill_step(step, [2, 1], [4 + 2 * K, 4 + 2 * K])
    step.run()
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    assert step.admitted_steps.eq(0).all() and step.slot_mapping_steps.eq(-1).all()
