"""tilekernels: tile-based GPU kernels for LLM workloads, in Triton, exposed as PyTorch ops."""

from ._runtime import raise_pending_errors
from .gemm import AsyncInputScheduler, GemmConfig, async_input_mm, gemm
from . import dist  # noqa: E402  (tk.dist.all_gather_matmul, tk.dist.matmul_reduce_scatter, tk.dist.Workspace)

__version__ = "0.1.0"

__all__ = ["AsyncInputScheduler", "GemmConfig", "__version__", "async_input_mm", "dist", "gemm",
           "raise_pending_errors"]
