"""The device manager's recorded errors say what was wrong and name the slot (docs/errors.md, "The status
word"): for each batched op and each cause its kernels detect (``kernels/layout.py`` Cause), the device
manager raises, at ``pool.check()``, the reference manager's error class with the same value and the
same text, and neither manager changed anything (whole state compared, the device's raw tensors too).

Causes only the device can have (a device count past its arrays, an attention view's length) are
checked against their documented wording; a decode step's inputs against the reference window's error
and the documented wording.
"""
from __future__ import annotations

import pytest
import torch

from gpupool.errors import InvalidArgumentError, InvalidCountError, PoolError
from gpupool.graph import DecodeStep
from gpupool.kernels.layout import Cause, Status
from harness.compare import assert_managers_agree
from harness.device import i32
from harness.ops import call_both, fill_step, reference_decode_step
from harness.state import manager_state, raw_state, same_raw_state
from harness.twins import SMALL_TOKENS, SW, small_manager_twin

T = SMALL_TOKENS  # 32: 8 blocks of 4 tokens a row
R = 4


@pytest.fixture(scope="module")
def twin():
    """Slots 0 and 1 running (12 and 5 tokens computed, slot 0 with a reservation), 2 and 3 free; two
    groups, one with a sliding window. Every case leaves it as it was."""
    ref, dev = small_manager_twin(groups=("full", SW))
    for m in (ref, dev):
        m.add_request(0, [])
        m.add_request(1, [])
        m.allocate_slots([0, 1], [12, 5], [12, 5])
        m.reserve([0], [4])
    dev.pool.check()
    assert_managers_agree(ref, dev)
    return ref, dev


def recorded(dev) -> tuple[int, int, int]:
    """(code, cause, extra) in the device's status word, before ``check()`` clears it."""
    s = dev.pool.state.status.tolist()
    return s[Status.CODE], s[Status.CAUSE], s[Status.EXTRA]


def expect_same_error(twin, exc: type, cause: Cause, ref_fn, dev_fn) -> PoolError:
    """The reference raises ``exc``; the device records ``cause`` and raises at ``check()`` an error of
    the same class, op, value and text; both managers are as before (the device bit for bit)."""
    ref, dev = twin
    before_ref, before_dev, raw = manager_state(ref), manager_state(dev), raw_state(dev.pool, dev)
    seen = []

    def dev_call():
        dev_fn(dev)
        seen.append(recorded(dev))

    _, r_err, _, d_err = call_both(lambda: ref_fn(ref), dev_call, dev.pool.check)
    assert type(r_err) is exc and type(d_err) is exc, (r_err, d_err)
    assert seen and seen[0][:2] == (exc.code, cause), (seen, cause)
    assert (d_err.op, d_err.value, str(d_err)) == (r_err.op, r_err.value, str(r_err))
    assert manager_state(ref) == before_ref and manager_state(dev) == before_dev, d_err
    assert same_raw_state(raw, raw_state(dev.pool, dev)) == []
    dev.pool.check()  # cleared
    assert_managers_agree(ref, dev)
    return d_err


def expect_device_error(dev, exc: type, cause: Cause, text: str, fn, like: PoolError | None = None) -> None:
    """A device-only error: ``fn`` records ``cause`` and ``check()`` raises ``exc`` saying ``text``
    (with the op and value of ``like``, the reference's error, when given); nothing changed."""
    raw = raw_state(dev.pool, dev)
    fn()
    assert recorded(dev)[:2] == (exc.code, cause)
    with pytest.raises(exc) as e:
        dev.pool.check()
    assert type(e.value) is exc and str(e.value) == text, str(e.value)
    if like is not None:
        assert (e.value.op, e.value.value) == (like.op, like.value), (e.value, like)
    assert same_raw_state(raw, raw_state(dev.pool, dev)) == []


