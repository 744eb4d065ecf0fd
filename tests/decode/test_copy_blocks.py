"""``gpupool.kernels.copy_blocks``: all pending block copies of all layers in one launch, against torch
indexing (``cache[dst] = cache[src]`` per layer, every copy reading the pre-copy contents), bitwise;
the unchecked path (``check=False``, the captured decode step's) skips an out-of-range pair instead of
touching memory outside the caches."""
import pytest
import torch

from gpupool.errors import InvalidArgumentError
from gpupool.kernels import copy_blocks as cb
from gpupool.kernels.copy_blocks import copy_blocks
from harness.device import cpu_i32

I32 = torch.int32
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
FP8 = getattr(torch, "float8_e4m3fn", None)


def random_bits(shape, dtype, gen):
    """A tensor of ``dtype`` with uniformly random bits (NaN and inf patterns included)."""
    size = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    return bits.view(dtype).reshape(shape).contiguous()


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def reference(caches, src, dst, n):
    s, d = src[:n].long(), dst[:n].long()
    out = []
    for c in caches:
        r = c.clone()
        r[d] = c[s]
        out.append(r)
    return out


def assert_copied(caches, before, src, dst, n):
    for c, b, r in zip(caches, before, reference(before, src, dst, n)):
        assert torch.equal(bits(c), bits(r))
        untouched = [i for i in range(c.shape[0]) if i not in set(dst[:n].tolist())]
        assert torch.equal(bits(c[untouched]), bits(b[untouched]))


def pairs(num_blocks, k, gen):
    perm = torch.randperm(num_blocks, generator=gen).to(I32)
    return perm[:k].clone(), perm[k:2 * k].clone()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,k", [((8, 2, 16, 8, 64), 3), ((32, 16, 4, 32), 0), ((32, 16, 4, 32), 1),
                                     ((32, 16, 4, 32), 12)])
def test_matches_torch_indexing(shape, k, dtype):
    gen = torch.Generator().manual_seed(k + shape[0])
    caches = [random_bits(shape, dtype, gen) for _ in range(3)]  # separate allocations
    before = [c.clone() for c in caches]
    src, dst = pairs(shape[0], k, gen)
    copy_blocks(caches, src, dst)
    assert_copied(caches, before, src, dst, k)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_num_copies_from_a_device_tensor(n):
    gen = torch.Generator().manual_seed(n)
    caches = [random_bits((16, 4, 2, 8), torch.float16, gen) for _ in range(2)]
    before = [c.clone() for c in caches]
    src, dst = pairs(16, 3, gen)
    # Entries past the count are garbage (out of range, repeated): ignored and not checked.
    src = torch.cat([src, torch.tensor([-1, 99, dst[0]], dtype=I32)])
    dst = torch.cat([dst, torch.tensor([src[0], src[0], 1000], dtype=I32)])
    copy_blocks(caches, src, dst, torch.tensor([n], dtype=I32))
    assert_copied(caches, before, src, dst, n)


def test_count_changes_between_calls_with_one_queue():
    gen = torch.Generator().manual_seed(7)
    caches = [random_bits((12, 64), torch.float32, gen)]
    src, dst = pairs(12, 4, gen)
    count = torch.zeros(1, dtype=I32)
    for n in (2, 4, 0, 1):
        before = [c.clone() for c in caches]
        count.fill_(n)
        copy_blocks(caches, src, dst, count, check=False)
        assert_copied(caches, before, src, dst, n)


def test_mixed_layers_are_grouped_by_block_bytes():
    """fp32/bf16/fp16 layers with equal and with different bytes per block, views into one stacked
    allocation, and a layer at an odd 2-byte alignment (copied in 2-byte units)."""
    gen = torch.Generator().manual_seed(3)
    stacked = random_bits((2, 10, 4, 8), torch.bfloat16, gen)
    raw = random_bits((10 * 3 * 5 + 1,), torch.float16, gen)
    caches = [random_bits((10, 4, 4), torch.float32, gen),  # 64 bytes per block
              stacked[0], stacked[1],  # 64 bytes per block, one allocation
              random_bits((10, 3, 5), torch.float16, gen),  # 30 bytes per block
              raw[1:].view(10, 3, 5),  # 30 bytes, address 2 mod 4
              random_bits((10, 7), torch.float32, gen)]  # 28 bytes
    if FP8 is not None:
        caches.append(random_bits((10, 2, 8), FP8, gen))  # 16 bytes
    before = [c.clone() for c in caches]
    raw_first = raw[:1].clone()
    src = torch.tensor([1, 2, 3], dtype=I32)
    dst = torch.tensor([9, 0, 5], dtype=I32)
    copy_blocks(caches, src, dst)
    assert_copied(caches, before, src, dst, 3)
    assert torch.equal(bits(raw[:1]), bits(raw_first))  # the element before the odd-aligned layer


def test_one_launch_for_alike_layers(monkeypatch):
    launches = []
    real = cb._launch
    monkeypatch.setattr(cb, "_launch", lambda layers, *a: (launches.append(len(layers)), real(layers, *a)))
    gen = torch.Generator().manual_seed(5)
    caches = [random_bits((6, 2, 8), torch.float16, gen) for _ in range(4)]
    copy_blocks(caches, torch.tensor([0], dtype=I32), torch.tensor([1], dtype=I32))
    assert launches == [4]
    launches.clear()
    copy_blocks(caches + [random_bits((6, 3), torch.float32, gen)], torch.tensor([0], dtype=I32),
                torch.tensor([1], dtype=I32))
    assert sorted(launches) == [1, 4]


