"""The batched ops' input checks: garbage into every device input, and hand-written bad inputs.

Each batched op of :class:`gpupool.BlockPool` (``allocate_batched``, ``free_batched``,
``touch_batched``, ``lookup_batched``, ``longest_prefix_batched``) and of
:class:`gpupool.manager.KVCacheManager` (``allocate_slots``, ``free``, ``slot_mapping``,
``get_computed_blocks``, ``release_copied``, ``admit``, ``append_tokens``), the
:class:`gpupool.graph.DecodeStep` and the :class:`gpupool.window.DecodeWindow` (begin, each step and
its end, with garbage in what a forward pass writes too) gets device tensors whose entries are
drawn from plausible values (ids, slots, counts in range) mixed with garbage: negative values,
values just past their array, huge values, int32 / int64 extremes, in the counted entries, the
counts, the offsets and the entries past the counts. The window's host arguments get junk too
(wrong types and shapes, values past int64, another manager's objects).

Whatever it gets, an op must not crash (no out-of-bounds access: in the interpreter a stray read or
write aborts the process or raises), and then either

* ``check()`` raises a typed :class:`PoolError` subclass (never the bare base) and every device
  tensor of the pool (and manager) is bit for bit as before, with no events and no watcher calls; or
* ``check()`` passes (the drawn garbage happened to be valid) and ``validate()`` holds (the manager's
  too: every ref count equals its references from block tables and pending copies).

Inputs that are certainly invalid (a count outside its array, a counted id or slot out of range)
must give the error. Default: a few examples per op (``GPUPOOL_FUZZ_EXAMPLES``, default 4), so the
default run stays short (about 30 s on two cores); ``test_fuzz_long`` (``@slow``, skipped unless
``GPUPOOL_FUZZ_LONG=<examples per op>`` is set: 40 per op take about ten minutes on two cores) runs
the large one.

Hand-written cases at the end: a chain length past its array and group ids out of range read on the
device (``longest_prefix_batched``), empty count tensors, output buffers shorter than the batch, ids
or flags that a dtype would narrow, bad ``slot_mapping`` slots and positions: each a typed error
(raised on the host, or at ``check()``) that changes nothing; a window too large for memory.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool import BlockPool
from gpupool.errors import InvalidArgumentError, PoolError
from gpupool.graph import DecodeStep
from gpupool.keys import device_key
from gpupool.manager import KVCacheManager
from gpupool.window import DecodeWindow
from harness.compare import assert_consistent
from harness.device import cpu_i32
from harness.keys import h
from harness.sizes import sized
from harness.state import manager_snapshot, pool_state, raw_state, same_raw_state
from harness.twins import small_manager

EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_EXAMPLES") or sized(4, 2))  # per op; dev: 2, ci: 4
LONG_EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_LONG") or 0)
N = 16  # pool blocks
BS = 4
R, M = 4, 6  # manager slots, blocks per row
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def t32(v):
    return torch.tensor(list(v), dtype=torch.int32, device=DEV)


def t64(v):
    return torch.tensor(list(v), dtype=torch.int64, device=DEV)


def garbage32(limit: int):
    """An int32: mostly plausible (0 .. limit), else garbage around and far past the bounds."""
    return st.one_of(
        st.integers(0, max(limit - 1, 0)),
        st.integers(0, max(limit - 1, 0)),
        st.sampled_from([-1, -2, limit, limit + 1, 2 * limit, 10**6, I32_MAX, I32_MIN, I32_MAX - 1, I32_MIN + 1]),
        st.integers(I32_MIN, I32_MAX),
    )


def garbage64():
    return st.one_of(st.integers(-4, 4), st.sampled_from([I64_MIN, I64_MAX, 2**32, -(2**32), 2**31]),
                     st.integers(I64_MIN, I64_MAX))


def vec32(data, limit: int, min_size=0, max_size=5, name="v"):
    return data.draw(st.lists(garbage32(limit), min_size=min_size, max_size=max_size), label=name)


def count32(data, n: int, name="count"):
    """A device count for an array of n: None (the whole array), a valid one, or garbage."""
    return data.draw(st.one_of(st.none(), st.integers(0, n), garbage32(n + 1)), label=name)


def bad_count(c, n) -> bool:
    return c is not None and not 0 <= c <= n


# ---- the pool and manager under test ----------------------------------------------------------

def make_pool() -> BlockPool:
    """16 blocks: 5 held (3 keyed), 3 keyed and free, the rest free; KV events on."""
    p = BlockPool(N, enable_kv_cache_events=True, event_capacity=256, device=DEV)
    b = p.get_new_blocks(8).tolist()
    p.cache_full_blocks(b[:6], [h(i) for i in range(6)], 0, 6, BS, 0)
    p.free_blocks(list(reversed(b[3:6])))
    p.take_events()
    return p


def make_manager(hashing: bool = False) -> KVCacheManager:
    """R = 4 slots of two groups (full + sliding window): slot 0 and 1 running, slot 2 added (no
    blocks), slot 3 free (``hashing``: admitted with a tail, so it hashes the tokens it gains); one
    pending copy-on-write copy; KV events on."""
    m = KVCacheManager(24, block_size=BS, max_num_reqs=R, max_blocks_per_req=M, groups=("full", ("sliding_window", 8)),
                       enable_kv_cache_events=True, device=DEV)
    m.add_request(0, [h(1), h(2)])
    m.add_request(1, [h(1), h(3)])
    m.allocate_slots([0, 1], [9, 6], [9, 6], [1, 1])
    m.add_request(2, [h(1)])
    m.cow_append(2, [m.rows(0)[0][0], m.rows(1)[0][0]])
    if hashing:
        m.admit([3], [[h(1)]], [6], [[9, 10]])
    m.pool.check()
    m.pool.take_events()
    m.validate()
    return m


def checked(pool, fn, *, manager=None, must_fail: bool = False):
    """Run ``fn`` (a batched op on garbage), then ``check()``: an error must be a typed PoolError with
    the device state unchanged; else the state must validate. Returns whether it failed."""
    pool.check()
    pool.take_events()
    before, before_state = raw_state(pool, manager), pool_state(pool)
    try:
        fn()
    except PoolError as e:  # raised at once on the host (host-checked inputs)
        assert type(e) is not PoolError, repr(e)
        assert same_raw_state(before, raw_state(pool, manager)) == []
        return True
    after = raw_state(pool, manager)
    try:
        pool.check()
    except PoolError as e:
        assert type(e) is not PoolError, repr(e)
        changed = same_raw_state(before, after)
        assert changed == [], f"{e!r} but changed {changed}"
        assert pool_state(pool) == before_state
        assert pool.take_events() == []
        (manager or pool).validate()
        return True
    assert not must_fail, "certainly invalid input passed"
    (manager or pool).validate()
    assert_consistent(pool)
    return False


# ---- BlockPool's batched ops ----------------------------------------------------------------------

def op_allocate_batched(data):
    p = make_pool()
    demands = vec32(data, 4, 1, 4, "demands")
    c = count32(data, len(demands))
    counted = demands if c is None else demands[: c] if 0 <= c <= len(demands) else []
    bad = bad_count(c, len(demands)) or any(d < 0 for d in counted)
    checked(p, lambda: p.allocate_batched(t32(demands), None if c is None else t32([c])), must_fail=bad)


def op_free_batched(data):
    p = make_pool()
    ids = vec32(data, N, 0, 6, "ids")
    nseg = data.draw(st.integers(0, 3), label="segments")
    segs = [0] + sorted(data.draw(st.lists(st.integers(0, len(ids)), min_size=nseg, max_size=nseg), label="cuts"))
    if data.draw(st.booleans(), label="garble offsets"):
        segs = vec32(data, len(ids) + 1, 1, 4, "seg_offsets")
    c = count32(data, len(ids))
    n = len(ids) if c is None else c
    bad = bad_count(c, len(ids)) or any(not 0 <= b < N for b in ids[: max(0, min(n, len(ids)))])
    checked(p, lambda: p.free_batched(t32(ids), t32(segs), None if c is None else t32([c])), must_fail=bad)


def op_touch_batched(data):
    p = make_pool()
    ids = vec32(data, N, 0, 6, "ids")
    c = count32(data, len(ids))
    n = len(ids) if c is None else c
    bad = bad_count(c, len(ids)) or any(not 0 <= b < N for b in ids[: max(0, min(n, len(ids)))])
    checked(p, lambda: p.touch_batched(t32(ids), None if c is None else t32([c])), must_fail=bad)


def op_lookup_batched(data):
    p = make_pool()
    k = data.draw(st.integers(0, 4), label="keys")
    keys = [device_key(h(data.draw(st.integers(0, 8))), data.draw(st.integers(0, 1))) for _ in range(k)]
    hi = [kk[0] for kk in keys]
    lo = [kk[1] for kk in keys]
    if k and data.draw(st.booleans(), label="garble keys"):
        hi = data.draw(st.lists(garbage64(), min_size=k, max_size=k))
        lo = data.draw(st.lists(garbage64(), min_size=k, max_size=k))
    groups = data.draw(st.lists(garbage32(2), min_size=k, max_size=k), label="groups")
    c = count32(data, k)
    out = []
    checked(p, lambda: out.append(p.lookup_batched(t64(hi), t64(lo), t32(groups), None if c is None else t32([c]))),
            must_fail=bad_count(c, k))


def op_longest_prefix_batched(data):
    p = make_pool()
    r = data.draw(st.integers(1, 3), label="R")
    g = data.draw(st.integers(1, 2), label="G")
    length = data.draw(st.integers(1, 4), label="L")
    keys = [[[device_key(h(data.draw(st.integers(0, 7))), gg % 2) for _ in range(length)] for gg in range(g)]
            for _ in range(r)]
    hi = torch.tensor([[[k[0] for k in row] for row in rg] for rg in keys], dtype=torch.int64, device=DEV)
    lo = torch.tensor([[[k[1] for k in row] for row in rg] for rg in keys], dtype=torch.int64, device=DEV)
    if data.draw(st.booleans(), label="garble a key"):
        hi.view(-1)[data.draw(st.integers(0, hi.numel() - 1))] = data.draw(garbage64())
    groups = data.draw(st.lists(garbage32(2), min_size=g, max_size=g), label="groups")
    lengths = data.draw(st.lists(garbage32(length + 1), min_size=r, max_size=r), label="lengths")
    bad = any(not 0 <= x <= length for x in lengths)
    checked(p, lambda: p.longest_prefix_batched(hi, lo, t32(groups), t32(lengths)), must_fail=bad)


# ---- the manager's batched ops and the decode step ----------------------------------------------

def op_allocate_slots(data):
    m = make_manager()
    b = data.draw(st.integers(1, 4), label="B")
    slots = vec32(data, R, b, b, "slots")
    nt = vec32(data, M * BS + 1, b, b, "num_tokens")
    tg = vec32(data, M * BS + 1, b, b, "target")
    lk = data.draw(st.lists(st.sampled_from([0, 1, -1, 127, -128]), min_size=b, max_size=b), label="lookup")
    c = count32(data, b, "num_reqs")
    n = b if c is None else c
    counted = slots[: max(0, min(n, b))]
    bad = bad_count(c, b) or any(not 0 <= s < R for s in counted)
    lookup = torch.tensor(lk, dtype=torch.int8, device=DEV)
    checked(m.pool, lambda: m.allocate_slots(t32(slots), t32(nt), t32(tg), lookup, None if c is None else t32([c]),
                                             stop_on_failure=data.draw(st.booleans(), label="stop")),
            manager=m, must_fail=bad)


def op_free(data):
    m = make_manager()
    slots = vec32(data, R, 0, 4, "slots")
    c = count32(data, len(slots), "num_reqs")
    n = len(slots) if c is None else c
    bad = bad_count(c, len(slots)) or any(not 0 <= s < R for s in slots[: max(0, min(n, len(slots)))])
    checked(m.pool, lambda: m.free(t32(slots), None if c is None else t32([c])), manager=m, must_fail=bad)


def op_slot_mapping(data):
    m = make_manager()
    k = data.draw(st.integers(0, 4), label="T")
    wide = data.draw(st.booleans(), label="int64 inputs")
    mk = t64 if wide else t32
    slots = data.draw(st.lists(garbage64() if wide else garbage32(R), min_size=k, max_size=k), label="slots")
    pos = data.draw(st.lists(garbage64() if wide else garbage32(M * BS), min_size=k, max_size=k), label="positions")
    c = count32(data, k, "num")
    offset = data.draw(st.one_of(st.integers(-2, 2), st.sampled_from([I32_MIN, I32_MAX, 2**40, -(2**40)])),
                       label="offset")
    adm = data.draw(st.one_of(st.none(), st.lists(garbage32(2), min_size=k, max_size=k)), label="admitted")
    group = data.draw(st.integers(0, 1), label="group")
    checked(m.pool, lambda: m.slot_mapping(mk(slots), mk(pos), group, None if c is None else t32([c]),
                                           position_offset=offset, admitted=None if adm is None else t32(adm)),
            manager=m, must_fail=bad_count(c, k))


def op_get_computed_blocks(data):
    m = make_manager()
    k = data.draw(st.integers(0, 3), label="B")
    slots = vec32(data, R, k, k, "slots")
    nt = vec32(data, M * BS + 1, k, k, "num_tokens")
    checked(m.pool, lambda: m.get_computed_blocks(t32(slots), t32(nt)), manager=m,
            must_fail=any(not 0 <= s < R for s in slots))


def op_release_copied(data):
    m = make_manager()
    ids = vec32(data, 24, 0, 4, "release")
    # the manager's own pending copies are left alone; a release of garbage ids must fail or validate
    # without the manager's identity (the caller holds those references), so check the pool only
    checked(m.pool, lambda: m.release_copied(t32(ids)), must_fail=any(not 0 <= b < 24 for b in ids))


def garbage_inputs(data, w) -> bool:
    """Garbage into the input buffers of a DecodeStep or DecodeWindow ``w`` of 3 lanes: slots, token
    counts, finished slots and both counts. Returns whether the counts are within their arrays."""
    w.slots.copy_(t32(vec32(data, R, 3, 3, "slots")))
    w.num_tokens.copy_(t32(vec32(data, M * BS + 1, 3, 3, "num_tokens")))
    w.finished.copy_(t32(vec32(data, R, 3, 3, "finished")))
    nr = data.draw(st.one_of(st.integers(0, 3), garbage32(4)), label="num_reqs")
    nf = data.draw(st.one_of(st.integers(0, 1), garbage32(4)), label="num_finished")
    w.num_reqs.fill_(nr)
    w.num_finished.fill_(nf)
    return 0 <= nr <= 3 and 0 <= nf <= 3


def op_decode_step(data):
    m = make_manager()
    step = DecodeStep(m, max_batch=3)
    checked(m.pool, step.run, manager=m, must_fail=not garbage_inputs(data, step))


def mostly(data, valid, garbage, label: str):
    """A value from ``valid`` three times in four, else from ``garbage`` (strategies)."""
    return data.draw(st.one_of(valid, valid, valid, garbage), label=label)


def op_decode_window(data):
    """A decode window (gpupool/window.py): its inputs valid (lanes of the slots in use, the request
    that hashes its tokens among them) or garbage, then before every step and its end what a forward
    pass writes, valid or with one garbage entry (a stop flag, an accepted count, a token id of any
    size); begin, each step and the end checked one by one (an op that fails changes nothing, and the
    window stops there)."""
    m = make_manager(hashing=True)
    K = data.draw(st.integers(1, 3), label="K")
    D = data.draw(st.integers(0, 2), label="D")
    Q = D + 1
    w = DecodeWindow(m, 3, K, D)
    if data.draw(st.booleans(), label="valid inputs"):
        order = data.draw(st.permutations([0, 1, 2]), label="order")
        n = data.draw(st.integers(0, 2), label="other lanes")
        lanes = order[:n] + [3]
        fin = order[n:n + data.draw(st.integers(0, 1), label="finished")]
        w.set_inputs(lanes, [data.draw(st.integers(1, M * BS - D), label="tokens") for _ in lanes], fin)
        must_fail = False
    else:
        must_fail = not garbage_inputs(data, w)
    if checked(m.pool, w.begin, manager=m, must_fail=must_fail):
        return
    for k in range(K + 1):
        if k:
            stopped = [data.draw(st.sampled_from([0, 0, 0, 1]), label="stop") for _ in range(3)]
            acc = [data.draw(st.integers(1, Q), label="accepted") for _ in range(3)]
            toks = [data.draw(st.integers(0, 99), label="token") for _ in range(3 * Q)]
            wrong = data.draw(st.sampled_from(["nothing", "stop", "accepted", "token"]), label="wrong")
            i = data.draw(st.integers(0, 2), label="lane at fault")
            if wrong == "stop":
                stopped[i] = data.draw(st.sampled_from([-1, I32_MIN, 2]), label="stop")
            elif wrong == "accepted":
                acc[i] = data.draw(garbage32(Q + 1), label="accepted")
            elif wrong == "token":
                toks[i * Q + data.draw(st.integers(0, Q - 1), label="query")] = data.draw(garbage64(), label="token")
            w.stopped.copy_(t32(stopped))
            w.accepted.copy_(t32(acc))
            w.tokens.copy_(t64(toks).view(3, Q))
        if checked(m.pool, (lambda k=k: w.step(k)) if k < K else w.end, manager=m):
            return


def op_admit(data):
    """``admit`` of requests (slots 1 and 3 free; some hash their tokens) with something wrong or odd
    drawn: the slots (in use, out of range, repeated: checked on the device), a token count, the
    hashes (too many, short, not bytes), a tail (a token past int32, a whole hash block), the resumed
    flags, the blocked flag (any value, another manager's window flags, a wrong dtype or size) or an
    output buffer (short, another dtype)."""
    m = make_manager()
    m.free([1])
    m.pool.check()
    m.pool.take_events()
    b = data.draw(st.integers(1, 3), label="B")
    slots = [mostly(data, st.sampled_from([1, 3]), garbage32(R), "slot") for _ in range(b)]
    nts, hs, tails = [], [], []
    for _ in range(b):
        n = data.draw(st.integers(1, M * BS), label="tokens")
        nts.append(n)
        hs.append([h(data.draw(st.integers(0, 4), label="hash")) for _ in range(n // BS)])
        tails.append(list(range(n % BS)) if data.draw(st.booleans(), label="hashing") else None)
    resumed, blocked, bufs = None, None, (None, None)
    j = data.draw(st.integers(0, b - 1), label="request at fault")
    wrong = data.draw(st.sampled_from(["nothing", "count", "hashes", "tail", "resumed", "blocked", "buffer"]),
                      label="wrong")
    if wrong == "count":
        nts[j] = data.draw(st.sampled_from([0, -1, M * BS + 1, 2**31, 2**40]), label="count")
    elif wrong == "hashes":
        hs[j] = data.draw(st.sampled_from([[h(0)] * (M + 1), [b"x" * 31], [7], "ab"]), label="hashes")
    elif wrong == "tail":
        tails[j] = data.draw(st.sampled_from([[2**31], [-(2**31) - 1], list(range(BS)), [0.5]]), label="tail")
    elif wrong == "resumed":
        resumed = data.draw(st.sampled_from([[2] * b, [-1] * b, [1] * (b + 1), ["x"] * b]), label="resumed")
    elif wrong == "blocked":
        blocked = data.draw(st.sampled_from([[0], [1], [-1], [I32_MAX], "other window", "int64", "empty", "2d"]),
                            label="blocked")
        if blocked == "other window":  # another manager's window flags: a device flag like any other
            blocked = DecodeWindow(KVCacheManager(8, block_size=BS, max_num_reqs=2, max_blocks_per_req=2,
                                                  device=DEV), 1).flags[:1]
        elif isinstance(blocked, str):
            blocked = {"int64": t64([0]), "empty": t32([]),
                       "2d": torch.zeros((1, 1), dtype=torch.int32, device=DEV)}[blocked]
        else:
            blocked = t32(blocked)
    elif wrong == "buffer":
        bufs = data.draw(st.sampled_from([(t32([7] * (b - 1)), None), (None, t64([7] * b)), (t32([7] * b), t32([7] * b))]),
                         label="buffers")
    bad = any(not 0 <= s < R for s in slots) or any(s in (0, 2) for s in slots) or len(set(slots)) < b
    checked(m.pool, lambda: m.admit(slots, hs, nts, tails, resumed, blocked=blocked, admitted=bufs[0],
                                    hit_tokens=bufs[1]), manager=m, must_fail=bad)


def op_append_tokens(data):
    """``append_tokens`` to requests in use, slot 3 (which hashes its tokens) among them, with something
    wrong drawn for another request: its slot (garbage: checked on the device), its count (past the
    tokens' width, negative), a token id (any int64); or the count of requests, token rows fewer or
    more than the slots, another dtype. A failed call must not have appended slot 3's tokens."""
    m = make_manager(hashing=True)
    b = data.draw(st.integers(2, 3), label="B")
    slots = data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=b - 1, max_size=b - 1, unique=True), label="others")
    lane = data.draw(st.integers(0, b - 1), label="hashing lane")
    slots.insert(lane, 3)
    T = data.draw(st.integers(1, 3), label="T")
    counts = [data.draw(st.integers(1, T), label="count") for _ in range(b)]
    vals = [data.draw(st.integers(0, 99), label="token") for _ in range(b * T)]
    rows, dtype, c = b, torch.int64, None
    wrong = data.draw(st.sampled_from(["slot", "count", "token", "num_reqs", "rows", "dtype", "nothing"]), label="wrong")
    j = data.draw(st.sampled_from([i for i in range(b) if i != lane]), label="request at fault")
    if wrong == "slot":
        slots[j] = data.draw(garbage32(R), label="slot")
    elif wrong == "count":
        counts[j] = data.draw(garbage32(T + 1), label="count")
    elif wrong == "num_reqs":
        c = data.draw(garbage32(b + 1), label="num_reqs")
    elif wrong == "token":
        vals[j * T] = data.draw(garbage64(), label="token")
    elif wrong == "rows":
        rows = data.draw(st.sampled_from([b - 1, b + 1]), label="rows")
        vals = (vals + [0] * T)[: rows * T]
    elif wrong == "dtype":
        dtype = data.draw(st.sampled_from([torch.float32, torch.int32, torch.int16]), label="dtype")
    tokens = torch.tensor(vals, dtype=torch.int64).view(rows, T).to(dtype).to(DEV)
    n = b if c is None else c
    bad = bad_count(c, b) or any(not 0 <= s < R for s in slots[: max(0, min(n, b))]) \
        or len(set(slots[: max(0, min(n, b))])) < min(max(n, 0), b)
    checked(m.pool, lambda: m.append_tokens(t32(slots), t32(counts), tokens, None if c is None else t32([c])),
            manager=m, must_fail=bad)


