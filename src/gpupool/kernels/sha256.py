"""SHA-256's compression function as ``@triton.jit`` helpers, vectorized over a tile of lanes (FIPS 180-4).

A lane's state and message words are ``tl.uint32`` tensors of one shape (``[L]``: one lane per
element); every add wraps modulo 2**32 (compiled: ``arith.addi`` on i32; Triton's interpreter: numpy
uint32, which wraps the same way), a rotation is two logical shifts. Padding and byte order are the
caller's: it hands in a chunk's 16 big-endian words (kernels/block_hash.py builds them).

The 64 rounds run as a loop of 16 steps of :data:`STEP` rounds unrolled inside; the 16-word schedule
window and the state are the loop's carried values, and the round constants come from a table in
device memory (:func:`round_constant_table`, ``int32 [K_TABLE_WORDS]``), loaded a step ahead. Not
fully unrolled, on purpose: the compiler's coalescing pass (TritonGPUCoalesce, triton 3.9) walks, for
every global load and store of a kernel, a slice of the whole kernel for each operation in it,
quadratic in the kernel's size; with 64 unrolled rounds (about 3,500 operations a compression) a
kernel of three compressions compiles for over 20 minutes, with the loop in seconds. Keep a kernel's
compressions few for the same reason. Nor are the constants picked by the step index in registers:
a 16-way pick compiles to about 27 instructions a round, as many as the round itself.
"""
import torch
import triton
import triton.language as tl

#: SHA-256's initial hash value H(0) (FIPS 180-4 section 5.3.3), as Python ints for the host.
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)

#: The 64 round constants K (FIPS 180-4 section 4.2.2).
ROUND_CONSTANTS = (
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
)

_IV = tl.constexpr(IV)
#: Rounds per step of the round loop (unrolled inside a step).
STEP = 4
_STEP = tl.constexpr(STEP)
#: Words of :func:`round_constant_table`: the 64 constants, then one step of zeros (read ahead, unused).
K_TABLE_WORDS = 64 + STEP


def round_constant_table(device=None) -> torch.Tensor:
    """The round constants as ``int32 [K_TABLE_WORDS]`` (their bit patterns, then ``STEP`` zeros) on
    ``device``, for :func:`sha256_compress`'s ``k_table``. Make it once and keep it: a captured CUDA
    graph reads it at replay."""
    words = [k - (1 << 32) if k >= 1 << 31 else k for k in ROUND_CONSTANTS] + [0] * STEP
    return torch.tensor(words, dtype=torch.int32, device=device)


@triton.jit
def sha256_iv(like):
    """The initial state: eight ``tl.uint32`` tensors ``H(0)`` of ``like``'s shape."""
    return (tl.full(like.shape, _IV[0], tl.uint32), tl.full(like.shape, _IV[1], tl.uint32),
            tl.full(like.shape, _IV[2], tl.uint32), tl.full(like.shape, _IV[3], tl.uint32),
            tl.full(like.shape, _IV[4], tl.uint32), tl.full(like.shape, _IV[5], tl.uint32),
            tl.full(like.shape, _IV[6], tl.uint32), tl.full(like.shape, _IV[7], tl.uint32))


