"""Copy-on-write block copies: every pending ``src[i] -> dst[i]`` copy of every KV-cache layer in one launch.

``copy_blocks(kv_caches, src, dst, num_copies=None, check=True)``: each layer is a contiguous tensor
``[num_blocks, ...]`` (any trailing shape, any dtype); block ``dst[i]`` of every layer becomes a copy of
block ``src[i]`` of that layer, for ``i < n`` (``n = num_copies[0]`` when given, else ``len(src)``).

Addressing. The kernel gets ONE base pointer and a per-layer offset table ``layer_off: int64[L]`` in
elements of the base (``(layer.data_ptr() - base.data_ptr()) // unit``), and addresses
``base + layer_off[l] + block * block_units + inner``. Compiled, a CUDA pointer is a flat 64-bit address,
so this reaches every layer's separate allocation. The interpreter (``TRITON_INTERPRET=1``) also
dereferences raw host addresses, and for CPU tensors it hands the kernel the tensors' own storage (it
copies storage only for non-CPU tensors), so the same trick works on CPU: checked by
``tests/decode/test_copy_blocks.py`` with layers allocated separately. For the one case where it cannot work,
the interpreter on CUDA tensors (it copies just the base tensor to the host), the launcher falls back to
one launch per layer. A pointer table (``int64`` addresses cast with ``.to(tl.pointer_type(...))``) would
work as well; the offset table was kept because the base argument carries the element type and its
16-byte alignment into the compiler's specialisation.

Bitwise copy. The copy moves bits, not values: the caches are reinterpreted as integers of ``unit``
bytes, the widest of 8/4/2/1 that divides the block size in bytes and every layer's address. So fp32,
fp16, bf16, fp8 (and anything else) copy exactly (NaN payloads included), fp8 needs no float8 support
in the interpreter, and layers of different dtypes share a launch when their blocks have the same size
in bytes. Layers are grouped by bytes per block: ONE launch per group (usually one group: all layers
alike). ``VEC`` (constexpr) more units of alignment are proven to the compiler (offsets are stored in
multiples of ``VEC`` and multiplied back by the constant), so copies vectorise to 16-byte accesses
(PTX ``ld/st.global.v2.b64`` or ``.v4.b32``). The tile loop is a ``for`` over ``range``, not a
``while``: the compiler knows the alignment of a for loop's induction variable but not of a while
loop's carried value, and with ``while`` the same kernel compiled to scalar accesses.

CUDA graphs. With ``num_copies: int32[1]`` on the device the grid is sized by ``len(src)`` (the queue
capacity) and programs ``i >= num_copies[0]`` exit, so a captured graph replays with a changing count.
The offset table is a small device tensor built from the layers' addresses. A caller that captures
passes ``offset_tables``, a dict it keeps for as long as the graph may replay (the manager keeps one):
the table is built on the first call for a given set of layer addresses and reused after (a few
bytes per layer); make that first call (and any with ``check=True``, whose value checks sync with
the host) before capture, and capture with ``check=False``. Without it each call builds its table
(one host-to-device copy), so the module itself keeps nothing.
The launcher groups layers by bytes per block and splits a group past 65,535 layers (CUDA's grid limit).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpupool.errors import InvalidArgumentError

# Host-side settings of the launcher (no kernel reads them, so they are plain Python values).
OP = "copy_blocks"
BYTES_PER_PROGRAM = 8192  # bytes one program copies per loop step (its tile)
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z
_UNIT_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def copy_blocks_kernel(base, layer_off, src, dst, num_copies, num_pairs, block_units, num_blocks,
                       HAS_COUNT: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Copy block ``src[i]`` to block ``dst[i]`` of layer ``l`` (bitwise, in units of ``base``'s dtype).

    Grid ``(len(src), num_layers, nz)``: program ``(i, l, z)`` copies tiles ``z, z + nz, ...`` of
    ``BLOCK`` units of pair ``i`` in layer ``l``. Reads ``num_copies[0]`` (if ``HAS_COUNT``; else the
    count is ``num_pairs``), ``src[i]``, ``dst[i]``, ``layer_off[l]`` and block ``src[i]`` of layer ``l``
    (``block_units * VEC`` units at ``base + layer_off[l] * VEC + src[i] * block_units * VEC``); writes
    only block ``dst[i]`` of layer ``l``. Programs with ``i >= count`` do nothing, and so does a pair
    with an id outside ``0 .. num_blocks - 1`` (the launch group's fewest blocks): with ``check=False``
    (a captured step) a bad id is never a read or write outside the caches.

    Race-free: every program writes a range no other program writes (pairs have distinct ``dst``,
    layers occupy disjoint memory, tiles of one block are disjoint), and no program reads what another
    writes (no ``dst`` is any pair's ``src``). The launcher checks both (``check=True``).
    """
    i = tl.program_id(0)
    layer = tl.program_id(1)
    z = tl.program_id(2)
    nz = tl.num_programs(2)
    if HAS_COUNT:
        n = tl.load(num_copies)
    else:
        n = num_pairs
    if i < n:
        s = tl.load(src + i).to(tl.int64)
        d = tl.load(dst + i).to(tl.int64)
    else:
        s = tl.full([], -1, tl.int64)
        d = tl.full([], -1, tl.int64)
    if (s >= 0) & (s < num_blocks) & (d >= 0) & (d < num_blocks):
        lo = tl.load(layer_off + layer)
        limit = block_units * VEC  # units per block, a multiple of VEC the compiler can see
        src_start = (lo + s * block_units) * VEC
        dst_start = (lo + d * block_units) * VEC
        offs = tl.arange(0, BLOCK)
        for c in range(z * BLOCK, limit, nz * BLOCK):
            m = (c + offs) < limit
            x = tl.load(base + src_start + c + offs, mask=m)
            tl.store(base + dst_start + c + offs, x, mask=m)


