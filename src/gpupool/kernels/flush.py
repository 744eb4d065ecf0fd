"""One launch for a batch of the four batched pool ops, in the order free, touch, pop, cache, in one
round or several one after another (``BlockPool.apply_batched``; the vLLM fast path's flush,
docs/vllm.md "The fast path").

Each part is the op's own body (``release_batch``, ``touch_batch``, ``alloc_batch``,
``cache_blocks_batch``), all or nothing; a part that fails records its error in the status word, which
makes every later part do nothing (docs/semantics.md section 3), as four launches would. The caching's
ids may name blocks this launch pops: ``N + k`` is the k-th popped block (in this round or an earlier one).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .alloc import alloc_batch, fill_head_minus_one
from .cache import cache_blocks_batch
from .common import batch_config, status_clear, warps_for
from .layout import (
    CF_AFTER, CF_BEFORE, CONFIRM_WIDTH, LAST_CACHINGS, LAST_DEMANDS, LAST_FREE_CALLS, LAST_FREE_IDS, LAST_POPPED,
    LAST_TOUCHES, OP_ALLOCATE_BATCHED, OP_CACHE_BLOCKS_BATCHED, OP_FREE_BATCHED,
    OP_TOUCH_BATCHED, RF_CACHE_START, RF_CACHINGS, RF_DEMANDS, RF_DEMANDS_START, RF_FREE_CALLS, RF_FREE_IDS,
    RF_FREE_OFFSETS_START, RF_FREE_START, RF_POPPED, RF_POPPED_START, RF_TOUCH_START, RF_TOUCHES, ROUND_PARTS, ROUND_WIDTH, RW,
    RoundField,
)
from .release import release_batch, touch_batch


class FreePart(NamedTuple):
    ids: object  # int32[>= n_free]: the frees' ids, call after call
    seg_off: object  # int32[nseg + 1]: call j is ids[seg_off[j]:seg_off[j + 1]]
    pf: object  # int32[n_free + 1] scratch
    seg_of: object  # int32[>= n_free] scratch
    code: object  # int32[>= n_free] scratch


class PopPart(NamedTuple):
    demands: object  # int32[>= n_demands]
    blocks: object  # int32[>= total + 1] out: the popped blocks
    offsets: object  # int32[n_demands + 1] out
    confirm: object  # int32[CONFIRM_WIDTH] out: the launch's confirmation words (layout.Confirm)


class CachePart(NamedTuple):
    ids: object  # int32[>= n_cache]: block ids, or N + k for the k-th popped block
    resolved: object  # int32[>= n_cache] scratch: the block ids
    key_hi: object  # int64[>= n_cache]
    key_lo: object
    key_group: object
    ntok: object


@triton.jit
def resolve_popped(pc: tl.constexpr, ids, out, n, popped, total):
    """``out[i] = ids[i]``, except ``popped[ids[i] - N]`` for ``N <= ids[i] < N + total``."""
    offs = tl.arange(0, pc.BLOCK)
    i = 0
    while i < n:
        idx = i + offs
        m = idx < n
        v = tl.load(ids + idx, mask=m, other=0)
        mine = m & (v >= pc.N) & (v < pc.N + total)
        v = tl.where(mine, tl.load(popped + (v - pc.N), mask=mine, other=0), v)
        tl.store(out + idx, v, mask=m)
        i += pc.BLOCK


class FlushBatch:
    """One launch of :func:`flush_kernel` as host values (``BlockPool.apply_predicted``; the vLLM fast
    path builds one per launch, docs/algorithms.md section 8): round after round, each round's frees
    (call after call), touches, pops (one demand per call) and cachings, kept as the kernel reads them.

    ``free_ids``, ``touch_ids``, ``cache_ids``: the id parts, every round's one after another (host
    ints, or ``int32`` device tensors where a caller has them there); ``free_offsets``: each round's
    own offsets into its frees, from 0 (``free calls + 1`` entries per round); ``demands``: host ints;
    ``cache_keys`` / ``cache_ntok``: per cached block its ``(hash, group)`` and covered tokens;
    ``cache_calls``: blocks per caching call; ``table``: the kernel's round table
    (``layout.RoundField`` per round), kept up to date by the ``add_*`` methods and :meth:`cut`."""

    __slots__ = ("free_ids", "free_offsets", "touch_ids", "demands", "cache_ids", "cache_keys", "cache_ntok",
                 "cache_calls", "table")

    def __init__(self):
        self.free_ids: list = []
        self.free_offsets = [0]
        self.touch_ids: list = []
        self.demands: list[int] = []
        self.cache_ids: list = []
        self.cache_keys: list = []
        self.cache_ntok: list[int] = []
        self.cache_calls: list[int] = []
        self.table = [0] * ROUND_WIDTH

    @property
    def rounds(self) -> int:
        return len(self.table) // ROUND_WIDTH

    def __bool__(self) -> bool:
        return bool(self.demands or len(self.free_ids) or len(self.touch_ids) or len(self.cache_ids))

    def round_empty(self) -> bool:
        """Whether the current (last) round has no op."""
        t = self.table
        return not (t[LAST_FREE_CALLS] or t[LAST_TOUCHES] or t[LAST_DEMANDS] or t[LAST_CACHINGS])

    def cut(self) -> None:
        """Start a new round (none if the current one is empty)."""
        if not self.round_empty():
            self._next_round(len(self.free_offsets))
            self.free_offsets.append(0)

    def _next_round(self, offsets_start: int) -> None:
        """An empty round in the table whose parts start where the current round's end (its free
        offsets at ``offsets_start``)."""
        t, r = self.table, len(self.table) - ROUND_WIDTH
        row = [0] * ROUND_WIDTH
        for start, count in ROUND_PARTS:
            row[start] = t[r + start] + t[r + count]
        row[RoundField.FREE_OFFSETS_START] = offsets_start
        t += row

    def add_free(self, ids: list[int]) -> None:
        """A ``free_blocks`` call of ``ids`` (a segment of the round's frees)."""
        t = self.table
        self.free_ids += ids
        t[LAST_FREE_IDS] += len(ids)
        t[LAST_FREE_CALLS] += 1
        self.free_offsets.append(t[LAST_FREE_IDS])

    def add_touch(self, ids: list[int]) -> None:
        self.touch_ids += ids
        self.table[LAST_TOUCHES] += len(ids)

    def add_pop(self, n: int) -> None:
        """A ``get_new_blocks(n)`` (one demand)."""
        t = self.table
        self.demands.append(n)
        t[LAST_DEMANDS] += 1
        t[LAST_POPPED] += n

    def add_cache(self, ids: list[int], keys: list, ntok: list[int]) -> None:
        """A ``cache_full_blocks`` call of ``ids`` under ``keys`` (``(hash, group)`` each) covering
        ``ntok`` tokens each; ``N + k`` names the launch's k-th pop."""
        self.cache_ids += ids
        self.cache_keys += keys
        self.cache_ntok += ntok
        self.cache_calls.append(len(ids))
        self.table[LAST_CACHINGS] += len(ids)

    def with_ids(self, free_ids, touch_ids, cache_ids) -> "FlushBatch":
        """The same batch with its id parts replaced (say, by device tensors), ``self`` unchanged."""
        out = FlushBatch.__new__(FlushBatch)
        for name in FlushBatch.__slots__:
            setattr(out, name, getattr(self, name))
        out.free_ids, out.touch_ids, out.cache_ids = free_ids, touch_ids, cache_ids
        return out

    @classmethod
    def of_rounds(cls, free_ids, free_offsets, touch_ids, demands: list[int], cache_ids, cache_items,
                  rounds) -> "FlushBatch":
        """A batch from its parts and per-round counts ``(free ids, free calls, touches, demands as a
        list, cached blocks)`` (``BlockPool.apply_batched``'s form; without frees every round reads the
        one offset 0). The parts are taken as they are (host ints or device tensors)."""
        b = cls()
        b.free_ids, b.touch_ids, b.cache_ids = free_ids, touch_ids, cache_ids
        b.free_offsets, b.demands = free_offsets, demands
        b.cache_keys, b.cache_ntok, b.cache_calls = cache_items
        s0 = 0
        for k, (nfi, nfc, nt, dem, nc) in enumerate(rounds):
            if k:
                b._next_round(s0)
            t, r = b.table, len(b.table) - ROUND_WIDTH
            t[r + RoundField.FREE_CALLS], t[r + RoundField.FREE_IDS], t[r + RoundField.TOUCHES] = nfc, nfi, nt
            t[r + RoundField.DEMANDS], t[r + RoundField.POPPED], t[r + RoundField.CACHINGS] = len(dem), sum(dem), nc
            s0 += nfc + 1 if free_ids is not None else 0
        return b

    def round_pops(self) -> list[int]:
        """Blocks each round's demands want, round after round."""
        t = self.table
        return [t[r + RoundField.POPPED] for r in range(0, len(t), ROUND_WIDTH)]


@triton.jit
def flush_kernel(ps, pc: tl.constexpr, fr, touch_ids, pop, ca, rounds, n_rounds):
    """Round after round (``rounds``: ``FlushBatch.table``): ``free_batched`` of the round's
    frees (its segments), ``touch_batched`` of its touches, ``allocate_batched`` of its demands and
    ``cache_blocks_batched`` of its cachings, in that order (module docstring). ``pop.blocks`` holds
    every round's pops one after another, -1 for a round whose pops fail or are skipped (as
    ``allocate_batched``); ``pop.offsets``: round r's offsets at ``demands start + r``;
    ``pop.confirm``: the status code before the rounds and after them (layout.Confirm)."""
    # strict: benign, every thread stores the one value it read before any store of this launch
    tl.store(pop.confirm + CF_BEFORE, tl.load(ps.status))
    r = 0
    while r < n_rounds:
        m = rounds + r * RW
        f0, s0 = tl.load(m + RF_FREE_START), tl.load(m + RF_FREE_OFFSETS_START)
        nseg, n_free = tl.load(m + RF_FREE_CALLS), tl.load(m + RF_FREE_IDS)
        t0, n_touch = tl.load(m + RF_TOUCH_START), tl.load(m + RF_TOUCHES)
        d0, n_demands = tl.load(m + RF_DEMANDS_START), tl.load(m + RF_DEMANDS)
        b0, want = tl.load(m + RF_POPPED_START), tl.load(m + RF_POPPED)
        c0, n_cache = tl.load(m + RF_CACHE_START), tl.load(m + RF_CACHINGS)
        release_batch(ps, pc, fr.ids + f0, None, n_free, fr.seg_off + s0, nseg, fr.pf, fr.seg_of, fr.code,
                      OP_FREE_BATCHED, False)
        tl.debug_barrier()
        touch_batch(ps, pc, touch_ids + t0, None, n_touch, OP_TOUCH_BATCHED)
        tl.debug_barrier()
        err_pop = tl.full([], 1, tl.int32)  # not run
        total = tl.zeros([], tl.int64)
        if status_clear(ps.status):
            err_pop, total = alloc_batch(ps, pc, pop.demands + d0, None, n_demands, pop.blocks + b0,
                                         pop.offsets + d0 + r, OP_ALLOCATE_BATCHED)
        total = tl.where(err_pop == 0, total, 0)  # blocks popped: none when the part failed (nothing to resolve)
        if err_pop != 0:
            fill_head_minus_one(pop.blocks + b0, want, pc.BLOCK)
        tl.debug_barrier()
        # N + k names the launch's k-th pop: those of this round and the earlier ones
        resolve_popped(pc, ca.ids + c0, ca.resolved + c0, n_cache, pop.blocks, b0 + total)
        tl.debug_barrier()
        cache_blocks_batch(ps, pc, ca.resolved + c0, ca.key_hi + c0, ca.key_lo + c0, ca.key_group + c0,
                           ca.ntok + c0, n_cache, OP_CACHE_BLOCKS_BATCHED)
        tl.debug_barrier()
        r += 1
    tl.store(pop.confirm + CF_AFTER, tl.load(ps.status))


def _aligned(n: int) -> int:
    """``n`` int32 entries rounded up to whole 16 bytes."""
    return (n + 3) & ~3


def launch_flush(ps, pc, free_ids, seg_off, touch_ids, demands, rounds, cache_ids, key_hi, key_lo, key_group, ntok,
                 *, n_rounds: int, n_free: int, n_touch: int, n_demands: int, n_cache: int, total: int,
                 offsets: bool = True):
    """Launch ``flush_kernel`` (one program; the pool has no KV events). Every argument is a device
    tensor with at least one entry, of which the first ``n_*`` count (``seg_off``: every round's
    offsets; ``rounds``: ``FlushBatch.table``, ``n_rounds * ROUND_WIDTH`` entries, int32); ``total``:
    the demands' sum, checked on the host (sizes the output). Returns ``(blocks: int32[total],
    offsets: int32[n_demands + 1], confirm: int32[CONFIRM_WIDTH])``, the offsets over all rounds'
    demands (``offsets=False``: None, three torch ops fewer for a caller that reads none); ``blocks``
    -1 where a round's pops fail or are skipped; ``confirm`` the status code before the launch and
    after it (not 0 before: a recorded error made it do nothing). Outputs and scratch are views of
    one allocation (one op, not one per part)."""
    import torch

    if pc.EVENTS:
        raise ValueError("flush_kernel's caching writes no events")
    pc = batch_config(pc, max(n_free, n_touch, total, n_cache))
    nf, nc = max(n_free, 1), max(n_cache, 1)
    sizes = [_aligned(total + 1), _aligned(n_demands + n_rounds), _aligned(nf + 1), _aligned(nf), _aligned(nf), _aligned(nc),
             CONFIRM_WIDTH]  # every part 16-byte aligned, as its own allocation would be (Triton specializes on it)
    blocks, offs, pf, seg_of, code, resolved, confirm = torch.empty(
        sum(sizes), dtype=torch.int32, device=free_ids.device).split_with_sizes(sizes)
    if offsets:  # a round whose pops are skipped writes none: 0, as allocate_batched's, not what was there
        offs.zero_()
    fr = FreePart(free_ids, seg_off, pf, seg_of, code)
    ca = CachePart(cache_ids, resolved, key_hi, key_lo, key_group, ntok)
    flush_kernel[(1,)](ps, pc, fr, touch_ids, PopPart(demands, blocks, offs, confirm), ca, rounds, n_rounds,
                       num_warps=warps_for(pc.BLOCK))
    if not offsets:
        offs = None
    elif n_rounds > 1:  # each round wrote its own offsets, from 0: the demands' prefix sums over all of them
        offs = torch.cat([offs[:1], torch.cumsum(demands[:n_demands], 0).to(torch.int32)])
    else:
        offs = offs[: n_demands + 1]
    return blocks[:total], offs, confirm