A, C = InvalidArgumentError, InvalidCountError
SLOT_LISTS = [  # (slots, error class, cause, text after "op: ")
    ([0, 4], A, Cause.SLOT_OUT_OF_RANGE, "slot 4 out of range 0..3"),
    ([-1], A, Cause.SLOT_OUT_OF_RANGE, "slot -1 out of range 0..3"),
    ([0, 2**31 - 1], A, Cause.SLOT_OUT_OF_RANGE, f"slot {2**31 - 1} out of range 0..3"),
    ([1, 3], A, Cause.SLOT_NOT_IN_USE, "slot 3 is not in use"),
    ([1, 0, 1], A, Cause.SLOT_LISTED_TWICE, "slot 1 is listed twice"),
    ([1, 2, 1], A, Cause.SLOT_LISTED_TWICE, "slot 1 is listed twice"),  # named at its first entry, before 2
    ([2, 0, 2], A, Cause.SLOT_NOT_IN_USE, "slot 2 is not in use"),  # not in use and repeated
    ([0, 0, 7], A, Cause.SLOT_LISTED_TWICE, "slot 0 is listed twice"),
]
SLOT_IDS = ["range", "negative", "int32-max", "not-in-use", "twice", "twice-before-idle", "idle-repeated",
            "twice-before-range"]


SLOT_OPS = ["allocate_slots", "free", "reserve", "release_reservation", "slot_mapping"]


@pytest.mark.parametrize("tensors", [True, False], ids=["tensors", "lists"])
@pytest.mark.parametrize("op, slots, exc, cause, text", [  # slot_mapping may list a slot twice: no such case
    pytest.param(op, *case, id=f"{op}-{cid}") for op in SLOT_OPS for case, cid in zip(SLOT_LISTS, SLOT_IDS)
    if not (op == "slot_mapping" and case[2] == Cause.SLOT_LISTED_TWICE)])
def test_a_bad_slot_is_named_as_the_reference_names_it(twin, op, slots, exc, cause, text, tensors):
    """A slot out of range, not in use or listed twice: the first bad entry, a repeat at its first."""
    if op == "free" and not tensors:
        cause = None  # a host list is checked on the host, at once: the same words, no record
    n = len(slots)
    arg = (lambda xs: i32(xs)) if tensors else list
    calls = {
        "allocate_slots": (lambda m, s: m.allocate_slots(s, [1] * n, [1] * n),
                           lambda m: m.allocate_slots(arg(slots), arg([1] * n), arg([1] * n))),
        "free": (lambda m, s: m.free(s), lambda m: m.free(arg(slots))),
        "reserve": (lambda m, s: m.reserve(s, [1] * n), lambda m: m.reserve(arg(slots), arg([1] * n))),
        "release_reservation": (lambda m, s: m.release_reservation(s), lambda m: m.release_reservation(arg(slots))),
        "slot_mapping": (lambda m, s: m.slot_mapping(s, [0] * n), lambda m: m.slot_mapping(arg(slots), arg([0] * n))),
    }
    ref_fn, dev_fn = calls[op]
    if cause is None:
        ref, dev = twin
        with pytest.raises(exc) as r_err:
            ref_fn(ref, slots)
        with pytest.raises(exc) as d_err:
            dev_fn(dev)
        assert str(d_err.value) == str(r_err.value) == f"{op}: {text}"
        assert_managers_agree(ref, dev)
        return
    err = expect_same_error(twin, exc, cause, lambda m: ref_fn(m, slots), dev_fn)
    assert str(err) == f"{op}: {text}"


COUNT_CASES = [  # (op, slots, num_tokens, target_tokens or None, cause's value, text after "op: ")
    ("allocate_slots", [0, 1], [12, T + 1], [12, 5], "token count 33 outside 0..32"),
    ("allocate_slots", [0, 1], [12, 5], [12, -1], "token count -1 outside 0..32"),
    ("allocate_slots", [0, 1], [12, T + 1], [-1, 5], "token count -1 outside 0..32"),  # request 0's target first
    ("allocate_slots", [1, 0], [2**31 - 1, 12], [5, 12], f"token count {2**31 - 1} outside 0..32"),
    ("reserve", [0, 1], [4, -1], None, "token count -1 outside 0..27 for slot 1"),
    ("reserve", [1, 0], [4, T - 12 + 1], None, "token count 21 outside 0..20 for slot 0"),
    ("reserve", [0, 1], [2**31 - 1, 4], None, f"token count {2**31 - 1} outside 0..20 for slot 0"),  # no wrap
]


