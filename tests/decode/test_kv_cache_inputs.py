"""Bad inputs to the KV consumer contract's entry points (gpupool.kv_cache, docs/kv_cache.md): each is
a typed error (a PoolError), raised before anything is written, never a raw TypeError, IndexError,
RuntimeError or a silently broadcast answer."""
from __future__ import annotations

import math

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


@pytest.mark.parametrize("bad", [dict(device="bogus"), dict(device="meta"), dict(num_blocks=10 ** 13),
                                 dict(num_blocks=2**31 - 1, num_kv_heads=2**20), dict(num_layers=2**31 - 1)])
def test_paged_kv_cache_rejects_a_bad_device_or_a_size_past_memory(bad):
    with pytest.raises(InvalidArgumentError):
        PagedKVCache(**(dict(num_layers=1, num_blocks=4, block_size=BS, num_kv_heads=1, head_dim=2) | bad))


def test_store_kv_rejects_caches_on_the_meta_device():
    k = torch.ones(2, 1, 2, device="meta")
    with pytest.raises(InvalidArgumentError):
        store_kv(k, k, torch.zeros(4, BS, 1, 2, device="meta"), torch.zeros(4, BS, 1, 2, device="meta"),
                 torch.tensor([0, 1], device="meta"))


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("custom_op", [False, True], ids=["function", "torch.ops"])
@pytest.mark.parametrize("which", ["key", "value", "both", "k_cache", "v_cache"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.int32, torch.int64], ids=str)
def test_store_kv_refuses_a_dtype_other_than_the_caches(dtype, which, custom_op):
    """vLLM's ``reshape_and_cache`` takes key, value and both caches of one dtype (no silent cast): any
    other dtype in one of them (a float64 key into float32 caches, a float16 value cache beside a
    float32 key cache, integers) is an InvalidArgumentError before anything is written; the same
    four tensors with one dtype store."""
    import gpupool.ops  # noqa: F401 - registers torch.ops.gpupool.store_kv
    fn = torch.ops.gpupool.store_kv if custom_op else store_kv
    base = torch.float32 if dtype != torch.float32 else torch.float16
    t = dict(key=torch.ones(2, 1, 2, dtype=base), value=torch.ones(2, 1, 2, dtype=base),
             k_cache=torch.zeros(4, BS, 1, 2, dtype=base), v_cache=torch.zeros(4, BS, 1, 2, dtype=base))
    for name in (("key", "value") if which == "both" else (which,)):
        t[name] = t[name].to(dtype)
    before = {n: x.clone() for n, x in t.items()}
    with pytest.raises(InvalidArgumentError, match="^store_kv: "):
        fn(t["key"], t["value"], t["k_cache"], t["v_cache"], torch.tensor([0, 5]))
    assert all(torch.equal(before[n], x) for n, x in t.items())
    if dtype.is_floating_point:  # all four of that dtype: stored exactly
        one = {n: x.to(dtype) for n, x in before.items()}
        fn(one["key"], one["value"], one["k_cache"], one["v_cache"], torch.tensor([0, 5]))
        assert torch.equal(one["k_cache"][0, 0], one["key"][0]) and torch.equal(one["v_cache"][1, 1], one["value"][1])


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
    assert torch.equal(paged_attention(q, kc, kc, torch.cat([bt, bt[:1]]), seq), paged_attention(q, kc, kc, bt, seq))
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


