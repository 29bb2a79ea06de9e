"""Launch configurations for the persistent GEMM, as data.

``select_config(M, N, K, dtype, device)`` picks a ``GemmConfig`` by a deterministic heuristic: a table
of measured winners per architecture and shape class (``TUNED``), falling back to rules of thumb.
Tests and the benchmark sweep override it with ``tk.gemm(..., config=GemmConfig(...))`` or the
``override_config`` context manager; ``candidate_configs`` lists what the sweep tries.

Why these shapes: on Hopper a 128x256x64 bf16 tile with 8 warps (two warpgroups) and 3-4 stages keeps
wgmma fed from TMA; skinny problems (small M) are bandwidth-bound on B, so they want many programs
along N (small BLOCK_N) and, when even that leaves SMs idle, split-K.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .._runtime import capability, cdiv, fp32_precision, sm_count


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # Load A/B tiles through host-built TMA tensor descriptors (Hopper+, aligned strides only).
    use_tma: bool = False
    # Warp-specialised persistent loop (producer/consumer warps), where the triton build supports it.
    warp_specialize: bool = False
    # Let the compiler fuse the tile loop with the K loop, so the next tile's loads overlap this
    # tile's epilogue. It can only with split_k 1 (every tile the same K range); gemm.py's
    # _can_flatten also keeps them apart where shared memory or a heavy epilogue says so.
    flatten: bool = True
    # Programs resident per SM for the persistent grid.
    programs_per_sm: int = 1
    # Read the residual and write C through TMA descriptors (with TMA operands, C and the residual
    # row-major and 16-byte aligned, no split-K): no per-element addresses, and C's store drains
    # asynchronously while the next tile starts.
    tma_epilogue: bool = True
    # Column slices the epilogue works through one after the other (1, 2 or 4); 0 picks: 2 for a heavy
    # epilogue (fewer live registers), and with a TMA epilogue as many as its shared-memory staging needs.
    epilogue_slices: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"GemmConfig: {name} must be a power-of-two int, got {v!r}")
        for name in ("group_m", "num_stages", "programs_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemmConfig: {name} must be an int >= 1, got {v!r}")
        for name in ("use_tma", "warp_specialize", "flatten", "tma_epilogue"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GemmConfig: {name} must be a bool, got {getattr(self, name)!r}")
        if self.epilogue_slices not in (0, 1, 2, 4):
            raise ValueError(f"GemmConfig: epilogue_slices must be 0 (pick), 1, 2 or 4, got {self.epilogue_slices!r}")
        if self.epilogue_slices and self.block_n % self.epilogue_slices:
            raise ValueError(f"GemmConfig: block_n {self.block_n} does not split into epilogue_slices "
                             f"{self.epilogue_slices}")

    def describe(self) -> str:
        extra = (("+tma" if self.use_tma else "") + ("+ws" if self.warp_specialize else "")
                 + ("" if self.flatten else "+noflat")
                 + (f"+p{self.programs_per_sm}" if self.programs_per_sm > 1 else "")
                 + ("" if self.tma_epilogue else "+ptrepi")
                 + (f"+e{self.epilogue_slices}" if self.epilogue_slices else ""))
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}{extra}")


_override: list[GemmConfig] = []


@contextlib.contextmanager
def override_config(config: GemmConfig):
    """Force ``config`` for every tk.gemm call inside the block (tests, sweeps)."""
    _override.append(config)
    try:
        yield config
    finally:
        _override.pop()


def active_override() -> GemmConfig | None:
    """The config forced by the innermost ``override_config`` block, if any."""
    return _override[-1] if _override else None


def _interpreter_config() -> GemmConfig:
    # Small tiles keep the CPU interpreter quick and make odd shapes straddle several tiles.
    return GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)


def _tile_count(M: int, N: int, cfg: GemmConfig) -> int:
    return cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)


# Measured winners on an H100 (bf16, B column-major, 2026-11-22; scripts in benchmarks/RESULTS.md):
# large 128x256x64 s4 reached 1.09x cuBLAS at 8192^3 and 0.98-1.02x on the other big anchor shapes;
# the skinny classes were timed in CUDA graphs (kernel against kernel): 16x64x256 0.99x at M=16,
# 64x64x128 0.99x at M=64, 64x128x64 s6 0.97x at M=128; split-K lost on every skinny shape tried.
TUNED_HOPPER_16BIT = {
    "large": GemmConfig(128, 256, 64, 8, 8, 4, use_tma=True),
    "medium": GemmConfig(128, 128, 64, 8, 4, 6, use_tma=True),
    "skinny": GemmConfig(64, 128, 64, 8, 4, 6, use_tma=True),
    "small": GemmConfig(64, 64, 128, 8, 4, 4, use_tma=True),
    "tiny": GemmConfig(16, 64, 256, 8, 4, 4, use_tma=True),
}
# fp32 (tf32) operands take twice the shared memory per element: half the K depth. Not yet tuned.
TUNED_HOPPER_FP32 = {
    "large": GemmConfig(128, 256, 32, 8, 8, 3, use_tma=True),
    "medium": GemmConfig(128, 128, 32, 8, 4, 5, use_tma=True),
    "skinny": GemmConfig(64, 128, 32, 8, 4, 5, use_tma=True),
    "small": GemmConfig(64, 64, 64, 8, 4, 4, use_tma=True),
    "tiny": GemmConfig(16, 64, 128, 8, 4, 4, use_tma=True),
}


def shape_class(M: int, N: int, K: int) -> str:
    if M <= 32:
        return "tiny"
    if M <= 64:
        return "small"
    if M <= 256:
        return "skinny"
    if M * N < 4096 * 4096:
        return "medium"
    return "large"


# The async-input GEMM (signals preset; H100, bf16, B column-major, K 8192, 2026-11-22, 4 interleaved
# rounds of do_bench medians, TFLOP/s): with the large tile, a group of 16 row tiles instead of 8 gave
# 705 / 688 / 707 at M 16384 / 4096 / 8192 and N 8192 against 676 / 682 / 691 (torch's
# _async_input_mm 690 / 685 / 688, tk.gemm with 8: 713 / 689 / 703). Why the async kernel trails tk.gemm
# with 8 is not pinned down (the per-tile wait is the only difference; the compiled pipeline was not
# inspected), nor why 16 helps it more. Other variants (3 stages, group 4, warp specialisation, 256x128
# tiles, unfused loops) were level or slower (benchmarks/NOTES.md).
ASYNC_LARGE_GROUP_M = 16


def _hopper_table(dtype: torch.dtype, async_input: bool) -> dict:
    """The tuned Hopper configs for ``dtype``; the async-input kernel's large tile takes ``ASYNC_LARGE_GROUP_M``."""
    table = dict(TUNED_HOPPER_FP32 if dtype == torch.float32 else TUNED_HOPPER_16BIT)
    if async_input:
        table["large"] = dataclasses.replace(table["large"], group_m=ASYNC_LARGE_GROUP_M)
    return table


