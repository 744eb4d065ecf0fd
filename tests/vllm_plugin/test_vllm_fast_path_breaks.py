"""Adversarial inputs to ``DeferredBlockPool`` (docs/algorithms.md section 8) against the per-call
``gpupool.vllm.BlockPool``: the same answer, error type and state, and nothing changed by an error.

* a release the host cannot confirm (a block of ref 0 on the host, which a placeholder's pop took on
  the device) synchronises and then frees the blocks the binding names, as the per-call pool does
  (not the placeholders' old slots, and not the null block, which is skipped);
"""
from harness.paths import CONFORMANCE
import sys

import pytest

sys.path.insert(0, str(CONFORMANCE))
import driver  # noqa: E402
from gpupool.vllm import BlockPool, fast_path  # noqa: E402
from gpupool.vllm.fast_path import DeferredBlockPool, PendingBlock  # noqa: E402

BS = driver.BLOCK_SIZE
BACKENDS = ["reference", "device"]


def pools(n, backend, caching=True, **kw):
    """(per-call, deferred) over ``backend``."""
    kw.update(device="cpu") if backend == "device" else kw.update(backend="reference")
    return BlockPool(n, caching, BS, **kw), DeferredBlockPool(n, caching, BS, **kw)


def state(p) -> dict:
    """The whole state vLLM's callers read, after a synchronisation."""
    if isinstance(p, DeferredBlockPool):
        p.sync()
    return driver.snapshot(p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_null", [False, True])
def test_free_of_a_block_a_placeholder_took(monkeypatch, backend, with_null):
    """A pop past the host's copy of the queue (placeholders), then a free naming a block the host
    has at ref 0 that the pop took (a stale reference), beside a placeholder or the null block."""
    monkeypatch.setattr(fast_path, "FREE_WINDOW", 1)
    out = []
    for p in pools(6, backend):
        got = p.get_new_blocks(3)
        assert isinstance(got[0], PendingBlock) == isinstance(p, DeferredBlockPool)
        first = p.null_block if with_null else got[0]
        p.free_blocks([first, p.blocks[2]])
        out.append(([b.block_id for b in got], state(p)))
    assert out[0] == out[1]
