"""One lock per pool: every public op of both pools and both managers holds it for the whole op,
including the host work after the device op (draining events, calling reuse watchers), so a serving
engine's scheduler thread and, say, a KV-transfer thread can share a pool (docs/design.md)."""
from __future__ import annotations

import functools
import threading


def new_lock() -> threading.RLock:
    """Re-entrant: an op may call another public op of the same object (the manager calls its pool's)."""
    return threading.RLock()


def locked(method):
    """Run ``method`` holding ``self._lock``."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class Locked:
    """Base of objects with a ``_lock``: a copy (``copy.deepcopy``, pickling) gets a fresh lock, or its
    own pool's when it has one (a manager shares its pool's lock)."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        pool = state.get("pool")
        self._lock = pool._lock if isinstance(pool, Locked) else new_lock()
