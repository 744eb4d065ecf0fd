"""A reference and a device manager driven through the same admissions, appended tokens and decode
windows (docs/semantics.md section 9), step by step: each admission's outcome, each pool step's
outputs by lane (admitted, every group's slot mapping, the attention lengths), each window's outcome,
and after every window the whole state (block tables, counters, the requests' hashes and tails, the
prefix-cache statistics, the pool, the KV events).

The workload: prompts that share prefixes with earlier prompts and with the tokens earlier requests
generated (a second turn of a chat hits blocks the first turn generated), requests that hash their own
tokens or not, random stops, random accepted counts (1 .. D + 1), token ids of every pickled size,
pools small enough that lanes are preempted.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from gpupool.keys import hash_request_tokens
from gpupool.reference.window import ReferenceDecodeWindow
from gpupool.window import DecodeWindow
from harness.compare import assert_managers_agree
from harness.twins import manager_twin


@dataclass
class Req:
    slot: int
    tokens: list[int]
    hashing: bool
    resumed: bool = False
    prompt_len: int = 0


@dataclass
class WindowPair:
    """``rng`` drives everything; ``K`` steps, ``D`` lookahead tokens per window."""

    rng: random.Random
    num_blocks: int
    groups: tuple = ("full",)
    block_size: int = 4
    hash_block_size: int | None = None
    K: int = 2
    D: int = 0
    events: bool = False
    max_num_reqs: int = 4
    max_blocks_per_req: int = 12
    parallel: bool = True
    log: list = field(default_factory=list)

    def __post_init__(self):
        cfg = dict(block_size=self.block_size, hash_block_size=self.hash_block_size, max_num_reqs=self.max_num_reqs,
                   max_blocks_per_req=self.max_blocks_per_req, groups=self.groups,
                   enable_kv_cache_events=self.events)
        self.ref, self.dev = manager_twin(self.num_blocks, device="cpu", **cfg)
        self.dev.parallel = self.parallel
        self.hbs = self.hash_block_size or self.block_size
        self.rw = ReferenceDecodeWindow(self.ref, self.max_num_reqs, self.K, self.D)
        self.dw = DecodeWindow(self.dev, self.max_num_reqs, self.K, self.D)
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.history: list[list[int]] = [[self.rng.randrange(70000) for _ in range(12)]]
        self.blocked = False
        self.windows = 0
        self.counts = {"preempted": 0, "stopped": 0, "admitted": 0, "hit_tokens": 0, "generated_hits": 0}
        self.cap = self.max_blocks_per_req * self.block_size

    # ---- workload ------------------------------------------------------------------------------------
    def token(self) -> int:
        return self.rng.choice((self.rng.randrange(256), self.rng.randrange(256, 65536),
                                self.rng.randrange(65536, 2**31), -self.rng.randrange(1, 2**31)))

    def new_request(self) -> Req:
        base = self.rng.choice(self.history)
        keep = self.rng.randint(0, len(base))
        tokens = base[:keep] + [self.token() for _ in range(self.rng.randint(1, 6))]
        tokens = tokens[: self.cap // 2]
        return Req(-1, tokens, self.rng.random() < 0.8, prompt_len=len(tokens))

    def free_slots(self) -> list[int]:
        used = {q.slot for q in self.running}
        return [r for r in range(self.max_num_reqs) if r not in used]

    # ---- admission ---------------------------------------------------------------------------------
    def admit(self) -> None:
        """Waiting requests (and a few new ones) admitted on both managers, then each admitted one's
        prefill: its next token appended."""
        while len(self.waiting) < 3:
            self.waiting.append(self.new_request())
        slots = self.free_slots()
        n = min(len(slots), self.rng.randint(0, 3), len(self.waiting))
        batch = self.waiting[:n]
        if not batch:
            return
        args = []
        for q, s in zip(batch, self.rng.sample(slots, n)):
            q.slot = s
            hs = hash_request_tokens(q.tokens, self.hbs)
            tail = q.tokens[len(hs) * self.hbs:] if q.hashing else None
            args.append((s, hs, len(q.tokens), tail, q.resumed))
        cols = list(zip(*args))
        ra, rh = self.ref.admit(*cols, blocked=self.blocked)
        flag = torch.tensor([int(self.blocked)], dtype=torch.int32)
        da, dh = self.dev.admit(*cols, blocked=flag)
        self.dev.pool.check()
        da, dh = [bool(x) for x in da.tolist()], dh.tolist()
        assert (da, dh) == (ra, rh), f"admit: device {da, dh} != reference {ra, rh}; {self.log[-3:]}"
        self.log.append(("admit", cols, ra, rh))
        got = [q for q, a in zip(batch, ra) if a]
        self.counts["admitted"] += len(got)
        self.counts["hit_tokens"] += sum(rh)
        self.waiting = self.waiting[len(got):]
        for q in batch[len(got):]:
            q.slot = -1
        if got:
            nxt = [self.token() for _ in got]
            self.ref.append_tokens([q.slot for q in got], [[t] for t in nxt])
            self.dev.append_tokens([q.slot for q in got], [1] * len(got), torch.tensor([[t] for t in nxt]))
            for q, t in zip(got, nxt):
                q.tokens.append(t)
            self.running += got

    # ---- a window ------------------------------------------------------------------------------------
    def window(self) -> None:
        lanes = list(self.running)
        self.rng.shuffle(lanes)
        finished = [q for q in lanes if self.rng.random() < 0.15 or len(q.tokens) + self.D > self.cap]
        lanes = [q for q in lanes if q not in finished]
        B = len(lanes)
        slots, ntok, fin = [q.slot for q in lanes], [len(q.tokens) for q in lanes], [q.slot for q in finished]
        self.rw.begin(slots, ntok, fin)
        self.dw.set_inputs(slots, ntok, fin)
        self.dw.begin()
        Q = self.D + 1
        for k in range(self.K):
            if k == 0:
                out = self.rw.step(0)
            else:
                dec = self.advance(lanes, Q)
                out = self.rw.step(k, *dec)
            self.dw.step(k)
            self.compare_step(k, out, B, Q)
        dec = self.advance(lanes, Q)
        self.rw.end(*dec)
        self.dw.end()
        res = self.dw.read()
        self.dev.pool.check()
        want = (self.rw.num_tokens, self.rw.stop_step, self.rw.preempt_step)
        assert (res.num_tokens, res.stop_step, res.preempt_step) == want, (
            f"window outcome: device {res[:3]} != reference {want}; {self.log[-3:]}")
        assert [len(q.tokens) for q in lanes] == res.num_tokens
        self.windows += 1
        self.log.append(("window", slots, ntok, fin, res[:3]))
        self.settle(lanes, finished, res)
        assert_managers_agree(self.ref, self.dev, where=f"window {self.windows}: {self.log[-3:]}")

    def advance(self, lanes, Q):
        """A forward pass's decisions (stops, accepted counts 1 .. Q, tokens), written for the device
        window; the host's tokens of every live lane that did not stop grow by its accepted ones."""
        stopped = [int(self.rng.random() < 0.15) for _ in lanes]
        acc = [self.rng.randint(1, Q) for _ in lanes]
        toks = [[self.token() for _ in range(Q)] for _ in lanes]
        for i, q in enumerate(lanes):  # a lane whose next step would pass its row stops
            if len(q.tokens) + acc[i] + self.D > self.cap:
                stopped[i] = 1
        B = len(lanes)
        if B:
            self.dw.stopped[:B] = torch.tensor(stopped, dtype=torch.int32)
            self.dw.accepted[:B] = torch.tensor(acc, dtype=torch.int32)
            self.dw.tokens[:B] = torch.tensor(toks, dtype=torch.int64)
        for i, q in enumerate(lanes):
            if self.rw.live[i] and not stopped[i]:
                q.tokens = q.tokens + toks[i][:acc[i]]
        return stopped, acc, toks

    def compare_step(self, k, out, B, Q) -> None:
        dev_adm = [bool(x) for x in self.dw.admitted[k].tolist()]
        want_adm = out.admitted + [False] * (self.max_num_reqs - B)
        assert dev_adm == want_adm, f"step {k} admitted: device {dev_adm} != reference {want_adm}; {self.log[-3:]}"
        for g in range(len(self.groups)):
            dev_sm = self.dw.slot_mapping[g, k].tolist()
            want_sm = out.slot_mapping[g] + [-1] * ((self.max_num_reqs - B) * Q)
            assert dev_sm == want_sm, f"step {k} group {g} slots: device {dev_sm} != reference {want_sm}"
        dev_seq = self.dw.seq[k].tolist()
        assert dev_seq == out.seq_lens + [0] * (self.max_num_reqs - B), f"step {k} lengths: {dev_seq} {out.seq_lens}"

    def settle(self, lanes, finished, res) -> None:
        """The host's side after the window's read: tokens, stops, preemptions, the finished requests."""
        self.blocked = res.any_preempted
        still = []
        for i, q in enumerate(lanes):
            if res.stop_step[i] >= 0:
                self.counts["stopped"] += 1
                self.history.append(q.tokens)
            elif res.preempt_step[i] >= 0:
                self.counts["preempted"] += 1
                q.slot, q.resumed = -1, True
                self.waiting.insert(0, q)
            else:
                still.append(q)
        for q in finished:
            self.history.append(q.tokens)
        self.running = still
