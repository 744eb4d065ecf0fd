"""``torch.ops.gpupool.store_kv`` and ``torch.ops.gpupool.attention_views`` (gpupool/ops.py): registered
custom ops that mutate exactly what they declare (``torch.library.opcheck``: schema, fake tensors,
autograd registration, AOT dispatch), whose results equal the eager functions', and whose errors are
theirs."""
from __future__ import annotations

import gc

import pytest
import torch

import gpupool.ops  # noqa: F401  (registers the ops)
from gpupool.errors import ArgumentTypeError, InvalidArgumentError
from gpupool.kv_cache import AttentionViews, store_kv
from gpupool.manager import KVCacheManager
from gpupool.ops import manager_id

BS, M = 4, 6


def kv_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    key, value = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    kc, vc = torch.zeros(6, BS, 2, 8), torch.zeros(6, BS, 2, 8)
    return key, value, kc, vc, torch.tensor([5, -1, 22], dtype=torch.int64)


def manager():
    m = KVCacheManager(16, block_size=BS, max_num_reqs=4, max_blocks_per_req=M, device="cpu")
    m.add_request(0, [])
    m.add_request(1, [])
    m.allocate_slots([0, 1], [9, 5], [9, 5], [1, 1])
    return m


def views_args(m, K=1):
    v = AttentionViews.empty(2, M, K, device="cpu")
    i32 = torch.int32
    return (manager_id(m), torch.tensor([0, 1], dtype=i32), torch.tensor([9, 5], dtype=i32),
            torch.tensor([2], dtype=i32), None, 0, *v)


def test_store_kv_op_equals_the_function():
    key, value, kc, vc, slots = kv_inputs()
    torch.ops.gpupool.store_kv(key, value, kc, vc, slots)
    key2, value2, kc2, vc2, _ = kv_inputs()
    store_kv(key2, value2, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc.abs().sum() > 0


def test_attention_views_op_equals_the_method():
    m = manager()
    args = views_args(m)
    torch.ops.gpupool.attention_views(*args)
    want = m.attention_views(args[1], args[2], args[3])
    for got, exp in zip(args[6:], want):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("which", ["store_kv", "attention_views"])
def test_opcheck(which):
    """torch.library.opcheck: the schema's mutations are the real ones, the fake version runs, and
    the op survives autograd registration and AOT dispatch checks."""
    if which == "store_kv":
        torch.library.opcheck(torch.ops.gpupool.store_kv.default, kv_inputs())
    else:
        torch.library.opcheck(torch.ops.gpupool.attention_views.default, views_args(manager()))


def test_a_wrong_schema_is_caught():
    """The check can fail: an op that writes v_cache but declares only k_cache is flagged."""
    lib = torch.library.Library("gpupool_fault", "FRAGMENT")  # noqa: F841  (kept alive for the op)

    @torch.library.custom_op("gpupool_fault::store_kv_k_only", mutates_args=("k_cache",))
    def bad(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    with pytest.raises(Exception, match="v_cache|mutat"):
        torch.library.opcheck(bad, kv_inputs(), test_utils=("test_schema",))


def test_errors_are_the_eager_ones():
    key, value, kc, vc, slots = kv_inputs()
    with pytest.raises(InvalidArgumentError, match="store_kv"):
        torch.ops.gpupool.store_kv(key[:, :1], value, kc, vc, slots)
    args = list(views_args(manager()))
    args[0] = 10 ** 6
    with pytest.raises(InvalidArgumentError, match="no live manager"):
        torch.ops.gpupool.attention_views(*args)


def test_a_collected_manager_is_refused():
    m = manager()
    args = list(views_args(m))
    del m
    gc.collect()
    with pytest.raises(InvalidArgumentError, match="no live manager"):
        torch.ops.gpupool.attention_views(*args)


@pytest.mark.parametrize("bad", ["x", None, "reference"])
def test_manager_id_takes_a_device_manager(bad):
    """Only a ``KVCacheManager`` has an id: anything else is an ArgumentTypeError naming its type (was a
    raw AttributeError, or an id for a reference manager that the op cannot drive)."""
    from gpupool.reference import ReferenceKVCacheManager

    if bad == "reference":
        bad = ReferenceKVCacheManager(16, block_size=BS, max_num_reqs=4, max_blocks_per_req=M)
    with pytest.raises(ArgumentTypeError, match="manager_id"):
        manager_id(bad)