# ---- the views' outputs must not overlap each other or an input --------------------------------------
def _state(m):
    return [t.clone() for t in (*m.state, *m.pool.state)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_attention_views_refuse_out_views_that_overlap():
    """Five views of one buffer at overlapping offsets (not the same start: the old check compared
    start addresses only) garbled the lengths; refused on the host, nothing written."""
    m = _manager()
    m.allocate_slots([0], [5], [5])
    shapes = AttentionViews.shapes(1, 8)
    buf = torch.zeros(64, dtype=i32)
    out = AttentionViews(*(buf[3 * j:3 * j + math.prod(s)].view(s) for j, s in enumerate(shapes)))
    before, buf0 = _state(m), buf.clone()
    with pytest.raises(InvalidArgumentError, match="share memory"):
        m.attention_views([0], [5], out=out)
    assert torch.equal(buf, buf0) and _same(before, _state(m))
    m.pool.check()


def test_attention_views_refuse_an_out_view_that_is_an_input():
    """``base_len`` as ``out.seqused_k[0]``: the views were right, then check() said a slot was not in
    use; now refused on the host."""
    m = _manager()
    m.allocate_slots([0], [5], [5])
    out = AttentionViews.empty(1, 8)
    out.seqused_k[0, 0] = 5
    with pytest.raises(InvalidArgumentError, match="share memory"):
        m.attention_views([0], out.seqused_k[0], out=out)
    with pytest.raises(InvalidArgumentError, match="share memory"):  # the count inside an output
        m.attention_views([0], [5], num_reqs=out.kv_indptr[0, 1:], out=out)
    with pytest.raises(InvalidArgumentError, match="the manager's num_blocks"):  # the manager's own state
        m.attention_views([0], [5], out=out._replace(seqused_k=m.state.num_blocks[:1].view(1, 1)))
    m.pool.check()


# ---- an empty batch with a count --------------------------------------------------------------------
@pytest.mark.parametrize("admitted", [None, torch.zeros(2, 0, dtype=i32)], ids=["one-step", "two-steps"])
def test_attention_views_of_an_empty_batch_check_the_count(admitted):
    """0 slots and ``num_reqs = [3]``: every other manager op records the count; so does this one (a
    (K, 0) grid ran no program, so nothing checked it). ``admitted [2, 0]`` is two empty steps (it
    raised torch's RuntimeError)."""
    m = _manager()
    v = m.attention_views([], [], admitted=admitted)
    m.pool.check()
    assert v.kv_indptr.tolist() == [[0]] * (1 if admitted is None else 2)
    m.attention_views([], [], num_reqs=torch.tensor([3], dtype=i32), admitted=admitted)
    with pytest.raises(InvalidArgumentError, match="attention_views"):
        m.pool.check()


# ---- the FlashInfer reference with no page at all -----------------------------------------------------
@pytest.mark.parametrize("max_pages", [0, 2])
def test_flashinfer_reference_with_no_page_gives_zeros(max_pages):
    """A burst step in which every lane stopped: ``kv_indptr`` all 0, ``kv_indices`` empty (was an
    IndexError)."""
    z = torch.zeros(2, dtype=i32)
    out = paged_attention_flashinfer(q1, kc, kc, torch.zeros(3, dtype=i32), torch.zeros(0, dtype=i32), z, max_pages)
    assert out.shape == q1.shape and out.abs().sum() == 0


def test_flashinfer_reference_reads_a_length_as_flashinfer_does():
    """``(pages - 1) * page_size + kv_last_page_len``, and 0 for a lane without pages whatever its
    ``kv_last_page_len`` (FlashInfer's ``paged_kv_t::get_length``): an empty lane gives zeros with 1
    (the views' value, vLLM's for a padded lane) or 0 alike; on a CPU the reference refuses a lane with
    pages whose last page is outside 1..page_size."""
    ptr = torch.tensor([0, 0, 1], dtype=i32)
    outs = [paged_attention_flashinfer(q1, kc, kc, ptr, ix, torch.tensor([e, 3], dtype=i32), 2) for e in (1, 0, BS)]
    assert all(o[0].abs().sum() == 0 for o in outs) and all(torch.equal(o, outs[0]) for o in outs)
    for last in ([0, 3], [5, 3], [2, 0]):  # a lane with pages and 0; past the page
        with pytest.raises(InvalidArgumentError, match="kv_last_page_len"):
            paged_attention_flashinfer(q1, kc, kc, ip, ix, torch.tensor(last, dtype=i32), 2)


# ---- typed errors, nothing changed --------------------------------------------------------------------
@pytest.mark.parametrize("call,error", [
    (lambda: paged_attention(q, kc, kc, bt, seq, scale="x"), ArgumentTypeError),
    (lambda: paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, 2, scale="x"), ArgumentTypeError),
    (lambda: attention(q, kv, kv, seq, scale=True), ArgumentTypeError),
    (lambda: attention(q, kv, kv, seq, scale=float("nan")), InvalidArgumentError),
    (lambda: paged_attention(q, kc, kc, bt, seq, scale=float("-inf")), InvalidArgumentError),
    (lambda: paged_attention_flashinfer(q1, kc, kc, ip, ix, lp, 2**40), InvalidArgumentError),  # 8 TiB was tried
    (lambda: paged_attention(q, kc, kc, torch.tensor([[1, 9], [3, 0]], dtype=i32), seq), InvalidArgumentError),
    (lambda: paged_attention(q, kc, kc, bt, torch.tensor([9, 3], dtype=i32)), InvalidArgumentError),
    (lambda: paged_attention_flashinfer(q1, kc, kc, torch.tensor([0, 2, 9], dtype=i32), ix, lp, 8),
     InvalidArgumentError),
    (lambda: AttentionViews.empty(2, 2, device="bogus"), InvalidArgumentError),
    (lambda: PagedKVCache(1, 2, BS, 1, 2, device=2**63), InvalidArgumentError),  # was torch's ValueError
    (lambda: AttentionViews.empty(2**20, 2**20), InvalidArgumentError),
    (lambda: AttentionViews.empty(2, 2, steps=True), ArgumentTypeError),
    (lambda: PagedKVCache(1, 4, BS, 1, 2, dtype="float16"), ArgumentTypeError),
    (lambda: store_kv(kc[0], kc[0], kc, kc, torch.tensor([0, 1, 2, 3])), InvalidArgumentError),  # K is V
], ids=["scale-str", "flashinfer-scale-str", "scale-bool", "scale-nan", "scale-inf", "max-pages-2**40",
        "block-past-cache", "length-past-row", "indptr-past-indices", "device-bogus", "device-2**63", "views-2**40",
        "steps-bool", "dtype-str", "k-is-v"])
def test_consumer_errors_are_typed(call, error):
    before = [t.clone() for t in (q, kv, kc, bt, seq, q1, ip, ix, lp)]
    with pytest.raises(error):
        call()
    assert _same(before, (q, kv, kc, bt, seq, q1, ip, ix, lp))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_without_cuda_is_a_typed_error():
    with pytest.raises(InvalidArgumentError):  # was torch's AssertionError
        AttentionViews.empty(2, 2, device="cuda")
    with pytest.raises(InvalidArgumentError):
        PagedKVCache(1, 2, BS, 1, 2, device="cuda")