JUNK = ("none", "bool", "float", "nan", "str", "bytes", "int64 max", "past int64", "list", "list of floats",
        "list of str", "nested list", "list past int32", "dict", "generator", "tensor f32", "tensor i64 past int32",
        "tensor 2d", "tensor meta", "tensor empty", "other manager", "other state", "other window")


def junk(data, label: str, other: KVCacheManager):
    """A value of the wrong type, shape or range for any argument (``other``: a second manager, whose
    objects are junk to this one's ops)."""
    kind = data.draw(st.sampled_from(JUNK), label=label)
    values = {
        "none": lambda: None, "bool": lambda: True, "float": lambda: 1.5, "nan": lambda: float("nan"),
        "str": lambda: "0", "bytes": lambda: b"\0" * 32, "int64 max": lambda: I64_MAX, "past int64": lambda: 2**70,
        "list": lambda: [0, 1], "list of floats": lambda: [0.5], "list of str": lambda: ["a"],
        "nested list": lambda: [[0]], "list past int32": lambda: [2**40], "dict": lambda: {0: 1},
        "generator": lambda: (x for x in [0]), "tensor f32": lambda: torch.zeros(2, device=DEV),
        "tensor i64 past int32": lambda: t64([2**40]), "tensor 2d": lambda: torch.zeros((2, 2), dtype=torch.int32,
                                                                                              device=DEV),
        "tensor meta": lambda: torch.zeros(2, dtype=torch.int32, device="meta"), "tensor empty": lambda: t32([]),
        "other manager": lambda: other, "other state": lambda: other.state.active,
        "other window": lambda: DecodeWindow(other, 1)}
    return values[kind]()


