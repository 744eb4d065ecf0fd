"""Output buffers the manager's batched ops take (``out=``, ``admitted=``, a decode step's
``slot_mapping``, ``attention_views(out=)``): one that shares memory with another output, with an
input or with the manager's or pool's own tensors is refused on the host before any launch
(InvalidArgumentError), with nothing changed; buffers that are disjoint views of one allocation (a
``DecodeStep``'s) are fine. ``gpupool.tensors.check_disjoint`` compares the bytes each tensor reaches,
not start addresses."""
from __future__ import annotations

import functools

import pytest
import torch

from gpupool.errors import InvalidArgumentError
from gpupool.kv_cache import AttentionViews
from gpupool.manager import KVCacheManager
from gpupool.tensors import check_disjoint, memory_span

BS = 4
i32, i64 = torch.int32, torch.int64


@functools.cache
def shared_manager():
    """One manager for the refused calls (none of them may change it: each test checks so)."""
    return manager()


def manager():
    m = KVCacheManager(32, block_size=BS, max_num_reqs=4, max_blocks_per_req=8)
    for r in range(2):
        m.add_request(r, [])
    m.allocate_slots([0, 1], [5, 6], [5, 6])
    return m


def snapshot(m):
    return [t.clone() for t in (*m.state, *m.pool.state)]


def buffer_calls():
    """(name, call(m)) pairs, each passing an output that overlaps something."""
    def slot_mapping_out_is_positions(m):
        buf = torch.zeros(4, dtype=i64)
        buf[:2] = torch.tensor([1, 2])
        m.slot_mapping(torch.tensor([0, 1], dtype=i32), buf[:2], out=buf[1:3])

    def slot_mapping_out_is_state(m):
        m.slot_mapping([0], [1], out=m.state.req_hi.view(-1)[:1])

    def reserve_out_is_slots(m):
        buf = torch.tensor([0, 1, 0], dtype=i32)
        m.reserve(buf[:2], [1, 1], out=buf[1:])

    def reserve_out_is_num_reserved(m):
        m.reserve([0], [1], out=m.num_reserved)

    def allocate_admitted_is_num_tokens(m):
        buf = torch.tensor([6, 7, 0], dtype=i32)
        m.allocate_slots([0, 1], buf[:2], [6, 7], admitted=buf[1:])

    def allocate_admitted_is_the_count(m):
        buf = torch.tensor([0, 2, 0], dtype=i32)
        m.allocate_slots([0, 1], [6, 7], [6, 7], num_reqs=buf[1:2], admitted=buf[:2])

    def views_out_is_admitted(m):
        out = AttentionViews.empty(2, 8, 2)
        m.attention_views([0, 1], [5, 6], admitted=out.kv_last_page_len, out=out)

    return [(f.__name__, f) for f in (slot_mapping_out_is_positions, slot_mapping_out_is_state, reserve_out_is_slots,
                                      reserve_out_is_num_reserved, allocate_admitted_is_num_tokens,
                                      allocate_admitted_is_the_count, views_out_is_admitted)]


@pytest.mark.parametrize("name,call", buffer_calls(), ids=[n for n, _ in buffer_calls()])
def test_overlapping_output_is_refused_and_changes_nothing(name, call):
    m = shared_manager()
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="shares? memory"):
        call(m)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(m))), name
    m.pool.check()
    m.validate()


def test_disjoint_views_of_one_buffer_are_fine():
    """A DecodeStep's inputs and outputs are views of shared buffers at disjoint offsets: accepted."""
    m = manager()
    buf = torch.zeros(8, dtype=i32)
    buf[:2] = torch.tensor([0, 1])
    buf[2:4] = torch.tensor([1, 2])
    out = torch.zeros(2, dtype=i64)
    m.slot_mapping(buf[:2], buf[2:4], num=buf[4:5].fill_(2), out=out)
    m.pool.check()
    assert out.tolist() == [m.rows()[0][0] * BS + 1, m.rows()[1][0] * BS + 2]
    admitted = buf[6:8]
    assert m.allocate_slots(buf[:2], [6, 7], [6, 7], admitted=admitted).tolist() == [1, 1]
    m.pool.check()


