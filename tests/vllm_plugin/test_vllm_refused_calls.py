"""A refused call changes nothing (docs/vllm.md, "The drop-in BlockPool", Errors): for every entry point
of the vLLM adapter (``gpupool.vllm.BlockPool`` and the fast path, ``DeferredBlockPool``, over both
backends), a refused call between two op lists leaves the same state, the same answers and the same
device reads and synchronisations of the later ops as the two lists without it; the call raises a
typed error (a PoolError), worded alike by both backends and both adapters.

The op lists make keyed held blocks, un-keyed held blocks, keyed free blocks, prefix hits, pops,
cachings, frees and ``end_step`` calls; the refused calls are each entry point's bad types, ranges,
nulls, double frees and other pools' blocks, the read-only views' mutators, ``ref_cnt`` writes and the
calls through ``device_pool`` that it refuses.
"""
from harness.paths import CONFORMANCE
import sys
import types

import pytest
import torch

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import D2H  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

BS = driver.BLOCK_SIZE
N = 16
KINDS = [(BlockPool, "reference"), (BlockPool, "device"), (DeferredBlockPool, "reference"),
         (DeferredBlockPool, "device")]


def req(seed, n):
    return driver.request(driver.tokens_of(seed)[:n * BS])


def set_attr(obj, name, value):
    setattr(obj, name, value)


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


# name -> the refused call (p: the pool; a: 3 held blocks, the first 2 keyed; b: 2 held un-keyed; c: 2
# keyed free blocks; o: another pool's held block)
REFUSED = {
    "get_new_blocks(str)": lambda p, a, b, c, o: p.get_new_blocks("2"),
    "get_new_blocks(-1)": lambda p, a, b, c, o: p.get_new_blocks(-1),
    "get_new_blocks(bool)": lambda p, a, b, c, o: p.get_new_blocks(True),
    "get_new_blocks(past free)": lambda p, a, b, c, o: p.get_new_blocks(p.get_num_free_blocks() + 1),
    "get_new_blocks(2**70)": lambda p, a, b, c, o: p.get_new_blocks(2 ** 70),
    "free_blocks(free block)": lambda p, a, b, c, o: p.free_blocks([b[0], c[0]]),
    "free_blocks(twice)": lambda p, a, b, c, o: p.free_blocks([b[0], b[1], b[0]]),
    "free_blocks(int inside)": lambda p, a, b, c, o: p.free_blocks([b[0], 3]),
    "free_blocks(None)": lambda p, a, b, c, o: p.free_blocks(None),
    "free_blocks(other pool, twice)": lambda p, a, b, c, o: p.free_blocks([b[0], o[0], o[0]]),
    "touch(None inside)": lambda p, a, b, c, o: p.touch([a[0], None]),
    "touch(str)": lambda p, a, b, c, o: p.touch("x"),
    "touch(other pool)": lambda p, a, b, c, o: p.touch([c[0], o[0]]),
    "unpin_blocks(null)": lambda p, a, b, c, o: p.unpin_blocks([b[0], p.null_block], lambda blk: None),
    "unpin_blocks(free block)": lambda p, a, b, c, o: p.unpin_blocks([b[0], c[0]], lambda blk: None),
    "unpin_blocks(not callable)": lambda p, a, b, c, o: p.unpin_blocks([b[0]], "x"),
    "unpin_blocks(int inside)": lambda p, a, b, c, o: p.unpin_blocks([b[0], 3], lambda blk: None),
    "cache_full_blocks(-1)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 2), b, -1, 2, BS, 0),
    "cache_full_blocks(past blocks)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 3), b, 0, 3, BS, 0),
    "cache_full_blocks(no hashes)": lambda p, a, b, c, o: p.cache_full_blocks(types.SimpleNamespace(), b, 0, 2, BS, 0),
    "cache_full_blocks(too few hashes)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 1), b, 0, 2, BS, 0),
    "cache_full_blocks(conflict)": lambda p, a, b, c, o: p.cache_full_blocks(req(3, 2), [b[0], a[1]], 0, 2, BS, 0),
    "cache_full_blocks(mask)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 2), b, 0, 2, BS, 0, [True]),
    "cache_full_blocks(block size 0)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 2), b, 0, 2, 0, 0),
    "cache_full_blocks(group -1)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 2), b, 0, 2, BS, -1),
    "cache_full_blocks(other pool)": lambda p, a, b, c, o: p.cache_full_blocks(req(2, 2), [b[0], o[0]], 0, 2, BS, 0),
    "cache_partial_block(tokens)": lambda p, a, b, c, o: p.cache_partial_block(req(2, 2), b[0], -3, 0, BS),
    "cache_partial_block(int)": lambda p, a, b, c, o: p.cache_partial_block(req(2, 2), 3, BS, 0, BS),
    "move_block_hashes(to null)": lambda p, a, b, c, o: p.move_block_hashes(a[0], p.null_block),
    "move_block_hashes(int)": lambda p, a, b, c, o: p.move_block_hashes(a[0], 3),
    "get_cached_block(int hash)": lambda p, a, b, c, o: p.get_cached_block(12345, [0]),
    "get_cached_block(str group)": lambda p, a, b, c, o: p.get_cached_block(b"h" * 32, ["0"]),
    "get_cached_block(group -1)": lambda p, a, b, c, o: p.get_cached_block(b"h" * 32, [-1]),
    "evict_blocks(out of range)": lambda p, a, b, c, o: p.evict_blocks({a[0].block_id, 10 ** 9}),
    "evict_blocks(str)": lambda p, a, b, c, o: p.evict_blocks({"x"}),
    "is_block_writable(int)": lambda p, a, b, c, o: p.is_block_writable(3),
    "ref_cnt lowered": lambda p, a, b, c, o: set_attr(b[0], "ref_cnt", 0),
    "ref_cnt of a free block": lambda p, a, b, c, o: set_attr(c[0], "ref_cnt", 5),
    "ref_cnt of the null block": lambda p, a, b, c, o: set_attr(p.null_block, "ref_cnt", 2),
    "ref_cnt str": lambda p, a, b, c, o: set_attr(b[0], "ref_cnt", "x"),
    "ref_cnt huge": lambda p, a, b, c, o: set_attr(b[0], "ref_cnt", 10 ** 9),
    "set_block_hash": lambda p, a, b, c, o: b[0].set_block_hash(b"h" * 36),
    "insert(short key)": lambda p, a, b, c, o: p.cached_block_hash_to_block.insert(b"abc", b[0]),
    "insert(int)": lambda p, a, b, c, o: p.cached_block_hash_to_block.insert(b"h" * 36, 3),
    "cached_block_hash_to_block.pop": lambda p, a, b, c, o: p.cached_block_hash_to_block.pop(b"h" * 36),
    "free_block_queue.popleft": lambda p, a, b, c, o: p.free_block_queue.popleft(),
    "device_pool.handle": lambda p, a, b, c, o: p.device_pool.handle(),
    "device_pool attribute": lambda p, a, b, c, o: set_attr(p.device_pool, "num_blocks", 3),
}
# calls through device_pool run after the fast path's ops are launched and checked, whatever their
# outcome (docs/vllm.md, "Other users of the device pool"): the later ops' reads may differ
SYNC_FIRST = {"device_pool.free_batched"}
DEVICE_ONLY = {
    "device_pool.free_batched": lambda p, a, b, c, o: p.device_pool.free_batched(i32([N + 3]), i32([0, 1])),
}


