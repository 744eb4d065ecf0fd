"""KV-cache group kinds (gpupool/groups.py, docs/semantics.md section 6): the spec parsing, each rule
against vLLM's formula, and the device twins (kernels/groups.py) equal to the Python rules."""
import re

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, strategies as st

from gpupool.errors import ArgumentTypeError, InvalidArgumentError
from gpupool.groups import KINDS, GroupKind, longest_cache_hit
from gpupool.kernels.groups import block_hit, num_skipped_blocks, releases_blocks, windowed, windowed_hit
from gpupool.manager import KVCacheManager
from gpupool.reference import ReferenceKVCacheManager

CL = "chunked_local_attention"


@pytest.mark.parametrize("spec, kind", [("full", ("full", 0)), (("full",), ("full", 0)),
                                        (("sliding_window", 6), ("sliding_window", 6)),
                                        (["sliding_window", 1], ("sliding_window", 1)),
                                        ((CL, 8), (CL, 8)), ([CL, 1], (CL, 1))])
def test_parse(spec, kind):
    g = GroupKind.parse("op", spec)
    assert g == kind and isinstance(g, GroupKind)


@pytest.mark.parametrize("spec, err", [(("sliding_window", 0), InvalidArgumentError), ("mamba", InvalidArgumentError),
                                       (("sliding_window", "6"), ArgumentTypeError),
                                       (("sliding_window",), InvalidArgumentError),
                                       ((CL, 0), InvalidArgumentError), ((CL, -8), InvalidArgumentError),
                                       ((CL, 8.0), ArgumentTypeError), ((CL, 1 << 80), InvalidArgumentError),
                                       ((CL,), InvalidArgumentError), (CL, InvalidArgumentError)])
def test_parse_refuses(spec, err):
    with pytest.raises(err):
        GroupKind.parse("op", spec)


@pytest.mark.parametrize("groups", [("full", (CL, 6)), ((CL, 8), (CL, 16)), ("full", (CL, 2)), ((CL, 8), (CL, "8")),
                                    ((CL, 1 << 31),), ((CL, True),), ((CL, 8, 8),), ((CL, None),)])
def test_managers_refuse_chunks_they_cannot_run(groups):
    """A chunk that is not a multiple of the block size, two chunk sizes in one manager, a chunk that
    is no int or does not fit int32, a spec of another shape: the same typed error from both."""
    kw = dict(block_size=4, max_num_reqs=1, max_blocks_per_req=4, groups=groups)
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)) as e:
        ReferenceKVCacheManager(8, **kw)
    with pytest.raises(type(e.value), match=re.escape(str(e.value).split(":")[-1].strip())):
        KVCacheManager(8, device="cpu", **kw)


def test_kind_codes_are_the_devices():
    """Each spec's code is its member of the kernels' ``KindCode`` (kernels/layout.py)."""
    from gpupool.kernels.layout import KindCode

    assert {k.name: k.code for k in KINDS.values()} == {"full": KindCode.FULL, "sliding_window": KindCode.SLIDING_WINDOW,
                                                          CL: KindCode.CHUNKED_LOCAL}


def test_skipped_blocks_are_vllms():
    """vLLM 0.33's SlidingWindowManager: skipped tokens ``max(0, num_computed - window + 1)``;
    ChunkedLocalAttentionManager: ``num_computed // chunk * chunk`` (its docstring's examples: chunk 8,
    13 -> 8, 8 -> 8, 7 -> 0); the blocks wholly inside them skipped; full attention skips none."""
    sw, full, cl = GroupKind("sliding_window", 6), GroupKind("full", 0), GroupKind(CL, 8)
    assert [sw.num_skipped_tokens(c) for c in (0, 5, 6, 7, 20)] == [0, 0, 1, 2, 15]
    assert [sw.num_skipped_blocks(c, 4, 10) for c in (0, 8, 9, 10, 20)] == [0, 0, 1, 1, 3]
    assert sw.num_skipped_blocks(100, 4, 5) == 5  # never past the row
    assert [full.num_skipped_blocks(c, 4, 10) for c in (0, 9, 100)] == [0, 0, 0]
    assert [cl.num_skipped_tokens(c) for c in (13, 8, 7, 0, 16, 23)] == [8, 8, 0, 0, 16, 16]
    assert [cl.num_skipped_blocks(c, 4, 10) for c in (7, 8, 15, 16, 100)] == [0, 2, 2, 4, 10]


def test_hit_length_is_vllms():
    """Full attention and a sliding window accept their leading cached blocks; chunked local attention
    is ChunkedLocalAttentionManager.find_longest_cache_hit (its docstring's examples: chunk 8, block 4;
    max length 15, 3 blocks: blocks 0, 1 null, block 2 looked up; max length 16: 4 null blocks)."""
    for kind in (GroupKind("full", 0), GroupKind("sliding_window", 6)):
        assert kind.spec is KINDS[kind.kind]
        assert [kind.hit_length(c, 4) for c in ([], [False], [True, True, False, True], [True] * 3)] == [0, 0, 2, 3]
    cl = GroupKind(CL, 8)
    assert cl.hit_length([False, False, True], 4) == 3
    assert cl.hit_length([True, True, False], 4) == 2
    assert cl.hit_length([False] * 4, 4) == 4
    assert cl.hit_length([False] * 5, 4) == 4  # 20 tokens: block 4 is looked up
    assert cl.hit_length([False] * 5 + [True], 4) == 6  # 24 tokens: all six are null
    assert cl.hit_length([], 4) == 0


