"""vLLM's block hash and the device keys computed on the device (gpupool.kernels.block_hash), against
hashlib and CPython's pickle through gpupool.keys: the message layout, every token encoding and its
boundaries, block sizes 1 to 64 (512 slow), chains, masked lanes, per-lane row pointers, the
launcher's tiling and its input checks, and the barrier that orders the digests before the keys.
docs/algorithms.md, "Block hashes on the device"."""
from __future__ import annotations

import pickle
import random

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import gpupool.kernels.block_hash as bh
from gpupool import keys
from gpupool.errors import ArgumentTypeError, InvalidArgumentError
from gpupool.keys import NONE_HASH_WORDS, digest_words, words_digest
from gpupool.kernels.block_hash import (KEY_DOMAIN, MAX_HASH_BLOCK_SIZE, block_hash, device_key,
                                        launch_block_hashes, max_chunks, max_message_bytes, scratch_words)
from gpupool.kernels.sha256 import round_constant_table
from strict import Checker
from test_kernel_barriers import without_barrier

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
#: every encoding's edges: BININT1 0..255, BININT2 256..65535, BININT for the rest of int32
BOUNDARIES = (0, 1, 127, 128, 255, 256, 257, 32767, 32768, 65535, 65536, 65537, I32_MAX, I32_MAX - 1,
              -1, -2, -255, -256, -65536, I32_MIN, I32_MIN + 1)
GROUPS = (0, 1, 7, -1)


def pickled_block(parent: bytes, tokens) -> bytes:
    """``pickle.dumps((parent, tuple(tokens), None), protocol=5)`` for a 32-byte parent and 1 or more
    int32 tokens, written out: the bytes the kernel builds (kernels/block_hash.py's table)."""
    assert len(parent) == 32 and tokens
    body = bytearray(pickle.SHORT_BINBYTES + bytes([32]) + parent + pickle.MEMOIZE)
    if len(tokens) > 3:
        body += pickle.MARK
    for t in tokens:
        if 0 <= t <= 0xFF:
            body += pickle.BININT1 + t.to_bytes(1, "little")
        elif 0 <= t <= 0xFFFF:
            body += pickle.BININT2 + t.to_bytes(2, "little")
        else:
            body += pickle.BININT + t.to_bytes(4, "little", signed=True)
    body += {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}.get(len(tokens), pickle.TUPLE)
    body += pickle.MEMOIZE + pickle.NONE + pickle.TUPLE3 + pickle.MEMOIZE + pickle.STOP
    return pickle.PROTO + bytes([5]) + pickle.FRAME + len(body).to_bytes(8, "little") + bytes(body)


def dumps(parent: bytes, tokens) -> bytes:
    return pickle.dumps((parent, tuple(tokens), None), protocol=5)


int32s = st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 300), st.integers(I32_MIN, I32_MAX))
parents = st.binary(min_size=32, max_size=32)


# ---- the message layout, on the host ------------------------------------------------------------
def test_pickle_protocol_is_5():
    assert keys.PICKLE_PROTOCOL == 5  # the layout is protocol 5's; a new protocol needs a new kernel


@given(parents, st.lists(int32s, min_size=1, max_size=70))
def test_pickled_block_is_cpythons_pickle(parent, tokens):
    assert pickled_block(parent, tokens) == dumps(parent, tokens)
    assert keys.hash_block_tokens(parent, tokens) == keys.sha256_hash((parent, tuple(tokens), None))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 64, 512, MAX_HASH_BLOCK_SIZE])
def test_pickled_block_every_size_and_the_longest_message(n):
    """Every token a BININT: the longest message of ``n`` tokens, one frame even at the largest size."""
    rng = random.Random(n)
    parent = rng.randbytes(32)
    for tokens in ([I32_MIN] * n, [rng.choice(BOUNDARIES) for _ in range(n)], [rng.randrange(256) for _ in range(n)]):
        assert pickled_block(parent, tokens) == dumps(parent, tokens)
    longest = pickled_block(parent, [-1] * n)
    assert max_message_bytes(n) == len(longest)
    assert max_chunks(n) == (len(longest) + 8 + 1 + 63) // 64  # the 0x80 byte and the 8-byte length
    assert scratch_words(n) * 4 >= len(longest) + 4  # the message, the pad byte and 3 zeros


