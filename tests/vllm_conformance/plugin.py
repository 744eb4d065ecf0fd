"""pytest plugin that runs vLLM 0.33's own tests with vLLM's released source on ``sys.path``
(tests/test_vllm_conformance.py starts pytest with ``-p plugin``; docs/vllm.md, "Conformance").

Environment: ``GPUPOOL_VLLM_SRC`` is the unpacked sdist (``vllm-0.33.0/``, holding ``vllm/`` and
``tests/``); ``GPUPOOL_VLLM_POOL`` is ``gpupool`` (vLLM's ``BlockPool`` replaced by
``gpupool.vllm.BlockPool`` everywhere it was imported) or ``stock`` (vLLM's own, for the baseline); ``GPUPOOL_VLLM_BACKEND`` is the adapter's ``backend``
(``device``, the default, or ``reference``).

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
import types

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
MODE = os.environ.get("GPUPOOL_VLLM_POOL", "gpupool")

import vllm.v1.core.block_pool as _vbp  # noqa: E402

_STOCK = _vbp.BlockPool
_BUILT = [0]  # gpupool pools built (reported, so the caller can tell the swap took)


def _swap():
    """Point every loaded module's ``BlockPool`` name that is vLLM's class at gpupool's."""
    from gpupool.vllm import BlockPool as GpBlockPool
    backend = os.environ.get("GPUPOOL_VLLM_BACKEND", "device")
    base = GpBlockPool

    def __init__(self, *a, **k):
        k.setdefault("backend", backend)
        base.__init__(self, *a, **k)
        _BUILT[0] += 1

    GpBlockPool = type("BlockPool", (base,), {"__init__": __init__, "__module__": base.__module__})
    swapped = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name.startswith("gpupool"):
            continue
        if getattr(mod, "BlockPool", None) is _STOCK:
            mod.BlockPool = GpBlockPool
            swapped.append(name)
    return swapped


def pytest_configure(config):
    config.addinivalue_line("markers", "gpupool_pool: which BlockPool ran")


def pytest_collection_finish(session):
    if MODE == "gpupool":
        swapped = _swap()
        session.config._gpupool_swapped = swapped
        print(f"\ngpupool conformance: BlockPool swapped in {len(swapped)} modules: {', '.join(sorted(swapped))}")


def pytest_report_header(config):
    return [f"gpupool conformance: BlockPool = {MODE}; stubbed (not installed): {', '.join(_missing) or 'none'}"]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("GPUPOOL_VLLM_COUNT_FILE")
    if path:
        with open(path, "w") as f:
            f.write(str(_BUILT[0]))
