from .norm import add_rms_norm_quant, layer_norm, rms_norm

__all__ = ["add_rms_norm_quant", "layer_norm", "rms_norm"]