def test_longest_cache_hit_is_the_hybrid_coordinators():
    """Full attention first, the chunked group given its hit (vLLM's simple hybrid): the chunk that
    holds the full hit's end is looked up, and the chunked group's miss there shortens the hit."""
    groups = [GroupKind(CL, 8), GroupKind("full", 0)]
    yes, no = True, False
    # full hits 5 blocks; chunk of block 5 starts at 4: the chunked group must hit block 4
    assert longest_cache_hit(groups, [[no, no, no, no, yes, no, no], [yes] * 5 + [no, yes]], 4) == 5
    assert longest_cache_hit(groups, [[yes] * 4 + [no, yes, yes], [yes] * 5 + [no, yes]], 4) == 4
    assert longest_cache_hit(groups, [[no] * 7, [yes] * 4 + [no] * 3], 4) == 4  # a chunk's end: all null


@triton.jit
def _skipped_kernel(nc_ptr, k_ptr, w_ptr, nb_ptr, out_ptr, n, BS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    nc = tl.load(nc_ptr + offs, mask=m, other=0)
    kind = tl.load(k_ptr + offs, mask=m, other=0)
    w = tl.load(w_ptr + offs, mask=m, other=0)
    nb = tl.load(nb_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, num_skipped_blocks(nc, kind, w, BS, nb), mask=m)


KIND_CASES = [GroupKind("full", 0), GroupKind("sliding_window", 1), GroupKind("sliding_window", 6),
              GroupKind("sliding_window", 33), GroupKind(CL, 1), GroupKind(CL, 16), GroupKind(CL, 48)]


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_device_twin_equals_the_rule(bs):
    cases = [(nc, g, nb) for nc in (0, 1, 5, 6, 7, 15, 16, 17, 63, 200) for g in KIND_CASES for nb in (0, 1, 3, 20)]
    nc, kind, w, nb = (torch.tensor(col, dtype=torch.int32)
                       for col in zip(*[(c, g.spec.code, g.window, b) for c, g, b in cases]))
    out = torch.full_like(nc, -7)
    _skipped_kernel[(1,)](nc, kind, w, nb, out, len(cases), BS=bs, BLOCK=triton.next_power_of_2(len(cases)))
    assert out.tolist() == [g.num_skipped_blocks(c, bs, b) for c, g, b in cases]


@triton.jit
def _kind_kernel(k_ptr, w_ptr, blk_ptr, pos_ptr, len_ptr, rel_ptr, hit_ptr, null_ptr, miss_ptr, n, BS: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    kind = tl.load(k_ptr + offs, mask=m, other=0)
    w = tl.load(w_ptr + offs, mask=m, other=0)
    blk = tl.load(blk_ptr + offs, mask=m, other=0)
    null, miss = windowed_hit(kind, w, tl.load(pos_ptr + offs, mask=m, other=0), blk,
                              tl.load(len_ptr + offs, mask=m, other=0), BS)
    tl.store(rel_ptr + offs, releases_blocks(kind).to(tl.int32) + 2 * windowed(kind).to(tl.int32), mask=m)
    tl.store(hit_ptr + offs, block_hit(kind, blk, True).to(tl.int32), mask=m)
    tl.store(null_ptr + offs, null.to(tl.int32), mask=m)
    tl.store(miss_ptr + offs, miss.to(tl.int32), mask=m)


def test_device_kind_hooks_equal_the_specs():
    """``releases_blocks``, ``windowed``, the prefix scan's ``block_hit`` and the windowed scan's
    ``windowed_hit`` (null: before ``hit_start``; miss: an uncached block from there) against the
    specs, and together they give ``hit_length`` for every cached pattern of up to 5 blocks."""
    bs = 4
    cases = [(g, b, p, n) for g in KIND_CASES for b in (-1, 0, 5) for n in range(6) for p in range(6)]
    cols = [torch.tensor(c, dtype=torch.int32)
            for c in zip(*[(g.spec.code, g.window, b, p, n) for g, b, p, n in cases])]
    outs = [torch.full_like(cols[0], -7) for _ in range(4)]
    _kind_kernel[(1,)](*cols, *outs, len(cases), BS=bs, BLOCK=triton.next_power_of_2(len(cases)))
    rel, hit, null, miss = (o.tolist() for o in outs)
    for i, (g, b, p, n) in enumerate(cases):
        s = g.spec.hit_start(g.window, n, bs)
        assert rel[i] == int(g.spec.releases_blocks) + 2 * int(g.spec.windowed_hit)
        assert hit[i] == int(b >= 0 or g.spec.windowed_hit)
        assert (null[i], miss[i]) == (int(p < min(s, n)), int(s <= p < n and b < 0)), (g, b, p, n)


@given(st.sampled_from(KIND_CASES), st.lists(st.booleans(), max_size=12))
def test_two_scans_give_the_kinds_hit(kind, cached):
    """The device's two scans (prefix scan with ``block_hit``, then the windowed scan's first miss) in
    Python over the specs: the hit ``hit_length`` gives."""
    bs = 4
    prefix = next((i for i, c in enumerate(cached) if not (c or kind.spec.windowed_hit)), len(cached))
    s = kind.spec.hit_start(kind.window, prefix, bs)
    windowed_miss = next((i for i in range(s, prefix) if not cached[i]), prefix)
    assert min(prefix, windowed_miss) == kind.hit_length(cached, bs)
