"""The device pool: ``BlockPool`` with vLLM's method names over device tensors (SPEC.md sections 1-4).

Two ways in, one state:

* The vLLM-named single ops (``get_new_blocks``, ``free_blocks``, ...) launch one kernel each, then
  wait for the device so that an error is raised at once (SPEC.md section 3), events are drained
  and reuse watchers are called.
* The batched ops (``*_batched``) take and return device tensors, counts included, and never wait:
  an op that would fail does nothing and records the error in the sticky status word, which the
  host raises at the next :meth:`check`, inspection or single op. They are safe to capture in a CUDA
  graph.

Every state change is a Triton kernel in ``gpupool.kernels``; this module checks arguments that need
no device state, packs launch arguments and translates the device's records (errors, events, reuse
log) into Python objects.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import _backend

from .errors import (
    ERRORS_BY_CODE, InvalidArgumentError, InvalidBlockIdError, InvalidCountError, NullBlockError,
    OutOfBlocksError, PoolError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored
from .keys import device_key
from .kernels import admit as k_admit
from .kernels import alloc as k_alloc
from .kernels import cache as k_cache
from .kernels import lookup as k_lookup
from .kernels import release as k_release
from .kernels import common as _c

HEAD, TAIL, NUM_FREE = _c.HEAD.value, _c.TAIL.value, _c.NUM_FREE.value
EV_COUNT, REUSE_COUNT = _c.EV_COUNT.value, _c.REUSE_COUNT.value
from .reference import NULL_BLOCK, as_group, as_id_list, as_int, check_tokens, partial_block_args
from .state import PoolState

OPS = ["", "get_new_blocks", "free_blocks", "touch", "unpin_blocks", "cache_full_blocks", "cache_partial_block",
       "move_block_hashes", "evict_blocks", "reset_prefix_cache", "allocate_batched", "free_batched", "touch_batched",
       "admission_step", "allocate_slots", "free_requests", "lookup_batched"]
OP = {name: i for i, name in enumerate(OPS) if name}
_EV_REMOVED, _EV_STORED, _EV_CLEARED = 1, 2, 3


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


class BlockPool:
    """vLLM V1's ``BlockPool`` with its state on a device (SPEC.md; layout in ``gpupool.state``).

    Args:
        num_blocks: N physical blocks, ids ``0 .. N-1`` (block 0 is the null block). N >= 1.
        enable_caching, enable_kv_cache_events, max_keys_per_block: as ``ReferenceBlockPool``.
        device: where the state lives; default ``"cuda"`` when available, else ``"cpu"`` (kernels then
            run in Triton's interpreter, which the package turns on by itself).
        ring_capacity, num_chunks: override the free-queue ring size (power of two >= N) and the key
            table's chunk count (power of two, 16 slots each, room for every key: 16 * num_chunks >=
            (N - 1) * max_keys_per_block, so the table never fills); for tests of compaction and of
            a table at its load limit.

    Ids are accepted as lists of ints or int32 tensors on the pool's device; block lists come back
    as int32 tensors on the device. Raises :class:`InvalidArgumentError` for bad sizes.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 max_keys_per_block: int = 4, device: str | torch.device | None = None,
                 ring_capacity: int | None = None, num_chunks: int | None = None):
        num_blocks = as_int("BlockPool", num_blocks, "num_blocks")
        max_keys_per_block = as_int("BlockPool", max_keys_per_block, "max_keys_per_block")
        if num_blocks < 1:
            raise InvalidArgumentError("BlockPool", f"num_blocks must be >= 1, got {num_blocks}", num_blocks)
        if not 1 <= max_keys_per_block <= 64:
            raise InvalidArgumentError("BlockPool", f"max_keys_per_block must be in 1..64, got {max_keys_per_block}",
                                       max_keys_per_block)
        if ring_capacity is not None and (ring_capacity < max(num_blocks, 2) or ring_capacity & (ring_capacity - 1)):
            raise InvalidArgumentError("BlockPool", f"ring_capacity must be a power of two >= {num_blocks}",
                                       ring_capacity)
        if num_chunks is not None and (num_chunks < 1 or num_chunks & (num_chunks - 1)
                                       or num_chunks * 16 < (num_blocks - 1) * max_keys_per_block):
            raise InvalidArgumentError("BlockPool", "num_chunks must be a power of two with room for every key "
                                       "(16 * num_chunks >= (num_blocks - 1) * max_keys_per_block)", num_chunks)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if (self.device.type == "cpu") != _backend.interpreted():
            raise InvalidArgumentError(
                "BlockPool", f"kernels were set up for {'the interpreter' if _backend.interpreted() else 'the GPU'} "
                f"(TRITON_INTERPRET={'1' if _backend.interpreted() else '0'} at import); device {self.device} needs "
                "the other")
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.max_keys_per_block = max_keys_per_block
        self.state = PoolState.allocate(num_blocks, max_keys_per_block, self.device, ring_capacity=ring_capacity,
                                        num_chunks=num_chunks, events=bool(enable_kv_cache_events))
        self._block = min(1024, max(16, _pow2_at_least(num_blocks)))
        self._warps = 8 if self._block >= 512 else 4
        self._mkp = _pow2_at_least(max_keys_per_block)
        self._keymap: dict[tuple[int, int], tuple[bytes, int]] = {}  # device key -> (hash, group)
        self._stored_meta: dict[int, tuple[bytes | None, int, int]] = {}  # op tag -> BlockStored fields
        # (first tag, end tag, resolver(tag, aux) -> BlockStored fields) of batched ops that tag by slot
        self._tag_resolvers: list[tuple[int, int, Callable]] = []
        self._next_tag = 1
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self._next_cb = 0
        self._events: list = []
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)

    # ---- launch plumbing -------------------------------------------------------------------
    def _consts(self) -> dict:
        s = self.state
        return dict(C=s.ring_capacity, MK=self.max_keys_per_block, NCHUNK=s.num_chunks,
                    CACHING=self.enable_caching, EVENTS=self.enable_kv_cache_events, EV_CAP=s.ev_capacity,
                    REUSE_CAP=s.reuse_capacity, BLOCK=self._block, num_warps=self._warps)

    def _i32(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=self.device)

    def _i64(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def _ids_arg(self, op: str, ids) -> torch.Tensor:
        """Ids as an int32 device tensor; lists are range-checked here, tensors by the kernel."""
        if isinstance(ids, torch.Tensor):
            if ids.dtype != torch.int32:
                raise InvalidArgumentError(op, f"block id tensors must be int32, got {ids.dtype}")
            if ids.device != self.device:
                raise InvalidArgumentError(op, f"block id tensor is on {ids.device}, the pool on {self.device}")
            if ids.dim() != 1:
                raise InvalidArgumentError(op, f"block id tensors must be 1-D, got shape {tuple(ids.shape)}")
            return ids.contiguous()
        out = as_id_list(op, ids)
        for b in out:
            if not 0 <= b < self.num_blocks:
                raise InvalidBlockIdError(op, f"block id {b} out of range 0..{self.num_blocks - 1}", b)
        return self._i32(out)

    def _key(self, block_hash: bytes, group_id: int) -> tuple[int, int]:
        k = device_key(block_hash, group_id)
        self._keymap[k] = (block_hash, group_id)
        return k

    def _tag(self, parent: bytes | None, block_size: int, group_id: int) -> int:
        tag = self._next_tag
        self._next_tag += 1
        if self.enable_kv_cache_events:
            self._stored_meta[tag] = (parent, block_size, group_id)
        return tag

    # ---- status, events, watchers -----------------------------------------------------------
    def check(self) -> None:
        """Wait for the device; raise the first error a batched op recorded (clearing it), drain
        events into the host queue and call the reuse watchers of blocks handed out since."""
        self._finish()

    def synchronize(self) -> None:
        self._finish()

    def _finish(self, reuse_in_registration_order: bool = False) -> None:
        s = self.state
        status = s.status.tolist()
        ctrl = s.ctrl.tolist()
        fired = []
        if ctrl[REUSE_COUNT]:
            rows = s.reuse[: ctrl[REUSE_COUNT]].tolist()
            s.ctrl[REUSE_COUNT] = 0
            if reuse_in_registration_order:
                rows.sort(key=lambda r: r[2])
            fired = [(b, self._callbacks[w]) for b, w, _ in rows]
        if ctrl[EV_COUNT]:
            self._translate_events(s.ev[: ctrl[EV_COUNT]].tolist())
            s.ctrl[EV_COUNT] = 0
        self._stored_meta.clear()  # every launched op has finished and its events are drained
        self._tag_resolvers.clear()
        for b, cb in fired:
            cb(b)
        if status[0]:
            s.status.zero_()
            code, op, value = status[0], status[1], status[2]
            cls = ERRORS_BY_CODE.get(code, PoolError)
            name = OPS[op] if 0 < op < len(OPS) else f"op {op}"
            raise cls(name, _MESSAGES.get(code, "failed") + f" ({value})", value)

    def _translate_events(self, rows) -> None:
        """Device event rows -> KV events. Consecutive stored items of one op tag form one BlockStored;
        its (parent, block size, group) come from the tag's metadata, or from the resolver of the
        batched op that owns the tag range, given the first item's ``aux``."""
        pending: list[bytes] = []
        pending_tag = None
        first_pos = 0

        def flush():
            nonlocal pending, pending_tag
            if pending:
                if pending_tag in self._stored_meta:
                    parent, bs, g = self._stored_meta.pop(pending_tag)
                else:
                    parent, bs, g = next((res(pending_tag, first_pos) for lo, hi, res in self._tag_resolvers
                                          if lo <= pending_tag < hi), (None, 0, 0))
                self._events.append(BlockStored(tuple(pending), parent, bs, g))
            pending, pending_tag = [], None

        for kind, _block, hi, lo, _grp, tag, aux in rows:
            if kind != _EV_STORED or tag != pending_tag:
                flush()
            if kind == _EV_REMOVED:
                h, g = self._keymap[(hi, lo)]
                self._events.append(BlockRemoved(h, g))
            elif kind == _EV_STORED:
                if not pending:
                    first_pos = aux
                pending.append(self._keymap[(hi, lo)][0])
                pending_tag = tag
            elif kind == _EV_CLEARED:
                self._events.append(AllBlocksCleared())
        flush()

    # ---- SPEC.md section 2: single ops --------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> torch.Tensor:
        """Take ``num_blocks`` blocks from the free queue's head, evicting their keys.

        Returns ``int32[num_blocks]`` block ids on the pool's device, each with ref_cnt 1 and no keys.
        Raises InvalidCountError (negative), OutOfBlocksError (more than free; also a ValueError).
        """
        op = "get_new_blocks"
        n = as_int(op, num_blocks, "num_blocks")
        if n < 0:
            raise InvalidCountError(op, f"cannot allocate a negative number of blocks ({n})", n)
        if n > self.num_blocks:
            raise OutOfBlocksError(op, f"cannot get {n} free blocks from a pool of {self.num_blocks}", n)
        blocks, _ = self._allocate(self._i32([n]), self._one, OP[op])
        self._finish()
        return blocks[:n].clone()

    def _allocate(self, demands: torch.Tensor, num_demands: torch.Tensor, op: int):
        s = self.state
        offsets = torch.empty(demands.numel() + 1, dtype=torch.int32, device=self.device)
        out = torch.empty(self.num_blocks + 1, dtype=torch.int32, device=self.device)
        k_alloc.alloc_kernel[(1,)](s.ctrl, s.status, s.ring, s.qslot, s.ref_cnt, s.num_keys, s.hash_ntok, s.keys,
                                   s.table, s.overflow, s.watcher_id, s.watch_seq, s.reuse, s.ev,
                                   demands, num_demands, demands.numel(), out, offsets, 0, OP=op, **self._consts())
        return out, offsets

    def free_blocks(self, ordered_blocks) -> None:
        """Release one reference per listed block (SPEC.md section 2: un-hashed blocks that reach 0
        go to the front, hashed ones to the back). Raises InvalidBlockIdError, DoubleFreeError."""
        op = "free_blocks"
        ids = self._ids_arg(op, ordered_blocks)
        m = ids.numel()
        seg = torch.zeros(m, dtype=torch.int32, device=self.device)
        self._release(ids, self._i32([m]), seg, self._i32([0, m]), None, OP[op], k_release.MODE_FREE.value)
        self._finish()

    def _release(self, ids, num_ids, seg, seg_off, cb, op, mode):
        s = self.state
        s_pf = torch.empty(ids.numel() + 1, dtype=torch.int32, device=self.device)
        cb_t = torch.full((1,), -1 if cb is None else cb, dtype=torch.int32, device=self.device)  # no H2D sync
        c = self._consts()
        k_release.release_kernel[(1,)](s.ctrl, s.status, s.ring, s.qslot, s.ref_cnt, s.num_keys, s.watcher_id,
                                       s.watch_seq, s.s_cnt, s.s_last, s.s_first, s_pf, ids, num_ids, ids.numel(), seg,
                                       seg_off, seg_off.numel() - 1, cb_t, OP=op, MODE=mode, N=self.num_blocks, C=c["C"],
                                       CACHING=self.enable_caching, BLOCK=self._block, num_warps=self._warps)

    def touch(self, blocks) -> None:
        """Prefix hit: unlink each non-null block with ref_cnt 0 from the queue, then ref_cnt += 1."""
        op = "touch"
        ids = self._ids_arg(op, blocks)
        self._touch(ids, self._i32([ids.numel()]), OP[op])
        self._finish()

    def _touch(self, ids, num_ids, op):
        s = self.state
        k_release.touch_kernel[(1,)](s.ctrl, s.status, s.ring, s.qslot, s.ref_cnt, s.s_cnt, s.s_last, s.s_first,
                                     ids, num_ids, ids.numel(), OP=op, N=self.num_blocks, BLOCK=self._block,
                                     num_warps=self._warps)

    def unpin_blocks(self, blocks, on_reuse: Callable[[int], None]) -> None:
        """Release one reference of each block and register ``on_reuse`` (called with the block id when
        the block is handed out again, or on reset). Raises InvalidBlockIdError, NullBlockError,
        DoubleFreeError, InvalidArgumentError (not callable)."""
        op = "unpin_blocks"
        ids = self._ids_arg(op, blocks)
        if not callable(on_reuse):
            raise InvalidArgumentError(op, "on_reuse must be callable")
        cb = self._next_cb
        self._next_cb += 1
        self._callbacks[cb] = on_reuse
        m = ids.numel()
        seg = torch.zeros(m, dtype=torch.int32, device=self.device)
        try:
            self._release(ids, self._i32([m]), seg, self._i32([0, m]), cb, OP[op], k_release.MODE_UNPIN.value)
            self._finish()
        except PoolError:
            del self._callbacks[cb]
            raise
        self._prune_callbacks()

    def _prune_callbacks(self) -> None:
        live = set(self.state.watcher_id.unique().tolist())
        for cb in [c for c in self._callbacks if c not in live]:
            del self._callbacks[cb]

    def cache_full_blocks(self, blocks, block_hashes: Sequence[bytes], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, group_id: int = 0, block_mask=None) -> None:
        """Key ``blocks[i]`` as ``(block_hashes[i], group_id)`` for i in ``[num_cached, num_full)``
        (SPEC.md section 2). Raises InvalidArgumentError (lengths, sizes, a block listed twice),
        InvalidBlockIdError, HashConflictError (already keyed at >= that many tokens)."""
        op = "cache_full_blocks"
        nc = as_int(op, num_cached_blocks, "num_cached_blocks")
        nf = as_int(op, num_full_blocks, "num_full_blocks")
        bs = as_int(op, block_size, "block_size")
        g = as_group(op, group_id)
        ids = self._ids_arg(op, blocks)
        if isinstance(blocks, torch.Tensor):  # ids first, as the reference (a single op may wait)
            self._check_ids_now(op, ids)
        if nc < 0:
            raise InvalidCountError(op, f"num_cached_blocks must be >= 0, got {nc}", nc)
        if bs <= 0:
            raise InvalidArgumentError(op, f"block_size must be > 0, got {bs}", bs)
        if nc >= nf or not self.enable_caching:
            return
        check_tokens(op, nf * bs, "num_full_blocks * block_size")
        if nf > ids.numel():
            raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {ids.numel()} blocks given", nf)
        if nf > len(block_hashes):
            raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {len(block_hashes)} hashes given", nf)
        for i in range(max(nc - 1, 0), nf):
            if not isinstance(block_hashes[i], (bytes, bytearray)):
                raise InvalidArgumentError(op, f"block hashes must be bytes, got {type(block_hashes[i]).__name__}")
        if block_mask is None:
            mask = torch.ones(nf - nc, dtype=torch.int8, device=self.device)
        else:
            mvals = [bool(x) for x in (block_mask.tolist() if hasattr(block_mask, "tolist") else block_mask)]
            if len(mvals) < nf - nc:
                raise InvalidArgumentError(op, f"block_mask has {len(mvals)} entries, need {nf - nc}", len(mvals))
            mask = torch.tensor(mvals[: nf - nc], dtype=torch.int8, device=self.device)
        hk = [self._key(bytes(block_hashes[i]), g) if i >= nc else (0, 0) for i in range(nf)]
        parent = bytes(block_hashes[nc - 1]) if nc > 0 else None
        tag = self._tag(parent, bs, g)
        self._cache_full(ids, self._i64([h for h, _ in hk]), self._i64([lo for _, lo in hk]), mask,
                         self._i64([nc, nf, bs, g, tag, ids.numel()]), OP[op])
        try:
            self._finish()
        except PoolError:
            self._stored_meta.pop(tag, None)
            raise

    def _cache_full(self, ids, key_hi, key_lo, mask, p, op):
        s = self.state
        k_cache.cache_full_kernel[(1,)](s.ctrl, s.status, s.num_keys, s.hash_ntok, s.keys, s.table, s.overflow, s.ev,
                                        s.s_cnt, s.s_last, s.s_first, ids, key_hi, key_lo, mask, p, OP=op,
                                        N=self.num_blocks, MK=self.max_keys_per_block, NCHUNK=s.num_chunks,
                                        EVENTS=self.enable_kv_cache_events, EV_CAP=s.ev_capacity, BLOCK=self._block,
                                        num_warps=self._warps)

    def _check_ids_now(self, op: str, ids: torch.Tensor) -> None:
        bad = ((ids < 0) | (ids >= self.num_blocks)).nonzero()
        if bad.numel():
            b = int(ids[bad[0, 0]])
            raise InvalidBlockIdError(op, f"block id {b} out of range 0..{self.num_blocks - 1}", b)

    def cache_partial_block(self, block: int, block_hashes: Sequence[bytes], num_tokens: int, group_id: int,
                            block_size: int, hash_block_size: int, replace_existing_hashes: bool = False):
        """Key a partly written block at a ``hash_block_size`` boundary (SPEC.md section 2).

        Returns the key ``(hash, group_id)``, or None for the null block or when caching is disabled.
        Raises InvalidArgumentError (sizes, too few hashes), InvalidBlockIdError, KeyCapacityError.
        """
        op = "cache_partial_block"
        b, nt, g, bs, h, parent = partial_block_args(op, self.num_blocks, block, block_hashes, num_tokens, group_id,
                                                     block_size, hash_block_size)
        if b == NULL_BLOCK or not self.enable_caching:
            return None
        hi, lo = self._key(h, g)
        tag = self._tag(parent, bs, g)
        s = self.state
        p = self._i64([b, nt, g, tag, int(bool(replace_existing_hashes)), hi, lo])
        k_cache.cache_partial_kernel[(1,)](s.ctrl, s.status, s.num_keys, s.hash_ntok, s.keys, s.table, s.overflow,
                                           s.ev, p, OP=OP[op], N=self.num_blocks, MK=self.max_keys_per_block,
                                           MKP=self._mkp, NCHUNK=s.num_chunks, EVENTS=self.enable_kv_cache_events,
                                           EV_CAP=s.ev_capacity)
        self._finish()
        return (h, g)

    def move_block_hashes(self, src: int, dst: int) -> None:
        """Copy-on-write: move every key of ``src`` to ``dst`` as newly inserted entries.
        Raises InvalidBlockIdError, NullBlockError (dst null), HashConflictError (dst keyed)."""
        op = "move_block_hashes"
        sb, db = as_int(op, src, "src"), as_int(op, dst, "dst")
        for b in (sb, db):
            if not 0 <= b < self.num_blocks:
                raise InvalidBlockIdError(op, f"block id {b} out of range 0..{self.num_blocks - 1}", b)
        if db == NULL_BLOCK:
            raise NullBlockError(op, "cannot move hashes onto the null block", db)
        s = self.state
        k_cache.move_kernel[(1,)](s.ctrl, s.status, s.num_keys, s.hash_ntok, s.keys, s.table, s.overflow,
                                  self._i64([sb, db]), OP=OP[op], N=self.num_blocks, MK=self.max_keys_per_block,
                                  MKP=self._mkp, NCHUNK=s.num_chunks)
        self._finish()

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[int] | None:
        """Earliest-inserted block under ``(block_hash, g)`` for every group, or None if any misses."""
        op = "get_cached_block"
        if not isinstance(block_hash, (bytes, bytearray)):
            raise InvalidArgumentError(op, f"block hashes must be bytes, got {type(block_hash).__name__}")
        groups = [as_group(op, g) for g in kv_cache_group_ids]
        if not groups:
            return []
        keys = [device_key(bytes(block_hash), g) for g in groups]
        out = self.lookup_batched(self._i64([k[0] for k in keys]), self._i64([k[1] for k in keys]),
                                  self._i32(groups)).tolist()
        return None if min(out) < 0 else out

    def evict_blocks(self, block_ids) -> None:
        """Remove every key of each listed block (duplicates once); ref counts and the queue unchanged."""
        op = "evict_blocks"
        ids = self._ids_arg(op, block_ids)
        s = self.state
        k_cache.evict_kernel[(1,)](s.ctrl, s.status, s.num_keys, s.hash_ntok, s.keys, s.table, s.overflow, s.ev,
                                   s.s_cnt, s.s_last, s.s_first, ids, self._i32([ids.numel()]), 0, OP=OP[op],
                                   N=self.num_blocks, MK=self.max_keys_per_block, NCHUNK=s.num_chunks,
                                   EVENTS=self.enable_kv_cache_events, EV_CAP=s.ev_capacity, BLOCK=self._block,
                                   num_warps=self._warps)
        self._finish()

    def reset_prefix_cache(self) -> bool:
        """Drop every key and fire all watchers if no block is held; else return False, changing nothing."""
        self._finish()
        s = self.state
        out = torch.zeros(1, dtype=torch.int32, device=self.device)
        k_cache.reset_kernel[(1,)](s.ctrl, s.status, s.ref_cnt, s.num_keys, s.hash_ntok, s.table, s.overflow,
                                   s.watcher_id, s.watch_seq, s.reuse, s.ev, out, OP=OP["reset_prefix_cache"],
                                   N=self.num_blocks, NCHUNK=s.num_chunks, EVENTS=self.enable_kv_cache_events,
                                   EV_CAP=s.ev_capacity, REUSE_CAP=s.reuse_capacity, BLOCK=self._block,
                                   num_warps=self._warps)
        self._finish(reuse_in_registration_order=True)
        done = bool(out.item())
        if done:
            self._callbacks.clear()
        return done

    def is_block_writable(self, block: int) -> bool:
        b = as_int("is_block_writable", block, "block id")
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockIdError("is_block_writable", f"block id {b} out of range", b)
        self._finish()
        s = self.state
        return b != NULL_BLOCK and int(s.ref_cnt[b]) == 1 and int(s.num_keys[b]) == 0

    def get_num_free_blocks(self) -> int:
        self._finish()
        return int(self.state.ctrl[NUM_FREE])

    def get_usage(self) -> float:
        if self.num_blocks == 1:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def take_events(self) -> list:
        self._finish()
        ev, self._events = self._events, []
        return ev

    # ---- batched ops: device tensors in and out, no host synchronisation -----------------------
    def allocate_batched(self, demands: torch.Tensor, num_demands: torch.Tensor | None = None):
        """Many ``get_new_blocks`` demands in batch order, as one op (all or nothing).

        ``demands: int32[B]`` on the device (``num_demands: int32[1]`` may say only the first k count).
        Returns ``(blocks: int32[N + 1], offsets: int32[B + 1])``: demand k got
        ``blocks[offsets[k]:offsets[k+1]]``. Errors go to the status word (raised by :meth:`check`).
        """
        demands = self._dev_i32("allocate_batched", demands, "demands")
        if num_demands is None:
            num_demands = torch.full((1,), demands.numel(), dtype=torch.int32, device=self.device)
        return self._allocate(demands, num_demands, OP["allocate_batched"])

    def free_batched(self, ids: torch.Tensor, seg_offsets: torch.Tensor, num_ids: torch.Tensor | None = None) -> None:
        """Many ``free_blocks`` calls in one op: segment j (``ids[seg_offsets[j]:seg_offsets[j+1]]``) is
        the j-th call, in order (a request's blocks reversed, typically). ``ids: int32[M]``,
        ``seg_offsets: int32[S + 1]`` with ``seg_offsets[-1] == M``. Errors go to the status word."""
        ids = self._dev_i32("free_batched", ids, "ids")
        seg_offsets = self._dev_i32("free_batched", seg_offsets, "seg_offsets")
        if seg_offsets.numel() < 1:
            raise InvalidArgumentError("free_batched", "seg_offsets needs at least one entry (0)")
        m = ids.numel()
        if num_ids is None:
            num_ids = torch.full((1,), m, dtype=torch.int32, device=self.device)
        pos = torch.arange(m, dtype=torch.int32, device=self.device)
        seg = (torch.searchsorted(seg_offsets[1:].contiguous(), pos, right=True)).to(torch.int32)
        self._release(ids, num_ids, seg, seg_offsets, None, OP["free_batched"], k_release.MODE_FREE.value)

    def touch_batched(self, ids: torch.Tensor, num_ids: torch.Tensor | None = None) -> None:
        """``touch`` of many blocks (order-free: one launch equals any sequence of touches)."""
        ids = self._dev_i32("touch_batched", ids, "ids")
        if num_ids is None:
            num_ids = torch.full((1,), ids.numel(), dtype=torch.int32, device=self.device)
        self._touch(ids, num_ids, OP["touch_batched"])

    def lookup_batched(self, key_hi: torch.Tensor, key_lo: torch.Tensor, key_group: torch.Tensor,
                       num_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Earliest-inserted block per device key (``gpupool.keys.device_key``), -1 on a miss.
        ``key_hi, key_lo: int64[K]``, ``key_group: int32[K]``; returns ``int32[K]``. Read-only. Raises
        InvalidArgumentError for other dtypes, devices, shapes or lengths."""
        op = "lookup_batched"
        for t, dt, what in ((key_hi, torch.int64, "key_hi"), (key_lo, torch.int64, "key_lo"),
                            (key_group, torch.int32, "key_group")):
            if not isinstance(t, torch.Tensor) or t.dtype != dt or t.device != self.device or t.dim() != 1:
                raise InvalidArgumentError(op, f"{what} must be a 1-D {dt} tensor on {self.device}")
        if not key_hi.numel() == key_lo.numel() == key_group.numel():
            raise InvalidArgumentError(op, "key_hi, key_lo and key_group differ in length")
        s = self.state
        k = key_hi.numel()
        out = torch.empty(k, dtype=torch.int32, device=self.device)
        if num_keys is None:
            num_keys = torch.full((1,), k, dtype=torch.int32, device=self.device)
        blk = 256
        k_lookup.lookup_kernel[(max(1, -(-k // blk)),)](s.table, s.overflow, s.keys, key_hi, key_lo, key_group,
                                                        num_keys, k, out, s.status, MK=self.max_keys_per_block,
                                                        NCHUNK=s.num_chunks, BLOCK=blk, num_warps=4)
        return out

    def longest_prefix_batched(self, key_hi: torch.Tensor, key_lo: torch.Tensor, groups: torch.Tensor,
                               lengths: torch.Tensor):
        """Longest cached prefix of R hash chains, all groups hitting at each position.

        ``key_hi, key_lo: int64[R, G, L]`` (device keys of request r's chain in group g),
        ``groups: int32[G]``, ``lengths: int32[R]`` (positions to consider, <= L). Returns
        ``(hits: int32[R], blocks: int32[R, G, L], zero_ref: int32[R])``: the hit length, the hit
        blocks (first ``hits[r]`` valid) and how many of them have ref_cnt 0. Read-only."""
        s = self.state
        r, g, length = key_hi.shape
        hits = torch.empty(r, dtype=torch.int32, device=self.device)
        blocks = torch.full((r, g, length), -1, dtype=torch.int32, device=self.device)
        zero_ref = torch.empty(r, dtype=torch.int32, device=self.device)
        if r == 0:
            return hits, blocks, zero_ref
        k_lookup.longest_prefix_kernel[(r,)](s.table, s.overflow, s.keys, s.ref_cnt, key_hi.contiguous(),
                                             key_lo.contiguous(), groups, torch.full((1,), g, dtype=torch.int32,
                                                                                     device=self.device),
                                             lengths, torch.full((1,), r, dtype=torch.int32, device=self.device),
                                             length, hits, blocks, zero_ref, MK=self.max_keys_per_block,
                                             NCHUNK=s.num_chunks, BLOCK=min(256, max(16, _pow2_at_least(length))),
                                             num_warps=4)
        return hits, blocks, zero_ref

    def admission_step(self, requests: dict, line: torch.Tensor, line_waiting: torch.Tensor, events: torch.Tensor,
                       free_ids: torch.Tensor, free_offsets: torch.Tensor, out_offsets: torch.Tensor,
                       out_capacity: int, *, block_size: int, group_id: int = 0) -> dict:
        """One scheduler step of frees and arrivals with head-of-line admission, as one op (no sync).

        ``requests``: device tensors describing every request once (index r): ``chain_hi, chain_lo:
        int64[K]`` device keys of all full prompt blocks, ``chain_off: int64[R]`` where request r's
        chain starts, ``full, hitcap, total: int32[R]`` (full blocks, positions that may hit, blocks
        needed). ``line: int32[L]`` request indices in line order, the first ``line_waiting[0]`` waiting
        already; ``events: int32[E]``: ``j >= 0`` frees segment j of ``free_ids`` (bounds in
        ``free_offsets: int32[S+1]``), -1 reveals the next arrival. ``out_offsets: int64[L]`` where line
        position k's blocks go in an ``int32[out_capacity]`` output.

        Equals, op for op, the sequence: for each event, its ``free_blocks`` or arrival, then admit
        the line in order until the first request that does not fit (``touch`` hits,
        ``get_new_blocks``, ``cache_full_blocks``) (SPEC.md section 5). Returns device tensors
        ``result`` (int32[L]: 0 waiting, 1 admitted, 2 rejected), ``hits`` (int32[L]), ``free_after``
        (int64[L], free blocks right after each admission) and ``blocks`` (int32[out_capacity]).
        Errors (bad ids, a free below zero) go to the status word and change nothing.
        """
        s = self.state
        L = line.numel()
        result = torch.zeros(L, dtype=torch.int32, device=self.device)
        hits = torch.zeros(L, dtype=torch.int32, device=self.device)
        free_after = torch.zeros(L, dtype=torch.int64, device=self.device)
        blocks = torch.zeros(max(out_capacity, 1), dtype=torch.int32, device=self.device)
        tag0 = self._next_tag
        self._next_tag += int(requests["total"].numel())
        dev = self.device
        k_admit.admission_step_kernel[(1,)](
            s.ctrl, s.status, s.ring, s.qslot, s.ref_cnt, s.num_keys, s.hash_ntok, s.keys, s.table, s.overflow,
            s.watcher_id, s.watch_seq, s.reuse, s.ev, s.s_cnt, s.s_last, s.s_first,
            requests["chain_hi"], requests["chain_lo"], requests["chain_off"], requests["full"], requests["hitcap"],
            requests["total"], line, line_waiting, events,
            torch.full((1,), events.numel(), dtype=torch.int32, device=dev), free_ids, free_offsets,
            torch.full((1,), free_ids.numel(), dtype=torch.int32, device=dev),
            result, hits, out_offsets, blocks, free_after, int(block_size), int(group_id), tag0,
            N=self.num_blocks, C=s.ring_capacity, MK=self.max_keys_per_block, NCHUNK=s.num_chunks,
            CACHING=self.enable_caching, EVENTS=self.enable_kv_cache_events, EV_CAP=s.ev_capacity,
            BLOCK=self._block, num_warps=self._warps)
        return {"result": result, "hits": hits, "free_after": free_after, "blocks": blocks}

    def _dev_i32(self, op: str, t, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(op, f"{what} must be a torch.Tensor on {self.device}")
        if t.dtype != torch.int32:
            raise InvalidArgumentError(op, f"{what} must be int32, got {t.dtype}")
        if t.device != self.device:
            raise InvalidArgumentError(op, f"{what} is on {t.device}, the pool on {self.device}")
        return t.reshape(-1).contiguous()

    # ---- inspection (SPEC.md section 4) -------------------------------------------------------
    def free_queue(self) -> list[int]:
        """Free block ids, head to tail (the live ring slots in position order)."""
        self._finish()
        s = self.state
        head, tail = int(s.ctrl[HEAD]), int(s.ctrl[TAIL])
        c = s.ring_capacity
        pos = torch.arange(head, tail, dtype=torch.int64, device=self.device) & (c - 1)
        vals = s.ring[pos].tolist()
        return [v for v in vals if v >= 0]

    def ref_counts(self, blocks=None) -> list[int]:
        self._finish()
        if blocks is None:
            return self.state.ref_cnt.tolist()
        ids = self._ids_arg("ref_counts", blocks)
        self._check_ids_now("ref_counts", ids)
        return self.state.ref_cnt[ids.long()].tolist()

    def block_keys(self, block: int) -> list[tuple[bytes, int]]:
        """The block's keys, primary first, as ``(hash, group)``."""
        b = as_int("block_keys", block, "block id")
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockIdError("block_keys", f"block id {b} out of range", b)
        self._finish()
        nk = int(self.state.num_keys[b])
        rows = self.state.keys[b * self.max_keys_per_block: b * self.max_keys_per_block + nk].tolist()
        return [self._keymap[(r[0], r[1])] for r in rows]

    def block_hash_num_tokens(self, block: int) -> int | None:
        b = as_int("block_hash_num_tokens", block, "block id")
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockIdError("block_hash_num_tokens", f"block id {b} out of range", b)
        self._finish()
        v = int(self.state.hash_ntok[b])
        return None if v < 0 else v

    def num_watchers(self) -> int:
        self._finish()
        return int((self.state.watcher_id >= 0).sum())

    def validate(self) -> None:
        """Check every invariant of SPEC.md section 1 and of the device layout (ring R1-R5 of
        DESIGN-NOTES.md, key rows against the table); raise InvariantError at the first violation."""
        from .validate import validate_state
        self._finish()
        validate_state(self)


_MESSAGES = {
    2: "not enough free blocks for the requested total",
    3: "negative block count",
    4: "block id out of range",
    5: "the null block is not allowed here",
    6: "ref count would go below zero (double free)",
    7: "block already cached at >= this many tokens, or destination already keyed",
    8: "a block would exceed max_keys_per_block keys",
    9: "invalid argument: a block or slot listed twice, or a count or offsets that do not fit their arrays",
    10: "invariant violated",
    11: "device event buffer or reuse log full; drain them (take_events / check) between batched ops",
}
