"""A drop-in for vLLM 0.33's ``vllm.v1.core.block_pool.BlockPool`` backed by gpupool's device pool
(docs/vllm.md, "The drop-in BlockPool").

:class:`BlockPool` keeps vLLM's interface (the block proxies, the views, every argument check, the error
re-typing, vLLM's events and metrics calls) and delegates the pool's work to an engine: the per-call
engine here (:mod:`gpupool.vllm.engine`), the fast path's in :mod:`gpupool.vllm.fast_path`. Every state
change is one op of :class:`gpupool.BlockPool` (Triton kernels; docs/semantics.md section 2), or of the
CPU oracle with ``backend="reference"`` (:mod:`gpupool.vllm.backends`). vLLM's callers read block fields
(``block.ref_cnt``, ``block.block_hash``, ``block.is_null``, ``block.block_hash_num_tokens``)
thousands of times per step, so those reads come from the engine's **host mirror**: after each
mutating op the engine gathers, in one device-to-host copy, the ref count, keys and covered tokens of
exactly the blocks that op could change (plus the free count), so the mirror equals the device state
after every op (tests/vllm_plugin/test_vllm_block_pool.py checks it) and a field read never touches
the device. The op itself already waits for the device (it raises its error
at once, docs/semantics.md section 3), so the mirror costs no extra synchronisation point.

Blocks are canonical :class:`KVCacheBlock` proxies, one object per block id for the pool's life, so
vLLM's ``is`` comparisons hold. ``free_block_queue`` and ``cached_block_hash_to_block`` are read-only
views; the free-queue order (and a proxy's ``prev_free_block`` / ``next_free_block``) is read from
the device on first use after a change.

vLLM checks many arguments with ``assert``; where it does, the adapter raises gpupool's error class
combined with ``AssertionError`` (``except AssertionError`` and ``except PoolError`` both catch it).
Everything else raises gpupool's own error types (docs/errors.md). vLLM itself is not needed: with
vLLM importable, events are vLLM's own ``vllm.distributed.kv_events`` classes and extra keys come from
vLLM's ``generate_block_hash_extra_keys``; without it, :mod:`gpupool.vllm.kv_events`' classes and
``None`` extra keys.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import events as gp_events
from ..args import (
    MAX_GROUP_ID, MAX_TOKENS, as_groups, as_host_list, as_int, cache_full_args, check_block_id, check_hash,
    partial_block_args,
)
from ..errors import (
    ArgumentTypeError, DoubleFreeError, HashConflictError, InvalidArgumentError, InvalidCountError, NullBlockError, OutOfBlocksError,
    PoolError,
)
from . import kv_events as _gp_kv_events
from .backends import PoolBackend, make_backend
from .compat import event_kwargs, supports_lookahead
from .device_access import SharedDevicePool
from .engine import PerCallEngine
from .host_events import NoEvents, PoolEvents, metrics_pop, metrics_touch
from .host_mirror import HostMirror, get_block_hash, get_group_id, vllm_key

MEDIUM_GPU = "GPU"


# ---- vLLM's key helpers (vllm/v1/core/kv_cache_utils.py), restated: they are 3 lines each ----------
make_block_hash_with_group_id = vllm_key


# a ``block.ref_cnt`` raise is that many touches of the block: at most this many at once
MAX_REF_RAISE = 1 << 16


def count_arg(op: str, x, what: str) -> int:
    """A count (``num_blocks``, ``num_cached_blocks``, ...): an int >= 0 (not bool; numpy and 0-d
    tensor ints taken), else ArgumentTypeError / InvalidCountError."""
    n = as_int(op, x, what)
    if n < 0:
        raise InvalidCountError(op, f"{what} must be >= 0, got {n}", n)
    return n


def vllm_key_arg(op: str, key) -> bytes:
    """vLLM's ``BlockHashWithGroupId``: bytes longer than the 4-byte group suffix, else
    ArgumentTypeError / InvalidArgumentError."""
    key = check_hash(op, key)
    if len(key) <= 4:
        raise InvalidArgumentError(op, f"a key is the block hash then its 4-byte group id; got {len(key)} bytes")
    return key


def _vllm_side():
    """vLLM's event classes and extra-key helpers when vLLM is importable, else gpupool's (None)."""
    try:
        from vllm.distributed import kv_events as ev  # type: ignore
        from vllm.v1.core import kv_cache_utils as ku  # type: ignore
    except Exception:  # noqa: BLE001 - vLLM absent or unusable: gpupool's own classes
        return _gp_kv_events, None
    return ev, ku


_ASSERT_CLASSES: dict[type, type] = {}


def _as_assertion(e: PoolError) -> PoolError:
    """``e`` re-typed as its gpupool class *and* AssertionError (where vLLM asserts)."""
    cls = type(e)
    if isinstance(e, AssertionError):
        return e
    sub = _ASSERT_CLASSES.get(cls)
    if sub is None:
        sub = _ASSERT_CLASSES[cls] = type(cls.__name__, (cls, AssertionError), {"__module__": __name__})
    new = sub.__new__(sub)
    new.__dict__.update(e.__dict__)
    new.args = e.args
    return new


class _Asserts:
    """Context manager: gpupool errors raised inside come out as :func:`_as_assertion`."""

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if e is not None and isinstance(e, PoolError) and not isinstance(e, (OutOfBlocksError, AssertionError)):
            raise _as_assertion(e) from e
        return False


_asserts = _Asserts()


class KVCacheBlock:
    """vLLM's ``KVCacheBlock`` as a read-mostly proxy of block ``block_id`` of a gpupool-backed pool.

    Fields are read from the pool's host mirror (never the device). ``ref_cnt`` may be raised on a
    held block (vLLM's copy-on-write paths do ``block.ref_cnt += 1``): that is a gpupool ``touch``.
    Any other write raises :class:`gpupool.errors.InvalidArgumentError` (and AssertionError).

    The pool makes one per block (``pool.blocks``). Made by hand, ``KVCacheBlock(pool, block_id)``
    stands for that block of ``pool``; raises ArgumentTypeError for a ``pool`` that is not a gpupool
    vLLM pool or a ``block_id`` that is not an int, InvalidArgumentError for an id outside the pool
    or an ``is_null`` other than ``block_id == 0`` (block 0 is the null block).
    """

    __slots__ = ("_pool", "block_id", "is_null", "_s")

    def __init__(self, pool: "BlockPool", block_id: int, is_null: bool = False):
        if not isinstance(pool, BlockPool):
            raise ArgumentTypeError("KVCacheBlock", f"pool must be a gpupool.vllm BlockPool, got {type(pool).__name__}")
        if type(block_id) is not int:
            raise ArgumentTypeError("KVCacheBlock", f"block_id must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < pool.num_gpu_blocks or bool(is_null) != (block_id == 0):
            raise InvalidArgumentError("KVCacheBlock", f"block {block_id!r} (is_null={is_null!r}) is not a block of "
                                                       f"this pool of {pool.num_gpu_blocks} (block 0 is the null block)",
                                       block_id)
        self._set(pool, block_id)

    def _set(self, pool: "BlockPool", block_id: int) -> None:
        self._pool = pool
        self.block_id = block_id
        self.is_null = block_id == 0
        self._s = block_id  # the host mirror's slot (a deferred pool's placeholders use slots >= N)

    @classmethod
    def _of(cls, pool: "BlockPool", block_id: int) -> "KVCacheBlock":
        """The pool's own proxy of ``block_id`` (checked by the pool)."""
        blk = cls.__new__(cls)
        blk._set(pool, block_id)
        return blk

    @property
    def pool(self) -> "BlockPool":
        return self._pool

    def _mirror_slot(self, why: str):
        """(pool, this block's mirror slot), the mirror made exact first where it may not be for this
        block (a free block of a deferred pool after a pop that may have evicted it)."""
        p = self._pool
        if p._engine.dirty and p._ref[self._s] == 0:
            p._engine.need_exact(why)
        return p, self._s

    @property
    def ref_cnt(self) -> int:
        p = self._pool  # _mirror_slot, inlined: vLLM reads this on every prefix hit
        if p._engine.dirty and p._ref[self._s] == 0:
            p._engine.need_exact("ref_cnt")
        return p._ref[self._s]

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        self._pool._set_ref_cnt(self, value)

    @property
    def block_hash(self) -> bytes | None:
        p, s = self._mirror_slot("block_hash")
        keys = p._keys[s]
        return keys[0] if keys else None

    @property
    def block_hash_num_tokens(self) -> int | None:
        p, s = self._mirror_slot("block_hash_num_tokens")
        return p._ntok[s]

    @property
    def prev_free_block(self):
        return self._pool.free_block_queue._link(self.block_id, -1)

    @property
    def next_free_block(self):
        return self._pool.free_block_queue._link(self.block_id, +1)

    def set_block_hash(self, *a, **k):
        raise _as_assertion(InvalidArgumentError("KVCacheBlock", "block hashes of a gpupool block are set by "
                                                                 "cache_full_blocks / cache_partial_block only"))

    reset_hash = set_block_hash

    def __repr__(self) -> str:
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, _block_hash={self.block_hash!r}, "
                f"_block_hash_num_tokens={self.block_hash_num_tokens})")


