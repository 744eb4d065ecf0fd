"""The test suite's interpreter patches Triton's language once per launch (``harness.interpreter``):
installed wherever the kernels are interpreted, once per launch for a kernel whose helpers are called
many times, and the kernels' results equal those of Triton's own interpreter."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from gpupool import BlockPool
from harness import interpreter
from harness.keys import hashes
from harness.state import pool_state

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run compiled on a GPU")


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _helpers_kernel(out_ptr, total_ptr, N: tl.constexpr, ROUNDS: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)  # each program its own N elements
    x = tl.load(out_ptr + offs)
    for _ in tl.static_range(ROUNDS):
        x = _twice(x) - x + tl.where(offs % 2 == 0, 1, 0)
    tl.store(out_ptr + offs, tl.maximum(x, 0))
    tl.atomic_add(total_ptr, tl.sum(x, axis=0))


def _launch():
    out, total = torch.arange(24, dtype=torch.int32) - 4, torch.zeros(1, dtype=torch.int32)
    _helpers_kernel[(3,)](out, total, N=8, ROUNDS=5)
    return out.tolist() + total.tolist()


def _pool_run() -> dict:
    p = BlockPool(32, enable_kv_cache_events=True)
    blocks = p.get_new_blocks(6)
    hs = hashes(range(6))
    p.cache_full_blocks(blocks, hs, 0, 6, 16, 0)
    p.free_blocks(blocks.flip(0))
    p.touch([int(b) for b in blocks[:2]])
    out, _ = p.allocate_batched(torch.tensor([3, 2], dtype=torch.int32, device=p.device))
    p.check()
    return {"state": pool_state(p), "out": out.tolist(), "events": [repr(e) for e in p.take_events()]}


def test_installed_where_kernels_are_interpreted():
    assert interpreter.installed()


def test_the_language_is_patched_once_per_launch(monkeypatch):
    from triton.runtime import interpreter as ti

    calls = []
    original = ti._patch_lang.__wrapped__

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(ti, "_patch_lang", interpreter.once_per_launch(counting))
    _launch()
    # the launch, and once tl.sum, whose module (triton.language.standard) sees tl.core, which the
    # kernel's does not; not at every call of _twice (3 programs x 5 rounds) or of tl.sum (3)
    assert calls == ["_helpers_kernel", "sum"], calls
    monkeypatch.setattr(ti, "_patch_lang", counting)  # Triton's own: the launch, then every helper call
    calls.clear()
    _launch()
    assert len(calls) == 1 + 3 * 5 + 3, calls


def test_results_equal_tritons_own_interpreter(monkeypatch):
    from triton.runtime import interpreter as ti

    ours = (_launch(), _pool_run())
    monkeypatch.setattr(ti, "_patch_lang", ti._patch_lang.__wrapped__)  # Triton's, patching at every call
    theirs = (_launch(), _pool_run())
    assert ours == theirs
