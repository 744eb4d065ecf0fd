"""A model decodes on gpupool: greedy decoding of a small Llama-style model (examples/llama.py) whose
KV lives in a paged cache written through the pool's slot mapping and read through its block table
(gpupool.kv_cache), checked token for token against the same model on contiguous KV and, with
``--model DIR``, against transformers' own ``generate``.

    python examples/decode_loop.py --quick         # a small workload (about a minute on a CPU)
    python examples/decode_loop.py                 # every mode on the default workload
    python examples/decode_loop.py --help

Modes (docs/kv_cache.md section 4):

* ``host``: the reference pool on the host, one pool step per forward pass (vLLM's and SGLang's
  pattern): the step's block table, slot mapping and positions uploaded, the tokens read back every
  step.
* ``window`` (K = ``--steps``): a ``DecodeWindow`` of K pool steps interleaved with K forward passes on
  the device: a request that samples its last token (its budget, or ``--eos``) at pass k is freed at
  step k + 1 and its blocks serve the others in the same window; one host read per window.
* ``spec`` (D = ``--draft``): speculative decoding in a window of ``--spec-steps`` steps: a prompt-lookup
  (n-gram) proposer drafts D tokens on the device, the target verifies all D + 1 positions in one pass,
  greedy acceptance on the device; each step advances a lane by 1 to D + 1 tokens.

Every mode admits requests in order with prefix-cache hits (admission is one device op whose outcome
comes back with the window's read), preempts as vLLM does (the last running request, so the others
advance; no admission after a step that preempted), resumes preempted requests by recompute, runs a
second turn of some conversations (its prompt holds the first turn's generated tokens, whose blocks the
pool keyed on the device) and one fork (copy-on-write of a shared last block).
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
# a device module before any kernel module: it picks the kernels' backend (the interpreter without CUDA)
import gpupool.kv_cache  # noqa: E402,F401
from gpupool.instrument import Meter  # noqa: E402

from gpupool.args import device_arg  # noqa: E402
from gpupool.errors import PoolError  # noqa: E402
from gpupool.keys import hash_request_tokens  # noqa: E402
from gpupool.kernels.copy_blocks import copy_blocks  # noqa: E402
from gpupool.kv_cache import PagedKVCache, attention, paged_attention  # noqa: E402
from gpupool.manager import KVCacheManager  # noqa: E402
from gpupool.reference import ReferenceKVCacheManager  # noqa: E402
from gpupool.reference.window import ReferenceDecodeWindow  # noqa: E402
from gpupool.window import DecodeWindow  # noqa: E402

MODES = ("host", "window", "spec")
NGRAM = 2  # the prompt-lookup proposer matches the last NGRAM tokens


@dataclass
class Request:
    """A prompt to continue for ``max_new`` tokens. A second turn (``parent``: another request's id)
    starts with that request's prompt and generated tokens, then its own ``prompt``. A fork
    (``fork_of``) shares that request's prompt and blocks and starts with ``first_token``."""

    rid: int
    prompt: list[int]
    max_new: int
    parent: int | None = None
    fork_of: int | None = None
    first_token: int | None = None


@dataclass
class Seq:
    """A request in the engine: its tokens (prompt + generated) as the host knows them."""

    req: Request
    tokens: list[int]
    prompt_len: int
    slot: int = -1
    generated: int = 0
    preemptions: int = 0
    pending_first: bool = False  # its prefill's token is on the device only

    @property
    def done_after_first(self) -> bool:
        """Its prefill's token (still on the device, or just read) is its last (its budget)."""
        return self.generated + self.pending_first >= self.req.max_new


@dataclass
class Stats:
    requests: int = 0
    tokens: int = 0
    windows: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    generated_hit_tokens: int = 0  # hits on blocks a first turn generated (second turns)
    preemptions: int = 0
    evictions: int = 0
    forks: int = 0
    stops_inside: int = 0  # requests that stopped before their window's last step
    accepted: int = 0  # tokens gained by forward passes (spec: above one per pass when drafts are accepted)
    passes: int = 0  # lane-passes
    meter: dict = field(default_factory=dict)
    host_seconds: float = 0.0  # driver time, the model's passes and the pool's kernels left out
    seconds: float = 0.0


def make_workload(num_requests: int, prompt_len: int, prefix_len: int, max_new: int, vocab: int, seed: int,
                  groups: int = 2, fork: bool = True, turns: int = 2, prompt_len_max: int | None = None) -> list[Request]:
    """Requests whose prompts (``prompt_len`` to ``prompt_len_max`` tokens) share a prefix within each of
    ``groups`` groups (prefix hits), budgets from ``max_new // 2`` to ``max_new`` (so requests stop at
    different steps of a window; the first request's is ``max_new``, so that its fork finds it running), a second turn for every ``turns``-th request (0: none; its prompt
    continues that request's conversation), and with ``fork`` a fork of the first request."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(1, vocab, (prefix_len,), generator=g).tolist() for _ in range(groups)]
    reqs = []
    hi = max(prompt_len, prompt_len_max or prompt_len)
    for i in range(num_requests):
        n = int(torch.randint(prompt_len, hi + 1, (1,), generator=g))
        tail = torch.randint(1, vocab, (n - prefix_len,), generator=g).tolist()
        budget = int(torch.randint(max(1, max_new // 2), max_new + 1, (1,), generator=g)) if i else max_new
        reqs.append(Request(i, prefixes[i % groups] + tail, budget))
    if turns:
        for i in range(0, num_requests, turns):
            more = torch.randint(1, vocab, (max(1, prompt_len // 4),), generator=g).tolist()
            reqs.append(Request(len(reqs) + 1000, more, reqs[i].max_new, parent=reqs[i].rid))
    if fork and reqs:
        reqs.insert(1, Request(len(reqs) + 2000, list(reqs[0].prompt), reqs[0].max_new, fork_of=0, first_token=1))
    return reqs


def full_prompt(req: Request, outputs: dict[int, list[int]], by_rid: dict[int, Request]) -> list[int]:
    """The tokens a request starts from: a second turn's include its parent's conversation."""
    if req.parent is None:
        return list(req.prompt)
    parent = by_rid[req.parent]
    return full_prompt(parent, outputs, by_rid) + outputs[parent.rid] + req.prompt


# ---- the oracle ------------------------------------------------------------------------------------
def contiguous_decode(model: Llama, prompt: list[int], max_new: int, first_token: int | None = None,
                      eos: int | None = None) -> list[int]:
    """Greedy tokens after ``prompt``, alone, its KV in contiguous buffers, no reuse (the oracle); stops
    after ``max_new`` tokens or after ``eos``."""
    c = model.cfg
    n_max = len(prompt) + max_new
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
    tok = int(forward(prompt, 0)[-1].argmax())
    if first_token is not None:
        tok = first_token
    pos = len(prompt)
    while True:
        out.append(tok)
        if len(out) == max_new or tok == eos:
            return out
        tok = int(forward([tok], pos)[-1].argmax())
        pos += 1


def oracle(model: Llama, reqs: list[Request], eos: int | None) -> dict[int, list[int]]:
    """Every request's tokens on contiguous KV, second turns after their first turn."""
    by_rid = {r.rid: r for r in reqs}
    out: dict[int, list[int]] = {}
    for r in sorted(reqs, key=lambda r: r.parent is not None):
        out[r.rid] = contiguous_decode(model, full_prompt(r, out, by_rid), r.max_new, r.first_token, eos)
    return out


# ---- the paged engine -------------------------------------------------------------------------------
class Engine:
    """Greedy decoding of ``model`` on a paged KV cache managed by gpupool (module docstring).

    ``mode``: one of MODES; ``steps``: K pool steps (and forward passes) per window; ``draft``: D draft
    tokens per lane and pass (``spec``); ``eos``: a token that ends a request (None: only budgets)."""

    def __init__(self, model: Llama, mode: str, *, num_blocks: int, block_size: int, max_num_reqs: int,
                 max_blocks_per_req: int, steps: int = 1, draft: int = 0, eos: int | None = None,
                 count_evictions: bool = True, kv_dtype=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode, self.dev = model, mode, model.device
        self.K = 1 if mode == "host" else steps
        self.D = draft if mode == "spec" else 0
        self.Q = self.D + 1
        self.eos = -1 if eos is None else eos
        self.bs, self.R, self.M = block_size, max_num_reqs, max_blocks_per_req
        c = model.cfg
        kw = dict(block_size=block_size, max_num_reqs=max_num_reqs, max_blocks_per_req=max_blocks_per_req,
                  enable_kv_cache_events=count_evictions)
        self.host = mode == "host"
        self.m = ReferenceKVCacheManager(num_blocks, **kw) if self.host else \
            KVCacheManager(num_blocks, device=self.dev, max_pending_copies=4, **kw)
        self.kv = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                               dtype=kv_dtype or model.dtype, device=self.dev)
        self.kc, self.vc = self.kv.key_caches, self.kv.value_caches
        R, dev, i64 = max_num_reqs, self.dev, torch.int64
        # per request slot, on the device: the next input token, tokens generated, budget, history
        self.last_token = torch.zeros(R, dtype=i64, device=dev)
        self.generated = torch.zeros(R, dtype=i64, device=dev)
        self.budget = torch.zeros(R, dtype=i64, device=dev)
        L = max_blocks_per_req * block_size
        self.hist = torch.full((R, L), -1, dtype=i64, device=dev)
        self.hist_len = torch.zeros(R, dtype=i64, device=dev)
        self.first_tok = torch.zeros(R, dtype=i64, device=dev)  # each prefill's sampled token, by slot
        self.out_tok = torch.zeros((self.K, R, self.Q), dtype=i64, device=dev)  # by lane
        self.out_acc = torch.zeros((self.K, R), dtype=i64, device=dev)
        if self.host:
            self.win = ReferenceDecodeWindow(self.m, R, 1, 0)
        else:
            self.win = DecodeWindow(self.m, R, self.K, self.D, kv_caches=self.kv.layers())
        self.stats = Stats()
        self._device_seconds = 0.0
        self._meter = None

    # ---- the model's passes -------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The model's pass, timed as device work (with the kernel launches inside it, which the
        meter's launch time also holds: they are taken out of that)."""
        t0, l0 = time.perf_counter(), self._meter.launch_seconds if self._meter else 0.0
        try:
            return self.model.forward(tokens, positions, attend)
        finally:
            self._device_seconds += time.perf_counter() - t0
            if self._meter:
                self._device_seconds -= self._meter.launch_seconds - l0

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
            self.kv.store(layer, k.to(self.kc[layer].dtype), v.to(self.vc[layer].dtype), sm)
            return paged_attention(q[None], self.kc[layer], self.vc[layer], table, seqused)[0]

        return self._forward(torch.tensor(tokens, device=dev), pos, attend)

    def _propose(self, slots: torch.Tensor) -> torch.Tensor:
        """Prompt lookup: per lane, the D tokens that followed the latest earlier match of its last
        NGRAM tokens in its history (its last token repeated where none), ``int64[B, D]``. Fixed
        shapes, no host sync."""
        D, L = self.D, self.hist.shape[1]
        h = self.hist[slots]  # [B, L]
        n = self.hist_len[slots]  # [B]
        j = torch.arange(L, device=self.dev)
        last = h.gather(1, (n - 1).clamp(min=0)[:, None])  # [B, 1]
        match = torch.ones_like(h, dtype=torch.bool)
        for g in range(NGRAM):  # h[p - g] == h[n - 1 - g]
            ref = h.gather(1, (n - 1 - g).clamp(min=0)[:, None])
            shifted = torch.cat([torch.full_like(h[:, :g], -2), h[:, :L - g]], 1) if g else h
            match &= shifted == ref
        match &= (j[None, :] < (n - 1)[:, None]) & (j[None, :] >= NGRAM - 1)
        p = torch.where(match, j[None, :], -1).max(1).values  # the latest match
        idx = (p[:, None] + 1 + torch.arange(D, device=self.dev)[None, :]).clamp(max=L - 1)
        ok = (p[:, None] >= 0) & (idx < n[:, None])
        return torch.where(ok, h.gather(1, idx), last)

    def _decode_pass(self, slots: torch.Tensor, live: torch.Tensor, positions: torch.Tensor, slot_mapping,
                     table: torch.Tensor, seqused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward pass over lanes ``slots: int64[B]`` (``live``: the lanes that take part), Q queries a
        lane: the input token and, in spec mode, D drafts. Returns (greedy tokens ``int64[B, Q]``,
        accepted ``int64[B]``, stopped ``int32[B]``) and updates the per-slot device state."""
        B, Q, D = slots.shape[0], self.Q, self.D
        tok_in = self.last_token[slots]
        q_tok = torch.cat([tok_in[:, None], self._propose(slots)], 1) if D else tok_in[:, None]

        def attend(layer, q, k, v):
            self.kv.store(layer, k.to(self.kc[layer].dtype), v.to(self.vc[layer].dtype), slot_mapping)
            return paged_attention(q.view(B, Q, *q.shape[1:]), self.kc[layer], self.vc[layer], table,
                                   seqused).reshape(B * Q, *q.shape[1:])

        g = self._forward(q_tok.reshape(-1), positions.reshape(-1), attend).argmax(-1).view(B, Q)
        acc = torch.ones(B, dtype=torch.int64, device=self.dev)
        if D:
            acc += torch.cumprod((q_tok[:, 1:] == g[:, :-1]).long(), 1).sum(1)
        left = self.budget[slots] - self.generated[slots]
        stop = acc >= left
        acc = torch.minimum(acc, left.clamp(min=1))
        first_eos = torch.where(g == self.eos, torch.arange(Q, device=self.dev)[None, :], Q).min(1).values
        hit = first_eos < acc
        acc = torch.where(hit, first_eos + 1, acc)
        stop |= hit | (tok_in == self.eos)  # a prefill that sampled the end: nothing more
        acc = torch.where(live, acc, 1)
        stop &= live
        self.last_token[slots] = torch.where(live, g.gather(1, (acc - 1)[:, None])[:, 0], tok_in)
        self.generated[slots] += torch.where(live, acc, 0)
        if D:
            self._record(slots, live, g, acc)
        return g, acc, stop.to(torch.int32)

    def _record(self, slots, live, g, acc) -> None:
        """The history the proposer reads: each live lane's accepted tokens appended."""
        L = self.hist.shape[1]
        n = self.hist_len[slots]
        pos = (n[:, None] + torch.arange(self.Q, device=self.dev)[None, :]).clamp(max=L - 1)
        keep = live[:, None] & (torch.arange(self.Q, device=self.dev)[None, :] < acc[:, None])
        rows = self.hist[slots]
        rows.scatter_(1, pos, torch.where(keep, g, rows.gather(1, pos)))
        self.hist[slots] = rows
        self.hist_len[slots] = torch.where(live, n + acc, n)

    # ---- admission and prefill ------------------------------------------------------------------------
    def _hash_args(self, seq: Seq) -> tuple[list[bytes], list[int]]:
        hs = hash_request_tokens(seq.tokens, block_size=self.bs)
        return hs, seq.tokens[len(hs) * self.bs:]

    def _admit(self, batch: list[Seq], slots: list[int]):
        """Admission of ``batch`` into ``slots`` (one device op, or the reference's); the outcome is read
        later (with the window)."""
        args = [self._hash_args(s) for s in batch]
        return self.m.admit(slots, [a[0] for a in args], [len(s.tokens) for s in batch], [a[1] for a in args],
                            [s.preemptions > 0 for s in batch])

    def _start(self, seq: Seq, slot: int, hit: int) -> None:
        """An admitted request's prefill (its tokens past the hit) and its sampled token on the device."""
        n = len(seq.tokens)
        seq.slot = slot
        self.stats.prompt_tokens += n
        self.stats.hit_tokens += hit
        if seq.req.parent is not None and seq.preemptions == 0:
            self.stats.generated_hit_tokens += max(0, hit - self._parent_prompt[seq.req.rid])
        logits = self._prefill(slot, seq.tokens[hit:], hit, n)
        tok = logits[-1].argmax()
        if seq.req.first_token is not None and seq.generated == 0:
            tok = torch.tensor(seq.req.first_token, device=self.dev)
        self._seed_slot(seq, slot, tok)

    def _seed_slot(self, seq: Seq, slot: int, tok: torch.Tensor) -> None:
        """Slot ``slot``'s device state for ``seq`` whose next token ``tok`` (on the device) was just
        sampled: budget, counts, history; the token appended to the request's pool state."""
        self.first_tok[slot] = tok
        self.last_token[slot] = tok
        self.budget[slot] = seq.req.max_new
        self.generated[slot] = seq.generated + 1
        if self.D:
            self.hist[slot] = -1
            n = len(seq.tokens)
            self.hist[slot, :n] = torch.tensor(seq.tokens, device=self.dev)
            self.hist[slot, n] = tok
            self.hist_len[slot] = n + 1
        if self.host:
            seq.tokens.append(int(tok))  # the host pool's engine reads each token (a sync per prefill)
            seq.generated += 1
            self.m.append_tokens([slot], [[seq.tokens[-1]]])
        else:
            seq.pending_first = True
            self.m.append_tokens(torch.tensor([slot], dtype=torch.int32, device=self.dev),
                                 torch.ones(1, dtype=torch.int32, device=self.dev), tok.view(1, 1))

    def _admit_fork(self, seq: Seq, slot: int, parent: Seq) -> bool:
        """A fork of ``parent``'s prompt: its full blocks as prefix hits, its last block copied through
        the copy-on-write queue (host ops: they wait for the device)."""
        m, bs = self.m, self.bs
        n = len(seq.tokens)
        hits = (n - 1) // bs
        hs, tail = self._hash_args(seq)
        m.add_request(slot, hs, tail)
        ok = m.allocate_slots([slot], [n], [hits * bs], lookup=[True])
        if not (ok[0] if self.host else bool(ok[0])):
            m.free([slot])
            return False
        src = m.block_table(0)[parent.slot][hits] if self.host else int(m.block_table[0, parent.slot, hits])
        try:
            m.cow_append(slot, [src])
        except PoolError:
            m.free([slot])
            return False
        m.allocate_slots([slot], [n], [n])  # nothing to allocate: its computed tokens are n now
        if self.host:  # the host pool's copies run now; the device's at the next window's begin
            copies = m.take_pending_copies()
            copy_blocks(self.kv.layers(), torch.tensor([c[0] for c in copies], dtype=torch.int32, device=self.dev),
                        torch.tensor([c[1] for c in copies], dtype=torch.int32, device=self.dev))
            m.release_copied(copies)
        seq.slot = slot
        self.stats.prompt_tokens += n
        self.stats.hit_tokens += n  # nothing recomputed: hits and the copied block
        self.stats.forks += 1
        self._seed_slot(seq, slot, torch.tensor(seq.req.first_token, device=self.dev))
        return True

    # ---- a window ---------------------------------------------------------------------------------------
    def _window_device(self, lanes: list[Seq], finished: list[int], extra: list[torch.Tensor]):
        """One decode window on the device over ``lanes``: inputs in one copy, begin, K pool steps each
        followed by a forward pass, end; then the window's one read (with ``extra``)."""
        win, B = self.win, len(lanes)
        win.set_inputs([s.slot for s in lanes], [len(s.tokens) + s.pending_first for s in lanes], finished)

        def forward(w: DecodeWindow, k: int) -> None:  # reads only the window's buffers: a graph can hold it
            live = w.admitted[k, :B] != 0
            g, acc, stop = self._decode_pass(w.slots[:B].long(), live, w.positions(k)[:B],
                                             w.slot_mapping[0, k, :B * self.Q], w.views[0].block_table[:B],
                                             w.views[0].seqused_k[k, :B])
            w.stopped[:B] = stop
            w.accepted[:B] = acc.to(torch.int32)
            w.tokens[:B] = g
            self.out_tok[k, :B] = g
            self.out_acc[k, :B] = acc

        with self.m.lock:
            win.run(forward if B else None)
        res = win.read(self.out_tok[:, :B], self.out_acc[:, :B], *extra)
        self.stats.windows += 1
        return res

    def _window_host(self, lanes: list[Seq], finished: list[int], extra: list[torch.Tensor]):
        """The host pool's step: the reference window's step, what the pass needs uploaded in one copy,
        the pass, one read of its tokens, then the reference window's end."""
        win, B, Q = self.win, len(lanes), self.Q
        copies = win.begin([s.slot for s in lanes], [len(s.tokens) for s in lanes], finished)
        assert not copies  # the fork's copies ran at its admission
        out = win.step(0)
        rows = self.m.block_table(0)
        table = [x for s in lanes for x in rows[s.slot] + [0] * (self.M - len(rows[s.slot]))]
        pos = [n - 1 for n in win.num_tokens]
        vals = table + out.seq_lens + out.slot_mapping[0] + [s.slot for s in lanes] + pos + \
            [int(a) for a in out.admitted]
        packed = torch.tensor(vals, dtype=torch.int64, device=self.dev)  # the step's one upload
        o = B * self.M
        tbl = packed[:o].view(B, self.M).to(torch.int32)
        seqused = packed[o:o + B].to(torch.int32)
        sm = packed[o + B:o + 2 * B]
        slots = packed[o + 2 * B:o + 3 * B]
        live = packed[o + 4 * B:o + 5 * B] != 0
        g, acc, stop = self._decode_pass(slots, live, packed[o + 3 * B:o + 4 * B], sm, tbl, seqused)
        self.out_tok[0, :B] = g
        self.out_acc[0, :B] = acc
        flat = torch.cat([stop.long(), self.out_tok[0, :B].reshape(-1), self.out_acc[0, :B]] +
                         [t.reshape(-1).long() for t in extra]).tolist()  # the step's one read
        st = flat[:B]
        win.end(st, flat[B + B * Q:B + B * Q + B], [flat[B + i * Q:B + (i + 1) * Q] for i in range(B)])
        self.stats.windows += 1
        o = B + B * Q + B
        ex = []
        for t in extra:
            ex.append(flat[o:o + t.numel()])
            o += t.numel()
        return _HostResult(list(win.num_tokens), list(win.stop_step), list(win.preempt_step),
                           [[int(a) for a in out.admitted]], win.any_preempted,
                           [[[flat[B + i * Q:B + (i + 1) * Q] for i in range(B)]], [flat[B + B * Q:B + B * Q + B]]] + ex)

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, requests: list[Request], progress=None) -> dict[int, list[int]]:
        """Decode every request to its end (its budget, or ``eos``); returns the generated tokens by id.

        An iteration: the requests ready to wait join the line; the fork joins when its parent runs;
        the line's head is admitted (one op; none after a window that preempted); a window runs over
        the running requests (the admission's outcome, and the first tokens of requests prefilled
        since the last read, read with it); the host settles the window (tokens, stops, preemptions),
        then prefills the admitted requests, which run in the next window."""
        t0 = time.perf_counter()
        self._device_seconds = 0.0
        by_rid = {r.rid: r for r in requests}
        pending = deque(requests)  # second turns wait here for their first turn
        waiting: deque[Seq] = deque()
        running: list[Seq] = []  # the next window's lanes, in order
        ending: list[Seq] = []  # prefilled requests whose prefill token was their last
        seqs: dict[int, Seq] = {}
        out: dict[int, list[int]] = {}
        self.free_slots = list(range(self.R))
        self._parent_prompt: dict[int, int] = {}
        self.stats.requests = len(requests)
        blocked = False
        with Meter() as meter:
            self._meter = meter
            while pending or waiting or running or ending:
                while pending and (pending[0].parent is None or pending[0].parent in out):
                    r = pending.popleft()
                    prompt = full_prompt(r, out, by_rid)
                    if r.parent is not None:
                        self._parent_prompt[r.rid] = len(full_prompt(by_rid[r.parent], out, by_rid))
                    seqs[r.rid] = s = Seq(r, prompt, len(prompt))
                    waiting.append(s)
                # a fork waits for its parent to run, then shares its blocks; once the parent ended, it is a request
                forking = lambda s: s.req.fork_of is not None and not s.generated and s.req.fork_of not in out  # noqa: E731
                if waiting and forking(waiting[0]) and self.free_slots:
                    s, parent = waiting[0], seqs.get(waiting[0].req.fork_of)
                    if parent is not None and any(q is parent for q in running) and not parent.pending_first and \
                            len(parent.tokens) > len(s.tokens) and \
                            self._admit_fork(s, self.free_slots[0], parent):
                        waiting.popleft()
                        self.free_slots.pop(0)
                        (ending if s.done_after_first else running).append(s)
                admitting = None
                if not blocked and waiting and self.free_slots:
                    batch = []
                    for s in waiting:  # the head of the line, up to a fork that waits for its parent
                        if forking(s) or len(batch) == len(self.free_slots):
                            break
                        batch.append(s)
                    if batch:
                        slots = self.free_slots[:len(batch)]
                        admitting = (batch, slots) + tuple(self._admit(batch, slots))
                if not running and not ending and admitting is None:
                    if blocked:  # the window that preempted was the last to run: admission resumes now
                        blocked = False
                        continue
                    head = (waiting or pending)[0]
                    raise RuntimeError(f"request {head.req.rid if isinstance(head, Seq) else head.rid} does not "
                                       "fit the pool even alone")
                firsts = [s for s in running + ending if s.pending_first]
                extra = []
                if not self.host:
                    if admitting is not None:
                        extra += [admitting[2], admitting[3]]
                    if firsts:
                        extra.append(self.first_tok[torch.tensor([s.slot for s in firsts], device=self.dev)])
                lanes = list(running)
                finished = [s.slot for s in ending]
                res = self._window_host(lanes, finished, extra) if self.host else \
                    self._window_device(lanes, finished, extra)
                ex = list(res.extra)
                toks, accs = ex.pop(0), ex.pop(0)
                if admitting is not None:
                    adm, hits = (admitting[2], admitting[3]) if self.host else (ex.pop(0), ex.pop(0))
                if firsts and not self.host:
                    for s, t in zip(firsts, ex.pop(0)):
                        s.tokens.append(t)
                        s.generated += 1
                        s.pending_first = False
                for s in ending:
                    self._finish(s, out)
                ending = []
                self._settle(lanes, res, toks, accs, running, waiting, out)
                blocked = res.any_preempted
                if admitting is not None:
                    if not (adm[0] or lanes or finished):  # refused with nothing else holding blocks
                        raise RuntimeError(f"request {admitting[0][0].req.rid} does not fit the pool even alone")
                    for s, slot, a, h in zip(admitting[0], admitting[1], adm, hits):
                        if not a:
                            break
                        waiting.remove(s)
                        self.free_slots.remove(slot)
                        self._start(s, slot, h)
                        (ending if s.done_after_first else running).append(s)
                if progress is not None:
                    progress(len(out), len(requests))
        self.stats.tokens = sum(len(v) for v in out.values())
        self.stats.meter = meter.as_dict()
        self.stats.seconds = time.perf_counter() - t0
        self.stats.host_seconds = self.stats.seconds - self._device_seconds - meter.launch_seconds
        self.stats.evictions = sum(type(e).__name__ == "BlockRemoved" for e in self.m.pool.take_events())
        return out

    def _finish(self, s: Seq, out: dict) -> None:
        """``s`` is done: its output recorded, its slot free (the pool freed it, or frees it next)."""
        out[s.req.rid] = s.tokens[s.prompt_len:]
        self.free_slots.append(s.slot)
        self.free_slots.sort()
        s.slot = -1

    def _settle(self, lanes, res, toks, accs, running, waiting, out) -> None:
        """The window's outcome on the host: each lane's tokens by step, its stop or preemption."""
        K = len(res.admitted)
        for i, s in enumerate(lanes):
            if not (s.tokens and s.generated and s.tokens[-1] == self.eos):  # a prefill that sampled the end
                for k in range(K):
                    if not res.admitted[k][i]:
                        break
                    a = accs[k][i]
                    s.tokens += toks[k][i][:a]
                    s.generated += a
                    self.stats.accepted += a
                    self.stats.passes += 1
                    if res.stop_step[i] == k:
                        break
            if s.generated > s.req.max_new:  # the pool missed a stop: a lane would decode forever
                raise RuntimeError(f"request {s.req.rid} decoded {s.generated} tokens past its budget of "
                                   f"{s.req.max_new}: its stop never reached the pool")
            if res.stop_step[i] >= 0:
                self.stats.stops_inside += res.stop_step[i] < K - 1
                running.remove(s)
                self._finish(s, out)
            elif res.preempt_step[i] >= 0:
                running.remove(s)
                self.free_slots.append(s.slot)
                self.free_slots.sort()
                s.slot = -1
                s.preemptions += 1
                self.stats.preemptions += 1
                waiting.appendleft(s)


class _HostResult(tuple):
    """The host engine's window outcome, shaped like ``gpupool.window.WindowResult``."""

    def __new__(cls, num_tokens, stop_step, preempt_step, admitted, any_preempted, extra):
        return super().__new__(cls, (num_tokens, stop_step, preempt_step, admitted, any_preempted, extra))

    num_tokens = property(lambda self: self[0])
    stop_step = property(lambda self: self[1])
    preempt_step = property(lambda self: self[2])
    admitted = property(lambda self: self[3])
    any_preempted = property(lambda self: self[4])
    extra = property(lambda self: self[5])


# ---- the command ------------------------------------------------------------------------------------
COLUMNS = [  # (key, heading, format, meaning)
    ("mode", "mode", "{}", "host: the reference pool on the host, a pool step and a read per pass; window: a "
                           "DecodeWindow of K steps on the device; spec: speculative decoding in a window"),
    ("K", "K", "{}", "pool steps (and forward passes) per window"),
    ("D", "D", "{}", "draft tokens verified per pass (spec)"),
    ("tokens", "tokens", "{}", "tokens generated, all requests"),
    ("identical", "same", "{}", "tokens identical to the same model on contiguous KV"),
    ("hf", "hf", "{}", "tokens identical to transformers' generate (--model), '-' without it"),
    ("hit_tokens", "hit tok", "{}", "prompt tokens served by prefix-cache hits (not recomputed)"),
    ("generated_hit_tokens", "gen hit", "{}", "of them, tokens a first turn generated (second turns)"),
    ("evictions", "evicted", "{}", "keys evicted from the prefix cache (BlockRemoved events)"),
    ("preemptions", "preempt", "{}", "requests preempted (resumed later by recompute)"),
    ("stops_inside", "stops in", "{}", "requests that stopped before their window's last step"),
    ("tokens/pass", "tok/pass", "{:.2f}", "tokens a lane gained per forward pass (above 1: drafts accepted)"),
    ("windows", "windows", "{}", "windows (host: steps)"),
    ("syncs/token", "syncs/tok", "{:.3f}", "host reads of device values per generated token, admissions included"),
    ("launches/token", "launch/tok", "{:.2f}", "pool kernel launches per generated token"),
    ("torch ops/token", "ops/tok", "{:.1f}", "torch operations per generated token (each a kernel launch on a GPU)"),
    ("copies/token", "H2D/tok", "{:.2f}", "host-to-device copies per generated token"),
    ("host us/token", "host us/tok", "{:.0f}", "driver CPU time per generated token, the model's passes and the "
                                               "pool's kernels left out (measured on this machine)"),
    ("host ratio", "vs host", "{:.2f}", "that time as a ratio to the host mode's in this run"),
    ("seconds", "wall s", "{:.1f}", "wall time of the mode (on a CPU: interpreter time, not a speed)"),
]


def run_all(args, progress=None) -> list[dict]:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = Llama.from_pretrained(args.model, dtype=dtype, device=args.device)
    else:
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                          intermediate_size=2 * args.hidden)
        model = Llama.random(cfg, seed=args.seed, dtype=dtype, device=args.device)
    reqs = make_workload(args.requests, args.prompt_len, args.prefix_len, args.max_new, model.cfg.vocab_size,
                         args.seed, fork=not args.no_fork, turns=0 if args.no_turns else 2,
                         prompt_len_max=args.prompt_len_max)
    want = oracle(model, reqs, args.eos)
    hf = hf_reference(args, reqs) if args.model else None
    rows = []
    runs = [("host", 1, 0)] if "host" in args.modes else []
    runs += [("window", K, 0) for K in args.steps] if "window" in args.modes else []
    runs += [("spec", args.spec_steps, D) for D in args.draft] if "spec" in args.modes else []
    for mode, K, D in runs:
        if progress is not None:
            progress(f"{mode} K={K} D={D}: decoding {len(reqs)} requests ...")
        eng = Engine(model, mode, num_blocks=args.num_blocks, block_size=args.block_size,
                     max_num_reqs=args.max_num_reqs, max_blocks_per_req=args.max_blocks_per_req, steps=K, draft=D,
                     eos=args.eos)
        got = eng.run(reqs)
        st = eng.stats
        mt = st.meter
        per = max(st.tokens, 1)
        rows.append({"mode": mode, "K": K, "D": D, "requests": st.requests, "tokens": st.tokens,
                     "identical": got == want, "hf": "-" if hf is None else got == hf,
                     "hit_tokens": st.hit_tokens, "generated_hit_tokens": st.generated_hit_tokens,
                     "prompt_tokens": st.prompt_tokens, "evictions": st.evictions, "preemptions": st.preemptions,
                     "stops_inside": st.stops_inside, "tokens/pass": st.accepted / max(st.passes, 1),
                     "windows": st.windows, "syncs/token": mt["syncs"] / per, "launches/token": mt["launches"] / per,
                     "torch ops/token": mt["torch_ops"] / per, "copies/token": mt["copies"] / per,
                     "host us/token": 1e6 * st.host_seconds / per, "seconds": st.seconds})
        if progress is not None:
            progress(f"{mode} K={K} D={D}: {st.tokens} tokens in {st.seconds:.1f} s")
    base = next((r["host us/token"] for r in rows if r["mode"] == "host"), None)
    for r in rows:
        r["host ratio"] = r["host us/token"] / base if base else float("nan")
    return rows


