"""The fast path's batch of device ops and its round rules (docs/algorithms.md section 8): the ops of
``get_new_blocks``, ``touch``, ``free_blocks`` and ``cache_full_blocks`` gathered on the host into the
one launch's ``gpupool.kernels.flush.FlushBatch`` (rounds, each run in the fixed order free, touch, pop,
cache). Blocks are named by the host mirror's *slots*: block ids, and ``num_blocks + k`` for the k-th
placeholder (a pop whose id the device has not reported yet)."""
from __future__ import annotations

from .. import _backend
_backend.select()  # the kernels' backend, before the kernel module below
from ..kernels.flush import FlushBatch  # noqa: E402
from ..kernels.layout import LAST_CACHINGS, LAST_DEMANDS, LAST_POPPED  # noqa: E402


class OpBatch(FlushBatch):
    """The device ops since the last launch, as the :class:`FlushBatch` they launch as (in slots), with
    what the round rules and the synchronisation need: ``pred``, the ids the host predicts its pops
    take, in order; ``size``, the block ids its ops name; ``placeholders``, whether a slot past the
    blocks is named (the launch then gives device ids); and the current round's touched, popped and
    cached blocks (:meth:`placement`). Pops the host predicted come before the others (placeholders): a
    placeholder pop empties the host's copy of the queue until the next synchronisation, which launches
    the batch first."""

    __slots__ = ("pred", "size", "placeholders", "touched", "popped", "cached")

    def __init__(self):
        super().__init__()
        self.pred: list[int] = []
        self.size = 0
        self.placeholders = False
        self.touched: set[int] = set()
        self.popped: set[int] = set()
        self.cached: set[int] = set()

    def cut(self) -> None:
        """Start a new round (none if the current one is empty)."""
        if not self.round_empty():
            super().cut()
            self.touched, self.popped, self.cached = set(), set(), set()

    def placement(self, kind: str, slots: list[int], front: bool, launched: int) -> str | None:
        """Where a touch or free (``kind``) of ``slots`` must go so that the round order does not move
        it before an op it follows: ``"launch"`` (launch the batch first) for an op on a placeholder
        whose pop is not launched (slot ``>= launched``: the free and touch parts take device ids);
        ``"round"`` (a new round) for a free of a block the round touches or caches, and, past the
        round's pops, an op on a block they took or a free to the queue's ``front`` (the pops would
        take it); else None, the op commuting with the round's pops: a pop of n takes the queue's
        first n, and a block freed to the back or a free block touched (still free after the pops,
        so not among their first n) leaves those alone."""
        if slots and max(slots) >= launched:
            return "launch"
        if kind == "free" and not (self.cached.isdisjoint(slots) and self.touched.isdisjoint(slots)):
            return "round"
        if self.table[LAST_DEMANDS] and (
                front or not self.popped.isdisjoint(slots)):
            return "round"
        return None

    def add_touch(self, slots: list[int]) -> None:
        super().add_touch(slots)
        self.touched.update(slots)
        self.size += len(slots)

    def add_free(self, slots: list[int]) -> None:
        super().add_free(slots)
        self.size += len(slots)

    def add_pop(self, n: int, predicted: list[int] | None = None) -> None:
        """A ``get_new_blocks(n)``; ``predicted``: the ids the host predicts (None: placeholders)."""
        super().add_pop(n)
        self.size += n
        if predicted:
            self.popped.update(predicted)
            self.pred += predicted

    def add_pop_one(self, slot: int) -> None:
        """``add_pop(1, [slot])`` in fewer steps (the decode step's pop)."""
        t = self.table
        self.demands.append(1)
        t[LAST_DEMANDS] += 1
        t[LAST_POPPED] += 1
        self.popped.add(slot)
        self.pred.append(slot)
        self.size += 1

    def add_cache_one(self, slot: int, key: tuple, ntok: int) -> None:
        """``add_cache([slot], [key], [ntok])`` in fewer steps (the decode step's caching)."""
        self.cache_ids.append(slot)
        self.cache_keys.append(key)
        self.cache_ntok.append(ntok)
        self.cache_calls.append(1)
        self.table[LAST_CACHINGS] += 1
        self.cached.add(slot)
        self.size += 1

    def add_cache(self, slots: list[int], keys: list, ntok: list[int]) -> None:
        """A ``cache_full_blocks`` of ``slots`` under ``keys`` ((hash, group) each), covering ``ntok``."""
        super().add_cache(slots, keys, ntok)
        self.cached.update(slots)
        self.size += len(slots)
