"""tilekernels: tile-based GPU kernels for LLM workloads, in Triton, exposed as PyTorch ops."""

from ._runtime import raise_pending_errors
from .gemm import AsyncInputScheduler, GemmConfig, async_input_mm, gemm

__version__ = "0.1.0"

__all__ = ["AsyncInputScheduler", "GemmConfig", "__version__", "async_input_mm", "gemm", "raise_pending_errors"]
