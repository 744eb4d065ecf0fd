"""Running ops: on a reference and a device side by side, expected to fail, a whole request's
admission (docs/semantics.md section 5), one decode step's inputs and its reference, several threads."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import pytest
import torch

from gpupool.errors import PoolError
from gpupool.reference.window import ReferenceDecodeWindow
from harness.keys import request_hashes
from harness.sizes import BLOCK_SIZE
from harness.state import ints, lookup, state_digest


# ---- request-level scenarios (docs/semantics.md section 5 admission) ---------------------------------------

def find_hits(pool, req_hashes: Sequence[bytes], num_tokens: int, block_size: int = BLOCK_SIZE,
              group: int = 0) -> list[int]:
    """The longest cached prefix of the first ``min(full, (num_tokens - 1) // block_size)`` hashes."""
    limit = min(len(req_hashes), num_tokens // block_size, max(num_tokens - 1, 0) // block_size)
    hits = []
    for hh in req_hashes[:limit]:
        got = lookup(pool, hh, [group])
        if got is None:
            break
        hits.append(got[0])
    return hits


def admit(pool, prefix_ids: Sequence, num_tokens: int, block_size: int = BLOCK_SIZE, group: int = 0,
          total_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """Admit a request the way docs/semantics.md section 5 does: look up hits, ``touch`` them, get the rest,
    cache the full blocks. ``prefix_ids`` names one test key per full block (see
    :func:`harness.keys.request_hashes`).

    Returns ``(hits, new_blocks)``; the request's block table is ``hits + new_blocks``.
    """
    total_tokens = num_tokens if total_tokens is None else total_tokens
    req_hashes = request_hashes(prefix_ids, num_tokens, block_size)
    hits = find_hits(pool, req_hashes, num_tokens, block_size, group)
    total = -(-total_tokens // block_size)
    pool.touch(hits)
    new = ints(pool.get_new_blocks(total - len(hits)))
    pool.cache_full_blocks(hits + new, req_hashes, len(hits), len(req_hashes), block_size, group)
    return hits, new


def free_request(pool, blocks: Sequence[int]) -> None:
    """Free a request's block table: ``free_blocks(reversed(blocks))`` after dropping leading null blocks."""
    blocks = list(blocks)
    while blocks and blocks[0] == 0:
        blocks.pop(0)
    pool.free_blocks(list(reversed(blocks)))


# ---- side by side and errors ---------------------------------------------------------------------------

def call_both(ref_fn: Callable, dev_fn: Callable, dev_check: Callable | None = None):
    """Run the reference op, then the device op (and ``dev_check``, e.g. the status word's ``check()``),
    each catching a PoolError. Returns (reference value, reference error, device value, device error)."""
    r_val = r_err = d_val = d_err = None
    try:
        r_val = ref_fn()
    except PoolError as e:
        r_err = e
    try:
        d_val = dev_fn()
        if dev_check is not None:
            dev_check()
    except PoolError as e:
        d_err = e
    return r_val, r_err, d_val, d_err


def expect_error(pool, exc_type: type, op: str, fn: Callable[[], object], *, check_events: bool = True):
    """Run ``fn``; assert it raises ``exc_type`` (a :class:`PoolError`) naming ``op``, and that the pool's
    observable state is unchanged. With ``check_events`` the pending events are drained first and the
    failed op must not have added any. Returns the exception."""
    assert issubclass(exc_type, PoolError)
    if check_events:
        pool.take_events()
    before = state_digest(pool)
    with pytest.raises(exc_type) as info:
        fn()
    err = info.value
    assert isinstance(err, PoolError)
    assert op in str(err), f"{err!s} does not name the op {op!r}"
    assert getattr(err, "op", op) == op
    assert state_digest(pool) == before, f"{op} raised {type(err).__name__} but changed the pool"
    if check_events:
        assert list(pool.take_events()) == [], f"{op} raised but emitted events"
    return err


# ---- the decode step --------------------------------------------------------------------------------

def fill_step(step, decoding, ntok, finished=()) -> None:
    """Write one step's inputs into a :class:`gpupool.graph.DecodeStep`'s fixed buffers: the running
    slots ``decoding`` with token counts ``ntok``, and the ``finished`` slots."""
    k = len(decoding)
    step.slots[:k] = torch.tensor(list(decoding), dtype=torch.int32)
    step.num_tokens[:k] = torch.tensor(list(ntok), dtype=torch.int32)
    step.num_reqs.fill_(k)
    step.finished[: len(finished)] = torch.tensor(list(finished), dtype=torch.int32)
    step.num_finished.fill_(len(finished))


class ReferenceSteps(NamedTuple):
    """:func:`reference_decode_step`'s outcome over the ``B`` lanes: ``admitted[k][i]`` (0 / 1),
    ``slot_mapping[k][i]`` (group 0's slot of lane i's newest token, -1 where not admitted),
    ``preempt_step[i]`` (the step that preempted lane i, else -1), ``error`` (the PoolError of the op
    that failed, its step's row and the later ones 0 / -1, or None)."""

    admitted: list[list[int]]
    slot_mapping: list[list[int]]
    preempt_step: list[int]
    error: PoolError | None


def reference_decode_step(ref, decoding, ntok, finished=(), steps: int = 1) -> ReferenceSteps:
    """What ``DecodeStep(steps=K)`` does (docs/semantics.md section 7), on the reference manager ``ref``:
    a :class:`ReferenceDecodeWindow` begun with the lanes ``decoding`` (token counts ``ntok``) and the
    ``finished`` slots, then K steps in which every live lane gains one token (accepted 1, none stopped,
    the tokens unknown), no ``end()``. Preempted lanes are freed by it (the host frees them no more)."""
    B, K = len(decoding), steps
    adm, sm = [[0] * B for _ in range(K)], [[-1] * B for _ in range(K)]
    w = ReferenceDecodeWindow(ref, max(1, B, len(finished)), K)
    try:
        w.begin(decoding, ntok, finished)
        for k in range(K):
            out = w.step(k)
            adm[k], sm[k] = [int(a) for a in out.admitted], list(out.slot_mapping[0])
    except PoolError as e:
        return ReferenceSteps(adm, sm, list(w.preempt_step) or [-1] * B, e)
    return ReferenceSteps(adm, sm, list(w.preempt_step), None)


def fail_a_batched_op(m) -> None:
    """Set a device manager's pool status word: a batched ``free`` of an out-of-range slot."""
    m.free(torch.tensor([m.max_num_reqs + 3], dtype=torch.int32))


# ---- threads --------------------------------------------------------------------------------------------

def run_in_threads(errors: list, *targets: Callable) -> None:
    """Run each target in its own thread and wait for all; the targets append what they caught to
    ``errors``, which must stay empty."""
    import threading

    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def flat_segments(segs) -> tuple[list[int], list[int]]:
    """Segments of block ids as ``free_batched`` takes them: the ids laid end to end and the
    ``len(segs) + 1`` offsets of the segments' starts (the last is the total)."""
    flat, offs = [b for seg in segs for b in seg], [0]
    for seg in segs:
        offs.append(offs[-1] + len(seg))
    return flat, offs