def _fail(message: str, value: int | None = None, op: str = OP):
    raise InvalidArgumentError(op, message, value)


def check_layers(kv_caches, op: str = OP) -> torch.device | None:
    """The checks of ``copy_blocks`` on the caches alone (no device read): a list of contiguous
    tensors ``[num_blocks, ...]`` on one device, in disjoint memory. Returns that device (None: empty
    list); raises InvalidArgumentError naming ``op``."""
    if not isinstance(kv_caches, (list, tuple)):
        _fail(f"kv_caches must be a list of tensors, got {type(kv_caches).__name__}", None, op)
    device = None
    spans = []
    for j, t in enumerate(kv_caches):
        if not isinstance(t, torch.Tensor):
            _fail(f"kv_caches[{j}] is a {type(t).__name__}, not a tensor", j, op)
        if t.dim() < 1:
            _fail(f"kv_caches[{j}] must be shaped [num_blocks, ...], got a 0-d tensor", j, op)
        if not t.is_contiguous():
            _fail(f"kv_caches[{j}] must be contiguous", j, op)
        if device is None:
            device = t.device
        elif t.device != device:
            _fail(f"kv_caches[{j}] is on {t.device}, kv_caches[0] on {device}", j, op)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            spans.append((t.data_ptr(), t.data_ptr() + nbytes, j))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            _fail(f"kv_caches[{a}] and kv_caches[{b}] share memory", b, op)
    return device


