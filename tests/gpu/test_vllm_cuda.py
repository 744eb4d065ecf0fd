"""CUDA-only checks of the vLLM fast path (skipped without a GPU; bench/gpu_check.sh runs ``-m cuda``):
what a CPU run cannot show (docs/vllm.md, "The fast path").

* the fast path on CUDA equals the per-call adapter on random op lists (ids, answers, whole state);
* a scheduler step's calls (pops, cachings, hits, frees, ``end_step``) make no host synchronisation:
  ``torch.cuda.set_sync_debug_mode("error")`` turns any into an error;
* the pool's own stream: a synchronisation of the pool does not wait for a long kernel queued on the
  default stream (vLLM's forward pass, TP = 1).
"""
from __future__ import annotations

from harness.paths import CONFORMANCE
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from harness.vllm_ops import DRIVER_OPS as OPS  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BS = driver.BLOCK_SIZE


@settings(max_examples=20, deadline=None)
@given(ops=st.lists(OPS, min_size=4, max_size=24), caching=st.booleans())
def test_fast_path_on_cuda_equals_per_call(ops, caching):
    pools = [BlockPool(12, caching, BS, device="cuda"), DeferredBlockPool(12, caching, BS, device="cuda")]
    assert all(p.stream is not None for p in pools)
    got = []
    for p in pools:
        reqs, seen = [], []
        for op in ops:
            seen.append(driver._apply(p, op, reqs, 12))
            p.end_step()
        got.append((seen, driver.snapshot(p)))
        with torch.cuda.stream(p.stream):
            p.device_pool.validate()
    assert got[0] == got[1]


def test_a_step_makes_no_host_sync():
    pool = DeferredBlockPool(4096, True, BS, device="cuda")
    reqs = [driver.request(driver.tokens_of(i)[: 2 * BS]) for i in range(64)]
    rows = [pool.get_new_blocks(1) for _ in reqs]
    pool.end_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r, row in zip(reqs, rows):  # a decode step: each request crosses into a new block
            row += pool.get_new_blocks(1)
            pool.cache_full_blocks(r, row, 0, 1, BS, 0)
        hit = pool.get_cached_block(reqs[0].block_hashes[0], [0])
        pool.touch(hit)
        pool.free_blocks(list(reversed(rows[-1])))
        ids = [b.block_id for row in rows for b in row]
        pool.end_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(set(ids)) == len(ids) and pool.syncs == {}
    pool.sync()
    with torch.cuda.stream(pool.stream):
        pool.device_pool.validate()


@pytest.mark.parametrize("cls", [BlockPool, DeferredBlockPool])
def test_pool_syncs_do_not_wait_for_the_default_stream(cls):
    pool = cls(256, True, BS, device="cuda")
    a = pool.get_new_blocks(4)
    pool.end_step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the default stream (a forward pass)
    t0 = time.perf_counter()
    b = pool.get_new_blocks(2)  # the per-call pool reads its answer; the fast path answers on the host
    pool.free_blocks(a)
    pool.end_step()
    if cls is DeferredBlockPool:
        pool.sync("test", window=True)  # one device-to-host transfer on the pool's stream
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    slept = time.perf_counter() - t0
    assert waited < 0.5 * slept, (waited, slept)
    assert len({x.block_id for x in b}) == 2


def test_cachings_keyed_on_the_device_on_cuda():
    """A launch of 16 or more cachings on a CUDA pool makes their device keys on the device
    (``DEVICE_KEYS_FROM``, kernels/device_keys.py): names, lookups and the whole state equal a launch
    keyed on the host, named before a check (the registry's name source) and after it."""
    from gpupool import BlockPool as DevicePool
    from gpupool.kernels.flush import FlushBatch
    from gpupool.keys import device_key
    from gpupool.pool import DEVICE_KEYS_FROM
    from harness.keys import h
    from harness.state import lookup, pool_state

    n = 64
    dev, host = DevicePool(n, device="cuda"), DevicePool(n, device="cuda")
    assert dev.device_keys_from == DEVICE_KEYS_FROM
    host.device_keys_from = None
    hashes = [h(f"k{i}") for i in range(DEVICE_KEYS_FROM + 4)]
    for p in (dev, host):
        b = FlushBatch()
        b.add_pop(len(hashes))
        for k, hs in enumerate(hashes):
            b.add_cache([n + k], [(hs, k % 3)], [16 * (k + 1)])
        p.apply_predicted(b)
    assert dev._unnamed and not host._unnamed
    assert dev.key_name(device_key(hashes[5], 5 % 3)) == (hashes[5], 5 % 3)
    dev.check()
    host.check()
    assert pool_state(dev) == pool_state(host)
    assert [lookup(dev, hs, [k % 3]) for k, hs in enumerate(hashes)] == [lookup(host, hs, [k % 3]) for k, hs in enumerate(hashes)]
