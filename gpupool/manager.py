"""The request layer on the device: vLLM's KVCacheManager over ``BlockPool`` (block tables, batched
admission and frees, prefix hits, KV-cache groups, copy-on-write queue).

State (device tensors, allocated at construction): ``block_table: int32[G, R, M]`` (group, request
slot, block index; 0 is the null block), ``num_blocks: int32[R]`` (row length, equal across groups),
``num_computed: int32[R]`` (tokens with slots), ``num_cached: int32[G, R]`` (blocks already keyed),
``req_hi, req_lo: int64[R, G, M * K]`` (device keys of each known hash block's hash, per group; K =
block_size / hash_block_size),
``num_hashes: int32[R]``, the pending-copy queue ``copy_src, copy_dst, copy_release: int32[Q]`` with
``num_copies: int32[1]``.

Semantics, op by op, are those of ``gpupool.reference.ReferenceKVCacheManager`` (the oracle):

* ``add_request(slot, hashes)`` / ``append_block_hashes``: the hashes of a request's full blocks.
* ``allocate_slots(slots, num_tokens, target_tokens, lookup)``: requests in order; for each: free the
  sliding-window blocks that left the window (null block in their place), take the longest cached
  prefix (``lookup``; all groups hitting; capped at ``num_tokens - 1`` tokens), and if
  ``new blocks x groups + zero-ref hits <= free``: touch every group's hits, then allocate each
  group's new blocks, then key the blocks that became full. All or nothing per request.
* ``free(slots)``: each request's rows freed tail first, group by group, requests in order.
* ``slot_mapping``: ``block_table[g, slot, pos // bs] * bs + pos % bs``.
* Copy-on-write: ``cow_append`` (a partial hit: a private copy of a cached block, the source held
  until the copy ran) and ``cow_move`` (a running request keeps writing a cached block: its keys move
  to a fresh block that receives the copy). ``run_pending_copies(kv_caches)`` copies all pending
  blocks of all layers in one launch and then drops the references the copies held.

The batched calls take device tensors (counts too) and never wait for the device; errors go to the
pool's status word (``check()``). The host ops (add_request, cow_*) may wait.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InvalidArgumentError, OutOfBlocksError
from .kernels import manager as k_manager
from .pool import BlockPool
from .reference import NULL_BLOCK, as_id_list, as_int, set_manager_shape


class KVCacheManager:
    """KV cache manager on the device (see the module docstring; the contract is
    ``ReferenceKVCacheManager``).

    Args:
        num_blocks: blocks in the shared pool (block 0 is the null block).
        block_size: tokens per block, all groups.
        max_num_reqs, max_blocks_per_req: block table shape (R, M).
        groups: per KV-cache group "full" or ("sliding_window", tokens); group g keys with group id g.
        max_pending_copies: capacity of the copy-on-write queue.
        Other keywords go to :class:`BlockPool` (``enable_caching``, ``enable_kv_cache_events``,
        ``max_keys_per_block``, ``device``).
    """

    def __init__(self, num_blocks: int, *, block_size: int, max_num_reqs: int, max_blocks_per_req: int,
                 groups=("full",), hash_block_size: int | None = None, max_pending_copies: int = 1024, **pool_kw):
        set_manager_shape(self, block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups)
        self.pool = BlockPool(num_blocks, **pool_kw)
        dev = self.device = self.pool.device
        G, R, M = len(self.groups), self.max_num_reqs, self.max_blocks_per_req
        i32, i64 = torch.int32, torch.int64
        self.block_table = torch.zeros((G, R, M), dtype=i32, device=dev)
        self.num_blocks = torch.zeros(R, dtype=i32, device=dev)
        self.num_computed = torch.zeros(R, dtype=i32, device=dev)
        self.num_cached = torch.zeros((G, R), dtype=i32, device=dev)
        K = self.hashes_per_block
        self.req_hi = torch.zeros((R, G, M * K), dtype=i64, device=dev)
        self.req_lo = torch.zeros((R, G, M * K), dtype=i64, device=dev)
        self.num_hashes = torch.zeros(R, dtype=i32, device=dev)
        self.active = torch.zeros(R, dtype=torch.int8, device=dev)  # slot in use (add_request .. free)
        self.windows = torch.tensor([w for _, w in self.groups], dtype=i32, device=dev)
        self.copy_src = torch.zeros(max_pending_copies, dtype=i32, device=dev)
        self.copy_dst = torch.zeros(max_pending_copies, dtype=i32, device=dev)
        self.copy_release = torch.zeros(max_pending_copies, dtype=i32, device=dev)
        self.num_copies = torch.zeros(1, dtype=i32, device=dev)
        self._s_req = torch.zeros(R, dtype=i32, device=dev)
        self._scratch = torch.zeros(M, dtype=i32, device=dev)
        self._hashes: list[list[bytes]] = [[] for _ in range(R)]  # host copy, for KV event parents
        self._active = [False] * R
        self._pending_host = 0

    # ---- host ops ----------------------------------------------------------------------------
    def _slot(self, op: str, slot, active: bool | None = True) -> int:
        r = as_int(op, slot, "slot")
        if not 0 <= r < self.max_num_reqs:
            raise InvalidArgumentError(op, f"slot {r} out of range 0..{self.max_num_reqs - 1}", r)
        if active is not None and self._active[r] != active:
            raise InvalidArgumentError(op, f"slot {r} is {'not ' if active else ''}in use", r)
        return r

    def _write_hashes(self, r: int, start: int, hashes: list[bytes]) -> None:
        if not hashes:
            return
        keys = [[self.pool._key(h, g) for h in hashes] for g in range(len(self.groups))]
        hi = torch.tensor([[k[0] for k in row] for row in keys], dtype=torch.int64, device=self.device)
        lo = torch.tensor([[k[1] for k in row] for row in keys], dtype=torch.int64, device=self.device)
        self.req_hi[r, :, start:start + len(hashes)] = hi
        self.req_lo[r, :, start:start + len(hashes)] = lo
        self.num_hashes[r] = start + len(hashes)

    def add_request(self, slot: int, block_hashes: Sequence[bytes] = ()) -> None:
        """Start a request in a free slot with the hashes of its known full blocks.
        Raises InvalidArgumentError (slot in use or out of range, too many hashes, non-bytes)."""
        op = "add_request"
        r = self._slot(op, slot, active=False)
        hs = [bytes(x) if isinstance(x, (bytes, bytearray)) else None for x in block_hashes]
        if None in hs:
            raise InvalidArgumentError(op, "block hashes must be bytes")
        if len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, f"{len(hs)} block hashes exceed max_blocks_per_req", len(hs))
        self.pool.check()
        if int(self.num_blocks[r]) != 0:
            raise InvalidArgumentError(op, f"slot {r} still holds blocks", r)
        self._active[r] = True
        self._hashes[r] = hs
        self.active[r] = 1
        self.num_computed[r] = 0
        self.num_cached[:, r] = 0
        self.num_hashes[r] = 0
        self._write_hashes(r, 0, hs)

    def append_block_hashes(self, slot: int, block_hashes: Sequence[bytes]) -> None:
        """Hashes of further full blocks of a running request (tokens it has generated)."""
        op = "append_block_hashes"
        r = self._slot(op, slot)
        hs = [bytes(x) if isinstance(x, (bytes, bytearray)) else None for x in block_hashes]
        if None in hs:
            raise InvalidArgumentError(op, "block hashes must be bytes")
        start = len(self._hashes[r])
        if start + len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, "block hashes exceed max_blocks_per_req", start + len(hs))
        self._hashes[r].extend(hs)
        self._write_hashes(r, start, hs)

    # ---- batched ops (device tensors, no host sync) -------------------------------------------
    def _i32(self, op: str, x, what: str) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            if x.dtype != torch.int32 or x.device != self.device:
                raise InvalidArgumentError(op, f"{what} must be an int32 tensor on {self.device}")
            return x.reshape(-1).contiguous()
        return torch.tensor(as_id_list(op, x), dtype=torch.int32, device=self.device)

    def get_computed_blocks(self, slots, num_tokens):
        """Longest cached prefix of each request's hashes, all groups hitting, capped at
        ``(num_tokens - 1) // block_size`` blocks. ``slots, num_tokens: int32[B]``. Returns
        ``(hits: int32[B], blocks: int32[B, G, M])`` on the device (first ``hits[b]`` valid). Read-only;
        the slots are checked on the host (a tensor of slots is read back: this op waits)."""
        op = "get_computed_blocks"
        rs = slots.tolist() if isinstance(slots, torch.Tensor) else as_id_list(op, slots)  # a host check
        for r in rs:
            self._slot(op, r)
        if len(set(rs)) != len(rs):
            raise InvalidArgumentError(op, "a slot is listed twice")
        s = self._i32(op, slots, "slots").long()
        nt = self._i32(op, num_tokens, "num_tokens")
        if s.numel() != nt.numel():
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        K = self.hashes_per_block
        cap = torch.minimum(torch.clamp(nt - 1, min=0) // self.block_size, self.num_hashes[s] // K)
        if not self.pool.enable_caching:
            cap = torch.zeros_like(cap)
        groups = torch.arange(len(self.groups), dtype=torch.int32, device=self.device)
        full_hi = self.req_hi[s][:, :, K - 1::K].contiguous()
        full_lo = self.req_lo[s][:, :, K - 1::K].contiguous()
        hits, blocks, _ = self.pool.longest_prefix_batched(full_hi, full_lo, groups, cap.to(torch.int32).contiguous())
        return hits, blocks

    def allocate_slots(self, slots, num_tokens, target_tokens, lookup=None, num_reqs=None,
                       stop_on_failure: bool = True) -> torch.Tensor:
        """Blocks for ``target_tokens`` tokens for each request, in order, all or nothing per request
        (see ``ReferenceKVCacheManager.allocate_slots``). ``slots, num_tokens, target_tokens:
        int32[B]``, ``lookup: int8/bool[B]`` (take prefix hits: new requests), ``num_reqs: int32[1]``
        (only the first k count). Returns ``admitted: int32[B]``. No host sync."""
        op = "allocate_slots"
        s = self._i32(op, slots, "slots")
        nt = self._i32(op, num_tokens, "num_tokens")
        tg = self._i32(op, target_tokens, "target_tokens")
        b = s.numel()
        if lookup is None:
            lk = torch.zeros(b, dtype=torch.int8, device=self.device)
        elif isinstance(lookup, torch.Tensor):
            lk = lookup.to(torch.int8)
        else:
            lk = torch.tensor([bool(x) for x in lookup], dtype=torch.int8, device=self.device)
        if not nt.numel() == tg.numel() == lk.numel() == b:
            raise InvalidArgumentError(op, "slots, num_tokens, target_tokens and lookup differ in length")
        if num_reqs is None:
            num_reqs = torch.full((1,), b, dtype=torch.int32, device=self.device)
        admitted = torch.zeros(max(b, 1), dtype=torch.int32, device=self.device)
        p, st = self.pool, self.pool.state
        G = len(self.groups)
        R, K = self.max_num_reqs, self.hashes_per_block
        tag0 = p._next_tag
        p._next_tag += 2 * R * G
        if p.enable_kv_cache_events:
            chains, bs = list(self._hashes), self.block_size  # the hash lists as of this call

            def resolve(tag, aux):  # full blocks of slot r from block aux on; or slot r's partial key aux
                i = tag - tag0
                partial, (r, g) = i >= R * G, divmod(i % (R * G), G)
                chain = chains[r]
                j = aux - 1 if partial else aux * K - 1
                return (chain[j] if 0 <= j < len(chain) and aux > 0 else None), bs, g

            p._tag_resolvers.append((tag0, tag0 + 2 * R * G, resolve))
        k_manager.allocate_slots_kernel[(1,)](
            st.ctrl, st.status, st.ring, st.qslot, st.ref_cnt, st.num_keys, st.hash_ntok, st.keys, st.table,
            st.overflow, st.watcher_id, st.watch_seq, st.reuse, st.ev, st.s_cnt, st.s_last, st.s_first,
            self.block_table, self.num_blocks, self.num_computed, self.num_cached, self.req_hi, self.req_lo,
            self.num_hashes, self.windows, self.active, self._s_req, self._scratch, s, nt, tg, lk, num_reqs, b,
            admitted,
            self.block_size, tag0, G=G, R=self.max_num_reqs, M=self.max_blocks_per_req, K=self.hashes_per_block,
            N=p.num_blocks,
            C=st.ring_capacity, MK=p.max_keys_per_block, NCHUNK=st.num_chunks, CACHING=p.enable_caching,
            EVENTS=p.enable_kv_cache_events, EV_CAP=st.ev_capacity, STOP_ON_FAILURE=bool(stop_on_failure),
            BLOCK=p._block, num_warps=p._warps)
        return admitted[:b]

    def free(self, slots, num_reqs=None) -> None:
        """Finish requests in order: every group's row freed tail first, counts reset. No host sync
        for tensor input; a list of slots is also checked (in use) on the host."""
        op = "free"
        if not isinstance(slots, torch.Tensor):
            rs = as_id_list(op, slots)
            for r in rs:
                self._slot(op, r)
            if len(set(rs)) != len(rs):
                raise InvalidArgumentError(op, "a slot is listed twice")
        s = self._i32(op, slots, "slots")
        if num_reqs is None:
            num_reqs = torch.full((1,), s.numel(), dtype=torch.int32, device=self.device)
        p, st = self.pool, self.pool.state
        k_manager.free_requests_kernel[(1,)](
            st.ctrl, st.status, st.ring, st.qslot, st.ref_cnt, st.num_keys, st.s_cnt, st.s_last,
            self.block_table, self.num_blocks, self.num_computed, self.num_cached, self.num_hashes, self.active,
            self._s_req, self._scratch, s, num_reqs, s.numel(), G=len(self.groups), R=self.max_num_reqs, M=self.max_blocks_per_req,
            C=st.ring_capacity, CACHING=p.enable_caching, BLOCK=p._block, num_warps=p._warps)
        if not isinstance(slots, torch.Tensor):
            for r in rs:
                self._active[r] = False
                self._hashes[r] = []

    def finish(self, slots) -> None:
        """Mark slots freed by a tensor-driven :meth:`free` (e.g. in a captured step) as free on the host."""
        for r in as_id_list("finish", slots):
            self._active[self._slot("finish", r, active=None)] = False
            self._hashes[r] = []

    def slot_mapping(self, slots: torch.Tensor, positions: torch.Tensor, group: int = 0) -> torch.Tensor:
        """``int64[T]`` KV slot of each token: ``block_table[group, slots[t], positions[t] // bs] * bs +
        positions[t] % bs`` (``slots, positions``: integer tensors on the device). No host sync; a
        position past the request's blocks reads the null block or a stale entry (caller's contract)."""
        bs = self.block_size
        blk = self.block_table[group, slots.long(), positions.long() // bs].long()
        return blk * bs + positions.long() % bs

    # ---- copy-on-write (host ops) --------------------------------------------------------------
    def _queue_copies(self, triples: list[tuple[int, int, int]]) -> None:
        n = self._pending_host
        if n + len(triples) > self.copy_src.numel():
            raise InvalidArgumentError("copy_on_write", "the pending-copy queue is full; run_pending_copies first",
                                       n + len(triples))
        for i, (a, b, c) in enumerate(triples):
            self.copy_src[n + i], self.copy_dst[n + i], self.copy_release[n + i] = a, b, c
        self._pending_host = n + len(triples)
        self.num_copies.fill_(self._pending_host)

    def cow_append(self, slot: int, srcs: Sequence[int]) -> list[int]:
        """Partial prefix hit (see ``ReferenceKVCacheManager.cow_append``): one private copy per group,
        appended to the request's rows; each src is touched and held until the copy ran."""
        op = "cow_append"
        r = self._slot(op, slot)
        G = len(self.groups)
        ss = as_id_list(op, srcs)
        if len(ss) != G:
            raise InvalidArgumentError(op, f"need one src per group ({G}), got {len(ss)}", len(ss))
        self.pool.check()
        n = int(self.num_blocks[r])
        if n >= self.max_blocks_per_req:
            raise InvalidArgumentError(op, f"slot {r}'s row is full", r)
        real = [x for x in ss if x != NULL_BLOCK]
        refs = self.pool.ref_counts(real) if real else []
        need = len(real) + len({x for x, c in zip(real, refs) if c == 0})
        if need > self.pool.get_num_free_blocks():
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        self._check_not_pending_dst(op, real)
        if self._pending_host + len(real) > self.copy_src.numel():
            raise InvalidArgumentError(op, "the pending-copy queue is full; run_pending_copies first")
        if real:
            self.pool.touch(real)
        dsts, triples = [], []
        for g, x in enumerate(ss):
            dst = int(self.pool.get_new_blocks(1)[0]) if x != NULL_BLOCK else NULL_BLOCK
            self.block_table[g, r, n] = dst
            if x != NULL_BLOCK:
                triples.append((x, dst, x))
            dsts.append(dst)
        self.num_blocks[r] = n + 1
        self._queue_copies(triples)
        return dsts

    def cow_move(self, slot: int, index: int) -> list[int]:
        """A running request keeps writing its cached blocks at ``index`` (see
        ``ReferenceKVCacheManager.cow_move``): keys move to fresh blocks that receive the copies."""
        op = "cow_move"
        r = self._slot(op, slot)
        i = as_int(op, index, "index")
        self.pool.check()
        if not 0 <= i < int(self.num_blocks[r]):
            raise InvalidArgumentError(op, f"slot {r} has no block at index {i}", i)
        srcs = self.block_table[:, r, i].tolist()
        real = [x for x in srcs if x != NULL_BLOCK]
        if len(real) > self.pool.get_num_free_blocks():
            raise OutOfBlocksError(op, f"copy-on-write needs {len(real)} free blocks", len(real))
        self._check_not_pending_dst(op, real)
        if self._pending_host + len(real) > self.copy_src.numel():
            raise InvalidArgumentError(op, "the pending-copy queue is full; run_pending_copies first")
        dsts, triples = [], []
        for x in srcs:
            if x == NULL_BLOCK:
                dsts.append(NULL_BLOCK)
                continue
            dst = int(self.pool.get_new_blocks(1)[0])
            self.pool.move_block_hashes(x, dst)
            triples.append((x, dst, dst))
            dsts.append(dst)
        self._queue_copies(triples)
        return dsts

    def _check_not_pending_dst(self, op: str, srcs: list[int]) -> None:
        """A block still waiting to receive a copy cannot be copied from in the same batch."""
        pending = set(self.copy_dst[: self._pending_host].tolist())
        for x in srcs:
            if x in pending:
                raise InvalidArgumentError(op, f"block {x} still waits for a pending copy; run_pending_copies first", x)

    def take_pending_copies(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drain the queue: ``(src, dst, release)`` int32 tensors, in queue order. After the copies
        have run, pass ``release`` to :meth:`release_copied`."""
        n = self._pending_host
        out = (self.copy_src[:n].clone(), self.copy_dst[:n].clone(), self.copy_release[:n].clone())
        self._pending_host = 0
        self.num_copies.zero_()
        return out

    def release_copied(self, release: torch.Tensor) -> None:
        """Drop the references the copies held (one ``free_blocks`` of ``release``, in order)."""
        r = release.to(torch.int32).contiguous()
        self.pool.free_batched(r, torch.tensor([0, r.numel()], dtype=torch.int32, device=self.device))

    def run_pending_copies(self, kv_caches: list[torch.Tensor]) -> int:
        """Copy every pending block for every layer (one launch per dtype group), then release the
        copies' references. ``kv_caches``: per layer ``[num_blocks, ...]``. Returns the copies run."""
        from .kernels.copy_blocks import copy_blocks

        n = self._pending_host
        if n:
            copy_blocks(kv_caches, self.copy_src[:n], self.copy_dst[:n])  # raises before the queue is drained
        src, dst, release = self.take_pending_copies()
        if n:
            self.release_copied(release)
        return n

    # ---- inspection -------------------------------------------------------------------------
    def rows(self, group: int = 0) -> list[list[int]]:
        """Each slot's block table row (its first ``num_blocks`` entries), as Python lists."""
        self.pool.check()
        n = self.num_blocks.tolist()
        t = self.block_table[group].tolist()
        return [t[r][: n[r]] for r in range(self.max_num_reqs)]
