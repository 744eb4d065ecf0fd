"""Cachings keyed on the device (``kernels/device_keys.py``; ``BlockPool.apply_predicted`` from
``device_keys_from`` cachings a launch, docs/algorithms.md section 8):

* the kernel's keys are ``gpupool.keys.device_key``'s, bit for bit (groups at the int64 edges, lane
  counts around a program's);
* a launch keyed on the device ends in the whole state of the same launch keyed on the host: lookups
  find its blocks, ``block_keys`` names them (before any check: the registry's name source reads the
  keys back; after a check or a sweep: named already);
* what the kernel cannot key (a hash of another length) or too few cachings stay on the host.
"""
import hashlib
import random

import pytest
import torch

from gpupool import BlockPool
from gpupool.kernels.device_keys import LANES, launch_device_keys
from gpupool.kernels.flush import FlushBatch
from gpupool.kernels.sha256 import round_constant_table
from gpupool.keys import device_key, device_key_list
from harness.keys import h
from harness.state import lookup, pool_state

N = 48
BS = 4


@pytest.mark.heavy("65")
@pytest.mark.parametrize("n", [1, LANES + 1])
def test_the_kernels_keys_are_the_hosts(n):
    rng = random.Random(n)
    hashes = [hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(n)]
    groups = [rng.choice([0, 1, 7, 2**31 - 1, -1, -2**63, 2**63 - 1, rng.randrange(-2**63, 2**63)]) for _ in range(n)]
    hi, lo = torch.full((n,), 7, dtype=torch.int64), torch.full((n,), 7, dtype=torch.int64)
    launch_device_keys(torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.int32),
                       torch.tensor(groups, dtype=torch.int64), hi, lo, round_constant_table())
    assert list(zip(hi.tolist(), lo.tolist())) == device_key_list(list(zip(hashes, groups)))


def _pools(on_device_from):
    """A pool keying on the device from ``on_device_from`` cachings and its twin keying on the host,
    each with 6 blocks keyed and freed, then 4 held."""
    dev, host = BlockPool(N, device="cpu"), BlockPool(N, device="cpu")
    dev.device_keys_from = on_device_from
    for p in (dev, host):
        old = [int(b) for b in p.get_new_blocks(6)]
        p.cache_full_blocks(old, [h(f"old{i}") for i in range(6)], 0, 6, BS, 0)
        p.free_blocks(old[::-1])
    return dev, host


def _batch(hashes) -> FlushBatch:
    """Pop ``len(hashes)`` blocks and cache them, one call each, in groups 0 and 1 (two calls reuse
    an old key: its block keeps the first insertion)."""
    b = FlushBatch()
    b.add_pop(len(hashes))
    for k, hs in enumerate(hashes):
        b.add_cache([N + k], [(hs, k % 2)], [BS * (k + 1)])
    return b


def _launch(pool, hashes):
    blocks, confirm = pool.apply_predicted(_batch(hashes))
    return blocks


@pytest.mark.heavy("after a check", "after a sweep")
@pytest.mark.parametrize("named", ["before a check", "after a check", "after a sweep"])
def test_a_launch_keyed_on_the_device_is_the_hosts(named):
    hashes = [h(f"new{i}") for i in range(18)] + [h("old0"), h("old3")]
    dev, host = _pools(1)
    a, b = _launch(dev, hashes), _launch(host, hashes)
    assert dev._unnamed and not host._unnamed  # the first keyed on the device, its names not read yet
    if named == "before a check":  # the registry's name source reads them back
        assert dev.key_name(device_key(hashes[3], 1)) == (hashes[3], 1)
        assert not dev._unnamed
    elif named == "after a check":
        dev.check()
        assert not dev._unnamed
    elif named == "after a sweep":
        dev.sweep_key_names()
        assert not dev._unnamed
    blocks = a.tolist()
    assert [dev.block_keys(x) for x in blocks] == [host.block_keys(x) for x in b.tolist()]  # named (a miss reads them)
    assert not dev._unnamed
    host.check()
    dev.check()
    assert pool_state(dev) == pool_state(host)
    for k, hs in enumerate(hashes):
        assert lookup(dev, hs, [k % 2]) == lookup(host, hs, [k % 2])


