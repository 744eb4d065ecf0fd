"""FlashInfer's decode planned from a decode window (gpupool/flashinfer.py, docs/kv_cache.md section 5),
against a stand-in wrapper that does what FlashInfer 0.5's ``BatchDecodeWithPagedKVCacheWrapper`` does
in CUDA-graph mode (fixed buffers; ``plan`` copies the host indptr and last-page lengths into them and
schedules from the host copies) and runs the reference FlashInfer attention on its buffers: the plan
reads nothing from the device, each step's kernel reads the rows the window wrote at that step, the
planned lengths bound the true ones, and the attention equals FlashAttention's route."""
from __future__ import annotations

import random

import pytest
import torch

from gpupool.errors import ArgumentTypeError, InvalidArgumentError, InvalidCountError
from gpupool.flashinfer import WindowDecodePlan, length_bounds, paged_layout
from gpupool.instrument import Meter, reads_not_synced
from gpupool.keys import hash_request_tokens
from gpupool.kv_cache import paged_attention, paged_attention_flashinfer
from gpupool.manager import KVCacheManager
from gpupool.window import DecodeWindow

BS, M, HQ, HKV, HD = 4, 8, 2, 1, 8


class StandInDecodeWrapper:
    """FlashInfer 0.5's decode wrapper in CUDA-graph mode, as far as the plan goes (decode.py ``plan``)."""

    def __init__(self, workspace, kv_layout, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD" and use_cuda_graph
        self.indptr_buf, self.indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_buf = paged_kv_last_page_len_buffer
        self.batch = len(paged_kv_last_page_len_buffer)
        self.planned = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        for t in (indptr, indices, last_page_len):
            assert t.dtype == torch.int32
        assert len(last_page_len) == self.batch and len(indices) <= len(self.indices_buf)
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"  # no read of the device
        with reads_not_synced():  # FlashInfer reads these host tensors on the host: no device sync
            assert ((last_page_len >= 1) & (last_page_len <= page_size)).all()  # FlashInfer's documented range
            pages = indptr[1:] - indptr[:-1]
            lens = torch.where(pages > 0, (pages - 1) * page_size + last_page_len, 0).tolist()  # get_length
        self.indptr_buf.copy_(indptr)
        self.last_buf.copy_(last_page_len)
        self.indices_buf[:len(indices)].copy_(indices)
        self.planned = (lens, (num_qo_heads, num_kv_heads, head_dim, page_size), kw)

    def run(self, q, kv_cache):
        k_cache, v_cache = kv_cache
        return paged_attention_flashinfer(q, k_cache, v_cache, self.indptr_buf, self.indices_buf, self.last_buf, M)


def setup(num_requests=3, num_blocks=24, steps=3, views=True, D=0):
    m = KVCacheManager(num_blocks, block_size=BS, max_num_reqs=4, max_blocks_per_req=M, device="cpu")
    ntok = []
    for r in range(num_requests):
        p = list(range(10 * r + 1, 10 * r + 6 + 2 * r))
        m.admit([r], [hash_request_tokens(p, BS)], [len(p)], [p[len(p) // BS * BS:]])
        m.append_tokens([r], [1], torch.tensor([[100 + r]]))
        ntok.append(len(p) + 1)
    w = DecodeWindow(m, 4, steps=steps, num_lookahead_tokens=D, views=views)
    return m, w, ntok


def workspace():
    return torch.zeros(1024, dtype=torch.uint8)


def test_the_plan_reads_nothing_and_each_step_reads_the_rows_the_window_wrote():
    """Three lanes, K = 3, lane 1 stopping at pass 0: the wrappers' buffers are the window's rows; the
    plan makes no host read; at each pass the true lengths are at most the planned ones (0 for the
    stopped lane), and FlashInfer's attention over the rows equals FlashAttention's over the table."""
    m, w, ntok = setup()
    plan = WindowDecodePlan(w, workspace(), wrapper_class=StandInDecodeWrapper)
    v = w.views[0]
    for k, fw in enumerate(plan.wrappers):
        assert fw.indptr_buf.data_ptr() == v.kv_indptr[k].data_ptr()
        assert fw.indices_buf.data_ptr() == v.kv_indices[k].data_ptr()
        assert fw.last_buf.data_ptr() == v.kv_last_page_len[k].data_ptr()
    w.set_inputs([0, 1, 2], ntok)
    with Meter() as meter:
        plan.plan(HQ, HKV, HD, q_data_type=torch.float32)
    assert meter.syncs == 0
    assert all(fw.planned[2]["disable_split_kv"] is True for fw in plan.wrappers)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(24, BS, HKV, HD, generator=g, dtype=torch.float64)
    v_cache = torch.randn(24, BS, HKV, HD, generator=g, dtype=torch.float64)
    seen = []

    def forward(win, k):
        planned = plan.wrappers[k].planned[0]
        true = win.views[0].seqused_k[k].tolist()
        assert all(t <= p for t, p in zip(true, planned)), (k, true, planned)
        q = torch.randn(4, HQ, HD, generator=g, dtype=torch.float64)
        out = plan.wrappers[k].run(q, (k_cache, v_cache))
        ref = paged_attention(q[:, None], k_cache, v_cache, win.views[0].block_table, win.views[0].seqused_k[k])[:, 0]
        torch.testing.assert_close(out, ref)
        seen.append(true)
        win.stopped[:3] = torch.tensor([0, 1 if k == 0 else 0, 0], dtype=torch.int32)
        win.tokens[:3, 0] = torch.tensor([7, 8, 9])

    w.run(forward)
    assert seen[0][:3] == ntok and seen[1][1] == 0 and seen[1][0] == ntok[0] + 1
    assert w.read().stop_step == [-1, 0, -1]


def test_bounds_cover_every_advance():
    """``length_bounds`` at step k is num_tokens + k * Q + D: what k passes accepting every token give."""
    assert length_bounds([5, 9], 0, 1, 32) == [5, 9]
    assert length_bounds([5, 9], 2, 3, 32) == [5 + 6 + 2, 9 + 6 + 2]
    assert length_bounds([30], 3, 1, 32) == [32]  # at most a row


def test_paged_layout_gives_empty_lanes_a_last_page_of_one_as_the_views_do():
    """FlashInfer's layout on the host for lengths 0, 1, 4, 5 and a padded lane: empty lanes 1 (as the
    views kernel writes them), the others ``(n - 1) % page + 1``; indptr the pages' prefix sum."""
    indptr, last = paged_layout([0, 1, 4, 5], 5, 4)
    assert indptr.tolist() == [0, 0, 1, 2, 4, 4] and last.tolist() == [1, 1, 4, 1, 1]
    m, w, ntok = setup(num_requests=2, steps=1)
    w.set_inputs([0, 1], ntok)
    w.run()
    v = w.views[0]
    indptr, last = paged_layout(v.seqused_k[0].tolist(), 4, BS)
    assert v.kv_indptr[0].tolist() == indptr.tolist() and v.kv_last_page_len[0].tolist() == last.tolist()


@pytest.mark.heavy("group type", "workspace dtype", "workspace type", "before set_inputs")
@pytest.mark.parametrize("case", ["drafts", "no views", "group", "group type", "workspace dtype", "workspace type",
                                  "before set_inputs", "split-kv"])
def test_refusals(case):
    """Each misuse is a typed error naming what is wrong."""
    m, w, ntok = setup(D=1 if case == "drafts" else 0, views=case != "no views")
    kw = dict(wrapper_class=StandInDecodeWrapper)
    ws = workspace()
    if case in ("drafts", "no views"):
        with pytest.raises(InvalidArgumentError, match="draft|views"):
            WindowDecodePlan(w, ws, **kw)
    elif case == "group":
        with pytest.raises(InvalidArgumentError, match="group 1"):
            WindowDecodePlan(w, ws, 1, **kw)
    elif case == "group type":
        with pytest.raises(ArgumentTypeError):
            WindowDecodePlan(w, ws, "0", **kw)
    elif case == "workspace dtype":
        with pytest.raises(InvalidArgumentError, match="uint8"):
            WindowDecodePlan(w, torch.zeros(8), **kw)
    elif case == "workspace type":
        with pytest.raises(ArgumentTypeError):
            WindowDecodePlan(w, b"1234", **kw)
    elif case == "before set_inputs":
        with pytest.raises(InvalidArgumentError, match="set_inputs"):
            WindowDecodePlan(w, ws, **kw).plan(HQ, HKV, HD)
    else:
        plan = WindowDecodePlan(w, ws, **kw)
        w.set_inputs([0], ntok[:1])
        with pytest.raises(InvalidArgumentError, match="split-KV"):
            plan.plan(HQ, HKV, HD, disable_split_kv=False)


def test_without_flashinfer_the_plan_says_how_to_install_it():
    try:
        import flashinfer  # noqa: F401
        pytest.skip("flashinfer is installed")
    except ImportError:
        pass
    m, w, ntok = setup()
    with pytest.raises(InvalidArgumentError, match="pip install flashinfer-python"):
        WindowDecodePlan(w, workspace())


def test_a_random_window_stays_inside_its_bounds():
    """Random stops over K = 4 with 4 lanes: every step's true lengths stay at or under the plan."""
    rng = random.Random(1)
    m, w, ntok = setup(num_requests=4, num_blocks=40, steps=4)
    plan = WindowDecodePlan(w, workspace(), wrapper_class=StandInDecodeWrapper)
    w.set_inputs([0, 1, 2, 3], ntok)
    plan.plan(HQ, HKV, HD)

    def forward(win, k):
        true = win.views[0].seqused_k[k].tolist()
        assert all(t <= p for t, p in zip(true, plan.wrappers[k].planned[0]))
        win.stopped.copy_(torch.tensor([int(rng.random() < 0.3) for _ in range(4)], dtype=torch.int32))
        win.tokens[:, 0] = torch.tensor([rng.randrange(50) for _ in range(4)])

    w.run(forward)
    m.pool.check()


@pytest.mark.parametrize("num_tokens", [0, -50, 8 * BS + 1])
def test_a_plan_from_inputs_the_window_refuses_is_refused_and_writes_nothing(num_tokens):
    """The window's begin refuses a token count outside 1 .. max_blocks_per_req * block_size - D and then
    writes no view row: a plan of such inputs (a decreasing ``kv_indptr`` for a negative count) would
    stay in the wrappers' buffers, which the captured kernel reads. The plan refuses it as begin words
    it, and leaves the rows as they were."""
    m, w, ntok = setup()
    plan = WindowDecodePlan(w, workspace(), wrapper_class=StandInDecodeWrapper)
    w.set_inputs([0, 1, 2], [ntok[0], num_tokens, ntok[2]])
    rows = [t.clone() for t in w.views[0]]
    with pytest.raises(InvalidCountError, match=f"token count {num_tokens} outside 1..{M * BS} for slot 1"):
        plan.plan(HQ, HKV, HD)
    assert all(torch.equal(a, b) for a, b in zip(rows, w.views[0]))
    assert all(fw.planned is None for fw in plan.wrappers)


@pytest.mark.heavy("bounds queries 0", "layout past int32", "bounds k -1", "layout lanes past batch", "heads str",
                    "a manager")
@pytest.mark.parametrize("case", ["window None", "a manager", "heads str", "heads 0", "page_size", "layout page 0",
                                  "layout lanes past batch", "layout negative", "layout past int32", "bounds k -1",
                                  "bounds queries 0"])
def test_bad_arguments_are_typed_errors(case):
    """Every public call of the module refuses a wrong argument with a PoolError naming it, before
    FlashInfer sees it."""
    m, w, ntok = setup()
    kw = dict(wrapper_class=StandInDecodeWrapper)
    err = ArgumentTypeError if case in ("window None", "a manager", "heads str") else InvalidArgumentError
    with pytest.raises(err):
        if case.startswith("layout"):
            paged_layout(*{"layout page 0": ([5], 1, 0), "layout lanes past batch": ([5, 5], 1, 4),
                           "layout negative": ([-3], 1, 4), "layout past int32": ([2**40], 1, 4)}[case])
        elif case.startswith("bounds"):
            length_bounds([5], *{"bounds k -1": (-1, 1, 32), "bounds queries 0": (0, 0, 32)}[case])
        elif case in ("window None", "a manager"):
            WindowDecodePlan(None if case == "window None" else m, workspace(), **kw)
        else:
            plan = WindowDecodePlan(w, workspace(), **kw)
            w.set_inputs([0, 1, 2], ntok)
            heads = {"heads str": ("2", HKV, HD), "heads 0": (0, HKV, HD)}.get(case, (HQ, HKV, HD))
            plan.plan(*heads, **({"page_size": BS} if case == "page_size" else {}))
