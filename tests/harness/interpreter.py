"""Triton's interpreter without its redundant re-patching: the test suite's largest waste.

Triton 3.x's interpreter maps ``triton.language`` onto numpy by patching the language modules
(``interpreter._patch_lang``) when a launch starts and restoring them when it ends. It also calls
``_patch_lang`` again at every call of a ``@triton.jit`` helper inside the launch, which walks every
member of ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core`` with ``inspect.getmembers`` to find the
builtins still unpatched, and finds none: the launch patched them already. For gpupool's kernels,
which call helpers thousands of times per launch, that walk is about half of all interpreter time
(cProfile of a decode-burst test: 49,754 ``getmembers`` calls, 52% of the run).

:func:`install` keeps one patching per launch: a helper's call patches only when its module sees a
language module (``tl`` or ``tl.core``) that the launch has not patched; everything else is
Triton's. The language each program sees is the same, so the kernels' results are the same
(``tests/kernels/test_interpreter_speedup.py`` checks both against Triton's own). It does nothing
where Triton's interpreter is not what it expects (another version's internals), so a new Triton
only makes the tests slower, never different.
"""
from __future__ import annotations

import inspect
import threading

_state = threading.local()  # .langs: ids of the language modules the running launch patched, or None
_installed = False


def _lang_ids(fn, langs) -> frozenset[int]:
    """The language modules ``fn``'s module sees (``tl``, ``tl.core``), as Triton's ``_patch_lang`` finds them."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)


class _LaunchScope:
    """The launch's patch scope: restoring it also ends the launch for the helpers' calls."""

    def __init__(self, scope):
        self._scope = scope

    def restore(self) -> None:
        try:
            self._scope.restore()
        finally:
            _state.langs = None


class _NoScope:
    def restore(self) -> None:
        pass


def once_per_launch(original):
    """``original`` (Triton's ``_patch_lang(fn)``) called once per launch, and for a helper only when its
    module sees a language module that the launch has not patched."""
    import triton.language as tl

    langs = (tl, tl.core)
    seen: dict[object, frozenset[int]] = {}

    def _patch_lang(fn):
        ids = seen.get(fn)
        if ids is None:
            ids = seen[fn] = _lang_ids(fn, langs)
        active = getattr(_state, "langs", None)
        if active is None:  # a launch starts (GridExecutor): Triton's patching, ended by its restore()
            scope = original(fn)
            _state.langs = set(ids)
            return _LaunchScope(scope)
        if ids <= active:  # a helper's call inside the launch: its language is patched already
            return _NoScope()
        active |= ids  # a helper whose module sees a language module the launch did not patch
        return original(fn)

    _patch_lang.__wrapped__ = original
    return _patch_lang


def install() -> bool:
    """Replace ``triton.runtime.interpreter._patch_lang`` by :func:`once_per_launch` of it (idempotent).
    Returns whether it is installed (False where Triton's interpreter lacks the expected internals)."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or list(inspect.signature(original).parameters) != ["fn"] \
            or not hasattr(interpreter, "_LangPatchScope"):
        return False
    interpreter._patch_lang = once_per_launch(original)
    _installed = True
    return True


def installed() -> bool:
    return _installed
