"""tk.flash_attn_func / tk.flash_attn_varlen_func against the fp64 reference, by the error-ratio rule.

The rule (FlashAttention's): out and lse within 2x, dq/dk/dv within 3x, of the error PyTorch makes
computing ``reference_attention`` in the inputs' own fp16/bf16; NaN/inf parity (an empty row's lse is
+inf in both).

CPU lane (no marker; ``TRITON_INTERPRET=1``): small odd shapes (seqlens 1, 37/53, 113/203, seqlen_q
above and below seqlen_k with causal masks aligned bottom-right, zero-length sequences inside varlen),
GQA/MQA, every feature alone and combined, dropout against the kernels' own keep mask, determinism,
non-contiguous inputs, varlen against batch mode, torch.compile and argument checks.

GPU lane (``-m gpu``): real sizes, every head dim, CUDA graph capture of varlen forward+backward
replayed over other sequence-length mixes, and proof that nothing synchronises the host.

Ids read ``B2-Sq37-Sk53-H4-Hk2-D40-causal-fp16`` (varlen: ``varlen-Sq37,0,113-Sk53,17,203-...``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
import triton

import tilekernels as tk
from tilekernels.attention._fwd import draw_philox_seed, dropout_keep_mask
from tilekernels.attention.reference import reference_attention
from tilekernels.testing import assert_close, assert_no_host_sync, capture_graph, random_tensor

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

gpu = pytest.mark.gpu


# ====================================================================================================
# cases, inputs and the check every test uses


@dataclasses.dataclass
class Case:
    """One attention problem. ``seqlen_q``/``seqlen_k`` are ints (batch mode, ``batch`` sequences) or
    tuples of per-sequence lengths (varlen mode). ``options`` are flash_attn keywords, except that
    ``alibi`` is ``"H"`` or ``"BH"`` (the slopes' shape; made on the test's device)."""

    batch: int
    seqlen_q: int | tuple
    seqlen_k: int | tuple
    heads: int
    heads_k: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def varlen(self) -> bool:
        return isinstance(self.seqlen_q, tuple)

    @property
    def name(self) -> str:
        def lengths(s):
            return ",".join(map(str, s)) if isinstance(s, tuple) else str(s)

        head = "varlen" if self.varlen else f"B{self.batch}"
        parts = [head, f"Sq{lengths(self.seqlen_q)}", f"Sk{lengths(self.seqlen_k)}", f"H{self.heads}",
                 f"Hk{self.heads_k}", f"D{self.head_dim}"]
        for key, value in self.options.items():
            if key == "causal":
                parts.append("causal" if value else "noncausal")
            elif key == "window_size":
                parts.append(f"win{value[0]},{value[1]}")
            elif key == "alibi":
                parts.append(f"alibi{value}")
            elif key == "softmax_scale":
                parts.append(f"scale{value}")
            elif key == "dropout_p":
                parts.append(f"drop{value}")
            else:
                parts.append(f"{key}{value}")
        parts.append(DTYPE_NAMES[self.dtype])
        return "-".join(parts)

    def param(self, marks=()):
        return pytest.param(self, id=self.name, marks=marks)


def batch_case(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype=torch.float16, **options):
    return Case(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, options)


def varlen_case(lengths_q, lengths_k, heads, heads_k, head_dim, dtype=torch.float16, **options):
    assert len(lengths_q) == len(lengths_k)
    return Case(len(lengths_q), tuple(lengths_q), tuple(lengths_k), heads, heads_k, head_dim, dtype, options)


@dataclasses.dataclass
class Problem:
    """A case's tensors: q, k, v, and for varlen the cu_seqlens and max_seqlens; op keywords."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    options: dict

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


def cu_seqlens(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def alibi_slopes(kind, batch, heads, device) -> torch.Tensor:
    """Random positive fp32 slopes, ``[H]`` or ``[B, H]``, around the sizes ALiBi uses (2^-1 .. 2^-8)."""
    shape = (heads,) if kind == "H" else (batch, heads)
    return torch.exp2(-8 * torch.rand(shape)).to(device)


def make_problem(case: Case, device) -> Problem:
    options = dict(case.options)
    if "alibi" in options:
        options["alibi_slopes"] = alibi_slopes(options.pop("alibi"), case.batch, case.heads, device)
    H, Hk, D = case.heads, case.heads_k, case.head_dim
    if case.varlen:
        q = random_tensor((sum(case.seqlen_q), H, D), case.dtype, device)
        k = random_tensor((sum(case.seqlen_k), Hk, D), case.dtype, device)
        v = random_tensor((sum(case.seqlen_k), Hk, D), case.dtype, device)
        return Problem(q, k, v, cu_seqlens(case.seqlen_q, device), cu_seqlens(case.seqlen_k, device),
                       max(case.seqlen_q), max(case.seqlen_k), options)
    q = random_tensor((case.batch, case.seqlen_q, H, D), case.dtype, device)
    k = random_tensor((case.batch, case.seqlen_k, Hk, D), case.dtype, device)
    v = random_tensor((case.batch, case.seqlen_k, Hk, D), case.dtype, device)
    return Problem(q, k, v, None, None, case.seqlen_q, case.seqlen_k, options)


def flash(problem: Problem, q, k, v, *, fn=None, **overrides):
    """The op under test on ``q, k, v`` (batch or varlen as ``problem`` says), ``return_attn_probs=True``."""
    options = {**problem.options, **overrides, "return_attn_probs": True}
    if problem.varlen:
        fn = fn or tk.flash_attn_varlen_func
        return fn(q, k, v, problem.cu_seqlens_q, problem.cu_seqlens_k, problem.max_seqlen_q,
                  problem.max_seqlen_k, **options)
    fn = fn or tk.flash_attn_func
    return fn(q, k, v, **options)


def reference(problem: Problem, q, k, v, compute_dtype, dropout_keep=None):
    options = {key: value for key, value in problem.options.items() if key != "deterministic"}
    return reference_attention(q, k, v, cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k,
                               compute_dtype=compute_dtype, dropout_keep=dropout_keep, **options)


def leave_nan_in_allocator(*like: torch.Tensor) -> None:
    """Allocate and free NaN-filled blocks the size of the op's outputs: CUDA's caching allocator hands
    them out next, so an output element the kernels never write (an empty row, a zero-length sequence)
    reads as NaN instead of a lucky zero."""
    for t in like:
        torch.full(t.shape, math.nan, dtype=t.dtype, device=t.device)


def expected_lse_shape(problem: Problem) -> tuple:
    if problem.varlen:
        return (problem.q.shape[1], problem.q.shape[0])
    batch, seqlen_q, heads, _ = problem.q.shape
    return (batch, heads, seqlen_q)


def check_lse(name, lse, ref_lse, problem: Problem, q, k, v, dropout_keep=None):
    """lse is fp32 accumulated from fp16/bf16 products, which fp32 holds exactly: the fair comparison is
    PyTorch's fp32 answer on the same inputs (not its fp16 one, a thousand times looser), with a floor
    of 1e-5 * max|lse| for the kernels' exp2/log2 approximations."""
    with torch.no_grad():
        _, fp32_lse = reference(problem, q.detach(), k.detach(), v.detach(), torch.float32, dropout_keep)
    finite = ref_lse.detach()[torch.isfinite(ref_lse.detach())]
    atol = 1e-5 * max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)
    assert_close(f"lse-{name}", lse, ref_lse, fp32_lse, atol=atol)


