"""Block hashing (chained, vLLM-compatible) and 128-bit device keys.

This is the *keys* layer of docs/design.md: it knows nothing about pools. It provides

* the prefix-cache identity of a block of tokens, computed exactly as vLLM V1 does it with its
  ``sha256`` hash function (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
  ``generate_block_hash_extra_keys``, ``hash_request_tokens``), with a *fixed* seed (:data:`NONE_HASH`)
  so that hashes are reproducible across processes and runs;
* the 128-bit key under which the device pool stores a docs/semantics.md key ``(block_hash, group_id)``
  (:func:`device_key`, :func:`device_keys`);
* the block hash of a Mooncake trace ``hash_id`` (:func:`trace_block_hash`, docs/semantics.md section 5).

Hashes are ``bytes`` (32 bytes for every hash made here; the pools accept any ``bytes``).
Token ids are Python ``int`` (anything with ``__index__``, e.g. numpy or 0-d integer torch
values, is converted to ``int`` first, so it hashes like the equal Python int).

Only the standard library and gpupool's errors are imported at module level; torch is imported lazily by
:func:`device_keys`, the one function that builds a tensor.
"""
from __future__ import annotations

import hashlib
import operator
import pickle
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "NONE_HASH",
    "PICKLE_PROTOCOL",
    "sha256_hash",
    "hash_block_tokens",
    "generate_block_hash_extra_keys",
    "hash_request_tokens",
    "device_key",
    "device_keys",
    "device_key_list",
    "trace_block_hash",
    "digest_words",
    "words_digest",
    "NONE_HASH_WORDS",
]

#: Pickle protocol used to serialise hash inputs (vLLM's ``sha256`` uses ``pickle.HIGHEST_PROTOCOL``;
#: 5 on every supported Python, 3.8+). Hashes are reproducible as long as this value is the same.
PICKLE_PROTOCOL: int = pickle.HIGHEST_PROTOCOL


def sha256_hash(obj: Any) -> bytes:
    """vLLM's ``sha256`` hash function: ``sha256(pickle.dumps(obj, HIGHEST_PROTOCOL)).digest()``.

    Args:
        obj: any picklable value; in practice a ``(parent_hash, token_tuple, extra_keys)`` tuple.

    Returns:
        The 32-byte SHA-256 digest.
    """
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


#: Parent hash of the first block of every request (32 bytes).
#:
#: vLLM draws it from ``os.urandom(32)`` unless ``PYTHONHASHSEED`` is set, in which case it is
#: ``hash_fn(os.getenv("PYTHONHASHSEED"))``. We fix it to ``sha256_hash("0")``, i.e.
#: ``sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()``, which is what vLLM
#: uses with ``PYTHONHASHSEED=0`` and the ``sha256`` hash function, so our hashes match such a vLLM
#: process bit for bit and are the same in every process whatever its ``PYTHONHASHSEED``.
NONE_HASH: bytes = sha256_hash("0")


def _token_tuple(token_ids: Iterable[int]) -> tuple[int, ...]:
    # operator.index accepts ints, numpy integers and integer 0-d tensors and rejects floats;
    # int() then normalises subclasses (bool, IntEnum), which would pickle differently.
    return tuple(int(operator.index(t)) for t in token_ids)


