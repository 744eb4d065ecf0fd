"""``DeferredBlockPool`` against the per-call pool where an adversarial review found them apart (each
failed before its fix): a touch of a placeholder and a free block while the mirror is dirty (the
placeholders bound mid-call); ``cache_full_blocks`` arguments the per-call pool rejects (bad groups,
bool or numpy counts, int hashes), which were queued and then failed the whole flush; argument checks
with caching disabled; ``cached_block_hashes_by_block`` while dirty; ``block_size`` 0."""
from harness.paths import CONFORMANCE
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

BS = driver.BLOCK_SIZE


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("backend", ["reference", "device"])
def test_touch_placeholder_with_free_block(monkeypatch, backend, first):
    """D1: touch([placeholder, ref-0 block]) while dirty: IndexError (per-call: fine)."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 2)
    kw = dict(device="cpu") if backend == "device" else dict(backend="reference")
    out = []
    for p in (BlockPool(10, True, BS, **kw), DeferredBlockPool(10, True, BS, **kw)):
        a = p.get_new_blocks(2)
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, 2, BS, 0)
        p.free_blocks(a)
        pp = p.get_new_blocks(4)  # deferred: placeholders
        p.touch([pp[0], a[0]] if first == 0 else [a[0], pp[0]])
        if hasattr(p, 'sync'):
            p.sync()
        out.append(([b.block_id for b in pp], driver.snapshot(p)))
    assert out[0] == out[1]


BAD_CACHE = {  # (nc, nf, group, hashes): rejected by the per-call pool at the call, unchanged
    "group 2**31": (0, 2, 2 ** 31, None),
    "group -1": (0, 2, -1, None),
    "group True": (0, 2, True, None),
    "nf True": (0, True, 0, None),
    "int hashes": (0, 2, 0, [1, 2]),
}


@pytest.mark.parametrize("case", list(BAD_CACHE))
def test_bad_cache_args_poison_the_batch(case):
    """D2: a cache_full_blocks the per-call pool rejects is queued; the flush (end_step) raises and drops
    the WHOLE batch on the device, the pop of `a` included; the held blocks end up free."""
    nc, nf, g, hashes = BAD_CACHE[case]
    snaps = []
    for p in (BlockPool(8, True, BS, device="cpu"), DeferredBlockPool(8, True, BS, device="cpu")):
        a = p.get_new_blocks(2)
        r = driver.request(driver.tokens_of(1)[:2 * BS]) if hashes is None else types.SimpleNamespace(block_hashes=hashes)
        with pytest.raises(PoolError):
            p.cache_full_blocks(r, a, nc, nf, BS, g)
        p.end_step()
        snaps.append(driver.snapshot(p))
    assert snaps[0] == snaps[1]


def test_numpy_count_poisons_the_batch():
    """D3: num_full_blocks as numpy.int64 (valid for the per-call pool) is queued and the flush fails."""
    snaps = []
    for p in (BlockPool(8, True, BS, device="cpu"), DeferredBlockPool(8, True, BS, device="cpu")):
        a = p.get_new_blocks(2)
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, np.int64(2), BS, 0)
        p.end_step()
        snaps.append(driver.snapshot(p))
    assert snaps[0] == snaps[1]


@pytest.mark.parametrize("kw", [dict(block_mask=[True]), dict(kv_cache_group_id=-1), dict(blocks=[1, 2])])
def test_caching_off_skips_checks(kw):
    """D4: caching disabled: deferred returns None for arguments the per-call pool rejects."""
    errs = []
    for p in (BlockPool(6, False, BS, backend="reference"), DeferredBlockPool(6, False, BS, backend="reference")):
        a = p.get_new_blocks(2)
        args = dict(request=driver.request(driver.tokens_of(1)[:2 * BS]), blocks=a, num_cached_blocks=0,
                    num_full_blocks=2, block_size=BS, kv_cache_group_id=0)
        args.update(kw)
        try:
            p.cache_full_blocks(**args)
            errs.append(None)
        except PoolError as e:
            errs.append(type(e).__name__)
    assert errs[0] == errs[1]


def test_secondary_keys_read_stale_when_dirty(monkeypatch):
    """D5: cached_block_hashes_by_block reads the mirror without synchronising while it is dirty."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 1)
    outs = []
    for p in (BlockPool(4, True, BS, backend="reference"), DeferredBlockPool(4, True, BS, backend="reference")):
        a = p.get_new_blocks(1)
        r = driver.request(driver.tokens_of(1)[:3 * BS])
        p.cache_partial_block(r, a[0], 8, 0, 8)
        p.cache_partial_block(r, a[0], 4, 1, 8)  # a secondary key (group 1)
        p.free_blocks(a)
        p.get_new_blocks(3)  # every free block, a[0] included: its keys are evicted
        outs.append(p.cached_block_hashes_by_block)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("cls", [BlockPool, DeferredBlockPool])
def test_block_size_zero_is_a_pool_error(cls):
    """``cache_full_blocks(block_size=0)`` raises InvalidArgumentError (was ZeroDivisionError), nothing changed."""
    p = cls(6, True, BS, backend="reference")
    a = p.get_new_blocks(2)
    before = driver.snapshot(p)
    with pytest.raises(PoolError):
        p.cache_full_blocks(driver.request(driver.tokens_of(1)[:2 * BS]), a, 0, 2, 0, 0)
    assert driver.snapshot(p) == before
