"""tk.gemm's Hopper kernel for the large 128x256x64 tile (Gluon), plain and with the fused epilogue.

``gemm.py`` sends a launch here where the plan takes the large tile on sm_90 and this kernel reads the operands
(``applies``; ``TILEKERNELS_GEMM_GLUON=0`` keeps gemm_kernel). Why Gluon: its main loop ran 0.8-2.5% faster than
``_kernels.gemm_kernel``'s on the large anchor shapes and equalled cuBLAS bit for bit (H100, bf16, CUDA graphs,
2026-12-07; benchmarks/NOTES.md, forty-sixth and forty-seventh sessions). Shared memory and barriers are explicit:

- one loader warp: A ``[128, 64]`` and B ``[64, 256]`` into a ring of ``STAGES`` slots (``ready`` / ``empty``
  barriers, as the attention kernels' rings);
- two consumer warpgroups (the default partition and one worker): warpgroup ``W`` owns rows ``W * 64 ...`` of
  the 128x256 tile, m64n256 wgmma over the whole K range, then the epilogue on its 64x256 half: bias,
  activation, ``+ beta * residual`` read from its half of ``io`` (a ``[2, 64, 256]`` buffer), the result
  written back over the residual it read (each thread rewrites the elements it loaded, so no thread waits
  for another), a proxy fence, and ``c_full[W]``;
- one I/O warp: for each tile, the residual halves into ``io`` (``res_ready``), then, as each consumer
  signals ``c_full``, C's half out of the same buffer by TMA, ``store_wait``, and at once the next tile's
  residual half into it (requested at the start of the next tile's K loop, it lands long before its epilogue).

Fetching the residual ahead gained nothing against gemm_kernel's fused epilogue, and nor did running half the
epilogue under the next tile's first K steps (since removed): what the fused epilogue costs is its arithmetic
while no wgmma is issued (NOTES, forty-sixth session).

Shared memory at 3 stages: 3 x 48 KiB of ring + 64 KiB of ``io`` = 208 KiB (C needs no buffer of its own).
Only bf16/fp16, A row-major, B row- or column-major, C and the residual row-major, a bias ``[N]``, split-K 1, no
async input (that stays on gemm_kernel).
"""

import torch

