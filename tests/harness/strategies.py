"""Hypothesis draws (``st.data()``) shared by several test files, and the note / statistics hooks
that only act inside a hypothesis test."""
from __future__ import annotations

from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context


def note(msg: str) -> None:
    """hypothesis' ``note`` inside a hypothesis test, nothing in a plain one."""
    if currently_in_test_context():
        _note(msg)


def rare(data, label: str, odds: int = 6) -> bool:
    """True for one of ``odds`` equally likely draws (the side-by-side manager workloads' rare branches)."""
    return data.draw(st.integers(0, odds - 1), label=label) == 0


def draw_batch(data, p) -> list[int]:
    """A batch of the request slots in use (``p.active()``): a size from 1, then an order (empty when
    none is in use)."""
    act = p.active()
    if not act:
        return []
    k = data.draw(st.integers(1, len(act)), label="batch size")
    return data.draw(st.permutations(act), label="order")[:k]
