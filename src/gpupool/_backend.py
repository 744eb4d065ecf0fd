"""Chooses how the kernels run before any of them is defined.

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted (the
``TRITON_INTERPRET`` environment variable). Without a CUDA device the kernels can only run on CPU
tensors through the interpreter, so the package turns it on unless the user chose otherwise.
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
