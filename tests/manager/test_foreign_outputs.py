"""An output buffer that is another object's state (docs/kv_cache.md section 2: "or with the manager's
or pool's own tensors"): another manager's state or a decode window's buffers, given as ``out`` to a
manager's op or as a cache to ``store_kv``, are refused before anything is written; written, they
would change the other object's state behind its back."""
from __future__ import annotations

import pytest
import torch

from gpupool.errors import InvalidArgumentError
from gpupool.kv_cache import AttentionViews, store_kv
from harness.state import manager_state

from test_window import twins, two_requests

I32 = torch.int32


def test_another_managers_state_is_not_an_output():
    _, m = twins(16)
    _, other = twins(16)
    two_requests(m)
    two_requests(other)
    win = other.window(2, steps=1)
    before = manager_state(other)
    v = AttentionViews.empty(2, 8, 1)
    for victim, what in ((other.state.num_computed[:2], "manager"), (win.seq[:1].view(2), "decode window")):
        out = v._replace(seqused_k=victim.view(1, 2))
        with pytest.raises(InvalidArgumentError, match=f"a {what}'s state"):
            m.attention_views(torch.tensor([0, 1], dtype=I32), torch.tensor([3, 2], dtype=I32), out=out)
        with pytest.raises(InvalidArgumentError, match=f"a {what}'s state"):
            m.slot_mapping(torch.tensor([0], dtype=I32), torch.tensor([1], dtype=I32), out=victim.view(torch.int64)[:1])
    m.pool.check()
    assert manager_state(other) == before and win.seq.tolist() == [[0, 0]]


def test_store_kv_does_not_write_a_managers_state():
    _, m = twins(16)
    before = manager_state(m)
    cache = m.state.block_table.view(torch.float32).reshape(-1)[:16].view(2, 4, 1, 2)  # its block table as a cache
    other = torch.zeros(2, 4, 1, 2)
    with pytest.raises(InvalidArgumentError, match="a manager's state"):
        store_kv(torch.ones(1, 1, 2), torch.ones(1, 1, 2), cache, other, torch.tensor([5]))
    assert manager_state(m) == before


@pytest.mark.parametrize("whose", ["own", "other"])
def test_a_managers_state_is_not_a_kv_cache(whose):
    """The KV caches a window's ``begin`` copies blocks in are outputs too: a pool's ref counts viewed as a
    cache of ``num_blocks`` rows would take the copy-on-write copies."""
    _, m = twins(16)
    _, other = twins(16)
    victim = (m if whose == "own" else other).pool.state.ref_cnt.view(16, 1)
    before = manager_state(other)
    with pytest.raises(InvalidArgumentError, match="shares memory"):
        m.window(2, kv_caches=[victim])
    with pytest.raises(InvalidArgumentError, match="shares memory"):
        m.copy_and_release([victim])
    assert manager_state(other) == before


def test_a_refused_kv_cache_names_the_call():
    """The caches' own checks (``copy_blocks``' layer checks) name the call that was refused."""
    _, m = twins(16)
    t = torch.zeros(16, 2, 4)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeWindow: kv_caches\[0\] and kv_caches\[1\] share memory"):
        m.window(2, kv_caches=[t, t])
    with pytest.raises(InvalidArgumentError, match=r"^copy_and_release: kv_caches\[1\] must be contiguous"):
        m.copy_and_release([t, t.transpose(0, 1)])
