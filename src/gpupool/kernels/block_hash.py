"""vLLM's block hash and gpupool's device key, computed on the device, bit for bit.

A *lane* is one hash block of one request. For each lane the helpers compute what the host computes in
``gpupool.keys``:

* :func:`block_hash`: ``hash_block_tokens(parent, tokens, None)``, i.e. vLLM's ``sha256`` block hash
  ``sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5)).digest()``, for a 32-byte
  ``parent`` and ``HBS`` tokens that are Python ints in int32 range;
* :func:`device_key`: ``device_key(digest, group)`` as the signed int64 pair ``(hi, lo)``.

Digests travel as 8 words: word ``j`` holds bytes ``4j .. 4j + 3`` of the digest big-endian, stored
as ``int32`` (the bit pattern of the ``uint32``); :func:`digest_words` and :func:`words_digest`
convert on the host, :data:`gpupool.keys.NONE_HASH_WORDS` is ``keys.NONE_HASH`` so.

Interface (a kernel that fills blocks with tokens keys them with the first two):

* ``h0, ..., h7 = block_hash(parent_ptrs, tok_ptrs, mask, out_ptrs, scratch_ptrs, k_table, HBS, L)``:
  per-lane ``int32`` pointer tensors ``[L]`` to the parent's digest words, the ``HBS`` token ids, where
  the digest's words go (may be the parent's) and a scratch row of :func:`scratch_words` ``(HBS)``
  words; ``k_table`` is ``sha256.round_constant_table(device)``, made once and kept. Returns the digest
  words as ``tl.uint32 [L]``.
* ``hi, lo = device_key(h0, ..., h7, group, k_table)``: ``tl.int64`` tensors; ``group`` an integer
  tensor broadcastable against the words.
* :func:`load_digest` / :func:`store_digest`: a digest's 8 words from / to memory.
* ``keys = launch_block_hashes(parents, tokens, out, groups)``: the standalone kernel
  (:func:`block_hashes_kernel`) over ``n`` lanes, for tests and for hashing batches on the device.

Each SHA-256 compression a kernel contains adds a few hundred operations to its IR, and Triton's
coalescing pass is quadratic in that size (kernels/sha256.py): ``block_hash`` and one ``device_key``
call hold three; the standalone kernel compiles in about 5 s of CPU per target.

The pickled message (protocol 5, what CPython's ``pickle.dumps`` writes; byte offsets):

====================  =======================================================================
``0``                 PROTO 5 (``80 05``)
``2``                 FRAME (``95``), then the frame length, 8 bytes little-endian: the
                      message length minus 11 (everything after this field)
``11``                SHORT_BINBYTES 32 (``43 20``), the parent's 32 bytes, MEMOIZE (``94``)
``46``                MARK (``28``), only when ``HBS > 3``
``46`` or ``47``      each token: BININT1 ``4b b`` (0 .. 255), BININT2 ``4d b b`` (256 ..
                      65535, little-endian) or BININT ``4a b b b b`` (everything else,
                      4 bytes signed little-endian); offsets from a prefix sum of the sizes
end - 6               TUPLE1/2/3 (``85``/``86``/``87``) for ``HBS`` 1/2/3, else TUPLE (``74``);
                      MEMOIZE, NONE (``4e``), TUPLE3 (``87``), MEMOIZE, STOP (``2e``)
====================  =======================================================================

so a message is ``46 + (HBS > 3) + sum(2 | 3 | 5 per token) + 6`` bytes (:func:`max_message_bytes`);
SHA-256 pads it to ``(length + 72) // 64`` chunks of 64 bytes (:func:`max_chunks`). One frame holds
the whole pickle while it is under 64 KiB (CPython's frame target), hence
:data:`MAX_HASH_BLOCK_SIZE`.

How a lane is hashed (:func:`block_hash`): the message is stored into the lane's scratch row in
its own byte order (the header as whole little-endian words; each token's 2, 3 or 5 bytes at its
offset), followed by the ``0x80`` pad byte and three zeros. After one barrier the chunks are loaded
back as words, byte-swapped into SHA-256's big-endian words (words past the pad load as 0, masked,
and the last chunk's word 15 is the bit length) and run through
:func:`gpupool.kernels.sha256.sha256_compress` for every lane at once; a lane whose message has fewer
chunks keeps its state (the loop runs to the tile's longest message).

Per lane cost: one compression (64 rounds) per chunk: a 16-token block of ids below 256 is 2 chunks,
below 65,536 2 chunks, larger ids 3; HBS 512 up to 41. A device key is 2 more compressions per group.
docs/algorithms.md, "Block hashes on the device".
"""
from __future__ import annotations

