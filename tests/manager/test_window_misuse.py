"""A decode window used the wrong way (docs/semantics.md section 9; docs/kv_cache.md section 5): the
order begin, step 0 .. K - 1, end is checked on the host as the reference window checks it, so a call
out of order, twice, or after ``set_inputs`` changed the lanes' requests is a typed error that changes
nothing; sizes whose buffers cannot exist, a step outside the window for ``positions`` and extra tensors
``read`` cannot return as they are are typed errors too."""
from __future__ import annotations

import pytest
import torch

from gpupool.errors import ArgumentTypeError, InvalidArgumentError, PoolError
from gpupool.reference.window import ReferenceDecodeWindow
from harness.state import manager_state

from test_window import twins, two_requests

K = 2


def opened(stage: str):
    """A reference and a device window over two requests, driven to ``stage``: "new" (inputs set, not
    begun), "begun", "stepped" (every step run), "ended"."""
    ref, dev = twins(16)
    ntok = two_requests(dev)
    two_requests(ref)
    rw, dw = ReferenceDecodeWindow(ref, 2, K), dev.window(2, steps=K)
    dw.set_inputs([0, 1], ntok)
    if stage != "new":
        rw.begin([0, 1], ntok)
        dw.begin()
    if stage in ("stepped", "ended"):
        for k in range(K):
            rw.step(k, [0, 0], [1, 1], [[7], [7]])
            dw.tokens[:, 0] = 7
            dw.step(k)
    if stage == "ended":
        rw.end([0, 0], [1, 1], [[7], [7]])
        dw.end()
    dev.pool.check()
    return ref, rw, dev, dw, ntok


@pytest.mark.parametrize("stage, calls", [
    ("new", ("step 0", "end")),  # begin() sets the lanes up
    ("begun", ("end", "step 1")),  # end before the last step
    ("ended", ("end", "step 0")),  # end twice: a second advance of every lane, with no blocks for it
])
def test_a_call_out_of_order_is_refused_and_changes_nothing(stage, calls):
    ref, rw, dev, dw, _ = opened(stage)
    before = manager_state(dev)
    for call in calls:
        k = int(call[-1]) if call.startswith("step") else None
        with pytest.raises(InvalidArgumentError, match="order"):
            dw.end() if k is None else dw.step(k)
        with pytest.raises(InvalidArgumentError):  # the reference refuses it too
            rw.end() if k is None else rw.step(k)
    dev.pool.check()  # nothing recorded on the device either
    assert manager_state(dev) == before


def test_set_inputs_closes_an_open_window():
    """New inputs in the middle of a window would hand the lanes' state to other requests (slot 2, not
    in use, got blocks at the next step): the window must begin again before it steps."""
    ref, rw, dev, dw, ntok = opened("begun")
    dw.step(0)
    dev.pool.check()
    before = manager_state(dev)
    dw.set_inputs([2, 3], ntok)
    for call in (lambda: dw.step(1), dw.end):
        with pytest.raises(InvalidArgumentError, match="begin"):
            call()
    dev.pool.check()
    assert manager_state(dev) == before
    dw.set_inputs([0, 1], [n + 1 for n in ntok])  # and a new window runs
    dw.run(lambda w, k: w.tokens[:, 0].fill_(7))
    assert dw.read().num_tokens == [n + 1 + K for n in ntok]


def test_a_window_whose_buffers_cannot_exist_is_refused():
    _, dev = twins(16)
    before = manager_state(dev)
    for kw in (dict(max_batch=2**40), dict(max_batch=4, steps=2**40), dict(max_batch=2**20, steps=2**12),
               dict(max_batch=2**20, steps=2**12, views=False)):
        with pytest.raises(InvalidArgumentError, match="DecodeWindow"):
            dev.window(**kw)
    assert manager_state(dev) == before


def test_positions_takes_a_step_of_the_window():
    _, _, _, dw, ntok = opened("stepped")
    assert dw.positions(1).tolist() == [[n] for n in ntok]  # step 1: the input token at num_tokens - 1 + 1
    for k, err in ((K, InvalidArgumentError), (-1, InvalidArgumentError), ("a", ArgumentTypeError),
                   (1.0, ArgumentTypeError)):
        with pytest.raises(err, match="positions"):
            dw.positions(k)


def test_read_returns_the_extra_tensors_as_tolist_gives_them():
    """``extra`` as ``tolist()`` gives it (a 0-d tensor a number, bools as bools); a tensor read cannot
    return as it is (float, another device) or a non-tensor is a typed error naming it."""
    ref, rw, dev, dw, _ = opened("ended")
    t = [torch.tensor(3), torch.tensor([True, False]), torch.tensor([[1, 2]], dtype=torch.int16), torch.zeros(0, 2, dtype=torch.int64)]
    assert dw.read(*t).extra == [x.tolist() for x in t]
    before = manager_state(dev)
    for bad, err in (("x", ArgumentTypeError), ([1, 2], ArgumentTypeError), (torch.tensor([0.5]), InvalidArgumentError),
                     (torch.zeros(2, dtype=torch.int64, device="meta"), InvalidArgumentError)):
        with pytest.raises(err, match="read"):
            dw.read(torch.tensor([1]), bad)
        assert manager_state(dev) == before
    with pytest.raises(PoolError):
        dw.read(torch.tensor([1.0 + 2j]))


def test_rebinding_a_buffer_the_kernels_read_is_refused():
    """``win.stopped = (tok == eos).int()`` would leave the kernels (and a captured graph) reading the
    old tensor: the lane would never stop. The window refuses the assignment; writing in place works."""
    _, _, dev, dw, ntok = opened("new")
    for name in ("stopped", "accepted", "tokens", "slot_mapping", "views", "seq"):
        with pytest.raises(InvalidArgumentError, match="in place"):
            setattr(dw, name, torch.zeros(2, dtype=torch.int32))
    dw.begin()
    dw.step(0)
    dw.stopped[1] = 1
    dw.step(1)
    assert dw.read().stop_step == [-1, 0]


@pytest.mark.heavy("before step 1", "before end")
@pytest.mark.parametrize("when", ["before step 0", "before step 1", "before end"])
def test_a_lane_freed_outside_the_window_is_refused_by_both_windows(when):
    """A lane's request freed by the host inside the window (``manager.free`` between its calls): the next
    step or the end refuses it (``slot 1 is not in use``, op ``window_step`` / ``window_end``) before it
    changes anything, as the reference window does. Before, the device step gave the freed slot new
    blocks (held by no request: lost) and only a later views launch recorded an error."""
    ref, rw, dev, dw, _ = opened("begun")
    steps = {"before step 0": 0, "before step 1": 1, "before end": K}[when]
    for k in range(steps):
        rw.step(k, [0, 0], [1, 1], [[7], [7]])
        dw.tokens[:, 0] = 7
        dw.step(k)
    dev.pool.check()
    ref.free([1])
    dev.free(torch.tensor([1], dtype=torch.int32))
    dev.pool.check()
    want, before = manager_state(ref), manager_state(dev)
    op = "window_end" if steps == K else "window_step"
    with pytest.raises(InvalidArgumentError, match=f"{op}: slot 1 is not in use"):
        rw.end([0, 0], [1, 1], [[7], [7]]) if steps == K else rw.step(steps, [0, 0], [1, 1], [[7], [7]])
    dw.end() if steps == K else dw.step(steps)
    with pytest.raises(InvalidArgumentError, match=f"{op}: slot 1 is not in use"):
        dev.pool.check()
    assert manager_state(dev) == before and manager_state(ref) == want
