"""Triton kernels of gpupool (installed as ``gpupool.kernels``): ``@triton.jit`` kernels and thin launch
functions. No policy and no Python state live here; the pool (``gpupool.pool``) decides what to launch.
"""
from .._backend import select as _select_backend

_select_backend()  # compiled or interpreted, before any kernel is defined (gpupool/_backend.py)
