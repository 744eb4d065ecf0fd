"""gpupool: a KV-cache block pool for LLM serving whose bookkeeping lives on the GPU.

``ReferenceBlockPool`` is the CPU oracle (docs/semantics.md as plain Python); ``BlockPool`` keeps the
same contract with its state in device tensors, changed by Triton kernels; ``KVCacheManager`` is the
request layer over it and ``DecodeStep`` a capturable decode step.

Importing the package defines no kernel and changes nothing in the process: the device classes are
imported on first use, and the kernels then run compiled for CUDA or, without a CUDA device (or after
:func:`use_interpreter`, or with ``TRITON_INTERPRET=1``), in Triton's interpreter on CPU tensors
(``gpupool/_backend.py``; docs/design.md, "Without a GPU").
"""
from ._backend import use_interpreter  # noqa: F401
from .errors import *  # noqa: F401,F403
from .events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: F401
from .reference import ReferenceBlockPool, ReferenceKVCacheManager  # noqa: F401

__version__ = "0.2.0"


def __getattr__(name):  # the device classes on first use (their import defines the kernels)
    if name == "BlockPool":
        from .pool import BlockPool

        return BlockPool
    if name in ("KVCacheManager", "DecodeStep"):
        from .graph import DecodeStep
        from .manager import KVCacheManager

        return {"KVCacheManager": KVCacheManager, "DecodeStep": DecodeStep}[name]
    raise AttributeError(f"module 'gpupool' has no attribute {name!r}")
