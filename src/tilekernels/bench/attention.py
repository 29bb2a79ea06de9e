"""Check cases and benchmark cases for ``tk.flash_attn_func`` / ``tk.flash_attn_varlen_func``.

Shapes are ``BxHxSxD`` (batch, heads, sequence length of queries and keys alike, head dim) with a
mask, ``full`` or ``causal``: ``--shapes 4x16x4096x128`` takes the masks ``--causal`` asks for (both by
default), ``4x16x4096x128xcausal`` names one; that suffixed form is also how rows label their shape.
The default GPU set is ANCHORS.md's SDPA sizes, head dims 64/128/256, each causal and not.

Providers, all on q, k, v ``[B, S, H, D]`` (FlashAttention-2's layout) in the bench dtype:

- ``tilekernels``: ``tk.flash_attn_func(q, k, v, causal=...)``.
- ``cudnn``, ``flash`` (FlashAttention-2 inside torch), ``efficient`` (mem-efficient):
  ``F.scaled_dot_product_attention`` on ``q.transpose(1, 2)`` etc. (views, as a user of that layout
  writes it) under ``torch.nn.attention.sdpa_kernel`` with only that backend allowed; the output is
  transposed back (a view). With ``S_q == S_k``, SDPA's top-left ``is_causal`` is FlashAttention's
  bottom-right causal mask. A backend that does not support a case raises, and that provider is a
  failure for that case only. Under the CPU interpreter only ``tilekernels`` and ``flash`` (torch's
  CPU flash kernel) run by default: cuDNN and mem-efficient are CUDA-only.

Passes (the rows' ``variant``):

- ``fwd``: the forward call, inputs not requiring grad.
- ``bwd``: FlashAttention's ``benchmark_backward`` method, the same for every provider: each input set
  gets the provider's forward graph built once (outside the timing), then each timed call is
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` on it: the backward alone, no
  forward and no ``.grad`` accumulation. Under ``--cuda-graph`` the bwd pass is not run (the graph
  built eagerly belongs to another stream than the capture).

FLOPs (ANCHORS.md): ``4*B*H*S^2*D`` forward, half that when causal; backward 2.5x the forward.

The accuracy check before timing compares, for a sample of (batch, head) pairs (the first and last
head of the first and last sequence, every query and key of them), the provider's output (fwd) or its
dq, dk, dv (bwd) with ``attention.reference.reference_attention`` in float64 on the same device,
under ``testing.compare``'s error-ratio rule against the same reference computed in the bench dtype:
at most 2x PyTorch's own low-precision error for the output, 3x for the gradients. The whole output
(or every gradient) must also be finite. ``python -m tilekernels check`` compares whole outputs, the
LSE and all three gradients at smaller shapes, varlen and GQA included.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from ..testing import Comparison, compare, random_tensor
from .check import CheckCase
from .harness import (
    OURS,
    Accuracy,
    BenchCase,
    UsageError,
    device_random,
    dtype_name,
    parse_dims,
    shape_items,
    tk_function,
)

NAME = "flash_attn"
ANCHOR_PROVIDER = "cudnn"
# the harness prints this in its header (FlashAttention's count; ANCHORS.md)
FLOPS_FORMULA = "4*B*H*S^2*D (x0.5 causal; bwd x2.5)"

DIMS = ("B", "H", "S", "D")
MASKS = ("full", "causal")
PASSES = ("fwd", "bwd")
LAYOUT = "BSHD"
SDPA_PROVIDERS = ("cudnn", "flash", "efficient")
PROVIDERS = (OURS, *SDPA_PROVIDERS)
CPU_PROVIDERS = (OURS, "flash")

# ANCHORS.md: SDPA attention, bf16, on one H100 (torch 2.11, triton 3.6, medians of do_bench, measured
# 2026-11-22), TFLOP/s as (forward, backward), keyed by (B, H, S, D, causal).
ANCHOR_SDPA_H100_BF16 = {
    (4, 16, 4096, 128, False): {"flash": (340.0, 296.0), "cudnn": (604.0, 527.0), "efficient": (173.0, 139.0)},
    (4, 16, 4096, 128, True): {"flash": (303.0, 252.0), "cudnn": (543.0, 471.0), "efficient": (160.0, 123.0)},
    (2, 16, 8192, 128, True): {"flash": (316.0, 280.0), "cudnn": (553.0, 476.0), "efficient": (167.0, 128.0)},
    (8, 16, 2048, 64, False): {"flash": (297.0, 239.0), "cudnn": (444.0, 401.0), "efficient": (129.0, 106.0)},
    (1, 16, 16384, 128, True): {"flash": (310.0, 323.0), "cudnn": (552.0, 520.0), "efficient": (171.0, 130.0)},
    (4, 16, 4096, 256, False): {"flash": (318.0, 236.0), "cudnn": (648.0, 356.0), "efficient": (149.0, 40.0)},
}

GPU_SIZES = ["4x16x4096x128", "2x16x8192x128", "8x16x2048x64", "1x16x16384x128", "4x16x4096x256"]
# Under the interpreter: a few 16-row tiles with both masks, small enough to run in seconds.
INTERPRETER_SIZES = ["1x2x64x32"]

OUT_RATIO = 2.0
GRAD_RATIO = 3.0


def _reference_attention():
    from ..attention.reference import reference_attention

    return reference_attention


def anchor(row: dict):
    """The ANCHORS.md cuDNN figure (fwd or bwd) for a bf16 GPU row, if its shape has one."""
    if row.get("interpreter") or row["dtype"] != "bf16" or row["variant"] not in PASSES:
        return None
    shape = row["shape"]
    key = (shape["B"], shape["H"], shape["S"], shape["D"], shape.get("mask") == "causal")
    figures = ANCHOR_SDPA_H100_BF16.get(key)
    if figures is None:
        return None
    return "H100 cuDNN anchor", figures["cudnn"][PASSES.index(row["variant"])]


def flops(shape: dict, variant: str) -> float:
    """ANCHORS.md's count: ``4*B*H*S^2*D`` forward (x0.5 causal), backward 2.5x forward."""
    forward = 4.0 * shape["B"] * shape["H"] * shape["S"] ** 2 * shape["D"]
    if shape["mask"] == "causal":
        forward *= 0.5
    return forward * (2.5 if variant == "bwd" else 1.0)


