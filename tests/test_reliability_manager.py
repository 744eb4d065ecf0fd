"""Issue #11 (reliability), manager and decode-step level: each reproduction from the issue as a test.

1. the manager's request hashes keep the key registry O(live keys), 2. unchecked slots / positions
in ``DecodeStep`` and ``slot_mapping``, 3. nothing lost to a sticky error (pending copies survive a
failed step, ``free(list)`` changes the host only after the device op succeeded) and ``validate()``
sees a leaked reference (any number of groups), 4. events past an int32 key sequence through
decode steps, 5. two threads on one manager's pool.
"""
from __future__ import annotations


import pytest
import torch

import gpupool.registry as registry_mod
from gpupool.errors import ArgumentTypeError, InvalidArgumentError, InvariantError, PoolError
from gpupool.graph import DecodeStep
from gpupool.kernels.layout import Ctrl
from gpupool.manager import KVCacheManager
from gpupool.reference import ReferenceKVCacheManager
from harness.compare import assert_consistent
from harness.keys import h
from harness.ops import fill_step as fill, run_in_threads
from harness.state import pool_state, raw_state, same_raw_state

BS = 4
SW = ("sliding_window", 8)
GROUPS = [("full",), ("full", "full"), ("full", SW)]
GROUP_IDS = ["full", "full+full", "full+sw"]
M_TOKENS = 8 * BS  # max_blocks_per_req * block_size of make()


def make(cls=KVCacheManager, groups=("full",), n=32, **kw):
    return cls(n, block_size=BS, max_num_reqs=4, max_blocks_per_req=8, groups=groups, **kw)


def i32(v):
    return torch.tensor(list(v), dtype=torch.int32)


def mstate(m: KVCacheManager) -> dict:
    s = m.state
    return {"pool": pool_state(m.pool), "rows": [m.rows(g) for g in range(len(m.groups))],
            "num_computed": s.num_computed.tolist(), "num_cached": s.num_cached.tolist(),
            "active": s.active.tolist(), "num_hashes": s.num_hashes.tolist(),
            "copies": [s.copy_src[: int(s.num_copies)].tolist(), s.copy_dst[: int(s.num_copies)].tolist(),
                       s.copy_release[: int(s.num_copies)].tolist()]}


def fail_a_batched_op(m: KVCacheManager) -> None:
    """Set the pool's status word (a batched free of an out-of-range slot)."""
    m.free(i32([m.max_num_reqs + 3]))


# ---- 1. host memory: request hashes of requests never admitted -------------------------------

def test_manager_registry_bounded_by_live_keys(monkeypatch):
    monkeypatch.setattr(registry_mod, "MIN_SWEEP", 16)
    m = make()
    m.pool.registry._sweep_at = 16
    peak = 0
    for i in range(40):
        m.add_request(i % 4, [h(1000 + 3 * i + j) for j in range(3)])  # never admitted
        if i % 4 == 3:
            m.free([0, 1, 2, 3])
        m.pool.check()
        peak = max(peak, len(m.pool.registry))
    assert peak <= 2 * 16 + 12, peak
    m.validate()


# ---- 2. unchecked slots and positions in the decode step -----------------------------------

@pytest.mark.parametrize("groups", GROUPS[:2], ids=GROUP_IDS[:2])
def test_decode_step_never_reads_past_num_reqs(groups):
    """Garbage in every input entry past ``num_reqs`` / ``num_finished`` is never read."""
    m = make(groups=groups)
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    step = DecodeStep(m, max_batch=4)
    fill(step, [0], [6])
    step.slots[1:] = i32([10**9, -7, 2**31 - 1])
    step.num_tokens[1:] = i32([-(2**31), 10**9, -1])
    step.finished[:] = i32([-5, 10**9, 77, 3])
    step.run()
    m.pool.check()
    assert step.admitted[0].item() == 1
    assert step.slot_mapping[0].item() == m.rows(0)[0][1] * BS + 1
    m.validate()


@pytest.mark.parametrize("field,values", [
    ("slots", [4, 0]), ("slots", [-1, 0]), ("slots", [2**31 - 1, 0]), ("slots", [1, 0]),  # 1: not in use
    ("num_tokens", [-3, 6]), ("num_tokens", [10**9, 6]), ("num_reqs", [5]), ("num_reqs", [-1]),
    ("finished", [4]), ("finished", [-(2**31)]), ("num_finished", [7]), ("num_finished", [-2]),
])
def test_decode_step_bad_input_changes_nothing(field, values):
    """A bad slot, token count or count inside the batch: a PoolError at check() and nothing changed
    (not an IndexError after the step's allocation was committed)."""
    m = make()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    step = DecodeStep(m, max_batch=4)
    fill(step, [0, 0][:1], [6])
    if field in ("finished", "num_finished"):
        step.num_finished.fill_(1)
    t = getattr(step, field)
    t[: len(values)] = i32(values)
    if field in ("slots", "num_tokens"):
        step.num_reqs.fill_(len(values))
        if field == "num_tokens":
            step.slots[: len(values)] = i32([0, 0][: len(values)])
    assert_step_changes_nothing(m, step)
    m.validate()



