"""The managers' differential harness: :class:`ManagerPair` (the device ``KVCacheManager`` and
``ReferenceKVCacheManager`` driven side by side, results and the whole state compared after every op)
and its op generators; used by tests/manager/.
"""
from __future__ import annotations


import torch
from hypothesis import settings
from hypothesis import event as _event
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from gpupool.graph import DecodeStep
from harness.compare import assert_managers_agree
from harness.device import DEVICE, i32
from harness.keys import h
from harness.ops import call_both, fill_step, reference_decode_step
from harness.state import ints, manager_state
from harness.strategies import draw_batch, note, rare
from harness.twins import manager_twin


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

class ManagerPair:
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
        if err is None and desc.startswith(("allocate_slots", "decode step", "DecodeStep")):
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

def draw_chain(data, p: ManagerPair) -> list[int]:
    t = data.draw(st.sampled_from(TEMPLATES), label="template")
    # the template prefix is drawn in blocks, so requests share whole-block prefixes
    k = min(p.L, data.draw(st.integers(0, p.M), label="template prefix blocks") * p.K)
    tail = data.draw(st.lists(st.sampled_from(TAIL), min_size=p.L - k, max_size=p.L - k), label="tail")
    return (t[:k] + tail)[: p.L]


def request_hashes(data, p: ManagerPair, r: int) -> list[bytes]:
    """Hashes handed over at (re-)admission: the known full blocks, sometimes fewer or more."""
    n = p.known[r] // p.hbs
    if rare(data, "odd hash count", 5):
        n = data.draw(st.integers(0, p.L), label="hash count")
    return [HASH[x] for x in p.chain[r][:n]]


def op_add(data, p: ManagerPair) -> None:
    free = p.free_slots()
    if not free:
        return
    r = data.draw(st.sampled_from(free), label="slot")
    p.chain[r] = draw_chain(data, p)
    p.known[r] = data.draw(st.integers(1, p.max_tokens), label="prompt tokens")
    hs = request_hashes(data, p, r)
    p.do(f"add_request({r}, {len(hs)} hashes, known={p.known[r]}, chain={p.chain[r]})",
         lambda: p.ref.add_request(r, hs), lambda: p.dev.add_request(r, hs))


def append_hashes(p: ManagerPair, r: int, upto: int) -> None:
    have = p.num_hashes(r)
    upto = min(upto, p.L)
    if upto > have:
        hs = [HASH[x] for x in p.chain[r][have:upto]]
        p.do(f"append_block_hashes({r}, {upto - have})", lambda: p.ref.append_block_hashes(r, hs),
             lambda: p.dev.append_block_hashes(r, hs))


def draw_alloc_entry(data, p: ManagerPair, r: int) -> tuple[int, int, bool]:
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


def op_allocate(data, p: ManagerPair) -> None:
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


def op_decode_steps(data, p: ManagerPair) -> None:
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


def op_decode_step(data, p: ManagerPair) -> None:
    """One :class:`DecodeStep` (gpupool/graph.py), the device's batch without lookups: some running
    requests finish, the others whose tokens are all computed decode one token. The reference is the
    same step of a reference window (harness.ops.reference_decode_step: the finished freed, the pending
    copies released, then vLLM's preemption of the last lanes); the device's step runs the copies on
    its KV caches too (the data checked); admitted flags and slot mappings of every lane must agree,
    and the preempted requests are gone on both sides."""
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
    want = reference_decode_step(p.ref, dec, nts, fin)
    assert want.error is None, f"{want.error}; {p.where()}"
    step.run()
    p.dev.pool.check()
    pad = p.R - len(dec)
    assert ints(step.admitted) == want.admitted[0] + [0] * pad, f"admitted differ; {p.where()}"
    assert ints(step.slot_mapping) == want.slot_mapping[0] + [-1] * pad, f"slot mapping differs; {p.where()}"
    for c, old in zip(p.caches or [], before):
        want_c = old.clone()
        for src, dst, _ in pend:
            want_c[dst] = old[src]
        assert torch.equal(c, want_c), f"the step's copies are not src -> dst ({c.dtype}); {p.where()}"
    for r in fin + [r for r, k in zip(dec, want.preempt_step) if k >= 0]:
        p.chain[r] = None
        p.known[r] = 0
    event("DecodeStep", None, want.admitted[0])
    p.compare()


def free_both(p: ManagerPair, slots: list[int], tensors: bool, desc: str) -> None:
    def dev_fn():
        if tensors:
            p.dev.free(i32(slots))
            p.dev.pool.check()
        else:
            p.dev.free(slots)

    p.do(f"{desc}({slots}, tensors={tensors})", lambda: p.ref.free(slots), dev_fn)