def parse_masked_shapes(text: str, causal: str, dims: tuple[str, ...], example: str) -> list[dict]:
    """Attention shapes ``AxBx...`` (one positive int per name in ``dims``) with an optional mask suffix
    (``xfull`` / ``xcausal``); an item without one takes the masks ``causal`` (both/yes/no) selects.
    ``example`` (a valid item) goes into the error message. Shared by the attention benches."""
    masks_for = {"both": MASKS, "yes": ("causal",), "no": ("full",)}
    if causal not in masks_for:
        raise UsageError(f"--causal: {causal!r}; choose from both, yes, no")
    shapes = []
    for item, parts in shape_items(text):
        masks = masks_for[causal]
        if parts[-1] in MASKS:
            masks = (parts.pop(),)
        try:
            parsed = parse_dims(item, parts, dims)
        except UsageError:
            raise UsageError(f"shape {item!r}: expected {'x'.join(dims)} ({len(dims)} positive integers joined by "
                             f"'x'), optionally followed by x{'|x'.join(MASKS)}, e.g. {example}") from None
        shapes += [{**parsed, "mask": mask} for mask in masks]
    return shapes


def parse_attention_shapes(text: str, causal: str = "both") -> list[dict]:
    """``"4x16x4096x128,8x16x2048x64xcausal"`` -> ``[{"B": 4, "H": 16, "S": 4096, "D": 128, "mask":
    "full"}, {... "mask": "causal"}, {"B": 8, ..., "mask": "causal"}]``: an item without a mask suffix
    takes the masks ``causal`` (both/yes/no) selects."""
    return parse_masked_shapes(text, causal, DIMS, "4x16x4096x128xcausal")


