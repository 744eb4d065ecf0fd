"""Helpers shared by the pool tests (reference pool now, device pool later).

Everything here drives a pool only through the docs/semantics.md section 4 conformance surface, plus
``num_blocks``, ``block_hash_num_tokens(b)`` and ``num_watchers()``, which both pools expose,
so the same helpers work for :class:`gpupool.ReferenceBlockPool` and the device ``BlockPool``
(ids may come back as Python ints or integer tensors; they are normalised to ints).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch

from gpupool.errors import PoolError


def sized(full: int, small: int) -> int:
    """A test's size: ``full`` under the ``ci`` and ``deep`` hypothesis profiles (``.ci/run``),
    ``small`` under ``dev``, the default, so the README's quick test command stays under 3 minutes."""
    from hypothesis import settings

    return full if settings().max_examples >= 25 else small

BLOCK_SIZE = 16


# ---- keys ------------------------------------------------------------------------------------

def h(i) -> bytes:
    """The 32-byte block hash of test key ``i``: ``sha256(str(i))`` (the docs/semantics.md section 5 trace hash)."""
    return hashlib.sha256(str(i).encode()).digest()


def hashes(ids: Iterable) -> list[bytes]:
    """``[h(i) for i in ids]``."""
    return [h(i) for i in ids]


def request_hashes(prefix_ids: Sequence, num_tokens: int, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Hashes of a request's full blocks: one test key per block (``prefix_ids[j]`` names block ``j``'s
    chained content), truncated to the ``num_tokens // block_size`` full blocks."""
    full = num_tokens // block_size
    if len(prefix_ids) < full:
        raise ValueError(f"{num_tokens} tokens need {full} prefix ids, got {len(prefix_ids)}")
    return hashes(prefix_ids[:full])


# ---- normalisation -----------------------------------------------------------------------------

def ints(x) -> list[int]:
    """A list / tuple / integer tensor / array of ids as a list of Python ints."""
    if hasattr(x, "tolist") and not isinstance(x, list):
        x = x.tolist()
        if isinstance(x, int):
            return [x]
    return [int(v) for v in x]


def norm_keys(keys) -> list[tuple[bytes, int]]:
    return [(bytes(hh), int(g)) for hh, g in keys]


def norm_ntok(v):
    return None if v is None else int(v)


# ---- observable state ----------------------------------------------------------------------------

def pool_state(pool) -> dict:
    """The whole observable state of a pool, through the conformance surface only."""
    return {
        "free_queue": ints(pool.free_queue()),
        "ref_counts": ints(pool.ref_counts()),
        "blocks": [(norm_keys(pool.block_keys(b)), norm_ntok(pool.block_hash_num_tokens(b)))
                   for b in range(int(pool.num_blocks))],
        "num_free": int(pool.get_num_free_blocks()),
        "num_watchers": int(pool.num_watchers()),
    }


def state_digest(pool) -> str:
    """sha256 of ``repr(pool_state(pool))``: equal digests mean equal observable states."""
    return hashlib.sha256(repr(pool_state(pool)).encode()).hexdigest()


def lookup(pool, block_hash: bytes, group_ids=(0,)):
    """``get_cached_block`` with the result normalised to a list of ints (or None)."""
    out = pool.get_cached_block(block_hash, list(group_ids))
    return None if out is None else ints(out)


def assert_consistent(pool) -> None:
    """``validate()`` plus the cheap section 1 checks anyone can make from outside."""
    pool.validate()
    st = pool_state(pool)
    q, refs = st["free_queue"], st["ref_counts"]
    assert st["num_free"] == len(q)
    assert len(set(q)) == len(q)
    assert 0 not in q
    assert all(r >= 0 for r in refs)
    assert set(q) == {b for b in range(1, len(refs)) if refs[b] == 0}
    assert st["blocks"][0] == ([], None)


# ---- request-level scenarios (docs/semantics.md section 5 admission) ---------------------------------------

