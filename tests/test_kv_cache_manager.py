"""Differential tests: the device ``KVCacheManager`` against ``ReferenceKVCacheManager``, op for op.

Random multi-request workloads (hypothesis ``st.data()``) drive both managers side by side: small
pools (8..48 blocks), block size 4 or 16, 4..6 request slots of 8..16 blocks, KV-cache groups
("full",), ("full", "full") and ("full", ("sliding_window", w)), hash blocks equal to or finer
than blocks (``hash_block_size``: partial-block keys), prefix caching and KV events on and off. Requests draw their block hashes from a few shared templates and a small alphabet, so
prefixes are shared and hashes repeat (within a request too). Ops: ``add_request``, batched
``allocate_slots`` (prefill with lookup, chunked prefill, decode of one or more tokens with
``append_block_hashes`` when a block fills, lookahead, arbitrary counts, ``stop_on_failure`` on and
off, list and tensor arguments), batched ``free`` (list and tensor form), preemption (free and
re-add), ``get_computed_blocks``, ``slot_mapping``, copy-on-write (``cow_append`` with sources from
``get_computed_blocks`` / ``pool.get_cached_block`` / null / any block, ``cow_move``), draining the
copy queue (``take_pending_copies`` + ``release_copied``, or ``run_pending_copies`` on real KV-cache
tensors) and bad calls (slot out of range or listed twice, token counts out of range, ...).

After every op: results (admitted flags, hits, dsts, copies), each group's block-table rows,
``num_computed`` / ``num_cached``, the pending copies, the pool's free queue, ref counts, every
block's keys and ``hash_num_tokens``, the KV events, and ``validate()`` of both pools. An op that
raises must raise the same error class on both sides (a batched device op raises at
``pool.check()``) and change nothing.

Deterministic tests cover ``get_computed_blocks``, ``slot_mapping`` against the reference table,
``run_pending_copies`` on fp16 and fp32 caches ``[num_blocks, 2, block_size, 8]``, the sticky status
word of the batched ops, and stop_on_failure with preemption. The tests at the end pin the defects
these tests found once (BlockStored parents after a leading null block, tensor slots with events,
slots not in use, copies chained through the queue, unchecked get_computed_blocks slots, partial
keys past max_keys_per_block), now fixed; the last ones show that a recorded error (the sticky
status word) loses nothing: pending copies stay pending, ``free(list)`` changes nothing until it
succeeds.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
the default hypothesis profile keeps this file near a minute on two CPU cores.
``GPUPOOL_HYPOTHESIS_PROFILE=deep`` runs many more examples.
"""
from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:  # normally done by tests/conftest.py
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import event as _event  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpupool.errors import (  # noqa: E402
    InvalidArgumentError, InvalidCountError, PoolError,
)
from gpupool.graph import DecodeStep  # noqa: E402
from harness.compare import assert_managers_agree  # noqa: E402
from harness.device import DEVICE, i32  # noqa: E402
from harness.keys import h  # noqa: E402
from harness.ops import call_both, fail_a_batched_op, fill_step  # noqa: E402
from harness.state import ints, manager_snapshot, manager_state, raw_state, same_raw_state  # noqa: E402
from harness.strategies import draw_batch, note, rare  # noqa: E402
from harness.twins import SW, manager_twin, small_manager  # noqa: E402


# =================================================================================================
# Hashes and small helpers
# =================================================================================================

H = h  # a test key's block hash


