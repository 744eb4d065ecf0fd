"""The host's copy of the device free queue's first ids (docs/algorithms.md section 8), kept exact with
the queue's own rules (docs/semantics.md section 2) so that the fast path knows which blocks a pop
takes without reading the device."""
from __future__ import annotations

from collections import OrderedDict

_IS_ID = (-1).__lt__  # v >= 0 for an int: a block id, not a hole (-1), at C speed


class FreeQueueCopy:
    """The free queue's first ids, in order, exactly (``ids``; None: not known).

    Filled from a window of the device's ring (:meth:`fill`); then every rule keeps it a prefix of the
    queue: a pop of n takes the first n (:meth:`take`), a touch of a free block unlinks it
    (:meth:`unlink`), a free puts un-keyed blocks at the front and keyed ones at the back
    (:meth:`requeue`, the back known only when the copy holds the whole queue). ``low_mark``: half the
    last fill; below it (and not the whole queue) the owner refills at its next synchronisation.
    """

    __slots__ = ("ids", "low_mark")

    def __init__(self):
        self.ids: OrderedDict | None = None
        self.low_mark = 0

    def __len__(self) -> int:
        return 0 if self.ids is None else len(self.ids)

    def known(self) -> bool:
        return self.ids is not None

    def fill(self, window) -> None:
        """From a device window: ids in queue order, -1 for holes and slots past the tail."""
        self.ids = OrderedDict.fromkeys(filter(_IS_ID, window))
        self.low_mark = len(self.ids) // 2

    def forget(self) -> None:
        """Not known any more (an op moved blocks in a way the copy does not model)."""
        self.ids = None

    def low(self, num_free: int) -> bool:
        """Whether to refill: unknown, or below the low mark and not the whole queue (a whole copy
        stays whole: every rule keeps it exact)."""
        q = self.ids
        return q is None or (len(q) < self.low_mark and len(q) < num_free)

    def fits(self, n: int) -> bool:
        return self.ids is not None and n <= len(self.ids)

    def take(self, n: int) -> list[int]:
        """The first ``n`` ids, removed (a pop); the caller checked :meth:`fits`."""
        pop = self.ids.popitem
        if n == 1:  # most pops in decode
            return [pop(False)[0]]
        return [pop(False)[0] for _ in range(n)]

    def unlink(self, block: int) -> None:
        """A free block touched leaves the queue (past the copy if absent: the copy stays a prefix)."""
        if self.ids is not None:
            self.ids.pop(block, None)

    def requeue(self, front: list[int], back: list[int], num_free_before: int, num_blocks: int) -> None:
        """A free call's blocks that reached 0: ``front`` (no key) to the front, its first element the
        new head; ``back`` (keyed) to the back, added only when the copy was the whole queue
        (``num_free_before`` free blocks). Ids ``>= num_blocks`` (placeholders) are not known: the copy
        is then forgotten."""
        q = self.ids
        if q is None or not (front or back):
            return
        if front and max(front) >= num_blocks or back and max(back) >= num_blocks:
            self.ids = None
            return
        whole = len(q) == num_free_before
        for s in reversed(front):
            q[s] = None
            q.move_to_end(s, last=False)
        if whole:
            q.update(dict.fromkeys(back))

    def agrees(self, window) -> bool:
        """Whether a device window continues the copy (the common prefix equal)."""
        if self.ids is None:
            return True
        mine, got = list(self.ids), list(filter(_IS_ID, window))
        m = min(len(mine), len(got))
        return mine[:m] == got[:m]
