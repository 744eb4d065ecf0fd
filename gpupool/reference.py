"""The reference block pool: SPEC.md sections 1 to 4 as plain Python (the CPU oracle).

Every device op is tested against :class:`ReferenceBlockPool`. It keeps vLLM V1's structures: a
doubly linked free queue (``popleft_n`` / ``prepend_n`` / ``append_n`` / ``remove``, all O(length)),
and a multi-valued key map where a lookup returns the earliest-inserted block still mapped.
Every op validates its whole input first and only then changes state, so an error leaves the pool
exactly as it was (SPEC.md section 3).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

from .errors import (
    DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidBlockIdError, InvalidCountError,
    InvariantError, KeyCapacityError, NullBlockError, OutOfBlocksError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored

Key = tuple[bytes, int]  # (block_hash, group_id), SPEC.md section 1
NULL_BLOCK = 0
_NIL = -1
# Limits both pools enforce (the device stores group ids and token counts as int32).
MAX_GROUP_ID = 2**31 - 1
MAX_TOKENS = 2**31 - 1


def as_int(op: str, x, what: str = "value") -> int:
    """``x`` as a Python int (ints, numpy and 0-d torch integers); anything else is InvalidArgumentError."""
    if isinstance(x, bool):
        raise InvalidArgumentError(op, f"{what} must be an integer, got bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidArgumentError(op, f"{what} must be an integer, got {type(x).__name__} {x!r}") from None


def as_group(op: str, g) -> int:
    """A KV-cache group id: an int in ``0 .. MAX_GROUP_ID``, else InvalidArgumentError."""
    g = as_int(op, g, "group_id")
    if not 0 <= g <= MAX_GROUP_ID:
        raise InvalidArgumentError(op, f"group_id {g} outside 0..{MAX_GROUP_ID}", g)
    return g


def check_tokens(op: str, n: int, what: str) -> None:
    """Token counts the pools store must fit ``MAX_TOKENS`` (int32 on the device)."""
    if n > MAX_TOKENS:
        raise InvalidArgumentError(op, f"{what} {n} exceeds {MAX_TOKENS} tokens", n)


def check_hash(op: str, h) -> bytes:
    if not isinstance(h, (bytes, bytearray)):
        raise InvalidArgumentError(op, f"block hashes must be bytes, got {type(h).__name__}")
    return bytes(h)


def partial_block_args(op: str, num_blocks: int, block, block_hashes, num_tokens, group_id, block_size,
                       hash_block_size):
    """``cache_partial_block``'s argument checks, shared by both pools (SPEC.md section 2):
    returns ``(block, num_tokens, group, block_size, hash, parent hash or None)``."""
    b = as_int(op, block, "block id")
    if not 0 <= b < num_blocks:
        raise InvalidBlockIdError(op, f"block id {b} out of range 0..{num_blocks - 1}", b)
    nt = as_int(op, num_tokens, "num_tokens")
    g = as_group(op, group_id)
    bs = as_int(op, block_size, "block_size")
    hbs = as_int(op, hash_block_size, "hash_block_size")
    if bs <= 0 or hbs <= 0 or bs % hbs != 0:
        raise InvalidArgumentError(op, f"block_size {bs} must be a positive multiple of hash_block_size {hbs}", bs)
    check_tokens(op, nt, "num_tokens")
    if nt % hbs != 0:
        raise InvalidArgumentError(op, f"num_tokens {nt} is not a multiple of hash_block_size {hbs}", nt)
    k = nt // hbs
    if not 0 < k <= len(block_hashes):
        raise InvalidArgumentError(op, f"num_tokens {nt} needs hash {k} of {len(block_hashes)}", nt)
    h = check_hash(op, block_hashes[k - 1])
    parent = check_hash(op, block_hashes[k - 2]) if k >= 2 else None
    return b, nt, g, bs, h, parent


def as_id_list(op: str, ids) -> list[int]:
    """Block ids (a sequence of ints, or an integer tensor / array) as a list of Python ints."""
    if hasattr(ids, "tolist") and not isinstance(ids, list):
        dtype = str(getattr(ids, "dtype", ""))
        if "int" not in dtype:
            raise InvalidArgumentError(op, f"block ids must have an integer dtype, got {dtype}")
        ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidArgumentError(op, f"block ids must be a sequence of ints, got {type(ids).__name__}")
    return [as_int(op, b, "block id") for b in ids]


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


class ReferenceBlockPool:
    """vLLM V1's ``BlockPool`` semantics in plain Python (SPEC.md sections 1-4).

    Args:
        num_blocks: N, the number of physical blocks (ids ``0 .. N-1``; block 0 is the null block). N >= 1.
        enable_caching: prefix caching; when off, blocks never get keys and every free prepends.
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
        max_keys_per_block: bound on a block's keys, primary plus secondary (SPEC.md section 1).

    Raises:
        InvalidArgumentError: ``num_blocks < 1`` or ``max_keys_per_block < 1``.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 max_keys_per_block: int = 4):
        num_blocks = as_int("BlockPool", num_blocks, "num_blocks")
        max_keys_per_block = as_int("BlockPool", max_keys_per_block, "max_keys_per_block")
        if num_blocks < 1:
            raise InvalidArgumentError("BlockPool", f"num_blocks must be >= 1, got {num_blocks}", num_blocks)
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

    # ---- small helpers -------------------------------------------------------------------
    def _check_id(self, op: str, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockIdError(op, f"block id {b} out of range 0..{self.num_blocks - 1}", b)

    def _ids(self, op: str, ids) -> list[int]:
        out = as_id_list(op, ids)
        for b in out:
            self._check_id(op, b)
        return out

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

    _check_hash = staticmethod(check_hash)

    # ---- SPEC.md section 2 ---------------------------------------------------------------
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
            raise OutOfBlocksError(op, f"cannot get {n} free blocks from the pool ({self.free_block_queue.size} free)", n)
        blocks = self.free_block_queue.popleft_n(n)
        for b in blocks:
            if self.enable_caching:
                self._remove_keys(b)
            self.ref_cnt[b] = 1
        fired = [(b, self.watchers.pop(b)) for b in blocks if b in self.watchers]
        for b, cb in fired:
            cb(b)
        return blocks

    def free_blocks(self, ordered_blocks) -> None:
        """Decrement each block's ref count (null skipped); blocks reaching 0 rejoin the free queue.

        Un-hashed ones go to the front (the first to reach 0 becomes the head), hashed ones to the back,
        both in the order they reached 0 (SPEC.md section 2). Raises InvalidBlockIdError, DoubleFreeError.
        """
        op = "free_blocks"
        ids = self._ids(op, ordered_blocks)
        count: dict[int, int] = {}
        for b in ids:
            if b != NULL_BLOCK:
                count[b] = count.get(b, 0) + 1
        for b, c in count.items():
            if c > self.ref_cnt[b]:
                raise DoubleFreeError(op, f"block {b} freed {c} time(s) with ref_cnt {self.ref_cnt[b]}", b)
        front, back = [], []
        for b in ids:
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (back if (self.enable_caching and self.keys[b]) else front).append(b)
        self.free_block_queue.prepend_n(front)
        self.free_block_queue.append_n(back)

    def touch(self, blocks) -> None:
        """Prefix-cache hit: unlink each non-null block with ``ref_cnt == 0`` from the queue, then ``ref_cnt += 1``."""
        for b in self._ids("touch", blocks):
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                self.free_block_queue.remove(b)
            self.ref_cnt[b] += 1

    def unpin_blocks(self, blocks, on_reuse: Callable[[int], None]) -> None:
        """Release one reference of each block and register ``on_reuse`` as its reuse watcher.

        Blocks reaching 0 go to the back in order, keeping their keys. Raises InvalidBlockIdError,
        NullBlockError, DoubleFreeError (unpinning a block with ``ref_cnt == 0``).
        """
        op = "unpin_blocks"
        ids = self._ids(op, blocks)
        if not callable(on_reuse):
            raise InvalidArgumentError(op, "on_reuse must be callable")
        count: dict[int, int] = {}
        for b in ids:
            if b == NULL_BLOCK:
                raise NullBlockError(op, "cannot unpin the null block", b)
            count[b] = count.get(b, 0) + 1
        for b, c in count.items():
            if c > self.ref_cnt[b]:
                raise DoubleFreeError(op, f"block {b} unpinned {c} time(s) with ref_cnt {self.ref_cnt[b]}", b)
        back = []
        for b in ids:
            self.ref_cnt[b] -= 1
            self.watchers[b] = on_reuse
            if self.ref_cnt[b] == 0:
                back.append(b)
        self.free_block_queue.append_n(back)

    def cache_full_blocks(self, blocks, block_hashes: Sequence[bytes], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, group_id: int = 0, block_mask=None) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``(block_hashes[i], group_id)``.

        A block already keyed must cover fewer tokens (promotion; its keys are replaced), else
        HashConflictError. Emits one BlockStored listing the stored hashes. Raises InvalidArgumentError
        (lengths, sizes, a non-null unmasked block listed twice: vLLM asserts there), InvalidBlockIdError,
        HashConflictError, KeyCapacityError.
        """
        op = "cache_full_blocks"
        nc = as_int(op, num_cached_blocks, "num_cached_blocks")
        nf = as_int(op, num_full_blocks, "num_full_blocks")
        bs = as_int(op, block_size, "block_size")
        g = as_group(op, group_id)
        ids = self._ids(op, blocks)
        if nc < 0:
            raise InvalidCountError(op, f"num_cached_blocks must be >= 0, got {nc}", nc)
        if bs <= 0:
            raise InvalidArgumentError(op, f"block_size must be > 0, got {bs}", bs)
        if nc >= nf or not self.enable_caching:
            return
        check_tokens(op, nf * bs, "num_full_blocks * block_size")
        if nf > len(ids):
            raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {len(ids)} blocks given", nf)
        if nf > len(block_hashes):
            raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {len(block_hashes)} hashes given", nf)
        hashes = [self._check_hash(op, block_hashes[i]) for i in range(max(nc - 1, 0), nf)]
        mask = None
        if block_mask is not None:
            mask = [bool(m) for m in (block_mask.tolist() if hasattr(block_mask, "tolist") else block_mask)]
            if len(mask) < nf - nc:
                raise InvalidArgumentError(op, f"block_mask has {len(mask)} entries, need {nf - nc}", len(mask))
        # Dry run on the touched blocks: (primary tokens, keys) after each step.
        todo = []
        sim: dict[int, tuple[int | None, list[Key]]] = {}
        for i in range(nc, nf):
            b = ids[i]
            if b == NULL_BLOCK or (mask is not None and not mask[i - nc]):
                continue
            if b in sim:  # vLLM asserts on a second set_block_hash; we reject the call
                raise InvalidArgumentError(op, f"block {b} is listed twice", b)
            key, ntok = (hashes[i - max(nc - 1, 0)], g), (i + 1) * bs
            cur_tok, cur_keys = sim.get(b, (self.hash_num_tokens[b], list(self.keys[b])))
            if cur_keys and cur_tok is not None and cur_tok >= ntok:
                raise HashConflictError(op, f"block {b} is already cached covering {cur_tok} tokens (>= {ntok})", b)
            sim[b] = (ntok, [key])  # old keys are replaced, so the key becomes the primary
            todo.append((b, key, ntok))
        stored = []
        for b, key, ntok in todo:
            self._remove_keys(b)
            self._insert_key(b, key, ntok)
            stored.append(key[0])
        if stored:
            parent = self._check_hash(op, block_hashes[nc - 1]) if nc > 0 else None
            self._emit(BlockStored(tuple(stored), parent, bs, g))

    def cache_partial_block(self, block: int, block_hashes: Sequence[bytes], num_tokens: int, group_id: int,
                            block_size: int, hash_block_size: int, replace_existing_hashes: bool = False):
        """Register a partly written block under ``(block_hashes[num_tokens // hash_block_size - 1], group_id)``.

        Returns the key, or None for the null block or when caching is disabled. Raises
        InvalidArgumentError (sizes not multiples, too few hashes), InvalidBlockIdError, KeyCapacityError.
        """
        op = "cache_partial_block"
        b, nt, g, bs, h, parent = partial_block_args(op, self.num_blocks, block, block_hashes, num_tokens, group_id,
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
        self._emit(BlockStored((h,), parent, bs, g))
        return key

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

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: Sequence[int]) -> list[int] | None:
        """The earliest-inserted block under ``(block_hash, g)`` for every group, or None if any misses."""
        op = "get_cached_block"
        h = self._check_hash(op, block_hash)
        groups = [as_group(op, g) for g in kv_cache_group_ids]
        out = []
        for g in groups:
            entries = self.cached_block_hash_to_block.get((h, g))
            if not entries:
                return None
            out.append(next(iter(entries)))
        return out

    def evict_blocks(self, block_ids) -> None:
        """Remove the keys of each block (given order, duplicates once); ref counts and queue unchanged."""
        seen = set()
        for b in self._ids("evict_blocks", block_ids):
            if b == NULL_BLOCK or b in seen:
                continue
            seen.add(b)
            self._remove_keys(b)

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

    def is_block_writable(self, block: int) -> bool:
        b = as_int("is_block_writable", block, "block id")
        self._check_id("is_block_writable", b)
        return b != NULL_BLOCK and self.ref_cnt[b] == 1 and not self.keys[b]

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.size

    def get_usage(self) -> float:
        if self.num_blocks == 1:
            return 0.0
        return 1.0 - self.free_block_queue.size / (self.num_blocks - 1)

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    # ---- inspection (SPEC.md section 4) ----------------------------------------------------
    def free_queue(self) -> list[int]:
        """Free block ids, head (next handed out) to tail."""
        return list(self.free_block_queue)

    def ref_counts(self, blocks=None) -> list[int]:
        """One ref count per block (all N, or only the given ids, in their order)."""
        if blocks is None:
            return list(self.ref_cnt)
        return [self.ref_cnt[b] for b in self._ids("ref_counts", blocks)]

    def block_keys(self, block: int) -> list[Key]:
        """The block's keys, primary first then secondaries in insertion order."""
        b = as_int("block_keys", block, "block id")
        self._check_id("block_keys", b)
        return list(self.keys[b])

    def block_hash_num_tokens(self, block: int) -> int | None:
        """Tokens covered by the block's primary key (None when it has none)."""
        b = as_int("block_hash_num_tokens", block, "block id")
        self._check_id("block_hash_num_tokens", b)
        return self.hash_num_tokens[b]

    def num_watchers(self) -> int:
        return len(self.watchers)

    def validate(self) -> None:
        """Check every invariant of SPEC.md section 1; raise InvariantError at the first violation."""
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


def _group_spec(op: str, spec) -> tuple[str, int]:
    """("full", 0) or ("sliding_window", window_tokens) from "full" / ("sliding_window", w)."""
    if spec == "full" or spec == ("full",):
        return ("full", 0)
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] == "sliding_window":
        w = as_int(op, spec[1], "sliding window")
        if w < 1:
            raise InvalidArgumentError(op, f"sliding window must be >= 1 token, got {w}", w)
        return ("sliding_window", w)
    raise InvalidArgumentError(op, f"unknown KV-cache group spec {spec!r} (\"full\" or (\"sliding_window\", tokens))")


def set_manager_shape(m, block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups) -> None:
    """Checked shape of a KV cache manager (both managers): block and hash-block sizes, table shape,
    groups. Raises InvalidArgumentError."""
    op = "KVCacheManager"
    m.block_size = as_int(op, block_size, "block_size")
    m.hash_block_size = as_int(op, hash_block_size if hash_block_size is not None else block_size, "hash_block_size")
    m.max_num_reqs = as_int(op, max_num_reqs, "max_num_reqs")
    m.max_blocks_per_req = as_int(op, max_blocks_per_req, "max_blocks_per_req")
    if m.block_size < 1 or m.max_num_reqs < 1 or m.max_blocks_per_req < 1:
        raise InvalidArgumentError(op, "block_size, max_num_reqs and max_blocks_per_req must be >= 1")
    if m.hash_block_size < 1 or m.block_size % m.hash_block_size:
        raise InvalidArgumentError(op, f"block_size {m.block_size} must be a multiple of hash_block_size "
                                       f"{m.hash_block_size}", m.hash_block_size)
    m.hashes_per_block = m.block_size // m.hash_block_size
    m.groups = [_group_spec(op, g) for g in groups]
    if not m.groups:
        raise InvalidArgumentError(op, "at least one KV-cache group is needed")


class ReferenceKVCacheManager:
    """The request layer (vLLM's KVCacheManager and its coordinator) over ``ReferenceBlockPool``: the
    oracle of ``gpupool.manager.KVCacheManager``. Semantics are documented there, op by op.

    Requests live in slots ``0 .. max_num_reqs-1``; every KV-cache group (``groups``: "full" or
    ("sliding_window", tokens)) has a block table row per slot, all of one ``block_size``, sharing one
    pool; group g's keys use group id g. Request hashes are per ``hash_block_size`` tokens (a divisor
    of ``block_size``, k = block_size / hash_block_size of them per block): full block i is keyed by
    hash ``(i + 1) * k - 1``; with k > 1 a partly written block is also keyed at its last complete
    hash-block boundary (``cache_partial_block``).
    """

    def __init__(self, num_blocks: int, *, block_size: int, max_num_reqs: int, max_blocks_per_req: int,
                 groups=("full",), hash_block_size: int | None = None, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False, max_keys_per_block: int = 4):
        set_manager_shape(self, block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups)
        self.pool = ReferenceBlockPool(num_blocks, enable_caching=enable_caching,
                                       enable_kv_cache_events=enable_kv_cache_events,
                                       max_keys_per_block=max_keys_per_block)
        self.enable_caching = bool(enable_caching)
        G, R = len(self.groups), self.max_num_reqs
        self.tables: list[list[list[int]]] = [[[] for _ in range(R)] for _ in range(G)]
        self.num_cached = [[0] * R for _ in range(G)]
        self.num_computed = [0] * R
        self.hashes: list[list[bytes]] = [[] for _ in range(R)]
        self.active = [False] * R
        self.pending_copies: list[tuple[int, int, int]] = []  # (src, dst, block released after the copy)

    # ---- checks ------------------------------------------------------------------------------
    def _slot(self, op: str, slot, active: bool | None = True) -> int:
        r = as_int(op, slot, "slot")
        if not 0 <= r < self.max_num_reqs:
            raise InvalidArgumentError(op, f"slot {r} out of range 0..{self.max_num_reqs - 1}", r)
        if active is not None and self.active[r] != active:
            raise InvalidArgumentError(op, f"slot {r} is {'not ' if active else ''}in use", r)
        return r

    def _slots(self, op: str, slots) -> list[int]:
        out = [self._slot(op, s) for s in as_id_list(op, slots)]
        if len(set(out)) != len(out):
            raise InvalidArgumentError(op, "a slot is listed twice")
        return out

    # ---- requests ----------------------------------------------------------------------------
    def _full_hashes(self, r: int) -> list[bytes]:
        k = self.hashes_per_block
        return self.hashes[r][k - 1::k]

    def add_request(self, slot: int, block_hashes: Sequence[bytes] = ()) -> None:
        """Start a request in a free slot with the hashes of its known hash blocks (prompt)."""
        op = "add_request"
        r = self._slot(op, slot, active=False)
        hs = [ReferenceBlockPool._check_hash(op, x) for x in block_hashes]
        if len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, f"{len(hs)} block hashes exceed max_blocks_per_req", len(hs))
        self.active[r] = True
        self.hashes[r] = hs
        self.num_computed[r] = 0
        for g in range(len(self.groups)):
            self.tables[g][r] = []
            self.num_cached[g][r] = 0

    def append_block_hashes(self, slot: int, block_hashes: Sequence[bytes]) -> None:
        """Hashes of further full blocks of a running request (tokens it generated)."""
        op = "append_block_hashes"
        r = self._slot(op, slot)
        hs = [ReferenceBlockPool._check_hash(op, x) for x in block_hashes]
        if len(self.hashes[r]) + len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, "block hashes exceed max_blocks_per_req", len(self.hashes[r]) + len(hs))
        self.hashes[r].extend(hs)

    def _lookup_hits(self, r: int, num_tokens: int) -> list[list[int]]:
        """Per group, the hit blocks of the longest prefix on which every group hits."""
        G = len(self.groups)
        out: list[list[int]] = [[] for _ in range(G)]
        if not self.enable_caching:
            return out
        full = self._full_hashes(r)
        cap = min(max(num_tokens - 1, 0) // self.block_size, len(full))
        for i in range(cap):
            got = self.pool.get_cached_block(full[i], list(range(G)))
            if got is None:
                break
            for g in range(G):
                out[g].append(got[g])
        return out

    def get_computed_blocks(self, slots, num_tokens) -> list[tuple[int, list[list[int]]]]:
        """For each request: (hit blocks, per-group hit block ids): the longest cached prefix of its
        hashes, at most ``(num_tokens - 1) // block_size`` blocks, all groups hitting. Pure."""
        op = "get_computed_blocks"
        rs = self._slots(op, slots)
        nts = [as_int(op, x, "num_tokens") for x in num_tokens]
        if len(nts) != len(rs):
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        out = []
        for r, nt in zip(rs, nts):
            hits = self._lookup_hits(r, nt)
            out.append((len(hits[0]), hits))
        return out

    def _remove_skipped_blocks(self, r: int) -> None:
        for g, (kind, window) in enumerate(self.groups):
            if kind != "sliding_window":
                continue
            row = self.tables[g][r]
            n_skip = max(0, self.num_computed[r] - window + 1) // self.block_size
            removed = []
            for i in range(min(n_skip, len(row)) - 1, -1, -1):
                if row[i] == NULL_BLOCK:
                    break
                removed.append(row[i])
                row[i] = NULL_BLOCK
            if removed:
                self.pool.free_blocks(removed)

    def allocate_slots(self, slots, num_tokens, target_tokens, lookup=None, stop_on_failure: bool = True) -> list[bool]:
        """Give each request, in order, blocks for ``target_tokens`` tokens (all or nothing per request).

        For request k (slot r): first the sliding-window blocks that left the window are freed and
        replaced by the null block (by ``num_computed`` before the step; vLLM's remove_skipped_blocks).
        If ``lookup[k]``, the longest cached prefix (``get_computed_blocks`` with ``num_tokens[k]``)
        is taken as hits, computed after the earlier requests of the batch. ``eff = max(target,
        hits * block_size)``; ``need = ceil(eff / block_size) - table length - hits`` new blocks per
        group. If ``need * groups + (hit blocks with ref_cnt 0) > free`` the request gets nothing (and
        with ``stop_on_failure`` neither do the ones after it). Else every group's hits are touched,
        then each group in order gets ``get_new_blocks(need)``, and blocks that became full are
        cached: ``cache_full_blocks(row, full_hashes, num_cached, nf, bs, g)`` with ``nf =
        min(min(eff, num_tokens) // bs, len(full_hashes))``; with hash_block_size < block_size the
        block after them, if written up to a hash-block boundary ``nh * hbs > nf * bs`` (``nh =
        min(min(eff, num_tokens) // hbs, len(hashes))``), is then ``cache_partial_block(row[nf],
        hashes, nh * hbs, g, bs, hbs)`` (null blocks skipped). Returns one admitted flag per request.
        """
        op = "allocate_slots"
        rs = self._slots(op, slots)
        nts = [as_int(op, x, "num_tokens") for x in num_tokens]
        tgt = [as_int(op, x, "target_tokens") for x in target_tokens]
        lk = [bool(x) for x in (lookup if lookup is not None else [False] * len(rs))]
        if not len(nts) == len(tgt) == len(lk) == len(rs):
            raise InvalidArgumentError(op, "slots, num_tokens, target_tokens and lookup differ in length")
        bs, G = self.block_size, len(self.groups)
        for t in tgt + nts:
            if not 0 <= t <= self.max_blocks_per_req * bs:
                raise InvalidCountError(op, f"token count {t} outside 0..{self.max_blocks_per_req * bs}", t)
        admitted = [False] * len(rs)
        for k, r in enumerate(rs):
            self._remove_skipped_blocks(r)
            hits = self._lookup_hits(r, nts[k]) if lk[k] and not self.tables[0][r] else [[] for _ in range(G)]
            nh = len(hits[0])
            eff = max(tgt[k], nh * bs)
            need = max(0, -(-eff // bs) - len(self.tables[0][r]) - nh)
            zero_ref = sum(1 for g in range(G) for c in self.pool.ref_counts(hits[g]) if c == 0)
            if need * G + zero_ref > self.pool.get_num_free_blocks():
                if stop_on_failure:
                    break
                continue
            for g in range(G):
                self.pool.touch(hits[g])
            for g in range(G):
                self.tables[g][r].extend(hits[g])
                self.num_cached[g][r] = max(self.num_cached[g][r], nh)
            for g in range(G):
                self.tables[g][r].extend(self.pool.get_new_blocks(need))
            if self.enable_caching:
                full = self._full_hashes(r)
                known = min(eff, nts[k])
                nf = min(known // bs, len(full))
                nh = min(known // self.hash_block_size, len(self.hashes[r]))
                for g in range(G):
                    if nf > self.num_cached[g][r]:
                        self.pool.cache_full_blocks(self.tables[g][r], full, self.num_cached[g][r], nf, bs, g)
                        self.num_cached[g][r] = nf
                    row = self.tables[g][r]
                    if nh * self.hash_block_size > nf * bs and nf < len(row) and row[nf] != NULL_BLOCK \
                            and self._partial_key_fits(row[nf], nh * self.hash_block_size):
                        self.pool.cache_partial_block(row[nf], self.hashes[r], nh * self.hash_block_size, g, bs,
                                                      self.hash_block_size)
            self.num_computed[r] = eff
            admitted[k] = True
        return admitted

    def _partial_key_fits(self, b: int, num_tokens: int) -> bool:
        """A partial key replaces the block's keys if its primary covers fewer tokens, else it is a
        secondary key: the manager skips one that would exceed max_keys_per_block."""
        p = self.pool
        return not p.keys[b] or p.hash_num_tokens[b] < num_tokens or len(p.keys[b]) < p.max_keys_per_block

    def free(self, slots) -> None:
        """Finish requests, in order: each group's blocks freed tail first (one free_blocks per group)."""
        op = "free"
        rs = self._slots(op, slots)
        for r in rs:
            for g in range(len(self.groups)):
                self.pool.free_blocks(self.tables[g][r][::-1])
                self.tables[g][r] = []
                self.num_cached[g][r] = 0
            self.active[r] = False
            self.num_computed[r] = 0
            self.hashes[r] = []

    def slot_mapping(self, slots, positions, group: int = 0) -> list[int]:
        """KV slot of each (request, token position): ``block_id * block_size + position % block_size``."""
        op = "slot_mapping"
        rs = [self._slot(op, s) for s in as_id_list(op, slots)]
        ps = [as_int(op, p, "position") for p in positions]
        out = []
        for r, p in zip(rs, ps):
            row = self.tables[group][r]
            if not 0 <= p < len(row) * self.block_size:
                raise InvalidArgumentError(op, f"position {p} of slot {r} has no block", p)
            out.append(row[p // self.block_size] * self.block_size + p % self.block_size)
        return out

    def block_table(self, group: int = 0) -> list[list[int]]:
        return [list(row) for row in self.tables[group]]

    # ---- copy-on-write ----------------------------------------------------------------------
    def cow_append(self, slot: int, srcs: Sequence[int]) -> list[int]:
        """Partial prefix hit of a request: for every group g, the cached block ``srcs[g]`` that
        partly matches its next tokens is copied into a private block ``dst_g`` appended to its row
        (null srcs get the null block, no copy). Each src is touched, so it is held by the pending
        copy until :meth:`release_copied`. Returns the dsts. Raises OutOfBlocksError (nothing changed)."""
        op = "cow_append"
        r = self._slot(op, slot)
        G = len(self.groups)
        ss = self.pool._ids(op, srcs)
        if len(ss) != G:
            raise InvalidArgumentError(op, f"need one src per group ({G}), got {len(ss)}", len(ss))
        if len(self.tables[0][r]) >= self.max_blocks_per_req:
            raise InvalidArgumentError(op, f"slot {r}'s row is full", r)
        real = [s for s in ss if s != NULL_BLOCK]
        self._check_not_pending_dst(op, real)
        need = len(real) + sum(1 for s in set(real) if self.pool.ref_cnt[s] == 0)
        if need > self.pool.get_num_free_blocks():
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        self.pool.touch(real)
        dsts = []
        for g, s in enumerate(ss):
            dst = self.pool.get_new_blocks(1)[0] if s != NULL_BLOCK else NULL_BLOCK
            self.tables[g][r].append(dst)
            if s != NULL_BLOCK:
                self.pending_copies.append((s, dst, s))
            dsts.append(dst)
        return dsts

    def cow_move(self, slot: int, index: int) -> list[int]:
        """A running request must keep writing its blocks at ``index`` while they are cached: for every
        group, the block's keys move to a fresh block ``dst_g`` (``move_block_hashes``), which gets a
        copy of the contents and is released after it; the rows stay append-only (null entries are
        skipped, dst null). Returns the dsts. Raises OutOfBlocksError, InvalidArgumentError."""
        op = "cow_move"
        r = self._slot(op, slot)
        i = as_int(op, index, "index")
        if not 0 <= i < len(self.tables[0][r]):
            raise InvalidArgumentError(op, f"slot {r} has no block at index {i}", i)
        srcs = [self.tables[g][r][i] for g in range(len(self.groups))]
        self._check_not_pending_dst(op, [s for s in srcs if s != NULL_BLOCK])
        need = sum(1 for s in srcs if s != NULL_BLOCK)
        if need > self.pool.get_num_free_blocks():
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        dsts = []
        for s in srcs:
            if s == NULL_BLOCK:
                dsts.append(NULL_BLOCK)
                continue
            dst = self.pool.get_new_blocks(1)[0]
            self.pool.move_block_hashes(s, dst)
            self.pending_copies.append((s, dst, dst))
            dsts.append(dst)
        return dsts

    def _check_not_pending_dst(self, op: str, srcs: list[int]) -> None:
        """A block still waiting to receive a copy cannot be copied from (one copy launch runs them all)."""
        pending = {c[1] for c in self.pending_copies}
        for s in srcs:
            if s in pending:
                raise InvalidArgumentError(op, f"block {s} still waits for a pending copy; run the copies first", s)

    def take_pending_copies(self) -> list[tuple[int, int, int]]:
        """Drain the queue: ``(src, dst, release)`` per copy, in order. After the copies have run, pass
        the list to :meth:`release_copied`."""
        out, self.pending_copies = self.pending_copies, []
        return out

    def release_copied(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Drop the references the copies held: ``free_blocks`` of the released endpoints, in order."""
        self.pool.free_blocks([c[2] for c in copies])
