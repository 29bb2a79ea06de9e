"""tilekernels: tile-based GPU kernels for LLM workloads, in Triton, exposed as PyTorch ops."""

from . import dist  # tk.dist.all_gather_matmul, tk.dist.matmul_reduce_scatter, tk.dist.Workspace
from ._runtime import raise_pending_errors
from .attention import (
           batch_decode,
           batch_prefill,
           flash_attn_func,
           flash_attn_varlen_func,
           merge_attention_states,
)
from .gemm import AsyncInputScheduler, GemmConfig, async_input_mm, gemm
from .norm import add_rms_norm_quant, layer_norm, rms_norm
from .quant import dynamic_quant, moe_smooth_quant, smooth_quant

__version__ = "0.1.0"

__all__ = ["AsyncInputScheduler", "GemmConfig", "__version__", "add_rms_norm_quant", "async_input_mm",
           "batch_decode", "batch_prefill", "dist", "dynamic_quant", "flash_attn_func", "flash_attn_varlen_func",
           "gemm", "layer_norm", "merge_attention_states", "moe_smooth_quant", "raise_pending_errors", "rms_norm",
           "smooth_quant"]
