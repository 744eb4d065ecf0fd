"""Triton kernels of gpupool (installed as ``gpupool.kernels``): ``@triton.jit`` kernels and thin launch
functions. No policy and no Python state live here; the pool (``gpupool.pool``) decides what to launch.
"""
