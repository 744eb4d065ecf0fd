"""``gpupool.tensors.to_device_packed``: several host int lists in ONE host-to-device copy (the batched
launch's arguments), each part its own dtype and values, whatever the parts' lengths and order."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool import tensors

CPU = torch.device("cpu")
I32 = st.lists(st.integers(-2**31, 2**31 - 1), max_size=9).map(lambda v: (v, torch.int32))
I64 = st.lists(st.integers(-2**63, 2**63 - 1), max_size=9).map(lambda v: (v, torch.int64))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(I32, I64), min_size=1, max_size=5))
def test_parts_come_back_equal(parts):
    got = tensors.to_device_packed(parts, CPU)
    assert len(got) == len(parts)
    for t, (vals, dt) in zip(got, parts):
        assert t.dtype == dt and t.dim() == 1 and t.tolist() == vals


def test_one_copy_and_a_shared_buffer(monkeypatch):
    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(1) or to(self, *a, **k))
    a, b = tensors.to_device_packed([([1, 2, 3], torch.int32), ([2**40, -5], torch.int64)], CPU)
    assert len(copies) == 1
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_out_of_range_raises_as_to_device():
    with pytest.raises(Exception) as packed:
        tensors.to_device_packed([([1], torch.int32), ([2**40], torch.int32)], CPU)
    with pytest.raises(Exception) as single:
        tensors.to_device([2**40], torch.int32, CPU)
    assert type(packed.value) is type(single.value)
