"""What the commands write besides their reports: counts in words, progress bars on stderr, and the
``--json`` file (checked before any work, written at the end)."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from .types import CLIError


def count(n: int, noun: str) -> str:
    """``1 request``, ``2 requests``, ``12,031 requests``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


class _Lines:
    """A file for tqdm when stderr is not a terminal (a log, a pipe): each refresh of the bar as one
    line, as pip and CI logs show progress, instead of carriage returns that pile up on one line."""

    def __init__(self, f):
        self.f = f

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.f.write(text + "\n")

    def flush(self) -> None:
        self.f.flush()


def progress(flag: bool | None, desc: str):
    """The ``progress`` argument of a replay, the same rule for every pool: a bar when stderr is a
    terminal; when it is not (output redirected), a line every 10 s once a run has taken 10 s (with
    ``--progress``, from the start); none with ``--no-progress``."""
    if flag is False:
        return False
    if importlib.util.find_spec("tqdm") is None:
        if flag:
            raise CLIError("--progress needs tqdm: pip install tqdm (or, in the repository, pip install -e '.[cli]')")
        return False
    kw = {"desc": desc, "unit": "req", "leave": True}
    if not sys.stderr.isatty():
        kw.update(mininterval=10.0, maxinterval=10.0, delay=0.0 if flag else 10.0, file=_Lines(sys.stderr),
                  ncols=100)
    return kw


def check_json_path(path: str | None, keep=None) -> None:
    """Fail before any work when the report could not be written, or would overwrite ``keep`` (the
    command's input file, a path or an importlib.resources Traversable; None: nothing to keep)."""
    if path is None or path == "-":
        return
    if not path.strip():
        raise CLIError("--json needs a file name (or '-' for stdout)")
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"--json {path}: is a directory; give a file name")
    if keep is not None and p.exists() and _same_file(p, keep):
        raise CLIError(f"--json {path}: is the trace file; the report would overwrite it, choose another path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"--json {path}: the folder {parent} does not exist")
    existed = p.exists()
    try:  # open it for appending: the only test that /proc, a read-only mount or ACLs cannot fool
        with open(p, "a"):
            pass
    except OSError as e:
        raise CLIError(f"--json {path}: not writable ({e.strerror}); choose another path or '-' for stdout") from None
    if not existed:
        p.unlink()


def _same_file(p: Path, other) -> bool:
    try:
        return p.samefile(str(other))
    except (OSError, TypeError, ValueError):  # the other is missing, or not a file on disk (in a zip)
        return False


def write_json(path: str | None, data: dict) -> None:
    """``data`` as indented JSON to ``path`` ('-': stdout; None: nowhere); non-finite floats as null."""
    if path is None:
        return
    text = json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e}") from None


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(f"not JSON serialisable: {x!r}")
