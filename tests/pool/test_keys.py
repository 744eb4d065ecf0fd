"""Tests of gpupool.keys: chained vLLM-compatible block hashing and 128-bit device keys."""
from __future__ import annotations

from harness.paths import ROOT
from harness.timeouts import scaled
import hashlib
import os
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.errors import ArgumentTypeError, InvalidArgumentError
from gpupool.keys import (
    NONE_HASH,
    device_key,
    device_key_list,
    device_keys,
    generate_block_hash_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
    trace_block_hash,
)

BS = 4
TOKENS = list(range(100, 100 + 5 * BS + 2))  # 5 full blocks + a 2-token partial block

token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=0, max_size=40)


def _reference_hash(parent: bytes, tokens, extra) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra), protocol=pickle.HIGHEST_PROTOCOL)).digest()


# --- the block hash formula ------------------------------------------------------------------

def test_none_hash_is_fixed_vllm_seed():
    # vLLM with PYTHONHASHSEED=0 and the sha256 hash fn: NONE_HASH = sha256(pickle("0")).
    assert NONE_HASH == hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert len(NONE_HASH) == 32


def test_hash_block_tokens_matches_formula():
    parent = b"\x01" * 32
    assert hash_block_tokens(parent, [1, 2, 3], ("lora", "mm")) == _reference_hash(parent, [1, 2, 3], ("lora", "mm"))
    assert hash_block_tokens(None, [1, 2, 3]) == _reference_hash(NONE_HASH, [1, 2, 3], None)
    assert len(hash_block_tokens(None, [1, 2, 3])) == 32
    # None and () extra keys are different inputs, as in vLLM.
    assert hash_block_tokens(None, [1], None) != hash_block_tokens(None, [1], ())


def test_token_ids_normalised_to_int():
    assert hash_block_tokens(None, torch.tensor([5, 6, 7])) == hash_block_tokens(None, [5, 6, 7])
    assert hash_block_tokens(None, [True, False]) == hash_block_tokens(None, [1, 0])
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1.0, 2.0])
    with pytest.raises(TypeError):
        hash_block_tokens("not bytes", [1])


def test_request_hashes_are_the_chain():
    hashes = hash_request_tokens(TOKENS, BS)
    parent = NONE_HASH
    for i, h in enumerate(hashes):
        parent = _reference_hash(parent, TOKENS[i * BS:(i + 1) * BS], None)
        assert h == parent


# --- chaining ------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=BS, max_size=6 * BS), data=st.data())
def test_changing_one_token_changes_that_block_and_later(tokens, data):
    pos = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[pos] += 1
    a, b = hash_request_tokens(tokens, BS), hash_request_tokens(changed, BS)
    assert len(a) == len(b) == len(tokens) // BS
    blk = pos // BS
    for i in range(len(a)):
        if i < blk:
            assert a[i] == b[i]
        else:
            assert a[i] != b[i]


