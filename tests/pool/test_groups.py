"""KV-cache group kinds (gpupool/groups.py, docs/semantics.md section 6): the spec parsing, each rule
against vLLM's formula, and the device twins (kernels/groups.py) equal to the Python rules."""
import pytest
import torch
import triton
import triton.language as tl

from gpupool.errors import ArgumentTypeError, InvalidArgumentError
from gpupool.groups import KINDS, GroupKind
from gpupool.kernels.groups import block_hit, num_skipped_blocks, releases_blocks


@pytest.mark.parametrize("spec, kind", [("full", ("full", 0)), (("full",), ("full", 0)),
                                        (("sliding_window", 6), ("sliding_window", 6)),
                                        (["sliding_window", 1], ("sliding_window", 1))])
def test_parse(spec, kind):
    g = GroupKind.parse("op", spec)
    assert g == kind and isinstance(g, GroupKind)


@pytest.mark.parametrize("spec, err", [(("sliding_window", 0), InvalidArgumentError), ("mamba", InvalidArgumentError),
                                       (("sliding_window", "6"), ArgumentTypeError), (("sliding_window",), InvalidArgumentError)])
def test_parse_refuses(spec, err):
    with pytest.raises(err):
        GroupKind.parse("op", spec)


def test_skipped_blocks_are_vllms():
    """vLLM 0.33's SlidingWindowManager: skipped tokens ``max(0, num_computed - window + 1)``, the
    blocks wholly inside them skipped; full attention skips none."""
    sw, full = GroupKind("sliding_window", 6), GroupKind("full", 0)
    assert [sw.num_skipped_tokens(c) for c in (0, 5, 6, 7, 20)] == [0, 0, 1, 2, 15]
    assert [sw.num_skipped_blocks(c, 4, 10) for c in (0, 8, 9, 10, 20)] == [0, 0, 1, 1, 3]
    assert sw.num_skipped_blocks(100, 4, 5) == 5  # never past the row
    assert [full.num_skipped_blocks(c, 4, 10) for c in (0, 9, 100)] == [0, 0, 0]


@triton.jit
def _skipped_kernel(nc_ptr, w_ptr, nb_ptr, out_ptr, n, BS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    nc = tl.load(nc_ptr + offs, mask=m, other=0)
    w = tl.load(w_ptr + offs, mask=m, other=0)
    nb = tl.load(nb_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, num_skipped_blocks(nc, w, BS, nb), mask=m)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_device_twin_equals_the_rule(bs):
    cases = [(nc, w, nb) for nc in (0, 1, 5, 6, 7, 15, 16, 17, 63, 200) for w in (0, 1, 6, 16, 33) for nb in (0, 1, 3, 20)]
    nc, w, nb = (torch.tensor(col, dtype=torch.int32) for col in zip(*cases))
    out = torch.full_like(nc, -7)
    _skipped_kernel[(1,)](nc, w, nb, out, len(cases), BS=bs, BLOCK=triton.next_power_of_2(len(cases)))
    expect = [GroupKind("sliding_window" if wi else "full", wi).num_skipped_blocks(c, bs, b) for c, wi, b in cases]
    assert out.tolist() == expect


@pytest.mark.parametrize("kind", [GroupKind("full", 0), GroupKind("sliding_window", 6)], ids=lambda g: g.kind)
def test_hit_length_is_the_leading_cached_run(kind):
    """gpupool's hit rule for every kind so far: the group accepts its leading cached blocks."""
    assert kind.spec is KINDS[kind.kind]
    assert [kind.hit_length(c) for c in ([], [False], [True, True, False, True], [True] * 3)] == [0, 0, 2, 3]


@triton.jit
def _kind_kernel(w_ptr, blk_ptr, rel_ptr, hit_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(w_ptr + offs, mask=m, other=0)
    blk = tl.load(blk_ptr + offs, mask=m, other=0)
    tl.store(rel_ptr + offs, releases_blocks(w).to(tl.int32), mask=m)
    tl.store(hit_ptr + offs, block_hit(w, blk).to(tl.int32), mask=m)


def test_device_kind_hooks_equal_the_specs():
    kinds = [GroupKind("full", 0), GroupKind("sliding_window", 1), GroupKind("sliding_window", 33)]
    cases = [(g, b) for g in kinds for b in (-1, 0, 5)]
    w = torch.tensor([g.device_word() for g, _ in cases], dtype=torch.int32)
    blk = torch.tensor([b for _, b in cases], dtype=torch.int32)
    rel, hit = torch.full_like(w, -7), torch.full_like(w, -7)
    _kind_kernel[(1,)](w, blk, rel, hit, len(cases), BLOCK=16)
    assert rel.tolist() == [int(g.spec.releases_blocks) for g, _ in cases]
    assert hit.tolist() == [g.hit_length([b >= 0]) for g, b in cases]
