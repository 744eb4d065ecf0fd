"""KV-cache events (docs/semantics.md section 2, vLLM's ``BlockStored`` / ``BlockRemoved`` stream) at
their edges: rows past an int32 key sequence (int64 sequence numbers, in single ops and through
decode steps, eager or a captured graph), the event buffer's size (a constructor argument; an op
that could overflow it raises ``BufferFullError`` and changes nothing: pool, ``allocate_slots``,
the decode step and a burst), a partial block's ``BlockStored`` (its hash block size) and the empty
``BlockStored`` of null or masked blocks. vLLM's event objects are in tests/vllm_plugin/test_vllm_events.py.
"""
from __future__ import annotations

import pytest
import torch

from gpupool import BlockPool
from gpupool.errors import BufferFullError, InvalidArgumentError
from gpupool.events import BlockStored
from gpupool.graph import DecodeStep
from gpupool.kernels.layout import Ctrl
from harness.compare import assert_consistent, assert_managers_agree
from harness.device import cpu_i32
from harness.keys import h
from harness.ops import fill_step as fill, reference_decode_step
from harness.state import manager_snapshot, pool_state
from harness.twins import POOL_IDS, POOLS, SMALL_BS, SMALL_TOKENS, SW, small_manager, small_manager_twin


def test_event_rows_past_int32_key_sequence():
    """Key sequence numbers are int64: past 2**31 BlockStored still carries parent, block size and
    group, and lookups still return the earliest-inserted block."""
    p = BlockPool(16, enable_kv_cache_events=True)
    p.state.ctrl[Ctrl.KEY_SEQ] = 2**31 - 2
    b = p.get_new_blocks(4).tolist()
    p.cache_full_blocks(b, [h(1), h(2), h(3), h(4)], 0, 4, 16, 1)
    ev = p.take_events()
    assert ev[0] == BlockStored((h(1), h(2), h(3), h(4)), None, 16, 1)
    assert int(p.state.ctrl[Ctrl.KEY_SEQ]) >= 2**31 + 2
    c = p.get_new_blocks(1).tolist()
    p.cache_full_blocks([b[0]] + c, [h(1), h(2)], 1, 2, 16, 1)  # a second holder of h(2), later
    assert p.take_events()[0] == BlockStored((h(2),), h(1), 16, 1)
    assert p.get_cached_block(h(2), [1]) == [b[1]]  # earliest inserted
    assert_consistent(p)


def test_event_capacity_argument_and_overflow():
    """Event rows are a constructor argument (not sized for the worst op); a batched op that could
    overflow them records BufferFullError and changes nothing."""
    small, big = BlockPool(64, enable_kv_cache_events=True), BlockPool(4096, enable_kv_cache_events=True)
    assert small.metadata_bytes()["buffers"] == big.metadata_bytes()["buffers"]  # not O(worst op per block)
    assert BlockPool(64, enable_kv_cache_events=True, event_capacity=4).metadata_bytes()["buffers"] == 4 * 6 * 8
    p = BlockPool(16, enable_kv_cache_events=True, event_capacity=5)
    b = p.get_new_blocks(6).tolist()
    p.cache_full_blocks(b[:3], [h(i) for i in range(3)], 0, 3, 16, 0)  # 4 rows each
    p.take_events()
    p.cache_full_blocks(b[3:], [h(i) for i in range(3, 6)], 0, 3, 16, 0)
    p.take_events()
    p.free_blocks(b)
    p.get_new_blocks(15 - 6)  # leave only the six keyed blocks free
    before = pool_state(p)
    p.allocate_batched(cpu_i32([6]))  # evicting 6 keys needs 6 rows > 5
    with pytest.raises(BufferFullError):
        p.check()
    assert pool_state(p) == before
    assert p.take_events() == []
    with pytest.raises(InvalidArgumentError):
        BlockPool(4, enable_kv_cache_events=True, event_capacity=0)