@triton.jit
def sha256_compress(state, words, k_table):
    """One SHA-256 compression: the state after the 64-byte chunk whose big-endian words are ``words``.

    ``state``: a tuple of 8 ``tl.uint32`` tensors, ``words`` one of 16, all of one shape (the lanes');
    ``k_table``: an ``int32`` pointer to :func:`round_constant_table` (read only, 4 scalar loads a
    step). Returns the new state, a tuple of 8 like ``state``.

    Written for Triton's interpreter as much as for the compiler: every operand of the rounds is a
    tensor of the lanes' shape (a Python constant costs the interpreter a broadcast per use; the
    compiler folds both forms to the same immediates) and adds are ``tl.add(..., sanitize_overflow=
    False)`` (the interpreter otherwise checks each add for overflow in int64; they are meant to
    wrap), so one compression is about 3,200 cheap interpreted ops. Rotations are written out, not
    called: a nested ``@triton.jit`` call costs the interpreter milliseconds.
    """
    s0, s1, s2, s3, s4, s5, s6, s7 = state
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = words
    # shift amounts, made once: a rotation right by n is (x >> n) | (x << (32 - n)), here ^ (disjoint bits)
    r2 = tl.full(s0.shape, 2, tl.uint32)
    r3 = tl.full(s0.shape, 3, tl.uint32)
    r6 = tl.full(s0.shape, 6, tl.uint32)
    r7 = tl.full(s0.shape, 7, tl.uint32)
    r10 = tl.full(s0.shape, 10, tl.uint32)
    r11 = tl.full(s0.shape, 11, tl.uint32)
    r13 = tl.full(s0.shape, 13, tl.uint32)
    r14 = tl.full(s0.shape, 14, tl.uint32)
    r15 = tl.full(s0.shape, 15, tl.uint32)
    r17 = tl.full(s0.shape, 17, tl.uint32)
    r18 = tl.full(s0.shape, 18, tl.uint32)
    r19 = tl.full(s0.shape, 19, tl.uint32)
    r21 = tl.full(s0.shape, 21, tl.uint32)
    r22 = tl.full(s0.shape, 22, tl.uint32)
    r25 = tl.full(s0.shape, 25, tl.uint32)
    r26 = tl.full(s0.shape, 26, tl.uint32)
    r30 = tl.full(s0.shape, 30, tl.uint32)
    a = s0
    b = s1
    c = s2
    d = s3
    e = s4
    f = s5
    g = s6
    h = s7
    bc = b ^ c  # Maj(a, b, c) = b ^ ((a ^ b) & (b ^ c)); a round's a ^ b is the next round's b ^ c
    k0 = tl.load(k_table + 0).to(tl.uint32, bitcast=True)
    k1 = tl.load(k_table + 1).to(tl.uint32, bitcast=True)
    k2 = tl.load(k_table + 2).to(tl.uint32, bitcast=True)
    k3 = tl.load(k_table + 3).to(tl.uint32, bitcast=True)
    for q in range(0, 64 // _STEP):  # a loop, not unrolled: keeps the compiler's IR small (module docstring)
        # the next step's constants, loaded a step ahead (the last step reads the table's zeros)
        n0 = tl.load(k_table + (q + 1) * _STEP + 0).to(tl.uint32, bitcast=True)
        n1 = tl.load(k_table + (q + 1) * _STEP + 1).to(tl.uint32, bitcast=True)
        n2 = tl.load(k_table + (q + 1) * _STEP + 2).to(tl.uint32, bitcast=True)
        n3 = tl.load(k_table + (q + 1) * _STEP + 3).to(tl.uint32, bitcast=True)
        for i in tl.static_range(_STEP):  # rounds 4 q + i: W[4 q + i] is w_i, K[4 q + i] is k_i
            wi = w0 if i == 0 else (w1 if i == 1 else (w2 if i == 2 else w3))
            ki = k0 if i == 0 else (k1 if i == 1 else (k2 if i == 2 else k3))
            big_s1 = (e >> r6) ^ (e << r26) ^ (e >> r11) ^ (e << r21) ^ (e >> r25) ^ (e << r7)
            ch = g ^ (e & (f ^ g))
            t1 = tl.add(tl.add(tl.add(h, big_s1, sanitize_overflow=False), tl.add(ch, wi, sanitize_overflow=False),
                               sanitize_overflow=False), ki, sanitize_overflow=False)
            big_s0 = (a >> r2) ^ (a << r30) ^ (a >> r13) ^ (a << r19) ^ (a >> r22) ^ (a << r10)
            ab = a ^ b
            t2 = tl.add(big_s0, b ^ (ab & bc), sanitize_overflow=False)
            bc = ab
            h = g
            g = f
            f = e
            e = tl.add(d, t1, sanitize_overflow=False)
            d = c
            c = b
            b = a
            a = tl.add(t1, t2, sanitize_overflow=False)
        if q < 64 // _STEP - 16 // _STEP:  # W[4 q + 16 .. 4 q + 19]; the last 16 rounds extend nothing
            x0 = tl.add(tl.add(w0, (w1 >> r7) ^ (w1 << r25) ^ (w1 >> r18) ^ (w1 << r14) ^ (w1 >> r3),
                               sanitize_overflow=False),
                        tl.add(w9, (w14 >> r17) ^ (w14 << r15) ^ (w14 >> r19) ^ (w14 << r13) ^ (w14 >> r10),
                               sanitize_overflow=False), sanitize_overflow=False)
            x1 = tl.add(tl.add(w1, (w2 >> r7) ^ (w2 << r25) ^ (w2 >> r18) ^ (w2 << r14) ^ (w2 >> r3),
                               sanitize_overflow=False),
                        tl.add(w10, (w15 >> r17) ^ (w15 << r15) ^ (w15 >> r19) ^ (w15 << r13) ^ (w15 >> r10),
                               sanitize_overflow=False), sanitize_overflow=False)
            x2 = tl.add(tl.add(w2, (w3 >> r7) ^ (w3 << r25) ^ (w3 >> r18) ^ (w3 << r14) ^ (w3 >> r3),
                               sanitize_overflow=False),
                        tl.add(w11, (x0 >> r17) ^ (x0 << r15) ^ (x0 >> r19) ^ (x0 << r13) ^ (x0 >> r10),
                               sanitize_overflow=False), sanitize_overflow=False)
            x3 = tl.add(tl.add(w3, (w4 >> r7) ^ (w4 << r25) ^ (w4 >> r18) ^ (w4 << r14) ^ (w4 >> r3),
                               sanitize_overflow=False),
                        tl.add(w12, (x1 >> r17) ^ (x1 << r15) ^ (x1 >> r19) ^ (x1 << r13) ^ (x1 >> r10),
                               sanitize_overflow=False), sanitize_overflow=False)
        else:
            x0 = w0
            x1 = w1
            x2 = w2
            x3 = w3
        w0, w1, w2, w3, w4, w5, w6, w7 = w4, w5, w6, w7, w8, w9, w10, w11
        w8, w9, w10, w11, w12, w13, w14, w15 = w12, w13, w14, w15, x0, x1, x2, x3
        k0, k1, k2, k3 = n0, n1, n2, n3
    return (tl.add(s0, a, sanitize_overflow=False), tl.add(s1, b, sanitize_overflow=False),
            tl.add(s2, c, sanitize_overflow=False), tl.add(s3, d, sanitize_overflow=False),
            tl.add(s4, e, sanitize_overflow=False), tl.add(s5, f, sanitize_overflow=False),
            tl.add(s6, g, sanitize_overflow=False), tl.add(s7, h, sanitize_overflow=False))
