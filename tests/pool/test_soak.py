"""Long-run soak of the device pool against the reference pool (docs/semantics.md sections 1-3).

A seeded random run of thousands of ops, valid and invalid mixed (every fault kind of
``tests/pool/test_pool_errors.py``, single and batched, with the sticky status word), on small device pools
built to reach the rare paths:

* ``ring_capacity`` = the smallest power of two >= ``num_blocks``: touch / free cycles fill the ring
  with tombstones and force compactions (``pool.state.ctrl[Ctrl.COMPACTIONS]`` counts them, checked > 0);
* ``num_chunks=1``: a key table of 16 slots with ``(num_blocks - 1) * max_keys_per_block == 16``, so
  the table runs (and is checked to run) completely full, with long probe paths and overflow counts.

After every op both pools must agree on the observable state, the events and the watcher firings,
every fault must leave both full-state digests unchanged; every ``CHECK_EVERY`` ops (and at the end)
``validate()`` runs on both and every hash used is looked up on both.

Default size: about a minute on two CPU cores in Triton's interpreter. ``GPUPOOL_SOAK_OPS=<n>`` sets
the ops per configuration for a longer run (e.g. ``GPUPOOL_SOAK_OPS=50000``), ``GPUPOOL_SOAK_SEED=<s>``
shifts the seeds.
"""
from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from harness.sizes import pow2_at_least
from harness.fault_pair import (
    CTRL_COMPACTIONS, FaultPair, RandChooser, step, total_keys, UNIVERSE, VALID,
)

DEFAULT_OPS = 800  # per configuration; the two configurations take about 50 s on two cores
SOAK_OPS = int(os.environ.get("GPUPOOL_SOAK_OPS") or DEFAULT_OPS)
SEED = int(os.environ.get("GPUPOOL_SOAK_SEED") or 0)
CHECK_EVERY = 25
FAULT_PCT = 30


def fill_keys(p: FaultPair, c) -> None:
    """Crowd the key table: add a secondary key to a keyed block with room (num_tokens <= its primary's,
    so no promotion), or key a held block. Soak only; goes through ``FaultPair.run`` like every valid op."""
    room = [b for b in p.keyed() if len(p.ref.keys[b]) < p.mk]
    if room and c.chance(80):
        b = c.pick(room)
        hh = c.pick(UNIVERSE)
        g = c.pick([0, 1])
        p.used.add(hh)
        p.run(f"fill secondary({b}, g={g})", lambda pool: pool.cache_partial_block(b, [hh], 4, g, 16, 4))
        return
    held = [b for b in p.held() if not p.ref.keys[b]]
    if held:
        ids = c.shuffled(held)[: c.int(1, 4)]
        hs = [c.pick(UNIVERSE) for _ in ids]
        p.used.update(hs)
        p.run(f"fill cache_full_blocks({ids})", lambda pool: pool.cache_full_blocks(ids, hs, 0, len(ids), 16))
    else:
        VALID[0](p, c)  # get_new_blocks


def churn(p: FaultPair, c) -> None:
    """Touch a block in the middle of the free queue and free it again: a tombstone plus an append or
    prepend, the pattern that fills a small ring and forces compaction."""
    q = p.ref.free_queue()
    if not q:
        return VALID[2](p, c)  # free_blocks
    pick = c.shuffled(q)[: c.int(1, 2)]
    p.run(f"churn touch({pick})", lambda pool: pool.touch(pick))
    order = c.shuffled(pick)
    p.run(f"churn free({order})", lambda pool: pool.free_blocks(order))


def soak(n, mk, *, events, caching=True, seed, ops, chunks=1):
    rng = random.Random(seed)
    c = RandChooser(rng)
    p = FaultPair(n, caching=caching, events=events, mk=mk, ring=pow2_at_least(n), chunks=chunks,
             log=lambda desc: None)  # FaultPair.history keeps the recent ops for failure messages
    p.auto_full = False  # validate() and lookups every CHECK_EVERY ops, the cheap comparison after each
    peak_keys = 0
    for i in range(ops):
        r = rng.random()
        if r < 0.2:
            fill_keys(p, c)
        elif r < 0.32:
            churn(p, c)
        else:
            step(p, c, FAULT_PCT)
        peak_keys = max(peak_keys, total_keys(p.ref))
        if len(p.history) > 200:
            del p.history[:-50]
        if i % CHECK_EVERY == CHECK_EVERY - 1:
            p.compare(full=True)
    p.compare(full=True)
    return p, peak_keys


CONFIGS = [
    # (id, num_blocks, max_keys_per_block, events): (num_blocks - 1) * mk == 16 == one table chunk
    ("n9-mk2-events", 9, 2, True),
    ("n5-mk4", 5, 4, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,n,mk,events", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_soak_against_reference(name, n, mk, events):
    p, peak = soak(n, mk, events=events, seed=SEED * 1000 + n, ops=SOAK_OPS)
    stats = p.stats
    ops_done = sum(stats.values())
    faults = Counter({k: v for k, v in stats.items() if k.startswith("fault")})
    compactions = int(p.dev.state.ctrl[CTRL_COMPACTIONS])
    print(f"\n{name}: {ops_done} ops compared, {sum(faults.values())} faults ({len(faults)} op/error labels), "
          f"compactions {compactions}, peak keys {peak}/16")
    if SOAK_OPS >= DEFAULT_OPS:  # the coverage goals of the default (and longer) runs
        assert compactions > 0, "the soak never compacted the ring"
        assert (n - 1) * mk == 16 and peak >= 15, f"the key table never ran (nearly) full: peak {peak}/16 keys"
        seen = {k.split(":")[0].removeprefix("fault ").split("(")[0] for k in faults}
        assert len(seen) >= 12, f"too few fault kinds exercised: {sorted(seen)}"
        assert any("+followups" in k for k in faults), "no valid batched op was launched after a failing one"
