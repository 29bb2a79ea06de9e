"""Attention: FlashAttention-2-compatible forward and backward (``fmha.py``); paged-KV prefill and decode
(``paged.py``)."""

from .fmha import flash_attn_func, flash_attn_varlen_func
from .paged import batch_decode, batch_prefill, merge_attention_states

__all__ = ["batch_decode", "batch_prefill", "flash_attn_func", "flash_attn_varlen_func", "merge_attention_states"]