def hash_block_tokens(
    parent_block_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> bytes:
    """Hash one block of tokens, chained to its parent (vLLM ``hash_block_tokens``).

    ``sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=HIGHEST_PROTOCOL)).digest()``

    Args:
        parent_block_hash: hash of the previous block of the same request, or ``None`` for the first
            block, which is then chained to :data:`NONE_HASH`.
        token_ids: the block's token ids (``block_size`` of them for a full block; this function
            does not check the count).
        extra_keys: the block's extra keys (see :func:`generate_block_hash_extra_keys`), a tuple, or
            ``None`` when there are none. ``()`` and ``None`` hash differently, as in vLLM.

    Returns:
        The 32-byte block hash.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    elif not isinstance(parent_block_hash, (bytes, bytearray)):
        raise TypeError(f"parent_block_hash must be bytes or None, not {type(parent_block_hash).__name__}")
    if extra_keys is not None and not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be a tuple or None, not {type(extra_keys).__name__}")
    return sha256_hash((bytes(parent_block_hash), _token_tuple(token_ids), extra_keys))


def _check_mm_features(mm_features: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    items = []
    for item in mm_features:
        mm_hash, offset, length = item
        offset, length = operator.index(offset), operator.index(length)
        if offset < 0 or length < 0:
            raise ValueError(f"multimodal item {mm_hash!r}: offset and length must be >= 0, got {offset}, {length}")
        items.append((mm_hash, int(offset), int(length)))
    return items


def generate_block_hash_extra_keys(
    start_token_idx: int,
    end_token_idx: int,
    *,
    lora_name: str | None = None,
    mm_features: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
) -> tuple | None:
    """Extra hash keys of the block covering token positions ``[start_token_idx, end_token_idx)``.

    Mirrors vLLM's ``generate_block_hash_extra_keys``. The tuple is, in this order:

    1. the LoRA name, if ``lora_name`` is not ``None`` (vLLM: ``lora_request.lora_name``);
    2. the ``mm_hash`` of every multimodal item overlapping the block, in the order given, where
       item ``(mm_hash, offset, length)`` (placeholder range in token positions) overlaps the block
       when ``offset < end_token_idx and offset + length > start_token_idx``;
    3. ``cache_salt``, only for the block starting at token 0 and only if the salt is non-empty
       (vLLM tests ``if request.cache_salt``).

    Unlike vLLM's incremental scan, an item that ends exactly at the block start (``offset + length
    == start_token_idx``) does not overlap (vLLM's ``start > offset + length`` test can still list it
    there); everything else agrees.

    Args:
        start_token_idx, end_token_idx: token positions, ``0 <= start <= end``.
        lora_name: LoRA adapter name, or ``None`` for the base model.
        mm_features: ``(mm_hash: str, offset: int, length: int)`` items (token positions).
        cache_salt: per-request salt string, or ``None``.

    Returns:
        The tuple of extra keys, or ``None`` when there are none.
    """
    if not 0 <= start_token_idx <= end_token_idx:
        raise ValueError(f"bad token range [{start_token_idx}, {end_token_idx})")
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    for mm_hash, offset, length in _check_mm_features(mm_features):
        if offset < end_token_idx and offset + length > start_token_idx:
            keys.append(mm_hash)
    if start_token_idx == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_features: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
    parent_block_hash: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of a request (vLLM ``hash_request_tokens``).

    Block ``i`` covers token positions ``[i * block_size, (i + 1) * block_size)``; a trailing partial
    block gets no hash, so the result has ``len(token_ids) // block_size`` entries. Block ``i``'s
    hash is ``hash_block_tokens(hashes[i - 1], block_tokens, extra_keys_i)`` (block 0's parent is
    ``parent_block_hash``, ``None`` meaning :data:`NONE_HASH`), with ``extra_keys_i`` from
    :func:`generate_block_hash_extra_keys`.

    Args:
        token_ids: the request's token ids.
        block_size: tokens per block, ``> 0``.
        lora_name, mm_features, cache_salt: see :func:`generate_block_hash_extra_keys`.
        parent_block_hash: parent of block 0 (``None``: :data:`NONE_HASH`).

    Returns:
        A list of 32-byte hashes, one per full block.
    """
    block_size = operator.index(block_size)
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = _token_tuple(token_ids)
    items = _check_mm_features(mm_features)
    hashes: list[bytes] = []
    parent = parent_block_hash
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        extra = generate_block_hash_extra_keys(
            start, end, lora_name=lora_name, mm_features=items, cache_salt=cache_salt
        )
        parent = hash_block_tokens(parent, tokens[start:end], extra)
        hashes.append(parent)
    return hashes


