"""Check cases, benchmark cases and the launch-config sweep for ``tk.gemm``.

Providers:

- ``tilekernels``: ``tk.gemm`` with its default launch config (``select_config``), or one given config
  in the sweep.
- ``cublas``: ``torch.matmul`` (fp16/bf16/fp32 with tf32 allowed, as tk.gemm computes fp32),
  ``torch._scaled_mm`` with tensorwise scales for fp8, ``torch._int_mm`` for int8 (int32 out).
- medium rows (``--variants medium``): plain GEMMs of 2-9 waves of tiles, where how full the last wave is
  decides much of the time (``configs.select_plan``'s row tail); the same providers as plain.
- async rows (``--variants async``): ``tk.async_input_mm`` with every chunk signal preset (A split in
  ``ASYNC_CHUNKS`` chunks, pivot 1), against ``tk.gemm`` on the same operands and PyTorch's
  ``torch.ops.symm_mem._async_input_mm`` (CUTLASS, SM90, bf16) with the same signals and pivot: the
  cost of the scheduler itself when nothing has to wait.
- epilogue rows, ``bias[N] -> gelu -> + residual[M, N]``: ``torch`` is ``torch.matmul`` followed by
  eager torch ops (what a model does without fusion), ``torch.compile`` is the same function compiled
  by inductor, which fuses the pointwise tail.

FLOPs are ``2*M*N*K`` for every row (epilogue work is negligible and counted by no provider), so
TFLOP/s compare directly across providers and variants.

The accuracy check before timing compares a sample of the output (the first and last 16 rows and
columns, so the edge tiles, plus 64 random ones of each; every element when the matrix is small)
with ``testing.reference_gemm`` in fp64 under ``testing.compare``'s error-ratio rule, and requires the
whole output to be finite. ``python -m tilekernels check`` compares whole outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from ..testing import compare, poisoned, random_matrix, random_tensor, reference_gemm
from .check import CheckCase
from .harness import (
    OURS,
    Accuracy,
    BenchCase,
    Run,
    UsageError,
    build_inputs,
    device_random,
    dtype_name,
    format_table,
    format_value,
    geomean,
    measure,
    parse_shapes,
    shape_label,
    write_rows,
)

NAME = "gemm"
ANCHOR_PROVIDER = "cublas"

# ANCHORS.md: cuBLAS bf16 GEMM on one H100 (torch.matmul, medians of do_bench, torch 2.11, triton 3.6,
# measured 2026-11-22), TFLOP/s, keyed by (M, N, K).
ANCHOR_CUBLAS_H100_BF16 = {
    (8192, 8192, 8192): 717.0,
    (4096, 4096, 4096): 719.0,
    (16384, 3584, 8192): 688.0,
    (8192, 28672, 8192): 686.0,
    (8192, 8192, 28672): 680.0,
    (2048, 7168, 4096): 654.0,
    (128, 8192, 8192): 288.0,
    (16, 8192, 8192): 37.0,
}

GPU_SHAPES = ["8192x8192x8192", "4096x4096x4096", "16384x3584x8192", "8192x28672x8192", "8192x8192x28672",
              "2048x7168x4096", "16x8192x8192", "64x8192x8192", "128x8192x8192"]
GPU_EPILOGUE_SHAPES = ["8192x8192x8192", "4096x4096x4096"]
GPU_ASYNC_SHAPES = [f"{m}x{n}x8192" for m in (4096, 8192, 16384) for n in (3584, 8192)]
# Medium problems of 2-9 waves of tiles on 132 SMs, some with a part-full last wave (hidden sizes 3072 and 4608,
# and a few squares) and some without (2048x7168x4096 is the anchor).
GPU_MEDIUM_SHAPES = ["3072x3072x4096", "1536x6144x4096", "6144x3072x4096", "4096x4608x4096", "2048x3072x8192",
                     "3000x3000x4096", "5120x5120x4096", "2560x2560x8192", "2048x7168x4096"]
MEDIUM = "plain, medium shapes"
ASYNC_CHUNKS = 2
# Under the interpreter: big enough to span several 32x32 tiles with ragged edges, small enough to run
# in seconds.
INTERPRETER_SHAPES = ["64x48x80", "16x48x80"]
INTERPRETER_EPILOGUE_SHAPES = ["64x48x80"]
INTERPRETER_ASYNC_SHAPES = ["64x48x80"]
INTERPRETER_MEDIUM_SHAPES = ["80x48x40"]

LAYOUTS = ("RR", "RC", "CR", "CC")
EPILOGUE = "bias+gelu+residual"
ASYNC = "async-input (signals preset)"
SAMPLE_EDGE = 16
SAMPLE_RANDOM = 64


def _tk_gemm():
    import tilekernels

    fn = getattr(tilekernels, "gemm", None)
    if not callable(fn):
        raise RuntimeError("tilekernels.gemm is not available as a function (tilekernels/__init__.py does "
                           "not export it)")
    return fn


def anchor(row: dict):
    """The ANCHORS.md cuBLAS figure for a plain bf16 GEMM row on a GPU, if its shape has one."""
    if row.get("interpreter") or row["variant"] != "plain" or row["dtype"] != "bf16":
        return None
    shape = row["shape"]
    value = ANCHOR_CUBLAS_H100_BF16.get((shape["M"], shape["N"], shape["K"]))
    return None if value is None else ("H100 cuBLAS anchor", value)


# ----------------------------------------------------------------------------------------------------
# inputs


def _matrix(rows: int, cols: int, dtype, device, column_major: bool, seed: int) -> torch.Tensor:
    if column_major:
        return device_random((cols, rows), dtype, device, seed).t()
    return device_random((rows, cols), dtype, device, seed)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.int8:
        return torch.int32  # compared with torch._int_mm, which returns the exact int32 product
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def _sample(n: int, device: torch.device, seed: int) -> torch.Tensor:
    if n <= 2 * SAMPLE_EDGE + SAMPLE_RANDOM:
        return torch.arange(n, device=device)
    gen = torch.Generator().manual_seed(seed)
    middle = torch.randperm(n - 2 * SAMPLE_EDGE, generator=gen)[:SAMPLE_RANDOM] + SAMPLE_EDGE
    picked = torch.cat([torch.arange(SAMPLE_EDGE), middle, torch.arange(n - SAMPLE_EDGE, n)])
    return picked.sort().values.to(device)


def _make_check(M: int, N: int, activation: str | None, out_dtype: torch.dtype, device: torch.device):
    """``check(inputs, out, provider)`` for one case; the reference is computed once per input set."""
    cache: dict[int, tuple] = {}

    def check(inputs: dict, out: torch.Tensor, provider: str) -> Accuracy:
        if tuple(out.shape) != (M, N):
            return Accuracy(False, math.inf, f"output shape {tuple(out.shape)}, expected {(M, N)}")
        key = id(inputs)
        if key not in cache:
            rows, cols = _sample(M, device, 1), _sample(N, device, 2)
            sub = {"a": inputs["a"][rows], "b": inputs["b"][:, cols], "activation": activation,
                   "out_dtype": out_dtype}
            if "bias" in inputs:
                sub["bias"] = inputs["bias"][cols]
            if "residual" in inputs:
                sub["residual"] = inputs["residual"][rows][:, cols]
            for name in ("scale_a", "scale_b"):
                if name in inputs:
                    sub[name] = inputs[name]
            ref = reference_gemm(**sub, compute_dtype=torch.float64)
            low = reference_gemm(**sub, compute_dtype=None)
            cache.clear()
            cache[key] = (rows, cols, ref, low)
        rows, cols, ref, low = cache[key]
        nonfinite = int((~torch.isfinite(out)).sum()) if out.is_floating_point() else 0
        result = compare(provider, out[rows][:, cols], ref, low)
        detail = str(result)
        if nonfinite:
            detail += f"; {nonfinite} non-finite elements in the whole output"
        return Accuracy(result.passed and nonfinite == 0, result.ratio, detail)

    return check


# ----------------------------------------------------------------------------------------------------
# providers


def _torch_epilogue(a, b, bias, residual):
    """The unfused baseline: what model code writes for Linear + bias -> GELU -> + residual."""
    return F.gelu(torch.matmul(a, b) + bias) + residual


_compiled_epilogue = None


def _compiled():
    global _compiled_epilogue
    if _compiled_epilogue is None:
        # dynamic=False: each shape gets its own static-shape kernel, as a benchmark of one shape should.
        _compiled_epilogue = torch.compile(_torch_epilogue, dynamic=False)
    return _compiled_epilogue


def _allow_tf32(dtype: torch.dtype) -> None:
    """The fp32 bench measures the tf32 tensor-core path: tk.gemm follows torch's float32 matmul
    precision like torch.matmul does, so switching it on (process-wide) compares like with like."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        print("fp32: torch.backends.cuda.matmul.allow_tf32 = True for the torch baselines "
              "and tk.gemm alike", flush=True)


