"""The fast path's batch of device ops and its round rules (docs/algorithms.md section 8): the ops of
``get_new_blocks``, ``touch``, ``free_blocks`` and ``cache_full_blocks`` gathered on the host, in
rounds that ``gpupool.BlockPool.apply_predicted`` runs as one launch, each round in the fixed order
free, touch, pop, cache. Blocks are named by the host mirror's *slots*: block ids, and
``num_blocks + k`` for the k-th placeholder (a pop whose id the device has not reported yet)."""
from __future__ import annotations


class Round:
    """One round of a batch: ops run free, touch, pop, cache on the device. A new round starts where
    that order would move an op before one it must follow (:meth:`OpBatch.placement`); otherwise the
    order commutes."""

    __slots__ = ("free", "seg", "touch", "touched", "demands", "popped", "cache_slots", "cache_keys", "cache_ntok",
                 "cache_calls", "cached")

    def __init__(self):
        self.free: list[int] = []  # slots, the free calls one after another
        self.seg = [0]  # free call j is free[seg[j]:seg[j + 1]]
        self.touch: list[int] = []
        self.touched: set[int] = set()
        self.demands: list[int] = []  # get_new_blocks counts, in call order
        self.popped: set[int] = set()  # the predicted ids of its pops
        self.cache_slots: list[int] = []  # each caching call's range, one after another
        self.cache_keys: list[tuple] = []  # per cached block (hash, group) and covered tokens (checked)
        self.cache_ntok: list[int] = []
        self.cache_calls: list[int] = []  # blocks per caching call
        self.cached: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.free or self.touch or self.demands or self.cache_calls)

    def counts(self) -> tuple[int, int, int, int, int]:
        """(free ids, free calls, touches, demands, cache calls): the round as ``apply_batched``'s
        ``rounds`` takes it."""
        return len(self.free), len(self.seg) - 1, len(self.touch), len(self.demands), len(self.cache_calls)


class OpBatch:
    """The device ops since the last launch, in rounds, run as one launch. Pops the host predicted
    (``pred``, their ids in order) come before the others (placeholders): a placeholder pop empties the
    host's copy of the queue until the next synchronisation, which launches the batch first."""

    __slots__ = ("rounds", "pred", "size")

    def __init__(self):
        self.rounds = [Round()]
        self.pred: list[int] = []
        self.size = 0  # ids in it: blocks freed, touched, popped and cached

    @property
    def cur(self) -> Round:
        return self.rounds[-1]

    def cut(self) -> None:
        """Start a new round (none if the current one is empty)."""
        if self.rounds[-1]:
            self.rounds.append(Round())

    def __bool__(self) -> bool:
        return any(self.rounds)

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
        r = self.rounds[-1]
        if kind == "free" and not (r.cached.isdisjoint(slots) and r.touched.isdisjoint(slots)):
            return "round"
        if r.demands and (front or not r.popped.isdisjoint(slots)):
            return "round"
        return None

    def add_touch(self, slots: list[int]) -> None:
        r = self.rounds[-1]
        r.touch += slots
        r.touched.update(slots)
        self.size += len(slots)

    def add_free(self, slots: list[int]) -> None:
        r = self.rounds[-1]
        r.free += slots
        r.seg.append(len(r.free))
        self.size += len(slots)

    def add_pop(self, n: int, predicted: list[int] | None) -> None:
        """A ``get_new_blocks(n)``; ``predicted``: the ids the host predicts (None: placeholders)."""
        r = self.rounds[-1]
        r.demands.append(n)
        self.size += n
        if predicted:
            r.popped.update(predicted)
            self.pred += predicted

    def add_cache(self, slots: list[int], keys: list[tuple], ntok: list[int]) -> None:
        """A ``cache_full_blocks`` of ``slots`` under ``keys`` ((hash, group) each), covering ``ntok``."""
        r = self.rounds[-1]
        r.cache_slots += slots
        r.cache_keys += keys
        r.cache_ntok += ntok
        r.cache_calls.append(len(slots))
        r.cached.update(slots)
        self.size += len(slots)

    def parts(self) -> dict:
        """The batch flattened as ``apply_predicted`` takes it, in slots: ``free``, ``seg`` (each round's
        own offsets), ``touch``, ``demands``, ``cache_slots``, ``cache_items`` ((keys, ntok, blocks per
        call)), ``rounds`` (per round (free ids, free calls, touches, demands, cache calls))."""
        rounds = [r for r in self.rounds if r]
        if len(rounds) == 1:  # the common case: its own lists (the batch is not changed once launched)
            r = rounds[0]
            return dict(free=r.free, seg=r.seg, touch=r.touch, demands=r.demands, cache_slots=r.cache_slots,
                        cache_items=(r.cache_keys, r.cache_ntok, r.cache_calls),
                        rounds=[r.counts()])
        return dict(
            free=[x for r in rounds for x in r.free], seg=[x for r in rounds for x in r.seg],
            touch=[x for r in rounds for x in r.touch], demands=[x for r in rounds for x in r.demands],
            cache_slots=[x for r in rounds for x in r.cache_slots],
            cache_items=([x for r in rounds for x in r.cache_keys], [x for r in rounds for x in r.cache_ntok],
                         [x for r in rounds for x in r.cache_calls]),
            rounds=[r.counts() for r in rounds])
