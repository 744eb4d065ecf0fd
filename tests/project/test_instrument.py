"""gpupool.instrument's Meter: the counts of a known sequence, nesting, re-entry, threads, and the
patched classes exactly as before once the last meter is left (an exception inside the block too)."""
from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface

from gpupool.errors import InvalidArgumentError
from gpupool.instrument import SYNC_METHODS, Meter


@triton.jit
def _add_one(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(x + i, tl.load(x + i, mask=m) + 1, mask=m)


def _patched_attrs() -> dict:
    """The attributes a meter patches, as the classes hold them (absent: None)."""
    out = {("KernelInterface", "__getitem__"): vars(KernelInterface).get("__getitem__")}
    for name in SYNC_METHODS:
        out[("Tensor", name)] = vars(torch.Tensor).get(name)
    return out


def _sequence(x: torch.Tensor) -> None:
    """2 launches, 4 syncs (item, tolist, bool, int), 3 torch ops (add, clone, sum; views not counted),
    2 host-to-device copies (torch.tensor of data: on a GPU each is one)."""
    _add_one[(1,)](x, x.numel(), BLOCK=8)
    _add_one[(1,)](x, x.numel(), BLOCK=8)
    x[0].item()
    x.tolist()
    bool(x[1])
    int(x[2])
    y = x + 1
    y.clone().view(2, -1)
    y.sum()
    torch.tensor([1, 2], dtype=x.dtype)
    torch.tensor([3], dtype=x.dtype)


KNOWN = {"syncs": 4, "launches": 2, "torch_ops": 3 + 3, "copies": 2}  # each read above is also one torch op,
# except tolist (torch dispatches one op for item, bool and int: _local_scalar_dense / is_nonzero)


def test_a_known_sequence():
    x = torch.zeros(6, dtype=torch.int32)
    with Meter() as m:
        _sequence(x)
    assert x.tolist() == [2] * 6
    assert m.as_dict() == KNOWN, m


def test_nothing_is_counted_outside_the_block_and_re_entering_adds():
    x = torch.zeros(6, dtype=torch.int32)
    m = Meter()
    _sequence(x)
    assert m.as_dict() == dict.fromkeys(KNOWN, 0)
    with m:
        _sequence(x)
    with m:
        _sequence(x)
    assert m.as_dict() == {k: 2 * v for k, v in KNOWN.items()}


def test_nested_meters_each_count_once():
    x = torch.zeros(6, dtype=torch.int32)
    outer, inner = Meter(), Meter()
    with outer:
        _sequence(x)
        with inner:
            _sequence(x)
            with inner:  # inside itself: counted once
                _sequence(x)
    assert outer.as_dict() == {k: 3 * v for k, v in KNOWN.items()}
    assert inner.as_dict() == {k: 2 * v for k, v in KNOWN.items()}


def test_meters_left_out_of_order_restore_everything():
    before = _patched_attrs()
    x = torch.zeros(6, dtype=torch.int32)
    a, b = Meter(), Meter()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    _sequence(x)  # b still counts, torch ops included
    b.__exit__(None, None, None)
    assert a.as_dict() == dict.fromkeys(KNOWN, 0)
    assert b.as_dict() == KNOWN
    assert _patched_attrs() == before


def test_an_exception_inside_the_block_goes_on_and_everything_is_restored():
    before = _patched_attrs()
    x = torch.zeros(6, dtype=torch.int32)
    m = Meter()
    with pytest.raises(ZeroDivisionError):
        with m:
            with Meter():
                x.tolist()
                1 / 0
    assert _patched_attrs() == before
    assert vars(torch.Tensor).get("item") is None  # torch's own method, from its C base class
    assert torch._C._len_torch_dispatch_stack() == 0  # the meters' dispatch mode is gone too
    assert m.syncs == 1
    with m:  # usable again afterwards
        _sequence(x)
    assert m.as_dict() == {k: v + (k == "syncs") for k, v in KNOWN.items()}


def test_another_tools_patch_over_a_meter_survives_its_exit():
    before = vars(torch.Tensor).get("tolist")
    with Meter() as m:
        inner = torch.Tensor.tolist
        calls = []

        def theirs(t, *a, **k):
            calls.append(1)
            return inner(t, *a, **k)

        torch.Tensor.tolist = theirs
    try:
        assert vars(torch.Tensor)["tolist"] is theirs
        torch.zeros(2).tolist()
        with Meter() as m2:
            torch.zeros(2).tolist()  # our new patch over theirs over our old one: one sync
    finally:
        if before is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = before
    assert (m.syncs, m2.syncs, len(calls)) == (0, 1, 2)


def test_each_thread_counts_its_own_work():
    """Two threads each inside their own meter, both meters active at once (a barrier after entering,
    another before leaving): each meter has its own thread's counts (a thread's work never reaches
    another thread's meter); a thread with no meter adds nothing. The work itself takes turns (Triton's
    interpreter runs one launch at a time)."""
    x = {name: torch.zeros(6, dtype=torch.int32) for name in ("a", "b", "bare")}
    meters = {"a": Meter(), "b": Meter()}
    both_in = threading.Barrier(3)
    done = threading.Barrier(3)
    turn = threading.Lock()
    errors = []

    def run(name, times):
        for _ in range(times):
            with turn:
                _sequence(x[name])

    def work(name):
        try:
            if name in meters:
                with meters[name]:
                    both_in.wait()
                    run(name, 2 if name == "a" else 1)
                    done.wait()
            else:
                both_in.wait()
                run(name, 1)
                done.wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in x]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert meters["a"].as_dict() == {k: 2 * v for k, v in KNOWN.items()}
    assert meters["b"].as_dict() == KNOWN


def test_a_meter_active_in_one_thread_cannot_be_entered_in_another():
    m = Meter()
    got = []
    with m:
        t = threading.Thread(target=lambda: got.append(_enter_elsewhere(m)))
        t.start()
        t.join(30)
    assert got and isinstance(got[0], InvalidArgumentError), got


def _enter_elsewhere(m):
    try:
        with m:
            pass
    except InvalidArgumentError as e:
        return e
    return None
