"""The fault harness of the pools: :class:`FaultPair` (each op decided on a copy of the reference; a
failing op must fail alike on the device and leave both full-state digests as they were), the
choosers (hypothesis draws or a seeded ``random.Random``), the valid-op and fault generators and
:func:`step`; used by tests/pool/test_pool_errors.py and tests/pool/test_soak.py.
"""
from __future__ import annotations


import copy
import hashlib
from collections import Counter

import pytest
import torch
from hypothesis import note as _hnote
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from gpupool import BlockPool, ReferenceBlockPool  # noqa
from gpupool.kernels.layout import Ctrl
from gpupool.errors import (
    ArgumentTypeError, DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError,
    KeyCapacityError, NullBlockError, OutOfBlocksError, PoolError,
)

from harness.compare import assert_pools_agree
from harness.ops import flat_segments
from harness.device import DEVICE, i32
from harness.keys import h
from harness.state import ints
from harness.twins import pool_twin
from harness.watchers import reuse_callbacks


CTRL_COMPACTIONS = Ctrl.COMPACTIONS
UNIVERSE = [h(f"fault{i}") for i in range(12)]  # small: keys repeat, collide and get promoted
ANY = object()  # "do not check the offending value"
BIG_BS = 1 << 12  # a block size whose token counts exceed every count the generators create


# =================================================================================================
# Full-state digests (bit for bit, not only the conformance surface)
# =================================================================================================

def ref_digest(ref: ReferenceBlockPool) -> str:
    """Everything the reference pool holds: queue links, counts, keys, map entry order, watchers
    (block and callback identity, in registration order) and pending events."""
    q = ref.free_block_queue
    state = (
        ref.ref_cnt, ref.keys, ref.hash_num_tokens,
        [(k, list(v)) for k, v in ref.cached_block_hash_to_block.items()],
        [(b, id(cb)) for b, cb in ref.watchers.items()],
        ref.events, q.prev, q.next, q.queued, q.head, q.tail, q.size,
    )
    return hashlib.sha256(repr(state).encode()).hexdigest()


def dev_digest(dev: BlockPool, *, status: bool = True) -> str:
    """Every tensor of the device state, bit for bit (``status`` optional: it is set between a failing
    batched op and ``check()``), plus the host's pending events and callback table. Never waits on or
    drains the device (it does not call ``_finish``)."""
    d = hashlib.sha256()
    for name, t in dev.state._asdict().items():
        if name == "status" and not status:
            continue
        d.update(name.encode())
        d.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    d.update(repr(([(b, id(cb)) for b, cb in dev._watchers.items()], dev._events)).encode())
    return d.hexdigest()


def total_keys(ref: ReferenceBlockPool) -> int:
    return sum(len(k) for k in ref.keys)


# =================================================================================================
# Choosers: one interface over hypothesis draws and over random.Random
# =================================================================================================

class HypChooser:
    def __init__(self, data):
        self.data = data

    def int(self, a: int, b: int, label: str | None = None) -> int:
        return self.data.draw(st.integers(a, b), label=label)

    def pick(self, seq, label: str | None = None):
        return self.data.draw(st.sampled_from(list(seq)), label=label)

    def chance(self, pct: int, label: str | None = None) -> bool:
        """True about ``pct`` percent of the time (shrinks towards False)."""
        return self.data.draw(st.integers(0, 99), label=label) >= 100 - pct

    def shuffled(self, seq) -> list:
        return self.data.draw(st.permutations(list(seq)))


class RandChooser:
    def __init__(self, rng):
        self.rng = rng

    def int(self, a: int, b: int, label: str | None = None) -> int:
        return self.rng.randint(a, b)

    def pick(self, seq, label: str | None = None):
        return self.rng.choice(list(seq))

    def chance(self, pct: int, label: str | None = None) -> bool:
        return self.rng.randrange(100) < pct

    def shuffled(self, seq) -> list:
        out = list(seq)
        self.rng.shuffle(out)
        return out


# =================================================================================================
# The side-by-side harness
# =================================================================================================

