"""The request-parallel ``allocate_slots`` (kernels/requests/parallel.py): hand-written batches that take
the parallel path, and one per fallback reason, each compared with ``ReferenceKVCacheManager`` on the
whole state (rows, counters, free-queue order, ref counts, keys, events) by the side-by-side harness
of ``test_kv_cache_manager.py``; the device's path counters say which path ran. The random differential tests
(``test_kv_cache_manager.py``) drive both paths too."""
from __future__ import annotations

import pytest

from gpupool.kernels.layout import Fallback
from harness.manager_pair import HASH, ManagerPair, add, alloc, small_pair


def stats(p: ManagerPair) -> tuple[int, int, list[int]]:
    s = p.dev.pool.statistics()
    return s["alloc_parallel"], s["alloc_fallback"], s["fallback_reasons"]


class PathCheck:
    """Counts the batches run inside, by path; ``reason`` set: exactly one fallback, for it."""

    def __init__(self, p: ManagerPair, reason: Fallback | None):
        self.p, self.reason = p, reason

    def __enter__(self):
        self.before = stats(self.p)
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        par0, fb0, rs0 = self.before
        par1, fb1, rs1 = stats(self.p)
        if self.reason is None:
            assert (par1 - par0, fb1 - fb0) == (1, 0), f"expected the parallel path: {self.before} -> {stats(self.p)}"
        else:
            assert fb1 - fb0 == 1, f"expected a fallback ({self.reason.name}): {self.before} -> {stats(self.p)}"
            assert rs1[self.reason] - rs0[self.reason] == 1, f"expected {self.reason.name}: {rs0} -> {rs1}"
        return False


def prefill(p: ManagerPair, r: int, chain, known: int) -> None:
    add(p, r, chain, known)
    alloc(p, [r], [known], [known], [True])


def decode(p: ManagerPair, slots, reason=None, sof=True) -> list[bool]:
    """One decode token for each slot (the hash of a block it fills is appended first)."""
    nts = []
    for r in slots:
        p.known[r] += 1
        n = p.known[r] // p.hbs
        have = p.num_hashes(r)
        if n > have:
            hs = [HASH[x] for x in p.chain[r][have:n]]
            p.do(f"append_block_hashes({r})", lambda: p.ref.append_block_hashes(r, hs),
                 lambda: p.dev.append_block_hashes(r, hs))
        nts.append(p.known[r])
    with PathCheck(p, reason):
        return alloc(p, list(slots), nts, nts, sof=sof)


@pytest.mark.parametrize("groups", [("full",), ("full", "full")], ids=["full", "full+full"])
@pytest.mark.heavy("full+full", "full")
def test_decode_batch_is_parallel(groups):
    """Block crossings, blocks that fill (keyed, BlockStored with parent), quiet requests, events on."""
    p = small_pair(groups, num_blocks=48)
    for r, known in enumerate([7, 8, 6, 3]):
        prefill(p, r, list(range(10 * r, 10 * r + 8)), known)
    decode(p, [0, 1, 2, 3])  # 7->8 fills a block; 8->9 crosses; 6->7 quiet; 3->4 fills the first block
    decode(p, [3, 0, 1])
    for _ in range(4):
        decode(p, [0, 1, 2, 3])


def test_new_requests_sharing_a_cached_prefix_are_parallel():
    """Two new requests hit the same zero-ref cached prefix (the first hitter's touch counts it as
    zero-ref, the second's not); a third misses everything."""
    p = small_pair(num_blocks=40)
    prefill(p, 0, [0, 1, 2, 3, 4], 20)
    free(p, 0)
    add(p, 1, [0, 1, 2, 7, 8], 20)
    add(p, 2, [0, 1, 9], 12)
    add(p, 3, [20, 21], 8)
    with PathCheck(p, None):
        assert alloc(p, [1, 2, 3], [20, 12, 8], [20, 12, 8], [True, True, True]) == [True, True, True]


def test_duplicate_prefix_in_one_batch_falls_back():
    """The second request's first miss is a key the first request caches in the same batch."""
    p = small_pair(num_blocks=40)
    add(p, 0, [0, 1, 2], 12)
    add(p, 1, [0, 1, 5], 12)
    with PathCheck(p, Fallback.PREFIX):
        alloc(p, [0, 1], [12, 12], [12, 12], [True, True])


@pytest.mark.heavy
def test_zero_ref_hit_an_earlier_request_pops_falls_back():
    """Request 1 hits cached blocks at the head of the queue that request 0's pops take first."""
    p = small_pair(num_blocks=16)
    prefill(p, 0, [0, 1], 8)
    free(p, 0)  # its two keyed blocks go to the tail, behind the 13 un-hashed ones
    prefill(p, 2, list(range(20, 28)), 32)  # these two take the 13 un-hashed blocks
    prefill(p, 3, list(range(30, 35)), 20)
    free(p, 3)  # keyed: behind the first request's blocks, which are now at the head
    add(p, 0, [5, 6], 8)
    add(p, 1, [0, 1, 3], 12)
    with PathCheck(p, Fallback.PREFIX):
        alloc(p, [0, 1], [8, 12], [8, 12], [False, True], sof=False)


def free(p: ManagerPair, r: int) -> None:
    p.do(f"free([{r}])", lambda: p.ref.free([r]), lambda: p.dev.free([r]))
    p.chain[r] = None


@pytest.mark.parametrize("sof", [True, False])
def test_out_of_blocks_mid_batch_falls_back(sof):
    p = small_pair(num_blocks=10)
    for r in range(3):
        add(p, r, [10 * r + i for i in range(8)], 16)
    add(p, 3, [40], 4)
    with PathCheck(p, Fallback.OUT_OF_BLOCKS):
        got = alloc(p, [0, 1, 2, 3], [12, 16, 16, 4], [12, 16, 16, 4], sof=sof)
    assert got == ([True, True, False, False] if sof else [True, True, False, True])


@pytest.mark.heavy
def test_sliding_window_hashed_release_is_parallel():
    """Blocks that leave the window are keyed: they go to the queue's tail, which no pop reaches."""
    p = small_pair(("full", ("sliding_window", 4)), num_blocks=40)
    prefill(p, 0, list(range(8)), 11)
    prefill(p, 1, list(range(10, 18)), 6)
    for _ in range(6):
        decode(p, [0, 1])


def test_sliding_window_unhashed_release_before_pops_falls_back():
    """Caching off: a released block goes to the queue's head, where a later pop takes it."""
    p = small_pair(("full", ("sliding_window", 4)), num_blocks=40, caching=False)
    for r, known in enumerate([12, 8]):
        add(p, r, list(range(10 * r, 10 * r + 8)), known)
        alloc(p, [r], [known], [known])
    with PathCheck(p, Fallback.SLIDING_WINDOW):  # request 0 releases its block 1 to the head; 1 pops
        alloc(p, [0, 1], [13, 9], [13, 9])


def test_partial_keys_fall_back():
    p = small_pair(num_blocks=40, hash_block_size=2)
    add(p, 0, list(range(16)), 6)
    with PathCheck(p, Fallback.PARTIAL_KEY):
        alloc(p, [0], [6], [6])


def test_forced_exact_path_counts_as_forced():
    p = small_pair(num_blocks=40)
    add(p, 0, [0, 1], 8)
    p.dev.parallel = False
    with PathCheck(p, Fallback.FORCED):
        alloc(p, [0], [8], [8])