def op_window_host_args(data):
    """The host-side arguments of the window's entry points (``DecodeWindow(...)``, ``set_inputs``,
    ``step``, ``admit``, ``append_tokens``), each argument valid or junk (:func:`junk`): the call
    succeeds (the pool validates) or raises a PoolError subclass at once or at ``check()`` with nothing
    changed. Sizes past int64 and huge window sizes are left to test_window_sizes_past_memory."""
    m = make_manager(hashing=True)
    other = KVCacheManager(8, block_size=BS, max_num_reqs=2, max_blocks_per_req=2, device=DEV)
    w = DecodeWindow(m, 3, 2)
    entry = data.draw(st.sampled_from(["window", "set_inputs", "step", "admit", "append_tokens"]), label="entry")
    good = {"window": [3, 2, 1, [], True, True], "set_inputs": [[0, 1], [10, 7], [2]], "step": [0],
            "admit": [[], [], [], None, None, None],
            "append_tokens": [t32([0, 3]), t32([1, 1]), t64([[5], [6]]), None]}[entry]
    args = [junk(data, f"argument {i}", other) if data.draw(st.booleans(), label=f"junk {i}") else a
            for i, a in enumerate(good)]
    if entry == "window":
        args[:2] = [a if not isinstance(a, int) or isinstance(a, bool) or a <= 8 else 3 for a in args[:2]]
    fn = {"window": lambda: DecodeWindow(m, *args), "set_inputs": lambda: w.set_inputs(*args),
          "step": lambda: w.step(*args), "admit": lambda: m.admit(*args),
          "append_tokens": lambda: m.append_tokens(*args)}[entry]
    checked(m.pool, fn, manager=m)


