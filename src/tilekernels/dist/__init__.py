"""tk.dist: tensor-parallel ops that overlap communication with the GEMM (DESIGN.md, "tk.dist")."""

from .all_gather_matmul import all_gather_matmul
from .matmul_reduce_scatter import matmul_reduce_scatter
from .workspace import Workspace

__all__ = ["Workspace", "all_gather_matmul", "matmul_reduce_scatter"]