def _cublas_matmul(x: dict) -> torch.Tensor:
    return torch.matmul(x["a"], x["b"])


def _cublas_scaled_mm(x: dict) -> torch.Tensor:
    return torch._scaled_mm(x["a"], x["b"], scale_a=x["scale_a"], scale_b=x["scale_b"],
                            out_dtype=torch.bfloat16)


def _cublas_int_mm(x: dict) -> torch.Tensor:
    return torch._int_mm(x["a"], x["b"])


def _tk_plain(split_k, config=None):
    gemm = _tk_gemm()

    def run(x: dict) -> torch.Tensor:
        kwargs = {k: x[k] for k in ("scale_a", "scale_b") if k in x}
        if x["a"].dtype == torch.int8:
            kwargs["out_dtype"] = torch.int32
        return gemm(x["a"], x["b"], split_k=split_k, config=config, **kwargs)

    return run


def _tk_epilogue(split_k):
    gemm = _tk_gemm()

    def run(x: dict) -> torch.Tensor:
        return gemm(x["a"], x["b"], bias=x["bias"], activation="gelu", residual=x["residual"],
                    split_k=split_k)

    return run


def _tk_async(x: dict) -> torch.Tensor:
    import tilekernels

    return tilekernels.async_input_mm(x["a"], x["b"], x["signals"], 1)


