"""References and assertions that every tilekernels test and ``python -m tilekernels check`` use.

The rule (FlashAttention's): a kernel's error against an fp64 reference may be at most ``ratio`` times
the error PyTorch itself makes computing the same thing in the same low precision, plus NaN/inf parity.
That is fair to every dtype at once: fp32 (tf32 on a GPU) and bf16 get their own natural tolerance
instead of a hand-tuned atol/rtol.

- ``random_tensor`` / ``random_matrix``: random inputs (never zeros), optionally as a transposed view
  (column-major) so all GEMM layouts are reached without copies in the op under test.
- ``poisoned``: an output buffer pre-filled with NaN (or the integer minimum), so an element the kernel
  never wrote shows up as an error.
- ``reference_gemm``: the specification of ``tk.gemm`` in fp64 (or in the inputs' own dtype, to
  measure PyTorch's low-precision error).
- ``compare`` / ``assert_close``: the error-ratio rule, reporting relative RMS error, max error and
  where the worst element is.
- ``capture_graph``: a CUDA graph of a step, warmed up (compiled) outside the capture.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


# ----------------------------------------------------------------------------------------------------
# inputs and outputs


def random_tensor(shape: Sequence[int], dtype: torch.dtype, device="cpu", *, scale: float = 1.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard-normal values times ``scale`` (integers in [-8, 8) for int8), never all zeros."""
    if dtype == torch.int8:
        return torch.randint(-8, 8, tuple(shape), generator=generator, dtype=torch.int8).to(device)
    x = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return x.to(device=device, dtype=dtype)


