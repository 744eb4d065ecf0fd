"""Trace replay: the main job's model (docs/semantics.md section 5), run against any pool of docs/semantics.md section 4.

A trace is JSON lines in Mooncake's format::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [id, ...]}

``hash_ids`` holds one prefix-hash id per ``block_size``-token block of the prompt (the last one may
cover a partial block); block ``i``'s hash is ``trace_block_hash(hash_ids[i])``, i.e.
``sha256(str(id).encode()).digest()``, in group 0. The bundled trace (12,031 requests of a chat
service, released with the Mooncake paper; see ``gpupool/data/mooncake/README.md``) has ids per
512-token block, so other block sizes replay it with the ids re-read at that size (a synthetic
workload, still deterministic and the same for both pools).

The model, exactly (docs/semantics.md section 5):

* Events are processed in time order. At equal times completions come before arrivals, completions
  in (finish time, admission order) order and arrivals in arrival order: by timestamp, ties in trace
  order. After every single event (each completion, each arrival) the waiting line is admitted in
  arrival order until the first request that does not fit (head-of-line blocking).
* Admitting a request at the event's time ``t``:
  ``full = input_length // block_size`` (clamped to ``len(hash_ids)`` if a trace line has fewer ids;
  the bundled trace never does at block size 512, but smaller block sizes do); its hashes are those of
  the first ``full`` ids. Hits: the longest prefix of the first ``min(full, (input_length - 1) //
  block_size)`` hashes that ``get_cached_block(h, [0])`` finds (the last prompt token is always
  computed, as in vLLM). ``total = ceil((input_length + output_length) / block_size)``,
  ``new = total - hits``.
* ``total > num_blocks - 1``: rejected (counted, never admitted, dropped from the line without
  blocking it). ``new + (hit blocks whose ref_cnt is 0) > get_num_free_blocks()``: it waits, and so
  does everything behind it. Else ``touch(hits)``, ``blocks = hits + get_new_blocks(new)``,
  ``cache_full_blocks(blocks, hashes, len(hits), full, block_size, 0)``; the request finishes at
  ``t + output_length * tpot_ms`` (Python float arithmetic) and then ``free_blocks(reversed(blocks))``.

The pool is driven only through the conformance names of docs/semantics.md section 4 (``get_cached_block``,
``touch``, ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``, ``get_num_free_blocks``,
``free_queue``, ``ref_counts(ids)``) plus ``num_blocks``, so the reference pool and the device pool
replay the same trace op for op; equal reports (hit counts, free-queue digest) mean equal behaviour.

Per-timestamp structure: :meth:`_Replayer.process_time` handles every event at one timestamp
(completions first, each followed by an admission pass, then arrivals, each followed by one). A
batched device variant that handles a whole timestamp through batched pool calls must leave the same
state as that sequence.

Default pool size (:data:`DEFAULT_NUM_BLOCKS` = 16,384 blocks of 512 tokens, 8M tokens of KV): at
``tpot_ms = 20`` the bundled trace holds at most 1,697 blocks at once (measured; 1,732 without prefix
sharing), so any pool above about 1,700 blocks never makes a request wait, and the rest of the pool is
prefix cache: free hashed blocks in the LRU tail of the free queue. The trace's reuse is far apart in
time (follow-up turns of a conversation), so the hit ratio grows slowly with the pool (measured,
reference pool, whole trace: 1,024 blocks 0.047 with 919 requests waiting; 2,048 0.056; 4,096 0.093;
8,192 0.195; 16,384 0.282; 32,768 0.355; unbounded (>= 171k blocks, nothing evicted) 0.382). At
16,384 the cache keeps about three quarters of the reachable reuse while still evicting all the time
(171k distinct blocks pass through it), so both the hit path and LRU eviction are exercised. The
largest request needs 248 blocks; pools of 248 blocks or fewer reject some requests.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from ..keys import trace_block_hash
from .trace import BUNDLED_TRACE, TraceRequest, _is_int, bundled_trace_path, check_requests, load_trace

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_NUM_BLOCKS", "DEFAULT_TPOT_MS", "BUNDLED_TRACE", "ReplayReport",
    "TraceRequest", "bundled_trace_path", "free_queue_digest", "load_trace", "replay",
]

DEFAULT_BLOCK_SIZE = 512
DEFAULT_TPOT_MS = 20.0
DEFAULT_NUM_BLOCKS = 16384


def free_queue_digest(free_queue: Iterable[int]) -> str:
    """SHA-256 hex of the free queue written as comma-joined decimal ids (head first)."""
    return hashlib.sha256(",".join(str(int(b)) for b in free_queue).encode()).hexdigest()


@dataclass
class ReplayReport:
    """What a replay measured. ``to_json_dict()`` gives the docs/semantics.md section 5 names (and the extras).

    Contract fields: ``requests``, ``admitted``, ``rejected``, ``prompt_blocks`` (sum of ``full`` over
    admitted requests), ``hit_blocks``, ``hit_ratio`` (hit / prompt blocks; 0 when there are none),
    ``free_queue_sha256``. Extras: ``pool`` (class name), ``num_blocks``, ``block_size``, ``tpot_ms``,
    ``wall_s`` and ``requests_per_s`` (replay time only, trace loading excluded), ``waited``
    (admitted requests that were admitted later than they arrived), ``peak_blocks_in_use`` (most non-free blocks
    right after an admission), ``end_time_ms`` (the last event's time) and ``time_points`` (distinct
    event times).
    """

    pool: str
    num_blocks: int
    block_size: int
    tpot_ms: float
    requests: int = 0
    admitted: int = 0
    rejected: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    hit_ratio: float = 0.0
    free_queue_sha256: str = ""
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    waited: int = 0
    peak_blocks_in_use: int = 0
    end_time_ms: float = 0.0
    time_points: int = 0

    def to_json_dict(self) -> dict:
        return asdict(self)


def _as_ints(x) -> list[int]:
    """Ids a pool returned (a list, or an integer tensor) as Python ints."""
    if hasattr(x, "tolist"):
        x = x.tolist()
        if isinstance(x, int):
            return [x]
    return [int(b) for b in x]


@dataclass
class _Req:
    idx: int  # arrival order
    t: TraceRequest
    hashes: list[bytes] = field(default_factory=list)
    full: int = 0
    hit_candidates: int = 0
    total: int = 0


class _Replayer:
    """State of one replay; :meth:`process_time` is the per-timestamp step of the model."""

    def __init__(self, pool, trace: list[TraceRequest], block_size: int, tpot_ms: float, bar=None):
        self.pool = pool
        self.n = int(pool.num_blocks)
        self.bs = block_size
        self.tpot = tpot_ms
        order = sorted(range(len(trace)), key=lambda i: trace[i].timestamp)  # stable: ties in trace order
        self.arrivals = [_Req(k, trace[i]) for k, i in enumerate(order)]
        self.next_arrival = 0
        self.waiting: deque[_Req] = deque()
        # (finish time, admission seq, blocks): heap order = (finish time, admission order)
        self.running: list[tuple[float, int, list[int]]] = []
        self.admit_seq = 0
        self.bar = bar
        self.report = ReplayReport(pool=getattr(pool, "name", None) or type(pool).__name__, num_blocks=self.n,
                                   block_size=block_size, tpot_ms=tpot_ms, requests=len(trace))
        self._hash_cache: dict[int, bytes] = {}

    # ---- per-request preparation (pure) ------------------------------------------------------
    def _prepare(self, r: _Req) -> None:
        tr, bs = r.t, self.bs
        r.full = min(tr.input_length // bs, len(tr.hash_ids))
        r.hit_candidates = min(r.full, (tr.input_length - 1) // bs)
        r.total = -(-(tr.input_length + tr.output_length) // bs)
        cache = self._hash_cache
        hashes = []
        for h in tr.hash_ids[:r.full]:
            d = cache.get(h)
            if d is None:
                d = cache[h] = trace_block_hash(h)
            hashes.append(d)
        r.hashes = hashes

    # ---- the model ---------------------------------------------------------------------------
    def try_admit(self, r: _Req, now: float) -> bool | None:
        """Admit ``r`` at ``now`` if it fits: True admitted, None rejected, False must wait."""
        rep, pool = self.report, self.pool
        if r.total > self.n - 1:
            rep.rejected += 1
            if self.bar is not None:
                self.bar.update(1)
            return None
        hits: list[int] = []
        for h in r.hashes[:r.hit_candidates]:
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(int(_as_ints(got)[0]))
        new = r.total - len(hits)
        hit_free = sum(1 for c in _as_ints(pool.ref_counts(hits)) if c == 0) if hits else 0
        free = int(pool.get_num_free_blocks())
        if new + hit_free > free:
            return False
        if hits:
            pool.touch(hits)
        blocks = hits + _as_ints(pool.get_new_blocks(new))
        pool.cache_full_blocks(blocks, r.hashes, len(hits), r.full, self.bs, 0)
        rep.admitted += 1
        if now > r.t.timestamp:
            rep.waited += 1
        rep.prompt_blocks += r.full
        rep.hit_blocks += len(hits)
        rep.peak_blocks_in_use = max(rep.peak_blocks_in_use, self.n - 1 - int(pool.get_num_free_blocks()))
        heapq.heappush(self.running, (now + r.t.output_length * self.tpot, self.admit_seq, blocks))
        self.admit_seq += 1
        return True

    def admit_waiting(self, now: float) -> None:
        """Admit waiting requests in arrival order until the first that does not fit."""
        w = self.waiting
        while w:
            if self.try_admit(w[0], now) is False:
                return
            w.popleft()

    def complete_next(self) -> float:
        """Finish the running request first in (finish time, admission order); return its time."""
        t, _, blocks = heapq.heappop(self.running)
        self.pool.free_blocks(blocks[::-1])
        if self.bar is not None:
            self.bar.update(1)
        return t

    def arrive_next(self) -> float:
        """Put the next arrival at the back of the waiting line; return its time."""
        r = self.arrivals[self.next_arrival]
        self.next_arrival += 1
        self._prepare(r)
        self.waiting.append(r)
        return r.t.timestamp

    def next_time(self) -> float | None:
        """The earliest pending event time (None when nothing is left)."""
        c = self.running[0][0] if self.running else None
        a = self.arrivals[self.next_arrival].t.timestamp if self.next_arrival < len(self.arrivals) else None
        if c is None:
            return a
        return c if a is None or c <= a else a

    def process_time(self, now: float) -> None:
        """Every event at time ``now``: completions first (each followed by an admission pass), then
        arrivals in arrival order (each followed by one). A completion created here at ``now``
        (``output_length == 0``) is processed as soon as it is the earliest event."""
        while True:
            if self.running and self.running[0][0] <= now:
                self.complete_next()
                self.admit_waiting(now)
            elif self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].t.timestamp <= now:
                line_was_blocked = bool(self.waiting)
                self.arrive_next()
                # A non-empty line before the arrival means its head did not fit, and an arrival
                # changes no pool state, so the admission pass would stop at that head again.
                if not line_was_blocked:
                    self.admit_waiting(now)
            else:
                return

    def run(self) -> ReplayReport:
        now = None
        while (t := self.next_time()) is not None:
            now = t
            self.report.time_points += 1
            self.process_time(t)
        if self.waiting:  # cannot happen: with nothing running every request of total <= N-1 fits
            raise RuntimeError(f"replay: {len(self.waiting)} requests still waiting at the end")
        rep = self.report
        rep.end_time_ms = float(now) if now is not None else 0.0
        rep.hit_ratio = rep.hit_blocks / rep.prompt_blocks if rep.prompt_blocks else 0.0
        rep.free_queue_sha256 = free_queue_digest(_as_ints(self.pool.free_queue()))
        return rep


def check_replay_args(pool, trace, block_size, tpot_ms) -> list[TraceRequest]:
    """The checks every replay makes; returns the trace as a checked list. ValueError for a
    ``block_size`` that is not an integer >= 1, a ``tpot_ms`` that is not a finite number >= 0, or a
    pool with blocks in use; TraceError (a ValueError) for a request with a bad field (as
    :func:`gpupool.replay.trace.check_requests`)."""
    trace = check_requests(trace)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if isinstance(tpot_ms, bool) or not isinstance(tpot_ms, (int, float)) or not math.isfinite(tpot_ms) \
            or tpot_ms < 0:
        raise ValueError(f"tpot_ms must be a finite number >= 0, got {tpot_ms!r}")
    n = int(pool.num_blocks)
    free = int(pool.get_num_free_blocks())
    if free != n - 1:
        raise ValueError(f"replay needs a pool with no block in use: {free} of {n - 1} blocks are free")
    return trace


def progress_bar(progress: bool | Mapping, total: int, desc: str):
    """A tqdm bar over ``total`` finished requests, or None when ``progress`` is falsy (a mapping adds
    tqdm arguments)."""
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("progress bars need tqdm: pip install tqdm (or, in the repository, pip install -e '.[cli]')", name="tqdm") from e

    kw = {"total": total, "desc": desc, "unit": "req"}
    if isinstance(progress, Mapping):
        kw.update(progress)
    return tqdm(**kw)


def replay(pool, trace: list[TraceRequest], *, block_size: int = DEFAULT_BLOCK_SIZE,
           tpot_ms: float = DEFAULT_TPOT_MS, progress: bool | Mapping = False) -> ReplayReport:
    """Replay ``trace`` on ``pool`` with the model of docs/semantics.md section 5 (see the module docstring).

    ``pool`` must be fresh in the sense that no block is held (all ``num_blocks - 1`` non-null blocks
    free); it is left with every request finished. ``progress``: a tqdm bar over finished requests
    (True, or a mapping of extra tqdm arguments). Returns a :class:`ReplayReport`.
    Raises ValueError for a bad ``block_size`` / ``tpot_ms`` or a pool with blocks in use, TraceError
    (a ValueError) for a request with a bad field, TypeError for an entry that is not a TraceRequest.
    """
    trace = check_replay_args(pool, trace, block_size, tpot_ms)
    bar = progress_bar(progress, len(trace), f"replay {type(pool).__name__}")
    try:
        start = time.perf_counter()
        rep = _Replayer(pool, trace, block_size, float(tpot_ms), bar).run()
        rep.wall_s = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
    rep.requests_per_s = rep.requests / rep.wall_s if rep.wall_s > 0 else 0.0
    return rep