class _Sentinel:
    """The free list's fake head / tail (``block_id`` -1), linked like vLLM's."""

    __slots__ = ("_queue", "_side")
    block_id = -1
    is_null = False
    ref_cnt = 0
    block_hash = None

    def __init__(self, queue, side):
        self._queue, self._side = queue, side

    @property
    def next_free_block(self):
        return self._queue._end(head=True) if self._side < 0 else None

    @property
    def prev_free_block(self):
        return self._queue._end(head=False) if self._side > 0 else None


class FreeBlockQueueView:
    """Read-only view of the pool's free queue (vLLM's ``FreeKVCacheBlockQueue``): iteration, head to
    tail, ``get_all_free_blocks()``, ``num_free_blocks`` (from the mirror), the fake head / tail and
    the proxies' ``prev_free_block`` / ``next_free_block``. The order is read from the device
    (``gpupool.BlockPool.free_queue``) once per pool change. Mutators raise InvalidArgumentError."""

    def __init__(self, pool: "BlockPool"):
        self._pool = pool
        self._version = -1
        self._order: list[int] = []
        self._pos: dict[int, int] = {}
        self.fake_free_list_head = _Sentinel(self, -1)
        self.fake_free_list_tail = _Sentinel(self, +1)

    def _snapshot(self) -> list[int]:
        e = self._pool._engine
        e.need_device("free_block_queue")
        if self._version != e.version:
            self._order = e.free_queue()
            self._pos = {b: i for i, b in enumerate(self._order)}
            self._version = e.version
        return self._order

    def _link(self, block_id: int, d: int):
        order = self._snapshot()
        i = self._pos.get(block_id)
        if i is None:
            return None
        j = i + d
        if j < 0:
            return self.fake_free_list_head
        if j >= len(order):
            return self.fake_free_list_tail
        return self._pool.blocks[order[j]]

    def _end(self, head: bool):
        order = self._snapshot()
        if not order:
            return self.fake_free_list_tail if head else self.fake_free_list_head
        return self._pool.blocks[order[0] if head else order[-1]]

    @property
    def num_free_blocks(self) -> int:
        return self._pool._engine.num_free

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return [self._pool.blocks[b] for b in self._snapshot()]

    def __iter__(self):
        return iter(self.get_all_free_blocks())

    def __len__(self) -> int:
        return self._pool._engine.num_free

    def _read_only(self, *a, **k):
        raise InvalidArgumentError("free_block_queue", "the free queue of a gpupool pool is changed by the "
                                                       "pool's ops only (a read-only view)")

    popleft = popleft_n = remove = append = append_n = prepend_n = _read_only