def hf_reference(args, reqs: list[Request]) -> dict[int, list[int]]:
    """transformers' own greedy ``generate`` on the checkpoint (its model code, its KV cache): first turns
    and the fork in one batch, then the second turns on their first turn's tokens."""
    from hf_oracle import HFOracle

    oracle_model = HFOracle(args.model, getattr(torch, args.dtype), args.device)
    by_rid = {r.rid: r for r in reqs}
    out: dict[int, list[int]] = {}
    for turn in ([r for r in reqs if r.parent is None], [r for r in reqs if r.parent is not None]):
        if turn:
            got = oracle_model.greedy([full_prompt(r, out, by_rid) for r in turn], [r.max_new for r in turn],
                                      [r.first_token for r in turn], eos_token_id=args.eos)
            out.update({r.rid: g for r, g in zip(turn, got)})
    return out


def format_table(rows: list[dict]) -> str:
    cells = [[h for _, h, _, _ in COLUMNS]]
    for r in rows:
        line = []
        for k, _, f, _ in COLUMNS:
            v = r[k]
            line.append(("yes" if v else "NO") if isinstance(v, bool) else f.format(v) if not isinstance(v, str) else v)
        cells.append(line)
    w = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    table = "\n".join("  ".join(c[i].rjust(w[i]) for i in range(len(COLUMNS))) for c in cells)
    legend = "\n".join(f"  {h:>{max(w)}}  {meaning}" for _, h, _, meaning in COLUMNS)
    return table + "\n\ncolumns:\n" + legend


