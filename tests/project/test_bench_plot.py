"""``gpupool bench``'s table and figure (bench/plot.py) never put the interpreter's microseconds beside
the host pools under "lower is better": without CUDA the device pool's rows are left out, with a note."""
from __future__ import annotations

from harness.paths import ROOT
import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "bench" / "plot.py")
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)


def _bench_json(tmp_path, device: str) -> Path:
    def bench(pool, us, dev):
        return {"name": f"alloc[{pool}]", "stats": {"median": us * 1e-6, "rounds": 3},
                "extra_info": {"op": "alloc_free", "pool": pool, "num_blocks": 1024, "batch": 64, "device": dev}}
    data = {"benchmarks": [bench("reference", 50.0, "cpu (host)"), bench("device-eager", 9000.0, device),
                           bench("device-graph", 7.0, device)], "datetime": "2026-12-03T00:00:00"}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    return path


def test_interpreter_rows_are_left_out_of_the_table(tmp_path):
    text = plot.table(_bench_json(tmp_path, "cpu (Triton interpreter)"))
    assert "device-eager" not in text and "device-graph" not in text and "9,000" not in text
    assert "reference" in text and "50.0" in text and "device pool left out" in text


def test_gpu_rows_are_kept_in_the_table(tmp_path):
    text = plot.table(_bench_json(tmp_path, "NVIDIA H200"))
    assert "device-eager" in text and "device-graph" in text and "7.0" in text
    assert "left out" not in text and "NVIDIA H200" in text


def test_interpreter_rows_are_left_out_of_the_figure(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    seen = []
    real = plot.comparable
    monkeypatch.setattr(plot, "comparable", lambda rows: seen.append(real(rows)) or seen[-1])
    png = plot.plot(_bench_json(tmp_path, "cpu (Triton interpreter)"), tmp_path / "b.png")
    assert png.stat().st_size > 0
    kept, note = seen[0]
    assert [r["pool"] for r in kept] == ["reference"] and note == plot.INTERPRETER_NOTE


def _figure_of(tmp_path, monkeypatch, device: str):
    """The matplotlib figure ``plot.plot`` saves for a run on ``device``."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    figs = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figs.append(self) or real(self, *a, **k))
    plot.plot(_bench_json(tmp_path, device), tmp_path / "b.png")
    fig = figs[0]
    stars = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_marker() == "*"]
    return fig._suptitle.get_text(), stars


def test_figure_on_the_interpreter_is_titled_host_only_without_gpu_targets(tmp_path, monkeypatch):
    title, stars = _figure_of(tmp_path, monkeypatch, "cpu (Triton interpreter)")
    assert "host-side pools only" in title and "vs" not in title
    assert not stars  # the GPU targets are not drawn beside host-only lines


def test_figure_on_a_gpu_compares_and_draws_the_targets(tmp_path, monkeypatch):
    title, stars = _figure_of(tmp_path, monkeypatch, "NVIDIA H200")
    assert "device block pool vs host-side pools" in title
    assert stars
