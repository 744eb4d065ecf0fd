"""A model decodes on gpupool (examples/decode_loop.py, docs/kv_cache.md section 4): a small Llama's
greedy tokens with its KV paged through the pool equal those of the same model on contiguous KV in every
mode (the host pool a step at a time; decode windows of K steps; speculative decoding with D drafts),
with prefix hits, second turns that hit blocks a first turn generated, stops inside windows, preemption
by recompute and a fork whose last block is copied on real KV. The check can fail: one block given to
two requests, a stop the pool ignores, or an advance off by one changes the tokens. Counted: a window
reads the device once; over a longer workload the window modes read less per token than the host pool."""
from __future__ import annotations

import sys

import pytest
import torch

from harness.paths import BENCH, EXAMPLES

sys.path.insert(0, str(EXAMPLES))
import decode_loop as dl  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

# the loop's kernels run under --strict-gpu in their own tests (test_window, test_kv_cache); here they serve
# the model
pytestmark = pytest.mark.strict_gpu_off

CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64)
POOL = dict(block_size=4, max_num_reqs=4, max_blocks_per_req=12)


@pytest.fixture(scope="module")
def model():
    return Llama.random(CFG, seed=1, dtype=torch.float64)


def workload(n=3, prompt=9, prefix=5, new=6, seed=0, **kw):
    return dl.make_workload(n, prompt, prefix, new, CFG.vocab_size, seed, **kw)


@pytest.fixture(scope="module")
def small(model):
    reqs = workload()
    return reqs, dl.oracle(model, reqs, None)


def run(model, reqs, mode, K=1, D=0, num_blocks=14, engine=dl.Engine, **kw):
    eng = engine(model, mode, num_blocks=num_blocks, steps=K, draft=D, **{**POOL, **kw})
    return eng.run(reqs), eng


@pytest.mark.heavy("window-4-0-10")  # window modes' tokens: test_every_mode; a window's reads: below
@pytest.mark.parametrize("mode,K,D,num_blocks", [("host", 1, 0, 10), ("window", 4, 0, 10),
                                                 pytest.param("spec", 2, 2, 12, marks=pytest.mark.slow)])
def test_tokens_equal_contiguous_kv(model, small, mode, K, D, num_blocks):
    """The quick case: prefix hits, second turns, the fork, a preemption (host), stops inside windows."""
    reqs, want = small
    got, eng = run(model, reqs, mode, K, D, num_blocks=num_blocks)
    assert got == want
    st = eng.stats
    assert st.hit_tokens > 0 and st.forks == 1
    assert st.generated_hit_tokens > 0  # a second turn hit blocks its first turn generated
    assert st.preemptions > 0 or mode != "host"  # the windows' preemptions: test_every_mode, test_window
    assert st.stops_inside > 0 or mode == "host"


@pytest.mark.slow
@pytest.mark.parametrize("mode,K,D", [("window", 1, 0), ("window", 2, 0), ("window", 8, 0), ("spec", 4, 1),
                                      ("spec", 4, 2), ("spec", 4, 4)])
def test_every_mode(model, mode, K, D):
    reqs = workload(n=4, prompt=10, prefix=6, new=9, seed=3)
    want = dl.oracle(model, reqs, None)
    got, eng = run(model, reqs, mode, K, D, num_blocks=14)
    assert got == want
    st = eng.stats
    assert st.preemptions > 0 and st.hit_tokens > 0
    # a fork joins its parent while the parent runs, and a second turn hits its first turn's generated
    # blocks if they outlive the windows between: a window that can take a request's 8 tokens past the
    # prefill's (K * (D + 1) >= 8) may end the parent before the fork's turn, and on this 14-block pool
    # evicts the generated blocks first (tokens stay equal: the check above)
    if K * (D + 1) < 8:
        assert st.forks == 1 and st.generated_hit_tokens > 0
    else:
        assert st.forks <= 1


@pytest.mark.slow
def test_spec_accepts_drafts_and_stops_at_eos(model):
    """A repetitive model accepts prompt-lookup drafts (more than one token per pass), and an end of
    sequence inside the accepted drafts ends the request there."""
    reqs = workload(n=3, prompt=9, prefix=5, new=12, seed=1, turns=0, fork=False)
    plain = dl.oracle(model, reqs, None)
    eos = plain[reqs[0].rid][5]  # a token the model does produce
    want = dl.oracle(model, reqs, eos)
    got, eng = run(model, reqs, "spec", 4, 3, num_blocks=40, eos=eos)
    assert got == want
    assert eng.stats.accepted > eng.stats.passes  # some drafts were accepted
    assert any(len(v) < r.max_new for r, v in zip(reqs, want.values()))


