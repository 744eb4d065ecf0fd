"""The request layer on the device: vLLM's KVCacheManager over ``BlockPool`` (block tables, batched
admission and frees, prefix hits, KV-cache groups, copy-on-write queue; docs/semantics.md section 6).

State (device tensors, allocated at construction, one ``ManagerState``): ``block_table: int32[G, R, M]``
(group, request slot, block index; 0 is the null block), ``num_blocks: int32[R]`` (row length, equal
across groups), ``num_computed: int32[R]`` (tokens with slots), ``num_cached: int32[G, R]`` (blocks
already keyed), ``req_hi, req_lo: int64[R, G, M * K]`` (device keys of each known hash block's hash,
per group; K = block_size / hash_block_size), ``num_hashes: int32[R]``, ``active: int8[R]`` (slot in
use), the reservations ``reserved: int32[R]`` (blocks booked per request) with their sum
``num_reserved: int32[1]`` (docs/semantics.md section 8), the pending-copy queue ``copy_src, copy_dst, copy_release: int32[Q]`` with ``num_copies:
int32[1]``, and kernel scratch. The host keeps no request state of its own: whatever it needs (slots
in use, pending copies) it reads from the device, so it never disagrees with a device op that failed.

Semantics, op by op, are those of ``gpupool.reference.ReferenceKVCacheManager`` (the oracle):

* ``add_request(slot, hashes)`` / ``append_block_hashes``: the hashes of a request's full blocks.
* ``allocate_slots(slots, num_tokens, target_tokens, lookup)``: requests in order; for each: free the
  sliding-window blocks that left the window (null block in their place), take the longest cached
  prefix (``lookup``; all groups hitting; capped at ``num_tokens - 1`` tokens), and if
  ``new blocks x groups + zero-ref hits <= free``: touch every group's hits, then allocate each
  group's new blocks, then key the blocks that became full. All or nothing per request.
* ``free(slots)``: each request's rows freed tail first, group by group, requests in order, as one
  batched free; their reservations are released.
* ``reserve(slots, num_tokens)`` / ``release_reservation(slots)``: book blocks for a request's next
  tokens without taking them off the free queue (a count held against the free blocks that the other
  requests' admissions respect), and give the unused part back (docs/semantics.md section 8).
* ``slot_mapping``: ``block_table[g, slot, pos // bs] * bs + pos % bs``.
* Copy-on-write: ``cow_append`` (a partial hit: a private copy of a cached block, the source held
  until the copy ran) and ``cow_move`` (a running request keeps writing a cached block: its keys move
  to a fresh block that receives the copy). ``run_pending_copies(kv_caches)`` copies all pending
  blocks of all layers in one launch and then drops the references the copies held.

The batched calls take device tensors (counts too) and never wait for the device; errors go to the
pool's status word (``check()``). The host ops (add_request, cow_*, a free of a Python list) may wait.
Every public op holds the pool's lock.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import tensors
from .keys import NONE_HASH_WORDS, digest_words, words_digest
from .args import (
    NULL_BLOCK, ManagerShape, admit_lists, as_flag_list, as_hash_bytes_list, as_id_list, as_int, as_token_list,
    check_slot, check_slot_list, check_tail, own_hashing_message,
)
from .errors import (
    ArgumentTypeError, InvalidArgumentError, InvalidCountError, InvariantError, OutOfBlocksError, pending_copy_message,
    token_count_message,
)
from . import _backend

_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels.block_hash import scratch_words  # noqa: E402
from .kernels.sha256 import round_constant_table  # noqa: E402
from .kernels.requests import admit as k_admit  # noqa: E402
from .kernels.requests import copies as k_copies
from .kernels.requests import exact as k_exact
from .kernels.requests import free as k_free
from .kernels.requests import parallel as k_parallel
from .kernels.requests import reserve as k_reserve
from .kernels.requests import slot_mapping as k_slot_mapping
from .kernels.requests import views as k_views
from .kernels.requests import window as k_window
from .kernels.requests.parallel_scratch import NKG, NMAP, NPAR
from .kernels.copy_blocks import check_layers, copy_blocks
from .kv_cache import AttentionViews
from .locking import locked
from .manager_errors import recorded_error
from .pool import BlockPool
from .reservations import check_reservations
from .state import pow2_at_least
from .tensors import check_int32
from .stats import NUM_PREFIX_STATS, PrefixCacheStats
from .kernels.layout import DIGEST_WORDS


class ManagerState(NamedTuple):
    """The manager's device tensors (module docstring); ``s_*`` are kernel scratch."""

    block_table: torch.Tensor
    num_blocks: torch.Tensor
    num_computed: torch.Tensor
    num_cached: torch.Tensor
    req_hi: torch.Tensor
    req_lo: torch.Tensor
    num_hashes: torch.Tensor
    kinds: torch.Tensor
    windows: torch.Tensor
    group_ids: torch.Tensor
    active: torch.Tensor
    reserved: torch.Tensor
    num_reserved: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    copy_release: torch.Tensor
    num_copies: torch.Tensor
    tail_tok: torch.Tensor
    num_tail: torch.Tensor
    hashing: torch.Tensor
    last_digest: torch.Tensor
    name_log: torch.Tensor
    num_names: torch.Tensor
    stats: torch.Tensor
    s_req: torch.Tensor
    s_ids: torch.Tensor
    s_pf: torch.Tensor
    s_seg: torch.Tensor
    s_par: torch.Tensor
    s_kg: torch.Tensor
    s_map: torch.Tensor
    s_filter: torch.Tensor
    s_hash: torch.Tensor
    k_table: torch.Tensor


class ManagerConfig(NamedTuple):
    """The manager's sizes, a ``tl.constexpr`` argument: G groups, R request slots, M blocks per row,
    K hash blocks per block, BS tokens per block, Q pending-copy capacity, BLOCK lanes per request tile,
    FS entries of the request-parallel path's key filter, MAPS = G * R * M entries per item map
    (kernels/requests/parallel.py), SW whether any group's skip rule can release blocks (else the
    kernels skip the windows' passes), CHUNKED whether any group's hit is windowed (chunked local
    attention; else the kernels skip the windowed hit's pass; gpupool/groups.py), HBS tokens per hash
    block, NLOG entries of the log of device-made hashes, HW words of a lane's scratch row for a block
    hash (kernels/block_hash.py)."""

    G: int
    R: int
    M: int
    K: int
    BS: int
    Q: int
    BLOCK: int
    FS: int
    MAPS: int
    SW: bool
    CHUNKED: bool
    HBS: int
    NLOG: int
    HW: int


class AllocateBatch(NamedTuple):
    """One ``allocate_slots`` batch: ``slots, num_tokens, target: int32[B]``, ``lookup: int8[B]`` (0: no
    lookup; 1: a new request's; 2: a request resumed after a preemption, for the prefix-cache
    statistics), ``num_reqs: int32[1]`` (the first ``num_reqs[0]`` count) and the outputs ``admitted:
    int32[B]`` and ``hits: int32[B]`` (each admitted request's prefix-hit tokens, else 0)."""

    slots: torch.Tensor
    num_tokens: torch.Tensor
    target: torch.Tensor
    lookup: torch.Tensor
    num_reqs: torch.Tensor
    admitted: torch.Tensor
    hits: torch.Tensor