from .._runtime import cdiv

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

    @gluon.jit
    def _tile_mn(tile_id, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Grouped raster, as ``scheduler.tile_coords``: GROUP_M row tiles walk the columns together."""
        tiles_in_group = GROUP_M * tiles_n
        group_id = tile_id // tiles_in_group
        first_m = group_id * GROUP_M
        group_size_m = gl.minimum(tiles_m - first_m, GROUP_M)
        in_group = tile_id % tiles_in_group
        return first_m + in_group % group_size_m, in_group // group_size_m

    @gluon.jit
    def _logistic_times(x, q):
        """``x / (1 + 2^q)`` by ex2.approx and rcp.approx, as ``_kernels._logistic_times`` on a GPU."""
        e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [q], dtype=gl.float32, is_pure=True,
                                      pack=1)
        r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=gl.float32,
                                      is_pure=True, pack=1)
        return x * r

    @gluon.jit
    def _activation(x, ACTIVATION: gl.constexpr):
        """The 16-bit output forms of ``_kernels.apply_activation`` (``SHORT_FORMS``), same constants."""
        if ACTIVATION == "relu":
            x = gl.where(x < 0.0, 0.0, x)
        elif ACTIVATION == "gelu":
            t = gl.minimum(x * x, 36.0)
            p = 5.346370129345479e-09 * t - 3.9003021824463704e-07
            p = p * t + 1.1527107182836388e-05
            p = p * t - 0.00015997022700301174
            p = p * t - 9.32933701122274e-05
            p = p * t + 0.1048345688660696
            p = p * t + 2.302209396871495
            x = _logistic_times(x, -(x * p))
        elif ACTIVATION == "gelu_tanh":
            x = _logistic_times(x, -(x * (x * x * 0.1029432395800235 + 2.302208198144325)))
        elif ACTIVATION == "silu":
            x = _logistic_times(x, x * -1.4426950408889634)
        return x

    @gluon.jit
    def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles_m, tiles_n, k_tiles, num_tiles,
                GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
        """One warp: A and B of every K step of every tile of this program, in the consumers' order."""
        step = 0
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, GROUP_M)
            for ki in range(k_tiles):
                s = step % STAGES
                # a fresh barrier counts its (non-existent) previous phase as complete: the first lap passes
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [pid_m * BLOCK_M, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
                if B_TRANS:
                    _tma_load(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
                else:
                    _tma_load(b_desc, [ki * BLOCK_K, pid_n * BLOCK_N], ready.index(s), b_bufs.index(s))
                step += 1

    @gluon.jit
    def _io(r_desc, c_desc, io, res_ready, c_full, tiles_m, tiles_n, num_tiles, GROUP_M: gl.constexpr,
            HAS_RESIDUAL: gl.constexpr):
        """One warp: each half tile's residual into ``io``, C out of it once the consumer has written it there,
        then the next tile's residual into the freed half. ``res_ready[w]`` says that half ``w`` of ``io`` holds
        the tile's residual, or without one, that it is free (C's last store from it has drained)."""
        t = 0
        first = gl.program_id(0)
        if first < num_tiles:
            pid_m, pid_n = _tile_mn(first, tiles_m, tiles_n, GROUP_M)
            for w in gl.static_range(2):
                _fill(r_desc, io, res_ready, w, pid_m, pid_n, HAS_RESIDUAL)
        for tile_id in range(first, num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, GROUP_M)
            next_id = tile_id + gl.num_programs(0)
            next_m, next_n = _tile_mn(next_id, tiles_m, tiles_n, GROUP_M)
            for w in gl.static_range(2):
                mbarrier.wait(c_full.index(w), t & 1)
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
    def _k_step(W: gl.constexpr, a_bufs, b_bufs, ready, empty, acc, step, prev, release, STAGES: gl.constexpr,
                B_TRANS: gl.constexpr):
        """One K step of warpgroup ``W``: wait for the stage, issue the wgmma, retire the previous one and, if
        ``release``, free its stage. Returns (acc, step + 1, this step's stage)."""
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        tok = warpgroup_mma(a_bufs.index(s).slice(W * HALF_M, HALF_M, dim=0), _b_operand(b_bufs, s, B_TRANS), acc,
                            is_async=True)
        # the previous step's product is done once one group is left in flight: its slot is free
        acc = warpgroup_mma_wait(1, deps=(tok,))
        if release:
            mbarrier.arrive(empty.index(prev))
        return acc, step + 1, s

    @gluon.jit
    def _epilogue_part(vals, part, col0, bias_ptr, N, beta, layout: gl.constexpr, HAS_BIAS: gl.constexpr,
                       ACTIVATION: gl.constexpr, HAS_RESIDUAL: gl.constexpr):
        """bias, activation and ``+ beta * residual`` on the fp32 columns ``col0 ...`` of a half tile; the
        residual is read from ``part`` (its place in ``io``) and the result written back there."""
        out = gl.convert_layout(vals, layout)
        if HAS_BIAS:
            cols = col0 + gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, layout))
            bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
            out = out + gl.expand_dims(bias.to(gl.float32), 0)
        out = _activation(out, ACTIVATION)
        if HAS_RESIDUAL:
            out = out + beta * part.load(layout).to(gl.float32)
        part.store(out.to(part.dtype))

    @gluon.jit
    def _split_cols(x):
        """``x [R, C]`` as its column halves ``(x[:, :C/2], x[:, C/2:])``."""
        return x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute(0, 2, 1).split()

    @gluon.jit
    def _consumer(W: gl.constexpr, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta,
                  tiles_m, tiles_n, k_tiles, num_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                  HAS_RESIDUAL: gl.constexpr):
        """One warpgroup: rows ``W * 64 ...`` of every tile of this program, then the epilogue of its half tile
        into its half of ``io``."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BLOCK_N // 2, 16])
        HALF_N: gl.constexpr = BLOCK_N // 2
        step = 0
        t = 0
        for tile_id in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            _, pid_n = _tile_mn(tile_id, tiles_m, tiles_n, GROUP_M)
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
            prev = 0
            for ki in range(k_tiles):
                acc, step, prev = _k_step(W, a_bufs, b_bufs, ready, empty, acc, step, prev, ki > 0, STAGES, B_TRANS)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(prev))

            # this tile's residual is in (without one: the last C store from this half has drained)
            mbarrier.wait(res_ready.index(W), t & 1)
            left, right = _split_cols(acc)
            col = pid_n * BLOCK_N
            _epilogue_part(left, io.index(W).slice(0, HALF_N, dim=1), col, bias_ptr, N, beta, half_layout,
                           HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
            _epilogue_part(right, io.index(W).slice(HALF_N, HALF_N, dim=1), col + HALF_N, bias_ptr, N, beta,
                           half_layout, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
            fence_async_shared()
            mbarrier.arrive(c_full.index(W))
            t += 1

    @gluon.jit
    def fused_gemm_kernel(a_desc, b_desc, c_desc, r_desc, bias_ptr, M, N, K, beta,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                          ACTIVATION: gl.constexpr, HAS_RESIDUAL: gl.constexpr, B_TRANS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, WORKER_REGS: gl.constexpr):
        """``C = act(A @ B + bias) + beta * residual``, persistent over 128x256 tiles (module docstring)."""
        dtype: gl.constexpr = a_desc.dtype
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_tiles = tiles_m * tiles_n

        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        if B_TRANS:
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        else:
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
        io = gl.allocate_shared_memory(dtype, [2, HALF_M, BLOCK_N], c_desc.layout)
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
            (_consumer, (0, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta, tiles_m,
                         tiles_n, k_tiles, num_tiles, GROUP_M, STAGES, B_TRANS, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)),
            (_consumer, (1, a_bufs, b_bufs, io, ready, empty, res_ready, c_full, bias_ptr, N, beta, tiles_m,
                         tiles_n, k_tiles, num_tiles, GROUP_M, STAGES, B_TRANS, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles_m, tiles_n, k_tiles, num_tiles, GROUP_M,
                       STAGES, B_TRANS)),
            (_io, (r_desc, c_desc, io, res_ready, c_full, tiles_m, tiles_n, num_tiles, GROUP_M, HAS_RESIDUAL)),
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


def _constexprs(bias, activation, residual, b_trans: bool) -> dict:
    """The kernel's constexprs for one launch: a group of 8 row tiles, 3 stages (the fourth's room is ``io``),
    and registers per thread for the consumers and the two one-warp workers."""
    return dict(GROUP_M=8, STAGES=3, HAS_BIAS=bias is not None, ACTIVATION=activation or "none",
                HAS_RESIDUAL=residual is not None, B_TRANS=b_trans, CONSUMER_REGS=232, WORKER_REGS=40)


def applies(a, b, c, bias, residual, mul, activation, alpha, scale_a, scale_b) -> bool:
    """Whether this kernel computes ``tk.gemm``'s call (its caller has settled the launch: the large tile, split-K 1,
    no async input): Hopper, 16-bit A row-major, B row- or column-major, C and the residual row-major of the
    inputs' dtype, a bias ``[N]`` at most, no ``mul``, scales or alpha."""
    if not (HAVE_GLUON and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and c.dtype == a.dtype
            and not mul and scale_a is None and scale_b is None and alpha == 1.0 and a.shape[1] >= 1):
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
    templates of A, B, C and the residual (C's when there is none), the rows it computes (a row tail computes
    the others) and whether B is read transposed."""

    __slots__ = ("launch", "descs", "rows", "b_trans", "ints")


def make_plan(a, b, c, bias, residual, activation, rows: int, num_sms: int) -> GluonPlan:
    """The plan for rows ``[0, rows)`` of ``c = act(a @ b + bias) + beta * residual`` (``applies`` holds)."""
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
    plan.ints = (rows, N, K)
    tiles = cdiv(rows, BLOCK_M.value) * cdiv(N, BLOCK_N.value)
    plan.launch = CachedLaunch(fused_gemm_kernel, max(1, min(tiles, num_sms)),
                               _constexprs(bias, activation, residual, plan.b_trans), num_warps=4)
    return plan


def launch_args(plan: GluonPlan, a, b, c, bias, residual, beta: float) -> tuple:
    """The runtime arguments of ``plan.launch`` for one call."""
    from .._runtime import rebase

    rows = plan.rows
    c_rows = c[:rows]
    a_desc, b_desc, c_desc, r_desc = plan.descs
    return (rebase(a_desc, a[:rows]), rebase(b_desc, b.t() if plan.b_trans else b), rebase(c_desc, c_rows),
            rebase(r_desc, residual[:rows] if residual is not None else c_rows), bias if bias is not None else c,
            *plan.ints, beta)


def _launch(a, b, bias, activation, residual, beta, num_sms, out):
    """(grid, arguments, constexprs and options) of one launch and its output; ValueError naming the operand this
    kernel does not read."""
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
    M, K = a.shape
    N = b.shape[1]
    b_trans = _b_trans(b)
    c = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    tiles = cdiv(M, BLOCK_M.value) * cdiv(N, BLOCK_N.value)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (max(1, min(tiles, num_sms)),)
    res = residual if residual is not None else c
    b_desc = (_descriptor(b.t(), [BLOCK_N.value, BLOCK_K.value]) if b_trans
              else _descriptor(b, [BLOCK_K.value, BLOCK_N.value]))
    args = (_descriptor(a, [BLOCK_M.value, BLOCK_K.value]), b_desc, _descriptor(c, [HALF_M.value, BLOCK_N.value]),
            _descriptor(res, [HALF_M.value, BLOCK_N.value]), bias if bias is not None else c, M, N, K, float(beta))
    return c, grid, args, dict(_constexprs(bias, activation, residual, b_trans), num_warps=4)


def fused_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
               residual: torch.Tensor | None = None, beta: float = 1.0, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(a @ b + bias) + beta * residual`` for row-major bf16/fp16 ``a [M, K]`` and ``b [K, N]`` row- or
    column-major, in one launch of ``fused_gemm_kernel`` with tk.gemm's constexprs (tests and probes; ``tk.gemm``
    plans its launches with ``make_plan``). ValueError naming an operand it does not read."""
    c, grid, args, kwargs = _launch(a, b, bias, activation, residual, beta, None, out)
    fused_gemm_kernel[grid](*args, **kwargs)
    return c


def compile_only(a, b, bias=None, activation=None, residual=None, beta=1.0):
    """The kernel for these arguments compiled on the active triton target as an H100 launch (132 SMs), not
    launched: ``scripts/compile_sm90.py --gluon`` builds it offline."""
    _, grid, args, kwargs = _launch(a, b, bias, activation, residual, beta, 132, None)
    return fused_gemm_kernel.warmup(*args, grid=grid, **kwargs)


__all__ = ["HAVE_GLUON", "applies", "fused_gemm", "launch_args", "make_plan"]
