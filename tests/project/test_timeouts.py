"""The tests' time limits scale with ``GPUPOOL_TEST_TIMEOUT_SCALE`` (docs/testing.md, "Settings of a
test run"): a busy machine gets more time instead of failures."""
from harness.paths import TESTS
from harness.timeouts import SCALE_ENV, scaled, scaled_ms, timeout_scale
import ast

import pytest

#: calls that take a subprocess's time limit
_LIMITED = {"run", "check_output", "check_call", "call", "communicate", "wait"}


def test_the_scale_multiplies_every_limit(monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert (scaled(600), scaled_ms(5000)) == (600, 5000)
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert (scaled(600), scaled_ms(5000)) == (1500, 12500)
    monkeypatch.setenv(SCALE_ENV, "inf")
    assert (scaled(600), scaled_ms(5000)) == (None, -1)  # no limit: subprocess's None, zmq's -1


@pytest.mark.parametrize("bad", ["0", "-1", "fast", "nan"])
def test_a_bad_scale_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(SCALE_ENV, bad)
    with pytest.raises(ValueError, match=SCALE_ENV):
        timeout_scale()


def test_no_subprocess_limit_is_a_bare_number():
    """Every ``timeout=`` of a subprocess call in the tests goes through ``scaled`` (a network timeout
    of ``urlopen`` is the network's, not the machine's)."""
    bare = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LIMITED:
                for kw in node.keywords:
                    if kw.arg == "timeout" and isinstance(kw.value, ast.Constant):
                        bare.append(f"{path.relative_to(TESTS)}:{node.lineno}: timeout={kw.value.value}")
    assert not bare, "\n".join(bare)