def _torch_async(x: dict) -> torch.Tensor:
    return torch.ops.symm_mem._async_input_mm(x["a"], x["b"], x["signals"], 1)


def _default_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device, split_k,
                    async_input: bool = False, heavy_epilogue: bool = False) -> str:
    from ..gemm.configs import describe_plan, select_config, select_plan

    if split_k != 1:
        text = select_config(M, N, K, dtype, device, async_input, heavy_epilogue).describe()
    else:
        # (an async tail's rows are the last in the pivoted order, not the last of A)
        text = describe_plan(*select_plan(M, N, K, dtype, device, heavy_epilogue, async_input))
    return text if split_k == 1 else f"{text} split_k={split_k}"


# ----------------------------------------------------------------------------------------------------
# benchmark cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", default="RR", choices=LAYOUTS,
                        help="A and B storage: R row-major, C column-major (a transposed view); default RR")
    parser.add_argument("--variants", default="plain,epilogue",
                        help=f"plain, medium ({MEDIUM}), epilogue ({EPILOGUE}) and/or async ({ASYNC}); "
                        "default plain,epilogue")
    parser.add_argument("--split-k", default="1",
                        help="tk.gemm split_k: one value for bench (1, N or auto), a comma list for --sweep")
    parser.add_argument("--no-prune", action="store_true",
                        help="sweep: also try configs whose BLOCK_M is far larger than M")