@pytest.mark.parametrize("op, slots, nts, tgs, text", COUNT_CASES,
                         ids=["nt-past-row", "target-negative", "target-before-later-nt", "nt-int32-max",
                              "reserve-negative", "reserve-past-row", "reserve-int32-wrap"])
def test_a_bad_token_count_is_named_as_the_reference_names_it(twin, op, slots, nts, tgs, text):
    if op == "allocate_slots":
        ref_fn, dev_fn = (lambda m: m.allocate_slots(slots, nts, tgs)), (lambda m: m.allocate_slots(i32(slots),
                                                                                                  i32(nts), i32(tgs)))
    else:
        ref_fn, dev_fn = (lambda m: m.reserve(slots, nts)), (lambda m: m.reserve(i32(slots), i32(nts)))
    err = expect_same_error(twin, C, Cause.TOKEN_COUNT, ref_fn, dev_fn)
    assert str(err) == f"{op}: {text}"


def test_append_tokens_past_the_row_names_the_count_its_bound_and_slot(twin):
    """A hashing request's tokens past ``max_blocks_per_req * block_size``: the reference's text (the
    count, ``1..T`` and the slot) from the device's record (its slot and bound)."""
    for m in twin:
        m.add_request(2, [], tail_tokens=[1, 2])
    n = T - 2 + 1
    err = expect_same_error(twin, C, Cause.TOKEN_COUNT, lambda m: m.append_tokens([1, 2], [[5], [5] * n]),
                            lambda m: m.append_tokens(i32([1, 2]), i32([1, n]), torch.full((2, n), 5)))
    assert str(err) == f"append_tokens: token count {T + 1} outside 1..{T} for slot 2"
    for m in twin:  # the module's twin as it was
        m.free([2])
    twin[1].pool.check()
    assert_managers_agree(*twin)


def test_a_bad_slot_comes_before_a_bad_token_count(twin):
    """Slots are checked first (all of them), then the counts, on both sides."""
    expect_same_error(twin, A, Cause.SLOT_NOT_IN_USE, lambda m: m.allocate_slots([0, 1, 3], [-1, 5, 1], [1, 5, 1]),
                      lambda m: m.allocate_slots(i32([0, 1, 3]), i32([-1, 5, 1]), i32([1, 5, 1])))
    expect_same_error(twin, A, Cause.SLOT_LISTED_TWICE, lambda m: m.reserve([0, 1, 0], [-1, 1, 1]),
                      lambda m: m.reserve(i32([0, 1, 0]), i32([-1, 1, 1])))


@pytest.mark.parametrize("slots, positions, cause, text", [
    ([0, 1], [3, 8], Cause.POSITION_OUTSIDE_ROW, "position 8 of slot 1 has no block"),  # slot 1: 2 blocks
    ([1, 0], [-1, 0], Cause.POSITION_OUTSIDE_ROW, "position -1 of slot 1 has no block"),
    ([0, 9], [12, 0], Cause.POSITION_OUTSIDE_ROW, "position 12 of slot 0 has no block"),  # entry by entry
    ([0, 9], [11, 0], Cause.SLOT_OUT_OF_RANGE, "slot 9 out of range 0..3"),
    ([0, 2], [11, 0], Cause.SLOT_NOT_IN_USE, "slot 2 is not in use"),
], ids=["past-row", "negative", "position-first", "slot-second", "idle-second"])
def test_slot_mapping_names_the_position_and_its_slot(twin, slots, positions, cause, text):
    err = expect_same_error(twin, A, cause, lambda m: m.slot_mapping(slots, positions, group=1),
                            lambda m: m.slot_mapping(i32(slots), i32(positions), group=1))
    assert str(err) == f"slot_mapping: {text}"


@pytest.mark.parametrize("op", ["allocate_slots", "free", "reserve", "release_reservation", "slot_mapping",
                                "attention_views"])