# Request chains (one hash id per hash block) are a template's prefix plus a random tail: prefixes are
# shared between requests, and some templates repeat a hash (so one block can be hit twice by one
# request, and a partial-block key can answer a full-block lookup).
CHAIN_MAX = 64  # max_blocks_per_req (16) * hashes per block (4)
TEMPLATES = [
    list(range(CHAIN_MAX)),
    [0, 1, 2] + list(range(100, 100 + CHAIN_MAX - 3)),
    [30] * CHAIN_MAX,
    [i // 2 for i in range(CHAIN_MAX)],
]
TAIL = [0, 1, 2, 3, 20, 30, 40, 41]
ALPHABET = sorted({x for t in TEMPLATES for x in t} | set(TAIL))
HASH = {i: H(i) for i in ALPHABET}


# =================================================================================================
# The side-by-side harness
# =================================================================================================

class Pair:
    """A reference manager and a device manager with one configuration, plus the workload's model
    of each request (its hash chain and how many tokens it knows)."""

    def __init__(self, num_blocks, *, block_size, max_num_reqs, max_blocks_per_req, groups, caching, events,
                 hash_block_size=None, max_keys_per_block=4, kv_caches=False):
        kw = dict(block_size=block_size, max_num_reqs=max_num_reqs, max_blocks_per_req=max_blocks_per_req,
                  groups=groups, enable_caching=caching, enable_kv_cache_events=events,
                  max_keys_per_block=max_keys_per_block)
        if hash_block_size is not None:
            kw["hash_block_size"] = hash_block_size
        self.hbs = hash_block_size or block_size
        self.K = block_size // self.hbs  # hashes per block
        self.L = max_blocks_per_req * self.K  # most hashes a request can have
        self.ref, self.dev = manager_twin(num_blocks, **kw)
        self.N, self.bs, self.R, self.M, self.G = num_blocks, block_size, max_num_reqs, max_blocks_per_req, len(groups)
        self.max_tokens = max_blocks_per_req * block_size
        self.caching, self.events = caching, events
        self.chain: list[list[int] | None] = [None] * max_num_reqs  # hash ids of the request's blocks
        self.known = [0] * max_num_reqs  # tokens the request knows (prompt + generated)
        self.ops: list[str] = []
        self.caches = None
        if kv_caches:
            g = torch.Generator().manual_seed(num_blocks)
            self.caches = [torch.randn(num_blocks, 2, block_size, 8, generator=g).to(DEVICE, dt)
                           for dt in (torch.float16, torch.float32)]
        self.compare()

    # ---- the workload model -------------------------------------------------------------------
    def active(self) -> list[int]:
        return [r for r in range(self.R) if self.chain[r] is not None]

    def free_slots(self) -> list[int]:
        return [r for r in range(self.R) if self.chain[r] is None]

    def row_len(self, r: int) -> int:
        return len(self.ref.tables[0][r])

    def num_hashes(self, r: int) -> int:
        return len(self.ref.hashes[r])

    # ---- comparing ------------------------------------------------------------------------------
    def where(self) -> str:
        return "after ops:\n  " + "\n  ".join(self.ops[-15:])

    def compare(self) -> None:
        """The whole state of both managers (harness.compare.assert_managers_agree)."""
        assert_managers_agree(self.ref, self.dev, where=self.where())

    def do(self, desc: str, ref_fn, dev_fn, norm=lambda x: x):
        """Run the op on both sides (the device's batched errors surface at ``pool.check()``). Both
        raise the same error class in the same words, and then neither changed anything, or both return equal
        (normalised) results. Then the whole state is compared. Returns the reference's result or
        None when it raised."""
        self.ops.append(desc)
        note(desc)
        before_ref, before_dev = manager_state(self.ref), manager_state(self.dev)
        r_val, r_err, d_val, d_err = call_both(ref_fn, dev_fn, self.dev.pool.check)
        assert type(d_err) is type(r_err), f"{desc}: device raised {d_err!r}, reference {r_err!r}; {self.where()}"
        assert str(d_err) == str(r_err), f"{desc}: device said {d_err}, reference {r_err}"  # the same words
        event(desc, r_err, r_val)
        if r_err is not None:
            assert manager_state(self.ref) == before_ref, f"{desc}: the reference raised but changed state"
            assert manager_state(self.dev) == before_dev, f"{desc}: the device raised but changed state"
            self.dev.pool.check()  # the status word was cleared
        else:
            assert norm(d_val) == norm(r_val), f"{desc}: device returned {norm(d_val)!r}, reference {norm(r_val)!r}"
        self.compare()
        return None if r_err is not None else r_val


def event(desc: str, err, val=None) -> None:
    """Count which ops ran and how they ended (``--hypothesis-show-statistics``)."""
    if currently_in_test_context():
        how = type(err).__name__ if err is not None else "ok"
        if err is None and desc.startswith(("allocate_slots", "decode step")):
            how = "admitted " + "".join("1" if x else "0" for x in admitted_norm(val))
        _event(f"{desc.split('(')[0]}: {how}")


def computed_norm(out, G):
    """get_computed_blocks results of either manager as [(hits, [[blocks of group g]...])]."""
    if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
        hits, blocks = ints(out[0]), out[1].tolist()
        return [(h, [blocks[b][g][:h] for g in range(G)]) for b, h in enumerate(hits)]
    return [(h, [list(x) for x in bl]) for h, bl in out]


def admitted_norm(out):
    return [bool(x) for x in ints(out)] if isinstance(out, torch.Tensor) else [bool(x) for x in out]


def copies_norm(out):
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], torch.Tensor):
        return list(zip(ints(out[0]), ints(out[1]), ints(out[2])))
    return [tuple(c) for c in out]


# =================================================================================================
# Op generators: each draws one op and runs it on both managers
# =================================================================================================

def draw_chain(data, p: Pair) -> list[int]:
    t = data.draw(st.sampled_from(TEMPLATES), label="template")
    # the template prefix is drawn in blocks, so requests share whole-block prefixes
    k = min(p.L, data.draw(st.integers(0, p.M), label="template prefix blocks") * p.K)
    tail = data.draw(st.lists(st.sampled_from(TAIL), min_size=p.L - k, max_size=p.L - k), label="tail")
    return (t[:k] + tail)[: p.L]


def request_hashes(data, p: Pair, r: int) -> list[bytes]:
    """Hashes handed over at (re-)admission: the known full blocks, sometimes fewer or more."""
    n = p.known[r] // p.hbs
    if rare(data, "odd hash count", 5):
        n = data.draw(st.integers(0, p.L), label="hash count")
    return [HASH[x] for x in p.chain[r][:n]]


def op_add(data, p: Pair) -> None:
    free = p.free_slots()
    if not free:
        return
    r = data.draw(st.sampled_from(free), label="slot")
    p.chain[r] = draw_chain(data, p)
    p.known[r] = data.draw(st.integers(1, p.max_tokens), label="prompt tokens")
    hs = request_hashes(data, p, r)
    p.do(f"add_request({r}, {len(hs)} hashes, known={p.known[r]}, chain={p.chain[r]})",
         lambda: p.ref.add_request(r, hs), lambda: p.dev.add_request(r, hs))


def append_hashes(p: Pair, r: int, upto: int) -> None:
    have = p.num_hashes(r)
    upto = min(upto, p.L)
    if upto > have:
        hs = [HASH[x] for x in p.chain[r][have:upto]]
        p.do(f"append_block_hashes({r}, {upto - have})", lambda: p.ref.append_block_hashes(r, hs),
             lambda: p.dev.append_block_hashes(r, hs))


