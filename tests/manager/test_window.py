"""Decode windows (docs/semantics.md section 9): the device window equals the reference window step by
step, with stops freed inside the window, speculative advances, preemption, every group, generated
blocks hashed on the device and admissions read with the window; and the single rules, each shown on a
small case the wrong rule fails (a stop ignored, an advance off by one, a rejected draft's block freed,
preemption of the first lane instead of the last)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.errors import InvalidArgumentError, InvalidCountError, PoolError
from gpupool.keys import hash_request_tokens
from gpupool.manager import KVCacheManager
from gpupool.reference import ReferenceKVCacheManager
from gpupool.reference.window import ReferenceDecodeWindow
from gpupool.window import DecodeWindow
from harness.compare import assert_managers_agree
from harness.state import manager_snapshot, manager_state
from harness.window_pair import WindowPair

BS = 4
POOL = dict(block_size=BS, max_num_reqs=4, max_blocks_per_req=8)
SW = ("sliding_window", 8)

CONFIGS = {  # a name: (WindowPair's keywords)
    "K2": dict(K=2, num_blocks=10),
    "K4-D1-events": dict(K=4, D=1, events=True, num_blocks=12),
    "K2-D2-sw-hbs2": dict(K=2, D=2, groups=("full", SW), num_blocks=16, hash_block_size=2),
    "K3-full+full-exact": dict(K=3, groups=("full", "full"), num_blocks=14, events=True, parallel=False),
}


def drive(seed: int, rounds: int, **cfg) -> WindowPair:
    pair = WindowPair(random.Random(seed), **cfg)
    for _ in range(rounds):
        pair.admit()
        pair.window()
    return pair


@pytest.mark.heavy("K4-D1-events")
@pytest.mark.parametrize("name", ["K2", "K4-D1-events"])
def test_window_equals_reference_step_by_step(name):
    """A few windows of the quick configurations: admissions (hits, head-of-line, blocked after a
    preemption), prefills' tokens appended, then windows with random stops, accepted counts and tokens;
    every step's outputs and each window's whole state equal the reference's."""
    pair = drive(0, 3, **CONFIGS[name])
    assert pair.windows == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
@settings(deadline=None, max_examples=2)  # each example is 6 windows in the interpreter: ~15 s on a quiet core
@given(seed=st.integers(0, 2**20))
def test_window_hunt(name, seed):
    """The differential hunt over every configuration (slow): 6 windows an example (the deep hunt:
    GPUPOOL_HYPOTHESIS_PROFILE=deep raises the examples of the other properties, not these: run this
    test with ``--hypothesis-seed`` values, or the harness in a loop, for longer)."""
    drive(seed, 6, **CONFIGS[name])


@pytest.mark.slow
def test_the_hunt_meets_stops_preemptions_and_hits():
    """The workload the hunt draws does exercise what it checks: over a few seeds, lanes stop inside
    windows, lanes are preempted, prompts hit cached prefixes."""
    counts = {"stopped": 0, "preempted": 0, "hit_tokens": 0}
    for seed in range(3):
        pair = drive(seed, 8, **CONFIGS["K4-D1-events"])
        for k in counts:
            counts[k] += pair.counts[k]
    assert all(v > 0 for v in counts.values()), counts


# ---- one rule at a time ------------------------------------------------------------------------------
def two_requests(m, prompts=((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14)), hashing=True):
    """Admit ``prompts`` into slots 0, 1 and append each one's first sampled token (100 + slot)."""
    for r, p in enumerate(prompts):
        hs = hash_request_tokens(list(p), BS)
        tail = list(p[len(hs) * BS:]) if hashing else None
        if isinstance(m, ReferenceKVCacheManager):
            assert m.admit([r], [hs], [len(p)], [tail])[0] == [True]
            m.append_tokens([r], [[100 + r]])
        else:
            assert m.admit([r], [hs], [len(p)], [tail])[0].tolist() == [1]
            m.append_tokens([r], [1], torch.tensor([[100 + r]]))
    return [len(p) + 1 for p in prompts]


def twins(num_blocks: int, **kw):
    return ReferenceKVCacheManager(num_blocks, **POOL, **kw), KVCacheManager(num_blocks, device="cpu", **POOL, **kw)


