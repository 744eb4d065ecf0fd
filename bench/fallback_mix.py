"""How often ``allocate_slots`` leaves the request-parallel path, per reason, on three batch mixes.

The device manager's counters (``pool.statistics()``: batches by path, fallbacks by reason, see
``kernels/requests/parallel.py``) are read after driving a scheduler-like loop through the public API,
with ``ReferenceKVCacheManager`` run beside it (the admitted flags of every batch and the final block
tables must agree, else the script exits with status 1). Mixes, one ``allocate_slots`` batch per step:

* ``decode``: B running requests decode one token each (a filled block's hash is appended first);
  a finished request is replaced by a new one with its own prompt, prefilled in a batch of its own
  before the step (not counted: only the decode batches are).
* ``chunked``: as ``decode``, plus every step some requests are in chunked prefill (a new request's
  first chunk looks up its prefix; later chunks continue), in the same batch as the decoders.
* ``shared``: as ``chunked``, and new requests' prompts start with one of four system prompts (their
  blocks shared and cached): lookups hit, zero-ref hits are touched, duplicates meet in one batch.

Run (kernels on Triton's interpreter without a GPU)::

    TRITON_INTERPRET=1 python bench/fallback_mix.py [--batch 32] [--steps 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

from gpupool.kernels.layout import Fallback  # noqa: E402
from gpupool.manager import KVCacheManager  # noqa: E402
from gpupool.reference import ReferenceKVCacheManager  # noqa: E402

BS = 16
MIXES = ("decode", "chunked", "shared")


def digest(x: str) -> bytes:
    return hashlib.sha256(x.encode()).digest()


class Driver:
    """One scheduler loop over both managers (device and reference), steps of one batch each."""

    def __init__(self, mix: str, batch: int, seed: int):
        self.mix, self.B, self.rng = mix, batch, random.Random(seed)
        kw = dict(block_size=BS, max_num_reqs=batch, max_blocks_per_req=64, enable_kv_cache_events=True)
        blocks = batch * 48
        self.dev = KVCacheManager(blocks, **kw)
        self.ref = ReferenceKVCacheManager(blocks, **kw)
        self.chain: dict[int, list[bytes]] = {}  # slot -> hashes of its prompt + output blocks
        self.known: dict[int, int] = {}  # tokens the request knows
        self.done: dict[int, int] = {}  # tokens with slots
        self.nh: dict[int, int] = {}  # hashes handed over
        self.counts = {"parallel": 0, "fallback": 0, "reasons": [0] * len(Fallback)}
        self.next_id = 0

    def both(self, fn):
        return fn(self.ref), fn(self.dev)

    def new_request(self, r: int) -> None:
        self.next_id += 1
        n = self.rng.randint(12, 40) * BS + self.rng.randint(0, BS - 1)
        prefix = []
        if self.mix == "shared":
            sys_prompt = self.rng.randrange(4)
            prefix = [digest(f"sys{sys_prompt}:{i}") for i in range(8 + 4 * sys_prompt)]
        own = [digest(f"r{self.next_id}:{i}") for i in range(64)]
        self.chain[r] = (prefix + own)[:64]
        self.known[r], self.done[r], self.nh[r] = n, 0, n // BS
        hs = self.chain[r][: n // BS]
        self.both(lambda m: m.add_request(r, hs))

    def entry(self, r: int) -> tuple[int, int, bool]:
        """(num_tokens, target, lookup) of slot r this step."""
        if self.done[r] < self.known[r]:  # prefill (chunked outside the decode mix)
            chunk = self.known[r] if self.mix == "decode" else self.rng.choice([64, 128, 256])
            return self.known[r], min(self.known[r], self.done[r] + chunk), self.done[r] == 0
        self.known[r] += 1  # decode one token
        have = min(self.known[r] // BS, 64)
        if have > self.nh[r]:
            hs = self.chain[r][self.nh[r]:have]
            self.both(lambda m: m.append_block_hashes(r, hs))
            self.nh[r] = have
        return self.known[r], self.known[r], False

    def batch(self, slots) -> list[bool]:
        entries = [self.entry(r) for r in slots]
        nts, tgs, lks = ([e[i] for e in entries] for i in range(3))
        ref_adm = self.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=False)
        dev_adm = self.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=False).tolist()
        self.dev.pool.check()
        if [bool(x) for x in ref_adm] != [bool(x) for x in dev_adm]:
            sys.exit(f"{self.mix}: admitted flags differ: device {dev_adm} reference {ref_adm}")
        for r, ok, tg in zip(slots, ref_adm, tgs):
            if ok:
                self.done[r] = tg
        return [bool(x) for x in ref_adm]

    def step(self) -> None:
        joined = [r for r in range(self.B) if r not in self.chain]
        for r in joined:  # finished or preempted requests left; new ones join
            self.new_request(r)
        if self.mix == "decode" and joined:
            self.batch(joined)
        slots = [r for r in self.chain if self.mix != "decode" or self.done[r] >= self.known[r]]
        self.rng.shuffle(slots)
        before = self.dev.pool.statistics()
        adm = self.batch(slots)
        after = self.dev.pool.statistics()
        for k in ("parallel", "fallback"):
            self.counts[k] += after[f"alloc_{k}"] - before[f"alloc_{k}"]
        for i in range(len(Fallback)):
            self.counts["reasons"][i] += after["fallback_reasons"][i] - before["fallback_reasons"][i]
        leave = [r for r in self.chain if self.done[r] < self.known[r] and self.mix == "decode"]
        for r, ok in zip(slots, adm):
            if not ok or (self.done[r] >= self.known[r] and self.rng.random() < 1 / 32) or self.known[r] >= 64 * BS - 1:
                leave.append(r)
        self.both(lambda m: m.free(leave))
        for r in leave:
            del self.chain[r], self.known[r], self.done[r], self.nh[r]

    def check(self) -> None:
        if self.dev.rows(0) != self.ref.block_table(0):
            sys.exit(f"{self.mix}: block tables differ")
        self.dev.pool.validate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="running requests (default 32)")
    ap.add_argument("--steps", type=int, default=40, help="batches per mix (default 40)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the counts to this file")
    args = ap.parse_args(argv)
    rows = {}
    print(f"| mix | batches | parallel | fallback | {' | '.join(f.name.lower() for f in Fallback)} |")
    print("|---|---:|---:|---:|" + "---:|" * len(Fallback))
    for mix in MIXES:
        d = Driver(mix, args.batch, args.seed)
        for _ in range(args.steps):
            d.step()
        d.check()
        c = d.counts
        reasons = c["reasons"]
        rows[mix] = dict(batches=c["parallel"] + c["fallback"], parallel=c["parallel"], fallback=c["fallback"],
                         reasons=dict(zip((f.name.lower() for f in Fallback), reasons)))
        r = rows[mix]
        print(f"| {mix} | {r['batches']} | {r['parallel']} | {r['fallback']} | " + " | ".join(map(str, reasons)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=args.batch, steps=args.steps, seed=args.seed, mixes=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
