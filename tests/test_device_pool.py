"""Differential tests: the device ``BlockPool`` against the reference pool, op by op (docs/semantics.md).

Every single op and every batched op of :class:`gpupool.BlockPool` is run side by side with
:class:`gpupool.ReferenceBlockPool` on hypothesis-generated op sequences (small pools, caching and
events on and off, small rings that force compaction, key tables of one or two chunks), and after
every op the whole observable state is compared: free-queue order, ref counts, every block's keys
and covered tokens, ``num_free``, the number of watchers, a lookup of every hash used so far in
both groups, the events (``take_events()``), the reuse-watcher firings, ``validate()`` of both (the
device's, a kernel, every few ops; every op under the deep profile) and a host-side check of the
device layout (ring, key table, overflow counts, idle scratch). Errors must have the same class on
both sides; a batched device op raises at ``check()``.

A batched op is checked against the sequence of single reference calls it replaces (docs/semantics.md,
"Batched forms"): applied as a whole when none of them fails, else nothing, and the error is that
of the first failing call.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
The default hypothesis profile keeps this file to a couple of minutes on two CPU cores;
``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs many more examples.

The side-by-side comparison is :func:`harness.compare.assert_pools_agree` (plus the host-side layout
check, ``harness.compare.host_check_layout``); scenario tests follow the property tests, and at the
end, watchers as per-block flags (many ``unpin_blocks`` calls).
"""
from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:  # normally done by tests/conftest.py
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import event as _event  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpupool import BlockPool  # noqa: E402
from gpupool.kernels.layout import Ctrl  # noqa: E402
from gpupool.errors import (  # noqa: E402
    DoubleFreeError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError, OutOfBlocksError, PoolError,
)
from gpupool.keys import device_key  # noqa: E402

from harness.compare import assert_consistent, assert_pools_agree  # noqa: E402
from harness.device import DEVICE, i32, i64  # noqa: E402
from harness.keys import h  # noqa: E402
from harness.ops import call_both  # noqa: E402
from harness.sizes import pow2_at_least, sized  # noqa: E402
from harness.strategies import note  # noqa: E402
from harness.twins import pool_twin  # noqa: E402
from harness.state import ints, pool_state  # noqa: E402
from harness.watchers import reuse_callbacks  # noqa: E402

CTRL_HEAD, CTRL_COMPACTIONS = Ctrl.HEAD, Ctrl.COMPACTIONS
BS = 16
NUM_HASHES = 10  # the hash universe: small, so keys collide, repeat and get promoted
H = h
HASHES = [H(i) for i in range(NUM_HASHES)]


def event(desc: str, err) -> None:
    """Count which ops ran and how they ended (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        _event(f"{desc.split('(')[0]}: {type(err).__name__ if err is not None else 'ok'}")


# How often compare() runs the device pool's own validate() (a kernel: ~40 ms in the interpreter);
# the host-side layout check (harness.compare.host_check_layout) runs after every op. Every op
# under the deep profile.
DEVICE_VALIDATE_EVERY = 1 if os.environ.get("GPUPOOL_HYPOTHESIS_PROFILE") == "deep" else 4


# =================================================================================================
# The side-by-side harness
# =================================================================================================

class Pair:
    """A reference pool and a device pool with the same configuration, driven op for op."""

    def __init__(self, n, *, caching=True, events=False, mk=4, ring=None, chunks=None, check_lookups=True):
        self.n = n
        self.ref, self.dev = pool_twin(n, enable_caching=caching, enable_kv_cache_events=events,
                                       max_keys_per_block=mk, ring_capacity=ring, num_chunks=chunks)
        self.fired = {"ref": [], "dev": []}
        self.used: set[bytes] = set()  # every hash handed to a caching op so far
        self.check_lookups = check_lookups
        self.ops: list[str] = []
        self.next_tag = 0
        self.compares = -1
        self.requests: list[list[int]] = []  # block tables of admitted requests (op_admit)
        self.compare()

    # ---- watchers ---------------------------------------------------------------------------
    def callbacks(self):
        return reuse_callbacks(self)

    # ---- comparing ----------------------------------------------------------------------------
    def where(self) -> str:
        return "after ops:\n  " + "\n  ".join(self.ops[-12:])

    def compare(self) -> None:
        """The whole state (harness.compare.assert_pools_agree) plus the host-side layout check; the
        device's validate() every DEVICE_VALIDATE_EVERY compares; lookups when ``check_lookups``."""
        self.compares += 1
        assert_pools_agree(self.ref, self.dev, self.fired, self.where(), layout=True,
                           dev_validate=self.compares % DEVICE_VALIDATE_EVERY == 0,
                           used=self.used if self.check_lookups else None)

    def snapshot(self):
        return pool_state(self.ref)

    # ---- running one op on both sides -----------------------------------------------------------
    def do(self, desc, ref_fn, dev_fn, norm=lambda x: x):
        """Run ``ref_fn`` and ``dev_fn``; both must raise the same error class or return equal
        (normalised) values; then the whole state is compared. Returns the reference's result."""
        self.ops.append(desc)
        note(desc)
        r_val, r_err, d_val, d_err = call_both(ref_fn, dev_fn)
        assert type(d_err) is type(r_err), (
            f"{desc}: device raised {d_err!r}, reference {r_err!r}; {self.where()}")
        event(desc, r_err)
        if r_err is None:
            assert norm(d_val) == norm(r_val), f"{desc}: device returned {d_val!r}, reference {r_val!r}"
        self.compare()
        return None if r_err else r_val

    # ---- batched ops: a device call against the sequence of single reference calls -------------
    def _dev_batched(self, launch, sticky_followup=None):
        """Launch a batched device op (no sync), optionally a second batched op (which must do
        nothing when the first failed), then ``check()``. Returns (launch's result, error)."""
        out = launch()
        if sticky_followup is not None:
            sticky_followup()
        try:
            self.dev.check()
        except PoolError as e:
            return out, e
        return out, None

    def batched(self, desc, expected_err, ref_apply, launch, dev_result=None, sticky_followup=None):
        self.ops.append(desc)
        note(desc)
        before = self.snapshot()
        r_val = None
        if expected_err is None:
            r_val = ref_apply()
        out, d_err = self._dev_batched(launch, sticky_followup if expected_err is not None else None)
        event(desc, d_err)
        assert type(d_err) is (type(None) if expected_err is None else expected_err), (
            f"{desc}: device check() raised {d_err!r}, the single calls {expected_err}; {self.where()}")
        if expected_err is not None:
            assert self.snapshot() == before
            # The status word was cleared by check(): a second check is quiet.
            self.dev.check()
        elif dev_result is not None:
            got = dev_result(out)
            assert got == r_val, f"{desc}: device returned {got}, the single calls {r_val}; {self.where()}"
        self.compare()


def held_multiset(ref) -> list[int]:
    out = []
    for b, c in enumerate(ref.ref_counts()):
        if b:
            out.extend([b] * c)
    return out


# =================================================================================================
# Op generators (st.data() draws), each runs one op on both pools
# =================================================================================================

def rare(data, label, odds=8) -> bool:
    """True about once in ``odds + 1`` draws (an explicit weight: plain integer draws lean to the edges)."""
    return data.draw(st.sampled_from([False] * odds + [True]), label=label)


def ids_arg(data, ids):
    """Ids as a list or (sometimes) an int32 tensor, which the device range-checks in the kernel."""
    if data.draw(st.booleans(), label="as_tensor"):
        return i32(ids), i32(ids)
    return list(ids), list(ids)


def draw_ids(data, pair, *, max_len=6, label="ids"):
    """A list of block ids: any block, the null block, duplicates, and rarely an out-of-range id."""
    ids = data.draw(st.lists(st.integers(0, pair.n - 1), max_size=max_len), label=label)
    if rare(data, label + "_bad", 12):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([-1, pair.n, pair.n + 3])))
    return ids


def op_get_new_blocks(data, pair):
    free = pair.ref.get_num_free_blocks()
    k = data.draw(st.integers(0, free), label="n")
    if rare(data, "n_bad", 10):
        k = data.draw(st.sampled_from([-1, free + 1, pair.n + 5]), label="n_bad_value")
    pair.do(f"get_new_blocks({k})", lambda: pair.ref.get_new_blocks(k), lambda: pair.dev.get_new_blocks(k),
            norm=ints)


