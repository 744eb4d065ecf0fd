"""What the benchmark suite runs, and the pools it runs on (``python -m pytest bench``).

Not part of the test run (CI runs ``pytest tests``); ``gpupool bench`` runs this suite and plots it.

Pools (``kind``), measured side by side in one run, one pytest-benchmark group per op and size:

* ``reference``: ``gpupool.ReferenceBlockPool`` (docs/semantics.md as plain Python, the vLLM-style host pool);
* ``vllm``: vLLM's own ``vllm.v1.core.block_pool.BlockPool``, when ``import vllm`` works;
* ``device-eager``: ``gpupool.BlockPool``'s batched ops (``allocate_batched``, ``free_batched``,
  ``touch_batched``, ``lookup_batched``), launched one by one;
* ``device-graph``: the same launches captured once in a ``torch.cuda.CUDAGraph`` and replayed (CUDA only);
* ``device-single``: the vLLM-named single ops (``get_new_blocks``, ``free_blocks``, ``touch``), each of
  which waits for the device (docs/semantics.md section 3), for the ops that have one.

Grids come from the environment:

* ``GPUPOOL_BENCH_GRID``: ``full`` (default with CUDA) or ``quick`` (default without). ``full``: batch
  1 .. 4,096 and pools of 4,096, 65,536 and 1,048,576 blocks for every pool (plus 10,000 lookups,
  the docs/design.md target). ``quick``: the same for the host pools, without the 10,000 lookups; the
  device pool on batch 1 and 64, pool 4,096 only: without CUDA its kernels run in Triton's
  interpreter (milliseconds per launch), so those numbers say nothing about GPU speed.
* ``GPUPOOL_BENCH_MAX_TIME``: seconds per case (pytest-benchmark's ``max_time``; default 0.1).
* ``GPUPOOL_BENCH_REPLAY_LIMIT``: requests of the bundled trace that the device pool replays
  (default: all with CUDA, 50 without; the reference pool always replays the whole trace).

Every case leaves its pool with no block held, so one pool per (kind, size) serves the whole session.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before gpupool defines its kernels

BLOCK_SIZE = 16  # tokens per block in the synthetic ops (vLLM's default)
DECODE_CROSS_EVERY = 16  # a decode step: one running request in 16 crosses a block boundary

GRID = os.environ.get("GPUPOOL_BENCH_GRID") or ("full" if CUDA else "quick")
if GRID not in ("full", "quick"):
    raise pytest.UsageError(f"GPUPOOL_BENCH_GRID must be 'full' or 'quick', got {GRID!r}")
MAX_TIME = float(os.environ.get("GPUPOOL_BENCH_MAX_TIME", "0.1"))
_limit = os.environ.get("GPUPOOL_BENCH_REPLAY_LIMIT")
REPLAY_LIMIT = (int(_limit) or None) if _limit else (None if CUDA else 50)

FULL_BATCHES = (1, 16, 64, 256, 1024, 4096)
FULL_SIZES = (4096, 65536, 1 << 20)
LOOKUP_EXTRA = (10_000,)  # docs/design.md: 10,000 prefix lookups

HOST_KINDS = ("reference", "vllm")
DEVICE_KINDS = ("device-eager", "device-graph", "device-single")
KINDS = HOST_KINDS + DEVICE_KINDS
# ops each kind implements (device-single: the vLLM-named single ops that exist)
OPS = ("alloc_free", "touch", "lookup", "decode_step")
KIND_OPS = {
    "reference": OPS,
    "vllm": OPS,
    "device-eager": OPS,
    "device-graph": OPS,
    "device-single": ("alloc_free", "touch"),
}


def device_name() -> str:
    """Where the device pool's kernels run in this session."""
    if CUDA:
        return "cuda:" + torch.cuda.get_device_name(0)
    return "cpu (Triton interpreter)"


_VLLM: list = []


def vllm_block_pool():
    """vLLM's ``BlockPool`` class, or None when ``import vllm`` fails (cached)."""
    if not _VLLM:
        try:
            import vllm  # noqa: F401
            from vllm.v1.core.block_pool import BlockPool
        except Exception:  # noqa: BLE001 - any failure to import means "not available"
            BlockPool = None
        _VLLM.append(BlockPool)
    return _VLLM[0]