OPS = {f.__name__.removeprefix("op_"): f for f in (
    op_allocate_batched, op_free_batched, op_touch_batched, op_lookup_batched, op_longest_prefix_batched,
    op_allocate_slots, op_free, op_slot_mapping, op_get_computed_blocks, op_release_copied, op_decode_step,
    op_decode_window, op_admit, op_append_tokens, op_window_host_args)}

HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
@pytest.mark.heavy("allocate_slots", "release_copied", "get_computed_blocks", "decode_step", "decode_window",
                    "append_tokens", "window_host_args")
def test_fuzz(op, data):
    OPS[op](data)


@pytest.mark.slow
@pytest.mark.skipif(not LONG_EXAMPLES, reason="set GPUPOOL_FUZZ_LONG=<examples per op> for the large run")
@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=max(LONG_EXAMPLES, 1), deadline=None, suppress_health_check=HEALTH)
@given(data=st.data())
def test_fuzz_long(op, data):
    OPS[op](data)


# =================================================================================================
# Host-side checks of the batched ops' device inputs and outputs: lengths and group ids read on the
# device, empty count tensors, short output buffers, narrowing dtypes, slot_mapping's slots / positions
# =================================================================================================

def test_longest_prefix_length_past_its_array():
    """The issue's repro: a length past the chain (100000 for L = 2) reads nothing past the buffers and
    records a typed error; the pool is unchanged."""
    p = BlockPool(16)
    before = pool_state(p)
    k = torch.zeros((2, 1, 2), dtype=torch.int64)
    hits, blocks, zero_ref = p.longest_prefix_batched(k, k, cpu_i32([0]), cpu_i32([0, 100000]))
    with pytest.raises(InvalidArgumentError):
        p.check()
    assert hits.tolist() == [0, 0] and zero_ref.tolist() == [0, 0]
    assert pool_state(p) == before
    for bad in (-1, 3, -(2**31)):
        p.longest_prefix_batched(k, k, cpu_i32([0]), cpu_i32([bad, 1]))
        with pytest.raises(InvalidArgumentError):
            p.check()
    assert pool_state(p) == before
    assert_consistent(p)


