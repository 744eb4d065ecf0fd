"""The quick ops' dispatch (``gpupool.vllm.BlockPool.get_new_blocks`` / ``cache_full_blocks`` when
``engine.quick``, docs/algorithms.md section 8) under arguments and uses vLLM's own callers never make:
a count whose ``== 1`` is not a bool or raises, a metrics collector set after construction. Each gives
what the general path gives: its answer, or its typed error with nothing changed."""
import numpy as np
import pytest
import torch

pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")

from gpupool.errors import ArgumentTypeError  # noqa: E402
from gpupool.vllm import BlockPool  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool  # noqa: E402
from harness import vllm_ops as O  # noqa: E402


class _EqRaises:
    """A count whose comparison raises (``__eq__`` of an arbitrary user object)."""

    def __eq__(self, other):
        raise KeyError("compared")

    __hash__ = object.__hash__


COUNTS = {"tensor of 2": lambda: torch.tensor([1, 1]), "ndarray of 2": lambda: np.array([1, 1]),
          "eq raises": _EqRaises}


@pytest.mark.parametrize("count", list(COUNTS))
@pytest.mark.parametrize("kind", ["per-call", "quick", "general"])
def test_a_count_that_is_no_int_is_refused_typed_before_any_comparison(kind, count):
    """``get_new_blocks(x)`` with ``x == 1`` ambiguous or raising: ArgumentTypeError as the count
    check words it (the per-call adapter's too: the dispatch is shared), the pool unchanged."""
    p = (BlockPool if kind == "per-call" else DeferredBlockPool)(6, True, O.BS, device="cpu")
    if kind == "general":
        p._engine.quick = False
    before = (list(p._ref), p.get_num_free_blocks())
    with pytest.raises(ArgumentTypeError, match="num_blocks must be an integer"):
        p.get_new_blocks(COUNTS[count]())
    assert (list(p._ref), p.get_num_free_blocks()) == before


def test_a_metrics_collector_set_after_construction_sees_the_quick_pops():
    """vLLM's ``BlockPool.metrics_collector`` is a plain attribute its pool reads at each call; set on a
    fast-path pool after construction, every pop reaches it as the general path's pops do (the quick
    pop is the general path's only while no collector is set)."""
    from harness.flush_stub import stubbed_flush

    import driver  # noqa: F401  (tests/vllm_plugin/conformance, on the path through harness.vllm_ops)

    calls = []
    with stubbed_flush(check=True):
        for quick in (True, False):
            p = DeferredBlockPool(8, True, O.BS, device="cpu")
            p._engine.quick = quick
            p.metrics_collector = driver.MetricsLog()
            a = p.get_new_blocks(1)
            p.cache_full_blocks(driver.request(driver.tokens_of(1)[: O.BS]), a, 0, 1, O.BS, 0)
            p.free_blocks(a)
            p.get_new_blocks(1)
            p.get_new_blocks(2)
            calls.append(p.metrics_collector.calls)
    assert calls[0] == calls[1]
    assert ("allocated", a[0].block_id) in calls[0]
