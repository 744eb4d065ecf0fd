"""gpupool: a KV-cache block pool for LLM serving whose bookkeeping lives on the GPU.

``ReferenceBlockPool`` is the CPU oracle (SPEC.md as plain Python); ``BlockPool`` keeps the same
contract with its state in device tensors, changed by Triton kernels.
"""
from . import _backend  # noqa: F401  (before any kernel is defined)
from .errors import *  # noqa: F401,F403
from .events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: F401
from .reference import ReferenceBlockPool  # noqa: F401
from .pool import BlockPool  # noqa: F401

__version__ = "0.1.0"