def test_longest_prefix_group_ids_out_of_range():
    """A group id read from the device that no pool accepts finds nothing (no crash)."""
    p = BlockPool(16)
    b = p.get_new_blocks(1)
    p.cache_full_blocks(b, [h(1)], 0, 1, 16, 0)
    from gpupool.keys import device_key
    hi, lo = device_key(h(1), 0)
    kh = torch.tensor([[[hi]]], dtype=torch.int64)
    kl = torch.tensor([[[lo]]], dtype=torch.int64)
    before = pool_state(p)
    for g in (-1, 2**31 - 1, -(2**31)):
        hits, _, _ = p.longest_prefix_batched(kh, kl, cpu_i32([g]), cpu_i32([1]))
        try:
            p.check()
        except PoolError:
            pass
        assert hits.tolist() == [0]
    assert pool_state(p) == before


def test_empty_count_tensors_are_refused():
    """A device count must have its one entry (the kernel reads ``count[0]``)."""
    p = BlockPool(8)
    empty = torch.zeros(0, dtype=torch.int32)
    before = pool_state(p)
    for fn in (lambda: p.allocate_batched(cpu_i32([1]), empty), lambda: p.free_batched(cpu_i32([1]), cpu_i32([0, 1]), empty),
               lambda: p.touch_batched(cpu_i32([1]), empty),
               lambda: p.lookup_batched(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                        cpu_i32([0]), empty)):
        with pytest.raises(InvalidArgumentError):
            fn()
    p.check()
    assert pool_state(p) == before


