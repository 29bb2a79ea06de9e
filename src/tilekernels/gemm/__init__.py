from .configs import GemmConfig, override_config
from .gemm import async_input_mm, gemm
from .scheduler import AsyncInputScheduler

__all__ = ["AsyncInputScheduler", "GemmConfig", "async_input_mm", "gemm", "override_config"]
