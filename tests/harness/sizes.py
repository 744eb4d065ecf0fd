"""Test sizes: how big a property test runs under each hypothesis profile (tests/conftest.py), and
the block size of the request-level scenarios."""
from __future__ import annotations

BLOCK_SIZE = 16


def sized(full: int, small: int) -> int:
    """A test's size: ``full`` under the ``ci`` and ``deep`` hypothesis profiles (``.ci/run``),
    ``small`` under ``dev``, the default, so the README's quick test command stays under 3 minutes."""
    from hypothesis import settings

    return full if settings().max_examples >= 25 else small


def pow2_at_least(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): the smallest legal ``ring_capacity``."""
    return 1 << max(0, (int(x) - 1).bit_length())
