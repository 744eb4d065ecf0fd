"""gpupool: a KV-cache block pool for LLM serving whose bookkeeping lives on the GPU.

``ReferenceBlockPool`` is the CPU oracle (docs/semantics.md as plain Python); ``BlockPool`` keeps the
same contract with its state in device tensors, changed by Triton kernels; ``KVCacheManager`` is the
request layer over it and ``DecodeStep`` a capturable decode step.
"""
from . import _backend  # noqa: F401  (before any kernel is defined)
from .errors import *  # noqa: F401,F403
from .events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: F401
from .pool import BlockPool  # noqa: F401
from .reference import ReferenceBlockPool, ReferenceKVCacheManager  # noqa: F401

__version__ = "0.2.0"


def __getattr__(name):  # the request layer on first use (it imports the copy kernel)
    if name in ("KVCacheManager", "DecodeStep"):
        from .graph import DecodeStep
        from .manager import KVCacheManager

        return {"KVCacheManager": KVCacheManager, "DecodeStep": DecodeStep}[name]
    raise AttributeError(f"module 'gpupool' has no attribute {name!r}")