def assert_step_changes_nothing(m, step):
    """``step.run()`` leaves every device tensor and the host state as they were, with an error
    waiting in the status word."""
    before, raw = mstate(m), raw_state(m.pool, m)
    step.run()
    assert same_raw_state(raw, raw_state(m.pool, m)) == []
    with pytest.raises(PoolError):
        m.pool.check()
    assert mstate(m) == before

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
    m = make(groups=("full", SW))
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
    bad entry, a repeat at its first occurrence, as the separate checks did."""
    m = make()
    for r in (0, 1, 2):
        m.add_request(r, [h(r)])
    m.allocate_slots([0, 1, 2], [5, 5, 5], [5, 5, 5], [1, 1, 1])
    m.pool.check()
    step = DecodeStep(m, max_batch=4)
    fill(step, slots, [6] * len(slots), finished)
    step.run()
    with pytest.raises(InvalidArgumentError) as e:
        m.pool.check()
    assert e.value.op == "decode_step" and e.value.value == bad


def _decoding_manager():
    m = make()
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
    step = DecodeStep(m, 2)
    fill(step, [0], [6], [1])
    batch = m.batch(step.slots, step.num_tokens, step.num_tokens, None, step.num_reqs, step.admitted)
    before, raw = mstate(m), raw_state(m.pool, m)
    with pytest.raises(exc, match=needle):
        m.decode_step(batch, step.finished, step.num_finished, step.slot_mapping, kv(m.pool.num_blocks))
    with pytest.raises(exc, match=needle):
        m.copy_and_release(kv(m.pool.num_blocks))
    m.pool.check()
    assert same_raw_state(raw, raw_state(m.pool, m)) == [] and mstate(m) == before


def test_hand_built_batch_is_checked_on_the_host():
    """A batch whose ``admitted`` is shorter than its slots (the kernel would write past it) or whose
    slots are int64 is refused before any launch."""
    m = _decoding_manager()
    good = m.batch([0], [6], [6])
    before = mstate(m)
    fin, nf, out = i32([0]), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    for bad in (good._replace(admitted=torch.zeros(0, dtype=torch.int32)),
                good._replace(slots=good.slots.to(torch.int64))):
        with pytest.raises(InvalidArgumentError, match="batch"):
            m.decode_step(bad, fin, nf, out, [])
    with pytest.raises(ArgumentTypeError, match="AllocateBatch"):
        m.decode_step(tuple(good), fin, nf, out, [])
    m.pool.check()
    assert mstate(m) == before


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


@pytest.mark.parametrize("slot,pos", [(4, 0), (-1, 0), (2**31 - 1, 0), (0, -1), (0, 8), (0, 2**31 - 1), (1, 0)])
def test_slot_mapping_bad_slot_or_position_is_a_pool_error(slot, pos):
    m = make()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    before = mstate(m)
    out = m.slot_mapping(i32([0, slot]), i32([0, pos]))
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    assert out[1].item() == -1
    assert mstate(m) == before
    for dt in (torch.int64,):  # no narrowing of int64 inputs
        out = m.slot_mapping(torch.tensor([slot + 2**32], dtype=dt), torch.tensor([pos], dtype=dt))
        with pytest.raises(InvalidArgumentError):
            m.pool.check()


# ---- 3. blocks leak when the status word is set --------------------------------------------

@pytest.mark.parametrize("groups", GROUPS, ids=GROUP_IDS)
def test_pending_copy_survives_a_failed_step(groups):
    """The issue's repro: cache a block, cow_append it, make a batched op fail, run a step, check(),
    free the request: every block comes back."""
    m = make(groups=groups)
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


def test_run_pending_copies_keeps_copies_past_a_recorded_error():
    m = make()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    src = m.rows(0)[0][0]
    m.add_request(1, [])
    m.allocate_slots([1], [1], [1])
    m.cow_append(1, [src])
    fail_a_batched_op(m)
    with pytest.raises(PoolError):
        m.run_pending_copies([])
    assert int(m.num_copies[0]) == 1
    m.validate()
    assert m.run_pending_copies([]) == 1
    m.free([0, 1])
    assert m.pool.get_num_free_blocks() == 31
    m.validate()


def test_free_list_after_a_recorded_error_keeps_the_slot():
    """``free(list)`` while an error is recorded raises it and changes nothing on host or device; the
    slot is then freed and reused normally."""
    m = make()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    before = mstate(m)
    fail_a_batched_op(m)
    raw = raw_state(m.pool, m)
    with pytest.raises(PoolError):
        m.free([0])
    assert same_raw_state(raw, raw_state(m.pool, m)) == []
    assert mstate(m) == before
    m.free([0])
    m.add_request(0, [h(2)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    m.validate()


@pytest.mark.parametrize("cls", [ReferenceKVCacheManager, KVCacheManager], ids=["reference", "device"])
@pytest.mark.parametrize("groups", GROUPS, ids=GROUP_IDS)
def test_validate_sees_a_leaked_reference(groups, cls):
    """validate() of both managers works with any number of groups and checks every block's ref count
    against its references from block tables and pending copies."""
    m = make(cls, groups=groups)
    m.add_request(0, [h(1), h(2)])
    m.add_request(1, [h(1), h(3)])
    m.allocate_slots([0, 1], [9, 9], [9, 9], [1, 1])
    m.validate()
    m.cow_move(0, 0)
    m.validate()
    leaked = m.block_table(0)[0][0] if cls is ReferenceKVCacheManager else m.rows(0)[0][0]
    m.pool.touch([leaked])  # a reference no table or copy holds
    with pytest.raises(InvariantError):
        m.validate()
    m.pool.free_blocks([leaked])
    m.validate()
    extra = int(m.pool.get_new_blocks(1)[0])  # a block held by no one
    with pytest.raises(InvariantError):
        m.validate()
    m.pool.free_blocks([extra])
    m.validate()


# ---- 4. counters: events through decode steps past an int32 key sequence ---------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", pytest.param("graph", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_decode_step_events_past_int32_key_sequence(groups, mode):
    """Decode steps (eager, or one captured graph replayed) past an int32 key sequence: every
    BlockStored carries the reference's hashes, parent, block size and group."""
    ref = make(ReferenceKVCacheManager, groups=groups, enable_kv_cache_events=True)
    dev = make(groups=groups, enable_kv_cache_events=True)
    dev.pool.state.ctrl[Ctrl.KEY_SEQ] = 2**31 - 3
    step = DecodeStep(dev, max_batch=2)
    for m in (ref, dev):
        m.add_request(0, [h(1)])
        m.add_request(1, [h(1), h(2)])
        m.allocate_slots([0, 1], [5, 9], [5, 9], [1, 1])
    if mode == "graph":
        step.capture()
    run = step.run if mode == "eager" else step.replay
    ntok = {0: 5, 1: 9}
    steps = 25 if mode == "eager" else 200
    for i in range(steps):
        for r in (0, 1):
            ntok[r] += 1
            if ntok[r] % BS == 0:
                for m in (ref, dev):
                    m.append_block_hashes(r, [h(100 * r + i)])
        ref.allocate_slots([0, 1], [ntok[0], ntok[1]], [ntok[0], ntok[1]], stop_on_failure=False)
        fill(step, [0, 1], [ntok[0], ntok[1]])
        run()
        dev.pool.check()
        assert dev.pool.take_events() == ref.pool.take_events(), i
        if ntok[1] >= M_TOKENS - 1:  # rows full: restart both requests
            for m in (ref, dev):
                m.free([0, 1])
                m.add_request(0, [h(1)])
                m.add_request(1, [h(1), h(2)])
                m.allocate_slots([0, 1], [5, 9], [5, 9], [1, 1])
            ntok = {0: 5, 1: 9}
            assert dev.pool.take_events() == ref.pool.take_events(), i
    assert int(dev.pool.state.ctrl[Ctrl.KEY_SEQ]) > 2**31
    dev.validate()