def _case(shape: dict, dtype: torch.dtype, layout: str, device: torch.device, seed: int, epilogue: bool,
          split_k, wanted: set[str] | None, async_input: bool = False, variant: str = "") -> BenchCase:
    M, N, K = shape["M"], shape["N"], shape["K"]
    out_dtype = _out_dtype(dtype)
    itemsize, out_size = dtype.itemsize, out_dtype.itemsize
    set_bytes = (M * K + K * N) * itemsize + M * N * out_size
    if epilogue:
        set_bytes += (N + M * N) * out_size

    def make_inputs(i: int) -> dict:
        base = 1000 * seed + 10 * i
        x = {"a": _matrix(M, K, dtype, device, layout[0] == "C", base),
             "b": _matrix(K, N, dtype, device, layout[1] == "C", base + 1)}
        if epilogue:
            x["bias"] = device_random((N,), out_dtype, device, base + 2)
            x["residual"] = device_random((M, N), out_dtype, device, base + 3)
        if async_input:
            x["signals"] = torch.ones(ASYNC_CHUNKS, dtype=torch.uint32, device=device)
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # Tensorwise dequantisation scales, as torch._scaled_mm takes them.
            x["scale_a"] = torch.tensor(0.75, device=device)
            x["scale_b"] = torch.tensor(1.25, device=device)
        return x

    if async_input:
        providers = {OURS: _tk_async, "tk.gemm": _tk_plain(1)}
        if device.type == "cuda":
            providers["torch _async_input_mm"] = _torch_async
    elif epilogue:
        providers = {OURS: _tk_epilogue(split_k), "torch": _torch_epilogue_provider,
                     "torch.compile": _compiled_provider}
    elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        providers = {OURS: _tk_plain(split_k), "cublas": _cublas_scaled_mm}
    elif dtype == torch.int8:
        providers = {OURS: _tk_plain(split_k), "cublas": _cublas_int_mm}
    else:
        providers = {OURS: _tk_plain(split_k), "cublas": _cublas_matmul}
    if wanted is not None:
        providers = {k: v for k, v in providers.items() if k in wanted}
    return BenchCase(
        op=NAME, shape=dict(shape), dtype=dtype,
        variant=variant or (ASYNC if async_input else EPILOGUE if epilogue else "plain"),
        layout=layout,
        flops=2.0 * M * N * K, set_bytes=set_bytes, make_inputs=make_inputs, providers=providers,
        check=_make_check(M, N, "gelu" if epilogue else None, out_dtype, device),
        configs={OURS: _default_config(M, N, K, dtype, device, split_k, async_input, epilogue)},
    )


def _torch_epilogue_provider(x: dict) -> torch.Tensor:
    return _torch_epilogue(x["a"], x["b"], x["bias"], x["residual"])


def _compiled_provider(x: dict) -> torch.Tensor:
    return _compiled()(x["a"], x["b"], x["bias"], x["residual"])


def _parse_split_k(text: str):
    values = []
    for item in str(text).split(","):
        item = item.strip()
        if item == "auto":
            values.append("auto")
        elif item.isdigit() and int(item) >= 1:
            values.append(int(item))
        elif item:
            raise UsageError(f"--split-k: {item!r} is neither a positive integer nor 'auto'")
    return values or [1]


