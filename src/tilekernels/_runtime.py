"""Device and interpreter facts shared by every op, and the device helpers every kernel uses.

Host side: whether kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``), which device a
tensor lives on, how many SMs it has, and whether it is a Hopper part.

Device side (``@triton.jit`` helpers imported by kernels):

- ``dot(a, b, acc)``: ``tl.dot`` on a GPU. Under the interpreter with triton 3.9, ``tl.dot`` on bf16
  operands returns garbage, so there (and only there) bf16 operands are widened to fp32 first; the
  products of two bf16 values are exact in fp32, so the result is what a bf16 tensor core computes.
- ``offset_i64(index, stride)``: ``index * stride`` in int64, for any address that can pass 2^31
  elements (paged KV caches, large batched strides).
"""

from __future__ import annotations

import copy
import functools
import os
import threading

import torch
import triton
import triton.language as tl


def is_interpreter() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Read once at import: triton's interpreter itself reads the variable at import time too.
INTERPRET = tl.constexpr(is_interpreter())

# Programs per "SM" under the interpreter: small, so persistent loops still visit several tiles each.
INTERPRETER_SM_COUNT = 4


def default_device() -> torch.device:
    """The device a user's tensors normally live on: CUDA if present, else CPU (interpreter)."""
    if torch.cuda.is_available() and not is_interpreter():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` where two elements of ``t`` may share an address (a stride of 0, an
    ``expand``ed or ``as_strided`` view): kernels writing ``t`` would race. The test is that each stride,
    in increasing order, steps past the span of the smaller ones (dims of size 1 aside); it is conservative:
    the rare interleaved layouts that fail it without overlapping (shape (2, 3), strides (3, 2)) are refused
    too. Shapes and strides only, so it also runs on traced (fake) tensors."""
    span = 0
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= span:
            raise ValueError(f"{name} must not have overlapping elements: strides {t.stride()} map two of its "
                             f"{tuple(t.shape)} elements to one address")
        span += (size - 1) * stride


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of memory that ``t``'s elements (non-negative strides) can touch."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _row_bytes(t: torch.Tensor):
    """For a ``t`` of two or more dims whose elements are contiguous past its first dim (or a 2-D ``t``
    contiguous along its first): (the other dim's stride in bytes, the byte offset of its first element
    within that period, the bytes it takes per period), else None. A slice of a fused buffer's rows (q of a
    QKV projection ``[T, H, D]``) has this form."""
    if t.dim() < 2:
        return None
    es = t.element_size()
    dense, expected = True, 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            dense = False
            break
        expected *= size
    blocks = [(expected, t.stride(0))] if dense else []
    if t.dim() == 2 and (t.stride(0) == 1 or t.shape[0] == 1):
        blocks.append((t.shape[0], t.stride(1)))
    for inner, stride in blocks:
        period = stride * es
        if period and inner * es <= period:
            return period, t.data_ptr() % period, inner * es
    return None


def may_overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` may share memory: their byte spans meet, unless both are blocks of the rows (or,
    2-D, the columns) of one buffer with the same row stride and apart within each row (slices of a fused QKV
    buffer).
    Tensors of different storages share no memory (torch's own rule for ``out=``: views of one allocation share
    its storage), which is also the fast answer for unrelated tensors."""
    if x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    (x0, x1), (y0, y1) = _byte_span(x), _byte_span(y)
    if x1 <= y0 or y1 <= x0:
        return False
    rx, ry = _row_bytes(x), _row_bytes(y)
    if rx is not None and ry is not None and rx[0] == ry[0]:
        period, gap = rx[0], (ry[1] - rx[1]) % rx[0]   # where y's bytes start, counted from x's, in each period
        return not (gap >= rx[2] and period - gap >= ry[2])
    return True


def check_out_memory(out: torch.Tensor, inputs: dict, hint: str) -> None:
    """ValueError naming the first of ``inputs`` (name -> tensor or None) that ``out`` may share memory with
    (``may_overlap``): a kernel reading it while other programs write ``out`` would give a silently wrong
    result. ``hint`` ends the message (what to pass instead)."""
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and may_overlap(out, t):
            raise ValueError(f"out overlaps {name} in memory; {hint}")


def check_runnable(device: torch.device, name: str = "input") -> None:
    """Raise unless kernels can run on ``device``: CUDA, or CPU under the interpreter."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and is_interpreter():
        return
    raise ValueError(
        f"{name} is on {device}; tilekernels runs on CUDA tensors, or on CPU tensors only under the "
        "Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
    )


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors (a small stand-in under the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device()).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability; (0, 0) on the CPU interpreter."""
    if device.type != "cuda":
        return (0, 0)
    props = _cuda_props(device.index if device.index is not None else torch.cuda.current_device())
    return (props.major, props.minor)


def is_hopper(device: torch.device) -> bool:
    return capability(device)[0] == 9


def device_name(device: torch.device | None = None) -> str:
    """Readable device name, 'cpu-interpreter' on the CPU."""
    device = device or default_device()
    if device.type != "cuda":
        return "cpu-interpreter"
    return _cuda_props(device.index if device.index is not None else torch.cuda.current_device()).name


def device_slug(device: torch.device | None = None) -> str:
    """Device name usable as a folder name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return "-".join(device_name(device).lower().replace("_", " ").split())


