"""The observable state of a pool or a manager, read through the conformance surface only
(docs/semantics.md section 4, plus ``num_blocks``, ``block_hash_num_tokens(b)`` and ``num_watchers()``,
which both pools expose), so one reader serves :class:`gpupool.ReferenceBlockPool` and the device
``BlockPool`` (ids may come back as Python ints or integer tensors; they are normalised to ints);
and raw snapshots of a device pool's tensors, for "changed nothing" checks while an error is pending."""
from __future__ import annotations

import hashlib


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


# ---- pools -----------------------------------------------------------------------------------------

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


# ---- managers ------------------------------------------------------------------------------------

MANAGER_FIELDS = ("rows", "num_computed", "num_cached", "pending", "reserved", "num_reserved", "requests", "stats")


def manager_state(m) -> dict:
    """Block tables, per-request counters, pending copies, reservations (docs/semantics.md section 8)
    and the pool state (``"pool"``) of either manager."""
    from gpupool.manager import KVCacheManager

    G = len(m.groups)
    if isinstance(m, KVCacheManager):
        n = int(m.num_copies[0])
        return {
            "rows": [m.rows(g) for g in range(G)],
            "num_computed": ints(m.num_computed),
            "num_cached": [ints(x) for x in m.num_cached],
            "pending": list(zip(ints(m.copy_src[:n]), ints(m.copy_dst[:n]), ints(m.copy_release[:n]))),
            "reserved": ints(m.reserved),
            "num_reserved": int(m.num_reserved[0]),
            "requests": device_requests(m),
            "stats": ints(m.state.stats),
            "pool": pool_state(m.pool),
        }
    return {
        "rows": [m.block_table(g) for g in range(G)],
        "num_computed": list(m.num_computed),
        "num_cached": [list(x) for x in m.num_cached],
        "pending": [tuple(c) for c in m.pending_copies],
        "reserved": list(m.reserved),
        "num_reserved": m.num_reserved,
        "requests": reference_requests(m),
        "stats": m.prefix_cache_stats.as_list(),
        "pool": pool_state(m.pool),
    }


def reference_requests(m) -> list:
    """Per active slot of a reference manager: its hashes' device keys in every group and, for a request
    that hashes its own tokens, its tail tokens (None otherwise); None for a free slot."""
    from gpupool.keys import device_key

    G = len(m.groups)
    return [None if not m.active[r] else ([[device_key(hh, g) for hh in m.hashes[r]] for g in range(G)],
                                          None if m.tails[r] is None else list(m.tails[r]))
            for r in range(m.max_num_reqs)]


def device_requests(m) -> list:
    """:func:`reference_requests` of a device manager, read from its tensors."""
    s = m.state
    act, nh, hashing, nt = s.active.tolist(), s.num_hashes.tolist(), s.hashing.tolist(), s.num_tail.tolist()
    hi, lo, tails = s.req_hi.tolist(), s.req_lo.tolist(), s.tail_tok.tolist()
    G = len(m.groups)
    return [None if not act[r] else ([list(zip(hi[r][g][:nh[r]], lo[r][g][:nh[r]])) for g in range(G)],
                                     tails[r][:nt[r]] if hashing[r] else None)
            for r in range(m.max_num_reqs)]


def manager_snapshot(m) -> dict:
    """A device manager's state tensors (rows, counters, ``active``, ``num_hashes``, the pending copies)
    and its pool's observable state: equal snapshots before and after an op mean it changed nothing."""
    s = m.state
    n = int(s.num_copies)
    return {"pool": pool_state(m.pool), "rows": [m.rows(g) for g in range(len(m.groups))],
            "num_computed": s.num_computed.tolist(), "num_cached": s.num_cached.tolist(),
            "active": s.active.tolist(), "num_hashes": s.num_hashes.tolist(),
            "copies": [s.copy_src[:n].tolist(), s.copy_dst[:n].tolist(), s.copy_release[:n].tolist()]}


# ---- raw device snapshots ------------------------------------------------------------------------

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