def random_matrix(rows: int, cols: int, dtype: torch.dtype, device="cpu", *, column_major: bool = False,
                  scale: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """A ``[rows, cols]`` random matrix; ``column_major=True`` returns the transposed view of a
    contiguous ``[cols, rows]`` tensor (strides ``(1, rows)``)."""
    if column_major:
        return random_tensor((cols, rows), dtype, device, scale=scale, generator=generator).t()
    return random_tensor((rows, cols), dtype, device, scale=scale, generator=generator)


def poisoned(shape: Sequence[int], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN (integer dtypes: their minimum) so unwritten elements are caught."""
    if dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.full(tuple(shape), torch.iinfo(dtype).min, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------
# references


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")


def reference_gemm(a, b, *, bias=None, residual=None, mul=(), activation=None, alpha=1.0, beta=1.0,
                   scale_a=None, scale_b=None, out_dtype=None, compute_dtype=torch.float64):
    """``tk.gemm``'s specification in plain PyTorch.

    Epilogue order: ``acc*alpha*scale_a*scale_b + bias -> activation -> * each of mul ->
    + beta*residual -> cast``. ``compute_dtype=torch.float64`` (on the CPU) gives the exact reference;
    ``compute_dtype=None`` computes in the inputs' own dtype on their device, which is PyTorch's
    low-precision answer (fp32 under torch's current float32 matmul precision, which tk.gemm follows
    too) that the error rule compares with.
    Returns a tensor of ``out_dtype`` (default: the inputs' dtype; bf16 for fp8/int8) unless
    ``compute_dtype`` is fp64, in which case the fp64 result is returned uncast.
    """
    if out_dtype is None:
        out_dtype = a.dtype if a.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    exact = compute_dtype == torch.float64
    if exact:
        def conv(t):
            return None if t is None else t.detach().to(device="cpu", dtype=torch.float64)
    else:
        low = a.dtype if a.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32

        def conv(t):
            return None if t is None else t.detach().to(low)
    acc_a, acc_b = conv(a), conv(b)
    acc = acc_a @ acc_b
    if alpha != 1.0:
        acc = acc * alpha
    if scale_a is not None:
        sa = conv(torch.as_tensor(scale_a, device=a.device))
        acc = acc * (sa.reshape(-1, 1) if sa.dim() == 1 else sa)
    if scale_b is not None:
        sb = conv(torch.as_tensor(scale_b, device=a.device))
        acc = acc * sb
    if bias is not None:
        acc = acc + conv(bias)
    acc = apply_activation(acc, activation)
    for m in mul:
        acc = acc * conv(m)
    if residual is not None:
        acc = acc + beta * conv(residual)
    if exact:
        return acc
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------------------------------
# the error-ratio rule


@dataclasses.dataclass
class Comparison:
    """How far ``out`` is from the fp64 reference, next to how far PyTorch's own answer is."""

    name: str
    max_err: float
    max_err_torch: float
    rel_rms: float
    worst_index: tuple
    worst_out: float
    worst_ref: float
    ratio: float            # max_err / allowed-denominator; <= the rule's ratio passes
    parity_ok: bool
    parity_detail: str
    passed: bool

    def __str__(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        text = (f"{head} {self.name}: max err {self.max_err:.3e} at {self.worst_index} "
                f"(out {self.worst_out:.6g}, ref {self.worst_ref:.6g}); torch's own max err "
                f"{self.max_err_torch:.3e}; ratio {self.ratio:.2f}; rel RMS {self.rel_rms:.3e}")
        if not self.parity_ok:
            text += f"; NaN/inf parity broken: {self.parity_detail}"
        return text


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor, *,
            ratio: float = 2.0, atol: float | None = None) -> Comparison:
    """Apply the rule: ``max|out - ref| <= ratio * max|torch_out - ref| + atol``, plus NaN/inf parity.

    ``ref`` is the fp64 reference, ``torch_out`` PyTorch's answer in the same low precision.
    ``atol`` defaults to half a unit in the last place of the output dtype at ``max|ref|`` (the rule
    must not demand better than one rounding when PyTorch happens to be exact somewhere).
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    low64 = torch_out.detach().to(device="cpu", dtype=torch.float64)

    parity_ok, detail = True, ""
    for label, f_out, f_ref in (("NaN", torch.isnan(out64), torch.isnan(ref64)),
                                ("+inf", out64 == math.inf, ref64 == math.inf),
                                ("-inf", out64 == -math.inf, ref64 == -math.inf)):
        bad = f_out != f_ref
        if bool(bad.any()):
            parity_ok = False
            first = tuple(int(i) for i in bad.nonzero()[0])
            detail = (f"{int(bad.sum())} elements differ in {label}, first at {first} "
                      f"(out {out64[first].item()}, ref {ref64[first].item()})")
            break

    finite = torch.isfinite(ref64) & torch.isfinite(out64)
    diff = torch.where(finite, (out64 - ref64).abs(), torch.zeros_like(out64))
    diff_torch = torch.where(torch.isfinite(ref64) & torch.isfinite(low64), (low64 - ref64).abs(),
                             torch.zeros_like(low64))
    max_err = float(diff.max()) if diff.numel() else 0.0
    max_err_torch = float(diff_torch.max()) if diff_torch.numel() else 0.0
    ref_max = float(torch.where(finite, ref64.abs(), torch.zeros_like(ref64)).max()) if ref64.numel() else 0.0
    if atol is not None:
        floor = atol
    elif out.dtype.is_floating_point:
        floor = 0.5 * torch.finfo(out.dtype).eps * ref_max + 1e-30
    else:
        floor = 0.5
    ratio_measured = max_err / max(max_err_torch, floor)
    if diff.numel():
        flat = int(diff.argmax())
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        worst_out, worst_ref = float(out64[worst]), float(ref64[worst])
    else:
        worst, worst_out, worst_ref = (), 0.0, 0.0
    ref_rms = float(ref64[finite].pow(2).mean().sqrt()) if bool(finite.any()) else 0.0
    rel_rms = float(diff[finite].pow(2).mean().sqrt()) / ref_rms if ref_rms > 0 else 0.0
    passed = parity_ok and max_err <= ratio * max_err_torch + floor
    return Comparison(name, max_err, max_err_torch, rel_rms, worst, worst_out, worst_ref,
                      ratio_measured, parity_ok, detail, passed)


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor, *,
                 ratio: float = 2.0, atol: float | None = None) -> Comparison:
    """``compare`` and raise ``AssertionError`` with the full report when the rule fails."""
    result = compare(name, out, ref, torch_out, ratio=ratio, atol=atol)
    if not result.passed:
        raise AssertionError(str(result))
    return result


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


def assert_no_host_sync(step) -> None:
    """Run ``step()`` once (compiling and tuning outside the check), then again under torch's sync
    debug mode "error": any host synchronisation inside the second call raises."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def capture_graph(step, warmups: int = 2):
    """``(graph, outputs)``: ``step()`` run ``warmups`` times on a side stream (so kernels compile and
    caches fill outside the capture), then captured once; replaying ``graph`` rewrites ``outputs``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
