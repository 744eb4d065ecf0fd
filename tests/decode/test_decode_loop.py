"""A model decodes on gpupool (examples/decode_loop.py, docs/kv_cache.md section 4): a small Llama's
greedy tokens with its KV paged through the manager equal those of the same model on contiguous KV,
in every mode (host pool, one DecodeStep per step, bursts of K steps with reservations, K steps
pre-booked), with prefix hits, preemption by recompute, requests that run out of blocks mid-burst
and a fork whose last block is copied on real KV. The check can fail: one block given to two
requests, or a copy that does not run, changes the tokens. Counted: a burst's replay reads the
device once."""
from __future__ import annotations

from harness.paths import EXAMPLES, BENCH
import sys

import pytest
import torch

sys.path.insert(0, str(EXAMPLES))
import decode_loop as dl  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

# the loop's kernels (the step, the burst, the views, the KV store) run under --strict-gpu in their own
# tests (test_decode_step, test_decode_burst, test_kv_cache); here they only serve the model
pytestmark = pytest.mark.strict_gpu_off

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64)
POOL = dict(block_size=4, max_num_reqs=4, max_blocks_per_req=8)


@pytest.fixture(scope="module")
def model():
    return Llama.random(CFG, seed=1, dtype=torch.float64)


def workload(n=3, prompt=9, prefix=5, new=5, seed=0):
    return dl.make_workload(n, prompt, prefix, new, CFG.vocab_size, seed)


@pytest.fixture(scope="module")
def small(model):
    reqs = workload()
    return reqs, {r.rid: dl.contiguous_decode(model, r) for r in reqs}


def run(model, reqs, mode, K=1, num_blocks=12, engine=dl.Engine, **kw):
    eng = engine(model, mode, num_blocks=num_blocks, steps=K, **POOL, **kw)
    return eng.run(reqs), eng


@pytest.mark.parametrize("mode,K", [("host", 1), ("burst", 2)])
@pytest.mark.heavy("host-1")
def test_tokens_equal_contiguous_kv(model, small, mode, K):
    """The quick case: prefix hits, a preemption, the fork, and (burst) a request out of blocks mid-burst."""
    reqs, want = small
    got, eng = run(model, reqs, mode, K)
    assert got == want
    st = eng.stats
    assert st.hit_tokens > 0 and st.forks == 1 and st.preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode,K", [("step", 1), ("burst", 1), ("burst", 4), ("burst", 8), ("prebook", 4)])
def test_every_mode_and_burst_length(model, mode, K):
    reqs = workload(n=4, prompt=10, prefix=6, new=9, seed=3)
    want = {r.rid: dl.contiguous_decode(model, r) for r in reqs}
    got, eng = run(model, reqs, mode, K, num_blocks=12)
    assert got == want
    st = eng.stats
    assert st.preemptions > 0 and st.hit_tokens > 0 and st.forks == 1
    assert st.booked_stops == 0  # a request whose reservation covered the burst ran all of it
    if K >= 4:
        assert st.mid_burst_stops > 0  # some request ran out of blocks mid-burst


class SharedBlock(dl.Engine):
    """Gives the second admitted request's last prompt block to the first as well (refs balanced):
    two requests then write one KV block."""

    def _admit(self, seq, slot, by_rid):
        ok = super()._admit(seq, slot, by_rid)
        if ok and slot == 1 and seq.req.fork_of is None:
            a, b = self.m.block_table[0, 0], self.m.block_table[0, 1]
            j = (seq.ctx - 1) // self.bs
            self.m.pool.touch([int(a[j])])
            b[j] = a[j]
        return ok


def test_a_block_given_to_two_requests_changes_the_tokens(model, small):
    reqs, want = small
    reqs = [r for r in reqs if r.fork_of is None]
    got, _ = run(model, reqs, "step", num_blocks=32, engine=SharedBlock)
    assert got != {r: t for r, t in want.items() if r in got}


@pytest.mark.slow
def test_a_copy_that_does_not_run_changes_the_fork(model, small, monkeypatch):
    reqs, want = small
    import gpupool.manager as manager

    monkeypatch.setattr(manager, "copy_blocks", lambda *a, **k: None)
    got, _ = run(model, reqs, "step", num_blocks=32)
    fork = next(r.rid for r in reqs if r.fork_of is not None)
    assert got[fork] != want[fork]
    assert all(got[r] == want[r] for r in got if r != fork)


