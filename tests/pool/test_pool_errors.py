"""Bad input, faults and invariants (docs/semantics.md section 3), on both pools side by side.

Every public op of :class:`gpupool.ReferenceBlockPool` and of the device :class:`gpupool.BlockPool`
checks its input before changing anything. Here random sequences mix valid ops with invalid ones of
every kind the issue lists:

* ids out of range (lists and int32 tensors), the null block where it is not allowed (``unpin_blocks``,
  the target of ``move_block_hashes``), negative or too-large counts (``get_new_blocks``,
  ``num_cached_blocks``, ``num_full_blocks``, ``block_size``, ``num_tokens``), a double free (a block
  listed more times than its ref count, or a free block), unpin of a free block, re-caching a block at
  the same (or a longer) length, a block listed twice, too few ids / hashes / mask entries for
  ``num_full_blocks``, a full key row (``max_keys_per_block``), non-bytes hashes, non-int ids,
  non-callable watchers;
* for the device pool: int64 / float / bool tensors of ids (``InvalidArgumentError``, raised at once,
  also for the batched ops), tensors on another device (only with CUDA), and the batched ops
  (``allocate_batched``, ``free_batched``, ``touch_batched``) whose errors go to the sticky status word:
  ``check()`` raises the class the single op would raise, a valid batched op issued after the failing
  one and before ``check()`` does nothing, and so does a single op (which raises the pending error).

After each invalid op: the right error class on each pool, naming the op (and the offending value
where both pools report one), and a digest of the *full* state equal to the digest before: for the
reference its queue links, ref counts, keys, covered tokens, key-map entry order, watchers and
pending events; for the device every state tensor bit for bit (ring, qslot, control words, key rows,
table, overflow counts, watchers, scratch, event and reuse buffers) plus the host's pending events
and callback table. After every op both pools agree on the whole observable state (free-queue order,
ref counts, every block's keys and ``hash_num_tokens``, ``num_free``, watchers, events, watcher
firings, lookups of every hash used) and ``validate()`` passes on both.

The harness (``harness.fault_pair``: ``FaultPair``, the op generators) is shared with ``tests/pool/test_soak.py``: generators
draw through a small chooser, backed by hypothesis here and by a seeded ``random.Random`` there.

Regression tests for the defects found while writing this file follow; at the end, bad Python
arguments (``None``, floats, non-bytes hashes) raise a typed :class:`PoolError` (``ArgumentTypeError``
for a wrong type) on both pools and both managers, changing nothing; int64 id tensors are accepted;
a pool larger than int32 ids allow is refused.
Without a GPU the kernels run in Triton's interpreter (tests/conftest.py). The default hypothesis
profile keeps this file near a minute on two cores; ``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs more.
"""
from __future__ import annotations

import os

import random
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpupool import BlockPool, ReferenceBlockPool  # noqa
from gpupool.kernels.layout import Op
from gpupool.errors import (
    ArgumentTypeError, DoubleFreeError, InvalidArgumentError, PoolError,
)
from gpupool.keys import device_key
from gpupool.manager import KVCacheManager
from gpupool.reference import ReferenceKVCacheManager

from harness.compare import assert_pools_agree
from harness.device import DEVICE, i32, i64
from harness.keys import h
from harness.sizes import pow2_at_least
from harness.state import ints, pool_state
from harness.twins import POOL_IDS, POOLS, pool_twin, small_manager
from harness.timeouts import scaled
from harness.fault_pair import (  # noqa: E402
    dev_digest, FaultPair, FAULTS, HypChooser, RandChooser, ref_digest, step, UNIVERSE,
)


# Hypothesis fuzz
# =================================================================================================

