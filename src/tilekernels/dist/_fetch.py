"""``all_gather_matmul(algorithm="fetch")``: iris' HBM-buffer design, gather along rows, in Triton.

Rank r holds ``A_shard [m, K]``; the gathered A is ``[world*m, K]`` with rank r's rows at
``[r*m, (r+1)*m)``; each output is ``gathered_A @ B_i``. One launch per B holds two kinds of program:

- **fetchers** (program ids ``[0, F)``) copy peers' A tiles, read over NVLink from each peer's
  symmetric data area, into a local staging buffer and raise one flag per (m-tile, k-group);
- **GEMM programs** (ids ``[F, F + G)``) walk the output tiles persistently, this rank's rows first
  (pivot = rank, read straight from the local shard, no wait), then rank+1's, ... and wait on a tile's
  flag before each k-group of its K loop, so a tile starts as soon as its first k-group has landed.

Protocol record (STYLE.md item 10). Words are int32 epochs in the own flag area of ``ws.flags``
(``workspace.py`` has the map); ``e`` is this call's epoch, ``ws.epoch`` on the device, read by every
kernel with a load, so a CUDA-graph replay waits for the epoch its replay reached.

1. ``fetch_publish`` (host, current stream): ``ws.begin()`` — ``e = EPOCH + 1`` and wait until every
   peer's ``DONE`` reached ``e - 1``, i.e. no peer still reads this rank's data area from the previous
   call. Copy ``a_shard`` into ``ws.data(rank)``, then ``ws.signal(peer, READY + rank)`` for every
   peer: a 4-byte copy-engine copy of ``e`` into the peer's flags, ordered after the shard copy by the
   stream (no SM needed, so it cannot be starved by the spinning kernel).
2. ``fetch_compute``, first launch (the one with B_0). Fetcher items are (source rank, m-tile,
   k-group), sources in GEMM order ``rank+1, rank+2, ...`` (own rank last, copied into staging only
   when the gathered A is returned), k-group fastest; fetcher f takes items ``f, f+F, f+2F, ...``.
   Per item: wait ``READY + src >= e`` in the OWN flags (``_signals.wait_flag``: scalar acquire
   atomic, scope ``sys`` since a peer's copy engine wrote it, bounded); load the tile from the peer's
   data area (``.cg``: L2 only); store it to staging (and to ``a_out`` when staging is not
   ``a_out``); ``tl.debug_barrier()`` — the flag write below is a scalar atomic run by one thread,
   the barrier puts every thread's stores before it; ``atomic_xchg(FETCH + i, e)`` with ``release``,
   scope ``gpu`` (only this GPU reads staging flags). ``i = (src * tiles_per_rank + m_tile) *
   k_groups + k_group``.
3. GEMM programs: for a peer tile, before k-group g: poll ``FETCH + i >= e`` (acquire, ``gpu``), on a
   miss fall back to ``wait_flag`` (bounded). Triton runs the scalar atomic in one thread and
   broadcasts its value behind a CTA barrier, so the tile loads that follow come after the acquire.
   The loads of group g sit in an inner loop that starts after the wait, so software pipelining
   (innermost loops only) cannot hoist them above it; staging loads are ``.cg``.
4. Later launches (B_1, ...): staging is complete (stream order), no fetchers, no flag waits.
5. ``ws.end()``: ``DONE[rank] := e`` on every peer (copy engine, after the kernels): this rank no
   longer reads any peer's data area for call e.

Epochs, never zeroing: a stale flag holds ``e - 1 < e``, whatever the shapes of the previous call.

Residency: GEMM programs spin on flags that fetchers raise, and fetchers on peers' READY, so every
program must be resident at once: ``F + G <= SM count x programs_per_sm`` (never more; the default
is one program per SM, which any kernel that launches at all satisfies). Fetchers take the lowest
program ids: dispatched first where other work holds some SMs, and under the interpreter, which runs
programs in id order, finished before any GEMM program starts. Nothing the kernel waits for needs an
SM: READY and DONE are copy-engine writes.

Peer addresses: one int64 ``[world]`` tensor of element offsets from this rank's data area to each
rank's (pointer arithmetic, no int-to-pointer casts; 16-byte aligned, checked), built at the first
call per workspace and dtype and then reused, so that first call must run before any CUDA-graph
capture (as a warm-up call does).

Timeouts: a wait that gives up records its word in ``ws.errors``. A fetcher whose peer never
published skips the item (no staging store, no flag); other fetchers find the READY word already
recorded and skip at once. A GEMM program whose flag misses first checks whether the fetch of that
source already gave up (then skips without waiting or recording), else waits and records the FETCH
word; the tile's output rows are not written; later launches skip the tiles of a source whose READY
was recorded. Every tile whose inputs arrived is computed. ``ws.check()`` then raises
``TimeoutError`` naming the rank (under the interpreter at once; on a GPU at the workspace's next
``begin`` or ``tk.raise_pending_errors()``).

Several Bs: one launch per B. Only the first fetches; the next ones are plain persistent GEMMs over
the staged A. One launch over all Bs would hide the transfer behind every GEMM instead of the first
only, at the price of selecting B/out per tile at run time; left for when measurements ask for it.

Measured: not yet run on a GPU. Compiled ahead of time for sm_90 with triton 3.6 and 3.9 (no device
needed): 144 KB shared memory at 128x256x64 s3 (fp16/bf16), 80 KB at 128x128x32 (fp32), 255 registers
(one program per SM); the PTX has the waits as ``ld.global.{sys,gpu}.acquire`` by one thread between
two ``bar.sync``, the flag as ``bar.sync`` then one thread's ``atom.global.gpu.release.exch``, 16-byte
peer loads (``ld.global.cg.v4``) and cp.async-pipelined GEMM loads in both layouts (m, K, strides
multiples of 16 elements; otherwise the loads narrow).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from .. import _runtime
from .._runtime import cast_for_store, cdiv, compensated_dot, dot, offset_i64
from ..gemm.scheduler import tile_coords
from ._common import DTYPES, check_matrix
from ._signals import wait_flag
from .workspace import FETCH, FLAG_WORDS, READY

LAYOUTS = ("k", "m")


@dataclasses.dataclass(frozen=True)
class FetchConfig:
    """Tiles and program split of the fused kernel.

    ``k_blocks_per_flag`` BLOCK_K blocks form one k-group (one flag per m-tile and k-group).
    ``fetch_block_k``: columns a fetcher moves per load/store step (a power of two). The fetch loop
    is not software-pipelined, so one step's loads are all a fetcher has in flight over NVLink: a
    64 KB step keeps ~4x more bytes in flight than a GEMM-sized 16 KB one.
    ``num_fetchers`` None: an eighth of the resident programs on a GPU.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    k_blocks_per_flag: int = 8
    fetch_block_k: int = 256
    num_fetchers: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1


