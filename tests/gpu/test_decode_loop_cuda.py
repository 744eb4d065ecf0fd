"""The decode loop on CUDA (run by bench/gpu_check.sh; skipped without a GPU): every mode's tokens equal
contiguous KV (float64, exact), and a burst's replay captured with the model as ONE CUDA graph gives
the eager tokens."""
from __future__ import annotations

from harness.paths import EXAMPLES, BENCH
import sys

import pytest
import torch

sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(BENCH))

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_every_mode_equals_contiguous_on_cuda():
    import decode_loop as dl
    from llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64)
    model = Llama.random(cfg, seed=1, dtype=torch.float64, device="cuda")
    reqs = dl.make_workload(6, 10, 6, 9, cfg.vocab_size, 3)
    want = {r.rid: dl.contiguous_decode(model, r) for r in reqs}
    for mode, K in (("host", 1), ("step", 1), ("burst", 4), ("prebook", 4)):
        eng = dl.Engine(model, mode, num_blocks=14, block_size=4, max_num_reqs=4, max_blocks_per_req=8, steps=K)
        assert eng.run(reqs) == want, mode


@pytest.mark.parametrize("K", [1, 4])
def test_a_captured_replay_equals_eager(K):
    import decode_loop_gpu as bench

    args = bench.argparse.Namespace(block_size=16, prompt_len=20, iters=4, graph=True)
    from llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128)
    model = Llama.random(cfg, seed=2, dtype=torch.float32, device="cuda")
    tokens = {}
    for graph in (False, True):
        args.graph = graph
        eng_seqs = []

        def keep(eng_seqs=eng_seqs, orig=bench.advance):
            def advance(seqs, results):
                eng_seqs[:] = seqs
                return orig(seqs, results)
            return advance

        bench.advance, saved = keep(), bench.advance
        try:
            bench.bench_one(model, "burst", 8, K, args)
        finally:
            bench.advance = saved
        tokens[graph] = [s.tokens for s in eng_seqs]
    assert tokens[True] == tokens[False]
