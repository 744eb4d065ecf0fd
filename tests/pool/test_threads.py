"""Threads: a scheduler thread and a transfer thread on one pool (either pool) or on one manager's
pool; every op serialises (gpupool/locking.py: one lock per pool), the pool validates and nothing
leaks (README, "Threads and host memory").
"""
from __future__ import annotations

import pytest

from gpupool import BlockPool
from gpupool.errors import PoolError
from harness.compare import assert_consistent
from harness.keys import h
from harness.ops import run_in_threads
from harness.twins import POOL_IDS, POOLS, small_manager


@pytest.mark.slow
@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_two_threads_share_a_pool(cls):
    """A scheduler thread (allocate / cache / free) and a transfer thread (lookups, touch / free of
    hits) on one pool: every op serialises; the pool validates and nothing leaks."""
    p = cls(24)
    errors = []
    ops = 25 if cls is BlockPool else 300

    def scheduler():
        try:
            for i in range(ops):
                b = p.get_new_blocks(2)
                p.cache_full_blocks(b, [h(i % 7), h(100 + i % 5)], 0, 2, 16, 0)
                p.free_blocks(list(reversed([int(x) for x in b])))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def transfer():
        try:
            for i in range(ops):
                got = p.get_cached_block(h(i % 7), [0])
                if got is not None:
                    try:
                        p.touch(got)
                    except PoolError:
                        continue
                    p.free_blocks(got)
                p.get_num_free_blocks()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    run_in_threads(errors, scheduler, transfer)
    assert_consistent(p)
    assert p.get_num_free_blocks() == 23


@pytest.mark.slow
def test_two_threads_share_a_managers_pool():
    """The scheduler (manager ops) and a transfer thread (pool lookups, touch and free of hits)."""
    m = small_manager(n=48)
    errors = []

    def scheduler():
        try:
            for i in range(8):
                r = i % 4
                m.add_request(r, [h(r), h(10 + r)])
                m.allocate_slots([r], [9], [9], [1])
                m.pool.check()
                m.free([r])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def transfer():
        try:
            for i in range(16):
                got = m.pool.get_cached_block(h(i % 4), [0])
                if got is not None:
                    m.pool.touch(got)
                    m.pool.free_blocks(got)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    run_in_threads(errors, scheduler, transfer)
    m.validate()
    assert_consistent(m.pool)
    assert m.pool.get_num_free_blocks() == 47