def setup(cls, backend):
    """A pool after the first op list, its blocks (a, b, c) and another pool's held block (o)."""
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    p = cls(N, True, BS, **kw)
    other = cls(4, True, BS, **kw)
    o = other.get_new_blocks(1)
    a = p.get_new_blocks(3)
    p.cache_full_blocks(req(1, 3), a, 0, 2, BS, 0)
    b = p.get_new_blocks(2)
    c = p.get_new_blocks(2)
    p.cache_full_blocks(req(5, 2), c, 0, 2, BS, 0)
    p.free_blocks(list(reversed(c)))
    p.end_step()
    return p, (a, b, c, o)


def refuse(case, p, blocks) -> tuple[str, str]:
    """The refused call: its error's (type, message); it must be a PoolError."""
    try:
        (REFUSED.get(case) or DEVICE_ONLY[case])(p, *blocks)
    except (PoolError, AssertionError) as e:
        assert isinstance(e, PoolError), repr(e)  # typed, not a bare AssertionError
        return type(e).__name__, str(e)
    raise AssertionError(f"{case} was not refused")


def run(cls, backend, case, monkeypatch):
    """The op lists with ``case`` between them (None: without): (the answers of the later ops, their
    device reads and synchronisations, the final state)."""
    p, blocks = setup(cls, backend)
    a, b, c, o = blocks
    if case is not None:
        refuse(case, p, blocks)
    d2h = D2H(monkeypatch)
    syncs0 = sum(getattr(p, "syncs", {}).values())
    seen = []
    hit = p.get_cached_block(req(5, 2).block_hashes[0], [0])
    seen.append([(x.block_id, x.ref_cnt, x.block_hash) for x in hit])
    p.touch(hit)
    d = p.get_new_blocks(2)
    p.cache_full_blocks(req(6, 2), d, 0, 1, BS, 0)
    p.free_blocks(list(reversed(b)))
    p.end_step()
    e = p.get_new_blocks(3)
    p.free_blocks(list(reversed(a)) + hit)
    p.end_step()
    seen += [[x.block_id for x in d + e], p.get_num_free_blocks(), [x.ref_cnt for x in d + e]]
    reads = (d2h.n, sum(getattr(p, "syncs", {}).values()) - syncs0)
    monkeypatch.undo()
    if isinstance(p, DeferredBlockPool):
        p.sync()
    return [seen, None if case in SYNC_FIRST else reads, driver.snapshot(p),
            o[0].pool.blocks[o[0].block_id].ref_cnt]


_WITHOUT: dict = {}


def check_unchanged(case, kinds, monkeypatch):
    for cls, backend in kinds:
        if case in DEVICE_ONLY and backend != "device":
            continue
        if (cls, backend) not in _WITHOUT:
            _WITHOUT[cls, backend] = run(cls, backend, None, monkeypatch)
        without = list(_WITHOUT[cls, backend])
        got = run(cls, backend, case, monkeypatch)
        if case in SYNC_FIRST:
            without[1] = None
        assert got == without, (cls.__name__, backend)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_call_changes_nothing(case, monkeypatch):
    check_unchanged(case, [k for k in KINDS if k[1] == "reference"], monkeypatch)


@pytest.mark.slow  # 49 cases, about 5 min
@pytest.mark.parametrize("case", list(REFUSED) + list(DEVICE_ONLY))
def test_a_refused_call_changes_nothing_device(case, monkeypatch):
    check_unchanged(case, [k for k in KINDS if k[1] == "device"], monkeypatch)


def test_both_backends_word_them_alike():
    """Every refused call, one after another on one pool per adapter and backend (each changes
    nothing, above): the same error type and message everywhere."""
    errors = {}
    for cls, backend in KINDS:
        p, blocks = setup(cls, backend)
        errors[cls.__name__, backend] = {case: refuse(case, p, blocks) for case in REFUSED}
    first = errors[KINDS[0][0].__name__, KINDS[0][1]]
    for kind, got in errors.items():
        assert got == first, (kind, {c: (got[c], first[c]) for c in got if got[c] != first[c]})