def bench_cases(opts: argparse.Namespace, device: torch.device) -> list[BenchCase]:
    interpreter = device.type != "cuda"
    variants = {v.strip() for v in opts.variants.split(",") if v.strip()}
    unknown = variants - {"plain", "epilogue", "async", "medium"}
    if unknown:
        raise UsageError(f"--variants: unknown {sorted(unknown)}; choose from plain, epilogue, async, medium")
    split_k = _parse_split_k(opts.split_k)
    if len(split_k) != 1:
        raise UsageError("--split-k: bench takes one value (a list is for --sweep)")
    split_k = split_k[0]
    wanted = {p.strip() for p in opts.providers.split(",")} if opts.providers else None
    if wanted is None and interpreter:
        wanted = {OURS, "cublas", "torch"}
        print("torch.compile provider skipped on the CPU interpreter (inductor's CPU compile takes ~20 s and "
              "its timing would mean nothing); ask for it with --providers", flush=True)
    if opts.shapes:
        shapes = epilogue_shapes = async_shapes = medium_shapes = parse_shapes(opts.shapes)
    else:
        shapes = parse_shapes(",".join(INTERPRETER_SHAPES if interpreter else GPU_SHAPES))
        epilogue_shapes = parse_shapes(",".join(INTERPRETER_EPILOGUE_SHAPES if interpreter
                                                else GPU_EPILOGUE_SHAPES))
        async_shapes = parse_shapes(",".join(INTERPRETER_ASYNC_SHAPES if interpreter else GPU_ASYNC_SHAPES))
        medium_shapes = parse_shapes(",".join(INTERPRETER_MEDIUM_SHAPES if interpreter else GPU_MEDIUM_SHAPES))
    dtype = opts.dtype
    _allow_tf32(dtype)
    if "epilogue" in variants and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        print(f"epilogue rows skipped for {dtype_name(dtype)} (the torch baselines are defined for "
              f"fp16/bf16/fp32)", flush=True)
        variants.discard("epilogue")
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and opts.layout != "RC":
        print("fp8: torch._scaled_mm needs B column-major; use --layout RC for a cuBLAS baseline", flush=True)
    cases = []
    if "plain" in variants:
        cases += [_case(s, dtype, opts.layout, device, opts.seed, False, split_k, wanted) for s in shapes]
    if "medium" in variants:
        cases += [_case(s, dtype, opts.layout, device, opts.seed, False, split_k, wanted, variant=MEDIUM)
                  for s in medium_shapes]
    if "epilogue" in variants:
        cases += [_case(s, dtype, opts.layout, device, opts.seed, True, split_k, wanted)
                  for s in epilogue_shapes]
    if "async" in variants:
        keep = None if wanted is None else wanted | {"tk.gemm", "torch _async_input_mm"}
        cases += [_case(s, dtype, opts.layout, device, opts.seed, False, 1, keep, async_input=True)
                  for s in async_shapes]
    return cases