def test_a_stopped_lane_is_freed_inside_the_window_and_its_blocks_serve_another():
    """Two requests of 8 tokens (2 blocks each) in a pool of 4 usable blocks: at step 1 lane 1 needs its
    third block, and only lane 0's stop at pass 0 frees one in time; without the stop lane 1 would be
    preempted. The device frees at step 1, and the reference agrees."""
    ref, dev = twins(5)
    ntok = two_requests(ref)
    two_requests(dev)
    rw, dw = ReferenceDecodeWindow(ref, 2, 2), DecodeWindow(dev, 2, 2)
    rw.begin([0, 1], ntok)
    dw.set_inputs([0, 1], ntok)
    dw.begin()
    out0 = rw.step(0)
    dw.step(0)
    assert out0.admitted == [True, True] == [bool(x) for x in dw.admitted[0].tolist()]
    free_before = dev.pool.get_num_free_blocks()
    out1 = rw.step(1, [1, 0], [1, 1], [[7], [8]])
    dw.stopped[:2] = torch.tensor([1, 0], dtype=torch.int32)
    dw.tokens[:2, 0] = torch.tensor([7, 8])
    dw.step(1)
    assert out1.admitted == [False, True] == [bool(x) for x in dw.admitted[1].tolist()]
    assert dw.preempt_step.tolist()[:2] == [-1, -1] and dw.stop_step.tolist()[:2] == [0, -1]
    assert free_before == 0  # lane 1's block at step 1 came from lane 0's stop
    rw.end([0, 0], [1, 1], [[0], [9]])
    dw.stopped.zero_()
    dw.tokens[:2, 0] = torch.tensor([0, 9])
    dw.end()
    res = dw.read()
    assert (res.stop_step, res.preempt_step, res.num_tokens) == ([0, -1], [-1, -1], [ntok[0], ntok[1] + 2])
    assert_managers_agree(ref, dev)


def test_a_lane_that_does_not_fit_preempts_the_last_lane_not_the_first():
    """Three requests, a pool that holds their next blocks for two: vLLM preempts the LAST running
    request (lane 2) so that lanes 0 and 1 advance; the window reports it and admits nobody after."""
    ref, dev = twins(8)
    prompts = ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14), (15, 16, 17, 18, 19, 20, 21))
    for m in (ref, dev):
        for r, p in enumerate(prompts):
            hs = hash_request_tokens(list(p), BS)
            m.admit([r], [hs], [len(p)])
    dev.pool.check()
    rw, dw = ReferenceDecodeWindow(ref, 3, 1), DecodeWindow(dev, 3, 1)
    rw.begin([0, 1, 2], [9, 9, 9])
    dw.set_inputs([0, 1, 2], [9, 9, 9])
    dw.begin()
    out = rw.step(0)
    dw.step(0)
    assert out.admitted == [True, True, False] == [bool(x) for x in dw.admitted[0].tolist()]
    assert rw.preempt_step == [-1, -1, 0] == dw.preempt_step.tolist()
    rw.end()
    dw.end()
    res = dw.read()
    assert res.any_preempted
    assert_managers_agree(ref, dev)
    # nobody is admitted after a window that preempted
    hs = hash_request_tokens([1, 2, 3, 4], BS)
    adm, _ = dev.admit([2], [hs], [4], blocked=dw.flags[:1])
    assert adm.tolist() == [0] and ref.admit([2], [hs], [4], blocked=True)[0] == [False]
    dev.pool.check()
    assert_managers_agree(ref, dev)


def test_rejected_drafts_keep_their_blocks_and_their_slots_are_reused():
    """D = 3 lookahead positions booked at step 0; pass 0 accepts 1 token: the blocks stay with the
    request (vLLM keeps them) and step 1's queries start one position later, on the same slots."""
    ref, dev = twins(16)
    ntok = two_requests(ref)
    two_requests(dev)
    rw, dw = ReferenceDecodeWindow(ref, 2, 2, 3), DecodeWindow(dev, 2, 2, 3)
    rw.begin([0, 1], ntok)
    dw.set_inputs([0, 1], ntok)
    dw.begin()
    out0 = rw.step(0)
    dw.step(0)
    rows0 = [dev.rows(0)[r] for r in (0, 1)]
    out1 = rw.step(1, [0, 0], [1, 2], [[5, 6, 7, 8], [9, 10, 11, 12]])
    dw.accepted[:2] = torch.tensor([1, 2], dtype=torch.int32)
    dw.tokens[:2] = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    dw.step(1)
    assert [dev.rows(0)[r][:len(rows0[r])] for r in (0, 1)] == rows0  # no block given back
    q = 4
    assert dw.slot_mapping[0, 1, :q].tolist() == out1.slot_mapping[0][:q] == out0.slot_mapping[0][1:q] + \
        [out1.slot_mapping[0][q - 1]]
    assert dw.seq[1, :2].tolist() == [ntok[0] + 1 + 3, ntok[1] + 2 + 3] == out1.seq_lens
    assert_managers_agree(ref, dev)