def draw_release(data, pair, held, *, label):
    """A list of held blocks (each at most its ref count times) in random order; sometimes the null
    block, a double free, a free block or an out-of-range id."""
    chosen = data.draw(st.lists(st.sampled_from(held), max_size=min(len(held), 8)) if held else st.just([]),
                       label=label + "_pick")
    # Keep each block at most its ref count (a valid call), then maybe break it.
    cnt = {}
    ok = []
    ref = pair.ref.ref_counts()
    for b in chosen:
        if cnt.get(b, 0) < ref[b]:
            cnt[b] = cnt.get(b, 0) + 1
            ok.append(b)
    kind = data.draw(st.sampled_from(["ok"] * 12 + ["dup", "bad", "null", "free"]), label=label + "_kind")
    if kind == "dup" and ok:
        ok.append(data.draw(st.sampled_from(ok)))  # a double free unless its ref count allows it
    elif kind == "bad":
        ok.insert(data.draw(st.integers(0, len(ok))), data.draw(st.sampled_from([-1, pair.n])))
    elif kind == "null":
        ok.insert(data.draw(st.integers(0, len(ok))), 0)
    elif kind == "free":
        free = [b for b in range(1, pair.n) if ref[b] == 0]
        if free:
            ok.insert(data.draw(st.integers(0, len(ok))), data.draw(st.sampled_from(free)))
    return ok


def op_free_blocks(data, pair):
    ids = draw_release(data, pair, held_multiset(pair.ref), label="free")
    a, b = ids_arg(data, ids)
    pair.do(f"free_blocks({ids})", lambda: pair.ref.free_blocks(a), lambda: pair.dev.free_blocks(b))


def op_touch(data, pair):
    ref = pair.ref.ref_counts()
    cached_free = [b for b in range(1, pair.n) if ref[b] == 0 and pair.ref.block_keys(b)]
    ids = draw_ids(data, pair, label="touch")
    if cached_free and data.draw(st.booleans(), label="hit?"):
        ids += data.draw(st.lists(st.sampled_from(cached_free), min_size=1, max_size=3), label="hits")
    a, b = ids_arg(data, ids)
    pair.do(f"touch({ids})", lambda: pair.ref.touch(a), lambda: pair.dev.touch(b))


def op_unpin(data, pair):
    ids = draw_release(data, pair, held_multiset(pair.ref), label="unpin")
    a, b = ids_arg(data, ids)
    cr, cd = pair.callbacks()
    pair.do(f"unpin_blocks({ids}, tag={pair.next_tag - 1})", lambda: pair.ref.unpin_blocks(a, cr),
            lambda: pair.dev.unpin_blocks(b, cd))


def op_cache_full(data, pair):
    ref = pair.ref.ref_counts()
    held = sorted({b for b in range(1, pair.n) if ref[b] > 0})
    length = data.draw(st.integers(0, 6), label="cf_len")
    if held and not rare(data, "cf_any_blocks", 3):
        # a request's blocks: distinct held blocks (repeats are rare)
        ids = data.draw(st.lists(st.sampled_from(held), min_size=min(length, len(held)), max_size=length,
                                 unique=not rare(data, "cf_repeats", 6)), label="cf_ids")
        length = len(ids)
    else:
        ids = data.draw(st.lists(st.integers(0, pair.n - 1), min_size=length, max_size=length), label="cf_any")
    if ids and rare(data, "cf_null?", 6):
        ids[data.draw(st.integers(0, len(ids) - 1))] = 0
    if ids and rare(data, "cf_bad?", 25):
        ids[data.draw(st.integers(0, len(ids) - 1))] = pair.n
    nc = data.draw(st.integers(0, length), label="nc")
    nf = data.draw(st.integers(nc, length), label="nf")
    if rare(data, "nf_odd", 10):
        nf = data.draw(st.integers(0, length + 1), label="nf_any")
    hl = length if not rare(data, "cf_few_hashes", 15) else data.draw(st.integers(0, length), label="cf_nhash")
    # Hash chains: mostly a prefix walk of the universe (so requests share prefixes), sometimes random.
    if rare(data, "cf_random_hashes", 2):
        hidx = data.draw(st.lists(st.integers(0, NUM_HASHES - 1), min_size=hl, max_size=hl), label="cf_hashes")
    else:
        start = data.draw(st.integers(0, NUM_HASHES - 1), label="cf_start")
        hidx = [(start + i) % NUM_HASHES for i in range(hl)]
    hs = [HASHES[i] for i in hidx]
    bs = data.draw(st.sampled_from([BS, BS, BS, 2 * BS, 4]), label="bs")
    if rare(data, "bs_bad", 25):
        bs = 0
    g = data.draw(st.sampled_from([0, 0, 1]), label="group")
    mask = None
    if rare(data, "masked?", 2):
        ml = max(nf - nc, 0)
        if rare(data, "mask_short", 10):
            ml = max(ml - 1, 0)
        mask = data.draw(st.lists(st.booleans(), min_size=ml, max_size=ml), label="mask")
    a, b = ids_arg(data, ids)
    if nc < nf and pair.ref.enable_caching:
        pair.used.update(hs[nc:nf])
    pair.do(f"cache_full_blocks({ids}, hashes={hidx}, nc={nc}, nf={nf}, bs={bs}, g={g}, mask={mask})",
            lambda: pair.ref.cache_full_blocks(a, hs, nc, nf, bs, g, mask),
            lambda: pair.dev.cache_full_blocks(b, hs, nc, nf, bs, g, mask))


def op_cache_partial(data, pair):
    keyed = [b for b in range(1, pair.n) if pair.ref.block_keys(b)]
    if keyed and data.draw(st.booleans(), label="cp_keyed?"):  # secondaries, promotions, KeyCapacityError
        blk = data.draw(st.sampled_from(keyed), label="cp_keyed_block")
    else:
        blk = data.draw(st.integers(1, pair.n - 1), label="cp_block")
    if rare(data, "cp_odd_block", 8):
        blk = data.draw(st.sampled_from([0, pair.n, -1]), label="cp_block_odd")
    hl = data.draw(st.integers(1, 4), label="cp_nhash")
    hidx = data.draw(st.lists(st.integers(0, NUM_HASHES - 1), min_size=hl, max_size=hl), label="cp_hashes")
    hs = [HASHES[i] for i in hidx]
    hbs = data.draw(st.sampled_from([4, 8, 16]), label="hbs")
    bs = 16 if not rare(data, "cp_bs_bad", 15) else 12
    k = data.draw(st.integers(1, hl), label="k")
    if rare(data, "k_bad", 15):
        k = data.draw(st.sampled_from([0, hl + 1]), label="k_bad_value")
    nt = k * hbs + (1 if rare(data, "nt_odd", 20) else 0)
    g = data.draw(st.sampled_from([0, 0, 1]), label="cp_group")
    replace = rare(data, "replace", 4)
    if pair.ref.enable_caching and 0 < k <= hl:
        pair.used.add(hs[k - 1])
    pair.do(f"cache_partial_block({blk}, {hidx}, nt={nt}, g={g}, bs={bs}, hbs={hbs}, replace={replace})",
            lambda: pair.ref.cache_partial_block(blk, hs, nt, g, bs, hbs, replace),
            lambda: pair.dev.cache_partial_block(blk, hs, nt, g, bs, hbs, replace))