def test_what_the_kernel_cannot_key_stays_on_the_host():
    """Fewer cachings than ``device_keys_from``, or a hash not of 32 bytes among them: keyed (and
    named) on the host at the launch, as a CPU pool keys everything."""
    for from_, hashes in ((21, [h(f"n{i}") for i in range(20)]),
                          (1, [h(f"n{i}") for i in range(19)] + [b"short"])):
        dev, host = _pools(from_)
        _launch(dev, hashes)
        _launch(host, hashes)
        assert not dev._unnamed
        dev.check()
        host.check()
        assert pool_state(dev) == pool_state(host)
    assert BlockPool(N, device="cpu").device_keys_from is None  # on the CPU the host is the device: it keys there


@pytest.mark.slow
def test_names_read_back_in_one_read_for_several_launches():
    dev, host = _pools(1)
    for r in range(3):
        hs = [h(f"r{r}.{i}") for i in range(5)]
        _launch(dev, hs)
        _launch(host, hs)
    assert len(dev._unnamed) == 3
    dev.check()
    host.check()
    assert not dev._unnamed and pool_state(dev) == pool_state(host)


def test_device_keys_from_takes_an_int_or_none():
    from gpupool.errors import ArgumentTypeError, InvalidArgumentError
    pool = BlockPool(N, device="cpu")
    for bad, err in (("16", ArgumentTypeError), (1.5, ArgumentTypeError), (True, ArgumentTypeError),
                     ([1], ArgumentTypeError), (0, InvalidArgumentError), (-2**70, InvalidArgumentError)):
        with pytest.raises(err):
            pool.device_keys_from = bad
        assert pool.device_keys_from is None
    pool.device_keys_from = 2**80  # never reached: the host keys everything
    pool.device_keys_from = 3
    assert pool.device_keys_from == 3


def test_a_batch_reused_after_its_launch_keeps_its_names():
    """``apply_predicted`` does not wait, and copies what it keeps: a caller may empty and refill its
    batch at once; the names read back later are the first launch's."""
    from gpupool.kernels.layout import ROUND_WIDTH
    pool = BlockPool(N, device="cpu")
    pool.device_keys_from = 1
    first = [h(f"first{i}") for i in range(3)]
    b = _batch(first)
    blocks = pool.apply_predicted(b)[0].tolist()
    for part in (b.demands, b.cache_ids, b.cache_keys, b.cache_ntok, b.cache_calls):
        part.clear()
    b.table[:] = [0] * ROUND_WIDTH
    b.add_pop(3)
    for k in range(3):
        b.add_cache([N + k], [(h(f"second{k}"), k % 2)], [BS * (k + 1)])
    pool.apply_predicted(b)
    pool.check()
    assert [pool.block_keys(x) for x in blocks] == [[(hs, k % 2)] for k, hs in enumerate(first)]


def test_a_launch_while_names_are_read_back_keeps_its_names():
    """A launch that lands while the name source reads keys back (a device wait on a GPU; another
    thread's launch, here forced from inside the read) is named at the next read, not dropped."""
    pool = BlockPool(N, device="cpu")
    pool.device_keys_from = 1
    first, second = [h(f"a{i}") for i in range(3)], [h(f"b{i}") for i in range(3)]
    pool.apply_predicted(_batch(first))

    class LaunchDuringRead:
        def __init__(self, t):
            self.t = t

        def tolist(self):
            pool.apply_predicted(_batch(second))
            return self.t.tolist()

    pairs, t, stream = pool._unnamed[0]
    pool._unnamed[0] = (pairs, LaunchDuringRead(t), stream)
    assert pool.key_name(device_key(first[0], 0)) == (first[0], 0)
    pool.check()
    assert [pool.key_name(device_key(hs, k % 2)) for k, hs in enumerate(second)] == [(hs, k % 2) for k, hs in enumerate(second)]
