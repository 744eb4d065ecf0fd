"""The vLLM adapter's backends (``gpupool.vllm.backends``), each driven directly as the fast path and the
per-call pool drive them, against the reference pool (``ReferenceBlockPool``) run beside them: pops of
predicted ids and of placeholders, touches, frees, cachings, then a synchronisation's read and the
mirror update; both backends give the same answers for the same ops. The reads of the per-call pool
(``read_rows``), the exact path (claims, the device's insertion seqs predicted, the second transfer), a recorded error
relaunched, and the factory's error."""
import hashlib

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from gpupool.errors import InvalidArgumentError, InvalidBlockIdError
from gpupool.kernels.layout import MirrorKey, mirror_key_col
from gpupool.reference import ReferenceBlockPool
from gpupool.vllm.backends import DeviceBackend, ReferenceBackend, make_backend
from gpupool.vllm.host_mirror import HostMirror, vllm_key

N, BS, MK = 12, 4, 4
KINDS = ("device", "reference")


def h(i) -> bytes:
    return hashlib.sha256(repr(i).encode()).digest()


def claim_rows(claims) -> list[tuple]:
    """``SyncRead.claims`` (three columns) as one ``(ref count, key count, tokens)`` per block."""
    return list(zip(*claims))


def new(kind: str):
    return make_backend(kind, N, enable_caching=True, enable_kv_cache_events=False, max_keys_per_block=MK,
                        device="cpu")


def oracle_rows(ref: ReferenceBlockPool, ids) -> list:
    return [(ref.ref_cnt[b], tuple(vllm_key(x, g) for x, g in ref.keys[b]), ref.hash_num_tokens[b]) for b in ids]


def mirror_rows(m: HostMirror, ids) -> list:
    return [(m.ref[b], m.keys[b], m.ntok[b]) for b in ids]


class Drive:
    """A backend and the reference pool in lockstep, the ops given as the fast path gives them (blocks
    named by slots: ids, and ``N + k`` for the k-th placeholder until the next synchronisation)."""

    def __init__(self, kind: str):
        self.b = new(kind)
        self.ref = ReferenceBlockPool(N, enable_caching=True, max_keys_per_block=MK)
        self.mirror = HostMirror(N)
        self.held: list[list[int]] = []  # each request's slots
        self.pend: list[int] = []  # the reference pool's ids of the placeholders, in order
        self.answers: list = []  # what the backend answered, for comparing backends
        self.seq = 0

    def oid(self, s: int) -> int:
        return s if s < N else self.pend[s - N]

    def run(self, op) -> None:
        b, ref = self.b, self.ref
        if op[0] == "pop" and 0 < op[1] <= ref.get_num_free_blocks():
            # a placeholder pop forgets the host's copy of the queue: pops are placeholders until the sync
            n, placeholders = op[1], op[2] or bool(self.pend)
            ids = ref.free_queue()[:n]
            assert [int(x) for x in ref.get_new_blocks(n)] == ids
            if placeholders:
                b.pop_pending(n)
                slots = list(range(N + len(self.pend), N + len(self.pend) + n))
                self.pend += ids
            else:
                assert b.pop_known(n, ids) is None
                self.answers.append(ids)
                slots = ids
            self.held.append(slots)
        elif op[0] == "touch" and self.held:
            slots = list(self.held[op[1] % len(self.held)])
            b.queue("touch", slots, False)
            ref.touch([self.oid(s) for s in slots])
            self.held.append(slots)
        elif op[0] == "hit" and ref.free_queue():  # a prefix hit on a free block: it leaves the queue
            blk = ref.free_queue()[op[1] % len(ref.free_queue())]
            b.queue("touch", [blk], False)
            ref.touch([blk])
            self.held.append([blk])
        elif op[0] == "free" and self.held:
            slots = self.held.pop(op[1] % len(self.held))[::-1]
            ids = [self.oid(s) for s in slots]
            front = any(ref.ref_cnt[x] == 1 and not ref.keys[x] for x in ids)
            b.queue("free", slots, front)
            ref.free_blocks(ids)
        elif op[0] == "cache" and self.held:
            slots = self.held[op[1] % len(self.held)]
            ids = [self.oid(s) for s in slots]
            if any(ref.keys[x] for x in ids) or len(set(ids)) != len(ids):
                return  # the fast path caches held, un-keyed blocks listed once
            self.seq += 1
            hashes = [h((self.seq, j)) for j in range(len(ids))]
            ntok = [(j + 1) * BS for j in range(len(ids))]
            seqs = list(b.cache(self.mirror, slots, hashes, 0, ntok, 0, len(ids), BS, lambda: hashes))
            assert len(seqs) == len(ids) and seqs == sorted(set(seqs))
            ref.cache_full_blocks(ids, hashes, 0, len(ids), BS, 0)
        elif op[0] == "sync":
            self.sync(op[1])

    def sync(self, window: int) -> None:
        """Flush, read and check every answer against the reference pool, update the mirror."""
        b, ref = self.b, self.ref
        b.flush()
        known = list(range(1, N))
        r = b.read(known, len(self.pend), window, False)
        assert not r.failed and r.recorded is None and r.bad_pops == 0
        assert r.ids == self.pend and r.num_free == ref.get_num_free_blocks()
        assert claim_rows(r.claims) == [(c, len(k), t) for c, k, t in oracle_rows(ref, known)]
        queue = ref.free_queue()
        if window:  # the queue's first ids (the device's ring has holes: -1)
            got = [v for v in r.window if v >= 0]
            assert got == queue[:len(got)] and (isinstance(b, DeviceBackend) or r.window == queue[:window])
        else:
            assert r.window is None
        b.bound()
        assert b.apply(self.mirror, r, known, False, False) == ref.get_num_free_blocks()
        assert mirror_rows(self.mirror, known) == oracle_rows(ref, known)
        self.answers.append((r.ids, r.num_free, r.claims, mirror_rows(self.mirror, known)))
        self.held = [[self.oid(s) for s in slots] for slots in self.held]
        self.pend = []