def test_digest_words_round_trip_and_errors():
    for d in (keys.NONE_HASH, bytes(range(32)), b"\xff" * 32):
        w = digest_words(d)
        assert len(w) == 8 and all(I32_MIN <= x <= I32_MAX for x in w)
        assert words_digest(w) == d == words_digest([x & 0xFFFFFFFF for x in w])
        assert words_digest(torch.tensor(w, dtype=torch.int32)) == d
    assert words_digest(NONE_HASH_WORDS) == keys.NONE_HASH
    assert digest_words(bytes(range(32)))[0] == 0x00010203
    with pytest.raises(ArgumentTypeError):
        digest_words("x" * 32)
    with pytest.raises(InvalidArgumentError):
        digest_words(b"x" * 31)
    for bad in ([0] * 7, [0] * 7 + [1 << 32], [0] * 7 + [-(1 << 31) - 1]):
        with pytest.raises(InvalidArgumentError):
            words_digest(bad)
    for bad in ([0.0] * 8, None, [b"x"] * 8):
        with pytest.raises(ArgumentTypeError):
            words_digest(bad)


# ---- on the device -------------------------------------------------------------------------------
def hash_on_device(parent_list, token_rows, groups=(), **kw):
    """``launch_block_hashes`` of host values: (digests as bytes, keys as (hi, lo) lists per group)."""
    parents_t = torch.tensor([digest_words(p) for p in parent_list], dtype=torch.int32)
    out = torch.zeros_like(parents_t)
    k = launch_block_hashes(parents_t, torch.tensor(token_rows, dtype=torch.int32), out,
                            torch.tensor(groups, dtype=torch.int32), **kw)
    return [words_digest(r) for r in out], [[tuple(x) for x in row] for row in k.tolist()]


def expected(parent_list, token_rows, groups=()):
    digests = [keys.hash_block_tokens(p, t) for p, t in zip(parent_list, token_rows)]
    return digests, [[keys.device_key(d, g) for g in groups] for d in digests]


def mixed_rows(hbs: int, rng: random.Random) -> list[list[int]]:
    """Lanes of one tile whose messages differ in length: boundaries cycled (from two offsets), all
    BININT1, all BININT2, all BININT, random int32, random small ids."""
    rows = [[BOUNDARIES[(i + s) % len(BOUNDARIES)] for i in range(hbs)] for s in (0, 7)]
    rows.append([rng.randrange(256) for _ in range(hbs)])
    rows.append([rng.randrange(256, 65536) for _ in range(hbs)])
    rows.append([rng.choice((65536, I32_MAX, -1, I32_MIN)) for _ in range(hbs)])
    rows.append([rng.randrange(I32_MIN, I32_MAX + 1) for _ in range(hbs)])
    rows.append([rng.randrange(150_000) for _ in range(hbs)])
    return rows


def check_block_size(hbs: int, groups=GROUPS):
    rng = random.Random(hbs)
    rows = mixed_rows(hbs, rng)
    parent_list = [keys.NONE_HASH] + [rng.randbytes(32) for _ in rows[1:]]
    assert hash_on_device(parent_list, rows, groups) == expected(parent_list, rows, groups)


def test_block_hashes_and_keys_equal_the_host():
    """One tile of lanes of 4 tokens (MARK ... TUPLE) whose messages differ in length (1 or 2 chunks),
    keys in groups 0, 1, 7, -1."""
    check_block_size(4)


@pytest.mark.slow
@pytest.mark.parametrize("hbs", [1, 2, 3, 16, 17, 64])
def test_block_hashes_and_keys_equal_the_host_more_sizes(hbs):
    """As above: TUPLE1, TUPLE2, TUPLE3; 16 tokens (2 or 3 chunks); 17 and 64 (several token tiles)."""
    check_block_size(hbs)


@pytest.mark.slow  # 41 chunks a lane: about a minute in the interpreter
def test_block_hashes_of_512_tokens():
    check_block_size(512, groups=(0,))


