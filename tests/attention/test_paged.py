"""tk.batch_prefill / tk.batch_decode / tk.merge_attention_states against the fp64 reference, by the
error-ratio rule.

The rule (FlashAttention's): out within 2x of the error PyTorch makes computing
``reference_paged_attention`` in q's own fp16/bf16 (K/V dequantised into that dtype), lse within 2x
of PyTorch's fp32 answer (floor 1e-5 * max|lse|), NaN/inf parity (a row with no key has out 0 and lse
-inf in both). Every cache is built by ``make_paged_kv``: pages shuffled over a pool with spare pages,
and every slot no sequence owns holding NaN, page 0 (where masked table reads land) all NaN in the CPU
lane, so a kernel that reads past a sequence shows it, even where it weighs what it read 0.

CPU lane (no marker; ``TRITON_INTERPRET=1``): the reference itself (gather inverts make, paged equals
contiguous attention, split-and-merge equals whole), then small odd shapes: page sizes 1, 3, 16, 64,
1024, linear and vectorized caches, 1-D and 2-D tables, GQA/MQA, causal with qo_len < kv_len, windows,
soft cap, softmax scale, fp8 KV with per-tensor and per-(page, head) scales, zero-length sequences,
``out=`` and ``return_lse``; decode with split KV; merge with empty states; the 64-bit page offsets;
argument checks.

GPU lane (``-m gpu``): real sizes, caches of 4.5 and 9 GB read through pages on both sides of 2^31 and
2^32 elements, CUDA graph capture replayed with other tables, and proof that nothing synchronises the
host.

Ids read ``Sq1,17,0,33-Sk5,40,0,70-H4-Hk2-D32-P16-linear-1d-causal-fp16`` (``-kv-e4m3-scale-page``
for fp8 caches).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

import tilekernels as tk
from tilekernels.attention import _paged_kernels
from tilekernels.attention import paged as paged_api
from tilekernels.attention._paged_kernels import paged_row_offsets
from tilekernels.attention.reference import (
    PagedKV,
    gather_paged_kv,
    make_paged_kv,
    reference_attention,
    reference_merge_states,
    reference_paged_attention,
)
from tilekernels.testing import assert_close, assert_no_host_sync, capture_graph, poisoned, random_tensor

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OPTION_KEYS = ("causal", "window_left", "logits_soft_cap", "softmax_scale")

gpu = pytest.mark.gpu


# ====================================================================================================
# cases, inputs and the check every test uses


@dataclasses.dataclass
class PagedCase:
    """One paged-attention problem: per-sequence query and key counts, the cache's geometry and the
    op's options. ``scale`` says how an fp8 cache's scales are passed: None (1.0), ``"tensor"`` (0-d),
    ``"tensor1"`` (1-element), ``"float"`` (a Python float) or ``"page"`` (``[num_pages, H_kv]``)."""

    seqlens_q: tuple
    seqlens_k: tuple
    heads: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    page_size: int = 16
    layout: str = "linear"
    table: str = "1d"
    dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype | None = None
    scale: str | None = None
    extra_pages: int = 3
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        parts = ["Sq" + ",".join(map(str, self.seqlens_q)), "Sk" + ",".join(map(str, self.seqlens_k)),
                 f"H{self.heads}", f"Hk{self.heads_kv}", f"D{self.head_dim}", f"P{self.page_size}", self.layout,
                 self.table]
        for key, value in self.options.items():
            if key == "causal":
                parts.append("causal" if value else "noncausal")
            elif key == "window_left":
                parts.append(f"win{value}")
            elif key == "logits_soft_cap":
                parts.append(f"cap{value}")
            elif key == "softmax_scale":
                parts.append(f"scale{value}")
        parts.append(DTYPE_NAMES[self.dtype])
        if self.kv_dtype is not None:
            parts.append(f"kv-{DTYPE_NAMES[self.kv_dtype]}")
            if self.scale is not None:
                parts.append(f"scale-{self.scale}")
        return "-".join(parts)

    def param(self, marks=()):
        return pytest.param(self, id=self.name, marks=marks)


def case(seqlens_q, seqlens_k, **kw) -> PagedCase:
    """A case; the op's options (causal, window_left, ...) may be given among the fields."""
    options = {key: kw.pop(key) for key in OPTION_KEYS if key in kw}
    return PagedCase(tuple(seqlens_q), tuple(seqlens_k), options=options, **kw)


@dataclasses.dataclass
class PagedProblem:
    """A case's tensors: q ``[total_q, H, D]``, ``qo_indptr``, the paged cache, and the table format
    and scales (in the form the case asks for) the op is called with."""

    q: torch.Tensor
    qo_indptr: torch.Tensor
    paged: PagedKV
    table: str
    k_scale: object
    v_scale: object
    options: dict

    def kwargs(self) -> dict:
        """The op's keywords besides q, caches and qo_indptr (also the reference's)."""
        return {**self.paged.table(self.table), "k_scale": self.k_scale, "v_scale": self.v_scale, **self.options}


def cu_seqlens(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def scale_as(scale, form: str | None):
    """A 0-d scale tensor in the form a case passes it."""
    if scale is None or form in ("tensor", "page"):
        return scale
    if form == "tensor1":
        return scale.reshape(1)
    if form == "float":
        return float(scale)
    raise ValueError(form)


def nan_page_zero(paged: PagedKV) -> PagedKV:
    """Relabel physical page 0 and an unused (all-NaN) page, caches, per-page scales and both tables
    alike: page 0 is where a masked page-table read lands (``other=0``), so a kernel that then loads
    K or V through it, even for keys it weighs 0 (0 * NaN = NaN), shows it."""
    used = set(paged.kv_page_indices.tolist())
    spare = next((p for p in range(paged.num_pages) if p not in used), None)
    if spare is None or 0 not in used:
        return paged
    order = torch.arange(paged.num_pages, device=paged.k_cache.device)
    order[0], order[spare] = spare, 0

    def relabel(table):
        return torch.where(table == 0, spare, torch.where(table == spare, 0, table)).to(torch.int32)

    def swap(scale):
        return scale[order] if isinstance(scale, torch.Tensor) and scale.dim() == 2 else scale

    return dataclasses.replace(paged, k_cache=paged.k_cache[order], v_cache=paged.v_cache[order],
                               kv_page_indices=relabel(paged.kv_page_indices),
                               block_table=relabel(paged.block_table), k_scale=swap(paged.k_scale),
                               v_scale=swap(paged.v_scale))


def make_paged_problem(c: PagedCase, device) -> PagedProblem:
    """Random q, k, v for ``c``, the keys and values paged by ``make_paged_kv`` with page 0 all NaN
    (when the pool has a spare page)."""
    total_k = sum(c.seqlens_k)
    q = random_tensor((sum(c.seqlens_q), c.heads, c.head_dim), c.dtype, device)
    k = random_tensor((total_k, c.heads_kv, c.head_dim), c.dtype, device)
    v = random_tensor((total_k, c.heads_kv, c.head_dim), c.dtype, device)
    make_scale = {None: None, "page": "page"}.get(c.scale, "tensor")
    paged = nan_page_zero(make_paged_kv(k, v, cu_seqlens(c.seqlens_k, device), c.page_size, layout=c.layout,
                                        kv_dtype=c.kv_dtype, scale=make_scale if c.kv_dtype is not None else None,
                                        extra_pages=c.extra_pages))
    return PagedProblem(q, cu_seqlens(c.seqlens_q, device), paged, c.table, scale_as(paged.k_scale, c.scale),
                        scale_as(paged.v_scale, c.scale), dict(c.options))


def reference(problem: PagedProblem, compute_dtype, q=None, qo_indptr=None):
    q = problem.q if q is None else q
    qo_indptr = problem.qo_indptr if qo_indptr is None else qo_indptr
    return reference_paged_attention(q, problem.paged.k_cache, problem.paged.v_cache, qo_indptr,
                                     compute_dtype=compute_dtype, **problem.kwargs())


def check_against_reference(name: str, problem: PagedProblem, out, lse, *, q=None, qo_indptr=None):
    """The op's out and lse by the rule, against the reference on ``problem`` (``q``/``qo_indptr``
    replace the problem's: a decode query batch with ``qo_indptr = arange(B + 1)``)."""
    q = problem.q if q is None else q
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, f"{name}: out {out.shape}"
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32, f"{name}: lse {lse.shape} {lse.dtype}"
    ref_out, ref_lse = reference(problem, torch.float64, q, qo_indptr)
    low_out, _ = reference(problem, q.dtype, q, qo_indptr)
    assert_close(f"out-{name}", out, ref_out, low_out)
    # lse is fp32 accumulated from products fp32 holds exactly: the fair denominator is PyTorch's fp32
    # answer, with a floor of 1e-5 * max|lse| for the kernels' exp2/log2.
    _, fp32_lse = reference(problem, torch.float32, q, qo_indptr)
    finite = ref_lse[torch.isfinite(ref_lse)]
    atol = 1e-5 * max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)
    assert_close(f"lse-{name}", lse, ref_lse, fp32_lse, atol=atol)