@pytest.mark.slow
def test_a_window_evicts_no_more_than_single_steps(model):
    """With stops inside the window, K steps a window evict no more cached blocks than single steps
    (the host pool, K = 1) on a workload whose requests end at every step of a window."""
    reqs = workload(n=8, prompt=10, prefix=8, new=9, seed=5)
    want = dl.oracle(model, reqs, None)
    stats = {}
    for mode, K in (("host", 1), ("window", 1), ("window", 4), ("window", 8)):
        got, eng = run(model, reqs, mode, K, num_blocks=20)
        assert got == want
        stats[(mode, K)] = eng.stats
    base = stats[("host", 1)]
    for key, st in stats.items():
        assert st.evictions <= base.evictions, (key, st.evictions, base.evictions)
        assert st.hit_tokens >= base.hit_tokens, (key, st.hit_tokens, base.hit_tokens)


# ---- the checks can fail ----------------------------------------------------------------------------------
class SharedBlock(dl.Engine):
    """Gives the second admitted request's last prompt block to the first as well (refs balanced):
    two requests then write one KV block."""

    def _start(self, seq, slot, hit):
        super()._start(seq, slot, hit)
        if slot == 1 and seq.req.fork_of is None:
            a, b = self.m.block_table[0, 0], self.m.block_table[0, 1]
            j = (len(seq.tokens) - 1) // self.bs
            self.m.pool.touch([int(a[j])])
            b[j] = a[j]


def test_a_block_given_to_two_requests_changes_the_tokens(model, small):
    reqs, want = small
    reqs = [r for r in reqs if r.fork_of is None and r.parent is None]
    got, _ = run(model, reqs, "window", 2, num_blocks=40, engine=SharedBlock)
    assert got != {r: t for r, t in want.items() if r in got}


class IgnoredStop(dl.Engine):
    """The model's stops never reach the pool: stopped lanes keep decoding inside the window."""

    def _decode_pass(self, *a, **k):
        g, acc, stop = super()._decode_pass(*a, **k)
        return g, acc, torch.zeros_like(stop)


class AdvanceOffByOne(dl.Engine):
    """The pool is told a lane gained one token more than it did (spec)."""

    def _decode_pass(self, *a, **k):
        g, acc, stop = super()._decode_pass(*a, **k)
        return g, torch.clamp(acc + 1, max=self.Q), stop


@pytest.mark.parametrize("engine,mode,K,D", [(IgnoredStop, "window", 4, 0), (AdvanceOffByOne, "spec", 2, 2)],
                         ids=["stop ignored", "advance off by one"])
def test_a_wrong_decision_changes_the_tokens_or_fails(model, small, engine, mode, K, D):
    reqs, want = small
    try:
        got, _ = run(model, reqs, mode, K, D, num_blocks=40, engine=engine)
    except Exception:  # noqa: BLE001 - a count past the row, or a budget overrun, shows the fault
        return
    assert got != want


@pytest.mark.slow
def test_a_copy_that_does_not_run_changes_the_fork(model, small, monkeypatch):
    reqs, want = small
    import gpupool.manager as manager

    monkeypatch.setattr(manager, "copy_blocks", lambda *a, **k: None)
    got, _ = run(model, reqs, "window", 2, num_blocks=40)
    fork = next(r.rid for r in reqs if r.fork_of is not None)
    assert got[fork] != want[fork]


# ---- reads ------------------------------------------------------------------------------------------
def test_a_window_reads_the_device_once(model):
    """Decode only (one request, no admission in between): K = 8 tokens a window, one host read and one
    host-to-device copy (the window's inputs) each; the host pool reads once per token."""
    reqs = [dl.Request(0, [3, 1, 4, 1, 5], 17)]
    _, eng = run(model, reqs, "window", 8, num_blocks=8)
    assert eng.stats.windows == 3  # admission's, then 16 tokens in two windows past the prefill's
    m = eng.stats.meter
    assert m["syncs"] == eng.stats.windows  # the events are drained after the run
    _, eng = run(model, reqs, "host", num_blocks=8)
    assert eng.stats.meter["syncs"] >= 16


@pytest.mark.slow
def test_window_modes_read_less_per_token_than_the_host_pool(model):
    """20 requests, prompts of 35 to 200 tokens sharing prefixes, 48 new tokens each, a pool that
    preempts: over the whole run (admissions, prefills, the fork, second turns included) the window
    mode syncs less per generated token than the host pool (K = 4; a longer window reads less)."""
    reqs = dl.make_workload(20, 35, 24, 48, CFG.vocab_size, 7, prompt_len_max=200)
    want = dl.oracle(model, reqs, None)
    pool = dict(block_size=16, max_num_reqs=12, max_blocks_per_req=24, num_blocks=100)
    got, host = run(model, reqs, "host", **pool)
    assert got == want
    for K in (4,):
        got, eng = run(model, reqs, "window", K, **pool)
        assert got == want
        per_tok = eng.stats.meter["syncs"] / eng.stats.tokens
        assert per_tok < host.stats.meter["syncs"] / host.stats.tokens
        assert eng.stats.preemptions > 0


