"""The flash_attn benchmark module on the CPU: shape parsing, FLOPs, anchors, the accuracy check and the
backward timing method, driven through torch's CPU flash SDPA kernel (no tilekernels kernel needed),
and the commands end to end once ``tk.flash_attn_func`` exists. Rows built by ``_row`` are synthetic
fixtures for the formatting code, not measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tilekernels.bench import attention, harness, load_op

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(__import__(module, fromlist=[name]), name)
    except ImportError:
        return False


needs_reference = pytest.mark.skipif(not _has("tilekernels.attention.reference", "reference_attention"),
                                     reason="tilekernels.attention.reference is not there yet")
needs_kernels = pytest.mark.skipif(not _has("tilekernels", "flash_attn_func"),
                                   reason="tilekernels.flash_attn_func is not exported yet")


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "tilekernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _row(provider, B, H, S, D, mask, p50, *, variant="fwd", gpu="NVIDIA H100 80GB HBM3"):
    return {"op": "flash_attn", "provider": provider, "shape": {"B": B, "H": H, "S": S, "D": D, "mask": mask},
            "dtype": "bf16", "layout": "BSHD", "variant": variant, "metric": "tflops", "p20": p50 * 0.98,
            "p50": p50, "p80": p50 * 1.01, "ms": 1.0, "config": "", "accuracy_ratio": 1.0, "mode": "bench",
            "run_id": "r1", "date": "2026-11-22T00:00:00+00:00", "gpu": gpu, "torch": "2.11.0",
            "triton": "3.6.0", "tilekernels": "0.1.0", "python": "3.12", "commit": None, "interpreter": False}


def _opts(**kw) -> argparse.Namespace:
    base = {"shapes": "1x2x64x32", "dtype": torch.bfloat16, "providers": "flash", "passes": "fwd,bwd",
            "causal": "both", "seed": 0, "cuda_graph": False}
    return argparse.Namespace(**{**base, **kw})


def test_registered():
    assert load_op("flash_attn") is attention and attention.NAME == "flash_attn"


def test_parse_shapes_masks_and_errors():
    full = {"B": 4, "H": 16, "S": 4096, "D": 128, "mask": "full"}
    causal = dict(full, mask="causal")
    assert attention.parse_attention_shapes("4x16x4096x128") == [full, causal]
    assert attention.parse_attention_shapes("4x16x4096x128", "yes") == [causal]
    assert attention.parse_attention_shapes("4X16×4096x128xfull,4x16x4096x128xcausal", "no") == [full, causal]
    # a row's shape label parses back to the same shape
    assert attention.parse_attention_shapes(harness.shape_label(causal)) == [causal]
    for bad in ("4x16x4096", "4x16x4096x128xsliding", "0x16x4096x128", ""):
        with pytest.raises(harness.UsageError):
            attention.parse_attention_shapes(bad)
    with pytest.raises(harness.UsageError):
        attention.parse_attention_shapes("1x2x64x32", "maybe")


def test_flops_and_anchor():
    shape = {"B": 4, "H": 16, "S": 4096, "D": 128, "mask": "full"}
    assert attention.flops(shape, "fwd") == 4 * 4 * 16 * 4096**2 * 128
    assert attention.flops(dict(shape, mask="causal"), "fwd") == 2 * 4 * 16 * 4096**2 * 128
    assert attention.flops(shape, "bwd") == 2.5 * attention.flops(shape, "fwd")
    assert attention.anchor(_row("cudnn", 4, 16, 4096, 128, "full", 1.0)) == ("H100 cuDNN anchor", 604.0)
    assert attention.anchor(_row("cudnn", 4, 16, 4096, 128, "causal", 1.0, variant="bwd"))[1] == 471.0
    assert attention.anchor(_row("cudnn", 4, 16, 4096, 256, "causal", 1.0)) is None  # not in ANCHORS.md
    assert attention.anchor(dict(_row("cudnn", 4, 16, 4096, 128, "full", 1.0), interpreter=True)) is None


def test_report_geomeans_against_cudnn_and_flash():
    rows = []
    for mask, ours, cudnn, flash in (("full", 604.0, 604.0, 302.0), ("causal", 271.5, 543.0, 271.5)):
        rows += [_row("tilekernels", 4, 16, 4096, 128, mask, ours), _row("cudnn", 4, 16, 4096, 128, mask, cudnn),
                 _row("flash", 4, 16, 4096, 128, mask, flash)]
    text = harness.report(rows, attention)
    assert "ours/cudnn" in text and "ours/flash" in text and "H100 cuDNN anchor" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("4x16x4096x128xcausal"))
    assert "0.500" in line and "1.000" in line and "543" in line
    assert f"ours/cudnn: geomean {math.sqrt(0.5):.3f} over 2 anchor shape(s)" in text
    assert f"ours/flash: geomean {math.sqrt(2.0):.3f} over 2 anchor shape(s)" in text


def test_bench_cases_options():
    cases = attention.bench_cases(_opts(), CPU)
    assert [(c.variant, c.shape["mask"]) for c in cases] == [("fwd", "full"), ("fwd", "causal"),
                                                              ("bwd", "full"), ("bwd", "causal")]
    assert all(list(c.providers) == ["flash"] and c.layout == "BSHD" for c in cases)
    graph = attention.bench_cases(_opts(cuda_graph=True, causal="yes"), CPU)
    assert [(c.variant, c.shape["mask"]) for c in graph] == [("fwd", "causal")]
    default = attention.bench_cases(_opts(shapes=None, providers=None, passes="fwd"), CPU)
    assert list(default[0].providers) == list(attention.CPU_PROVIDERS)
    for bad in ({"passes": "fwd,sideways"}, {"providers": "flash,triton"}, {"dtype": torch.float32}):
        with pytest.raises(harness.UsageError):
            attention.bench_cases(_opts(**bad), CPU)


@needs_reference
@pytest.mark.parametrize("passes", ["fwd", "bwd"])
def test_run_case_checks_then_times_and_rejects_a_wrong_provider(passes):
    (case,) = attention.bench_cases(_opts(shapes="2x3x40x32xcausal", passes=passes), CPU)
    flash = case.providers["flash"]

    def off_by_a_little(x):
        out = flash(x)
        if passes == "bwd":
            out = tuple(t.clone() for t in out)
            out[1][1, 39, 2, 5] += 1.0     # dk, last sequence, last head, last key: a sampled pair
        else:
            out = out.clone()
            out[1, 39, 2, 5] += 1.0
        return out

    case.providers = {"flash": flash, "wrong": off_by_a_little}
    run = harness.Run("flash_attn", CPU, "bench")
    harness.run_case(case, run, warmup=1, rep=1)
    assert [r["provider"] for r in run.rows] == ["flash"]
    assert run.rows[0]["variant"] == passes and run.rows[0]["accuracy_ratio"] <= (3 if passes == "bwd" else 2)
    assert len(run.failures) == 1 and "accuracy check failed, not timed" in run.failures[0]
    assert ("dk" if passes == "bwd" else "out") in run.failures[0]


def test_backward_provider_keeps_one_graph_per_set_and_drops_other_providers():
    calls = []

    def forward(q, k, v):
        calls.append(1)
        return (q * k + v).sum(-1, keepdim=True).expand_as(q)

    (case,) = attention.bench_cases(_opts(shapes="1x2x8x4xfull", passes="bwd"), CPU)
    x = case.make_inputs(0)
    first = attention._backward_provider("a", forward)
    second = attention._backward_provider("b", forward)
    dq, _, _ = first(x)
    first(x)
    assert len(calls) == 1 and "graph:a" in x                    # the forward ran once, outside the timing
    torch.testing.assert_close(dq, (x["dout"].float().sum(-1, keepdim=True) * x["k"].float()).to(dq.dtype))
    assert x["q"].grad is None and not x["q"].requires_grad        # nothing accumulates, inputs untouched
    second(x)
    assert "graph:a" not in x and "graph:b" in x and len(calls) == 2


def test_check_case_names():
    names = [c.name for c in attention.check_cases(CPU)]
    assert len(names) == len(set(names))
    assert "bf16-B1-Sq37-Sk53-H2-D40-causal-fwd" in names and "bf16-B1-Sq37-Sk53-H2-D40-causal-bwd" in names
    assert any(n.startswith("bf16-varlen-q17_0_30_9-k23_11_20_0-H4-Hk1") for n in names)


@needs_kernels
def test_check_flash_attn_command():
    result = _cli("check", "--op", "flash_attn", "--filter", "bf16-B1-Sq37-Sk53-H2-D40-causal-*")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 0 failed" in result.stdout


@needs_kernels
def test_bench_flash_attn_command(tmp_path):
    result = _cli("bench", "flash_attn", "--shapes", "1x2x48x32xcausal", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "flash_attn.json").read_text())
    assert {(r["variant"], r["provider"]) for r in rows} == {(v, p) for v in ("fwd", "bwd")
                                                             for p in attention.CPU_PROVIDERS}
    assert "ours/flash" in (tmp_path / "flash_attn.txt").read_text()