def op_free(data, p: ManagerPair) -> None:
    slots = draw_batch(data, p)
    if not slots:
        return
    free_both(p, slots, data.draw(st.booleans(), label="tensor args"), "free")
    for r in slots:
        p.chain[r] = None
        p.known[r] = 0


def op_preempt(data, p: ManagerPair) -> None:
    """Preemption: the request gives back its blocks and is re-added with every hash it knows."""
    act = [r for r in p.active() if p.row_len(r)]
    if not act:
        return
    r = data.draw(st.sampled_from(act), label="slot")
    free_both(p, [r], False, "preempt: free")
    hs = request_hashes(data, p, r)
    p.do(f"preempt: add_request({r}, {len(hs)} hashes)", lambda: p.ref.add_request(r, hs),
         lambda: p.dev.add_request(r, hs))


def op_append_hashes(data, p: ManagerPair) -> None:
    act = p.active()
    if act:
        r = data.draw(st.sampled_from(act), label="slot")
        append_hashes(p, r, p.known[r] // p.hbs)


def op_get_computed(data, p: ManagerPair) -> None:
    act = p.active()
    if not act:
        return
    slots = data.draw(st.lists(st.sampled_from(act), min_size=0, max_size=len(act), unique=True), label="slots")
    nts = [data.draw(st.integers(0, p.max_tokens), label="nt") for _ in slots]
    G = p.G
    p.do(f"get_computed_blocks({slots}, {nts})", lambda: p.ref.get_computed_blocks(slots, nts),
         lambda: p.dev.get_computed_blocks(i32(slots), i32(nts)), lambda out: computed_norm(out, G))


def op_slot_mapping(data, p: ManagerPair) -> None:
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


def draw_cow_srcs(data, p: ManagerPair) -> list[int]:
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


def op_cow_append(data, p: ManagerPair) -> None:
    act = p.active()
    if not act:
        return
    r = data.draw(st.sampled_from(act), label="slot")
    srcs = draw_cow_srcs(data, p)
    p.do(f"cow_append({r}, {srcs})", lambda: p.ref.cow_append(r, srcs), lambda: p.dev.cow_append(r, srcs), ints)


def op_cow_move(data, p: ManagerPair) -> None:
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


def run_copies(p: ManagerPair) -> list[tuple[int, int, int]]:
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


def op_drain(data, p: ManagerPair) -> None:
    pend = copies_norm(p.ref.pending_copies)
    # A chain (a copy whose source is another's destination) is test_run_pending_copies_chained.
    if p.caches is not None and pend and runnable(pend) and data.draw(st.booleans(), label="run copies"):
        run_copies(p)
        return
    copies = p.do("take_pending_copies()", p.ref.take_pending_copies, p.dev.take_pending_copies, copies_norm)
    release = i32([c[2] for c in copies])
    p.do(f"release_copied({copies})", lambda: p.ref.release_copied(copies), lambda: p.dev.release_copied(release))


def op_error(data, p: ManagerPair) -> None:
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
    "full+chunked": lambda data, bs: ("full", ("chunked_local_attention", data.draw(
        st.sampled_from([bs, 2 * bs, 3 * bs]), label="chunk"))),
    "chunked": lambda data, bs: (("chunked_local_attention", data.draw(st.sampled_from([bs, 2 * bs]), label="chunk")),),
}

# Each example takes ~0.2-3 s in the interpreter: a third of the profile's examples per group kind.
_EXAMPLES = max(2, settings().max_examples // 5)  # dev: 2, ci: 5


# ---- deterministic scenarios ------------------------------------------------------------------
def small_pair(groups=("full",), *, num_blocks=32, block_size=4, events=True, caching=True, **kw) -> ManagerPair:
    return ManagerPair(num_blocks, block_size=block_size, max_num_reqs=4, max_blocks_per_req=8, groups=groups,
                caching=caching, events=events, **kw)


def add(p: ManagerPair, r: int, chain: list[int], known: int, nhashes: int | None = None) -> None:
    p.chain[r], p.known[r] = list(chain), known
    hs = [HASH[x] for x in chain[: known // p.hbs if nhashes is None else nhashes]]
    p.do(f"add_request({r}, {chain})", lambda: p.ref.add_request(r, hs), lambda: p.dev.add_request(r, hs))


def alloc(p: ManagerPair, slots, nts, tgs, lks=None, sof=True):
    lks = lks or [False] * len(slots)
    return p.do(f"allocate_slots({slots}, {nts}, {tgs}, {lks})",
                lambda: p.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof),
                lambda: p.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof), admitted_norm)


def preemption_and_stop_on_failure() -> None:
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
