"""A decode step of the KV cache manager as one fixed-shape sequence of launches, captured once in a
CUDA graph and replayed every step with new device inputs.

Per step, in order (vLLM's scheduler order: finished requests leave before the next allocation):

0. check every input first (``kernels/requests/checks.py`` check_step: both counts, every slot of both
   lists in range, in use and listed once, token counts in ``1 .. max_blocks_per_req * block_size``,
   room for the events), so that a bad input changes nothing: no op below runs on a failed check,
   and none of them can fail after an earlier one committed;
1. ``free`` the finished requests (``finished[:num_finished]``);
2. ``allocate_slots`` for the running requests (``slots[:num_reqs]``, ``target = num_tokens``, no
   lookup, ``stop_on_failure=False``): a request crossing a block boundary gets a block per group,
   blocks that became full are cached; ``admitted`` says which fitted (the others are the
   scheduler's to preempt);
3. ``slot_mapping`` of each request's new token (position ``num_tokens - 1``) into ``slot_mapping``
   (steps 0 to 3 are one launch, ``kernels/requests/decode.py``);
4. the pending copy-on-write copies of all layers (``kv_caches``), then the release of the
   references they held.

Everything reads counts from device tensors and makes no host synchronisation, so the same code
runs eagerly (:meth:`DecodeStep.run`, also on CPU) and as a graph (:meth:`capture`, CUDA only). An
error (a bad slot, say) makes the step's ops do nothing and sits in the pool's status word; the host
raises it at ``manager.pool.check()``; the graph keeps working once the inputs are fixed.

A burst (``steps=K``, docs/semantics.md section 7 "Multi-step decode"): K steps in one run or one
replay, with no host work between them. Step 0 is the step above. Step k >= 1 takes the requests
step k - 1 admitted, in order, each with one token more (``num_tokens + k``), and only allocates
and maps (no free, no slot check: the slots are step 0's, checked there; token counts and event
rows are checked as a step checks them). A request that step k could not admit takes no part in the
later steps (``admitted[k', i] = 0``, ``slot_mapping[k', i] = -1`` for ``k' >= k``) and keeps its
blocks: the host preempts it after the burst. The burst equals K single steps where the host, in
between, adds 1 to each admitted request's count and drops the others (keeping the order), with no
finished requests after step 0 and no event drain in between. A request whose reservation
(``manager.reserve(slots, [K, ...])`` before the burst, docs/semantics.md section 8) covers the
burst is admitted at every step: its blocks are drawn from it and no other request can take them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .args import as_id_list, as_int
from .errors import ArgumentTypeError, InvalidArgumentError
from .kv_cache import AttentionViews
from .manager import KVCacheManager
from .tensors import check_int32


class DecodeStep:
    """Fixed-capacity inputs and outputs of one decode step, or of a burst of ``steps`` steps
    (capacity ``max_batch`` requests; module docstring).

    Inputs (fill in place before :meth:`run` / :meth:`replay`): ``slots, num_tokens: int32[B]``
    (``num_tokens``: each running request's token count at the burst's first step),
    ``num_reqs: int32[1]``, ``finished: int32[B]``, ``num_finished: int32[1]``.
    Outputs: ``admitted_steps: int32[K, B]`` and ``slot_mapping_steps: int64[K, B]`` (KV slot of each
    request's newest token in group 0 at step k, -1 where not admitted and on every lane past
    ``num_reqs``, so a row can be stored over its whole width), by the request's lane in ``slots``; ``admitted`` and ``slot_mapping`` are the same tensors, or for ``steps=1`` their row 0
    (``int32[B]`` / ``int64[B]``, the single step's API); and the manager's ``block_table``.
    ``InvalidArgumentError``: ``max_batch`` or ``steps`` below 1.
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
        kv_caches = [] if kv_caches is None else kv_caches
        manager.check_kv_caches("DecodeStep", kv_caches)
        self.kv_caches = list(kv_caches)
        dev = manager.device
        i32 = torch.int32
        B = max_batch
        # the inputs are views of one buffer, so :meth:`set_inputs` writes them with one copy
        self._inputs = torch.zeros(3 * B + 2, dtype=i32, device=dev)
        self.slots, self.num_tokens, self.finished = self._inputs[:B], self._inputs[B:2 * B], self._inputs[2 * B:3 * B]
        self.num_reqs, self.num_finished = self._inputs[3 * B:3 * B + 1], self._inputs[3 * B + 1:]
        self.max_batch = B
        self.admitted_steps = torch.zeros((steps, max_batch), dtype=i32, device=dev)
        self.slot_mapping_steps = torch.zeros((steps, max_batch), dtype=torch.int64, device=dev)
        self.admitted = self.admitted_steps[0] if steps == 1 else self.admitted_steps
        self.slot_mapping = self.slot_mapping_steps[0] if steps == 1 else self.slot_mapping_steps
        no_lookup = torch.zeros(max_batch, dtype=torch.int8, device=dev)
        # views of the buffers above, built once: every step reads them in place
        self._batch = manager.batch(self.slots, self.num_tokens, self.num_tokens, no_lookup, self.num_reqs,
                                    self.admitted_steps[0])
        self._work = []
        if steps > 1:  # steps k >= 1 alternate between two work batches (the previous one is read)
            w_slots = torch.zeros((2, max_batch), dtype=i32, device=dev)
            w_tokens = torch.zeros((2, max_batch), dtype=i32, device=dev)
            w_num = torch.zeros(2, dtype=i32, device=dev)
            w_adm = torch.zeros((2, max_batch), dtype=i32, device=dev)
            self._w_orig = torch.zeros((2, max_batch), dtype=i32, device=dev)
            self._w_map = torch.zeros((2, max_batch), dtype=torch.int64, device=dev)
            self._work = [manager.batch(w_slots[p], w_tokens[p], w_tokens[p], no_lookup, w_num[p:p + 1], w_adm[p])
                          for p in range(2)]
        self.views = AttentionViews.empty(max_batch, manager.max_blocks_per_req, steps, device=dev) if views else None
        self.graph = None

    def set_inputs(self, slots: Sequence[int], num_tokens: Sequence[int], finished: Sequence[int] = ()) -> None:
        """Write a step's inputs from host lists in ONE host-to-device copy (no sync): the running
        requests ``slots`` with their token counts ``num_tokens`` (at the burst's first step) and
        the ``finished`` slots to free first. Raises ArgumentTypeError for a value that is not an
        int, InvalidArgumentError for lists longer than ``max_batch`` or of different lengths
        (values themselves are checked on the device, as the step checks them)."""
        op = "DecodeStep.set_inputs"
        s, n = as_id_list(op, slots, "slots"), as_id_list(op, num_tokens, "num_tokens")
        f = as_id_list(op, finished, "finished")
        B = self.max_batch
        if len(s) != len(n):
            raise InvalidArgumentError(op, f"{len(s)} slots but {len(n)} token counts")
        if len(s) > B or len(f) > B:
            raise InvalidArgumentError(op, f"at most max_batch = {B} requests a step", max(len(s), len(f)))
        for vals, what in ((s, "slots"), (n, "num_tokens"), (f, "finished")):
            check_int32(op, vals, what)
        pad = [0] * B
        host = torch.tensor((s + pad)[:B] + (n + pad)[:B] + (f + pad)[:B] + [len(s), len(f)], dtype=torch.int32,
                            pin_memory=self._inputs.is_cuda)
        self._inputs.copy_(host, non_blocking=True)

    def _body(self) -> None:
        self.m.decode_step(self._batch, self.finished, self.num_finished, self.slot_mapping_steps[0], self.kv_caches)
        for k in range(1, self.steps):
            src = self._batch if k == 1 else self._work[(k - 1) % 2]
            p = k % 2
            self.m.decode_burst_step(src, self._w_orig[(k - 1) % 2], self._work[p], self._w_orig[p], self._w_map[p],
                                     self.admitted_steps[k], self.slot_mapping_steps[k], src_is_step0=k == 1)
        if self.views is not None:
            self.m.attention_views(self.slots, self.num_tokens, self.num_reqs, admitted=self.admitted_steps,
                                   out=self.views)

    def run(self) -> None:
        """One step (or burst), eagerly (any device), holding the pool's lock. No host sync."""
        with self.m.lock:
            self._body()

    def capture(self) -> None:
        """Record the step in a CUDA graph (after one eager warm-up run with empty inputs, which
        compiles the kernels). Raises InvalidArgumentError off CUDA."""
        if self.m.device.type != "cuda":
            raise InvalidArgumentError("DecodeStep.capture", "CUDA graphs need a CUDA device")
        saved = (self.num_reqs.clone(), self.num_finished.clone(), self.m.num_copies.clone())
        self.num_reqs.zero_()
        self.num_finished.zero_()
        self.m.num_copies.zero_()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._body()
        torch.cuda.current_stream().wait_stream(s)
        self.num_reqs.copy_(saved[0])
        self.num_finished.copy_(saved[1])
        self.m.num_copies.copy_(saved[2])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    def replay(self) -> None:
        """One step (or burst) through the captured graph."""
        if self.graph is None:
            raise InvalidArgumentError("DecodeStep.replay", "capture() first")
        with self.m.lock:
            self.graph.replay()
