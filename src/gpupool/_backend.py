"""Chooses how the kernels run before any of them is defined.

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted (the
``TRITON_INTERPRET`` environment variable). Without a CUDA device the kernels can only run on CPU
tensors through the interpreter, so the package turns it on unless the user chose otherwise.

A process that imported triton before gpupool (any vLLM process does) has triton.language's own
``@jit`` helpers (``tl.zeros``, ``tl.sum``, ``tl.cumsum``, ...) built as compiled functions, which
the interpreter cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel").
:func:`_interpret_triton_language` rebuilds them as interpreted ones; without a CUDA device the
compiled ones could not run anyway.
"""
import os
import sys

import torch


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if interpreted() and "triton" in sys.modules:
    _interpret_triton_language()
