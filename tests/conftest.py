"""Hypothesis profiles: "fast" (default) and "deep" (GPUPOOL_HYPOTHESIS_PROFILE=deep)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before gpupool defines its kernels

from hypothesis import settings

settings.register_profile("fast", max_examples=50, deadline=None)
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("GPUPOOL_HYPOTHESIS_PROFILE", "fast"))
