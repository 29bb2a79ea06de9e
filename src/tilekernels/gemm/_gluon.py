"""tk.gemm's Hopper kernel for the large 128x256x64 tile (Gluon): plain, with the fused epilogue, and with async input.

``gemm.py`` sends a launch here where the plan takes the large tile on sm_90 and this kernel reads the operands
(``applies``; ``TILEKERNELS_GEMM_GLUON=0`` keeps gemm_kernel). Why Gluon: its main loop ran 0.8-2.5% faster than
``_kernels.gemm_kernel``'s on the large anchor shapes and equalled cuBLAS bit for bit (H100, bf16, CUDA graphs,
2026-12-07; benchmarks/NOTES.md, forty-sixth session). Shared memory and barriers are explicit:

- one loader warp: A ``[128, 64]`` and B ``[64, 256]`` into a ring of ``STAGES`` slots (``ready`` / ``empty``
  barriers, as the attention kernels' rings). With async input it first waits for the chunks of A that the tile's
  rows touch (``scheduler``'s protocol: pivoted row tile, acquire, bounded polls, the error table) and tells
  the I/O warp, through the ``missed`` ring in shared memory, whether a wait gave up on the tile;
- two consumer warpgroups (the default partition and one worker): warpgroup ``W`` owns rows ``W * 64 ...`` of
  the 128x256 tile, m64n256 wgmma over the whole K range, then the epilogue on its 64x256 half: bias,
  activation, ``+ beta * residual`` read from its half of ``io`` (a ``[2, 64, 256]`` buffer), the result
  written back over the residual it read (each thread rewrites the elements it loaded, so no thread waits
  for another), a proxy fence, and ``c_full[W]``;
- one I/O warp: for each tile, the residual halves into ``io`` (``res_ready``), then, as each consumer
  signals ``c_full``, C's half out of the same buffer by TMA, ``store_wait``, and at once the next tile's
  residual half into it (requested at the start of the next tile's K loop, it lands long before its epilogue).
  With async input it skips the store of a tile that the ``missed`` ring marks.

Fetching the residual ahead gained nothing against gemm_kernel's fused epilogue, and nor did running half the
epilogue under the next tile's first K steps (since removed): what the fused epilogue costs is its arithmetic
while no wgmma is issued (NOTES, forty-sixth session). Two more warps doing that epilogue in place in ``io``
while the consumers went on timed level (668 TFLOP/s both, 8192^3, H100, graphs; forty-eighth session; removed).

Shared memory at 3 stages: 3 x 48 KiB of ring + 64 KiB of ``io`` = 208 KiB (C needs no buffer of its own), and
1 KiB of ``missed`` ring with async input.
Only bf16/fp16, A row-major, B row- or column-major, C and the residual row-major, a bias ``[N]``, split-K 1.
"""

import torch

from .._runtime import cdiv
from ._kernels import apply_activation

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # triton 3.9 renamed the TMA copies (the old names raise there); 3.6 has only the old ones
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

