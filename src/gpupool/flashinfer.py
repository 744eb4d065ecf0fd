"""FlashInfer's paged decode planned from a decode window's views (docs/kv_cache.md section 5).

``BatchDecodeWithPagedKVCacheWrapper.plan()`` reads ``kv_indptr`` and ``kv_last_page_len`` on the
host to schedule its kernel, and in CUDA-graph mode its kernel then reads them from fixed device
buffers. A :class:`~gpupool.window.DecodeWindow` builds step k's views on the device, at step k,
from what the passes before it decided (stops, accepted drafts), so their values exist on the host
only after the window. :class:`WindowDecodePlan` therefore makes one wrapper per step whose fixed
buffers ARE the window's rows of step k, and plans it from host bounds on those rows: lane i's
length at step k is at most ``num_tokens[i] + k * Q + D`` (every earlier pass accepting all ``Q = D +
1`` tokens), and 0 where it stopped or was preempted. No device value is read: the plan costs the
window nothing, and the kernel reads the true rows the window wrote before the pass.

Split-KV is off (``disable_split_kv=True``): FlashInfer splits a lane's KV into chunks from the
planned length, and a chunk past a shorter true length would compute an unsigned negative size. Each
lane is then one pass over its whole length, as FlashInfer does without split-KV.
"""
from __future__ import annotations

import importlib

import torch

from .args import as_id_list, as_int
from .errors import ArgumentTypeError, InvalidArgumentError, InvalidCountError, token_count_message
from .kv_args import MAX_INT32

OP = "WindowDecodePlan"


def _decode_wrapper_class():
    try:
        return importlib.import_module("flashinfer").BatchDecodeWithPagedKVCacheWrapper
    except ImportError as e:
        raise InvalidArgumentError(OP, f"flashinfer is not installed ({e}); pip install flashinfer-python") from None


def length_bounds(num_tokens: list[int], k: int, queries: int, max_len: int) -> list[int]:
    """Host bounds on each lane's attention length at step ``k`` of a window: ``num_tokens[i] + k *
    queries + queries - 1`` (every earlier pass accepting all ``queries`` tokens; the last
    ``queries - 1`` are the step's draft slots), at most ``max_len`` (a row's tokens). Raises
    ArgumentTypeError (a non-int), InvalidArgumentError (a negative count, ``k`` or ``max_len``, or
    ``queries`` below 1)."""
    op = "length_bounds"
    num_tokens = as_id_list(op, num_tokens, "num_tokens")
    k, queries, max_len = (as_int(op, x, name) for x, name in ((k, "k"), (queries, "queries"), (max_len, "max_len")))
    if min(num_tokens + [k, queries - 1, max_len]) < 0:
        raise InvalidArgumentError(op, f"num_tokens, k and max_len must be >= 0 and queries >= 1, got {num_tokens}, "
                                       f"{k}, {max_len} and {queries}")
    return [min(n + k * queries + queries - 1, max_len) for n in num_tokens]