def test_manager_rejects_short_buffers_and_empty_counts():
    """An empty count tensor, an ``admitted`` / ``out`` buffer shorter than the batch and a release
    list of another dtype are refused on the host (the kernel would read or write past them, or the
    ids would be narrowed), changing nothing."""
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    before = manager_snapshot(m)
    empty = torch.zeros(0, dtype=torch.int32)
    cases = [
        lambda: m.allocate_slots(cpu_i32([0]), cpu_i32([6]), cpu_i32([6]), num_reqs=empty),
        lambda: m.allocate_slots(cpu_i32([0, 1]), cpu_i32([6, 6]), cpu_i32([6, 6]), admitted=torch.zeros(1, dtype=torch.int32)),
        lambda: m.allocate_slots(cpu_i32([0]), cpu_i32([6]), cpu_i32([6]), admitted=torch.zeros(1, dtype=torch.int64)),
        lambda: m.allocate_slots(cpu_i32([0]), cpu_i32([6]), cpu_i32([6]), admitted=torch.zeros(4, dtype=torch.int32)[::2]),
        lambda: m.free(cpu_i32([0]), num_reqs=empty),
        lambda: m.slot_mapping(cpu_i32([0, 0]), cpu_i32([1, 2]), out=torch.zeros(1, dtype=torch.int64)),
        lambda: m.slot_mapping(cpu_i32([0, 0]), cpu_i32([1, 2]), out=torch.zeros(2, dtype=torch.int32)),
        lambda: m.slot_mapping(cpu_i32([0, 0]), cpu_i32([1, 2]), admitted=cpu_i32([1])),
        lambda: m.slot_mapping(cpu_i32([0]), cpu_i32([1]), num=empty),
        lambda: m.release_copied(torch.tensor([2**32 + 1], dtype=torch.int64)),
        lambda: m.release_copied(torch.tensor([1.0])),
    ]
    for i, fn in enumerate(cases):
        with pytest.raises(InvalidArgumentError):
            fn()
        assert manager_snapshot(m) == before, i


