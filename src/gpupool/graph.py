"""A decode step of the KV cache manager, or a burst of K of them, as one fixed-shape sequence of
launches, captured once in a CUDA graph and replayed every step with new device inputs: the capture
wrapper of a :class:`gpupool.window.DecodeWindow` whose forward passes are not in the graph
(docs/semantics.md sections 7 and 9).

Per run (or replay), in order: the window's begin (every input checked first, so that a bad one
changes nothing; the finished requests freed; the pending copy-on-write copies of ``kv_caches`` run
and released), then K pool steps. Step 0 allocates each running request's block for its new token
(position ``num_tokens - 1``), keys the blocks that became full and maps the slot; step k >= 1 does the
same with one token more for every lane still live. When a request does not fit, the last live ones
are preempted (freed) as vLLM's scheduler preempts them; ``admitted_steps[k, i]`` says whether lane i
took part in step k. No forward pass runs between the steps, so no lane stops inside the burst and
the tokens are not known to the pool (a request's own hashing ends: ``DecodeWindow(tokens=False)``);
an engine whose model decides stops and advances drives a :class:`~gpupool.window.DecodeWindow`.

Everything reads counts from device tensors and makes no host synchronisation, so the same code runs
eagerly (:meth:`DecodeStep.run`, also on CPU) and as a graph (:meth:`DecodeStep.capture`, CUDA only).
An error sits in the pool's status word; the host raises it at ``manager.pool.check()``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .args import as_int
from .errors import ArgumentTypeError, InvalidArgumentError
from .manager import KVCacheManager
from .window import DecodeWindow


class DecodeStep:
    """Fixed-capacity inputs and outputs of one decode step, or of a burst of ``steps`` steps
    (capacity ``max_batch`` requests; module docstring).

    Inputs (fill in place, or :meth:`set_inputs`, before :meth:`run` / :meth:`replay`): ``slots,
    num_tokens: int32[B]`` (each running request's token count at the burst's first step),
    ``num_reqs: int32[1]``, ``finished: int32[B]``, ``num_finished: int32[1]``. Outputs:
    ``admitted_steps: int32[K, B]`` and ``slot_mapping_steps: int64[K, B]`` (KV slot of each lane's
    newest token in group 0 at step k, -1 where it takes no part: lanes past ``num_reqs`` included);
    ``admitted`` and ``slot_mapping`` are the same tensors, or for ``steps=1`` their row 0; ``window``
    (the underlying :class:`~gpupool.window.DecodeWindow`: every group's slot mapping, views, the
    lanes' preemptions); ``views`` (group 0's attention views, row k built at step k) with ``views=True``.
    ``block_table`` is shared by the steps and holds the last step's rows: a lane preempted at step k
    has no row after the burst, and its blocks may be another lane's (read step k's views between
    steps, as a :class:`~gpupool.window.DecodeWindow`'s forward pass does, or only for lanes admitted at
    the burst's last step).
    InvalidArgumentError: ``max_batch`` or ``steps`` below 1.
    """

    def __init__(self, manager: KVCacheManager, max_batch: int, kv_caches: list[torch.Tensor] | None = None,
                 steps: int = 1, views: bool = False):
        max_batch = as_int("DecodeStep", max_batch, "max_batch")
        if max_batch < 1:
            raise InvalidArgumentError("DecodeStep", f"max_batch must be >= 1, got {max_batch}", max_batch)
        steps = as_int("DecodeStep", steps, "steps")
        if steps < 1:
            raise InvalidArgumentError("DecodeStep", f"steps must be >= 1, got {steps}", steps)
        if not isinstance(views, bool):  # "no" or a tensor would read as True
            raise ArgumentTypeError("DecodeStep", f"views must be a bool, got {type(views).__name__}")
        self.m = manager
        self.steps = steps
        self.max_batch = max_batch
        self.window = w = DecodeWindow(manager, max_batch, steps, 0, kv_caches, views=views, tokens=False)
        self.kv_caches = w.kv_caches
        self.slots, self.num_tokens, self.finished = w.slots, w.num_tokens, w.finished
        self.num_reqs, self.num_finished = w.num_reqs, w.num_finished
        self.admitted_steps = w.admitted
        self.slot_mapping_steps = w.slot_mapping[0]
        self.admitted = self.admitted_steps[0] if steps == 1 else self.admitted_steps
        self.slot_mapping = self.slot_mapping_steps[0] if steps == 1 else self.slot_mapping_steps
        self.views = w.views[0] if views else None
        self.graph = None

    def set_inputs(self, slots: Sequence[int], num_tokens: Sequence[int], finished: Sequence[int] = ()) -> None:
        """Write a step's inputs from host lists in ONE host-to-device copy (no sync): the running
        requests ``slots`` with their token counts ``num_tokens`` (at the burst's first step) and
        the ``finished`` slots to free first (:meth:`DecodeWindow.set_inputs`)."""
        self.window.set_inputs(slots, num_tokens, finished)

    def _body(self) -> None:
        w = self.window
        w.begin()
        for k in range(self.steps):
            w.step(k)

    def run(self) -> None:
        """One step (or burst), eagerly (any device), holding the pool's lock. No host sync."""
        with self.m.lock:
            self._body()

    def capture(self) -> None:
        """Record the step in a CUDA graph (after one eager warm-up run with empty inputs, which
        compiles the kernels). Raises InvalidArgumentError off CUDA."""
        if self.m.device.type != "cuda":
            raise InvalidArgumentError("DecodeStep.capture", "CUDA graphs need a CUDA device")
        w = self.window
        saved = (w._inputs.clone(), self.m.num_copies.clone())
        w._inputs.zero_()
        self.m.num_copies.zero_()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._body()
        torch.cuda.current_stream().wait_stream(s)
        w._inputs.copy_(saved[0])
        self.m.num_copies.copy_(saved[1])
        self.graph = torch.cuda.CUDAGraph()
        w.graph = self.graph
        with torch.cuda.graph(self.graph):
            self._body()

    def replay(self) -> None:
        """One step (or burst) through the captured graph."""
        if self.graph is None:
            raise InvalidArgumentError("DecodeStep.replay", "capture() first")
        with self.m.lock:
            self.graph.replay()
