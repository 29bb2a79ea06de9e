"""Tile schedulers for the persistent GEMM: which output tile a program computes next.

A persistent program walks ``tile_id = pid, pid + P, pid + 2P, ...`` over ``tiles_m * tiles_n *
split_k`` work items (P = programs launched, at most SM count x resident programs). ``tile_coords``
turns a work item into ``(pid_m, pid_n, pid_k)``: the K-split is outermost, and inside one split the
output tiles are walked in a grouped raster — ``GROUP_M`` rows of tiles column by column — so that the
programs running at the same time share B's columns and A's rows in L2.

This is the one place that decides which tile comes next and which rows it covers; the async-input
scheduler (chunk signals and a pivot) extends it here, so a pivoted M index can drive both the rows read
and the signals waited on.
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Work item -> (pid_m, pid_n, pid_k): K-split outermost, grouped raster inside."""
    tiles_mn = tiles_m * tiles_n
    pid_k = tile_id // tiles_mn
    tile_mn = tile_id % tiles_mn
    tiles_in_group = GROUP_M * tiles_n
    group_id = tile_mn // tiles_in_group
    first_m = group_id * GROUP_M
    group_size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile_mn % tiles_in_group) % group_size_m
    pid_n = (tile_mn % tiles_in_group) // group_size_m
    return pid_m, pid_n, pid_k
