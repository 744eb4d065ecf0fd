"""A ZMQ subscriber's start against a publisher: PUB drops what it sends before the subscription
arrives, so warm-up batches go out until one lands."""
from __future__ import annotations

import pytest


def warm_up(pub, sub, batch) -> int:
    """Publish ``batch`` until ``sub`` receives one, drain what followed; returns the last seq seen."""
    for _ in range(100):
        pub.publish(batch)
        if sub.poll(50):
            break
    else:
        pytest.fail("SUB never received a warm-up batch")
    last = -1
    while sub.poll(200):
        last = int.from_bytes(sub.recv_multipart()[1], "big")
    return last
