"""The decode step (gpupool/graph.py, docs/semantics.md section 7): eagerly on any device it equals the
reference window's step (a ``ReferenceDecodeWindow`` of one step: the finished requests freed, the
copies released, vLLM's preemption of the last lanes; the whole state after every step); on CUDA, a
captured graph replayed 1,000 times with changing inputs equals the eager path, makes no host
synchronisation, and an error inside a replay changes nothing; its launches do not depend on the
batch size.

Bad input: entries past ``num_reqs`` / ``num_finished`` are never read; a bad slot, token count or
count, or a step whose free would succeed but whose allocation would fail, changes every device
tensor and the host state not at all, names the first bad slot as the reference window does (op
``window_begin``) and admits nobody; bad KV-cache tensors are refused on the host before any launch;
a pending copy survives a failed step."""
from __future__ import annotations

import random

import pytest
import torch

from gpupool.errors import ArgumentTypeError, InvalidArgumentError, PoolError
from gpupool.graph import DecodeStep
from gpupool.manager import KVCacheManager
from harness.compare import assert_managers_agree
from harness.keys import h
from gpupool.instrument import Meter
from harness.device import cpu_i32
from harness.ops import fail_a_batched_op, fill_step as fill, reference_decode_step
from harness.sizes import sized
from harness.state import manager_snapshot, pool_state, raw_state, same_raw_state
from harness.twins import SMALL_BS, SMALL_GROUP_IDS, SMALL_GROUPS, SW, manager_twin, small_manager, small_manager_twin

BS = 4


CONFIG = dict(block_size=BS, max_num_reqs=6, max_blocks_per_req=16)


def make(groups=("full",), n=48, **kw) -> KVCacheManager:
    return KVCacheManager(n, groups=groups, **CONFIG, **kw)


def twin(groups=("full",), n=48, **kw):
    """A reference and a device manager with this file's configuration (harness.twins.manager_twin)."""
    return manager_twin(n, groups=groups, **CONFIG, **kw)