@pytest.mark.parametrize("count", [3, -1])
def test_a_device_count_past_its_arrays_is_named_with_their_length(twin, op, count):
    _, dev = twin
    s, n, num = i32([0, 1]), i32([4, 4]), i32([count])
    name = "num" if op == "slot_mapping" else "num_reqs"
    call = {
        "allocate_slots": lambda: dev.allocate_slots(s, n, n, num_reqs=num),
        "free": lambda: dev.free(s, num_reqs=num),
        "reserve": lambda: dev.reserve(s, n, num_reqs=num),
        "release_reservation": lambda: dev.release_reservation(s, num_reqs=num),
        "slot_mapping": lambda: dev.slot_mapping(s, n, num=num),
        "attention_views": lambda: dev.attention_views(s, n, num_reqs=num),
    }[op]
    expect_device_error(dev, A, Cause.COUNT_PAST_ARRAYS, f"{op}: {name} {count} is outside 0..2, the length of its "
                        "arrays", call)


@pytest.mark.parametrize("slots, base_len, cause, text", [
    ([0, 1], [12, 9], Cause.LENGTH_OUTSIDE_ROW, "length 9 of slot 1 is outside 0..8, its row"),
    ([0, 1], [-2, 5], Cause.LENGTH_OUTSIDE_ROW, "length -2 of slot 0 is outside 0..12, its row"),
    ([0, 5], [12, 5], Cause.SLOT_OUT_OF_RANGE, "slot 5 out of range 0..3"),
    ([3, 1], [0, 5], Cause.SLOT_NOT_IN_USE, "slot 3 is not in use"),
], ids=["past-row", "negative", "range", "not-in-use"])
def test_attention_views_name_the_lane_and_its_slot(twin, slots, base_len, cause, text):
    _, dev = twin
    expect_device_error(dev, A, cause, f"attention_views: {text}",
                        lambda: dev.attention_views(i32(slots), i32(base_len)))


@pytest.mark.parametrize("finished, slots, ntok, exc, cause, text", [
    ([], [0, 1], [13, 0], C, Cause.TOKEN_COUNT, "token count 0 outside 1..32 for slot 1"),
    ([], [0, 1], [13, T + 1], C, Cause.TOKEN_COUNT, "token count 33 outside 1..32 for slot 1"),
    ([1], [0, 1], [13, 6], A, Cause.SLOT_LISTED_TWICE, "slot 1 is listed twice"),  # finished and running
    ([2], [0], [13], A, Cause.SLOT_NOT_IN_USE, "slot 2 is not in use"),
    ([], [0, 6], [13, 6], A, Cause.SLOT_OUT_OF_RANGE, "slot 6 out of range 0..3"),
], ids=["ntok-0", "ntok-past-row", "finished-and-running", "finished-idle", "running-range"])
def test_decode_step_names_the_bad_input(twin, finished, slots, ntok, exc, cause, text):
    """The step's inputs are the window's (op ``window_begin``): the error the reference window's
    ``begin`` raises (class, op, value, text), nothing changed."""
    ref, dev = twin
    before = manager_state(ref)
    want = reference_decode_step(ref, slots, ntok, finished).error
    assert type(want) is exc and str(want) == f"window_begin: {text}" and manager_state(ref) == before
    step = DecodeStep(dev, max_batch=2)
    fill_step(step, slots, ntok, finished)
    expect_device_error(dev, exc, cause, f"window_begin: {text}", step.run, want)
    assert_managers_agree(ref, dev)


@pytest.mark.parametrize("field, value, cause, text", [
    ("num_reqs", 3, Cause.COUNT_PAST_ARRAYS, "num_reqs 3 is outside 0..2, the length of its arrays"),
    ("num_finished", -1, Cause.FINISHED_PAST_ARRAYS, "num_finished -1 is outside 0..2, the length of finished"),
])
def test_decode_step_names_the_count_past_its_arrays(twin, field, value, cause, text):
    _, dev = twin
    step = DecodeStep(dev, max_batch=2)
    fill_step(step, [0], [13])
    getattr(step, field).fill_(value)
    expect_device_error(dev, A, cause, f"window_begin: {text}", step.run)


def test_a_record_without_a_cause_keeps_the_catch_all(twin):
    """A status record with cause 0 (written by hand here: no manager kernel writes one) gets the
    error class's own message, which lists what the value can be."""
    ref, dev = twin
    dev.pool.state.status[:5] = torch.tensor([A.code, 15, 7, 0, 0])  # Op.ALLOCATE_SLOTS
    with pytest.raises(A, match=r"^allocate_slots: slot 7 is out of range, not in use \(add_request first\)"):
        dev.pool.check()
    assert_managers_agree(ref, dev)
