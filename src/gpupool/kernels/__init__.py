"""Triton kernels of gpupool (installed as ``gpupool.kernels``): ``@triton.jit`` kernels and thin launch
functions. No policy and no Python state live here, and importing a module of it changes nothing in
the process: its kernels follow ``TRITON_INTERPRET`` as it stands, like any Triton code. The pool
(``gpupool.pool``) decides what to launch, and gpupool's device modules choose the backend before they
import the kernels (``gpupool/_backend.py``).
"""