# ----------------------------------------------------------------------------------------------------
# sweep


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cuda_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def sweep(opts: argparse.Namespace, device: torch.device, run: Run) -> str:
    """Time every ``candidate_configs`` config (x each ``--split-k``) per shape; returns the report.

    Configs that raise (compile errors, out of resources) are noted and skipped; a config whose output
    fails the accuracy check is a failure. New configs stop starting once ``--budget-s`` has passed
    and the untried ones are listed.
    """
    from ..gemm.configs import candidate_configs, select_config, shape_class

    start = time.monotonic()
    deadline = start + opts.budget_s
    interpreter = device.type != "cuda"
    dtype, layout = opts.dtype, opts.layout
    shapes = parse_shapes(opts.shapes or ",".join(INTERPRETER_SHAPES if interpreter else GPU_SHAPES))
    split_ks = _parse_split_k(opts.split_k)
    configs = candidate_configs(dtype, device)
    gemm = _tk_gemm()
    _allow_tf32(dtype)
    print(f"sweep: {len(configs)} candidate configs x split_k {split_ks} on {len(shapes)} shape(s); "
          f"budget {opts.budget_s:g} s; '(n) default' is select_config's choice and the rank it would take",
          flush=True)
    blocks, untried = [], []
    measured: dict[str, dict[str, float]] = {}   # shape -> config -> ours/cublas
    for shape in shapes:
        M, N, K = shape["M"], shape["N"], shape["K"]
        label = shape_label(shape)
        if time.monotonic() > deadline:
            untried.append(f"{label}: all configs")
            continue
        case = _case(shape, dtype, layout, device, opts.seed, False, 1, None)
        sets = build_inputs(case, run)
        if sets is None:
            continue
        baseline_provider = next(p for p in case.providers if p != OURS)
        base = measure(case, baseline_provider, case.providers[baseline_provider], sets, run, opts.warmup,
                       opts.rep)
        default_cfg = select_config(M, N, K, dtype, device)
        default = measure(case, OURS, case.providers[OURS], sets, run, opts.warmup, opts.rep,
                          config=f"default {default_cfg.describe()}")
        rows = []
        pruned = 0
        for cfg in configs:
            if not opts.no_prune and cfg.block_m > max(64, _next_pow2(M)):
                pruned += 1  # tiles that are mostly padding rows cannot win on this M
                continue
            for sk in split_ks:
                name = cfg.describe() + f" sk{sk}"
                if time.monotonic() > deadline:
                    untried.append(f"{label}: {name}")
                    continue

                def fn(x, cfg=cfg, sk=sk):
                    kwargs = {k: x[k] for k in ("scale_a", "scale_b") if k in x}
                    if dtype == torch.int8:
                        kwargs["out_dtype"] = torch.int32
                    return gemm(x["a"], x["b"], config=cfg, split_k=sk, **kwargs)

                row = measure(case, OURS, fn, sets, run, opts.warmup, opts.rep, config=name,
                              failures_are_notes=True)
                if row is None:
                    if not _cuda_alive(device):
                        run.fail(f"sweep {label} {name}", "the CUDA context is lost (illegal access?); "
                                                          "sweep stopped")
                        del sets
                        return "\n\n".join(blocks)
                    continue
                row["config_fields"] = {**dataclasses.asdict(cfg), "split_k": sk}
                row["shape_class"] = shape_class(M, N, K)
                rows.append(row)
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.sort(key=lambda r: -r["p50"])
        base_p50 = base["p50"] if base else None
        measured[label] = {r["config"]: r["p50"] / base_p50 for r in rows if base_p50}
        body = []
        for rank, r in enumerate(rows[:opts.top], 1):
            body.append([str(rank), r["config"], format_value(r["p50"]),
                         f"{r['p50'] / base_p50:.3f}" if base_p50 else "-",
                         f"{format_value(r['p20'])}-{format_value(r['p80'])}"])
        if default is not None:
            rank = 1 + sum(r["p50"] > default["p50"] for r in rows)
            body.append([f"({rank})", default["config"], format_value(default["p50"]),
                         f"{default['p50'] / base_p50:.3f}" if base_p50 else "-",
                         f"{format_value(default['p20'])}-{format_value(default['p80'])}"])
        text = (f"{label} ({shape_class(M, N, K)}) {dtype_name(dtype)} {layout}: {baseline_provider} "
                f"{format_value(base_p50) if base_p50 else 'failed'} TFLOP/s; {len(rows)} configs timed"
                + (f", {pruned} pruned (BLOCK_M >> M)" if pruned else "") + "\n")
        text += format_table(["rank", "config", "TFLOP/s", f"ours/{baseline_provider}", "p20-p80"], body,
                             left=2)
        print("\n" + text, flush=True)
        blocks.append(text)
        if opts.out is not None:
            write_rows(opts.out / f"{NAME}-sweep.json", run.rows)  # partial results survive a kill
    tail = [_class_summary(shapes, measured, dtype, device)]
    if untried:
        tail.append(f"budget of {opts.budget_s:g} s exhausted; {len(untried)} untried (restrict --shapes "
                    f"or raise --budget-s):\n" + "\n".join(f"  {u}" for u in untried[:40])
                    + (f"\n  ... and {len(untried) - 40} more" if len(untried) > 40 else ""))
    tail = [t for t in tail if t]
    if tail:
        print("\n" + "\n\n".join(tail), flush=True)
    return "\n\n".join(blocks + tail)