def draw_alloc_entry(data, p: Pair, r: int) -> tuple[int, int, bool]:
    """(num_tokens, target_tokens, lookup) for slot r: a natural step for its state, or anything."""
    T = p.max_tokens
    if rare(data, "arbitrary counts", 5):
        return (data.draw(st.integers(0, T), label="nt"), data.draw(st.integers(0, T), label="tg"),
                data.draw(st.booleans(), label="lookup"))
    comp = p.ref.num_computed[r]
    if p.row_len(r) == 0:  # prefill of a new (or re-added) request, possibly chunked
        nt = p.known[r]
        tg = nt if data.draw(st.booleans(), label="whole prefill") else data.draw(st.integers(0, nt), label="chunk")
        return nt, tg, not rare(data, "no lookup", 5)
    if comp < p.known[r]:  # chunked prefill continues
        return p.known[r], data.draw(st.integers(comp + 1, p.known[r]), label="chunk"), False
    # decode: one or more new tokens (hashes of blocks that became full), maybe lookahead slots
    if p.known[r] < T:
        p.known[r] = min(T, p.known[r] + data.draw(st.sampled_from([1, 1, 1, 2, p.bs]), label="new tokens"))
        if not rare(data, "lazy hashes", 6):
            append_hashes(p, r, p.known[r] // p.hbs)
    tg = min(T, p.known[r] + data.draw(st.sampled_from([0, 0, 0, 1, p.bs]), label="lookahead"))
    return p.known[r], tg, rare(data, "lookup on a running request", 8)


def op_allocate(data, p: Pair) -> None:
    slots = draw_batch(data, p)
    if not slots:
        return
    entries = [draw_alloc_entry(data, p, r) for r in slots]
    nts, tgs, lks = ([e[i] for e in entries] for i in range(3))
    sof = data.draw(st.booleans(), label="stop_on_failure")
    # Tensor slots lose the BlockStored metadata (see test_allocate_tensor_slots_events), so the
    # workload passes tensors only with events off.
    tensors = not p.events and data.draw(st.booleans(), label="tensor args")

    def dev_fn():
        if tensors:
            return p.dev.allocate_slots(i32(slots), i32(nts), i32(tgs), torch.tensor(lks, dtype=torch.bool),
                                        stop_on_failure=sof)
        return p.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof)

    p.do(f"allocate_slots({slots}, nt={nts}, tg={tgs}, lookup={lks}, stop_on_failure={sof}, tensors={tensors})",
         lambda: p.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof), dev_fn, admitted_norm)