OPS = st.lists(st.one_of(
    st.tuples(st.just("pop"), st.integers(1, 4), st.booleans()),  # pop n (placeholders or predicted ids)
    st.tuples(st.just("touch"), st.integers(0, 20)),  # another holder of a request's blocks
    st.tuples(st.just("hit"), st.integers(0, 20)),
    st.tuples(st.just("free"), st.integers(0, 20)),  # a request's blocks, tail first
    st.tuples(st.just("cache"), st.integers(0, 20)),
    st.tuples(st.just("sync"), st.sampled_from([0, 3, N])),
), max_size=14)


@given(ops=OPS)
@example(ops=[("hit", 0), ("free", 0)])  # a free of a block the round touched: a new round
# a touch of a placeholder not launched: launched first; then cached, freed (ids gathered on the device)
@example(ops=[("pop", 2, True), ("touch", 0), ("cache", 0), ("free", 0), ("free", 0), ("sync", 3)])
# placeholders cached in the flush that pops them, after its predicted pops
@example(ops=[("pop", 2, False), ("pop", 2, True), ("cache", 1), ("free", 0), ("sync", 3)])
def test_backends_follow_the_reference_and_agree(ops):
    """The same op sequence on both backends: every answer of each equals the reference pool's, and
    the two answer alike (ids, free counts, claims, the mirror after each synchronisation)."""
    runs = [Drive(kind) for kind in KINDS]
    for d in runs:
        for op in ops:
            d.run(op)
        d.sync(N)
        if isinstance(d.b, DeviceBackend):
            d.b.pool.check()  # nothing recorded
    assert runs[0].answers == runs[1].answers