def test_generated_blocks_are_keyed_as_vllm_keys_them_and_a_second_turn_hits_them():
    """A request decodes through a window past a block boundary; its block of generated tokens gets the
    key vLLM's hash of those tokens gives (hashed on the device), so a request whose prompt is that
    conversation hits it."""
    ref, dev = twins(16)
    prompt = [1, 2, 3, 4, 5, 6]
    for m in (ref, dev):
        hs = hash_request_tokens(prompt, BS)
        m.admit([0], [hs], [len(prompt)], [prompt[len(hs) * BS:]])
    ref.append_tokens([0], [[70000]])
    dev.append_tokens([0], [1], torch.tensor([[70000]]))
    gen = [70000, 300, 2**31 - 1, 5]
    rw, dw = ReferenceDecodeWindow(ref, 1, 3), DecodeWindow(dev, 1, 3)
    rw.begin([0], [7])
    dw.set_inputs([0], [7])
    dw.begin()
    rw.step(0)
    dw.step(0)
    for k, t in ((1, gen[1]), (2, gen[2])):
        rw.step(k, [0], [1], [[t]])
        dw.tokens[0, 0] = t
        dw.step(k)
    rw.end([0], [1], [[gen[3]]])
    dw.tokens[0, 0] = gen[3]
    dw.end()
    dw.read()
    convo = prompt + gen  # 10 tokens: block 1 holds 5, 6 and two generated tokens
    want = hash_request_tokens(convo, BS)
    blocks = dev.rows(0)[0]
    dev.pool.check()
    assert dev.pool.block_keys(blocks[1]) == [(want[1], 0)]  # keyed at step 1 (its last token the input)
    assert ref.hashes[0] == want
    assert_managers_agree(ref, dev)
    for m in (ref, dev):
        m.free([0])
    _, hits = dev.admit([1], [want], [len(convo)])
    assert hits.tolist() == [8] and ref.admit([1], [want], [len(convo)])[1] == [8]
    dev.pool.check()
    assert_managers_agree(ref, dev)


# ---- errors: typed, nothing changed -------------------------------------------------------------------
@pytest.mark.heavy("token past int32", "past the row")
@pytest.mark.parametrize("bad", ["accepted 0", "accepted past Q", "token past int32", "past the row"])
def test_a_bad_model_output_is_a_typed_error_and_changes_nothing(bad):
    ref, dev = twins(16)
    ntok = two_requests(dev)
    dw = DecodeWindow(dev, 2, 2, 1)
    dw.set_inputs([0, 1], ntok)
    dw.begin()
    dw.step(0)
    dev.pool.check()
    before = manager_snapshot(dev)
    if bad == "accepted 0":
        dw.accepted[1] = 0
    elif bad == "accepted past Q":
        dw.accepted[1] = 3
    elif bad == "token past int32":
        dw.tokens[0, 0] = 2**31
    else:
        dw.accepted[0] = 2
        dw.lane_tokens[0] = 8 * BS - 2
    dw.step(1)
    err = InvalidArgumentError if bad == "token past int32" else InvalidCountError
    with pytest.raises(err, match="window_step"):
        dev.pool.check()
    assert manager_snapshot(dev) == before


ROW = POOL["max_blocks_per_req"] * BS


