"""Modelled GPU latency of gpupool's hot operations (a MODEL, not a measurement).

Each case builds a steady state through the public API (outside the recorder), then records ONE
operation with ``gpucost.Recorder`` (Triton's CPU interpreter, instrumented) and prints a markdown
row: the modelled H200 time of that operation (best / lo / hi scenarios, microseconds) as CUDA-graph
nodes and eagerly, the number of Triton launches, torch glue kernels and host syncs, the
critical-path counts of the dominant launch's slowest program, and the dominant kernel's name.
gpucost is a latency *model* (see its module docstring): quote its figures as "modelled".

Steady state (every case): a pool of 100,000 blocks whose free blocks ALL carry a key (a warm prefix
cache). It is made by allocating every free block with ``allocate_batched`` (chunks of 16,384),
keying each chunk with fresh hashes (``cache_full_blocks``) and freeing it (``free_batched``); the
pool's ``get_num_free_blocks()`` and a ``lookup_batched`` of every warm key then check it. It is made
once per run and pool configuration; each later case's fresh pool gets a copy (its device state and
the names of its keys).

Cases:

* ``decode_step`` (B = ``--sizes``, default 64, 256, 1024): ``KVCacheManager(100_000, block_size=16,
  max_num_reqs=B, max_blocks_per_req=168)`` on a warm pool; B running requests with prompts of 192 to
  2,591 tokens (``random.Random(SEED + B)``), each added with fresh hashes of its full blocks and
  prefilled with ``allocate_slots(lookup=True)`` (batched, ``--prefill-batch`` requests per call;
  the lookups miss, the prompt blocks are taken from the head of the queue, evicting warm keys, and
  their full blocks get keyed). Then ONE ``DecodeStep.run()`` where ``B // 128`` requests (at least
  1) finish (``finished``) and the other requests decode one token each (``num_tokens =
  num_computed + 1``): exactly ``B // 16`` of them cross a block boundary (``num_computed % 16 ==
  0``: one new block each), exactly ``B // 16`` fill their last block (``num_computed % 16 == 15``;
  the hash of that block is appended with ``append_block_hashes`` before the step, so the step keys
  it), the rest have ``num_computed % 16`` in 1..14. No copy-on-write copies are pending.
* ``decode_multi`` (B = ``--sizes``, K = ``--steps``, default 8): the same state and inputs, ONE
  ``DecodeStep(steps=K).run()``: a burst of K steps (each running request decodes K tokens; one
  crossing a block boundary at step k gets a block there; blocks that fill are keyed where the hash
  is known, as in ``decode_step``). Compare with K x ``decode_step`` of the same B.

* ``window_begin``, ``window_step``, ``window_end`` (B = ``--sizes``): one launch of a decode window
  (``DecodeWindow(views=False)``, D = 0) on the same state with the device's hashing (every request
  added with its tail tokens and its prefill's token appended; the kinds' residues shifted so that B
  // 16 requests cross into a new block and B // 16 fill one at the recorded launch), the B // 128
  finishing requests in ``finished``, each pass accepting one token. ``window_begin``: the begin;
  ``window_step``: step 0 of a one-step window (K = 1), step K // 2 of a ``--steps`` window, and the
  same with B // 16 lanes stopped (freed in the step); ``window_end``: the end of a ``--steps`` window.
  The window's earlier launches run before the recorded one.
* ``admit`` (B = ``--sizes``): on the warm pool, ONE ``KVCacheManager.admit`` of B requests, each with 8
  cached (free, keyed) blocks to hit from the back half of the free queue, 4 missing and a 5-token tail:
  197 tokens, 8 hit blocks and 5 popped each.
* ``reserve`` (B = ``--sizes``, K = ``--steps``): the same state; ONE ``KVCacheManager.reserve`` of the
  running requests (all but the finishing ones) for K tokens each, the booking an engine makes before
  a burst (docs/semantics.md section 8); checked: all booked, each request's count, nothing popped.
* ``alloc_4096x1`` / ``alloc_64x64``: ``allocate_batched`` of 4,096 blocks as one demand / as 64
  demands of 64, on the warm pool (every block taken loses its key).
* ``free_4096``: ``free_batched`` of 4,096 blocks in 64 segments of 64 (64 "requests", each freed
  tail first). The blocks were allocated from the warm pool; in each segment the first 32 blocks
  (request order) were keyed again with fresh hashes, the last 32 are un-hashed: half / half, and
  each segment frees its 32 un-hashed blocks first (to the queue's front), then its 32 hashed ones
  (to the back).
* ``lookup_10000``: ``lookup_batched`` of 10,000 device keys (``gpupool.keys.device_key``) of warm
  hashes, all hits.
* ``touch_4096``: ``touch_batched`` of 4,096 distinct cached free blocks chosen at random (they are
  unlinked from the middle of the free queue).
* ``vllm_flush`` / ``vllm_per_call`` (B = ``--sizes``): the vLLM fast path's device work for a decode
  step of B running requests (docs/vllm.md, "The fast path") on the warm pool: ``max(1, B // 128)``
  finished requests of 32 held blocks each freed (tail first), ``B // 16`` requests crossing into a
  new block (one pop each) and ``B // 16`` caching the block they filled (held, un-keyed: one block
  each, ``cache_full_blocks`` of ``[k, k + 1)``). ``vllm_flush``: ONE ``apply_predicted``, as the
  fast path launches it; ``vllm_per_call``: one launch per vLLM call (``free_batched`` per finished request,
  ``allocate_batched`` per crossing one, ``cache_full_blocks_batched`` per filling one), as the fast
  path launched before the flush. Compare the eager figures (the fast path launches eagerly).
* ``replay`` (``--replay-requests``, default 1,000): ``replay_on_device`` of the bundled trace's first
  requests on a fresh ``BlockPool(16384)`` (the CLI's default model), recorded whole and compared
  with the reference pool's report. Its target is the eager figure (host round trips counted).

Every op is called as a plain caller would (optional count tensors left to their defaults: the kernels
then take the array's length, with no glue kernel), and checked afterwards (``check()``, counts, hits).

``--measure`` (on a CUDA machine; ``bench/gpu_check.sh`` runs it) builds the same states on the GPU
and MEASURES each op with CUDA events instead of modelling it: every state tensor of the pool (and
manager) is snapshotted before the op and restored before each repetition; "eager" times the op as
called, "graph" times the replay of a CUDA graph captured from it (median of ``--reps``). Without
CUDA, ``--measure`` is a dry run of the same flow on the CPU (wall clock, the interpreter's speed).

Run (from the repository root; the package's kernels run in Triton's interpreter, no GPU needed)::

    TRITON_INTERPRET=1 python bench/model_cases.py                       # every case, table only
    TRITON_INTERPRET=1 python bench/model_cases.py --cases decode_step --sizes 64 --report
    TRITON_INTERPRET=1 python bench/model_cases.py --json /tmp/model.json

gpucost is NOT part of this repository, nor of any package: it is an unpublished latency model. It
is looked for at ``--gpucost PATH``, else ``$GPUCOST``, else
``../shared/tools/gpucost.py`` next to the repository root; without it (or if it does not load) the
script prints one line and exits with status 2, so the modelled figures of bench/RESULTS.md cannot be
recomputed from the repository alone. ``--measure`` needs no gpucost.
The script always measures the tree it lives in (its ``gpupool`` and ``kernels`` directories come
first on the import path, even when another checkout is installed editable).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

if "--measure" not in sys.argv[1:]:  # modelling runs the kernels in the interpreter; measuring compiles them
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GPUCOST = ROOT.parent / "shared" / "tools" / "gpucost.py"
NUM_BLOCKS = 100_000
BLOCK_SIZE = 16
MAX_BLOCKS_PER_REQ = 168
SEED = 20240611
WARM_CHUNK = 16_384
CASES = ("decode_step", "decode_multi", "window_begin", "window_step", "window_end", "admit", "reserve",
         "alloc_4096x1", "alloc_64x64", "free_4096", "lookup_10000", "touch_4096",
         "replay", "vllm_flush", "vllm_per_call")
COUNT_KINDS = ("ld", "at", "red", "scan", "bar", "br", "it")


# ---- imports: gpucost from where it is given, gpupool from this tree ------------------------
def load_gpucost(path_arg: str | None):
    """Import gpucost from --gpucost, $GPUCOST or ../shared/tools/gpucost.py; exit 2 if absent."""
    path = Path(path_arg or os.environ.get("GPUCOST") or DEFAULT_GPUCOST)
    if not path.is_file():
        print(f"model_cases: gpucost not found at {path} (pass --gpucost PATH or set GPUCOST): the modelled "
              "figures need this latency model, which is not published with this repository or as a package "
              "(bench/RESULTS.md); --measure needs no gpucost", file=sys.stderr)
        sys.exit(2)
    spec = importlib.util.spec_from_file_location("gpucost", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpucost"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign file: one line, not a traceback
        print(f"model_cases: cannot load gpucost from {path}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    return mod, path


def import_this_tree():
    sys.path.insert(0, str(ROOT / "src"))
    import gpupool
    import gpupool.kernels
    for mod in (gpupool, gpupool.kernels):
        if not Path(mod.__file__).resolve().is_relative_to(ROOT):
            sys.exit(f"model_cases: imported {mod.__name__} from {mod.__file__}, not from {ROOT}")
    return gpupool


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- steady state ------------------------------------------------------------------------------
DEVICE = "cpu"  # "cuda" with --measure on a CUDA machine (set in main)


def i32(values):
    import torch
    return torch.tensor(list(values), dtype=torch.int32, device=DEVICE)


class Hashes:
    """Fresh, distinct 32-byte block hashes (never a real token chain: nothing shares a prefix)."""

    def __init__(self, tag: str):
        self.tag = tag.encode()
        self.n = 0

    def take(self, k: int) -> list[bytes]:
        out = [hashlib.sha256(self.tag + b":%d" % (self.n + j)).digest() for j in range(k)]
        self.n += k
        return out


_WARM: dict = {}  # (pool config, hashes' tag) -> the warm state made once: device state, keys, owner, hashes


def warm_pool(pool, hashes: Hashes) -> dict[bytes, int]:
    """Key every free block of ``pool`` (allocate a chunk, cache it with fresh hashes, free it; the
    hashed blocks go to the back, so the next chunk takes un-keyed ones). Returns hash -> block. A
    fresh pool of a configuration warmed before in this run gets that state copied instead (its device
    state and its registry of key names: the same state, made once)."""
    cached = _WARM.get((pool.config, hashes.tag))
    if cached is not None and pool.get_num_free_blocks() == pool.num_blocks - 1:
        snap, names, owner, n = cached
        for t, saved in zip(pool.state, snap):
            t.copy_(saved)
        pool.registry.register_pairs(names)
        hashes.n = n
        return dict(owner)
    n_free = pool.get_num_free_blocks()
    owner: dict[bytes, int] = {}
    left = n_free
    while left:
        n = min(WARM_CHUNK, left)
        out, _ = pool.allocate_batched(i32([n]))
        blocks = out[:n].clone()
        hs = hashes.take(n)
        pool.cache_full_blocks(blocks, hs, 0, n, BLOCK_SIZE, 0)
        pool.free_batched(blocks.flip(0).contiguous(), i32([0, n]))
        pool.check()
        owner.update(zip(hs, blocks.tolist()))
        left -= n
    assert pool.get_num_free_blocks() == n_free, "warm-up changed the number of free blocks"
    check_free_keyed(pool, owner)
    if n_free == pool.num_blocks - 1:
        _WARM[(pool.config, hashes.tag)] = ([t.clone() for t in pool.state], [(h, 0) for h in owner], dict(owner),
                                            hashes.n)
    return owner


def lookup_all(pool, hashes: list[bytes]):
    import torch
    from gpupool.keys import device_key
    keys = [device_key(h, 0) for h in hashes]
    hi = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=DEVICE)
    lo = torch.tensor([k[1] for k in keys], dtype=torch.int64, device=DEVICE)
    return hi, lo, torch.zeros(len(keys), dtype=torch.int32)


def check_free_keyed(pool, owner: dict[bytes, int]) -> None:
    """Every free block answers to its warm key (one lookup_batched of every warm key)."""
    hs = list(owner)
    found = pool.lookup_batched(*lookup_all(pool, hs)).tolist()
    keyed = {b for b in found if b >= 0}
    assert all(b < 0 or b == owner[h] for h, b in zip(hs, found)), "a warm key answers with another block"
    free = pool.free_queue()
    assert len(free) == pool.get_num_free_blocks()
    missing = [b for b in free if b not in keyed]
    assert not missing, f"{len(missing)} free blocks carry no key (e.g. {missing[:5]})"


def warm_block_pool(gp):
    t0 = time.perf_counter()
    pool = gp.BlockPool(NUM_BLOCKS)
    owner = warm_pool(pool, Hashes("warm"))
    return pool, owner, time.perf_counter() - t0


# ---- measuring (--measure) ---------------------------------------------------------------------
class Measure:
    """Times one op with CUDA events (``--measure``), in place of gpucost's model.

    Every tensor of ``state`` (the NamedTuples the op changes) is snapshotted first and restored
    before each repetition, so every repetition starts from the same steady state; the last run, on a
    restored state, is the one the case checks. "eager": the op as called (launch overheads
    included); "graph": the replay of a CUDA graph captured from it. Medians over ``reps``, us.
    Without CUDA: a dry run on the CPU (wall clock; no graph)."""

    def __init__(self, reps: int):
        import torch
        self.reps = reps
        self.cuda = torch.cuda.is_available()
        self.device = torch.cuda.get_device_name(0) if self.cuda else "cpu (dry run, interpreter)"

    def _time(self, fn, restore) -> float:
        import torch
        restore()
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0

    def run(self, fn, state, title: str, graph_ok: bool = True):
        import statistics

        import torch
        t0 = time.perf_counter()
        tensors = [t for nt in state for t in nt if isinstance(t, torch.Tensor)]
        snap = [t.clone() for t in tensors]

        def restore():
            for t, saved in zip(tensors, snap):
                t.copy_(saved)

        eager = [self._time(fn, restore) for _ in range(self.reps)]
        graph = []
        if self.cuda and graph_ok:
            restore()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graph = [self._time(g.replay, restore) for _ in range(self.reps)]
        restore()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        rec = {"measured": True, "device": self.device, "reps": self.reps,
               "eager_us": round(statistics.median(eager), 2),
               "graph_us": round(statistics.median(graph), 2) if graph else None}
        return rec, out, time.perf_counter() - t0


# ---- recording ---------------------------------------------------------------------------------
def summarize(gc, rec, case: str, params: dict, build_s: float, record_s: float, extra: dict) -> dict:
    """The numbers of one recorded case (all scenario triples are best / lo / hi, microseconds)."""
    if isinstance(gc, Measure):
        return {"case": case, "params": params, "build_s": round(build_s, 2), "record_s": round(record_s, 2),
                **rec, **extra}
    hi = gc.SCENARIO_NAMES.index("hi")
    launches = rec.launches
    dom = max(launches, key=lambda L: L.body()[hi]) if launches else None
    host = rec.host_counts()
    glue_names: dict[str, int] = {}
    for h in rec.host:
        if h.kind == "glue":
            glue_names[h.what] = glue_names.get(h.what, 0) + 1
    return {
        "case": case, "params": params,
        "graph_us": rec.totals(graph=True)["all"], "eager_us": rec.totals(graph=False)["all"],
        "totals_graph": rec.totals(graph=True), "totals_eager": rec.totals(graph=False),
        "serial_graph_us": rec.totals(graph=True, model="serial")["all"],
        "launches": len(launches), "glue": host.get("glue", 0), "syncs": host.get("sync", 0),
        "h2d": host.get("h2d", 0), "glue_ops": glue_names,
        "dominant": None if dom is None else {
            "kernel": dom.name, "grid": list(dom.grid), "programs": dom.nprog, "warps": dom.num_warps,
            "body_us": dom.body(), "max_counts": dom.max_counts()},
        "per_launch": [{"kernel": L.name, "grid": list(L.grid), "programs": L.nprog, "body_us": L.body(),
                        "max_counts": L.max_counts()} for L in launches],
        "build_s": round(build_s, 2), "record_s": round(record_s, 2), **extra,
    }


def record(gc, fn, report: bool, title: str, state=(), graph_ok: bool = True):
    """Model ``fn`` with gpucost, or (``gc`` a :class:`Measure`) time it; ``state``: the NamedTuples
    of tensors the op changes (restored between repetitions when measuring); ``graph_ok`` False: no
    CUDA graph is captured when measuring (an op that copies host arguments at each call)."""
    if isinstance(gc, Measure):
        return gc.run(fn, state, title, graph_ok)
    t0 = time.perf_counter()
    with gc.Recorder(label=title, track_lines=report) as rec:
        out = fn()
    dt = time.perf_counter() - t0
    if report:
        print()
        rec.report(title=f"{title} (modelled, gpucost)")
        print()
    return rec, out, dt


# ---- cases -------------------------------------------------------------------------------------
def decode_state(B: int, args, shift: int = 1, tails: bool = False):
    """The decode cases' steady state (module docstring): a manager on a warm pool with B requests
    prefilled. ``shift``: the tokens each request will have gained past its prompt at the recorded
    allocation (1: the step right after the prefill); the residues are chosen so that exactly B // 16
    requests cross into a new block there and B // 16 fill their last block. ``tails``: every request
    added with its tail tokens (it hashes its own tokens on the device), its prefill's sampled token
    appended (``append_tokens``); else the filling requests get their block's hash from the host
    (``append_block_hashes``). Returns (manager, kinds, prompt, held blocks, fill hashes, free before,
    warm s, prefill s, t0)."""
    from gpupool.manager import KVCacheManager

    t0 = time.perf_counter()
    m = KVCacheManager(NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_reqs=B, max_blocks_per_req=MAX_BLOCKS_PER_REQ)
    owner = warm_pool(m.pool, Hashes("warm"))
    t_warm = time.perf_counter() - t0

    # Request kinds, exact counts: cross (crosses a block boundary at the recorded allocation), fill (fills
    # its last block there), finish, other.
    rng = random.Random(SEED + B)
    n_cross = n_fill = B // 16
    n_fin = max(1, B // 128)
    kinds = ["cross"] * n_cross + ["fill"] * n_fill + ["finish"] * n_fin
    kinds += ["other"] * (B - len(kinds))
    rng.shuffle(kinds)
    cross, fill = (1 - shift) % BLOCK_SIZE, (-shift) % BLOCK_SIZE
    others = [x for x in range(BLOCK_SIZE) if x not in (cross, fill)]  # shift 1: 1 .. 14
    resid = {"cross": lambda: cross, "fill": lambda: fill, "finish": lambda: others[rng.randint(0, len(others) - 1)],
             "other": lambda: others[rng.randint(0, len(others) - 1)]}
    # 12 .. 161 full blocks + residue: prompts of 192 .. 2,591 tokens (max_blocks_per_req 168 fits).
    prompt = [rng.randint(12, 161) * BLOCK_SIZE + resid[k]() for k in kinds]
    held = sum(-(-p // BLOCK_SIZE) for p in prompt)
    if held + n_cross > NUM_BLOCKS - 1:
        raise SystemExit(f"decode_step B={B}: prompts need {held} blocks, more than the pool's {NUM_BLOCKS - 1}")

    req_hashes = Hashes(f"req{B}")
    for r in range(B):
        tail = [rng.randint(1, 50_000) for _ in range(prompt[r] % BLOCK_SIZE)] if tails else None
        m.add_request(r, req_hashes.take(prompt[r] // BLOCK_SIZE), tail)
    t1 = time.perf_counter()
    for lo in range(0, B, args.prefill_batch):
        rs = list(range(lo, min(B, lo + args.prefill_batch)))
        adm = m.allocate_slots(rs, [prompt[r] for r in rs], [prompt[r] for r in rs], lookup=[True] * len(rs))
        m.pool.check()
        assert int(adm.sum()) == len(rs), "a prefill was not admitted"
    t_prefill = time.perf_counter() - t1
    fill_hash = {}
    if tails:  # each prefill's sampled token, hashed with its tail where that fills a block
        import torch
        m.append_tokens(i32(range(B)), i32([1] * B), torch.tensor([[rng.randint(1, 50_000)] for _ in range(B)],
                                                                  dtype=torch.int32, device=DEVICE))
        m.pool.check()
    else:
        for r in range(B):
            if kinds[r] == "fill":
                fill_hash[r] = req_hashes.take(1)[0]
                m.append_block_hashes(r, [fill_hash[r]])
    free_before = m.pool.get_num_free_blocks()
    assert free_before == NUM_BLOCKS - 1 - held, (free_before, held)
    check_free_keyed(m.pool, owner)
    return m, kinds, prompt, held, fill_hash, free_before, t_warm, t_prefill, t0


def case_decode_step(gp, gc, B: int, args, steps: int = 1) -> dict:
    import torch

    from gpupool.graph import DecodeStep

    m, kinds, prompt, held, fill_hash, free_before, t_warm, t_prefill, t0 = decode_state(B, args)
    n_cross = n_fill = B // 16
    step = DecodeStep(m, max_batch=B, steps=steps)
    run = [r for r in range(B) if kinds[r] != "finish"]
    fin = [r for r in range(B) if kinds[r] == "finish"]
    step.slots[: len(run)] = i32(run)
    step.num_tokens[: len(run)] = i32([prompt[r] + 1 for r in run])
    step.num_reqs.fill_(len(run))
    step.finished[: len(fin)] = i32(fin)
    step.num_finished.fill_(len(fin))
    build_s = time.perf_counter() - t0

    name = f"decode_step B={B}" if steps == 1 else f"decode_multi K={steps} B={B}"
    state = (m.pool.state, m.state, tuple(v for v in vars(step.window).values() if isinstance(v, torch.Tensor)),
             step.window._work)
    rec, _, record_s = record(gc, step.run, args.report, name, state=state)

    # The step (every step of the burst) did what the steady state says.
    m.pool.check()
    assert int(step.admitted_steps[:, : len(run)].sum()) == steps * len(run), "a decoding request was not admitted"
    freed = sum(-(-prompt[r] // BLOCK_SIZE) for r in fin)
    crossed = sum((prompt[r] + k) % BLOCK_SIZE == 0 for r in run for k in range(steps))
    assert m.pool.get_num_free_blocks() == free_before + freed - crossed
    if fill_hash:
        hit = m.pool.lookup_batched(*lookup_all(m.pool, list(fill_hash.values()))).tolist()
        assert min(hit) >= 0, "a block filled by the step was not keyed"
    params = {"B": B, "steps": steps, "running": len(run), "cross": n_cross, "crossed_in_burst": crossed,
              "fill": n_fill, "finished": len(fin),
              "prompt_tokens_min": min(prompt), "prompt_tokens_max": max(prompt), "blocks_held": held,
              "free_blocks_before": free_before, "prefill_batch": args.prefill_batch}
    extra = {"warm_s": round(t_warm, 2), "prefill_s": round(t_prefill, 2)}
    return summarize(gc, rec, name, params, build_s, record_s, extra)




def case_window(gp, gc, B: int, args, what: str, K: int = 1, stops: bool = False) -> dict:
    """One launch of a decode window's pool side (docs/semantics.md section 9; ``views=False``: the
    attention views are their own launch) on the decode state with device hashing (``tails``), B - B // 128
    lanes, the B // 128 finishing requests in ``finished``, D = 0, each pass accepting 1 token:

    * ``window_begin``: the inputs checked, the finished requests freed, the lanes set up;
    * ``window_step``: pool step k of a K-step window (K = 1: step 0, the allocation alone; else step
      K // 2, which first takes pass k - 1's tokens: appended, and hashed where a block fills),
      B // 16 lanes crossing into a new block and B // 16 filling one (hashed, then keyed); ``stops``: B // 16
      other lanes stopped at pass k - 1 (freed in the step);
    * ``window_end``: the end of a K-step window (pass K - 1's tokens: B // 16 lanes fill a block, hashed
      on the device; no allocation).

    The window's earlier launches run eagerly before the recorded one (outside the recorder)."""
    import torch

    from gpupool.window import DecodeWindow

    k = {"begin": 0, "step": K // 2, "end": K}[what]
    m, kinds, prompt, held, _, free_before, t_warm, t_prefill, t0 = decode_state(B, args, shift=k + 1, tails=True)
    run = [r for r in range(B) if kinds[r] != "finish"]
    fin = [r for r in range(B) if kinds[r] == "finish"]
    win = DecodeWindow(m, B, K, 0, views=False)
    win.set_inputs(run, [prompt[r] + 1 for r in run], fin)
    win.tokens.copy_(torch.randint(1, 50_000, tuple(win.tokens.shape), generator=torch.Generator().manual_seed(SEED)))
    lanes_stopped = [i for i, r in enumerate(run) if kinds[r] == "other"][:B // 16] if stops else []
    if what == "begin":
        fn = win.begin
    else:
        win.begin()
        for j in range(k):
            win.step(j)
        if lanes_stopped:
            win.stopped[lanes_stopped] = 1
        def step():
            win._next = k  # --measure repeats the step from a restored state: the eager order check would refuse
            win.step(k)

        def end():
            win._next = K  # as for step: a second end() of one window is refused
            win.end()

        fn = step if what == "step" else end
    m.pool.check()
    hashes_before = m.state.num_hashes[:B].clone()
    build_s = time.perf_counter() - t0
    name = f"window_{what}" + (f" K={K}" if what != "begin" else "") + (" stops" if stops else "") + f" B={B}"
    cached_before = m.state.num_cached[0, :B].clone()
    bufs = tuple(t for t in vars(win).values() if isinstance(t, torch.Tensor))
    rec, _, record_s = record(gc, fn, args.report, name, state=(m.pool.state, m.state, bufs, win._work))
    m.pool.check()
    fills = [r for r in run if kinds[r] == "fill"]
    if what == "begin":
        freed = sum(-(-prompt[r] // BLOCK_SIZE) for r in fin)
        assert m.pool.get_num_free_blocks() == free_before + freed, "the finished requests were not freed"
    if what == "step":
        admitted = win.admitted[k, :len(run)].tolist()
        assert sum(admitted) == len(run) - len(lanes_stopped), "a live lane was not admitted"
        keyed = (m.state.num_cached[0, :B] - cached_before).tolist()
        assert all(keyed[r] == 1 for r in fills), "a filled block was not keyed"
    if k > 0:  # the recorded launch took a pass's tokens: the blocks they filled were hashed
        gained = (m.state.num_hashes[:B] - hashes_before).tolist()
        assert all(gained[r] == 1 for r in fills), "a filled block was not hashed"
    params = {"B": B, "steps": K, "step": k, "running": len(run), "finished": len(fin), "stopped": len(lanes_stopped),
              "cross": B // 16 if what == "step" else 0, "fill": len(fills) if what != "begin" else 0}
    return summarize(gc, rec, name, params, build_s, record_s, {"warm_s": round(t_warm, 2), "prefill_s": round(t_prefill, 2)})


def case_admit(gp, gc, B: int, args) -> dict:
    """``admit``: B waiting requests admitted in one launch on the warm pool (an empty manager), each with
    8 hash blocks cached (free and keyed: prefix hits, taken out of the free queue) then 4 missing and a
    tail of 5 tokens (it hashes its own tokens): 197 tokens, 8 x 16 hit tokens, 5 blocks popped each."""
    from gpupool.manager import KVCacheManager

    t0 = time.perf_counter()
    m = KVCacheManager(NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_reqs=B, max_blocks_per_req=MAX_BLOCKS_PER_REQ)
    owner = warm_pool(m.pool, Hashes("warm"))
    rng = random.Random(SEED + 3)
    queue = m.pool.free_queue()  # hits from the back half: the pops of the batch (from the front) evict none
    by_block = {b: h for h, b in owner.items()}
    warm = [by_block[b] for b in rng.sample(queue[len(queue) // 2:], 8 * B)]
    fresh = Hashes("admit")
    hashes = [warm[8 * k:8 * k + 8] + fresh.take(4) for k in range(B)]
    n_tokens = 12 * BLOCK_SIZE + 5
    tails = [[rng.randint(1, 50_000) for _ in range(5)] for _ in range(B)]
    free0 = m.pool.get_num_free_blocks()
    build_s = time.perf_counter() - t0
    name = f"admit B={B}"
    rec, (admitted, hits), record_s = record(
        gc, lambda: m.admit(list(range(B)), hashes, [n_tokens] * B, tails), args.report, name,
        state=(m.pool.state, m.state), graph_ok=False)  # it copies its host arguments at each call
    m.pool.check()
    assert admitted[:B].tolist() == [1] * B and hits[:B].tolist() == [8 * BLOCK_SIZE] * B, "not every request hit"
    assert m.pool.get_num_free_blocks() == free0 - 13 * B
    params = {"B": B, "hit_blocks_each": 8, "new_blocks_each": 5, "tokens_each": n_tokens}
    return summarize(gc, rec, name, params, build_s, record_s, {})


def case_reserve(gp, gc, B: int, args) -> dict:
    """``reserve`` of the decode state's B - B // 128 running requests for ``--steps`` tokens each
    (the booking before a burst; docs/semantics.md section 8): one launch, nothing popped."""
    m, kinds, prompt, held, _, free_before, t_warm, t_prefill, t0 = decode_state(B, args)
    K = args.steps
    run = [r for r in range(B) if kinds[r] != "finish"]
    slots, tokens = i32(run), i32([K] * len(run))
    queue_before = m.pool.free_queue()
    build_s = time.perf_counter() - t0
    name = f"reserve K={K} B={B}"
    rec, booked, record_s = record(gc, lambda: m.reserve(slots, tokens), args.report, name, state=(m.state,))
    m.pool.check()
    need = [-(-(prompt[r] + K) // BLOCK_SIZE) - -(-prompt[r] // BLOCK_SIZE) for r in run]
    assert booked.tolist() == [1] * len(run), "a reservation was not booked"
    assert m.state.reserved[run].tolist() == need and m.get_num_reserved_blocks() == sum(need)
    assert m.pool.get_num_free_blocks() == free_before and m.pool.free_queue() == queue_before  # nothing popped
    params = {"B": B, "steps": K, "running": len(run), "reserved_blocks": sum(need), "blocks_held": held,
              "free_blocks_before": free_before}
    return summarize(gc, rec, name, params, build_s, record_s,
                     {"warm_s": round(t_warm, 2), "prefill_s": round(t_prefill, 2)})


def case_alloc(gp, gc, num: int, each: int, args) -> dict:
    import torch
    pool, owner, build_s = warm_block_pool(gp)
    free0 = pool.get_num_free_blocks()
    demands = torch.full((num,), each, dtype=torch.int32, device=DEVICE)
    rec, (out, offsets), record_s = record(gc, lambda: pool.allocate_batched(demands), args.report,
                                           f"allocate_batched {num} x {each}", state=(pool.state,))
    pool.check()
    total = num * each
    blocks = out[:total].tolist()
    assert offsets.tolist() == [k * each for k in range(num + 1)]
    assert len(set(blocks)) == total and pool.get_num_free_blocks() == free0 - total
    by_block = {b: h for h, b in owner.items()}
    hit = pool.lookup_batched(*lookup_all(pool, [by_block[b] for b in blocks])).tolist()
    assert max(hit) < 0, "an allocated block kept its key"
    name = "alloc_4096x1" if num == 1 else f"alloc_{num}x{each}"
    return summarize(gc, rec, name, {"demands": num, "blocks_each": each, "evicted_keys": total}, build_s,
                     record_s, {})


def case_free(gp, gc, args) -> dict:
    import torch
    pool, owner, build_s = warm_block_pool(gp)
    t0 = time.perf_counter()
    segs, per = 64, 64
    out, _ = pool.allocate_batched(torch.full((segs,), per, dtype=torch.int32, device=DEVICE))
    blocks = out[: segs * per].view(segs, per).clone()
    hashed = blocks[:, : per // 2].reshape(-1).contiguous()  # first half of each "request" keyed again
    pool.cache_full_blocks(hashed, Hashes("free").take(hashed.numel()), 0, hashed.numel(), BLOCK_SIZE, 0)
    pool.check()
    ids = blocks.flip(1).reshape(-1).contiguous()  # each request tail first
    seg_offsets = torch.arange(0, segs * per + 1, per, dtype=torch.int32, device=DEVICE)
    free0 = pool.get_num_free_blocks()
    build_s += time.perf_counter() - t0
    rec, _, record_s = record(gc, lambda: pool.free_batched(ids, seg_offsets), args.report,
                              f"free_batched {segs * per} in {segs} segments", state=(pool.state,))
    pool.check()
    assert pool.get_num_free_blocks() == free0 + segs * per
    return summarize(gc, rec, "free_4096", {"blocks": segs * per, "segments": segs, "hashed": hashed.numel()},
                     build_s, record_s, {})


def case_lookup(gp, gc, args) -> dict:
    pool, owner, build_s = warm_block_pool(gp)
    t0 = time.perf_counter()
    rng = random.Random(SEED + 1)
    hs = rng.sample(sorted(owner), 10_000)
    keys = lookup_all(pool, hs)
    build_s += time.perf_counter() - t0
    rec, out, record_s = record(gc, lambda: pool.lookup_batched(*keys), args.report, "lookup_batched 10,000",
                                state=(pool.state,))
    pool.check()
    assert out.tolist() == [owner[h] for h in hs], "a lookup did not hit its block"
    return summarize(gc, rec, "lookup_10000", {"keys": len(hs), "hits": len(hs)}, build_s, record_s, {})


def case_touch(gp, gc, args) -> dict:
    pool, owner, build_s = warm_block_pool(gp)
    t0 = time.perf_counter()
    rng = random.Random(SEED + 2)
    chosen = rng.sample(sorted(owner.values()), 4096)
    ids = i32(chosen)
    free0 = pool.get_num_free_blocks()
    build_s += time.perf_counter() - t0
    rec, _, record_s = record(gc, lambda: pool.touch_batched(ids), args.report, "touch_batched 4,096",
                              state=(pool.state,))
    pool.check()
    assert pool.get_num_free_blocks() == free0 - 4096
    assert set(pool.ref_counts(chosen)) == {1}
    return summarize(gc, rec, "touch_4096", {"blocks": 4096, "cached_free": True}, build_s, record_s, {})


def case_vllm(gp, gc, B: int, args, flush: bool) -> dict:
    """``vllm_flush`` / ``vllm_per_call`` (module docstring)."""
    import torch
    pool, owner, build_s = warm_block_pool(gp)
    t0 = time.perf_counter()
    n_fin, n_cross, n_fill, per = max(1, B // 128), B // 16, B // 16, 32
    out, _ = pool.allocate_batched(i32([per] * n_fin + [1] * n_fill))
    held = out[: n_fin * per + n_fill].tolist()
    fin = [held[k * per:(k + 1) * per][::-1] for k in range(n_fin)]  # each request tail first
    fill = held[n_fin * per:]
    hashes = Hashes("vllm")
    calls = [(hashes.take(2), 1, 2, BLOCK_SIZE, 0) for _ in fill]  # block 1 of a request: [1, 2)
    fin_ids = [i32(f) for f in fin]
    fill_ids = [i32([0, b]) for b in fill]
    one = i32([1])
    pool.check()
    free0 = pool.get_num_free_blocks()
    build_s += time.perf_counter() - t0

    from gpupool.kernels.flush import FlushBatch
    from gpupool.pool import DEVICE_KEYS_FROM
    pool.device_keys_from = DEVICE_KEYS_FROM  # a GPU pool's path (a CPU pool keys on the host)

    def fused():  # as the fast path launches it: host ints, one copy with the demands and the keys
        b = FlushBatch()
        for f in fin:
            b.add_free(f)
        for _ in range(n_cross):
            b.add_pop(1)
        for blk, (hs, _, _, _, g) in zip(fill, calls):
            b.add_cache([blk], [(hs[1], g)], [2 * BLOCK_SIZE])
        return pool.apply_predicted(b)

    def per_call():
        for ids in fin_ids:
            pool.free_batched(ids, i32([0, per]))
        for _ in range(n_cross):
            pool.allocate_batched(one)
        for ids, (hs, nc, nf, bs, g) in zip(fill_ids, calls):
            pool.cache_full_blocks_batched(ids, hs, nc, nf, bs, g)

    name = "vllm_flush" if flush else "vllm_per_call"
    # measured eagerly only: both copy their host arguments at each call, as the fast path does
    rec, _, record_s = record(gc, fused if flush else per_call, args.report, f"{name} B={B}", state=(pool.state,),
                              graph_ok=False)
    pool.check()
    assert pool.get_num_free_blocks() == free0 + n_fin * per - n_cross
    assert all(len(pool.block_keys(b)) == 1 for b in fill)
    params = {"B": B, "finished": n_fin, "freed_blocks": n_fin * per, "popped": n_cross, "cached": n_fill}
    return summarize(gc, rec, f"{name} B={B}", params, build_s, record_s, {})


def case_replay(gp, gc, args) -> dict:
    """The device replay loop on the bundled trace's first ``--replay-requests`` requests (default
    pool and model settings), recorded whole: upload, launches, host syncs, the final digest."""
    from gpupool.replay import DEFAULT_NUM_BLOCKS, load_trace, replay
    from gpupool.replay.device import replay_on_device

    t0 = time.perf_counter()
    trace = load_trace(limit=args.replay_requests)
    pool = gp.BlockPool(DEFAULT_NUM_BLOCKS, device=DEVICE)
    ref = replay(gp.ReferenceBlockPool(DEFAULT_NUM_BLOCKS), trace)
    build_s = time.perf_counter() - t0
    params = {"requests": len(trace), "num_blocks": DEFAULT_NUM_BLOCKS}
    if isinstance(gc, Measure):  # a whole run, wall clock (host syncs included); no graph
        import torch
        if gc.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        rep = replay_on_device(pool, trace)
        rec = {"measured": True, "device": gc.device, "reps": 1, "eager_us": (time.perf_counter() - t) * 1e6,
               "graph_us": None}
        record_s = rec["eager_us"] / 1e6
    else:
        rec, rep, record_s = record(gc, lambda: replay_on_device(pool, trace), args.report,
                                    f"replay_on_device, first {len(trace)} requests")
    for f in ("admitted", "hit_blocks", "free_queue_sha256"):
        assert getattr(rep, f) == getattr(ref, f), f"device replay differs from the reference in {f}"
    params["time_points"] = rep.time_points
    return summarize(gc, rec, f"replay_{len(trace)}", params, build_s, record_s, {})


# ---- output ------------------------------------------------------------------------------------
def fmt(v) -> str:
    return " / ".join(f"{x:,.0f}" if x >= 10 else f"{x:.1f}" for x in v)


HEADER = ("| case | graph us best / lo / hi | eager us best / lo / hi | launches | glue | syncs | "
          + " | ".join(COUNT_KINDS) + " | dominant kernel |")


def table(results: list[dict]) -> str:
    sep = "|---|---|---|---:|---:|---:|" + "---:|" * len(COUNT_KINDS) + "---|"
    return "\n".join([HEADER, sep] + [row(r) for r in results])


MEASURED_HEADER = "| case | measured graph us | measured eager us | reps | device |\n|---|---:|---:|---:|---|"


def row(r: dict) -> str:
    if r.get("measured"):
        g = "-" if r["graph_us"] is None else f"{r['graph_us']:,.1f}"
        return f"| {r['case']} | {g} | {r['eager_us']:,.1f} | {r['reps']} | {r['device']} |"
    d = r["dominant"] or {"kernel": "-", "max_counts": dict.fromkeys(COUNT_KINDS, 0)}
    return (f"| {r['case']} | {fmt(r['graph_us'])} | {fmt(r['eager_us'])} | {r['launches']} | {r['glue']} | "
            f"{r['syncs']} | " + " | ".join(str(d["max_counts"][k]) for k in COUNT_KINDS) + f" | {d['kernel']} |")


def main(argv=None) -> int:
    global DEVICE, NUM_BLOCKS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma list of cases (default all): {', '.join(CASES)}; 'alloc' means both alloc cases")
    ap.add_argument("--sizes", default="64,256,1024", help="decode_step batch sizes B (comma list)")
    ap.add_argument("--steps", type=int, default=8,
                    help="K of decode_multi (steps per burst), reserve, window_step and window_end (default 8)")
    ap.add_argument("--report", action="store_true", help="print gpucost's full report (launches, hot lines, loops)")
    ap.add_argument("--json", metavar="PATH", help="write every number to PATH")
    ap.add_argument("--gpucost", metavar="PATH", help="gpucost.py (default $GPUCOST, else ../shared/tools/gpucost.py)")
    ap.add_argument("--prefill-batch", type=int, default=256, help="requests per allocate_slots call when prefilling")
    ap.add_argument("--measure", action="store_true",
                    help="time each op with CUDA events on the GPU instead of modelling it (no gpucost needed)")
    ap.add_argument("--reps", type=int, default=20, help="repetitions per op with --measure (median)")
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS,
                    help=f"pool size of every case but replay (default {NUM_BLOCKS:,}, the figures' size; smaller "
                         "only to check the script quickly)")
    ap.add_argument("--replay-requests", type=int, default=1000,
                    help="requests of the bundled trace for the replay case (default 1,000)")
    args = ap.parse_args(argv)

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    cases = [x for c in cases for x in (("alloc_4096x1", "alloc_64x64") if c == "alloc" else (c,))]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {', '.join(bad)}; choose from {', '.join(CASES)}")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    NUM_BLOCKS = args.num_blocks
    if args.measure:
        gc, gc_path = Measure(args.reps), "-"
        DEVICE = "cuda" if gc.cuda else "cpu"
    else:
        gc, gc_path = load_gpucost(args.gpucost)
    gp = import_this_tree()
    commit = git_commit()
    print(f"gpupool {Path(gp.__file__).parent} at {commit}; gpucost {gc_path}")
    if args.measure:
        print(f"MEASURED with CUDA events on {gc.device}; median us of {args.reps} repetitions, each from the "
              "same restored state.")
    else:
        print("Modelled H200 latency (gpucost, a model, not a measurement); us best / lo / hi. "
              "Counts: the dominant launch's slowest program (max per kind over its programs).")
    print()
    if args.measure:
        print(MEASURED_HEADER)
    elif not args.report:
        print(table([]))
    results = []
    jobs = []
    for c in cases:
        if c == "decode_step":
            jobs += [(f"decode_step B={B}", lambda B=B: case_decode_step(gp, gc, B, args)) for B in sizes]
        elif c == "decode_multi":
            jobs += [(f"decode_multi K={args.steps} B={B}", lambda B=B: case_decode_step(gp, gc, B, args, args.steps))
                     for B in sizes]
        elif c == "window_begin":
            jobs += [(f"window_begin B={B}", lambda B=B: case_window(gp, gc, B, args, "begin")) for B in sizes]
        elif c == "window_step":
            jobs += [(f"window_step K={K}{' stops' if st else ''} B={B}",
                      lambda B=B, K=K, st=st: case_window(gp, gc, B, args, "step", K, st))
                     for B in sizes for K, st in ((1, False), (args.steps, False), (args.steps, True))]
        elif c == "window_end":
            jobs += [(f"window_end K={args.steps} B={B}", lambda B=B: case_window(gp, gc, B, args, "end", args.steps))
                     for B in sizes]
        elif c == "admit":
            jobs += [(f"admit B={B}", lambda B=B: case_admit(gp, gc, B, args)) for B in sizes]
        elif c == "reserve":
            jobs += [(f"reserve K={args.steps} B={B}", lambda B=B: case_reserve(gp, gc, B, args)) for B in sizes]
        elif c == "alloc_4096x1":
            jobs.append((c, lambda: case_alloc(gp, gc, 1, 4096, args)))
        elif c == "alloc_64x64":
            jobs.append((c, lambda: case_alloc(gp, gc, 64, 64, args)))
        elif c == "free_4096":
            jobs.append((c, lambda: case_free(gp, gc, args)))
        elif c == "lookup_10000":
            jobs.append((c, lambda: case_lookup(gp, gc, args)))
        elif c == "touch_4096":
            jobs.append((c, lambda: case_touch(gp, gc, args)))
        elif c == "replay":
            jobs.append((c, lambda: case_replay(gp, gc, args)))
        elif c in ("vllm_flush", "vllm_per_call"):
            jobs += [(f"{c} B={B}", lambda B=B, c=c: case_vllm(gp, gc, B, args, c == "vllm_flush")) for B in sizes]
    for name, job in jobs:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: building and recording ...", file=sys.stderr, flush=True)
        r = job()
        results.append(r)
        if not args.report:
            print(row(r), flush=True)
    if args.report and not args.measure:  # the reports came in between: the whole table once more
        print(table(results))
    print()
    for r in results:
        extra = "".join(f", {k} {r[k]} s" for k in ("warm_s", "prefill_s") if k in r)
        glue = ", ".join(f"{k} x{v}" for k, v in sorted(r.get("glue_ops", {}).items())) or "-"
        print(f"- {r['case']}: build {r['build_s']} s{extra}, record {r['record_s']} s; glue {glue}")
    if args.json:
        how = ({"model": f"measured with CUDA events on {gc.device}"} if args.measure else
               {"scenarios": list(gc.SCENARIO_NAMES), "model": "gpucost (modelled H200 latency, not measured)"})
        meta = {"commit": commit, "gpupool": str(Path(gp.__file__).parent), "gpucost": str(gc_path), **how,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