def test_lookup_flags_are_not_narrowed():
    """A lookup flag of 256 in an int32 tensor means "look up" (not 256 -> int8 0)."""
    m = small_manager()
    m.add_request(0, [h(1), h(2)])
    m.allocate_slots([0], [9], [9], [1])
    m.add_request(1, [h(1), h(2)])
    m.allocate_slots(cpu_i32([1]), cpu_i32([9]), cpu_i32([9]), cpu_i32([256]))
    m.pool.check()
    assert m.rows(0)[1][:2] == m.rows(0)[0][:2]
    m.validate()


@pytest.mark.parametrize("slot,pos", [(4, 0), (-1, 0), (2**31 - 1, 0), (0, -1), (0, 8), (0, 2**31 - 1), (1, 0)])
def test_slot_mapping_bad_slot_or_position_is_a_pool_error(slot, pos):
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [5], [5], [1])
    m.pool.check()
    before = manager_snapshot(m)
    out = m.slot_mapping(cpu_i32([0, slot]), cpu_i32([0, pos]))
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    assert out[1].item() == -1
    assert manager_snapshot(m) == before
    for dt in (torch.int64,):  # no narrowing of int64 inputs
        out = m.slot_mapping(torch.tensor([slot + 2**32], dtype=dt), torch.tensor([pos], dtype=dt))
        with pytest.raises(InvalidArgumentError):
            m.pool.check()



# ---- outputs of a failed or skipped op (docs/errors.md, "Outputs of a failed or skipped op") -----