def check_problem(name, problem: Problem, *, backward=True, dropout_keep=None, q=None, k=None, v=None):
    """Run the op (forward, and backward via ``out.backward(dout)``) and assert out, lse, dq, dk, dv by
    the error-ratio rule. ``q, k, v`` default to leaves copied from the problem; pass views to test
    strided inputs. Returns the op's out, lse and gradients."""
    q, k, v = (t.detach().requires_grad_(backward) if t is not None else s.detach().clone().requires_grad_(backward)
               for t, s in ((q, problem.q), (k, problem.k), (v, problem.v)))
    dtype = q.dtype
    leave_nan_in_allocator(q, torch.empty(expected_lse_shape(problem), dtype=torch.float32, device=q.device))
    result = flash(problem, q, k, v)
    assert isinstance(result, tuple) and len(result) == 3, "return_attn_probs=True must give (out, lse, None)"
    out, lse, probs = result
    assert probs is None, "the attention probabilities are not returned (FA2 returns None without dropout)"
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device, f"{name}: out {out.shape}"
    assert lse.shape == expected_lse_shape(problem) and lse.dtype == torch.float32, f"{name}: lse {lse.shape}"

    exact = [t.detach().to(torch.float64).requires_grad_(backward) for t in (q, k, v)]
    low = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    ref_out, ref_lse = reference(problem, *exact, torch.float64, dropout_keep)
    low_out, _ = reference(problem, *low, dtype, dropout_keep)
    assert_close(f"out-{name}", out, ref_out, low_out)
    check_lse(name, lse, ref_lse, problem, q, k, v, dropout_keep)
    if not backward:
        return out, lse, None

    dout = random_tensor(out.shape, dtype, out.device)
    out.backward(dout)
    ref_grads = torch.autograd.grad(ref_out, exact, dout.to(torch.float64))
    low_grads = torch.autograd.grad(low_out, low, dout)
    grads = (q.grad, k.grad, v.grad)
    # Half a unit in the last place at the largest gradient of the three: dq is exactly 0 where a row
    # sees a single key, which torch's softmax backward reproduces and FlashAttention's (delta from the
    # rounded out) cannot.
    atol = 0.5 * torch.finfo(dtype).eps * max(float(r.abs().max()) if r.numel() else 0.0 for r in ref_grads)
    for label, g, leaf, r, lo in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads, low_grads):
        assert g.shape == leaf.shape and g.dtype == dtype, f"{label}-{name}: {tuple(g.shape)} {g.dtype}"
        assert_close(f"{label}-{name}", g, r, lo, ratio=3.0, atol=atol)
    return out, lse, grads


def check_case(case: Case, device, **kwargs):
    return check_problem(case.name, make_problem(case, device), **kwargs)


# ====================================================================================================
# the reference itself (plain PyTorch): it must agree with torch's SDPA where the two overlap


def test_reference_matches_sdpa():
    """Non-causal with GQA, and causal with an explicit bottom-right mask, against SDPA's math in fp64."""
    q = torch.randn(2, 37, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 53, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 53, 2, 16, dtype=torch.float64)

    def sdpa(mask=None, scale=None):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    out, lse = reference_attention(q, k, v)
    torch.testing.assert_close(out, sdpa())
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) / 4.0
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    out, _ = reference_attention(q, k, v, causal=True, softmax_scale=0.3)
    bottom_right = torch.ones(37, 53, dtype=torch.bool).tril(diagonal=53 - 37)
    torch.testing.assert_close(out, sdpa(bottom_right, 0.3))
    out, _ = reference_attention(q, k, v, window_size=(5, 2))
    ones = torch.ones(37, 53, dtype=torch.bool)
    band = ones.tril(diagonal=53 - 37 + 2) & ~ones.tril(diagonal=53 - 37 - 5 - 1)
    torch.testing.assert_close(out, sdpa(band))


def test_reference_empty_rows_and_varlen():
    """Causal with seqlen_q > seqlen_k: the first rows see no key (out 0, lse +inf, no NaN gradient);
    varlen with zero-length sequences equals batch mode sequence by sequence."""
    q = torch.randn(1, 10, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = reference_attention(q, k, v, causal=True, alibi_slopes=torch.rand(2))
    assert bool((out[:, :6] == 0).all()) and bool((lse[..., :6] == math.inf).all())
    assert bool(torch.isfinite(out[:, 6:]).all()) and bool(torch.isfinite(lse[..., 6:]).all())
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))

    lengths_q, lengths_k = (5, 0, 7, 3), (7, 2, 0, 11)
    qv = torch.randn(sum(lengths_q), 4, 8, dtype=torch.float64)
    kv = torch.randn(sum(lengths_k), 2, 8, dtype=torch.float64)
    vv = torch.randn(sum(lengths_k), 2, 8, dtype=torch.float64)
    slopes = torch.rand(4, 4)
    keep = torch.rand(4, 4, 7, 11) > 0.25
    options = {"causal": True, "window_size": (4, -1), "softcap": 3.0, "dropout_p": 0.25}
    out, lse = reference_attention(qv, kv, vv, cu_seqlens_q=cu_seqlens(lengths_q, "cpu"),
                                   cu_seqlens_k=cu_seqlens(lengths_k, "cpu"), alibi_slopes=slopes,
                                   dropout_keep=keep, **options)
    assert out.shape == qv.shape and lse.shape == (4, sum(lengths_q))
    start_q = start_k = 0
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(start_q, start_q + len_q), slice(start_k, start_k + len_k)
        out_b, lse_b = reference_attention(qv[None, rows], kv[None, keys], vv[None, keys],
                                           alibi_slopes=slopes[b:b + 1],
                                           dropout_keep=keep[b:b + 1, :, :len_q, :len_k], **options)
        torch.testing.assert_close(out[rows], out_b[0])
        torch.testing.assert_close(lse[:, rows], lse_b[0])
        start_q, start_k = start_q + len_q, start_k + len_k
    assert bool((out[5:12] == 0).all()) and bool((lse[:, 5:12] == math.inf).all())  # the k-less sequence


