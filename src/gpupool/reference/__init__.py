"""The CPU oracle: docs/semantics.md as plain Python. ``ReferenceBlockPool`` (vLLM V1's BlockPool) and
``ReferenceKVCacheManager`` (its request layer). Imported by the tests, the replay and the public API;
nothing in the device path imports it."""
from .manager import ReferenceKVCacheManager
from .pool import ReferenceBlockPool

__all__ = ["ReferenceBlockPool", "ReferenceKVCacheManager"]