@pytest.mark.parametrize("kind", KINDS)
def test_read_rows_is_the_pool_state(kind):
    """The per-call pool's read: after ops on the pool, ``read_rows`` sets the mirror to the pool's
    rows (keys in insertion order) and returns the free count."""
    b, ref = new(kind), ReferenceBlockPool(N, enable_caching=True, max_keys_per_block=MK)
    for p in (b.pool, ref):
        a = [int(x) for x in p.get_new_blocks(3)]
        p.cache_full_blocks(a, [h(0), h(1), h(2)], 0, 3, BS, 0)
        c = [int(x) for x in p.get_new_blocks(2)]
        p.cache_full_blocks(c, [h(0), h(5)], 0, 2, BS, 0)  # h(0) held twice: the earlier holder answers
        p.free_blocks(a[::-1])
        p.touch([a[0]])
    m = HostMirror(N)
    assert b.read_rows(list(range(N)), m) == ref.get_num_free_blocks()
    assert mirror_rows(m, range(N)) == oracle_rows(ref, range(N))
    assert m.earliest(vllm_key(h(0), 0)) == a[0] and len(m.holders[vllm_key(h(0), 0)]) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_exact_sync_takes_the_pools_seqs(kind):
    """A synchronisation with the host's rows as claims (``exact``): the claims read are the pool's; the
    claims held, nothing changes: the insertion seqs the host gave the keys are the device's; the
    claims failed, the whole rows are read again."""
    b = new(kind)
    m = HostMirror(N)
    b.read_rows(list(range(N)), m)
    ids = b.window(N)[:3]
    b.pop_known(3, ids)
    hashes = [h(i) for i in range(3)]
    seqs = list(b.cache(m, ids, hashes, 0, [BS, 2 * BS, 3 * BS], 0, 3, BS, lambda: hashes))
    m.pop(ids)  # the host's predicted rows, as the fast path's
    m.add_keys(ids, [vllm_key(x, 0) for x in hashes], seqs, [BS, 2 * BS, 3 * BS])
    b.flush()
    r = b.read(ids, 0, 0, True)
    assert claim_rows(r.claims) == [(1, 1, (i + 1) * BS) for i in range(3)] and r.num_free == N - 4
    assert r.seqs_ok and r.rows is None
    assert b.apply(m, r, ids, True, True) == N - 4
    got = [m.holders[vllm_key(x, 0)][s] for s, x in zip(ids, hashes)]
    assert got == seqs == sorted(got)
    if kind == "device":  # the device's own seqs, as the host predicted them
        assert [row[mirror_key_col(0, MirrorKey.SEQ)] for row in b.pool.mirror_rows(torch.tensor(ids)).tolist()] == seqs
    b.queue("free", ids[::-1], False)
    b.flush()
    r = b.read(ids, 0, 0, True)
    assert r.claims[0] == [0, 0, 0]
    b.apply(m, r, ids, True, False)  # the claims failed: the rows read again, whole
    assert mirror_rows(m, ids) == [(0, (vllm_key(x, 0),), (i + 1) * BS) for i, x in enumerate(hashes)]


def test_device_seqs_taken_whole_when_another_user_keyed_blocks():
    """Another user of the device pool keys a block between the host's prediction and the launch: the
    device numbers the fast path's keys after it, the counter read differs from the host's, and the
    synchronisation takes the changed blocks' whole rows, so the mirror's seqs are the device's."""
    b = DeviceBackend(N, enable_caching=True, enable_kv_cache_events=False, max_keys_per_block=MK, device="cpu")
    other = int(b.pool.get_new_blocks(1)[0])  # another user's block, held
    m = HostMirror(N)
    b.read_rows(list(range(N)), m)
    ids = b.window(N)[:2]
    b.pop_known(2, ids)
    seqs = list(b.cache(m, ids, [h(0), h(1)], 0, [BS, 2 * BS], 0, 2, BS, None))
    m.pop(ids)
    m.add_keys(ids, [vllm_key(h(0), 0), vllm_key(h(1), 0)], seqs, [BS, 2 * BS])
    b.pool.cache_full_blocks([other], [h(9)], 0, 1, BS, 0)  # the other user keys it before the launch
    b.flush()
    r = b.read(ids, 0, 0, True)
    assert not r.seqs_ok and claim_rows(r.claims) == [(1, 1, BS), (1, 1, 2 * BS)]
    b.apply(m, r, ids, True, True)
    dev = [row[5] for row in b.pool.mirror_rows(torch.tensor(ids)).tolist()]
    assert [m.holders[vllm_key(h(i), 0)][s] for i, s in enumerate(ids)] == dev == [q + 1 for q in seqs]


def test_device_relaunches_after_a_recorded_error():
    """Another user's error recorded in the status word before a launch: the launch did nothing; the
    read launches it again, reads again and hands the error back, the ops run once."""
    b = DeviceBackend(N, enable_caching=True, enable_kv_cache_events=False, max_keys_per_block=MK, device="cpu")
    ids = b.window(N)[:2]
    b.pop_known(2, ids)
    b.pool.free_batched(torch.tensor([N + 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    b.flush()
    assert b.flushes == 1
    r = b.read(ids, 0, 0, False)
    assert isinstance(r.recorded, InvalidBlockIdError) and not r.failed
    assert r.num_free == N - 3 and r.claims[0] == [1, 1] and b.flushes == 1
    b.pool.check()  # taken: nothing recorded any more


@pytest.mark.parametrize("name", ["gpu", None, 3])
def test_make_backend_refuses_other_names(name):
    with pytest.raises(InvalidArgumentError, match="backend must be 'device' or 'reference'"):
        make_backend(name, N, enable_caching=True, enable_kv_cache_events=False, max_keys_per_block=MK)
    assert isinstance(new("reference"), ReferenceBackend) and new("reference").stream is None