def test_reference_low_precision_is_torch_low_precision():
    q, k, v = (random_tensor((1, 33, 2, 32), torch.bfloat16) for _ in range(3))
    out, lse = reference_attention(q, k, v, causal=True, compute_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact, _ = reference_attention(q, k, v, causal=True)
    low_error = float((out.double() - exact).abs().max())
    assert 1e-4 < low_error < 5e-2, low_error


# ====================================================================================================
# CPU lane


SHAPE_CASES = [
    batch_case(1, 1, 1, 2, 2, 16, causal=False),
    batch_case(1, 1, 1, 2, 1, 16, torch.bfloat16, causal=True),
    batch_case(2, 37, 53, 4, 2, 40, causal=False),
    batch_case(2, 37, 53, 4, 2, 40, torch.bfloat16, causal=True),
    batch_case(1, 113, 203, 2, 1, 64, torch.bfloat16, causal=True),   # MQA
    batch_case(1, 113, 203, 2, 2, 64, causal=False),
    batch_case(1, 203, 113, 2, 2, 64, causal=True),                   # rows 0..89 see no key
    batch_case(2, 1, 53, 2, 1, 16, causal=True),                      # one query sees every key
    batch_case(1, 53, 1, 2, 2, 16, torch.bfloat16, causal=True),      # one key, seen by the last query only
    batch_case(1, 37, 37, 3, 1, 80, causal=True),
    batch_case(1, 29, 45, 2, 2, 96, torch.bfloat16, causal=False),
]


@pytest.mark.parametrize("case", [c.param() for c in SHAPE_CASES])
def test_shapes(case, device):
    check_case(case, device)


def test_empty_rows_are_zero(device):
    """Causal with seqlen_q > seqlen_k (bottom-right): the first rows see no key, give out 0 and lse +inf,
    and their dq is 0 (not NaN)."""
    case = batch_case(1, 45, 20, 2, 1, 32, causal=True)
    out, lse, (dq, _, _) = check_case(case, device)
    assert bool((out[:, :25] == 0).all()) and bool((lse[..., :25] == math.inf).all())
    assert bool((dq[:, :25] == 0).all())


FEATURE_CASES = [
    batch_case(2, 37, 53, 4, 2, 40, window_size=(8, -1)),
    batch_case(2, 37, 53, 4, 2, 40, torch.bfloat16, window_size=(-1, 5)),
    batch_case(2, 37, 53, 4, 2, 40, window_size=(7, 3)),
    batch_case(1, 53, 37, 2, 1, 40, torch.bfloat16, window_size=(6, 2)),  # rows whose window is past the keys
    batch_case(1, 37, 53, 2, 2, 40, window_size=(0, 0)),                  # the diagonal key alone
    batch_case(2, 37, 53, 4, 2, 40, torch.bfloat16, causal=True, window_size=(10, -1)),
    batch_case(2, 37, 53, 4, 2, 40, softcap=5.0),
    batch_case(1, 113, 203, 2, 1, 64, torch.bfloat16, causal=True, softcap=2.0),
    batch_case(2, 37, 53, 4, 2, 40, causal=True, alibi="H"),
    batch_case(2, 37, 53, 4, 2, 40, torch.bfloat16, causal=False, alibi="BH"),
    batch_case(1, 53, 37, 2, 2, 40, causal=True, alibi="BH"),
    batch_case(2, 37, 53, 4, 2, 40, softmax_scale=0.3),
    batch_case(2, 37, 53, 4, 1, 40, torch.bfloat16, causal=True, softmax_scale=0.05, softcap=8.0),
    batch_case(2, 37, 53, 4, 2, 40, causal=True, window_size=(12, -1), softcap=8.0, alibi="BH",
               softmax_scale=0.2),
]


@pytest.mark.parametrize("case", [c.param() for c in FEATURE_CASES])
def test_features(case, device):
    check_case(case, device)


VARLEN_CASES = [
    varlen_case((37, 0, 113, 1), (53, 17, 203, 0), 4, 2, 40, causal=True),  # zero q and zero k lengths
    varlen_case((37, 0, 113, 1), (53, 17, 203, 0), 4, 2, 40, torch.bfloat16, causal=False),
    varlen_case((1, 53, 29), (1, 37, 29), 2, 1, 64, causal=True),  # seqlen_q > seqlen_k inside a batch
    varlen_case((37, 0, 61), (53, 20, 40), 4, 2, 40, torch.bfloat16, window_size=(9, 4), alibi="BH",
                softcap=6.0),
    varlen_case((37, 5, 61), (53, 20, 40), 4, 4, 16, alibi="H", causal=True),
]


@pytest.mark.parametrize("case", [c.param() for c in VARLEN_CASES])
def test_varlen(case, device):
    check_case(case, device)


def test_varlen_rows_past_the_last_sequence(device):
    """Rows of q/k/v past cu_seqlens[-1] (a buffer sized for more tokens, here holding NaN) belong to no
    sequence: their output is 0 with LSE +inf and their gradients are 0, and they leak into nothing."""
    cu_q = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 11, 16], dtype=torch.int32, device=device)
    q = random_tensor((26, 2, 32), torch.float16, device)
    k = random_tensor((21, 1, 32), torch.float16, device)
    v = random_tensor((21, 1, 32), torch.float16, device)
    q[20:], k[16:], v[16:] = float("nan"), float("nan"), float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, _ = tk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 11, causal=True, return_attn_probs=True)
    dout = random_tensor(out.shape, torch.float16, device)
    dout[20:] = float("nan")
    out.backward(dout)
    assert not torch.isnan(out[:20]).any() and not torch.isnan(lse[:, :20]).any()
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))
    assert bool((lse[:, 20:] == float("inf")).all())
    for name, grad, real in (("dq", q.grad, 20), ("dk", k.grad, 16), ("dv", v.grad, 16)):
        assert not torch.isnan(grad[:real]).any(), f"{name}: NaN from the padding rows reached real rows"
        assert torch.equal(grad[real:], torch.zeros_like(grad[real:])), f"{name}: padding rows not zero"


