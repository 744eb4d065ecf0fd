"""The reference decode window: ``gpupool.window.DecodeWindow``'s rules over
``ReferenceKVCacheManager``, in plain Python (docs/semantics.md section 9), the oracle the device window
is tested against step by step."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..args import as_flag_list, as_host_list, as_id_list, as_int, as_token_list, check_slot_list
from ..errors import InvalidArgumentError, InvalidCountError, slot_use_message, token_count_message
from .manager import ReferenceKVCacheManager


class WindowStep(NamedTuple):
    """One pool step's outputs by lane (``n`` lanes): ``admitted[i]`` (the lane takes part in the
    forward pass), ``slot_mapping[g][i * Q + j]`` (the KV slot of lane i's query j in group g, -1 where
    not admitted), ``seq_lens[i]`` (tokens lane i attends to: ``num_tokens + D``, 0 where not admitted)."""

    admitted: list[bool]
    slot_mapping: list[list[int]]
    seq_lens: list[int]


class ReferenceDecodeWindow:
    """A decode window of ``steps`` pool steps over ``manager`` (docs/semantics.md section 9):
    :meth:`begin`, then :meth:`step` k for k in ``0 .. steps - 1`` (each after forward pass k - 1, given
    what that pass decided), then :meth:`end` (after the last pass). ``num_lookahead_tokens`` (D):
    draft positions each step books past a lane's tokens (speculative decoding; Q = D + 1 queries per
    lane). Lanes are the order of ``begin``'s ``slots``."""

    def __init__(self, manager: ReferenceKVCacheManager, max_batch: int, steps: int = 1,
                 num_lookahead_tokens: int = 0):
        op = "DecodeWindow"
        self.m = manager
        self.max_batch = as_int(op, max_batch, "max_batch")
        self.steps = as_int(op, steps, "steps")
        self.num_lookahead = as_int(op, num_lookahead_tokens, "num_lookahead_tokens")
        if self.max_batch < 1 or self.steps < 1 or self.num_lookahead < 0:
            raise InvalidArgumentError(op, "max_batch and steps must be >= 1, num_lookahead_tokens >= 0")
        self.queries = self.num_lookahead + 1
        self.slots: list[int] = []
        self.num_tokens: list[int] = []
        self.live: list[bool] = []
        self.stop_step: list[int] = []
        self.preempt_step: list[int] = []
        self._next = -1  # the next step; -1: no window open

    @property
    def any_preempted(self) -> bool:
        return any(p >= 0 for p in self.preempt_step)

    def begin(self, slots: Sequence[int], num_tokens: Sequence[int], finished: Sequence[int] = ()) -> list:
        """Check the window's inputs, free the ``finished`` requests (one batched free, in order) and
        release the pending copy-on-write copies, which the caller runs on its KV caches (returned,
        ``(src, dst, release)`` triples, before anything is written). ``num_tokens[i]``: lane i's tokens,
        the last one the input of step 0 (``1 .. max_blocks_per_req * block_size - D``)."""
        op = "window_begin"
        rs = as_id_list(op, slots, "slots")
        nts = as_id_list(op, num_tokens, "num_tokens")
        fs = as_id_list(op, finished, "finished")
        if len(rs) != len(nts):
            raise InvalidArgumentError(op, f"{len(rs)} slots but {len(nts)} token counts")
        if max(len(rs), len(fs)) > self.max_batch:
            raise InvalidArgumentError(op, f"at most max_batch = {self.max_batch} requests", max(len(rs), len(fs)))
        m = self.m
        check_slot_list(op, fs + rs, m.max_num_reqs, m.active.__getitem__)
        cap = m.max_blocks_per_req * m.block_size - self.num_lookahead
        for r, t in zip(rs, nts):
            if not 1 <= t <= cap:
                raise InvalidCountError(op, token_count_message(t, 1, cap, r), t)
        if fs:
            m.free(fs)
        copies = m.take_pending_copies()
        m.release_copied(copies)
        self.slots, self.num_tokens = rs, nts
        self.live = [True] * len(rs)
        self.stop_step = [-1] * len(rs)
        self.preempt_step = [-1] * len(rs)
        self._next = 0
        return copies

    def step(self, k: int, stopped=None, num_accepted=None, tokens=None) -> WindowStep:
        """Pool step ``k``. For k >= 1, first what forward pass k - 1 decided (:meth:`_advance`).
        Then vLLM's scheduler over the live lanes (``allocate_running``: blocks for ``num_tokens +
        D``, keys as far as ``num_tokens``, the last lanes preempted when one does not fit). Returns the
        step's :class:`WindowStep`."""
        op = "window_step"
        k = as_int(op, k, "k")
        if k != self._next or not 0 <= k < self.steps:
            raise InvalidArgumentError(op, f"step {k} out of order (next: {self._next} of {self.steps})", k)
        m, D = self.m, self.num_lookahead
        self._check_lanes(op)
        if k > 0:
            self._advance(op, k, stopped, num_accepted, tokens, check_room=True)
        lanes = [i for i, a in enumerate(self.live) if a]
        adm, pre = m.allocate_running([self.slots[i] for i in lanes], [self.num_tokens[i] for i in lanes], D)
        n, Q, bs = len(self.slots), self.queries, m.block_size
        admitted = [False] * n
        for i, a, p in zip(lanes, adm, pre):
            admitted[i] = a
            if p:
                self.live[i] = False
                self.preempt_step[i] = k
        sm = [[-1] * (n * Q) for _ in m.groups]
        for g in range(len(m.groups)):
            rows = m.tables[g]
            for i in lanes:
                if admitted[i]:
                    row = rows[self.slots[i]]
                    for j in range(Q):
                        p = self.num_tokens[i] - 1 + j
                        sm[g][i * Q + j] = row[p // bs] * bs + p % bs
        self._next = k + 1
        return WindowStep(admitted, sm, [self.num_tokens[i] + D if admitted[i] else 0 for i in range(n)])

    def end(self, stopped=None, num_accepted=None, tokens=None) -> None:
        """After the last forward pass: what it decided (:meth:`_advance`); the window is closed."""
        op = "window_end"
        if self._next != self.steps:
            raise InvalidArgumentError(op, f"end() after step {self.steps - 1} (next: {self._next})")
        self._check_lanes(op)
        self._advance(op, self.steps, stopped, num_accepted, tokens, check_room=False)
        self._next = -1

    def _check_lanes(self, op: str) -> None:
        """Every live lane's request is still in use (the host may have freed it between the window's
        calls): InvalidArgumentError naming the first lane's slot that is not, before anything changes."""
        for i, r in enumerate(self.slots):
            if self.live[i] and not self.m.active[r]:
                raise InvalidArgumentError(op, slot_use_message(r), r)

    def _advance(self, op: str, k: int, stopped, num_accepted, tokens, check_room: bool) -> None:
        """What forward pass k - 1 decided, checked first (all or nothing): the lanes that ``stopped``
        (end of sequence, or their budget) are freed in lane order as one batched free; every other
        live lane gained ``num_accepted[i]`` tokens (1 .. Q; ``tokens[i][:num_accepted[i]]``, which a
        request hashing its tokens appends; ``tokens`` None: the tokens are unknown and its hashing
        ends). ``check_room``: a step's allocation follows, so ``num_tokens + D`` must fit the row."""
        n, m = len(self.slots), self.m
        st = [False] * n if stopped is None else as_flag_list(op, stopped)[:n]
        acc = [1] * n if num_accepted is None else as_id_list(op, num_accepted, "num_accepted")[:n]
        toks = None if tokens is None else [as_token_list(op, t) for t in as_host_list(op, tokens, "tokens")[:n]]
        if len(st) < n or len(acc) < n or (toks is not None and len(toks) < n):
            raise InvalidArgumentError(op, f"stopped, num_accepted and tokens need {n} lanes")
        going = [i for i in range(n) if self.live[i] and not st[i]]
        cap = m.max_blocks_per_req * m.block_size - (self.num_lookahead if check_room else 0)
        for i in going:
            r = self.slots[i]
            if not 1 <= acc[i] <= self.queries:
                raise InvalidCountError(op, f"lane {i} (slot {r}) accepted {acc[i]} tokens, not 1..{self.queries}",
                                        acc[i])
            if self.num_tokens[i] + acc[i] > cap:
                t = self.num_tokens[i] + acc[i]
                raise InvalidCountError(op, token_count_message(t, 1, cap, r), t)
            if toks is not None and len(toks[i]) < acc[i]:
                raise InvalidArgumentError(op, f"lane {i} accepted {acc[i]} tokens but {len(toks[i])} are given")
        stops = [i for i in range(n) if self.live[i] and st[i]]
        if stops:
            m.free([self.slots[i] for i in stops])
        for i in stops:
            self.live[i] = False
            self.stop_step[i] = k - 1
        for i in going:
            self.num_tokens[i] += acc[i]
            if toks is None:
                m.forget_tokens(self.slots[i])
            else:
                m._append(self.slots[i], toks[i][:acc[i]])
