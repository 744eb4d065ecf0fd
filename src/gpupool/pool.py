"""The device pool: ``BlockPool`` with vLLM's method names over device tensors (docs/semantics.md
sections 1-4; layout in ``gpupool/state.py``).

Two ways in, one state:

* The vLLM-named single ops (``get_new_blocks``, ``free_blocks``, ...) launch one kernel each, then
  wait for the device so that an error is raised at once (docs/semantics.md section 3), events are
  drained and reuse watchers are called.
* The batched ops (``*_batched``) take and return device tensors, counts included, and never wait:
  an op that would fail does nothing and records the error in the sticky status word, which the host
  raises at the next :meth:`check`, inspection or single op. They are safe to capture in a CUDA graph.

Every state change is a Triton kernel in ``gpupool.kernels``, started through the launcher beside
it; this module checks the arguments that need no device state and turns the device's records
(status word, event rows, reuse log) into Python exceptions, events and callbacks. Every public op
holds the pool's lock (threads may share a pool).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _backend, tensors
from .args import (
    NULL_BLOCK, as_groups, as_host_list, as_id_list, as_int, cache_full_args, check_block_id, check_hash, device_arg,
    num_blocks_arg, partial_block_args,
)
from .errors import (
    ArgumentTypeError, DoubleFreeError, InvalidArgumentError, InvalidCountError, OutOfBlocksError, PoolError,
    double_free_message, out_of_blocks_message,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored
_backend.select()  # the kernels' backend, before the kernels below are defined
from .kernels import alloc as k_alloc
from .kernels import cache as k_cache
from .kernels import device_keys as k_keys
from .kernels import flush as k_flush
from .kernels import lookup as k_lookup
from .kernels import release as k_release
from .kernels.flush import FlushBatch
from .kernels.layout import (
    CHUNK_SLOTS, KEY_WIDTH, MIRROR_KEY_WIDTH, ROUND_WIDTH, Ctrl, Event, Fallback, KeyCol, MirrorCol, Op, RoundField,
    Status, op_name,
)
from .kernels.sha256 import round_constant_table
from .keys import INT64_MAX, INT64_MIN
from .locking import locked, new_lock
from .memory import allocate_checked
from .registry import KeyRegistry
from .state import PoolConfig, PoolState, allocate_state, make_config, metadata_bytes

#: ``apply_predicted`` keys its cachings on the device from this many a launch (a GPU pool's default):
#: the extra launch costs the host about what 10-15 host SHA-256s do (about 2 us each).
DEVICE_KEYS_FROM = 16
_BYTES, _HASH_LEN, _INT = {bytes}, {k_keys.HASH_BYTES}, {int}


@dataclass(frozen=True)
class PoolHandle:
    """What the request manager and the replay use of a pool (internal; docs/design.md, layers):
    the device ``state`` and its ``config`` for their launchers, the key ``registry`` that names
    device keys, the pool's ``lock`` (shared, so the manager's ops and the pool's serialise),
    ``finish``, which waits for the device and raises a recorded error (``BlockPool.check``), and
    ``add_error_wording``, through which the manager words its own ops' records."""

    state: PoolState
    config: PoolConfig
    registry: KeyRegistry
    lock: object
    device: torch.device
    finish: Callable[[], None]
    add_error_wording: Callable[[Callable[..., PoolError | None]], None]