EXAMPLES = max(3, settings().max_examples // 2)  # "dev" profile: 3; "ci": 12; "deep": 500
# Shrinking re-runs whole interpreted op sequences (minutes); the failing example's op log is printed
# either way (hypothesis notes). GPUPOOL_FAULTS_SHRINK=1 turns it back on.
PHASES = tuple(Phase) if os.environ.get("GPUPOOL_FAULTS_SHRINK") else tuple(p for p in Phase if p != Phase.shrink)


@settings(max_examples=EXAMPLES, deadline=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(st.data())
@pytest.mark.heavy
def test_mixed_valid_and_invalid_ops_on_both_pools(data):
    """Random mixes of valid and invalid ops (single and batched) on small pools: right error class,
    full-state digests unchanged by every fault, pools equal and valid after every op."""
    c = HypChooser(data)
    n = c.pick([2, 5, 8, 12], "num_blocks")
    pair = FaultPair(n, caching=c.chance(85, "caching"), events=c.chance(50, "events"), mk=c.pick([1, 2, 4], "mk"),
                ring=pow2_at_least(n) if c.chance(40, "small_ring") else None)
    for _ in range(c.int(10, 22, "steps")):
        step(pair, c, fault_pct=50)


# =================================================================================================
# Every fault kind at least once, on a prepared pool (independent of the fuzz's luck)
# =================================================================================================

class _Prepared:
    """A pool pair with held blocks (some keyed, one with a full key row), free cached blocks,
    free un-hashed blocks and a registered watcher. Rebuilt after a failing test."""

    pair: FaultPair | None = None

    @classmethod
    def get(cls) -> FaultPair:
        if cls.pair is None:
            p = FaultPair(10, events=True, mk=2)
            p.run("get 7", lambda pool: pool.get_new_blocks(7), norm=ints)  # 1..7 held
            hs = UNIVERSE[:5]
            p.used.update(hs)
            p.run("cache 1..5", lambda pool: pool.cache_full_blocks([1, 2, 3, 4, 5], hs, 0, 5, 16))
            p.used.add(UNIVERSE[9])
            p.run("secondary on 1", lambda pool: pool.cache_partial_block(1, [UNIVERSE[9]], 8, 1, 16, 8))
            p.run("touch 2,6", lambda pool: pool.touch([2, 6, 6]))
            p.run("free 5,4", lambda pool: pool.free_blocks([5, 4]))  # free, cached
            cr, cd = p.callbacks()
            p.run("unpin 3", lambda pool: pool.unpin_blocks([3], cr), lambda pool: pool.unpin_blocks([3], cd))
            assert p.free() and p.held() and any(len(k) == 2 for k in p.ref.keys)
            cls.pair = p
        return cls.pair


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_each_fault_kind(kind):
    """Several draws of one fault kind (seeded) on the prepared pools; a kind with nothing to hit here
    (``other_device`` without CUDA) is skipped."""
    if kind == "other_device" and DEVICE != "cuda":
        pytest.skip("tensors on another device need a CUDA pool")
    try:
        p = _Prepared.get()
        rng = random.Random(kind)
        hits = 0
        for _ in range(6):
            before = pool_state(p.ref)
            if FAULTS[kind](p, RandChooser(rng)) is not False:
                hits += 1
            assert pool_state(p.ref) == before
        assert hits, f"fault kind {kind} never applied"
    except BaseException:
        _Prepared.pair = None
        raise


# =================================================================================================
# Sticky status, spelled out
# =================================================================================================

def test_sticky_status_word_blocks_later_batched_ops_until_check():
    """A failing free_batched, then valid allocate / touch / free batched ops: nothing changes on the
    device (bit for bit, status aside), check() raises DoubleFreeError and clears; the reference, which
    saw none of it, still equals the device; afterwards the same valid ops apply normally."""
    p = FaultPair(8, events=True)
    p.run("get 4", lambda pool: pool.get_new_blocks(4), norm=ints)
    p.used.update(UNIVERSE[:2])
    p.run("cache", lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 2, 16))
    ref_before, dev_before = ref_digest(p.ref), dev_digest(p.dev)
    dev_digest_before_ns = dev_digest(p.dev, status=False)
    p.dev.free_batched(i32([1, 2, 2]), i32([0, 1, 3]))  # segment 1 frees block 2 twice
    assert p.dev.state.status.tolist()[:3] == [DoubleFreeError.code, Op.FREE_BATCHED, 2]
    p.dev.allocate_batched(i32([2]))
    p.dev.touch_batched(i32([5, 6]))
    p.dev.free_batched(i32([3]), i32([0, 1]))
    assert dev_digest(p.dev, status=False) == dev_digest_before_ns
    with pytest.raises(DoubleFreeError) as info:
        p.dev.check()
    assert info.value.op == "free_batched" and info.value.value == 2
    assert dev_digest(p.dev) == dev_before and ref_digest(p.ref) == ref_before
    p.dev.check()
    p.compare()
    p.batched("allocate_batched([2])", [lambda pool: ints(pool.get_new_blocks(2))],
              lambda dev: dev.allocate_batched(i32([2])), lambda out: [ints(out[0])[: ints(out[1])[1]]])
    p.batched("touch_batched([5, 6])", [lambda pool: pool.touch([5, 6])], lambda dev: dev.touch_batched(i32([5, 6])))


# =================================================================================================
# Regression tests for the defects this file found (all fixed)
# =================================================================================================

def test_a_key_table_that_could_fill_is_refused():
    """The device table is sized so it never fills: 16 * num_chunks >= (N - 1) * max_keys_per_block.
    A smaller table (one that a run could overflow) is an InvalidArgumentError at construction; a table
    exactly at its limit is accepted (the soak fills it)."""
    with pytest.raises(InvalidArgumentError, match="num_chunks"):
        BlockPool(9, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 32 keys, 16 slots
    p = BlockPool(5, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 16 keys, 16 slots
    p.get_new_blocks(4)
    p.cache_full_blocks([1, 2, 3, 4], UNIVERSE[:4], 0, 4, 16)
    for i in range(12):
        p.cache_partial_block(1 + i % 4, [h(f"extra{i}")], 4, 0, 16, 4)
    assert sum(len(p.block_keys(b)) for b in range(5)) == 16
    p.validate()


@pytest.mark.parametrize("case", ["cache_full_2**31", "cache_full_2**30_x2", "cache_partial_2**32"])
def test_too_large_token_counts_are_rejected(case):
    p = FaultPair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    fn = {
        "cache_full_2**31": lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 1, 2**31),
        "cache_full_2**30_x2": lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 2, 2**30),
        "cache_partial_2**32": lambda pool: pool.cache_partial_block(1, [UNIVERSE[0]], 2**32, 0, 2**32, 2**32),
    }[case]
    p.run(case, fn)  # both pools must raise the same class, unchanged (or agree on the result)
    assert any(k.startswith("incidental") for k in p.stats), f"{case}: a token count >= 2**31 was accepted"


@pytest.mark.parametrize("g", [2**40, 2**70])
def test_large_group_ids_agree(g):
    p = FaultPair(5)
    p.run("get 1", lambda pool: pool.get_new_blocks(1), norm=ints)
    p.run(f"cache g={g}", lambda pool: pool.cache_full_blocks([1], UNIVERSE[:1], 0, 1, 16, g))
    p.run(f"lookup g={g}", lambda pool: pool.get_cached_block(UNIVERSE[0], [g]),
          norm=lambda x: None if x is None else ints(x))


@pytest.mark.parametrize("case", ["hi_int32", "list"])
def test_lookup_batched_checks_its_tensors(case):
    p = FaultPair(5)
    p.run("get 1", lambda pool: pool.get_new_blocks(1), norm=ints)
    p.run("cache", lambda pool: pool.cache_full_blocks([1], UNIVERSE[:1], 0, 1, 16))
    hi, lo = device_key(UNIVERSE[0], 0)
    args = {
        "hi_int32": (i64([hi]).to(torch.int32), i64([lo]), i32([0])),
        "list": ([hi], [lo], [0]),
    }[case]
    with pytest.raises(InvalidArgumentError):
        p.dev.lookup_batched(*args)


_SEG_OFFSETS_REPRO = textwrap.dedent("""
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from gpupool import BlockPool
    from gpupool.errors import InvalidArgumentError
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool = BlockPool(9, device=dev)
    pool.get_new_blocks(2)
    before = pool.ref_counts()
    try:
        # seg_offsets[-1] == 1 but 2 ids: the kernel reads seg_offsets out of bounds
        pool.free_batched(torch.tensor([1, 2], dtype=torch.int32, device=dev),
                          torch.tensor([0, 1], dtype=torch.int32, device=dev))
        pool.check()
    except InvalidArgumentError:
        assert pool.ref_counts() == before
        print("REJECTED")
""")


def test_free_batched_rejects_mismatched_seg_offsets():
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1" if DEVICE == "cpu" else "0")
    r = subprocess.run([sys.executable, "-c", _SEG_OFFSETS_REPRO], capture_output=True, text=True, env=env,
                       timeout=scaled(120))
    assert r.returncode == 0 and "REJECTED" in r.stdout, f"rc={r.returncode} {r.stdout[-500:]} {r.stderr[-500:]}"


def test_get_cached_block_checks_every_group():
    p = FaultPair(5)
    p.expect_fail("get_cached_block(H0, [0, '1'])", "get_cached_block", ArgumentTypeError,
                  lambda pool: pool.get_cached_block(UNIVERSE[0], [0, "1"]),
                  lambda pool: pool.get_cached_block(UNIVERSE[0], [0, "1"]))


def test_two_dimensional_id_tensors_agree():
    p = FaultPair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    t = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    p.run("touch(2-D tensor)", lambda pool: pool.touch(t))


@pytest.mark.skipif(DEVICE != "cuda", reason="tensors on another device need a CUDA pool")
def test_tensor_on_another_device_is_rejected():
    p = FaultPair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    cpu = torch.tensor([1], dtype=torch.int32)
    for op in ("free_blocks", "touch", "evict_blocks"):
        p.expect_fail(f"{op}(cpu tensor)", op, InvalidArgumentError, None, lambda dev, op=op: getattr(dev, op)(cpu))
    for op, fn in (("allocate_batched", lambda dev: dev.allocate_batched(cpu)),
                   ("touch_batched", lambda dev: dev.touch_batched(cpu)),
                   ("free_batched", lambda dev: dev.free_batched(cpu, torch.tensor([0, 1], dtype=torch.int32)))):
        p.expect_fail(f"{op}(cpu tensor)", op, InvalidArgumentError, None, fn)


# =================================================================================================
# Typed errors for bad Python arguments: both pools, both managers
# =================================================================================================

@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_typed_errors_for_bad_python_arguments(cls):
    p = cls(8)
    b = [int(x) for x in p.get_new_blocks(2)]
    before = pool_state(p)
    cases = [
        lambda: p.cache_full_blocks(b, None, 0, 2, 16, 0),
        lambda: p.cache_full_blocks(b, [h(1), None], 0, 2, 16, 0),
        lambda: p.get_cached_block(h(1), None),
        lambda: p.get_cached_block(h(1), 0),
        lambda: p.get_cached_block(None, [0]),
        lambda: p.get_new_blocks(None),
        lambda: p.get_new_blocks(1.5),
        lambda: p.free_blocks(None),
        lambda: p.touch([None]),
        lambda: p.cache_partial_block(b[0], None, 16, 0, 16, 16),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, (TypeError, ValueError)), (i, info.value)
        assert isinstance(info.value, ArgumentTypeError) or not isinstance(info.value, TypeError), i
    assert pool_state(p) == before


def test_both_pools_accept_int64_id_tensors():
    ref, dev = pool_twin(8)
    for p in (ref, dev):
        b = p.get_new_blocks(3)
        ids = torch.tensor([int(x) for x in b], dtype=torch.int64)
        p.touch(ids)
        p.free_blocks(ids)
        p.cache_full_blocks(ids, [h(1), h(2), h(3)], 0, 3, 16, 0)
        p.free_blocks(torch.flip(ids, [0]))
        p.evict_blocks(ids[:1])
    assert_pools_agree(ref, dev)


@pytest.mark.parametrize("cls", [ReferenceBlockPool, BlockPool])
def test_pool_size_is_bounded_by_int32_ids(cls):
    """Block ids are int32 on the device: both pools refuse more than 2**31 - 1 blocks before
    allocating anything (a typed error, not a MemoryError or an overflow later)."""
    for n in (2**31, 10**11, 0, -1):
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            cls(n)
    with pytest.raises(ArgumentTypeError):
        cls(16.0)


@pytest.mark.parametrize("cls", [ReferenceKVCacheManager, KVCacheManager], ids=["reference", "device"])
def test_manager_typed_errors(cls):
    """Bad Python arguments raise a PoolError subclass (ArgumentTypeError, also a TypeError, for a
    wrong type) on both managers, changing nothing; a group or length the other rejects too."""
    m = small_manager(cls, groups=("full", "full"))
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    rows = [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    cases = [
        lambda: m.add_request(1, None), lambda: m.add_request(1, [None]), lambda: m.add_request(None, []),
        lambda: m.append_block_hashes(0, None), lambda: m.allocate_slots(None, [1], [1]),
        lambda: m.allocate_slots([0], None, [6]), lambda: m.allocate_slots([0], [6], None),
        lambda: m.allocate_slots([0], [6], [6], 5), lambda: m.allocate_slots([0], [6], [6], [None]),
        lambda: m.free(None), lambda: m.free([1.5]), lambda: m.slot_mapping(None, [0]),
        lambda: m.slot_mapping([0], [0], None), lambda: m.cow_append(0, None), lambda: m.cow_move(0, None),
        lambda: m.get_computed_blocks(None, [1]), lambda: m.get_computed_blocks([0], None),
        lambda: m.release_copied(None),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, TypeError), (i, info.value)
    for fn in (lambda: m.slot_mapping([0], [1], 2), lambda: m.slot_mapping([0], [1], -1),
               lambda: m.slot_mapping([0, 0], [1])):
        with pytest.raises(InvalidArgumentError):
            fn()
    assert rows == [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    m.validate()



def test_a_pool_too_big_for_memory_is_a_pool_error_before_any_allocation(monkeypatch):
    """``BlockPool(2**31 - 1)`` (hundreds of GiB of tensors): InvalidArgumentError naming the size,
    found by sizing the tensors on the meta device, not torch's RuntimeError (or the host's OOM killer);
    and an allocation torch refuses anyway is the same error."""
    from gpupool import BlockPool, memory
    from gpupool.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"num_blocks 2,147,483,647: needs [\d,.]+ GiB"):
        BlockPool(2**31 - 1)
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # unknown: torch decides

    real = torch.zeros

    def refuse(*a, device=None, **k):
        if str(device) == "meta":
            return real(*a, device=device, **k)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore")
    monkeypatch.setattr(torch, "zeros", refuse)
    with pytest.raises(InvalidArgumentError, match="num_blocks 1,024: cannot allocate .*DefaultCPUAllocator"):
        BlockPool(1024)
