"""The fast path's host-side parts, each on its own: the host's copy of the free queue
(``FreeQueueCopy``) against the reference pool's queue under random pops, frees and touches; the op
batch's round rules (``OpBatch.placement``, the flush batch it launches as); the host mirror (``HostMirror``) against the
reference pool, and the binding of placeholders."""
import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.reference import ReferenceBlockPool
from gpupool.vllm.host_mirror import HostMirror, vllm_key
from gpupool.kernels.flush import FlushBatch
from gpupool.vllm.op_batch import OpBatch
from gpupool.vllm.queue_copy import FreeQueueCopy

N = 12


def h(i) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


OPS = st.lists(st.one_of(
    st.tuples(st.just("pop"), st.integers(1, 4), st.booleans()),  # pop n, key them (then cached)
    st.tuples(st.just("free"), st.integers(0, 20)),  # a held request's blocks, tail first
    st.tuples(st.just("touch"), st.integers(0, N - 1)),  # a touch of any block (free or held)
), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, window=st.integers(1, N))
def test_queue_copy_stays_a_prefix_of_the_queue(ops, window):
    """Filled with a window of the queue's first ids, the copy stays the queue's prefix under its rules
    (the owner refills it when a pop does not fit, as the fast path does)."""
    ref = ReferenceBlockPool(N, enable_caching=True)
    qc = FreeQueueCopy()
    qc.fill(ref.free_queue()[:window] + [-1])
    held, seq = [], 0
    for op in ops:
        if op[0] == "pop" and op[1] <= ref.get_num_free_blocks():
            if not qc.fits(op[1]):
                qc.fill(ref.free_queue()[:window])
            got = [int(b) for b in ref.get_new_blocks(op[1])]
            if qc.fits(op[1]):
                assert qc.take(op[1]) == got
            else:
                qc.forget()
            if op[2]:
                seq += 1
                ref.cache_full_blocks(got, [h((seq, i)) for i in range(len(got))], 0, len(got), 4, 0)
            held.append(got)
        elif op[0] == "free" and held:
            blocks = held.pop(op[1] % len(held))[::-1]
            before = ref.get_num_free_blocks()
            refs = [ref.ref_cnt[b] for b in blocks]
            ref.free_blocks(blocks)
            zero = [b for b, r in zip(blocks, refs) if r == 1]
            qc.requeue([b for b in zero if not ref.keys[b]], [b for b in zero if ref.keys[b]], before, N)
        elif op[0] == "touch" and op[1] != 0:
            if ref.ref_cnt[op[1]] == 0:
                qc.unlink(op[1])
            ref.touch([op[1]])
            held.append([op[1]])
        if qc.known():
            queue = ref.free_queue()
            assert list(qc.ids) == queue[:len(qc)]
            assert qc.agrees(queue + [-1])
            assert qc.low(len(queue)) == (len(qc) < qc.low_mark and len(qc) < len(queue))


def test_queue_copy_forgets_placeholders():
    qc = FreeQueueCopy()
    qc.fill([3, -1, 4, 5])
    assert list(qc.ids) == [3, 4, 5] and qc.low_mark == 1
    qc.requeue([N + 1], [], 3, N)  # a placeholder's id is not known
    assert not qc.known() and qc.low(3) and len(qc) == 0


def test_batch_round_rules():
    b = OpBatch()
    launched = N + 2  # slots N, N + 1: placeholders of launched pops
    b.add_pop(2, [5, 6])
    assert b.placement("touch", [7], False, launched) is None  # a touch of another block commutes
    assert b.placement("touch", [5], False, launched) == "round"  # a block the round's pops took
    assert b.placement("free", [7], True, launched) == "round"  # to the front: the pops would take it
    assert b.placement("free", [7], False, launched) is None  # to the back
    assert b.placement("touch", [N + 2], False, launched) == "launch"  # a placeholder not launched
    b.add_cache([5], [(h(1), 0)], [16])
    b.cut()
    b.add_touch([8])
    assert b.placement("free", [8], False, launched) == "round"  # a free of a block the round touched
    b.add_free([8, 9])
    assert b.demands == [2] and b.pred == [5, 6] and b.touch_ids == [8] and b.free_ids == [8, 9]
    assert b.free_offsets == [0, 0, 2] and b.cache_ids == [5]
    assert (b.cache_keys, b.cache_ntok, b.cache_calls) == ([(h(1), 0)], [16], [1])
    # the kernel's round table, as FlushBatch.of_rounds builds it from per-round counts
    assert b.table == FlushBatch.of_rounds([8, 9], [0, 0, 2], [8], [2], [5], ([(h(1), 0)], [16], [1]),
                                           [(0, 0, 0, [2], 1), (2, 1, 1, [], 0)]).table
    empty = OpBatch()
    empty.cut()
    assert not empty and empty.rounds == 1


def test_mirror_follows_the_reference_pool_and_binds_placeholders():
    ref = ReferenceBlockPool(N, enable_caching=True)
    m = HostMirror(N)
    a = [int(x) for x in ref.get_new_blocks(3)]
    ref.cache_full_blocks(a, [h(0), h(1), h(2)], 0, 2, 4, 0)
    m.apply_reference(range(N), ref)
    assert [m.ref[b] for b in a] == [1, 1, 1] and m.keys[a[0]] == (vllm_key(h(0), 0),)
    assert m.ntok[a[1]] == 8 and m.earliest(vllm_key(h(1), 0)) == a[1]
    # a placeholder keyed on the host, then bound to block 7, whose old key it evicts
    m.add_keys([7], [vllm_key(h(9), 0)], [100], [4])
    m.add_placeholder()
    m.add_keys([N], [vllm_key(h(5), 0)], [101], [8])
    m.bind(N, [7])
    assert len(m.ref) == N and m.keys[7] == (vllm_key(h(5), 0),) and m.ref[7] == 1 and m.ntok[7] == 8
    assert m.earliest(vllm_key(h(9), 0)) is None and m.holders[vllm_key(h(5), 0)] == {7: 101}
    m.pop([7])  # a pop evicts its keys
    assert m.earliest(vllm_key(h(5), 0)) is None and m.keys[7] == () and m.ref[7] == 1
    # the rules of touch and release: the blocks that were free, and those reaching 0 (front: no key)
    assert m.touch([7, 9, 9]) == [9] and m.ref[9] == 2
    assert m.release([a[0], 9, 9, 7, 7]) == ([9, 7], [a[0]]) and m.ref[a[0]] == 0