class FaultPair:
    """A reference pool and a device pool with the same configuration, driven op for op.

    ``chunks`` sets the device key table to ``16 * chunks`` slots; ops whose result would hold more
    keys than that are expected to fail on the device with KeyCapacityError (the issue: "a full key
    table") and to change nothing, while the reference, which has no table, is left as it was.
    """

    def __init__(self, n, *, caching=True, events=False, mk=4, ring=None, chunks=None, log=None):
        self.n, self.mk, self.caching, self.events = n, mk, caching, events
        self.ref, self.dev = pool_twin(n, enable_caching=caching, enable_kv_cache_events=events,
                                       max_keys_per_block=mk, ring_capacity=ring, num_chunks=chunks)
        self.table_cap = None if chunks is None else 16 * chunks
        self.fired = {"ref": [], "dev": []}
        self.used: set[bytes] = set()
        self.history: list[str] = []
        self.stats: Counter = Counter()
        self.next_tag = 0
        self.auto_full = True  # full comparison (validate, lookups) after every op; the soak turns it off
        self._log = log
        self.compare()

    # ---- bookkeeping ----------------------------------------------------------------------------
    def log(self, desc: str) -> None:
        self.history.append(desc)
        if self._log is not None:
            self._log(desc)
        elif currently_in_test_context():
            _hnote(desc)

    def where(self) -> str:
        return "after ops:\n  " + "\n  ".join(self.history[-15:])

    def callbacks(self):
        return reuse_callbacks(self)

    # ---- reading the reference -------------------------------------------------------------------
    def refs(self) -> list[int]:
        return list(self.ref.ref_cnt)

    def held_multiset(self) -> list[int]:
        return [b for b, c in enumerate(self.ref.ref_cnt) if b for _ in range(c)]

    def held(self) -> list[int]:
        return [b for b, c in enumerate(self.ref.ref_cnt) if b and c]

    def free(self) -> list[int]:
        return [b for b, c in enumerate(self.ref.ref_cnt) if b and not c]

    def keyed(self) -> list[int]:
        return [b for b in range(1, self.n) if self.ref.keys[b]]

    def unkeyed(self) -> list[int]:
        return [b for b in range(1, self.n) if not self.ref.keys[b]]

    # ---- comparing ---------------------------------------------------------------------------------
    def compare(self, full: bool = True) -> None:
        """Observable state, events and watcher firings equal; with ``full`` also ``validate()`` of
        both, usage and a lookup of every hash used so far in groups 0 and 1
        (harness.compare.assert_pools_agree)."""
        assert_pools_agree(self.ref, self.dev, self.fired, self.where(), full=full, used=self.used)

    # ---- an op expected to fail ------------------------------------------------------------------
    def expect_fail(self, desc, op, exc, ref_fn, dev_fn, value=ANY, full=True) -> None:
        """``ref_fn(ref)`` and ``dev_fn(dev)`` must each raise exactly ``exc`` naming ``op`` (and
        ``value``, unless ANY) and leave their pool's full-state digest as it was; no events, no
        watcher firings. ``ref_fn`` None: a device-only fault (a tensor the reference accepts)."""
        self.log(f"FAULT {desc} -> {exc.__name__}")
        self.compare(full=False)  # drains pending events, so counters and buffers are quiet
        fired = (len(self.fired["ref"]), len(self.fired["dev"]))
        for side, fn, pool, digest in (("reference", ref_fn, self.ref, ref_digest),
                                       ("device", dev_fn, self.dev, dev_digest)):
            if fn is None:
                continue
            before = digest(pool)
            with pytest.raises(PoolError) as info:
                fn(pool)
            err = info.value
            assert type(err) is exc, (
                f"{side} {desc}: raised {type(err).__name__}({err}), expected {exc.__name__}; {self.where()}")
            assert err.op == op and op in str(err), f"{side} {desc}: {err!s} does not name {op!r}"
            if value is not ANY:
                assert err.value == value, f"{side} {desc}: offending value {err.value!r}, expected {value!r}"
            assert digest(pool) == before, f"{side} {desc} raised {exc.__name__} but changed the state"
        assert (len(self.fired["ref"]), len(self.fired["dev"])) == fired, f"{desc} fired a watcher"
        self.stats[f"fault {op}: {exc.__name__}"] += 1
        self.compare(full=full and self.auto_full)

    # ---- an op the reference decides ----------------------------------------------------------------
    def run(self, desc, ref_fn, dev_fn=None, norm=lambda x: x, full=True):
        """Run ``ref_fn`` on a copy of the reference: if it raises, the device must raise the same class
        and both must be unchanged; if it succeeds but the result would overflow the device key table,
        the device must raise KeyCapacityError unchanged; else the device must succeed with an equal
        (normalised) result and the copy becomes the reference. Returns the result (None on error)."""
        dev_fn = ref_fn if dev_fn is None else dev_fn
        self.log(desc)
        fired_len = len(self.fired["ref"])
        r_before = ref_digest(self.ref)
        trial = copy.deepcopy(self.ref)
        r_err = r_val = None
        try:
            r_val = ref_fn(trial)
        except PoolError as e:
            r_err = e
        expected = type(r_err) if r_err is not None else None
        table_full = (r_err is None and self.table_cap is not None and total_keys(trial) > self.table_cap)
        if table_full:
            expected = KeyCapacityError
        d_before = dev_digest(self.dev)
        d_err = d_val = None
        try:
            d_val = dev_fn(self.dev)
        except PoolError as e:
            d_err = e
        if expected is None:
            assert d_err is None, f"{desc}: device raised {d_err!r}, the reference succeeded; {self.where()}"
            assert norm(d_val) == norm(r_val), f"{desc}: device returned {d_val!r}, reference {r_val!r}"
            self.ref = trial
            self.stats[f"ok {desc.split('(')[0]}"] += 1
        else:
            del self.fired["ref"][fired_len:]
            what = "overflows the device key table" if table_full else f"raised {r_err!r} on the reference"
            assert type(d_err) is expected, f"{desc} {what}; device raised {d_err!r}; {self.where()}"
            if r_err is not None:
                assert ref_digest(trial) == r_before, f"reference {desc} raised {r_err!r} but changed the state"
            assert dev_digest(self.dev) == d_before, f"device {desc} raised {d_err!r} but changed the state"
            self.stats[f"incidental {desc.split('(')[0]}: {expected.__name__}"] += 1
        self.compare(full=full and self.auto_full)
        return None if expected else r_val

    # ---- a batched device op against the sequence of single reference calls -------------------------
    def batched(self, desc, calls, launch, result=None, followups=(), single_followup=None, full=True):
        """``calls``: single reference calls (each ``fn(ref)``) the batch stands for. If one of them
        fails, the batch must do nothing: the follow-up batched ops (valid on their own) launched
        before ``check()`` must do nothing either, ``check()`` (or ``single_followup``, a valid single
        op) must raise the failing call's class, and the full device state must be as before;
        a second ``check()`` is quiet. Else ``result(launch's output)`` must equal the calls' results."""
        self.log(desc)
        self.compare(full=False)  # drains pending events, so counters and buffers are quiet
        fired_len = len(self.fired["ref"])
        trial = copy.deepcopy(self.ref)
        vals, exp = [], None
        for call in calls:
            try:
                vals.append(call(trial))
            except PoolError as e:
                exp = e
                break
        before = dev_digest(self.dev)
        before_ns = dev_digest(self.dev, status=False)
        out = launch(self.dev)
        if exp is None:
            self.dev.check()
            if result is not None:
                got = result(out)
                assert got == vals, f"{desc}: device gave {got}, the single calls {vals}; {self.where()}"
            self.ref = trial
            self.stats[f"ok {desc.split('(')[0]}"] += 1
        else:
            del self.fired["ref"][fired_len:]
            assert int(self.dev.state.status[0]) == type(exp).code, (
                f"{desc}: status word {self.dev.state.status.tolist()}, expected {type(exp).__name__}")
            for f in followups:
                f(self.dev)
            assert dev_digest(self.dev, status=False) == before_ns, (
                f"{desc} failed ({type(exp).__name__}) but it or a later batched op changed the state")
            with pytest.raises(PoolError) as info:
                if single_followup is not None:
                    single_followup(self.dev)
                else:
                    self.dev.check()
            assert type(info.value) is type(exp), (
                f"{desc}: raised {info.value!r}, the single calls {exp!r}; {self.where()}")
            assert dev_digest(self.dev) == before, f"{desc}: state changed after check()"
            self.dev.check()  # cleared
            self.stats[f"fault {desc.split('(')[0]}: {type(exp).__name__}"
                       + (" +followups" if followups else "") + (" +single" if single_followup else "")] += 1
        self.compare(full=full and self.auto_full)


