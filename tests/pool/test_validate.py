"""``validate()`` of the device pool reports each kind of corruption (docs/semantics.md section 1 invariants,
docs/algorithms.md ring and key-table invariants); a healthy pool passes. ``validate()`` of both
managers checks every block's ref count against its references from the block tables and the pending
copies, with any number of KV-cache groups (README, "Errors")."""
from __future__ import annotations

import pytest

from gpupool import BlockPool, InvariantError
from gpupool.manager import KVCacheManager
from gpupool.reference import ReferenceKVCacheManager
from harness.keys import h
from harness.twins import SMALL_GROUP_IDS, SMALL_GROUPS, small_manager


def busy_pool():
    p = BlockPool(16, max_keys_per_block=3)
    a = p.get_new_blocks(6).tolist()
    p.cache_full_blocks(a, [h(i) for i in range(6)], 0, 4, 16, 0)
    p.cache_partial_block(a[4], [h(i) for i in range(10, 14)], 32, 0, 64, 16)
    p.free_blocks(a[::-1][:4])  # frees a[5], a[4], a[3], a[2]
    p.touch([a[3]])
    p.validate()
    return p, a


def corrupt_ref(p, a):
    p.state.ref_cnt[a[0]] = -1


def corrupt_queue_flag(p, a):
    p.state.ref_cnt[a[5]] = 1  # queued but held


def corrupt_num_free(p, a):
    p.state.ctrl[2] += 1


def corrupt_ring_slot(p, a):
    q = int(p.state.qslot[a[5]])
    p.state.ring[q] = a[0]


def corrupt_table_word(p, a):
    slot = int(p.state.keys[a[0] * 3, 4])
    p.state.table[slot] = 0


def corrupt_overflow(p, a):
    p.state.overflow[0] += 1


def corrupt_ntok(p, a):
    p.state.hash_ntok[a[1]] = -1


def corrupt_null(p, a):
    p.state.num_keys[0] = 1


def corrupt_window(p, a):
    p.state.ctrl[1] = p.state.ctrl[0] - 1


CASES = [
    (corrupt_ref, "below zero"), (corrupt_queue_flag, "queued but held"), (corrupt_num_free, "num_free"),
    (corrupt_ring_slot, "ring slot"), (corrupt_table_word, "table slot"), (corrupt_overflow, "overflow"),
    (corrupt_ntok, "hash_num_tokens"), (corrupt_null, "null block"), (corrupt_window, "live window"),
]


@pytest.mark.parametrize("corrupt,words", CASES, ids=[c.__name__ for c, _ in CASES])
def test_validate_reports_corruption(corrupt, words):
    p, a = busy_pool()
    corrupt(p, a)
    with pytest.raises(InvariantError, match=words) as e:
        p.validate()
    assert e.value.op == "validate"


def test_healthy_pool_after_many_ops_validates():
    p, a = busy_pool()
    p.free_blocks([a[3], a[1], a[0]])
    p.evict_blocks([a[2]])
    p.get_new_blocks(5)
    p.validate()


# ---- both managers: every ref count against the block tables and pending copies -----------------

@pytest.mark.parametrize("cls", [ReferenceKVCacheManager, KVCacheManager], ids=["reference", "device"])
@pytest.mark.parametrize("groups", SMALL_GROUPS, ids=SMALL_GROUP_IDS)
@pytest.mark.heavy("full+full-device")
def test_validate_sees_a_leaked_reference(groups, cls):
    """validate() of both managers works with any number of groups and checks every block's ref count
    against its references from block tables and pending copies."""
    m = small_manager(cls, groups=groups)
    m.add_request(0, [h(1), h(2)])
    m.add_request(1, [h(1), h(3)])
    m.allocate_slots([0, 1], [9, 9], [9, 9], [1, 1])
    m.validate()
    m.cow_move(0, 0)
    m.validate()
    leaked = m.block_table(0)[0][0] if cls is ReferenceKVCacheManager else m.rows(0)[0][0]
    m.pool.touch([leaked])  # a reference no table or copy holds
    with pytest.raises(InvariantError):
        m.validate()
    m.pool.free_blocks([leaked])
    m.validate()
    extra = int(m.pool.get_new_blocks(1)[0])  # a block held by no one
    with pytest.raises(InvariantError):
        m.validate()
    m.pool.free_blocks([extra])
    m.validate()