def op_decode_steps(data, p: Pair) -> None:
    """A few scheduler steps in a row: every running request whose tokens are all computed decodes one
    token per step (its hashes follow as hash blocks fill); sliding windows move token by token."""
    sof = data.draw(st.booleans(), label="stop_on_failure")
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        run = [r for r in p.active()
               if p.row_len(r) and p.ref.num_computed[r] >= p.known[r] and p.known[r] < p.max_tokens]
        if not run:
            return
        for r in run:
            p.known[r] += 1
            append_hashes(p, r, p.known[r] // p.hbs)
        nts = [p.known[r] for r in run]
        p.do(f"decode step({run}, nt={nts}, stop_on_failure={sof})",
             lambda: p.ref.allocate_slots(run, nts, nts, stop_on_failure=sof),
             lambda: p.dev.allocate_slots(run, nts, nts, stop_on_failure=sof), admitted_norm)


def op_decode_step(data, p: Pair) -> None:
    """One :class:`DecodeStep` (gpupool/graph.py), the device's batch without lookups: some running
    requests finish, the others whose tokens are all computed decode one token. The reference frees,
    allocates (``stop_on_failure=False``) and releases the pending copies; the device's step does the
    same and runs the copies on its KV caches (the data checked); admitted flags and slot mappings
    must agree."""
    run = [r for r in p.active() if p.row_len(r) and p.ref.num_computed[r] >= p.known[r] and p.known[r] < p.max_tokens]
    pend = copies_norm(p.ref.pending_copies)
    if not run or not runnable(pend):
        return
    fin = data.draw(st.lists(st.sampled_from(run), unique=True, max_size=max(1, len(run) // 2)), label="finished")
    dec = [r for r in run if r not in fin]
    for r in dec:
        p.known[r] += 1
        append_hashes(p, r, p.known[r] // p.hbs)
    nts = [p.known[r] for r in dec]
    if getattr(p, "step", None) is None:
        p.step = DecodeStep(p.dev, max_batch=p.R, kv_caches=p.caches)
    step = p.step
    fill_step(step, dec, nts, fin)
    p.ops.append(f"DecodeStep(decode {dec}, nt={nts}, finished {fin}, copies {pend})")
    note(p.ops[-1])
    before = [c.clone() for c in p.caches] if p.caches is not None else []
    p.ref.free(fin)
    ref_adm = [bool(x) for x in p.ref.allocate_slots(dec, nts, nts, stop_on_failure=False)]
    p.ref.release_copied(p.ref.take_pending_copies())
    step.run()
    p.dev.pool.check()
    assert admitted_norm(step.admitted[: len(dec)]) == ref_adm, f"admitted differ; {p.where()}"
    want_map = [p.ref.slot_mapping([r], [nt - 1])[0] for r, nt, ok in zip(dec, nts, ref_adm) if ok]
    got_map = [x for x, ok in zip(ints(step.slot_mapping[: len(dec)]), ref_adm) if ok]
    assert got_map == want_map, f"slot mapping differs; {p.where()}"
    for c, old in zip(p.caches or [], before):
        want = old.clone()
        for src, dst, _ in pend:
            want[dst] = old[src]
        assert torch.equal(c, want), f"the step's copies are not src -> dst ({c.dtype}); {p.where()}"
    for r in fin:
        p.chain[r] = None
        p.known[r] = 0
    event("DecodeStep", None)
    p.compare()


def free_both(p: Pair, slots: list[int], tensors: bool, desc: str) -> None:
    def dev_fn():
        if tensors:
            p.dev.free(i32(slots))
            p.dev.pool.check()
        else:
            p.dev.free(slots)

    p.do(f"{desc}({slots}, tensors={tensors})", lambda: p.ref.free(slots), dev_fn)


def op_free(data, p: Pair) -> None:
    slots = draw_batch(data, p)
    if not slots:
        return
    free_both(p, slots, data.draw(st.booleans(), label="tensor args"), "free")
    for r in slots:
        p.chain[r] = None
        p.known[r] = 0


def op_preempt(data, p: Pair) -> None:
    """Preemption: the request gives back its blocks and is re-added with every hash it knows."""
    act = [r for r in p.active() if p.row_len(r)]
    if not act:
        return
    r = data.draw(st.sampled_from(act), label="slot")
    free_both(p, [r], False, "preempt: free")
    hs = request_hashes(data, p, r)
    p.do(f"preempt: add_request({r}, {len(hs)} hashes)", lambda: p.ref.add_request(r, hs),
         lambda: p.dev.add_request(r, hs))


def op_append_hashes(data, p: Pair) -> None:
    act = p.active()
    if act:
        r = data.draw(st.sampled_from(act), label="slot")
        append_hashes(p, r, p.known[r] // p.hbs)


def op_get_computed(data, p: Pair) -> None:
    act = p.active()
    if not act:
        return
    slots = data.draw(st.lists(st.sampled_from(act), min_size=0, max_size=len(act), unique=True), label="slots")
    nts = [data.draw(st.integers(0, p.max_tokens), label="nt") for _ in slots]
    G = p.G
    p.do(f"get_computed_blocks({slots}, {nts})", lambda: p.ref.get_computed_blocks(slots, nts),
         lambda: p.dev.get_computed_blocks(i32(slots), i32(nts)), lambda out: computed_norm(out, G))


def op_slot_mapping(data, p: Pair) -> None:
    act = [r for r in p.active() if p.row_len(r)]
    if not act:
        return
    g = data.draw(st.integers(0, p.G - 1), label="group")
    toks = data.draw(st.lists(st.tuples(st.sampled_from(act), st.integers(0, p.max_tokens - 1)), max_size=12),
                     label="tokens")
    toks = [(r, pos % (p.row_len(r) * p.bs)) for r, pos in toks]
    slots, pos = [t[0] for t in toks], [t[1] for t in toks]
    table = p.ref.block_table(g)
    want = [table[r][q // p.bs] * p.bs + q % p.bs for r, q in toks]
    p.ops.append(f"slot_mapping({toks}, group={g})")
    assert p.ref.slot_mapping(slots, pos, g) == want
    got = p.dev.slot_mapping(i32(slots), i32(pos), g)
    assert got.dtype == torch.int64
    assert ints(got) == want, f"slot_mapping: device {ints(got)} != {want}; {p.where()}"


def draw_cow_srcs(data, p: Pair) -> list[int]:
    G = p.G
    kind = data.draw(st.sampled_from(["cached", "computed", "null", "mixed", "any"]), label="src kind")
    if kind in ("cached", "mixed"):
        x = data.draw(st.sampled_from(ALPHABET), label="hash")
        got = p.ref.pool.get_cached_block(HASH[x], list(range(G)))
        assert ints(p.dev.pool.get_cached_block(HASH[x], list(range(G))) or []) == (got or [])
        if got is not None:
            if kind == "mixed":
                return [b if data.draw(st.booleans(), label="keep") else 0 for b in got]
            return got
    if kind == "computed":
        act = p.active()
        if act:
            r = data.draw(st.sampled_from(act), label="lookup slot")
            (hits, blocks), = p.ref.get_computed_blocks([r], [p.max_tokens])
            if hits:
                i = data.draw(st.integers(0, hits - 1), label="hit index")
                return [blocks[g][i] for g in range(G)]
    if kind == "any":
        return [data.draw(st.integers(0, p.N - 1), label="src") for _ in range(G)]
    return [0] * G


def op_cow_append(data, p: Pair) -> None:
    act = p.active()
    if not act:
        return
    r = data.draw(st.sampled_from(act), label="slot")
    srcs = draw_cow_srcs(data, p)
    p.do(f"cow_append({r}, {srcs})", lambda: p.ref.cow_append(r, srcs), lambda: p.dev.cow_append(r, srcs), ints)


def op_cow_move(data, p: Pair) -> None:
    act = [r for r in p.active() if p.row_len(r)]
    if not act:
        return
    r = data.draw(st.sampled_from(act), label="slot")
    n = p.row_len(r)
    cached = [i for i in range(n) if p.ref.pool.block_keys(p.ref.tables[0][r][i])]
    if cached and not rare(data, "uncached index", 4):
        i = data.draw(st.sampled_from(cached), label="cached index")
    else:
        i = data.draw(st.integers(0, n - 1), label="index")
    p.do(f"cow_move({r}, {i})", lambda: p.ref.cow_move(r, i), lambda: p.dev.cow_move(r, i), ints)


def has_chain(copies) -> bool:
    """A copy whose source is an earlier (or later) copy's destination in the same batch."""
    dsts = {d for _, d, _ in copies}
    return any(s in dsts for s, _, _ in copies)


def runnable(copies) -> bool:
    """Copies the KV-data check can run: no chain (test_run_pending_copies_chained) and no block the
    destination of two copies (a request freed with a copy pending into its block, the block handed
    out again: ``copy_blocks`` refuses that, the unchecked step's copy runs them in no set order)."""
    dsts = [d for _, d, _ in copies]
    return not has_chain(copies) and len(set(dsts)) == len(dsts)


def run_copies(p: Pair) -> list[tuple[int, int, int]]:
    """``run_pending_copies`` on the device's KV caches (the reference drains and releases): block
    ``dst`` of every layer becomes a copy of block ``src``, no other block changes, and the pool then
    matches the reference after ``release_copied``. Returns the copies."""
    pend = copies_norm(p.ref.pending_copies)
    p.ops.append(f"run_pending_copies({pend})")
    note(p.ops[-1])
    before = [c.clone() for c in p.caches]
    assert p.dev.run_pending_copies(p.caches) == len(pend)
    for c, old in zip(p.caches, before):
        want = old.clone()
        for s, d, _ in pend:
            want[d] = old[s]
        assert torch.equal(c, want), f"run_pending_copies: the KV data is not src -> dst ({c.dtype}); {p.where()}"
    p.ref.release_copied(p.ref.take_pending_copies())
    p.compare()
    return pend


def op_drain(data, p: Pair) -> None:
    pend = copies_norm(p.ref.pending_copies)
    # A chain (a copy whose source is another's destination) is test_run_pending_copies_chained.
    if p.caches is not None and pend and runnable(pend) and data.draw(st.booleans(), label="run copies"):
        run_copies(p)
        return
    copies = p.do("take_pending_copies()", p.ref.take_pending_copies, p.dev.take_pending_copies, copies_norm)
    release = i32([c[2] for c in copies])
    p.do(f"release_copied({copies})", lambda: p.ref.release_copied(copies), lambda: p.dev.release_copied(release))


def op_error(data, p: Pair) -> None:
    """A bad call: the same error class on both sides, nothing changed."""
    act = p.active()
    R, T = p.R, p.max_tokens
    kind = data.draw(st.sampled_from(["alloc slot range", "alloc slot twice", "alloc count", "free slot range",
                                      "free slot twice", "add in use", "add too many", "append too many",
                                      "cow_move index", "cow_append row full"]), label="error kind")
    slots = data.draw(st.permutations(act), label="order")[:3] if act else []
    if kind.startswith("alloc"):
        nts = [min(T, p.known[r]) for r in slots]
        tgs = list(nts)
        if kind == "alloc slot range" or not slots:
            k = data.draw(st.integers(0, len(slots)), label="at")
            slots = slots[:k] + [data.draw(st.sampled_from([R, R + 3, -1]), label="bad slot")] + slots[k:]
            nts.insert(k, 1)
            tgs.insert(k, 1)
        elif kind == "alloc slot twice":
            slots = slots + [slots[0]]
            nts.append(nts[0])
            tgs.append(tgs[0])
        else:
            k = data.draw(st.integers(0, len(slots) - 1), label="at")
            bad = data.draw(st.sampled_from([T + 1, -1]), label="bad count")
            (nts if data.draw(st.booleans(), label="in nt") else tgs)[k] = bad
        lks = [True] * len(slots)
        sof = data.draw(st.booleans(), label="stop_on_failure")
        tensors = not p.events and data.draw(st.booleans(), label="tensor args")

        def dev_fn():
            if tensors:
                return p.dev.allocate_slots(i32(slots), i32(nts), i32(tgs), lks, stop_on_failure=sof)
            return p.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof)

        p.do(f"bad allocate_slots({slots}, {nts}, {tgs}, tensors={tensors})",
             lambda: p.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof), dev_fn, admitted_norm)
    elif kind.startswith("free"):
        if kind == "free slot range" or not slots:
            slots = slots + [data.draw(st.sampled_from([R, -1]), label="bad slot")]
        else:
            slots = [slots[0]] + slots
        tensors = data.draw(st.booleans(), label="tensor args")

        def dev_fn():
            p.dev.free(i32(slots) if tensors else slots)

        p.do(f"bad free({slots}, tensors={tensors})", lambda: p.ref.free(slots), dev_fn)
    elif kind == "add in use" and act:
        r = act[0]
        p.do(f"bad add_request({r}) in use", lambda: p.ref.add_request(r, []), lambda: p.dev.add_request(r, []))
    elif kind == "add too many" and p.free_slots():
        r = p.free_slots()[0]
        hs = [HASH[0]] * (p.L + 1)
        p.do(f"bad add_request({r}, {p.L + 1} hashes)", lambda: p.ref.add_request(r, hs),
             lambda: p.dev.add_request(r, hs))
    elif kind == "append too many" and act:
        r = act[0]
        hs = [HASH[1]] * (p.L + 1 - p.num_hashes(r))
        p.do(f"bad append_block_hashes({r}, {len(hs)})", lambda: p.ref.append_block_hashes(r, hs),
             lambda: p.dev.append_block_hashes(r, hs))
    elif kind == "cow_move index" and act:
        r = act[0]
        i = data.draw(st.sampled_from([p.row_len(r), p.M, -1]), label="bad index")
        p.do(f"bad cow_move({r}, {i})", lambda: p.ref.cow_move(r, i), lambda: p.dev.cow_move(r, i), ints)
    elif kind == "cow_append row full":
        full = [r for r in act if p.row_len(r) >= p.M]
        if full:
            r = full[0]
            p.do(f"bad cow_append({r}) row full", lambda: p.ref.cow_append(r, [0] * p.G),
                 lambda: p.dev.cow_append(r, [0] * p.G), ints)


OPS = {
    "add": (op_add, 5), "allocate": (op_allocate, 8), "decode_steps": (op_decode_steps, 3),
    "decode_step": (op_decode_step, 2), "free": (op_free, 2), "preempt": (op_preempt, 1),
    "append_hashes": (op_append_hashes, 1), "get_computed": (op_get_computed, 1),
    "slot_mapping": (op_slot_mapping, 1), "cow_append": (op_cow_append, 2), "cow_move": (op_cow_move, 2),
    "drain": (op_drain, 2), "error": (op_error, 1),
}
OP_CHOICES = [name for name, (_, w) in OPS.items() for _ in range(w)]


GROUP_KINDS = {
    "full": lambda data, bs: ("full",),
    "full+full": lambda data, bs: ("full", "full"),
    "full+sliding": lambda data, bs: ("full", ("sliding_window", data.draw(
        st.sampled_from([1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs]), label="window"))),
}

# Each example takes ~0.2-3 s in the interpreter: a third of the profile's examples per group kind.
_EXAMPLES = max(2, settings().max_examples // 5)  # dev: 2, ci: 5


@pytest.mark.parametrize("parallel", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["parallel", "exact"])
# full+full in the slow run only (quick budget): full+sliding covers two groups in the quick run
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "full+full" else k for k in GROUP_KINDS])
@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])
@given(data=st.data())
def test_manager_matches_reference(kind, parallel, data):
    """Random workloads; ``parallel``: allocate_slots takes the request-parallel path where it is exact
    (kernels/requests/parallel.py), else every batch takes the exact sequential path."""
    bs = data.draw(st.sampled_from([4, 16]), label="block_size")
    hbs = bs if data.draw(st.booleans(), label="hash blocks = blocks") else data.draw(
        st.sampled_from([2] if bs == 4 else [4, 8]), label="hash_block_size")
    groups = GROUP_KINDS[kind](data, bs)
    p = Pair(data.draw(st.integers(8, 48), label="num_blocks"), block_size=bs,
             max_num_reqs=data.draw(st.integers(4, 6), label="max_num_reqs"),
             max_blocks_per_req=data.draw(st.integers(8, 16), label="max_blocks_per_req"), groups=groups,
             caching=not rare(data, "caching off", 4), events=data.draw(st.booleans(), label="events"),
             hash_block_size=hbs, kv_caches=True)
    p.dev.parallel = parallel
    note(f"config: N={p.N} bs={bs} hbs={hbs} R={p.R} M={p.M} groups={groups} caching={p.caching} "
         f"events={p.events}")
    num_ops = data.draw(st.integers(6, 24), label="num ops")
    for _ in range(num_ops):
        name = data.draw(st.sampled_from(OP_CHOICES), label="op")
        OPS[name][0](data, p)
    # Finish everything: every block back in the queue, nothing held.
    if p.ref.pending_copies:
        op_drain(data, p)
    if p.active():
        free_both(p, p.active(), False, "free all")
    assert p.ref.pool.get_num_free_blocks() == p.N - 1


# =================================================================================================
# Deterministic scenarios
# =================================================================================================

def small_pair(groups=("full",), *, num_blocks=32, block_size=4, events=True, caching=True, **kw) -> Pair:
    return Pair(num_blocks, block_size=block_size, max_num_reqs=4, max_blocks_per_req=8, groups=groups,
                caching=caching, events=events, **kw)


def add(p: Pair, r: int, chain: list[int], known: int, nhashes: int | None = None) -> None:
    p.chain[r], p.known[r] = list(chain), known
    hs = [HASH[x] for x in chain[: known // p.hbs if nhashes is None else nhashes]]
    p.do(f"add_request({r}, {chain})", lambda: p.ref.add_request(r, hs), lambda: p.dev.add_request(r, hs))


def alloc(p: Pair, slots, nts, tgs, lks=None, sof=True):
    lks = lks or [False] * len(slots)
    return p.do(f"allocate_slots({slots}, {nts}, {tgs}, {lks})",
                lambda: p.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof),
                lambda: p.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof), admitted_norm)


# full+full in the slow run only (quick budget): full+sw covers two groups in the quick run
@pytest.mark.parametrize("groups", [("full",), pytest.param(("full", "full"), marks=pytest.mark.slow), ("full", SW)],
                         ids=["full", "full+full", "full+sw"])
def test_get_computed_blocks_agree(groups):
    """Shared prefixes, a repeated hash (one block hit twice), every num_tokens cap, any slot order."""
    p = small_pair(groups)
    add(p, 0, [0, 1, 2, 3, 4], 21)
    add(p, 1, [30, 30, 30], 13)
    assert alloc(p, [0, 1], [21, 13], [21, 13], [True, True]) == [True, True]
    add(p, 2, [0, 1, 2, 9, 4], 20)
    add(p, 3, [30, 30, 30, 30], 16)
    for nt in [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 32]:
        out = p.do(f"get_computed_blocks(nt={nt})",
                   lambda: p.ref.get_computed_blocks([3, 2, 0], [nt] * 3),
                   lambda: p.dev.get_computed_blocks(i32([3, 2, 0]), i32([nt] * 3)),
                   lambda o: computed_norm(o, p.G))
        assert out[1][0] == min(max(nt - 1, 0) // 4, 3)  # request 2 shares 3 blocks with request 0
    (hits, blocks), = p.ref.get_computed_blocks([3], [16])
    assert hits == 3 and len(set(blocks[0])) == 1  # the one block keyed by hash 30 at position 0, 3 times
    # Admitting with lookup takes exactly those hits.
    assert alloc(p, [2, 3], [20, 16], [20, 16], [True, True]) == [True, True]
    assert p.ref.block_table(0)[2][:3] == p.ref.block_table(0)[0][:3]
    p.do("free all", lambda: p.ref.free([0, 1, 2, 3]), lambda: p.dev.free([0, 1, 2, 3]))
    # Caching off: never a hit.
    q = small_pair(groups, caching=False)
    add(q, 0, [0, 1, 2], 12)
    alloc(q, [0], [12], [12])
    add(q, 1, [0, 1, 2], 12)
    q.do("get_computed_blocks", lambda: q.ref.get_computed_blocks([1], [12]),
         lambda: q.dev.get_computed_blocks(i32([1]), i32([12])), lambda o: computed_norm(o, q.G))


@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_slot_mapping_matches_reference_table(groups):
    """Every valid (slot, position) of every group, against block_id * bs + pos % bs from the
    reference table (null blocks of the sliding window included)."""
    p = small_pair(groups)
    add(p, 0, [0, 1, 2, 3, 4, 5], 22)
    add(p, 1, [0, 1, 7], 9)
    alloc(p, [0, 1], [22, 9], [22, 9], [True, True])
    for nt in (23, 24, 25, 26):  # decode past the window: sliding-window blocks become null
        alloc(p, [1, 0], [10, nt], [10, nt])
    bs = p.bs
    for g in range(p.G):
        table = p.ref.block_table(g)
        toks = [(r, q) for r in (1, 0) for q in range(len(table[r]) * bs)]
        want = [table[r][q // bs] * bs + q % bs for r, q in toks]
        assert p.ref.slot_mapping([t[0] for t in toks], [t[1] for t in toks], g) == want
        for dt in (torch.int32, torch.int64):
            got = p.dev.slot_mapping(torch.tensor([t[0] for t in toks], dtype=dt, device=DEVICE),
                                     torch.tensor([t[1] for t in toks], dtype=dt, device=DEVICE), g)
            assert got.dtype == torch.int64 and ints(got) == want
    if p.G == 2:
        assert 0 in p.ref.block_table(1)[0]  # the window freed blocks


@pytest.mark.parametrize("groups", [("full",), ("full", SW)], ids=["full", "full+sw"])
def test_run_pending_copies_moves_kv_data(groups):
    """cow_append (a partial hit copied into a private block) and cow_move (a cached block the request
    keeps writing) queue copies; run_pending_copies copies them in fp16 and fp32 caches shaped
    [num_blocks, 2, block_size, 8] and releases them; the pool then matches the reference."""
    p = small_pair(groups, kv_caches=True)
    add(p, 0, [0, 1, 2, 3], 16)
    assert alloc(p, [0], [16], [16], [True]) == [True]
    add(p, 1, [0, 1, 7, 8], 15)
    assert alloc(p, [1], [15], [8], [True]) == [True]  # hits blocks 0, 1
    src = p.ref.pool.get_cached_block(HASH[2], list(range(p.G)))  # a partial match of its next block
    assert src is not None
    dsts = p.do(f"cow_append(1, {src})", lambda: p.ref.cow_append(1, src), lambda: p.dev.cow_append(1, src), ints)
    p.do("cow_move(0, 3)", lambda: p.ref.cow_move(0, 3), lambda: p.dev.cow_move(0, 3), ints)
    pend = copies_norm(p.ref.pending_copies)
    assert len(pend) == 2 * p.G and not has_chain(pend)
    assert [d for _, d, _ in pend[: p.G]] == dsts
    assert run_copies(p) == pend
    assert p.dev.take_pending_copies()[0].numel() == 0
    # The moved key now answers from the copy, which is free (hashed, at the back of the queue).
    moved = p.ref.pool.get_cached_block(HASH[3], [0])
    assert moved == [pend[p.G][1]] and p.ref.pool.ref_counts(moved) == [0]
    assert run_copies(p) == []  # nothing pending: no launch, nothing changes
    p.do("free", lambda: p.ref.free([0, 1]), lambda: p.dev.free([0, 1]))
    assert p.ref.pool.get_num_free_blocks() == p.N - 1


def test_batched_errors_raise_at_check_sticky_and_change_nothing():
    """A bad batched call does nothing and raises at check(); until then later batched calls do
    nothing either (sticky status word); afterwards the manager works on."""
    p = small_pair(("full", SW))
    add(p, 0, [0, 1, 2], 12)
    add(p, 1, [0, 1, 5], 12)
    alloc(p, [0], [12], [12], [True])
    T = p.max_tokens
    cases = [
        (InvalidArgumentError, [0, 4], [12, 12], [12, 12]),  # slot out of range
        (InvalidArgumentError, [-1], [1], [1]),
        (InvalidArgumentError, [1, 0, 1], [12, 13, 12], [12, 13, 12]),  # listed twice
        (InvalidCountError, [1, 0], [12, T + 1], [12, 13]),
        (InvalidCountError, [1, 0], [12, 13], [-1, 13]),
    ]
    for exc, slots, nts, tgs in cases:
        before_ref, before_dev = manager_state(p.ref), manager_state(p.dev)
        with pytest.raises(exc):
            p.ref.allocate_slots(slots, nts, tgs, [True] * len(slots))
        out = p.dev.allocate_slots(slots, nts, tgs, [True] * len(slots))  # no raise: no host sync
        # sticky: a valid call before check() does nothing
        p.dev.allocate_slots([1], [12], [12], [True])
        p.dev.free(i32([1]))
        with pytest.raises(exc):
            p.dev.pool.check()
        assert ints(out) == [0] * len(slots)
        p.dev.pool.check()  # cleared
        assert manager_state(p.ref) == before_ref and manager_state(p.dev) == before_dev
        p.compare()
    for slots in ([0, 0], [4], [-1]):
        before = manager_state(p.dev)
        p.dev.free(i32(slots))
        with pytest.raises(InvalidArgumentError):
            p.dev.pool.check()
        assert manager_state(p.dev) == before
        with pytest.raises(InvalidArgumentError):  # lists are checked on the host, at once
            p.dev.free(slots)
        with pytest.raises(InvalidArgumentError):
            p.ref.free(slots)
        p.compare()
    assert alloc(p, [1, 0], [12, 13], [12, 13], [True, False]) == [True, True]


def test_preemption_and_stop_on_failure():
    """A pool too small for everyone: stop_on_failure stops the batch at the first request that does
    not fit (False: later ones may still fit); preemption (free + re-add) frees room, and the re-added
    request gets its cached prefix back."""
    p = small_pair(("full", "full"), num_blocks=13)
    add(p, 0, [0, 1, 2, 3], 16)
    add(p, 1, [10, 11, 12, 13, 14, 15, 16], 28)
    add(p, 2, [20], 4)
    assert alloc(p, [0], [16], [16], [True]) == [True]  # 8 of 12 blocks
    assert alloc(p, [1, 2], [28, 4], [28, 4], [True, True], sof=True) == [False, False]
    assert alloc(p, [1, 2], [28, 4], [28, 4], [True, True], sof=False) == [False, True]
    p.do("preempt 0", lambda: p.ref.free([0]), lambda: p.dev.free([0]))
    hs = [HASH[x] for x in [0, 1, 2, 3]]
    p.do("re-add 0", lambda: p.ref.add_request(0, hs), lambda: p.dev.add_request(0, hs))
    out = p.do("get_computed_blocks", lambda: p.ref.get_computed_blocks([0], [17]),
               lambda: p.dev.get_computed_blocks(i32([0]), i32([17])), lambda o: computed_norm(o, p.G))
    assert out[0][0] == 4
    assert alloc(p, [1, 0], [28, 17], [28, 17], [True, True], sof=False) == [False, True]


# =================================================================================================
# Regression tests for the defects these tests found (all fixed)
# =================================================================================================

def _events_pair(groups=("full",)) -> Pair:
    return small_pair(groups, num_blocks=16, events=True)


def _raw_events(p: Pair):
    return p.ref.pool.take_events(), p.dev.pool.take_events()


def test_blockstored_parent_after_leading_null_block():
    p = _events_pair()
    add(p, 0, [0, 1], 8)
    p.ref.cow_append(0, [0])  # a null entry at index 0 (a partial hit in no group)
    p.dev.cow_append(0, [0])
    p.ref.allocate_slots([0], [9], [9])
    p.dev.allocate_slots([0], [9], [9])
    ref_ev, dev_ev = _raw_events(p)
    assert ref_ev[0].parent_block_hash is None  # docs/semantics.md: parent = block_hashes[num_cached_blocks - 1], none at 0
    assert dev_ev == ref_ev


def test_blockstored_parent_sliding_window_late_hashes():
    p = _events_pair(("full", ("sliding_window", 4)))
    add(p, 0, [0, 1, 2], 0, nhashes=0)
    for m in (p.ref, p.dev):
        m.allocate_slots([0], [12], [12])
        m.allocate_slots([0], [13], [13])  # the window drops blocks 0 and 1 of group 1
        m.append_block_hashes(0, [HASH[0], HASH[1], HASH[2]])
    _raw_events(p)
    for m in (p.ref, p.dev):
        m.allocate_slots([0], [14], [14])
    ref_ev, dev_ev = _raw_events(p)
    assert dev_ev == ref_ev


def test_allocate_tensor_slots_events():
    p = _events_pair(("full", "full"))
    add(p, 0, [0, 1], 8)
    p.ref.allocate_slots([0], [9], [9])
    p.dev.allocate_slots(i32([0]), i32([9]), i32([9]))
    ref_ev, dev_ev = _raw_events(p)
    assert dev_ev == ref_ev


def test_allocate_slots_rejects_slot_not_in_use():
    p = small_pair()
    with pytest.raises(InvalidArgumentError):
        p.ref.allocate_slots([1], [4], [4])
    before = manager_state(p.dev)
    with pytest.raises(InvalidArgumentError):
        p.dev.allocate_slots([1], [4], [4])
        p.dev.pool.check()
    assert manager_state(p.dev) == before


def test_copy_from_a_block_still_waiting_for_its_copy_is_refused():
    """cow_move puts block 1's key on a fresh block D (copy 1 -> D pending); a request hitting that key
    in the same step would copy from D before D has its data (one launch runs every copy at once).
    Both managers refuse that cow_append (InvalidArgumentError, nothing changed); after the copies run
    it is fine, and the copied data is block 1's."""
    p = small_pair(num_blocks=16, kv_caches=True)
    add(p, 0, [0, 1], 8)
    alloc(p, [0], [9], [9])
    add(p, 1, [0], 4)
    (d,) = p.do("cow_move(0, 0)", lambda: p.ref.cow_move(0, 0), lambda: p.dev.cow_move(0, 0), ints)
    src = p.ref.pool.get_cached_block(HASH[0], [0])
    assert src == [d]
    before = manager_state(p.dev)
    for m in (p.ref, p.dev):
        with pytest.raises(InvalidArgumentError, match="pending copy"):
            m.cow_append(1, src)
    assert manager_state(p.dev) == before
    old = [c.clone() for c in p.caches]
    assert p.dev.run_pending_copies(p.caches) == 1
    for c, o in zip(p.caches, old):
        assert torch.equal(c[d], o[1])
    p.ref.release_copied(p.ref.take_pending_copies())
    p.compare()
    p.do(f"cow_append(1, {src})", lambda: p.ref.cow_append(1, src), lambda: p.dev.cow_append(1, src), ints)
    p.compare()


def test_get_computed_blocks_slot_out_of_range():
    p = small_pair()
    add(p, 0, [0], 4)
    with pytest.raises(InvalidArgumentError):
        p.ref.get_computed_blocks([4], [5])
    with pytest.raises(InvalidArgumentError):
        p.dev.get_computed_blocks(i32([4]), i32([5]))
        p.dev.pool.check()


def test_get_computed_blocks_slot_twice_or_free():
    p = small_pair()
    add(p, 0, [0], 4)
    for slots in ([0, 0], [1]):
        with pytest.raises(InvalidArgumentError):
            p.ref.get_computed_blocks(slots, [5] * len(slots))
        with pytest.raises(InvalidArgumentError):
            p.dev.get_computed_blocks(i32(slots), i32([5] * len(slots)))
            p.dev.pool.check()


def test_partial_key_that_does_not_fit_is_skipped():
    """hash_block_size 4 < block_size 16, max_keys_per_block 1: block 0 is keyed at 12 tokens; a step
    that knows only 8 tokens would add a second (secondary) partial key, which does not fit: both
    managers skip it (the pool op would raise KeyCapacityError) and the allocation goes on."""
    p = Pair(16, block_size=16, max_num_reqs=4, max_blocks_per_req=4, groups=("full",), caching=True, events=False,
             hash_block_size=4, max_keys_per_block=1)
    add(p, 0, [0, 1, 2], 12)
    assert alloc(p, [0], [12], [12]) == [True]
    assert alloc(p, [0], [8], [40]) == [True]
    p.compare()


# ---- a recorded error (the sticky status word) loses nothing ------------------------------------

def test_run_pending_copies_keeps_copies_past_a_recorded_error():
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    src = m.rows(0)[0][0]
    m.add_request(1, [])
    m.allocate_slots([1], [1], [1])
    m.cow_append(1, [src])
    fail_a_batched_op(m)
    with pytest.raises(PoolError):
        m.run_pending_copies([])
    assert int(m.num_copies[0]) == 1
    m.validate()
    assert m.run_pending_copies([]) == 1
    m.free([0, 1])
    assert m.pool.get_num_free_blocks() == 31
    m.validate()


def test_free_list_after_a_recorded_error_keeps_the_slot():
    """``free(list)`` while an error is recorded raises it and changes nothing on host or device; the
    slot is then freed and reused normally."""
    m = small_manager()
    m.add_request(0, [h(1)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    before = manager_snapshot(m)
    fail_a_batched_op(m)
    raw = raw_state(m.pool, m)
    with pytest.raises(PoolError):
        m.free([0])
    assert same_raw_state(raw, raw_state(m.pool, m)) == []
    assert manager_snapshot(m) == before
    m.free([0])
    m.add_request(0, [h(2)])
    m.allocate_slots([0], [4], [4], [1])
    m.pool.check()
    m.validate()