def allocate_manager_state(shape: ManagerShape, q: int, device) -> ManagerState:
    G, R, M, K = len(shape.groups), shape.max_num_reqs, shape.max_blocks_per_req, shape.hashes_per_block
    i32, i64 = torch.int32, torch.int64
    return ManagerState(
        block_table=torch.zeros((G, R, M), dtype=i32, device=device),
        num_blocks=torch.zeros(R, dtype=i32, device=device),
        num_computed=torch.zeros(R, dtype=i32, device=device),
        num_cached=torch.zeros((G, R), dtype=i32, device=device),
        req_hi=torch.zeros((R, G, M * K), dtype=i64, device=device),
        req_lo=torch.zeros((R, G, M * K), dtype=i64, device=device),
        num_hashes=torch.zeros(R, dtype=i32, device=device),
        kinds=torch.tensor([g.spec.code for g in shape.groups], dtype=i32, device=device),
        windows=torch.tensor([w for _, w in shape.groups], dtype=i32, device=device),
        group_ids=torch.arange(G, dtype=i32, device=device),
        active=torch.zeros(R, dtype=torch.int8, device=device),
        reserved=torch.zeros(R, dtype=i32, device=device),
        num_reserved=torch.zeros(1, dtype=i32, device=device),
        copy_src=torch.zeros(q, dtype=i32, device=device),
        copy_dst=torch.zeros(q, dtype=i32, device=device),
        copy_release=torch.zeros(q, dtype=i32, device=device),
        num_copies=torch.zeros(1, dtype=i32, device=device),
        tail_tok=torch.zeros((R, shape.hash_block_size), dtype=i32, device=device),
        num_tail=torch.zeros(R, dtype=i32, device=device),
        hashing=torch.zeros(R, dtype=torch.int8, device=device),
        last_digest=torch.zeros((R, DIGEST_WORDS), dtype=i32, device=device),
        name_log=torch.zeros((name_log_size(shape), DIGEST_WORDS), dtype=i32, device=device),
        num_names=torch.zeros(1, dtype=i32, device=device),
        stats=torch.zeros(NUM_PREFIX_STATS, dtype=i64, device=device),
        s_req=torch.zeros(R, dtype=i32, device=device),
        s_ids=torch.zeros(max(G * R * M, q), dtype=i32, device=device),
        s_pf=torch.zeros(max(G * R * M, q) + 1, dtype=i32, device=device),
        s_seg=torch.zeros(G * R + 1, dtype=i32, device=device),
        s_par=torch.zeros((NPAR, R + 1), dtype=i32, device=device),
        s_kg=torch.zeros((NKG, G * R + 1), dtype=i32, device=device),
        s_map=torch.zeros((NMAP, G * R * M), dtype=i32, device=device),
        s_filter=torch.zeros(filter_size(R), dtype=i32, device=device),
        s_hash=torch.zeros(request_block(R) * scratch_words(shape.hash_block_size), dtype=i32, device=device),
        k_table=round_constant_table(device),
    )


def request_block(max_num_reqs: int) -> int:
    """Lanes of a request tile (``ManagerConfig.BLOCK``)."""
    return min(1024, max(16, pow2_at_least(max_num_reqs)))


def name_log_size(shape: ManagerShape) -> int:
    """Entries of the log of hashes the device made (``name_log``): every hash block of every request
    slot, so that it cannot fill between two drains of one request lifetime per slot."""
    return shape.max_num_reqs * shape.max_blocks_per_req * shape.hashes_per_block


def filter_size(max_num_reqs: int) -> int:
    return pow2_at_least(max(1024, 4 * max_num_reqs))