class BlockHashToBlockView:
    """Read-only view of the prefix cache (vLLM's ``BlockHashToBlockMap``), from the host mirror:
    ``get_one_block`` (the earliest-inserted block of a key), ``contain``, ``len`` and ``_cache``
    (``{key: block}`` or ``{key: {block_id: block}}`` in insertion order, as vLLM holds it).
    ``insert`` / ``pop`` raise InvalidArgumentError."""

    def __init__(self, pool: "BlockPool"):
        self._pool = pool

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        p = self._pool
        holders = p._holders.get(key)
        if not holders:
            return None  # a miss is exact even when the mirror is dirty: pops only remove keys
        s = next(iter(holders)) if len(holders) == 1 else min(holders, key=holders.__getitem__)
        if p._engine.dirty and p._ref[s] == 0:  # a free block: a pop since the last sync may have evicted it
            p._engine.need_exact("get_one_block")
            return self.get_one_block(key)
        return p._block(s)

    def contain(self, key: bytes, block_id: int) -> bool:
        self._pool._engine.need_device("cached_block_hash_to_block")
        return block_id in self._pool._holders.get(key, ())

    def __len__(self) -> int:
        self._pool._engine.need_device("cached_block_hash_to_block")
        return len(self._pool._holders)

    def __contains__(self, key) -> bool:
        self._pool._engine.need_device("cached_block_hash_to_block")
        return key in self._pool._holders

    @property
    def _cache(self) -> dict:
        self._pool._engine.need_device("cached_block_hash_to_block")
        out = {}
        blocks = self._pool.blocks
        for key, holders in self._pool._holders.items():
            ids = sorted(holders, key=holders.__getitem__)
            out[key] = blocks[ids[0]] if len(ids) == 1 else {b: blocks[b] for b in ids}
        return out

    def _read_only(self, *a, **k):
        raise InvalidArgumentError("cached_block_hash_to_block", "the prefix cache of a gpupool pool is changed "
                                                                 "by the pool's ops only (a read-only view)")

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        """vLLM tests seed the cache with ``insert(key, block)``; here that is the pool op
        ``cache_full_blocks`` of that one block under ``key`` (so, unlike vLLM's bare dict insert, the
        block's ``block_hash`` becomes ``key`` when it had none; ``block_hash_num_tokens`` is None)."""
        self._pool._insert_key(key, block)

    pop = _read_only