def test_varlen_zero_length_sequences(device):
    """A sequence with no keys gives out 0 and lse +inf; one with no queries leaves its keys' dk, dv 0."""
    case = varlen_case((7, 0, 9), (11, 13, 0), 2, 1, 32, causal=False)
    out, lse, (_, dk, dv) = check_case(case, device)
    assert bool((out[7:] == 0).all()) and bool((lse[:, 7:] == math.inf).all())
    assert bool((dk[11:24] == 0).all()) and bool((dv[11:24] == 0).all())


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_varlen_equals_batch(causal, device):
    """Equal lengths packed as varlen give what batch mode gives (lse laid out [H, total] not [B, H, S])."""
    B, S, H, D = 2, 37, 4, 40
    case = batch_case(B, S, S, H, 2, D, causal=causal, alibi="BH")
    batch = make_problem(case, device)
    cu = cu_seqlens([S] * B, device)
    packed = Problem(batch.q.flatten(0, 1), batch.k.flatten(0, 1), batch.v.flatten(0, 1), cu, cu, S, S,
                     batch.options)
    torch.manual_seed(0)
    out_b, lse_b, grads_b = check_problem(case.name, batch)
    torch.manual_seed(0)  # the same dout
    out_v, lse_v, grads_v = check_problem("varlen-" + case.name, packed)
    torch.testing.assert_close(out_v.view(B, S, H, D), out_b)
    torch.testing.assert_close(lse_v.view(H, B, S).transpose(0, 1), lse_b)
    for label, g_v, g_b in zip(("dq", "dk", "dv"), grads_v, grads_b):
        torch.testing.assert_close(g_v.view(g_b.shape), g_b, msg=lambda m, label=label: f"{label}: {m}")


def test_return_attn_probs(device):
    """Without return_attn_probs the op returns out alone; with it, (out, lse, None) in both modes."""
    problem = make_problem(batch_case(2, 9, 13, 2, 1, 16, causal=True), device)
    out = tk.flash_attn_func(problem.q, problem.k, problem.v, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == problem.q.shape
    full = tk.flash_attn_func(problem.q, problem.k, problem.v, causal=True, return_attn_probs=True)
    assert len(full) == 3 and full[2] is None and full[1].shape == (2, 2, 9)
    assert torch.equal(full[0], out)
    varlen = make_problem(varlen_case((9, 4), (13, 0), 2, 1, 16), device)
    out = tk.flash_attn_varlen_func(varlen.q, varlen.k, varlen.v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, 9, 13)
    assert isinstance(out, torch.Tensor) and out.shape == varlen.q.shape
    full = flash(varlen, varlen.q, varlen.k, varlen.v)
    assert len(full) == 3 and full[2] is None and full[1].shape == (2, 13)


@pytest.mark.parametrize("case", [
    batch_case(2, 37, 53, 4, 1, 40, causal=True, deterministic=True).param(),
    varlen_case((37, 0, 61, 5), (53, 20, 40, 70), 4, 2, 40, torch.bfloat16, alibi="H",
                deterministic=True).param(),
])
def test_deterministic(case, device):
    """deterministic=True: bit-identical dq, dk, dv (and out, lse) over two runs."""
    problem = make_problem(case, device)
    dout = random_tensor(problem.q.shape, case.dtype, device)
    runs = []
    for _ in range(2):
        q, k, v = (t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
        out, lse, _ = flash(problem, q, k, v)
        out.backward(dout)
        runs.append((out, lse, q.grad, k.grad, v.grad))
    for label, first, second in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{label} differs between two deterministic runs"


def test_noncontiguous_inputs(device):
    """q, k, v sliced out of one packed [B, S, 3, H, D] tensor (row strides 3*H*D), and q as the
    transpose of a [B, H, S, D] tensor; the gradients land in the packed tensor."""
    B, S, H, D = 2, 37, 4, 40
    qkv = random_tensor((B, S, 3, H, D), torch.float16, device)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    check_problem("packed-qkv", Problem(q, k, v, None, None, S, S, {"causal": True}), q=q, k=k, v=v)

    q_bhsd = random_tensor((B, H, S + 8, D), torch.bfloat16, device).transpose(1, 2)
    kv = random_tensor((B, S + 8, 2, 2, D), torch.bfloat16, device)
    k, v = kv.unbind(dim=2)
    check_problem("bhsd-q-packed-kv", Problem(q_bhsd, k, v, None, None, S + 8, S + 8, {"window_size": (5, 9)}),
                  q=q_bhsd, k=k, v=v)

    total = 37 + 0 + 50
    qkv = random_tensor((total, 3, H, D), torch.float16, device)
    q, k, v = qkv.unbind(dim=1)
    cu = cu_seqlens((37, 0, 50), device)
    check_problem("varlen-packed-qkv", Problem(q, k, v, cu, cu, 50, 50, {"causal": True}), q=q, k=k, v=v)

    qkv_leaf = random_tensor((B, S, 3, H, D), torch.float16, device).requires_grad_()
    out = tk.flash_attn_func(*qkv_leaf.unbind(dim=2), causal=True)
    out.backward(random_tensor(out.shape, torch.float16, device))
    assert qkv_leaf.grad.shape == qkv_leaf.shape and bool(torch.isfinite(qkv_leaf.grad).all())


def test_strided_cu_seqlens_and_alibi_slopes(device):
    """cu_seqlens and alibi_slopes given as strided views (every other element, a transpose) give what
    their contiguous copies give, forward and backward (the kernels read them as contiguous)."""
    # [0, 7, 7, 12]; read as contiguous, [0, 2, 7, 7]: other sequences, still in bounds
    cu = torch.tensor([0, 2, 7, 7, 7, 9, 12], dtype=torch.int32, device=device)[::2]
    total, H, D = 12, 2, 16
    q, k, v = (random_tensor((total, H, D), torch.float16, device) for _ in range(3))
    dout = random_tensor((total, H, D), torch.float16, device)

    def varlen_run(cu_q, cu_k, slopes):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = tk.flash_attn_varlen_func(*leaves, cu_q, cu_k, 7, 7, causal=True, alibi_slopes=slopes,
                                                return_attn_probs=True)
        out.backward(dout)
        return out, lse, *(t.grad for t in leaves)

    slopes_bh = alibi_slopes("BH", H, 3, device).t()     # [B, H] = [3, 2], strides (1, 3)
    slopes_h = alibi_slopes("H", 1, 2 * H, device)[::2]  # [H] = [2], stride 2
    for name, strided_args in (("cu_seqlens_q-cu_seqlens_k-alibiBH", (cu, cu, slopes_bh)),
                               ("cu_seqlens_q-alibiH", (cu, cu.contiguous(), slopes_h)),
                               ("cu_seqlens_k", (cu.contiguous(), cu, None))):
        strided = varlen_run(*strided_args)
        contiguous = varlen_run(*(None if t is None else t.contiguous() for t in strided_args))
        for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), strided, contiguous):
            assert torch.equal(got, want), f"{label} differs with strided {name}"

    qb, kb, vb = (random_tensor((2, 5, H, D), torch.float16, device) for _ in range(3))
    for slopes in (alibi_slopes("BH", H, 2, device).t(), alibi_slopes("H", 1, 2 * H, device)[::2]):
        strided = tk.flash_attn_func(qb, kb, vb, alibi_slopes=slopes)
        assert torch.equal(strided, tk.flash_attn_func(qb, kb, vb, alibi_slopes=slopes.contiguous())), \
            f"strided alibi_slopes {tuple(slopes.shape)}"


