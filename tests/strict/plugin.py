"""pytest plugin of the strict GPU mode: ``pytest --strict-gpu[=detect|perturb|stale|lag]`` (or
``GPUPOOL_STRICT_GPU=MODE``), registered by tests/conftest.py.

Each test's setup and call run under a :class:`strict.checker.Checker` in the chosen mode, except
tests marked ``slow`` (they run plain, so CI runs one pass: the quick tests strict, the slow ones
not) and tests marked ``strict_gpu_off`` (the checker's self-tests, which run their own). Under
``detect`` a test whose launches show a hazard that no ``# strict: benign, <reason>`` marker covers
fails with the hazards listed. Under ``perturb``, ``stale`` and ``lag`` the execution changes and the
test's own assertions decide; hazards are only summarised. ``GPUPOOL_STRICT_OUT=PATH``
writes every hazard seen (marked ones too) to PATH as a markdown table.
"""
from __future__ import annotations

import os

import pytest

from .checker import Checker


class StrictGPUFailure(AssertionError):
    """A test's kernels showed an unmarked hazard under ``--strict-gpu=detect``."""


class StrictPlugin:
    def __init__(self, mode: str):
        self.mode = mode
        self.stats: dict = {}
        self.seen: dict = {}  # (kind, kernel, a, b) -> [Hazard, tests]
        self.strict_tests = 0

    def _run(self, item):
        if item.get_closest_marker("slow") is not None or item.get_closest_marker("strict_gpu_off") is not None:
            res = yield
            return res
        self.strict_tests += 1
        c = Checker(self.mode)
        with c:
            res = yield
        self._collect(item, c)
        bad = c.unmarked()
        if self.mode == "detect" and bad:
            raise StrictGPUFailure(
                f"strict-gpu (detect): {len(bad)} unmarked hazard(s) in this test's launches; fix them "
                f"(a barrier, atomics, disjoint addresses) or mark an accepted one with "
                f"`# strict: benign, <reason>` on either side's line:\n" + c.report(bad))
        return res

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._run(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._run(item))

    def _collect(self, item, c):
        for k, v in c.stats.items():
            self.stats[k] = self.stats.get(k, 0) + v
        for h in c.hazards():
            key = (h.kind, h.kernel, h.a, h.b)
            e = self.seen.get(key)
            if e is None:
                self.seen[key] = [h, [item.nodeid]]
            else:
                e[0].count += h.count
                if len(e[1]) < 3 and item.nodeid not in e[1]:
                    e[1].append(item.nodeid)

    def pytest_terminal_summary(self, terminalreporter, config):
        tr = terminalreporter
        if not self.strict_tests and getattr(config.option, "numprocesses", None):
            tr.write_sep("-", f"strict-gpu ({self.mode})")
            tr.write_line("checked in the pytest-xdist workers: an unmarked hazard fails its test above; "
                          "run without -n for the hazard summary")
            return
        marked = sum(1 for h, _ in self.seen.values() if h.benign)
        tr.write_sep("-", f"strict-gpu ({self.mode})")
        tr.write_line(f"{self.strict_tests} test phases checked; " +
                      ", ".join(f"{k} {v}" for k, v in self.stats.items()))
        tr.write_line(f"distinct hazards: {len(self.seen)} ({marked} marked benign, "
                      f"{len(self.seen) - marked} unmarked)")
        for h, tests in self.seen.values():
            if not h.benign:
                tr.write_line("  " + h.describe() + f"  [{tests[0]}]")
        out = os.environ.get("GPUPOOL_STRICT_OUT")
        if out:
            with open(out, "w") as f:
                f.write(f"| kind | kernel | A | B | count | benign | sample | first test |\n|---|---|---|---|---:|---|---|---|\n")
                for h, tests in sorted(self.seen.values(), key=lambda e: (e[0].kind, e[0].a[-1:], e[0].b[-1:])):
                    sa = ":".join(map(str, h.a[-1][:2])) if h.a else "?"
                    sb = ":".join(map(str, h.b[-1][:2])) if h.b else "?"
                    f.write(f"| {h.kind} | {h.kernel} | {h.a_cls} {sa} | {h.b_cls} {sb} | {h.count} | "
                            f"{h.benign} | {', '.join(h.samples)} | {tests[0]} |\n")
