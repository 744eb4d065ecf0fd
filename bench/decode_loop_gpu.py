"""The decode loop's throughput (examples/decode_loop.py; docs/kv_cache.md section 4): B running
requests in steady decode, tokens per second and time per replay of each mode.

* ``host``: the reference pool allocates on the host, the step's table / lengths / slot mapping are
  uploaded in one copy, the model's forward pass replays a CUDA graph captured over static inputs,
  one read of the tokens per step (vLLM's pattern);
* ``step`` / ``burst`` (K steps): the pool's step (and the reservation) AND the K forward passes
  captured as ONE CUDA graph per replay; per replay one copy of the inputs and one read.

    python bench/decode_loop_gpu.py                          # CUDA: B in 64 256 1024, K in 1 2 4 8
    python bench/decode_loop_gpu.py --device cpu --batch 2 --steps 2 --iters 2 --no-graph   # a smoke run

Prints one row per (mode, B, K) and writes JSON with ``--json``. Without CUDA the figures are the
interpreter's and say nothing about a GPU (the output says so).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import decode_loop as dl  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402


def prefill_all(eng: dl.Engine, prompts: list[list[int]]) -> list[dl.Seq]:
    """Admit ``len(prompts)`` requests of one length at once and prefill them in one forward pass."""
    B, P, dev = len(prompts), len(prompts[0]), eng.dev
    seqs = [dl.Seq(dl.Request(i, p, 1 << 30), list(p)) for i, p in enumerate(prompts)]
    slots = list(range(B))
    for s, r in zip(seqs, slots):
        eng.m.add_request(r, [])
        s.slot, s.ctx, s.first_pending = r, P, True
    flat_slots = [r for r in slots for _ in range(P)]
    positions = list(range(P)) * B
    if eng.host:
        assert all(eng.m.allocate_slots(slots, [P] * B, [P] * B))
        rows = eng.m.block_table(0)
        sm = torch.tensor(eng.m.slot_mapping(flat_slots, positions), device=dev)
        table = torch.tensor([(rows[r] + [0] * eng.M)[:eng.M] for r in slots], dtype=torch.int32, device=dev)
        seqused = torch.full((B,), P, dtype=torch.int32, device=dev)
    else:
        assert bool(eng.m.allocate_slots(slots, [P] * B, [P] * B).all())
        i32 = torch.int32
        sm = eng.m.slot_mapping(torch.tensor(flat_slots, dtype=i32, device=dev), torch.tensor(positions, dtype=i32, device=dev))
        v = eng.m.attention_views(slots, [P] * B)
        table, seqused = v.block_table, v.seqused_k[0]
    c = eng.model.cfg

    def attend(layer, q, k, v):
        eng.kv.store(layer, k, v, sm)
        out = dl.paged_attention(q.view(B, P, c.num_heads, c.head_dim), eng.kc[layer], eng.vc[layer], table, seqused)
        return out.reshape(B * P, c.num_heads, c.head_dim)

    tok = torch.tensor([t for p in prompts for t in p], device=dev)
    logits = eng.model.forward(tok, torch.tensor(positions, device=dev), attend)
    eng.last_token[:B] = logits.view(B, P, -1)[:, -1].argmax(-1)
    return seqs


def advance(seqs: list[dl.Seq], results) -> int:
    """The host's bookkeeping after a replay (every step admitted: the pool is big enough)."""
    n = 0
    for seq, (first, toks) in zip(seqs, results):
        if seq.first_pending:
            seq.tokens.append(first)
            seq.first_pending = False
        for t in toks:
            assert t is not None, "a step did not admit a request: the pool is too small"
            seq.tokens.append(t)
            seq.ctx += 1
            n += 1
    return n


class HostGraph:
    """The host mode with the model's forward pass in a CUDA graph over a static upload buffer."""

    def __init__(self, eng: dl.Engine, B: int):
        self.eng, self.B = eng, B
        self.packed = torch.zeros(B * eng.M + 4 * B, dtype=torch.int64, device=eng.dev)
        self.graph = None

    def _body(self):
        self.tok, self.nxt = self.eng.host_forward(self.packed, self.B)

    def decode(self, seqs, capture: bool):
        eng = self.eng
        adm, vals = eng.host_step(seqs)
        self.packed.copy_(torch.tensor(vals, dtype=torch.int64, pin_memory=eng.dev.type == "cuda"), non_blocking=True)
        if self.graph is None:
            self._body()
            if capture:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._body()
        else:
            self.graph.replay()
        first, toks = torch.stack([self.tok, self.nxt]).tolist()
        return [(first[i], [toks[i] if a else None]) for i, a in enumerate(adm)]


class DeviceGraph:
    """A device mode with the pool's step and the K forward passes in one CUDA graph per replay."""

    def __init__(self, eng: dl.Engine, B: int):
        self.eng, self.B, self.graph = eng, B, None

    def decode(self, seqs, capture: bool):
        eng, B = self.eng, self.B
        if self.graph is None:  # the first replay runs eagerly (it compiles the kernels), then capture
            out = eng._decode_device(seqs)
            if capture:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    with eng.m.lock:
                        eng._burst_body(B)
            return out
        eng.step.set_inputs([s.slot for s in seqs], [s.ctx + 1 for s in seqs])
        self.graph.replay()
        return eng.read_replay(B)


def bench_one(model, mode: str, B: int, K: int, args) -> dict:
    bs = args.block_size
    M = -(-(args.prompt_len + (args.iters + 2) * K + 1) // bs) + 1
    eng = dl.Engine(model, mode, num_blocks=B * M + 1, block_size=bs, max_num_reqs=B, max_blocks_per_req=M, steps=K)
    g = torch.Generator().manual_seed(B * 10 + K)
    prompts = torch.randint(1, model.cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
    seqs = prefill_all(eng, prompts)
    runner = HostGraph(eng, B) if mode == "host" else DeviceGraph(eng, B)
    capture = args.graph and eng.dev.type == "cuda"
    cuda = eng.dev.type == "cuda"
    advance(seqs, runner.decode(seqs, capture))  # warm-up and capture
    if cuda:
        torch.cuda.synchronize()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.iters):
        tokens += advance(seqs, runner.decode(seqs, capture))
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"mode": mode, "B": B, "K": K, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
            "ms_per_replay": 1e3 * dt / args.iters, "graph": capture, "device": str(eng.dev)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=["host", "step", "burst"], choices=["host", "step", "burst"])
    p.add_argument("--iters", type=int, default=10, help="timed replays per case")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    p.add_argument("--no-graph", dest="graph", action="store_false")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    for name in ("batch", "steps", "iters", "prompt_len", "block_size", "hidden", "layers"):
        v = getattr(args, name)
        if min(v if isinstance(v, list) else [v]) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.device == "cpu":
        print("note: on a CPU the pool's kernels run in Triton's interpreter: these times say nothing about a GPU")
    cfg = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                      num_kv_heads=max(1, args.hidden // 128), head_dim=64, intermediate_size=2 * args.hidden)
    model = Llama.random(cfg, seed=0, dtype=getattr(torch, args.dtype), device=args.device)
    rows = []
    for B in args.batch:
        for mode in args.modes:
            for K in (args.steps if mode == "burst" else [1]):
                r = bench_one(model, mode, B, K, args)
                rows.append(r)
                print(f"{r['mode']:>6} B={B:<5} K={K}  {r['tokens_per_s']:12.0f} tok/s  {r['ms_per_replay']:8.3f} ms/replay"
                      f"  graph={r['graph']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
