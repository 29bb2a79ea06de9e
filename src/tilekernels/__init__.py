"""tilekernels: tile-based GPU kernels for LLM workloads, in Triton, exposed as PyTorch ops."""

from .gemm import GemmConfig, gemm

__version__ = "0.1.0"

__all__ = ["GemmConfig", "__version__", "gemm"]