@functools.lru_cache(maxsize=None)
def supports_tensor_descriptors(device: torch.device) -> bool:
    """Host-side TMA tensor descriptors: Hopper or newer, and a triton that has them."""
    if device.type != "cuda" or capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


_thread_contexts = threading.local()


def ensure_cuda_context(device_index: int) -> None:
    """Make the device's primary CUDA context current in this thread, once per thread and device.

    Triton encodes a host TMA descriptor (``cuTensorMapEncodeTiled``) before its launcher makes the
    context current, so the first TMA launch in a thread that has made no CUDA runtime call fails with
    "invalid device context" -- torch's autograd backward thread is one (seen on an H100 with triton
    3.6). This does what Triton's launcher would: retain the primary context and set it current.
    """
    done = getattr(_thread_contexts, "devices", None)
    if done is None:
        done = _thread_contexts.devices = set()
    if device_index in done:
        return
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        dev = ctypes.c_int()
        for call, args in (("cuDeviceGet", (ctypes.byref(dev), device_index)),
                           ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
                           ("cuCtxSetCurrent", (ctx,))):
            err = getattr(cuda, call)(*args)
            if err != 0:
                raise RuntimeError(f"{call} failed with CUDA driver error {err} (device {device_index})")
    done.add(device_index)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def round_to_tf32(x):
    """Round fp32 to tf32 (10 mantissa bits) to nearest, ties away, as cuBLAS does.

    Tensor cores read only the top 10 mantissa bits of an fp32 operand, i.e. they truncate; rounding
    first halves the per-product error, which is what makes a tf32 product as accurate as cuBLAS's.
    """
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