# ---- 5. threads -----------------------------------------------------------------------------

@pytest.mark.slow
def test_two_threads_share_a_managers_pool():
    """The scheduler (manager ops) and a transfer thread (pool lookups, touch and free of hits)."""
    m = make(n=48)
    errors = []

    def scheduler():
        try:
            for i in range(8):
                r = i % 4
                m.add_request(r, [h(r), h(10 + r)])
                m.allocate_slots([r], [9], [9], [1])
                m.pool.check()
                m.free([r])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def transfer():
        try:
            for i in range(16):
                got = m.pool.get_cached_block(h(i % 4), [0])
                if got is not None:
                    m.pool.touch(got)
                    m.pool.free_blocks(got)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    run_in_threads(errors, scheduler, transfer)
    m.validate()
    assert_consistent(m.pool)
    assert m.pool.get_num_free_blocks() == 47


# ---- 2. (same pattern) host-side shape checks of device inputs and outputs ------------------------

def test_manager_rejects_short_buffers_and_empty_counts():
    """An empty count tensor, an ``admitted`` / ``out`` buffer shorter than the batch and a release
    list of another dtype are refused on the host (the kernel would read or write past them, or the
    ids would be narrowed), changing nothing."""
    m = make()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    before = mstate(m)
    empty = torch.zeros(0, dtype=torch.int32)
    cases = [
        lambda: m.allocate_slots(i32([0]), i32([6]), i32([6]), num_reqs=empty),
        lambda: m.allocate_slots(i32([0, 1]), i32([6, 6]), i32([6, 6]), admitted=torch.zeros(1, dtype=torch.int32)),
        lambda: m.allocate_slots(i32([0]), i32([6]), i32([6]), admitted=torch.zeros(1, dtype=torch.int64)),
        lambda: m.allocate_slots(i32([0]), i32([6]), i32([6]), admitted=torch.zeros(4, dtype=torch.int32)[::2]),
        lambda: m.free(i32([0]), num_reqs=empty),
        lambda: m.slot_mapping(i32([0, 0]), i32([1, 2]), out=torch.zeros(1, dtype=torch.int64)),
        lambda: m.slot_mapping(i32([0, 0]), i32([1, 2]), out=torch.zeros(2, dtype=torch.int32)),
        lambda: m.slot_mapping(i32([0, 0]), i32([1, 2]), admitted=i32([1])),
        lambda: m.slot_mapping(i32([0]), i32([1]), num=empty),
        lambda: m.release_copied(torch.tensor([2**32 + 1], dtype=torch.int64)),
        lambda: m.release_copied(torch.tensor([1.0])),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(InvalidArgumentError):
            fn()
        assert mstate(m) == before, i


def test_lookup_flags_are_not_narrowed():
    """A lookup flag of 256 in an int32 tensor means "look up" (not 256 -> int8 0)."""
    m = make()
    m.add_request(0, [h(1), h(2)])
    m.allocate_slots([0], [9], [9], [1])
    m.add_request(1, [h(1), h(2)])
    m.allocate_slots(i32([1]), i32([9]), i32([9]), i32([256]))
    m.pool.check()
    assert m.rows(0)[1][:2] == m.rows(0)[0][:2]
    m.validate()


# ---- 6. typed errors: both managers -------------------------------------------------------------

@pytest.mark.parametrize("cls", [ReferenceKVCacheManager, KVCacheManager], ids=["reference", "device"])
def test_manager_typed_errors(cls):
    """Bad Python arguments raise a PoolError subclass (ArgumentTypeError, also a TypeError, for a
    wrong type) on both managers, changing nothing; a group or length the other rejects too."""
    m = make(cls, groups=("full", "full"))
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    rows = [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    cases = [
        lambda: m.add_request(1, None), lambda: m.add_request(1, [None]), lambda: m.add_request(None, []),
        lambda: m.append_block_hashes(0, None), lambda: m.allocate_slots(None, [1], [1]),
        lambda: m.allocate_slots([0], None, [6]), lambda: m.allocate_slots([0], [6], None),
        lambda: m.allocate_slots([0], [6], [6], 5), lambda: m.allocate_slots([0], [6], [6], [None]),
        lambda: m.free(None), lambda: m.free([1.5]), lambda: m.slot_mapping(None, [0]),
        lambda: m.slot_mapping([0], [0], None), lambda: m.cow_append(0, None), lambda: m.cow_move(0, None),
        lambda: m.get_computed_blocks(None, [1]), lambda: m.get_computed_blocks([0], None),
        lambda: m.release_copied(None),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, TypeError), (i, info.value)
    for fn in (lambda: m.slot_mapping([0], [1], 2), lambda: m.slot_mapping([0], [1], -1),
               lambda: m.slot_mapping([0, 0], [1])):
        with pytest.raises(InvalidArgumentError):
            fn()
    assert rows == [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    m.validate()


@pytest.mark.parametrize("how", ["allocate_slots", "decode_step", "burst"])
def test_event_buffer_too_small_is_buffer_full_and_changes_nothing(how):
    """A batch whose caching could write more event rows than the buffer holds records
    BufferFullError (value: the rows) in its input check and changes nothing: allocate_slots, the
    decode step, and a 2-step burst (refused by its step 0; a later step's own check is not isolated
    here)."""
    import hashlib
    from gpupool.errors import BufferFullError
    m = make(enable_caching=True, enable_kv_cache_events=True, event_capacity=2)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    m.add_request(0, hashes)
    m.pool.take_events()
    before = mstate(m)
    with pytest.raises(BufferFullError):
        if how == "allocate_slots":
            m.allocate_slots(i32([0]), i32([0]), i32([6 * BS]))
        else:
            step = DecodeStep(m, 2, steps=1 if how == "decode_step" else 2)
            step.slots[:1] = i32([0])
            step.num_tokens[:1] = i32([6 * BS])
            step.num_reqs.fill_(1)
            step.run()
        m.pool.check()
    assert mstate(m) == before
