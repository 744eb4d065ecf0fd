"""The decode step (gpupool/graph.py): eagerly on any device it equals the reference manager's
sequence of ops; on CUDA, a captured graph replayed 1,000 times with changing inputs equals the
eager path, makes no host synchronisation, and an error inside a replay changes nothing."""
from __future__ import annotations

import random

import pytest
import torch

from gpupool.errors import InvalidArgumentError
from gpupool.graph import DecodeStep
from gpupool.manager import KVCacheManager
from harness.compare import assert_managers_agree
from harness.keys import h
from harness.ops import fill_step as fill
from harness.sizes import sized
from harness.state import pool_state
from harness.twins import manager_twin

BS = 4


CONFIG = dict(block_size=BS, max_num_reqs=6, max_blocks_per_req=16)


def make(groups=("full",), n=48, **kw) -> KVCacheManager:
    return KVCacheManager(n, groups=groups, **CONFIG, **kw)


def twin(groups=("full",), n=48, **kw):
    """A reference and a device manager with this file's configuration (harness.twins.manager_twin)."""
    return manager_twin(n, groups=groups, **CONFIG, **kw)


def drive(step_fn, ref, dev, steps, seed, dev_manager):
    """Random decode traffic: requests join (prefill through allocate_slots), decode one token per
    step through the DecodeStep, and finish; after each step the two managers must agree on the
    whole state (harness.compare.assert_managers_agree: tables, counters, pool, KV events, validate). Returns the number of KV events seen."""
    rng = random.Random(seed)
    tokens: dict[int, int] = {}
    num_events = 0
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
        # reference: free finished, then allocate the decode batch
        ref.free(finished)
        ref_adm = ref.allocate_slots(decoding, [tokens[r] for r in decoding], [tokens[r] for r in decoding],
                                     stop_on_failure=False)
        step_fn(decoding, [tokens[r] for r in decoding], finished)
        dev_adm = dev.admitted[: len(decoding)].tolist()
        assert [int(x) for x in ref_adm] == dev_adm, step
        for r in finished:
            del tokens[r]
        for r, ok in zip(decoding, ref_adm):
            if not ok:  # preempted: the scheduler frees it
                ref.free([r])
                dev_manager.free([r])
                del tokens[r]
        expect = [ref.slot_mapping([r], [tokens_r - 1])[0] for r, tokens_r, ok in
                  zip(decoding, [tokens.get(r, 1) for r in decoding], ref_adm) if ok]
        got = [s for s, ok in zip(dev.slot_mapping[: len(decoding)].tolist(), ref_adm) if ok]
        assert got == expect, step
        ev = assert_managers_agree(ref, dev_manager, where=f"step {step}")  # events: [] with events off
        num_events += len(ev)
    return num_events


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("groups", [("full",), ("full", ("sliding_window", 8))])
def test_eager_decode_step_equals_reference(groups, events):
    """Full groups only (``ManagerConfig.SW`` off: no window passes) and with a window; KV events
    off (no event layout) and on (every event row compared)."""
    kw = {"enable_kv_cache_events": events}
    ref, dev_m = twin(groups, **kw)
    step = DecodeStep(dev_m, max_batch=6)

    def run(decoding, ntok, finished):
        fill(step, decoding, ntok, finished)
        step.run()

    num_events = drive(run, ref, step, steps=sized(40, 12), seed=5, dev_manager=dev_m)
    assert (num_events > 0) == events


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


class LaunchCounter:
    """Counts Triton launches (interpreter) and host reads of device tensors inside the block."""

    SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__")

    def __enter__(self):
        import triton.runtime.interpreter as interp

        self.launches = self.syncs = 0
        self._cls = interp.InterpretedFunction
        self._getitem = self._cls.__getitem__
        counter = self

        def getitem(fn, grid):
            counter.launches += 1
            return counter._getitem(fn, grid)

        self._cls.__getitem__ = getitem
        self._saved = {}
        for name in self.SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, _orig=orig, **kw):
                counter.syncs += 1
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        self._cls.__getitem__ = self._getitem
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreter launches")
def test_decode_step_launches_and_syncs_do_not_depend_on_batch_size():
    """A decode step is the same fixed sequence of launches with no host sync, for 1 or 24 requests
    (the request-parallel kernel, the exact path that returns at once, ...): nothing loops over
    requests on the host."""
    counts = []
    for batch in (1, 24):
        m = KVCacheManager(256, block_size=BS, max_num_reqs=32, max_blocks_per_req=8)
        for r in range(batch):
            m.add_request(r, [h(1000 * r + i) for i in range(2)])
        m.allocate_slots(list(range(batch)), [7] * batch, [7] * batch, [1] * batch)
        step = DecodeStep(m, 32)
        fill(step, list(range(1, batch)), [8] * (batch - 1), [0])
        with LaunchCounter() as c:
            step.run()
        m.pool.check()
        assert step.admitted[: batch - 1].tolist() == [1] * (batch - 1)
        assert m.pool.statistics()["alloc_fallback"] == 0
        counts.append((c.launches, c.syncs))
    assert counts[0] == counts[1], counts
    # the step kernel (check, free, allocate, slot mapping), the copy release
    assert counts[0] == (2, 0), counts