def drive(step_fn, ref, dev, steps, seed, dev_manager):
    """Random decode traffic: requests join (prefill through allocate_slots), decode one token per
    step through the DecodeStep, and finish; the reference is the same step on the reference manager
    (harness.ops.reference_decode_step: a reference window of one step, vLLM's preemption of the last
    lanes). After each step the admitted flags and slot mapping of every lane (those past ``num_reqs``
    read 0 / -1) and the two managers' whole state must agree (harness.compare.assert_managers_agree:
    tables, counters, pool, KV events, validate). Returns the number of KV events seen and of lanes
    preempted."""
    rng = random.Random(seed)
    tokens: dict[int, int] = {}
    num_events = num_preempted = 0
    for step in range(steps):
        # joins (host ops + a prefill allocation on both, outside the decode step)
        free_slots = [r for r in range(6) if r not in tokens]
        if free_slots and rng.random() < 0.5:
            r = rng.choice(free_slots)
            n_tok = rng.randint(1, 20)
            hashes = [h(rng.randint(0, 3) * 10 + i) for i in range(n_tok // BS)]
            for m in (ref, dev_manager):
                m.add_request(r, hashes)
            a = ref.allocate_slots([r], [n_tok], [n_tok], [1])
            d = dev_manager.allocate_slots([r], [n_tok], [n_tok], [1]).tolist()
            assert [int(x) for x in a] == d
            if a[0]:
                tokens[r] = n_tok
            else:
                ref.free([r])
                dev_manager.free([r])
        running = sorted(tokens)
        finished = [r for r in running if rng.random() < 0.15]
        decoding = [r for r in running if r not in finished]
        for r in decoding:
            tokens[r] += 1
            if tokens[r] % BS == 0:  # a block filled: its hash is known now
                for m in (ref, dev_manager):
                    m.append_block_hashes(r, [h(1000 + step * 10 + r)])
        ntok = [tokens[r] for r in decoding]
        want = reference_decode_step(ref, decoding, ntok, finished)
        assert want.error is None, want.error
        step_fn(decoding, ntok, finished)
        pad = dev.max_batch - len(decoding)
        assert dev.admitted.tolist() == want.admitted[0] + [0] * pad, step
        assert dev.slot_mapping.tolist() == want.slot_mapping[0] + [-1] * pad, step
        for r in finished:
            del tokens[r]
        for r, p in zip(decoding, want.preempt_step):
            if p >= 0:  # preempted (freed by the step): the scheduler re-queues it
                del tokens[r]
                num_preempted += 1
        ev = assert_managers_agree(ref, dev_manager, where=f"step {step}")  # events: [] with events off
        num_events += len(ev)
    return num_events, num_preempted


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("groups", [("full",), ("full", ("sliding_window", 8))])
@pytest.mark.heavy("groups1-events", "groups1-no-events", "groups0-events")
def test_eager_decode_step_equals_reference(groups, events):
    """Full groups only (``ManagerConfig.SW`` off: no window passes) and with a window; KV events
    off (no event layout) and on (every event row compared)."""
    kw = {"enable_kv_cache_events": events}
    ref, dev_m = twin(groups, n=16, **kw)  # 15 usable blocks for 6 requests of up to 16: lanes are preempted
    step = DecodeStep(dev_m, max_batch=6)

    def run(decoding, ntok, finished):
        fill(step, decoding, ntok, finished)
        step.run()

    num_events, num_preempted = drive(run, ref, step, steps=sized(40, 12), seed=24, dev_manager=dev_m)
    assert (num_events > 0) == events
    assert num_preempted > 0  # the pool is small enough that lanes are preempted


def test_decode_step_error_changes_nothing_and_is_raised_at_check():
    dev_m = make()
    dev_m.add_request(0, [h(1)])
    dev_m.allocate_slots([0], [5], [5], [1])
    step = DecodeStep(dev_m, max_batch=2)
    before = pool_state(dev_m.pool)
    fill(step, [0, 0], [6, 6], [])  # a slot listed twice
    step.run()
    with pytest.raises(InvalidArgumentError):
        dev_m.pool.check()
    assert pool_state(dev_m.pool) == before
    fill(step, [0], [6], [])
    step.run()
    dev_m.pool.check()
    assert step.admitted[0].item() == 1


def test_capture_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the graph tests below run instead")
    step = DecodeStep(make(), max_batch=2)
    with pytest.raises(InvalidArgumentError):
        step.capture()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_step_replays_like_the_reference_for_1000_steps():
    ref, dev_m = twin(n=256, device="cuda")
    step = DecodeStep(dev_m, max_batch=6)
    step.capture()

    def run(decoding, ntok, finished):
        fill(step, decoding, ntok, finished)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    drive(run, ref, step, steps=1000, seed=9, dev_manager=dev_m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreter launches")
def test_decode_step_launches_and_syncs_do_not_depend_on_batch_size():
    """A decode step is the same fixed sequence of launches with no host sync, for 1 or 24 requests
    (the request-parallel path, the exact path that returns at once, ...): nothing loops over
    requests on the host."""
    counts = []
    for batch in (1, 24):
        m = KVCacheManager(256, block_size=BS, max_num_reqs=32, max_blocks_per_req=8)
        for r in range(batch):
            m.add_request(r, [h(1000 * r + i) for i in range(2)])
        m.allocate_slots(list(range(batch)), [7] * batch, [7] * batch, [1] * batch)
        step = DecodeStep(m, 32)
        fill(step, list(range(1, batch)), [8] * (batch - 1), [0])
        with Meter() as c:
            step.run()
        m.pool.check()
        assert step.admitted[: batch - 1].tolist() == [1] * (batch - 1)
        assert m.pool.statistics()["alloc_fallback"] == 0
        counts.append((c.launches, c.syncs))
    assert counts[0] == counts[1], counts
    # the window's begin (check, free), its step (allocate with preemption, slot mapping), the copy release
    assert counts[0] == (3, 0), counts


# =================================================================================================
# Bad input: every input entry of a step is checked before its first op (docs/semantics.md section 3)
# =================================================================================================

@pytest.mark.parametrize("groups", SMALL_GROUPS[:2], ids=SMALL_GROUP_IDS[:2])
def test_decode_step_never_reads_past_num_reqs(groups):
    """Garbage in every input entry past ``num_reqs`` / ``num_finished`` is never read."""
    m = small_manager(groups=groups)
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    step = DecodeStep(m, max_batch=4)
    fill(step, [0], [6])
    step.slots[1:] = cpu_i32([10**9, -7, 2**31 - 1])
    step.num_tokens[1:] = cpu_i32([-(2**31), 10**9, -1])
    step.finished[:] = cpu_i32([-5, 10**9, 77, 3])
    step.run()
    m.pool.check()
    assert step.admitted[0].item() == 1
    assert step.slot_mapping[0].item() == m.rows(0)[0][1] * SMALL_BS + 1
    m.validate()


@pytest.mark.parametrize("field,values", [
    ("slots", [4, 0]), ("slots", [-1, 0]), ("slots", [2**31 - 1, 0]), ("slots", [1, 0]),  # 1: not in use
    ("num_tokens", [-3, 6]), ("num_tokens", [10**9, 6]), ("num_reqs", [5]), ("num_reqs", [-1]),
    ("finished", [4]), ("finished", [-(2**31)]), ("num_finished", [7]), ("num_finished", [-2]),
])
def test_decode_step_bad_input_changes_nothing(field, values):
    """A bad slot, token count or count inside the batch: a PoolError at check() and nothing changed
    (not an IndexError after the step's allocation was committed)."""
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    step = DecodeStep(m, max_batch=4)
    fill(step, [0, 0][:1], [6])
    if field in ("finished", "num_finished"):
        step.num_finished.fill_(1)
    t = getattr(step, field)
    t[: len(values)] = cpu_i32(values)
    if field in ("slots", "num_tokens"):
        step.num_reqs.fill_(len(values))
        if field == "num_tokens":
            step.slots[: len(values)] = cpu_i32([0, 0][: len(values)])
    assert_step_changes_nothing(m, step)
    m.validate()


def assert_step_changes_nothing(m, step):
    """``step.run()`` leaves every device tensor and the host state as they were, with an error
    waiting in the status word."""
    before, raw = manager_snapshot(m), raw_state(m.pool, m)
    step.run()
    assert same_raw_state(raw, raw_state(m.pool, m)) == []
    with pytest.raises(PoolError):
        m.pool.check()
    assert manager_snapshot(m) == before


@pytest.mark.parametrize("finished,slots,ntok", [
    ([1], [0], [0]),  # token count 0: the new token's position would be -1 (after the free and allocation)
    ([1], [4], [6]),  # a bad running slot after a valid finished one
    ([0], [0], [6]),  # a slot both finished and running
    ([1, 1], [0], [6]),  # finished twice
    ([1], [0], [10**6]),
], ids=["ntok0", "bad-slot", "finished-and-running", "finished-twice", "too-many-tokens"])
def test_decode_step_is_all_or_nothing(finished, slots, ntok):
    """A step whose free would succeed but whose allocation or slot mapping would fail changes nothing
    (its inputs are checked before any op)."""
    m = small_manager(groups=("full", SW))
    for r in (0, 1):
        m.add_request(r, [h(r)])
    m.allocate_slots([0, 1], [5, 5], [5, 5], [1, 1])
    m.pool.check()
    step = DecodeStep(m, max_batch=2)
    fill(step, slots, ntok, finished)
    assert_step_changes_nothing(m, step)
    fill(step, [0], [6], [1])
    step.run()
    m.pool.check()
    assert step.admitted[0].item() == 1
    m.validate()


@pytest.mark.parametrize("finished,slots,bad", [
    ([1], [0, 1], 1),  # finished and running: found by the running entry, marked second
    ([1, 1], [0], 1),
    ([2], [0, 3, 3, 1], 3),  # slot 3 is not in use and repeated
    ([1], [3, 1], 1),  # slot 1's first entry (finished) comes before the idle slot 3
], ids=["across-lists", "finished-twice", "idle-and-repeated", "repeat-before-idle"])
def test_decode_step_names_the_first_bad_slot(finished, slots, bad):
    """The step's one-pass slot check (kernels/requests/checks.py mark_tile) reports the slot of the earliest
    bad entry, a repeat at its first occurrence, as the separate checks did, in the reference window's
    words (op ``window_begin``)."""
    ref, m = small_manager_twin()
    for x in (ref, m):
        for r in (0, 1, 2):
            x.add_request(r, [h(r)])
        x.allocate_slots([0, 1, 2], [5, 5, 5], [5, 5, 5], [1, 1, 1])
    m.pool.check()
    want = reference_decode_step(ref, slots, [6] * len(slots), finished).error
    step = DecodeStep(m, max_batch=4)
    fill(step, slots, [6] * len(slots), finished)
    step.run()
    with pytest.raises(InvalidArgumentError) as e:
        m.pool.check()
    assert e.value.op == "window_begin" and e.value.value == bad
    assert (type(e.value), e.value.op, e.value.value, str(e.value)) == (type(want), want.op, want.value, str(want))
    assert_managers_agree(ref, m)


def _decoding_manager():
    m = small_manager()
    for r in (0, 1):
        m.add_request(r, [h(r)])
    m.allocate_slots([0, 1], [5, 5], [5, 5], [1, 1])
    m.pool.check()
    return m


@pytest.mark.parametrize("kv, exc, needle", [
    (lambda n: torch.zeros(n, 4), ArgumentTypeError, "list of tensors"),  # a bare tensor, not a list
    (lambda n: [torch.zeros(4, n).t()], InvalidArgumentError, "contiguous"),
    (lambda n: [torch.zeros(n - 1, 4)], InvalidArgumentError, "blocks"),  # a copy past it would be dropped
    (lambda n: [1], InvalidArgumentError, "not a tensor"),
], ids=["bare-tensor", "non-contiguous", "too-few-blocks", "not-a-tensor"])
def test_bad_kv_caches_fail_before_the_step_runs(kv, exc, needle):
    m = _decoding_manager()
    with pytest.raises(exc, match=needle):
        DecodeStep(m, 2, kv_caches=kv(m.pool.num_blocks))
    before, raw = manager_snapshot(m), raw_state(m.pool, m)
    with pytest.raises(exc, match=needle):
        m.window(2, kv_caches=kv(m.pool.num_blocks))
    with pytest.raises(exc, match=needle):
        m.copy_and_release(kv(m.pool.num_blocks))
    m.pool.check()
    assert same_raw_state(raw, raw_state(m.pool, m)) == [] and manager_snapshot(m) == before


def test_failed_step_admits_nobody():
    """After a step that fails its slot check, ``admitted`` is all 0 (no stale flag from the step
    before) and the slot mapping -1."""
    m = _decoding_manager()
    step = DecodeStep(m, 2)
    fill(step, [0], [6])
    step.run()
    m.pool.check()
    assert step.admitted.tolist() == [1, 0]
    fill(step, [0, 3], [7, 6])  # slot 3 is not in use
    step.run()
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    assert step.admitted.tolist() == [0, 0] and step.slot_mapping.tolist() == [-1, -1]


@pytest.mark.parametrize("groups", SMALL_GROUPS, ids=SMALL_GROUP_IDS)
@pytest.mark.heavy("full+full")
def test_pending_copy_survives_a_failed_step(groups):
    """The issue's repro: cache a block, cow_append it, make a batched op fail, run a step, check(),
    free the request: every block comes back."""
    m = small_manager(groups=groups)
    G = len(groups)
    m.add_request(0, [h(1), h(2)])
    m.allocate_slots([0], [8], [8], [1])
    m.pool.check()
    src = m.rows(0)[0][1]
    m.add_request(1, [h(1)])
    m.allocate_slots([1], [4], [4], [1])
    m.cow_append(1, [src] + [m.rows(g)[0][1] for g in range(1, G)])
    m.validate()
    fail_a_batched_op(m)
    step = DecodeStep(m, max_batch=2)
    fill(step, [0], [9])
    step.run()
    with pytest.raises(PoolError):
        m.pool.check()
    assert int(m.num_copies[0]) == G  # the copies stay pending
    m.validate()
    m.run_pending_copies([])
    m.free([0, 1])
    m.validate()
    assert m.pool.get_num_free_blocks() == 31

