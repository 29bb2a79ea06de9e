"""Attention: FlashAttention-2-compatible forward and backward (``fmha.py``)."""

from .fmha import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
