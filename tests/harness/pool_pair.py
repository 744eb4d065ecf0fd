"""The op-for-op differential harness of the pools: :class:`PoolPair` (a reference pool and a device
pool driven side by side, the whole state compared after every op) and its op generators (hypothesis
draws), used by tests/pool/test_device_pool.py.
"""
from __future__ import annotations

import os


import torch
from hypothesis import event as _event
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from gpupool.kernels.layout import Ctrl
from gpupool.errors import (
    DoubleFreeError, InvalidBlockIdError, InvalidCountError, OutOfBlocksError, PoolError,
)
from gpupool.keys import device_key

from harness.compare import assert_pools_agree
from harness.device import DEVICE, i32, i64
from harness.keys import h
from harness.ops import call_both, flat_segments
from harness.sizes import pow2_at_least
from harness.strategies import note
from harness.twins import pool_twin
from harness.state import ints, pool_state
from harness.watchers import reuse_callbacks


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

class PoolPair:
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
    flat, offs = flat_segments(segs)

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
