"""How gpupool's kernels run: compiled for CUDA, or in Triton's interpreter on CPU tensors.

Triton fixes that for a kernel when its ``@triton.jit`` runs (it reads ``TRITON_INTERPRET`` then).
``gpupool.kernels`` is plain Triton: importing it or one of its modules chooses nothing and sets
nothing, its kernels follow ``TRITON_INTERPRET`` as it stands. gpupool's device modules (the pool,
the manager, the KV cache, the validator, the replay's device loop) choose once, with :func:`select`,
before they import their kernels, and never change the choice. ``import gpupool`` alone chooses
nothing and changes nothing. In order:

1. :func:`use_interpreter`, if called before that;
2. else the backend of gpupool kernels already defined (a program that imported ``gpupool.kernels``
   modules itself), so the pool never mixes the two;
3. else ``TRITON_INTERPRET`` as the user set it (Triton's own switch);
4. else the interpreter when torch sees no CUDA device, so the package works out of the box on a
   CPU-only machine (logged at INFO on the ``gpupool`` logger), and compiled kernels otherwise.

Choosing the interpreter sets ``TRITON_INTERPRET=1`` for the process, which Triton reads (child
processes inherit it). A process that imported triton earlier with the interpreter off (any vLLM
process does) has triton.language's own ``@jit`` helpers (``tl.zeros``, ``tl.sum``, ``tl.cumsum``,
...) built as compiled functions, which the interpreter cannot call ("Cannot call @triton.jit'd
outside of the scope of a kernel"); :func:`_interpret_triton_language` then rebuilds them as
interpreted ones (without a CUDA device the compiled ones could not run anyway). docs/design.md,
"Without a GPU".
"""
from __future__ import annotations

import logging
import os
import sys

_chosen: bool | None = None  # the choice once made: True = the interpreter


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (makes the choice if not made yet)."""
    return select()


def use_interpreter(enable: bool = True) -> None:
    """Run gpupool's kernels in Triton's interpreter (``enable``), or compiled for CUDA (``False``),
    whatever ``TRITON_INTERPRET`` says. Call it before the first kernel is defined (before the first
    ``BlockPool``); a later call that asks for the other backend raises InvalidArgumentError (the
    kernels are already defined), one that asks for the chosen backend does nothing."""
    from .errors import InvalidArgumentError

    enable = bool(enable)
    if _chosen is None and _defined_kernels() is not None:
        select()  # kernels defined already: their backend is the choice
    if _chosen is not None:
        if _chosen != enable:
            raise InvalidArgumentError(
                "use_interpreter", f"gpupool's kernels are already defined for "
                f"{'the interpreter' if _chosen else 'CUDA'}; call use_interpreter before the first BlockPool")
        return
    _choose(enable)


def select() -> bool:
    """Make the choice (module docstring) if not made yet; returns it. Each device module calls it
    before it imports its kernels."""
    global _chosen
    if _chosen is None:
        defined = _defined_kernels()
        if defined is not None:
            _chosen = defined  # the environment stays as those kernels found it
        elif "TRITON_INTERPRET" in os.environ:
            _choose(os.environ["TRITON_INTERPRET"] not in ("", "0"))
        else:
            import torch

            cpu_only = not torch.cuda.is_available()
            if cpu_only:
                logging.getLogger("gpupool").info(
                    "no CUDA device: gpupool's kernels run in Triton's interpreter (TRITON_INTERPRET=1)")
            _choose(cpu_only)
    return _chosen


def _defined_kernels() -> bool | None:
    """Whether gpupool kernels already defined run in the interpreter (True) or compiled (False);
    None when none is defined yet."""
    if "triton.runtime.jit" not in sys.modules:
        return None
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, mod in list(sys.modules.items()):
        if name.startswith("gpupool.kernels.") and mod is not None:
            for value in vars(mod).values():
                if isinstance(value, (JITFunction, InterpretedFunction)):
                    return isinstance(value, InterpretedFunction)
    return None


def _choose(enable: bool) -> None:
    global _chosen
    if enable:
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:
            _interpret_triton_language()
    elif os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "0"  # use_interpreter(False) over the variable
    _chosen = enable


def _interpret_triton_language() -> int:
    """Replace every compiled ``JITFunction`` of triton.language (module attributes and the tensor
    methods made from them) by an ``InterpretedFunction`` of the same Python function. Returns how
    many were replaced (0 when triton was imported with the interpreter on)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    made: dict[int, InterpretedFunction] = {}

    def interpreted_twin(jf: JITFunction) -> InterpretedFunction:
        if id(jf) not in made:
            made[id(jf)] = InterpretedFunction(jf.fn)
        return made[id(jf)]

    mods = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    for mod in mods:
        for name, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                setattr(mod, name, interpreted_twin(value))
    for name, value in list(vars(tl.tensor).items()):
        inner = [c.cell_contents for c in (getattr(value, "__closure__", None) or ())
                 if isinstance(c.cell_contents, JITFunction)]
        if inner:  # a tensor method made by core._tensor_member_fn around a @jit function
            twin = interpreted_twin(inner[0])
            setattr(tl.tensor, name, lambda *args, _f=twin, **kwargs: _f(*args, **kwargs))
    return len(made)

