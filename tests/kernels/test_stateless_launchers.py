"""The launchers keep nothing between calls (docs/design.md, "Layers"): a forced warp count comes from
the test (tests/harness/warps.py) and reaches every one-program launch of the pool and the manager
inside its block only; ``copy_blocks``' offset tables live in the dict its caller passes (the
manager's), built once per set of layer addresses, and without one each call builds its own."""
from __future__ import annotations

import pytest
import torch
from triton.runtime.jit import KernelInterface

from gpupool.instrument import Meter
from gpupool.kernels import common
from gpupool.kernels.copy_blocks import copy_blocks
from harness.keys import h
from harness.twins import small_manager_twin
from harness.warps import forced_warps


@pytest.fixture
def launch_warps(monkeypatch):
    """The ``num_warps`` of every Triton launch (None: not given)."""
    seen: list = []
    getitem = KernelInterface.__getitem__

    def recorded(fn, grid):
        launch = getitem(fn, grid)

        def run(*args, **kwargs):
            seen.append(kwargs.get("num_warps"))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(KernelInterface, "__getitem__", recorded)
    return seen


def _ops(dev):
    dev.add_request(0, [h(1), h(2)])
    dev.allocate_slots([0], [9], [9])
    dev.pool.free_blocks(dev.pool.get_new_blocks(2).tolist())
    dev.free([0])


def test_forced_warps_reach_every_one_program_launch_and_end_with_the_block(launch_warps):
    _, dev = small_manager_twin(n=12)
    with forced_warps(2):
        _ops(dev)
    forced = list(launch_warps)
    launch_warps.clear()
    _ops(dev)
    assert len(forced) >= 4 and set(forced) == {2}, forced
    assert set(launch_warps) == {common.warps_for(dev.pool.config.BLOCK)} != {2}, launch_warps


def test_copy_blocks_keeps_its_offset_tables_in_the_callers_dict():
    layers = [torch.arange(24, dtype=torch.float32).reshape(6, 4) + 100 * i for i in range(3)]
    src, dst = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)
    tables: dict = {}
    copies = []
    for kept in (tables, tables, None, None):
        with Meter() as m:
            copy_blocks(layers, src, dst, check=False, offset_tables=kept)
        copies.append(m.copies)
    assert copies == [1, 0, 1, 1]  # the table's one host-to-device copy: built once in the dict, else each call
    assert len(tables) == 1 and next(iter(tables.values())).tolist() == [
        (t.data_ptr() - layers[0].data_ptr()) // 16 for t in layers]  # in units of 4 floats (16-byte VEC)
    for t in layers:
        assert torch.equal(t[4:6], t[0:2])


def test_the_manager_passes_its_own_offset_tables(monkeypatch):
    from gpupool import manager as mgr

    seen = []
    monkeypatch.setattr(mgr, "copy_blocks", lambda *a, offset_tables=None, **k: seen.append(offset_tables))
    _, dev = small_manager_twin(n=12)
    caches = [torch.zeros(12, 4)]
    dev.copy_and_release(caches)
    dev.run_pending_copies(caches)
    assert seen and all(t is dev._copy_offsets for t in seen), seen