# ----------------------------------------------------------------------------------------------------
# providers: forward functions of (q, k, v) [B, S, H, D] -> out [B, S, H, D]


def _tk_forward(causal: bool):
    flash_attn_func = tk_function("flash_attn_func")

    def forward(q, k, v):
        return flash_attn_func(q, k, v, causal=causal)

    return forward


def _sdpa_forward(provider: str, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[provider]

    def forward(q, k, v):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal)
        return out.transpose(1, 2)

    return forward


def _forward_provider(forward):
    def run(x: dict) -> torch.Tensor:
        return forward(x["q"], x["k"], x["v"])

    return run


def _backward_provider(provider: str, forward):
    """Time ``autograd.grad`` on a forward graph built once per input set (kept in the set itself, so it
    goes when the harness drops the sets; another provider's graphs are dropped when this one starts)."""
    key = f"graph:{provider}"

    def run(x: dict) -> tuple[torch.Tensor, ...]:
        if key not in x:
            for other in [k for k in x if k.startswith("graph:")]:
                del x[other]
            leaves = tuple(x[name].detach().requires_grad_() for name in ("q", "k", "v"))
            x[key] = (forward(*leaves), leaves)
        out, leaves = x[key]
        return torch.autograd.grad(out, leaves, x["dout"], retain_graph=True)

    return run


# ----------------------------------------------------------------------------------------------------
# the accuracy check before timing


def _sample_pairs(batch: int, heads: int) -> list[tuple[int, int]]:
    return [(b, h) for b in sorted({0, batch - 1}) for h in sorted({0, heads - 1})]


def _reference_pair(x: dict, b: int, h: int, causal: bool, backward: bool, compute_dtype: torch.dtype):
    """Output ``[S, D]`` (or dq, dk, dv) of (batch ``b``, head ``h``) by ``reference_attention``.

    In float64 the leaves are float64 (exact gradients); in the bench dtype they keep that dtype, so the
    gradients are what PyTorch computes in that precision."""
    reference_attention = _reference_attention()
    pick = (slice(b, b + 1), slice(None), slice(h, h + 1))
    leaf_dtype = torch.float64 if compute_dtype == torch.float64 else x["q"].dtype
    q, k, v = (x[name][pick].detach().to(leaf_dtype).requires_grad_(backward) for name in ("q", "k", "v"))
    with torch.set_grad_enabled(backward):
        out, _ = reference_attention(q, k, v, causal=causal, compute_dtype=compute_dtype)
        if not backward:
            return (out[0, :, 0],)
        grads = torch.autograd.grad(out, (q, k, v), x["dout"][pick].to(out.dtype))
    return tuple(g[0, :, 0] for g in grads)


def _combine(comparisons: list[Comparison], nonfinite: dict[str, int]) -> Accuracy:
    worst = max(comparisons, key=lambda c: (not c.passed, c.ratio))
    detail = "; ".join(str(c) for c in comparisons if not c.passed) or str(worst)
    bad = {name: n for name, n in nonfinite.items() if n}
    if bad:
        detail += "; non-finite elements in the whole " + ", ".join(f"{name} ({n})" for name, n in bad.items())
    return Accuracy(all(c.passed for c in comparisons) and not bad, max(c.ratio for c in comparisons), detail)