def run_prefill(problem: PagedProblem, **overrides):
    return tk.batch_prefill(problem.q, problem.paged.k_cache, problem.paged.v_cache, problem.qo_indptr,
                            **{**problem.kwargs(), "return_lse": True, **overrides})


def check_prefill(c: PagedCase, device):
    problem = make_paged_problem(c, device)
    out, lse = run_prefill(problem)
    check_against_reference(c.name, problem, out, lse)
    return problem, out, lse


def decode_case(seqlens_k, **kw) -> PagedCase:
    """A decode case: one query per sequence, q ``[B, H, D]``."""
    return case((1,) * len(seqlens_k), seqlens_k, **kw)


def run_decode(problem: PagedProblem, **overrides):
    kwargs = {key: value for key, value in problem.kwargs().items() if key != "causal"}
    return tk.batch_decode(problem.q, problem.paged.k_cache, problem.paged.v_cache,
                           **{**kwargs, "return_lse": True, **overrides})


def leave_nan_in_allocator(*shapes_dtypes) -> None:
    """Allocate and free NaN-filled blocks the size of the op's outputs: CUDA's caching allocator hands
    them out next, so an output element the kernels never write reads as NaN, not a lucky zero."""
    for shape, dtype, device in shapes_dtypes:
        torch.full(shape, math.nan, dtype=dtype, device=device)


# ====================================================================================================
# the reference itself (plain PyTorch)


REFERENCE_LENGTHS_Q, REFERENCE_LENGTHS_K = (1, 17, 0, 33, 4), (5, 40, 0, 70, 0)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("table", ["1d", "2d"])
def test_reference_paged_equals_contiguous(page_size, table):
    """Paged attention is varlen attention on the gathered keys: the same out, lse laid out [total, H]
    with -inf (not +inf) on rows that see no key (the k-less sequences and causal rows past the keys)."""
    q = torch.randn(sum(REFERENCE_LENGTHS_Q), 4, 16, dtype=torch.float64)
    k = torch.randn(sum(REFERENCE_LENGTHS_K), 2, 16, dtype=torch.float64).to(torch.float16)
    v = torch.randn(sum(REFERENCE_LENGTHS_K), 2, 16, dtype=torch.float64).to(torch.float16)
    cu_q, cu_k = cu_seqlens(REFERENCE_LENGTHS_Q, "cpu"), cu_seqlens(REFERENCE_LENGTHS_K, "cpu")
    paged = make_paged_kv(k, v, cu_k, page_size, extra_pages=2)
    for options in ({"causal": True}, {"causal": False, "window_left": 6}, {"logits_soft_cap": 2.0}):
        out, lse = reference_paged_attention(q, paged.k_cache, paged.v_cache, cu_q, **paged.table(table),
                                             **options)
        window = (options.get("window_left", -1), 0 if options.get("causal") else -1)
        ref_out, ref_lse = reference_attention(q, k.double(), v.double(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                               window_size=window, softcap=options.get("logits_soft_cap", 0.0))
        assert out.dtype == torch.float64 and lse.shape == (q.shape[0], 4)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse.t().masked_fill(ref_lse.t() == math.inf, -math.inf))
    assert bool((lse[51:] == -math.inf).all()) and bool((out[51:] == 0).all())  # sequence 4 has no keys