def paged_layout(lengths: list[int], batch: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``(kv_indptr: int32[batch + 1], kv_last_page_len: int32[batch])`` on the host for
    lanes of ``lengths`` tokens (lanes past them empty). An empty lane has ``kv_last_page_len`` 1,
    inside FlashInfer's documented ``1 <= kv_last_page_len <= page_size`` (its kernel gives a lane
    without pages length 0 whatever the value). Raises ArgumentTypeError (a non-int),
    InvalidArgumentError (a negative length, more lengths than ``batch``, ``page_size`` below 1, pages
    past int32)."""
    op = "paged_layout"
    lengths = as_id_list(op, lengths, "lengths")
    batch, page_size = as_int(op, batch, "batch"), as_int(op, page_size, "page_size")
    if page_size < 1 or not len(lengths) <= batch or min(lengths, default=0) < 0:
        raise InvalidArgumentError(op, f"lengths must be >= 0 and at most batch = {batch}, page_size >= 1; got "
                                       f"{len(lengths)} lengths (least {min(lengths, default=0)}), page_size {page_size}")
    indptr, last = _layout_lists(lengths, batch, page_size)
    if indptr[-1] > MAX_INT32:
        raise InvalidArgumentError(op, f"{indptr[-1]:,} pages in all, past int32 (FlashInfer's kv_indptr)", indptr[-1])
    return torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32)


def _layout_lists(lengths: list[int], batch: int, page_size: int) -> tuple[list[int], list[int]]:
    lens = (list(lengths) + [0] * batch)[:batch]
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + (n + page_size - 1) // page_size)
    return indptr, [(n - 1) % page_size + 1 if n > 0 else 1 for n in lens]


class WindowDecodePlan:
    """One FlashInfer decode wrapper per step of ``window`` (a ``DecodeWindow`` with views), in CUDA-graph
    mode over the window's own view rows of KV-cache group ``group``: ``wrappers[k]``'s
    ``paged_kv_indptr_buffer`` is ``window.views[group].kv_indptr[k]`` (``int32[B + 1]``), its indices
    ``kv_indices[k]`` (``int32[B * M]``) and its last-page lengths ``kv_last_page_len[k]`` (``int32[B]``),
    so forward pass k calls ``plan.wrappers[k].run(q, kv_cache)`` on what pool step k wrote.

    ``workspace``: FlashInfer's float workspace (``uint8``, on the window's device), shared by the K
    wrappers (they run one after another). ``wrapper_class``: FlashInfer's
    ``BatchDecodeWithPagedKVCacheWrapper`` unless given (a test's stand-in); extra keyword arguments go
    to its constructor (``use_tensor_cores``, ``backend``).

    Raises ArgumentTypeError: ``window`` not a ``DecodeWindow``, a non-int ``group``; InvalidArgumentError: a window without views or with draft positions (the decode wrapper
    takes one query a lane; a window with ``num_lookahead_tokens`` needs FlashInfer's prefill wrapper),
    ``group`` outside the window's groups, a workspace that is not a uint8 tensor on its device,
    flashinfer not installed.
    """

    def __init__(self, window, workspace: torch.Tensor, group: int = 0, *, wrapper_class=None, **wrapper_kwargs):
        if not all(hasattr(window, a) for a in ("views", "queries", "steps", "host_inputs", "m")):  # a DecodeWindow
            raise ArgumentTypeError(OP, f"window must be a DecodeWindow (manager.window(...)), got {type(window).__name__}")
        group = as_int(OP, group, "group")
        if window.views is None:
            raise InvalidArgumentError(OP, "the window has no views (DecodeWindow(views=False))")
        if window.queries != 1:
            raise InvalidArgumentError(OP, f"the decode wrapper takes one query a lane; this window books "
                                           f"{window.num_lookahead} draft positions (plan FlashInfer's prefill "
                                           "wrapper with qo_indptr for speculative decoding)", window.num_lookahead)
        if not 0 <= group < len(window.views):
            raise InvalidArgumentError(OP, f"group {group} outside 0..{len(window.views) - 1}", group)
        if not isinstance(workspace, torch.Tensor):
            raise ArgumentTypeError(OP, f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
        if workspace.dtype != torch.uint8 or workspace.device != window.m.device:
            raise InvalidArgumentError(OP, f"workspace must be uint8 on {window.m.device}, got {workspace.dtype} "
                                           f"on {workspace.device}")
        cls = _decode_wrapper_class() if wrapper_class is None else wrapper_class
        self.window, self.group = window, group
        v = window.views[group]
        self.wrappers = [cls(workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=v.kv_indptr[k],
                             paged_kv_indices_buffer=v.kv_indices[k], paged_kv_last_page_len_buffer=v.kv_last_page_len[k],
                             **wrapper_kwargs)
                         for k in range(window.steps)]

    def plan(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, **plan_kwargs) -> None:
        """Plan every step's wrapper for the window's inputs (after ``window.set_inputs``, before the
        window runs or replays), from the host bounds (module docstring); no device read. Keyword
        arguments go to FlashInfer's ``plan`` (``q_data_type``, ``window_left`` for a sliding-window
        group, ``sm_scale``, ...). Raises ArgumentTypeError (a non-int head count),
        InvalidArgumentError before ``set_inputs``, for a head count below 1, a ``page_size`` (the
        manager's ``block_size``) or ``disable_split_kv=False``; InvalidCountError (op ``window_begin``,
        as the window's ``begin`` words it) for a token count outside ``1 .. max_blocks_per_req *
        block_size - D``: a plan of inputs the window refuses would stay in the buffers the kernel
        reads. Nothing is planned when it raises."""
        w = self.window
        heads = [as_int(OP, x, name) for x, name in ((num_qo_heads, "num_qo_heads"), (num_kv_heads, "num_kv_heads"),
                                                     (head_dim, "head_dim"))]
        if min(heads) < 1:
            raise InvalidArgumentError(OP, f"num_qo_heads, num_kv_heads and head_dim must be >= 1, got {heads}")
        if w.host_inputs is None:
            raise InvalidArgumentError(OP, "set_inputs() first: the plan is made from the window's inputs")
        if "page_size" in plan_kwargs:
            raise InvalidArgumentError(OP, f"page_size is the manager's block_size ({w.m.block_size}); do not pass it")
        if plan_kwargs.get("disable_split_kv", True) is not True:
            raise InvalidArgumentError(OP, "split-KV needs the true lengths on the host; the window plans from "
                                           "bounds (module docstring)")
        plan_kwargs["disable_split_kv"] = True
        m, v = w.m, w.views[self.group]
        slots, num_tokens, _ = w.host_inputs
        cap = m.max_blocks_per_req * m.block_size - w.num_lookahead
        for r, n in zip(slots, num_tokens):
            if not 1 <= n <= cap:
                raise InvalidCountError("window_begin", token_count_message(n, 1, cap, r), n)
        for k, wrapper in enumerate(self.wrappers):
            lens = length_bounds(num_tokens, k, w.queries, m.max_blocks_per_req * m.block_size)
            indptr, last = _layout_lists(lens, w.max_batch, m.block_size)
            wrapper.plan(torch.tensor(indptr, dtype=torch.int32), v.kv_indices[k][:indptr[-1]],
                         torch.tensor(last, dtype=torch.int32), *heads, m.block_size, **plan_kwargs)


__all__ = ["WindowDecodePlan", "length_bounds", "paged_layout"]
