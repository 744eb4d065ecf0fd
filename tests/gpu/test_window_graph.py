"""A decode window captured WITH the model's forward passes as ONE CUDA graph (``DecodeWindow.capture``,
replayed as bench/decode_loop_gpu.py replays it) gives the tokens of the same windows run eagerly, and
those of the model on contiguous KV (float64, exact): requests that stop inside a window (freed there,
their slots refilled by new requests between windows), and speculative windows whose passes accept 1 to
D + 1 tokens. Skipped without CUDA; bench/gpu_check.sh runs it. Small on purpose: each window shape
compiles the pool's kernels once."""
from __future__ import annotations

import sys

import pytest
import torch

from harness.paths import BENCH, EXAMPLES

sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(BENCH))

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LANES, WINDOWS, PROMPT = 3, 5, 6
# test_decode_loop_cuda.py's pool and windows: the kernels compiled for one serve both files
SHAPE = dict(max_num_reqs=4, max_blocks_per_req=12, num_blocks=24)


def decode(mode: str, K: int, D: int, graph: bool, device: str = "cuda"):
    """Steady decode of LANES requests for WINDOWS windows (budgets of 2 to 7 tokens: stops inside
    windows); returns (every request's tokens so far by id, the finished ones' ids, the requests, the
    model, the graph's replays)."""
    import decode_loop_gpu as bench
    from llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64)
    model = Llama.random(cfg, seed=3, dtype=torch.float64, device=device)
    shape = bench.PoolShape(**SHAPE)
    eng, timer = bench.make_engine(model, mode, LANES, K, D, shape, block_size=4, graph=graph)
    budgets = iter([2, 7, 4, 5, 3, 6, 2, 7, 5, 4, 3, 6] * 8)
    drv = bench.Steady(eng, LANES, PROMPT, seed=1, budget=lambda: next(budgets))
    stopped = 0
    for _ in range(WINDOWS):
        stopped += drv.window()[1]
        drv.refill()
    assert stopped >= 2  # requests stopped inside windows, and new ones took their slots
    tokens = {s.req.rid: s.tokens[s.prompt_len:] for s in drv.running} | drv.out
    return tokens, set(drv.out), drv.requests, model, len(timer.pairs)


@pytest.mark.parametrize("mode,K,D", [("window", 4, 0), ("spec", 2, 2)])
def test_a_captured_window_gives_the_eager_tokens(mode, K, D):
    import decode_loop as dl

    eager, finished, reqs, model, replays = decode(mode, K, D, graph=False)
    assert replays == 0
    graphed, _, reqs_g, _, replays = decode(mode, K, D, graph=True)
    assert replays == WINDOWS  # every window a replay of the one captured graph
    assert {r: q.prompt for r, q in reqs_g.items()} == {r: q.prompt for r, q in reqs.items()}
    assert graphed == eager
    for rid, toks in eager.items():  # and the model on contiguous KV: the finished requests whole, the others so far
        want = dl.contiguous_decode(model, reqs[rid].prompt, reqs[rid].max_new)
        assert toks == (want if rid in finished else want[:len(toks)]), rid
