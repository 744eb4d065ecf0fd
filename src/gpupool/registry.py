"""The host's key registry: device key -> (hash bytes, group) for the keys the host must name.

The device stores a 128-bit key per (hash, group) (``gpupool.keys.device_key``); KV events and
``block_keys`` need the hash bytes back. The registry learns a key when the host hands it to the
device (``cache_full_blocks``, a manager's request hashes, a replayed trace) and forgets the keys no
one can name any more: when it has grown past twice what it kept at its last sweep (and past its
floor, the pool's block count: a sweep reads every live key, so a pool filling up does not sweep at
each doubling), a sweep keeps only the keys live in the device table plus those a pin source still
needs (a manager's active requests), so host memory is O(live keys + blocks), with KV events on or off
(docs/design.md, device state).

Sweeps run only where no device event row is waiting to be named (right after the pool drained its
events), so every key an event row carries is still here when it is translated.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from .keys import device_key, device_key_list

Key = tuple[int, int]  # (hi, lo) as device_key returns it

#: Sweep no earlier than at this many entries.
MIN_SWEEP = 4096


class KeyRegistry:
    """Device keys the host can name. ``live_keys()`` returns the keys live in the device table (a
    device read: called only by :meth:`maybe_sweep`); ``floor``: no sweep below this many entries
    (at least ``MIN_SWEEP``; a pool gives its block count)."""

    def __init__(self, live_keys: Callable[[], Iterable[Key]], floor: int = 0):
        self._names: dict[Key, tuple[bytes, int]] = {}
        self._live_keys = live_keys
        self._pin_sources: list[Callable[[], Iterable[Key]]] = []
        self._name_sources: list[Callable[[], None]] = []
        self._floor = max(MIN_SWEEP, floor)  # no sweep below this many entries
        self._sweep_at = self._floor

    def __len__(self) -> int:
        return len(self._names)

    def register(self, block_hash: bytes, group: int) -> Key:
        """The device key of ``(block_hash, group)``, remembered until a sweep finds it unused."""
        k = device_key(block_hash, group)
        self._names[k] = (block_hash, group)
        return k

    def register_pairs(self, keys: list[tuple[bytes, int]]) -> list[Key]:
        """:meth:`register` of each ``(block_hash, group)`` (``gpupool.keys.device_key_list``)."""
        dev = device_key_list(keys)
        self.learn(dev, keys)
        return dev

    def learn(self, dev: Iterable[Key], keys: Iterable[tuple[bytes, int]]) -> None:
        """Remember ``dev[i]`` as the device key of ``keys[i]`` (made on the device, not hashed here)."""
        self._names.update(zip(dev, keys))

    def register_many(self, hashes: Iterable[bytes], group: int) -> list[Key]:
        return [self.register(h, group) for h in hashes]

    def name(self, key: Key) -> tuple[bytes, int]:
        """``(hash, group)`` of a device key the host registered, or one a name source then registers
        (hashes the device made: a manager's log); KeyError for a key nobody knows (a bug)."""
        try:
            return self._names[key]
        except KeyError:
            for src in self._name_sources:
                src()
            return self._names[key]

    def add_name_source(self, fill: Callable[[], None]) -> None:
        """``fill()`` registers keys the device made (called when :meth:`name` meets an unknown key)."""
        self._name_sources.append(fill)

    def add_pin_source(self, keys: Callable[[], Iterable[Key]]) -> None:
        """Keys that ``keys()`` returns survive every sweep (e.g. a manager's active requests)."""
        self._pin_sources.append(keys)

    def maybe_sweep(self) -> bool:
        """Forget every key neither live on the device nor pinned, if the registry has doubled since
        the last sweep. Returns whether it swept."""
        if len(self._names) < self._sweep_at:
            return False
        keep = self._live_keys()
        keep = keep if type(keep) is set else set(keep)
        for src in self._pin_sources:
            keep.update(src())
        self._names = {k: v for k, v in self._names.items() if k in keep}
        self._sweep_at = max(self._floor, 2 * len(self._names))
        return True

    def clear_unpinned(self) -> None:
        """After ``reset_prefix_cache``: nothing is live on the device; keep only pinned keys."""
        keep: set[Key] = set()
        for src in self._pin_sources:
            keep.update(src())
        self._names = {k: v for k, v in self._names.items() if k in keep}
        self._sweep_at = max(self._floor, 2 * len(self._names))
