"""Time limits of the tests (a subprocess's ``timeout=``, a wait for a message), scaled for a busy
machine: ``GPUPOOL_TEST_TIMEOUT_SCALE`` multiplies each one (default 1; ``3`` on a machine three
times as loaded; ``inf``: no limit). docs/testing.md, "Time limits"."""
from __future__ import annotations

import math
import os

SCALE_ENV = "GPUPOOL_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor of ``GPUPOOL_TEST_TIMEOUT_SCALE`` (1 when unset); ValueError naming the variable for
    anything but a number > 0 or ``inf``."""
    text = os.environ.get(SCALE_ENV, "").strip()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not scale > 0:
        raise ValueError(f"{SCALE_ENV}={text!r}: expected a number > 0 (or inf for no time limit)")
    return scale


def scaled(seconds: float) -> float | None:
    """``seconds`` times :func:`timeout_scale`; None (no limit, as ``subprocess.run`` takes it) for ``inf``."""
    limit = seconds * timeout_scale()
    return None if math.isinf(limit) else limit


def scaled_ms(ms: int) -> int:
    """A wait in milliseconds (zmq's ``poll``), scaled; -1 (wait forever) for ``inf``."""
    limit = scaled(ms)
    return -1 if limit is None else int(limit)