@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_partial_block_stored_reports_hash_block_size(cls):
    p = cls(4, enable_kv_cache_events=True)
    b = int(p.get_new_blocks(1)[0])
    p.take_events()
    p.cache_partial_block(b, [b"h0" * 16, b"h1" * 16], num_tokens=8, group_id=0, block_size=12, hash_block_size=4)
    assert p.take_events() == [BlockStored((b"h1" * 16,), b"h0" * 16, 4, 0)]


@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_cache_full_blocks_of_null_or_masked_blocks_emits_empty_stored(cls):
    p = cls(4, enable_kv_cache_events=True)
    p.cache_full_blocks([0, 0], [h(0), h(1)], 0, 2, 4, 0)
    assert p.take_events() == [BlockStored((), None, 4, 0)]
    b = [int(x) for x in p.get_new_blocks(2)]
    p.take_events()
    p.cache_full_blocks(b, [h(0), h(1)], 1, 2, 4, 1, block_mask=[False])
    assert p.take_events() == [BlockStored((), h(0), 4, 1)]
    assert p.get_cached_block(h(1), [1]) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", pytest.param("graph", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_decode_step_events_past_int32_key_sequence(groups, mode):
    """Decode steps (eager, or one captured graph replayed) past an int32 key sequence: every
    BlockStored carries the reference's hashes, parent, block size and group."""
    ref, dev = small_manager_twin(groups=groups, enable_kv_cache_events=True)
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
            if ntok[r] % SMALL_BS == 0:
                for m in (ref, dev):
                    m.append_block_hashes(r, [h(100 * r + i)])
        want = reference_decode_step(ref, [0, 1], [ntok[0], ntok[1]])
        assert want.error is None and want.admitted == [[1, 1]], i  # room for both: nobody preempted
        fill(step, [0, 1], [ntok[0], ntok[1]])
        run()
        dev.pool.check()
        assert dev.pool.take_events() == ref.pool.take_events(), i
        if ntok[1] >= SMALL_TOKENS - 1:  # rows full: restart both requests
            for m in (ref, dev):
                m.free([0, 1])
                m.add_request(0, [h(1)])
                m.add_request(1, [h(1), h(2)])
                m.allocate_slots([0, 1], [5, 9], [5, 9], [1, 1])
            ntok = {0: 5, 1: 9}
            assert dev.pool.take_events() == ref.pool.take_events(), i
    assert int(dev.pool.state.ctrl[Ctrl.KEY_SEQ]) > 2**31
    assert_managers_agree(ref, dev)
    dev.validate()


@pytest.mark.parametrize("how", ["allocate_slots", "decode_step", "burst"])
def test_event_buffer_too_small_is_buffer_full_and_changes_nothing(how):
    """A batch whose caching could write more event rows than the buffer holds records
    BufferFullError (value: the rows) in its input check and changes nothing: allocate_slots, the
    decode step, and a 2-step burst (refused by the window's begin, which checks step 0's rows, op
    ``window_begin``; a later step's own check, op ``window_step``, is not isolated here)."""
    import hashlib
    m = small_manager(enable_caching=True, enable_kv_cache_events=True, event_capacity=2)
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    m.add_request(0, hashes)
    m.pool.take_events()
    before = manager_snapshot(m)
    with pytest.raises(BufferFullError) as e:
        if how == "allocate_slots":
            m.allocate_slots(cpu_i32([0]), cpu_i32([0]), cpu_i32([6 * SMALL_BS]))
        else:
            step = DecodeStep(m, 2, steps=1 if how == "decode_step" else 2)
            step.slots[:1] = cpu_i32([0])
            step.num_tokens[:1] = cpu_i32([6 * SMALL_BS])
            step.num_reqs.fill_(1)
            step.run()
        m.pool.check()
    assert manager_snapshot(m) == before
    assert e.value.op == ("allocate_slots" if how == "allocate_slots" else "window_begin")