def _check_ids(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != 1:
        _fail(f"{name} must be a 1-d int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, the caches on {device}")


def _check_values(kv_caches, src, dst, num_copies) -> None:
    """The checks that read device values (host syncs)."""
    n = len(src)
    if num_copies is not None:
        n = int(num_copies.item())
        if not 0 <= n <= len(src):
            _fail(f"num_copies[0] = {n} is outside 0 .. len(src) = {len(src)}", n)
    if n == 0:
        return
    s = src[:n].tolist()
    d = dst[:n].tolist()
    num_blocks = min(t.shape[0] for t in kv_caches)
    for ids in (s, d):
        for b in ids:
            if not 0 <= b < num_blocks:
                _fail(f"block id {b} is outside 0 .. {num_blocks - 1}", b)
    seen = set()
    for b in d:
        if b in seen:
            _fail(f"block {b} is the destination of two copies", b)
        seen.add(b)
    for b in s:
        if b in seen:
            _fail(f"block {b} is both a copy's source and a copy's destination", b)


def _offset_table(layers, unit: int, vec: int, device, offset_tables: dict | None) -> torch.Tensor:
    key = (str(device), unit, vec, tuple(t.data_ptr() for t in layers))
    off = None if offset_tables is None else offset_tables.get(key)
    if off is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _fail("the layers' offset table is not built: pass offset_tables (a dict kept while the graph "
                  "lives) to an eager call with these caches first, and the same dict when capturing")
        base = layers[0].data_ptr()
        off = torch.tensor([(t.data_ptr() - base) // (unit * vec) for t in layers], dtype=torch.int64,
                           device=device)
        if offset_tables is not None:
            offset_tables[key] = off
    return off


def _launch(layers, block_bytes: int, src, dst, num_copies, device, offset_tables: dict | None) -> None:
    align = 16
    for v in [block_bytes] + [t.data_ptr() for t in layers]:
        while v % align:
            align //= 2
    unit = min(align, 8)
    vec = align // unit
    units = block_bytes // unit
    block = min(triton.next_power_of_2(units), max(BYTES_PER_PROGRAM // unit, vec))
    nz = min(triton.cdiv(units, block), MAX_GRID_YZ)
    warps = max(1, min(4, block * unit // 512))
    base = layers[0].view(-1).view(torch.uint8).view(_UNIT_DTYPE[unit])
    off = _offset_table(layers, unit, vec, device, offset_tables)
    count = num_copies if num_copies is not None else src
    copy_blocks_kernel[(len(src), len(layers), nz)](
        base, off, src, dst, count, len(src), units // vec, min(t.shape[0] for t in layers),
        HAS_COUNT=num_copies is not None, VEC=vec, BLOCK=block, num_warps=warps)


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor,
                num_copies: torch.Tensor | None = None, check: bool = True, offset_tables: dict | None = None) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer of ``kv_caches``, for ``i < n``, in place.

    ``kv_caches``: contiguous tensors ``[num_blocks, ...]`` on one device, in disjoint memory; any
    trailing shape and dtype (the copy is bitwise). ``src``, ``dst``: ``int32[P]`` on the caches'
    device. ``num_copies``: optional ``int32[1]`` on the device; ``n = num_copies[0]`` (``0 <= n <= P``;
    entries from ``n`` on are ignored, unchecked), else ``n = P``. Layers with the same bytes per block
    are copied by one launch (all layers, when alike); one launch per distinct block size otherwise.

    Raises :class:`gpupool.errors.InvalidArgumentError` for a non-contiguous cache, caches or ids on
    different devices, overlapping caches, ids that are not 1-d int32 of equal length, and (``check=True``
    only, as these read device values: a host sync) a count outside ``0 .. P``, an id outside
    ``0 .. num_blocks - 1``, two copies to one block, or a block that is both a source and a destination.
    ``offset_tables``: a dict the caller keeps, where the per-layer offset tables are built once per
    set of layer addresses and reused (module docstring); None builds one for this call alone.
    Use ``check=False`` inside CUDA graph capture, after one eager call with the same caches and the
    same ``offset_tables`` (a table not built yet during capture is an InvalidArgumentError).
    """
    device = check_layers(kv_caches)
    _check_ids("src", src, device)
    _check_ids("dst", dst, device)
    if len(src) != len(dst):
        _fail(f"src has {len(src)} ids, dst {len(dst)}", len(dst))
    if num_copies is not None:
        if not isinstance(num_copies, torch.Tensor) or num_copies.dtype != torch.int32 or num_copies.numel() != 1:
            _fail("num_copies must be an int32 tensor of one element")
        if device is not None and num_copies.device != device:
            _fail(f"num_copies is on {num_copies.device}, the caches on {device}")
        num_copies = num_copies.reshape(1)
    if device is None or len(src) == 0:
        return
    if check:
        _check_values(kv_caches, src, dst, num_copies)
    if not src.is_contiguous():
        src = src.contiguous()
    if not dst.is_contiguous():
        dst = dst.contiguous()
    groups: dict[int, list[torch.Tensor]] = {}
    for t in kv_caches:
        block_bytes = math.prod(t.shape[1:]) * t.element_size()
        if t.numel() and block_bytes:
            groups.setdefault(block_bytes, []).append(t)
    # The interpreter copies non-CPU tensors to the host one argument at a time, so a layer it was
    # not given is out of its reach: one launch per layer there.
    per_layer = device.type != "cpu" and not isinstance(copy_blocks_kernel, triton.runtime.JITFunction)
    for block_bytes, layers in groups.items():
        if per_layer:
            for t in layers:
                _launch([t], block_bytes, src, dst, num_copies, device, offset_tables)
            continue
        for start in range(0, len(layers), MAX_GRID_YZ):
            _launch(layers[start:start + MAX_GRID_YZ], block_bytes, src, dst, num_copies, device, offset_tables)
