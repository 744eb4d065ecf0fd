"""Compile every kernel the pools launch, ahead of time, for a CUDA target, without a GPU.

Run as a script with TRITON_INTERPRET=0 (``@triton.jit`` must give compiler objects): it drives a
pool on CPU tensors with kernel launches intercepted and recorded (nothing runs), then compiles
each distinct (kernel, signature, constexprs) with ``triton.compile`` for ``GPUTarget("cuda", CC, 32)``.
Prints one line per compiled kernel and exits non-zero on the first failure.
"""
import hashlib
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import gpupool._backend as backend  # noqa: E402

backend.interpreted = lambda: True  # let a CPU pool be built; its launches are only recorded
import gpupool  # noqa: E402
from gpupool.keys import device_key  # noqa: E402

RECORDS = []
_DT = {torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.float64: "*fp64", torch.float16: "*fp16",
       torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.bool: "*i1"}


def _record(self, grid):
    def launch(*args, **kwargs):
        RECORDS.append((self, args, kwargs))
    return launch


JITFunction.__getitem__ = _record


def drive_pool(num_blocks=64, **kw):  # noqa: C901
    """Call every op of the pool once, so each launch is recorded."""
    p = gpupool.BlockPool(num_blocks, device="cpu", **kw)
    h = [hashlib.sha256(str(i).encode()).digest() for i in range(4)]
    p.get_new_blocks(3)
    p.free_blocks([1, 2])
    p.touch([1])
    p.unpin_blocks([3], lambda b: None)
    p.cache_full_blocks([1, 2], h, 0, 2, 16, 0)
    p.cache_partial_block(1, h, 16, 0, 32, 16)
    p.move_block_hashes(1, 2)
    p.evict_blocks([1])
    p.reset_prefix_cache()
    p.get_cached_block(h[0], [0])
    i32 = torch.int32
    p.allocate_batched(torch.tensor([1, 2], dtype=i32))
    p.free_batched(torch.tensor([1, 2], dtype=i32), torch.tensor([0, 1, 2], dtype=i32))
    p.touch_batched(torch.tensor([1], dtype=i32))
    if num_blocks >= 4096:  # batches of 4,096 ids take wide tiles (kernels/common.py batch_config)
        wide = torch.ones(4096, dtype=i32)
        p.touch_batched(wide)
        p.free_batched(wide, torch.tensor([0, 4096], dtype=i32))
    k = device_key(h[0], 0)
    kh = torch.tensor([[[k[0]]]], dtype=torch.int64)
    p.longest_prefix_batched(kh, kh.clone(), torch.tensor([0], dtype=i32), torch.tensor([1], dtype=i32))
    from gpupool.replay import TraceRequest
    from gpupool.replay.device import replay_on_device
    q = p if not kw.get("enable_kv_cache_events") else gpupool.BlockPool(num_blocks, device="cpu")
    try:  # nothing runs here, so the loop never reports progress and stops; its launch is recorded
        replay_on_device(q, [TraceRequest(0.0, 40, 4, (1, 2, 3))], block_size=16)
    except RuntimeError:
        pass
    p.validate()
    drive_manager(**kw)
    for hook in EXTRA_DRIVERS:
        hook(p)


EXTRA_DRIVERS = []


def drive_manager(**kw):
    """The manager's batched kernels, with a full and a sliding-window group and with a full group
    only (``ManagerConfig.SW`` leaves the windows' passes out)."""
    for groups in (("full", ("sliding_window", 32)), ("full",)):
        drive_manager_groups(groups, **kw)


def drive_manager_groups(groups, **kw):
    from gpupool.manager import KVCacheManager

    m = KVCacheManager(64, block_size=16, max_num_reqs=4, max_blocks_per_req=8, groups=groups, device="cpu", **kw)
    i32 = torch.int32
    s = torch.tensor([0, 1], dtype=i32)
    m.add_request(0, [hashlib.sha256(b"x").digest()])
    m.add_request(1)
    m.allocate_slots(s, torch.tensor([20, 30], dtype=i32), torch.tensor([20, 30], dtype=i32), [1, 0])
    m.slot_mapping(s, torch.tensor([3, 4], dtype=i32))
    m.reserve(s, torch.tensor([4, 8], dtype=i32))  # reservations (kernels/reserve.py)
    m.release_reservation(s[:1])
    m.reserve(s, torch.tensor([4, 8], dtype=i32), num_reqs=torch.tensor([1], dtype=i32))  # a device count
    m.release_reservation(s, num_reqs=torch.tensor([2], dtype=i32))
    from gpupool.graph import DecodeStep

    DecodeStep(m, 2).run()  # the step's variants: free with its input check, allocate without
    DecodeStep(m, 2, steps=3).run()  # a burst: decode_burst_kernel after step 0 and after a burst step
    m.free(s)
    m.run_pending_copies([])


def drive_copy_blocks(pool):
    """``copy_blocks`` once per cache dtype (bitwise copy: 64 B blocks in int64 units with a device count,
    36 B blocks in int32 units, 256 B blocks in int64 units); launches are recorded, not run."""
    from gpupool.kernels.copy_blocks import copy_blocks
    i32 = torch.int32
    src, dst = torch.tensor([0, 1], dtype=i32), torch.tensor([2, 3], dtype=i32)
    for dtype, shape, count in ((torch.float32, (4, 2, 8), torch.tensor([1], dtype=i32)),
                                (torch.float16, (4, 3, 6), None), (torch.bfloat16, (4, 16, 8), None)):
        copy_blocks([torch.zeros(shape, dtype=dtype) for _ in range(2)], src, dst, count, check=False)


EXTRA_DRIVERS.append(drive_copy_blocks)


def signature_of(fn, args, kwargs):
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts = {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if fn.params[i].is_constexpr or v is None:  # None (an absent optional pointer) is a constexpr
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple of tensors: one argument
            sig[name] = type(v)(*[_DT[t.dtype] for t in v])
        elif isinstance(v, torch.Tensor):
            sig[name] = _DT[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    return sig, consts


def main(ccs):
    for kw in ({}, {"enable_kv_cache_events": True}, {"enable_caching": False}, {"num_blocks": 16384}):
        drive_pool(**kw)
    seen = set()
    failures = 0
    for fn, args, kwargs in RECORDS:
        sig, consts = signature_of(fn, args, kwargs)
        warps = kwargs.get("num_warps", 4)
        key = (fn.__name__, repr(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in consts.items())), warps)
        if key in seen:
            continue
        seen.add(key)
        for cc in ccs:
            try:
                out = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", cc, 32),
                                     options={"num_warps": warps})
                ok = "cubin" in out.asm
            except Exception as e:  # report and go on, so one run lists every failure
                ok = False
                root = e
                while root.__cause__ is not None:  # the innermost jit function's error says what is wrong
                    root = root.__cause__
                print(f"FAIL sm_{cc} {fn.__name__}: {type(e).__name__}: {str(e)[:600]} | innermost: "
                      f"{type(root).__name__}: {str(root)[-1500:]}", flush=True)
            failures += not ok
            if ok:
                print(f"ok   sm_{cc} {fn.__name__} {consts}", flush=True)
    print(f"compiled {len(seen)} kernel variants; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main([int(x) for x in (sys.argv[1:] or ["90", "80"])]))