def _make_check(shape: dict, variant: str):
    """``check(inputs, output, provider)`` for one case; references are computed once per input set."""
    B, H, S, D = (shape[d] for d in DIMS)
    causal = shape["mask"] == "causal"
    backward = variant == "bwd"
    names = ("dq", "dk", "dv") if backward else ("out",)
    ratio = GRAD_RATIO if backward else OUT_RATIO
    pairs = _sample_pairs(B, H)
    cache: dict[int, tuple] = {}

    def check(inputs: dict, output, provider: str) -> Accuracy:
        outputs = tuple(output) if backward else (output,)
        for name, t in zip(names, outputs):
            if tuple(t.shape) != (B, S, H, D):
                return Accuracy(False, math.inf, f"{name} shape {tuple(t.shape)}, expected {(B, S, H, D)}")
        key = id(inputs)
        if key not in cache:
            per_pair = [(_reference_pair(inputs, b, h, causal, backward, torch.float64),
                         _reference_pair(inputs, b, h, causal, backward, inputs["q"].dtype)) for b, h in pairs]
            refs = [torch.stack([p[0][i] for p in per_pair]) for i in range(len(names))]
            lows = [torch.stack([p[1][i] for p in per_pair]) for i in range(len(names))]
            cache.clear()
            cache[key] = (refs, lows)
        refs, lows = cache[key]
        comparisons = []
        for name, t, ref, low in zip(names, outputs, refs, lows):
            sample = torch.stack([t[b, :, h] for b, h in pairs])
            comparisons.append(compare(f"{provider} {name}", sample, ref, low, ratio=ratio))
        nonfinite = {name: int((~torch.isfinite(t)).sum()) for name, t in zip(names, outputs)}
        return _combine(comparisons, nonfinite)

    return check


# ----------------------------------------------------------------------------------------------------
# benchmark cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", default="fwd,bwd",
                        help="flash_attn: fwd and/or bwd (backward alone, on a prebuilt forward graph); "
                             "default fwd,bwd")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"),
                        help="flash_attn: masks for shapes given without an xfull/xcausal suffix "
                             "(default both)")


def _case(shape: dict, variant: str, dtype: torch.dtype, device: torch.device, seed: int,
          providers: tuple[str, ...]) -> BenchCase:
    B, H, S, D = (shape[d] for d in DIMS)
    causal = shape["mask"] == "causal"
    backward = variant == "bwd"
    tensor_bytes = B * S * H * D * dtype.itemsize
    # q, k, v, out; the backward adds dout, dq, dk, dv.
    set_bytes = tensor_bytes * (8 if backward else 4)

    def make_inputs(i: int) -> dict:
        base = 1000 * seed + 10 * i
        x = {name: device_random((B, S, H, D), dtype, device, base + j)
             for j, name in enumerate(("q", "k", "v"))}
        if backward:
            x["dout"] = device_random((B, S, H, D), dtype, device, base + 3)
        return x

    fns = {}
    for provider in providers:
        forward = _tk_forward(causal) if provider == OURS else _sdpa_forward(provider, causal)
        fns[provider] = _backward_provider(provider, forward) if backward else _forward_provider(forward)
    return BenchCase(op=NAME, shape=dict(shape), dtype=dtype, variant=variant, layout=LAYOUT,
                     flops=flops(shape, variant), set_bytes=set_bytes, make_inputs=make_inputs,
                     providers=fns, check=_make_check(shape, variant))


def _split(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in items if p not in allowed]
    if unknown or not items:
        raise UsageError(f"{option}: {', '.join(unknown) or 'nothing given'}; choose from {', '.join(allowed)}")
    return items


def bench_cases(opts: argparse.Namespace, device: torch.device) -> list[BenchCase]:
    interpreter = device.type != "cuda"
    passes = _split(getattr(opts, "passes", "fwd,bwd"), PASSES, "--passes")
    if getattr(opts, "cuda_graph", False) and "bwd" in passes:
        passes.remove("bwd")
        print("flash_attn: bwd not timed under --cuda-graph (its forward graphs are built eagerly, on "
              "another stream than the capture)", flush=True)
    if opts.providers:
        providers = _split(opts.providers, PROVIDERS, "--providers")
    elif interpreter:
        providers = list(CPU_PROVIDERS)
        print("flash_attn: cudnn and efficient are CUDA-only SDPA backends, skipped on the CPU; 'flash' "
              "here is torch's CPU flash kernel", flush=True)
    else:
        providers = list(PROVIDERS)
    causal = getattr(opts, "causal", "both")
    sizes = opts.shapes or ",".join(INTERPRETER_SIZES if interpreter else GPU_SIZES)
    shapes = parse_attention_shapes(sizes, causal)
    dtype = opts.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise UsageError(f"flash_attn: --dtype {dtype_name(dtype)}; attention runs in fp16 or bf16")
    print("flash_attn: FLOPs 4*B*H*S^2*D forward (x0.5 causal), backward 2.5x forward; bwd times "
          "autograd.grad on a prebuilt forward graph", flush=True)
    return [_case(shape, variant, dtype, device, opts.seed, tuple(providers))
            for variant in passes for shape in shapes]


