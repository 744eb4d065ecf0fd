"""Argument coercion and limits shared by both pools and both managers (the bottom layer).

Both the reference pool and the device pool accept the same inputs and reject the rest with the same
typed errors (docs/errors.md): ids are Python ints or integer tensors / arrays, hashes are ``bytes``,
group ids and token counts fit the device's int32 fields. Nothing here knows about pools.
"""
from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .errors import (
    ArgumentTypeError, InvalidArgumentError, InvalidBlockIdError, slot_range_message, slot_twice_message,
    slot_use_message,
)
from .groups import GroupKind, check_groups

NULL_BLOCK = 0
#: Largest group id and token count either pool stores (int32 on the device).
MAX_GROUP_ID = 2**31 - 1
MAX_TOKENS = 2**31 - 1


def device_arg(op: str, device) -> "torch.device":
    """The pool's device: ``None`` (CUDA when there is one, else CPU), ``"cpu"``, ``"cuda[:i]"`` or a
    ``torch.device``. Raises InvalidArgumentError for an unknown device string, a device type other
    than cpu / cuda (``meta``: the pool's kernels need real memory), and a CUDA device when there is
    none or the index is past the devices there are."""
    import torch  # the reference pool uses this module without torch
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # ValueError: an index past int64
        raise InvalidArgumentError(op, f"unknown device {device!r} (use 'cpu' or 'cuda[:index]')", device) from e
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(op, f"device {dev} is not supported: the pool runs on 'cuda' or, through "
                                   "the Triton interpreter, on 'cpu'", device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(op, f"device {dev}: no CUDA device (torch.cuda.is_available() is False); "
                                       "use device='cpu' to run the kernels in the Triton interpreter", device)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidArgumentError(op, f"device {dev}: there are {torch.cuda.device_count()} CUDA devices",
                                       device)
    return dev


def as_int(op: str, x, what: str = "value") -> int:
    """``x`` as a Python int (ints, numpy and 0-d torch integers); anything else is ArgumentTypeError."""
    if isinstance(x, bool):
        raise ArgumentTypeError(op, f"{what} must be an integer, got bool {x!r}")
    if _on_meta(x):
        raise ArgumentTypeError(op, f"{what} is a tensor on the meta device, which holds no values")
    try:
        return operator.index(x)
    except TypeError:
        raise ArgumentTypeError(op, f"{what} must be an integer, got {type(x).__name__} {x!r}") from None


def _on_meta(x) -> bool:
    return getattr(getattr(x, "device", None), "type", None) == "meta"


MAX_NUM_BLOCKS = 2**31 - 1  # block ids are int32 on the device


def num_blocks_arg(op: str, num_blocks) -> int:
    """A pool size: an integer in ``1 .. 2**31 - 1`` (block ids are int32; docs/semantics.md section 1).
    ArgumentTypeError for a non-integer, InvalidArgumentError out of range."""
    num_blocks = as_int(op, num_blocks, "num_blocks")
    if not 1 <= num_blocks <= MAX_NUM_BLOCKS:
        raise InvalidArgumentError(op, f"num_blocks must be in 1..{MAX_NUM_BLOCKS} (int32 block ids), got {num_blocks}",
                                   num_blocks)
    return num_blocks


def as_group(op: str, g) -> int:
    """A KV-cache group id: an int in ``0 .. MAX_GROUP_ID``, else InvalidArgumentError."""
    g = as_int(op, g, "group_id")
    if not 0 <= g <= MAX_GROUP_ID:
        raise InvalidArgumentError(op, f"group_id {g} outside 0..{MAX_GROUP_ID}", g)
    return g


def as_groups(op: str, groups) -> list[int]:
    """A sequence of group ids (``get_cached_block``'s ``kv_cache_group_ids``)."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise ArgumentTypeError(op, f"kv_cache_group_ids must be a sequence of ints, got {type(groups).__name__}")
    return [as_group(op, g) for g in groups]


def check_tokens(op: str, n: int, what: str) -> None:
    """Token counts the pools store must fit ``MAX_TOKENS`` (int32 on the device)."""
    if n > MAX_TOKENS:
        raise InvalidArgumentError(op, f"{what} {n} exceeds {MAX_TOKENS} tokens", n)


def check_hash(op: str, h) -> bytes:
    """A block hash: ``bytes`` (or bytearray), else ArgumentTypeError."""
    if not isinstance(h, (bytes, bytearray)):
        raise ArgumentTypeError(op, f"block hashes must be bytes, got {type(h).__name__}")
    return bytes(h)


def as_hash_list(op: str, hashes) -> Sequence:
    """A sequence of block hashes (checked one by one where used), else ArgumentTypeError."""
    if isinstance(hashes, (str, bytes, bytearray)) or not isinstance(hashes, Sequence):
        raise ArgumentTypeError(op, f"block_hashes must be a sequence of bytes, got {type(hashes).__name__}")
    return hashes


def as_host_list(op: str, xs, what: str) -> list:
    """A host sequence (list, tuple, any iterable but a string) as a list; else ArgumentTypeError."""
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise ArgumentTypeError(op, f"{what} must be a sequence, got {type(xs).__name__}")
    return list(xs)


def as_id_list(op: str, ids, what: str = "block ids") -> list[int]:
    """Block ids (a sequence of ints, or an integer tensor / array of any integer dtype) as Python ints;
    ``what`` names them in the errors."""
    if hasattr(ids, "tolist") and not isinstance(ids, list):
        dtype = str(getattr(ids, "dtype", ""))
        if "int" not in dtype:
            raise ArgumentTypeError(op, f"{what} must have an integer dtype, got {dtype}")
        if _on_meta(ids):
            raise ArgumentTypeError(op, f"{what} are a tensor on the meta device, which holds no values")
        ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ArgumentTypeError(op, f"{what} must be a sequence of ints, got {type(ids).__name__}")
    item = "block id" if what == "block ids" else f"an entry of {what}"
    return [as_int(op, b, item) for b in ids]


def as_flag_list(op: str, values) -> list[bool]:
    """A sequence (or tensor) of lookup flags as bools; ArgumentTypeError for anything else."""
    if hasattr(values, "tolist") and not isinstance(values, list):
        values = values.tolist()
        values = [values] if isinstance(values, (int, bool)) else values
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ArgumentTypeError(op, f"lookup must be a sequence of flags, got {type(values).__name__}")
    out = []
    for x in values:
        if not isinstance(x, (bool, int)) and not hasattr(x, "__index__"):
            raise ArgumentTypeError(op, f"a lookup flag must be a bool or int, got {type(x).__name__}")
        out.append(bool(x))
    return out


def admit_lists(op: str, slots, block_hashes, num_tokens, tail_tokens, resumed) -> tuple[list, list, list, list, list]:
    """``admit``'s arguments as host lists ``(slots, block_hashes, num_tokens, tail_tokens, resumed)``
    (``tail_tokens`` None: a None a request; ``resumed`` None: all False); ArgumentTypeError for a
    wrong type, InvalidArgumentError for lists of different lengths (docs/semantics.md section 9)."""
    rs = as_id_list(op, slots, "slots")
    hls = as_host_list(op, block_hashes, "block_hashes")
    nts = as_id_list(op, num_tokens, "num_tokens")
    tls = [None] * len(rs) if tail_tokens is None else as_host_list(op, tail_tokens, "tail_tokens")
    rsm = as_flag_list(op, resumed) if resumed is not None else [False] * len(rs)
    if not len(hls) == len(nts) == len(tls) == len(rsm) == len(rs):
        raise InvalidArgumentError(op, "slots, block_hashes, num_tokens, tail_tokens and resumed differ in length")
    return rs, hls, nts, tls, rsm


def check_block_id(op: str, b: int, num_blocks: int) -> int:
    if not 0 <= b < num_blocks:
        raise InvalidBlockIdError(op, f"block id {b} out of range 0..{num_blocks - 1}", b)
    return b


def partial_block_args(op: str, num_blocks: int, block, block_hashes, num_tokens, group_id, block_size,
                       hash_block_size):
    """``cache_partial_block``'s argument checks (docs/semantics.md section 2):
    returns ``(block, num_tokens, group, hash_block_size, hash, parent hash or None)``."""
    b = check_block_id(op, as_int(op, block, "block id"), num_blocks)
    block_hashes = as_hash_list(op, block_hashes)
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
    return b, nt, g, hbs, h, parent


@dataclass(frozen=True)
class CacheFullArgs:
    """``cache_full_blocks``'s checked arguments: the caching range ``[nc, nf)``, the hashes of
    ``[max(nc - 1, 0), nf)`` (the first is the parent when ``nc > 0``), the mask over the range."""

    ids: list[int]
    hashes: list[bytes]
    nc: int
    nf: int
    block_size: int
    group: int
    mask: list[bool] | None
    noop: bool

    @property
    def parent(self) -> bytes | None:
        return self.hashes[0] if self.nc > 0 else None

    def stored_hash(self, i: int) -> bytes:
        """The hash of block ``ids[i]`` for ``nc <= i < nf``."""
        return self.hashes[i - max(self.nc - 1, 0)]


def cache_full_args(op: str, num_blocks: int, caching: bool, blocks, block_hashes, num_cached_blocks,
                    num_full_blocks, block_size, group_id, block_mask) -> CacheFullArgs:
    """``cache_full_blocks``'s argument checks, shared by both pools (docs/semantics.md section 2).
    ``noop`` is set (and nothing past the scalar checks validated) when ``nc >= nf`` or caching is off.
    ``blocks`` None: the ids are checked elsewhere (on the device, ``cache_blocks_batched``); ``ids`` empty."""
    nc = as_int(op, num_cached_blocks, "num_cached_blocks")
    nf = as_int(op, num_full_blocks, "num_full_blocks")
    bs = as_int(op, block_size, "block_size")
    g = as_group(op, group_id)
    ids = [] if blocks is None else [check_block_id(op, b, num_blocks) for b in as_id_list(op, blocks)]
    block_hashes = as_hash_list(op, block_hashes)
    from .errors import InvalidCountError

    if nc < 0:
        raise InvalidCountError(op, f"num_cached_blocks must be >= 0, got {nc}", nc)
    if bs <= 0:
        raise InvalidArgumentError(op, f"block_size must be > 0, got {bs}", bs)
    if nc >= nf or not caching:
        return CacheFullArgs(ids, [], nc, nf, bs, g, None, True)
    check_tokens(op, nf * bs, "num_full_blocks * block_size")
    if blocks is not None and nf > len(ids):
        raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {len(ids)} blocks given", nf)
    if nf > len(block_hashes):
        raise InvalidArgumentError(op, f"num_full_blocks {nf} exceeds the {len(block_hashes)} hashes given", nf)
    hashes = [check_hash(op, block_hashes[i]) for i in range(max(nc - 1, 0), nf)]
    mask = None
    if block_mask is not None:
        raw = block_mask.tolist() if hasattr(block_mask, "tolist") else block_mask
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise ArgumentTypeError(op, f"block_mask must be a sequence of bools, got {type(raw).__name__}")
        mask = [bool(m) for m in raw]
        if len(mask) < nf - nc:
            raise InvalidArgumentError(op, f"block_mask has {len(mask)} entries, need {nf - nc}", len(mask))
    return CacheFullArgs(ids, hashes, nc, nf, bs, g, mask, False)


MIN_TOKEN_ID, MAX_TOKEN_ID = -(2**31), 2**31 - 1  # token ids the managers hash (int32 on the device)


def as_token_list(op: str, tokens, what: str = "tokens") -> list[int]:
    """Token ids (a sequence of ints, or an integer tensor / array) as Python ints in int32 range (the
    device keeps them as int32): ArgumentTypeError for a non-integer, InvalidArgumentError out of range."""
    ids = as_id_list(op, tokens, what)
    for t in ids:
        if not MIN_TOKEN_ID <= t <= MAX_TOKEN_ID:
            raise InvalidArgumentError(op, f"token id {t} in {what} is outside int32", t)
    return ids


HASH_BYTES = 32  # a block hash the managers chain on when they hash a request's tokens (vLLM's sha256)


def check_tail(op: str, hashes: list[bytes], tail: list[int], hash_block_size: int, max_tokens: int) -> None:
    """``add_request``'s ``tail_tokens`` for a request that hashes its own tokens (docs/semantics.md
    section 9): fewer than ``hash_block_size``, the hashes they chain on 32-byte, the request's known
    tokens at most ``max_tokens``. InvalidArgumentError otherwise."""
    if len(tail) >= hash_block_size:
        raise InvalidArgumentError(op, f"tail_tokens has {len(tail)} tokens; the tokens after the last hash block "
                                       f"are fewer than hash_block_size ({hash_block_size})", len(tail))
    if hashes and len(hashes[-1]) != HASH_BYTES:
        raise InvalidArgumentError(op, f"a request that hashes its own tokens chains on {HASH_BYTES}-byte block "
                                       f"hashes (vLLM's sha256), got {len(hashes[-1])} bytes", len(hashes[-1]))
    known = len(hashes) * hash_block_size + len(tail)
    if known > max_tokens:
        raise InvalidArgumentError(op, f"{known} tokens exceed max_blocks_per_req * block_size ({max_tokens})", known)


def own_hashing_message(slot: int) -> str:
    return (f"slot {slot} hashes its own tokens (added with tail_tokens): give them with append_tokens, "
            "not their hashes")


def as_hash_bytes_list(op: str, hashes) -> list[bytes]:
    """Every entry of a hash sequence as bytes (``add_request`` / ``append_block_hashes``)."""
    return [check_hash(op, x) for x in as_hash_list(op, hashes)]


# ---- request slots (both managers) -------------------------------------------------------------

def check_slot(op: str, r: int, num_slots: int, in_use: Callable[[int], bool], active: bool | None = True) -> int:
    """``r`` in ``0 .. num_slots - 1`` and, unless ``active`` is None, in use (``in_use(r)``) iff
    ``active``; else InvalidArgumentError naming the slot."""
    if not 0 <= r < num_slots:
        raise InvalidArgumentError(op, slot_range_message(r, num_slots), r)
    if active is not None and in_use(r) != active:
        raise InvalidArgumentError(op, slot_use_message(r, active), r)
    return r


def check_slot_list(op: str, slots: list[int], num_slots: int, in_use: Callable[[int], bool],
                     active: bool = True) -> list[int]:
    """``slots``, each in range, in use (free where ``active`` is False) and listed once; else
    InvalidArgumentError for the first bad entry in list order, a repeated slot at its first entry
    (the device's one-pass check, kernels/requests/checks.py ``mark_tile``, finds the same one)."""
    times = Counter(slots)
    for r in slots:
        check_slot(op, r, num_slots, in_use, active)
        if times[r] > 1:
            raise InvalidArgumentError(op, slot_twice_message(r), r)
    return slots


# ---- the request manager's shape -------------------------------------------------------------

@dataclass(frozen=True)
class ManagerShape:
    """The checked shape of a KV cache manager (both managers; docs/semantics.md section 6).

    ``block_size`` tokens per block in every group; request hashes per ``hash_block_size`` tokens
    (a divisor of ``block_size``; ``hashes_per_block`` = block_size / hash_block_size); block tables
    of ``max_num_reqs`` rows of ``max_blocks_per_req`` blocks; ``groups``: per KV-cache group
    ``GroupKind(kind, tokens)`` (gpupool/groups.py: full attention, a sliding window, chunked local
    attention).
    """

    block_size: int
    hash_block_size: int
    max_num_reqs: int
    max_blocks_per_req: int
    groups: tuple[GroupKind, ...]

    @property
    def hashes_per_block(self) -> int:
        return self.block_size // self.hash_block_size

    @property
    def max_tokens(self) -> int:
        return self.max_blocks_per_req * self.block_size

    @classmethod
    def make(cls, block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups) -> "ManagerShape":
        """Raises InvalidArgumentError for sizes below 1, a hash block size that does not divide the
        block size, or an unknown group spec."""
        op = "KVCacheManager"
        bs = as_int(op, block_size, "block_size")
        hbs = as_int(op, hash_block_size if hash_block_size is not None else bs, "hash_block_size")
        r = as_int(op, max_num_reqs, "max_num_reqs")
        m = as_int(op, max_blocks_per_req, "max_blocks_per_req")
        if bs < 1 or r < 1 or m < 1:
            raise InvalidArgumentError(op, "block_size, max_num_reqs and max_blocks_per_req must be >= 1")
        if hbs < 1 or bs % hbs:
            raise InvalidArgumentError(op, f"block_size {bs} must be a multiple of hash_block_size {hbs}", hbs)
        check_tokens(op, m * bs, "max_blocks_per_req * block_size")
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
            raise ArgumentTypeError(op, f"groups must be a sequence of group specs, got {type(groups).__name__}")
        gs = tuple(GroupKind.parse(op, g) for g in groups)
        if not gs:
            raise InvalidArgumentError(op, "at least one KV-cache group is needed")
        check_groups(op, gs, bs)
        return cls(bs, hbs, r, m, gs)