def op_move(data, pair):
    n = pair.n
    keyed = [b for b in range(1, n) if pair.ref.block_keys(b)]
    holders: dict = {}
    for b in keyed:
        for key in pair.ref.block_keys(b):
            holders.setdefault(key, []).append(b)
    # The block a lookup returns for a key that several blocks hold: moving its keys must make the
    # next holder the earliest (moved entries count as newly inserted).
    shadowing = sorted({pair.ref.get_cached_block(k[0], [k[1]])[0] for k, bs in holders.items() if len(bs) > 1})
    if shadowing and data.draw(st.booleans(), label="mv_shadowing?"):
        src = data.draw(st.sampled_from(shadowing), label="src_shadowing")
    elif keyed and not rare(data, "mv_src_any", 3):
        src = data.draw(st.sampled_from(keyed), label="src")
    else:
        src = data.draw(st.integers(0, n - 1), label="src_any")
    if rare(data, "mv_src_bad", 20):
        src = data.draw(st.sampled_from([n, -1]), label="src_bad")
    unkeyed = [b for b in range(1, n) if not pair.ref.block_keys(b)]
    if unkeyed and not rare(data, "mv_dst_any", 4):
        dst = data.draw(st.sampled_from(unkeyed), label="dst")
    else:
        dst = data.draw(st.integers(0, n - 1), label="dst_any")
    pair.do(f"move_block_hashes({src}, {dst})", lambda: pair.ref.move_block_hashes(src, dst),
            lambda: pair.dev.move_block_hashes(src, dst))


def op_evict(data, pair):
    ids = draw_ids(data, pair, label="evict")
    keyed = [b for b in range(1, pair.n) if pair.ref.block_keys(b)]
    if keyed and data.draw(st.booleans(), label="evict_keyed?"):  # keyed blocks, repeated: events in first order
        ids += data.draw(st.lists(st.sampled_from(keyed), min_size=1, max_size=4), label="evict_keyed")
    a, b = ids_arg(data, ids)
    pair.do(f"evict_blocks({ids})", lambda: pair.ref.evict_blocks(a), lambda: pair.dev.evict_blocks(b))


def op_reset(data, pair):
    pair.do("reset_prefix_cache()", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)


def op_get_cached(data, pair):
    hh = HASHES[data.draw(st.integers(0, NUM_HASHES - 1), label="gc_hash")]
    groups = data.draw(st.sampled_from([[], [0], [1], [0, 1], [1, 0], [0, 0]]), label="gc_groups")
    pair.do(f"get_cached_block(H{HASHES.index(hh)}, {groups})", lambda: pair.ref.get_cached_block(hh, groups),
            lambda: pair.dev.get_cached_block(hh, groups),
            norm=lambda x: None if x is None else ints(x))


def op_small_queries(data, pair):
    b = data.draw(st.integers(0, pair.n - 1), label="wr_block")
    pair.do(f"is_block_writable({b})", lambda: pair.ref.is_block_writable(b), lambda: pair.dev.is_block_writable(b))
    sel = data.draw(st.lists(st.integers(0, pair.n - 1), max_size=4), label="rc_ids")
    pair.do(f"ref_counts({sel})", lambda: pair.ref.ref_counts(sel), lambda: pair.dev.ref_counts(sel), norm=ints)


# ---- batched ----------------------------------------------------------------------------------

def sticky_followup(data, pair):
    """A valid batched op to launch right after a failing one: it must do nothing (sticky status)."""
    if not data.draw(st.booleans(), label="followup?"):
        return None
    kind = data.draw(st.sampled_from(["alloc", "touch", "free"]), label="followup")
    if kind == "alloc":
        return lambda: pair.dev.allocate_batched(i32([min(1, pair.ref.get_num_free_blocks())]))
    if kind == "touch":
        return lambda: pair.dev.touch_batched(i32([pair.n - 1]))
    held = sorted(set(held_multiset(pair.ref)))
    return lambda: pair.dev.free_batched(i32(held[:1]), i32([0, len(held[:1])]))


def padding(data, pair, label):
    """Junk after the counted entries (a captured graph's fixed-size buffers with a device count):
    the ops must ignore it. Out-of-range ids and negative demands included on purpose."""
    if data is None or not rare(data, label + "_padded?", 2):
        return []
    return data.draw(st.lists(st.sampled_from([-1, 0, 1, pair.n - 1, pair.n, 5]), min_size=1, max_size=3),
                     label=label + "_padding")


def count_arg(k):
    return torch.full((1,), k, dtype=torch.int32, device=DEVICE)