# ----------------------------------------------------------------------------------------------------
# dropout


def dropout_run(problem: Problem, seed: int, dropout_p: float):
    """The kernels' keep mask for ``seed`` (drawn as the op draws it) and the problem's options."""
    torch.manual_seed(seed)
    seed_offset = draw_philox_seed(problem.q.device)
    batch = problem.cu_seqlens_q.numel() - 1 if problem.varlen else problem.q.shape[0]
    keep = dropout_keep_mask(seed_offset, batch, problem.q.shape[-2], problem.max_seqlen_q, problem.max_seqlen_k,
                             dropout_p)
    torch.manual_seed(seed)
    return keep


@pytest.mark.parametrize("case", [
    batch_case(2, 37, 53, 4, 2, 40, causal=True, dropout_p=0.17).param(),
    batch_case(1, 113, 203, 2, 1, 64, torch.bfloat16, softcap=4.0, alibi="H", dropout_p=0.5).param(),
    varlen_case((37, 0, 61, 1), (53, 20, 40, 0), 4, 2, 40, causal=True, dropout_p=0.3).param(),
])
def test_dropout_matches_reference(case, device):
    """Forward and backward with dropout against the reference given the kernels' own keep mask."""
    problem = make_problem(case, device)
    keep = dropout_run(problem, 1234, case.options["dropout_p"])
    assert keep.dtype == torch.bool
    assert keep.shape == (case.batch, case.heads, problem.max_seqlen_q, problem.max_seqlen_k)
    check_problem(case.name, problem, dropout_keep=keep)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.83])
def test_dropout_keep_fraction(dropout_p, device):
    """About 1 - p of the elements are kept (within 6 sigma), independently per batch and head, and a
    different seed gives a different mask."""
    torch.manual_seed(7)
    seed_offset = draw_philox_seed(device)
    keep = dropout_keep_mask(seed_offset, 2, 2, 64, 160, dropout_p)
    assert keep.shape == (2, 2, 64, 160) and keep.dtype == torch.bool
    kept = float(keep.float().mean())
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / keep.numel())
    assert abs(kept - (1 - dropout_p)) < 6 * sigma, f"kept {kept:.4f}, expected {1 - dropout_p:.4f}"
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    torch.manual_seed(8)
    assert not torch.equal(dropout_keep_mask(draw_philox_seed(device), 2, 2, 64, 160, dropout_p), keep)