# ---- the command ------------------------------------------------------------------------------------
def test_the_command_prints_the_table_and_its_legend(capsys):
    assert dl.main(["--modes", "host", "--requests", "2", "--max-new", "3", "--prompt-len", "6", "--prefix-len", "4",
                    "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--vocab", "32",
                    "--no-fork"]) == 0
    out = capsys.readouterr()
    assert "same" in out.out.splitlines()[0] and " yes " in out.out
    assert "columns:" in out.out and "syncs/tok" in out.out.split("columns:")[1]
    assert "host K=1" in out.err  # progress on stderr


@pytest.mark.parametrize("flags", [["--kv-heads", "3"], ["--heads", "0"], ["--hidden", "63"], ["--prefix-len", "30"],
                                   ["--max-blocks-per-req", "1"], ["--num-blocks", "2"], ["--steps", "0"],
                                   ["--requests", "0"], ["--max-new", "0"], ["--block-size", "0"],
                                   ["--device", "meta"], ["--device", "bogus"], ["--vocab", "1"],
                                   ["--vocab", "100000000000"], ["--max-num-reqs", "100000000000"],
                                   ["--requests", "1000000000000"], ["--num-blocks", "2000000000"],
                                   ["--model", "/nonexistent"], ["--draft", "0"]])
def test_bad_flags_end_with_a_usage_message(flags, capsys):
    """Each used to end in a traceback, an allocation of the machine's memory or, under --quick, to be
    overridden silently."""
    with pytest.raises(SystemExit) as e:
        dl.main(["--quick", "--modes", "host", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_quick_keeps_the_flags_given():
    p = dl.parser()
    p.set_defaults(**dl.QUICK)
    args = p.parse_args(["--quick", "--requests", "1", "--max-new", "1"])
    assert (args.requests, args.max_new, args.num_blocks) == (1, 1, 24)


def test_every_flag_has_help():
    assert all(a.help for a in dl.parser()._actions)


def test_a_request_that_never_fits_alone_raises_instead_of_looping(model):
    reqs = dl.make_workload(1, 8, 4, 4, CFG.vocab_size, 0, fork=False, turns=0)
    with pytest.raises(RuntimeError, match="does not fit"):
        run(model, reqs, "window", 2, num_blocks=3)


@pytest.mark.parametrize("flags", [["--iters", "0"], ["--dtype", "int32"], ["--batch", "0"], ["--steps", "0"]])
def test_gpu_bench_bad_flags_end_with_a_usage_message(flags, capsys):
    sys.path.insert(0, str(BENCH))
    import decode_loop_gpu as bench
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--no-graph", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("mode,K", [("host", 1), pytest.param("window", 2, marks=pytest.mark.slow)])
def test_an_exactly_full_pool_makes_progress(model, mode, K):
    """Six requests at a block boundary fill the pool exactly and each needs a block for its next
    token: following vLLM (the last running request preempted so the earlier ones advance, nobody
    admitted after a step that preempted) every request finishes; preempting every request a step
    refused (the rule this replaced) re-admitted the same six forever."""
    prompts = [[i + 1, 2, 3, 4, 5, 6, 7] for i in range(6)]  # 7 tokens + the prefill's: 2 full blocks each
    reqs = [dl.Request(i, p, 3) for i, p in enumerate(prompts)]
    want = dl.oracle(model, reqs, None)
    got, eng = run(model, reqs, mode, K, num_blocks=13, max_num_reqs=6)  # 12 usable blocks: exactly full
    assert got == want
    assert eng.stats.preemptions > 0


@pytest.mark.slow  # a subprocess running the example (~10 s)
def test_the_example_picks_the_interpreter_itself_without_cuda():
    """Run as a newcomer runs it: no TRITON_INTERPRET in the environment (the tests set it), no CUDA.
    Importing a kernel module before a device module once left Triton without a driver."""
    import os
    import subprocess

    from harness.paths import SRC
    from harness.timeouts import scaled

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    r = subprocess.run([sys.executable, str(EXAMPLES / "decode_loop.py"), "--modes", "window", "--steps", "2",
                        "--requests", "1", "--max-new", "2", "--prompt-len", "5", "--prefix-len", "0", "--no-fork",
                        "--no-turns", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1",
                        "--vocab", "32"], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stderr[-2000:]
    assert " yes " in r.stdout
