"""A decode window the model drives: K pool steps interleaved with K forward passes, on the device, with
no host read until the window ends (docs/semantics.md section 9; docs/kv_cache.md section 5).

    win = manager.window(max_batch=B, steps=K, num_lookahead_tokens=D, kv_caches=cache.layers())
    win.set_inputs(slots, num_tokens, finished)      # one host-to-device copy
    win.begin()                                      # checks, frees `finished`, runs the pending copies
    for k in range(K):
        win.step(k)                                  # reads what pass k - 1 wrote; allocates step k
        forward(k)                                   # reads win.slot_mapping[g, k], win.views[g].step(k),
                                                     # win.positions(k); writes win.stopped,
                                                     # win.accepted, win.tokens
    win.end()                                        # what the last pass decided
    out = win.read(my_tokens)                        # the window's one host read

All of it is capturable in one CUDA graph with the model's passes (:meth:`DecodeWindow.capture`).
Lane i is request ``slots[i]`` for the whole window. Step k books blocks for each live lane's
``num_tokens + D`` tokens (D draft positions past the input token; ``Q = D + 1`` queries a lane) and keys
the blocks its ``num_tokens`` tokens fill; a lane that stopped at pass k - 1 is freed at step k (its
cached blocks stay cached) and its blocks are there for the other lanes in the same window; when a lane
does not fit, the last live lanes are preempted as vLLM's scheduler preempts them. A request added with
``tail_tokens`` has the hash blocks its accepted tokens fill hashed on the device (vLLM's sha256), so
blocks it generates are keyed as vLLM keys them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from . import _backend
from .args import as_id_list, as_int
from .errors import ArgumentTypeError, InvalidArgumentError
from .kv_args import MAX_INT32
from .memory import check_fits

_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels.requests import views as k_views  # noqa: E402
from .kernels.requests import window as k_window  # noqa: E402
from .kv_cache import AttentionViews  # noqa: E402
from .tensors import HeldMemory, check_int32  # noqa: E402


class WindowResult(NamedTuple):
    """:meth:`DecodeWindow.read`, host lists over the window's ``n`` lanes: ``num_tokens[i]`` (lane i's
    tokens at the end), ``stop_step[i]`` (the pass at which it stopped and was freed, else -1),
    ``preempt_step[i]`` (the pool step that preempted it, else -1), ``admitted[k][i]`` (it took part in
    step k), ``any_preempted`` (vLLM: admit nobody after a step that preempted), ``extra`` (the
    caller's tensors, each as ``tolist()`` gives it)."""

    num_tokens: list[int]
    stop_step: list[int]
    preempt_step: list[int]
    admitted: list[list[int]]
    any_preempted: bool
    extra: list


class DecodeWindow:
    """Fixed-capacity buffers of a decode window over ``manager`` (a ``KVCacheManager``): ``max_batch``
    lanes, ``steps`` pool steps (K), ``num_lookahead_tokens`` draft positions (D) a lane books per step
    (module docstring; docs/semantics.md section 9).

    Inputs (:meth:`set_inputs`): ``slots, num_tokens, finished: int32[B]``, ``num_reqs, num_finished:
    int32[1]``. What each forward pass writes (in place: rebinding one of the window's tensors raises
    InvalidArgumentError) before the next step reads it: ``stopped: int32[B]``
    (nonzero: the lane stopped), ``accepted: int32[B]`` (tokens it gained, 1 .. Q; starts at 1),
    ``tokens: int64[B, Q]`` (those tokens, left-aligned). Outputs, rewritten whole at every step:
    ``admitted: int32[K, B]``, ``seq: int32[K, B]`` (each lane's attention length ``num_tokens + D``,
    0 where it takes no part), ``slot_mapping: int64[G, K, B * Q]`` (the KV slot of lane i's query j at
    ``i * Q + j``, -1 where not admitted), ``views[g]`` (an ``AttentionViews`` of K steps per group g,
    row k built at step k). ``kv_caches``: the layers the pending copy-on-write copies run on at
    :meth:`begin`. ``tokens=False``: the model's tokens are not given (a ``DecodeStep`` burst): every
    lane gains one token per step and its request stops hashing its tokens.

    The calls go in order, checked on the host as ``ReferenceDecodeWindow`` checks them: :meth:`set_inputs`,
    :meth:`begin`, :meth:`step` 0 .. K - 1, :meth:`end`; ``set_inputs`` closes an open window (the lanes
    are set up by ``begin``).

    Raises InvalidArgumentError (``max_batch``, ``steps`` below 1, ``num_lookahead_tokens`` below 0 or
    leaving no room in a row, buffers past int32 entries or the free memory of the manager's device),
    ArgumentTypeError (a non-int size or flag).
    """

    #: Tensors the kernels (and a captured graph) hold: written in place, never rebound.
    _BUFFERS = frozenset(("slots", "num_tokens", "finished", "num_reqs", "num_finished", "stopped", "accepted",
                          "tokens", "lane_tokens", "live", "stop_step", "preempt_step", "flags", "admitted", "seq",
                          "slot_mapping", "views"))

    def __setattr__(self, name, value):
        if name in self._BUFFERS and name in self.__dict__:
            raise InvalidArgumentError(f"DecodeWindow.{name}", f"the window's kernels read this tensor: write into "
                                       f"it in place (win.{name}.copy_(x), win.{name}[:] = x), do not rebind it")
        super().__setattr__(name, value)

    def __init__(self, manager, max_batch: int, steps: int = 1, num_lookahead_tokens: int = 0,
                 kv_caches: list[torch.Tensor] | None = None, views: bool = True, tokens: bool = True):
        op = "DecodeWindow"
        B = as_int(op, max_batch, "max_batch")
        K = as_int(op, steps, "steps")
        D = as_int(op, num_lookahead_tokens, "num_lookahead_tokens")
        if B < 1 or K < 1:
            raise InvalidArgumentError(op, f"max_batch and steps must be >= 1, got {B} and {K}")
        if not 0 <= D < manager.max_blocks_per_req * manager.block_size:
            raise InvalidArgumentError(op, f"num_lookahead_tokens must be in 0..{manager.shape.max_tokens - 1}, "
                                           f"got {D}", D)
        for flag, name in ((views, "views"), (tokens, "tokens")):
            if not isinstance(flag, bool):
                raise ArgumentTypeError(op, f"{name} must be a bool, got {type(flag).__name__}")
        kv_caches = [] if kv_caches is None else kv_caches
        manager.check_kv_caches(op, kv_caches)
        _check_sizes(op, manager, B, K, D + 1, views)
        self.m, self.max_batch, self.steps, self.num_lookahead = manager, B, K, D
        self.queries = Q = D + 1
        self.kv_caches = list(kv_caches)
        self.has_tokens = tokens
        dev, i32 = manager.device, torch.int32
        G = len(manager.groups)
        # the inputs are views of one buffer: set_inputs writes them in one copy
        self._inputs = torch.zeros(3 * B + 2, dtype=i32, device=dev)
        self.slots, self.num_tokens, self.finished = (self._inputs[j * B:(j + 1) * B] for j in range(3))
        self.num_reqs, self.num_finished = self._inputs[3 * B:3 * B + 1], self._inputs[3 * B + 1:]
        self.stopped = torch.zeros(B, dtype=i32, device=dev)
        self.accepted = torch.ones(B, dtype=i32, device=dev)
        self.tokens = torch.zeros((B, Q), dtype=torch.int64, device=dev)
        # lane state and outputs, one buffer: read() reads them in one copy with the caller's tensors
        self._state = torch.zeros(4 * B + 2 + 2 * K * B, dtype=i32, device=dev)
        self.lane_tokens, self.live, self.stop_step, self.preempt_step = (self._state[j * B:(j + 1) * B]
                                                                          for j in range(4))
        self.flags = self._state[4 * B:4 * B + 2]
        o = 4 * B + 2
        self.admitted = self._state[o:o + K * B].view(K, B)
        self.seq = self._state[o + K * B:].view(K, B)
        self.slot_mapping = torch.full((G, K, B * Q), -1, dtype=torch.int64, device=dev)
        self._scratch = torch.zeros(3 * B, dtype=i32, device=dev)
        self._work = manager.batch(torch.zeros(B, dtype=i32, device=dev), torch.zeros(B, dtype=i32, device=dev),
                                   torch.zeros(B, dtype=i32, device=dev), num_reqs=torch.zeros(1, dtype=i32, device=dev))
        self._wb = k_window.WindowBuffers(
            self.slots, self.num_tokens, self.num_reqs, self.finished, self.num_finished, self.stopped, self.accepted,
            self.tokens, self.lane_tokens, self.live, self.stop_step, self.preempt_step, self.flags, self.seq,
            self.admitted, self.slot_mapping, self._scratch[:B], self._scratch[B:2 * B], self._scratch[2 * B:])
        self.views = [AttentionViews.empty(B, manager.max_blocks_per_req, K, device=dev) for _ in range(G)] \
            if views else None
        # the window's own state: no op may take it as an output buffer (tensors.check_disjoint)
        self._held = HeldMemory([(t, f"the window's {n}") for n, t in (
            ("inputs", self._inputs), ("stopped", self.stopped), ("accepted", self.accepted), ("tokens", self.tokens),
            ("lane state", self._state), ("slot_mapping", self.slot_mapping), ("scratch", self._scratch))]
            + [(t, f"the window's work {n}") for n, t in self._work._asdict().items() if isinstance(t, torch.Tensor)],
            owner="a decode window")
        self._next = -1  # the next pool step (steps: end() is next); -1: no window open (begin() opens one)
        self.graph = None
        self.host_inputs: tuple[list[int], list[int], list[int]] | None = None  # set_inputs' lists, as given

    # ---- inputs -----------------------------------------------------------------------------------
    def set_inputs(self, slots: Sequence[int], num_tokens: Sequence[int], finished: Sequence[int] = ()) -> None:
        """Write the window's inputs from host lists in ONE host-to-device copy (no sync): the running
        requests ``slots`` (the lanes, in the scheduler's order) with their token counts
        ``num_tokens`` (each request's tokens; the last is step 0's input) and the ``finished`` slots to
        free at :meth:`begin`; keeps the lists as ``host_inputs`` (what a host-side planner such as
        :class:`gpupool.flashinfer.WindowDecodePlan` reads). Resets ``stopped`` to 0 and ``accepted`` to 1. Raises ArgumentTypeError
        (a value that is not an int), InvalidArgumentError (lists longer than ``max_batch`` or of
        different lengths, a value outside int32); the values themselves are checked on the device."""
        op = "DecodeWindow.set_inputs"
        s, n = as_id_list(op, slots, "slots"), as_id_list(op, num_tokens, "num_tokens")
        f = as_id_list(op, finished, "finished")
        B = self.max_batch
        if len(s) != len(n):
            raise InvalidArgumentError(op, f"{len(s)} slots but {len(n)} token counts")
        if len(s) > B or len(f) > B:
            raise InvalidArgumentError(op, f"at most max_batch = {B} requests a window", max(len(s), len(f)))
        for vals, what in ((s, "slots"), (n, "num_tokens"), (f, "finished")):
            check_int32(op, vals, what)
        pad = [0] * B
        host = torch.tensor((s + pad)[:B] + (n + pad)[:B] + (f + pad)[:B] + [len(s), len(f)], dtype=torch.int32,
                            pin_memory=self._inputs.is_cuda)
        self._inputs.copy_(host, non_blocking=True)
        self._next = -1  # the lanes are begin()'s: steps on new inputs would give them to other requests
        self.host_inputs = (s, n, f)
        self.stopped.zero_()
        self.accepted.fill_(1)

    # ---- the pool's side of the window (no host sync) ---------------------------------------------
    def _launch(self, k: int, advance: bool, allocate: bool) -> None:
        m = self.m
        k_window.launch_window_step(m._pool.state, m._pool.config, m.state, m.config, self._wb, self._work, k,
                                    steps=self.steps, lookahead=self.num_lookahead, advance=advance,
                                    allocate=allocate, tokens=self.has_tokens, force_exact=not m.parallel)

    def begin(self) -> None:
        """Check the inputs (every slot in range, in use and listed once across both lists, counts within
        their arrays, token counts ``1 .. max_blocks_per_req * block_size - D``, room for the events),
        free the finished requests, set up the lanes; then the pending copy-on-write copies of
        ``kv_caches`` and their release. A bad input records InvalidArgumentError / InvalidCountError
        (op ``window_begin``) and the window does nothing. No host sync."""
        m = self.m
        with m.lock:
            k_window.launch_window_begin(m._pool.state, m._pool.config, m.state, m.config, self._wb, self._work,
                                         lookahead=self.num_lookahead)
            m._copy_and_release(self.kv_caches)
        self._next = 0

    def step(self, k: int) -> None:
        """Pool step ``k`` (``0 .. steps - 1``, in order): for k >= 1 first what forward pass k - 1
        wrote (``stopped``, ``accepted``, ``tokens``; checked, then the stopped lanes freed and the others'
        tokens appended), then the live lanes' blocks with vLLM's preemption, their slot mappings in
        every group, and step k's attention views. A bad value records an error (op ``window_step``)
        and this and every later op does nothing. No host sync."""
        k = as_int("DecodeWindow.step", k, "k")
        if not 0 <= k < self.steps or k != self._next:
            self._out_of_order("DecodeWindow.step", f"step {k}", k)
        m = self.m
        with m.lock:
            self._launch(k, advance=k > 0, allocate=True)
            if self.views is not None:
                for g, v in enumerate(self.views):
                    row = AttentionViews(v.block_table, v.seqused_k[k:k + 1], v.kv_indptr[k:k + 1],
                                         v.kv_indices[k:k + 1], v.kv_last_page_len[k:k + 1])
                    k_views.launch_attention_views(m._pool.state, m.state, m.config, self.slots, self.seq[k],
                                                   self.admitted[k:k + 1], self.num_reqs, g, 1, row)
        self._next = k + 1

    def end(self) -> None:
        """After the last forward pass: what it wrote (the stopped lanes freed, the others' tokens
        appended and hashed), no allocation (op ``window_end``). No host sync. Raises
        InvalidArgumentError before step K - 1 has run, and a second time."""
        if self._next != self.steps:
            self._out_of_order("DecodeWindow.end", "end()", self.steps)
        with self.m.lock:
            self._launch(self.steps, advance=True, allocate=False)
        self._next = -1

    def _out_of_order(self, op: str, what: str, value: int):
        where = "no window is open: set_inputs() then begin() first" if self._next < 0 else \
            f"next: {'end()' if self._next == self.steps else f'step {self._next}'} of {self.steps}"
        raise InvalidArgumentError(op, f"{what} out of order ({where})", value)

    # ---- what a forward pass reads ------------------------------------------------------------------
    def positions(self, k: int) -> torch.Tensor:
        """``int64[B, Q]``: the position of lane i's query j at step k, ``seq[k, i] - Q + j`` (its input
        token at ``num_tokens - 1``, then the draft positions); negative for a lane that takes no
        part (its slots are -1, so it writes nothing). A torch op on the device, no sync. Raises
        ArgumentTypeError (a non-int ``k``), InvalidArgumentError (``k`` outside ``0 .. steps - 1``)."""
        k = as_int("DecodeWindow.positions", k, "k")
        if not 0 <= k < self.steps:
            raise InvalidArgumentError("DecodeWindow.positions", f"step {k} outside 0..{self.steps - 1}", k)
        Q = self.queries
        return self.seq[k].to(torch.int64)[:, None] - Q + torch.arange(Q, device=self.m.device)[None, :]

    # ---- eager run, capture, replay --------------------------------------------------------------
    def run(self, forward: Callable[["DecodeWindow", int], None] | None = None) -> None:
        """The whole window eagerly: :meth:`begin`, then per step :meth:`step` and ``forward(self, k)``
        (the model's pass k, which writes ``stopped``, ``accepted`` and ``tokens``), then :meth:`end`."""
        self.begin()
        for k in range(self.steps):
            self.step(k)
            if forward is not None:
                forward(self, k)
        self.end()

    def capture(self, forward: Callable[["DecodeWindow", int], None] | None = None) -> None:
        """Record :meth:`run` (the pool's steps and ``forward``'s passes) in one CUDA graph, after an
        eager warm-up with no lanes (which compiles the kernels). Raises InvalidArgumentError off CUDA."""
        m = self.m
        if m.device.type != "cuda":
            raise InvalidArgumentError("DecodeWindow.capture", "CUDA graphs need a CUDA device")
        saved = (self._inputs.clone(), m.num_copies.clone())
        self._inputs.zero_()
        m.num_copies.zero_()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.run(forward)
        torch.cuda.current_stream().wait_stream(s)
        self._inputs.copy_(saved[0])
        m.num_copies.copy_(saved[1])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run(forward)

    def replay(self) -> None:
        """The captured window (inputs set by :meth:`set_inputs` first)."""
        if self.graph is None:
            raise InvalidArgumentError("DecodeWindow.replay", "capture() first")
        with self.m.lock:
            self.graph.replay()

    # ---- the window's one read --------------------------------------------------------------------
    def read(self, *extra: torch.Tensor) -> WindowResult:
        """The window's outcome and the caller's ``extra`` tensors (its sampled tokens, say) in ONE
        device-to-host read, plus the names of the hashes the device made (registered so that KV
        events and ``block_keys`` name them). Lanes past the window's ``num_reqs`` are left out.
        ``extra``: integer or bool tensors on the manager's device, each returned as ``tolist()`` gives
        it (ArgumentTypeError for a non-tensor, InvalidArgumentError for another dtype or device)."""
        m = self.m
        for t in extra:
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError("DecodeWindow.read", f"extra must be tensors, got {type(t).__name__}")
            if t.is_floating_point() or t.is_complex() or t.device != m.device:
                raise InvalidArgumentError("DecodeWindow.read", f"extra must be integer or bool tensors on {m.device} "
                                                                f"(read in one int64 copy), got {t.dtype} on {t.device}")
        names = m._name_rows(self.max_batch * self._fills_per_lane())
        parts = [self._inputs[3 * self.max_batch:3 * self.max_batch + 1].long(), self._state.long(), names[0].long(),
                 names[1].long().reshape(-1)] + [t.reshape(-1).long() for t in extra]
        flat = torch.cat(parts).tolist()
        n = flat[0]
        B, K = self.max_batch, self.steps
        st = flat[1:1 + self._state.numel()]
        o = 1 + self._state.numel()
        m._register_names(flat[o], flat[o + 1:o + 1 + names[1].numel()])
        o += 1 + names[1].numel()
        out = []
        for t in extra:
            vals = flat[o:o + t.numel()]
            out.append(_nest([bool(v) for v in vals] if t.dtype == torch.bool else vals, tuple(t.shape)))
            o += t.numel()
        adm = [st[4 * B + 2 + k * B:4 * B + 2 + k * B + n] for k in range(K)]
        return WindowResult(st[:n], st[2 * B:2 * B + n], st[3 * B:3 * B + n], adm, bool(st[4 * B]), out)

    def _fills_per_lane(self) -> int:
        """Hash blocks one lane can fill in a window (its accepted tokens over K steps, and its end)."""
        hbs = self.m.hash_block_size
        return (self.queries * (self.steps + 1) + hbs - 1) // hbs


def _check_sizes(op: str, manager, B: int, K: int, Q: int, views: bool) -> None:
    """The window's buffers fit int32 offsets and the free memory of the manager's device (refused
    before anything is allocated: InvalidArgumentError naming the largest)."""
    G, M = len(manager.groups), manager.max_blocks_per_req
    if views:
        AttentionViews.shapes(B, M, K, op=op)  # refuses views past int32 entries
    entries = G * K * B * Q  # slot_mapping, the largest of the window's own buffers
    if entries > MAX_INT32:
        raise InvalidArgumentError(op, f"a window of {B} lanes, {K} steps and {Q} queries a lane needs {entries:,} "
                                       f"slot-mapping entries, more than {MAX_INT32:,}", entries)
    int32s = 18 * B + 4 + 2 * K * B + (G * (B * M + K * (3 * B + 1) + K * B * M) if views else 0)
    check_fits(op, "max_batch * steps", B * K, 4 * int32s + 8 * (B * Q + entries), manager.device)


def _nest(flat: list, shape: tuple) -> list:
    """``flat`` as the nested lists of ``shape`` (``Tensor.tolist``'s form, built on the host: a number
    for a 0-d tensor)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


__all__ = ["DecodeWindow", "WindowResult"]