def blocks_needed(op: str, batch: int, num_blocks: int) -> int:
    """Blocks a case holds at once (it must fit in ``num_blocks - 1``)."""
    if op in ("alloc_free", "touch"):
        return batch
    if op == "lookup":
        return min(batch, (num_blocks - 1) // 2)
    if op == "decode_step":
        return batch + 2 * math.ceil(batch / DECODE_CROSS_EVERY) + 1
    raise ValueError(op)


def grid(kind: str, op: str) -> list[tuple[int, int]]:
    """(num_blocks, batch) cases of ``op`` for ``kind`` under the current grid."""
    if kind in DEVICE_KINDS and GRID == "quick":
        sizes, batches = (4096,), (1, 64)
    elif GRID == "quick":
        sizes, batches = FULL_SIZES, FULL_BATCHES
    else:
        sizes, batches = FULL_SIZES, FULL_BATCHES + (LOOKUP_EXTRA if op == "lookup" else ())
    return [(n, b) for n in sizes for b in batches if blocks_needed(op, b, n) <= n - 1]


def _kind_marks(kind: str) -> list:
    marks = []
    if kind == "device-graph":
        marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))
    if kind == "vllm":
        marks.append(pytest.mark.skipif(vllm_block_pool() is None, reason="vllm is not installed (import vllm fails)"))
    if kind in DEVICE_KINDS and not CUDA:  # the interpreter: few, slow rounds
        marks.append(pytest.mark.benchmark(max_time=MAX_TIME, min_rounds=3))
    else:
        marks.append(pytest.mark.benchmark(max_time=MAX_TIME, min_rounds=5))
    return marks


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_op: a pool-op benchmark, parametrized over ops, kinds and the grid")


def pytest_report_header(config):
    return (f"gpupool bench: grid {GRID}, device pool on {device_name()}, max_time {MAX_TIME:g} s, "
            f"device replay limit {REPLAY_LIMIT or 'none (whole trace)'}, "
            f"vllm {'available' if vllm_block_pool() is not None else 'not installed'}")


def pytest_generate_tests(metafunc):
    """Parametrize ``op, kind, num_blocks, batch`` of the ``@pytest.mark.bench_op`` test."""
    if metafunc.definition.get_closest_marker("bench_op") is None:
        return
    params = []
    for op in OPS:
        for kind in KINDS:
            if op not in KIND_OPS[kind]:
                continue
            for n, b in grid(kind, op):
                params.append(pytest.param(op, kind, n, b, id=f"{op}-{kind}-N{n}-B{b}", marks=_kind_marks(kind)))
    metafunc.parametrize(("op", "kind", "num_blocks", "batch"), params)


class PoolCache:
    """One pool per (pool family, size) for the whole session (device kinds share one BlockPool)."""

    def __init__(self):
        self._pools: dict[tuple[str, int], object] = {}

    def get(self, kind: str, num_blocks: int):
        family = "device" if kind in DEVICE_KINDS else kind
        key = (family, num_blocks)
        if key not in self._pools:
            self._pools[key] = make_pool(family, num_blocks)
        return self._pools[key]


def make_pool(family: str, num_blocks: int):
    """A fresh pool of ``num_blocks`` blocks: ``reference``, ``vllm`` or ``device``."""
    if family == "reference":
        from gpupool import ReferenceBlockPool

        return ReferenceBlockPool(num_blocks)
    if family == "device":
        from gpupool import BlockPool

        return BlockPool(num_blocks, device="cuda" if CUDA else "cpu")
    if family == "vllm":
        import inspect

        cls = vllm_block_pool()
        params = inspect.signature(cls.__init__).parameters
        kw = {"num_gpu_blocks": num_blocks, "enable_caching": True}
        if "hash_block_size" in params:
            kw["hash_block_size"] = BLOCK_SIZE
        if "enable_kv_cache_events" in params:
            kw["enable_kv_cache_events"] = False
        try:
            return cls(**kw)
        except TypeError as e:
            pytest.skip(f"this vllm's BlockPool constructor is not supported by the benchmark: {e}")
    raise ValueError(family)


@pytest.fixture(scope="session")
def pools() -> PoolCache:
    return PoolCache()