def test_dropout_seed_reproducible(device):
    """The same generator state gives bit-identical out and gradients; the op advances the generator,
    so a second call without reseeding drops other elements."""
    problem = make_problem(varlen_case((37, 0, 61), (53, 20, 40), 4, 2, 40, causal=True), device)
    dout = random_tensor(problem.q.shape, torch.float16, device)
    runs = []
    for _ in range(2):
        torch.manual_seed(99)
        q, k, v = (t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
        out, lse, _ = flash(problem, q, k, v, dropout_p=0.25, deterministic=True)
        out.backward(dout)
        runs.append((out, lse, q.grad, k.grad, v.grad))
        following = flash(problem, problem.q, problem.k, problem.v, dropout_p=0.25)[0]
        assert not torch.equal(following, out), "the second call reused the first call's dropout mask"
    for label, first, second in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{label} differs with the same seed"


# ----------------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_fullgraph(device):
    """Forward and backward of both functions under torch.compile(fullgraph=True): bit-equal to eager."""
    torch._dynamo.reset()
    compiled_batch = torch.compile(tk.flash_attn_func, fullgraph=True)
    compiled_varlen = torch.compile(tk.flash_attn_varlen_func, fullgraph=True)
    cases = [(batch_case(2, 19, 27, 4, 2, 32, causal=True, softcap=3.0), compiled_batch),
             (varlen_case((19, 0, 8), (27, 5, 8), 4, 2, 32, window_size=(4, 4)), compiled_varlen)]
    for case, compiled in cases:
        problem = make_problem(case, device)
        dout = random_tensor(problem.q.shape, case.dtype, device)
        results = []
        for fn in (compiled, None):
            q, k, v = (t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
            out, lse, _ = flash(problem, q, k, v, fn=fn)
            out.backward(dout)
            results.append((out, lse, q.grad, k.grad, v.grad))
        for label, first, second in zip(("out", "lse", "dq", "dk", "dv"), *results):
            assert torch.equal(first, second), f"{case.name}: compiled and eager {label} differ"


def test_custom_op_registration(device):
    """Schema, fake (meta) implementation and autograd registration agree with the real kernels, in
    batch and varlen mode (lse ``[B, H, S]`` and ``[H, total]``), with dropout and alibi."""
    batch = make_problem(batch_case(2, 9, 13, 4, 2, 16, alibi="BH"), device)
    varlen = make_problem(varlen_case((9, 0, 4), (13, 5, 0), 4, 2, 16), device)
    seed_offset = draw_philox_seed(device)
    cases = [(batch.q, batch.k, batch.v, None, None, 9, 13, 0.0, 0.25, -1, 0, 0.0, batch.options["alibi_slopes"],
              None),
             (varlen.q, varlen.k, varlen.v, varlen.cu_seqlens_q, varlen.cu_seqlens_k, 9, 13, 0.2, 0.25, 3, 2,
              5.0, None, seed_offset)]
    for args in cases:
        args = (args[0].requires_grad_(), args[1].requires_grad_(), args[2].requires_grad_(), *args[3:])
        torch.library.opcheck(torch.ops.tilekernels.flash_attn_fwd, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                          "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------------------------------
# the eager fast path (no dispatcher) and the launch plans it and the op share


def _run_with_grads(problem: Problem, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse, _ = flash(problem, q, k, v)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", [batch_case(2, 37, 53, 4, 2, 32, causal=True).param(),
                                  varlen_case((19, 0, 40), (27, 5, 33), 4, 1, 40, window_size=(6, 3)).param()])
def test_eager_path_and_plans(case, tma, device, monkeypatch):
    """Plain eager calls skip the dispatcher (``_FlashAttnFunction`` with grads, the op's body without):
    bit-equal to the torch.library op, forward and backward. A second call of the same signature on new
    tensors reuses the launch plans (no new plan) and reads the new tensors: bit-equal to plans made
    afresh for them. A view at another 16-byte alignment gets plans of its own."""
    from tilekernels.attention import _bwd, _fwd, fmha

    monkeypatch.setattr(_fwd, "tma_mode", tma if device.type == "cpu" else None)
    _fwd.clear_plans()
    _bwd.clear_plans()
    first, second = make_problem(case, device), make_problem(case, device)
    dout = random_tensor(first.q.shape, case.dtype, device)
    eager = _run_with_grads(first, first.q, first.k, first.v, dout)
    with monkeypatch.context() as m:
        m.setattr(fmha, "plain_eager", lambda t: False)
        through_op = _run_with_grads(first, first.q, first.k, first.v, dout)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, through_op):
        assert torch.equal(a, b), f"{case.name}: eager path and op differ in {label}"

    plans = (len(_fwd._FWD_PLANS), len(_bwd._BWD_PLANS))
    reused = _run_with_grads(second, second.q, second.k, second.v, dout)
    assert (len(_fwd._FWD_PLANS), len(_bwd._BWD_PLANS)) == plans, "a call of the same signature made new plans"
    _fwd.clear_plans()
    _bwd.clear_plans()
    fresh = _run_with_grads(second, second.q, second.k, second.v, dout)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), reused, fresh):
        assert torch.equal(a, b), f"{case.name}: a reused plan gave another {label} than a fresh one"
    assert not torch.equal(reused[0], eager[0]), "the second call's output is the first call's"

    # q one element into a buffer: another alignment, so another plan (the TMA one would not apply)
    plans = len(_fwd._FWD_PLANS)
    buffer = torch.empty(second.q.numel() + 1, dtype=case.dtype, device=device)
    shifted = buffer[1:].view(second.q.shape)
    shifted.copy_(second.q)
    out, lse, _ = flash(second, shifted, second.k, second.v)
    assert len(_fwd._FWD_PLANS) == plans + 1, "a misaligned q reused the aligned call's plan"
    assert torch.equal(out, fresh[0]) and torch.equal(lse, fresh[1]), "the misaligned q changed the result"


# ----------------------------------------------------------------------------------------------------
# bad inputs: a ValueError or TypeError that names the argument