# A heavy epilogue (bias, activation, mul or residual) on the medium class takes the large tile: bias + gelu +
# residual, bf16, H100, CUDA-graph replays, two processes of 5 rounds (2026-11-25), the large tile at 3 stages with
# its loops fused against the medium 128x128 tile: 2048x7168x4096 569 against 502 TFLOP/s, 2048x4096x4096 636
# against 515, 1024x8192x8192 680 / 574, 3000x3000x4096 398 / 342, 2048x2048x8192 679 / 606, 4000x4000x2048 525 /
# 368, 512x8192x4096 605 / 540 (the plain GEMM follows the wave rule below: medium at 2048x7168x4096, 1.03x cuBLAS).
HEAVY_EPILOGUE_CLASS = {"medium": "large"}

# Without a heavy epilogue the medium class takes the large tile where that tile's waves over the persistent
# programs cost less: a large (128x256) tile runs in about LARGE_TILE_COST times a medium (128x128) tile's time, so
# the large tile wins when waves(large) * LARGE_TILE_COST < waves(medium), waves = ceil(tiles / programs).
# Plain bf16, H100 (132 programs), CUDA-graph replays, 3 rounds, RC and RR alike (2026-11-25), medium against
# large TFLOP/s: 2048x2048x8192 676 / 708 (waves 2 / 1), 2048x4096x4096 635 / 678 (4 / 2), 1024x8192x8192 656 / 693
# (4 / 2), 2560x2560x8192 540 / 587 (4 / 2), 4000x4000x2048 559 / 625 (8 / 4), 1024x4096x4096 648 / 662 (2 / 1),
# 512x8192x4096 645 / 646 (2 / 1); and the other way: 2048x7168x4096 643 / 616 (7 / 4), 3072x3072x4096 583 / 557
# (5 / 3), 1536x6144x4096 578 / 553 (5 / 3). Those ratios put the cost at 1.74-1.91.
LARGE_TILE_COST = 1.85


