"""Compile every kernel the pools launch, ahead of time, for a CUDA target, without a GPU.

Run as a script with TRITON_INTERPRET=0 (``@triton.jit`` must give compiler objects): it drives a
pool on CPU tensors with kernel launches intercepted and recorded (nothing runs), then compiles
each distinct (kernel, signature, constexprs) with ``triton.compile`` for ``GPUTarget("cuda", CC, 32)``.
Prints one line per compiled kernel and exits non-zero on a failure, or when a kernel of
``gpupool.kernels`` (a ``@triton.jit`` function named ``*_kernel``: the launch targets) was never
launched by the drivers below, so a new kernel cannot go uncompiled. ``--record-only`` stops after
that check (seconds: nothing is compiled). ``--only=NAME,...`` compiles those kernels alone. ``--cover`` compiles a cover instead of every variant:
variants that together bring each kernel every signature and every value of each boolean constexpr
(a flag such as ``pc.EVENTS`` or ``FORCE_EXACT``) that its variants have. CI compiles the cover for
both targets (tests/kernels/test_aot_compile.py; ``GPUPOOL_AOT_FULL=1`` for every variant): the full set
took about 10 minutes of CPU for the two, over half of CI's budget.
"""
import hashlib
import os
import resource
import sys
import time

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
    if not kw.get("enable_kv_cache_events"):
        p.cache_blocks_batched(torch.tensor([1, 2], dtype=i32), [(h, 0, 2, 16, 0)])
        p.apply_batched(free_ids=torch.tensor([1], dtype=i32), free_offsets=torch.tensor([0, 1], dtype=i32),
                        touch_ids=torch.tensor([2], dtype=i32), demands=[1, 1],
                        cache_ids=torch.tensor([num_blocks, num_blocks + 1], dtype=i32), cache_calls=[(h, 0, 2, 16, 0)])
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
    """The manager's batched kernels, with a full and a sliding-window group, with a full and a
    chunked-local group (``ManagerConfig.CHUNKED``: the windowed hit's passes) and with a full group
    only (``ManagerConfig.SW`` leaves the windows' passes out)."""
    for groups in (("full", ("sliding_window", 32)), ("full", ("chunked_local_attention", 32)), ("full",)):
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
    m.reserve(s, torch.tensor([4, 8], dtype=i32))  # reservations (kernels/requests/reserve.py)
    m.release_reservation(s[:1])
    m.reserve(s, torch.tensor([4, 8], dtype=i32), num_reqs=torch.tensor([1], dtype=i32))  # a device count
    m.release_reservation(s, num_reqs=torch.tensor([2], dtype=i32))
    from gpupool.graph import DecodeStep
    from gpupool.window import DecodeWindow

    DecodeStep(m, 2).run()  # window_begin_kernel, window_step_kernel allocating (no advance), tokens unknown
    DecodeStep(m, 2, steps=3, views=True).run()  # a burst: steps >= 1 advance then allocate; each step's views
    w = DecodeWindow(m, 2, steps=2, num_lookahead_tokens=1)  # the model's window: tokens hashed, Q = 2
    w.run()  # its steps, and its end (window_step_kernel advancing alone)
    ws = torch.tensor([2, 3], dtype=i32)
    m.admit(ws, [[], []], [4, 4], [[1], None])  # admit_kernel without a blocked flag, one request hashing
    m.admit(ws, [[], []], [4, 4], blocked=w.flags[:1])  # and with the window's flag
    m.append_tokens(s, torch.tensor([1, 0], dtype=i32), torch.zeros((2, 1), dtype=torch.int64))
    m.attention_views(s, torch.tensor([20, 30], dtype=i32))  # one step, no admitted flags
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


def drive_store_kv(pool):
    """``store_kv`` (the paged KV store) per cache dtype, with and without a device count."""
    from gpupool.kv_cache import store_kv
    slots = torch.tensor([3, -1], dtype=torch.int64)
    for dtype, count in ((torch.float16, None), (torch.bfloat16, torch.tensor([1], dtype=torch.int32)),
                         (torch.float32, None)):
        cache = [torch.zeros(4, 16, 2, 64, dtype=dtype) for _ in range(2)]
        store_kv(torch.zeros(2, 2, 64, dtype=dtype), torch.zeros(2, 2, 64, dtype=dtype), *cache, slots, count)


EXTRA_DRIVERS.append(drive_store_kv)