def _bad_cases():
    """Builders taking a tensor factory ``t(*shape, dtype=fp16)``; each returns the call's arguments."""
    B, S, H, D = 1, 8, 4, 32
    bf16 = torch.bfloat16

    def batch(q=None, k=None, v=None, **kw):
        return lambda t: ("batch", (q(t) if q else t(B, S, H, D), k(t) if k else t(B, S, 2, D),
                                    v(t) if v else t(B, S, 2, D)), kw)

    def varlen(cu_q=None, cu_k=None, **kw):
        ok = (lambda t: torch.tensor([0, 3, 8], dtype=torch.int32, device=t(1).device))
        return lambda t: ("varlen", (t(S, H, D), t(S, 2, D), t(S, 2, D),
                                     cu_q(t) if cu_q else ok(t), cu_k(t) if cu_k else ok(t), 5, 5), kw)

    cases = {
        "head-dim-264": (batch(q=lambda t: t(B, S, H, 264), k=lambda t: t(B, S, 2, 264),
                               v=lambda t: t(B, S, 2, 264)), r"head.?dim|\bq\b"),
        "heads-not-multiple": (batch(k=lambda t: t(B, S, 3, D), v=lambda t: t(B, S, 3, D)), r"\bk\b|head"),
        "k-heads-differ-from-v": (batch(v=lambda t: t(B, S, 4, D)), r"\bv\b"),
        "head-dim-differs": (batch(k=lambda t: t(B, S, 2, 16)), r"\bk\b"),
        "batch-differs": (batch(k=lambda t: t(B + 1, S, 2, D), v=lambda t: t(B + 1, S, 2, D)), r"\bk\b"),
        "mixed-dtypes": (batch(k=lambda t: t(B, S, 2, D, dtype=bf16)), r"\bk\b"),
        "fp32": (batch(q=lambda t: t(B, S, H, D, dtype=torch.float32), k=lambda t: t(B, S, 2, D, dtype=torch.float32),
                       v=lambda t: t(B, S, 2, D, dtype=torch.float32)), r"dtype|\bq\b"),
        "q-3d": (batch(q=lambda t: t(S, H, D)), r"\bq\b"),
        "mixed-devices": (batch(k=lambda t: t(B, S, 2, D).to("meta")), r"\bk\b|device"),
        "window-3-tuple": (batch(window_size=(1, 2, 3)), r"window_size"),
        "window-string": (batch(window_size="left"), r"window_size"),
        "window-float": (batch(window_size=(1.5, 0)), r"window_size"),
        "window-below-minus-1": (batch(window_size=(-2, 0)), r"window_size"),
        "dropout-negative": (batch(dropout_p=-0.1), r"dropout_p"),
        "causal-string": (batch(causal="no"), r"causal"),
        "causal-int": (batch(causal=1), r"causal"),
        "return_attn_probs-string": (batch(return_attn_probs="no"), r"return_attn_probs"),
        "deterministic-string": (batch(deterministic="yes"), r"deterministic"),
        "varlen-causal-string": (varlen(causal="no"), r"causal"),
        "alibi-shape": (batch(alibi_slopes=torch.ones(H + 1)), r"alibi_slopes"),
        "cu_seqlens_q-int64": (varlen(cu_q=lambda t: torch.tensor([0, 3, 8], device=t(1).device)),
                               r"cu_seqlens_q"),
        "cu_seqlens_k-int64": (varlen(cu_k=lambda t: torch.tensor([0, 3, 8], device=t(1).device)),
                               r"cu_seqlens_k"),
        "cu_seqlens-lengths-differ": (varlen(cu_k=lambda t: torch.tensor([0, 3, 5, 8], dtype=torch.int32,
                                                                          device=t(1).device)), r"cu_seqlens"),
    }
    return [pytest.param(build, match, id=name) for name, (build, match) in cases.items()]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input(build, match, device):
    def t(*shape, dtype=torch.float16):
        return random_tensor(shape, dtype, device)

    mode, args, kwargs = build(t)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(device)
    fn = tk.flash_attn_func if mode == "batch" else tk.flash_attn_varlen_func
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("name, offsets, where", [
    pytest.param("cu_seqlens_q", [0, 5, 3], r"cu_seqlens_q\[2\] = 3 follows 5$", id="q-decreasing"),
    pytest.param("cu_seqlens_k", [-1, 3, 8], r"cu_seqlens_k\[0\] = -1$", id="k-negative"),
    pytest.param("cu_seqlens_q", [0, 3, 9], r"at most the 8 packed rows; cu_seqlens_q\[2\] = 9 follows 3$",
                 id="q-past-the-rows"),
    pytest.param("cu_seqlens_k", [0, 9, 8], r"cu_seqlens_k\[1\] = 9 follows 0$", id="k-past-then-back"),
])
def test_malformed_cu_seqlens_raise_on_the_cpu(name, offsets, where, device):
    """The kernels trust cu_seqlens (a malformed one reads and writes out of bounds); on the CPU, where reading the
    offsets costs nothing, flash_attn_varlen_func checks them and names the first bad one. Offsets that end short of
    the packed rows, and empty sequences, stay valid."""
    if device.type != "cpu":
        pytest.skip("on a GPU the offsets are trusted, as in FlashAttention: checking them would synchronise")
    S, H, D = 8, 2, 16
    q, k, v = (random_tensor((S, H, D), torch.float16, device) for _ in range(3))
    good = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu = {"cu_seqlens_q": good, "cu_seqlens_k": good, name: torch.tensor(offsets, dtype=torch.int32)}
    with pytest.raises(ValueError, match=rf"{name} must be non-decreasing offsets") as info:
        tk.flash_attn_varlen_func(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 9, 9)
    assert re.search(where, str(info.value)), str(info.value)
    short = torch.tensor([0, 0, 5], dtype=torch.int32)   # an empty sequence, rows 5..7 in none
    out = tk.flash_attn_varlen_func(q, k, v, short, short, 5, 5)
    assert out[5:].eq(0).all() and not out.isnan().any()


def test_hopper_backward_config_rejects_early_dq_with_split_d():
    """early_dq reorders the two-consumer schedule's waits; the head-dim-split schedule has no such step,
    so a config asking for both is refused instead of silently ignoring early_dq."""
    from tilekernels.attention._bwd import HopperBwdConfig

    assert HopperBwdConfig(64, 3, early_dq=True).early_dq
    with pytest.raises(ValueError, match="early_dq"):
        HopperBwdConfig(64, 2, block_n=64, split_d=True, early_dq=True)
    # the same for the statistics loaded a step ahead (the split schedule loads them its own way)
    assert HopperBwdConfig(64, 2, stats_ahead=True).stats_ahead
    with pytest.raises(ValueError, match="stats_ahead"):
        HopperBwdConfig(64, 2, block_n=64, split_d=True, stats_ahead=True)


def test_backward_side_kernels(device):
    """The Gluon backward's two Triton helpers, launched directly (the Gluon kernel itself runs on Hopper only):
    the delta kernel zeroing the fp32 dQ accumulator (``ZERO_ACC``) and ``_scale_cast``. Odd sizes, outputs
    poisoned with NaN, and NaN sentinels around the accumulator's rows and columns that must stay untouched."""
    from tilekernels.attention import _bwd

    B, S, H, D = 2, 37, 3, 40   # D pads to 64; 37 rows are not a multiple of the 16-row blocks
    out = random_tensor((B, S, H, D), torch.bfloat16, device)
    dout = random_tensor((B, S, H, D), torch.bfloat16, device)
    delta = torch.full((B, H, S), float("nan"), device=device)
    acc_full = torch.full((B, S + 3, H, D + 8), float("nan"), device=device)
    acc = acc_full[:, :S, :, :D]
    _bwd._attn_bwd_delta[(triton.cdiv(S, 16), B * H)](
        out, dout, delta, delta, acc, *out.stride()[:3], *dout.stride()[:3], *delta.stride()[:2], *acc.stride()[:3],
        S, H, HEAD_DIM=D, HEAD_DIM_PAD=64, BLOCK_M=16, IS_VARLEN=False, ZERO_ACC=True)
    expect = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(delta.double(), expect, atol=1e-5, rtol=1e-5)
    assert not acc.any(), "accumulator rows not zeroed"
    assert acc_full[:, S:].isnan().all() and acc_full[..., D:].isnan().all(), "zeroed past the accumulator's rows"

    n = 4099
    src = random_tensor((n,), torch.float32, device) * 100
    dst = torch.full((n + 5,), float("nan"), dtype=torch.bfloat16, device=device)
    _bwd._scale_cast[(triton.cdiv(n, 1024),)](src, dst, n, 0.125, BLOCK=1024)
    assert torch.equal(dst[:n], torch.mul(src, 0.125).to(torch.bfloat16)), "not torch.mul's rounding"
    assert dst[n:].isnan().all(), "written past n"


# ====================================================================================================
# GPU lane (-m gpu): real sizes, every head dim, CUDA graphs, no host synchronisation


