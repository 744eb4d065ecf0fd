"""pytest plugin that runs vLLM 0.33's own tests with vLLM's released source on ``sys.path``
(tests/vllm_plugin/test_vllm_conformance.py starts pytest with ``-p plugin``; docs/vllm.md, "Conformance").

Environment: ``GPUPOOL_VLLM_SRC`` is the unpacked sdist (``vllm-0.33.0/``, holding ``vllm/`` and
``tests/``). Imported without pytest (tests/vllm_plugin/conformance/driver.py) the plugin only sets up the
path and the stubs; vLLM's ``BlockPool`` stays in place.

Under pytest (``-p plugin``) every collected test runs once per *mode*, one after the other in the same
process (vLLM is imported once), and its outcome per mode goes to the JSON file ``GPUPOOL_VLLM_RESULTS``:

* ``GPUPOOL_VLLM_MODES``: comma-separated modes for every test, default ``stock,reference``;
* ``GPUPOOL_VLLM_DEVICE_FILES``: comma-separated test-file paths whose tests also run in mode ``device``.

``stock`` is vLLM's own ``BlockPool`` (the baseline); ``reference`` / ``device`` put
``gpupool.vllm.BlockPool`` with that ``backend`` in every loaded module whose ``BlockPool`` name is
vLLM's class (or gpupool's, from the previous mode), set again before each run; ``deferred`` puts
``gpupool.vllm.fast_path.DeferredBlockPool`` (the scheduler's fast path) over the reference backend. Function-scoped
fixtures are set up and torn down for each mode (vLLM's files here have no wider-scoped ones). The
results file also holds, per mode, how many gpupool pools were built, so a swap that did not take
shows as 0.

Stubbed, because they are not installed here and none is used by the code these tests exercise:
the third-party packages in ``STUBBED`` are served by an import hook as empty modules whose every
attribute is a placeholder class (subscriptable, usable in ``X | None`` and as a pydantic field type).
vLLM's own code and tests are run unchanged; torch is the installed one.
"""
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
import types

_T0 = time.perf_counter()

STUBBED = ("psutil", "cbor2", "transformers", "huggingface_hub", "safetensors", "aiohttp", "openai_harmony",
           "openai", "pybase64", "cachetools", "uvloop", "prometheus_client", "xgrammar", "fastapi",
           "partial_json_parser", "llguidance", "einops")


class _StubMeta(type):
    def __getattr__(cls, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _stub_class(n)

    def __getitem__(cls, i):
        return cls

    def __or__(cls, o):
        return cls

    def __ror__(cls, o):
        return cls


def _stub_class(n):
    def __getattr__(self, a):
        if a.startswith("__"):
            raise AttributeError(a)
        return _stub_class(a)

    def schema(cls, source, handler):
        from pydantic_core import core_schema
        return core_schema.any_schema()

    return _StubMeta(n, (), {"__init__": lambda s, *a, **k: None, "__getattr__": __getattr__,
                             "__get_pydantic_core_schema__": classmethod(schema)})


class _StubModule(types.ModuleType):
    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        v = importlib.import_module(self.__name__ + "." + n) if n[:1].islower() else _stub_class(n)
        setattr(self, n, v)
        return v


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, tops):
        self.tops = set(tops)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


_missing = []
for _top in STUBBED:
    try:
        importlib.import_module(_top)
    except ImportError:
        _missing.append(_top)
sys.meta_path.insert(0, _Finder(_missing))
sys.path.insert(0, os.environ["GPUPOOL_VLLM_SRC"])
import vllm.v1.core.block_pool as _vbp  # noqa: E402

_IMPORT_S = time.perf_counter() - _T0  # the stubs and vLLM's block pool module (most of vLLM's import)

_STOCK = _vbp.BlockPool
_BUILT: dict[str, int] = {}  # mode -> gpupool pools built (reported, so the caller can tell the swap took)
_RESULTS: dict[str, dict[str, str]] = {}  # mode -> test id -> outcome
_DETAILS: dict[str, dict[str, str]] = {}  # mode -> test id -> the tail of its failure text
_SECONDS: dict[str, float] = {}  # mode -> seconds spent running tests in it
_GP: dict = {}  # mode -> the swapped-in class, built on first use
_MODE = ["stock"]