# =================================================================================================
# Argument helpers
# =================================================================================================

def ids_args(c, ids):
    """(reference arg, device arg): lists, or an int32 tensor for the device (range-checked in the
    kernel) and the list or the same tensor for the reference."""
    if all(-2**31 <= b < 2**31 for b in ids) and c.chance(35, "as_tensor"):
        t = i32(ids)
        return (t if c.chance(50, "ref_tensor") else list(ids)), t
    return list(ids), list(ids)


def release_pick(p: FaultPair, c, max_len=5) -> list[int]:
    """A valid release: held blocks, each at most its ref count times, shuffled; maybe a null block."""
    pool = p.held_multiset()
    k = c.int(0, min(len(pool), max_len), "rel_len")
    chosen = c.shuffled(pool)[:k]
    if c.chance(15, "rel_null"):
        chosen.insert(c.int(0, len(chosen)), 0)
    return chosen


def bad_id(p: FaultPair, c, tensor_ok=True) -> int:
    choices = [-1, p.n, p.n + 7, -(2**31)] + ([] if tensor_ok else [2**31, 2**40])
    return c.pick(choices, "bad_id")


def insert(c, ids, x) -> list[int]:
    out = list(ids)
    out.insert(c.int(0, len(out), "pos"), x)
    return out


# =================================================================================================
# Valid ops (the reference decides; most succeed)
# =================================================================================================

def v_get_new_blocks(p, c):
    k = c.int(0, min(len(p.free()), 4), "n")
    p.run(f"get_new_blocks({k})", lambda pool: pool.get_new_blocks(k), norm=ints)


def v_free_blocks(p, c):
    ids = release_pick(p, c)
    a, b = ids_args(c, ids)
    p.run(f"free_blocks({ids})", lambda pool: pool.free_blocks(a), lambda pool: pool.free_blocks(b))


def v_touch(p, c):
    ids = [c.int(0, p.n - 1, "touch_id") for _ in range(c.int(0, 4, "touch_len"))]
    cached_free = [b for b in p.free() if p.ref.keys[b]]
    if cached_free and c.chance(50, "touch_hit"):
        ids.append(c.pick(cached_free, "hit"))
    a, b = ids_args(c, ids)
    p.run(f"touch({ids})", lambda pool: pool.touch(a), lambda pool: pool.touch(b))


def v_unpin(p, c):
    ids = [x for x in release_pick(p, c, 4) if x]
    a, b = ids_args(c, ids)
    cr, cd = p.callbacks()
    p.run(f"unpin_blocks({ids}, tag={p.next_tag - 1})", lambda pool: pool.unpin_blocks(a, cr),
          lambda pool: pool.unpin_blocks(b, cd))


def _chain(c, length):
    start = c.int(0, len(UNIVERSE) - 1, "chain_start")
    if c.chance(30, "random_chain"):
        return [c.pick(UNIVERSE, "hash") for _ in range(length)]
    return [UNIVERSE[(start + i) % len(UNIVERSE)] for i in range(length)]


def v_cache_full(p, c):
    held = p.held()
    if held and c.chance(85, "cf_held"):
        ids = c.shuffled(held)[: c.int(1, min(5, len(held)), "cf_len")]
    else:
        ids = [c.int(0, p.n - 1, "cf_any") for _ in range(c.int(0, 4, "cf_len_any"))]
    if ids and c.chance(10, "cf_null"):
        ids[c.int(0, len(ids) - 1, "cf_null_pos")] = 0
    nc = c.int(0, len(ids), "nc")
    nf = c.int(nc, len(ids), "nf")
    hs = _chain(c, len(ids))
    bs = c.pick([4, 16, 16, 32], "bs")
    g = c.pick([0, 0, 1], "g")
    mask = None
    if nf > nc and c.chance(25, "masked"):
        mask = [c.chance(70, "m") for _ in range(nf - nc)]
    if p.caching and nc < nf:
        p.used.update(hs[nc:nf])
    a, b = ids_args(c, ids)
    p.run(f"cache_full_blocks({ids}, nc={nc}, nf={nf}, bs={bs}, g={g}, mask={mask})",
          lambda pool: pool.cache_full_blocks(a, hs, nc, nf, bs, g, mask),
          lambda pool: pool.cache_full_blocks(b, hs, nc, nf, bs, g, mask))