def test_memory_span_reaches_every_element():
    """The span covers a view's first to last element: strided views that interleave in one
    storage overlap (conservatively refused), neighbouring slices do not, empty tensors reach nothing."""
    t = torch.zeros(8, dtype=i32)
    even, odd = t[0::2], t[1::2]
    with pytest.raises(InvalidArgumentError):
        check_disjoint("op", [(even, "even")], [(odd, "odd")])
    check_disjoint("op", [(t[:4], "a"), (t[4:], "b")])
    check_disjoint("op", [(t[:0], "empty"), (t, "all")])
    check_disjoint("op", [(t[:4], "out")], [(t[4:], "in"), (t[4:], "in again")])  # inputs may share memory
    assert memory_span(t[:0]) is None
    dev, lo, hi = memory_span(t.view(2, 4).t())  # a transpose reaches the same bytes
    assert (lo, hi) == (t.data_ptr(), t.data_ptr() + 32)


def test_many_live_held_objects_refuse_an_overlapping_output_and_accept_a_disjoint_one():
    """Fifty live objects' held memory (as fifty managers' states would be), interleaved in one buffer
    (object k holds elements 16k .. 16k + 7, one of them two spans) plus a real manager: an output
    reaching into any object's bytes is refused naming that object's tensor (the op's own without its
    owner), one in the gaps between them or elsewhere is accepted; an object that dies leaves the index
    (its bytes are anyone's again) while the others still refuse."""
    import gc

    from gpupool.tensors import HeldMemory

    buf = torch.zeros(16 * 50 + 8, dtype=i32)
    held = [HeldMemory([(buf[16 * k:16 * k + 3], f"head {k}"), (buf[16 * k + 3:16 * k + 8], f"tail {k}")]
                       if k % 7 == 0 else [(buf[16 * k:16 * k + 8], f"part {k}")], owner=f"object {k}")
            for k in range(50)]
    m = shared_manager()
    gap = lambda k: buf[16 * k + 8:16 * k + 16]  # noqa: E731 - between object k and k + 1

    def refused(out, word, own=None):
        with pytest.raises(InvalidArgumentError, match=word):
            check_disjoint("op", [(out, "out")], held=own)

    for k in (0, 1, 7, 24, 49):
        name = f"head {k}" if k % 7 == 0 else f"part {k}"
        refused(buf[16 * k:16 * k + 1], rf"^op: out shares memory with object {k}'s state \({name}\)")
        refused(buf[16 * k + 7:16 * k + 12], f"object {k}'s state")  # its last element, then the gap
        refused(buf[16 * k + 4:16 * k + 20], f"object ({k}|{k + 1})'s state")  # inside it, past the next's start
        refused(buf[16 * k + 1:16 * k + 2], rf"^op: out shares memory with {name}: an output", own=held[k])
        check_disjoint("op", [(gap(k), "out")])
        check_disjoint("op", [(gap(k), "out")], held=held[k])
    refused(buf[8:16 * 50], r"object \d+'s state")  # across all of them
    end = 16 * 50  # an object holding the last 8 elements, and one a view inside them
    outer = HeldMemory([(buf[end:end + 8], "all of it")], owner="the outer object")
    inner = HeldMemory([(buf[end + 1:end + 2], "one")], owner="the inner object")
    refused(buf[end + 5:end + 6], r"the outer object's state \(all of it\)")  # past the inner, inside the outer
    refused(m.state.num_computed, "a manager's state")
    check_disjoint("op", [(torch.zeros(64, dtype=i32), "out")])

    dead = list(range(0, 50, 2))
    for k in dead:
        held[k] = None
    gc.collect()
    for k in range(50):
        out = buf[16 * k:16 * k + 8]
        if k in dead:
            check_disjoint("op", [(out, "out")])
        else:
            refused(out, f"object {k}'s state")
    refused(m.state.num_computed, "a manager's state")
    refused(buf[end + 1:end + 2], "the (inner|outer) object's state")
    assert outer.owner and inner.owner
