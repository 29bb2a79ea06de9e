"""Shared host helpers of tk.dist: process groups, the gather/scatter dimension bookkeeping."""

from __future__ import annotations

import torch
import torch.distributed as dist

# the dtypes tk.dist's GEMMs and reductions take
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ALGORITHMS = ("auto", "nccl", "pipelined", "copy_engine", "fetch")


def resolve_group(group) -> tuple[dist.ProcessGroup, str]:
    """``group``: None (the default group), a ProcessGroup, or a group name -> (group, group name)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tk.dist needs torch.distributed initialised (init_process_group) first")
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            return _resolve_process_group(group), group
        except Exception as error:
            raise ValueError(f"group: no process group named {group!r}") from error
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None, a ProcessGroup or a group name, got {type(group).__name__}")
    return group, group.group_name


def check_algorithm(algorithm: str, allowed=ALGORITHMS) -> None:
    if algorithm not in allowed:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, allowed))}, got {algorithm!r}")


def check_dim(name: str, dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {dim}")
    return dim % ndim


def check_matrix(name: str, t, dtype=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype} (the dtype of the first operand)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