def _gp_class(mode: str):
    """``reference`` / ``device``: ``gpupool.vllm.BlockPool`` over that backend; ``deferred``:
    ``gpupool.vllm.fast_path.DeferredBlockPool`` (the scheduler's fast path) over the reference backend."""
    if mode not in _GP:
        from gpupool.vllm import BlockPool
        from gpupool.vllm.fast_path import DeferredBlockPool
        base = DeferredBlockPool if mode == "deferred" else BlockPool
        backend = "reference" if mode == "deferred" else mode

        def __init__(self, *a, **k):
            k.setdefault("backend", backend)
            base.__init__(self, *a, **k)
            _BUILT[_MODE[0]] = _BUILT.get(_MODE[0], 0) + 1
            if type(getattr(getattr(self, "_engine", None), "events", None)).__name__ == "HostEvents":
                # the fast path with KV events made on the host
                _BUILT[_MODE[0] + "+host_events"] = _BUILT.get(_MODE[0] + "+host_events", 0) + 1

        _GP[mode] = type("BlockPool", (base,), {"__init__": __init__, "__module__": base.__module__})
    return _GP[mode]


_HOLDERS: dict[str, types.ModuleType] = {}  # modules whose BlockPool name is vLLM's (or ours)
_SCANNED: set[str] = set()  # module names already looked at (each loaded module is looked at once)


def _set_mode(mode: str) -> list[str]:
    """Point every loaded module's ``BlockPool`` name that is vLLM's (or gpupool's) class at the class
    of ``mode``; returns the module names. Modules loaded since the last call are looked at first."""
    target = _STOCK if mode == "stock" else _gp_class(mode)
    _MODE[0] = mode
    ours = set(_GP.values())
    if len(_SCANNED) != len(sys.modules):
        for name, mod in list(sys.modules.items()):
            if name in _SCANNED:
                continue
            _SCANNED.add(name)
            if mod is None or name.startswith("gpupool") or not isinstance(mod, types.ModuleType):
                continue
            try:
                cur = mod.__dict__.get("BlockPool")
            except Exception:  # noqa: BLE001 - a module without a plain __dict__
                continue
            if cur is not None and (cur is _STOCK or cur in ours):
                _HOLDERS[name] = mod
    for mod in _HOLDERS.values():
        mod.BlockPool = target
    return list(_HOLDERS)


def _modes(item) -> list[str]:
    modes = [m for m in os.environ.get("GPUPOOL_VLLM_MODES", "stock,reference").split(",") if m]
    device_files = [f for f in os.environ.get("GPUPOOL_VLLM_DEVICE_FILES", "").split(",") if f]
    if item.nodeid.split("::")[0] in device_files and "device" not in modes:
        modes.append("device")
    return modes


def _outcome(reports) -> str:
    """One word per run, as JUnit counts it: a failing setup or teardown is an error, a failing call a
    failure, a skip (or an expected failure) skipped."""
    by = {r.when: r for r in reports}
    if by["setup"].failed:
        return "error"
    if by["setup"].skipped:
        return "skipped"
    call = by.get("call")
    if call is not None and call.failed:
        return "failed"
    if "teardown" in by and by["teardown"].failed:
        return "error"
    if call is not None and call.skipped:
        return "skipped"
    return "passed"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpupool_pool: which BlockPool ran")


def pytest_collection_finish(session):
    swapped = _set_mode("stock")
    print(f"\ngpupool conformance: BlockPool toggled in {len(swapped)} modules: {', '.join(sorted(swapped))}")


def pytest_runtest_protocol(item, nextitem):
    """Run ``item`` once per mode (the last run tears down as far as ``nextitem`` needs); record each
    outcome; log only a summary report so pytest's own counts are per test, not per run."""
    from _pytest.runner import runtestprotocol

    modes = _modes(item)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for i, mode in enumerate(modes):
        _set_mode(mode)
        # between modes tear down the test's own (function-scoped) fixtures only: ``item.parent``'s
        # chain keeps the module and session set up
        last = i == len(modes) - 1
        t0 = time.perf_counter()
        reports = runtestprotocol(item, nextitem=nextitem if last else item.parent, log=False)
        _SECONDS[mode] = _SECONDS.get(mode, 0.0) + time.perf_counter() - t0
        out = _outcome(reports)
        _RESULTS.setdefault(mode, {})[item.nodeid] = out
        if out in ("failed", "error"):
            _DETAILS.setdefault(mode, {})[item.nodeid] = "\n".join(
                str(r.longrepr)[-1500:] for r in reports if r.failed)
    _set_mode("stock")
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_report_header(config):
    return [f"gpupool conformance: stubbed (not installed): {', '.join(_missing) or 'none'}"]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("GPUPOOL_VLLM_RESULTS")
    if path:
        import json
        with open(path, "w") as f:
            json.dump({"outcomes": _RESULTS, "built": _BUILT, "details": _DETAILS, "seconds": _SECONDS,
                   "import_s": _IMPORT_S, "process_s": time.perf_counter() - _T0}, f)