def drive_block_hashes(pool):
    """``block_hashes_kernel`` (block hashes and device keys on the device, kernels/block_hash.py) as it
    runs compiled: 32 lanes a program, 16 tokens a block."""
    from gpupool.kernels.block_hash import launch_block_hashes
    i32 = torch.int32
    launch_block_hashes(torch.zeros(2, 8, dtype=i32), torch.zeros(2, 16, dtype=i32), torch.zeros(2, 8, dtype=i32),
                        torch.tensor([0, 1], dtype=i32), lanes=32)


EXTRA_DRIVERS.append(drive_block_hashes)


def drive_device_keys(pool):
    """``device_keys_kernel`` (``apply_predicted``'s cachings keyed on the device, kernels/device_keys.py)."""
    from gpupool.kernels.device_keys import launch_device_keys
    from gpupool.kernels.sha256 import round_constant_table
    i64 = torch.int64
    launch_device_keys(torch.zeros(16, dtype=torch.int32), torch.zeros(2, dtype=i64), torch.zeros(2, dtype=i64),
                       torch.zeros(2, dtype=i64), round_constant_table())


EXTRA_DRIVERS.append(drive_device_keys)


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


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas), so the figure holds on a busy machine."""
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime


def all_kernels() -> set[str]:
    """The launch targets: every ``@triton.jit`` function named ``*_kernel`` defined in ``gpupool.kernels`` and its subpackages."""
    import importlib
    import pkgutil

    import gpupool.kernels as package

    names = set()
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        mod = importlib.import_module(info.name)
        names |= {n for n, v in vars(mod).items()
                  if isinstance(v, JITFunction) and v.__module__ == mod.__name__ and n.endswith("_kernel")}
    return names


def flags_of(name, sig, consts) -> set:
    """What a variant brings to a cover: its signature, and the value of each boolean (or absent,
    None) constexpr, NamedTuple config fields included."""
    out = {(name, "signature", repr(sorted(sig.items())))}
    for k, v in consts.items():
        fields = zip(v._fields, v) if isinstance(v, tuple) and hasattr(v, "_fields") else [(None, v)]
        out |= {(name, k if f is None else f"{k}.{f}", x) for f, x in fields if x is None or isinstance(x, bool)}
    return out


def greedy_cover(variants):
    """A few variants that together bring everything the variants bring (:func:`flags_of`): the
    greedy set cover, each pick the one bringing the most not yet covered, ties in launch order."""
    brings = [flags_of(fn.__name__, sig, consts) for fn, sig, consts, _ in variants]
    left = set().union(*brings)
    picked = []
    while left:
        best = max(range(len(variants)), key=lambda i: len(brings[i] & left))
        picked.append(best)
        left -= brings[best]
    return [variants[i] for i in sorted(picked)]


def main(ccs, record_only=False, cover=False, only=None):
    for kw in ({}, {"enable_kv_cache_events": True}, {"enable_caching": False}, {"num_blocks": 16384}):
        drive_pool(**kw)
    launched = {fn.__name__ for fn, _, _ in RECORDS}
    missing = sorted(all_kernels() - launched)
    print(f"kernels launched by the drivers: {' '.join(sorted(launched))}")
    if missing:
        print(f"FAIL never launched, so never compiled (add a call to a driver above): {' '.join(missing)}")
        return 1
    if record_only:
        return 0
    variants = {}  # distinct (kernel, signature, constexprs, warps), in launch order
    for fn, args, kwargs in RECORDS:
        sig, consts = signature_of(fn, args, kwargs)
        warps = kwargs.get("num_warps", 4)
        key = (fn.__name__, repr(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in consts.items())), warps)
        variants.setdefault(key, (fn, sig, consts, warps))
    todo = [v for v in variants.values() if only is None or v[0].__name__ in only]
    if cover:
        todo = greedy_cover(todo)
    failures = 0
    for fn, sig, consts, warps in todo:
        for cc in ccs:
            t0 = cpu_seconds()
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
                print(f"ok   sm_{cc} {fn.__name__} {consts} {cpu_seconds() - t0:.1f} s CPU", flush=True)
    print(f"compiled {len(todo)} of {len(variants)} kernel variants{' (a cover)' if cover else ''}; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    only = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")]
    sys.exit(main([int(x) for x in (args or ["90", "80"])], record_only="--record-only" in sys.argv,
                  cover="--cover" in sys.argv, only=only[0] if only else None))