import operator
import pickle
import struct

import torch
import triton
import triton.language as tl

from ..errors import ArgumentTypeError, InvalidArgumentError
from .sha256 import round_constant_table, sha256_compress, sha256_iv

__all__ = [
    "DIGEST_WORDS", "MAX_HASH_BLOCK_SIZE", "block_hash", "block_hashes_kernel", "device_key",
    "launch_block_hashes", "load_digest", "max_chunks", "max_message_bytes", "round_constant_table",
    "scratch_words", "store_digest",
]

OP = "block_hashes"
DIGEST_WORDS = 8  # a 32-byte digest as int32 words

# Pickle protocol 5 opcodes, for the kernels (CPython's pickle module names them once)
_HEAD_WORD = tl.constexpr(int.from_bytes(pickle.PROTO + bytes([5]) + pickle.FRAME, "little"))  # word 0 but its top byte
_SHORT_BINBYTES, _MEMOIZE, _MARK, _BININT1, _BININT2, _BININT = (
    tl.constexpr(op[0]) for op in (pickle.SHORT_BINBYTES, pickle.MEMOIZE, pickle.MARK, pickle.BININT1,
                                   pickle.BININT2, pickle.BININT))
_TUPLE_OF = (pickle.TUPLE1[0], pickle.TUPLE2[0], pickle.TUPLE3[0], pickle.TUPLE[0])  # by min(HBS, 4) - 1
_TRAILER = (pickle.MEMOIZE + pickle.NONE + pickle.TUPLE3 + pickle.MEMOIZE + pickle.STOP)

# The message layout (module docstring), in bytes
FRAMED_FROM = 11  # the frame length counts the bytes from here to the end
HEADER_BYTES = 46  # PROTO, FRAME + length, SHORT_BINBYTES 32 + parent, MEMOIZE
TAIL_BYTES = 1 + len(_TRAILER)  # the token tuple's opcode, then _TRAILER
PAD_BYTES = 4  # the 0x80 pad byte and 3 zeros, so the word holding it loads complete
MAX_TOKEN_BYTES = 5  # BININT
#: Largest ``HBS``: the whole pickle stays in one frame (CPython cuts frames at 64 KiB).
MAX_HASH_BLOCK_SIZE = 8192
assert HEADER_BYTES + 1 + MAX_TOKEN_BYTES * MAX_HASH_BLOCK_SIZE + TAIL_BYTES < 64 * 1024
# the kernels' mirrors of the layout's widths (a kernel reads only tl.constexpr globals)
_HEADER, _TAIL, _PAD, _TOKEN_MAX, _FRAMED_FROM, _DIGEST = (
    tl.constexpr(v) for v in (HEADER_BYTES, TAIL_BYTES, PAD_BYTES, MAX_TOKEN_BYTES, FRAMED_FROM, DIGEST_WORDS))

# The tail bytes after the tokens, with the pad: opcode, trailer, 0x80, zeros, little-endian in an int64 per HBS
_TAIL64 = tl.constexpr(tuple(int.from_bytes(bytes([op]) + _TRAILER + b"\x80", "little") for op in _TUPLE_OF))
assert TAIL_BYTES + 1 <= 8

# device_key: domain + 8-byte length (30 bytes) + digest (32) + group (8) = 70 bytes, 2 chunks
#: ``keys.device_key``'s domain (a kernel module imports no host module: tests/kernels/test_block_hash.py
#: checks the two are equal)
KEY_DOMAIN = b"gpupool.device_key.v1\x00"
_KEY_PREFIX = KEY_DOMAIN + (32).to_bytes(8, "little")
assert len(_KEY_PREFIX) == 30 and _KEY_PREFIX[28:] == b"\0\0"  # word 7 = 00 00 d0 d1 (shifts below)
_KEY_WORDS = tl.constexpr(struct.unpack(">7I", _KEY_PREFIX[:28]))
_KEY_BITS = tl.constexpr((len(_KEY_PREFIX) + 32 + 8) * 8)