@pytest.mark.heavy("begin-past-row-0", "begin-zero-0", "step-past-row-0", "end-past-row-0")
@pytest.mark.parametrize("D", [0, 3])
@pytest.mark.parametrize("where, ntok, accepted, lane", [  # (call, token counts, pass's accepted counts, bad lane)
    ("begin", lambda D: [8, ROW - D + 1], None, 1),  # past the row less the lookahead
    ("begin", lambda D: [0, 8], None, 0),  # below 1
    ("step", lambda D: [8, ROW - D - min(D, 1)], lambda D: [1, 1 + min(D, 1)], 1),  # pass 0: past the row less D
    ("end", lambda D: [8, ROW - D], lambda D: [1, D + 1], 1),  # the last pass takes lane 1 past the row
], ids=["begin-past-row", "begin-zero", "step-past-row", "end-past-row"])
def test_a_bad_token_count_is_the_same_error_on_both_windows(D, where, ntok, accepted, lane):
    """The same token count out of range, through the reference window and the device window with D
    lookahead tokens: the same class, op, value and text, which names the count the caller gave (or the
    pass made), its true bound (``max_blocks_per_req * block_size - D`` while steps follow, the row at
    the end) and the lane's slot; both managers as before the failing call."""
    ref, dev = twins(24)
    two_requests(ref)
    two_requests(dev)
    ntok, slots = ntok(D), [1, 0]  # lane i is slot 1 - i: the text names the slot, not the lane
    K = 2 if where == "step" else 1
    rw, dw = ReferenceDecodeWindow(ref, 2, K, D), DecodeWindow(dev, 2, K, D)
    acc = None if accepted is None else accepted(D)
    toks = [[7] * (D + 1), [8] * (D + 1)]

    def reference():
        rw.begin(slots, ntok)
        rw.step(0)
        return rw.step(1, [0, 0], acc, toks) if where == "step" else rw.end([0, 0], acc, toks)

    with pytest.raises(PoolError) as r_err:
        reference()
    dw.set_inputs(slots, ntok)
    dw.begin()
    if where != "begin":
        dw.step(0)
        dev.pool.check()
        dw.accepted[:2] = torch.tensor(acc, dtype=torch.int32)
        dw.tokens[:2] = torch.tensor(toks)
        dw.step(1) if where == "step" else dw.end()
    with pytest.raises(PoolError) as d_err:
        dev.pool.check()
    bad = ntok[lane] + (0 if acc is None else acc[lane])
    op, bound = {"begin": ("window_begin", ROW - D), "step": ("window_step", ROW - D), "end": ("window_end", ROW)}[where]
    assert type(r_err.value) is InvalidCountError, r_err.value
    assert str(r_err.value) == f"{op}: token count {bad} outside 1..{bound} for slot {slots[lane]}"
    assert (type(d_err.value), d_err.value.op, d_err.value.value, str(d_err.value)) == \
        (type(r_err.value), r_err.value.op, r_err.value.value, str(r_err.value))
    assert_managers_agree(ref, dev)


def test_steps_out_of_order_are_refused():
    _, dev = twins(16)
    dw = DecodeWindow(dev, 2, 2)
    dw.set_inputs([], [])
    dw.begin()
    with pytest.raises(InvalidArgumentError, match="out of order"):
        dw.step(1)
    with pytest.raises(InvalidArgumentError):
        DecodeWindow(dev, 0, 2)
    with pytest.raises(InvalidArgumentError):
        DecodeWindow(dev, 2, 2, num_lookahead_tokens=8 * BS)


@pytest.mark.parametrize("call", [
    lambda m: m.admit([0], [[b"x" * 31]], [4], [[1]]),  # a tail needs 32-byte hashes
    lambda m: m.admit([0], [[]], [4], [[1, 2, 3, 4]]),  # a tail of a whole block
    lambda m: m.admit([0], [[]], [0]),  # no token
    lambda m: m.admit([0], [[]], [8 * BS + 1]),  # past the row
    lambda m: m.admit([0, 1], [[]], [4]),  # lengths
    lambda m: m.admit([0], "abc", [4]),  # types
    lambda m: m.admit([0], [[]], [4], [[2**31]]),  # a token past int32
])
def test_admit_refuses_bad_arguments_at_once(call):
    ref, dev = twins(16)
    want = manager_state(ref)
    before = manager_snapshot(dev)
    for m in (ref, dev):
        with pytest.raises(PoolError):
            call(m)
    assert manager_snapshot(dev) == before and manager_state(ref) == want


def test_admit_into_a_slot_in_use_is_recorded_and_changes_nothing():
    ref, dev = twins(16)
    two_requests(dev)
    dev.pool.check()
    before = manager_snapshot(dev)
    dev.admit([2, 1], [[], []], [4, 4])
    with pytest.raises(InvalidArgumentError, match="admit"):
        dev.pool.check()
    assert manager_snapshot(dev) == before