def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_allocate_batched_offsets_are_zero_after_a_failure_or_a_skip():
    from gpupool.errors import InvalidCountError, OutOfBlocksError

    pool = BlockPool(16)
    for demands, err in (([2, 100], OutOfBlocksError), ([1, -1], InvalidCountError)):
        out, offsets = pool.allocate_batched(_i32(demands))
        assert offsets.tolist() == [0, 0, 0] and set(out.tolist()) == {-1}
        with pytest.raises(err):
            pool.check()
    pool.allocate_batched(_i32([-1]))  # pending error: the next op is skipped
    out, offsets = pool.allocate_batched(_i32([2, 1, 3]))
    assert offsets.tolist() == [0, 0, 0, 0] and set(out.tolist()) == {-1}
    with pytest.raises(InvalidCountError):
        pool.check()
    assert pool.get_num_free_blocks() == 15


def test_allocate_slots_admits_nobody_after_a_failure_or_a_skip():
    from gpupool.manager import KVCacheManager

    m = KVCacheManager(64, block_size=4, max_num_reqs=4, max_blocks_per_req=8)
    m.add_request(0, [])
    buf = torch.full((2,), 7, dtype=torch.int32)  # a captured step's reused buffer
    m.allocate_slots([0, 3], [4, 4], [4, 4], admitted=buf)  # slot 3 never added
    assert buf.tolist() == [0, 0]
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    buf.fill_(7)
    m.allocate_slots(_i32([0]), _i32([4]), _i32([4]), num_reqs=_i32([5]), admitted=buf)  # count past the array
    assert buf.tolist() == [0, 7]  # the batch's one entry; past the batch the buffer is the caller's
    with pytest.raises(InvalidArgumentError):
        m.pool.check()
    m.pool.allocate_batched(_i32([-1]))  # pending: allocate_slots is skipped
    buf.fill_(7)
    m.allocate_slots([0], [4], [4], admitted=buf)
    assert buf.tolist() == [0, 7]  # the one counted entry; past the batch the buffer is the caller's
    with pytest.raises(PoolError):
        m.pool.check()


def test_slot_mapping_is_minus_one_past_the_count_and_for_a_bad_count():
    from gpupool.manager import KVCacheManager

    m = KVCacheManager(64, block_size=4, max_num_reqs=4, max_blocks_per_req=8)
    m.add_request(0, [])
    m.allocate_slots([0], [8], [8])
    m.pool.check()
    out = torch.full((3,), 12345, dtype=torch.int64)
    m.slot_mapping(_i32([0, 0, 0]), _i32([0, 5, 6]), num=_i32([2]), out=out)
    assert out[0] >= 0 and out[1] >= 0 and out[2] == -1
    m.pool.check()
    out.fill_(12345)
    m.slot_mapping(_i32([0, 0, 0]), _i32([0, 5, 6]), num=_i32([9]), out=out)
    assert out.tolist() == [-1, -1, -1]
    with pytest.raises(InvalidArgumentError):
        m.pool.check()


def test_manager_device_errors_say_what_the_op_checks():
    """The status word's errors of the manager's ops are worded per op and cause (the slot, or the token
    count; gpupool/manager_errors.py), not the catch-all of every batched op."""
    from gpupool.errors import InvalidCountError
    from gpupool.manager import KVCacheManager

    m = KVCacheManager(64, block_size=4, max_num_reqs=4, max_blocks_per_req=8)
    m.add_request(0, [])
    cases = [(InvalidArgumentError, lambda: m.allocate_slots([0, 3], [4, 4], [4, 4]),
              "allocate_slots: slot 3 is not in use"),
             (InvalidArgumentError, lambda: m.release_reservation([2]), "release_reservation: slot 2 is not in use"),
             (InvalidCountError, lambda: m.reserve([0], [40]), "reserve: token count 40 outside 0..32 for slot 0"),
             (InvalidCountError, lambda: m.allocate_slots([0], [40], [40]),
              "allocate_slots: token count 40 outside 0..32"),
             (InvalidArgumentError, lambda: m.slot_mapping([0], [99]), "slot_mapping: position 99 of slot 0 has no block")]
    for exc, fn, says in cases:
        fn()
        with pytest.raises(exc) as e:
            m.pool.check()
        assert str(e.value).startswith(says) and "a block or slot listed twice" not in str(e.value), str(e.value)


@pytest.mark.parametrize("make", [lambda m: DecodeWindow(m, 2**40, 1), lambda m: DecodeWindow(m, 1, 2**40),
                                  lambda m: DecodeStep(m, 2**40)], ids=["window-lanes", "window-steps", "step-lanes"])
def test_window_sizes_past_memory_are_a_typed_error(make):
    """A window of more lanes or steps than memory holds is refused with a PoolError, nothing changed."""
    m = make_manager()
    before = manager_snapshot(m)
    with pytest.raises(PoolError):
        make(m)
    assert manager_snapshot(m) == before