@pytest.mark.parametrize("layout, page_size", [("linear", 1), ("linear", 3), ("linear", 16), ("linear", 64),
                                               ("vectorized", 16), ("vectorized", 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_reference_gather_inverts_make(layout, page_size, dtype):
    """gather(make(k, v)) is k, v bit for bit, from either table; every slot no sequence owns is NaN; the
    2-D table's padding is a valid, all-NaN page; the vectorized layout is the spec's index map."""
    lengths = (5, 40, 0, 70, 1)
    k = random_tensor((sum(lengths), 2, 16), dtype)
    v = random_tensor((sum(lengths), 2, 16), dtype)
    cu = cu_seqlens(lengths, "cpu")
    for order in ("shuffle", "interleave"):
        paged = make_paged_kv(k, v, cu, page_size, layout=layout, extra_pages=3, order=order)
        used = sum(-(-n // page_size) for n in lengths)
        assert paged.num_pages == used + 3 and paged.kv_page_indices.numel() == used
        assert paged.kv_page_indices.dtype == paged.block_table.dtype == torch.int32
        for fmt in ("1d", "2d"):
            k_back, v_back, cu_back = gather_paged_kv(paged.k_cache, paged.v_cache, **paged.table(fmt), dtype=dtype)
            assert torch.equal(k_back, k) and torch.equal(v_back, v) and torch.equal(cu_back, cu), (order, fmt)
        unused_slots = paged.num_pages * page_size - sum(lengths)
        assert int(torch.isnan(paged.k_cache).sum()) == int(torch.isnan(paged.v_cache).sum()) == unused_slots * 32
        pad = paged.block_table[2, 0]  # sequence 2 has no pages: its row is all padding
        assert 0 <= int(pad) < paged.num_pages and int(pad) not in paged.kv_page_indices.tolist()
        if order == "interleave":
            pool = paged.num_pages
            expected = [i // 2 if i % 2 == 0 else pool - 1 - i // 2 for i in range(used)]
            assert paged.kv_page_indices.tolist() == expected
    if layout == "vectorized":
        x = 16 // k.element_size()
        key_cache, value_cache = paged.k_cache, paged.v_cache
        page, slot = int(paged.kv_page_indices[1]), 2  # sequence 1's first page
        for h, d in ((0, 0), (1, 13)):
            assert torch.equal(key_cache[page, h, d // x, slot, d % x], k[5 + slot, h, d])
            assert torch.equal(value_cache[page, h, slot // x, d, slot % x], v[5 + slot, h, d])


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [None, "tensor", "page"], ids=["noscale", "tensor", "page"])
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_reference_gather_inverts_make_fp8(kv_dtype, scale, layout):
    """fp8 caches give back k, v within one rounding: |error| <= 2^-(mantissa bits + 1) |x| plus half the
    smallest subnormal, times the key's scale; the scale forms (0-d, 1-element, float) agree."""
    lengths = (5, 40, 0, 70)
    k = random_tensor((sum(lengths), 2, 32), torch.bfloat16)
    v = random_tensor((sum(lengths), 2, 32), torch.bfloat16, scale=3.0)
    paged = make_paged_kv(k, v, cu_seqlens(lengths, "cpu"), 16, layout=layout, kv_dtype=kv_dtype, scale=scale,
                          extra_pages=2)
    assert paged.k_cache.dtype == kv_dtype
    assert int(torch.isnan(paged.k_cache.float()).sum()) == (paged.num_pages * 16 - sum(lengths)) * 64
    mantissa, tiny = (3, 2.0 ** -9) if kv_dtype == E4M3 else (2, 2.0 ** -16)
    k_back, v_back, _ = gather_paged_kv(paged.k_cache, paged.v_cache, **paged.table("1d"), k_scale=paged.k_scale,
                                        v_scale=paged.v_scale, dtype=torch.float64)
    if scale == "tensor":
        assert paged.k_scale.shape == () and paged.k_scale.dtype == torch.float32
        for form in ("tensor1", "float"):
            k_form, _, _ = gather_paged_kv(paged.k_cache, paged.v_cache, **paged.table("2d"),
                                           k_scale=scale_as(paged.k_scale, form), dtype=torch.float64)
            torch.testing.assert_close(k_form, k_back, rtol=1e-6, atol=0.0)
    if scale == "page":
        assert paged.k_scale.shape == (paged.num_pages, 2) and paged.k_scale.dtype == torch.float32
        unused = sorted(set(range(paged.num_pages)) - set(paged.kv_page_indices.tolist()))
        assert bool((paged.k_scale[unused] == 1).all())
    for label, original, back, factor in (("k", k, k_back, paged.k_scale), ("v", v, v_back, paged.v_scale)):
        if factor is None:
            per_key = torch.ones(())
        elif factor.dim() == 0:
            per_key = factor.double()
        else:
            tok_page = torch.cat([paged.kv_page_indices[paged.kv_indptr[b]:paged.kv_indptr[b + 1]].long()
                                  .repeat_interleave(16)[:n] for b, n in enumerate(lengths)])
            per_key = factor.double()[tok_page].unsqueeze(-1)
        bound = 2.0 ** -(mantissa + 1) * original.double().abs() + tiny / 2 * per_key
        error = (back - original.double()).abs()
        assert bool((error <= bound * (1 + 1e-9)).all()), f"{label}: max error {float(error.max()):.3g}"
        if scale is not None:  # a scale uses the format's range: the largest value is near fp8 max
            assert float((original.double().abs() / per_key).max()) > torch.finfo(kv_dtype).max / 2


@pytest.mark.parametrize("layout", ["linear", "vectorized"])
def test_nan_page_zero_is_a_relabelling(layout):
    """The tests' page-0 swap keeps what every table points at (fp8 per-page scales included) and
    leaves page 0 all NaN."""
    lengths = (5, 40, 0, 70)
    k = random_tensor((sum(lengths), 2, 32), torch.float16)
    v = random_tensor((sum(lengths), 2, 32), torch.float16)
    for seed in range(4):
        paged = make_paged_kv(k, v, cu_seqlens(lengths, "cpu"), 16, layout=layout, kv_dtype=E4M3, scale="page",
                              extra_pages=2, generator=torch.Generator().manual_seed(seed))
        swapped = nan_page_zero(paged)
        assert bool(torch.isnan(swapped.k_cache[0].float()).all())
        assert bool(torch.isnan(swapped.v_cache[0].float()).all())
        for fmt in ("1d", "2d"):
            before = gather_paged_kv(paged.k_cache, paged.v_cache, **paged.table(fmt), k_scale=paged.k_scale,
                                     v_scale=paged.v_scale)
            after = gather_paged_kv(swapped.k_cache, swapped.v_cache, **swapped.table(fmt),
                                    k_scale=swapped.k_scale, v_scale=swapped.v_scale)
            for first, second in zip(before, after):
                assert torch.equal(first, second)


def test_reference_low_precision_is_torch_low_precision():
    """compute_dtype = q's dtype: out in that dtype, lse fp32, an error of the size bf16 makes."""
    lengths_q, lengths_k = (7, 0, 20), (30, 5, 20)
    q = random_tensor((27, 4, 32), torch.bfloat16)
    k = random_tensor((55, 2, 32), torch.bfloat16)
    paged = make_paged_kv(k, k.flip(0), cu_seqlens(lengths_k, "cpu"), 3, kv_dtype=E4M3, scale="page")
    args = (q, paged.k_cache, paged.v_cache, cu_seqlens(lengths_q, "cpu"))
    kwargs = {**paged.table("2d"), "causal": True, "k_scale": paged.k_scale, "v_scale": paged.v_scale}
    out, lse = reference_paged_attention(*args, compute_dtype=torch.bfloat16, **kwargs)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact, _ = reference_paged_attention(*args, **kwargs)
    low_error = float((out.double() - exact).abs().max())
    assert 1e-4 < low_error < 5e-2, low_error


def test_reference_merge_of_halves_is_whole():
    """Attention over a sequence's keys is the merge of attention over its first and second halves
    (disjoint key sets); a state with lse -inf weighs 0, two give out 0 and lse -inf."""
    q = torch.randn(9, 4, 16, dtype=torch.float64)
    k = torch.randn(40, 2, 16, dtype=torch.float64)
    v = torch.randn(40, 2, 16, dtype=torch.float64)

    def attend(keys):
        cu_q, cu_k = cu_seqlens((9,), "cpu"), cu_seqlens((keys.stop - keys.start,), "cpu")
        out, lse = reference_attention(q, k[keys], v[keys], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return out, lse.t()

    whole_out, whole_lse = attend(slice(0, 40))
    merged_out, merged_lse = reference_merge_states(*attend(slice(0, 13)), *attend(slice(13, 40)))
    torch.testing.assert_close(merged_out, whole_out)
    torch.testing.assert_close(merged_lse, whole_lse)

    v_a, v_b = torch.randn(3, 1, 4), torch.full((3, 1, 4), math.nan)  # an empty state's v is never read
    lse_a = torch.tensor([[0.5], [-math.inf], [-math.inf]])
    lse_b = torch.tensor([[-math.inf], [-math.inf], [2.0]])
    v_b[2] = 7.0
    out, lse = reference_merge_states(v_a, lse_a, v_b, lse_b)
    torch.testing.assert_close(out[0], v_a[0].double())
    assert bool((out[1] == 0).all()) and bool((out[2] == 7).all())
    assert lse.tolist() == [[0.5], [-math.inf], [2.0]]


# ====================================================================================================
# CPU lane: batch_prefill


SQ, SK = (1, 17, 0, 33), (5, 40, 0, 70)  # a 1-query sequence, qo_len < kv_len, an empty one
SMALL_Q, SMALL_K = (3, 9), (4, 11)

PREFILL_CASES = [
    # page sizes x layouts x tables x dtypes
    case(SQ, SK, page_size=1, causal=True),
    case(SQ, SK, page_size=3, table="2d", dtype=torch.bfloat16),
    case(SQ, SK, page_size=16, dtype=torch.bfloat16, causal=True),
    case(SQ, SK, page_size=64, table="2d", causal=True),
    case(SMALL_Q, SMALL_K, page_size=1024, causal=True),
    case(SQ, SK, page_size=16, layout="vectorized", causal=True),
    case(SQ, SK, page_size=64, layout="vectorized", table="2d", dtype=torch.bfloat16),
    case(SQ, SK, page_size=16, layout="vectorized", table="2d", heads_kv=1, causal=True),       # MQA
    case(SQ, SK, page_size=3, heads_kv=1, head_dim=64, dtype=torch.bfloat16, causal=True),       # MQA
    case(SQ, SK, page_size=16, heads_kv=4, table="2d", causal=False),                          # MHA
    case((9, 4, 1), (3, 6, 1), page_size=3, causal=True),                # qo_len > kv_len: rows see no key
    case((40, 5), (20, 37), page_size=3, causal=True),          # ... with blocks of whole keys before them
    # head dims that are not powers of two
    case(SQ, SK, page_size=16, head_dim=40, causal=True),
    case(SQ, SK, page_size=3, head_dim=80, table="2d", dtype=torch.bfloat16, causal=False),
    # options
    case(SQ, SK, page_size=3, window_left=8, causal=True),
    case(SQ, SK, page_size=16, table="2d", dtype=torch.bfloat16, window_left=5, causal=False),
    case(SQ, SK, page_size=1, window_left=0, causal=True),                    # the diagonal key alone
    case(SQ, SK, page_size=16, logits_soft_cap=5.0, causal=True),
    case(SQ, SK, page_size=3, table="2d", dtype=torch.bfloat16, softmax_scale=0.3),
    case(SQ, SK, page_size=16, layout="vectorized", dtype=torch.bfloat16, causal=True, window_left=12,
         logits_soft_cap=8.0, softmax_scale=0.2),
    # fp8 caches
    case(SQ, SK, page_size=16, kv_dtype=E4M3, causal=True),
    case(SQ, SK, page_size=16, dtype=torch.bfloat16, kv_dtype=E4M3, scale="tensor"),
    case(SQ, SK, page_size=3, table="2d", kv_dtype=E4M3, scale="float", causal=True),
    case(SQ, SK, page_size=16, layout="vectorized", kv_dtype=E4M3, scale="page", causal=True),
    case(SQ, SK, page_size=16, dtype=torch.bfloat16, kv_dtype=E5M2, scale="tensor1", causal=True),
    case(SQ, SK, page_size=1, table="2d", dtype=torch.bfloat16, kv_dtype=E5M2, scale="page"),
    case(SQ, SK, page_size=64, layout="vectorized", table="2d", kv_dtype=E5M2, scale="page", causal=True,
         window_left=20),
]


@pytest.mark.parametrize("c", [c.param() for c in PREFILL_CASES])
def test_prefill(c, device):
    check_prefill(c, device)


def test_prefill_zero_length_sequences(device):
    """A sequence with no keys gives out 0 and lse -inf on all its rows; one with no queries writes
    nothing; the unused pages (NaN) between them are never read."""
    c = case((3, 0, 5, 4), (0, 9, 0, 7), page_size=3, extra_pages=10, causal=False)
    _, out, lse = check_prefill(c, device)
    for rows in (slice(0, 3), slice(3, 8)):
        assert bool((out[rows] == 0).all()) and bool((lse[rows] == -math.inf).all())
    assert bool(torch.isfinite(out[8:]).all()) and bool(torch.isfinite(lse[8:]).all())


def test_prefill_out_and_return_lse(device):
    """out= (poisoned with NaN) is filled in place and returned; without return_lse the op returns out
    alone, equal to the return_lse=True answer."""
    c = case(SQ, SK, page_size=3, causal=True)
    problem = make_paged_problem(c, device)
    buffer = poisoned(problem.q.shape, problem.q.dtype, device)
    result = tk.batch_prefill(problem.q, problem.paged.k_cache, problem.paged.v_cache, problem.qo_indptr,
                              **problem.kwargs(), out=buffer)
    assert isinstance(result, torch.Tensor) and result.data_ptr() == buffer.data_ptr()
    assert not bool(torch.isnan(buffer).any())
    out, lse = run_prefill(problem)
    assert torch.equal(out, buffer)
    check_against_reference(c.name, problem, buffer, lse)
    buffer.fill_(math.nan)
    out, lse = run_prefill(problem, out=buffer)
    assert out.data_ptr() == buffer.data_ptr()
    check_against_reference(c.name, problem, out, lse)


def test_prefill_tables_agree(device):
    """The 1-D and 2-D tables of one cache give bit-identical answers."""
    c = case(SQ, SK, page_size=3, causal=True)
    problem = make_paged_problem(c, device)
    one = run_prefill(problem)
    two = run_prefill(dataclasses.replace(problem, table="2d"))
    for first, second in zip(one, two):
        assert torch.equal(first, second)


# ====================================================================================================
# CPU lane: batch_decode and merge_attention_states


DK = (5, 40, 0, 70, 1)

DECODE_CASES = [
    decode_case(DK, page_size=16),
    decode_case(DK, page_size=3, table="2d", dtype=torch.bfloat16),
    decode_case(DK, page_size=1, heads_kv=1),
    decode_case(DK, page_size=16, layout="vectorized", table="2d", heads=8, heads_kv=2),
    decode_case(DK, page_size=3, window_left=7, dtype=torch.bfloat16),
    decode_case(DK, page_size=16, head_dim=40, logits_soft_cap=4.0, softmax_scale=0.25),
    decode_case(DK, page_size=16, kv_dtype=E4M3, scale="page", table="2d"),
    decode_case(DK, page_size=3, dtype=torch.bfloat16, kv_dtype=E5M2, scale="float"),
]


@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["splits-auto", "splits1", "splits3"])
@pytest.mark.parametrize("c", [c.param() for c in DECODE_CASES])
def test_decode(c, num_splits, device):
    """batch_decode is batch_prefill with qo_indptr = arange(B + 1), whatever the number of splits."""
    problem = make_paged_problem(c, device)
    out, lse = run_decode(problem, num_splits=num_splits)
    check_against_reference(f"{c.name}-splits{num_splits}", problem, out, lse)
    assert bool((out[2] == 0).all()) and bool((lse[2] == -math.inf).all())  # the sequence with no keys


def test_decode_out_and_return_lse(device):
    """out= (poisoned with NaN) is filled in place and returned; without return_lse, out alone."""
    problem = make_paged_problem(decode_case(DK, page_size=3), device)
    buffer = poisoned(problem.q.shape, problem.q.dtype, device)
    result = tk.batch_decode(problem.q, problem.paged.k_cache, problem.paged.v_cache, **problem.kwargs(),
                             out=buffer, num_splits=3)
    assert isinstance(result, torch.Tensor) and result.data_ptr() == buffer.data_ptr()
    out, lse = run_decode(problem, num_splits=3)
    assert torch.equal(out, buffer)
    check_against_reference("decode-out", problem, buffer, lse)


def test_zero_query_heads_give_empty_results(device):
    """q with 0 heads (and caches with some): batch_decode, like batch_prefill, returns empty out and lse."""
    problem = make_paged_problem(decode_case(DK, page_size=3), device)
    q = problem.q[:, :0]
    out, lse = run_decode(dataclasses.replace(problem, q=q))
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    out, lse = run_prefill(dataclasses.replace(problem, q=q))
    assert out.shape == q.shape and lse.shape == q.shape[:2]


def test_no_backward_ops_take_grad_inputs_under_no_grad(device):
    """The ops have no backward: inputs that require grad raise (test_bad_input) while grad mode is on, and
    run as any other input under torch.no_grad()."""
    problem = make_paged_problem(decode_case(DK, page_size=3), device)
    q = problem.q.clone().requires_grad_()
    want_prefill, want_decode = run_prefill(problem), run_decode(problem)
    v_a, lse_a, v_b, lse_b = merge_inputs(torch.float16, device)
    want_merge = tk.merge_attention_states(v_a, lse_a, v_b, lse_b)
    with torch.no_grad():
        got_prefill = run_prefill(dataclasses.replace(problem, q=q))
        got_decode = run_decode(dataclasses.replace(problem, q=q))
        got_merge = tk.merge_attention_states(v_a.requires_grad_(), lse_a, v_b, lse_b.requires_grad_())
    for name, got, want in (("prefill", got_prefill, want_prefill), ("decode", got_decode, want_decode),
                            ("merge", got_merge, want_merge)):
        for label, g, w in zip(("out", "lse"), got, want):
            assert torch.equal(g, w) and not g.requires_grad, f"{name} {label}"


def merge_inputs(dtype, device, rows=11, heads=4, head_dim=40):
    """Two states with every kind of row: both finite, one -inf (its v huge: it must weigh 0), both."""
    v_a = random_tensor((rows, heads, head_dim), dtype, device)
    v_b = random_tensor((rows, heads, head_dim), dtype, device)
    lse_a = random_tensor((rows, heads), torch.float32, device, scale=3.0)
    lse_b = random_tensor((rows, heads), torch.float32, device, scale=3.0)
    lse_a[0], lse_b[1] = -math.inf, -math.inf
    lse_a[2, 1:], lse_b[2, 1:] = -math.inf, -math.inf
    v_a[0], v_b[1] = 1000.0, -1000.0
    lse_b[3] = lse_a[3] + 30.0  # a weights ~1e-13 against b
    return v_a, lse_a, v_b, lse_b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_merge_attention_states(dtype, device):
    """Against the fp64 reference, by the rule against PyTorch's fp32 answer cast to v's dtype."""
    v_a, lse_a, v_b, lse_b = merge_inputs(dtype, device)
    out, lse = tk.merge_attention_states(v_a, lse_a, v_b, lse_b)
    assert out.dtype == dtype and out.shape == v_a.shape and lse.dtype == torch.float32 and lse.shape == lse_a.shape
    ref_out, ref_lse = reference_merge_states(v_a, lse_a, v_b, lse_b)
    low_out, low_lse = reference_merge_states(v_a, lse_a, v_b, lse_b, compute_dtype=torch.float32)
    assert_close(f"merge-out-{DTYPE_NAMES[dtype]}", out, ref_out, low_out.to(dtype))
    assert_close(f"merge-lse-{DTYPE_NAMES[dtype]}", lse, ref_lse, low_lse, atol=1e-6 * float(ref_lse[
        torch.isfinite(ref_lse)].abs().max()))
    assert bool((out[2, 1:] == 0).all()) and bool((lse[2, 1:] == -math.inf).all())


def test_merge_weighs_plus_inf_lse_zero(device):
    """lse +inf (flash_attn_*'s empty row) weighs 0 as -inf (the paged ops') does, against either kind of
    state, and two empty states give v 0 and lse -inf whichever sign they carry. flash_attn_varlen_func
    over a sequence with no keys, merged with a state over other keys, is that state."""
    v_a, lse_a, v_b, lse_b = merge_inputs(torch.float16, device)
    want_out, want_lse = tk.merge_attention_states(v_a, lse_a, v_b, lse_b)
    plus_a, plus_b = lse_a.clone(), lse_b.clone()
    plus_a[0], plus_b[2, 1:] = math.inf, math.inf   # row 0: a empty; row 2: a (-inf) and b (+inf) empty
    for lse_first, lse_second in ((plus_a, lse_b), (lse_a, plus_b), (plus_a, plus_b)):
        out, lse = tk.merge_attention_states(v_a, lse_first, v_b, lse_second)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        ref_out, ref_lse = reference_merge_states(v_a, lse_first, v_b, lse_second)
        assert torch.equal(ref_out, reference_merge_states(v_a, lse_a, v_b, lse_b)[0])
        assert bool((ref_lse[2, 1:] == -math.inf).all()) and bool((ref_out[2, 1:] == 0).all())
    both_plus = torch.full_like(lse_a, math.inf)
    out, lse = tk.merge_attention_states(v_a, both_plus, v_b, both_plus)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())

    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 3], [0, 0]))
    q, k = random_tensor((3, 2, 16), torch.float16, device), random_tensor((1, 2, 16), torch.float16, device)
    empty_out, empty_lse, _ = tk.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 1, return_attn_probs=True)
    other_out = random_tensor((3, 2, 16), torch.float16, device)
    other_lse = random_tensor((3, 2), torch.float32, device)
    out, lse = tk.merge_attention_states(empty_out, empty_lse.t(), other_out, other_lse)
    assert torch.equal(out, other_out) and torch.equal(lse, other_lse)


def test_merge_of_split_prefill_is_whole(device):
    """batch_prefill over the first pages of each sequence and over the rest, merged by
    merge_attention_states, is batch_prefill over all of them (non-causal: the halves are disjoint key
    sets of one softmax)."""
    lengths_q, lengths_k, page_size = (4, 7), (33, 20), 3
    problem = make_paged_problem(case(lengths_q, lengths_k, page_size=page_size), device)
    paged = problem.paged
    pages = [paged.kv_page_indices[paged.kv_indptr[b]:paged.kv_indptr[b + 1]] for b in range(2)]
    cut = [5, 3]  # pages in the first part, per sequence
    states = []
    for part in (0, 1):
        chosen = [p[:n] if part == 0 else p[n:] for p, n in zip(pages, cut)]
        counts = [n * page_size if part == 0 else length - n * page_size for n, length in zip(cut, lengths_k)]
        table = {"kv_indptr": cu_seqlens([c.numel() for c in chosen], device),
                 "kv_page_indices": torch.cat(chosen),
                 "kv_last_page_len": torch.tensor([n - (-(-n // page_size) - 1) * page_size for n in counts],
                                                  dtype=torch.int32, device=device)}
        states += tk.batch_prefill(problem.q, paged.k_cache, paged.v_cache, problem.qo_indptr, **table,
                                   return_lse=True)
    out, lse = tk.merge_attention_states(*states)
    ref_out, ref_lse = reference(problem, torch.float64)
    low_out, _ = reference(problem, problem.q.dtype)
    # two partial outputs, each rounded to fp16, then their merge rounded: twice one pass's error
    assert_close("split-merge-out", out, ref_out, low_out, ratio=4.0)
    atol = 2e-5 * float(ref_lse.abs().max())
    assert_close("split-merge-lse", lse, ref_lse, reference(problem, torch.float32)[1], atol=atol)


# ====================================================================================================
# CPU lane: alternative load paths, torch.compile


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tma_pages_equal_pointer_pages(causal, monkeypatch, device):
    """With whole key blocks per page, the kernels read K and V through 4-D tensor descriptors (Hopper);
    the interpreter runs them too. Bit-identical to the gathered pointer loads, with the last pages'
    unused slots and page 0 holding NaN (a masked block must zero them before ``p @ v``)."""
    c = case(SQ, SK, page_size=16, table="2d", causal=causal, kv_dtype=E4M3, scale="page", window_left=20)
    problem = make_paged_problem(c, device)
    results = []
    for mode in (True, False):
        monkeypatch.setattr(_paged_kernels, "tma_mode", mode)
        results.append(run_prefill(problem))
        results.append(run_decode(dataclasses.replace(problem, q=problem.q[:4]), num_splits=2))
    (p_out, p_lse), (d_out, d_lse), (p_out2, p_lse2), (d_out2, d_lse2) = results
    for label, first, second in (("prefill out", p_out, p_out2), ("prefill lse", p_lse, p_lse2),
                                 ("decode out", d_out, d_out2), ("decode lse", d_lse, d_lse2)):
        assert torch.equal(first, second), f"{c.name}: TMA and pointer {label} differ"
    check_against_reference(c.name, problem, p_out, p_lse)


def test_torch_compile_fullgraph(device):
    """The three ops under torch.compile(fullgraph=True), ``out=`` included: bit-equal to eager."""
    c = case(SQ, SK, page_size=3, causal=True)
    problem = make_paged_problem(c, device)
    decode = dataclasses.replace(problem, q=problem.q[:4])

    def step(p, d, out):
        o, lse = tk.batch_prefill(p.q, p.paged.k_cache, p.paged.v_cache, p.qo_indptr,
                                  **{**p.kwargs(), "return_lse": True, "out": out})
        kwargs = {key: value for key, value in d.kwargs().items() if key != "causal"}
        od, lsed = tk.batch_decode(d.q, d.paged.k_cache, d.paged.v_cache, **kwargs, return_lse=True,
                                   num_splits=2)
        merged = tk.merge_attention_states(o[:4], lse[:4], od, lsed)
        return o, lse, od, lsed, *merged

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    eager_out, compiled_out = torch.empty_like(problem.q), torch.empty_like(problem.q)
    eager = step(problem, decode, eager_out)
    got = compiled(problem, decode, compiled_out)
    assert got[0].data_ptr() == compiled_out.data_ptr(), "out= was not written in place under torch.compile"
    for label, first, second in zip(("out", "lse", "decode out", "decode lse", "merged", "merged lse"), eager,
                                    got):
        assert torch.equal(first, second), f"compiled and eager {label} differ"


TALL_TILE_CASES = [
    # sequences of more and fewer queries than one tile, a tile past the last sequence's queries
    case((600, 5, 0, 260), (610, 40, 3, 400), heads=2, heads_kv=1, page_size=3),
    case((300, 17), (290, 33), page_size=16, table="2d", dtype=torch.bfloat16, window_left=40),
]


@pytest.mark.parametrize("c", [c.param() for c in TALL_TILE_CASES])
def test_prefill_256_row_tiles(c, monkeypatch, device):
    """The 256-row tiles of ``PREFILL_GATHER_CONFIGS`` at D 128 (the interpreter otherwise runs 16-row
    ones): virtual query blocks of 256 queries, against the reference."""
    monkeypatch.setattr(_paged_kernels, "config_override", _paged_kernels.PREFILL_GATHER_CONFIGS[128])
    monkeypatch.setattr(paged_api, "_PLANS", {})
    check_prefill(c, device)
    (plan,) = paged_api._PLANS.values()
    assert plan.attn.constexprs["BLOCK_M"] == 256


def test_causal_prefill_takes_its_own_gather_config(monkeypatch):
    """Gathered rows under a causal mask at D 128 take ``PREFILL_GATHER_CAUSAL_CONFIGS``; full masks, TMA
    pages, decode and other head dims keep their tables; short sequences keep 128-row tiles."""
    monkeypatch.setattr(_paged_kernels, "is_interpreter", lambda: False)
    pick = _paged_kernels.paged_config
    assert pick(128, False, False, 2, causal=True) == _paged_kernels.PREFILL_GATHER_CAUSAL_CONFIGS[128]
    assert pick(128, False, False, 2) == _paged_kernels.PREFILL_GATHER_CONFIGS[128]
    assert pick(128, False, True, 2, causal=True) == _paged_kernels.PREFILL_TMA_CONFIGS[128]
    assert pick(128, True, False, 2, causal=True) == _paged_kernels.DECODE_CONFIGS[128]
    assert pick(64, False, False, 2, causal=True) == _paged_kernels.PREFILL_GATHER_CONFIGS[64]
    # full masks at D 128 take 256-row tiles only where the sequences average 256 queries or more
    assert pick(128, False, False, 2, mean_queries=4096).block_m == 256
    assert pick(128, False, False, 2, mean_queries=100.5) == _paged_kernels.SHORT_PREFILL_GATHER_CONFIG
    assert pick(64, False, False, 2, mean_queries=10) == _paged_kernels.PREFILL_GATHER_CONFIGS[64]


def _must_not_dispatch(*args, **kwargs):
    raise AssertionError("a plain eager call went through the torch.library op")


def test_cached_plans_serve_new_tensors_of_one_signature(monkeypatch, device):
    """Eager calls skip the custom op and keep one plan per call signature: a second call on other
    queries, caches, tables and scales of the same shapes runs through the first call's plan (TMA
    descriptors rebased onto the new caches) and is as right as the first."""
    monkeypatch.setattr(paged_api, "_PLANS", {})
    monkeypatch.setattr(paged_api, "_paged_op", _must_not_dispatch)
    monkeypatch.setattr(_paged_kernels, "tma_mode", True)   # descriptors, also under the interpreter
    prefill = case(SQ, SK, page_size=16, table="2d", causal=True, kv_dtype=E4M3, scale="page")
    decode = decode_case(DK, page_size=16, window_left=7)
    for call in (1, 2):
        torch.manual_seed(call)
        problem = make_paged_problem(prefill, device)
        out, lse = run_prefill(problem)
        check_against_reference(f"{prefill.name}-call{call}", problem, out, lse)
        problem = make_paged_problem(decode, device)
        out, lse = run_decode(problem, num_splits=3)
        check_against_reference(f"{decode.name}-call{call}", problem, out, lse)
        assert len(paged_api._PLANS) == 2, f"call {call}: {len(paged_api._PLANS)} plans"


def test_a_planned_signature_still_checks_devices(monkeypatch, device):
    """A cached plan skips the checks, so its key holds every tensor's device: the same shapes with a
    cache elsewhere miss it and get the check's error."""
    monkeypatch.setattr(paged_api, "_PLANS", {})
    problem = make_paged_problem(case(SQ, SK, page_size=3), device)
    run_prefill(problem)
    assert len(paged_api._PLANS) == 1
    elsewhere = dataclasses.replace(problem, paged=dataclasses.replace(problem.paged,
                                                                       v_cache=problem.paged.v_cache.to("meta")))
    with pytest.raises(ValueError, match="v_cache must be on q's device"):
        run_prefill(elsewhere)


def test_a_strided_table_is_copied_on_every_call_not_planned(monkeypatch, device):
    """An index tensor whose last dim is strided is copied contiguous on each call; its plan is not
    cached (the cached path hands the caller's tensors to the kernel as they are)."""
    monkeypatch.setattr(paged_api, "_PLANS", {})
    problem = make_paged_problem(case(SQ, SK, page_size=3, table="2d"), device)
    kwargs = problem.kwargs()
    strided = torch.stack([kwargs["block_table"], kwargs["block_table"]], dim=-1)[..., 0]
    assert strided.stride(-1) == 2
    want, want_lse = run_prefill(problem)
    assert len(paged_api._PLANS) == 1
    for _ in range(2):
        out, lse = run_prefill(problem, block_table=strided)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert len(paged_api._PLANS) == 1


# ====================================================================================================
# CPU lane: 64-bit page offsets


@triton.jit
def _row_offsets_probe(Out, Pages, Slots, head, stride_page, stride_head, stride_sa, stride_sb, XS: tl.constexpr,
                       N: tl.constexpr):
    offs = tl.arange(0, N)
    rows = paged_row_offsets(tl.load(Pages + offs), tl.load(Slots + offs), head, stride_page, stride_head,
                             stride_sa, stride_sb, XS)
    tl.store(Out + offs, rows)


@pytest.mark.parametrize("layout", ["linear-K", "vectorized-V"])
def test_paged_row_offsets_are_64_bit(layout, device):
    """The kernels' row addresses for pages of a 9 GB bf16 pool (H_kv 8, D 128, page size 16: offsets
    past 2^31 and 2^32 elements) are exact, where an int32 product would wrap."""
    page_size, heads_kv, head_dim = 16, 8, 128
    if layout == "linear-K":  # [P, page_size, H_kv, D]
        strides, xs = (page_size * heads_kv * head_dim, head_dim, heads_kv * head_dim, 0), 1
    else:  # V [P, H_kv, page_size // x, D, x]
        x = 8
        strides, xs = (page_size * heads_kv * head_dim, page_size * head_dim, head_dim * x, 1), x
    num_pages = 9 * 2**30 // (2 * strides[0]) + 1
    page_list = [0, 1, 2**31 // strides[0] - 1, 2**31 // strides[0], 2**32 // strides[0] - 1,
                 2**32 // strides[0] + 3, num_pages - 2, num_pages - 1]
    pages = torch.tensor(page_list, dtype=torch.int32, device=device)
    slots = torch.tensor([0, 15, 7, 8, 1, 9, 3, 15], dtype=torch.int32, device=device)
    out = torch.zeros(8, dtype=torch.int64, device=device)
    head = 7
    _row_offsets_probe[(1,)](out, pages, slots, head, *strides, XS=xs, N=8)
    p, s = pages.long(), slots.long()
    expected = p * strides[0] + head * strides[1] + (s // xs) * strides[2] + (s % xs) * strides[3]
    assert int(expected.max()) > 2**32
    assert out.tolist() == expected.tolist()


# ====================================================================================================
# bad inputs: a ValueError or TypeError that names the argument


def _bad_cases():
    """Builders taking a tensor factory ``t(*shape, dtype=fp16)`` and an int32 factory ``i(values)``;
    each returns (function, args, kwargs)."""
    T, H, D, P, PS = 8, 4, 32, 6, 4
    fp16, bf16, int64 = torch.float16, torch.bfloat16, torch.int64

    def prefill(q=None, k=None, v=None, qo=None, table="1d", **kw):
        def build(t, i):
            tables = {"1d": {"kv_indptr": i([0, 2, 5]), "kv_page_indices": i([0, 1, 2, 3, 4]),
                             "kv_last_page_len": i([3, 4])},
                      "2d": {"block_table": i([[0, 1, 5], [2, 3, 4]]), "seqlen_k": i([7, 12])},
                      "both": {"kv_indptr": i([0, 2, 5]), "kv_page_indices": i([0, 1, 2, 3, 4]),
                               "kv_last_page_len": i([3, 4]), "block_table": i([[0, 1, 5], [2, 3, 4]]),
                               "seqlen_k": i([7, 12])},
                      "none": {}}[table]
            args = (q(t) if q else t(T, H, D), k(t) if k else t(P, PS, 2, D), v(t) if v else t(P, PS, 2, D),
                    qo(i) if qo else i([0, 3, 8]))
            extra = {name: value(t, i) if callable(value) else value for name, value in kw.items()}
            return tk.batch_prefill, args, {**tables, **extra}
        return build

    def decode(q=None, k=None, v=None, **kw):
        def build(t, i):
            args = (q(t) if q else t(2, H, D), k(t) if k else t(P, PS, 2, D), v(t) if v else t(P, PS, 2, D))
            extra = {name: value(t, i) if callable(value) else value for name, value in kw.items()}
            return tk.batch_decode, args, {"block_table": i([[0, 1, 5], [2, 3, 4]]), "seqlen_k": i([7, 12]),
                                           **extra}
        return build

    def merge(v_a=None, lse_a=None, v_b=None, lse_b=None):
        def build(t, i):
            return tk.merge_attention_states, (v_a(t) if v_a else t(5, H, D),
                                               lse_a(t) if lse_a else t(5, H, dtype=torch.float32),
                                               v_b(t) if v_b else t(5, H, D),
                                               lse_b(t) if lse_b else t(5, H, dtype=torch.float32)), {}
        return build

    def as_int64(values):
        return lambda t, i: i(values).to(int64)

    def fp8(*shape):
        return lambda t: t(*shape).to(E4M3)

    cases = {
        "q-2d": (prefill(q=lambda t: t(T, H * D)), r"\bq\b"),
        "q-4d": (prefill(q=lambda t: t(1, T, H, D)), r"\bq\b"),
        "q-fp32": (prefill(q=lambda t: t(T, H, D, dtype=torch.float32)), r"\bq\b"),
        "q-fp32-fp8-caches": (prefill(q=lambda t: t(T, H, D, dtype=torch.float32), k=fp8(P, PS, 2, D),
                                      v=fp8(P, PS, 2, D)), r"\bq\b"),
        "heads-not-multiple": (prefill(k=lambda t: t(P, PS, 3, D), v=lambda t: t(P, PS, 3, D)),
                               r"head|k_cache"),
        "head-dim-differs": (prefill(k=lambda t: t(P, PS, 2, 16), v=lambda t: t(P, PS, 2, 16)), r"k_cache"),
        "k_cache-no-heads": (prefill(k=lambda t: t(P, PS, 0, D), v=lambda t: t(P, PS, 0, D)), r"k_cache"),
        "decode-k_cache-no-heads": (decode(q=lambda t: t(2, 0, D), k=lambda t: t(P, PS, 0, D),
                                           v=lambda t: t(P, PS, 0, D)), r"k_cache"),
        "caches-differ-shape": (prefill(v=lambda t: t(P, PS * 2, 2, D)), r"v_cache"),
        "caches-differ-dtype": (prefill(v=lambda t: t(P, PS, 2, D, dtype=bf16)), r"v_cache"),
        "caches-not-q-dtype": (prefill(k=lambda t: t(P, PS, 2, D, dtype=bf16),
                                       v=lambda t: t(P, PS, 2, D, dtype=bf16)), r"k_cache"),
        "cache-3d": (prefill(k=lambda t: t(P * PS, 2, D), v=lambda t: t(P * PS, 2, D)), r"k_cache"),
        "vectorized-wrong-x": (prefill(k=lambda t: t(P, 2, D // 4, 8, 4), v=lambda t: t(P, 2, 2, D, 4)),
                               r"k_cache|\bx\b"),
        "vectorized-page-not-multiple-of-x": (prefill(k=lambda t: t(P, 2, D // 8, 4, 8),
                                                      v=lambda t: t(P, 2, 0, D, 8)), r"page_size|v_cache"),
        "qo_indptr-int64": (prefill(qo=lambda i: i([0, 3, 8]).to(int64)), r"qo_indptr"),
        "qo_indptr-none": (prefill(qo=lambda i: None), r"qo_indptr"),
        "kv_indptr-int64": (prefill(kv_indptr=as_int64([0, 2, 5])), r"kv_indptr"),
        "kv_indptr-wrong-length": (prefill(kv_indptr=lambda t, i: i([0, 2, 4, 5])), r"kv_indptr"),
        "kv_page_indices-int64": (prefill(kv_page_indices=as_int64([0, 1, 2, 3, 4])), r"kv_page_indices"),
        "kv_last_page_len-int64": (prefill(kv_last_page_len=as_int64([3, 4])), r"kv_last_page_len"),
        "block_table-int64": (prefill(table="2d", block_table=as_int64([[0, 1, 5], [2, 3, 4]])), r"block_table"),
        "block_table-1d": (prefill(table="2d", block_table=lambda t, i: i([0, 1, 5])), r"block_table"),
        "seqlen_k-int64": (prefill(table="2d", seqlen_k=as_int64([7, 12])), r"seqlen_k"),
        "both-tables": (prefill(table="both"), r"block_table|kv_indptr|table"),
        "no-table": (prefill(table="none"), r"block_table|kv_indptr|table"),
        "1d-table-incomplete": (prefill(kv_last_page_len=None), r"kv_last_page_len"),
        "k_scale-shape": (prefill(k=fp8(P, PS, 2, D), v=fp8(P, PS, 2, D),
                                  k_scale=lambda t, i: torch.ones(P + 1, 2, device=i([0]).device)), r"k_scale"),
        "v_scale-shape": (prefill(k=fp8(P, PS, 2, D), v=fp8(P, PS, 2, D),
                                  v_scale=lambda t, i: torch.ones(P, 3, device=i([0]).device)), r"v_scale"),
        "k_scale-fp16": (prefill(k=fp8(P, PS, 2, D), v=fp8(P, PS, 2, D),
                                 k_scale=lambda t, i: torch.ones((), dtype=fp16, device=i([0]).device)), r"k_scale"),
        "window_left-below-minus-1": (prefill(window_left=-2), r"window_left"),
        "logits_soft_cap-negative": (prefill(logits_soft_cap=-1.0), r"logits_soft_cap"),
        "softmax_scale-zero": (prefill(softmax_scale=0.0), r"softmax_scale"),
        "out-wrong-shape": (prefill(out=lambda t, i: t(T, H, D + 1)), r"\bout\b"),
        "out-wrong-dtype": (prefill(out=lambda t, i: t(T, H, D, dtype=bf16)), r"\bout\b"),
        "out-stride-0": (prefill(out=lambda t, i: t(1, H, D).expand(T, H, D)), r"\bout\b"),
        "out-rows-overlap": (prefill(out=lambda t, i: t(T * D + H).as_strided((T, H, D), (D, 1, 1))), r"\bout\b"),
        "decode-out-stride-0": (decode(out=lambda t, i: t(2, 1, D).expand(2, H, D)), r"\bout\b"),
        "q-requires-grad": (prefill(q=lambda t: t(T, H, D).requires_grad_()), r"\bq requires grad"),
        "v_cache-requires-grad": (prefill(v=lambda t: t(P, PS, 2, D).requires_grad_()), r"v_cache requires grad"),
        "decode-q-requires-grad": (decode(q=lambda t: t(2, H, D).requires_grad_()), r"\bq requires grad"),
        "decode-q-2d": (decode(q=lambda t: t(2, H * D)), r"\bq\b"),
        "decode-q-batch-differs": (decode(q=lambda t: t(3, H, D)), r"block_table|seqlen_k"),
        "decode-num_splits-zero": (decode(num_splits=0), r"num_splits"),
        "merge-lse_a-fp16": (merge(lse_a=lambda t: t(5, H)), r"lse_a"),
        "merge-v_b-shape": (merge(v_b=lambda t: t(5, H, D + 8)), r"v_b"),
        "merge-v_b-dtype": (merge(v_b=lambda t: t(5, H, D, dtype=bf16)), r"v_b"),
        "merge-lse_b-shape": (merge(lse_b=lambda t: t(5, H + 1, dtype=torch.float32)), r"lse_b"),
        "merge-v_a-2d": (merge(v_a=lambda t: t(5, H * D)), r"v_a"),
        "merge-v_b-requires-grad": (merge(v_b=lambda t: t(5, H, D).requires_grad_()), r"v_b requires grad"),
        "merge-lse_a-requires-grad": (merge(lse_a=lambda t: t(5, H, dtype=torch.float32).requires_grad_()),
                                      r"lse_a requires grad"),
    }
    return [pytest.param(build, match, id=name) for name, (build, match) in cases.items()]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input(build, match, device):
    def t(*shape, dtype=torch.float16):
        return random_tensor(shape, dtype, device)

    def i(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    fn, args, kwargs = build(t, i)
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args, **kwargs)


def test_out_sharing_memory_with_inputs(device):
    """out= that shares memory with q, a cache or the page table is refused, naming what it overlaps (the
    kernels read those while other programs write out: a silently wrong result otherwise); q and out as
    disjoint head blocks of one fused buffer are allowed, and give what a separate out gives."""
    T, H, D, P, PS = 8, 4, 32, 6, 4

    def t(*shape):
        return random_tensor(shape, torch.float16, device)

    def i(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    tables = {"kv_indptr": i([0, 2, 5]), "kv_page_indices": i([0, 1, 2, 3, 4]), "kv_last_page_len": i([3, 4])}
    q, k, v, qo = t(T, H, D), t(P, PS, 2, D), t(P, PS, 2, D), i([0, 3, 8])
    fused = t(T, 2 * H, D)
    q_part, out_part = fused[:, :H], fused[:, H:]
    ahead = t(T * H * D + H * D)
    cases = (("q", q, q), ("k_cache", q, k.view(-1)[:T * H * D].view(T, H, D)),
             ("v_cache", q, v.view(-1)[D:D + T * H * D].view(T, H, D)),
             ("q", q_part, fused[:, 1:H + 1]),                                  # one head of the other's block
             ("q", ahead[:T * H * D].view(T, H, D), ahead[H * D:].view(T, H, D)))   # a row apart
    for name, query, out in cases:
        with pytest.raises(ValueError, match=rf"out overlaps {name}\b"):
            tk.batch_prefill(query, k, v, qo, **tables, out=out)
    with pytest.raises(ValueError, match=r"out overlaps q\b"):
        tk.batch_decode(q[:2], k, v, block_table=i([[0, 1, 5], [2, 3, 4]]), seqlen_k=i([7, 12]), out=q[:2])
    shared = torch.zeros(T * H * D * 2, dtype=torch.uint8, device=device)
    pages = shared[:20].view(torch.int32)
    pages.copy_(i([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"out overlaps kv_page_indices\b"):
        tk.batch_prefill(q, k, v, qo, kv_indptr=i([0, 2, 5]), kv_page_indices=pages, kv_last_page_len=i([3, 4]),
                         out=shared.view(torch.float16).view(T, H, D))
    # allowed: q and out are the two halves of each row of one buffer
    q_before = q_part.clone()
    expected = tk.batch_prefill(q_part, k, v, qo, **tables)
    got = tk.batch_prefill(q_part, k, v, qo, **tables, out=out_part)
    assert got.data_ptr() == out_part.data_ptr()
    assert torch.equal(q_part, q_before)
    assert torch.equal(out_part, expected)


# ====================================================================================================
# GPU lane (-m gpu): real sizes, caches past 4 GB, CUDA graphs, no host synchronisation


GPU_Q, GPU_K = (1, 700, 0, 1500), (2000, 700, 1, 3000)

GPU_CASES = [
    case((2048,), (3000,), heads=32, heads_kv=8, head_dim=128, page_size=ps, dtype=torch.bfloat16, causal=True,
         extra_pages=64)
    for ps in (1, 16, 1024)
] + [
    case(GPU_Q, GPU_K, heads=32, heads_kv=8, head_dim=128, page_size=ps, dtype=torch.bfloat16, causal=True,
         table=table, extra_pages=64)
    for ps, table in ((1, "2d"), (16, "1d"), (1024, "2d"))
] + [
    case(GPU_Q, GPU_K, heads=32, heads_kv=8, head_dim=128, page_size=16, layout="vectorized",
         dtype=torch.bfloat16, window_left=256, causal=True),
    case(GPU_Q, GPU_K, heads=32, heads_kv=8, head_dim=128, page_size=16, dtype=torch.bfloat16, kv_dtype=E4M3,
         scale="page", causal=True),
    case(GPU_Q, GPU_K, heads=32, heads_kv=8, head_dim=128, page_size=16, dtype=torch.float16, kv_dtype=E5M2,
         scale="tensor", table="2d", logits_soft_cap=30.0),
    # full masks over gathered pages at D 128: 256-row tiles (the queries average 550 a sequence)
    case(GPU_Q, GPU_K, heads=16, heads_kv=16, head_dim=128, page_size=1, dtype=torch.bfloat16, causal=False),
]


@gpu
@pytest.mark.parametrize("c", [c.param() for c in GPU_CASES])
def test_gpu_prefill(c, device):
    leave_nan_in_allocator(((sum(c.seqlens_q), c.heads, c.head_dim), c.dtype, device))
    check_prefill(c, device)


GPU_DECODE_K = (1, 4000, 0, 517, 2048, 33, 777, 16384)


@gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7], ids=["splits-auto", "splits1", "splits7"])
@pytest.mark.parametrize("c", [
    decode_case(GPU_DECODE_K, heads=32, heads_kv=8, head_dim=128, page_size=16, dtype=torch.bfloat16).param(),
    decode_case(GPU_DECODE_K, heads=32, heads_kv=8, head_dim=128, page_size=1, table="2d",
         dtype=torch.bfloat16, window_left=1000).param(),
    decode_case(GPU_DECODE_K, heads=32, heads_kv=8, head_dim=128, page_size=64, layout="vectorized",
         dtype=torch.bfloat16, kv_dtype=E4M3, scale="page").param(),
])
def test_gpu_decode(c, num_splits, device):
    problem = make_paged_problem(c, device)
    out, lse = run_decode(problem, num_splits=num_splits)
    check_against_reference(f"{c.name}-splits{num_splits}", problem, out, lse)


def large_pool_problem(pool_bytes: int, page_size: int, device, lengths_q, lengths_k) -> PagedProblem:
    """bf16 caches (H_kv 8, D 128) of at least ``pool_bytes`` each, the sequences' pages interleaved
    over the pool (0, N-1, 1, N-2, ...: half of them past 2^31 or 2^32 elements), each page's values
    equal to its page index, so a wrapped 32-bit address reads a wrong value (or an unused page's NaN)."""
    heads_kv, head_dim = 8, 128
    page_bytes = page_size * heads_kv * head_dim * 2
    used = sum(-(-n // page_size) for n in lengths_k)
    num_pages = -(-pool_bytes // page_bytes) + 1
    q = random_tensor((sum(lengths_q), 32, head_dim), torch.bfloat16, device)
    k = random_tensor((sum(lengths_k), heads_kv, head_dim), torch.bfloat16, device)
    paged = make_paged_kv(k, k, cu_seqlens(lengths_k, device), page_size, extra_pages=num_pages - used,
                          order="interleave")
    pages = paged.kv_page_indices.long()
    paged.v_cache[pages] = pages.to(torch.bfloat16).view(-1, 1, 1, 1).expand(-1, *paged.v_cache.shape[1:])
    assert paged.k_cache.numel() * 2 >= pool_bytes and int(pages.max()) == num_pages - 1
    return PagedProblem(q, cu_seqlens(lengths_q, device), paged, "1d", None, None, {"causal": True})


@gpu
@pytest.mark.parametrize("pool_gb, page_size", [(4.5, 16), (9, 16), (9, 1)], ids=["4.5GB-P16", "9GB-P16", "9GB-P1"])
def test_gpu_cache_past_4gb(pool_gb, page_size, device):
    """Prefill and decode read pages on both sides of 2^31 (4.5 GB) and 2^32 (9 GB) elements exactly:
    a few queries per sequence, against the reference on the gathered pages."""
    try:
        check_large_pool(int(pool_gb * 2**30), page_size, device, f"{pool_gb}GB-P{page_size}")
    finally:
        torch.cuda.empty_cache()  # the pool died with check_large_pool's frame


def check_large_pool(pool_bytes: int, page_size: int, device, name: str) -> None:
    problem = large_pool_problem(pool_bytes, page_size, device, (5, 1, 3), (3000, 17, 1200))
    out, lse = run_prefill(problem)
    check_against_reference(f"prefill-{name}", problem, out, lse)
    arange = torch.arange(4, dtype=torch.int32, device=device)
    for table in ("1d", "2d"):
        decode = dataclasses.replace(problem, q=problem.q[:3].contiguous(), table=table, options={})
        out, lse = run_decode(decode, num_splits=4)
        check_against_reference(f"decode-{table}-{name}", decode, out, lse, qo_indptr=arange)


def copy_tables(captured: dict, paged) -> None:
    """Write ``paged``'s tables into the captured buffers (same B; page lists and rows may be shorter)."""
    for name, src in (("kv_indptr", paged.kv_indptr), ("kv_last_page_len", paged.kv_last_page_len),
                      ("seqlen_k", paged.seqlen_k)):
        captured[name].copy_(src)
    captured["kv_page_indices"][:paged.kv_page_indices.numel()].copy_(paged.kv_page_indices)
    captured["block_table"].zero_()
    captured["block_table"][:, :paged.block_table.shape[1]].copy_(paged.block_table)


@gpu
@pytest.mark.parametrize("table", ["1d", "2d"])
def test_gpu_cuda_graph(table, device):
    """Capture batch_prefill (causal) and batch_decode (3 splits) in one CUDA graph, then replay it with
    other query/key length mixes (same B, same totals of queries) written into the captured tables and
    caches; each replay within the rule."""
    H, Hk, D, page_size, dtype = 16, 4, 128, 16, torch.bfloat16
    mixes_q = [(1, 500, 0, 300), (300, 1, 500, 0), (200, 200, 200, 201)]
    mixes_k = [(700, 500, 3, 1000), (300, 2000, 600, 1), (1, 1, 1500, 201)]
    pool = max(sum(-(-n // page_size) for n in m) for m in mixes_k) + 8
    max_pages = max(-(-n // page_size) for m in mixes_k for n in m)
    total_q = sum(mixes_q[0])
    assert all(sum(m) == total_q for m in mixes_q)

    def paged_for(lengths_k):
        used = sum(-(-n // page_size) for n in lengths_k)
        k = random_tensor((sum(lengths_k), Hk, D), dtype, device)
        v = random_tensor((sum(lengths_k), Hk, D), dtype, device)
        return make_paged_kv(k, v, cu_seqlens(lengths_k, device), page_size, extra_pages=pool - used)

    first = paged_for(mixes_k[0])
    k_cache, v_cache = first.k_cache.clone(), first.v_cache.clone()
    tables = {"kv_indptr": first.kv_indptr.clone(), "kv_last_page_len": first.kv_last_page_len.clone(),
              "seqlen_k": first.seqlen_k.clone(),
              "kv_page_indices": torch.zeros(pool, dtype=torch.int32, device=device),
              "block_table": torch.zeros(4, max_pages, dtype=torch.int32, device=device)}
    copy_tables(tables, first)
    fmt_keys = ("kv_indptr", "kv_page_indices", "kv_last_page_len") if table == "1d" else ("block_table", "seqlen_k")
    table_kwargs = {key: tables[key] for key in fmt_keys}
    qo_indptr = cu_seqlens(mixes_q[0], device)
    q = random_tensor((total_q, H, D), dtype, device)
    q_decode = random_tensor((4, H, D), dtype, device)

    def step():
        prefill = tk.batch_prefill(q, k_cache, v_cache, qo_indptr, causal=True, return_lse=True, **table_kwargs)
        decode = tk.batch_decode(q_decode, k_cache, v_cache, return_lse=True, num_splits=3, **table_kwargs)
        return (*prefill, *decode)

    graph, results = capture_graph(step)

    for i, (lengths_q, lengths_k) in enumerate(zip(mixes_q[1:] + mixes_q[:1], mixes_k[1:] + mixes_k[:1])):
        paged = paged_for(lengths_k)
        k_cache.copy_(paged.k_cache)
        v_cache.copy_(paged.v_cache)
        copy_tables(tables, paged)
        qo_indptr.copy_(cu_seqlens(lengths_q, device))
        q.copy_(random_tensor(q.shape, dtype, device))
        q_decode.copy_(random_tensor(q_decode.shape, dtype, device))
        for t in results:
            t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        out, lse, out_decode, lse_decode = results
        name = f"replay{i}-{table}-Sq" + ",".join(map(str, lengths_q)) + "-Sk" + ",".join(map(str, lengths_k))
        replayed = PagedProblem(q, qo_indptr, paged, table, None, None, {"causal": True})
        check_against_reference(f"prefill-{name}", replayed, out, lse)
        decode = dataclasses.replace(replayed, q=q_decode, options={})
        arange = torch.arange(5, dtype=torch.int32, device=device)
        check_against_reference(f"decode-{name}", decode, out_decode, lse_decode, qo_indptr=arange)


@gpu
@pytest.mark.parametrize("table", ["1d", "2d"])
def test_gpu_no_host_sync(table, device):
    """batch_prefill, batch_decode (automatic and explicit splits, fp8 per-page scales) and
    merge_attention_states never synchronise with the host: torch's sync debug mode turns any .item(),
    .tolist() or device-to-host copy into an error."""
    c = case(GPU_Q, GPU_K, heads=32, heads_kv=8, head_dim=128, page_size=16, dtype=torch.bfloat16,
             kv_dtype=E4M3, scale="page", table=table, causal=True)
    problem = make_paged_problem(c, device)
    decode = make_paged_problem(dataclasses.replace(c, seqlens_q=(1,) * len(GPU_K)), device)

    def step():
        out, lse = run_prefill(problem)
        run_decode(decode)
        run_decode(decode, num_splits=5)
        tk.merge_attention_states(out, lse, out, lse)

    assert_no_host_sync(step)
