from .configs import GemmConfig, override_config
from .gemm import gemm

__all__ = ["GemmConfig", "gemm", "override_config"]
