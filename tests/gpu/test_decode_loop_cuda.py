"""The decode loop on CUDA (run by bench/gpu_check.sh; skipped without a GPU): every mode's tokens equal
contiguous KV (float64, exact), with prefix hits, preemptions, second turns and the fork. A window
captured with the model as one CUDA graph: tests/gpu/test_window_graph.py."""
from __future__ import annotations

from harness.paths import EXAMPLES
import sys

import pytest
import torch

sys.path.insert(0, str(EXAMPLES))

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_every_mode_equals_contiguous_on_cuda():
    import decode_loop as dl
    from llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64)
    model = Llama.random(cfg, seed=1, dtype=torch.float64, device="cuda")
    reqs = dl.make_workload(6, 10, 6, 9, cfg.vocab_size, 3)
    want = dl.oracle(model, reqs, None)
    for mode, K, D in (("host", 1, 0), ("window", 4, 0), ("spec", 2, 2)):
        eng = dl.Engine(model, mode, num_blocks=24, block_size=4, max_num_reqs=4, max_blocks_per_req=12, steps=K,
                        draft=D, count_evictions=False)  # test_window_graph.py's pool: its kernels serve here
        assert eng.run(reqs) == want, mode