@pytest.mark.slow
def test_reservations_evict_no_more_than_single_steps(model):
    """Requests arrive as others finish and hit their cached prefixes: booking a burst's blocks
    (reserve) evicts no more cached blocks than single steps; popping them up front (pre-booking,
    what engines do today) is reported beside it. 9 tokens a request: the prefill's, then two bursts
    of 4, so no request ends inside a burst (one that does decodes to the burst's end)."""
    reqs = workload(n=8, prompt=10, prefix=8, new=9, seed=5)
    want = {r.rid: dl.contiguous_decode(model, r) for r in reqs}
    stats = {}
    for mode, K in (("step", 1), ("burst", 4), ("prebook", 4)):
        got, eng = run(model, reqs, mode, K, num_blocks=16, count_evictions=True)
        assert got == want
        stats[mode] = eng.stats
    print({m: (s.evictions, s.hit_tokens) for m, s in stats.items()})
    assert stats["burst"].evictions <= stats["step"].evictions
    assert stats["burst"].hit_tokens >= stats["prebook"].hit_tokens


@pytest.mark.heavy
def test_a_burst_reads_the_device_once_per_replay(model):
    """Decode only (one request, no admission in between): K = 8 tokens per replay, one host read,
    one host-to-device copy (the step's inputs); the host pool reads and uploads once per token."""
    reqs = [dl.Request(0, [3, 1, 4, 1, 5], 17)]
    _, eng = run(model, reqs, "burst", 8, num_blocks=8)
    d = eng.stats.decode_meter
    assert eng.stats.replays == 2  # 17 tokens: the prefill's, 8 with the first replay, 8 with the second
    assert d["syncs"] == eng.stats.replays and d["copies"] <= 2 * eng.stats.replays
    _, eng = run(model, reqs, "host", num_blocks=8)
    assert eng.stats.decode_meter["syncs"] == eng.stats.replays == 16


def test_the_command_prints_the_table(capsys):
    assert dl.main(["--modes", "host", "--requests", "2", "--max-new", "3", "--prompt-len", "6", "--prefix-len", "4",
                    "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--vocab", "32"]) == 0
    out = capsys.readouterr().out
    assert "identical" in out.splitlines()[0] and " yes " in out


# ---- the command's flags --------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--kv-heads", "3"], ["--heads", "0"], ["--hidden", "63"], ["--prefix-len", "30"],
                                   ["--max-blocks-per-req", "1"], ["--num-blocks", "2"], ["--steps", "0"],
                                   ["--requests", "0"], ["--max-new", "0"], ["--block-size", "0"],
                                   ["--device", "meta"], ["--device", "bogus"]])
def test_bad_flags_end_with_a_usage_message(flags, capsys):
    """Each used to end in a traceback (ZeroDivisionError, a shape error, a pool error) or, under
    --quick, to be overridden silently."""
    with pytest.raises(SystemExit) as e:
        dl.main(["--quick", "--modes", "host", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_quick_keeps_the_flags_given():
    p = dl.parser()
    p.set_defaults(**dl.QUICK)
    args = p.parse_args(["--quick", "--requests", "1", "--max-new", "1"])
    assert (args.requests, args.max_new, args.num_blocks) == (1, 1, 24)


def test_a_request_that_never_fits_alone_raises_instead_of_looping(model):
    """Two usable blocks, a request that needs three: it was admitted, preempted before its next token,
    and admitted again, forever."""
    reqs = dl.make_workload(1, 8, 4, 4, CFG.vocab_size, 0, fork=False)
    with pytest.raises(RuntimeError, match="does not fit"):
        run(model, reqs, "host", num_blocks=3)


@pytest.mark.parametrize("flags", [["--iters", "0"], ["--dtype", "int32"], ["--batch", "0"], ["--steps", "0"]])
def test_gpu_bench_bad_flags_end_with_a_usage_message(flags, capsys):
    """--iters 0 ended in ZeroDivisionError after the whole run, --dtype int32 in a pool error."""
    sys.path.insert(0, str(BENCH))
    import decode_loop_gpu as bench
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--no-graph", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