def op_allocate_batched(data, pair):
    free = pair.ref.get_num_free_blocks()
    nd = data.draw(st.integers(0, 4), label="num_demands")
    demands = data.draw(st.lists(st.integers(0, max(1, free // 2)), min_size=nd, max_size=nd), label="demands")
    kind = data.draw(st.sampled_from(["ok"] * 8 + ["negative", "too_many"]), label="ab_kind")
    if kind == "negative" and demands:
        demands[data.draw(st.integers(0, nd - 1))] = -1
    elif kind == "too_many" and demands:
        demands[data.draw(st.integers(0, nd - 1))] = free + 1
    expected = None
    total = 0
    for d in demands:  # the first single call that would fail
        if d < 0:
            expected = InvalidCountError
            break
        if total + d > free:
            expected = OutOfBlocksError
            break
        total += d

    def ref_apply():
        return [ints(pair.ref.get_new_blocks(d)) for d in demands]

    def dev_result(out):
        blocks, offs = out
        blocks, offs = ints(blocks), ints(offs)
        return [blocks[offs[k]:offs[k + 1]] for k in range(len(demands))]

    pad = padding(data, pair, "ab")
    pair.batched(f"allocate_batched({demands}, padding={pad})", expected, ref_apply,
                 lambda: pair.dev.allocate_batched(i32(demands + pad), count_arg(len(demands)) if pad else None),
                 dev_result, sticky_followup(data, pair))


def op_free_batched(data, pair):
    held = held_multiset(pair.ref)
    nseg = data.draw(st.integers(0, 4), label="num_segments")
    segs = []
    for j in range(nseg):
        seg = draw_release(data, pair, held, label=f"seg{j}")
        segs.append(seg)
        for b in seg:  # later segments release from what is left (mostly; overlaps make double frees)
            if b in held and not rare(data, "keep", 6):
                held.remove(b)
    run_free_batched(data, pair, segs)


def first_free_error(pair, segs):
    """The error class of the first of the ``free_blocks(seg)`` calls that would fail, or None."""
    ref = pair.ref.ref_counts()
    cnt: dict[int, int] = {}
    for seg in segs:
        if any(not 0 <= b < pair.n for b in seg):
            return InvalidBlockIdError
        for b in seg:
            if b:
                cnt[b] = cnt.get(b, 0) + 1
        if any(c > ref[b] for b, c in cnt.items()):
            return DoubleFreeError
    return None


def run_free_batched(data, pair, segs):
    """``free_batched`` of the segments against the sequence of ``free_blocks`` calls."""
    flat = [b for seg in segs for b in seg]
    offs = [0]
    for seg in segs:
        offs.append(offs[-1] + len(seg))

    def ref_apply():
        for seg in segs:
            pair.ref.free_blocks(seg)

    pad = padding(data, pair, "fb")
    if pad:  # a last segment of junk past num_ids, or junk that extends the last real segment
        offs_arg = offs + [offs[-1] + len(pad)] if (not segs or rare(data, "fb_pad_own_segment", 1)) else offs[:-1] + [
            offs[-1] + len(pad)]
    else:
        offs_arg = offs
    pair.batched(f"free_batched({segs}, padding={pad})", first_free_error(pair, segs), ref_apply,
                 lambda: pair.dev.free_batched(i32(flat + pad), i32(offs_arg),
                                               count_arg(len(flat)) if pad else None),
                 None, sticky_followup(data, pair) if data is not None else None)


def op_touch_batched(data, pair):
    ids = draw_ids(data, pair, max_len=8, label="tb")
    expected = InvalidBlockIdError if any(not 0 <= b < pair.n for b in ids) else None
    pad = padding(data, pair, "tb")
    pair.batched(f"touch_batched({ids}, padding={pad})", expected, lambda: pair.ref.touch(ids),
                 lambda: pair.dev.touch_batched(i32(ids + pad), count_arg(len(ids)) if pad else None), None,
                 sticky_followup(data, pair))


def check_lookup_batched(pair, keys):
    """``lookup_batched`` of ``(hash index, group)`` keys against the reference's get_cached_block."""
    dk = [device_key(HASHES[i], g) for i, g in keys]
    got = ints(pair.dev.lookup_batched(i64([k[0] for k in dk]), i64([k[1] for k in dk]), i32([g for _, g in keys])))
    want = []
    for i, g in keys:
        r = pair.ref.get_cached_block(HASHES[i], [g])
        want.append(-1 if r is None else r[0])
    pair.ops.append(f"lookup_batched({keys})")
    assert got == want, f"lookup_batched({keys}): device {got} != reference {want}; {pair.where()}"


def op_lookup_batched(data, pair):
    keys = data.draw(st.lists(st.tuples(st.integers(0, NUM_HASHES - 1), st.sampled_from([0, 1, 2])), max_size=12),
                     label="lookup_keys")
    check_lookup_batched(pair, keys)


def check_longest_prefix(pair, chains, groups, lengths):
    """``longest_prefix_batched`` of hash-index chains against get_cached_block walked on the reference."""
    r, length = len(chains), len(chains[0])
    hi = torch.zeros((r, len(groups), length), dtype=torch.int64)
    lo = torch.zeros_like(hi)
    for q in range(r):
        for gi, g in enumerate(groups):
            for t in range(length):
                hi[q, gi, t], lo[q, gi, t] = device_key(HASHES[chains[q][t]], g)
    hits, blocks, zero_ref = pair.dev.longest_prefix_batched(hi.to(DEVICE), lo.to(DEVICE), i32(groups), i32(lengths))
    hits, blocks, zero_ref = ints(hits), blocks.tolist(), ints(zero_ref)
    refc = pair.ref.ref_counts()
    pair.ops.append(f"longest_prefix_batched({chains}, {groups}, {lengths})")
    for q in range(r):
        want_blocks = []
        for t in range(lengths[q]):
            got = pair.ref.get_cached_block(HASHES[chains[q][t]], groups)
            if got is None:
                break
            want_blocks.append(got)
        assert hits[q] == len(want_blocks), (f"longest prefix of {chains[q][:lengths[q]]} in {groups}: "
                                             f"device {hits[q]} != {len(want_blocks)}; {pair.where()}")
        for gi in range(len(groups)):
            assert blocks[q][gi][:hits[q]] == [w[gi] for w in want_blocks]
        assert zero_ref[q] == sum(1 for w in want_blocks for b in w if refc[b] == 0)


def op_longest_prefix(data, pair):
    groups = data.draw(st.sampled_from([[0], [1], [0, 1]]), label="lp_groups")
    r = data.draw(st.integers(1, 3), label="lp_reqs")
    length = data.draw(st.integers(1, 5), label="lp_len")
    chains = data.draw(st.lists(st.lists(st.integers(0, NUM_HASHES - 1), min_size=length, max_size=length),
                                min_size=r, max_size=r), label="chains")
    lengths = data.draw(st.lists(st.integers(0, length), min_size=r, max_size=r), label="lp_lengths")
    check_longest_prefix(pair, chains, groups, lengths)


# ---- request-level ops: the way a scheduler drives the pool (docs/semantics.md section 5) ------------------

TEMPLATES = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 7, 8, 9, 3], [5, 6, 7, 8, 9, 0, 1]]


def op_admit(data, pair):
    """Admit a request: look up its longest cached prefix (sometimes skipped, which caches duplicate
    keys), touch the hits, get the rest, cache the full blocks."""
    full = data.draw(st.integers(1, 6), label="req_full")
    tmpl = data.draw(st.sampled_from(TEMPLATES), label="req_template")
    cut = data.draw(st.integers(0, full), label="req_shared")
    chain = tmpl[:cut] + data.draw(st.lists(st.integers(0, NUM_HASHES - 1), min_size=full - cut,
                                            max_size=full - cut), label="req_tail")
    hs = [HASHES[i] for i in chain]
    g = data.draw(st.sampled_from([0, 0, 1]), label="req_group")
    extra = data.draw(st.integers(0, 2), label="req_decode_blocks")
    hits: list[int] = []
    if not rare(data, "req_no_lookup", 4):
        for i, hh in enumerate(hs[: full - 1] if not rare(data, "req_all_hit", 3) else hs):
            got = pair.do(f"get_cached_block(H{chain[i]}, [{g}])", lambda: pair.ref.get_cached_block(hh, [g]),
                          lambda: pair.dev.get_cached_block(hh, [g]), norm=lambda x: None if x is None else ints(x))
            if got is None:
                break
            hits.append(got[0])
    new = full + extra - len(hits)
    refc = pair.ref.ref_counts()
    if new + sum(1 for b in set(hits) if refc[b] == 0) > pair.ref.get_num_free_blocks() and not rare(
            data, "req_overcommit", 4):
        return
    pair.do(f"touch({hits})", lambda: pair.ref.touch(hits), lambda: pair.dev.touch(hits))
    got = pair.do(f"get_new_blocks({new})", lambda: pair.ref.get_new_blocks(new), lambda: pair.dev.get_new_blocks(new),
                  norm=ints)
    if got is None:
        pair.do(f"free_blocks({hits[::-1]})", lambda: pair.ref.free_blocks(hits[::-1]),
                lambda: pair.dev.free_blocks(hits[::-1]))
        return
    blocks = hits + ints(got)
    if pair.ref.enable_caching:
        pair.used.update(hs)
    pair.do(f"cache_full_blocks({blocks}, hashes={chain}, nc={len(hits)}, nf={full}, bs={BS}, g={g})",
            lambda: pair.ref.cache_full_blocks(blocks, hs, len(hits), full, BS, g),
            lambda: pair.dev.cache_full_blocks(blocks, hs, len(hits), full, BS, g))
    pair.requests.append(blocks)


def op_finish(data, pair):
    """Free one request (``free_blocks(reversed(blocks))``), or several in one ``free_batched``."""
    if not pair.requests:
        return
    k = data.draw(st.integers(1, min(3, len(pair.requests))), label="finish_count")
    picks = []
    for _ in range(k):
        picks.append(pair.requests.pop(data.draw(st.integers(0, len(pair.requests) - 1), label="finish_which")))
    segs = [blocks[::-1] for blocks in picks]
    if k == 1 and data.draw(st.booleans(), label="finish_single?"):
        seg = segs[0]
        pair.do(f"free_blocks({seg})", lambda: pair.ref.free_blocks(seg), lambda: pair.dev.free_blocks(seg))
    else:
        run_free_batched(data, pair, segs)


def op_cow(data, pair):
    """Copy-on-write of a request's last block: a fresh block takes its keys, the request keeps
    writing the copy and releases the original."""
    cands = [i for i, blocks in enumerate(pair.requests) if blocks and pair.ref.block_keys(blocks[-1])]
    if not cands or pair.ref.get_num_free_blocks() == 0:
        return
    i = data.draw(st.sampled_from(cands), label="cow_request")
    src = pair.requests[i][-1]
    got = pair.do("get_new_blocks(1)", lambda: pair.ref.get_new_blocks(1), lambda: pair.dev.get_new_blocks(1),
                  norm=ints)
    dst = ints(got)[0]
    pair.do(f"move_block_hashes({src}, {dst})", lambda: pair.ref.move_block_hashes(src, dst),
            lambda: pair.dev.move_block_hashes(src, dst))
    pair.do(f"free_blocks([{src}])", lambda: pair.ref.free_blocks([src]), lambda: pair.dev.free_blocks([src]))
    pair.requests[i][-1] = dst


def op_shadow_move(data, pair):
    """Cache a key that block A holds on a second block B (a duplicate: lookups keep returning A),
    then move A's keys to a fresh block C: B becomes the earliest holder (docs/semantics.md move_block_hashes)."""
    keyed = [b for b in range(1, pair.n) if pair.ref.block_keys(b)]
    if not keyed or pair.ref.get_num_free_blocks() < 2:
        return
    a = data.draw(st.sampled_from(keyed), label="shadow_a")
    hh, g = pair.ref.block_keys(a)[0]
    got = pair.do("get_new_blocks(2)", lambda: pair.ref.get_new_blocks(2), lambda: pair.dev.get_new_blocks(2),
                  norm=ints)
    b, c = ints(got)
    pair.do(f"cache_full_blocks([{b}], [H{HASHES.index(hh)}], 0, 1, {BS}, {g})",
            lambda: pair.ref.cache_full_blocks([b], [hh], 0, 1, BS, g),
            lambda: pair.dev.cache_full_blocks([b], [hh], 0, 1, BS, g))
    if data.draw(st.booleans(), label="shadow_move?"):
        pair.do(f"move_block_hashes({a}, {c})", lambda: pair.ref.move_block_hashes(a, c),
                lambda: pair.dev.move_block_hashes(a, c))
    else:
        pair.do(f"evict_blocks([{a}])", lambda: pair.ref.evict_blocks([a]), lambda: pair.dev.evict_blocks([a]))
    pair.requests.append([b, c])


def op_drain_and_reset(data, pair):
    """Touch a few blocks (some may carry watchers from earlier unpins), release every held block in
    random order by two unpin calls (re-registering watchers) and a free, then reset the prefix cache:
    it succeeds, fires the watchers in registration order and clears them."""
    extra = data.draw(st.lists(st.integers(1, pair.n - 1), max_size=3), label="drain_touch") if pair.n > 1 else []
    pair.do(f"touch({extra})", lambda: pair.ref.touch(extra), lambda: pair.dev.touch(extra))
    held = held_multiset(pair.ref)
    order = data.draw(st.permutations(held), label="drain_order") if held else []
    c1 = data.draw(st.integers(0, len(order)), label="drain_cut1")
    c2 = data.draw(st.integers(c1, len(order)), label="drain_cut2")
    for part in (order[:c1], order[c1:c2]):
        if part:
            cr, cd = pair.callbacks()
            pair.do(f"unpin_blocks({part}, tag={pair.next_tag - 1})", lambda: pair.ref.unpin_blocks(part, cr),
                    lambda: pair.dev.unpin_blocks(part, cd))
    rest = order[c2:]
    pair.do(f"free_blocks({rest})", lambda: pair.ref.free_blocks(rest), lambda: pair.dev.free_blocks(rest))
    pair.requests.clear()
    pair.do("reset_prefix_cache()", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)


def op_hit_cycle(data, pair):
    """A short request that only hits: touch a few free blocks in the middle of the queue (tombstones
    in the ring), then free them (hashed ones to the back, others to the front). Repeated, this grows
    the ring window until the kernels compact it (small rings)."""
    for _ in range(data.draw(st.integers(1, 6), label="cycles")):
        q = pair.ref.free_queue()
        if not q:
            return
        pick = data.draw(st.lists(st.sampled_from(q), min_size=1, max_size=3, unique=True), label="cycle_pick")
        pair.do(f"touch({pick})", lambda: pair.ref.touch(pick), lambda: pair.dev.touch(pick))
        order = data.draw(st.permutations(pick), label="cycle_order")
        pair.do(f"free_blocks({order})", lambda: pair.ref.free_blocks(order), lambda: pair.dev.free_blocks(order))


OPS = [
    (op_admit, 10), (op_hit_cycle, 5), (op_finish, 7), (op_cow, 1), (op_shadow_move, 2), (op_drain_and_reset, 2),
    (op_get_new_blocks, 6), (op_free_blocks, 6), (op_touch, 3), (op_unpin, 2), (op_cache_full, 6),
    (op_cache_partial, 4), (op_move, 2), (op_evict, 2), (op_reset, 1), (op_get_cached, 1), (op_small_queries, 1),
    (op_allocate_batched, 4), (op_free_batched, 4), (op_touch_batched, 2), (op_lookup_batched, 1),
    (op_longest_prefix, 1),
]
OP_TABLE = [f for f, w in OPS for _ in range(w)]


@st.composite
def pool_configs(draw):
    n = draw(st.sampled_from([2, 3, 5, 8, 12, 16, 24]), label="num_blocks")
    mk = draw(st.integers(1, 4), label="max_keys_per_block")
    ring = draw(st.sampled_from([None, pow2_at_least(max(n, 2)), pow2_at_least(max(n, 2))]), label="ring_capacity")
    chunk_choices = [None, None] + [c for c in (1, 2) if (n - 1) * mk <= 16 * c]
    chunks = draw(st.sampled_from(chunk_choices), label="num_chunks")
    return dict(n=n, mk=mk, ring=ring, chunks=chunks, caching=draw(st.booleans(), label="caching"),
                events=draw(st.booleans(), label="events"))


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
          deadline=None, max_examples=3 * settings.default.max_examples // 2)  # ci: 37 sequences of up to 40 ops
@given(cfg=pool_configs(), data=st.data())
def test_random_op_sequences_match_reference(cfg, data):
    note(f"config: {cfg}")
    pair = Pair(cfg["n"], caching=cfg["caching"], events=cfg["events"], mk=cfg["mk"], ring=cfg["ring"],
                chunks=cfg["chunks"])
    num_ops = data.draw(st.integers(5, 40), label="num_ops")
    for _ in range(num_ops):
        # Bias toward keeping blocks held, so frees, unpins and caching have something to work on.
        op = data.draw(st.sampled_from(OP_TABLE), label="op")
        op(data, pair)
    pair.dev.validate()


# =================================================================================================
# Hand-written cases
# =================================================================================================

def noop(_b):
    pass


@pytest.mark.slow
def test_ring_compaction_many_touch_free_cycles():
    """Ring of the smallest power of two >= N: touch / free cycles leave tombstones and grow the window
    (hashed blocks go to the back, un-hashed to the front) until the kernels compact it; the order stays
    the reference's throughout."""
    n = 12
    pair = Pair(n, ring=pow2_at_least(n), check_lookups=True)
    blocks = ints(pair.dev.get_new_blocks(n - 1))
    pair.ref.get_new_blocks(n - 1)
    hs = [H(100 + i) for i in range(n - 1)]
    pair.used.update(hs[:6])
    pair.do("cache_full_blocks(first 6)", lambda: pair.ref.cache_full_blocks(blocks, hs, 0, 6, BS),
            lambda: pair.dev.cache_full_blocks(blocks, hs, 0, 6, BS))
    pair.do("free all", lambda: pair.ref.free_blocks(blocks[::-1]), lambda: pair.dev.free_blocks(blocks[::-1]))
    rng = random.Random(7)
    heads = []
    for step in range(60):
        q = pair.ref.free_queue()
        pick = rng.sample(q, rng.randint(1, 3))
        pair.do(f"touch({pick})", lambda: pair.ref.touch(pick), lambda: pair.dev.touch(pick))
        order = pick[:]
        rng.shuffle(order)
        pair.do(f"free({order})", lambda: pair.ref.free_blocks(order), lambda: pair.dev.free_blocks(order))
        heads.append(int(pair.dev.state.ctrl[CTRL_HEAD]))
        if step % 10 == 9:
            k = rng.randint(1, 4)
            got = pair.do(f"get_new_blocks({k})", lambda: pair.ref.get_new_blocks(k),
                          lambda: pair.dev.get_new_blocks(k), norm=ints)
            pair.do(f"free({got})", lambda: pair.ref.free_blocks(got), lambda: pair.dev.free_blocks(got))
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0
    assert min(heads) < 0


@pytest.mark.slow
def test_ring_wraparound_negative_head_caching_off():
    """Caching off: every free prepends, so touch / free of a block in the middle pushes the head
    further below zero (several times around the ring) and compacts when the window is full."""
    n = 6
    c = pow2_at_least(n)
    pair = Pair(n, caching=False, ring=c, check_lookups=False)
    rng = random.Random(3)
    for step in range(8 * c):
        q = pair.ref.free_queue()
        b = q[rng.randrange(len(q))]
        pair.do(f"touch([{b}])", lambda: pair.ref.touch([b]), lambda: pair.dev.touch([b]))
        pair.do(f"free([{b}])", lambda: pair.ref.free_blocks([b]), lambda: pair.dev.free_blocks([b]))
    head = int(pair.dev.state.ctrl[CTRL_HEAD])
    assert head < -2 * c, head
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0
    # Allocation across the wrapped window still takes the reference's blocks.
    pair.do("get_new_blocks(5)", lambda: pair.ref.get_new_blocks(5), lambda: pair.dev.get_new_blocks(5), norm=ints)
    pair.do("free", lambda: pair.ref.free_blocks([5, 1, 3, 2, 4]), lambda: pair.dev.free_blocks([5, 1, 3, 2, 4]))


@pytest.mark.slow
def test_ring_compaction_in_free_batched_and_unpin():
    """Compaction triggered from inside the batched free and from unpin (appends), smallest ring."""
    n = 8
    pair = Pair(n, ring=pow2_at_least(n), events=True)
    rng = random.Random(11)
    for it in range(sized(25, 10)):
        free = pair.ref.get_num_free_blocks()
        demands = [rng.randint(0, free // 3) for _ in range(3)]
        pair.batched(f"allocate_batched({demands})", None,
                     lambda: [ints(pair.ref.get_new_blocks(d)) for d in demands],
                     lambda: pair.dev.allocate_batched(i32(demands)),
                     lambda out: [ints(out[0])[ints(out[1])[k]:ints(out[1])[k + 1]] for k in range(3)])
        held = sorted({b for b, c in enumerate(pair.ref.ref_counts()) if b and c})
        if held:
            hs = [H(rng.randint(0, 5)) for _ in held]
            pair.used.update(hs)
            cut = rng.randint(0, len(held))
            pair.do("cache_full", lambda: pair.ref.cache_full_blocks(held, hs, 0, cut, BS),
                    lambda: pair.dev.cache_full_blocks(held, hs, 0, cut, BS))
        rng.shuffle(held)
        if it % 3 == 0 and held:
            cr, cd = pair.callbacks()
            part = held[: len(held) // 2]
            pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
            held = held[len(held) // 2:]
        cut = rng.randint(0, len(held))
        segs = [held[:cut], held[cut:]]
        flat = segs[0] + segs[1]

        def ref_apply():
            for s in segs:
                pair.ref.free_blocks(s)
        pair.batched(f"free_batched({segs})", None, ref_apply,
                     lambda: pair.dev.free_batched(i32(flat), i32([0, cut, len(flat)])))
        # touch something in the middle: a tombstone
        for _ in range(2):
            q = pair.ref.free_queue()
            if len(q) > 2:
                mid = [q[len(q) // 2]]
                pair.do(f"touch({mid})", lambda: pair.ref.touch(mid), lambda: pair.dev.touch(mid))
                pair.do(f"free({mid})", lambda: pair.ref.free_blocks(mid), lambda: pair.dev.free_blocks(mid))
    assert int(pair.dev.state.ctrl[CTRL_COMPACTIONS]) > 0


@pytest.mark.parametrize("chunks,n,mk", [(1, 5, 4), pytest.param(1, 17, 1, marks=pytest.mark.slow),
                                         pytest.param(2, 9, 4, marks=pytest.mark.slow),
                                         pytest.param(2, 17, 2, marks=pytest.mark.slow)])
def test_key_table_near_its_limit(chunks, n, mk):
    """Tables sized so every key slot can be in use at once ((N-1)*MK == 16*chunks): inserts, deletes,
    moves and lookups stay exact, and validate() checks the overflow counts along every probe path."""
    assert (n - 1) * mk == 16 * chunks
    pair = Pair(n, mk=mk, chunks=chunks, events=True)
    rng = random.Random(chunks * 100 + n)
    universe = [H(f"t{i}") for i in range(3 * n)]
    blocks = ints(pair.dev.get_new_blocks(n - 1))
    pair.ref.get_new_blocks(n - 1)
    for rnd in range(4):
        # Fill every block's row: a full key (primary) and partial secondaries, up to MK keys.
        for b in blocks:
            for j in range(mk - len(pair.ref.block_keys(b))):
                hh = rng.choice(universe)
                g = rng.randint(0, 1)
                pair.used.add(hh)
                # num_tokens below the primary's 16 so the key is added as a secondary
                pair.do(f"partial({b}, g={g})",
                        lambda: pair.ref.cache_partial_block(b, [hh], 4, g, 16, 4),
                        lambda: pair.dev.cache_partial_block(b, [hh], 4, g, 16, 4), norm=lambda x: x)
        assert sum(len(pair.ref.block_keys(b)) for b in blocks) <= 16 * chunks
        # The table is now (nearly) full. Delete some, move some, re-add.
        victims = rng.sample(blocks, len(blocks) // 3)
        pair.do(f"evict({victims})", lambda: pair.ref.evict_blocks(victims), lambda: pair.dev.evict_blocks(victims))
        keyed = [b for b in blocks if pair.ref.block_keys(b)]
        empty = [b for b in blocks if not pair.ref.block_keys(b)]
        if keyed and empty:
            s, d = rng.choice(keyed), rng.choice(empty)
            pair.do(f"move({s}, {d})", lambda: pair.ref.move_block_hashes(s, d),
                    lambda: pair.dev.move_block_hashes(s, d))
        # Primary keys via cache_full (promotion of partial keys: old keys removed).
        order = blocks[:]
        rng.shuffle(order)
        hs = [rng.choice(universe) for _ in order]
        pair.used.update(hs)
        nc = rng.randint(0, len(order) - 1)
        try_ids = order[: nc + 3]
        pair.do("cache_full", lambda: pair.ref.cache_full_blocks(try_ids, hs, nc, len(try_ids), 16, 0),
                lambda: pair.dev.cache_full_blocks(try_ids, hs, nc, len(try_ids), 16, 0))
    pair.do("reset refused", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    pair.do("free all", lambda: pair.ref.free_blocks(blocks), lambda: pair.dev.free_blocks(blocks))
    pair.do("reset", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)


def test_free_batched_a_then_b_puts_b_ahead_of_a():
    """docs/semantics.md, batched forms: freeing A then B in one call puts B's un-hashed blocks ahead of A's;
    hashed blocks go to the back in the order they reach zero."""
    pair = Pair(12)
    a = ints(pair.dev.get_new_blocks(4))
    b = ints(pair.dev.get_new_blocks(4))
    assert a == ints(pair.ref.get_new_blocks(4)) and b == ints(pair.ref.get_new_blocks(4))
    hs = [H(f"a{i}") for i in range(4)]
    pair.used.update(hs[:1])
    pair.do("cache A[0]", lambda: pair.ref.cache_full_blocks(a, hs, 0, 1, BS),
            lambda: pair.dev.cache_full_blocks(a, hs, 0, 1, BS))
    rest = pair.ref.free_queue()
    segs = [a[::-1], b[::-1]]

    def ref_apply():
        for s in segs:
            pair.ref.free_blocks(s)
    pair.batched("free_batched(A, B)", None, ref_apply,
                 lambda: pair.dev.free_batched(i32(segs[0] + segs[1]), i32([0, 4, 8])))
    assert pair.dev.free_queue() == b[::-1] + a[:0:-1] + rest + [a[0]]


def test_free_batched_one_block_in_many_segments():
    """A block held several times, released across segments: it joins the queue once, at the segment
    where it reaches zero (the last occurrence)."""
    pair = Pair(8)
    blocks = ints(pair.dev.get_new_blocks(3))
    pair.ref.get_new_blocks(3)
    pair.do("touch", lambda: pair.ref.touch([blocks[0]] * 3), lambda: pair.dev.touch([blocks[0]] * 3))
    segs = [[blocks[0], blocks[1]], [blocks[0]], [], [blocks[2], blocks[0]], [blocks[0]]]
    flat = [x for s in segs for x in s]
    offs = [0]
    for s in segs:
        offs.append(offs[-1] + len(s))

    def ref_apply():
        for s in segs:
            pair.ref.free_blocks(s)
    pair.batched("free_batched", None, ref_apply, lambda: pair.dev.free_batched(i32(flat), i32(offs)))
    assert pair.dev.free_queue()[:3] == [blocks[0], blocks[2], blocks[1]]


@pytest.mark.parametrize("failing", ["free_double", "free_bad_id", "alloc_negative", "alloc_too_many",
                                     "touch_bad_id"])
def test_sticky_status_after_failing_batched_op(failing):
    """After a failing batched op, later batched ops (and single ops) do nothing until check() raises
    and clears the status word."""
    pair = Pair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(3))
    pair.ref.get_new_blocks(3)
    pair.used.update([H(1), H(2)])
    pair.do("cache", lambda: pair.ref.cache_full_blocks(blocks, [H(1), H(2)], 0, 2, BS),
            lambda: pair.dev.cache_full_blocks(blocks, [H(1), H(2)], 0, 2, BS))
    before = pool_state(pair.dev)
    dev = pair.dev
    launch, exc = {
        "free_double": (lambda: dev.free_batched(i32([blocks[0], blocks[0]]), i32([0, 1, 2])), DoubleFreeError),
        "free_bad_id": (lambda: dev.free_batched(i32([blocks[0], 8]), i32([0, 1, 2])), InvalidBlockIdError),
        "alloc_negative": (lambda: dev.allocate_batched(i32([1, -2])), InvalidCountError),
        "alloc_too_many": (lambda: dev.allocate_batched(i32([3, 3])), OutOfBlocksError),
        "touch_bad_id": (lambda: dev.touch_batched(i32([1, -1])), InvalidBlockIdError),
    }[failing]
    launch()
    # These would all succeed on their own.
    dev.allocate_batched(i32([1]))
    dev.free_batched(i32(blocks[:1]), i32([0, 1]))
    dev.touch_batched(i32([blocks[1]]))
    with pytest.raises(exc):
        dev.check()
    dev.check()  # cleared
    assert pool_state(dev) == before
    pair.compare()
    # A single op after a failing batched op raises that error and is not applied either.
    launch()
    with pytest.raises(exc):
        dev.free_blocks([blocks[2]])
    assert pool_state(dev) == before
    pair.compare()
    # And the pool works normally afterwards.
    pair.batched("allocate_batched([2])", None, lambda: [ints(pair.ref.get_new_blocks(2))],
                 lambda: dev.allocate_batched(i32([2])), lambda out: [ints(out[0])[:ints(out[1])[1]]])


def test_batched_error_is_that_of_the_first_failing_call():
    """A batch that would fail in two ways reports the first single call's error."""
    pair = Pair(6)
    # demand 0 asks for too many, demand 1 is negative: the sequence fails at demand 0.
    pair.batched("allocate_batched([9, -1])", OutOfBlocksError, None,
                 lambda: pair.dev.allocate_batched(i32([9, -1])))
    blocks = ints(pair.dev.get_new_blocks(2))
    pair.ref.get_new_blocks(2)
    # segment 0 double-frees, segment 1 has a bad id: the sequence fails at segment 0.
    pair.batched("free_batched([[b0, b0], [99]])", DoubleFreeError, None,
                 lambda: pair.dev.free_batched(i32([blocks[0], blocks[0], 99]), i32([0, 2, 3])))


def test_watchers_fire_in_handout_order_across_batched_demands():
    pair = Pair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(5))
    pair.ref.get_new_blocks(5)
    hs = [H(f"w{i}") for i in range(5)]
    pair.used.update(hs)
    pair.do("cache", lambda: pair.ref.cache_full_blocks(blocks, hs, 0, 5, BS),
            lambda: pair.dev.cache_full_blocks(blocks, hs, 0, 5, BS))
    for part in ([blocks[3], blocks[1]], [blocks[0], blocks[4], blocks[2]]):
        cr, cd = pair.callbacks()
        pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
    demands = [1, 3, 3]
    pair.batched(f"allocate_batched({demands})", None, lambda: [ints(pair.ref.get_new_blocks(d)) for d in demands],
                 lambda: pair.dev.allocate_batched(i32(demands)),
                 lambda out: [ints(out[0])[ints(out[1])[k]:ints(out[1])[k + 1]] for k in range(3)])
    assert len(pair.fired["ref"]) == 5


def test_lookup_and_longest_prefix_batched_against_reference():
    """Chains cached in two groups, a duplicate key on a second block (earliest inserted wins), some
    hit blocks free (zero_ref counts them)."""
    pair = Pair(16, mk=2)
    blocks = ints(pair.dev.get_new_blocks(8))
    pair.ref.get_new_blocks(8)
    chain = HASHES[:8]
    pair.used.update(chain)
    pair.do("cache g0", lambda: pair.ref.cache_full_blocks(blocks[:5], chain, 0, 5, BS),
            lambda: pair.dev.cache_full_blocks(blocks[:5], chain, 0, 5, BS))
    pair.do("cache g1", lambda: pair.ref.cache_full_blocks(blocks[5:8], chain, 0, 3, BS, 1),
            lambda: pair.dev.cache_full_blocks(blocks[5:8], chain, 0, 3, BS, 1))
    pair.do("partial g1", lambda: pair.ref.cache_partial_block(blocks[0], chain, 16, 1, 16, 4),
            lambda: pair.dev.cache_partial_block(blocks[0], chain, 16, 1, 16, 4))
    more = ints(pair.dev.get_new_blocks(2))
    pair.ref.get_new_blocks(2)
    pair.do("dup", lambda: pair.ref.cache_full_blocks(more, chain, 0, 2, BS),
            lambda: pair.dev.cache_full_blocks(more, chain, 0, 2, BS))
    pair.do("free some", lambda: pair.ref.free_blocks(blocks[:3][::-1]),
            lambda: pair.dev.free_blocks(blocks[:3][::-1]))
    check_lookup_batched(pair, [(i, g) for i in range(NUM_HASHES) for g in (0, 1, 2)])
    chains = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 9, 3, 4, 5, 6], [3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    for groups in ([0], [1], [0, 1], [1, 0]):
        check_longest_prefix(pair, chains, groups, [7, 7, 7, 2])
    # Long chains: more than one tile of positions.
    long_chain = [[i % 5 for i in range(300)]]
    check_longest_prefix(pair, long_chain, [0], [300])


def test_reset_fires_watchers_in_registration_order_after_reregistration():
    """Re-registering a watcher replaces the callback but keeps the block's place in the order."""
    pair = Pair(8, events=True)
    blocks = ints(pair.dev.get_new_blocks(5))
    pair.ref.get_new_blocks(5)
    pair.do("touch", lambda: pair.ref.touch(blocks), lambda: pair.dev.touch(blocks))  # ref 2 each
    for part in ([blocks[2], blocks[0]], [blocks[4], blocks[2]], [blocks[1], blocks[0], blocks[3]]):
        cr, cd = pair.callbacks()
        pair.do(f"unpin({part})", lambda: pair.ref.unpin_blocks(part, cr), lambda: pair.dev.unpin_blocks(part, cd))
    pair.do("reset refused", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    rest = [b for b, c in enumerate(pair.ref.ref_counts()) for _ in range(c) if b]
    pair.do(f"free({rest})", lambda: pair.ref.free_blocks(rest), lambda: pair.dev.free_blocks(rest))
    pair.do("reset", pair.ref.reset_prefix_cache, pair.dev.reset_prefix_cache)
    assert [b for _, b in pair.fired["ref"]] == [blocks[2], blocks[0], blocks[4], blocks[1], blocks[3]]


def test_cache_full_blocks_error_precedence_with_tensor_ids():
    pair = Pair(6)
    pair.ref.get_new_blocks(2)
    pair.dev.get_new_blocks(2)
    bad = [1, 6]
    pair.do("cache_full_blocks(tensor [1, 6], block_size=0)",
            lambda: pair.ref.cache_full_blocks(i32(bad), [H(0), H(1)], 0, 2, 0),
            lambda: pair.dev.cache_full_blocks(i32(bad), [H(0), H(1)], 0, 2, 0))


def test_key_table_too_small_is_refused():
    """A table with fewer slots than (N-1)*MK live keys could fill (an insert would find no slot):
    the constructor refuses it; the exact limit is accepted (test_key_table_near_its_limit)."""
    with pytest.raises(InvalidArgumentError):
        BlockPool(6, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 20 keys, 16 slots
    BlockPool(5, max_keys_per_block=4, num_chunks=1, device=DEVICE)  # 16 keys, 16 slots


def test_allocate_batched_fills_the_unused_tail_with_minus_one():
    """``blocks`` is ``int32[N + 1]``: past the last offset every entry is -1 (the kernel writes it, no
    extra launch); a failed or skipped batch leaves all of it -1."""
    n = 9
    dev = BlockPool(n, device=DEVICE)
    blocks, offsets = dev.allocate_batched(i32([2, 0, 3]))
    dev.check()
    assert blocks.shape == (n + 1,) and ints(offsets) == [0, 2, 2, 5]
    assert ints(blocks)[:5] == list(range(1, 6))
    assert ints(blocks)[5:] == [-1] * (n + 1 - 5)
    # A padded batch: only the first num_demands count; the tail starts at their sum.
    blocks, offsets = dev.allocate_batched(i32([1, 7]), torch.tensor([1], dtype=torch.int32, device=DEVICE))
    dev.check()
    assert ints(offsets)[:2] == [0, 1] and ints(blocks)[1:] == [-1] * n
    # Too many: nothing is allocated, every entry is -1, and so is a batch skipped by the sticky status.
    blocks, _ = dev.allocate_batched(i32([2, 9]))
    skipped, _ = dev.allocate_batched(i32([1]))
    assert ints(blocks) == [-1] * (n + 1) and ints(skipped) == [-1] * (n + 1)
    with pytest.raises(OutOfBlocksError):
        dev.check()
    blocks, _ = dev.allocate_batched(i32([2, -1]))  # a negative demand: nothing popped, all -1
    assert ints(blocks) == [-1] * (n + 1)
    with pytest.raises(InvalidCountError):
        dev.check()
    # A pool wider than one tile: the fill programs cover several tiles.
    big = BlockPool(5000, device=DEVICE)
    blocks, _ = big.allocate_batched(i32([3]))
    big.check()
    got = ints(blocks)
    assert got[:3] == [1, 2, 3] and got[3:] == [-1] * (5001 - 3)


@pytest.mark.parametrize("device, says", [
    ("foo", "unknown device 'foo'"),
    ("meta", "device meta is not supported"),
    pytest.param("cuda", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
    pytest.param("cuda:0", "no CUDA device", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_device_is_one_clear_error(device, says):
    from gpupool.manager import KVCacheManager
    with pytest.raises(InvalidArgumentError, match=says):
        BlockPool(8, device=device)
    with pytest.raises(InvalidArgumentError, match=says):
        KVCacheManager(16, block_size=4, max_num_reqs=2, max_blocks_per_req=4, device=device)


def _meta_i32(values):
    return torch.tensor(values, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("case", ["allocate_2d", "free_2d", "touch_2d", "free_blocks_meta", "get_new_blocks_meta",
                                  "touch_meta"])
def test_wrong_rank_or_meta_inputs_are_pool_errors_and_change_nothing(case):
    p = BlockPool(16, enable_caching=True)
    held = p.get_new_blocks(3)
    before = (p.free_queue(), p.ref_counts())
    calls = {
        "allocate_2d": lambda: p.allocate_batched(torch.tensor([[1, 2]], dtype=torch.int32)),
        "free_2d": lambda: p.free_batched(held.reshape(1, 3).to(torch.int32), torch.tensor([3], dtype=torch.int32)),
        "touch_2d": lambda: p.touch_batched(held.reshape(3, 1).to(torch.int32)),
        "free_blocks_meta": lambda: p.free_blocks(_meta_i32([1])),
        "get_new_blocks_meta": lambda: p.get_new_blocks(torch.tensor(2, device="meta")),
        "touch_meta": lambda: p.touch(_meta_i32([1])),
    }
    with pytest.raises(PoolError):
        calls[case]()
        p.check()
    assert (p.free_queue(), p.ref_counts()) == before


def _named_block(msg: str) -> str | None:
    import re
    m = re.search(r"\bblock (?:id )?(-?\d+)", msg)
    return m.group(1) if m else None


_H = [bytes([i]) * 32 for i in range(8)]  # distinct block hashes

# Each bad-input class of the pool's device-recorded errors: (setup, the failing op). The setup
# leaves the pool in a state both pools share; the failing op must raise the same class, name the
# same block, and leave the pool as the setup left it.
_BAD_INPUTS = {
    "double_free_in_one_call": (lambda p: p.get_new_blocks(3), lambda p: p.free_blocks([2, 2])),
    "double_free_across_calls": (lambda p: (p.get_new_blocks(3), p.free_blocks([3])), lambda p: p.free_blocks([3])),
    "free_out_of_range": (lambda p: p.get_new_blocks(3), lambda p: p.free_blocks([1, 40])),
    "touch_out_of_range": (lambda p: p.get_new_blocks(3), lambda p: p.touch([2, 99])),
    "unpin_free_block": (lambda p: p.get_new_blocks(3), lambda p: p.unpin_blocks([5], lambda b: None)),
    "cache_listed_twice": (lambda p: p.get_new_blocks(3), lambda p: p.cache_full_blocks([1, 1], _H[:2], 0, 2, 4)),
    "cache_already_cached": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1, 2], _H[:2], 0, 2, 4)),
                             lambda p: p.cache_full_blocks([3, 2], _H[2:4], 0, 2, 4)),
    "move_onto_keyed": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1, 2], _H[:2], 0, 2, 4)),
                        lambda p: p.move_block_hashes(1, 2)),
    "move_onto_null": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1], _H[:1], 0, 1, 4)),
                       lambda p: p.move_block_hashes(1, 0)),
    "key_capacity": (lambda p: (p.get_new_blocks(3), p.cache_full_blocks([1], _H[:1], 0, 1, 4)),
                     lambda p: p.cache_partial_block(1, _H[:3], 2, 1, 4, 2)),
}


def _pool_state(pool):
    return pool.free_queue(), pool.ref_counts(), [sorted(pool.block_keys(b)) for b in range(pool.num_blocks)]


@pytest.mark.parametrize("case", sorted(_BAD_INPUTS))
def test_device_errors_name_the_same_block_as_the_reference(case):
    """A device-recorded error names the offending block from the status word's value, as the
    reference pool's message does (same class, same block id), and changes nothing."""
    setup, fail = _BAD_INPUTS[case]
    errs = []
    for pool in pool_twin(16, enable_caching=True, max_keys_per_block=1):
        setup(pool)
        before = _pool_state(pool)
        with pytest.raises(PoolError) as e:
            fail(pool)
            if isinstance(pool, BlockPool):
                pool.check()
        errs.append(e.value)
        assert _pool_state(pool) == before
    ref, dev = errs
    assert type(dev) is type(ref)
    assert dev.value == ref.value, (str(ref), str(dev))
    named = _named_block(str(dev))
    assert named is not None and int(named) == ref.value, (str(ref), str(dev))


# =================================================================================================
# Watchers are flags
# =================================================================================================

@pytest.mark.slow
def test_unpin_many_watchers():
    """Watchers are flags, not counted ids: many unpin calls keep working."""
    p = BlockPool(4)
    fired = []
    for _ in range(50):
        b = p.get_new_blocks(1)
        p.unpin_blocks(b, fired.append)
    assert p.num_watchers() <= 3
    assert_consistent(p)



@pytest.mark.parametrize("case", ["out_of_blocks", "out_of_blocks_past_the_pool", "double_free", "double_unpin"])
def test_both_pools_word_the_same_error_the_same_way(case):
    """Out of blocks names the free count, a double free the block's ref count, in both pools and in
    the same words (the device's read at ``check()``, which the failed op left unchanged)."""
    msgs = []
    for pool in pool_twin(8):
        b = pool.get_new_blocks(2)
        try:
            if case == "out_of_blocks":
                pool.get_new_blocks(7)
            elif case == "out_of_blocks_past_the_pool":
                pool.get_new_blocks(9)
            elif case == "double_free":
                pool.free_blocks(b)
                pool.free_blocks(b[:1])
            else:
                pool.free_blocks(b[:1])
                pool.unpin_blocks(b[:1], lambda blk: None)
            if isinstance(pool, BlockPool):
                pool.check()
        except PoolError as e:
            msgs.append(str(e))
    assert len(msgs) == 2 and msgs[0] == msgs[1], msgs
    assert "(5 free)" in msgs[0] if case.startswith("out_of") else "ref_cnt 0" in msgs[0]