def fp32_precision() -> str:
    """How fp32 products run, following torch's own switch (``torch.set_float32_matmul_precision``):
    "highest" (torch's default) -> "ieee" (fp32 FMA, as accurate as cuBLAS SGEMM); "high" or
    "medium" (``allow_tf32=True``) -> "tf32" tensor cores with operands rounded to nearest tf32."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@triton.jit
def interpreted_dot(a, b):
    """``a @ b`` of floating tiles under the interpreter, as fp32: products and sums in fp64, rounded once.

    The interpreter's ``tl.dot`` is numpy's fp32 matmul, whose BLAS sums K in an order that depends on the
    tile's shape (OpenBLAS on the CPU machine's AMD EPYC: rows of a 16-row tile differed in the last bit from
    the same rows of a 32-row tile), so kernels that are bit-identical across tile shapes on a GPU were not
    under the interpreter. Summed in fp64 (exact products), another order moves the sum by a few fp64 units,
    which changes the fp32 result only where the sum lies that close to an fp32 rounding boundary. Also right
    for bf16, whose interpreted ``tl.dot`` is wrong, and for fp8.
    """
    part = tl.dot(a.to(tl.float32).to(tl.float64), b.to(tl.float32).to(tl.float64))
    return part.to(tl.float32)


@triton.jit
def dot(a, b, acc, FP32_PRECISION: tl.constexpr):
    """``acc + a @ b`` with fp32 (int32 for int8) accumulation.

    Under the interpreter: ``interpreted_dot`` for floating tiles (the same bits whatever the tile shape; bf16
    ``tl.dot`` is wrong there). fp32 on a GPU: ``FP32_PRECISION`` "ieee" (FMA) or "tf32" (tensor cores, operands
    rounded to nearest tf32 first); the interpreter computes fp32 exactly either way.
    """
    if INTERPRET:
        if a.dtype == tl.int8:
            return tl.dot(a, b, acc)
        return acc + interpreted_dot(a, b)
    elif a.dtype == tl.float32:
        if FP32_PRECISION == "ieee":
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(round_to_tf32(a), round_to_tf32(b), acc, input_precision="tf32")
    elif a.dtype == tl.int8:
        return tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def offset_i64(index, stride):
    """``index * stride`` in int64: use for any address that can pass 2^31 elements."""
    return tl.cast(index, tl.int64) * stride


@triton.jit
def known_multiple(value, DIV: tl.constexpr):
    """``value`` (a multiple of ``DIV``, which the host has checked) in a form whose alignment the compiler
    sees: triton marks integer arguments divisible by 16 and no others, so a row stride (or a K-loop bound) of
    8 bf16 elements mod 16 would otherwise leave every row's loads (or their masks) unvectorised. ``DIV`` 1 is
    a no-op (a unit stride that triton has made the constant 1 stays 1)."""
    if DIV > 1:
        return (value // DIV) * DIV
    return value


@triton.jit
def cast_for_store(x, dtype: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest-even everywhere.

    The interpreter (triton 3.9) truncates fp32 -> bf16 even when asked for "rtne", which doubles the
    rounding error of every bf16 output on the CPU lane; and its fp32 -> float8e4nv cast drops the carry
    when rounding up crosses a power of two (125.9 -> 64, not 128). There the value is first rounded
    onto the target's grid on the bits (e4m3 subnormals, below 2^-6, in steps of 2^-9), so the cast
    itself is exact. ``x`` must already be within the target's range.
    """
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float8e4nv:
            x = x.to(tl.float32)
            bits = x.to(tl.uint32, bitcast=True)
            normal = ((bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000).to(tl.float32, bitcast=True)
            magnitude = tl.abs(x)
            subnormal = (magnitude + 24576.0) - 24576.0   # 1.5 * 2^14: fp32's step there is 2^-9
            subnormal = tl.where(x < 0, -subnormal, subnormal)
            x = tl.where(magnitude < 0.015625, subnormal, normal)
    return x.to(dtype)


@triton.jit
def compensated_dot(a, b, acc, comp):
    """fp32 ``acc + a @ b`` with Kahan compensation across K slices: returns (acc, comp).

    One FMA chain over all of K loses ~sqrt(K) roundings (measured 2-15x cuBLAS SGEMM's error at
    K = 4096 on an H100); summing each BLOCK_K slice on its own and adding the slices with a carried
    compensation term leaves about the error of one slice. Costs 4 adds per element per slice.
    """
    if INTERPRET:
        part = interpreted_dot(a, b)
    else:
        part = tl.dot(a, b, input_precision="ieee")
    y = part - comp
    total = acc + y
    comp = (total - acc) - y
    # Once the sum is inf, (inf - inf) would turn the compensation into NaN and the result with it.
    comp = tl.where(comp == comp, comp, 0.0)
    return total, comp


# ----------------------------------------------------------------------------------------------------
# trace events: kernels that take ``TRACE`` record (kind, start, end, tag) spans (tk.dist's trace=True;
# the host side is dist/trace.py)

TRACE_FETCH = tl.constexpr(1)
TRACE_WAIT = tl.constexpr(2)
TRACE_COMPUTE = tl.constexpr(3)


@triton.jit
def trace_clock(clock):
    """Now, as int64: ``%globaltimer`` ns on a GPU; under the interpreter the next tick of ``clock[0]``."""
    if INTERPRET:
        now = tl.atomic_add(clock, 1).to(tl.int64)
    else:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
    return now


@triton.jit
def trace_event(events, clock, program, slot, kind, start, tag, MAX_EVENTS: tl.constexpr):
    """Record ``(kind, start, now, tag)`` in row ``slot`` of ``program``; returns the next slot.

    ``events``: int64 ``[programs, MAX_EVENTS, 4]``; ``start``: an earlier ``trace_clock``; ``kind``:
    ``TRACE_FETCH | TRACE_WAIT | TRACE_COMPUTE``; ``tag``: an int the trace shows (tile, chunk, peer).
    """
    end = trace_clock(clock)
    if slot < MAX_EVENTS:
        row = events + (program * MAX_EVENTS + slot).to(tl.int64) * 4
        tl.store(row + 1, start)
        tl.store(row + 2, end)
        tl.store(row + 3, tag)
        tl.store(row, kind)
    return slot + 1



# ----------------------------------------------------------------------------------------------------
# launching a compiled kernel again without re-binding its arguments


def direct_launcher(compiled, device_index: int):
    """``launch(grid, args)`` for a kernel that ``jit_fn[grid](...)`` already compiled and returned;
    ``grid`` is an int (1-D) or a tuple of up to three ints.

    Triton's ``JITFunction.run`` re-derives the specialisation of every argument on every call (the
    "binder"): ~30 us on the device machine for the GEMM's 33 runtime arguments, as long as a whole
    skinny GEMM. An op that has already checked its arguments and keyed a cache on everything that
    specialisation depends on (dtypes, exact integer values, 16-byte alignment of pointers, ``None``-ness)
    can hand the next call's arguments straight to the compiled kernel's launcher with this.
    ``args`` are all of the kernel's parameters in declaration order, constexprs included, exactly
    what ``JITFunction.run`` passes (triton 3.6 and 3.9 share this calling convention). Returns None
    when this triton's ``CompiledKernel`` lacks that API; callers then keep using ``jit_fn[grid]``.

    Where the launcher is the one ``_raw_launch`` knows (triton 3.6's CUDA launcher) and no launch hook is
    registered, the call goes to its C entry point directly, with each host tensor descriptor's CUtensorMap
    taken from a small cache (see ``_raw_launch``): that is ~9 us of the ~32 us the launcher's Python takes on
    the device host. Anything else (another triton, a profiler's launch hook) takes triton's own path.
    """
    try:
        from triton import knobs

        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        launch_metadata = compiled.launch_metadata
        get_stream = triton.runtime.driver.active.get_current_stream
    except Exception:  # pragma: no cover - depends on the installed triton
        return None
    hooks = knobs.runtime
    raw = _raw_launch(compiled)

    def launch(grid, args) -> None:
        stream = get_stream(device_index)
        grid = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
        if raw is not None and _idle(hooks.launch_enter_hook) and _idle(hooks.launch_exit_hook):
            raw(grid, stream, args)
            return
        run(grid[0], grid[1], grid[2], stream, function, packed, launch_metadata(grid, stream, *args),
            hooks.launch_enter_hook, hooks.launch_exit_hook, *args)

    launch.raw = raw   # for tests: whether the fast path exists for this kernel
    return launch


def _idle(hook) -> bool:
    """Whether a launch hook slot calls nothing: None, or triton 3.6's empty ``HookChain``."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


# the C launcher's leading arguments in triton 3.6: grid x/y/z, stream, function, cooperative, pdl, global and
# profile scratch, kernel metadata, launch metadata, enter and exit hooks
_RAW_BASE_FORMAT = "iiiKKppOOOOOO"
_RAW_DESCRIPTOR_CACHE = 32   # tensor maps kept per descriptor argument of one compiled kernel


def _raw_launch(compiled):
    """``raw(grid3, stream, args)``: ``compiled``'s launch through its C launcher with no Python in between, or
    None where the launcher is not exactly triton 3.6's CUDA one (``CudaLauncher`` whose ``launch`` is the C
    function, or the ``wrap_handle_tensordesc`` closure around it) or needs scratch memory.

    What it skips, per call: ``CudaLauncher.__call__``'s scratch allocation (none here), the launch metadata
    (``LazyDict``; only launch hooks read it, and ``launch`` comes here only with none registered), and
    ``make_tensordesc_arg``'s encoding of every host descriptor into a CUtensorMap (~4 us each on the device host).
    A CUtensorMap depends only on the descriptor's base address, shape, strides and padding (its element type, box
    and swizzle are the compiled kernel's), so it is cached under exactly those; a miss encodes it as triton
    would."""
    try:
        from triton.backends.nvidia import driver as nv

        run = compiled.run
        if getattr(nv, "_BASE_ARGS_FORMAT", None) != _RAW_BASE_FORMAT or type(run).__name__ != "CudaLauncher":
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        launcher = run.launch
        if type(launcher).__name__ == "builtin_function_or_method":
            c_launch, positions, metas = launcher, (), ()
        else:
            code, closure = launcher.__code__, launcher.__closure__
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure or ())))
            if code.co_name != "inner" or set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
                return None
            c_launch, positions = cells["launcher"], tuple(sorted(cells["tensordesc_indices"]))
            metas = tuple(cells["tensordesc_meta"] or (None,) * len(positions))
            if type(c_launch).__name__ != "builtin_function_or_method" or len(metas) != len(positions):
                return None
        make_arg = nv.make_tensordesc_arg
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                None, None, None)
    except Exception:  # pragma: no cover - depends on the installed triton
        return None
    caches = tuple({} for _ in positions)

    def expand(slot: int, desc) -> list:
        if metas[slot] is None:   # passed as the tensor, its shape and strides (nothing to encode, nothing to keep)
            return make_arg(desc, None)
        key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        cache = caches[slot]
        words = cache.get(key)
        if words is None:
            if len(cache) >= _RAW_DESCRIPTOR_CACHE:
                cache.clear()
            words = cache[key] = make_arg(desc, metas[slot])
        return words

    if not positions:
        def raw(grid, stream, args) -> None:
            c_launch(grid[0], grid[1], grid[2], stream, *head, *args)
        return raw

    def raw(grid, stream, args) -> None:
        flat, start = [], 0
        for slot, at in enumerate(positions):
            flat += args[start:at]
            flat += expand(slot, args[at])
            start = at + 1
        flat += args[start:]
        c_launch(grid[0], grid[1], grid[2], stream, *head, *flat)

    return raw


class CachedLaunch:
    """One kernel's launch for one cached call signature: the grid, the constexprs and launch options,
    and after the first call on a GPU a ``direct_launcher`` that skips triton's per-call binder.

    The caller keys its cache on everything triton specialises on (argument dtypes and ``None``-ness,
    pointer 16-byte alignment, integer values) and passes the runtime arguments in declaration order;
    the constexprs must be the kernel's trailing parameters, in order (else every call goes through
    ``jit_fn[grid]``, which is correct, only slower).
    """

    __slots__ = ("kernel", "grid", "constexprs", "options", "values", "launch", "compiled")

    def __init__(self, kernel, grid, constexprs: dict, **options):
        """``grid``: an int (1-D) or a tuple of up to three ints."""
        self.kernel, self.grid, self.constexprs, self.options = kernel, grid, constexprs, options
        self.values = tuple(constexprs.values())
        self.launch = None
        self.compiled = False   # whether a call or ``prepare`` has compiled the kernel (GPU)

    def __call__(self, args: tuple, device: torch.device) -> None:
        if self.launch is not None:
            self.launch(self.grid, args + self.values)
            return
        compiled = self.kernel[self._grid()](*args, **self.constexprs, **self.options)
        self._take(compiled, args, device)

    def prepare(self, args: tuple, device: torch.device) -> None:
        """Compile and load the kernel for these arguments (as ``__call__`` takes them) without launching, unless
        that is done. Loading a kernel waits for the kernels running on the device, so a launch that follows one
        whose programs wait for a producer (an async-input GEMM's row tail: its caller may start the producer only
        once the call has returned) must be loaded before that one starts. Nothing to do off a GPU."""
        if self.compiled or device.type != "cuda":
            return
        with torch.cuda.device(device):
            compiled = self.kernel.warmup(*args, grid=self._grid(), **self.constexprs, **self.options)
            load = getattr(compiled, "_init_handles", None)   # triton loads the module lazily, at the first launch
            if load is not None:
                load()
        self._take(compiled, args, device)

    def _grid(self) -> tuple:
        return (self.grid,) if isinstance(self.grid, int) else tuple(self.grid)

    def _take(self, compiled, args: tuple, device: torch.device) -> None:
        if device.type != "cuda":
            return
        self.compiled = True
        if list(self.constexprs) == self.kernel.arg_names[len(args):]:
            self.launch = direct_launcher(compiled, device.index)


class ClusterLaunch(CachedLaunch):
    """A ``CachedLaunch`` whose programs run as thread-block clusters of ``cluster`` programs each (Hopper),
    with ``extra_smem`` bytes of shared memory past the kernel's own, which the kernel addresses from the end
    of its dynamic shared memory (``%dynamic_smem_size``) and its cluster partners through ``mapa``.

    The kernel is compiled as usual (one CTA per program: ``program_id`` is the CTA's index, consecutive
    programs ``cluster * c .. cluster * c + cluster - 1`` form cluster ``c``); only the launch differs:
    triton's launcher takes the cluster size and the shared-memory bytes from the compiled kernel's
    ``packed_metadata``, so a copy of it with those two changed launches ``grid * cluster`` programs in
    clusters. ``prepare`` compiles without launching (a first launch without clusters would run the
    kernel's cluster instructions outside a cluster) and says how many clusters the device runs at once,
    so that a persistent grid can be sized to be resident. Raises RuntimeError where triton's
    ``CompiledKernel`` does not have that API (callers then use a kernel without clusters).
    """

    __slots__ = ("cluster", "extra_smem")

    def __init__(self, kernel, grid: int, constexprs: dict, cluster: int, extra_smem: int, **options):
        """``grid``: the number of clusters (1-D)."""
        super().__init__(kernel, grid, constexprs, **options)
        self.cluster, self.extra_smem = cluster, extra_smem

    def prepare(self, args: tuple, device: torch.device) -> int:
        """Compile for these arguments (as ``__call__`` takes them) and return the most clusters the device
        keeps resident at once."""
        if list(self.constexprs) != self.kernel.arg_names[len(args):]:
            raise RuntimeError("ClusterLaunch: the constexprs must be the kernel's trailing parameters")
        with torch.cuda.device(device):
            compiled = self.kernel.warmup(*args, grid=(self.grid,), **self.constexprs, **self.options)
            try:
                compiled._init_handles()
                num_warps, _, shared = compiled.packed_metadata
                patched = copy.copy(compiled)
                patched.packed_metadata = (num_warps, self.cluster, -(-shared // 16) * 16 + self.extra_smem)
                utils = triton.runtime.driver.active.utils
                resident = utils.cuOccupancyMaxActiveClusters(compiled.function, patched.packed_metadata[2],
                                                             self.cluster)
            except Exception as error:  # pragma: no cover - depends on the installed triton
                raise RuntimeError(f"ClusterLaunch: this triton cannot launch clusters ({error})") from error
        launch = direct_launcher(patched, device.index)
        if launch is None or resident < 1:  # pragma: no cover - depends on the installed triton
            raise RuntimeError("ClusterLaunch: this triton or device cannot launch the clusters")
        self.launch, self.compiled = launch, True
        return resident

    def __call__(self, args: tuple, device: torch.device) -> None:
        if self.launch is None:
            self.prepare(args, device)
        self.launch(self.grid, args + self.values)


def descriptor_template(view: torch.Tensor, shape, strides, block_shape):
    """A host TensorDescriptor over ``view`` validated once and holding no tensor (a cached plan that
    kept the first call's operands would keep their memory alive); ``rebase`` puts each call's tensor
    of the same shape, strides and alignment under it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return as_template(TensorDescriptor(view, list(shape), list(strides), list(block_shape)))


def as_template(descriptor):
    """A host tensor descriptor (triton's or Gluon's), already validated by its constructor, made into a
    template for ``rebase``: it keeps no tensor (a cached plan must not keep the first call's operands
    alive)."""
    descriptor.base = None
    return descriptor


def rebase(template, view: torch.Tensor):
    """``template`` (``descriptor_template``, already validated for this shape, strides and alignment)
    over ``view``'s storage, without re-running the constructor's checks (~5 us each on the device
    host)."""
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = view
    return d


def tensor_key(t: torch.Tensor | None):
    """What a cached launch depends on for one optional tensor argument: triton specialises pointers
    on dtype and 16-byte alignment, and the strides and shape are baked into the plan."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0)


def plain_eager(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` may launch directly instead of through its torch.library op: a plain
    tensor (not a fake tensor or other subclass) outside torch.compile's tracing. The ops' eager fast
    paths (the op's own launch, minus the dispatcher's host cost) take it."""
    return type(t) is torch.Tensor and not torch.compiler.is_compiling()


def on_current_device(t: torch.Tensor) -> bool:
    """Whether a launch for ``t`` may go ahead as is: triton launches on the current CUDA device."""
    return not t.is_cuda or t.device.index == torch.cuda.current_device()


def cache_put(cache: dict, key, value, limit: int = 1024):
    """``cache[key] = value``, dropping the oldest entry past ``limit``; returns ``value``."""
    if len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


# ----------------------------------------------------------------------------------------------------
# error tables: what a kernel whose bounded wait gave up leaves for the host


class ErrorTable:
    """int32 words a kernel sets when a wait gives up: word 0 "something failed", word 1 + i "item i
    never arrived". On a GPU the table is pinned host memory, mapped into the device's address space:
    the kernel writes it only on failure, and the host reads it at any time without synchronising."""

    def __init__(self, device: torch.device, words: int):
        self.tensor = torch.zeros(words, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.words = self.tensor.numpy()


# (device type, index) -> tables, newest last. An outgrown table is kept: a captured CUDA graph may
# still write it.
_ERROR_TABLES: dict[tuple, list[ErrorTable]] = {}


def _device_key(device: torch.device) -> tuple:
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return device.type, index


def error_table(device: torch.device, items: int) -> torch.Tensor:
    """The error table a kernel on ``device`` writes when a wait on one of ``items`` things gives up."""
    tables = _ERROR_TABLES.setdefault(_device_key(device), [])
    if not tables or tables[-1].words.size < 1 + items:
        tables.append(ErrorTable(device, max(1 + items, 1024)))
    return tables[-1].tensor


def check_errors(device: torch.device, what: str) -> None:
    """Raise ``TimeoutError`` if a kernel on ``device`` recorded a wait that gave up, naming the items;
    reads what has landed so far and does not synchronise. ``what`` names the items ("chunk")."""
    failed = []
    for table in _ERROR_TABLES.get(_device_key(device), []):
        if table.words[0]:
            failed += [int(i) for i in table.words[1:].nonzero()[0]]
            table.words[:] = 0
    if failed:
        raise TimeoutError(
            f"a tilekernels wait gave up: {what}(s) {', '.join(map(str, sorted(set(failed))))} never reached "
            "its signal value within max_spins polls; the tiles that needed them were skipped (their "
            "output rows were not written). Check the producer, its signal_value (epoch) and stream.")


# Other owners of error tables (tk.dist workspaces): (device, weak reference to their ``check``).
_ERROR_CHECKS: list = []


def register_error_check(device: torch.device, weak_check) -> None:
    """Have ``raise_pending_errors`` also synchronise ``device`` and call ``weak_check()()`` (a
    ``weakref.WeakMethod``)."""
    _ERROR_CHECKS[:] = [(d, w) for d, w in _ERROR_CHECKS if w() is not None] + [(device, weak_check)]


def raise_pending_errors() -> None:
    """Wait for the work queued on every device that ran a bounded-wait kernel and raise
    ``TimeoutError`` if any wait gave up (see ``tk.AsyncInputScheduler`` and ``tk.dist``)."""
    devices = {torch.device(kind, index) for kind, index in _ERROR_TABLES}
    devices |= {device for device, weak_check in _ERROR_CHECKS if weak_check() is not None}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for (kind, index) in list(_ERROR_TABLES):
        check_errors(torch.device(kind, index), "chunk")
    for _, weak_check in list(_ERROR_CHECKS):
        check = weak_check()
        if check is not None:
            check()