@given(tokens=token_lists, bs=st.integers(1, 8))
@settings(max_examples=50, deadline=None)
def test_only_full_blocks_are_hashed(tokens, bs):
    hashes = hash_request_tokens(tokens, bs)
    assert len(hashes) == len(tokens) // bs
    # Appending a partial block adds nothing and changes nothing.
    full = tokens[: len(tokens) // bs * bs]
    assert hash_request_tokens(full, bs) == hashes
    assert hash_request_tokens(full + [7] * (bs - 1), bs) == hashes


def test_trailing_partial_block_has_no_hash():
    assert len(hash_request_tokens(TOKENS, BS)) == 5
    assert hash_request_tokens(TOKENS[:BS - 1], BS) == []
    assert hash_request_tokens([], BS) == []
    with pytest.raises(ValueError):
        hash_request_tokens(TOKENS, 0)


def test_parent_block_hash_continues_a_chain():
    hashes = hash_request_tokens(TOKENS, BS)
    tail = hash_request_tokens(TOKENS[2 * BS:], BS, parent_block_hash=hashes[1])
    assert tail == hashes[2:]
    assert hash_request_tokens(TOKENS, BS, parent_block_hash=None) == hashes


# --- extra keys ----------------------------------------------------------------------------

def test_extra_keys_order_and_none():
    assert generate_block_hash_extra_keys(0, 4) is None
    assert generate_block_hash_extra_keys(
        0, 4, lora_name="L", mm_features=[("m1", 1, 2), ("m2", 3, 5)], cache_salt="s"
    ) == ("L", "m1", "m2", "s")
    # salt only on the first block; empty salt is ignored as in vLLM (`if cache_salt`).
    assert generate_block_hash_extra_keys(4, 8, cache_salt="s") is None
    assert generate_block_hash_extra_keys(0, 4, cache_salt="") is None
    assert generate_block_hash_extra_keys(4, 8, lora_name="L") == ("L",)


def test_mm_overlap_rule():
    item = [("img", 4, 4)]  # token positions 4..7
    assert generate_block_hash_extra_keys(0, 4, mm_features=item) is None  # ends where item starts
    assert generate_block_hash_extra_keys(4, 8, mm_features=item) == ("img",)
    assert generate_block_hash_extra_keys(8, 12, mm_features=item) is None  # starts where item ends
    assert generate_block_hash_extra_keys(0, 5, mm_features=item) == ("img",)
    assert generate_block_hash_extra_keys(7, 9, mm_features=item) == ("img",)
    # An item spanning several blocks is listed in each.
    big = [("vid", 2, 9)]  # positions 2..10
    assert [generate_block_hash_extra_keys(s, s + 4, mm_features=big) for s in (0, 4, 8, 12)] == [
        ("vid",), ("vid",), ("vid",), None]
    with pytest.raises(ValueError):
        generate_block_hash_extra_keys(0, 4, mm_features=[("x", -1, 2)])


def test_lora_name_changes_every_hash():
    base = hash_request_tokens(TOKENS, BS)
    lora = hash_request_tokens(TOKENS, BS, lora_name="adapter-a")
    other = hash_request_tokens(TOKENS, BS, lora_name="adapter-b")
    assert len(lora) == len(base) == 5
    assert all(x != y for x, y in zip(base, lora))
    assert all(x != y for x, y in zip(lora, other))
    # Block 0 carries exactly the lora name as its extra keys.
    assert lora[0] == hash_block_tokens(None, TOKENS[:BS], ("adapter-a",))


def test_mm_item_changes_overlapped_blocks_and_later_only():
    base = hash_request_tokens(TOKENS, BS)
    # item covers positions 9..10 -> block 2 only ([8, 12)).
    mm = hash_request_tokens(TOKENS, BS, mm_features=[("img-hash", 9, 2)])
    assert mm[:2] == base[:2]
    assert all(x != y for x, y in zip(mm[2:], base[2:]))
    assert mm[2] == hash_block_tokens(base[1], TOKENS[8:12], ("img-hash",))
    # Block 3 has no extra key of its own; it differs only through its parent.
    assert mm[3] == hash_block_tokens(mm[2], TOKENS[12:16], None)
    # A different mm hash for the same placeholder gives different hashes from block 2 on.
    mm2 = hash_request_tokens(TOKENS, BS, mm_features=[("img-other", 9, 2)])
    assert mm2[:2] == base[:2] and mm2[2] != mm[2]


def test_mm_item_only_in_partial_block_changes_nothing():
    base = hash_request_tokens(TOKENS, BS)
    assert hash_request_tokens(TOKENS, BS, mm_features=[("img", 5 * BS, 2)]) == base


def test_salt_only_in_block0_but_changes_all_by_chaining():
    base = hash_request_tokens(TOKENS, BS)
    salted = hash_request_tokens(TOKENS, BS, cache_salt="tenant-1")
    assert all(x != y for x, y in zip(base, salted))
    assert salted[0] == hash_block_tokens(None, TOKENS[:BS], ("tenant-1",))
    for i in range(1, len(salted)):
        assert salted[i] == hash_block_tokens(salted[i - 1], TOKENS[i * BS:(i + 1) * BS], None)


def test_all_extra_keys_together_in_block0():
    h = hash_request_tokens(TOKENS, BS, lora_name="L", mm_features=[("m", 0, 1)], cache_salt="s")
    assert h[0] == hash_block_tokens(None, TOKENS[:BS], ("L", "m", "s"))
    assert h[1] == hash_block_tokens(h[0], TOKENS[BS:2 * BS], ("L",))


# --- determinism across processes -----------------------------------------------------------

_CHILD = (
    "from gpupool.keys import hash_request_tokens, device_key, trace_block_hash, NONE_HASH\n"
    "h = hash_request_tokens(list(range(100, 122)), 4, lora_name='L', mm_features=[('m', 5, 3)], cache_salt='s')\n"
    "print(NONE_HASH.hex())\n"
    "print(','.join(x.hex() for x in h))\n"
    "print(device_key(h[-1], 3))\n"
    "print(trace_block_hash(42).hex())\n"
)


@pytest.mark.parametrize("seed", ["1", "12345"])
def test_deterministic_across_processes(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         check=True, timeout=scaled(60)).stdout.splitlines()
    h = hash_request_tokens(list(range(100, 122)), 4, lora_name="L", mm_features=[("m", 5, 3)], cache_salt="s")
    assert out == [NONE_HASH.hex(), ",".join(x.hex() for x in h), str(device_key(h[-1], 3)),
                   trace_block_hash(42).hex()]


# --- device keys -----------------------------------------------------------------------------

def test_device_key_formula_and_range():
    bh = b"abc"
    d = hashlib.sha256(b"gpupool.device_key.v1\x00" + (3).to_bytes(8, "little") + bh
                       + (7).to_bytes(8, "little", signed=True)).digest()
    hi, lo = device_key(bh, 7)
    assert (hi, lo) == (int.from_bytes(d[:8], "little", signed=True), int.from_bytes(d[8:16], "little", signed=True))
    for h in (b"", b"x", NONE_HASH):
        for v in device_key(h, 0):
            assert -(2**63) <= v < 2**63
    with pytest.raises(TypeError):
        device_key("abc", 0)
    with pytest.raises(ValueError):
        device_key(b"abc", 2**63)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=70), st.integers(min_value=-2**63, max_value=2**63 - 1)), max_size=12))