def _large_tile_waves_less(M: int, N: int, table: dict, device: torch.device) -> bool:
    """Whether ``table``'s large tile takes less time than its medium tile by the wave count (above)."""
    def waves(cfg: GemmConfig) -> int:
        return cdiv(_tile_count(M, N, cfg), sm_count(device) * cfg.programs_per_sm)

    return waves(table["large"]) * LARGE_TILE_COST < waves(table["medium"])


def select_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device,
                  async_input: bool = False, heavy_epilogue: bool = False) -> GemmConfig:
    """The launch config for one problem (``async_input``: for the async-input kernel, which waits for
    its rows at every tile; ``heavy_epilogue``: tk.gemm with a bias, activation, mul or residual, which
    moves 16-bit medium problems on Hopper to the large tile, ``HEAVY_EPILOGUE_CLASS``; without one a 16-bit
    medium problem on Hopper takes the large tile where it needs fewer waves, ``LARGE_TILE_COST``); an active
    ``override_config`` wins."""
    if _override:
        return _override[-1]
    if device.type != "cuda":
        return _interpreter_config()
    major, _ = capability(device)
    if dtype == torch.float32 and fp32_precision() == "ieee":
        # fp32 FMA with a compensation term: two fp32 tiles live, so smaller tiles (not yet tuned).
        if M <= 64:
            return GemmConfig(64, 64, 32, 8, 4, 3, use_tma=major >= 9)
        return GemmConfig(128, 128, 32, 8, 8, 3, use_tma=major >= 9)
    table = _hopper_table(dtype, async_input)
    cls = shape_class(M, N, K)
    if not async_input and dtype.itemsize == 2 and major >= 9:
        if heavy_epilogue:
            cls = HEAVY_EPILOGUE_CLASS.get(cls, cls)
        elif cls == "medium" and _large_tile_waves_less(M, N, table, device):
            cls = "large"
    cfg = table[cls]
    if major < 9:
        cfg = dataclasses.replace(cfg, use_tma=False, warp_specialize=False,
                                  num_stages=min(cfg.num_stages, 3))
    if dtype.itemsize == 1 and cfg.block_k < 128:
        cfg = dataclasses.replace(cfg, block_k=128)
    return cfg


@dataclasses.dataclass(frozen=True)
class RowTail:
    """A launch split in two by rows: rows ``[0, rows)`` take the main config in whole waves over the persistent
    programs, rows ``[rows, M)`` a smaller tile (``config``) in a launch of their own, right after."""
    rows: int
    config: GemmConfig