class KVCacheManager:
    """KV cache manager on the device (see the module docstring; the contract is
    ``ReferenceKVCacheManager``).

    Args:
        num_blocks: blocks in the shared pool (block 0 is the null block).
        block_size: tokens per block, all groups.
        max_num_reqs, max_blocks_per_req: block table shape (R, M).
        groups: per KV-cache group "full", ("sliding_window", tokens) or ("chunked_local_attention",
            tokens) (docs/semantics.md section 6); group g keys with group id g.
        hash_block_size: tokens per request hash (a divisor of block_size; default block_size).
        max_pending_copies: capacity of the copy-on-write queue.
        Other keywords go to :class:`BlockPool` (``enable_caching``, ``enable_kv_cache_events``,
        ``max_keys_per_block``, ``device``, ``event_capacity``).

    Raises InvalidArgumentError for a bad shape or group spec (an attention chunk that is not a
    multiple of block_size, two chunks in one manager), ArgumentTypeError for a parameter that is
    not an int.
    """

    def __init__(self, num_blocks: int, *, block_size: int, max_num_reqs: int, max_blocks_per_req: int,
                 groups=("full",), hash_block_size: int | None = None, max_pending_copies: int = 1024, **pool_kw):
        self.shape = sh = ManagerShape.make(block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups)
        self.block_size, self.hash_block_size, self.hashes_per_block = sh.block_size, sh.hash_block_size, \
            sh.hashes_per_block
        self.max_num_reqs, self.max_blocks_per_req, self.groups = sh.max_num_reqs, sh.max_blocks_per_req, sh.groups
        q = as_int("KVCacheManager", max_pending_copies, "max_pending_copies")
        if q < 1:
            raise InvalidArgumentError("KVCacheManager", f"max_pending_copies must be >= 1, got {q}", q)
        self.pool = BlockPool(num_blocks, **pool_kw)
        self._pool = self.pool.handle()
        self._lock = self._pool.lock
        self.device = self._pool.device
        self.state = allocate_manager_state(sh, q, self.device)
        self.config = ManagerConfig(G=len(sh.groups), R=sh.max_num_reqs, M=sh.max_blocks_per_req,
                                    K=sh.hashes_per_block, BS=sh.block_size, Q=q,
                                    BLOCK=request_block(sh.max_num_reqs),
                                    FS=filter_size(sh.max_num_reqs),
                                    MAPS=len(sh.groups) * sh.max_num_reqs * sh.max_blocks_per_req,
                                    SW=any(g.spec.releases_blocks for g in sh.groups),
                                    CHUNKED=any(g.spec.windowed_hit for g in sh.groups), HBS=sh.hash_block_size,
                                    NLOG=name_log_size(sh), HW=scratch_words(sh.hash_block_size))
        self.parallel = True  # False: every batch takes the exact sequential path (tests, debugging)
        self._copy_offsets: dict = {}  # copy_blocks' layer offset tables, read by captured steps: kept while we live
        # what a caller's output buffer must not overlap (tensors.check_disjoint)
        self._held = tensors.HeldMemory([(t, f"the manager's {n}") for n, t in self.state._asdict().items()]
                                        + [(t, f"the pool's {n}") for n, t in self._pool.state._asdict().items()])
        self._pool.registry.add_pin_source(self._active_keys)
        self._pool.registry.add_name_source(self._drain_names)
        self._pool.add_error_wording(self._recorded_error)

    # the device tensors by name, for readers and tests
    lock = property(lambda self: self._lock, doc="The pool's re-entrant lock, which every public op holds.")
    block_table = property(lambda self: self.state.block_table)
    num_blocks = property(lambda self: self.state.num_blocks)
    num_computed = property(lambda self: self.state.num_computed)
    num_cached = property(lambda self: self.state.num_cached)
    num_copies = property(lambda self: self.state.num_copies)
    reserved = property(lambda self: self.state.reserved)
    num_reserved = property(lambda self: self.state.num_reserved)
    copy_src = property(lambda self: self.state.copy_src)
    copy_dst = property(lambda self: self.state.copy_dst)
    copy_release = property(lambda self: self.state.copy_release)

    # ---- host ops ----------------------------------------------------------------------------
    def _in_use(self, r: int) -> bool:
        return bool(self.state.active[r].item())

    def _slot(self, op: str, slot, active: bool | None = True) -> int:
        """A slot number, range-checked; ``active``: whether it must be in use (read on the device)."""
        return check_slot(op, as_int(op, slot, "slot"), self.max_num_reqs, self._in_use, active)

    def _host_slots(self, op: str, slots) -> list[int]:
        """A host list of distinct slots in use, checked on the host (waits for the device) as the
        kernels check a device list: the first bad entry, a repeat at its first."""
        rs = as_id_list(op, slots)
        self._pool.finish()
        return check_slot_list(op, rs, self.max_num_reqs, self._in_use)

    def _recorded_error(self, code: int, op: str, value: int, cause: int, extra: int, limit: int):
        """This manager's words for a record of its kernels (gpupool/manager_errors.py)."""
        return recorded_error(self.shape, self._read_slot, code, op, value, cause, extra, limit)

    def _read_slot(self, name: str, r: int) -> int:
        return int(getattr(self.state, name)[r].item())

    def _write_hashes(self, r: int, start: int, hashes: list[bytes]) -> None:
        if hashes:
            keys = [self._pool.registry.register_many(hashes, g) for g in range(len(self.groups))]
            t = torch.tensor(keys, dtype=torch.int64, device=self.device)  # [G, n, 2]
            self.state.req_hi[r, :, start:start + len(hashes)] = t[:, :, 0]
            self.state.req_lo[r, :, start:start + len(hashes)] = t[:, :, 1]
        self.state.num_hashes[r] = start + len(hashes)

    def _active_keys(self):
        """Device keys of every active request's hashes: the registry keeps them (a sweep's pin source)."""
        s = self.state
        n = torch.where(s.active != 0, s.num_hashes, 0)
        used = torch.arange(s.req_hi.shape[2], device=self.device)[None, None, :] < n[:, None, None]
        return list(zip(s.req_hi[used].tolist(), s.req_lo[used].tolist()))

    @locked
    def add_request(self, slot: int, block_hashes: Sequence[bytes] = (), tail_tokens: Sequence[int] | None = None) -> None:
        """Start a request in a free slot with the hashes of its known hash blocks (its prompt). With
        ``tail_tokens`` (the tokens after the last hash block, fewer than ``hash_block_size``) the
        device hashes the request's further tokens itself as :meth:`append_tokens` or a window gives
        them (docs/semantics.md section 9); the hashes must then be 32-byte (vLLM's sha256). Raises
        InvalidArgumentError (slot in use or out of range, too many hashes or tokens), ArgumentTypeError
        (hashes that are not bytes, tokens that are not ints). Waits for the device (:meth:`admit`
        admits many requests without waiting)."""
        op = "add_request"
        hs = as_hash_bytes_list(op, block_hashes)
        tail = None if tail_tokens is None else as_token_list(op, tail_tokens, "tail_tokens")
        self._pool.finish()
        r = self._slot(op, slot, active=False)
        if len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, f"{len(hs)} block hashes exceed max_blocks_per_req", len(hs))
        if tail is not None:
            check_tail(op, hs, tail, self.hash_block_size, self.shape.max_tokens)
        if int(self.state.num_blocks[r]) != 0:
            raise InvalidArgumentError(op, f"slot {r} still holds blocks", r)
        s = self.state
        s.num_computed[r] = 0
        s.num_cached[:, r] = 0
        self._write_hashes(r, 0, hs)
        s.hashing[r] = int(tail is not None)
        if tail is not None:
            s.num_tail[r] = len(tail)
            s.tail_tok[r, :len(tail)] = torch.tensor(tail, dtype=torch.int32)
            s.last_digest[r] = torch.tensor(digest_words(hs[-1]) if hs else NONE_HASH_WORDS, dtype=torch.int32)
        s.active[r] = 1

    @locked
    def append_block_hashes(self, slot: int, block_hashes: Sequence[bytes]) -> None:
        """Hashes of further hash blocks of a running request (tokens it has generated). Raises
        InvalidArgumentError for a request that hashes its own tokens (``add_request`` with
        ``tail_tokens``: give it the tokens, :meth:`append_tokens`)."""
        op = "append_block_hashes"
        hs = as_hash_bytes_list(op, block_hashes)
        self._pool.finish()
        r = self._slot(op, slot)
        if int(self.state.hashing[r].item()):
            raise InvalidArgumentError(op, own_hashing_message(r), r)
        start = int(self.state.num_hashes[r])
        if start + len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, "block hashes exceed max_blocks_per_req", start + len(hs))
        self._write_hashes(r, start, hs)

    # ---- admission, appended tokens, prefix-cache statistics (docs/semantics.md section 9) ----------
    @locked
    def admit(self, slots, block_hashes, num_tokens, tail_tokens=None, resumed=None, blocked: torch.Tensor | None = None,
              admitted: torch.Tensor | None = None, hit_tokens: torch.Tensor | None = None):
        """Admit waiting requests in order, in one launch, without waiting for the device
        (``ReferenceKVCacheManager.admit``; docs/semantics.md section 9, "Admission"): each request
        ``slots[k]`` (a free slot) starts with its hashes ``block_hashes[k]`` (and ``tail_tokens[k]``: it
        hashes its further tokens), then gets ``num_tokens[k]`` tokens' blocks with a prefix lookup;
        the first that does not fit is not admitted, nor any after it (their slots stay free).
        ``resumed[k]``: it resumes after a preemption (statistics). ``blocked``: an ``int32[1]`` device
        flag (a window's ``flags``); nonzero: nobody is admitted (vLLM admits nobody in a step that
        preempted). Returns ``(admitted, hit_tokens)``, ``int32[B]`` device tensors (``admitted`` and
        ``hit_tokens`` may be given as buffers). The host checks lengths, counts, hashes and tails at
        once (InvalidArgumentError, InvalidCountError, ArgumentTypeError); the device checks that each
        slot is in range, free and listed once (op ``admit``, raised at ``check()``)."""
        op = "admit"
        rs, hls, nts, tls, rsm = admit_lists(op, slots, block_hashes, num_tokens, tail_tokens, resumed)
        check_int32(op, rs, "slots")
        cap, K, hbs = self.shape.max_tokens, self.hashes_per_block, self.hash_block_size
        for r, t in zip(rs, nts):
            if not 1 <= t <= cap:
                raise InvalidCountError(op, token_count_message(t, 1, cap, r), t)
        reqs = []
        for hs, tl in zip(hls, tls):
            hs = as_hash_bytes_list(op, hs)
            if len(hs) > self.max_blocks_per_req * K:
                raise InvalidArgumentError(op, f"{len(hs)} block hashes exceed max_blocks_per_req", len(hs))
            tail = None if tl is None else as_token_list(op, tl, "tail_tokens")
            if tail is not None:
                check_tail(op, hs, tail, hbs, cap)
            reqs.append((hs, tail))
        if blocked is not None:
            blocked = tensors.device_count(op, blocked, self.device)
        B = len(rs)
        G = len(self.groups)
        offs, keys, tlen, tails, digests = [0], [], [], [], []
        for hs, tail in reqs:
            offs.append(offs[-1] + len(hs))
            per_group = [self._pool.registry.register_many(hs, g) for g in range(G)]
            keys += [w for i in range(len(hs)) for g in range(G) for w in per_group[g][i]]
            tlen.append(-1 if tail is None else len(tail))
            tails += (tail or []) + [0] * (hbs - len(tail or []))
            digests += (digest_words(hs[-1]) if hs else NONE_HASH_WORDS) if tail is not None else [0] * DIGEST_WORDS
        dev = tensors.to_device_packed([(rs, torch.int32), (nts, torch.int32), ([B], torch.int32), (offs, torch.int32),
                                        (tlen, torch.int32), (tails, torch.int32), (digests, torch.int32),
                                        ([1 + f for f in rsm], torch.int32), (keys, torch.int64)], self.device)
        s, nt, num, off, tln, tls_t, dig, lk, kys = dev
        batch = self.batch(s, nt, nt, lk.to(torch.int8), num, admitted, hits=hit_tokens, op=op)
        inp = k_admit.AdmitInputs(off, kys if kys.numel() else torch.zeros(2, dtype=torch.int64, device=self.device),
                                  tln, tls_t if tls_t.numel() else torch.zeros(1, dtype=torch.int32, device=self.device),
                                  dig if dig.numel() else torch.zeros(1, dtype=torch.int32, device=self.device),
                                  num if blocked is None else blocked)
        k_admit.launch_admit(self._pool.state, self._pool.config, self.state, self.config, batch, inp,
                             has_blocked=blocked is not None, force_exact=not self.parallel)
        return batch.admitted[:B], batch.hits[:B]

    @locked
    def append_tokens(self, slots, counts, tokens: torch.Tensor, num_reqs=None) -> None:
        """Requests ``slots[:num_reqs]`` (``int32[B]``) gained ``counts[k]`` tokens (``int32[B]``, each in
        0 .. T) from row k of ``tokens`` (``int32`` or ``int64[B, T]`` on the device: a prefill's sampled
        token, say), in order: a request that hashes its own tokens appends them to its tail and hashes
        the hash blocks they fill on the device (docs/semantics.md section 9); the others ignore them.
        No host sync: a slot out of range, not in use or listed twice (InvalidArgumentError), a count
        outside 0 .. T or a hashing request's tokens past ``max_blocks_per_req * block_size``
        (InvalidCountError), a token outside int32 (InvalidArgumentError) go to the status word (op
        ``append_tokens``) and change nothing. Shapes, dtypes and devices raise at once."""
        op = "append_tokens"
        s = self._i32(op, slots, "slots")
        c = self._i32(op, counts, "counts", InvalidCountError)
        if not isinstance(tokens, torch.Tensor):
            raise ArgumentTypeError(op, "tokens must be an int32 or int64 tensor [B, T] on the device")
        if tokens.dtype not in (torch.int32, torch.int64) or tokens.device != self.device or tokens.dim() != 2 \
                or tokens.shape[0] < s.numel() or tokens.shape[1] < 1:
            raise InvalidArgumentError(op, f"tokens must be an int32/int64 tensor [>= {s.numel()}, T >= 1] on "
                                           f"{self.device}, got {tuple(tokens.shape)} {tokens.dtype} on {tokens.device}")
        if c.numel() != s.numel():
            raise InvalidArgumentError(op, "slots and counts differ in length")
        k_window.launch_append_tokens(self._pool.state, self._pool.config, self.state, self.config, s, c,
                                      tokens.contiguous(), self._count(op, num_reqs, s.numel()))

    @locked
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache statistics since the last call (vLLM's ``PrefixCacheStats``: requests,
        queries and hits in tokens, and the same of resumed requests; gpupool/stats.py), and a fresh
        count. Waits for the device."""
        self._pool.finish()
        out = PrefixCacheStats.from_list(self.state.stats.tolist())
        self.state.stats.zero_()
        return out

    def window(self, max_batch: int, steps: int = 1, num_lookahead_tokens: int = 0,
               kv_caches: list[torch.Tensor] | None = None, views: bool = True):
        """A :class:`gpupool.window.DecodeWindow` over this manager (its buffers, fixed; docs/semantics.md
        section 9)."""
        from .window import DecodeWindow

        return DecodeWindow(self, max_batch, steps, num_lookahead_tokens, kv_caches, views)

    def _name_rows(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The count of the log of device-made hashes and its first rows (as many as a window and the
        appends before it can have logged): views to read with a window's outcome."""
        n = min(self.config.NLOG, self.max_num_reqs + extra)
        return self.state.num_names, self.state.name_log[:n]

    def _register_names(self, count: int, words: list[int]) -> None:
        """Name the ``count`` hashes the device logged (``words``: at least the first rows, flat; the rest
        read now) in every group, then empty the log. Holds the lock."""
        if count <= 0:
            return
        if count * DIGEST_WORDS > len(words):
            words = self.state.name_log[:count].reshape(-1).tolist()
        G = len(self.groups)
        digests = [words_digest(words[i * DIGEST_WORDS:(i + 1) * DIGEST_WORDS]) for i in range(count)]
        self._pool.registry.register_pairs([(d, g) for d in digests for g in range(G)])
        self.state.num_names.zero_()

    def _drain_names(self) -> None:
        """The registry's fallback when it meets a key it cannot name: register the device's log."""
        with self._lock:
            self._register_names(int(self.state.num_names.item()), [])

    # ---- batched ops (device tensors, no host sync) -------------------------------------------
    def _i32(self, op: str, x, what: str, error=InvalidArgumentError) -> torch.Tensor:
        """``x`` as an int32 tensor on the device (``tensors.i32``); a value of a sequence outside int32
        raises ``error`` (the reference's class for that argument: a count InvalidCountError, an id
        InvalidArgumentError) before anything runs."""
        return tensors.i32(op, x, what, self.device, error)

    def _index_tensor(self, op: str, x, what: str) -> torch.Tensor:
        """An int32 or int64 tensor on the device (read as is by the kernel: no narrowing), or a list
        (int64 where a value is past int32, so the kernel finds it out of range as for any other)."""
        if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.device == self.device and x.dim() == 1:
            return x.contiguous()
        if not isinstance(x, torch.Tensor):
            x = as_id_list(op, x)
            if any(not -(1 << 31) <= v < 1 << 31 for v in x):
                bad = next((v for v in x if not -(1 << 63) <= v < 1 << 63), None)
                if bad is not None:
                    raise InvalidArgumentError(op, f"{what}: {bad} is outside int64", bad)
                return torch.tensor(x, dtype=torch.int64, device=self.device)
        return self._i32(op, x, what)

    def _count(self, op: str, count, n: int) -> torch.Tensor:
        if count is None:
            return torch.full((1,), n, dtype=torch.int32, device=self.device)
        return tensors.device_count(op, count, self.device)

    def _out(self, op: str, t, dtype, n: int, what: str) -> torch.Tensor:
        return tensors.out_buffer(op, t, dtype, n, what, self.device)

    def _disjoint(self, op: str, outputs, inputs) -> None:
        """No output shares memory with another, with an input or with this manager's or its pool's
        state (``tensors.check_disjoint``; ``(tensor, name)`` pairs, None entries skipped):
        InvalidArgumentError before anything runs."""
        tensors.check_disjoint(op, [x for x in outputs if x[0] is not None], [x for x in inputs if x[0] is not None],
                               self._held)

    @locked
    def get_computed_blocks(self, slots, num_tokens):
        """Longest cached prefix of each request's hashes, all groups hitting, capped at
        ``(num_tokens - 1) // block_size`` blocks. ``slots, num_tokens: int32[B]``. Returns
        ``(hits: int32[B], blocks: int32[B, G, M])`` on the device (first ``hits[b]`` valid). Read-only;
        the slots are checked on the host (a tensor of slots is read back: this op waits)."""
        op = "get_computed_blocks"
        rs = self._host_slots(op, slots)
        s = torch.tensor(rs, dtype=torch.long, device=self.device)
        nt = self._i32(op, num_tokens, "num_tokens")
        if s.numel() != nt.numel():
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        K = self.hashes_per_block
        cap = torch.minimum(torch.clamp(nt - 1, min=0) // self.block_size, self.state.num_hashes[s] // K)
        if not self.pool.enable_caching:
            cap = torch.zeros_like(cap)
        full_hi = self.state.req_hi[s][:, :, K - 1::K].contiguous()
        full_lo = self.state.req_lo[s][:, :, K - 1::K].contiguous()
        kinds = (self.state.kinds, self.state.windows, self.block_size, self.config.CHUNKED)
        hits, blocks, _ = self.pool._longest_prefix_of_kinds(full_hi, full_lo, self.state.group_ids,
                                                            cap.to(torch.int32).contiguous(), kinds)
        return hits, blocks

    def batch(self, slots, num_tokens, target_tokens, lookup=None, num_reqs=None,
              admitted: torch.Tensor | None = None, resumed=None, hits: torch.Tensor | None = None,
              op: str = "allocate_slots") -> AllocateBatch:
        """An ``AllocateBatch`` from tensors or sequences (checked for dtype, device and lengths).
        ``resumed``: per request, whether it resumes after a preemption (its lookup counts in the
        ``preempted_*`` statistics: lookup flag 2)."""
        s = self._i32(op, slots, "slots")
        nt = self._i32(op, num_tokens, "num_tokens", InvalidCountError)
        tg = self._i32(op, target_tokens, "target_tokens", InvalidCountError)
        b = s.numel()
        lk = self._flags(op, lookup, b, "lookup")
        if resumed is not None:
            lk = torch.where(lk != 0, 1 + self._flags(op, resumed, b, "resumed"), 0).to(torch.int8)
        if not nt.numel() == tg.numel() == lk.numel() == b:
            raise InvalidArgumentError(op, "slots, num_tokens, target_tokens, lookup and resumed differ in length")
        count = self._count(op, num_reqs, b)
        admitted = self._buffer(op, admitted, b, "admitted")
        hits = self._buffer(op, hits, b, "hit_tokens")
        self._disjoint(op, [(admitted, "admitted"), (hits, "hit_tokens")],
                       [(s, "slots"), (nt, "num_tokens"), (tg, "target_tokens"), (lk, "lookup"), (count, "num_reqs")])
        return AllocateBatch(s, nt, tg, lk, count, admitted, hits)

    def _flags(self, op: str, x, n: int, what: str) -> torch.Tensor:
        """Per-request flags as ``int8[n]`` (0 / 1; an int8 tensor as is) on the device."""
        if x is None:
            return torch.zeros(n, dtype=torch.int8, device=self.device)
        if isinstance(x, torch.Tensor):
            if x.device != self.device:
                raise InvalidArgumentError(op, f"{what} must be on {self.device}")
            f = x.reshape(-1)
            return f.to(torch.int8) if f.dtype in (torch.int8, torch.bool) else (f != 0).to(torch.int8)  # no narrowing
        return torch.tensor(as_flag_list(op, x), dtype=torch.int8, device=self.device)

    def _buffer(self, op: str, t, n: int, what: str) -> torch.Tensor:
        """An ``int32[n]`` output buffer: ``t`` checked, or a new one (at least one entry)."""
        if t is None:
            return torch.zeros(max(n, 1), dtype=torch.int32, device=self.device)
        return self._out(op, t, torch.int32, n, what)

    @locked
    def allocate_slots(self, slots, num_tokens, target_tokens, lookup=None, num_reqs=None,
                       stop_on_failure: bool = True, admitted: torch.Tensor | None = None, resumed=None,
                       hit_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks for ``target_tokens`` tokens for each request, in order, all or nothing per request
        (see ``ReferenceKVCacheManager.allocate_slots``). ``slots, num_tokens, target_tokens:
        int32[B]``, ``lookup: int8/bool[B]`` (take prefix hits: new requests), ``num_reqs: int32[1]``
        (only the first k count). Returns ``admitted: int32[B]``. No host sync; errors (a slot out of
        range, repeated or not in use, a token count outside ``0 .. max_blocks_per_req * block_size``, a
        count past the arrays) go to the status word and change nothing. ``admitted``: an output
        buffer to fill (a captured step's). ``hit_tokens``: an ``int32[B]`` output buffer, filled
        with each admitted request's prefix-hit tokens (0 elsewhere): no separate lookup is needed,
        and hits on blocks an earlier request of the batch cached are counted. A ``lookup`` flag on a
        row that holds blocks looks nothing up; an admitted request that looked up is recorded in the
        prefix-cache statistics (:meth:`make_prefix_cache_stats`;
        ``resumed[k]``: in the ``preempted_*`` counters; docs/semantics.md section 9)."""
        batch = self.batch(slots, num_tokens, target_tokens, lookup, num_reqs, admitted, resumed, hit_tokens)
        ps, pc = self._pool.state, self._pool.config
        k_parallel.launch_allocate_slots_parallel(ps, pc, self.state, self.config, batch, force_exact=not self.parallel)
        k_exact.launch_allocate_slots(ps, pc, self.state, self.config, batch, stop_on_failure=stop_on_failure,
                                      stats=lookup is not None)
        return batch.admitted[: batch.slots.numel()]

    @locked
    def free(self, slots, num_reqs=None) -> None:
        """Finish requests in order: every group's row freed tail first, as one batched free; the
        slots become free. No host sync for tensor input; a list of slots is checked on the host first
        (and the call waits for the device, so its errors are raised at once)."""
        op = "free"
        host_list = not isinstance(slots, torch.Tensor)
        if host_list:
            self._host_slots(op, slots)
        s = self._i32(op, slots, "slots")
        k_free.launch_free_requests(self._pool.state, self._pool.config, self.state, self.config, s,
                                       self._count(op, num_reqs, s.numel()))
        if host_list:
            self._pool.finish()

    @locked
    def reserve(self, slots, num_tokens, num_reqs=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Book, for each running request in order, the blocks it needs for ``num_tokens[k]`` more
        tokens, WITHOUT taking any off the free queue (nothing evicted now; docs/semantics.md section
        8): ``need = G * max(0, ceil((num_computed + num_tokens) / block_size) - num_blocks)`` and the
        request's reservation becomes ``max(reserved, need)``. The growths must fit ``num_free -
        num_reserved``; the first request whose growth does not fit is not booked, nor any after it.
        Later admissions of other requests see ``num_free`` less the reservations; a reserved
        request's own allocations (``allocate_slots``, a decode step or burst, ``cow_*``) draw from
        its reservation first and pop blocks only then.

        ``slots, num_tokens: int32[B]`` (device tensors or sequences), ``num_reqs: int32[1]`` (only the
        first k count), ``out``: an ``int32[B]`` output buffer (a captured step's). Returns ``booked:
        int32[B]`` (1: its reservation covers ``num_tokens``). No host sync: a slot out of range, not in
        use or listed twice (InvalidArgumentError), ``num_tokens < 0`` or ``num_computed + num_tokens >
        max_blocks_per_req * block_size`` (InvalidCountError) go to the status word (op ``reserve``,
        raised at ``pool.check()``) and change nothing; lengths that differ raise InvalidArgumentError."""
        op = "reserve"
        s = self._i32(op, slots, "slots")
        n = self._i32(op, num_tokens, "num_tokens", InvalidCountError)
        if s.numel() != n.numel():
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        count = None if num_reqs is None else self._count(op, num_reqs, s.numel())  # None: all of them
        if out is None:  # the kernel writes every entry: no fill kernel
            out = torch.empty(max(s.numel(), 1), dtype=torch.int32, device=self.device)
        else:
            out = self._out(op, out, torch.int32, s.numel(), "out")
            self._disjoint(op, [(out, "out")], [(s, "slots"), (n, "num_tokens"), (count, "num_reqs")])
        k_reserve.launch_reserve(self._pool.state, self._pool.config, self.state, self.config, s, n, count, out)
        return out[: s.numel()]

    @locked
    def release_reservation(self, slots, num_reqs=None) -> None:
        """Give the requests' unused reservations back (each becomes 0, the total drops by their sum;
        docs/semantics.md section 8). ``slots: int32[B]`` or a sequence, ``num_reqs: int32[1]``. No
        host sync: a slot out of range, not in use or listed twice goes to the status word (op
        ``release_reservation``, InvalidArgumentError) and changes nothing. ``free`` releases a
        request's reservation too."""
        op = "release_reservation"
        s = self._i32(op, slots, "slots")
        count = None if num_reqs is None else self._count(op, num_reqs, s.numel())  # None: all of them
        k_reserve.launch_release_reservation(self._pool.state, self._pool.config, self.state, self.config, s, count)

    @locked
    def get_num_reserved_blocks(self) -> int:
        """Blocks reserved by all requests (waits for the device; raises the pool's recorded error)."""
        self._pool.finish()
        return int(self.state.num_reserved.item())

    @locked
    def reservations(self) -> list[int]:
        """Each slot's reserved blocks (0 for a free slot), as a Python list (waits for the device)."""
        self._pool.finish()
        return self.state.reserved.tolist()

    def _room(self, r: int) -> int:
        """Host ops: free blocks request ``r`` may take (the others' reservations held back)."""
        s = self.state
        return self.pool.get_num_free_blocks() - (int(s.num_reserved.item()) - int(s.reserved[r].item()))

    def _draw(self, r: int, n: int) -> None:
        """Host ops: request ``r`` took ``n`` blocks off the free queue, from its reservation first."""
        s = self.state
        take = min(int(s.reserved[r].item()), n)
        if take:
            s.reserved[r] -= take
            s.num_reserved.sub_(take)

    def check_kv_caches(self, op: str, kv_caches) -> None:
        """Raises ArgumentTypeError / InvalidArgumentError (naming ``op``) unless ``kv_caches`` are as
        ``copy_blocks`` takes them, on this device, each holding every block of the pool (a copy past a
        smaller cache would be dropped unseen), sharing no memory with a manager's or a window's state
        (the copies write them). Host-only checks: no device read."""
        if not isinstance(kv_caches, (list, tuple)):
            raise ArgumentTypeError(op, f"kv_caches must be a list of tensors [num_blocks, ...], one per layer, "
                                        f"got {type(kv_caches).__name__}")
        check_layers(kv_caches, op)
        for j, t in enumerate(kv_caches):
            if t.device != self.device:
                raise InvalidArgumentError(op, f"kv_caches[{j}] is on {t.device}, the pool on {self.device}", j)
            if t.shape[0] < self.pool.num_blocks:
                raise InvalidArgumentError(op, f"kv_caches[{j}] holds {t.shape[0]} blocks, the pool "
                                               f"{self.pool.num_blocks}", t.shape[0])
        self._disjoint(op, [(t, f"kv_caches[{j}]") for j, t in enumerate(kv_caches)], [])

    @locked
    def slot_mapping(self, slots: torch.Tensor, positions: torch.Tensor, group: int = 0,
                     num: torch.Tensor | None = None, *, out: torch.Tensor | None = None, position_offset: int = 0,
                     admitted: torch.Tensor | None = None) -> torch.Tensor:
        """``int64[T]`` KV slot of each token: ``block_table[group, slots[t], p // bs] * bs + p % bs`` with
        ``p = positions[t] + position_offset`` (``slots, positions: int32[T]`` on the device, the first
        ``num[0]`` counted). A slot not in use or a position outside its row gives -1 and
        InvalidArgumentError at the next ``check()``; with ``admitted: int32[T]``, entries whose flag is 0
        give -1 and no error (requests a step did not admit); entries past ``num[0]`` give -1 (all of
        them for a count past the arrays; docs/errors.md, "Outputs of a failed or skipped op"). No host sync."""
        op = "slot_mapping"
        g = self._group(op, group)
        s = self._index_tensor(op, slots, "slots")
        p = self._index_tensor(op, positions, "positions")
        if s.numel() != p.numel():
            raise InvalidArgumentError(op, "slots and positions differ in length")
        adm = None if admitted is None else self._i32(op, admitted, "admitted")
        if adm is not None and adm.numel() < s.numel():
            raise InvalidArgumentError(op, f"admitted has {adm.numel()} entries for {s.numel()} slots")
        count = self._count(op, num, s.numel())
        offset = as_int(op, position_offset, "position_offset")
        if out is None:
            out = torch.empty(s.numel(), dtype=torch.int64, device=self.device)
        else:
            out = self._out(op, out, torch.int64, s.numel(), "out")
            self._disjoint(op, [(out, "out")], [(s, "slots"), (p, "positions"), (count, "num"), (adm, "admitted")])
        k_slot_mapping.launch_slot_mapping(self._pool.state, self.state, self.config, s, p, count, out, g, offset, adm)
        return out

    @locked
    def attention_views(self, slots, base_len, num_reqs=None, admitted: torch.Tensor | None = None, group: int = 0,
                        out: AttentionViews | None = None) -> AttentionViews:
        """The paged-KV views of requests ``slots: int32[B]`` for attention kernels (docs/kv_cache.md
        section 2): FlashAttention's ``block_table: int32[B, M]`` + ``seqused_k``, FlashInfer's
        ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``, for one step, or for the K steps of a
        burst with ``admitted: int32[K, B]`` (a ``DecodeStep``'s ``admitted_steps``). Lane i's length
        at step k is ``base_len[i] + k`` (``int32[B]``: its token count at the first step) where
        ``admitted[k, i] != 0`` (every lane ``< num_reqs[0]`` without ``admitted``), else 0. Built on
        the device, no host sync. A live lane whose slot is not in use or whose length passes its row
        gives length 0 and InvalidArgumentError at the next ``check()`` (op ``attention_views``), as
        does a count outside ``0..B`` (an empty batch too). ``out``: views to fill (shapes
        ``AttentionViews.shapes(B, max_blocks_per_req, K)``); a wrong shape, dtype or device, or an
        ``out`` tensor sharing memory with another, with an input or with the manager's state, raises
        InvalidArgumentError at once (ArgumentTypeError: not an ``AttentionViews``)."""
        op = "attention_views"
        g = self._group(op, group)
        s = self._i32(op, slots, "slots")
        bl = self._i32(op, base_len, "base_len")
        B = s.numel()
        if bl.numel() != B:
            raise InvalidArgumentError(op, "slots and base_len differ in length")
        adm = None
        if admitted is not None:
            if not isinstance(admitted, torch.Tensor):
                raise ArgumentTypeError(op, "admitted must be an int32 tensor [K, B] or [B]")
            if admitted.dim() not in (1, 2) or admitted.shape[-1] != B or admitted.dtype != torch.int32 \
                    or admitted.device != self.device or not admitted.is_contiguous():
                raise InvalidArgumentError(op, f"admitted must be a contiguous int32 tensor [K, {B}] or [{B}] on "
                                               f"{self.device}, got {tuple(admitted.shape)} {admitted.dtype} on "
                                               f"{admitted.device}")
            adm = admitted if admitted.dim() == 2 else admitted[None]
        K = 1 if adm is None else adm.shape[0]
        shapes = AttentionViews.shapes(B, self.max_blocks_per_req, K, op=op)
        count = self._count(op, num_reqs, B)
        if out is None:
            out = AttentionViews.empty(B, self.max_blocks_per_req, K, device=self.device)
        else:
            AttentionViews.check_out(op, out, shapes, self.device)
            self._disjoint(op, [(t, f"out.{name}") for name, t in zip(AttentionViews._fields, out)],
                           [(s, "slots"), (bl, "base_len"), (count, "num_reqs"), (adm, "admitted")])
        self._attention_views(s, bl, count, adm, g, K, out)
        return out

    def _group(self, op: str, group) -> int:
        g = as_int(op, group, "group")
        if not 0 <= g < len(self.groups):
            raise InvalidArgumentError(op, f"group {g} out of range 0..{len(self.groups) - 1}", g)
        return g

    def _attention_views(self, slots, base_len, num, admitted, group: int, steps: int, out: AttentionViews) -> None:
        """:meth:`attention_views` of arguments already checked (a ``DecodeStep``'s buffers)."""
        k_views.launch_attention_views(self._pool.state, self.state, self.config, slots, base_len, admitted, num,
                                       group, steps, out)

    # ---- copy-on-write (host ops) --------------------------------------------------------------
    def _pending(self) -> int:
        return int(self.state.num_copies.item())

    def _queue_copies(self, op: str, triples: list[tuple[int, int, int]]) -> None:
        n = self._pending()
        if n + len(triples) > self.config.Q:
            raise InvalidArgumentError(op, "the pending-copy queue is full; run_pending_copies first", n + len(triples))
        if triples:
            t = torch.tensor(triples, dtype=torch.int32, device=self.device)
            self.state.copy_src[n:n + len(triples)] = t[:, 0]
            self.state.copy_dst[n:n + len(triples)] = t[:, 1]
            self.state.copy_release[n:n + len(triples)] = t[:, 2]
        self.state.num_copies.fill_(n + len(triples))

    @locked
    def cow_append(self, slot: int, srcs: Sequence[int]) -> list[int]:
        """Partial prefix hit (see ``ReferenceKVCacheManager.cow_append``): one private copy per group,
        appended to the request's rows; each src is touched and held until the copy ran."""
        op = "cow_append"
        ss = as_id_list(op, srcs)
        self._pool.finish()
        r = self._slot(op, slot)
        G = len(self.groups)
        if len(ss) != G:
            raise InvalidArgumentError(op, f"need one src per group ({G}), got {len(ss)}", len(ss))
        n = int(self.state.num_blocks[r])
        if n >= self.max_blocks_per_req:
            raise InvalidArgumentError(op, f"slot {r}'s row is full", r)
        real = [x for x in ss if x != NULL_BLOCK]
        refs = self.pool.ref_counts(real) if real else []
        need = len(real) + len({x for x, c in zip(real, refs) if c == 0})
        if need > self._room(r):
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        self._check_not_pending_dst(op, real)
        if self._pending() + len(real) > self.config.Q:
            raise InvalidArgumentError(op, "the pending-copy queue is full; run_pending_copies first")
        self._draw(r, need)
        if real:
            self.pool.touch(real)
        dsts, triples = [], []
        for g, x in enumerate(ss):
            dst = int(self.pool.get_new_blocks(1)[0]) if x != NULL_BLOCK else NULL_BLOCK
            self.state.block_table[g, r, n] = dst
            if x != NULL_BLOCK:
                triples.append((x, dst, x))
            dsts.append(dst)
        self.state.num_blocks[r] = n + 1
        self._queue_copies(op, triples)
        return dsts

    @locked
    def cow_move(self, slot: int, index: int) -> list[int]:
        """A running request keeps writing its cached blocks at ``index`` (see
        ``ReferenceKVCacheManager.cow_move``): keys move to fresh blocks that receive the copies."""
        op = "cow_move"
        i = as_int(op, index, "index")
        self._pool.finish()
        r = self._slot(op, slot)
        if not 0 <= i < int(self.state.num_blocks[r]):
            raise InvalidArgumentError(op, f"slot {r} has no block at index {i}", i)
        srcs = self.state.block_table[:, r, i].tolist()
        real = [x for x in srcs if x != NULL_BLOCK]
        self._check_not_pending_dst(op, real)  # before the free count, as the reference checks
        if len(real) > self._room(r):
            raise OutOfBlocksError(op, f"copy-on-write needs {len(real)} free blocks", len(real))
        if self._pending() + len(real) > self.config.Q:
            raise InvalidArgumentError(op, "the pending-copy queue is full; run_pending_copies first")
        self._draw(r, len(real))
        dsts, triples = [], []
        for x in srcs:
            if x == NULL_BLOCK:
                dsts.append(NULL_BLOCK)
                continue
            dst = int(self.pool.get_new_blocks(1)[0])
            self.pool.move_block_hashes(x, dst)
            triples.append((x, dst, dst))
            dsts.append(dst)
        self._queue_copies(op, triples)
        return dsts

    def _check_not_pending_dst(self, op: str, srcs: list[int]) -> None:
        """A block still waiting to receive a copy cannot be copied from in the same batch."""
        pending = set(self.state.copy_dst[: self._pending()].tolist())
        for x in srcs:
            if x in pending:
                raise InvalidArgumentError(op, pending_copy_message(x), x)

    @locked
    def take_pending_copies(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drain the queue: ``(src, dst, release)`` int32 tensors, in queue order. After the copies
        have run, pass ``release`` to :meth:`release_copied`."""
        n = self._pending()
        s = self.state
        out = (s.copy_src[:n].clone(), s.copy_dst[:n].clone(), s.copy_release[:n].clone())
        s.num_copies.zero_()
        return out

    @locked
    def release_copied(self, release: torch.Tensor) -> None:
        """Drop the references the copies held (one ``free_blocks`` of ``release``, in order).
        ``release``: the int32 tensor (on the device) :meth:`take_pending_copies` returned, or a list;
        another dtype or device raises InvalidArgumentError (no silent narrowing of int64 ids)."""
        r = self._i32("release_copied", release, "release")
        self.pool.free_batched(r, torch.tensor([0, r.numel()], dtype=torch.int32, device=self.device))

    @locked
    def copy_and_release(self, kv_caches: list[torch.Tensor]) -> None:
        """The pending copies of every layer in one launch, then the release of the references they
        held and an empty queue, both only if the status word is clear (else the copies stay pending,
        so no block is lost to an earlier error). No host sync: a captured step's tail. ``kv_caches``:
        a list of contiguous ``[num_blocks, ...]`` tensors on the pool's device, each with at least the
        pool's blocks (InvalidArgumentError / ArgumentTypeError before anything runs)."""
        self.check_kv_caches("copy_and_release", kv_caches)
        self._copy_and_release(kv_caches)

    def _copy_and_release(self, kv_caches: list[torch.Tensor]) -> None:
        """:meth:`copy_and_release` of caches already checked by ``check_kv_caches``."""
        s = self.state
        if kv_caches:
            copy_blocks(kv_caches, s.copy_src, s.copy_dst, num_copies=s.num_copies, check=False,
                        offset_tables=self._copy_offsets)
        k_copies.launch_release_copies(self._pool.state, self._pool.config, s, self.config)

    @locked
    def run_pending_copies(self, kv_caches: list[torch.Tensor]) -> int:
        """Copy every pending block for every layer (one launch per dtype group), then release the
        copies' references. ``kv_caches``: per layer ``[num_blocks, ...]``. Returns the copies run.
        Raises the pool's recorded error (the copies then stay pending)."""
        self._pool.finish()
        n = self._pending()
        if n:
            copy_blocks(kv_caches, self.state.copy_src[:n], self.state.copy_dst[:n],  # checks, may raise
                        offset_tables=self._copy_offsets)
        k_copies.launch_release_copies(self._pool.state, self._pool.config, self.state, self.config)
        self._pool.finish()
        return n

    # ---- inspection -------------------------------------------------------------------------
    @locked
    def rows(self, group: int = 0) -> list[list[int]]:
        """Each slot's block table row (its first ``num_blocks`` entries), as Python lists."""
        self._pool.finish()
        n = self.state.num_blocks.tolist()
        t = self.state.block_table[group].tolist()
        return [t[r][: n[r]] for r in range(self.max_num_reqs)]

    @locked
    def validate(self) -> None:
        """The pool's invariants, then the manager's: every block's ref count equals its references
        from the active requests' block tables plus the pending copies' held blocks (so a leaked
        reference shows), when only the manager takes references; and the reservations' (docs/semantics.md
        section 8: each >= 0 and 0 on a free slot, their sum ``num_reserved``, at most the free blocks).
        Raises InvariantError."""
        self.pool.validate()
        s = self.state
        n = torch.where(s.active != 0, s.num_blocks, 0)
        in_row = torch.arange(self.max_blocks_per_req, device=self.device)[None, :] < n[:, None]  # [R, M]
        held = s.block_table[:, in_row].reshape(-1).long()  # every group's rows
        held = torch.cat([held, s.copy_release[: self._pending()].long()])
        expect = torch.bincount(held, minlength=self.pool.num_blocks)
        expect[NULL_BLOCK] = 0
        got = torch.tensor(self.pool.ref_counts(), device=self.device)
        got[NULL_BLOCK] = 0
        bad = (expect != got).nonzero().flatten().tolist()
        if bad:
            b = bad[0]
            raise InvariantError("validate", f"block {b} has ref_cnt {int(got[b])} but {int(expect[b])} "
                                             "references from block tables and pending copies", b)
        if (torch.where(s.active == 0, s.num_blocks, 0) != 0).any():
            raise InvariantError("validate", "a free slot still holds blocks")
        check_reservations(s.reserved.tolist(), [bool(a) for a in s.active.tolist()], int(s.num_reserved.item()),
                           self.pool.get_num_free_blocks())


__all__ = ["KVCacheManager", "ManagerState", "ManagerConfig", "AllocateBatch", "AttentionViews"]