def test_device_key_list_equals_device_key(pairs):
    """The fast many-keys form (a copied prefix state) gives device_key's values, in order, repeated
    hash lengths and groups included."""
    pairs = pairs + pairs[:3]
    assert device_key_list(pairs) == [device_key(h, g) for h, g in pairs]


def test_device_key_list_raises_as_device_key():
    with pytest.raises(TypeError):
        device_key_list([(b"ok", 0), ("abc", 0)])
    with pytest.raises(ValueError):
        device_key_list([(b"abc", 2**63)])


def test_device_key_prefix_related_hashes_differ():
    hs = [b"", b"a", b"a\x00", b"a\x00\x00", b"\x00a", b"\x00", b"\x00" * 32, b"\x00" * 33, NONE_HASH,
          NONE_HASH + b"\x00", NONE_HASH[:16], NONE_HASH[:16] + b"\xff" * 16]
    keys = {device_key(h, 0) for h in hs}
    assert len(keys) == len(hs)


@settings(max_examples=200, deadline=None)
@given(a=st.binary(min_size=0, max_size=40), b=st.binary(min_size=0, max_size=40), g=st.integers(0, 2**31 - 1))
def test_device_keys_of_distinct_hashes_differ(a, b, g):
    if a == b:
        assert device_key(a, g) == device_key(b, g)
    else:
        assert device_key(a, g) != device_key(b, g)


@settings(max_examples=100, deadline=None)
@given(a=st.binary(min_size=0, max_size=8), suffix=st.binary(min_size=1, max_size=4), g=st.integers(0, 7))
def test_device_keys_of_prefix_extensions_differ(a, suffix, g):
    assert device_key(a, g) != device_key(a + suffix, g)


@settings(max_examples=100, deadline=None)
@given(h=st.binary(min_size=0, max_size=40), g1=st.integers(-(2**63), 2**63 - 1), g2=st.integers(-(2**63), 2**63 - 1))
def test_same_hash_different_groups_differ(h, g1, g2):
    if g1 == g2:
        assert device_key(h, g1) == device_key(h, g2)
    else:
        assert device_key(h, g1) != device_key(h, g2)


def test_device_keys_tensor_matches_rows():
    hashes = hash_request_tokens(TOKENS, BS) + [b"a", b"a\x00", b""]
    t = device_keys(hashes, 2)
    assert t.shape == (len(hashes), 2)
    assert t.dtype == torch.int64
    assert t.device.type == "cpu"
    for i, h in enumerate(hashes):
        assert tuple(t[i].tolist()) == device_key(h, 2)
    # Different group -> every row differs.
    assert bool((device_keys(hashes, 3) != t).any(dim=1).all())


def test_device_keys_empty():
    t = device_keys([], 0)
    assert t.shape == (0, 2) and t.dtype == torch.int64


# --- trace hashes ----------------------------------------------------------------------------

@given(hid=st.integers(min_value=-(2**40), max_value=2**64))
@settings(max_examples=50, deadline=None)
def test_trace_block_hash_formula(hid):
    assert trace_block_hash(hid) == hashlib.sha256(str(hid).encode()).digest()


def test_trace_block_hash_known_value():
    assert trace_block_hash(0) == hashlib.sha256(b"0").digest()
    assert trace_block_hash(0) != trace_block_hash(1)
    assert len(trace_block_hash(123)) == 32


@pytest.mark.parametrize("bad, error", [
    ("\ud800", InvalidArgumentError), ("a\udfff\ud800", InvalidArgumentError),  # no UTF-8 form
    (1.0, ArgumentTypeError), (True, ArgumentTypeError), (b"7", ArgumentTypeError), (None, ArgumentTypeError),
    ([7], ArgumentTypeError), (torch.tensor(1.5), ArgumentTypeError),
])
def test_trace_block_hash_refuses_what_has_no_text_form(bad, error):
    """A typed error naming the op (not the codec's UnicodeEncodeError or a bare TypeError)."""
    with pytest.raises(error, match="trace_block_hash"):
        trace_block_hash(bad)


def test_trace_block_hash_of_an_int_past_the_str_digit_limit():
    with pytest.raises(InvalidArgumentError, match="decimal digits"):
        trace_block_hash(10**5000)
    assert trace_block_hash(torch.tensor(7)) == trace_block_hash(7)  # __index__ values hash as the int