#: Largest sizes the command accepts (the workload and the pool are built in host lists first).
LIMITS = {"requests": 4096, "prompt_len": 65536, "prompt_len_max": 65536, "max_new": 65536, "num_blocks": 1 << 20,
          "block_size": 4096, "max_num_reqs": 4096, "max_blocks_per_req": 1 << 16, "vocab": 1 << 20,
          "hidden": 8192, "layers": 256, "heads": 256, "kv_heads": 256, "spec_steps": 64}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Greedy decoding of a small Llama-style model on gpupool's paged KV, every mode checked token "
                    "for token against the same model on contiguous KV (and, with --model, transformers' generate).",
        epilog="The table's columns are explained under it. Without a GPU the pool's kernels run in Triton's "
               "interpreter: the wall time is not a speed; host us/tok is measured driver time.")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to run (default: all)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8], help="K of the window mode, one row each")
    p.add_argument("--draft", type=int, nargs="+", default=[1, 2, 4], help="D of the spec mode, one row each")
    p.add_argument("--spec-steps", type=int, default=4, help="K of the spec mode's windows")
    p.add_argument("--eos", type=int, default=None, help="a token id that ends a request (default: budgets only)")
    p.add_argument("--requests", type=int, default=8, help="first-turn requests (second turns and the fork come on top)")
    p.add_argument("--prompt-len", type=int, default=21, help="prompt tokens of a first turn")
    p.add_argument("--prompt-len-max", type=int, default=None, help="prompt lengths vary up to this (default: fixed)")
    p.add_argument("--prefix-len", type=int, default=12, help="prompt tokens shared within a group of requests")
    p.add_argument("--max-new", type=int, default=12, help="largest budget of new tokens (budgets vary from half)")
    p.add_argument("--num-blocks", type=int, default=40, help="pool size in blocks (small enough to preempt)")
    p.add_argument("--block-size", type=int, default=4, help="tokens per block")
    p.add_argument("--max-num-reqs", type=int, default=8, help="request slots (the most running at once)")
    p.add_argument("--max-blocks-per-req", type=int, default=24, help="a block table row's length")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary of the random model")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the random model")
    p.add_argument("--layers", type=int, default=2, help="layers of the random model")
    p.add_argument("--heads", type=int, default=4, help="query heads of the random model")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads of the random model")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                   help="weights and KV (float64: exact comparisons)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    p.add_argument("--model", help="a local LlamaForCausalLM or Qwen2ForCausalLM checkpoint directory (needs "
                                   "transformers; nothing is downloaded): its tokens are also compared with "
                                   "transformers' own generate")
    p.add_argument("--seed", type=int, default=0, help="seed of the random model and the workload")
    p.add_argument("--no-fork", action="store_true", help="no copy-on-write fork in the workload")
    p.add_argument("--no-turns", action="store_true", help="no second turns in the workload")
    p.add_argument("--quick", action="store_true",
                   help="a small workload: 4 requests, 6 new tokens, K in {1, 4}, D in {2}, 24 blocks (flags given "
                        "with it win)")
    return p