# The row tail (``select_plan``). A persistent launch whose tiles leave the last wave part-full runs that wave at
# the full tile's time; with the leftover rows in a smaller tile the last wave costs less. Time of one full wave
# of each tile relative to a medium (128x128) tile's wave, and what a wave with idle SMs costs of a full one (fewer
# programs share L2 and the power budget). Measured on the H100 (bf16, CUDA-graph replays, 2026-11-25): at
# 3072x3072x4096 2 large waves 99-102 us, their leftover 256 rows as one large wave 42 us, in 128x128 tiles 21.6 us,
# in 64x128 tiles 15.5 us; 6144x3072x4096: 4 large waves 197-208 us, the leftover 512 rows in 128x128 tiles 23.4 us;
# a full medium wave at K 4096 26.6-27.5 us. The tail's launch costs TAIL_LAUNCH_US more, and the split is taken only
# where the model says it saves TAIL_MIN_GAIN of select_config's single launch. Tail against single launch (same
# process, 3 interleaved rounds, eager / CUDA graphs; outputs bit-identical to the single launch in every case):
# 3072x3072x4096 +7% / +12-14%, 3000x3000x4096 +27% / +20-25%, 6144x3072x4096 +7% / +8-20%, 4096x4608x4096 +3-5% /
# +6-12%, 1536x6144x4096 +0-1% / +1-7%, 5120x5120x4096 +1% / +0-4%; bias+gelu+residual 3072x3072x4096 +15-17%,
# 6144x3072x4096 +4-8%, 4096x4608x4096 +4-9%, 2048x7168x4096 +2-7%.
TAIL_WAVE_COST = {"large": LARGE_TILE_COST, "medium": 1.0, "skinny": 0.7}
TAIL_LIGHT_WAVE = 0.85
TAIL_LAUNCH_US = 3.0
TAIL_MIN_GAIN = 0.07
# and only behind two whole waves or more: 2048x3072x8192 (one large wave, then 640 rows in 128x128 tiles, a
# predicted 8%) measured 3-5% faster than its single launch eager but 5-7% slower under CUDA graphs.
TAIL_MIN_WAVES = 2
# Behind TAIL_LONG_WAVES whole waves or more the tail's fixed costs (its launch, a pipeline fill) are a small part of
# the whole, and a smaller gain is taken: 16384x8192x8192 (31 large waves and 4 tiles on 132 SMs; the model says
# 2.0% with 128 rows of 64x128 tiles after) measured +0.3% (RC) and +0.8% (RR) under CUDA graphs, 5 rounds each,
# bit-identical (tk.gemm's rows split by hand; H100, bf16, 2026-11-25), where the async-input kernel trailed
# torch's _async_input_mm by 0.2-0.5% in every graph run of that day (H100 and H200, both layouts).
TAIL_LONG_WAVES = 16
TAIL_MIN_GAIN_LONG = 0.015
# bf16 tensor-core rate of one SM under load (H100: ~690 TFLOP/s over 132 SMs), to put TAIL_LAUNCH_US in waves
_SM_FLOPS = 5.2e12


def _row_tail_cost(M: int, N: int, main: GemmConfig, tail: GemmConfig, costs: dict, programs: int,
                   launch: float) -> tuple[float, int] | None:
    """(cost in medium waves, rows of the main launch) of ``main`` over whole waves and ``tail`` over the rest,
    or None where there is no such split (whole waves already, fewer than ``TAIL_MIN_WAVES`` of them, or no whole
    row of tiles inside them)."""
    tiles_n = cdiv(N, main.block_n)
    tiles = cdiv(M, main.block_m) * tiles_n
    waves = tiles // programs
    if waves < TAIL_MIN_WAVES or tiles % programs == 0:
        return None
    row_tiles = waves * programs // tiles_n
    rows = row_tiles * main.block_m
    if row_tiles == 0 or rows >= M:
        return None
    tail_waves = cdiv(cdiv(M - rows, tail.block_m) * cdiv(N, tail.block_n), programs)
    cost = waves * costs[main] + (tail_waves - 1 + TAIL_LIGHT_WAVE) * costs[tail] + launch
    return cost, rows


def select_plan(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device,
                heavy_epilogue: bool = False, async_input: bool = False) -> tuple[GemmConfig, RowTail | None]:
    """``select_config``'s choice, or a split of the rows into a main launch of whole waves and a tail in a
    smaller tile (``RowTail``) where the model above says that saves at least ``TAIL_MIN_GAIN``: plain or heavy
    16-bit medium and large problems on Hopper (a heavy epilogue keeps the large tile for its main launch). An
    active ``override_config`` takes no tail.

    ``async_input``: for the async-input kernel (its large tile with ``ASYNC_LARGE_GROUP_M``). There the tail is
    the last ``M - rows`` rows in the pivoted order, not the last rows of A (gemm.py places them); the model is the
    same. Measured on the H100 (bf16, 4096x3584x8192, signals preset, CUDA graphs, 2026-11-25): tk.gemm's plan
    (the large tile over 3584 rows, 512 rows of 128x128 tiles after) ran 676-699 TFLOP/s in single rounds, RC and RR,
    against 646-667 for the async kernel's single launch of 128x128 tiles."""
    cfg = select_config(M, N, K, dtype, device, async_input, heavy_epilogue)
    if _override or device.type != "cuda" or dtype.itemsize != 2 or capability(device)[0] < 9 or K < 1:
        return cfg, None
    table = _hopper_table(dtype, async_input)
    costs = {table[name]: cost for name, cost in TAIL_WAVE_COST.items()}
    if cfg not in (table["medium"], table["large"]):
        return cfg, None
    programs = sm_count(device)
    launch = TAIL_LAUNCH_US * 1e-6 * _SM_FLOPS / (2.0 * 128 * 128 * K)
    best = cdiv(_tile_count(M, N, cfg), programs) * costs[cfg]
    choice: tuple[GemmConfig, RowTail | None] = (cfg, None)
    chosen = best
    mains = (table["large"],) if heavy_epilogue else (table["large"], table["medium"])
    for main in mains:
        long = _tile_count(M, N, main) // programs >= TAIL_LONG_WAVES
        bar = best * (1.0 - (TAIL_MIN_GAIN_LONG if long else TAIL_MIN_GAIN))
        for name in ("medium", "skinny"):
            tail = table[name]
            if tail.block_m * tail.block_n >= main.block_m * main.block_n:
                continue
            found = _row_tail_cost(M, N, main, tail, costs, programs, launch)
            if found is not None and found[0] <= bar and found[0] < chosen:
                chosen = found[0]
                choice = (main, RowTail(found[1], tail))
    return choice