if HAVE_GLUON:
    BLOCK_M = gl.constexpr(128)
    BLOCK_N = gl.constexpr(256)
    BLOCK_K = gl.constexpr(64)
    HALF_M = gl.constexpr(64)
    # Slots of the ring in which the loader tells the I/O warp which of its tiles a wait gave up on (async
    # input), one per tile, slot t % MISSED_RING. The loader is ahead of the I/O warp by fewer tiles: the
    # consumers finish tile t + 1 only after the I/O warp has stored tile t (res_ready), and the loader is at most
    # STAGES K steps (so tiles) ahead of the consumers: at most STAGES + 2 < 8.
    MISSED_RING = gl.constexpr(8)

    @gluon.jit
    def _tile_mn(tile_id, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M: gl.constexpr,
                 ASYNC_INPUT: gl.constexpr):
        """Grouped raster over ``tiles_m`` row tiles, as ``scheduler.tile_coords``: GROUP_M row tiles walk the
        columns together. With ``ASYNC_INPUT`` the row tile is pivoted, ``(m + pivot_tile_m) % tiles_m_all`` (A's
        row tiles; ``tiles_m`` may be fewer where a row tail computes the last in this order): every partition
        takes the one pivoted index for the rows it waits for, reads and writes."""
        tiles_in_group = GROUP_M * tiles_n
        group_id = tile_id // tiles_in_group
        first_m = group_id * GROUP_M
        group_size_m = gl.minimum(tiles_m - first_m, GROUP_M)
        in_group = tile_id % tiles_in_group
        pid_m = first_m + in_group % group_size_m
        if ASYNC_INPUT:
            pid_m = (pid_m + pivot_tile_m) % tiles_m_all
        return pid_m, in_group // group_size_m

    @gluon.jit
    def _lanes_max(x):
        """The largest of a warp's 32 values, as a scalar (every lane holds the same value here)."""
        return gl.max(x, axis=0)

    @gluon.jit
    def _acquire(ptrs, lane0):
        """The signal word at ``ptrs`` (the same address in every lane), read by lane 0 alone with an acquire at
        system scope and broadcast to the warp, then ``bar.warp.sync``, which orders the warp's later accesses
        (the TMA loads, whichever lane issues them) behind that acquire: one atomic per wait, as
        ``scheduler._poll``'s one thread and CTA barrier. (Every lane's own atomic timed the same, H100,
        2026-12-07; fewer system-scope atomics is what ``scheduler.wait_chunk``'s note on copies asks for.)"""
        got = gl.atomic_add(ptrs, gl.zeros_like(lane0.to(gl.int32)), mask=lane0, sem="acquire", scope="sys")
        got = gl.where(lane0, got, 0)
        gl.inline_asm_elementwise("bar.warp.sync -1; mov.u32 $0, 0;", "=r,r", [got], dtype=gl.int32,
                                  is_pure=False, pack=1)
        return gl.sum(got.to(gl.int64), axis=0)

    @gluon.jit
    def _wait_chunk(signals, errors, chunk, signal_value, max_spins):
        """``scheduler.wait_chunk`` for the one-warp loader: True once ``signals[chunk] >= signal_value``, False
        after ``max_spins`` polls (then ``errors[1 + chunk]`` and ``errors[0]`` are set), or at once if an
        earlier wait gave up on the chunk. The acquires are ``_acquire``'s; the polls between them are volatile
        loads of one word by the whole warp (one transaction), so every lane holds the same value and the warp
        takes one branch. ``errors`` is pinned host memory: read only on this slow path."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        zero = gl.zeros([32], gl.int32, lanes)
        lane0 = gl.arange(0, 32, layout=lanes) == 0
        ptrs = signals + chunk + zero
        seen = _acquire(ptrs, lane0)
        ready = seen >= signal_value
        if seen < signal_value:
            gave_up = _lanes_max(gl.load(errors + 1 + chunk + zero, volatile=True)) != 0
            spins = gl.where(gave_up, max_spins, 0)
            # volatile polls and one acquire at the end, as scheduler.wait_chunk (why there)
            while (seen < signal_value) & (spins < max_spins):
                gl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r,r", [zero], dtype=gl.int32,
                                          is_pure=False, pack=1)
                seen = _lanes_max(gl.load(ptrs, volatile=True).to(gl.int64))
                spins += 1
            seen = _acquire(ptrs, lane0)
            ready = seen >= signal_value
            if seen < signal_value:
                gl.store(errors + 1 + chunk + zero, zero + 1)
                gl.store(errors + zero, zero + 1)
        return ready

    @gluon.jit
    def _widen(x):
        """16-bit ``x`` as float32: a bf16 pair (one register) by one shift and one mask, where the conversion
        took three instructions a pair (H100 SASS, triton 3.6); fp16 by its conversion."""
        if x.dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [x],
                                             dtype=gl.float32, is_pure=True, pack=2)
        return x.to(gl.float32)

    @gluon.jit
    def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, missed, M, tiles_m, tiles_n, k_tiles, num_tiles,
                pivot_tile_m, tiles_m_all, signals, errors, rows_per_chunk, signal_value, max_spins,
                GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr, ASYNC_INPUT: gl.constexpr):
        """One warp: A and B of every K step of every tile of this program, in the consumers' order. With
        ``ASYNC_INPUT`` it first waits for every chunk of A that the tile's rows touch (``scheduler``'s protocol);
        a tile whose chunk never came reads A from row M on (zeros), and its slot of the ``missed`` ring tells
        the I/O warp not to store it."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        step = 0
        t = 0
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M, ASYNC_INPUT)
            off_m = pid_m * BLOCK_M
            if ASYNC_INPUT:
                last = gl.minimum(M, off_m + BLOCK_M) - 1
                arrived = True
                for chunk in range(off_m // rows_per_chunk, last // rows_per_chunk + 1):
                    arrived = arrived & _wait_chunk(signals, errors, chunk, signal_value, max_spins)
                if not arrived:
                    off_m = M
                # written before this tile's first load is armed (mbarrier.expect: a release), so the I/O warp,
                # behind the consumers' c_full, reads it (see MISSED_RING)
                missed.index(t % MISSED_RING).store(gl.zeros([32], gl.int32, lanes) + (off_m == M).to(gl.int32))
            t += 1
            for ki in range(k_tiles):
                s = step % STAGES
                # a fresh barrier counts its (non-existent) previous phase as complete: the first lap passes
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [off_m, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
                if B_TRANS:
                    _tma_load(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
                else:
                    _tma_load(b_desc, [ki * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                step += 1

    @gluon.jit
    def _io(r_desc, c_desc, io, res_ready, c_full, missed, tiles_m, tiles_n, num_tiles, pivot_tile_m, tiles_m_all,
            GROUP_M: gl.constexpr, HAS_RESIDUAL: gl.constexpr, ASYNC_INPUT: gl.constexpr):
        """One warp: each half tile's residual into ``io``, C out of it once the consumer has written it there,
        then the next tile's residual into the freed half. ``res_ready[w]`` says that half ``w`` of ``io`` holds
        the tile's residual, or without one, that it is free (C's last store from it has drained). With
        ``ASYNC_INPUT`` a tile whose chunk a wait gave up on is not stored: the loader's slot of the ``missed``
        ring says so (shared memory: the error table is pinned host memory, and reading it here for every tile
        ran the GEMM at a third of its speed, H100, 2026-12-07)."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        t = 0
        first = gl.program_id(0)
        if first < num_tiles:
            pid_m, pid_n = _tile_mn(first, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M, ASYNC_INPUT)
            for w in gl.static_range(2):
                _fill(r_desc, io, res_ready, w, pid_m, pid_n, HAS_RESIDUAL)
        for tile_id in range(first, num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M, ASYNC_INPUT)
            next_id = tile_id + gl.num_programs(0)
            next_m, next_n = _tile_mn(next_id, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M, ASYNC_INPUT)
            for w in gl.static_range(2):
                mbarrier.wait(c_full.index(w), t & 1)
                store = True
                if ASYNC_INPUT:
                    store = gl.max(missed.index(t % MISSED_RING).load(lanes), axis=0) == 0
                if store:
                    _tma_store(c_desc, [pid_m * BLOCK_M + w * HALF_M, pid_n * BLOCK_N], io.index(w))
                    tma.store_wait(0)
                if next_id < num_tiles:
                    _fill(r_desc, io, res_ready, w, next_m, next_n, HAS_RESIDUAL)
            t += 1

    @gluon.jit
    def _fill(r_desc, io, res_ready, w: gl.constexpr, pid_m, pid_n, HAS_RESIDUAL: gl.constexpr):
        """Half ``w`` of ``io`` for tile ``(pid_m, pid_n)``: its residual rows by TMA, or, without a residual,
        only the signal that the half is free."""
        if HAS_RESIDUAL:
            mbarrier.expect(res_ready.index(w), r_desc.block_type.nbytes)
            _tma_load(r_desc, [pid_m * BLOCK_M + w * HALF_M, pid_n * BLOCK_N], res_ready.index(w), io.index(w))
        else:
            mbarrier.arrive(res_ready.index(w))

    @gluon.jit
    def _b_operand(b_bufs, s, B_TRANS: gl.constexpr):
        """Stage ``s`` of B as the ``[BLOCK_K, BLOCK_N]`` operand of wgmma (a transposed view of a K-major tile)."""
        if B_TRANS:
            return b_bufs.index(s).permute((1, 0))
        else:
            return b_bufs.index(s)

    @gluon.jit
    def _k_step(W: gl.constexpr, a_bufs, b_bufs, ready, empty, acc, step, prev, later, STAGES: gl.constexpr,
                B_TRANS: gl.constexpr):
        """One K step of warpgroup ``W``: wait for the stage, issue the wgmma, retire the previous one and, on a
        tile's ``later`` steps, free the previous one's stage. A tile's first step does not read ``acc`` (the last
        tile's, never zeroed). Returns (acc, step + 1, this step's stage)."""
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        tok = warpgroup_mma(a_bufs.index(s).slice(W * HALF_M, HALF_M, dim=0), _b_operand(b_bufs, s, B_TRANS), acc,
                            use_acc=later, is_async=True)
        # the previous step's product is done once one group is left in flight: its slot is free
        acc = warpgroup_mma_wait(1, deps=(tok,))
        if later:
            mbarrier.arrive(empty.index(prev))
        return acc, step + 1, s

    @gluon.jit
    def _bias_cols(bias_ptr, col0, N, layout: gl.constexpr):
        """The bias of columns ``col0 ... col0 + 127`` in the columns' slice of ``layout``, in its own dtype."""
        cols = col0 + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(0, layout))
        return gl.load(bias_ptr + cols, mask=cols < N, other=0.0)

    @gluon.jit
    def _epilogue_part(vals, part, bias, beta, layout: gl.constexpr, HAS_BIAS: gl.constexpr,
                       ACTIVATION: gl.constexpr, HAS_RESIDUAL: gl.constexpr, UNIT_BETA: gl.constexpr):
        """bias (``_bias_cols``), activation and ``+ beta * residual`` on the fp32 columns of a half tile; the
        residual is read from ``part`` (its place in ``io``) and the result written back there. ``UNIT_BETA``:
        beta is 1, and the residual is added without its multiply."""
        out = gl.convert_layout(vals, layout)
        if HAS_BIAS:
            out = out + gl.expand_dims(_widen(bias), 0)
        # the 16-bit forms (bf16: the coarse GELU), the same code as gemm_kernel's epilogue
        out = apply_activation(out, ACTIVATION, True, part.dtype.is_bf16())
        if HAS_RESIDUAL:
            if UNIT_BETA:
                out = out + _widen(part.load(layout))
            else:
                out = out + beta * _widen(part.load(layout))
        part.store(out.to(part.dtype))

    @gluon.jit
    def _split_cols(x):
        """``x [R, C]`` as its column halves ``(x[:, :C/2], x[:, C/2:])``."""
        return x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute(0, 2, 1).split()

    @gluon.jit
    def _consumer(W: gl.constexpr, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta,
                  tiles_m, tiles_n, k_tiles, num_tiles, pivot_tile_m, tiles_m_all, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                  HAS_RESIDUAL: gl.constexpr, UNIT_BETA: gl.constexpr, ASYNC_INPUT: gl.constexpr):
        """One warpgroup: rows ``W * 64 ...`` of every tile of this program, then the epilogue of its half tile
        into its half of ``io``."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BLOCK_N // 2, 16])
        HALF_N: gl.constexpr = BLOCK_N // 2
        step = 0
        t = 0
        # zeroed once: each tile's first wgmma overwrites it (use_acc=False) instead of 64 CS2R a thread a tile
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            _, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, pivot_tile_m, tiles_m_all, GROUP_M, ASYNC_INPUT)
            prev = 0
            for ki in range(k_tiles):
                acc, step, prev = _k_step(W, a_bufs, b_bufs, ready, empty, acc, step, prev, ki > 0, STAGES, B_TRANS)
            col = pid_n * BLOCK_N
            bias_left = 0.0
            bias_right = 0.0
            if HAS_BIAS:
                # requested while the last wgmma runs, off the epilogue's path: bias alone 681 -> 688 TFLOP/s at
                # 4096^3, 698 -> 700 at 8192^3 (H100, graphs, 2026-12-07), output bit for bit the same
                bias_left = _bias_cols(bias_ptr, col, N, half_layout)
                bias_right = _bias_cols(bias_ptr, col + HALF_N, N, half_layout)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(prev))

            # this tile's residual is in (without one: the last C store from this half has drained)
            mbarrier.wait(res_ready.index(W), t & 1)
            left, right = _split_cols(acc)
            _epilogue_part(left, io.index(W).slice(0, HALF_N, dim=1), bias_left, beta, half_layout, HAS_BIAS,
                           ACTIVATION, HAS_RESIDUAL, UNIT_BETA)
            _epilogue_part(right, io.index(W).slice(HALF_N, HALF_N, dim=1), bias_right, beta, half_layout, HAS_BIAS,
                           ACTIVATION, HAS_RESIDUAL, UNIT_BETA)
            fence_async_shared()
            mbarrier.arrive(c_full.index(W))
            t += 1

    @gluon.jit(do_not_specialize=["signal_value", "max_spins"])
    def fused_gemm_kernel(a_desc, b_desc, c_desc, r_desc, bias_ptr, signals, errors, M, N, K, tiles_m, pivot_tile_m,
                          rows_per_chunk, signal_value, max_spins, beta, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                          UNIT_BETA: gl.constexpr, B_TRANS: gl.constexpr, ASYNC_INPUT: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
        """``C = act(A @ B + bias) + beta * residual``, persistent over 128x256 tiles (module docstring), over
        the first ``tiles_m`` row tiles of the grouped raster (pivoted with ``ASYNC_INPUT``)."""
        dtype: gl.constexpr = a_desc.dtype
        tiles_m_all = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_tiles = tiles_m * tiles_n

        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        if B_TRANS:
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        io = gl.allocate_shared_memory(dtype, [2, HALF_M, BLOCK_N], c_desc.layout)
        if ASYNC_INPUT:
            missed = gl.allocate_shared_memory(gl.int32, [MISSED_RING, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            missed = io   # not read
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        res_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        c_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)   # both consumer warpgroups release a slot
        for w in gl.static_range(2):
            mbarrier.init(res_ready.index(w), count=1)
            mbarrier.init(c_full.index(w), count=1)
        fence_async_shared()

        gl.warp_specialize([
            (_consumer, (0, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta, tiles_m, tiles_n,
                         k_tiles, num_tiles, pivot_tile_m, tiles_m_all, GROUP_M, STAGES, B_TRANS, HAS_BIAS, ACTIVATION,
                         HAS_RESIDUAL, UNIT_BETA, ASYNC_INPUT)),
            (_consumer, (1, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta, tiles_m, tiles_n,
                         k_tiles, num_tiles, pivot_tile_m, tiles_m_all, GROUP_M, STAGES, B_TRANS, HAS_BIAS, ACTIVATION,
                         HAS_RESIDUAL, UNIT_BETA, ASYNC_INPUT)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, missed, M, tiles_m, tiles_n, k_tiles, num_tiles,
                       pivot_tile_m, tiles_m_all, signals, errors, rows_per_chunk, signal_value, max_spins, GROUP_M,
                       STAGES, B_TRANS, ASYNC_INPUT)),
            (_io, (r_desc, c_desc, io, res_ready, c_full, missed, tiles_m, tiles_n, num_tiles, pivot_tile_m,
                   tiles_m_all, GROUP_M, HAS_RESIDUAL, ASYNC_INPUT)),
        ], [4, 1, 1], [CONSUMER_REGS, WORKER_REGS, WORKER_REGS])

def _descriptor(t: torch.Tensor, block_shape):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    elem = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), elem)
    return GluonDescriptor(t, list(t.shape), list(t.stride()), list(block_shape), layout)


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether a 16-bit ``[R, C]`` tensor is row-major as a TMA descriptor needs it: unit column stride, rows
    16 bytes apart, 16-byte aligned."""
    return t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _b_readable(b: torch.Tensor) -> bool:
    """Whether B is row-major as ``_tma_rows`` needs, or column-major the same way (read as ``b.t()``)."""
    return _tma_rows(b) or (b.stride(0) == 1 and b.stride(1) % 8 == 0 and b.data_ptr() % 16 == 0)


def _b_trans(b: torch.Tensor) -> bool:
    """Whether the kernel reads B through ``b.t()`` (column-major B; ``_b_readable`` holds)."""
    return not _tma_rows(b)


def _constexprs(bias, activation, residual, b_trans: bool, group_m: int = 8, async_input: bool = False,
                unit_beta: bool = False) -> dict:
    """The kernel's constexprs for one launch: ``group_m`` row tiles a group, 3 stages (the fourth's room is
    ``io``), whether beta is 1 (with a residual), the async-input form or not, and registers per thread for the
    consumers and the two one-warp workers."""
    return dict(GROUP_M=group_m, STAGES=3, HAS_BIAS=bias is not None, ACTIVATION=activation or "none",
                HAS_RESIDUAL=residual is not None, UNIT_BETA=residual is not None and unit_beta, B_TRANS=b_trans,
                ASYNC_INPUT=async_input, CONSUMER_REGS=232, WORKER_REGS=40)


def applies(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b) -> bool:
    """Whether this kernel computes ``tk.gemm``'s call (its caller has settled the launch: the large tile, split-K 1;
    async input as ``gemm._gluon_takes`` allows): Hopper, 16-bit A row-major, B row- or column-major, C and the
    residual row-major of the inputs' dtype, a bias ``[N]`` at most, no ``mul``, scales or alpha."""
    return HAVE_GLUON and a.is_cuda and _reads(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b)


def _reads(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b) -> bool:
    """``applies`` on any device (an offline build compiles for CPU tensors)."""
    if not (a.dtype in (torch.bfloat16, torch.float16) and c.dtype == a.dtype and not mul and scale_a is None
            and scale_b is None and alpha == 1.0 and a.shape[1] >= 1):
        return False
    if not (_tma_rows(a) and _tma_rows(c)):
        return False
    if not _b_readable(b):
        return False
    N = b.shape[1]
    if bias is not None and not (bias.dim() == 1 and bias.shape[0] == N and bias.stride(0) == 1):
        return False
    if residual is not None and not (residual.shape == c.shape and residual.dtype == c.dtype and _tma_rows(residual)):
        return False
    return activation in (None, "relu", "gelu", "gelu_tanh", "silu")


class GluonPlan:
    """One launch of ``fused_gemm_kernel`` for one ``tk.gemm`` call signature: the ``CachedLaunch``, descriptor
    templates of A, B, C and the residual (C's when there is none), the rows of the views it reads and writes
    (a prefix of A's; all of them with async input) and whether B is read transposed."""

    __slots__ = ("launch", "descs", "rows", "b_trans", "ints")


def make_plan(a, b, c, bias, residual, activation, rows: int, num_sms: int, group_m: int = 8,
              async_tiles=None, unit_beta: bool = False) -> GluonPlan:
    """The plan for ``c = act(a @ b + bias) + beta * residual`` (``applies`` holds) over rows ``[0, rows)``, or
    with ``async_tiles`` = (rows per chunk, pivot row tile, skip) over A's row tiles from the pivot tile on but the
    last ``skip`` (a row tail computes those)."""
    from .._runtime import CachedLaunch, as_template

    K, N = a.shape[1], b.shape[1]
    plan = GluonPlan()
    plan.rows = rows
    plan.b_trans = _b_trans(b)
    a_rows, c_rows = a[:rows], c[:rows]
    res = residual[:rows] if residual is not None else c_rows
    b_desc = (_descriptor(b.t(), [BLOCK_N.value, BLOCK_K.value]) if plan.b_trans
              else _descriptor(b, [BLOCK_K.value, BLOCK_N.value]))
    plan.descs = tuple(as_template(d) for d in (
        _descriptor(a_rows, [BLOCK_M.value, BLOCK_K.value]), b_desc, _descriptor(c_rows, [HALF_M.value, BLOCK_N.value]),
        _descriptor(res, [HALF_M.value, BLOCK_N.value])))
    rows_per_chunk, pivot_tile_m, skip = async_tiles if async_tiles is not None else (0, 0, 0)
    tiles_m = cdiv(rows, BLOCK_M.value) - skip
    plan.ints = (rows, N, K, tiles_m, pivot_tile_m, rows_per_chunk)
    tiles = tiles_m * cdiv(N, BLOCK_N.value)
    plan.launch = CachedLaunch(fused_gemm_kernel, max(1, min(tiles, num_sms)),
                               _constexprs(bias, activation, residual, plan.b_trans, group_m, async_tiles is not None,
                                           unit_beta), num_warps=4)
    return plan


def launch_args(plan: GluonPlan, a, b, c, bias, residual, beta: float, signals=None, errors=None, signal_value=0,
                max_spins=0) -> tuple:
    """The runtime arguments of ``plan.launch`` for one call (the last four: its async input's, or none)."""
    from .._runtime import rebase

    rows = plan.rows
    c_rows = c[:rows]
    a_desc, b_desc, c_desc, r_desc = plan.descs
    return (rebase(a_desc, a[:rows]), rebase(b_desc, b.t() if plan.b_trans else b), rebase(c_desc, c_rows),
            rebase(r_desc, residual[:rows] if residual is not None else c_rows), bias if bias is not None else c,
            signals if signals is not None else c, errors if errors is not None else c, *plan.ints, signal_value,
            max_spins, beta)


def _launch(a, b, bias, activation, residual, beta, num_sms, group_m, out, async_words=None):
    """(grid, arguments, constexprs and options) of one launch and its output; ``async_words``: int32 signals and
    error table to compile the async-input form with (``compile_only``). ValueError naming the operand this kernel
    does not read."""
    if not HAVE_GLUON:
        raise RuntimeError("fused_gemm: this triton has no Gluon")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fused_gemm: a must be bfloat16 or float16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise ValueError(f"fused_gemm: b must have a's dtype {a.dtype}, got {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.shape[1] < 1:
        raise ValueError(f"fused_gemm: a [M, K] and b [K, N] with K >= 1, got {tuple(a.shape)} and {tuple(b.shape)}")
    if not _tma_rows(a):
        raise ValueError(f"fused_gemm: a must be row-major with rows 16 bytes apart and 16-byte aligned (TMA), got "
                         f"strides {a.stride()}")
    if not _b_readable(b):
        raise ValueError(f"fused_gemm: b must be row- or column-major with rows 16 bytes apart and 16-byte aligned "
                         f"(TMA), got strides {b.stride()}")
    M, N = a.shape[0], b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    # tk.gemm's plan and arguments, so that tests and probes run the descriptors and integers tk.gemm launches with
    plan = make_plan(a, b, c, bias, residual, activation, M, num_sms, group_m,
                     (1000, 0, 0) if async_words else None, beta == 1.0)
    args = launch_args(plan, a, b, c, bias, residual, float(beta), *(async_words or (None, None)), 1 << 20, 1 << 20)
    return c, (plan.launch.grid,), args, dict(plan.launch.constexprs, **plan.launch.options)


def fused_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
               residual: torch.Tensor | None = None, beta: float = 1.0, *, num_sms: int | None = None,
               group_m: int = 8, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(a @ b + bias) + beta * residual`` for row-major bf16/fp16 ``a [M, K]`` and ``b [K, N]`` row- or
    column-major, in one launch of ``fused_gemm_kernel`` with tk.gemm's constexprs (tests and probes; ``tk.gemm``
    plans its launches with ``make_plan``). ValueError naming an operand it does not read."""
    c, grid, args, kwargs = _launch(a, b, bias, activation, residual, beta, num_sms, group_m, out)
    fused_gemm_kernel[grid](*args, **kwargs)
    return c


def compile_only(a, b, bias=None, activation=None, residual=None, beta=1.0, *, group_m=8, async_input=False):
    """The kernel for these arguments compiled on the active triton target as an H100 launch (132 SMs), not
    launched: ``scripts/compile_sm90.py --gluon`` builds it offline; ``async_input``: its async-input form."""
    words = (torch.empty(8, dtype=torch.int32), torch.empty(9, dtype=torch.int32)) if async_input else None
    _, grid, args, kwargs = _launch(a, b, bias, activation, residual, beta, 132, group_m, None, words)
    return fused_gemm_kernel.warmup(*args, grid=grid, **kwargs)


__all__ = ["HAVE_GLUON", "applies", "fused_gemm", "launch_args", "make_plan"]
