"""Bad input, faults and invariants (docs/semantics.md section 3), on both pools side by side.

Every public op of :class:`gpupool.ReferenceBlockPool` and of the device :class:`gpupool.BlockPool`
checks its input before changing anything. Here random sequences mix valid ops with invalid ones of
every kind the issue lists:

* ids out of range (lists and int32 tensors), the null block where it is not allowed (``unpin_blocks``,
  the target of ``move_block_hashes``), negative or too-large counts (``get_new_blocks``,
  ``num_cached_blocks``, ``num_full_blocks``, ``block_size``, ``num_tokens``), a double free (a block
  listed more times than its ref count, or a free block), unpin of a free block, re-caching a block at
  the same (or a longer) length, a block listed twice, too few ids / hashes / mask entries for
  ``num_full_blocks``, a full key row (``max_keys_per_block``), non-bytes hashes, non-int ids,
  non-callable watchers;
* for the device pool: int64 / float / bool tensors of ids (``InvalidArgumentError``, raised at once,
  also for the batched ops), tensors on another device (only with CUDA), and the batched ops
  (``allocate_batched``, ``free_batched``, ``touch_batched``) whose errors go to the sticky status word:
  ``check()`` raises the class the single op would raise, a valid batched op issued after the failing
  one and before ``check()`` does nothing, and so does a single op (which raises the pending error).

After each invalid op: the right error class on each pool, naming the op (and the offending value
where both pools report one), and a digest of the *full* state equal to the digest before: for the
reference its queue links, ref counts, keys, covered tokens, key-map entry order, watchers and
pending events; for the device every state tensor bit for bit (ring, qslot, control words, key rows,
table, overflow counts, watchers, scratch, event and reuse buffers) plus the host's pending events
and callback table. After every op both pools agree on the whole observable state (free-queue order,
ref counts, every block's keys and ``hash_num_tokens``, ``num_free``, watchers, events, watcher
firings, lookups of every hash used) and ``validate()`` passes on both.

The harness (:class:`Pair`, the op generators) is shared with ``tests/test_soak.py``: generators
draw through a small chooser, backed by hypothesis here and by a seeded ``random.Random`` there.

Regression tests for the defects found while writing this file follow; at the end, bad Python
arguments (``None``, floats, non-bytes hashes) raise a typed :class:`PoolError` (``ArgumentTypeError``
for a wrong type) on both pools and both managers, changing nothing; int64 id tensors are accepted;
a pool larger than int32 ids allow is refused.
Without a GPU the kernels run in Triton's interpreter (tests/conftest.py). The default hypothesis
profile keeps this file near a minute on two cores; ``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs more.
"""
from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:  # normally done by tests/conftest.py
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import copy  # noqa: E402
import hashlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import note as _hnote  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402

from gpupool import BlockPool, ReferenceBlockPool  # noqa
from gpupool.kernels.layout import Ctrl, Op  # noqa: E402
from gpupool.errors import (  # noqa: E402
    ArgumentTypeError, DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError,
    KeyCapacityError, NullBlockError, OutOfBlocksError, PoolError,
)
from gpupool.keys import device_key  # noqa: E402
from gpupool.manager import KVCacheManager  # noqa: E402
from gpupool.reference import ReferenceKVCacheManager  # noqa: E402

from harness.compare import assert_pools_agree  # noqa: E402
from harness.device import DEVICE, i32, i64  # noqa: E402
from harness.keys import h  # noqa: E402
from harness.sizes import pow2_at_least  # noqa: E402
from harness.state import ints, pool_state  # noqa: E402
from harness.twins import POOL_IDS, POOLS, pool_twin, small_manager  # noqa: E402
from harness.watchers import reuse_callbacks  # noqa: E402

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

class Pair:
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


def release_pick(p: Pair, c, max_len=5) -> list[int]:
    """A valid release: held blocks, each at most its ref count times, shuffled; maybe a null block."""
    pool = p.held_multiset()
    k = c.int(0, min(len(pool), max_len), "rel_len")
    chosen = c.shuffled(pool)[:k]
    if c.chance(15, "rel_null"):
        chosen.insert(c.int(0, len(chosen)), 0)
    return chosen


