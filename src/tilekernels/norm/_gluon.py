"""Two kernels in Gluon: the norm backward for wide rows (dw and db summed in shared memory), and
moe_smooth_quant's forward with x streamed through shared memory (``_moe_rows_smem``, at the end).

The Triton backward (``_kernels._row_backward``) keeps a program's dw/db sums in registers. Past 8192
columns a whole row of them does not fit beside the row's x and dy, so there each row is split over
column programs that re-read the whole row from L2 for the row sums (0.47-0.76 of copy bandwidth at
N 16384-32768, benchmarks/NOTES.md). Here one persistent program per SM owns whole rows and keeps the
sums in shared memory instead, which Triton cannot allocate explicitly but Gluon can::

    for row in rows pid, pid + P, ...:
        x, dy of this row                         (registers: the whole row)
        the next row's x and dy                   -> shared memory by cp.async (PREFETCH 2), or registers (1)
        xhat, g = ..., dy * w
        sums of g * xhat and g                    (one reduction)
        dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   -> stored
        dw_smem += dy * xhat;  db_smem += dy      (each thread its own elements)

With ``ACC_REGS`` (the table's layer norm at 16384 columns) dw and db are summed in registers instead: they
are updated before the row's reduction, x and dy are read a second time from a ring of staged rows after it,
and xhat and g computed again for dx, so the row's 256 KiB of shared-memory read-modify-write go away.

At the end each program writes its sums to row ``pid`` of the ``[P, N]`` fp32 partial buffers that
``_kernels._sum_rows`` adds in a fixed order, as the Triton path does: dw and db are bit-identical run
to run. The shared-memory accumulators are loaded and stored in the register layout of the row, so
each thread reads back only what it wrote.

Shared memory bounds it: dw and db of a 16384-column row are 128 KiB and the staged bf16 row 64 KiB.
Wider rows are shared (``SPLIT`` > 1): ``SPLIT`` programs each own ``N / SPLIT`` columns of
a group's rows, with their sums in shared memory as above, and exchange their parts of each row's two
sums, adding them in part order, so dx, dw and db are bit-identical run to run and the same in every
program of a row. Two ways:

- ``CLUSTER`` (the table's choice on Hopper): a group's programs are one thread-block cluster
  (``_runtime.ClusterLaunch``). Thread 0 of each writes its part's sums into every partner's shared
  memory (``mapa`` + a relaxed cluster-scope store), each sum one 64-bit word with the row's iteration
  number above its bits, into one of two slots by the iteration's parity; the partners poll their own
  shared memory until the words carry that tag. The round trip stays inside the GPC (0.85 of copy
  bandwidth at 32768 columns against 0.69 through global memory, H100). The words need no fence, so the
  dx stores in flight are not drained each row, which a cluster barrier with release semantics does
  (0.75). Partners in a cluster run together, so a wait cannot fail; it is bounded all the same, and a
  program that stops waiting records the row in an error word that the host raises as TimeoutError.
- Otherwise through global memory: one int64 word per sum, the value's bits with a "here" bit above
  them, in a ``[M, SPLIT, 2]`` buffer zeroed per call. A program publishes its part, updates dw/db, then
  polls; a program whose partner has not published after ``max_spins`` polls (it could only be one that
  is not resident) sums that part of the row itself from memory, with the same code and so the same
  bits, and waits no more.

``_kernels.SMEM_BACKWARD_CONFIGS`` says which widths take which kernel (H100 figures there);
``smem_backward_applies`` says which calls they can take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import is_interpreter
from ._kernels import FP32_MAX, HELD_TOPK, NORM_LAYER, PRESCALE, ROUND_HALF_EVEN, TINY_AMAX

try:  # gluon ships with triton 3.6 and 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # triton 3.9 renamed the cp.async copy (the old name raises there); 3.6 has only the old one
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # a CTA barrier: triton 3.9 renamed it (3.6 has only thread_barrier)
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

SMEM_BYTES = 200 * 1024   # of the 227 KiB an H100 program may have, leaving room for the reductions' scratch


def cluster_exchange_bytes(split: int) -> int:
    """Shared memory the cluster exchange of ``_row_backward_smem`` (``CLUSTER``) takes past the kernel's own:
    [2 parities][split parts][2 sums] tagged 64-bit words."""
    return 32 * split


# polls of a partner's row sums (split rows) before a program gives up and sums that part of the row itself;
# a negative value never polls (tests: the fallback gives the same bits)
max_spins = 1 << 16


def smem_backward_bytes(block_n: int, want_dw: bool, want_db: bool, prefetch: int, x_dtype, dy_dtype,
                        acc_regs: bool = False, stages: int = 1) -> int:
    """Shared memory a program allocates beyond the reductions' scratch (``block_n``: its columns): the fp32
    sums (unless ``acc_regs``: in registers) and the ring of staged rows."""
    stage = stages * block_n * (x_dtype.itemsize + dy_dtype.itemsize) if prefetch == 2 else 0
    sums = 0 if acc_regs else 4 * block_n * (int(want_dw) + int(want_db))
    return sums + stage


def _aligned(t: torch.Tensor) -> bool:
    """Row starts 16-byte aligned, as triton sees them (pointer and row stride divisible by 16)."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def smem_backward_applies(x: torch.Tensor, dy: torch.Tensor, ds, config, block_n: int, want_dw: bool,
                          want_db: bool) -> bool:
    """Whether the Gluon backward runs ``config`` for these tensors (``block_n``: the row's power-of-two width,
    which ``config.split`` programs share): it needs Gluon, a CUDA device of compute capability 8.0 or later,
    unit column strides and shared memory for its sums (and the staged row). cp.async (prefetch 2) copies 4
    bytes or more per thread and so also needs 16-byte aligned rows and N a multiple of 16; where that fails
    the Triton backward runs (the Gluon one with the next row in registers measured no faster than it)."""
    if config is None or not HAVE_GLUON or is_interpreter() or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 8 or not (want_dw or want_db):
        return False
    if any(t is not None and t.shape[1] > 1 and t.stride(1) != 1 for t in (x, dy, ds)):
        return False
    if config.prefetch == 2 and not (x.shape[1] % 16 == 0 and _aligned(x) and _aligned(dy)):
        return False
    return smem_backward_bytes(block_n // config.split, want_dw, want_db, config.prefetch, x.dtype,
                               dy.dtype, config.acc_regs, config.stages) <= SMEM_BYTES