def default_config(dtype: torch.dtype, device: torch.device) -> FetchConfig:
    if device.type != "cuda":
        # Small tiles keep the interpreter quick and make odd shapes straddle tiles and k-groups.
        return FetchConfig(16, 16, 16, 2, 2, fetch_block_k=16, num_fetchers=2, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return FetchConfig(128, 128, 32, 8, 16, fetch_block_k=128)
    return FetchConfig()


# ----------------------------------------------------------------------------------------------------
# device side


@triton.jit
def _wait_staged(flags, word, epoch, errors, source_word, max_spins):
    """``flags[word] >= epoch`` (a staging flag raised on this GPU); gives up at once, recording
    nothing, when the fetch of that source already gave up on ``source_word``."""
    seen = tl.atomic_add(flags + word, 0, sem="acquire", scope="gpu")
    ready = seen >= epoch
    if seen < epoch:  # noqa: SIM102 - the error word (host memory) is read only after a miss
        if tl.load(errors + 1 + source_word, volatile=True) == 0:
            ready = wait_flag(flags, word, epoch, errors, max_spins)
    return ready


@triton.jit
def _accumulate(acc, comp, a_rows, stride_ak, mask_m, b_cols, stride_bk, mask_n, k_start, k_end,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, A_CACHE: tl.constexpr,
                FP32_PRECISION: tl.constexpr):
    """``acc + A[rows, k_start:k_end] @ B[k_start:k_end, cols]``, as (acc, comp); ``a_rows`` [BM] and
    ``b_cols`` [BN] point to the rows' / columns' first element. Rows and columns past the matrix are
    masked, not clamped: a clamped index loses its contiguity, which m-contiguous staging (and row-major
    B) needs for vector loads. fp32 FMA ("ieee") carries a Kahan compensation term ``comp`` across K
    slices, as tk.gemm does: one FMA chain measured 2.4x torch's error at K 520 on an H100."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows[:, None] + offset_i64(k_start + offs_k, stride_ak)[None, :]
    b_ptrs = b_cols[None, :] + offset_i64(k_start + offs_k, stride_bk)[:, None]
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a_tile = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0, cache_modifier=A_CACHE)
            b_tile = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_left = k_end - k
            a_tile = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0,
                             cache_modifier=A_CACHE)
            b_tile = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_PRECISION == "ieee" and a_tile.dtype == tl.float32:
            acc, comp = compensated_dot(a_tile, b_tile, acc, comp)  # [BM, BK] @ [BK, BN] -> [BM, BN]
        else:
            acc = dot(a_tile, b_tile, acc, FP32_PRECISION)  # [BM, BK] @ [BK, BN] -> [BM, BN]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, comp


@triton.jit
def _fetch_tiles(pid, num_fetchers, data, peer_offsets, stage, a_out, flags, epoch, errors,
                 rank, world, m, K, stride_sm, stride_sk, stride_om, stride_ok, max_spins,
                 READY_WORD: tl.constexpr, FETCH_WORD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS_PER_FLAG: tl.constexpr,
                 FETCH_BLOCK_K: tl.constexpr, STAGE_OWN: tl.constexpr, HAS_A_OUT: tl.constexpr,
                 PEER_ALIGN: tl.constexpr):
    tiles_per_rank = tl.cdiv(m, BLOCK_M)
    k_groups = tl.cdiv(K, BLOCK_K * K_BLOCKS_PER_FLAG)
    items_per_source = tiles_per_rank * k_groups
    sources = world - 1
    if STAGE_OWN:
        sources += 1
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, FETCH_BLOCK_K)
    for item in range(pid, sources * items_per_source, num_fetchers):
        src = (rank + 1 + item // items_per_source) % world
        m_tile = (item % items_per_source) // k_groups
        k_group = item % k_groups
        ready = src >= 0  # True, as a tensor the branch can update
        if src != rank:
            ready = wait_flag(flags, READY_WORD + src, epoch, errors, max_spins)
        if ready:
            # Distance from this rank's data area to src's, in elements (0 for the own rank).
            src_base = data + tl.multiple_of(tl.load(peer_offsets + src), PEER_ALIGN)
            rows = m_tile * BLOCK_M + offs_m
            mask_m = rows < m
            src_rows = src_base + offset_i64(rows, K)
            stage_rows = stage + offset_i64(src * m + rows, stride_sm)
            out_rows = a_out + offset_i64(src * m + rows, stride_om)
            k_start = k_group * (BLOCK_K * K_BLOCKS_PER_FLAG)
            k_end = min(K, k_start + BLOCK_K * K_BLOCKS_PER_FLAG)
            for k in range(k_start, k_end, FETCH_BLOCK_K):
                cols = k + offs_k
                mask = mask_m[:, None] & (cols < k_end)[None, :]
                tile = tl.load(src_rows[:, None] + cols[None, :], mask=mask, cache_modifier=".cg")
                tl.store(stage_rows[:, None] + offset_i64(cols, stride_sk)[None, :], tile, mask=mask)
                if HAS_A_OUT:
                    tl.store(out_rows[:, None] + offset_i64(cols, stride_ok)[None, :], tile, mask=mask)
            if src != rank:
                # The flag is one thread's atomic: every thread's stores must come before it.
                tl.debug_barrier()
                flag = FETCH_WORD + (src * tiles_per_rank + m_tile) * k_groups + k_group
                tl.atomic_xchg(flags + flag, epoch, sem="release", scope="gpu")


@triton.jit
def _gemm_tiles(pid, num_programs, a_shard, stage, b, c, flags, epoch, errors,
                rank, world, m, N, K, stride_sm, stride_sk, stride_bk, stride_bn, stride_cm, stride_cn,
                max_spins,
                READY_WORD: tl.constexpr, FETCH_WORD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                K_BLOCKS_PER_FLAG: tl.constexpr, WAIT: tl.constexpr, EVEN_K: tl.constexpr,
                FP32_PRECISION: tl.constexpr):
    tiles_per_rank = tl.cdiv(m, BLOCK_M)
    tiles_m = world * tiles_per_rank
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_groups = tl.cdiv(K, BLOCK_K * K_BLOCKS_PER_FLAG)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    for tile_id in range(pid, tiles_m * tiles_n, num_programs):
        # One pivoted m-tile (this rank's rows first) drives the waits, the rows read and the rows written.
        pid_m, pid_n, _ = tile_coords(tile_id, tiles_m, tiles_n, GROUP_M, rank * tiles_per_rank, True)
        src = pid_m // tiles_per_rank
        m_tile = pid_m % tiles_per_rank
        rows = m_tile * BLOCK_M + offs_m
        mask_m = rows < m
        cols = pid_n * BLOCK_N + offs_n
        mask_n = cols < N
        b_cols = b + offset_i64(cols, stride_bn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ready = src >= 0  # True, as a tensor the branches can update
        if src == rank:
            acc, comp = _accumulate(acc, comp, a_shard + offset_i64(rows, K), 1, mask_m, b_cols, stride_bk,
                                    mask_n, 0, K, BLOCK_K, EVEN_K, "", FP32_PRECISION)
        else:
            a_rows = stage + offset_i64(src * m + rows, stride_sm)
            if WAIT:
                for k_group in range(k_groups):
                    if ready:
                        flag = FETCH_WORD + (src * tiles_per_rank + m_tile) * k_groups + k_group
                        ready = _wait_staged(flags, flag, epoch, errors, READY_WORD + src, max_spins)
                    if ready:
                        k_start = k_group * (BLOCK_K * K_BLOCKS_PER_FLAG)
                        k_end = min(K, k_start + BLOCK_K * K_BLOCKS_PER_FLAG)
                        acc, comp = _accumulate(acc, comp, a_rows, stride_sk, mask_m, b_cols, stride_bk, mask_n,
                                                k_start, k_end, BLOCK_K, EVEN_K, ".cg", FP32_PRECISION)
            else:
                # Staging was filled by an earlier launch; skip the sources whose fetch gave up there.
                ready = tl.load(errors + 1 + READY_WORD + src, volatile=True) == 0
                if ready:
                    acc, comp = _accumulate(acc, comp, a_rows, stride_sk, mask_m, b_cols, stride_bk, mask_n,
                                            0, K, BLOCK_K, EVEN_K, "", FP32_PRECISION)
        mask = tl.where(ready, mask_m, False)[:, None] & mask_n[None, :]
        c_ptrs = c + offset_i64(src * m + rows, stride_cm)[:, None] + offset_i64(cols, stride_cn)[None, :]
        tl.store(c_ptrs, cast_for_store(acc, c.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "max_spins"])
def fetch_gemm_kernel(
    a_shard, data, peer_offsets, stage, a_out, b, c, flags, epoch_ptr, errors,
    rank, world, m, N, K,
    stride_sm, stride_sk, stride_om, stride_ok, stride_bk, stride_bn, stride_cm, stride_cn,
    num_fetchers, num_gemm, max_spins,
    READY_WORD: tl.constexpr, FETCH_WORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_BLOCKS_PER_FLAG: tl.constexpr, FETCH_BLOCK_K: tl.constexpr, DO_FETCH: tl.constexpr, STAGE_OWN: tl.constexpr,
    HAS_A_OUT: tl.constexpr, EVEN_K: tl.constexpr, PEER_ALIGN: tl.constexpr, FP32_PRECISION: tl.constexpr,
):
    """Programs ``[0, num_fetchers)`` fetch (only with ``DO_FETCH``), the rest compute ``c = A @ b``."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr, volatile=True)
    if pid < num_fetchers:
        _fetch_tiles(pid, num_fetchers, data, peer_offsets, stage, a_out, flags, epoch, errors,
                     rank, world, m, K, stride_sm, stride_sk, stride_om, stride_ok, max_spins,
                     READY_WORD, FETCH_WORD, BLOCK_M, BLOCK_K, K_BLOCKS_PER_FLAG, FETCH_BLOCK_K, STAGE_OWN,
                     HAS_A_OUT, PEER_ALIGN)
    else:
        _gemm_tiles(pid - num_fetchers, num_gemm, a_shard, stage, b, c, flags, epoch, errors,
                    rank, world, m, N, K, stride_sm, stride_sk, stride_bk, stride_bn, stride_cm, stride_cn,
                    max_spins, READY_WORD, FETCH_WORD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                    K_BLOCKS_PER_FLAG, DO_FETCH, EVEN_K, FP32_PRECISION)


# ----------------------------------------------------------------------------------------------------
# host side

# workspace -> {dtype: int64 [world] element offsets from the own data area to each rank's}
_PEER_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _peer_offsets(ws, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Element offsets from this rank's data area to every rank's (device int64 ``[world]``; built
    once per workspace and dtype, so a captured CUDA graph keeps reading the same tensor) and the
    alignment, in elements, that all of them share (16 bytes when possible)."""
    cached = _PEER_OFFSETS.setdefault(ws, {})
    if dtype not in cached:
        size = torch.empty((), dtype=dtype).element_size()
        own = ws.data(ws.rank, (1,), torch.uint8).data_ptr()
        deltas = [ws.data(p, (1,), torch.uint8).data_ptr() - own for p in range(ws.world_size)]
        if any(d % size for d in deltas):
            raise ValueError(f"tk.dist fetch: the ranks' data areas are not {size}-byte aligned to each other")
        align = 16 // size if all(d % 16 == 0 for d in deltas) else 1
        cached[dtype] = (torch.tensor([d // size for d in deltas], dtype=torch.int64, device=ws.device), align)
    return cached[dtype]


def _check_shard(ws, a_shard) -> None:
    check_matrix("a_shard", a_shard, device=ws.device)
    if a_shard.dtype not in DTYPES:
        raise TypeError(f"a_shard must be float16, bfloat16 or float32, got {a_shard.dtype}")
    if not a_shard.is_contiguous():
        raise ValueError("a_shard must be contiguous (row-major [m, K])")
    if a_shard.shape[0] < 1 or a_shard.shape[1] < 1:
        raise ValueError(f"a_shard must have at least one row and column, got shape {tuple(a_shard.shape)}")


def fetch_publish(ws, a_shard: torch.Tensor) -> None:
    """Steps 1 of the protocol: begin the call, put the own shard into the symmetric data area and
    tell every peer it is there."""
    _check_shard(ws, a_shard)
    m, K = a_shard.shape
    ws.require(m * K * a_shard.element_size(), "all_gather_matmul(algorithm='fetch')'s A shard")
    ws.begin()
    ws.data(ws.rank, (m, K), a_shard.dtype).copy_(a_shard)
    for peer in range(ws.world_size):
        if peer != ws.rank:
            ws.signal(peer, READY + ws.rank)


def _check_compute(ws, a_shard, bs, outs, a_out, layout) -> None:
    _check_shard(ws, a_shard)
    m, K = a_shard.shape
    rows = ws.world_size * m
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'k' (k-contiguous staging) or 'm' (m-contiguous), got {layout!r}")
    if not isinstance(bs, (list, tuple)) or not isinstance(outs, (list, tuple)):
        raise TypeError("bs and outs must be lists of tensors")
    if len(bs) < 1 or len(bs) != len(outs):
        raise ValueError(f"bs and outs must be non-empty and of one length, got {len(bs)} and {len(outs)}")
    for i, (b, out) in enumerate(zip(bs, outs)):
        check_matrix(f"bs[{i}]", b, dtype=a_shard.dtype, device=ws.device)
        if b.shape[0] != K:
            raise ValueError(f"bs[{i}] must be [K, N] with K = {K}, got shape {tuple(b.shape)}")
        check_matrix(f"outs[{i}]", out, device=ws.device)
        if tuple(out.shape) != (rows, b.shape[1]):
            raise ValueError(f"outs[{i}] must be [world*m, N] = [{rows}, {b.shape[1]}], got {tuple(out.shape)}")
        if out.dtype not in DTYPES:
            raise TypeError(f"outs[{i}] must be float16, bfloat16 or float32, got {out.dtype}")
    if a_out is not None:
        check_matrix("a_out", a_out, dtype=a_shard.dtype, device=ws.device)
        if tuple(a_out.shape) != (rows, K):
            raise ValueError(f"a_out must be [world*m, K] = [{rows}, {K}], got {tuple(a_out.shape)}")


def _flag_groups(cfg: FetchConfig, world: int, m: int, K: int) -> int:
    """k_blocks_per_flag, doubled until the staging flags fit the workspace's FETCH words."""
    per_flag = cfg.k_blocks_per_flag
    tiles = world * cdiv(m, cfg.block_m)
    while tiles * cdiv(K, cfg.block_k * per_flag) > FLAG_WORDS - FETCH:
        if per_flag * cfg.block_k >= K:
            raise ValueError(f"tk.dist fetch: {tiles} m-tiles need more staging flags than the workspace's "
                             f"{FLAG_WORDS - FETCH}; use a larger block_m")
        per_flag *= 2
    return per_flag


def fetch_compute(ws, a_shard: torch.Tensor, bs, outs, a_out: torch.Tensor | None = None, *,
                  layout: str = "k", config: FetchConfig | None = None) -> None:
    """Steps 2-5 of the protocol: the fused launches (the first fetches), then ``ws.end()``.

    ``a_out`` receives the gathered A (any strides; when they match ``layout`` it is the staging
    buffer itself), or None (staging is a temporary). Under the interpreter a wait that gave up raises
    ``TimeoutError`` here, after ``end``.
    """
    _check_compute(ws, a_shard, bs, outs, a_out, layout)
    _launch(ws, a_shard, bs, outs, a_out, layout, config)


def _launch(ws, a_shard, bs, outs, a_out, layout, config) -> None:
    m, K = a_shard.shape
    world, rank, device = ws.world_size, ws.rank, ws.device
    rows = world * m
    cfg = config or default_config(a_shard.dtype, device)
    stage_strides = (K, 1) if layout == "k" else (1, rows)
    if a_out is not None and a_out.stride() == stage_strides:
        stage, has_a_out = a_out, False
    else:
        stage = torch.empty_strided((rows, K), stage_strides, dtype=a_shard.dtype, device=device)
        has_a_out = a_out is not None
    stage_own = a_out is not None
    a_out_arg = a_out if has_a_out else stage
    k_blocks_per_flag = _flag_groups(cfg, world, m, K)
    peer_offsets, peer_align = _peer_offsets(ws, a_shard.dtype)

    resident = _runtime.sm_count(device) * cfg.programs_per_sm
    tiles_per_rank = cdiv(m, cfg.block_m)
    fetch_items = (world - 1 + stage_own) * tiles_per_rank * cdiv(K, cfg.block_k * k_blocks_per_flag)
    wanted_fetchers = cfg.num_fetchers if cfg.num_fetchers is not None else max(1, resident // 8)
    if fetch_items and resident < 2:
        raise ValueError("tk.dist fetch needs at least two resident programs (a fetcher and a GEMM program)")
    precision = _runtime.fp32_precision() if a_shard.dtype == torch.float32 else "tf32"
    for i, (b, out) in enumerate(zip(bs, outs)):
        first = i == 0
        num_fetchers = min(fetch_items, wanted_fetchers, resident - 1) if first else 0
        gemm_tiles = world * tiles_per_rank * cdiv(b.shape[1], cfg.block_n)
        num_gemm = min(gemm_tiles, resident - num_fetchers)
        if num_fetchers + num_gemm == 0:
            continue
        fetch_gemm_kernel[(num_fetchers + num_gemm,)](
            a_shard, ws.data(rank, (m, K), a_shard.dtype), peer_offsets, stage, a_out_arg, b, out,
            ws.flags, ws.epoch, ws.errors,
            rank, world, m, b.shape[1], K,
            stage.stride(0), stage.stride(1), a_out_arg.stride(0), a_out_arg.stride(1),
            b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            num_fetchers, num_gemm, ws.spins(),
            READY_WORD=READY, FETCH_WORD=FETCH,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            K_BLOCKS_PER_FLAG=k_blocks_per_flag, FETCH_BLOCK_K=cfg.fetch_block_k, DO_FETCH=first, STAGE_OWN=stage_own, HAS_A_OUT=has_a_out,
            EVEN_K=K % cfg.block_k == 0, PEER_ALIGN=peer_align, FP32_PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    ws.end()
    ws.check_if_interpreted()


def fetch_all_gather_matmul(ws, a_shard: torch.Tensor, bs, outs, a_out: torch.Tensor | None = None, *,
                            layout: str = "k", config: FetchConfig | None = None) -> None:
    """``outs[i] = all_gather(a_shard, dim 0) @ bs[i]`` and, with ``a_out``, the gathered A, by the
    fetch algorithm on workspace ``ws`` (the protocol is this module's docstring).

    a_shard: ``[m, K]`` contiguous fp16/bf16/fp32 on ``ws.device``; bs: ``[K, N_i]``, any strides;
    outs: ``[world*m, N_i]`` to fill; a_out: ``[world*m, K]`` or None; layout: staging buffer
    k-contiguous ("k", row-major) or m-contiguous ("m", column-major).
    """
    _check_compute(ws, a_shard, bs, outs, a_out, layout)  # before publishing: a bad call leaves no trace
    fetch_publish(ws, a_shard)
    _launch(ws, a_shard, bs, outs, a_out, layout, config)