def _hashes_at(block_hashes, hash_block_size: int, block_size: int, upto: int) -> list[bytes]:
    """vLLM's ``resolve_block_hashes`` as a list: the hash at each ``block_size`` boundary (the last
    ``hash_block_size`` hash inside the block; docs/vllm.md), for the first ``upto`` blocks."""
    if block_size == hash_block_size:
        return list(block_hashes[:upto])
    if not isinstance(block_size, int) or block_size <= 0 or block_size % hash_block_size:
        raise InvalidArgumentError("cache_full_blocks", f"block_size {block_size!r} is not a positive multiple of "
                                                        f"the hash block size {hash_block_size}")
    k = block_size // hash_block_size
    n = min(upto, len(block_hashes) // k)
    return [block_hashes[(i + 1) * k - 1] for i in range(n)]


class BlockPool:
    """vLLM 0.33's ``BlockPool`` over a gpupool pool (docs/vllm.md, "The drop-in BlockPool").

    vLLM's interface: the block proxies, the views, every argument check, the error re-typing (vLLM's
    assertions), vLLM's KV events and metrics calls. The pool's work is its engine's (``_engine``):
    the per-call engine here (:class:`gpupool.vllm.engine.PerCallEngine`), the fast path's in
    :class:`gpupool.vllm.fast_path.DeferredBlockPool`; the engine owns the backend and the host mirror,
    which this class only reads.

    Args (vLLM's, same order and defaults):
        num_gpu_blocks: blocks in the pool, ids ``0 .. num_gpu_blocks - 1``; block 0 is ``null_block``.
        enable_caching: prefix caching on / off.
        hash_block_size: tokens per block hash (``request.block_hashes`` granularity).
        enable_kv_cache_events: queue KV events for :meth:`take_events`.
        metrics_collector: vLLM's ``KVCacheMetricsCollector`` (``on_block_allocated`` /
            ``on_block_accessed`` / ``on_block_evicted`` / ``reset``, called where vLLM calls them).
        num_hash_lookahead_tokens: tokens after each block covered by its hash (events only).
        medium: the events' ``medium``.
    gpupool's, keyword only:
        device: the device pool's device (default: CUDA when present, else CPU under Triton's
            interpreter). On CUDA the pool has its own stream, ``self.stream``, and every device op,
            mirror copy and synchronisation runs on it, so they wait for the pool's kernels only, not
            for work on the caller's stream (vLLM's forward pass, docs/vllm.md "TP > 1").
        max_keys_per_block: keys one block may hold (primary + partial entries; 1..64, default 8).
        device_lookups: answer :meth:`get_cached_block` with a device lookup (one launch and one
            synchronisation per call) instead of from the host mirror; both give the same block.
        backend: ``"device"`` (default: :class:`gpupool.BlockPool`) or ``"reference"`` (the CPU oracle
            :class:`gpupool.reference.ReferenceBlockPool`, same semantics; for running vLLM's test
            suites where Triton's interpreter would be too slow, docs/vllm.md).

    Raises InvalidArgumentError (and AssertionError, as vLLM asserts) for a bad ``num_gpu_blocks``.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None,
                 num_hash_lookahead_tokens: int = 0, medium: str = MEDIUM_GPU, *,
                 device: str | torch.device | None = None, max_keys_per_block: int = 8,
                 device_lookups: bool = False, backend: str = "device"):
        if not isinstance(num_gpu_blocks, int) or isinstance(num_gpu_blocks, bool) or num_gpu_blocks <= 0:
            raise _as_assertion(InvalidArgumentError("BlockPool", f"num_gpu_blocks must be a positive int, got "
                                                                  f"{num_gpu_blocks!r}"))
        hbs = as_int("BlockPool", hash_block_size, "hash_block_size") if not isinstance(hash_block_size, bool) else 0
        if hbs <= 0:
            raise _as_assertion(InvalidArgumentError("BlockPool", f"hash_block_size must be a positive int, got "
                                                                  f"{hash_block_size!r}"))
        self.num_gpu_blocks = num_gpu_blocks
        self.medium = medium
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = hbs
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.metrics_collector = metrics_collector
        self.device_lookups = device_lookups
        self._ev, self._ku = _vllm_side()
        if num_hash_lookahead_tokens and not supports_lookahead(self._ku):
            raise InvalidArgumentError("BlockPool", "num_hash_lookahead_tokens needs a vLLM with lookahead "
                                                    "hashing (0.33); the installed vLLM has none")
        self.backend = backend
        self._engine = self._make_engine(make_backend(
            backend, num_gpu_blocks, enable_caching=self.enable_caching,
            enable_kv_cache_events=self.enable_kv_cache_events and self._device_events(),
            max_keys_per_block=max_keys_per_block, device=device))
        m = self._engine.mirror  # read here (vLLM's hot path); written by the engine's mirror only
        self._ref, self._keys, self._ntok, self._holders = m.ref, m.keys, m.ntok, m.holders
        self.blocks: list[KVCacheBlock] = [KVCacheBlock._of(self, i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueueView(self)
        self.cached_block_hash_to_block = BlockHashToBlockView(self)
        self.kv_event_queue: list = []

    def _make_engine(self, backend: PoolBackend) -> PerCallEngine:
        """The engine over ``backend`` (the fast path's class builds its own)."""
        return PerCallEngine(backend, (lambda m: PoolEvents(backend.pool)) if self.enable_kv_cache_events
                             else (lambda m: NoEvents()))

    def _device_events(self) -> bool:
        """Whether the pool records the KV events (the per-call engine); else the engine makes them."""
        return True

    @property
    def stream(self):
        """The pool's own CUDA stream (None off CUDA; class docstring, ``device``)."""
        return self._engine.stream

    @property
    def mirror(self) -> HostMirror:
        """The engine's host mirror (read only here)."""
        return self._engine.mirror

    @property
    def _backend(self) -> PoolBackend:
        return self._engine.backend

    @property
    def _dev(self):
        """The pool behind the adapter (:class:`gpupool.BlockPool` or the reference pool)."""
        return self._engine.pool

    def end_step(self) -> None:
        """The end of a scheduler step (``GpuPoolScheduler`` calls it after each ``schedule()``): the
        fast path launches its batch here (docs/vllm.md); the per-call engine has nothing waiting."""
        self._engine.end_step()

    def _block(self, slot: int) -> KVCacheBlock:
        """The proxy of a mirror slot (a block id, or a placeholder's slot on the fast path)."""
        n = self.num_gpu_blocks
        return self.blocks[slot] if slot < n else self._engine.pending[slot - n]

    # ---- blocks -> ids ----------------------------------------------------------------------------
    def _ids(self, blocks) -> list[int]:
        """The block ids of ``blocks`` (KVCacheBlocks of this pool; a placeholder's id read, which binds
        it), else ArgumentTypeError."""
        out = []
        for blk in as_host_list("BlockPool", blocks, "blocks"):
            if not issubclass(type(blk), KVCacheBlock) or blk._pool is not self:  # type(): not fooled by __class__
                raise ArgumentTypeError("BlockPool", f"expected a KVCacheBlock of this pool, got {blk!r}")
            out.append(blk.block_id)
        return out

    def _own_slots(self, blocks: list) -> list[int] | None:
        """The block ids of ``blocks`` (a list) but the null block where every one is a
        :class:`KVCacheBlock` of this pool (its slot is its id), else None; one pass."""
        out = []
        for blk in blocks:
            if type(blk) is not KVCacheBlock or blk._pool is not self:
                return None
            if not blk.is_null:
                out.append(blk._s)
        return out

    def _live_slots(self, blocks: list) -> list[int]:
        """The mirror slots of ``blocks`` (a list) but the null block, else ArgumentTypeError; one pass
        over canonical blocks."""
        out = self._own_slots(blocks)
        if out is not None:
            return out
        out = []
        for blk in blocks:
            if type(blk) is not KVCacheBlock or blk._pool is not self:
                if not issubclass(type(blk), KVCacheBlock) or blk._pool is not self:
                    self._ids([blk])
            if not blk.is_null:
                out.append(blk._s)
        return out

    def _settled(self, blocks: list, slots: list[int], why: str) -> list[int]:
        """``slots`` of ``blocks`` with every one at ref 0 on the host exact: while the mirror is dirty
        the engine synchronises first (a placeholder's pop may have taken such a block), and the slots
        are read again (placeholders bound to their ids)."""
        e = self._engine
        if e.dirty and 0 in map(self._ref.__getitem__, slots):  # at C speed
            e.need_exact(why)
            return self._live_slots(blocks)
        return slots

    # ---- vLLM's BlockPool interface ---------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the free queue's head (evicting their keys), each with ref_cnt 1.
        Raises OutOfBlocksError (a ValueError, as vLLM's) when fewer are free, ArgumentTypeError /
        InvalidCountError for a count that is not an int >= 0."""
        e = self._engine
        # a decode step's pop; the type first: `==` of an arbitrary count may be ambiguous or raise
        # (a metrics collector set after construction takes the general path, which calls it)
        if type(num_blocks) is int and num_blocks == 1 and e.quick and e.num_free and not self.metrics_collector:
            s = e.pop_one()
            if s is not None:
                return [self.blocks[s]]
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = count_arg("get_new_blocks", num_blocks, "num_blocks")
        if num_blocks > e.num_free:
            raise OutOfBlocksError("get_new_blocks", f"Cannot get {num_blocks} free blocks from the pool", num_blocks)
        slots = e.get_new_blocks(num_blocks)
        if self.enable_kv_cache_events:
            self._drain_events()
        if slots and slots[-1] >= self.num_gpu_blocks:
            k0 = slots[0] - self.num_gpu_blocks
            out = e.pending[k0: k0 + len(slots)]
        else:
            out = list(map(self.blocks.__getitem__, slots))
        if self.metrics_collector:
            metrics_pop(self.metrics_collector, out, self.enable_caching)
        return out

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release one reference per block in eviction order (null blocks skipped; blocks of another
        pool forwarded to it, as vLLM does). All or nothing: every block of every pool is checked
        first (ArgumentTypeError for one that is no block, DoubleFreeError (and AssertionError) for a
        release below 0), then this pool's are freed, then the others'."""
        blocks = ordered_blocks if type(ordered_blocks) is list else as_host_list(
            "free_blocks", ordered_blocks, "ordered_blocks")
        slots, others = self._own_slots(blocks), None  # the common case, one pass: this pool's own blocks
        if slots is None:
            blocks, others = self._split_by_pool(blocks)
            for owner, blks in others.values():  # all or nothing: every pool's blocks checked first
                owner._check_release(blks)
        slots = self._check_release(blocks, slots)
        if slots:
            with _asserts:
                self._engine.free_blocks(slots)
        if others:
            for owner, blks in others.values():
                owner.free_blocks(blks)

    def _split_by_pool(self, blocks) -> tuple[list, dict]:
        """(this pool's non-null blocks, {id(pool): (pool, its blocks)} for gpupool pools' others)."""
        mine, others = [], {}
        for blk in blocks:
            if not issubclass(type(blk), KVCacheBlock):  # no block (a mock's attributes are not read)
                mine.append(blk)
                continue
            if blk.is_null:
                continue
            owner = getattr(blk, "pool", None)
            if isinstance(owner, BlockPool) and owner is not self:
                others.setdefault(id(owner), (owner, []))[1].append(blk)
                continue
            mine.append(blk)
        return mine, others

    def _check_release(self, blocks: list, slots: list[int] | None = None) -> list[int]:
        """The mirror slots of ``blocks`` but the null block (``slots`` where the caller has them),
        checked to be this pool's and held as often as listed (exact on the host for held blocks; a
        block at ref 0 while the mirror is dirty is read from the device first), nothing changed;
        raises ArgumentTypeError, DoubleFreeError (and AssertionError)."""
        if slots is None:
            slots = self._live_slots(blocks)
        ref = self._ref
        if len(set(slots)) == len(slots):
            short = min(map(ref.__getitem__, slots), default=1) < 1  # one pass at C speed
        else:
            short = any(ref[s] < c for s, c in Counter(slots).items())
        if short:  # whatever waits on the fast path synchronised first: the ids after the binding
            self._engine.need_device("op:free_blocks")
            slots = self._live_slots(blocks)
            counts = Counter(slots)
            for s in slots:
                if ref[s] < counts[s]:
                    b = self._block(s).block_id
                    raise _as_assertion(DoubleFreeError("free_blocks", f"block {b} freed more times than it is "
                                                                       "referenced (double free)", b))
        return slots

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit: each non-null block leaves the free queue if ref_cnt is 0, then ref_cnt += 1."""
        if type(blocks) is not list:
            blocks = as_host_list("touch", blocks, "blocks")
        slots = self._live_slots(blocks)
        if not slots:
            return
        slots = self._settled(blocks, slots, "touch")
        self._engine.touch(slots)
        if self.metrics_collector:
            metrics_touch(self.metrics_collector, blocks)

    def _set_ref_cnt(self, blk: KVCacheBlock, value: int) -> None:
        """``blk.ref_cnt = value``: a raise of a held non-null block by at most ``MAX_REF_RAISE``
        (touches; no metrics call, as vLLM's write makes none), else InvalidArgumentError (and
        AssertionError), checked on the host."""
        # a placeholder's own row is the host's: only a block a placeholder's pop may have taken is read
        (s,) = self._settled([blk], [blk._s], "ref_cnt") if type(blk) is KVCacheBlock else (blk._s,)
        cur = self._ref[s]
        if isinstance(value, int) and not isinstance(value, bool) and value - cur > MAX_REF_RAISE:
            raise _as_assertion(InvalidArgumentError(
                "KVCacheBlock.ref_cnt", f"block {blk.block_id}: ref_cnt raised by {value - cur}, more than "
                f"{MAX_REF_RAISE} at once", value))
        if (not isinstance(value, int) or isinstance(value, bool) or blk.is_null or cur <= 0 or value < cur):
            raise _as_assertion(InvalidArgumentError(
                "KVCacheBlock.ref_cnt", f"block {blk.block_id}: ref_cnt of a gpupool block may only be raised on "
                f"a held block (from {cur} to {value!r}); release references with free_blocks", blk.block_id))
        if value > cur:
            self._engine.raise_refs(s, value - cur)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """Release one reference of each block; ``on_reuse(block)`` fires when the pool hands it out
        again (or the cache is reset). Raises ArgumentTypeError (not this pool's blocks, ``on_reuse``
        not callable), NullBlockError, DoubleFreeError (each also an AssertionError)."""
        ids = self._ids(blocks)
        if not callable(on_reuse):
            raise ArgumentTypeError("unpin_blocks", "on_reuse must be callable")
        if 0 in ids:  # checked here: both backends' words
            raise _as_assertion(NullBlockError("unpin_blocks", "cannot unpin the null block", 0))
        with _asserts:
            self._engine.unpin_blocks(ids, lambda b: on_reuse(self.blocks[b]))

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """The earliest-inserted block under ``(block_hash, g)`` for each group, or None if any misses
        (from the mirror; ``device_lookups=True``: a device lookup). Raises ArgumentTypeError for a
        hash that is not bytes or groups that are not ints, InvalidArgumentError for a group outside
        ``0 .. 2**31 - 1`` (either way)."""
        e = self._engine
        if e.quick and type(block_hash) is bytes and type(kv_cache_group_ids) is list and len(kv_cache_group_ids) == 1:
            g = kv_cache_group_ids[0]  # vLLM's common case in one step: one group, one holder (the fast path)
            if type(g) is int and 0 <= g <= MAX_GROUP_ID and not self.device_lookups:
                hs = self._holders.get(block_hash + g.to_bytes(4, "big"))
                if not hs:
                    return None  # a miss is exact even when the mirror is dirty: pops only remove keys
                if len(hs) == 1:
                    (s,) = hs
                    if not (e.dirty and self._ref[s] == 0) and s < self.num_gpu_blocks:
                        return [self.blocks[s]]
        if self.device_lookups:
            self._engine.before_op("get_cached_block")
        if type(block_hash) is not bytes:
            block_hash = check_hash("get_cached_block", block_hash)
        groups = kv_cache_group_ids
        if type(groups) is not list or not (  # one group (vLLM's common case) checked without a generator
                len(groups) == 1 and type(groups[0]) is int and 0 <= groups[0] <= MAX_GROUP_ID
                or all(type(g) is int and 0 <= g <= MAX_GROUP_ID for g in groups)):
            groups = as_groups("get_cached_block", groups)
        if self.device_lookups:
            ids = self._engine.device_lookup(block_hash, list(groups))
            return None if ids is None else [self.blocks[b] for b in ids]
        out = []
        view = self.cached_block_hash_to_block
        for g in groups:  # bytes and plain ints here: vLLM's key is their concatenation (vllm_key)
            blk = view.get_one_block(block_hash + g.to_bytes(4, "big"))
            if blk is None:
                return None
            out.append(blk)
        return out

    def cache_full_blocks(self, request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        """vLLM's ``cache_full_blocks``: gpupool's ``cache_full_blocks`` with ``request.block_hashes``
        viewed at ``block_size`` (docs/semantics.md section 2). Raises ArgumentTypeError /
        InvalidCountError / InvalidArgumentError / HashConflictError (and AssertionError) for counts
        that are not ints >= 0, ``num_full_blocks`` past ``blocks``, a request without
        ``block_hashes``, a block listed twice or keyed covering as many tokens, before anything is
        allocated."""
        nc, nf = num_cached_blocks, num_full_blocks
        e = self._engine
        if (e.quick and block_mask is None and type(nc) is int and type(nf) is int and nf == nc + 1
                and type(block_size) is int and block_size == self.hash_block_size and type(blocks) is list
                and len(blocks) > nc >= 0
                and e.cache_one(request, blocks[nc], nc, block_size, kv_cache_group_id)):
            return  # a decode step's caching of the block it filled
        if type(nc) is not int or type(nf) is not int:  # the common case skips the full checks
            nc, nf = self._cache_counts(request, blocks, nc, nf, block_size)
        if nc >= nf:
            return
        g = kv_cache_group_id
        if e.cache_fast(request, blocks, nc, nf, block_size, g, block_mask, self.hash_block_size):
            if self.enable_kv_cache_events:
                self._drain_events(self._full_stored(request, blocks, nc, nf, block_size, g, None))
            return
        e.before_op("cache_full_blocks")
        nc, nf = self._cache_counts(request, blocks, nc, nf, block_size)
        with _asserts:
            if block_mask is not None and len(block_mask) != nf - nc:
                raise InvalidArgumentError("cache_full_blocks", f"block_mask has {len(block_mask)} entries for "
                                                                f"{nf - nc} blocks")
            # only blocks[nc:nf] are read (vLLM's own tests pass placeholders before nc): id 0 stands in
            ids = [0] * nc + self._ids(blocks[nc:nf])
            hashes = _hashes_at(request.block_hashes, self.hash_block_size, block_size, nf)
            mask = None if block_mask is None else list(block_mask)
            self._cache_conflicts(ids, hashes, nc, nf, block_size, g, mask)
            e.cache_full_blocks(ids, hashes, nc, nf, block_size, g, mask)
        if self.enable_kv_cache_events:
            self._drain_events(self._full_stored(request, blocks, nc, nf, block_size, g, block_mask))

    def _cache_conflicts(self, ids, hashes, nc: int, nf: int, block_size: int, group: int, mask) -> None:
        """``cache_full_blocks``' checks that read the blocks' keys, made on the host from the mirror
        (exact for held blocks) after the pool's argument checks, so that both backends word them
        alike: a block listed twice (InvalidArgumentError), a keyed block covering at least as many
        tokens as the new key (HashConflictError; docs/semantics.md section 2)."""
        op = "cache_full_blocks"
        if not cache_full_args(op, self.num_gpu_blocks, self.enable_caching, ids, hashes, nc, nf, block_size,
                               group, mask).noop:
            seen = set()
            for i in range(nc, nf):
                b = ids[i]
                if b == 0 or (mask is not None and not mask[i - nc]):
                    continue
                if b in seen:
                    raise InvalidArgumentError(op, f"block {b} is listed twice", b)
                seen.add(b)
                cur, ntok = self._ntok[b], (i + 1) * block_size
                if self._keys[b] and cur is not None and cur >= ntok:
                    raise HashConflictError(op, f"block {b} is already cached covering {cur} tokens (>= {ntok})", b)

    def _full_stored(self, request, blocks, nc: int, nf: int, block_size: int, group: int, block_mask):
        """gpupool's BlockStored of a ``cache_full_blocks`` call -> vLLM's, with the request's tokens,
        extra keys (one per non-null unmasked block) and lookahead tokens."""
        def stored(e):
            keys, look, mm = [], [] if self.num_hash_lookahead_tokens else None, 0
            for i in range(nc, nf):
                if blocks[i].is_null or (block_mask is not None and not block_mask[i - nc]):
                    continue
                k, mm = self._extra_keys(request, i * block_size, (i + 1) * block_size, mm)
                keys.append(k)
                if look is not None:
                    look.append(self._lookahead(request, (i + 1) * block_size))
            return self._stored(request, [self._ext(h) for h in e.block_hashes],
                                None if e.parent_block_hash is None else self._ext(e.parent_block_hash),
                                nc * block_size, nf * block_size, block_size, group, keys, look)
        return stored

    def _cache_counts(self, request, blocks, nc, nf, block_size) -> tuple[int, int]:
        """``cache_full_blocks``' counts checked (module docstring of the method): (nc, nf)."""
        op = "cache_full_blocks"
        with _asserts:
            nc, nf = count_arg(op, nc, "num_cached_blocks"), count_arg(op, nf, "num_full_blocks")
            if nc >= nf:
                return nc, nf
            bs = count_arg(op, block_size, "block_size")
            if not hasattr(blocks, "__getitem__") or not hasattr(blocks, "__len__"):
                raise ArgumentTypeError(op, f"blocks must be a list of KVCacheBlocks, got {type(blocks).__name__}")
            if nf > len(blocks):
                raise InvalidArgumentError(op, f"num_full_blocks {nf} is past the request's {len(blocks)} blocks", nf)
            if nf * bs > MAX_TOKENS:
                raise InvalidArgumentError(op, f"{nf} blocks of {bs} tokens exceed {MAX_TOKENS} tokens", nf)
            if getattr(request, "block_hashes", None) is None:
                raise ArgumentTypeError(op, f"request must be a vLLM Request (with block_hashes), got "
                                            f"{type(request).__name__}")
        return nc, nf

    def emit_cached_block_events(self, request, num_cached_blocks: int, block_size: int,
                                 kv_cache_group_id: int) -> None:
        """vLLM's ``BlockStored`` for blocks reused from the prefix cache (events only, no state)."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        hashes = _hashes_at(request.block_hashes, self.hash_block_size, block_size, num_cached_blocks)
        keys, look, mm = [], [] if self.num_hash_lookahead_tokens else None, 0
        for i in range(num_cached_blocks):
            k, mm = self._extra_keys(request, i * block_size, (i + 1) * block_size, mm)
            keys.append(k)
            if look is not None:
                look.append(self._lookahead(request, (i + 1) * block_size))
        if not hashes:
            return
        self.kv_event_queue.append(self._stored(request, [self._ext(h) for h in hashes], None, 0,
                                                num_cached_blocks * block_size, block_size, kv_cache_group_id,
                                                keys, look))

    def cache_partial_block(self, request, block: KVCacheBlock, num_tokens: int, kv_cache_group_id: int,
                            block_size: int, replace_existing_hashes: bool = False) -> bytes | None:
        """vLLM's ``cache_partial_block``: gpupool's with ``request.block_hashes``; returns vLLM's key
        bytes, or None for the null block."""
        self._engine.before_op("cache_partial_block")
        (b,) = self._ids([block])
        if block.is_null:
            return None
        with _asserts:
            partial_block_args("cache_partial_block", self.num_gpu_blocks, b, request.block_hashes, num_tokens,
                               kv_cache_group_id, block_size, self.hash_block_size)
            key = self._engine.cache_partial_block(b, request.block_hashes, num_tokens, kv_cache_group_id,
                                                   block_size, self.hash_block_size, replace_existing_hashes)
        if key is None:
            return None
        if self.enable_kv_cache_events:
            hbs = self.hash_block_size
            start = (num_tokens // hbs - 1) * hbs

            def stored(e):
                mm = 0
                feats = getattr(request, "mm_features", None)
                if self._ku is not None and start > 0 and feats:
                    last = feats[-1].mm_position
                    if last.offset + last.length > start:
                        from vllm.multimodal.utils import get_mm_features_in_window  # type: ignore
                        mm, _ = get_mm_features_in_window(feats, start, num_tokens)
                k, _ = self._extra_keys(request, start, num_tokens, mm)
                look = [self._lookahead(request, num_tokens)] if self.num_hash_lookahead_tokens else None
                return self._stored(request, [self._ext(h) for h in e.block_hashes],
                                    None if e.parent_block_hash is None else self._ext(e.parent_block_hash),
                                    start, num_tokens, num_tokens - start, kv_cache_group_id, [k], look)

            self._drain_events(stored)
        return make_block_hash_with_group_id(*key)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Copy-on-write: ``src_block``'s keys move to ``dst_block`` (no events)."""
        self._engine.before_op("move_block_hashes")
        s, d = self._ids([src_block, dst_block])
        with _asserts:
            if d == 0:  # checked here: both backends' words
                raise NullBlockError("move_block_hashes", "cannot move hashes onto the null block", d)
            self._engine.move_block_hashes(s, d)
        if self.enable_kv_cache_events:
            self._drain_events()

    def _insert_key(self, key: bytes, block: KVCacheBlock) -> None:
        """Register ``key`` (vLLM's key bytes) on ``block``: gpupool's ``cache_full_blocks`` of one
        block with block size 1 (``block_hash_num_tokens`` is then whatever the pool records for it)."""
        self._engine.before_op("_insert_key")
        with _asserts:
            key = vllm_key_arg("cached_block_hash_to_block.insert", key)
        (b,) = self._ids([block])
        with _asserts:
            self._engine.cache_full_blocks([b], [get_block_hash(key)], 0, 1, 1, get_group_id(key), None)
        if self.enable_kv_cache_events:
            self._drain_events(lambda e: self._ev.BlockStored(
                block_hashes=[self._ext(h) for h in e.block_hashes], parent_block_hash=None, token_ids=[],
                block_size=e.block_size, lora_id=None, medium=self.medium, lora_name=None,
                extra_keys=[None] * len(e.block_hashes), group_idx=e.group_id))

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Remove every key of ``block``; True if it had one (vLLM's metrics call first, as vLLM's)."""
        self._engine.before_op("_maybe_evict_cached_block")
        (b,) = self._ids([block])
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        had = bool(self._keys[b])
        self._engine.evict_blocks([b])
        if self.enable_kv_cache_events:
            self._drain_events()
        return had

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Remove every key of each listed block id; ref counts and the queue unchanged. Raises
        InvalidBlockIdError (and AssertionError, as vLLM) for an id out of range."""
        self._engine.before_op("evict_blocks")
        ids = as_host_list("evict_blocks", block_ids, "block_ids")
        if not ids:
            return
        with _asserts:
            ids = [check_block_id("evict_blocks", as_int("evict_blocks", b, "block id"), self.num_gpu_blocks)
                   for b in ids]
            self._engine.evict_blocks(ids, self._metrics_evicted if self.metrics_collector else None)
        if self.enable_kv_cache_events:
            self._drain_events()

    def _metrics_evicted(self, ids: list[int]) -> None:
        for b in ids:
            self.metrics_collector.on_block_evicted(self.blocks[b])

    def reset_prefix_cache(self) -> bool:
        """Drop every key if no block is held (True), else change nothing (False)."""
        if not self._engine.reset_prefix_cache():
            return False
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self._drain_events()
        return True

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether ``block`` (a block of this pool, else ArgumentTypeError) may take new tokens."""
        self._ids([block])
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def get_num_free_blocks(self) -> int:
        return self._engine.num_free

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        if not total:
            return 0
        return 1.0 - self._engine.num_free / total

    def take_events(self) -> list:
        if not self.enable_kv_cache_events:
            return []
        ev, self.kv_event_queue = self.kv_event_queue, []
        return ev

    @property
    def cached_block_hashes_by_block(self) -> dict[int, set[bytes]]:
        """vLLM's map of each block's secondary keys (every key past the primary), from the mirror."""
        self._engine.need_exact("cached_block_hashes_by_block")
        return {b: set(k[1:]) for b, k in enumerate(self._keys) if len(k) > 1}

    # ---- vLLM's events ----------------------------------------------------------------------------
    def _drain_events(self, stored: Callable[[Any], Any] | None = None) -> None:
        """The engine's gpupool events -> vLLM's, into ``kv_event_queue`` (``stored`` converts a
        BlockStored with the call's request)."""
        ev = self._ev
        for e in self._engine.take_events():
            if isinstance(e, gp_events.BlockStored):
                self.kv_event_queue.append(stored(e))
            elif isinstance(e, gp_events.BlockRemoved):
                self.kv_event_queue.append(ev.BlockRemoved(
                    block_hashes=[self._ext(e.block_hash)], medium=self.medium, group_idx=e.group_id))
            elif isinstance(e, gp_events.AllBlocksCleared):
                self.kv_event_queue.append(ev.AllBlocksCleared())

    def _ext(self, h: bytes):
        if self._ku is not None:
            return self._ku.maybe_convert_block_hash(h)
        return _gp_kv_events.wire_block_hash(h)

    def _extra_keys(self, request, start: int, end: int, mm_idx: int):
        ku = self._ku
        if ku is None:
            return None, mm_idx
        if self.num_hash_lookahead_tokens:
            return ku.generate_lookahead_block_hash_extra_keys(request, start, end,
                                                               end + self.num_hash_lookahead_tokens, mm_idx)
        return ku.generate_block_hash_extra_keys(request, start, end, mm_idx)

    def _event_extra_keys(self, keys):
        if self._ku is not None:
            return self._ku.to_event_extra_keys(keys)
        return list(keys)

    def _stored(self, request, hashes, parent, start: int, end: int, block_size: int, group: int,
                extra_keys: list, lookahead) -> Any:
        lora = getattr(request, "lora_request", None)
        return self._ev.BlockStored(**event_kwargs(  # vLLM 0.32's BlockStored has no lookahead_token_ids
            self._ev.BlockStored, block_hashes=hashes, parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:end]), block_size=block_size,
            lora_id=lora.adapter_id if lora else None, medium=self.medium, lora_name=lora.name if lora else None,
            extra_keys=self._event_extra_keys(extra_keys), group_idx=group,
            session_id=getattr(request, "session_id", None), lookahead_token_ids=lookahead))

    def _lookahead(self, request, end: int) -> list[int]:
        return list(request.all_token_ids[end: end + self.num_hash_lookahead_tokens])

    # ---- other users of the pool ------------------------------------------------------------------
    @property
    def device_pool(self) -> SharedDevicePool:
        """The gpupool pool behind this adapter (``gpupool.BlockPool``; the reference pool with
        ``backend="reference"``) for other users: its batched ops, lookups, ``validate``, inspection.
        Every call goes through the adapter (:class:`gpupool.vllm.device_access.SharedDevicePool`): a
        read sees every op the adapter answered; a change waits, raises its error at the call and
        leaves the adapter's answers the device's (docs/vllm.md, "Other users of the device pool").
        Calls run on the pool's stream (``self.stream``) on CUDA."""
        return SharedDevicePool(self)

    def _other_user_reads(self, fn, args, kwargs):
        return self._engine.other_user_reads(fn, args, kwargs)

    def _other_user_changes(self, name: str, fn, args, kwargs):
        return self._engine.other_user_changes(name, fn, args, kwargs)


__all__ = ["BlockPool", "KVCacheBlock", "FreeBlockQueueView", "BlockHashToBlockView",
           "make_block_hash_with_group_id", "get_block_hash", "get_group_id"]