def smem_quant_applies(x: torch.Tensor, topk: int, config, block_n: int) -> bool:
    """Whether the Gluon MoE forward runs ``config`` for x with ``topk`` expert choices per token
    (``block_n``: the row's power-of-two width): it needs Gluon, a CUDA device of compute capability 8.0
    or later, unit column strides, rows that cp.async can copy 16 bytes at a time (16-byte aligned, N a
    multiple of 16), a token's ids (k padded to a power of two) within a ring slot (one id per thread of a
    program), and a ring (x's rows and the ids' slots) that fits in shared memory. Elsewhere the Triton
    forward runs."""
    if config is None or not HAVE_GLUON or is_interpreter() or x.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 8 or x.shape[1] % 16 != 0 or not _aligned(x):
        return False
    if x.shape[1] > 1 and x.stride(1) != 1:
        return False
    if triton.next_power_of_2(topk) > 32 * config.num_warps:
        return False
    ids_ring = (config.stages + 1) * 32 * config.num_warps * 8   # the ids' slots (int64 at most)
    return config.stages * block_n * x.dtype.itemsize + ids_ring <= SMEM_BYTES


if HAVE_GLUON:
    # the split backward's exchange words (``_word``)
    _READY = gl.constexpr(1 << 32)
    _LOW_BITS = gl.constexpr(0xFFFFFFFF)

    @gluon.jit
    def _add_pairs(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @gluon.jit
    def _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym):
        mask = mask_n & (row < M)
        x = gl.load(x_ptr + row.to(gl.int64) * stride_xm + cols, mask=mask, other=0.0)
        dy = gl.load(dy_ptr + row.to(gl.int64) * stride_dym + cols, mask=mask, other=0.0)
        return x, dy

    @gluon.jit
    def _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM: gl.constexpr,
                    HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr):
        """(xhat, g = dy * w) fp32 of one loaded row, xhat 0 past N."""
        v = x.to(gl.float32)
        if HAS_XBIAS:
            v += gl.load(xbias_ptr + cols, mask=mask_n, other=0.0).to(gl.float32)
        if NORM == NORM_LAYER:
            xhat = (v - gl.load(mean_ptr + row)) * rstd
        else:
            xhat = v * rstd
        g = dy.to(gl.float32)
        if HAS_W:
            g = g * gl.load(w_ptr + cols, mask=mask_n, other=0.0).to(gl.float32)
        return gl.where(mask_n, xhat, 0.0), g

    @gluon.jit
    def _stage_row(x_stage, dy_stage, x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym):
        mask = mask_n & (row < M)
        _async_load(x_stage, x_ptr + row.to(gl.int64) * stride_xm + cols, mask=mask)
        _async_load(dy_stage, dy_ptr + row.to(gl.int64) * stride_dym + cols, mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _row_sums(xhat, g, NORM: gl.constexpr):
        """(sum of g * xhat, sum of g) (rms norm: the second sum is not needed, and is 0 times the first)."""
        if NORM == NORM_LAYER:
            sum_gx, sum_g = gl.reduce((g * xhat, g), 0, _add_pairs)
        else:
            sum_gx = gl.sum(g * xhat, axis=0)
            sum_g = sum_gx * 0.0
        return sum_gx, sum_g

    @gluon.jit
    def _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM: gl.constexpr,
                   HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr):
        """(xhat, g, sum of g * xhat, sum of g) over the columns ``cols`` of one loaded row. The same code and
        layout for a program's own part of a row and for a partner's part re-read after a wait gave up, so
        both give the same bits."""
        xhat, g = _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM, HAS_W, HAS_XBIAS)
        sum_gx, sum_g = _row_sums(xhat, g, NORM)
        return xhat, g, sum_gx, sum_g

    @gluon.jit
    def _opaque(t):
        """``t`` through a register move the compiler cannot see through (so values computed from ``t`` before
        are not reused: they are computed again)."""
        PACK: gl.constexpr = 2 if t.type.is_block() and t.dtype.primitive_bitwidth == 16 else 1   # 16-bit pairs
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=t.dtype, is_pure=False, pack=PACK)

    @gluon.jit
    def _word(value):
        """An fp32 partial sum as an int64 exchange word: the value's bits below, 1 above (a zeroed word
        reads as "not yet"). One 64-bit store, so a reader sees the value whole or not at all."""
        return value.to(gl.uint32, bitcast=True).to(gl.int64) | _READY

    @gluon.jit
    def _unword(word):
        return (word & _LOW_BITS).to(gl.uint32).to(gl.float32, bitcast=True)

    @gluon.jit
    def _accumulate(dw_smem, db_smem, dy, xhat, layout: gl.constexpr, WANT_DW: gl.constexpr, WANT_DB: gl.constexpr):
        """dw += dy * xhat and db += dy in shared memory (each thread its own elements)."""
        if WANT_DW:
            dw_smem.store(dw_smem.load(layout) + dy.to(gl.float32) * xhat)
        if WANT_DB:
            db_smem.store(db_smem.load(layout) + dy.to(gl.float32))

    @gluon.jit
    def _load_words(word_ptr, spins_left):
        """A part's two exchange words, or zeros (not there) once this program has stopped waiting."""
        polling = spins_left >= 0
        return (gl.load(word_ptr, mask=polling, other=0, volatile=True),
                gl.load(word_ptr + 1, mask=polling, other=0, volatile=True))

    @gluon.jit
    def _partner_sums(w0, w1, word_ptr, x_ptr, dy_ptr, xbias_ptr, w_ptr, mean_ptr, row, rstd, part, M, N, stride_xm,
                      stride_dym, spins_left, layout: gl.constexpr, NORM: gl.constexpr, HAS_W: gl.constexpr,
                      HAS_XBIAS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Column part ``part``'s sums for ``row`` from its program's words (``w0, w1`` as last loaded from
        ``word_ptr``), polled up to ``spins_left`` more times. If they have not come by then (the partner
        program is not resident, say), that part of the row is read from memory and summed here, and
        ``spins_left`` becomes -1, so this program waits no more. Returns (sum of g * xhat, sum of g, spins
        left)."""
        while (w0 & w1 & _READY) == 0:
            if spins_left > 0:
                spins_left -= 1
                w0, w1 = _load_words(word_ptr, spins_left)
            else:
                cols = part * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
                mask_n = cols < N
                x, dy = _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym)
                _, _, sum_gx, sum_g = _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM,
                                                 HAS_W, HAS_XBIAS)
                w0 = _word(sum_gx)
                w1 = _word(sum_g)
                spins_left = -1
        return _unword(w0), _unword(w1), spins_left

    # The cluster exchange (``CLUSTER``): the ``SPLIT`` programs of a row group are one thread-block cluster,
    # and each row's part sums travel through distributed shared memory instead of global memory. The words
    # sit in ``cluster_exchange_bytes(SPLIT)`` bytes past the end of the kernel's own shared memory (the launch
    # asks for that much more: ``norm.launch_backward``), as [parity][part][gx, g] 64-bit words, each the sum's
    # bits with the row's iteration + 1 above them, parity being the iteration & 1. Thread 0 writes the
    # program's pair into every partner's words (``mapa`` + a relaxed ``st.shared::cluster``); every thread
    # polls its own shared memory until a partner's pair carries the row's tag. No fence and no barrier per
    # row: a program publishes row i + 2 (parity of i) only after its poll of row i + 1 saw every partner's pair,
    # each published after that partner's own poll of row i, so a pair is never overwritten before it is read.
    # The exchange area's address (register a): the last $X bytes of the dynamic shared memory
    def _area(size: str) -> str:
        return ("mov.u32 a, global_smem; mov.u32 t, %dynamic_smem_size; add.u32 a, a, t; "
                f"sub.u32 a, a, {size}; ")

    # the area's words zeroed ("no row yet"; shared memory starts undefined), then a cluster barrier, so no
    # partner writes a word before it was zeroed. Also used once at the end: no program leaves while a partner
    # may still write into its shared memory.
    _INIT_ASM = gl.constexpr(
        "{ .reg .pred p; .reg .u32 a, t; " + _area("$1")
        + "mov.u32 t, %tid.x; shl.b32 t, t, 3; setp.lt.u32 p, t, $1; add.u32 a, a, t; "
        "@p st.shared.b64 [a], 0; barrier.cluster.arrive.release; barrier.cluster.wait.acquire; mov.u32 $0, 0; }")
    _SYNC_ASM = gl.constexpr("barrier.cluster.arrive.release; barrier.cluster.wait.acquire; mov.u32 $0, 0;")
    # thread 0: the two sums ($1, $2), each as one 64-bit word with the tag $4 above its bits, into words
    # 2 * $3 and 2 * $3 + 1 of program $5's area (strong relaxed stores: a reader sees a word whole or not)
    _PUBLISH_ASM = gl.constexpr(
        "{ .reg .pred p; .reg .u32 a, t, lo; .reg .b64 w; " + _area("$6")
        + "mad.lo.u32 a, $3, 16, a; mapa.shared::cluster.u32 a, a, $5; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "mov.b32 lo, $1; mov.b64 w, {lo, $4}; @p st.relaxed.cluster.shared::cluster.b64 [a], w; "
        "mov.b32 lo, $2; mov.b64 w, {lo, $4}; @p st.relaxed.cluster.shared::cluster.b64 [a+8], w; "
        "mov.u32 $0, 0; }")
    # words 2 * $2 and 2 * $2 + 1 of this program's area
    _LOAD_ASM = gl.constexpr(
        "{ .reg .u32 a, t; " + _area("$3") + "mad.lo.u32 a, $2, 16, a; "
        "ld.relaxed.cluster.shared::cta.b64 $0, [a]; ld.relaxed.cluster.shared::cta.b64 $1, [a+8]; }")
    @gluon.jit
    def _cluster_init(area_bytes):
        return gl.inline_asm_elementwise(_INIT_ASM, "=r,r", [area_bytes], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _cluster_sync():
        return gl.inline_asm_elementwise(_SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _cluster_publish(own_gx, own_g, index, tag, target, area_bytes):
        """Thread 0 sends (own_gx, own_g), tagged ``tag``, into pair ``index`` of cluster program ``target``."""
        return gl.inline_asm_elementwise(_PUBLISH_ASM, "=r,f,f,r,r,r,r",
                                         [own_gx, own_g, index, tag, target, area_bytes], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _cluster_load(index, area_bytes):
        """Pair ``index``'s two words in this program's area (``_unword`` has the value, bits 32 up the tag)."""
        return gl.inline_asm_elementwise(_LOAD_ASM, "=l,=l,r,r", [index, area_bytes], dtype=(gl.int64, gl.int64),
                                         is_pure=False, pack=1)

    @gluon.jit
    def _cluster_partner_sums(errors, index, tag, row, spins_left, area_bytes):
        """The (gx, g) sums in pair ``index`` of this program's area, polled up to ``spins_left`` times until
        both words carry ``tag``. They cannot fail to come while the partner runs (it is in this cluster);
        if they do, ``errors`` records the row, this program waits no more (``spins_left`` -1) and the host
        raises (``norm._ExchangeErrors``). Returns (gx, g, spins left)."""
        w0, w1 = _cluster_load(index, area_bytes)
        spins = spins_left
        while (((w0 >> 32) != tag) | ((w1 >> 32) != tag)) & (spins > 0):
            spins -= 1
            w0, w1 = _cluster_load(index, area_bytes)
        if ((w0 >> 32) != tag) | ((w1 >> 32) != tag):
            gl.store(errors + 1, row)
            gl.store(errors, 1)
            spins_left = -1
        return _unword(w0), _unword(w1), spins_left

    @gluon.jit
    def _row_backward_smem(x_ptr, xbias_ptr, dy_ptr, ds_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr,
                           db_part_ptr, xchg_ptr, M, N, stride_xm, stride_dym, stride_dsm, max_spins,
                           NORM: gl.constexpr, HAS_W: gl.constexpr, HAS_XBIAS: gl.constexpr, HAS_DS: gl.constexpr,
                           WANT_DW: gl.constexpr, WANT_DB: gl.constexpr, PREFETCH: gl.constexpr,
                           BLOCK_N: gl.constexpr, VEC: gl.constexpr, SPLIT: gl.constexpr,
                           CLUSTER: gl.constexpr = False, ACC_REGS: gl.constexpr = False,
                           STAGES: gl.constexpr = 1):
        """``SPLIT`` programs (a group; 1 for rows of ``BLOCK_N`` columns or fewer) share the group's rows,
        each ``BLOCK_N`` columns of them (``cols``). With ``SPLIT > 1`` a program
        publishes its part's two row sums (``_word``), updates dw/db while its partners' come (two programs:
        the partner's words are loaded before that update), and adds all parts' sums in part order
        (``_partner_sums``) before its dx. With ``CLUSTER`` the group is a thread-block cluster: the sums
        travel through its shared memory (``_cluster_publish``, ``_cluster_load``), ``xchg_ptr`` is the
        int32 error words (set, and a row, when a wait gave up), and dw/db are updated after the dx store,
        as with one program per row (the partner's sums come in well under a row's time).

        ``ACC_REGS`` (one program per row, or ``CLUSTER``): dw/db are summed in registers instead of shared
        memory, updated before the row's reduction, and xhat and g are computed again after it for dx, from x
        and dy read again from their ring slot (``STAGES`` > 1) or held across it (16-bit: half the registers
        of xhat and g). ``STAGES``: the rows copied ahead by cp.async (``PREFETCH`` 2) are ``STAGES`` - 1."""
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
        smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        pid = gl.program_id(0)
        groups = gl.num_programs(0) // SPLIT
        group = pid // SPLIT
        part = pid % SPLIT
        cols = part * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
        mask_n = cols < N
        zero = gl.zeros([BLOCK_N], gl.float32, layout)
        dw_smem = None
        db_smem = None
        dw_acc = zero
        db_acc = zero
        if not ACC_REGS:
            if WANT_DW:
                dw_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
            if WANT_DB:
                db_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N], smem_layout, zero)
        if PREFETCH == 2:   # the next rows wait in shared memory, copied there by cp.async
            x_ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_N], smem_layout)
            dy_ring = gl.allocate_shared_memory(dy_ptr.dtype.element_ty, [STAGES, BLOCK_N], smem_layout)
            for s in gl.static_range(max(STAGES - 1, 1)):
                _stage_row(x_ring.index(s), dy_ring.index(s), x_ptr, dy_ptr, group + s * groups, M, cols, mask_n,
                           stride_xm, stride_dym)
        elif PREFETCH == 1:   # in registers
            x_next, dy_next = _load_row(x_ptr, dy_ptr, group, M, cols, mask_n, stride_xm, stride_dym)
        spins_left = max_spins
        area_bytes = 32 * SPLIT   # cluster_exchange_bytes
        if CLUSTER:
            _cluster_init(area_bytes)
        it = 0   # CLUSTER: the row's iteration (its parity picks the slot; it + 1 tags the words)
        step = 0   # the ring's iteration
        for row in range(group, M, groups):
            slot = step % STAGES
            if PREFETCH == 2 and STAGES == 1:
                async_copy.wait_group(0)
                x = x_ring.index(0).load(layout)
                dy = dy_ring.index(0).load(layout)
                _stage_row(x_ring.index(0), dy_ring.index(0), x_ptr, dy_ptr, row + groups, M, cols, mask_n, stride_xm,
                           stride_dym)
            elif PREFETCH == 2:   # into the slot read last iteration (each thread copies and reads its own elements)
                ahead = (step + STAGES - 1) % STAGES
                _stage_row(x_ring.index(ahead), dy_ring.index(ahead), x_ptr, dy_ptr, row + (STAGES - 1) * groups, M,
                           cols, mask_n, stride_xm, stride_dym)
                async_copy.wait_group(STAGES - 1)
                x = x_ring.index(slot).load(layout)
                dy = dy_ring.index(slot).load(layout)
            elif PREFETCH == 1:
                x = x_next
                dy = dy_next
                x_next, dy_next = _load_row(x_ptr, dy_ptr, row + groups, M, cols, mask_n, stride_xm, stride_dym)
            else:
                x, dy = _load_row(x_ptr, dy_ptr, row, M, cols, mask_n, stride_xm, stride_dym)
            rstd = gl.load(rstd_ptr + row)
            if ACC_REGS:
                xhat, g = _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM, HAS_W,
                                      HAS_XBIAS)
                if WANT_DW:
                    dw_acc += dy.to(gl.float32) * xhat
                if WANT_DB:
                    db_acc += dy.to(gl.float32)
                sum_gx, sum_g = _row_sums(xhat, g, NORM)
            else:
                xhat, g, sum_gx, sum_g = _part_sums(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM,
                                                    HAS_W, HAS_XBIAS)
            if SPLIT > 1:
                own_gx = sum_gx
                own_g = sum_g
                if CLUSTER:   # dw/db are updated after the dx store: the partners' sums come in well before
                    slot = it % 2
                    for target in gl.static_range(SPLIT):
                        if target != part:
                            _cluster_publish(own_gx, own_g, slot * SPLIT + part, it + 1, target, area_bytes)
                else:
                    words = xchg_ptr + row.to(gl.int64) * (2 * SPLIT)
                    gl.atomic_xchg(words + 2 * part, _word(own_gx), sem="relaxed", scope="gpu")
                    gl.atomic_xchg(words + 2 * part + 1, _word(own_g), sem="relaxed", scope="gpu")
                    if SPLIT == 2:   # the partner's words: the loads overlap the dw/db update
                        w0, w1 = _load_words(words + 2 * (1 - part), spins_left)
                    if not ACC_REGS:
                        _accumulate(dw_smem, db_smem, dy, xhat, layout, WANT_DW, WANT_DB)
                sum_gx = 0.0
                sum_g = 0.0
                for other in gl.static_range(SPLIT):
                    if other == part:
                        part_gx = own_gx
                        part_g = own_g
                    elif CLUSTER:
                        part_gx, part_g, spins_left = _cluster_partner_sums(
                            xchg_ptr, slot * SPLIT + other, it + 1, row, spins_left, area_bytes)
                    else:
                        if SPLIT > 2:
                            w0, w1 = _load_words(words + 2 * other, spins_left)
                        part_gx, part_g, spins_left = _partner_sums(
                            w0, w1, words + 2 * other, x_ptr, dy_ptr, xbias_ptr, w_ptr, mean_ptr, row, rstd, other, M,
                            N, stride_xm, stride_dym, spins_left, layout, NORM, HAS_W, HAS_XBIAS, BLOCK_N)
                    sum_gx += part_gx
                    sum_g += part_g
                it += 1
            if ACC_REGS:   # xhat and g again (from an opaque slot index or copies: the first ones are not held)
                if PREFETCH == 2 and STAGES > 1:
                    again = _opaque(slot)
                    x = x_ring.index(again).load(layout)
                    dy = dy_ring.index(again).load(layout)
                else:
                    x = _opaque(x)
                    dy = _opaque(dy)
                xhat, g = _row_values(x, dy, xbias_ptr, w_ptr, mean_ptr, row, rstd, cols, mask_n, NORM, HAS_W,
                                      HAS_XBIAS)
            if NORM == NORM_LAYER:
                dx = (g - xhat * (sum_gx / N) - sum_g / N) * rstd
            else:
                dx = (g - xhat * (sum_gx / N)) * rstd
            if HAS_DS:
                dx += gl.load(ds_ptr + row.to(gl.int64) * stride_dsm + cols, mask=mask_n, other=0.0).to(gl.float32)
            gl.store(dx_ptr + row.to(gl.int64) * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask_n)
            if (SPLIT == 1 or CLUSTER) and not ACC_REGS:
                _accumulate(dw_smem, db_smem, dy, xhat, layout, WANT_DW, WANT_DB)
            step += 1
        if CLUSTER:   # no program leaves while a partner may still write into its shared memory
            _cluster_sync()
        if PREFETCH == 2:   # the last copy (of no row: masked) lands before the program exits
            async_copy.wait_group(0)
        part_row = group.to(gl.int64) * N
        if not ACC_REGS:
            if WANT_DW:
                dw_acc = dw_smem.load(layout)
            if WANT_DB:
                db_acc = db_smem.load(layout)
        if WANT_DW:
            gl.store(dw_part_ptr + part_row + cols, dw_acc, mask=mask_n)
        if WANT_DB:
            gl.store(db_part_ptr + part_row + cols, db_acc, mask=mask_n)


# ----------------------------------------------------------------------------------------------------
# moe_smooth_quant's forward: x through a shared-memory ring
#
# moe_smooth_quant writes k quantised rows per row of x, each scaled by its expert's fp32 smooth row. The
# Triton row kernel holds x and the expert row in registers, which caps the rows in flight per SM (0.81 of
# copy bandwidth at 4096 columns on the H100). Here a few persistent programs per SM copy x a token ahead
# into a ring of shared-memory rows by cp.async (no registers held for it), load each output row's expert
# row one row ahead into registers (the ids through the same ring a token ahead of x, so that load never
# waits for them), and read x from shared memory once per token, holding it for the token's k rows and z from
# max|z| to q (``_kernels.SMEM_QUANT_CONFIGS`` has the widths and figures). The same loop for dynamic and smooth
# quantisation measured slower than the Triton kernel, so it does MoE only.
# Gluon cannot call the Triton kernel's jit functions, so ``_quant_row`` repeats ``_kernels._row_scales`` and
# ``_quantize`` (their constants are shared); the GPU tests check the two bit for bit.


if HAVE_GLUON:
    @gluon.jit
    def _max_nan(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _quant_row(x, smooth, row, valid, q_ptr, scale_ptr, N, cols, mask_n, QMAX: gl.constexpr, scratch=None,
                   WARP_REDUCE: gl.constexpr = False):
        """Quantise one row, z = ``x`` (a token's row as read from its ring slot) * ``smooth``, into row ``row`` of q
        and row_scale, as the Triton kernel's ``_row_scales`` and ``_quantize`` do (the same operations in the same
        order: the same bits). z is held in registers from max|z| to q: the loop runs near the SM's instruction
        issue limit, and reading the slot back and multiplying again cost more than the registers (figures at
        ``_kernels.SMEM_QUANT_CONFIGS``).

        ``WARP_REDUCE`` (``cols`` then ``[warps, BLOCK_N / warps]``, a warp's part of the row in its own row of the
        layout): max|z| is each warp's by shuffles, stored to ``scratch`` (``[warps]`` fp32 in shared memory), and
        read back whole by every thread after the one CTA barrier that triton puts between the store and the
        load. triton's reduction over the CTA takes three barriers a row and a second shuffle tree. A row's
        ``scratch`` must not be the last row's (``_moe_rows_smem`` alternates two), or a barrier is added before
        the store, for the last row's loads. The maximum is the same whatever the order: the same bits."""
        z = x.to(gl.float32) * smooth
        if WARP_REDUCE:
            # each warp's max by shuffles, then every thread reads all warps' from shared memory: one CTA barrier
            warp_max = gl.reduce(gl.abs(z), 1, _max_nan)
            scratch.store(warp_max)
            all_layout: gl.constexpr = gl.BlockedLayout([gl.num_warps()], [32], [gl.num_warps()], [0])
            amax = gl.reduce(scratch.load(all_layout), 0, _max_nan)
        else:
            amax = gl.reduce(gl.abs(z), 0, _max_nan)
        scale = gl.where(valid, gl.div_rn(amax, QMAX), float("nan"))
        nonzero = valid & (amax > 0.0) & (amax <= FP32_MAX)
        prescale = gl.where(amax < TINY_AMAX, PRESCALE, gl.where(amax <= FP32_MAX, 1.0, 0.0))
        inv_scale = gl.where(nonzero, gl.div_rn(QMAX, gl.where(nonzero, amax * prescale, 1.0)), 0.0)
        if prescale == 1.0:
            v = z * inv_scale
        else:
            v = (z * prescale) * inv_scale
            v = gl.where(v == v, v, 0.0)
        q_dtype: gl.constexpr = q_ptr.dtype.element_ty
        if q_dtype == gl.int8:
            q = (v + ROUND_HALF_EVEN).to(gl.int32, bitcast=True).to(gl.int8)   # see _kernels._quantize
        else:
            q = v.to(q_dtype)   # within +-QMAX after rounding: no clamp (see _kernels._quantize)
        # k rows written per row of x read: stream them past L2, which holds the expert rows
        gl.store(q_ptr + row.to(gl.int64) * N + cols, q, mask=mask_n, cache_modifier=".cs")
        gl.store(scale_ptr + row, scale)

    @gluon.jit
    def _token_ids(topk_ptr, token, T, stride_tk_t, stride_tk_j, TOPK: gl.constexpr, KP: gl.constexpr):
        """Token ``token``'s expert ids, int64 ``[KP]`` (k padded to a power of two), every thread holding all;
        -1 (no expert) past T and past k."""
        ids_layout: gl.constexpr = gl.BlockedLayout([KP], [32], [gl.num_warps()], [0])
        jj = gl.arange(0, KP, layout=ids_layout)
        return gl.load(topk_ptr + token.to(gl.int64) * stride_tk_t + jj * stride_tk_j, mask=(jj < TOPK) & (token < T),
                       other=-1).to(gl.int64)

    @gluon.jit
    def _expert_row(smooth_ptr, ids, j, num_experts, stride_sm, cols, mask_n, KP: gl.constexpr):
        """(valid, the smooth row as fp32) of choice ``j`` of a token's ``ids`` (``_token_ids``): an id outside
        [0, E) is not valid, and its row reads nothing (0)."""
        jj = gl.arange(0, KP, layout=ids.type.layout)
        expert = gl.sum(gl.where(jj == j, ids, 0), axis=0)   # within each thread: it holds all KP ids
        valid = (expert >= 0) & (expert < num_experts)
        smooth = gl.load(smooth_ptr + expert * stride_sm + cols, mask=mask_n & valid, other=0.0,
                         eviction_policy="evict_last").to(gl.float32)
        return valid, smooth

    @gluon.jit
    def _stage_token(x_slot, ids_slot, x_ptr, topk_ptr, token, ids_token, T, cols, mask_n, stride_xm, stride_tk_t,
                     stride_tk_j, TOPK: gl.constexpr):
        """Token ``token``'s x (the columns ``cols``) and token ``ids_token``'s expert ids (copied by threads 0 ..
        k-1, one id each) into ring slots by cp.async, one commit group. The ids travel through shared memory
        too: a register loaded a few tokens ahead would still be waited for within one iteration (the loop moves
        it from register to register, and a move waits for the load)."""
        _async_load(x_slot, x_ptr + token.to(gl.int64) * stride_xm + cols, mask=mask_n & (token < T))
        _stage_ids(ids_slot, topk_ptr, ids_token, T, stride_tk_t, stride_tk_j, TOPK)
        async_copy.commit_group()

    @gluon.jit
    def _stage_ids(ids_slot, topk_ptr, token, T, stride_tk_t, stride_tk_j, TOPK: gl.constexpr):
        """Token ``token``'s expert ids into an ids slot by cp.async (threads 0 .. k-1, one id each; not committed)."""
        lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        lane = gl.arange(0, 32 * gl.num_warps(), layout=lane_layout)
        _async_load(ids_slot, topk_ptr + token.to(gl.int64) * stride_tk_t + lane * stride_tk_j,
                    mask=(lane < TOPK) & (token < T))

    @gluon.jit
    def _slot_ids(ids_slot, KP: gl.constexpr):
        """A token's expert ids from its ring slot, int64 ``[KP]`` with every thread holding all (after the copies
        landed and a CTA barrier: other threads copied them)."""
        ids_layout: gl.constexpr = gl.BlockedLayout([KP], [32], [gl.num_warps()], [0])
        return ids_slot.slice(0, KP).load(ids_layout).to(gl.int64)

    @gluon.jit
    def _moe_rows_smem(x_ptr, smooth_ptr, topk_ptr, q_ptr, scale_ptr, T, N, num_experts, stride_xm, stride_sm,
                       stride_tk_t, stride_tk_j, QMAX: gl.constexpr, TOPK: gl.constexpr, BLOCK_N: gl.constexpr,
                       VEC: gl.constexpr, STAGES: gl.constexpr, EVEN_N: gl.constexpr,
                       WARP_REDUCE: gl.constexpr = False):
        """q and row_scale of moe_smooth_quant (``TOPK``: k; row ``j * T + t`` is token t's j-th expert) in a
        persistent loop over tokens (rows of x): x streams through a ring of ``STAGES`` shared-memory rows
        filled by cp.async ``STAGES - 1`` tokens ahead, so every program keeps that many rows of loads in flight
        without holding them in registers; each output row's expert row is loaded one row ahead. ``WARP_REDUCE``
        (k <= ``HELD_TOPK``): each warp owns a contiguous part of the row, and a row's max|z| takes one CTA barrier
        (``_quant_row``)."""
        ring_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        pid = gl.program_id(0)
        step = gl.num_programs(0)
        WARPS: gl.constexpr = gl.num_warps()
        # one CTA barrier a row (``_quant_row``): k <= HELD_TOPK only (the many-k loop's rows share one layout)
        WR: gl.constexpr = WARP_REDUCE and TOPK <= HELD_TOPK
        if WR:
            # warp w owns columns [w * BLOCK_N / WARPS, (w + 1) * BLOCK_N / WARPS): a row's max is one reduction per
            # warp, then one over the warps through shared memory
            layout: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [WARPS, 1], [1, 0])
            PART: gl.constexpr = BLOCK_N // WARPS
            warp_ids = gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
            part_cols = gl.arange(0, PART, layout=gl.SliceLayout(0, layout))
            cols = gl.expand_dims(warp_ids, 1) * PART + gl.expand_dims(part_cols, 0)
            if EVEN_N:
                mask_n = gl.full([WARPS, PART], 1, gl.int1, layout)
            else:
                mask_n = cols < N
            ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, WARPS, PART],
                                             gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            # two buffers, a row's for each parity: a row's writes need no barrier against the last row's reads
            scratch0 = gl.allocate_shared_memory(gl.float32, [WARPS], flat)
            scratch1 = gl.allocate_shared_memory(gl.float32, [WARPS], flat)
        else:
            layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [WARPS], [0])
            cols = gl.arange(0, BLOCK_N, layout=layout)
            if EVEN_N:
                mask_n = gl.full([BLOCK_N], 1, gl.int1, layout)
            else:
                mask_n = cols < N
            ring = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_N], ring_layout)
            scratch0 = None
            scratch1 = None
        # each copy group: a token's x and the next token's ids (a slot more than x's ring: a slot is refilled only
        # after a CTA barrier that every thread passed after reading it)
        ids_ring = gl.allocate_shared_memory(topk_ptr.dtype.element_ty, [STAGES + 1, 32 * gl.num_warps()], ring_layout)
        # k <= HELD_TOPK: a token's k rows unrolled, its ids held in registers (loaded from their slot a token ahead).
        # Larger k (the many-k form): a loop over the rows, each re-reading its ids from their slot, so the first
        # token's ids go through the ring too (slot 0). Held ids (two int64 [k] a thread) and unrolled rows took
        # 150-167 registers at k 8 where k 2 takes 128 (``_kernels.SMEM_QUANT_CONFIGS`` has the figures).
        HOLD_IDS: gl.constexpr = TOPK <= HELD_TOPK
        gl.static_assert(STAGES >= 2, "the ring stages at least one token ahead")
        if not HOLD_IDS:
            _stage_ids(ids_ring.index(0), topk_ptr, pid, T, stride_tk_t, stride_tk_j, TOPK)   # joins the first group
        for s in gl.static_range(STAGES - 1):
            _stage_token(ring.index(s), ids_ring.index(s + 1), x_ptr, topk_ptr, pid + s * step, pid + (s + 1) * step, T,
                         cols, mask_n, stride_xm, stride_tk_t, stride_tk_j, TOPK)
        KP: gl.constexpr = triton.next_power_of_2(TOPK)
        # the first token's expert ids, and the first row's expert row
        ids = _token_ids(topk_ptr, pid, T, stride_tk_t, stride_tk_j, TOPK, KP)
        smooth_valid, smooth = _expert_row(smooth_ptr, ids, 0, num_experts, stride_sm, cols, mask_n, KP)
        slot = 0
        it = 0
        for token in range(pid, T, step):
            # x into the slot read last iteration (each thread copies and reads back only its own elements), the
            # ids into the slot last read two iterations ago (a CTA barrier since)
            _stage_token(ring.index((slot + STAGES - 1) % STAGES), ids_ring.index((it + STAGES) % (STAGES + 1)), x_ptr,
                         topk_ptr, token + (STAGES - 1) * step, token + STAGES * step, T, cols, mask_n, stride_xm,
                         stride_tk_t, stride_tk_j, TOPK)
            async_copy.wait_group(STAGES - 1)
            _cta_barrier()   # the next token's ids landed (copied by other threads)
            if HOLD_IDS:
                ids_next = _slot_ids(ids_ring.index((it + 1) % (STAGES + 1)), KP)
            # read once for the token's k rows and held as read (16-bit x: half the registers of fp32), converted
            # per row (holding it converted measured 0.1-0.3% slower)
            x = ring.index(slot).load(layout)
            if HOLD_IDS:
                for j in gl.static_range(TOPK):
                    valid = smooth_valid
                    row_smooth = smooth
                    # the next row's expert row: this token's next choice, or the next token's first
                    if j + 1 < TOPK:
                        smooth_valid, smooth = _expert_row(smooth_ptr, ids, j + 1, num_experts, stride_sm, cols,
                                                           mask_n, KP)
                    else:
                        smooth_valid, smooth = _expert_row(smooth_ptr, ids_next, 0, num_experts, stride_sm, cols,
                                                           mask_n, KP)
                    _quant_row(x, row_smooth, j * T + token, valid, q_ptr, scale_ptr, N, cols, mask_n, QMAX,
                               scratch0 if j % 2 == 0 else scratch1, WR)
            else:
                for j in range(TOPK):
                    valid = smooth_valid
                    row_smooth = smooth
                    # the next row's: this token's next choice (slot `it`), or the next token's first (slot `it` + 1)
                    last = j + 1 == TOPK
                    source = _slot_ids(ids_ring.index((it + last.to(gl.int32)) % (STAGES + 1)), KP)
                    smooth_valid, smooth = _expert_row(smooth_ptr, source, (j + 1) % TOPK, num_experts, stride_sm,
                                                       cols, mask_n, KP)
                    _quant_row(x, row_smooth, j * T + token, valid, q_ptr, scale_ptr, N, cols, mask_n, QMAX)
            if HOLD_IDS:
                ids = ids_next
            slot = (slot + 1) % STAGES
            it += 1
        async_copy.wait_group(0)   # the last copies (of no token: masked) land before the program exits