QUICK = dict(requests=4, max_new=6, steps=[1, 4], draft=[2], num_blocks=24)  # --quick's sizes; flags given win


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Sizes the workload and the model can run with, else ``p.error`` (a usage message, exit 2)."""
    sizes = ["requests", "prompt_len", "max_new", "num_blocks", "block_size", "max_num_reqs", "max_blocks_per_req",
             "spec_steps"]
    if not args.model:
        sizes += ["vocab", "hidden", "layers", "heads", "kv_heads"]
    for name in sizes + ["prompt_len_max"]:
        v = getattr(args, name)
        if v is None:
            continue
        if not 1 <= v <= LIMITS[name]:
            p.error(f"--{name.replace('_', '-')} must be in 1..{LIMITS[name]}, got {v}")
    if not args.model and args.vocab < 2:
        p.error(f"--vocab must be >= 2 (token 0 is kept out of prompts), got {args.vocab}")
    if any(not 1 <= k <= 64 for k in args.steps):
        p.error(f"--steps must all be in 1..64, got {args.steps}")
    if any(not 1 <= d <= 32 for d in args.draft):
        p.error(f"--draft must all be in 1..32, got {args.draft}")
    if not 0 <= args.prefix_len <= args.prompt_len:
        p.error(f"--prefix-len must be in 0..--prompt-len ({args.prompt_len}), got {args.prefix_len}")
    if args.prompt_len_max is not None and args.prompt_len_max < args.prompt_len:
        p.error(f"--prompt-len-max ({args.prompt_len_max}) is below --prompt-len ({args.prompt_len})")
    if not args.model:
        if args.heads % args.kv_heads:
            p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
        if args.hidden % args.heads or (args.hidden // args.heads) % 2:
            p.error(f"--hidden ({args.hidden}) must be --heads ({args.heads}) times an even head size (rotary "
                    "embeddings rotate pairs)")
    elif not os.path.isdir(args.model):
        p.error(f"--model {args.model}: not a directory")
    D = max(args.draft) if "spec" in args.modes else 0
    prompt = args.prompt_len_max or args.prompt_len
    longest = prompt + (0 if args.no_turns else args.max_new + max(1, prompt // 4)) + args.max_new + D
    need = -(-longest // args.block_size)
    if need > args.max_blocks_per_req:
        p.error(f"a request takes up to {need} blocks of {args.block_size} tokens (its prompt, a second turn's, the new "
                f"tokens and the drafts), more than --max-blocks-per-req ({args.max_blocks_per_req})")
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
    started = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    try:
        rows = run_all(args, progress)
    except (PoolError, ValueError, ImportError, OSError) as e:  # a checkpoint the loader refuses, a size the pool refuses
        p.error(str(e).splitlines()[0] if str(e) else type(e).__name__)
    print(format_table(rows))
    return 0 if all(r["identical"] and r["hf"] in (True, "-") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