_DEVICE_KEY_DOMAIN = b"gpupool.device_key.v1\x00"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def device_key(block_hash: bytes, group_id: int) -> tuple[int, int]:
    """128-bit device key of the docs/semantics.md key ``(block_hash, group_id)``, as signed int64 ``(hi, lo)``.

    ``d = sha256(b"gpupool.device_key.v1\\x00" + len(block_hash).to_bytes(8, "little")
    + block_hash + group_id.to_bytes(8, "little", signed=True)).digest()``;
    ``hi = int.from_bytes(d[0:8], "little", signed=True)``,
    ``lo = int.from_bytes(d[8:16], "little", signed=True)``.

    The digest covers the whole key (the length prefix keeps ``b"a"`` and ``b"a\\x00"`` apart), so
    short or structured hashes never collide by truncation; distinct keys collide only with
    probability about 2**-128 per pair. The device table (docs/design.md) identifies an entry by
    ``(key_hi, key_lo, key_group)``, so the group is also stored in the clear next to this pair.
    ``(0, 0)`` is not excluded; the table marks empty slots by ``num_keys``, not by a zero key.

    Args:
        block_hash: the block hash (any length ``bytes``).
        group_id: KV-cache group id, a signed 64-bit int (in practice ``0 <= group_id < 2**31``).

    Returns:
        ``(hi, lo)``, each in ``[-2**63, 2**63)``.
    """
    if not isinstance(block_hash, (bytes, bytearray)):
        raise TypeError(f"block_hash must be bytes, not {type(block_hash).__name__}")
    group_id = operator.index(group_id)
    if not INT64_MIN <= group_id <= INT64_MAX:
        raise ValueError(f"group_id {group_id} does not fit in int64")
    h = hashlib.sha256(_DEVICE_KEY_DOMAIN)
    h.update(len(block_hash).to_bytes(8, "little"))
    h.update(block_hash)
    h.update(group_id.to_bytes(8, "little", signed=True))
    d = h.digest()
    return int.from_bytes(d[0:8], "little", signed=True), int.from_bytes(d[8:16], "little", signed=True)


_KEY_PAIR = struct.Struct("<qq")
_PREFIXES: dict[int, bytes] = {}  # hash length -> the domain and the length prefix
_MAX_PREFIXES = 256  # hash lengths kept (vLLM's are 32 bytes; a bound, not a memo of keys)


def device_key_list(keys: Iterable[tuple[bytes, int]]) -> list[tuple[int, int]]:
    """:func:`device_key` of each ``(block_hash, group_id)``, the same values (about 1.5x faster per key:
    the domain and length prefix made once per hash length, the group's bytes once per call, one
    SHA-256 call per key over the whole message, ``(hi, lo)`` read with one ``struct`` call). Raises
    what :func:`device_key` raises."""
    out = []
    pre, groups = _PREFIXES, {}
    unpack, sha = _KEY_PAIR.unpack_from, hashlib.sha256
    for h, g in keys:
        if type(h) is not bytes or type(g) is not int or not INT64_MIN <= g <= INT64_MAX:
            out.append(device_key(h, g))  # its conversions and errors
            continue
        p = pre.get(len(h))
        if p is None:
            p = _DEVICE_KEY_DOMAIN + len(h).to_bytes(8, "little")
            if len(pre) < _MAX_PREFIXES:
                pre[len(h)] = p
        gb = groups.get(g)
        if gb is None:
            gb = groups[g] = g.to_bytes(8, "little", signed=True)
        out.append(unpack(sha(p + h + gb).digest()))
    return out


def device_keys(block_hashes: Sequence[bytes], group_id: int, device=None):
    """Device keys of many hashes in one group, as a tensor.

    No memo is kept (one SHA-256 per hash; nothing grows with the number of hashes seen).

    Args:
        block_hashes: ``n`` block hashes (``bytes``).
        group_id: the group of every key (see :func:`device_key`).
        device: torch device of the result (``None``: CPU).

    Returns:
        ``torch.int64`` tensor of shape ``[n, 2]``; row ``i`` is ``device_key(block_hashes[i],
        group_id)`` (column 0 ``hi``, column 1 ``lo``).
    """
    import torch

    rows = [device_key(h, group_id) for h in block_hashes]
    if not rows:
        return torch.empty((0, 2), dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device)


