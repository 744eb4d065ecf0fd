"""Every code block of README.md works as written: each ``python`` block runs in a fresh namespace
(on the GPU when there is one, else in the interpreter), and each ``bash`` block parses, and the
commands it names exist (``gpupool`` arguments parse, pytest markers and paths exist, the pip extra
exists). Nothing is installed."""
from __future__ import annotations

from harness.paths import ROOT
from harness.timeouts import scaled
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text(encoding="utf-8")) if kind == lang]


def test_readme_has_blocks():
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 2
    assert {kind for kind, _ in FENCE.findall(README.read_text(encoding="utf-8"))} <= {"python", "bash"}


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_python_block_runs(i, capsys):
    code = blocks("python")[i]
    exec(compile(code, f"README.md python block {i + 1}", "exec"), {"__name__": "__readme__"})


def _commands(block: str) -> list[list[str]]:
    """The simple commands of a block (split at &&, ||, ;, |), as argv lists."""
    out = []
    for part in re.split(r"&&|\|\||;|\|", block.replace("\\\n", " ")):
        part = part.strip()
        if part and not part.startswith("#"):
            out.append(shlex.split(part))
    return out


@pytest.mark.parametrize("i", range(len(blocks("bash"))))
def test_bash_block_is_valid(i):
    block = blocks("bash")[i]
    subprocess.run(["bash", "-n", "-c", block], check=True)
    from gpupool import cli

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    for argv in _commands(block):
        env = [a for a in argv if re.match(r"^[A-Z_]+=", a)]
        argv = argv[len(env):]
        prog = argv[0]
        if prog == "gpupool":
            assert "gpupool" in project["project"]["scripts"]
            cli.build_parser().parse_args(argv[1:])  # raises SystemExit on a bad argument
        elif prog == "pip":
            assert argv[1] == "install"
            for spec in argv[2:]:
                m = re.fullmatch(r"\.\[(\w+)\]", spec)
                if m:
                    assert m.group(1) in project["project"]["optional-dependencies"], spec
        elif prog in ("python", "python3") and argv[1:3] == ["-m", "pytest"]:
            args = argv[3:]
            if "-m" in args:
                expr = args[args.index("-m") + 1]
                markers = {m.split(":")[0] for m in project["tool"]["pytest"]["ini_options"]["markers"]}
                assert set(re.findall(r"\w+", expr)) - {"not", "and", "or"} <= markers, expr
            valued = {"-m", "-n", "-k", "-p"}  # options whose value is the next word
            paths = [a for k, a in enumerate(args) if not a.startswith("-") and (k == 0 or args[k - 1] not in valued)]
            assert all((ROOT / a).exists() for a in paths), paths
        elif prog in ("python", "python3") and argv[1].endswith(".py"):  # a script of the repository
            assert (ROOT / argv[1]).is_file(), argv[1]
            if argv[1] == "examples/decode_loop.py":  # its options parse (tests/project/test_documented_commands.py runs it)
                sys.path.insert(0, str(ROOT / "examples"))
                import decode_loop
                decode_loop.parser().parse_args(argv[2:])
        elif prog == ".ci/run":
            assert (ROOT / ".ci" / "run").is_file()
        else:
            pytest.fail(f"README bash block {i + 1}: no check for the command {prog!r}; add one")


def test_console_script_entry_point_exists():
    """``gpupool`` (the console script the README runs) resolves to a callable."""
    p = subprocess.run([sys.executable, "-c", "import gpupool.cli as c; assert callable(c.main)"], timeout=scaled(120))
    assert p.returncode == 0


def test_first_python_block_runs_as_a_script_beside_a_clone_named_gpupool(tmp_path):
    """A snippet saved next to the clone (``~/gpupool`` and ``~/snippet.py``) imports the installed
    package, not the clone's root as a namespace package: the src/ layout's editable install is a
    plain path entry, which wins over a namespace portion (README "Layout and docs")."""
    import importlib.util
    origin = Path(importlib.util.find_spec("gpupool").origin).resolve()
    if not origin.is_relative_to(ROOT / "src"):
        pytest.skip(f"gpupool is imported from {origin}, not from this tree's src/")
    (tmp_path / "gpupool").symlink_to(ROOT, target_is_directory=True)
    (tmp_path / "snippet.py").write_text(blocks("python")[0], encoding="utf-8")
    p = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=scaled(300))
    assert p.returncode == 0, p.stderr[-2000:]
