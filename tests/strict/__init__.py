"""Strict GPU mode for the tests: :mod:`strict.checker` (the interpreter hooks and the
thread model) and :mod:`strict.plugin` (``pytest --strict-gpu[=MODE]``)."""
from .checker import ALL, MARKER, MODES, Checker, Hazard, active

__all__ = ["ALL", "MARKER", "MODES", "Checker", "Hazard", "active"]