def bad_id(p: Pair, c, tensor_ok=True) -> int:
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
    flat = [b for s in segs for b in s]
    offs = [0]
    for s in segs:
        offs.append(offs[-1] + len(s))
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


def step(p: Pair, c, fault_pct: int) -> None:
    """One op: a fault of a random kind with probability ``fault_pct`` %, else a valid op."""
    if c.chance(fault_pct, "fault?"):
        kind = c.pick(sorted(FAULTS), "fault")
        if FAULTS[kind](p, c) is not False:
            return
    c.pick(VALID, "op")(p, c)


# =================================================================================================
# Hypothesis fuzz
# =================================================================================================

EXAMPLES = max(3, settings().max_examples // 2)  # "dev" profile: 3; "ci": 12; "deep": 500
# Shrinking re-runs whole interpreted op sequences (minutes); the failing example's op log is printed
# either way (hypothesis notes). GPUPOOL_FAULTS_SHRINK=1 turns it back on.
PHASES = tuple(Phase) if os.environ.get("GPUPOOL_FAULTS_SHRINK") else tuple(p for p in Phase if p != Phase.shrink)


@settings(max_examples=EXAMPLES, deadline=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(st.data())
def test_mixed_valid_and_invalid_ops_on_both_pools(data):
    """Random mixes of valid and invalid ops (single and batched) on small pools: right error class,
    full-state digests unchanged by every fault, pools equal and valid after every op."""
    c = HypChooser(data)
    n = c.pick([2, 5, 8, 12], "num_blocks")
    pair = Pair(n, caching=c.chance(85, "caching"), events=c.chance(50, "events"), mk=c.pick([1, 2, 4], "mk"),
                ring=pow2_at_least(n) if c.chance(40, "small_ring") else None)
    for _ in range(c.int(10, 22, "steps")):
        step(pair, c, fault_pct=50)


# =================================================================================================
# Every fault kind at least once, on a prepared pool (independent of the fuzz's luck)
# =================================================================================================

class _Prepared:
    """A pool pair with held blocks (some keyed, one with a full key row), free cached blocks,
    free un-hashed blocks and a registered watcher. Rebuilt after a failing test."""

    pair: Pair | None = None

    @classmethod
    def get(cls) -> Pair:
        if cls.pair is None:
            p = Pair(10, events=True, mk=2)
            p.run("get 7", lambda pool: pool.get_new_blocks(7), norm=ints)  # 1..7 held
            hs = UNIVERSE[:5]
            p.used.update(hs)
            p.run("cache 1..5", lambda pool: pool.cache_full_blocks([1, 2, 3, 4, 5], hs, 0, 5, 16))
            p.used.add(UNIVERSE[9])
            p.run("secondary on 1", lambda pool: pool.cache_partial_block(1, [UNIVERSE[9]], 8, 1, 16, 8))
            p.run("touch 2,6", lambda pool: pool.touch([2, 6, 6]))
            p.run("free 5,4", lambda pool: pool.free_blocks([5, 4]))  # free, cached
            cr, cd = p.callbacks()
            p.run("unpin 3", lambda pool: pool.unpin_blocks([3], cr), lambda pool: pool.unpin_blocks([3], cd))
            assert p.free() and p.held() and any(len(k) == 2 for k in p.ref.keys)
            cls.pair = p
        return cls.pair


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_each_fault_kind(kind):
    """Several draws of one fault kind (seeded) on the prepared pools; a kind with nothing to hit here
    (``other_device`` without CUDA) is skipped."""
    if kind == "other_device" and DEVICE != "cuda":
        pytest.skip("tensors on another device need a CUDA pool")
    try:
        p = _Prepared.get()
        rng = random.Random(kind)
        hits = 0
        for _ in range(6):
            before = pool_state(p.ref)
            if FAULTS[kind](p, RandChooser(rng)) is not False:
                hits += 1
            assert pool_state(p.ref) == before
        assert hits, f"fault kind {kind} never applied"
    except BaseException:
        _Prepared.pair = None
        raise


# =================================================================================================
# Sticky status, spelled out
# =================================================================================================

def test_sticky_status_word_blocks_later_batched_ops_until_check():
    """A failing free_batched, then valid allocate / touch / free batched ops: nothing changes on the
    device (bit for bit, status aside), check() raises DoubleFreeError and clears; the reference, which
    saw none of it, still equals the device; afterwards the same valid ops apply normally."""
    p = Pair(8, events=True)
    p.run("get 4", lambda pool: pool.get_new_blocks(4), norm=ints)
    p.used.update(UNIVERSE[:2])
    p.run("cache", lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 2, 16))
    ref_before, dev_before = ref_digest(p.ref), dev_digest(p.dev)
    dev_digest_before_ns = dev_digest(p.dev, status=False)
    p.dev.free_batched(i32([1, 2, 2]), i32([0, 1, 3]))  # segment 1 frees block 2 twice
    assert p.dev.state.status.tolist()[:3] == [DoubleFreeError.code, Op.FREE_BATCHED, 2]
    p.dev.allocate_batched(i32([2]))
    p.dev.touch_batched(i32([5, 6]))
    p.dev.free_batched(i32([3]), i32([0, 1]))
    assert dev_digest(p.dev, status=False) == dev_digest_before_ns
    with pytest.raises(DoubleFreeError) as info:
        p.dev.check()
    assert info.value.op == "free_batched" and info.value.value == 2
    assert dev_digest(p.dev) == dev_before and ref_digest(p.ref) == ref_before
    p.dev.check()
    p.compare()
    p.batched("allocate_batched([2])", [lambda pool: ints(pool.get_new_blocks(2))],
              lambda dev: dev.allocate_batched(i32([2])), lambda out: [ints(out[0])[: ints(out[1])[1]]])
    p.batched("touch_batched([5, 6])", [lambda pool: pool.touch([5, 6])], lambda dev: dev.touch_batched(i32([5, 6])))


# =================================================================================================
# Regression tests for the defects this file found (all fixed)
# =================================================================================================

def test_a_key_table_that_could_fill_is_refused():
    """The device table is sized so it never fills: 16 * num_chunks >= (N - 1) * max_keys_per_block.
    A smaller table (one that a run could overflow) is an InvalidArgumentError at construction; a table
    exactly at its limit is accepted (the soak fills it)."""
    with pytest.raises(InvalidArgumentError, match="num_chunks"):
        BlockPool(9, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 32 keys, 16 slots
    p = BlockPool(5, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 16 keys, 16 slots
    p.get_new_blocks(4)
    p.cache_full_blocks([1, 2, 3, 4], UNIVERSE[:4], 0, 4, 16)
    for i in range(12):
        p.cache_partial_block(1 + i % 4, [h(f"extra{i}")], 4, 0, 16, 4)
    assert sum(len(p.block_keys(b)) for b in range(5)) == 16
    p.validate()


@pytest.mark.parametrize("case", ["cache_full_2**31", "cache_full_2**30_x2", "cache_partial_2**32"])
def test_too_large_token_counts_are_rejected(case):
    p = Pair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    fn = {
        "cache_full_2**31": lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 1, 2**31),
        "cache_full_2**30_x2": lambda pool: pool.cache_full_blocks([1, 2], UNIVERSE[:2], 0, 2, 2**30),
        "cache_partial_2**32": lambda pool: pool.cache_partial_block(1, [UNIVERSE[0]], 2**32, 0, 2**32, 2**32),
    }[case]
    p.run(case, fn)  # both pools must raise the same class, unchanged (or agree on the result)
    assert any(k.startswith("incidental") for k in p.stats), f"{case}: a token count >= 2**31 was accepted"


@pytest.mark.parametrize("g", [2**40, 2**70])
def test_large_group_ids_agree(g):
    p = Pair(5)
    p.run("get 1", lambda pool: pool.get_new_blocks(1), norm=ints)
    p.run(f"cache g={g}", lambda pool: pool.cache_full_blocks([1], UNIVERSE[:1], 0, 1, 16, g))
    p.run(f"lookup g={g}", lambda pool: pool.get_cached_block(UNIVERSE[0], [g]),
          norm=lambda x: None if x is None else ints(x))


@pytest.mark.parametrize("case", ["hi_int32", "list"])
def test_lookup_batched_checks_its_tensors(case):
    p = Pair(5)
    p.run("get 1", lambda pool: pool.get_new_blocks(1), norm=ints)
    p.run("cache", lambda pool: pool.cache_full_blocks([1], UNIVERSE[:1], 0, 1, 16))
    hi, lo = device_key(UNIVERSE[0], 0)
    args = {
        "hi_int32": (i64([hi]).to(torch.int32), i64([lo]), i32([0])),
        "list": ([hi], [lo], [0]),
    }[case]
    with pytest.raises(InvalidArgumentError):
        p.dev.lookup_batched(*args)


_SEG_OFFSETS_REPRO = textwrap.dedent("""
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from gpupool import BlockPool
    from gpupool.errors import InvalidArgumentError
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool = BlockPool(9, device=dev)
    pool.get_new_blocks(2)
    before = pool.ref_counts()
    try:
        # seg_offsets[-1] == 1 but 2 ids: the kernel reads seg_offsets out of bounds
        pool.free_batched(torch.tensor([1, 2], dtype=torch.int32, device=dev),
                          torch.tensor([0, 1], dtype=torch.int32, device=dev))
        pool.check()
    except InvalidArgumentError:
        assert pool.ref_counts() == before
        print("REJECTED")
""")


def test_free_batched_rejects_mismatched_seg_offsets():
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1" if DEVICE == "cpu" else "0")
    r = subprocess.run([sys.executable, "-c", _SEG_OFFSETS_REPRO], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "REJECTED" in r.stdout, f"rc={r.returncode} {r.stdout[-500:]} {r.stderr[-500:]}"


def test_get_cached_block_checks_every_group():
    p = Pair(5)
    p.expect_fail("get_cached_block(H0, [0, '1'])", "get_cached_block", ArgumentTypeError,
                  lambda pool: pool.get_cached_block(UNIVERSE[0], [0, "1"]),
                  lambda pool: pool.get_cached_block(UNIVERSE[0], [0, "1"]))


def test_two_dimensional_id_tensors_agree():
    p = Pair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    t = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    p.run("touch(2-D tensor)", lambda pool: pool.touch(t))


@pytest.mark.skipif(DEVICE != "cuda", reason="tensors on another device need a CUDA pool")
def test_tensor_on_another_device_is_rejected():
    p = Pair(5)
    p.run("get 2", lambda pool: pool.get_new_blocks(2), norm=ints)
    cpu = torch.tensor([1], dtype=torch.int32)
    for op in ("free_blocks", "touch", "evict_blocks"):
        p.expect_fail(f"{op}(cpu tensor)", op, InvalidArgumentError, None, lambda dev, op=op: getattr(dev, op)(cpu))
    for op, fn in (("allocate_batched", lambda dev: dev.allocate_batched(cpu)),
                   ("touch_batched", lambda dev: dev.touch_batched(cpu)),
                   ("free_batched", lambda dev: dev.free_batched(cpu, torch.tensor([0, 1], dtype=torch.int32)))):
        p.expect_fail(f"{op}(cpu tensor)", op, InvalidArgumentError, None, fn)


# =================================================================================================
# Typed errors for bad Python arguments: both pools, both managers
# =================================================================================================

@pytest.mark.parametrize("cls", POOLS, ids=POOL_IDS)
def test_typed_errors_for_bad_python_arguments(cls):
    p = cls(8)
    b = [int(x) for x in p.get_new_blocks(2)]
    before = pool_state(p)
    cases = [
        lambda: p.cache_full_blocks(b, None, 0, 2, 16, 0),
        lambda: p.cache_full_blocks(b, [h(1), None], 0, 2, 16, 0),
        lambda: p.get_cached_block(h(1), None),
        lambda: p.get_cached_block(h(1), 0),
        lambda: p.get_cached_block(None, [0]),
        lambda: p.get_new_blocks(None),
        lambda: p.get_new_blocks(1.5),
        lambda: p.free_blocks(None),
        lambda: p.touch([None]),
        lambda: p.cache_partial_block(b[0], None, 16, 0, 16, 16),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, (TypeError, ValueError)), (i, info.value)
        assert isinstance(info.value, ArgumentTypeError) or not isinstance(info.value, TypeError), i
    assert pool_state(p) == before


def test_both_pools_accept_int64_id_tensors():
    ref, dev = pool_twin(8)
    for p in (ref, dev):
        b = p.get_new_blocks(3)
        ids = torch.tensor([int(x) for x in b], dtype=torch.int64)
        p.touch(ids)
        p.free_blocks(ids)
        p.cache_full_blocks(ids, [h(1), h(2), h(3)], 0, 3, 16, 0)
        p.free_blocks(torch.flip(ids, [0]))
        p.evict_blocks(ids[:1])
    assert_pools_agree(ref, dev)


@pytest.mark.parametrize("cls", [ReferenceBlockPool, BlockPool])
def test_pool_size_is_bounded_by_int32_ids(cls):
    """Block ids are int32 on the device: both pools refuse more than 2**31 - 1 blocks before
    allocating anything (a typed error, not a MemoryError or an overflow later)."""
    for n in (2**31, 10**11, 0, -1):
        with pytest.raises(InvalidArgumentError, match="num_blocks"):
            cls(n)
    with pytest.raises(ArgumentTypeError):
        cls(16.0)


@pytest.mark.parametrize("cls", [ReferenceKVCacheManager, KVCacheManager], ids=["reference", "device"])
def test_manager_typed_errors(cls):
    """Bad Python arguments raise a PoolError subclass (ArgumentTypeError, also a TypeError, for a
    wrong type) on both managers, changing nothing; a group or length the other rejects too."""
    m = small_manager(cls, groups=("full", "full"))
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    rows = [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    cases = [
        lambda: m.add_request(1, None), lambda: m.add_request(1, [None]), lambda: m.add_request(None, []),
        lambda: m.append_block_hashes(0, None), lambda: m.allocate_slots(None, [1], [1]),
        lambda: m.allocate_slots([0], None, [6]), lambda: m.allocate_slots([0], [6], None),
        lambda: m.allocate_slots([0], [6], [6], 5), lambda: m.allocate_slots([0], [6], [6], [None]),
        lambda: m.free(None), lambda: m.free([1.5]), lambda: m.slot_mapping(None, [0]),
        lambda: m.slot_mapping([0], [0], None), lambda: m.cow_append(0, None), lambda: m.cow_move(0, None),
        lambda: m.get_computed_blocks(None, [1]), lambda: m.get_computed_blocks([0], None),
        lambda: m.release_copied(None),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(PoolError) as info:
            fn()
        assert isinstance(info.value, TypeError), (i, info.value)
    for fn in (lambda: m.slot_mapping([0], [1], 2), lambda: m.slot_mapping([0], [1], -1),
               lambda: m.slot_mapping([0, 0], [1])):
        with pytest.raises(InvalidArgumentError):
            fn()
    assert rows == [m.block_table(g) if cls is ReferenceKVCacheManager else m.rows(g) for g in range(2)]
    m.validate()



def test_a_pool_too_big_for_memory_is_a_pool_error_before_any_allocation(monkeypatch):
    """``BlockPool(2**31 - 1)`` (hundreds of GiB of tensors): InvalidArgumentError naming the size,
    found by sizing the tensors on the meta device, not torch's RuntimeError (or the host's OOM killer);
    and an allocation torch refuses anyway is the same error."""
    from gpupool import BlockPool, memory
    from gpupool.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"num_blocks 2,147,483,647: needs [\d,.]+ GiB"):
        BlockPool(2**31 - 1)
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)  # unknown: torch decides

    real = torch.zeros

    def refuse(*a, device=None, **k):
        if str(device) == "meta":
            return real(*a, device=device, **k)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore")
    monkeypatch.setattr(torch, "zeros", refuse)
    with pytest.raises(InvalidArgumentError, match="num_blocks 1,024: cannot allocate .*DefaultCPUAllocator"):
        BlockPool(1024)
