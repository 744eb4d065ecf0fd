"""Device keys of hashes the host holds, computed on the device.

``gpupool.keys.device_key(block_hash, group)`` is a SHA-256 over the 32-byte hash and the group (two
compressions): about 2 us per key in CPython, one thread. A launch that caches many blocks
(``BlockPool.apply_predicted``) ships the hashes' raw bytes instead and lets :func:`device_keys_kernel`
make the keys, a lane per key, before the launch's own kernel reads them (same stream: ordered).

Interface: ``launch_device_keys(digests, groups, hi, lo, k_table)``; ``digests`` holds each hash's 32
bytes as the host has them (``b"".join(hashes)`` viewed as ``int32``): the kernel byte-swaps each word
into the big-endian words :func:`gpupool.kernels.block_hash.device_key` reads.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .block_hash import DIGEST_WORDS, device_key

__all__ = ["HASH_BYTES", "LANES", "device_keys_kernel", "launch_device_keys"]

HASH_BYTES = 4 * DIGEST_WORDS  # a hash the kernel keys: 32 bytes (vLLM's sha256 block hashes)
LANES = 64  # keys per program
_WORDS = tl.constexpr(DIGEST_WORDS)


@triton.jit
def _word(ptrs, mask):
    """The big-endian word of 4 hash bytes stored little-endian as one ``int32``, as ``tl.uint32``."""
    w = tl.load(ptrs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    return (w >> 24) | ((w >> 8) & 0xFF00) | ((w & 0xFF00) << 8) | (w << 24)


@triton.jit
def device_keys_kernel(digests, groups, hi, lo, n, k_table, L: tl.constexpr):
    """``(hi[i], lo[i]) = keys.device_key(hash i, groups[i])`` for ``i < n``, ``L`` lanes a program.

    ``digests``: ``int32 [n * 8]``, hash ``i``'s raw bytes at words ``8 i .. 8 i + 7``; ``groups``:
    ``int64 [n]``; ``hi``, ``lo``: ``int64 [n]``, written. Lanes are disjoint: programs never race."""
    lane = (tl.program_id(0) * L + tl.arange(0, L)).to(tl.int64)
    m = lane < n
    at = digests + lane * _WORDS
    k_hi, k_lo = device_key(_word(at, m), _word(at + 1, m), _word(at + 2, m), _word(at + 3, m), _word(at + 4, m),
                            _word(at + 5, m), _word(at + 6, m), _word(at + 7, m),
                            tl.load(groups + lane, mask=m, other=0), k_table)
    tl.store(hi + lane, k_hi, mask=m)
    tl.store(lo + lane, k_lo, mask=m)


def launch_device_keys(digests, groups, hi, lo, k_table) -> None:
    """Launch :func:`device_keys_kernel` over ``n = groups.numel()`` keys (``n >= 1``), not waiting.
    ``digests``: ``int32 [8 n]`` on the device; ``groups``, ``hi``, ``lo``: ``int64 [n]`` there, ``hi``
    and ``lo`` sharing no memory with the inputs; ``k_table``: ``sha256.round_constant_table(device)``.
    The caller checks the shapes (an internal launcher: ``BlockPool.apply_predicted``)."""
    n = groups.numel()
    device_keys_kernel[(triton.cdiv(n, LANES),)](digests, groups, hi, lo, n, k_table, L=LANES, num_warps=2)