# ----------------------------------------------------------------------------------------------------
# check cases




def _worst(comparisons: list[tuple[Comparison, float]]) -> Comparison:
    """The comparison a case reports: a failing one if any, else the one nearest its limit."""
    return max(comparisons, key=lambda pair: (not pair[0].passed, pair[0].ratio / pair[1]))[0]


def _check_case(name: str, device: torch.device, seed: int, *, heads: int, heads_k: int, head_dim: int,
                seqlens_q: list[int], seqlens_k: list[int], dtype: torch.dtype, varlen: bool, backward: bool,
                alibi: bool = False, **options) -> CheckCase:
    """tk.flash_attn_func (or, with ``varlen``, tk.flash_attn_varlen_func on sequences of the given
    lengths) against ``reference_attention``: the output and LSE (forward) or dq, dk, dv (backward),
    every element, each under the error-ratio rule (2x the output and LSE, 3x the gradients); the case
    reports the worst. ``options``: flash_attn_func's causal, window_size, softcap."""

    def run() -> Comparison:
        reference_attention = _reference_attention()
        gen = torch.Generator().manual_seed(seed)
        batch = len(seqlens_q)
        if varlen:
            q_shape, k_shape = (sum(seqlens_q), heads, head_dim), (sum(seqlens_k), heads_k, head_dim)
        else:
            q_shape, k_shape = (batch, seqlens_q[0], heads, head_dim), (batch, seqlens_k[0], heads_k, head_dim)
        q = random_tensor(q_shape, dtype, device, generator=gen)
        k = random_tensor(k_shape, dtype, device, generator=gen)
        v = random_tensor(k_shape, dtype, device, generator=gen)
        kwargs = dict(options)
        if alibi:
            kwargs["alibi_slopes"] = (torch.rand(batch, heads, generator=gen) * 0.3).to(device)
        reference_kwargs = dict(kwargs)
        if varlen:
            flash_attn_varlen_func = tk_function("flash_attn_varlen_func")
            cu_q = torch.tensor([0, *itertools.accumulate(seqlens_q)], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, *itertools.accumulate(seqlens_k)], dtype=torch.int32, device=device)
            reference_kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

            def call(q, k, v, **extra):
                return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), **kwargs,
                                              **extra)
        else:
            flash_attn_func = tk_function("flash_attn_func")

            def call(q, k, v, **extra):
                return flash_attn_func(q, k, v, **kwargs, **extra)

        if not backward:
            out, lse, _ = call(q, k, v, return_attn_probs=True)
            ref, ref_lse = reference_attention(q, k, v, compute_dtype=torch.float64, **reference_kwargs)
            low, low_lse = reference_attention(q, k, v, compute_dtype=dtype, **reference_kwargs)
            return _worst([(compare("out", out, ref, low, ratio=OUT_RATIO), OUT_RATIO),
                           (compare("lse", lse, ref_lse, low_lse, ratio=OUT_RATIO), OUT_RATIO)])
        dout = random_tensor(q_shape, dtype, device, generator=gen)
        grads = {}
        for which, leaf_dtype in (("tk", dtype), ("ref", torch.float64), ("low", dtype)):
            leaves = tuple(t.detach().to(leaf_dtype).requires_grad_() for t in (q, k, v))
            if which == "tk":
                out = call(*leaves)
            else:
                out, _ = reference_attention(*leaves, compute_dtype=leaf_dtype, **reference_kwargs)
            grads[which] = torch.autograd.grad(out, leaves, dout.to(leaf_dtype))
        return _worst([(compare(g, *(grads[w][i] for w in ("tk", "ref", "low")), ratio=GRAD_RATIO), GRAD_RATIO)
                       for i, g in enumerate(("dq", "dk", "dv"))])

    return CheckCase(name, run)