@pytest.mark.slow
@settings(max_examples=max(4, settings().max_examples // 4))
@given(st.integers(1, 40), st.data())
def test_random_blocks_equal_the_host(hbs, data):
    n = data.draw(st.integers(1, 9))
    rows = data.draw(st.lists(st.lists(int32s, min_size=hbs, max_size=hbs), min_size=n, max_size=n))
    parent_list = data.draw(st.lists(parents, min_size=n, max_size=n))
    groups = data.draw(st.lists(st.integers(I32_MIN, I32_MAX), max_size=3))
    lanes = data.draw(st.sampled_from([None, 1, 2, 4]))
    assert hash_on_device(parent_list, rows, groups, lanes=lanes) == expected(parent_list, rows, groups)


def test_chains_equal_hash_request_tokens():
    """Block i's parent is block i - 1's digest: hashed in place (``out`` is ``parents``), one launch
    per block position, every request's chain equals ``hash_request_tokens``."""
    hbs, blocks = 2, 2
    rng = random.Random(5)
    requests = [[rng.choice(BOUNDARIES) for _ in range(hbs * blocks)], list(range(hbs * blocks)),
                [rng.randrange(I32_MIN, I32_MAX + 1) for _ in range(hbs * blocks + 2)]]
    words = torch.tensor([NONE_HASH_WORDS] * len(requests), dtype=torch.int32)
    for b in range(blocks):
        tokens = torch.tensor([r[b * hbs:(b + 1) * hbs] for r in requests], dtype=torch.int32)
        assert launch_block_hashes(words, tokens, words).shape == (len(requests), 0, 2)
        for r, row in zip(requests, words):
            assert words_digest(row) == keys.hash_request_tokens(r, hbs)[b]


def test_tiles_and_a_persistent_loop_leave_other_rows_untouched(monkeypatch):
    """5 lanes in tiles of 4 on one program (it hashes and keys tile 0, then tile 1): every digest and
    key right, and the rows of ``out``'s tensor past ``n`` never written."""
    monkeypatch.setattr(bh, "MAX_PROGRAMS", 1)
    n, hbs = 5, 1
    rng = random.Random(11)
    rows = [[rng.randrange(256)] for _ in range(n)]  # one chunk each
    parent_list = [rng.randbytes(32) for _ in range(n)]
    big = torch.full((n + 3, 8), 12345, dtype=torch.int32)
    parents_t = torch.tensor([digest_words(p) for p in parent_list], dtype=torch.int32)
    k = launch_block_hashes(parents_t, torch.tensor(rows, dtype=torch.int32), big[:n], torch.tensor([3], dtype=torch.int32),
                            lanes=4)
    assert ([words_digest(r) for r in big[:n]], [[tuple(x) for x in r] for r in k.tolist()]) == \
        expected(parent_list, rows, [3])
    assert (big[n:] == 12345).all()


@triton.jit
def _helpers_kernel(parents, tokens, out, groups, keys_out, scratch, k_table, row_of, MASK_EVERY: tl.constexpr,
                    HBS: tl.constexpr, L: tl.constexpr, W: tl.constexpr):
    """The helpers as a caller uses them: lane l hashes row ``row_of[l]`` (per-lane row pointers, in
    place: out is parents) unless ``l % MASK_EVERY == 1``, then keys its digest in ``groups[l]`` (int64)."""
    lane = tl.arange(0, L)
    row = tl.load(row_of + lane)
    m = (lane % MASK_EVERY) != 1
    h0, h1, h2, h3, h4, h5, h6, h7 = block_hash(parents + row * 8, tokens + row * HBS, m, out + row * 8,
                                                scratch + row * W, k_table, HBS, L)
    hi, lo = device_key(h0, h1, h2, h3, h4, h5, h6, h7, tl.load(groups + lane), k_table)
    tl.store(keys_out + row * 2, hi, mask=m)
    tl.store(keys_out + row * 2 + 1, lo, mask=m)


def test_helpers_with_row_pointers_masks_and_int64_groups():
    L, hbs = 8, 3
    rng = random.Random(3)
    row_of = list(range(L))
    rng.shuffle(row_of)
    rows = [[rng.choice(BOUNDARIES) for _ in range(hbs)] for _ in range(L)]
    parent_list = [rng.randbytes(32) for _ in range(L)]
    groups = [0, -1, 2**40, -(2**63), 2**63 - 1, 7, -(2**31), 2**31]
    words = torch.tensor([digest_words(p) for p in parent_list], dtype=torch.int32)
    before = words.clone()
    keys_out = torch.full((L, 2), 99, dtype=torch.int64)
    scratch = torch.empty(L * scratch_words(hbs), dtype=torch.int32)
    _helpers_kernel[(1,)](words, torch.tensor(rows, dtype=torch.int32), words, torch.tensor(groups, dtype=torch.int64),
                          keys_out, scratch, round_constant_table(), torch.tensor(row_of, dtype=torch.int32),
                          MASK_EVERY=3, HBS=hbs, L=L, W=scratch_words(hbs))
    for lane, r in enumerate(row_of):
        if lane % 3 == 1:  # masked: nothing read, nothing written
            assert torch.equal(words[r], before[r]) and keys_out[r].tolist() == [99, 99]
            continue
        d = keys.hash_block_tokens(parent_list[r], rows[r])
        assert words_digest(words[r]) == d
        assert tuple(keys_out[r].tolist()) == keys.device_key(d, groups[lane])


# ---- the launcher's input checks -----------------------------------------------------------------
def _args():
    return (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32),
            torch.full((2, 8), 7, dtype=torch.int32), torch.tensor([0], dtype=torch.int32))


SHARED = torch.zeros(3, 8, dtype=torch.int32)
BAD = {
    "parents not a tensor": lambda p, t, o, g: ([[0] * 8] * 2, t, o, g, {}),
    "tokens not a tensor": lambda p, t, o, g: (p, None, o, g, {}),
    "groups not a tensor": lambda p, t, o, g: (p, t, o, [0], {}),
    "parents int64": lambda p, t, o, g: (p.long(), t, o, g, {}),
    "tokens int64": lambda p, t, o, g: (p, t.long(), o, g, {}),
    "tokens float": lambda p, t, o, g: (p, t.float(), o, g, {}),
    "groups int64": lambda p, t, o, g: (p, t, o, g.long(), {}),
    "groups 2-d": lambda p, t, o, g: (p, t, o, g[None], {}),
    "tokens 1-d": lambda p, t, o, g: (p, t[0], o, g, {}),
    "parents 7 words": lambda p, t, o, g: (p[:, :7].contiguous(), t, o, g, {}),
    "out 3 rows": lambda p, t, o, g: (p, t, torch.zeros(3, 8, dtype=torch.int32), g, {}),
    "parents 3 rows": lambda p, t, o, g: (torch.zeros(3, 8, dtype=torch.int32), t, o, g, {}),
    "no tokens per block": lambda p, t, o, g: (p, t[:, :0], o, g, {}),
    "too many tokens per block": lambda p, t, o, g: (p, torch.zeros(2, MAX_HASH_BLOCK_SIZE + 1, dtype=torch.int32), o, g,
                                                     {}),
    "tokens not contiguous": lambda p, t, o, g: (p, torch.zeros(4, 2, dtype=torch.int32).t(), o, g, {}),
    "out not contiguous": lambda p, t, o, g: (p, t, torch.zeros(8, 2, dtype=torch.int32).t(), g, {}),
    "out overlaps parents": lambda p, t, o, g: (SHARED[:2], t, SHARED[1:], g, {}),
    "out is tokens": lambda p, t, o, g: (p, torch.zeros(2, 8, dtype=torch.int32), None, g, {"out_is_tokens": True}),
    "groups on meta": lambda p, t, o, g: (p, t, o, g.to("meta"), {}),
    "lanes 3": lambda p, t, o, g: (p, t, o, g, {"lanes": 3}),
    "lanes 0": lambda p, t, o, g: (p, t, o, g, {"lanes": 0}),
    "lanes 2048": lambda p, t, o, g: (p, t, o, g, {"lanes": 2048}),
    "lanes a float": lambda p, t, o, g: (p, t, o, g, {"lanes": 4.0}),
    "lanes True": lambda p, t, o, g: (p, t, o, g, {"lanes": True}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_are_typed_errors_and_write_nothing(case):
    p, t, o, g, kw = BAD[case](*_args())
    if kw.pop("out_is_tokens", False):
        o = t
    out_before = o.clone() if isinstance(o, torch.Tensor) and o.device.type != "meta" else None
    with pytest.raises(InvalidArgumentError) as e:
        launch_block_hashes(p, t, o, g, **kw)
    assert e.value.op == "block_hashes"
    if "not a tensor" in case or case.startswith("lanes a") or case == "lanes True":
        assert isinstance(e.value, ArgumentTypeError)
    if out_before is not None:
        assert torch.equal(o, out_before)


def test_no_lanes():
    p, t, o, g = _args()
    assert launch_block_hashes(p[:0], t[:0], o[:0], g).shape == (0, 1, 2)


# ---- the barrier between the digests and the keys ----------------------------------------------
@pytest.mark.strict_gpu_off  # runs its own checker
def test_the_digest_barrier_is_needed(tmp_path, monkeypatch):
    """Without the barrier that orders the digests' stores before the key phase reads them back (other
    threads), the strict checker flags the RAW and, reading the digests from before the stores
    (``stale``), the keys come out wrong. (With it, ``--strict-gpu=detect`` runs of this file see no
    hazard. The message's own barriers order byte stores before word loads, which the checker,
    comparing element start addresses, does not see.)"""
    mod, path, (line,) = without_barrier("block_hash", "the digests' stores", tmp_path)
    rows, parent_list = [[5], [200]], [keys.NONE_HASH, bytes(32)]  # one chunk each; 2 groups: (lane, group) pairs
    monkeypatch.setattr(bh, "block_hashes_kernel", mod.block_hashes_kernel)
    with Checker("detect") as c:
        hash_on_device(parent_list, rows, (0, 1))
    raw = [h for h in c.unmarked() if h.kind == "RAW" and h.b[-1][0] == str(path)]
    assert raw, c.report()
    with Checker("stale"):
        assert hash_on_device(parent_list, rows, (0, 1)) != expected(parent_list, rows, (0, 1))



def test_the_key_domain_is_the_hosts():
    """The kernel module names keys.device_key's domain itself (it imports no host module)."""
    assert KEY_DOMAIN == keys._DEVICE_KEY_DOMAIN
