"""vLLM 0.33.0's released source, for the tests that compare with vLLM (never a copy in this repo): its
sdist (47 MB), downloaded once into ``~/.cache/gpupool`` and checked against its published SHA-256,
and the sdist's ``vllm/`` and ``tests/`` unpacked beside it.

pytest-xdist workers may ask at once: one downloads while the others wait on a file lock, into a
temporary file of its own that is renamed into place only when complete, so no worker reads a
partial file. Quick tests pass ``download=False``: they use the sdist when it is there and skip
otherwise (the README: only the slow tests download it).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

SDIST_URL = ("https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
             "vllm-0.33.0.tar.gz")
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
CACHE = Path.home() / ".cache" / "gpupool"
SDIST = CACHE / "vllm-0.33.0.tar.gz"
TREE = CACHE / "vllm-0.33.0-src"


class SourceUnavailable(Exception):
    """vLLM's source cannot be had here; the message is the skip reason."""


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created) between processes; no lock where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the unique temporary name and the atomic rename still hold
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist(download: bool = True) -> Path:
    """The path of vLLM 0.33.0's sdist: the cached one, or (``download``) fetched once now. Raises
    SourceUnavailable with the reason when it is not cached and may not, or cannot, be downloaded."""
    if SDIST.is_file():
        return SDIST
    if not download:
        raise SourceUnavailable(f"vLLM 0.33.0's source is not in {CACHE} (the slow vLLM tests download it once, "
                                f"47 MB: pytest -m slow tests/vllm_plugin)")
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        with _locked(CACHE / (SDIST.name + ".lock")):
            if SDIST.is_file():  # another worker fetched it while this one waited
                return SDIST
            fd, tmp = tempfile.mkstemp(prefix=SDIST.name + ".", suffix=".part", dir=CACHE)
            try:
                with os.fdopen(fd, "wb") as f, urllib.request.urlopen(SDIST_URL, timeout=120) as r:
                    shutil.copyfileobj(r, f)
                got = _sha256(tmp)
                if got != SDIST_SHA256:
                    raise OSError(f"SHA-256 {got}, expected {SDIST_SHA256} (a partial or altered download)")
                os.replace(tmp, SDIST)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    except Exception as e:  # the network's and the disk's errors (http.client's are not all OSError)
        raise SourceUnavailable(f"vLLM 0.33.0's sdist (47 MB, downloaded once into {CACHE}) could not be "
                                f"downloaded ({e})") from None
    return SDIST


def read(files, download: bool = True) -> dict[str, str]:
    """The text of ``files`` (paths inside vLLM's tree, ``vllm/...``) read from the sdist."""
    with tarfile.open(sdist(download)) as t:
        return {f: t.extractfile(f"vllm-0.33.0/{f}").read().decode() for f in files}


def tree(needed: str, download: bool = True) -> Path:
    """vLLM 0.33.0's ``vllm/`` and ``tests/`` (their ``.py`` files) unpacked from the sdist once, where
    ``needed`` (a path in the tree) shows a complete unpacking; SourceUnavailable as :func:`sdist`."""
    if (TREE / "vllm" / "v1" / "core" / "block_pool.py").is_file() and (TREE / needed).is_file():
        return TREE
    archive = sdist(download)
    part = Path(tempfile.mkdtemp(prefix=TREE.name + ".", suffix=".part", dir=CACHE))
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers()
                   if m.isfile() and m.name.endswith(".py") and m.name.split("/")[1] in ("vllm", "tests")]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        try:
            t.extractall(part, members=members, filter="data")
        except TypeError:  # Python without tarfile extraction filters (all members are plain .py files)
            t.extractall(part, members=members)
    try:
        part.rename(TREE)
    except OSError:  # another process unpacked it first
        shutil.rmtree(part, ignore_errors=True)
    return TREE