class BlockPool:
    """vLLM V1's ``BlockPool`` with its state on a device (docs/semantics.md; layout in ``gpupool.state``).

    Args:
        num_blocks: N physical blocks, ids ``0 .. N-1`` (block 0 is the null block). N >= 1.
        enable_caching, enable_kv_cache_events, max_keys_per_block: as ``ReferenceBlockPool``
            (``max_keys_per_block`` in 1..64).
        device: where the state lives; default ``"cuda"`` when available, else ``"cpu"`` (kernels then
            run in Triton's interpreter, which the package turns on by itself).
        event_capacity: device event rows kept between drains with KV events on (default
            ``gpupool.state.DEFAULT_EVENT_CAPACITY``); a batched op that could overflow it records
            BufferFullError and changes nothing.
        ring_capacity, num_chunks: override the free-queue ring size (power of two >= N) and the key
            table's chunk count (power of two, 16 slots each, room for every key: 16 * num_chunks >=
            (N - 1) * max_keys_per_block); for tests of compaction and of a table at its load limit.

    Ids are accepted as sequences of ints or integer tensors (any device) by the single ops, and as
    int32 tensors on the pool's device by the batched ops; block lists come back as int32 tensors on
    the device. Raises :class:`InvalidArgumentError` for bad sizes.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 max_keys_per_block: int = 4, device: str | torch.device | None = None,
                 event_capacity: int | None = None, ring_capacity: int | None = None, num_chunks: int | None = None):
        op = "BlockPool"
        num_blocks = num_blocks_arg(op, num_blocks)
        max_keys_per_block = as_int(op, max_keys_per_block, "max_keys_per_block")
        if not 1 <= max_keys_per_block <= 64:
            raise InvalidArgumentError(op, f"max_keys_per_block must be in 1..64, got {max_keys_per_block}",
                                       max_keys_per_block)
        if ring_capacity is not None and (ring_capacity < max(num_blocks, 2) or ring_capacity & (ring_capacity - 1)):
            raise InvalidArgumentError(op, f"ring_capacity must be a power of two >= {num_blocks}", ring_capacity)
        if num_chunks is not None and (num_chunks < 1 or num_chunks & (num_chunks - 1)
                                       or num_chunks * CHUNK_SLOTS < (num_blocks - 1) * max_keys_per_block):
            raise InvalidArgumentError(op, "num_chunks must be a power of two with room for every key "
                                       f"({CHUNK_SLOTS} * num_chunks >= (num_blocks - 1) * max_keys_per_block)",
                                       num_chunks)
        if event_capacity is not None and as_int(op, event_capacity, "event_capacity") < 1:
            raise InvalidArgumentError(op, f"event_capacity must be >= 1, got {event_capacity}", event_capacity)
        self.device = device_arg(op, device)
        if (self.device.type == "cpu") != _backend.interpreted():
            raise InvalidArgumentError(
                op, f"kernels were set up for {'the interpreter' if _backend.interpreted() else 'the GPU'} "
                f"(TRITON_INTERPRET={'1' if _backend.interpreted() else '0'} at import); device {self.device} needs "
                "the other: set TRITON_INTERPRET before importing gpupool")
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.max_keys_per_block = max_keys_per_block
        self.config = make_config(num_blocks, max_keys_per_block, caching=enable_caching,
                                  events=enable_kv_cache_events, ring_capacity=ring_capacity, num_chunks=num_chunks,
                                  event_capacity=event_capacity)
        self.state = allocate_checked(op, "num_blocks", num_blocks, lambda d: allocate_state(self.config, d), self.device)
        self.registry = KeyRegistry(self._live_keys, floor=num_blocks)
        self.registry.add_name_source(self._name_device_keys)
        # apply_predicted's cachings keyed on the device from this many (None: on the host, where the
        # device is the CPU); their names are read back at the next check or sweep (_name_device_keys)
        self._keys_from = None if self.device.type == "cpu" else DEVICE_KEYS_FROM
        self._unnamed: list[tuple[list, torch.Tensor, object]] = []  # (pairs, hi then lo, stream)
        self._k_table: torch.Tensor | None = None
        self._watchers: dict[int, Callable[[int], None]] = {}  # dict order = registration order
        self._events: list = []
        self._lock = new_lock()
        self._window_offsets: dict[int, torch.Tensor] = {}  # free_window's ring offsets, per length
        # fn(code, op, value, cause, extra) -> the error, or None: a manager's words for its records
        self._wordings: list[Callable[..., PoolError | None]] = []

    def handle(self) -> PoolHandle:
        """The internal handle the request manager and the replay work through."""
        return PoolHandle(self.state, self.config, self.registry, self._lock, self.device, self.check,
                          self._wordings.append)

    # ---- device records: status, events, reuse log ----------------------------------------------
    @locked
    def check(self) -> None:
        """Wait for the device; drain events into the host queue, call the reuse watchers of blocks
        handed out since, and raise the first error a batched op recorded (clearing it)."""
        s = self.state
        status = s.status.tolist()
        self._name_device_keys()
        ctrl = s.ctrl[: Ctrl.REUSE_COUNT + 1].tolist()
        fired = []
        if ctrl[Ctrl.REUSE_COUNT]:
            fired = [(b, self._watchers.pop(b)) for b in s.reuse[: ctrl[Ctrl.REUSE_COUNT]].tolist()]
            s.ctrl[Ctrl.REUSE_COUNT] = 0
        if ctrl[Ctrl.EV_COUNT]:
            self._translate_events(s.ev[: ctrl[Ctrl.EV_COUNT]].tolist())
            s.ctrl[Ctrl.EV_COUNT] = 0
        self.registry.maybe_sweep()
        for b, cb in fired:
            cb(b)
        if status[Status.CODE]:
            s.status.zero_()
            raise self._recorded_error(status[Status.CODE], op_name(status[Status.OP]), status[Status.VALUE],
                                       ctrl[Ctrl.NUM_FREE], status[Status.CAUSE], status[Status.EXTRA],
                                       status[Status.LIMIT])

    def _recorded_error(self, code: int, op: str, value: int, num_free: int, cause: int, extra: int,
                        limit: int) -> PoolError:
        """The status word's error, worded as the reference pool words it: the free count of an
        out-of-blocks error and the ref count of a double free, read now (the failed op, and every op
        skipped after it, changed neither); a manager's op as the manager words it (its cause)."""
        for word in self._wordings:
            err = word(code, op, value, cause, extra, limit)
            if err is not None:
                return err
        if code == OutOfBlocksError.code:
            return OutOfBlocksError(op, out_of_blocks_message(value, num_free), value)
        if code == DoubleFreeError.code and 0 <= value < self.num_blocks:
            verb = "unpinned" if op == "unpin_blocks" else "freed"
            return DoubleFreeError(op, double_free_message(value, verb, int(self.state.ref_cnt[value])), value)
        return PoolError.from_status(code, op, value)

    synchronize = check

    def _translate_events(self, rows) -> None:
        """Device event rows (``kernels/layout.py`` Event) -> vLLM's KV events, in row order."""
        name = self.registry.name
        stored = None  # the BlockStored being assembled: [hashes, parent, block size, group]

        def flush():
            nonlocal stored
            if stored is not None:
                self._events.append(BlockStored(tuple(stored[0]), stored[1], stored[2], stored[3]))
                stored = None

        for kind, a, hi, lo, grp, b in rows:  # EventCol's order
            if kind != Event.STORED_ITEM:
                flush()
            if kind == Event.REMOVED:
                self._events.append(BlockRemoved(*name((hi, lo))))
            elif kind == Event.STORED:
                stored = [[], name((hi, lo))[0] if a else None, b, grp]
            elif kind == Event.STORED_ITEM:
                stored[0].append(name((hi, lo))[0])
            elif kind == Event.CLEARED:
                self._events.append(AllBlocksCleared())
        flush()

    def _live_keys(self):
        """The keys live in the device table (the registry's sweep)."""
        s, mk = self.state, self.max_keys_per_block
        rows = s.keys.view(self.num_blocks, mk, KEY_WIDTH)[:, :, KeyCol.HI: KeyCol.LO + 1]
        live = torch.arange(mk, device=self.device)[None, :] < s.num_keys[:, None]
        flat = iter(rows[live].reshape(-1).tolist())
        return set(zip(flat, flat))  # (hi, lo) pairs, without a list per row

    # ---- argument plumbing ------------------------------------------------------------------------
    def _tensor(self, values, dtype=torch.int32) -> torch.Tensor:
        """Host values on the device, without a stream synchronisation (``gpupool.tensors.to_device``)."""
        return tensors.to_device(values, dtype, self.device)

    def _ids(self, op: str, ids) -> torch.Tensor:
        """Ids of a single op (a sequence or any integer tensor), range-checked, as int32 on the device."""
        return self._tensor([check_block_id(op, b, self.num_blocks) for b in as_id_list(op, ids)])

    def _device_i32(self, op: str, t, what: str) -> torch.Tensor:
        """A batched op's ``int32[n]`` tensor on the pool's device (``gpupool.tensors.device_i32``)."""
        return tensors.device_i32(op, t, what, self.device)

    def _count(self, op: str, count, n: int) -> torch.Tensor:
        """A device count: the given ``int32[1]`` tensor, or None when the whole array counts (the
        kernel then takes its length: no glue kernel, no H2D copy)."""
        return tensors.device_count(op, count, self.device)

    # ---- docs/semantics.md section 2: single ops ----------------------------------------------------
    @locked
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
            raise OutOfBlocksError(op, out_of_blocks_message(n, int(self.state.ctrl[Ctrl.NUM_FREE])), n)
        blocks, _ = k_alloc.launch_alloc(self.state, self.config, self._tensor([n]), self._count(op, None, 1),
                                         op=Op.GET_NEW_BLOCKS, max_total=n, fill_tail=False)
        self.check()
        return blocks[:n].clone()

    @locked
    def free_blocks(self, ordered_blocks) -> None:
        """Release one reference per listed block (docs/semantics.md section 2: un-hashed blocks that
        reach 0 go to the front, hashed ones to the back). Raises InvalidBlockIdError, DoubleFreeError."""
        op = "free_blocks"
        ids = self._ids(op, ordered_blocks)
        k_release.launch_release(self.state, self.config, ids, self._count(op, None, ids.numel()),
                                 self._tensor([0, ids.numel()]), unpin=False, op=Op.FREE_BLOCKS)
        self.check()

    @locked
    def touch(self, blocks) -> None:
        """Prefix hit: unlink each non-null block with ref_cnt 0 from the queue, then ref_cnt += 1."""
        op = "touch"
        ids = self._ids(op, blocks)
        k_release.launch_touch(self.state, self.config, ids, self._count(op, None, ids.numel()), op=Op.TOUCH)
        self.check()

    @locked
    def unpin_blocks(self, blocks, on_reuse: Callable[[int], None]) -> None:
        """Release one reference of each block and register ``on_reuse`` as its reuse watcher; blocks
        reaching 0 go to the back in order, keeping their keys. Raises InvalidBlockIdError,
        NullBlockError, DoubleFreeError, ArgumentTypeError (``on_reuse`` not callable)."""
        op = "unpin_blocks"
        ids = self._ids(op, blocks)
        if not callable(on_reuse):
            raise ArgumentTypeError(op, "on_reuse must be callable")
        self.check()
        k_release.launch_release(self.state, self.config, ids, self._count(op, None, ids.numel()),
                                 self._tensor([0, ids.numel()]), unpin=True, op=Op.UNPIN_BLOCKS)
        self.check()  # raises before any watcher is registered on the host
        for b in ids.tolist():
            self._watchers[b] = on_reuse

    @locked
    def cache_full_blocks(self, blocks, block_hashes, num_cached_blocks: int, num_full_blocks: int,
                          block_size: int, group_id: int = 0, block_mask=None) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache (docs/semantics.md
        section 2; one BlockStored per call past the no-op checks). Raises InvalidArgumentError,
        ArgumentTypeError, InvalidBlockIdError, InvalidCountError, HashConflictError."""
        op = "cache_full_blocks"
        a = cache_full_args(op, self.num_blocks, self.enable_caching, blocks, block_hashes, num_cached_blocks,
                            num_full_blocks, block_size, group_id, block_mask)
        if a.noop:
            return
        self._launch_cache_full(a, self._tensor(a.ids), Op.CACHE_FULL_BLOCKS)
        self.check()

    def _launch_cache_full(self, a, ids: torch.Tensor, op: int) -> None:
        reg = self.registry
        keys = [(0, 0)] * a.nc + [reg.register(a.stored_hash(i), a.group) for i in range(a.nc, a.nf)]
        parent = reg.register(a.parent, a.group) if a.parent is not None else (0, 0)
        p = self._tensor([a.nc, a.nf, a.block_size, a.group, ids.numel(), a.parent is not None, *parent],
                         torch.int64)
        mask = None if a.mask is None else self._tensor(a.mask[: a.nf - a.nc], torch.int8)
        k_cache.launch_cache_full(self.state, self.config, ids, self._tensor([k[0] for k in keys], torch.int64),
                                  self._tensor([k[1] for k in keys], torch.int64), mask, p, op=op)

    @locked
    def cache_partial_block(self, block: int, block_hashes, num_tokens: int, group_id: int, block_size: int,
                            hash_block_size: int, replace_existing_hashes: bool = False):
        """Register a partly written block under ``(block_hashes[num_tokens // hash_block_size - 1],
        group_id)`` (docs/semantics.md section 2). Returns the key, or None for the null block or when
        caching is disabled. Raises InvalidArgumentError, InvalidBlockIdError, KeyCapacityError."""
        op = "cache_partial_block"
        b, nt, g, hbs, h, parent = partial_block_args(op, self.num_blocks, block, block_hashes, num_tokens,
                                                      group_id, block_size, hash_block_size)
        if b == NULL_BLOCK or not self.enable_caching:
            return None
        k = self.registry.register(h, g)
        pk = self.registry.register(parent, g) if parent is not None else (0, 0)
        p = self._tensor([b, nt, g, hbs, k[0], k[1], parent is not None, *pk], torch.int64)
        k_cache.launch_cache_partial(self.state, self.config, p, replace=bool(replace_existing_hashes),
                                     op=Op.CACHE_PARTIAL_BLOCK)
        self.check()
        return (h, g)

    @locked
    def move_block_hashes(self, src: int, dst: int) -> None:
        """Copy-on-write: every key of ``src`` moves to ``dst`` (as newly inserted); ``src`` ends
        un-hashed. Raises InvalidBlockIdError, NullBlockError, HashConflictError (``dst`` keyed)."""
        op = "move_block_hashes"
        s, d = as_int(op, src, "src"), as_int(op, dst, "dst")
        k_cache.launch_move(self.state, self.config, self._tensor([s, d], torch.int64), op=Op.MOVE_BLOCK_HASHES)
        self.check()

    @locked
    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids) -> list[int] | None:
        """The earliest-inserted block under ``(block_hash, g)`` for every group, or None if any misses."""
        op = "get_cached_block"
        h = check_hash(op, block_hash)
        groups = as_groups(op, kv_cache_group_ids)
        if not groups:
            return []
        from .keys import device_key

        keys = [device_key(h, g) for g in groups]
        out = self.lookup_batched(self._tensor([k[0] for k in keys], torch.int64),
                                  self._tensor([k[1] for k in keys], torch.int64), self._tensor(groups))
        self.check()
        got = out.tolist()
        return None if min(got) < 0 else got

    @locked
    def evict_blocks(self, block_ids) -> None:
        """Remove every key of each listed block (duplicates once); ref counts and the queue unchanged."""
        op = "evict_blocks"
        ids = self._ids(op, block_ids)
        k_cache.launch_evict(self.state, self.config, ids, op=Op.EVICT_BLOCKS)
        self.check()

    @locked
    def reset_prefix_cache(self) -> bool:
        """Drop every key and fire all watchers (registration order) if no block is held; else return
        False, changing nothing."""
        self.check()
        out = torch.zeros(1, dtype=torch.int32, device=self.device)
        k_cache.launch_reset(self.state, self.config, out, op=Op.RESET_PREFIX_CACHE)
        self.check()
        if not out.item():
            return False
        fired, self._watchers = list(self._watchers.items()), {}
        self.registry.clear_unpinned()
        for b, cb in fired:
            cb(b)
        return True

    @locked
    def is_block_writable(self, block: int) -> bool:
        op = "is_block_writable"
        b = check_block_id(op, as_int(op, block, "block id"), self.num_blocks)
        self.check()
        s = self.state
        return b != NULL_BLOCK and int(s.ref_cnt[b]) == 1 and int(s.num_keys[b]) == 0

    @locked
    def get_num_free_blocks(self) -> int:
        self.check()
        return int(self.state.ctrl[Ctrl.NUM_FREE])

    @locked
    def get_usage(self) -> float:
        if self.num_blocks == 1:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    @locked
    def take_events(self) -> list:
        self.check()
        ev, self._events = self._events, []
        return ev

    # ---- batched ops: device tensors in and out, no host synchronisation -------------------------
    @locked
    def allocate_batched(self, demands: torch.Tensor, num_demands: torch.Tensor | None = None):
        """Many ``get_new_blocks`` demands in batch order, as one op (all or nothing).

        ``demands: int32[B]`` on the device (``num_demands: int32[1]`` may say only the first k count).
        Returns ``(blocks: int32[N + 1], offsets: int32[B + 1])``: demand k got
        ``blocks[offsets[k]:offsets[k+1]]``; every entry of ``blocks`` past ``offsets[num_demands]`` is -1
        (all of ``blocks`` when the op fails or is skipped). When the op fails or is skipped (an earlier
        error pending) every entry of ``offsets`` is 0 (no demand got a block); after a success the
        entries past ``num_demands + 1`` are unspecified. Errors go to the status word (raised by
        :meth:`check`; docs/errors.md, "Outputs of a failed or skipped op").
        """
        op = "allocate_batched"
        demands = self._device_i32(op, demands, "demands")
        return k_alloc.launch_alloc(self.state, self.config, demands, self._count(op, num_demands, demands.numel()),
                                    op=Op.ALLOCATE_BATCHED)

    @locked
    def free_batched(self, ids: torch.Tensor, seg_offsets: torch.Tensor, num_ids: torch.Tensor | None = None) -> None:
        """Many ``free_blocks`` calls in one op: segment j (``ids[seg_offsets[j]:seg_offsets[j+1]]``) is
        the j-th call, in order (a request's blocks reversed, typically). ``ids: int32[M]``,
        ``seg_offsets: int32[S + 1]`` from 0, nondecreasing, with ``seg_offsets[S] >= num_ids`` (default
        M): a fixed-capacity graph input may pad past the count, and segments are cut at ``num_ids``.
        Segments are found in the kernel. Errors go to the status word."""
        op = "free_batched"
        ids = self._device_i32(op, ids, "ids")
        seg_offsets = self._device_i32(op, seg_offsets, "seg_offsets")
        if seg_offsets.numel() < 1:
            raise InvalidArgumentError(op, "seg_offsets needs at least one entry (0)")
        k_release.launch_release(self.state, self.config, ids, self._count(op, num_ids, ids.numel()), seg_offsets,
                                 unpin=False, op=Op.FREE_BATCHED)

    @locked
    def cache_full_blocks_batched(self, ids: torch.Tensor, block_hashes, num_cached_blocks: int,
                                  num_full_blocks: int, block_size: int, group_id: int = 0, block_mask=None) -> None:
        """``cache_full_blocks`` with the block ids as a device tensor (``ids: int32[M]`` on the pool's
        device, M >= ``num_full_blocks``; e.g. a slice of ``allocate_batched``'s output), not waiting.
        The hashes, counts and mask are host values, checked here as ``cache_full_blocks`` checks them
        (raising at once); the ids are checked by the kernel, and a bad id, a duplicate or a hash
        conflict goes to the status word (raised by :meth:`check`, nothing changed)."""
        op = "cache_full_blocks_batched"
        ids = self._device_i32(op, ids, "ids")
        a = cache_full_args(op, self.num_blocks, self.enable_caching, [0] * ids.numel(), block_hashes,
                            num_cached_blocks, num_full_blocks, block_size, group_id, block_mask)
        if not a.noop:
            self._launch_cache_full(a, ids, Op.CACHE_FULL_BLOCKS)

    @locked
    def cache_blocks_batched(self, ids: torch.Tensor, calls) -> None:
        """Many ``cache_full_blocks`` calls in one launch, not waiting (docs/semantics.md section 2,
        batched forms). ``calls``: host tuples ``(block_hashes, num_cached_blocks, num_full_blocks,
        block_size, group_id)`` in call order; ``ids: int32[M]`` on the pool's device is the
        concatenation of each call's ``blocks[num_cached_blocks:num_full_blocks]`` (``M`` their total:
        no-op calls add none), e.g. gathered from ``allocate_batched``'s output. A no-op when caching
        is off.

        Equals the calls in order, except that a block listed twice in the whole batch is an error
        (the calls would re-key it). The host values are checked here as ``cache_full_blocks`` checks
        them (raising at once: InvalidArgumentError, ArgumentTypeError, InvalidCountError, nothing
        changed); InvalidArgumentError too when ``M`` is not the ranges' total or the pool records KV
        events (each call's BlockStored names its parent: use ``cache_full_blocks_batched``). A bad id,
        a duplicate or a hash conflict goes to the status word (raised by :meth:`check`, nothing changed)."""
        op = "cache_blocks_batched"
        ids = self._device_i32(op, ids, "ids")
        if self.enable_kv_cache_events:
            raise InvalidArgumentError(op, "a pool with KV events caches request by request (cache_full_blocks_batched)")
        keys, ntok, _ = self._cache_items(op, calls, ids.numel(), "ids")  # none with caching off (a no-op)
        if keys:
            k_cache.launch_cache_blocks(self.state, self.config, ids, *self._key_tensors(keys, ntok),
                                        op=Op.CACHE_BLOCKS_BATCHED)

    def _cache_items(self, op: str, calls, n_ids: int, what: str) -> tuple[list, list, list]:
        """``cache_blocks_batched``'s host checks, made with caching off too (as ``cache_full_blocks``
        makes them): ((hash, group) and tokens covered per cached block; none with caching off; the
        number of them per call). Raises InvalidArgumentError when caching is on and ``n_ids``
        (``what``'s length) is not the calls' ranges' total."""
        keys, ntok, per_call = [], [], []
        for call in as_host_list(op, calls, "calls"):
            if not isinstance(call, (tuple, list)) or len(call) != 5:
                raise ArgumentTypeError(op, "each call is (block_hashes, num_cached_blocks, num_full_blocks, "
                                            f"block_size, group_id), got {call!r}")
            hashes, nc, nf, bs, g = call
            a = cache_full_args(op, self.num_blocks, self.enable_caching, None, hashes, nc, nf, bs, g, None)
            k0 = len(keys)
            if not a.noop:
                keys += [(a.stored_hash(i), a.group) for i in range(a.nc, a.nf)]
                ntok += [(i + 1) * a.block_size for i in range(a.nc, a.nf)]
            per_call.append(len(keys) - k0)
        if self.enable_caching and len(keys) != n_ids:
            raise InvalidArgumentError(op, f"{what} has {n_ids} entries, the calls' ranges {len(keys)}", n_ids)
        return keys, ntok, per_call

    def _key_tensors(self, keys, ntok) -> list[torch.Tensor]:
        """(key_hi, key_lo, key_group, ntok): ``int64[len(keys)]`` each (at least one entry) on the
        device, four views of ONE host-to-device copy."""
        return self._split_keys(self._tensor(self._key_values(keys, ntok), torch.int64))

    def _key_values(self, keys, ntok) -> list[int]:
        """:meth:`_key_tensors`' host values, flat (the keys registered)."""
        dev = self.registry.register_pairs(keys) or [(0, 0)]
        return [k[0] for k in dev] + [k[1] for k in dev] + ([g for _, g in keys] or [0]) + (ntok or [0])

    @staticmethod
    def _split_keys(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return flat.view(4, -1).unbind(0)  # four rows, two ops (views: no device work)

    @locked
    def apply_batched(self, *, free_ids=None, free_offsets=None, touch_ids=None, demands=(), cache_ids=None,
                      cache_calls=(), rounds=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``free_batched(free_ids, free_offsets)``, ``touch_batched(touch_ids)``,
        ``allocate_batched(demands)`` and ``cache_blocks_batched(cache_ids, cache_calls)`` in that
        order, as ONE launch, not waiting (docs/semantics.md section 2, batched forms). Every part is
        optional and is that op exactly; a part that fails records its error in the status word and the
        later parts do nothing, as four launches would.

        ``free_ids``, ``free_offsets``, ``touch_ids``, ``cache_ids``: each an ``int32[n]`` tensor on the
        pool's device or host ints; the host ones travel in ONE host-to-device copy with the demands
        (ints outside int32 raise InvalidArgumentError; ids are checked on the device, as a tensor's).
        ``demands``: host ints (the pops' sum sizes the output without a wait). ``cache_ids`` may name
        this call's popped blocks: ``num_blocks + k`` is the k-th. Returns ``(blocks:
        int32[sum(demands)], offsets: int32[len(demands) + 1])`` as ``allocate_batched``'s: blocks -1
        where the pops failed or were skipped; offsets all 0 where an earlier part's error skipped the
        pops (one round), else the demands' prefix sums (also where the pops failed on the device, or
        with rounds: the blocks say which did).

        ``rounds``: several such batches in one launch, one after another (None: one). A host list,
        per round ``(free ids, free calls, touch ids, demands, cache calls)``: how many of each part's
        entries, in order, are the round's; every count summed over the rounds is the part's length.
        ``free_offsets`` then holds each round's own offsets (from 0, ``free calls + 1`` entries),
        one round after another (none without ``free_ids``). The pops of all rounds come out one after
        another, and ``num_blocks + k`` in a caching names the k-th of them (an earlier round's or its
        own round's).

        Raises at once (nothing changed) what the four ops raise for bad host values, and
        InvalidArgumentError for a pool with KV events (the caching part writes none) or rounds that
        do not add up, InvalidCountError for a negative demand, OutOfBlocksError for a demands' sum (a
        round's) above the pool's ``num_blocks - 1`` blocks (it can never fit, whatever the frees
        before it); device errors, a sum above the free blocks among them, go to the status word
        (raised by :meth:`check`). A caller that predicts the pops uses :meth:`apply_predicted`."""
        op = "apply_batched"
        if self.enable_kv_cache_events:
            raise InvalidArgumentError(op, "a pool with KV events runs the ops one by one")
        _, n_cids = self._i32_part(op, cache_ids, "cache_ids")
        keys, ntok, per_call = self._cache_items(op, cache_calls, n_cids, "cache_ids")
        dem = self._demands(op, demands)
        fids, n_free = self._i32_part(op, free_ids, "free_ids")
        seg, n_seg = None, None
        if free_ids is not None:
            if free_offsets is None:
                raise InvalidArgumentError(op, "free_ids needs free_offsets (as free_batched's seg_offsets)")
            seg, n_seg = self._i32_part(op, free_offsets, "free_offsets")
            if n_seg < 1:
                raise InvalidArgumentError(op, "free_offsets needs at least one entry (0)")
        tids, n_touch = self._i32_part(op, touch_ids, "touch_ids")
        cids, _ = self._i32_part(op, cache_ids, "cache_ids")
        parts = self._rounds(op, rounds, n_free, n_seg, n_touch, dem, per_call)
        batch = FlushBatch.of_rounds(fids, seg, tids, dem, cids, (keys, ntok, per_call), parts)
        blocks, offsets, _ = self._launch_batch(op, batch, rounds is not None)
        return blocks, offsets

    @locked
    def apply_predicted(self, batch: FlushBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`apply_batched` for a caller that predicts its pops and checked its cachings itself (the
        vLLM fast path, docs/algorithms.md section 8), its ops as a ``gpupool.kernels.flush.FlushBatch``
        (built with its ``add_*`` methods and ``cut``: the round table kept with the parts; the id parts
        host ints or ``int32`` device tensors, ``N + k`` in the caching naming the launch's k-th pop; its
        cachings' keys checked by the caller with ``gpupool.args.cache_full_args``). Not waiting.

        Returns ``(blocks: int32[sum(demands)], confirm: int32[CONFIRM_WIDTH])`` on the device: the pops
        as ``apply_batched``'s (-1 where a round's pops failed or were skipped), which the caller compares
        with its predictions when it next synchronises, and the launch's confirmation
        (``layout.Confirm``), read then too: the status code before the launch (not 0: a recorded error
        made the launch do nothing) and the status code after it (not 0 with the first 0: this launch
        failed), both written by the kernel (no device op besides the one launch and its one
        host-to-device copy; a second launch first where :attr:`device_keys_from` cachings or more make
        their device keys on the device, named at the next :meth:`check` or :meth:`sweep_key_names`).
        The batch may be reused at once (what is kept is copied). Raises at once what
        ``apply_batched`` raises for bad host values, and InvalidArgumentError for a batch whose parts
        do not match its round table or its cache items."""
        op = "apply_predicted"
        if self.enable_kv_cache_events:
            raise InvalidArgumentError(op, "a pool with KV events runs the ops one by one")
        if not isinstance(batch, FlushBatch):
            raise ArgumentTypeError(op, f"batch must be a gpupool.kernels.flush.FlushBatch, got {type(batch).__name__}")
        n_cids = len(batch.cache_ids)
        keys, ntok, per_call = batch.cache_keys, batch.cache_ntok, batch.cache_calls
        if not (len(keys) == len(ntok) == sum(per_call) == (n_cids if self.enable_caching else 0)):
            raise InvalidArgumentError(op, f"cache items: {len(keys)} keys, {len(ntok)} token counts, "
                                           f"{sum(per_call)} blocks in the calls, {n_cids} cache_ids")
        blocks, _, confirm = self._launch_batch(op, batch, True, offsets=False)
        return blocks, confirm

    @staticmethod
    def _demands(op: str, demands) -> list[int]:
        """Host demands as plain ints >= 0 (InvalidCountError)."""
        if type(demands) is list and set(map(type, demands)) <= _INT:  # plain ints (the fast path's), at C speed
            dem = demands
        else:
            dem = [as_int(op, d, "demand") for d in as_host_list(op, demands, "demands")]
        if dem and min(dem) < 0:
            bad = next(d for d in dem if d < 0)
            raise InvalidCountError(op, f"a demand must be >= 0, got {bad}", bad)
        return dem

    def _launch_batch(self, op: str, b: FlushBatch, in_rounds: bool, offsets: bool = True):
        """The launch behind :meth:`apply_batched` and :meth:`apply_predicted`: (blocks, offsets,
        confirm). ``in_rounds``: the caller gave rounds (named in an error); ``offsets``: False for a
        caller that reads none (None then)."""
        fids, n_free = self._i32_part(op, b.free_ids, "free_ids")
        seg, n_seg = self._i32_part(op, b.free_offsets, "free_offsets")
        tids, n_touch = self._i32_part(op, b.touch_ids, "touch_ids")
        cids, _ = self._i32_part(op, b.cache_ids, "cache_ids")
        n_cache = len(b.cache_keys)  # the cachings that run: none with caching off, whatever ids came
        table, dem = b.table, self._demands(op, b.demands)
        self._check_table(op, table, n_free, n_seg, n_touch, len(dem), n_cache, seg is not None)
        for want in b.round_pops():
            if want > self.num_blocks - 1:  # never fits (a free cannot make more blocks free); sizes the output
                raise OutOfBlocksError(op, f"the demands' sum {want} exceeds the pool's {self.num_blocks - 1} blocks"
                                       + (" (in a round)" if in_rounds else ""), want)
        total = sum(dem)
        # ONE host-to-device copy: a placeholder entry for empty parts, demands, rounds, the host parts, and
        # the caching's int64 keys; split on the device in one op
        host, sizes = [0] + dem + table, [1, len(dem), len(table)]
        for v in (fids, seg, tids, cids):
            n = len(v) if isinstance(v, list) else 0
            if n:
                host += v
            sizes.append(n)
        keys = b.cache_keys
        on_device = self._device_key_parts(keys)
        if on_device:  # the hashes' bytes travel (hi, lo zero-filled); the kernel below makes the keys
            raw, groups = on_device
            parts = [(host, torch.int32), ([0] * (2 * n_cache) + groups + b.cache_ntok, torch.int64),
                     (raw, torch.int32)]
        else:
            parts = [(host, torch.int32), (self._key_values(keys, b.cache_ntok), torch.int64)]
        small, key_flat, *digests = tensors.to_device_packed(parts, self.device)
        one, d_dem, d_table, *d_parts = small.split_with_sizes(sizes)
        d_f, d_s, d_t, d_c = (d if type(v) is list else v for v, d in zip((fids, seg, tids, cids), d_parts))
        key_parts = self._split_keys(key_flat)
        if digests:
            if self._k_table is None:
                self._k_table = round_constant_table(self.device)
            k_keys.launch_device_keys(digests[0], key_parts[2], key_parts[0], key_parts[1], self._k_table)
        out = k_flush.launch_flush(
            self.state, self.config, d_f if n_free else one, d_s if n_seg else one, d_t if n_touch else one,
            d_dem if dem else one, d_table, d_c if n_cache else one, *key_parts,
            n_rounds=len(table) // ROUND_WIDTH, n_free=n_free, n_touch=n_touch, n_demands=len(dem),
            n_cache=n_cache, total=total, offsets=offsets)
        if digests:  # a copy kept for the names: the caller may reuse its batch
            self._unnamed.append((list(keys), key_flat[: 2 * n_cache],
                                  torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None))
        return out

    @property
    def device_keys_from(self) -> int | None:
        """:meth:`apply_predicted` keys a launch's cachings on the device from this many (``None``:
        always on the host; default :data:`DEVICE_KEYS_FROM` on a GPU, ``None`` on the CPU, where the
        host is the device). Set it to an int >= 1 or None (ArgumentTypeError, InvalidArgumentError).
        docs/algorithms.md section 8."""
        return self._keys_from

    @device_keys_from.setter
    def device_keys_from(self, value) -> None:
        op = "device_keys_from"
        if value is not None:
            value = as_int(op, value, "device_keys_from")
            if value < 1:
                raise InvalidArgumentError(op, f"device_keys_from must be >= 1 or None, got {value}", value)
        self._keys_from = value

    def _device_key_parts(self, keys: list) -> tuple[bytes, list[int]] | None:
        """``(the hashes' bytes, the groups)`` where a launch's cachings ``keys`` (``(hash, group)``
        pairs) are keyed on the device: at least :attr:`device_keys_from` of them, every hash 32 bytes
        (``kernels.device_keys``), every group an int64; else None (keyed on the host)."""
        m = self._keys_from
        if m is None or len(keys) < m:
            return None
        hashes, groups = [h for h, _ in keys], [g for _, g in keys]
        if (set(map(type, hashes)) == _BYTES and set(map(len, hashes)) == _HASH_LEN and set(map(type, groups)) == _INT
                and INT64_MIN <= min(groups) and max(groups) <= INT64_MAX):  # else the host's errors, keyed there
            return b"".join(hashes), groups
        return None

    @staticmethod
    def _check_table(op: str, table: list, n_free: int, n_seg: int, n_touch: int, n_dem: int, n_cache: int,
                     has_seg: bool) -> None:
        """A batch's round table against its parts' lengths (InvalidArgumentError where they differ)."""
        if not table or len(table) % ROUND_WIDTH:
            raise InvalidArgumentError(op, f"a round table has {ROUND_WIDTH} entries per round, got {len(table)}")
        last = len(table) - ROUND_WIDTH
        got = (table[last + RoundField.FREE_START] + table[last + RoundField.FREE_IDS],
               table[last + RoundField.TOUCH_START] + table[last + RoundField.TOUCHES],
               table[last + RoundField.DEMANDS_START] + table[last + RoundField.DEMANDS],
               table[last + RoundField.CACHE_START] + table[last + RoundField.CACHINGS])
        if got != (n_free, n_touch, n_dem, n_cache) or (
                has_seg and table[last + RoundField.FREE_OFFSETS_START] + table[last + RoundField.FREE_CALLS] + 1
                != n_seg):
            raise InvalidArgumentError(op, f"the round table adds up to (free ids, touch ids, demands, cached "
                                           f"blocks) {got}, the parts have {(n_free, n_touch, n_dem, n_cache)}")

    # ---- the read API: device views for a host mirror of the pool (the vLLM adapter), no wait ------
    def mirror_rows(self, idx: torch.Tensor, key_slots: int | None = None) -> torch.Tensor:
        """``int64[len(idx), MirrorCol.KEYS + MIRROR_KEY_WIDTH * k]`` on the device (``k``: ``key_slots``,
        default ``max_keys_per_block``), per block of ``idx`` (``int64[n]`` ids on the device), columns
        named by ``kernels/layout.py``'s MirrorCol: ref count, key count, tokens its primary key covers
        (-1: none), then per key slot of its first ``k``, primary first, ``(hi, lo, insertion seq)``
        (MirrorKey; slots past the key count are unspecified; ``hi, lo`` are device keys,
        :meth:`key_name` gives vLLM's). Not waiting."""
        s, mk = self.state, self.max_keys_per_block
        k = mk if key_slots is None else max(0, min(int(key_slots), mk))
        kv = s.keys.view(self.num_blocks, mk, KEY_WIDTH)[idx, :k]
        keys = torch.cat([kv[:, :, KeyCol.HI: KeyCol.LO + 1], kv[:, :, KeyCol.SEQ: KeyCol.SEQ + 1]],  # MirrorKey's order
                         dim=2).reshape(idx.numel(), MIRROR_KEY_WIDTH * k)
        per_block = {MirrorCol.REF_CNT: s.ref_cnt, MirrorCol.NUM_KEYS: s.num_keys, MirrorCol.HASH_NTOK: s.hash_ntok}
        return torch.cat([per_block[c][idx].long()[:, None] for c in sorted(per_block)] + [keys], dim=1)

    def free_window(self, n: int) -> torch.Tensor:
        """``int64[min(ring capacity, n)]`` on the device: the ids in the free queue's first ``n`` ring
        slots from the head, -1 for holes (free blocks a touch unlinked) and slots past the tail; the
        others are the free queue's first ids, in order (docs/algorithms.md section 1). Not waiting."""
        st, c = self.state, self.config.C
        rel = self._window_offsets.get(n)
        if rel is None:
            rel = self._window_offsets[n] = torch.arange(min(c, n), dtype=torch.int64, device=self.device)
        head, tail = st.ctrl[Ctrl.HEAD].long(), st.ctrl[Ctrl.TAIL].long()
        v = st.ring[(head + rel) & (c - 1)].long()
        return torch.where((rel < tail - head) & (v >= 0), v, -1)

    def counters(self) -> torch.Tensor:
        """``int64[len(Counter)]`` on the device, entries named by ``kernels/layout.py``'s Counter: the
        status word's error code (0: none), the free count, the key insertion counter, the undrained
        event rows and the undrained reuse-log entries. Not waiting."""
        st = self.state
        return torch.cat([st.status[Status.CODE: Status.CODE + 1],  # Counter's order
                          st.ctrl[Ctrl.NUM_FREE: Ctrl.REUSE_COUNT + 1].long()])

    def key_name(self, device_key: tuple[int, int]) -> tuple[bytes, int]:
        """The ``(block hash bytes, group)`` of a device key ``(hi, lo)`` read by :meth:`mirror_rows`."""
        return self.registry.name(device_key)

    def sweep_key_names(self) -> bool:
        """Housekeeping for a reader that does not call :meth:`check` (which does it after each wait):
        once the host's table of key names (:meth:`key_name`) has doubled since its last sweep, forget
        the names of keys neither live on the device nor pinned (reading the device's keys, a
        synchronisation). Returns whether it swept; most calls only compare two ints. The keys
        :meth:`apply_predicted` made on the device are named first (one device read where there are any)."""
        self._name_device_keys()
        return self.registry.maybe_sweep()

    @locked
    def _name_device_keys(self) -> None:
        """Teach the registry the keys :meth:`apply_predicted` made on the device since the last call:
        their values read back in ONE device read (after the streams that made them), paired with the
        ``(hash, group)`` the host kept. Also the registry's name source (a key it cannot name yet)."""
        pending = self._unnamed
        if not pending:
            return
        self._unnamed = []  # taken before the read: a launch meanwhile (another thread's) stays for the next
        if self.device.type == "cuda":
            here = torch.cuda.current_stream(self.device)
            for s in {id(e[2]): e[2] for e in pending}.values():
                if s is not None and s != here:
                    here.wait_stream(s)
        try:
            vals = (pending[0][1] if len(pending) == 1 else torch.cat([t for _, t, _ in pending])).tolist()
        except BaseException:
            self._unnamed = pending + self._unnamed  # nothing named, nothing lost
            raise
        o = 0
        for pairs, _, _ in pending:
            n = len(pairs)
            self.registry.learn(zip(vals[o: o + n], vals[o + n: o + 2 * n]), pairs)
            o += 2 * n

    def host_tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        """Host ints as a 1-D tensor on the device without a stream synchronisation (pinned and
        ``non_blocking`` on CUDA)."""
        return self._tensor(values, dtype)

    def _i32_part(self, op: str, v, what: str):
        """An ``apply_batched`` part: (None, 0), (the checked device tensor, length) or (host ints
        within int32, length)."""
        if v is None:
            return None, 0
        if type(v) is list:  # the fast path's (read, not kept)
            vals = v
        elif isinstance(v, torch.Tensor):
            t = self._device_i32(op, v, what)
            return t, t.numel()
        else:
            vals = as_host_list(op, v, what)
        if not set(map(type, vals)) <= _INT:  # plain ints (the fast path's) are checked at C speed
            vals = [as_int(op, x, what) for x in vals]
        if vals and (min(vals) < -2**31 or max(vals) >= 2**31):
            bad = next(x for x in vals if not -2**31 <= x < 2**31)
            raise InvalidArgumentError(op, f"{what} holds {bad}, outside int32", bad)
        return vals, len(vals)

    @staticmethod
    def _rounds(op: str, rounds, n_free: int, n_seg, n_touch: int, dem: list[int], per_call: list[int]) -> list:
        """``apply_batched``'s rounds checked against the parts' lengths (``n_seg``: None without free
        ids), as ``FlushBatch.of_rounds`` takes them (cache calls as cached blocks). Raises InvalidArgumentError
        where they do not add up."""
        nseg = 0 if n_seg is None else n_seg
        if rounds is None:
            return [(n_free, max(nseg - 1, 0), n_touch, dem, sum(per_call))]
        out, f, s, t, d, c = [], 0, 0, 0, 0, 0
        for rd in rounds if type(rounds) is list else as_host_list(op, rounds, "rounds"):
            if not isinstance(rd, (tuple, list)) or len(rd) != 5:
                raise ArgumentTypeError(op, f"each round is (free ids, free calls, touch ids, demands, cache calls), "
                                            f"got {rd!r}")
            nfi, nfc, nt, ndm, ncc = rd
            if not (type(nfi) is int and type(nfc) is int and type(nt) is int and type(ndm) is int
                    and type(ncc) is int):  # plain ints (the fast path's) skip the conversions
                nfi, nfc, nt, ndm, ncc = (as_int(op, x, "a round's count") for x in rd)
            if min(nfi, nfc, nt, ndm, ncc) < 0:
                raise InvalidArgumentError(op, f"a round's counts must be >= 0, got {tuple(rd)}")
            out.append((nfi, nfc, nt, dem[d:d + ndm], sum(per_call[c:c + ncc])))
            f, s, t, d, c = f + nfi, s + (nfc + 1 if n_seg is not None else nfc), t + nt, d + ndm, c + ncc
        want = (n_free, nseg, n_touch, len(dem), len(per_call))
        if (f, s, t, d, c) != want:
            raise InvalidArgumentError(op, f"the rounds add up to (free ids, free offsets, touch ids, demands, cache "
                                           f"calls) {(f, s, t, d, c)}, the parts have {want}")
        return out

    @locked
    def touch_batched(self, ids: torch.Tensor, num_ids: torch.Tensor | None = None) -> None:
        """``touch`` of many blocks (order-free: one launch equals any sequence of touches)."""
        op = "touch_batched"
        ids = self._device_i32(op, ids, "ids")
        k_release.launch_touch(self.state, self.config, ids, self._count(op, num_ids, ids.numel()),
                               op=Op.TOUCH_BATCHED)

    @locked
    def lookup_batched(self, key_hi: torch.Tensor, key_lo: torch.Tensor, key_group: torch.Tensor,
                       num_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Earliest-inserted block per device key (``gpupool.keys.device_key``), -1 on a miss.
        ``key_hi, key_lo: int64[K]``, ``key_group: int32[K]``; returns ``int32[K]``. Read-only. Raises
        InvalidArgumentError for other dtypes, devices, shapes or lengths."""
        op = "lookup_batched"
        self._check_tensors(op, ((key_hi, torch.int64, "key_hi"), (key_lo, torch.int64, "key_lo"),
                                 (key_group, torch.int32, "key_group")), dims=1)
        if not key_hi.numel() == key_lo.numel() == key_group.numel():
            raise InvalidArgumentError(op, "key_hi, key_lo and key_group differ in length")
        out = torch.empty(key_hi.numel(), dtype=torch.int32, device=self.device)
        k_lookup.launch_lookup(self.state, self.config, key_hi.contiguous(), key_lo.contiguous(),
                               key_group.contiguous(), self._count(op, num_keys, key_hi.numel()), out,
                               op=Op.LOOKUP_BATCHED)
        return out

    @locked
    def longest_prefix_batched(self, key_hi: torch.Tensor, key_lo: torch.Tensor, groups: torch.Tensor,
                               lengths: torch.Tensor):
        """Longest cached prefix of R hash chains, all groups hitting at each position.

        ``key_hi, key_lo: int64[R, G, L]`` (device keys of request r's chain in group g),
        ``groups: int32[G]``, ``lengths: int32[R]`` (positions to consider, each in ``0..L``; another
        records InvalidArgumentError and looks nothing up for that request). Returns ``(hits:
        int32[R], blocks: int32[R, G, L], zero_ref: int32[R])``: the hit length, the hit blocks
        (first ``hits[r]`` valid) and how many of them have ref_cnt 0. Read-only."""
        op = "longest_prefix_batched"
        self._check_tensors(op, ((key_hi, torch.int64, "key_hi"), (key_lo, torch.int64, "key_lo")), dims=3)
        self._check_tensors(op, ((groups, torch.int32, "groups"), (lengths, torch.int32, "lengths")), dims=1)
        r, g, length = key_hi.shape
        if key_lo.shape != key_hi.shape or groups.numel() != g or lengths.numel() != r:
            raise InvalidArgumentError(op, f"shapes disagree: key_hi {tuple(key_hi.shape)}, key_lo "
                                           f"{tuple(key_lo.shape)}, groups {groups.numel()}, lengths {lengths.numel()}")
        return self._longest_prefix_of_kinds(key_hi, key_lo, groups, lengths, None)

    @locked
    def _longest_prefix_of_kinds(self, key_hi, key_lo, groups, lengths, kinds):
        """:meth:`longest_prefix_batched` of checked tensors under a manager's group kinds: ``kinds``
        None (full attention) or the manager's ``(kinds, windows, block_size, windowed)``: its groups'
        kind codes and parameters (``ManagerState``) and whether one has a windowed hit, whose rule
        then applies (docs/semantics.md section 6; a windowed group's blocks before its hit's start
        come back as the null block). For ``KVCacheManager.get_computed_blocks``."""
        r, g, length = key_hi.shape
        hits = torch.zeros(r, dtype=torch.int32, device=self.device)
        blocks = torch.full((r, g, length), -1, dtype=torch.int32, device=self.device)
        zero_ref = torch.zeros(r, dtype=torch.int32, device=self.device)
        if r and g:
            k_lookup.launch_longest_prefix(self.state, self.config, key_hi.contiguous(), key_lo.contiguous(),
                                           groups.contiguous(), lengths.contiguous(), hits, blocks, zero_ref,
                                           op=Op.LONGEST_PREFIX_BATCHED, kinds=kinds)
        return hits, blocks, zero_ref

    def _check_tensors(self, op: str, specs, dims: int) -> None:
        tensors.check_tensors(op, specs, dims, self.device)

    # ---- inspection (docs/semantics.md section 4) -------------------------------------------------
    @locked
    def free_queue(self) -> list[int]:
        """Free block ids, head to tail (the live ring slots in position order)."""
        self.check()
        s = self.state
        head, tail = int(s.ctrl[Ctrl.HEAD]), int(s.ctrl[Ctrl.TAIL])
        pos = torch.arange(head, tail, dtype=torch.int64, device=self.device) & (self.config.C - 1)
        return [v for v in s.ring[pos].tolist() if v >= 0]

    @locked
    def ref_counts(self, blocks=None) -> list[int]:
        """One ref count per block (all N, or only the given ids, in their order)."""
        self.check()
        if blocks is None:
            return self.state.ref_cnt.tolist()
        ids = self._ids("ref_counts", blocks)
        return self.state.ref_cnt[ids.long()].tolist()

    @locked
    def block_keys(self, block: int) -> list[tuple[bytes, int]]:
        """The block's keys, primary first, as ``(hash, group)``."""
        op = "block_keys"
        b = check_block_id(op, as_int(op, block, "block id"), self.num_blocks)
        self.check()
        mk = self.max_keys_per_block
        nk = int(self.state.num_keys[b])
        rows = self.state.keys[b * mk: b * mk + nk, KeyCol.HI: KeyCol.LO + 1].tolist()
        return [self.registry.name(tuple(r)) for r in rows]

    @locked
    def block_hash_num_tokens(self, block: int) -> int | None:
        """Tokens covered by the block's primary key (None when it has none)."""
        op = "block_hash_num_tokens"
        b = check_block_id(op, as_int(op, block, "block id"), self.num_blocks)
        self.check()
        v = int(self.state.hash_ntok[b])
        return None if v < 0 else v

    @locked
    def num_watchers(self) -> int:
        self.check()
        return len(self._watchers)

    @locked
    def validate(self) -> None:
        """Check every invariant of docs/semantics.md section 1 and of the device layout (ring R1-R5 of
        docs/algorithms.md section 1, key rows against the table); raise InvariantError at the first
        violation."""
        from .validate import validate_pool

        self.check()
        validate_pool(self)

    def metadata_bytes(self) -> dict[str, int]:
        """Bytes of device memory by kind (``gpupool.state.metadata_bytes``)."""
        return metadata_bytes(self.state)

    @locked
    def statistics(self) -> dict[str, int]:
        """Counters kept on the device: ring compactions, ``allocate_slots`` batches by path and the
        fallback reasons (``kernels/requests/parallel.py``). Waits for the device."""
        c = self.state.ctrl.tolist()
        return {"compactions": c[Ctrl.COMPACTIONS], "alloc_parallel": c[Ctrl.ALLOC_PARALLEL],
                "alloc_fallback": c[Ctrl.ALLOC_FALLBACK],
                "fallback_reasons": c[Ctrl.FALLBACK_REASONS: Ctrl.FALLBACK_REASONS + len(Fallback)]}


__all__ = ["BlockPool", "PoolHandle"]