def _caches():
    return [torch.zeros(8, 4, 16) for _ in range(2)]


def _ids(*v):
    return torch.tensor(v, dtype=I32)


@pytest.mark.parametrize("make", [
    lambda: dict(kv_caches=[torch.zeros(8, 16, 4).transpose(1, 2)]),  # not contiguous
    lambda: dict(kv_caches=[torch.zeros(8, 4)] * 2),  # the same memory twice
    lambda: dict(kv_caches=(lambda t: [t[:5], t[4:]])(torch.zeros(8, 4))),  # overlapping views
    lambda: dict(kv_caches=[torch.zeros(8, 4), torch.zeros(8, 4, device="meta")]),  # two devices
    lambda: dict(src=_ids(0).to("meta")),
    lambda: dict(src=torch.tensor([0]), dst=torch.tensor([1])),  # int64 ids
    lambda: dict(src=_ids(0, 1), dst=_ids(2)),  # lengths differ
    lambda: dict(src=_ids(0, 1), dst=_ids(2, 2)),  # two copies to one block
    lambda: dict(src=_ids(0, 1), dst=_ids(1, 2)),  # a destination is another copy's source
    lambda: dict(src=_ids(3), dst=_ids(3)),  # a block onto itself
    lambda: dict(src=_ids(8), dst=_ids(1)),  # out of range
    lambda: dict(src=_ids(0), dst=_ids(-1)),
    lambda: dict(num_copies=_ids(2)),  # more than len(src)
    lambda: dict(num_copies=_ids(-1)),
    lambda: dict(num_copies=torch.tensor([1])),  # int64 count
    lambda: dict(num_copies=_ids(1, 1)),
])
def test_invalid_arguments_raise_and_change_nothing(make):
    args = dict(kv_caches=_caches(), src=_ids(0), dst=_ids(1), num_copies=None)
    args.update(make())
    before = [c.clone() for c in args["kv_caches"] if c.device.type == "cpu"]
    with pytest.raises(InvalidArgumentError) as e:
        copy_blocks(**args)
    assert e.value.op == "copy_blocks"
    after = [c for c in args["kv_caches"] if c.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_check_false_skips_only_the_value_checks():
    caches = _caches()
    caches[0][0] = 1
    copy_blocks(caches, _ids(0), _ids(1), check=False)
    assert torch.equal(caches[0][1], caches[0][0])
    with pytest.raises(InvalidArgumentError):  # structure is still checked (no host sync needed)
        copy_blocks(caches, torch.tensor([0]), _ids(1), check=False)


def test_nothing_to_do():
    copy_blocks([], _ids(0), _ids(1))
    caches = _caches()
    copy_blocks(caches, _ids(), _ids())
    copy_blocks([torch.zeros(0, 4)], _ids(), _ids())
    assert all(torch.count_nonzero(c) == 0 for c in caches)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_with_a_changing_count():
    gen = torch.Generator().manual_seed(11)
    caches = [random_bits((64, 2, 16, 8, 64), torch.bfloat16, gen).cuda() for _ in range(4)]
    src, dst = (t.cuda() for t in pairs(64, 16, gen))
    count = torch.tensor([16], dtype=I32, device="cuda")
    tables = {}
    copy_blocks(caches, src, dst, count, offset_tables=tables)  # eager: builds the offset table, compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_blocks(caches, src, dst, count, check=False, offset_tables=tables)
    for n in (3, 0, 16):
        before = [c.clone() for c in caches]
        count.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        assert_copied([c.cpu() for c in caches], [b.cpu() for b in before], src.cpu(), dst.cpu(), n)


def test_tiles_loop_and_layer_split_past_the_grid_limit(monkeypatch):
    """With the grid's y/z limit made tiny, programs loop over several tiles and layers go in batches."""
    monkeypatch.setattr(cb, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(cb, "BYTES_PER_PROGRAM", 64)
    gen = torch.Generator().manual_seed(13)
    caches = [random_bits((6, 100), torch.float32, gen) for _ in range(5)]  # 400 bytes: 7 tiles of 64
    before = [c.clone() for c in caches]
    src, dst = _ids(0, 5), _ids(3, 1)
    copy_blocks(caches, src, dst)
    assert_copied(caches, before, src, dst, 2)


# ---- the unchecked path of the captured step ---------------------------------------------------

def test_unchecked_copy_blocks_never_touches_memory_outside_the_caches():
    """``copy_blocks(check=False)`` (the captured step's path) skips a pair with an id outside the
    caches instead of reading or writing past them; the valid pairs are copied."""
    from gpupool.kernels.copy_blocks import copy_blocks

    big = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    layer, guard = big[:4], big[4:].clone()
    src, dst = cpu_i32([1, 2, -1, 3]), cpu_i32([6, 3, 0, 0])  # 1 -> 6 and -1 -> 0: out of range; 3 -> 0 valid
    want = layer.clone()
    want[0] = layer[3]
    copy_blocks([layer], src[[0, 2, 3]].contiguous(), dst[[0, 2, 3]].contiguous(), check=False)
    assert torch.equal(big[4:], guard)
    assert torch.equal(layer, want)
    copy_blocks([layer], cpu_i32([2**31 - 1]), cpu_i32([1]), num_copies=cpu_i32([1]), check=False)
    assert torch.equal(big[4:], guard) and torch.equal(layer, want)