def max_message_bytes(hbs: int) -> int:
    """Bytes of the longest pickled message of a block of ``hbs`` tokens (every token a BININT)."""
    return HEADER_BYTES + (hbs > 3) + MAX_TOKEN_BYTES * hbs + TAIL_BYTES


def max_chunks(hbs: int) -> int:
    """SHA-256 chunks (64 bytes) of the longest message of ``hbs`` tokens: the chunk loop's bound."""
    return (max_message_bytes(hbs) + 72) // 64


def scratch_words(hbs: int) -> int:
    """``W``: int32 words of the scratch row each lane of :func:`block_hash` needs for blocks of ``hbs``
    tokens (the longest message and its 4 pad bytes)."""
    return (max_message_bytes(hbs) + PAD_BYTES + 3) // 4


@triton.jit
def load_digest(ptrs, mask):
    """The 8 digest words at ``ptrs + j`` (``int32`` pointers, any shape) as ``tl.uint32``, 0 where not ``mask``."""
    return (tl.load(ptrs + 0, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 1, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 2, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 3, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 4, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 5, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 6, mask=mask, other=0).to(tl.uint32, bitcast=True),
            tl.load(ptrs + 7, mask=mask, other=0).to(tl.uint32, bitcast=True))


@triton.jit
def store_digest(ptrs, h0, h1, h2, h3, h4, h5, h6, h7, mask):
    """Store the digest words ``h0..h7`` (``tl.uint32``) at ``ptrs + j`` where ``mask``."""
    tl.store(ptrs + 0, h0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 1, h1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 2, h2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 3, h3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 4, h4.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 5, h5.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 6, h6.to(tl.int32, bitcast=True), mask=mask)
    tl.store(ptrs + 7, h7.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _bswap(x):
    """The ``tl.uint32`` words ``x`` with their bytes reversed (compiled: one byte permute)."""
    return (x >> 24) | ((x >> 8) & 0xFF00) | ((x & 0xFF00) << 8) | (x << 24)


@triton.jit
def _chunk_words(rows, b, live, wlim):
    """Words ``b .. b + 15`` of every lane's message (``rows``: the lanes' scratch rows), big-endian:
    loaded where ``live`` and the word holds a message or pad byte (``w <= wlim``), else 0."""
    w0 = tl.load(rows + b, mask=live & (wlim >= b), other=0).to(tl.uint32, bitcast=True)
    w1 = tl.load(rows + (b + 1), mask=live & (wlim >= b + 1), other=0).to(tl.uint32, bitcast=True)
    w2 = tl.load(rows + (b + 2), mask=live & (wlim >= b + 2), other=0).to(tl.uint32, bitcast=True)
    w3 = tl.load(rows + (b + 3), mask=live & (wlim >= b + 3), other=0).to(tl.uint32, bitcast=True)
    w4 = tl.load(rows + (b + 4), mask=live & (wlim >= b + 4), other=0).to(tl.uint32, bitcast=True)
    w5 = tl.load(rows + (b + 5), mask=live & (wlim >= b + 5), other=0).to(tl.uint32, bitcast=True)
    w6 = tl.load(rows + (b + 6), mask=live & (wlim >= b + 6), other=0).to(tl.uint32, bitcast=True)
    w7 = tl.load(rows + (b + 7), mask=live & (wlim >= b + 7), other=0).to(tl.uint32, bitcast=True)
    w8 = tl.load(rows + (b + 8), mask=live & (wlim >= b + 8), other=0).to(tl.uint32, bitcast=True)
    w9 = tl.load(rows + (b + 9), mask=live & (wlim >= b + 9), other=0).to(tl.uint32, bitcast=True)
    w10 = tl.load(rows + (b + 10), mask=live & (wlim >= b + 10), other=0).to(tl.uint32, bitcast=True)
    w11 = tl.load(rows + (b + 11), mask=live & (wlim >= b + 11), other=0).to(tl.uint32, bitcast=True)
    w12 = tl.load(rows + (b + 12), mask=live & (wlim >= b + 12), other=0).to(tl.uint32, bitcast=True)
    w13 = tl.load(rows + (b + 13), mask=live & (wlim >= b + 13), other=0).to(tl.uint32, bitcast=True)
    w14 = tl.load(rows + (b + 14), mask=live & (wlim >= b + 14), other=0).to(tl.uint32, bitcast=True)
    w15 = tl.load(rows + (b + 15), mask=live & (wlim >= b + 15), other=0).to(tl.uint32, bitcast=True)
    # byte swaps written out: a nested @triton.jit call per word would cost the interpreter milliseconds
    return ((w0 >> 24) | ((w0 >> 8) & 0xFF00) | ((w0 & 0xFF00) << 8) | (w0 << 24),
            (w1 >> 24) | ((w1 >> 8) & 0xFF00) | ((w1 & 0xFF00) << 8) | (w1 << 24),
            (w2 >> 24) | ((w2 >> 8) & 0xFF00) | ((w2 & 0xFF00) << 8) | (w2 << 24),
            (w3 >> 24) | ((w3 >> 8) & 0xFF00) | ((w3 & 0xFF00) << 8) | (w3 << 24),
            (w4 >> 24) | ((w4 >> 8) & 0xFF00) | ((w4 & 0xFF00) << 8) | (w4 << 24),
            (w5 >> 24) | ((w5 >> 8) & 0xFF00) | ((w5 & 0xFF00) << 8) | (w5 << 24),
            (w6 >> 24) | ((w6 >> 8) & 0xFF00) | ((w6 & 0xFF00) << 8) | (w6 << 24),
            (w7 >> 24) | ((w7 >> 8) & 0xFF00) | ((w7 & 0xFF00) << 8) | (w7 << 24),
            (w8 >> 24) | ((w8 >> 8) & 0xFF00) | ((w8 & 0xFF00) << 8) | (w8 << 24),
            (w9 >> 24) | ((w9 >> 8) & 0xFF00) | ((w9 & 0xFF00) << 8) | (w9 << 24),
            (w10 >> 24) | ((w10 >> 8) & 0xFF00) | ((w10 & 0xFF00) << 8) | (w10 << 24),
            (w11 >> 24) | ((w11 >> 8) & 0xFF00) | ((w11 & 0xFF00) << 8) | (w11 << 24),
            (w12 >> 24) | ((w12 >> 8) & 0xFF00) | ((w12 & 0xFF00) << 8) | (w12 << 24),
            (w13 >> 24) | ((w13 >> 8) & 0xFF00) | ((w13 & 0xFF00) << 8) | (w13 << 24),
            (w14 >> 24) | ((w14 >> 8) & 0xFF00) | ((w14 & 0xFF00) << 8) | (w14 << 24),
            (w15 >> 24) | ((w15 >> 8) & 0xFF00) | ((w15 & 0xFF00) << 8) | (w15 << 24))


@triton.jit
def block_hash(parent_ptrs, tok_ptrs, mask, out_ptrs, scratch_ptrs, k_table, HBS: tl.constexpr, L: tl.constexpr):
    """vLLM's ``sha256`` block hash of every lane ``tl.arange(0, L)`` where ``mask`` (module docstring).

    Args:
        parent_ptrs: ``int32`` pointers ``[L]``: lane ``l``'s parent digest words at
            ``parent_ptrs[l] + j``, ``j < 8`` (``keys.digest_words``; block 0's parent is
            ``keys.NONE_HASH_WORDS``).
        tok_ptrs: ``int32`` pointers ``[L]``: lane ``l``'s ``HBS`` token ids at ``tok_ptrs[l] + t``.
        mask: ``[L]`` booleans, the lanes to hash; the others read and write nothing.
        out_ptrs: ``int32`` pointers ``[L]``: lane ``l``'s digest words go to ``out_ptrs[l] + j``. May
            equal ``parent_ptrs`` (a lane reads its parent before anything is written).
        scratch_ptrs: ``int32`` pointers ``[L]``: lane ``l``'s scratch row of ``scratch_words(HBS)``
            words, which this call overwrites (its message); rows of lanes another program may run
            at the same time must not overlap it.
        k_table: ``int32`` pointer to SHA-256's round constants (``sha256.round_constant_table``).
        HBS: tokens per hash block, ``1 .. MAX_HASH_BLOCK_SIZE``.
        L: lanes, a power of two.

    Returns:
        The digest as eight ``tl.uint32 [L]`` words (word ``j`` as stored; garbage on masked lanes),
        so a caller can go on to :func:`device_key` without reloading.

    Barriers: one at entry (the rows may hold a previous call's message, and the caller's writes of
    tokens or parents by other threads become visible) and one between storing the message and reading
    it back; every thread of the program must call it.
    """
    FIRST: tl.constexpr = _HEADER + (1 if HBS > 3 else 0)
    TT: tl.constexpr = 16 if HBS > 8 else (8 if HBS > 4 else (4 if HBS > 2 else HBS))
    MAXC: tl.constexpr = (FIRST + _TOKEN_MAX * HBS + _TAIL + 72) // 64
    rows = scratch_ptrs
    rb = rows.to(tl.pointer_type(tl.uint8))  # the rows as bytes: message byte p of a lane at rb + p
    tl.debug_barrier()  # strict: orders a previous call's scratch reads and the caller's row writes before ours
    p0, p1, p2, p3, p4, p5, p6, p7 = load_digest(parent_ptrs, mask)

    # the tokens, a tile of TT at a time: BININT1 / BININT2 / BININT at a prefix sum of their sizes
    total = tl.zeros([L], tl.int32)
    rb2 = rb[:, None]
    for t0 in range(0, HBS, TT):
        t = t0 + tl.arange(0, TT)
        tm = mask[:, None] & (t < HBS)[None, :]
        tok = tl.load(tok_ptrs[:, None] + t[None, :], mask=tm, other=0)
        small = tok >= 0
        size = tl.where(small & (tok < 256), 2, tl.where(small & (tok < 65536), 3, 5))
        size = tl.where(tm, size, 0)
        at = rb2 + (total[:, None] + tl.cumsum(size, axis=1) - size + FIRST)
        total += tl.sum(size, axis=1)
        tl.store(at, tl.where(size == 2, _BININT1, tl.where(size == 3, _BININT2, _BININT)).to(tl.uint8), mask=tm)
        tl.store(at + 1, tok.to(tl.uint8), mask=tm)
        tl.store(at + 2, (tok >> 8).to(tl.uint8), mask=tm & (size > 2))
        tl.store(at + 3, (tok >> 16).to(tl.uint8), mask=tm & (size > 3))
        tl.store(at + 4, (tok >> 24).to(tl.uint8), mask=tm & (size > 3))
    end = total + FIRST  # where the tail starts
    mlen = end + _TAIL

    # one byte store for the rest: j < 10 the tail (the tuple's opcode, MEMOIZE NONE TUPLE3 MEMOIZE STOP)
    # and the pad (0x80, 0, 0, 0) at end + j; j = 10, 11, 12 the parent's last byte, MEMOIZE and MARK
    # (HBS > 3) at bytes 44, 45, 46
    j = tl.arange(0, 16)[None, :]
    tail = tl.full([1, 16], _TAIL64[(HBS if HBS < 4 else 4) - 1], tl.int64)
    tail = tl.where(j < 8, (tail >> (tl.minimum(j, 7) * 8).to(tl.int64)) & 0xFF, 0).to(tl.int32)
    head = tl.where(j == 10, (p7 & 0xFF).to(tl.int32)[:, None], tl.where(j == 11, _MEMOIZE, _MARK))
    tl.store(rb2 + tl.where(j < _TAIL + _PAD, end[:, None] + j, _HEADER - 12 + j),
             tl.where(j < _TAIL + _PAD, tail, head).to(tl.uint8),
             mask=mask[:, None] & (j < _TAIL + _PAD + (3 if HBS > 3 else 2)))

    # the header, whole words (little-endian, as memory holds them): PROTO 5, FRAME + its length,
    # SHORT_BINBYTES 32 + the parent (its words are big-endian: swapped first)
    fl = (mlen - _FRAMED_FROM).to(tl.uint32)
    q0 = _bswap(p0)
    q1 = _bswap(p1)
    q2 = _bswap(p2)
    q3 = _bswap(p3)
    q4 = _bswap(p4)
    q5 = _bswap(p5)
    q6 = _bswap(p6)
    q7 = _bswap(p7)
    tl.store(rows, ((fl << 24) | _HEAD_WORD).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 1, (fl >> 8).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 2, tl.full([L], _SHORT_BINBYTES << 24, tl.int32), mask=mask)
    tl.store(rows + 3, ((q0 << 8) | 32).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 4, ((q1 << 8) | (q0 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 5, ((q2 << 8) | (q1 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 6, ((q3 << 8) | (q2 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 7, ((q4 << 8) | (q3 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 8, ((q5 << 8) | (q4 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 9, ((q6 << 8) | (q5 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.store(rows + 10, ((q7 << 8) | (q6 >> 24)).to(tl.int32, bitcast=True), mask=mask)
    tl.debug_barrier()  # strict: orders the message's byte stores before its word loads (other threads)

    # The message length again, from the frame length just stored (bytes 3..5: word 0's top byte and
    # word 1's low two; fl < 65,536): from here on every per-lane value derives from loads of [L] words,
    # so the compiler keeps them in one layout (the token tile's sums would cost a layout conversion at
    # every use in the chunk loop).
    f0 = tl.load(rows, mask=mask, other=0).to(tl.uint32, bitcast=True)
    f1 = tl.load(rows + 1, mask=mask, other=0).to(tl.uint32, bitcast=True)
    mlen = ((f0 >> 24) | ((f1 & 0xFFFF) << 8)).to(tl.int32) + _FRAMED_FROM
    nch = tl.where(mask, (mlen + 72) >> 6, 0)
    last = nch - 1
    bits = (mlen * 8).to(tl.uint32)
    wlim = mlen >> 2  # words 0 .. mlen // 4 hold message bytes or the 0x80; later ones load as 0
    s0, s1, s2, s3, s4, s5, s6, s7 = sha256_iv(p0)
    for c in range(0, tl.minimum(tl.max(nch, axis=0), MAXC)):
        live = c < nch
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _chunk_words(rows, c * 16, live, wlim)
        w15 = tl.where(c == last, bits, w15)  # the last chunk ends with the bit length (its word 14 is 0)
        n0, n1, n2, n3, n4, n5, n6, n7 = sha256_compress(
            (s0, s1, s2, s3, s4, s5, s6, s7), (w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15),
            k_table)
        s0 = tl.where(live, n0, s0)
        s1 = tl.where(live, n1, s1)
        s2 = tl.where(live, n2, s2)
        s3 = tl.where(live, n3, s3)
        s4 = tl.where(live, n4, s4)
        s5 = tl.where(live, n5, s5)
        s6 = tl.where(live, n6, s6)
        s7 = tl.where(live, n7, s7)
    store_digest(out_ptrs, s0, s1, s2, s3, s4, s5, s6, s7, mask)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _bswap64(lo, hi):
    """The int64 whose little-endian bytes are the big-endian words ``lo``, ``hi`` (``tl.uint32``)."""
    lo = (lo >> 24) | ((lo >> 8) & 0xFF00) | ((lo & 0xFF00) << 8) | (lo << 24)
    hi = (hi >> 24) | ((hi >> 8) & 0xFF00) | ((hi & 0xFF00) << 8) | (hi << 24)
    return (lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)).to(tl.int64, bitcast=True)


@triton.jit
def device_key(h0, h1, h2, h3, h4, h5, h6, h7, group, k_table):
    """``keys.device_key(digest, group)`` as ``(hi, lo)``, two ``tl.int64`` tensors.

    ``h0..h7``: the digest words (``tl.uint32``, e.g. :func:`block_hash`'s result); ``group``: the group
    id, an integer tensor (int32 or int64, sign-extended to 8 bytes) broadcastable against them (a
    ``[L, 1]`` digest and a ``[1, G]`` group give ``[L, G]`` keys); ``k_table`` as for :func:`block_hash`.
    No memory is written. The message
    ``domain + (32).to_bytes(8, "little") + digest + group.to_bytes(8, "little", signed=True)`` is 70
    bytes, two chunks: the digest starts at byte 30, so its words enter shifted by 16 bits.
    """
    g = group.to(tl.int64)
    glo = g.to(tl.uint32)
    ghi = (g >> 32).to(tl.uint32)
    h0, glo = tl.broadcast(h0, glo)
    h0, ghi = tl.broadcast(h0, ghi)
    h1, h0 = tl.broadcast(h1, h0)
    h2, h0 = tl.broadcast(h2, h0)
    h3, h0 = tl.broadcast(h3, h0)
    h4, h0 = tl.broadcast(h4, h0)
    h5, h0 = tl.broadcast(h5, h0)
    h6, h0 = tl.broadcast(h6, h0)
    h7, h0 = tl.broadcast(h7, h0)
    zero = tl.zeros_like(h0)
    state = sha256_compress(
        sha256_iv(h0),
        (zero + _KEY_WORDS[0], zero + _KEY_WORDS[1], zero + _KEY_WORDS[2], zero + _KEY_WORDS[3],
         zero + _KEY_WORDS[4], zero + _KEY_WORDS[5], zero + _KEY_WORDS[6], h0 >> 16,
         (h0 << 16) | (h1 >> 16), (h1 << 16) | (h2 >> 16), (h2 << 16) | (h3 >> 16), (h3 << 16) | (h4 >> 16),
         (h4 << 16) | (h5 >> 16), (h5 << 16) | (h6 >> 16), (h6 << 16) | (h7 >> 16),
         (h7 << 16) | ((glo & 0xFF) << 8) | ((glo >> 8) & 0xFF)), k_table)
    s0, s1, s2, s3, _, _, _, _ = sha256_compress(
        state,
        ((((glo >> 16) & 0xFF) << 24) | ((glo >> 24) << 16) | ((ghi & 0xFF) << 8) | ((ghi >> 8) & 0xFF),
         (((ghi >> 16) & 0xFF) << 24) | ((ghi >> 24) << 16) | 0x8000,
         zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero + _KEY_BITS), k_table)
    return _bswap64(s0, s1), _bswap64(s2, s3)


@triton.jit
def block_hashes_kernel(parents, tokens, out, groups, keys, scratch, k_table, n, num_groups,
                        HBS: tl.constexpr, L: tl.constexpr, W: tl.constexpr, GB: tl.constexpr):
    """Block hashes of ``n`` lanes and their device keys in ``num_groups`` groups.

    ``parents``, ``out``: ``int32 [n, 8]`` digest words (may be one tensor); ``tokens``: ``int32 [n, HBS]``;
    ``groups``: ``int32 [num_groups]``; ``keys``: ``int64 [n, num_groups, 2]`` (``hi``, ``lo``);
    ``scratch``: ``int32 [num_programs * L * W]``, ``W = scratch_words(HBS)``; ``k_table``: the round
    constants (``sha256.round_constant_table``). Program ``p`` hashes tiles
    ``p, p + num_programs, ...`` of ``L`` lanes with scratch rows ``p * L .. p * L + L - 1``, then reads the tile's digests back as
    ``L * GB`` (lane, group) pairs and keys ``GB`` groups at a time. Lanes and their rows are disjoint
    across programs, so programs never race.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_rows = scratch + (pid * L + tl.arange(0, L)) * W  # this program's lanes' scratch rows
    KL: tl.constexpr = L * GB
    k = tl.arange(0, KL)  # the keys of a tile: lane k // GB, group g0 + k % GB
    for tile in range(pid, tl.cdiv(n, L), nprog):
        lane = (tile * L + tl.arange(0, L)).to(tl.int64)
        m = lane < n
        block_hash(parents + lane * _DIGEST, tokens + lane * HBS, m, out + lane * _DIGEST, my_rows, k_table, HBS,
                   L)
        if num_groups > 0:
            tl.debug_barrier()  # strict: orders the digests' stores before their reads as (lane, group) pairs
            kl = (tile * L + k // GB).to(tl.int64)
            kml = kl < n
            h0, h1, h2, h3, h4, h5, h6, h7 = load_digest(out + kl * _DIGEST, kml)
            for g0 in range(0, num_groups, GB):
                gi = g0 + k % GB
                km = kml & (gi < num_groups)
                hi, lo = device_key(h0, h1, h2, h3, h4, h5, h6, h7, tl.load(groups + gi, mask=km, other=0), k_table)
                at = keys + (kl * num_groups + gi) * 2
                tl.store(at, hi, mask=km)
                tl.store(at + 1, lo, mask=km)


MAX_LANES = 1024  # lanes per program a caller may ask for
SCRATCH_BUDGET = 64 << 20  # bytes of scratch one launch may allocate (it bounds the programs)
MAX_PROGRAMS = 4096  # about one wave of one-warp programs on an H200 (132 SMs x 32)


def _fail(message: str, value: int | None = None):
    raise InvalidArgumentError(OP, message, value)


def _tensor(name: str, t, dtypes, dims: int, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(OP, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or t.dim() != dims:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(f"{name} must be a {dims}-d {want} tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, parents on {device}")
    return t


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def launch_block_hashes(parents: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
                        groups: torch.Tensor | None = None, *, lanes: int | None = None) -> torch.Tensor:
    """Hash ``n`` blocks on the device: ``out[i]`` = the digest words of
    ``keys.hash_block_tokens(keys.words_digest(parents[i]), tokens[i].tolist())`` and
    ``keys[i, g] = keys.device_key(that digest, groups[g])``. One launch.

    Args:
        parents: ``int32 [n, 8]``: each lane's parent digest words (``keys.digest_words``).
        tokens: ``int32 [n, HBS]``: each lane's token ids, ``1 <= HBS <= MAX_HASH_BLOCK_SIZE``.
        out: ``int32 [n, 8]``: receives the digest words; ``parents`` itself (hashed in place) or memory
            shared with neither ``parents`` nor ``tokens``.
        groups: ``int32 [G]`` group ids (``None``: no keys, ``G = 0``).
        lanes: lanes per program, a power of two up to ``MAX_LANES`` (default: 32 compiled, up to 256
            in Triton's interpreter, whose cost is per operation, not per lane).

    Returns:
        ``int64 [n, G, 2]``: ``(hi, lo)`` of each lane's device key in each group.

    Raises:
        ArgumentTypeError: an argument is not a tensor.
        InvalidArgumentError: a dtype, shape, device or layout is wrong, ``out`` overlaps an input other
            than as ``parents`` itself, ``lanes`` is not a power of two in range. Nothing is written then.
    """
    _tensor("parents", parents, (torch.int32,), 2, None)
    device = parents.device
    _tensor("tokens", tokens, (torch.int32,), 2, device)
    _tensor("out", out, (torch.int32,), 2, device)
    if groups is None:
        groups = torch.zeros(0, dtype=torch.int32, device=device)
    _tensor("groups", groups, (torch.int32,), 1, device)
    n, hbs = tokens.shape
    if tuple(parents.shape) != (n, DIGEST_WORDS) or tuple(out.shape) != (n, DIGEST_WORDS):
        _fail(f"parents and out must be [{n}, {DIGEST_WORDS}] (tokens has {n} rows), got "
              f"{tuple(parents.shape)} and {tuple(out.shape)}", n)
    if not 1 <= hbs <= MAX_HASH_BLOCK_SIZE:
        _fail(f"tokens per block must be 1 .. {MAX_HASH_BLOCK_SIZE}, got {hbs}", hbs)
    if n and not (out.data_ptr() == parents.data_ptr() or not _overlap(out, parents)):
        _fail("out must be parents itself or share no memory with it")
    if n and _overlap(out, tokens):
        _fail("out shares memory with tokens")
    if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int)):
        raise ArgumentTypeError(OP, f"lanes must be an int, got {type(lanes).__name__}")
    if lanes is not None and not (1 <= lanes <= MAX_LANES and lanes & (lanes - 1) == 0):
        _fail(f"lanes must be a power of two in 1 .. {MAX_LANES}, got {lanes}", lanes)
    num_groups = groups.numel()
    keys = torch.empty((n, num_groups, 2), dtype=torch.int64, device=device)
    if n == 0:
        return keys
    if lanes is None:
        lanes = min(triton.next_power_of_2(n), 256 if parents.device.type == "cpu" else 32)
    words = scratch_words(hbs)
    tiles = triton.cdiv(n, lanes)
    programs = max(1, min(tiles, MAX_PROGRAMS, SCRATCH_BUDGET // (lanes * words * 4)))
    scratch = torch.empty(programs * lanes * words, dtype=torch.int32, device=device)
    gb = min(triton.next_power_of_2(max(num_groups, 1)), 8)
    block_hashes_kernel[(programs,)](parents, tokens, out, groups, keys, scratch, round_constant_table(device), n,
                                     num_groups,
                                     HBS=hbs, L=lanes, W=words, GB=gb, num_warps=max(1, min(4, lanes // 32)))
    return keys
