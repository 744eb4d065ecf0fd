"""vLLM's sdist as the vLLM tests fetch it (``harness.vllm_source``): several pytest-xdist workers asking
at once download it once, a file appears only complete and checked, and a failed or altered download
leaves nothing behind. The network is a stand-in here."""
from __future__ import annotations

import hashlib
import io
import threading
import time

import pytest

from harness import vllm_source

DATA = bytes(range(256)) * 4096  # 1 MiB


class _Slow(io.BytesIO):
    """A response that trickles, so the workers' requests overlap; ``fail_at``: raise after that many bytes."""

    def __init__(self, data, fail_at=None):
        super().__init__(data)
        self.fail_at = fail_at

    def read(self, n=-1):
        time.sleep(0.002)
        if self.fail_at is not None and self.tell() >= self.fail_at:
            raise ConnectionResetError("connection reset by peer")
        return super().read(min(n, 64 << 10) if n and n > 0 else 64 << 10)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_source, "CACHE", tmp_path)
    monkeypatch.setattr(vllm_source, "SDIST", tmp_path / "vllm-0.33.0.tar.gz")
    monkeypatch.setattr(vllm_source, "SDIST_SHA256", hashlib.sha256(DATA).hexdigest())
    return tmp_path


def _serve(monkeypatch, **kw):
    calls = []

    def urlopen(url, timeout):
        calls.append(url)
        return _Slow(DATA, **kw)

    monkeypatch.setattr(vllm_source.urllib.request, "urlopen", urlopen)
    return calls


def test_workers_at_once_download_it_once(cache, monkeypatch):
    calls = _serve(monkeypatch)
    got, errors = [], []

    def worker():
        try:
            got.append(vllm_source.sdist())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [vllm_source.SDIST] * 4
    assert len(calls) == 1 and vllm_source.SDIST.read_bytes() == DATA
    assert sorted(p.name for p in cache.iterdir()) == ["vllm-0.33.0.tar.gz", "vllm-0.33.0.tar.gz.lock"]


@pytest.mark.parametrize("what", ["reset", "altered"])
def test_a_failed_download_leaves_nothing(cache, monkeypatch, what):
    if what == "reset":
        _serve(monkeypatch, fail_at=len(DATA) // 2)
    else:
        monkeypatch.setattr(vllm_source, "SDIST_SHA256", "0" * 64)
        _serve(monkeypatch)
    with pytest.raises(vllm_source.SourceUnavailable, match="could not be downloaded"):
        vllm_source.sdist()
    assert [p.name for p in cache.iterdir()] == ["vllm-0.33.0.tar.gz.lock"]


def test_quick_tests_never_download(cache, monkeypatch):
    calls = _serve(monkeypatch)
    with pytest.raises(vllm_source.SourceUnavailable, match="slow vLLM tests download it"):
        vllm_source.sdist(download=False)
    assert calls == [] and not vllm_source.SDIST.exists()