DIGEST_OP = "block_hashes"  # the op the digest conversions' errors name
DIGEST_WORDS = 8  # a 32-byte digest as int32 words (kernels/layout.py DIGEST_WORDS)


def digest_words(b: bytes) -> list[int]:
    """The 8 int32 words of a 32-byte digest: word ``j`` = bytes ``4j .. 4j + 3`` big-endian, as a
    signed int32. Raises ArgumentTypeError (not bytes) or InvalidArgumentError (not 32 bytes)."""
    if not isinstance(b, (bytes, bytearray)):
        raise ArgumentTypeError(DIGEST_OP, f"a digest must be bytes, got {type(b).__name__}")
    if len(b) != 4 * DIGEST_WORDS:
        raise InvalidArgumentError(DIGEST_OP, f"a digest must be {4 * DIGEST_WORDS} bytes, got {len(b)}", len(b))
    return list(struct.unpack(">8i", bytes(b)))


def words_digest(words) -> bytes:
    """The digest of 8 words (:func:`digest_words`' inverse): integers in ``-2**31 .. 2**32 - 1`` (signed
    or unsigned 32-bit), or an integer tensor row. Raises ArgumentTypeError (not integers) or
    InvalidArgumentError (another count, a value out of range)."""
    try:
        words = [operator.index(w) for w in (words.tolist() if hasattr(words, "tolist") and not isinstance(words, (list, tuple)) else words)]
    except TypeError as e:
        raise ArgumentTypeError(DIGEST_OP, f"digest words must be integers: {e}") from None
    if len(words) != DIGEST_WORDS:
        raise InvalidArgumentError(DIGEST_OP, f"a digest is {DIGEST_WORDS} words, got {len(words)}", len(words))
    for w in words:
        if not -(1 << 31) <= w < 1 << 32:
            raise InvalidArgumentError(DIGEST_OP, f"digest word {w} is not a 32-bit value", w)
    return struct.pack(">8I", *(w & 0xFFFFFFFF for w in words))


#: :data:`NONE_HASH` (block 0's parent) as digest words (:func:`digest_words`).
NONE_HASH_WORDS: list[int] = digest_words(NONE_HASH)


def trace_block_hash(hash_id: int | str) -> bytes:
    """Block hash of a trace ``hash_id`` (docs/semantics.md section 5), an integer or a string.

    ``sha256(str(hash_id).encode()).digest()`` (32 bytes; ``7`` and ``"7"`` are the same block); trace
    blocks use group 0. Raises ArgumentTypeError (a TypeError) for anything else (a float, bytes, a
    bool); InvalidArgumentError (a ValueError) for a string without a UTF-8 form (a lone surrogate such
    as ``"\\ud800"``, which JSON can spell) or an integer with more decimal digits than Python turns
    into text (``sys.get_int_max_str_digits()``).
    """
    if isinstance(hash_id, str):
        try:
            return hashlib.sha256(hash_id.encode()).digest()
        except UnicodeEncodeError as e:
            raise InvalidArgumentError("trace_block_hash", f"a trace hash id must be valid Unicode text; this one "
                                       f"holds a lone surrogate {hash_id[e.start]!r} at character {e.start}") from None
    try:
        if isinstance(hash_id, bool):
            raise TypeError
        value = int(operator.index(hash_id))
    except TypeError:
        raise ArgumentTypeError("trace_block_hash", f"a trace hash id is an integer or a string, got "
                                f"{type(hash_id).__name__}") from None
    try:
        text = str(value)
    except ValueError:  # past the int-to-str digit limit
        raise InvalidArgumentError("trace_block_hash", "a trace hash id has more decimal digits than Python "
                                   "converts to text (sys.get_int_max_str_digits())") from None
    return hashlib.sha256(text.encode()).digest()
