"""The reference block pool: docs/semantics.md sections 1 to 4 as plain Python (the CPU oracle).

Every device op is tested against :class:`ReferenceBlockPool`. It keeps vLLM V1's structures: a
doubly linked free queue (``popleft_n`` / ``prepend_n`` / ``append_n`` / ``remove``, all O(length)),
and a multi-valued key map where a lookup returns the earliest-inserted block still mapped.
Every op validates its whole input first and only then changes state, so an error leaves the pool
exactly as it was (docs/semantics.md section 3). Every public op holds the pool's lock.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..args import (
    NULL_BLOCK, as_groups, as_id_list, as_int, cache_full_args, check_block_id, check_hash, num_blocks_arg,
    partial_block_args,
)
from ..errors import (
    ArgumentTypeError, DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidCountError,
    InvariantError, KeyCapacityError, NullBlockError, OutOfBlocksError, double_free_message, out_of_blocks_message,
)
from ..events import AllBlocksCleared, BlockRemoved, BlockStored
from ..locking import Locked, locked, new_lock

Key = tuple[bytes, int]  # (block_hash, group_id), docs/semantics.md section 1
_NIL = -1


class _FreeQueue:
    """vLLM's FreeKVCacheBlockQueue over integer ids: arrays of prev/next links, head and tail."""

    def __init__(self, n: int):
        self.prev = [_NIL] * n
        self.next = [_NIL] * n
        self.queued = [False] * n
        self.head = self.tail = _NIL
        self.size = 0

    def _link_after_tail(self, b: int) -> None:
        self.prev[b], self.next[b] = self.tail, _NIL
        if self.tail == _NIL:
            self.head = b
        else:
            self.next[self.tail] = b
        self.tail = b
        self.queued[b] = True
        self.size += 1

    def append_n(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self._link_after_tail(b)

    def prepend_n(self, blocks: Sequence[int]) -> None:
        """Put ``blocks`` at the front; ``blocks[0]`` becomes the new head."""
        for b in reversed(blocks):
            self.prev[b], self.next[b] = _NIL, self.head
            if self.head == _NIL:
                self.tail = b
            else:
                self.prev[self.head] = b
            self.head = b
            self.queued[b] = True
            self.size += 1

    def remove(self, b: int) -> None:
        p, n = self.prev[b], self.next[b]
        if p == _NIL:
            self.head = n
        else:
            self.next[p] = n
        if n == _NIL:
            self.tail = p
        else:
            self.prev[n] = p
        self.prev[b] = self.next[b] = _NIL
        self.queued[b] = False
        self.size -= 1

    def popleft_n(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.head
            out.append(b)
            self.remove(b)
        return out

    def __iter__(self):
        b = self.head
        while b != _NIL:
            yield b
            b = self.next[b]


class ReferenceBlockPool(Locked):
    """vLLM V1's ``BlockPool`` semantics in plain Python (docs/semantics.md sections 1-4).

    Args:
        num_blocks: N, the number of physical blocks (ids ``0 .. N-1``; block 0 is the null block). N >= 1.
        enable_caching: prefix caching; when off, blocks never get keys and every free prepends.
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
        max_keys_per_block: bound on a block's keys, primary plus secondary (docs/semantics.md section 1).

    Raises:
        InvalidArgumentError: ``num_blocks < 1`` or ``max_keys_per_block < 1``.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 max_keys_per_block: int = 4):
        num_blocks = num_blocks_arg("BlockPool", num_blocks)
        max_keys_per_block = as_int("BlockPool", max_keys_per_block, "max_keys_per_block")
        if max_keys_per_block < 1:
            raise InvalidArgumentError("BlockPool", f"max_keys_per_block must be >= 1, got {max_keys_per_block}",
                                       max_keys_per_block)
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.max_keys_per_block = max_keys_per_block
        self.ref_cnt = [0] * num_blocks
        self.keys: list[list[Key]] = [[] for _ in range(num_blocks)]  # primary first
        self.hash_num_tokens: list[int | None] = [None] * num_blocks
        # key -> {block: None}; dict order is insertion order, so the first entry is the earliest.
        self.cached_block_hash_to_block: dict[Key, dict[int, None]] = {}
        self.watchers: dict[int, Callable[[int], None]] = {}  # dict order = registration order
        self.events: list = []
        self.free_block_queue = _FreeQueue(num_blocks)
        self.free_block_queue.append_n(range(1, num_blocks))
        self._lock = new_lock()

    # ---- small helpers -------------------------------------------------------------------
    def _check_id(self, op: str, b: int) -> None:
        check_block_id(op, b, self.num_blocks)

    def _ids(self, op: str, ids) -> list[int]:
        return [check_block_id(op, b, self.num_blocks) for b in as_id_list(op, ids)]

    def _emit(self, ev) -> None:
        if self.enable_kv_cache_events:
            self.events.append(ev)

    def _insert_key(self, b: int, key: Key, num_tokens: int | None) -> None:
        if not self.keys[b]:
            self.hash_num_tokens[b] = num_tokens
        self.keys[b].append(key)
        self.cached_block_hash_to_block.setdefault(key, {})[b] = None

    def _remove_keys(self, b: int, emit: bool = True) -> list[Key]:
        removed = self.keys[b]
        for key in removed:
            entries = self.cached_block_hash_to_block[key]
            del entries[b]
            if not entries:
                del self.cached_block_hash_to_block[key]
            if emit:
                self._emit(BlockRemoved(key[0], key[1]))
        self.keys[b] = []
        self.hash_num_tokens[b] = None
        return removed

    # ---- docs/semantics.md section 2 ---------------------------------------------------------------
    @locked
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting their keys.

        Returns the block ids in queue order, each with ``ref_cnt == 1`` and no keys.
        Raises: InvalidCountError (negative), OutOfBlocksError (more than free; also a ValueError).
        """
        op = "get_new_blocks"
        n = as_int(op, num_blocks, "num_blocks")
        if n < 0:
            raise InvalidCountError(op, f"cannot allocate a negative number of blocks ({n})", n)
        if n > self.free_block_queue.size:
            raise OutOfBlocksError(op, out_of_blocks_message(n, self.free_block_queue.size), n)
        blocks = self.free_block_queue.popleft_n(n)
        for b in blocks:
            if self.enable_caching:
                self._remove_keys(b)
            self.ref_cnt[b] = 1
        fired = [(b, self.watchers.pop(b)) for b in blocks if b in self.watchers]
        for b, cb in fired:
            cb(b)
        return blocks

    @locked
    def free_blocks(self, ordered_blocks) -> None:
        """Decrement each block's ref count (null skipped); blocks reaching 0 rejoin the free queue.

        Un-hashed ones go to the front (the first to reach 0 becomes the head), hashed ones to the back,
        both in the order they reached 0 (docs/semantics.md section 2). Raises InvalidBlockIdError, DoubleFreeError.
        """
        op = "free_blocks"
        ids = self._ids(op, ordered_blocks)
        count: dict[int, int] = {}
        for b in ids:
            if b != NULL_BLOCK:
                count[b] = count.get(b, 0) + 1
        for b, c in count.items():
            if c > self.ref_cnt[b]:
                raise DoubleFreeError(op, double_free_message(b, "freed", self.ref_cnt[b]), b)
        front, back = [], []
        for b in ids:
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (back if (self.enable_caching and self.keys[b]) else front).append(b)
        self.free_block_queue.prepend_n(front)
        self.free_block_queue.append_n(back)

    @locked
    def touch(self, blocks) -> None:
        """Prefix-cache hit: unlink each non-null block with ``ref_cnt == 0`` from the queue, then ``ref_cnt += 1``."""
        for b in self._ids("touch", blocks):
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                self.free_block_queue.remove(b)
            self.ref_cnt[b] += 1

    @locked
    def unpin_blocks(self, blocks, on_reuse: Callable[[int], None]) -> None:
        """Release one reference of each block and register ``on_reuse`` as its reuse watcher.

        Blocks reaching 0 go to the back in order, keeping their keys. Raises InvalidBlockIdError,
        NullBlockError, DoubleFreeError (unpinning a block with ``ref_cnt == 0``).
        """
        op = "unpin_blocks"
        ids = self._ids(op, blocks)
        if not callable(on_reuse):
            raise ArgumentTypeError(op, "on_reuse must be callable")
        count: dict[int, int] = {}
        for b in ids:
            if b == NULL_BLOCK:
                raise NullBlockError(op, "cannot unpin the null block", b)
            count[b] = count.get(b, 0) + 1
        for b, c in count.items():
            if c > self.ref_cnt[b]:
                raise DoubleFreeError(op, double_free_message(b, "unpinned", self.ref_cnt[b]), b)
        back = []
        for b in ids:
            self.ref_cnt[b] -= 1
            self.watchers[b] = on_reuse
            if self.ref_cnt[b] == 0:
                back.append(b)
        self.free_block_queue.append_n(back)

    @locked
    def cache_full_blocks(self, blocks, block_hashes: Sequence[bytes], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, group_id: int = 0, block_mask=None) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``(block_hashes[i], group_id)``.

        A block already keyed must cover fewer tokens (promotion; its keys are replaced), else
        HashConflictError. Emits one BlockStored listing the stored hashes. Raises InvalidArgumentError
        (lengths, sizes, a non-null unmasked block listed twice: vLLM asserts there), InvalidBlockIdError,
        HashConflictError, KeyCapacityError.
        """
        op = "cache_full_blocks"
        a = cache_full_args(op, self.num_blocks, self.enable_caching, blocks, block_hashes, num_cached_blocks,
                            num_full_blocks, block_size, group_id, block_mask)
        if a.noop:
            return
        # Dry run on the touched blocks: (primary tokens, keys) after each step.
        todo = []
        sim: dict[int, tuple[int | None, list[Key]]] = {}
        for i in range(a.nc, a.nf):
            b = a.ids[i]
            if b == NULL_BLOCK or (a.mask is not None and not a.mask[i - a.nc]):
                continue
            if b in sim:  # vLLM asserts on a second set_block_hash; we reject the call
                raise InvalidArgumentError(op, f"block {b} is listed twice", b)
            key, ntok = (a.stored_hash(i), a.group), (i + 1) * a.block_size
            cur_tok, cur_keys = sim.get(b, (self.hash_num_tokens[b], list(self.keys[b])))
            if cur_keys and cur_tok is not None and cur_tok >= ntok:
                raise HashConflictError(op, f"block {b} is already cached covering {cur_tok} tokens (>= {ntok})", b)
            sim[b] = (ntok, [key])  # old keys are replaced, so the key becomes the primary
            todo.append((b, key, ntok))
        for b, key, ntok in todo:
            self._remove_keys(b)
            self._insert_key(b, key, ntok)
        # One BlockStored per call past the no-op checks, even with an empty hash list (as vLLM).
        self._emit(BlockStored(tuple(key[0] for _, key, _ in todo), a.parent, a.block_size, a.group))

    @locked
    def cache_partial_block(self, block: int, block_hashes: Sequence[bytes], num_tokens: int, group_id: int,
                            block_size: int, hash_block_size: int, replace_existing_hashes: bool = False):
        """Register a partly written block under ``(block_hashes[num_tokens // hash_block_size - 1], group_id)``.

        Returns the key, or None for the null block or when caching is disabled. Raises
        InvalidArgumentError (sizes not multiples, too few hashes), InvalidBlockIdError, KeyCapacityError.
        """
        op = "cache_partial_block"
        b, nt, g, hbs, h, parent = partial_block_args(op, self.num_blocks, block, block_hashes, num_tokens, group_id,
                                                      block_size, hash_block_size)
        if b == NULL_BLOCK or not self.enable_caching:
            return None
        key = (h, g)
        if key in self.keys[b] and not replace_existing_hashes:
            return key
        cur = self.hash_num_tokens[b]
        replace = replace_existing_hashes or (bool(self.keys[b]) and cur is not None and cur < nt)
        if not replace and len(self.keys[b]) >= self.max_keys_per_block:
            raise KeyCapacityError(op, f"block {b} already has {len(self.keys[b])} keys "
                                       f"(max_keys_per_block={self.max_keys_per_block})", b)
        if replace:
            self._remove_keys(b)
        self._insert_key(b, key, nt)
        self._emit(BlockStored((h,), parent, hbs, g))  # the span of the one hash block it stores (vLLM)
        return key

    @locked
    def move_block_hashes(self, src: int, dst: int) -> None:
        """Copy-on-write: move every key of ``src`` to ``dst`` (as newly inserted); ``src`` ends un-hashed.

        Raises InvalidBlockIdError, NullBlockError (``dst`` is the null block), HashConflictError
        (``dst`` already has keys).
        """
        op = "move_block_hashes"
        s, d = as_int(op, src, "src"), as_int(op, dst, "dst")
        self._check_id(op, s)
        self._check_id(op, d)
        if d == NULL_BLOCK:
            raise NullBlockError(op, "cannot move hashes onto the null block", d)
        if self.keys[d]:
            raise HashConflictError(op, f"destination block {d} already has keys", d)
        if s == d:
            return
        ntok = self.hash_num_tokens[s]
        for key in self._remove_keys(s, emit=False):
            self._insert_key(d, key, ntok)

    @locked
    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[int] | None:
        """The earliest-inserted block under ``(block_hash, g)`` for every group, or None if any misses."""
        op = "get_cached_block"
        h = check_hash(op, block_hash)
        groups = as_groups(op, kv_cache_group_ids)
        out = []
        for g in groups:
            entries = self.cached_block_hash_to_block.get((h, g))
            if not entries:
                return None
            out.append(next(iter(entries)))
        return out

    @locked
    def evict_blocks(self, block_ids) -> None:
        """Remove the keys of each block (given order, duplicates once); ref counts and queue unchanged."""
        seen = set()
        for b in self._ids("evict_blocks", block_ids):
            if b == NULL_BLOCK or b in seen:
                continue
            seen.add(b)
            self._remove_keys(b)

    @locked
    def reset_prefix_cache(self) -> bool:
        """Drop every key if no block is held (else return False, changing nothing); fire all watchers."""
        if any(self.ref_cnt[b] > 0 for b in range(1, self.num_blocks)):
            return False
        for b in range(self.num_blocks):
            self.keys[b] = []
            self.hash_num_tokens[b] = None
        self.cached_block_hash_to_block.clear()
        self._emit(AllBlocksCleared())
        fired = list(self.watchers.items())
        self.watchers.clear()
        for b, cb in fired:
            cb(b)
        return True

    @locked
    def is_block_writable(self, block: int) -> bool:
        b = as_int("is_block_writable", block, "block id")
        self._check_id("is_block_writable", b)
        return b != NULL_BLOCK and self.ref_cnt[b] == 1 and not self.keys[b]

    @locked
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.size

    @locked
    def get_usage(self) -> float:
        if self.num_blocks == 1:
            return 0.0
        return 1.0 - self.free_block_queue.size / (self.num_blocks - 1)

    @locked
    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    # ---- inspection (docs/semantics.md section 4) ----------------------------------------------------
    @locked
    def free_queue(self) -> list[int]:
        """Free block ids, head (next handed out) to tail."""
        return list(self.free_block_queue)

    @locked
    def ref_counts(self, blocks=None) -> list[int]:
        """One ref count per block (all N, or only the given ids, in their order)."""
        if blocks is None:
            return list(self.ref_cnt)
        return [self.ref_cnt[b] for b in self._ids("ref_counts", blocks)]

    @locked
    def block_keys(self, block: int) -> list[Key]:
        """The block's keys, primary first then secondaries in insertion order."""
        b = as_int("block_keys", block, "block id")
        self._check_id("block_keys", b)
        return list(self.keys[b])

    @locked
    def block_hash_num_tokens(self, block: int) -> int | None:
        """Tokens covered by the block's primary key (None when it has none)."""
        b = as_int("block_hash_num_tokens", block, "block id")
        self._check_id("block_hash_num_tokens", b)
        return self.hash_num_tokens[b]

    @locked
    def num_watchers(self) -> int:
        return len(self.watchers)

    @locked
    def validate(self) -> None:
        """Check every invariant of docs/semantics.md section 1; raise InvariantError at the first violation."""
        op, q = "validate", self.free_block_queue
        order = []
        b, prev = q.head, _NIL
        while b != _NIL:
            if len(order) > self.num_blocks or q.prev[b] != prev:
                raise InvariantError(op, f"free queue links are broken at block {b}", b)
            order.append(b)
            prev, b = b, q.next[b]
        if prev != q.tail:
            raise InvariantError(op, "free queue tail does not end the list", q.tail)
        if len(order) != q.size:
            raise InvariantError(op, f"num_free {q.size} != queue length {len(order)}", q.size)
        in_queue = set(order)
        if len(in_queue) != len(order):
            raise InvariantError(op, "a block is queued twice")
        if NULL_BLOCK in in_queue:
            raise InvariantError(op, "the null block is in the free queue", NULL_BLOCK)
        if self.keys[NULL_BLOCK]:
            raise InvariantError(op, "the null block has keys", NULL_BLOCK)
        for b in range(1, self.num_blocks):
            if self.ref_cnt[b] < 0:
                raise InvariantError(op, f"block {b} has ref_cnt {self.ref_cnt[b]} < 0", b)
            if (b in in_queue) != (self.ref_cnt[b] == 0):
                raise InvariantError(op, f"block {b}: queued={b in in_queue} but ref_cnt={self.ref_cnt[b]}", b)
            if len(self.keys[b]) > self.max_keys_per_block:
                raise InvariantError(op, f"block {b} has {len(self.keys[b])} keys", b)
            if len(set(self.keys[b])) != len(self.keys[b]):
                raise InvariantError(op, f"block {b} has a duplicate key", b)
            if bool(self.keys[b]) != (self.hash_num_tokens[b] is not None):
                raise InvariantError(op, f"block {b}: keys and hash_num_tokens disagree", b)
            for key in self.keys[b]:
                if b not in self.cached_block_hash_to_block.get(key, {}):
                    raise InvariantError(op, f"block {b}'s key is missing from the map", b)
        for key, entries in self.cached_block_hash_to_block.items():
            if not entries:
                raise InvariantError(op, "an empty entry list is left in the map")
            for b in entries:
                if key not in self.keys[b]:
                    raise InvariantError(op, f"the map lists block {b} under a key it does not have", b)
