from .quant import dynamic_quant, moe_smooth_quant, smooth_quant

__all__ = ["dynamic_quant", "moe_smooth_quant", "smooth_quant"]