def v_cache_partial(p, c):
    keyed = p.keyed()
    if keyed and c.chance(50, "cp_keyed"):
        blk = c.pick(keyed, "cp_block")
    else:
        blk = c.int(0, p.n - 1, "cp_any")
    hbs = c.pick([4, 8, 16], "hbs")
    k = c.int(1, 4, "k")
    hs = [c.pick(UNIVERSE, "cp_hash") for _ in range(k + c.int(0, 1, "extra"))]
    nt = k * hbs
    g = c.pick([0, 0, 1], "cp_g")
    replace = c.chance(20, "replace")
    if p.caching:
        p.used.add(hs[k - 1])
    p.run(f"cache_partial_block({blk}, nt={nt}, g={g}, hbs={hbs}, replace={replace})",
          lambda pool: pool.cache_partial_block(blk, hs, nt, g, 16, hbs, replace))


def v_move(p, c):
    keyed, unkeyed = p.keyed(), p.unkeyed()
    src = c.pick(keyed, "src") if keyed and c.chance(80, "src_keyed") else c.int(0, p.n - 1, "src_any")
    if not unkeyed:
        return v_evict(p, c)
    dst = c.pick(unkeyed, "dst")
    p.run(f"move_block_hashes({src}, {dst})", lambda pool: pool.move_block_hashes(src, dst))


def v_evict(p, c):
    ids = [c.int(0, p.n - 1, "ev_id") for _ in range(c.int(0, 3, "ev_len"))]
    a, b = ids_args(c, ids)
    p.run(f"evict_blocks({ids})", lambda pool: pool.evict_blocks(a), lambda pool: pool.evict_blocks(b))


def v_reset(p, c):
    p.run("reset_prefix_cache()", lambda pool: pool.reset_prefix_cache())


def v_queries(p, c):
    hh = c.pick(UNIVERSE, "gc_hash")
    groups = c.pick([[], [0], [1], [0, 1], [1, 0]], "gc_groups")
    p.run(f"get_cached_block(H{UNIVERSE.index(hh)}, {groups})", lambda pool: pool.get_cached_block(hh, groups),
          norm=lambda x: None if x is None else ints(x), full=False)
    b = c.int(0, p.n - 1, "wr")
    p.run(f"is_block_writable({b})", lambda pool: pool.is_block_writable(b), full=False)