def check_cases(device: torch.device) -> list[CheckCase]:
    on_gpu = device.type == "cuda"
    cases: list[CheckCase] = []
    seed = iter(range(1, 10_000))
    bf16, fp16 = torch.bfloat16, torch.float16

    def add(heads, head_dim, seqlens_q, seqlens_k, *, heads_k=None, dtype=bf16, varlen=False, label="",
            **options):
        heads_k = heads_k or heads
        if varlen:
            size = f"varlen-q{'_'.join(map(str, seqlens_q))}-k{'_'.join(map(str, seqlens_k))}"
        else:
            size = f"B{len(seqlens_q)}-Sq{seqlens_q[0]}-Sk{seqlens_k[0]}"
        name = (f"{dtype_name(dtype)}-{size}-H{heads}" + (f"-Hk{heads_k}" if heads_k != heads else "")
                + f"-D{head_dim}" + ("-causal" if options.get("causal") else "") + (f"-{label}" if label else ""))
        for backward in (False, True):
            cases.append(_check_case(f"{name}-{'bwd' if backward else 'fwd'}", device, next(seed), heads=heads,
                                     heads_k=heads_k, head_dim=head_dim, seqlens_q=seqlens_q,
                                     seqlens_k=seqlens_k, dtype=dtype, varlen=varlen, backward=backward,
                                     **options))

    if on_gpu:
        add(8, 128, [1024] * 2, [1024] * 2)
        add(8, 128, [1024] * 2, [1024] * 2, causal=True)
        add(16, 64, [2048] * 4, [2048] * 4)
        add(4, 64, [1000], [1531], causal=True)
        add(4, 64, [1531] * 2, [1000] * 2, causal=True)      # the first 531 rows see no key
        add(4, 96, [1000] * 2, [1000] * 2, causal=True)
        add(4, 256, [1025] * 2, [1025] * 2, causal=True)
        add(4, 256, [777] * 2, [777] * 2, dtype=fp16)
        add(16, 128, [1025] * 2, [1025] * 2, heads_k=4, causal=True, dtype=fp16)
        lens_q, lens_k = [512, 0, 1000, 77, 300], [512, 100, 700, 0, 300]
        add(8, 128, lens_q, lens_k, heads_k=2, varlen=True, causal=True)
        add(8, 128, lens_q, lens_k, heads_k=2, varlen=True)
        add(4, 128, [1500] * 2, [1500] * 2, window_size=(256, 0), label="window256_0")
        add(4, 128, [1024] * 2, [1024] * 2, causal=True, softcap=2.0, label="softcap2")
        add(4, 128, [1024] * 2, [1024] * 2, causal=True, alibi=True, label="alibi")
    else:
        add(2, 40, [37], [53], causal=True)
        add(2, 40, [53] * 2, [37] * 2, causal=True)          # the first 16 rows see no key
        add(2, 64, [64], [64])
        add(4, 32, [45] * 2, [45] * 2, heads_k=2, dtype=fp16)
        # A sequence without queries, one without keys (its rows give 0) and one with more queries
        # than keys under the causal mask; one kv head for all four query heads (MQA).
        add(4, 32, [17, 0, 30, 9], [23, 11, 20, 0], heads_k=1, varlen=True, causal=True)
        add(2, 40, [37], [53], window_size=(8, 4), label="window8_4")
        add(2, 32, [45], [45], causal=True, softcap=2.0, label="softcap2")
        add(2, 32, [45] * 2, [45] * 2, causal=True, alibi=True, label="alibi")
    return cases