def find_hits(pool, req_hashes: Sequence[bytes], num_tokens: int, block_size: int = BLOCK_SIZE,
              group: int = 0) -> list[int]:
    """The longest cached prefix of the first ``min(full, (num_tokens - 1) // block_size)`` hashes."""
    limit = min(len(req_hashes), num_tokens // block_size, max(num_tokens - 1, 0) // block_size)
    hits = []
    for hh in req_hashes[:limit]:
        got = lookup(pool, hh, [group])
        if got is None:
            break
        hits.append(got[0])
    return hits


def admit(pool, prefix_ids: Sequence, num_tokens: int, block_size: int = BLOCK_SIZE, group: int = 0,
          total_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """Admit a request the way docs/semantics.md section 5 does: look up hits, ``touch`` them, get the rest,
    cache the full blocks. ``prefix_ids`` names one test key per full block (see :func:`request_hashes`).

    Returns ``(hits, new_blocks)``; the request's block table is ``hits + new_blocks``.
    """
    total_tokens = num_tokens if total_tokens is None else total_tokens
    req_hashes = request_hashes(prefix_ids, num_tokens, block_size)
    hits = find_hits(pool, req_hashes, num_tokens, block_size, group)
    total = -(-total_tokens // block_size)
    pool.touch(hits)
    new = ints(pool.get_new_blocks(total - len(hits)))
    pool.cache_full_blocks(hits + new, req_hashes, len(hits), len(req_hashes), block_size, group)
    return hits, new


def free_request(pool, blocks: Sequence[int]) -> None:
    """Free a request's block table: ``free_blocks(reversed(blocks))`` after dropping leading null blocks."""
    blocks = list(blocks)
    while blocks and blocks[0] == 0:
        blocks.pop(0)
    pool.free_blocks(list(reversed(blocks)))


# ---- errors --------------------------------------------------------------------------------------

def expect_error(pool, exc_type: type, op: str, fn: Callable[[], object], *, check_events: bool = True):
    """Run ``fn``; assert it raises ``exc_type`` (a :class:`PoolError`) naming ``op``, and that the pool's
    observable state is unchanged. With ``check_events`` the pending events are drained first and the
    failed op must not have added any. Returns the exception."""
    assert issubclass(exc_type, PoolError)
    if check_events:
        pool.take_events()
    before = state_digest(pool)
    with pytest.raises(exc_type) as info:
        fn()
    err = info.value
    assert isinstance(err, PoolError)
    assert op in str(err), f"{err!s} does not name the op {op!r}"
    assert getattr(err, "op", op) == op
    assert state_digest(pool) == before, f"{op} raised {type(err).__name__} but changed the pool"
    if check_events:
        assert list(pool.take_events()) == [], f"{op} raised but emitted events"
    return err


class WatcherLog:
    """Reuse-watcher callbacks that record ``(tag, block, state_digest at call time)``."""

    def __init__(self, pool):
        self.pool = pool
        self.calls: list[tuple[object, int, str]] = []

    def cb(self, tag=None) -> Callable[[int], None]:
        def on_reuse(block, _tag=tag):
            self.calls.append((_tag, int(block), state_digest(self.pool)))
        return on_reuse

    def blocks(self) -> list[int]:
        return [b for _, b, _ in self.calls]

    def tagged(self) -> list[tuple[object, int]]:
        return [(t, b) for t, b, _ in self.calls]


def reuse_callbacks(pair):
    """A pair of ``on_reuse`` callbacks (reference, device) that log ``(tag, block)`` into
    ``pair.fired[side]``, with a fresh tag from ``pair.next_tag`` (the pair harnesses' watchers)."""
    tag = pair.next_tag
    pair.next_tag += 1

    def make(side):
        log = pair.fired[side]

        def on_reuse(b):
            log.append((tag, int(b)))
        return on_reuse
    return make("ref"), make("dev")


def assert_lookups_agree(ref, dev, hashes, where: str = "") -> None:
    """``lookup_batched`` on the device pool of every hash in groups 0 and 1 equals the reference's
    ``get_cached_block`` (-1 for a miss)."""
    import torch

    from gpupool.keys import device_key
    keys = [(hh, g) for hh in sorted(hashes) for g in (0, 1)]
    dk = [device_key(hh, g) for hh, g in keys]
    t64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev.device)  # noqa: E731
    got = ints(dev.lookup_batched(t64([k[0] for k in dk]), t64([k[1] for k in dk]),
                                  torch.tensor([g for _, g in keys], dtype=torch.int32, device=dev.device)))
    want = []
    for hh, g in keys:
        r = ref.get_cached_block(hh, [g])
        want.append(-1 if r is None else r[0])
    assert got == want, f"lookups differ: device {got} != reference {want}; {where}"


def run_in_threads(errors: list, *targets: Callable) -> None:
    """Run each target in its own thread and wait for all; the targets append what they caught to
    ``errors``, which must stay empty."""
    import threading

    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def call_both(ref_fn: Callable, dev_fn: Callable, dev_check: Callable | None = None):
    """Run the reference op, then the device op (and ``dev_check``, e.g. the status word's ``check()``),
    each catching a PoolError. Returns (reference value, reference error, device value, device error)."""
    r_val = r_err = d_val = d_err = None
    try:
        r_val = ref_fn()
    except PoolError as e:
        r_err = e
    try:
        d_val = dev_fn()
        if dev_check is not None:
            dev_check()
    except PoolError as e:
        d_err = e
    return r_val, r_err, d_val, d_err


def assert_pools_agree(ref, dev, fired: dict, where: str) -> None:
    """Both pools' observable state (``pool_state``), drained events and watcher firings are equal."""
    rs, ds = pool_state(ref), pool_state(dev)
    for k in rs:
        assert ds[k] == rs[k], f"{k} differs: device {ds[k]} != reference {rs[k]}; {where}"
    rev, dev_ev = ref.take_events(), dev.take_events()
    assert dev_ev == rev, f"events differ: device {dev_ev} != reference {rev}; {where}"
    assert fired["dev"] == fired["ref"], (
        f"watcher firings differ: device {fired['dev']} != reference {fired['ref']}; {where}")


def raw_state(pool, manager=None) -> dict:
    """Every device tensor of a device pool (and of its manager), as host copies, read without waiting
    on or draining the device (no ``check()``): comparable while an error sits in the status word.
    Left out: the status word itself, the statistics and scratch slots of ``ctrl`` (from
    ``Ctrl.COMPACTIONS`` on), the manager's kernel scratch (``s_*``). The host's pending events and
    watcher table are included."""
    from gpupool.kernels.layout import Ctrl

    out = {}
    for name, t in pool.state._asdict().items():
        if name == "status":
            continue
        if name == "ctrl":
            t = t[: Ctrl.COMPACTIONS]
        out[name] = t.detach().to("cpu").clone()
    if manager is not None:
        for name, t in manager.state._asdict().items():
            if not name.startswith("s_"):
                out["m." + name] = t.detach().to("cpu").clone()
    out["host"] = repr(([(b, id(cb)) for b, cb in pool._watchers.items()], pool._events))
    return out


def same_raw_state(a: dict, b: dict) -> list[str]:
    """Names of the entries where two :func:`raw_state` snapshots differ (empty: the same)."""
    import torch

    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def fill_step(step, decoding, ntok, finished=()) -> None:
    """Write one step's inputs into a :class:`gpupool.graph.DecodeStep`'s fixed buffers: the running
    slots ``decoding`` with token counts ``ntok``, and the ``finished`` slots."""
    k = len(decoding)
    step.slots[:k] = torch.tensor(list(decoding), dtype=torch.int32)
    step.num_tokens[:k] = torch.tensor(list(ntok), dtype=torch.int32)
    step.num_reqs.fill_(k)
    step.finished[: len(finished)] = torch.tensor(list(finished), dtype=torch.int32)
    step.num_finished.fill_(len(finished))