def v_allocate_batched(p, c):
    free = len(p.free())
    demands = [c.int(0, max(1, free // 2), "d") for _ in range(c.int(0, 3, "nd"))]
    _alloc_batched(p, c, demands)


def _alloc_batched(p, c, demands, followups=(), single=None):
    calls = [lambda pool, d=d: ints(pool.get_new_blocks(d)) for d in demands]

    def result(out):
        blocks, offs = ints(out[0]), ints(out[1])
        return [blocks[offs[k]:offs[k + 1]] for k in range(len(demands))]
    p.batched(f"allocate_batched({demands})", calls, lambda dev: dev.allocate_batched(i32(demands)), result,
              followups, single)


def held_segments(p, c, min_segs: int, label: str) -> list[list[int]]:
    """Up to 3 segments of up to 3 held blocks each (a block's references split among them)."""
    pool = p.held_multiset()
    segs = []
    for _ in range(c.int(min_segs, 3, label + "nseg")):
        k = c.int(0, min(3, len(pool)), label + "seg_len")
        seg = c.shuffled(pool)[:k]
        for b in seg:
            pool.remove(b)
        segs.append(seg)
    return segs


def v_free_batched(p, c):
    _free_batched(p, held_segments(p, c, 0, ""))


def _free_batched(p, segs, followups=(), single=None):
    flat, offs = flat_segments(segs)
    calls = [lambda pool, s=s: pool.free_blocks(s) for s in segs]
    p.batched(f"free_batched({segs})", calls, lambda dev: dev.free_batched(i32(flat), i32(offs)), None,
              followups, single)


def v_touch_batched(p, c):
    ids = [c.int(0, p.n - 1, "tb") for _ in range(c.int(0, 4, "tb_len"))]
    p.batched(f"touch_batched({ids})", [lambda pool: pool.touch(ids)], lambda dev: dev.touch_batched(i32(ids)))


VALID = [v_get_new_blocks, v_get_new_blocks, v_free_blocks, v_free_blocks, v_touch, v_unpin, v_cache_full,
         v_cache_full, v_cache_partial, v_move, v_evict, v_reset, v_queries, v_allocate_batched, v_free_batched,
         v_touch_batched]


# =================================================================================================
# Invalid ops, by kind. Each returns False when the current state offers no such fault.
# =================================================================================================

def f_get_negative(p, c):
    n = c.pick([-1, -2, -(2**31), -(2**40)], "neg")
    p.expect_fail(f"get_new_blocks({n})", "get_new_blocks", InvalidCountError,
                  lambda pool: pool.get_new_blocks(n), lambda pool: pool.get_new_blocks(n), n)


def f_get_too_many(p, c):
    n = c.pick([len(p.free()) + 1, len(p.free()) + 2, p.n, p.n + 1, 2**31, 2**40], "too_many")
    if n <= len(p.free()):
        n = len(p.free()) + 1
    p.expect_fail(f"get_new_blocks({n})", "get_new_blocks", OutOfBlocksError,
                  lambda pool: pool.get_new_blocks(n), lambda pool: pool.get_new_blocks(n), n)


def f_get_not_int(p, c):
    n = c.pick([1.0, "1", None, True, torch.tensor(1.0)], "not_int")
    p.expect_fail(f"get_new_blocks({n!r})", "get_new_blocks", ArgumentTypeError,
                  lambda pool: pool.get_new_blocks(n), lambda pool: pool.get_new_blocks(n))


def f_free_bad_id(p, c):
    ids = release_pick(p, c)
    x = bad_id(p, c)
    ids = insert(c, ids, x)
    a, b = ids_args(c, ids)
    p.expect_fail(f"free_blocks({ids})", "free_blocks", InvalidBlockIdError,
                  lambda pool: pool.free_blocks(a), lambda pool: pool.free_blocks(b), x)


def f_free_double(p, c):
    """A held block listed one more time than its ref count (or a free block), among valid releases."""
    refs = p.refs()
    if p.held() and c.chance(60, "over"):
        x = c.pick(p.held(), "dbl")
        ids = [x] * (refs[x] + 1)
    elif p.free():
        x = c.pick(p.free(), "free_one")
        ids = [x]
    else:
        return False
    others = [b for b in release_pick(p, c) if b != x]
    ids = c.shuffled(ids + others)
    a, b = ids_args(c, ids)
    p.expect_fail(f"free_blocks({ids})", "free_blocks", DoubleFreeError,
                  lambda pool: pool.free_blocks(a), lambda pool: pool.free_blocks(b), x)


def f_free_not_ids(p, c):
    arg = c.pick([None, "12", [1.5], [True], [None], 3], "not_ids")
    p.expect_fail(f"free_blocks({arg!r})", "free_blocks", ArgumentTypeError,
                  lambda pool: pool.free_blocks(arg), lambda pool: pool.free_blocks(arg))


def _bad_tensor(c, ids):
    """(tensor, reference rejects it too): float / bool tensors fail on both pools (integer tensors of
    any dtype are ids for both: test_int64_id_tensors_agree)."""
    kind = c.pick(["float32", "bool", "float64"], "bad_dtype")
    dtype = getattr(torch, kind)
    t = torch.tensor(ids if kind != "bool" else [True] * len(ids), device=DEVICE).to(dtype)
    return t, True


def f_ids_dtype(p, c):
    op = c.pick(["free_blocks", "touch", "unpin_blocks", "evict_blocks", "cache_full_blocks"], "dtype_op")
    ids = release_pick(p, c) if op in ("free_blocks", "unpin_blocks") else [c.int(0, p.n - 1, "dt_id")]
    if op == "unpin_blocks":
        ids = [x for x in ids if x]
    if not ids:
        ids = [0] if op != "unpin_blocks" else []
    if not ids:
        return False
    t, ref_rejects = _bad_tensor(c, ids)
    cr, cd = p.callbacks()
    hs = UNIVERSE[: len(ids)]

    def call(pool, cb):
        if op == "unpin_blocks":
            return pool.unpin_blocks(t, cb)
        if op == "cache_full_blocks":
            return pool.cache_full_blocks(t, hs, 0, len(ids), 16)
        return getattr(pool, op)(t)
    p.expect_fail(f"{op}(tensor {ids} of {t.dtype})", op, ArgumentTypeError,
                  (lambda pool: call(pool, cr)) if ref_rejects else None, lambda pool: call(pool, cd))


def bad_id_in_list(p, c, method: str, label: str):
    """``method(ids)`` with one bad id among valid ones fails with InvalidBlockIdError on both pools."""
    ids = [c.int(0, p.n - 1, label) for _ in range(c.int(0, 3, f"{label}_len"))]
    x = bad_id(p, c)
    ids = insert(c, ids, x)
    a, b = ids_args(c, ids)
    p.expect_fail(f"{method}({ids})", method, InvalidBlockIdError, lambda pool: getattr(pool, method)(a),
                  lambda pool: getattr(pool, method)(b), x)


def f_touch_bad_id(p, c):
    bad_id_in_list(p, c, "touch", "t_id")


def f_unpin_null(p, c):
    ids = insert(c, [x for x in release_pick(p, c, 3) if x], 0)
    a, b = ids_args(c, ids)
    cr, cd = p.callbacks()
    p.expect_fail(f"unpin_blocks({ids})", "unpin_blocks", NullBlockError, lambda pool: pool.unpin_blocks(a, cr),
                  lambda pool: pool.unpin_blocks(b, cd), 0)


def f_unpin_free(p, c):
    refs = p.refs()
    if p.free() and (not p.held() or c.chance(50, "unpin_free")):
        x = c.pick(p.free(), "uf")
        ids = [x]
    elif p.held():
        x = c.pick(p.held(), "uo")
        ids = [x] * (refs[x] + 1)
    else:
        return False
    others = [b for b in release_pick(p, c, 3) if b and b != x]
    ids = c.shuffled(ids + others)
    a, b = ids_args(c, ids)
    cr, cd = p.callbacks()
    p.expect_fail(f"unpin_blocks({ids})", "unpin_blocks", DoubleFreeError, lambda pool: pool.unpin_blocks(a, cr),
                  lambda pool: pool.unpin_blocks(b, cd), x)


def f_unpin_bad(p, c):
    ids = [x for x in release_pick(p, c, 3) if x]
    if c.chance(50, "unpin_bad_id"):
        x = bad_id(p, c)
        ids = insert(c, ids, x)
        a, b = ids_args(c, ids)
        cr, cd = p.callbacks()
        p.expect_fail(f"unpin_blocks({ids})", "unpin_blocks", InvalidBlockIdError,
                      lambda pool: pool.unpin_blocks(a, cr), lambda pool: pool.unpin_blocks(b, cd), x)
    else:
        cb = c.pick([None, 3, "cb"], "not_callable")
        a, b = ids_args(c, ids)
        p.expect_fail(f"unpin_blocks({ids}, {cb!r})", "unpin_blocks", ArgumentTypeError,
                      lambda pool: pool.unpin_blocks(a, cb), lambda pool: pool.unpin_blocks(b, cb))


def f_cache_full_recache(p, c):
    """Re-caching a block at the same (or a longer) token count: HashConflictError."""
    if not p.caching or not p.keyed():
        return False
    x = c.pick(p.keyed(), "rc_block")
    t = p.ref.hash_num_tokens[x]
    pos = c.int(0, 2, "rc_pos")  # x at index pos: covers (pos + 1) * bs tokens
    if t % (pos + 1):
        pos = 0
    bs = t // (pos + 1)
    if c.chance(30, "shorter") and bs > 1:
        bs = c.int(1, bs - 1, "rc_bs")
    others = [b for b in p.unkeyed() if b != x]
    if len(others) < pos:
        pos, bs = 0, t
    ids = c.shuffled(others)[:pos] + [x]
    hs = _chain(c, len(ids))
    a, b = ids_args(c, ids)
    p.expect_fail(f"cache_full_blocks({ids}, nc=0, nf={len(ids)}, bs={bs}) over {t} cached tokens",
                  "cache_full_blocks", HashConflictError, lambda pool: pool.cache_full_blocks(a, hs, 0, len(ids), bs),
                  lambda pool: pool.cache_full_blocks(b, hs, 0, len(ids), bs), x)


def f_cache_full_twice(p, c):
    if not p.caching:
        return False
    x = c.int(1, p.n - 1, "tw_block")
    ids = [x, x]
    if c.chance(50, "tw_more"):
        others = [b for b in range(1, p.n) if b != x]
        ids = c.shuffled(others)[: c.int(0, 2, "tw_others")] + ids
        ids = c.shuffled(ids)
    hs = _chain(c, len(ids))
    a, b = ids_args(c, ids)
    # BIG_BS: every new key covers more tokens than any key the generators made, so no HashConflict
    # comes first; the second listing of x is the fault.
    p.expect_fail(f"cache_full_blocks({ids}, nc=0, nf={len(ids)}, bs={BIG_BS})", "cache_full_blocks",
                  InvalidArgumentError, lambda pool: pool.cache_full_blocks(a, hs, 0, len(ids), BIG_BS),
                  lambda pool: pool.cache_full_blocks(b, hs, 0, len(ids), BIG_BS), x)


def f_cache_full_lengths(p, c):
    """Too few ids, hashes or mask entries for num_full_blocks; hashes that are not bytes."""
    if not p.caching:
        return False
    ids = [c.int(1, p.n - 1, "ln_id") for _ in range(c.int(1, 4, "ln_len"))]
    ids = list(dict.fromkeys(ids))
    nf = len(ids)
    hs = _chain(c, nf)
    mask = None
    kind = c.pick(["ids", "hashes", "mask", "not_bytes"], "len_kind")
    value = nf
    if kind == "ids":
        nf = len(ids) + c.int(1, 3, "extra_nf")
        hs = _chain(c, nf)
        value = nf
    elif kind == "hashes":
        hs = hs[: c.int(0, nf - 1, "nh")]
    elif kind == "mask":
        mask = [True] * c.int(0, nf - 1, "nm")
        value = len(mask)
    else:
        hs = list(hs)
        hs[c.int(0, nf - 1, "nb_pos")] = c.pick(["str", 7, None, UNIVERSE[0].hex()], "nb")
        value = ANY
    a, b = ids_args(c, ids)
    p.expect_fail(f"cache_full_blocks({ids}, {len(hs)} hashes, nf={nf}, mask={mask})", "cache_full_blocks",
                  ArgumentTypeError if kind == "not_bytes" else InvalidArgumentError, lambda pool: pool.cache_full_blocks(a, hs, 0, nf, BIG_BS, 0, mask),
                  lambda pool: pool.cache_full_blocks(b, hs, 0, nf, BIG_BS, 0, mask), value)


def f_cache_full_counts(p, c):
    """A negative num_cached_blocks, a non-positive block size (checked even when there is nothing to
    cache), an out-of-range id (likewise)."""
    ids = [c.int(0, p.n - 1, "cn_id") for _ in range(c.int(1, 3, "cn_len"))]
    hs = _chain(c, len(ids))
    kind = c.pick(["nc", "bs", "id"], "cn_kind")
    nc, nf, bs = 0, len(ids), 16
    if kind == "nc":
        nc = c.pick([-1, -5], "neg_nc")
        exc, value = InvalidCountError, nc
    elif kind == "bs":
        bs = c.pick([0, -16], "bad_bs")
        nc = c.int(0, len(ids), "bs_nc")
        exc, value = InvalidArgumentError, bs
    else:
        value = bad_id(p, c)
        ids = insert(c, ids, value)
        nc = c.int(0, len(ids), "id_nc")
        nf = c.int(0, len(ids), "id_nf")
        hs = _chain(c, len(ids))
        exc = InvalidBlockIdError
    a, b = ids_args(c, ids)
    p.expect_fail(f"cache_full_blocks({ids}, nc={nc}, nf={nf}, bs={bs})", "cache_full_blocks", exc,
                  lambda pool: pool.cache_full_blocks(a, hs, nc, nf, bs),
                  lambda pool: pool.cache_full_blocks(b, hs, nc, nf, bs), value)


def f_cache_partial_capacity(p, c):
    """A block holding max_keys_per_block keys gets one more (not a promotion): KeyCapacityError."""
    if not p.caching:
        return False
    full = [b for b in p.keyed() if len(p.ref.keys[b]) >= p.mk]
    if not full:
        return False
    x = c.pick(full, "cap_block")
    have = set(p.ref.keys[x])
    g = c.pick([0, 1], "cap_g")
    fresh = [hh for hh in UNIVERSE if (hh, g) not in have]
    hh = c.pick(fresh, "cap_hash")
    t = p.ref.hash_num_tokens[x]
    hbs = c.pick([hb for hb in (4, 8, 16) if hb <= t] or [4], "cap_hbs")
    k = c.int(1, max(1, min(4, t // hbs)), "cap_k")  # num_tokens = k * hbs <= t: not a promotion
    hs = [c.pick(UNIVERSE, "cap_parent") for _ in range(k - 1)] + [hh]
    p.expect_fail(f"cache_partial_block({x}, nt={k * hbs}, g={g}) with {len(have)} keys", "cache_partial_block",
                  KeyCapacityError, lambda pool: pool.cache_partial_block(x, hs, k * hbs, g, 16, hbs),
                  lambda pool: pool.cache_partial_block(x, hs, k * hbs, g, 16, hbs), x)


def f_cache_partial_args(p, c):
    x = c.int(0, p.n - 1, "pa_block")
    hs = [c.pick(UNIVERSE, "pa_hash") for _ in range(c.int(1, 3, "pa_len"))]
    kind = c.pick(["bs", "hbs", "nt_odd", "k_zero", "k_big", "nt_neg", "id", "not_bytes"], "pa_kind")
    bs, hbs, nt, exc = 16, 4, 4, InvalidArgumentError
    if kind == "bs":
        bs = c.pick([6, 10, 0, -16], "pa_bs")  # not a positive multiple of hbs = 4
        value = bs
    elif kind == "hbs":
        hbs = c.pick([0, -4, 32], "pa_hbs")
        value = bs
    elif kind == "nt_odd":
        nt = c.pick([1, 5, 6, 7], "pa_nt")
        value = nt
    elif kind == "k_zero":
        nt = 0
        value = 0
    elif kind == "k_big":
        nt = (len(hs) + c.int(1, 3, "pa_over")) * hbs
        value = nt
    elif kind == "nt_neg":
        nt = -hbs * c.int(1, 3, "pa_neg")
        value = nt
    elif kind == "id":
        x = bad_id(p, c, tensor_ok=False)
        exc, value = InvalidBlockIdError, x
    else:
        hs = list(hs)
        hs[0] = "not bytes"
        exc, value = ArgumentTypeError, ANY
    p.expect_fail(f"cache_partial_block({x}, {len(hs)} hashes, nt={nt}, bs={bs}, hbs={hbs})", "cache_partial_block",
                  exc, lambda pool: pool.cache_partial_block(x, hs, nt, 0, bs, hbs),
                  lambda pool: pool.cache_partial_block(x, hs, nt, 0, bs, hbs), value)


def f_move(p, c):
    kind = c.pick(["dst_null", "dst_keyed", "bad", "not_int"], "mv_kind")
    src = c.int(0, p.n - 1, "mv_src")
    if kind == "dst_null":
        dst, exc, value = 0, NullBlockError, 0
    elif kind == "dst_keyed":
        keyed = [b for b in p.keyed() if b != src] or p.keyed()
        if not keyed:
            return False
        dst, exc, value = c.pick(keyed, "mv_dst"), HashConflictError, None
        value = dst
    elif kind == "bad":
        x = bad_id(p, c, tensor_ok=False)
        src, dst = (x, c.int(1, p.n - 1, "mv_d")) if c.chance(50, "bad_src") else (src, x)
        exc, value = InvalidBlockIdError, x
    else:
        dst, exc, value = c.pick([1.0, "1", None], "mv_dst_bad"), ArgumentTypeError, ANY
    p.expect_fail(f"move_block_hashes({src!r}, {dst!r})", "move_block_hashes", exc,
                  lambda pool: pool.move_block_hashes(src, dst), lambda pool: pool.move_block_hashes(src, dst), value)


def f_evict_bad(p, c):
    bad_id_in_list(p, c, "evict_blocks", "ev")


def f_queries(p, c):
    kind = c.pick(["hash", "group", "writable", "writable_type"], "q_kind")
    if kind == "hash":
        hh = c.pick(["abc", 5, None, [UNIVERSE[0]]], "q_hash")
        p.expect_fail(f"get_cached_block({hh!r}, [0])", "get_cached_block", ArgumentTypeError,
                      lambda pool: pool.get_cached_block(hh, [0]), lambda pool: pool.get_cached_block(hh, [0]))
    elif kind == "group":
        g = c.pick(["0", 0.0, None], "q_group")
        groups = [g] + c.pick([[], [0]], "q_more")  # the bad group first (see test_get_cached_block_checks_every_group)
        p.expect_fail(f"get_cached_block(H0, {groups!r})", "get_cached_block", ArgumentTypeError,
                      lambda pool: pool.get_cached_block(UNIVERSE[0], groups),
                      lambda pool: pool.get_cached_block(UNIVERSE[0], groups))
    elif kind == "writable":
        x = bad_id(p, c, tensor_ok=False)
        p.expect_fail(f"is_block_writable({x})", "is_block_writable", InvalidBlockIdError,
                      lambda pool: pool.is_block_writable(x), lambda pool: pool.is_block_writable(x), x)
    else:
        x = c.pick([1.0, "1", None], "q_wr")
        p.expect_fail(f"is_block_writable({x!r})", "is_block_writable", ArgumentTypeError,
                      lambda pool: pool.is_block_writable(x), lambda pool: pool.is_block_writable(x))


def _followups(p, c):
    """Valid batched ops (each would succeed on its own) to launch after a failing one, before check()."""
    out = []
    for _ in range(c.int(0, 3, "n_followups")):
        kind = c.pick(["alloc", "touch", "free"], "followup")
        if kind == "alloc":
            k = min(1, len(p.free()))
            out.append(lambda dev, k=k: dev.allocate_batched(i32([k])))
        elif kind == "touch":
            x = c.int(0, p.n - 1, "fu_touch")
            out.append(lambda dev, x=x: dev.touch_batched(i32([x])))
        elif p.held():
            x = c.pick(p.held(), "fu_free")
            out.append(lambda dev, x=x: dev.free_batched(i32([x]), i32([0, 1])))
    return out


def _single_followup(p, c):
    """Maybe a valid single op that must raise the pending batched error instead of running."""
    if not c.chance(25, "single_followup"):
        return None
    x = c.int(0, p.n - 1, "sf")
    return lambda dev: dev.touch([x])


def f_allocate_batched(p, c):
    free = len(p.free())
    demands = [c.int(0, max(1, free // 2), "fd") for _ in range(c.int(1, 3, "fnd"))]
    i = c.int(0, len(demands) - 1, "bad_at")
    demands[i] = c.pick([-1, -3, free + 1, p.n + 2], "bad_demand")
    _alloc_batched(p, c, demands, _followups(p, c), _single_followup(p, c))


def f_free_batched(p, c):
    segs = held_segments(p, c, 1, "f")
    j = c.int(0, len(segs) - 1, "bad_seg")
    kind = c.pick(["bad", "double", "free"], "fb_kind")
    if kind == "bad":
        x = c.pick([-1, p.n, p.n + 5], "fb_bad")
    elif kind == "double" and p.held():
        x = c.pick(p.held(), "fb_dbl")
        segs[j] = segs[j] + [x] * (p.refs()[x] + 1)
        x = None
    elif p.free():
        x = c.pick(p.free(), "fb_free")
    else:
        x = -1
    if x is not None:
        segs[j] = insert(c, segs[j], x)
    _free_batched(p, segs, _followups(p, c), _single_followup(p, c))


def f_touch_batched(p, c):
    ids = [c.int(0, p.n - 1, "ftb") for _ in range(c.int(0, 3, "ftb_len"))]
    ids = insert(c, ids, c.pick([-1, p.n, p.n + 9], "ftb_bad"))
    p.batched(f"touch_batched({ids})", [lambda pool: pool.touch(ids)], lambda dev: dev.touch_batched(i32(ids)),
              None, _followups(p, c), _single_followup(p, c))


def f_batched_dtype(p, c):
    """Batched ops take int32 device tensors only: anything else raises InvalidArgumentError at once
    (not through the status word) and changes nothing on the device."""
    kind = c.pick(["alloc", "free_ids", "free_offsets", "touch", "alloc_list", "touch_list"], "bd_kind")
    ids = p.held()[:1] or [0]
    bad = c.pick([torch.int64, torch.float32, torch.int16], "bd_dtype")
    op, fn = {
        "alloc": ("allocate_batched", lambda dev: dev.allocate_batched(torch.tensor([1], dtype=bad, device=DEVICE))),
        "alloc_list": ("allocate_batched", lambda dev: dev.allocate_batched([1])),
        "free_ids": ("free_batched", lambda dev: dev.free_batched(torch.tensor(ids, dtype=bad, device=DEVICE),
                                                                i32([0, len(ids)]))),
        "free_offsets": ("free_batched",
                         lambda dev: dev.free_batched(i32(ids), torch.tensor([0, len(ids)], dtype=bad, device=DEVICE))),
        "touch": ("touch_batched", lambda dev: dev.touch_batched(torch.tensor(ids, dtype=bad, device=DEVICE))),
        "touch_list": ("touch_batched", lambda dev: dev.touch_batched(list(ids))),
    }[kind]
    p.expect_fail(f"{op}({kind}, {bad})", op, ArgumentTypeError if kind.endswith("_list") else InvalidArgumentError,
                  None, fn)
    assert int(p.dev.state.status[0]) == 0, "a host-side argument error must not set the status word"


def f_other_device(p, c):
    """A tensor on another device than the pool's (only testable with CUDA)."""
    if DEVICE != "cuda":
        return False
    ids = p.held()[:1] or [0]
    t = torch.tensor(ids, dtype=torch.int32, device="cpu")
    op = c.pick(["free_blocks", "touch", "evict_blocks", "touch_batched"], "od_op")
    p.expect_fail(f"{op}(cpu tensor)", op, InvalidArgumentError, None, lambda dev: getattr(dev, op)(t))


FAULTS = {
    "get_negative": f_get_negative, "get_too_many": f_get_too_many, "get_not_int": f_get_not_int,
    "free_bad_id": f_free_bad_id, "free_double": f_free_double, "free_not_ids": f_free_not_ids,
    "ids_dtype": f_ids_dtype, "touch_bad_id": f_touch_bad_id, "unpin_null": f_unpin_null,
    "unpin_free": f_unpin_free, "unpin_bad": f_unpin_bad, "cache_full_recache": f_cache_full_recache,
    "cache_full_twice": f_cache_full_twice, "cache_full_lengths": f_cache_full_lengths,
    "cache_full_counts": f_cache_full_counts, "cache_partial_capacity": f_cache_partial_capacity,
    "cache_partial_args": f_cache_partial_args, "move": f_move, "evict_bad": f_evict_bad, "queries": f_queries,
    "allocate_batched": f_allocate_batched, "free_batched": f_free_batched, "touch_batched": f_touch_batched,
    "batched_dtype": f_batched_dtype, "other_device": f_other_device,
}


def step(p: FaultPair, c, fault_pct: int) -> None:
    """One op: a fault of a random kind with probability ``fault_pct`` %, else a valid op."""
    if c.chance(fault_pct, "fault?"):
        kind = c.pick(sorted(FAULTS), "fault")
        if FAULTS[kind](p, c) is not False:
            return
    c.pick(VALID, "op")(p, c)


# =================================================================================================