def _class_summary(shapes: list[dict], measured: dict[str, dict[str, float]], dtype, device) -> str:
    """Per shape class (configs.shape_class): the config with the best geomean ratio over its shapes,
    beside what select_config picks today, so TUNED tables can be updated from data."""
    from ..gemm.configs import select_config, shape_class

    classes: dict[str, list[dict]] = {}
    for s in shapes:
        if shape_label(s) in measured and measured[shape_label(s)]:
            classes.setdefault(shape_class(s["M"], s["N"], s["K"]), []).append(s)
    body = []
    for cls, members in classes.items():
        labels = [shape_label(s) for s in members]
        common = set.intersection(*(set(measured[lb]) for lb in labels))
        if not common:
            continue
        best = max(common, key=lambda c: geomean(measured[lb][c] for lb in labels))
        s0 = members[0]
        current = select_config(s0["M"], s0["N"], s0["K"], dtype, device).describe()
        score = geomean(measured[lb][best] for lb in labels)
        body.append([cls, ", ".join(labels), best, current, f"{score:.3f}"])
    if not body:
        return ""
    return ("best config per shape class (geomean of ours/baseline over the class's shapes):\n"
            + format_table(["class", "shapes", "best config", "select_config today", "geomean"], body,
                           left=4))


# ----------------------------------------------------------------------------------------------------
# check cases


def _check_case(name: str, M: int, N: int, K: int, dtype: torch.dtype, layout: str, device: torch.device,
                seed: int, *, bias: str | None = None, activation: str | None = None, residual: bool = False,
                n_mul: int = 0, alpha: float = 1.0, beta: float = 1.0, scales: str | None = None,
                out_dtype: torch.dtype | None = None, out_layout: str | None = None, split_k=1,
                config=None) -> CheckCase:
    """One full-output comparison of tk.gemm with reference_gemm (fp64) under the error-ratio rule."""

    def run():
        gemm = _tk_gemm()
        gen = torch.Generator().manual_seed(seed)
        final_dtype = out_dtype or (dtype if dtype in (torch.float16, torch.bfloat16, torch.float32)
                                    else torch.bfloat16)
        epi_dtype = final_dtype if final_dtype.is_floating_point else torch.float32
        a = random_matrix(M, K, dtype, device, column_major=layout[0] == "C", generator=gen)
        b = random_matrix(K, N, dtype, device, column_major=layout[1] == "C", generator=gen)
        kwargs: dict = {"activation": activation, "alpha": alpha, "beta": beta}
        if bias == "row":
            kwargs["bias"] = random_tensor((N,), epi_dtype, device, generator=gen)
        elif bias == "col":
            kwargs["bias"] = random_tensor((M, 1), epi_dtype, device, generator=gen)
        if residual:
            kwargs["residual"] = random_matrix(M, N, epi_dtype, device, generator=gen)
        kwargs["mul"] = tuple(random_matrix(M, N, epi_dtype, device, generator=gen) for _ in range(n_mul))
        if scales == "vector":
            kwargs["scale_a"] = random_tensor((M,), torch.float32, device, generator=gen).abs() + 0.25
            kwargs["scale_b"] = random_tensor((N,), torch.float32, device, generator=gen).abs() + 0.25
        elif scales == "scalar":
            kwargs["scale_a"], kwargs["scale_b"] = 0.5, 1.5
        out = None
        if out_layout is not None:
            # A column-major out (a transposed view) checks that any output strides are honoured.
            out = (poisoned((N, M), final_dtype, device).t() if out_layout == "C"
                   else poisoned((M, N), final_dtype, device))
        result = gemm(a, b, out_dtype=out_dtype, out=out, split_k=split_k, config=config, **kwargs)
        if out is not None and result.data_ptr() != out.data_ptr():
            raise AssertionError("tk.gemm(out=...) returned a tensor other than out")
        ref = reference_gemm(a, b, out_dtype=final_dtype, compute_dtype=torch.float64, **kwargs)
        low = reference_gemm(a, b, out_dtype=final_dtype, compute_dtype=None, **kwargs)
        return compare(name, result, ref, low)

    return CheckCase(name, run)