GPU_SIZE_CASES = [batch_case(2, 1024, 1024, 8, 8, D, dtype, causal=causal)
                  for D in (64, 128, 256) for dtype in (torch.bfloat16, torch.float16) for causal in (False, True)]
GPU_SIZE_CASES += [batch_case(2, 1000, 1537, 8, 2, 128, torch.bfloat16, causal=True),
                   batch_case(2, 1537, 1000, 8, 1, 128, torch.bfloat16, causal=True)]


@gpu
@pytest.mark.parametrize("case", [c.param() for c in GPU_SIZE_CASES])
def test_gpu_sizes(case, device):
    check_case(case, device)


@gpu
@pytest.mark.parametrize("case", [batch_case(2, 300, 517, 4, 2, D, torch.bfloat16, causal=causal).param()
                                  for D in (32, 40, 64, 80, 96, 128, 160, 192, 256) for causal in (False, True)])
def test_gpu_head_dims(case, device):
    check_case(case, device)


GPU_VARLEN_LENGTHS = ((1, 1000, 0, 517, 2048, 33, 777), (1, 1537, 3, 0, 1024, 33, 400))

GPU_FEATURE_CASES = [
    batch_case(2, 1024, 1024, 8, 2, 128, torch.bfloat16, window_size=(256, 0)),
    batch_case(2, 1024, 1500, 8, 2, 128, torch.bfloat16, window_size=(100, 300)),
    batch_case(2, 1024, 1024, 8, 2, 128, torch.bfloat16, causal=True, softcap=30.0),
    batch_case(2, 1024, 1024, 8, 2, 128, torch.bfloat16, causal=True, alibi="BH"),
    batch_case(2, 1024, 1024, 8, 2, 64, torch.float16, alibi="H", softmax_scale=0.05),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, torch.bfloat16, causal=True),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 8, 64, torch.float16, causal=False),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 1, 256, torch.bfloat16, causal=True, window_size=(128, -1), alibi="BH",
                softcap=20.0),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, torch.bfloat16, causal=True, deterministic=True),
]


@gpu
@pytest.mark.parametrize("case", [c.param() for c in GPU_FEATURE_CASES])
def test_gpu_features(case, device):
    check_case(case, device)


@gpu
@pytest.mark.parametrize("case", [
    batch_case(2, 1024, 1024, 8, 2, 128, torch.bfloat16, causal=True, dropout_p=0.1).param(),
    varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 64, torch.float16, dropout_p=0.3).param(),
])
def test_gpu_dropout(case, device):
    problem = make_problem(case, device)
    keep = dropout_run(problem, 4321, case.options["dropout_p"])
    check_problem(case.name, problem, dropout_keep=keep)


@gpu
@pytest.mark.parametrize("case", [
    batch_case(4, 2048, 2048, 16, 2, 128, torch.bfloat16, causal=True, deterministic=True).param(),
    varlen_case(*GPU_VARLEN_LENGTHS, 16, 2, 128, torch.bfloat16, deterministic=True).param(),
])
def test_gpu_deterministic(case, device):
    """On a GPU, where atomics would make a difference: bit-identical gradients over three runs."""
    problem = make_problem(case, device)
    dout = random_tensor(problem.q.shape, case.dtype, device)
    runs = []
    for _ in range(3):
        q, k, v = (t.clone().requires_grad_() for t in (problem.q, problem.k, problem.v))
        out, _, _ = flash(problem, q, k, v)
        out.backward(dout)
        runs.append((q.grad, k.grad, v.grad))
    for run in runs[1:]:
        for label, first, other in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(first, other), f"{label} differs between deterministic runs"


@gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["nodrop", "drop0.1"])
def test_gpu_no_host_sync(dropout_p, device):
    """Varlen forward and backward never synchronise with the host (no .item(), .cpu(), .tolist() or
    device-to-host copy): torch's sync debug mode turns any such call into an error."""
    case = varlen_case(*GPU_VARLEN_LENGTHS, 8, 2, 128, torch.bfloat16, causal=True, dropout_p=dropout_p)
    problem = make_problem(case, device)
    dout = random_tensor(problem.q.shape, case.dtype, device)

    def step():
        q, k, v = (t.detach().requires_grad_() for t in (problem.q, problem.k, problem.v))
        out, lse, _ = flash(problem, q, k, v)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    assert_no_host_sync(step)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gpu_cuda_graph_varlen(causal, device):
    """Capture varlen forward+backward in one CUDA graph, then replay it with other sequence-length
    mixes of the same total (cu_seqlens updated in place) and new data; each replay within the rule."""
    mixes = [(1, 1000, 0, 517, 2048, 33, 777), (1, 1537, 3, 0, 1024, 33, 1778), (626,) * 6 + (620,),
             (4374, 0, 0, 0, 0, 0, 2)]
    total = sum(mixes[0])
    assert all(sum(m) == total for m in mixes)
    max_seqlen = max(max(m) for m in mixes)
    H, Hk, D, dtype = 8, 2, 128, torch.bfloat16
    cu = cu_seqlens(mixes[0], device)
    q = random_tensor((total, H, D), dtype, device).requires_grad_()
    k = random_tensor((total, Hk, D), dtype, device).requires_grad_()
    v = random_tensor((total, Hk, D), dtype, device).requires_grad_()
    dout = random_tensor((total, H, D), dtype, device)
    options = {"causal": causal}

    def step():
        out, lse, _ = tk.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, return_attn_probs=True,
                                                **options)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    graph, results = capture_graph(step)

    for i, mix in enumerate(mixes[1:] + mixes[:1]):
        cu.copy_(cu_seqlens(mix, device))
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(random_tensor(t.shape, dtype, device))
        for t in results:
            t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        out, lse, dq, dk, dv = results
        name = f"replay{i}-" + ",".join(map(str, mix))
        problem = Problem(q, k, v, cu, cu, max_seqlen, max_seqlen, options)
        exact = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
        low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference(problem, *exact, torch.float64)
        low_out, _ = reference(problem, *low, dtype)
        assert_close(f"out-{name}", out, ref_out, low_out)
        check_lse(name, lse, ref_lse, problem, q, k, v)
        ref_grads = torch.autograd.grad(ref_out, exact, dout.to(torch.float64))
        low_grads = torch.autograd.grad(low_out, low, dout)
        for label, g, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, low_grads):
            assert_close(f"{label}-{name}", g, r, lo, ratio=3.0)
