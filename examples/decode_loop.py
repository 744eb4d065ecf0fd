"""A model decodes on gpupool: greedy decoding of a small Llama-style model (examples/llama.py) whose
KV lives in a paged cache written through the manager's slot mapping and read through its block
table (gpupool.kv_cache), checked token for token against the same model on contiguous KV.

    python examples/decode_loop.py                 # every mode on the default workload, one table
    python examples/decode_loop.py --quick         # a small workload (seconds)
    python examples/decode_loop.py --help

Modes (docs/kv_cache.md section 4):

* ``contiguous``: the oracle. Each request alone, its KV in a contiguous buffer, no cache reuse.
* ``host``: the reference pool allocates on the host every step; the block table and slot mapping
  are uploaded every step; one host sync per step to read the tokens (vLLM's and SGLang's pattern).
* ``step``: ``DecodeStep``, one decode step per run (or graph replay) and one forward pass.
* ``burst``: ``reserve`` (blocks booked for K tokens, nothing popped or evicted) then
  ``DecodeStep(steps=K)``: allocation for K steps, then K forward passes reading
  ``slot_mapping_steps[k]`` and the step's attention views, each step's token fed to the next on the
  device; the host reads the K tokens of every request once per replay, frees the finished ones and
  preempts those a step could not admit.
* ``prebook``: as ``burst``, but the K steps' blocks are popped up front by ``allocate_slots``
  (what engines do today), which evicts cached blocks earlier.

Every mode admits requests in order with prefix-cache hits (the hit blocks are read, not
recomputed), preempts by recompute, and runs one fork: a second continuation of a prompt that shares
its blocks, its last block copied by the copy-on-write queue and ``copy_blocks`` on real KV.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import Llama, LlamaConfig  # noqa: E402
from gpupool.instrument import Meter  # noqa: E402

from gpupool.args import device_arg  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.graph import DecodeStep  # noqa: E402
from gpupool.keys import hash_request_tokens  # noqa: E402
from gpupool.kernels.copy_blocks import copy_blocks  # noqa: E402
from gpupool.kv_cache import PagedKVCache, attention, paged_attention  # noqa: E402
from gpupool.manager import KVCacheManager  # noqa: E402
from gpupool.reference import ReferenceKVCacheManager  # noqa: E402

MODES = ("host", "step", "burst", "prebook")


@dataclass
class Request:
    """A prompt to continue for ``max_new`` tokens. A fork (``fork_of`` another request's id) shares
    that request's prompt and blocks and starts with ``first_token`` instead of its greedy token."""

    rid: int
    prompt: list[int]
    max_new: int
    fork_of: int | None = None
    first_token: int | None = None


@dataclass
class Seq:
    """A request in the engine: every token it has (prompt + generated), ``ctx`` of them in the cache;
    while running, ``ctx == len(tokens) - 1`` (the last token is the next input) once its first token is
    known to the host."""

    req: Request
    tokens: list[int]
    slot: int = -1
    ctx: int = 0
    generated: int = 0
    preemptions: int = 0
    first_pending: bool = False  # its first token is on the device only (the prefill's greedy token)

    @property
    def done(self) -> bool:
        return self.generated >= self.req.max_new


@dataclass
class Stats:
    requests: int = 0
    tokens: int = 0
    replays: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    forks: int = 0
    mid_burst_stops: int = 0  # requests admitted at a burst's first step that a later step could not admit
    booked_stops: int = 0  # ... of them whose reservation covered the burst (never, by its contract)
    meter: dict = field(default_factory=dict)  # the whole run (admissions and prefill included)
    decode_meter: dict = field(default_factory=dict)  # the replays alone (decode)
    seconds: float = 0.0


def make_workload(num_requests: int, prompt_len: int, prefix_len: int, max_new: int, vocab: int, seed: int,
                  groups: int = 2, fork: bool = True) -> list[Request]:
    """Requests whose prompts share a prefix within each of ``groups`` groups (prefix-cache hits),
    plus, with ``fork``, a fork of the first request with a different first token."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(1, vocab, (prefix_len,), generator=g).tolist() for _ in range(groups)]
    reqs = []
    for i in range(num_requests):
        tail = torch.randint(1, vocab, (prompt_len - prefix_len,), generator=g).tolist()
        reqs.append(Request(i, prefixes[i % groups] + tail, max_new))
    if fork and reqs:
        reqs.insert(1, Request(num_requests, list(reqs[0].prompt), max_new, fork_of=0, first_token=1))
    return reqs


# ---- the oracle ------------------------------------------------------------------------------------
def contiguous_decode(model: Llama, req: Request) -> list[int]:
    """Greedy tokens of ``req`` alone, its KV in contiguous buffers, no reuse (the oracle)."""
    c = model.cfg
    n_max = len(req.prompt) + req.max_new
    kbuf = [torch.zeros(1, n_max, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=model.device)
            for _ in range(c.num_layers)]
    vbuf = [torch.zeros_like(b) for b in kbuf]

    def forward(tokens: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(tokens), device=model.device)
        end = torch.tensor([start + len(tokens)], device=model.device)

        def attend(layer, q, k, v):
            kbuf[layer][0, start:start + len(tokens)] = k
            vbuf[layer][0, start:start + len(tokens)] = v
            return attention(q[None], kbuf[layer], vbuf[layer], end)[0]

        return model.forward(torch.tensor(tokens, device=model.device), pos, attend)

    out = []
    tok = int(forward(req.prompt, 0)[-1].argmax())
    if req.first_token is not None:
        tok = req.first_token
    pos = len(req.prompt)
    while True:
        out.append(tok)
        if len(out) == req.max_new:
            return out
        tok = int(forward([tok], pos)[-1].argmax())
        pos += 1


# ---- the paged engine -------------------------------------------------------------------------------
class Engine:
    """Greedy decoding of ``model`` on a paged KV cache managed by gpupool (module docstring).

    ``mode``: one of MODES; ``steps``: K decode steps per replay (``burst`` / ``prebook``);
    ``reserve``: book the burst's blocks first (``burst``); ``count_evictions``: drain the pool's KV
    events after each admission and count ``BlockRemoved`` (instrumentation: adds syncs)."""

    def __init__(self, model: Llama, mode: str, *, num_blocks: int, block_size: int, max_num_reqs: int,
                 max_blocks_per_req: int, steps: int = 1, count_evictions: bool = False, kv_dtype=None,
                 graph: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode, self.dev = model, mode, model.device
        self.K = steps if mode in ("burst", "prebook") else 1
        self.bs, self.R, self.M = block_size, max_num_reqs, max_blocks_per_req
        self.count_evictions = count_evictions
        c = model.cfg
        kw = dict(block_size=block_size, max_num_reqs=max_num_reqs, max_blocks_per_req=max_blocks_per_req,
                  enable_kv_cache_events=count_evictions)
        self.host = mode == "host"
        # one fork at a time waits for its copy: a small copy queue (copy_blocks' grid is its capacity)
        self.m = ReferenceKVCacheManager(num_blocks, **kw) if self.host else \
            KVCacheManager(num_blocks, device=self.dev, max_pending_copies=4, **kw)
        self.kv = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                               dtype=kv_dtype or model.dtype, device=self.dev)
        self.kc, self.vc = self.kv.key_caches, self.kv.value_caches
        self.last_token = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.dev)  # next input, by slot
        if not self.host:
            self.step = DecodeStep(self.m, max_num_reqs, kv_caches=self.kv.layers(), steps=self.K, views=True)
            self.in_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.dev)
            self.out_tokens = torch.zeros((self.K, max_num_reqs), dtype=torch.int64, device=self.dev)
            self.k_tokens = torch.full((max_num_reqs,), self.K, dtype=torch.int32, device=self.dev)
            self.reserved_ok = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.dev)
        self.graph = graph and not self.host
        self._captured = None
        self.stats = Stats()

    # ---- admission and prefill ----------------------------------------------------------------------
    def _drain_events(self) -> None:
        if self.count_evictions:
            self.stats.evictions += sum(type(e).__name__ == "BlockRemoved" for e in self.m.pool.take_events())

    def _admit(self, seq: Seq, slot: int, by_rid: dict) -> bool:
        """Admit ``seq`` into ``slot`` with its prefix hits and prefill the rest; False if it does not fit."""
        m, bs = self.m, self.bs
        fresh = seq.generated == 0
        known = seq.tokens if fresh else seq.tokens[:-1]  # a resumed request's last token is its next input
        n = len(known)
        parent = by_rid.get(seq.req.fork_of) if fresh and seq.req.fork_of is not None else None
        m.add_request(slot, hash_request_tokens(known, block_size=bs))
        if parent is not None and parent.slot >= 0 and parent.ctx >= n:
            return self._admit_fork(seq, slot, parent, n)
        if self.host:
            hits = m.get_computed_blocks([slot], [n])[0][0]
            ok = m.allocate_slots([slot], [n], [n], lookup=[True])[0]
        else:
            h, _ = m.get_computed_blocks([slot], [n])
            a = m.allocate_slots([slot], [n], [n], lookup=[True])
            hits, ok = torch.cat([h, a]).tolist()  # one read for both
        if not ok:
            m.free([slot])
            return False
        seq.slot, seq.ctx = slot, n
        hit = hits * bs
        self.stats.prompt_tokens += n
        self.stats.hit_tokens += hit
        logits = self._prefill(slot, known[hit:], hit, n)
        if not fresh:
            self.last_token[slot] = seq.tokens[-1]
        elif seq.req.first_token is not None:
            self._start(seq, seq.req.first_token)
        else:
            self.last_token[slot] = logits[-1].argmax()
            seq.first_pending = True
        return True

    def _start(self, seq: Seq, first: int) -> None:
        """A fresh request whose first token the host chose (a fork's)."""
        seq.tokens.append(first)
        seq.generated = 1
        self.last_token[seq.slot] = first

    def _admit_fork(self, seq: Seq, slot: int, parent: Seq, n: int) -> bool:
        """A fork of ``parent``'s prompt: its full blocks as prefix hits, its last block copied (the
        copy-on-write queue; the copy runs on the KV caches before the next forward pass)."""
        m, bs = self.m, self.bs
        hits = (n - 1) // bs
        ok = m.allocate_slots([slot], [n], [hits * bs], lookup=[True])
        if not (ok[0] if self.host else bool(ok[0])):
            m.free([slot])
            return False
        src = m.block_table(0)[parent.slot][hits] if self.host else int(m.block_table[0, parent.slot, hits])
        try:
            m.cow_append(slot, [src])
        except Exception:
            m.free([slot])
            return False
        m.allocate_slots([slot], [n], [n])  # nothing to allocate: its tokens computed are now n (reserve counts from there)
        if self.host:  # the host pool's copies run now
            copies = m.take_pending_copies()
            copy_blocks(self.kv.layers(), torch.tensor([c[0] for c in copies], dtype=torch.int32, device=self.dev),
                        torch.tensor([c[1] for c in copies], dtype=torch.int32, device=self.dev))
            m.release_copied(copies)
        seq.slot, seq.ctx = slot, n
        self.stats.prompt_tokens += n
        self.stats.hit_tokens += n  # nothing recomputed: hits and the copied block
        self.stats.forks += 1
        self._start(seq, seq.req.first_token)
        return True

    def _prefill(self, slot: int, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """One forward pass over ``tokens`` at positions ``start .. end - 1`` of request ``slot``."""
        dev = self.dev
        pos = torch.arange(start, end, device=dev)
        if self.host:
            row = self.m.block_table(0)[slot]
            sm = torch.tensor(self.m.slot_mapping([slot] * len(tokens), list(range(start, end))), device=dev)
            table = torch.tensor([row + [0] * (self.M - len(row))], dtype=torch.int32, device=dev)
            seqused = torch.tensor([end], dtype=torch.int32, device=dev)
        else:
            sm = self.m.slot_mapping(torch.full((len(tokens),), slot, dtype=torch.int32, device=dev),
                                     pos.to(torch.int32))
            views = self.m.attention_views([slot], [end])
            table, seqused = views.block_table, views.seqused_k[0]

        def attend(layer, q, k, v):
            self.kv.store(layer, k, v, sm)
            return paged_attention(q[None], self.kc[layer], self.vc[layer], table, seqused)[0]

        return self.model.forward(torch.tensor(tokens, device=dev), pos, attend)

    # ---- decode -----------------------------------------------------------------------------------------
    def _forward_step(self, tok: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      table: torch.Tensor, seqused: torch.Tensor) -> torch.Tensor:
        """One decode forward pass over lanes ``tok: int64[B]``: greedy next tokens ``int64[B]``."""
        def attend(layer, q, k, v):
            self.kv.store(layer, k, v, slot_mapping)
            return paged_attention(q[:, None], self.kc[layer], self.vc[layer], table, seqused)[:, 0]

        return self.model.forward(tok, positions, attend).argmax(-1)

    def _burst_body(self, B: int) -> None:
        """The device part of one replay over ``B`` lanes (fixed once captured): the pool's step (with
        the reservation or the pre-booking first), then K forward passes, each step's tokens fed to
        the next on the device."""
        st = self.step
        if self.mode == "burst":
            self.m.reserve(st.slots, self.k_tokens, num_reqs=st.num_reqs, out=self.reserved_ok)
        elif self.mode == "prebook" and self.K > 1:
            target = st.num_tokens + (self.K - 1)
            self.m.allocate_slots(st.slots, st.num_tokens, target, num_reqs=st.num_reqs, stop_on_failure=False)
        st.run()
        slots = st.slots[:B].long()
        tok = self.last_token[slots]
        self.in_tokens[:B] = tok
        for k in range(self.K):
            v = st.views.step(k)
            pos = (st.num_tokens[:B] + (k - 1)).long()
            nxt = self._forward_step(tok, pos, st.slot_mapping_steps[k, :B], v.block_table[:B], v.seqused_k[:B])
            self.out_tokens[k, :B] = nxt
            tok = torch.where(st.admitted_steps[k, :B] != 0, nxt, tok)
        self.last_token[slots] = tok

    def _decode_device(self, running: list[Seq]) -> list[tuple[int, list[int | None]]]:
        """One replay of the device modes over ``running``: its inputs in one copy, the step and the K
        forward passes, then the replay's one host read (:meth:`read_replay`)."""
        self.step.set_inputs([s.slot for s in running], [s.ctx + 1 for s in running])
        with self.m.lock:
            self._burst_body(len(running))
        self.stats.replays += 1
        return self.read_replay(len(running))

    def read_replay(self, B: int) -> list[tuple[int, list[int | None]]]:
        """The replay's one host read: per lane (its input token at step 0, its K tokens, None from
        the first step that did not admit it); counts the requests stopped mid-burst."""
        both = torch.cat([self.in_tokens[None, :B], self.out_tokens[:, :B], self.step.admitted_steps[:, :B].long(),
                          self.reserved_ok[None, :B].long()])
        rows = both.tolist()
        K = self.K
        out = [(rows[0][i], [rows[1 + k][i] if rows[1 + K + k][i] else None for k in range(K)]) for i in range(B)]
        for i, (_, toks) in enumerate(out):
            if toks[0] is not None and None in toks:
                self.stats.mid_burst_stops += 1
                self.stats.booked_stops += self.mode == "burst" and rows[1 + 2 * K][i] == 1
        return out

    def host_step(self, running: list[Seq]) -> tuple[list[bool], list[int]]:
        """The host pool's step: ``allocate_slots`` on the host, then what the step uploads, packed:
        the block table ``[B, M]``, lengths, slot mapping (-1 where not admitted), slots, positions."""
        m, bs = self.m, self.bs
        slots = [s.slot for s in running]
        ntok = [s.ctx + 1 for s in running]
        adm = m.allocate_slots(slots, ntok, ntok, stop_on_failure=False)
        rows = m.block_table(0)
        table = [x for r in slots for x in rows[r] + [0] * (self.M - len(rows[r]))]
        seq = [n if a else 0 for n, a in zip(ntok, adm)]
        sm = [rows[r][(n - 1) // bs] * bs + (n - 1) % bs if a else -1 for r, n, a in zip(slots, ntok, adm)]
        return adm, table + seq + sm + slots + [n - 1 for n in ntok]

    def host_forward(self, packed: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device part of a host-mode step over :meth:`host_step`'s upload ``packed: int64``:
        one forward pass; returns (input tokens, greedy next tokens), both ``int64[B]``."""
        o = B * self.M
        tbl = packed[:o].view(B, self.M).to(torch.int32)
        seqused = packed[o:o + B].to(torch.int32)
        sl = packed[o + 2 * B:o + 3 * B]
        tok = self.last_token[sl]
        nxt = self._forward_step(tok, packed[o + 3 * B:o + 4 * B], packed[o + B:o + 2 * B], tbl, seqused)
        self.last_token[sl] = torch.where(seqused > 0, nxt, tok)
        return tok, nxt

    def _decode_host(self, running: list[Seq]) -> list[tuple[int, list[int | None]]]:
        adm, vals = self.host_step(running)
        tok, nxt = self.host_forward(torch.tensor(vals, dtype=torch.int64, device=self.dev), len(running))  # one upload
        self.stats.replays += 1
        first, toks = torch.stack([tok, nxt]).tolist()  # the step's one host read
        return [(first[i], [toks[i] if a else None]) for i, a in enumerate(adm)]

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> dict[int, list[int]]:
        """Decode every request to its ``max_new`` tokens; returns the generated tokens by request id."""
        t0 = time.perf_counter()
        waiting = deque(Seq(r, list(r.prompt)) for r in requests)
        by_rid = {s.req.rid: s for s in waiting}
        running: list[Seq] = []
        free_slots = list(range(self.R))
        out: dict[int, list[int]] = {}
        self.stats.requests = len(requests)
        self._decode_meter = Meter()
        with Meter() as meter:
            preempted: list[Seq] = []
            while waiting or running:
                # vLLM's rule: no new admission in a step that preempted (they would be preempted next)
                while waiting and free_slots and not (preempted and running):
                    seq = waiting[0]
                    if not self._admit(seq, free_slots[0], by_rid):
                        break
                    waiting.popleft()
                    free_slots.pop(0)
                    running.append(seq)
                self._drain_events()
                if not running:
                    raise RuntimeError(f"request {waiting[0].req.rid} does not fit the pool even alone")
                with self._decode_meter:
                    results = self._decode_host(running) if self.host else self._decode_device(running)
                leaving, still, preempted = [], [], []
                generated = sum(seq.generated for seq in running)
                for seq, (first, toks) in zip(running, results):
                    if seq.first_pending:
                        seq.tokens.append(first)
                        seq.generated, seq.first_pending = 1, False
                    stopped = False
                    for t in toks:
                        if seq.done:
                            break
                        if t is None:
                            stopped = True
                            break
                        seq.tokens.append(t)
                        seq.ctx += 1
                        seq.generated += 1
                    if seq.done:
                        out[seq.req.rid] = seq.tokens[len(seq.req.prompt):]
                        leaving.append(seq.slot)
                    elif stopped:  # a step could not admit it: preempt, resume by recompute
                        seq.preemptions += 1
                        self.stats.preemptions += 1
                        leaving.append(seq.slot)
                        preempted.append(seq)
                    else:
                        still.append(seq)
                if len(running) == 1 and preempted and sum(seq.generated for seq in running) == generated:
                    # alone, preempted before a token: resuming would run the same step again, forever
                    raise RuntimeError(f"request {running[0].req.rid} does not fit the pool even alone")
                if leaving:
                    self._free(leaving)
                    free_slots = sorted(free_slots + leaving)
                for seq in reversed(preempted):
                    seq.slot, seq.ctx = -1, 0
                    waiting.appendleft(seq)
                running = still
            self._drain_events()
        self.stats.tokens = sum(len(v) for v in out.values())
        self.stats.meter = meter.as_dict()
        self.stats.decode_meter = self._decode_meter.as_dict()
        self.stats.seconds = time.perf_counter() - t0
        return out

    def _free(self, slots: list[int]) -> None:
        if self.host:
            self.m.free(slots)
        else:  # a device tensor: no sync
            self.m.free(torch.tensor(slots, dtype=torch.int32, device=self.dev))


# ---- the command ------------------------------------------------------------------------------------
def run_all(args) -> list[dict]:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, intermediate_size=2 * args.hidden)
    model = Llama.from_pretrained(args.model, dtype=dtype, device=args.device) if args.model else \
        Llama.random(cfg, seed=args.seed, dtype=dtype, device=args.device)
    reqs = make_workload(args.requests, args.prompt_len, args.prefix_len, args.max_new, model.cfg.vocab_size,
                         args.seed, fork=not args.no_fork)
    want = {r.rid: contiguous_decode(model, r) for r in reqs}
    rows = []
    for mode in args.modes:
        for K in (args.steps if mode in ("burst", "prebook") else [1]):
            eng = Engine(model, mode, num_blocks=args.num_blocks, block_size=args.block_size,
                         max_num_reqs=args.max_num_reqs, max_blocks_per_req=args.max_blocks_per_req, steps=K,
                         count_evictions=True)
            got = eng.run(reqs)
            st = eng.stats
            mt = st.meter
            rows.append({"mode": mode, "K": K, "requests": st.requests, "tokens": st.tokens,
                         "identical": got == want, "hit_tokens": st.hit_tokens, "prompt_tokens": st.prompt_tokens,
                         "evictions": st.evictions, "preemptions": st.preemptions, "replays": st.replays,
                         "syncs/token": mt["syncs"] / max(st.tokens, 1),
                         "launches/token": mt["launches"] / max(st.tokens, 1),
                         "torch ops/token": mt["torch_ops"] / max(st.tokens, 1),
                         "copies/token": mt["copies"] / max(st.tokens, 1),
                         "decode syncs/replay": st.decode_meter["syncs"] / max(st.replays, 1),
                         "seconds": st.seconds})
    return rows


def format_table(rows: list[dict]) -> str:
    cols = [("mode", "mode", "{}"), ("K", "K", "{}"), ("requests", "requests", "{}"), ("tokens", "tokens", "{}"),
            ("identical", "identical", "{}"), ("hit_tokens", "hit tok", "{}"), ("evictions", "evicted", "{}"),
            ("preemptions", "preempt", "{}"), ("replays", "replays", "{}"), ("syncs/token", "syncs/tok", "{:.2f}"),
            ("launches/token", "launch/tok", "{:.2f}"), ("torch ops/token", "ops/tok", "{:.1f}"),
            ("copies/token", "H2D/tok", "{:.2f}"), ("decode syncs/replay", "syncs/replay", "{:.2f}"),
            ("seconds", "s", "{:.1f}")]
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([("yes" if r[k] else "NO") if k == "identical" else f.format(r[k]) for k, _, f in cols])
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].rjust(w[i]) for i in range(len(cols))) for c in cells)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Greedy decoding of a small Llama-style model on gpupool's paged KV, "
                                            "every mode checked token for token against contiguous KV.")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8], help="K of the burst and prebook modes")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=21)
    p.add_argument("--prefix-len", type=int, default=12, help="prompt tokens shared within a group")
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--num-blocks", type=int, default=40, help="pool size (small enough to preempt)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--max-num-reqs", type=int, default=8)
    p.add_argument("--max-blocks-per-req", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", help="a local LlamaForCausalLM directory (needs transformers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fork", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="a small workload: 4 requests, 6 new tokens, K in {1, 4}, 24 blocks (flags given with it win)")
    return p


QUICK = dict(requests=4, max_new=6, steps=[1, 4], num_blocks=24)  # --quick's sizes; flags given still win


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Sizes the workload and the model can run with, else ``p.error`` (a usage message, exit 2)."""
    sizes = ["requests", "prompt_len", "max_new", "num_blocks", "block_size", "max_num_reqs", "max_blocks_per_req"]
    if not args.model:
        sizes += ["vocab", "hidden", "layers", "heads", "kv_heads"]
    for name in sizes:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.steps):
        p.error(f"--steps must all be >= 1, got {args.steps}")
    if not 0 <= args.prefix_len <= args.prompt_len:
        p.error(f"--prefix-len must be in 0..--prompt-len ({args.prompt_len}), got {args.prefix_len}")
    if not args.model:
        if args.heads % args.kv_heads:
            p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
        if args.hidden % args.heads or (args.hidden // args.heads) % 2:
            p.error(f"--hidden ({args.hidden}) must be --heads ({args.heads}) times an even head size (rotary "
                    "embeddings rotate pairs)")
    burst = max(args.steps) - 1 if {"burst", "prebook"} & set(args.modes) else 0  # a burst runs past a request's end
    need = -(-(args.prompt_len + args.max_new - 1 + burst) // args.block_size)  # the last token is not stored
    if need > args.max_blocks_per_req:
        p.error(f"a request takes up to {need} blocks of {args.block_size} tokens (--prompt-len + --max-new, and a "
                f"burst's --steps - 1 past the end), more than --max-blocks-per-req ({args.max_blocks_per_req})")
    if need > args.num_blocks - 1:  # block 0 is the null block
        p.error(f"--num-blocks ({args.num_blocks}) is too small for one request alone: it takes up to {need} "
                "blocks, and block 0 is the null block")
    try:
        device_arg("decode_loop", args.device)
    except PoolError as e:
        p.error(str(e))


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    check_args(p, args)
    try:
        rows = run_all(args)
    except PoolError as e:  # a size the checks above cannot see (a checkpoint's, the pool's own limits)
        print(f"decode_loop: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