def check_cases(device: torch.device) -> list[CheckCase]:
    from ..gemm.configs import candidate_configs, select_config

    on_gpu = device.type == "cuda"
    cases: list[CheckCase] = []
    seed = iter(range(1, 10_000))

    def add(name, M, N, K, dtype, layout, **kw):
        full = f"{dtype_name(dtype)}-{layout}-{M}x{N}x{K}" + (f"-{name}" if name else "")
        cases.append(_check_case(full, M, N, K, dtype, layout, device, next(seed), **kw))

    # Every dtype x layout, at a tile-aligned and a ragged shape (ragged leading dimensions also take
    # the non-TMA path on a GPU, since TMA needs 16-byte aligned strides).
    shapes = [(2048, 1024, 1536), (1031, 517, 1029)] if on_gpu else [(37, 29, 45), (70, 90, 100)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for layout in LAYOUTS:
            for M, N, K in shapes:
                add("", M, N, K, dtype, layout)

    # Epilogues, each stage alone and together, in bf16 with B column-major (nn.Linear's weight layout)
    # and one fp16 row-major repeat of the full chain.
    M, N, K = (1024, 768, 1536) if on_gpu else (33, 40, 70)
    bf16, fp16 = torch.bfloat16, torch.float16
    add("bias", M, N, K, bf16, "RC", bias="row")
    add("colbias", M, N, K, bf16, "RC", bias="col")
    for act in ("relu", "gelu", "gelu_tanh", "silu"):
        add(f"bias+{act}", M, N, K, bf16, "RC", bias="row", activation=act)
    add("bias+gelu+residual", M, N, K, bf16, "RC", bias="row", activation="gelu", residual=True)
    add("bias+gelu+residual", M, N, K, fp16, "RR", bias="row", activation="gelu", residual=True)
    add("silu*mul2", M, N, K, bf16, "RC", activation="silu", n_mul=2)
    add("alpha0.5+beta2res", M, N, K, bf16, "RC", alpha=0.5, beta=2.0, residual=True)
    add("out_fp32", M, N, K, bf16, "RC", bias="row", out_dtype=torch.float32)
    add("out=colmajor", M, N, K, bf16, "RC", bias="row", residual=True, out_layout="C")
    add("split_k2+bias+res", M, N, K, bf16, "RC", bias="row", residual=True, split_k=2)
    # Skinny problems: M = 1 and a decode-sized M, where split-K matters.
    skinny_nk = (1024, 4096) if on_gpu else (40, 150)
    add("", 1, *skinny_nk, bf16, "RC")
    add("split_k_auto", 16, *skinny_nk, bf16, "RC", split_k="auto")
    if on_gpu:
        add("split_k4", 64, 1024, 4096, bf16, "RC", bias="row", split_k=4)
    # A launch config other than the default, through config= (what the sweep relies on).
    default = select_config(M, N, K, bf16, device)
    others = [c for c in candidate_configs(bf16, device) if c != default]
    if others:
        pick = next((c for c in others if not c.use_tma), others[0])
        add(f"config={pick.describe().replace(' ', '_')}", M, N, K, bf16, "RR", bias="row", config=pick)
    # int8 everywhere (an integer dot runs under the interpreter too); fp8 on GPUs that have it.
    add("int8_scales", M, N, K, torch.int8, "RC", scales="vector")
    add("int8_int32out", M, N, K, torch.int8, "RC", out_dtype=torch.int32)
    if on_gpu and torch.cuda.get_device_capability(device) >= (8, 9):
        add("scales", M, N, K, torch.float8_e4m3fn, "RC", scales="vector", bias="row")
        add("scalar_scales", M, N, K, torch.float8_e5m2, "RC", scales="scalar")
    return cases