def describe_plan(cfg: GemmConfig, tail: RowTail | None) -> str:
    return cfg.describe() if tail is None else f"{cfg.describe()} rows<{tail.rows}, then {tail.config.describe()}"


def auto_split_k(M: int, N: int, K: int, cfg: GemmConfig, device: torch.device) -> int:
    """Split K when the output tiles cannot fill the machine and K is long enough to share.

    Each split must keep at least four BLOCK_K steps so its own pipeline fills; the split count is the
    smallest that gives every SM a tile, capped at 16.
    """
    tiles = _tile_count(M, N, cfg)
    sms = sm_count(device)
    # Measured: with a quarter of the SMs busy or more, the partial-sum traffic costs more than the
    # idle SMs would add (split 2 and 4 lost at M = 16..128, N = K = 8192 on an H100).
    if tiles >= max(2, sms // 4):
        return 1
    max_by_k = K // (4 * cfg.block_k)
    if max_by_k < 2:
        return 1
    return int(max(1, min(16, max_by_k, cdiv(sms, tiles))))


def candidate_configs(dtype: torch.dtype, device: torch.device) -> list[GemmConfig]:
    """What ``python -m tilekernels bench gemm --sweep`` tries on this device."""
    if device.type != "cuda":
        return [_interpreter_config(), GemmConfig(16, 32, 16, 1, 4, 1), GemmConfig(64, 32, 32, 4, 4, 1)]
    tma = capability(device)[0] >= 9
    bk = 32 if dtype == torch.float32 else (128 if dtype.itemsize == 1 else 64)
    out = []
    # (block_m, block_n, block_k, num_warps, stages list)
    shapes = [(128, 256, bk, 8, (3, 4)), (256, 128, bk, 8, (3, 4)), (128, 128, bk, 8, (4, 5)),
              (128, 128, bk, 4, (4, 5, 6)), (64, 128, bk, 4, (4, 6)), (64, 256, bk, 4, (4,)),
              (64, 64, bk, 4, (4, 6)), (16, 64, 2 * bk, 4, (4, 6)), (16, 128, 2 * bk, 4, (4, 6)),
              (32, 64, 2 * bk, 4, (4, 6)), (64, 128, 2 * bk, 4, (4,))]
    for bm, bn, bk2, warps, stages_list in shapes:
        for stages in stages_list:
            out.append(GemmConfig(bm, bn, bk2, 8, warps, stages, use_tma=tma))
    if tma:
        out += [GemmConfig(128, 256, bk, 8, 8, 3, use_tma=True, warp_specialize=True),
                GemmConfig(128, 256, bk, 8, 8, 4, use_tma=True, warp_specialize=True),
                GemmConfig(128, 128, bk, 8, 8, 4, use_tma=True, warp_specialize=True),
                GemmConfig(128, 128, bk, 8, 4, 5, use_tma=True, programs_per_sm=2),
                GemmConfig(128, 256, bk, 8, 8, 4, use_tma=True, flatten=False),
                GemmConfig(128, 256, bk, 8, 8, 3),
                GemmConfig(128, 128, bk, 8, 4, 5)]
    return out
