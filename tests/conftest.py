"""Test setup: Triton's interpreter without a GPU, and the hypothesis profiles.

Profiles (``GPUPOOL_HYPOTHESIS_PROFILE``): ``dev`` (the default: few examples per property, so
``pytest -m "not slow" tests`` stays under 3 minutes on 2 cores), ``ci`` (what ``.ci/run`` uses with
every test, slow ones included), ``deep`` (1,000 examples, a long hunt). Tests that scale their own
example counts read ``settings().max_examples``. Long runs are marked ``slow``; the heaviest of the
quick-looking ones ``heavy``, which this file turns into ``slow``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before gpupool defines its kernels
    from harness.interpreter import install  # Triton's interpreter, its language patched once per launch

    install()

from hypothesis import settings  # noqa: E402

settings.register_profile("dev", max_examples=3, deadline=None)
# ci: derandomized, so a CI run's examples are the same each time (a failure reproduces); 25
# examples, 8x dev, so the whole suite fits .ci/run's 25 minutes on 2 cores; deep hunts at random
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("fast", settings.get_profile("ci"))  # the old name of "ci"
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("GPUPOOL_HYPOTHESIS_PROFILE", "dev"))

# The heaviest of the quick tests (2 to 37 s each on 2 cores) carry ``@pytest.mark.heavy`` (every
# parametrization) or ``@pytest.mark.heavy("id", ...)`` (the parametrizations with those ids, as pytest
# shows them in brackets): they run with the slow ones, which .ci/run runs too. Each keeps a lighter
# sibling in the quick run (another parameter of the same test, or a test of the same code path), so
# `pytest -m "not slow"` stays under 3 minutes on 2 cores.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    named: dict[str, tuple[set, set]] = {}  # test -> (ids its heavy marks name, ids collected)
    for item in items:
        mark = item.get_closest_marker("heavy")
        if mark is None:
            continue
        param = item.callspec.id if hasattr(item, "callspec") else None
        if not mark.args or param in mark.args:
            item.add_marker(pytest.mark.slow)
        if mark.args:
            named.setdefault(item.nodeid.split("[")[0], (set(mark.args), set()))[1].add(param)
    if not any("::" in str(a) for a in config.args):  # every parametrization collected: a stale id is an error
        stale = {test: sorted(ids - seen) for test, (ids, seen) in named.items() if ids - seen}
        if stale:
            raise pytest.UsageError(f"@pytest.mark.heavy names parametrizations that do not exist: {stale}")


# ---- strict GPU mode (tests/strict/) --------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--strict-gpu", nargs="?", const="detect", default=os.environ.get("GPUPOOL_STRICT_GPU") or None,
        metavar="MODE",
        help="run each non-slow test's kernels under the strict GPU checker (tests/strict/checker.py): "
             "detect (default: flag races the interpreter hides), perturb (another legal schedule), "
             "stale / lag (a load racing a store reads the value from before / after it). Also "
             "GPUPOOL_STRICT_GPU=MODE. Bare, it takes "
             "the next word as its mode: write --strict-gpu=MODE or put it last.")


def pytest_configure(config):
    config.addinivalue_line("markers", "strict_gpu_off: not run under --strict-gpu's checker (tests that run their own, "
                                       "or whose kernels other tests check under it)")
    mode = config.getoption("--strict-gpu")
    if mode:
        from strict.checker import MODES
        from strict.plugin import StrictPlugin

        if mode not in MODES:
            raise pytest.UsageError(f"--strict-gpu: mode must be one of {MODES}, not {mode!r} "
                                    f"(write --strict-gpu=MODE, or put a bare --strict-gpu last)")

        config.pluginmanager.register(StrictPlugin(mode), "strict-gpu")
        if mode != "detect":  # a changed execution fails where it fails: shrinking would rerun it for minutes
            from hypothesis import Phase

            settings.register_profile("strict-gpu", settings(), phases=[Phase.explicit, Phase.reuse, Phase.generate])
            settings.load_profile("strict-gpu")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Why tests were skipped, one line per reason, in the normal output (pytest shows reasons only
    with ``-rs``): a skipped claim (vLLM's tests without their packages, say) must not pass in silence."""
    if set(config.option.reportchars or "") & {"s", "a", "A"}:
        return  # pytest lists every skip itself
    merged: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        merged[reason] = merged.get(reason, 0) + 1
    if merged:
        terminalreporter.section("skip reasons (pytest -rs lists each test)", sep="-")
        for reason, n in sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])):
            terminalreporter.write_line(f"{n:>4}  {reason}")
