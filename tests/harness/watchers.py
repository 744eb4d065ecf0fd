"""Reuse-watcher callbacks (docs/semantics.md section 2, ``unpin_blocks``) that record what fired."""
from __future__ import annotations

from collections.abc import Callable

from harness.state import state_digest


class WatcherLog:
    """Reuse-watcher callbacks that record ``(tag, block, state_digest at call time)``."""

    def __init__(self, pool):
        self.pool = pool
        self.calls: list[tuple[object, int, str]] = []

    def cb(self, tag=None) -> Callable[[int], None]:
        def on_reuse(block, _tag=tag):
            self.calls.append((_tag, int(block), state_digest(self.pool)))
        return on_reuse

    def blocks(self) -> list[int]:
        return [b for _, b, _ in self.calls]

    def tagged(self) -> list[tuple[object, int]]:
        return [(t, b) for t, b, _ in self.calls]


def reuse_callbacks(pair):
    """A pair of ``on_reuse`` callbacks (reference, device) that log ``(tag, block)`` into
    ``pair.fired[side]``, with a fresh tag from ``pair.next_tag`` (the pair harnesses' watchers)."""
    tag = pair.next_tag
    pair.next_tag += 1

    def make(side):
        log = pair.fired[side]

        def on_reuse(b):
            log.append((tag, int(b)))
        return on_reuse
    return make("ref"), make("dev")
