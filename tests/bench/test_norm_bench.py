"""The norms/quantisation benchmark module on the CPU: shape parsing, the bytes each op must move, the
rules for quantised outputs, the copy-fraction rows and goals tables, the accuracy check (driven through
the eager provider, which needs no tilekernels kernel), and the commands end to end under the
interpreter. Rows built by ``_row`` are synthetic fixtures for the formatting code, not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tilekernels.bench import harness, load_op, norm, results

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
H100 = "NVIDIA H100 80GB HBM3"
OPS = ("layer_norm", "rms_norm", "add_rms_norm_quant", "dynamic_quant", "smooth_quant", "moe_smooth_quant")


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(__import__(module, fromlist=[name]), name)
    except ImportError:
        return False


needs_kernels = pytest.mark.skipif(not all(_has("tilekernels", op) for op in OPS),
                                   reason="tilekernels' norm and quant ops are not exported yet")


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "tilekernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _opts(**kw) -> argparse.Namespace:
    base = {"shapes": None, "dtype": torch.bfloat16, "providers": "tilekernels,eager", "passes": "fwd,bwd",
            "quant_dtype": "int8", "moe_topk": 2, "moe_experts": 8, "seed": 0, "warmup": 1.0, "rep": 1.0,
            "cuda_graph": False}
    return argparse.Namespace(**{**base, **kw})


def _row(provider, shape, ms, *, op="layer_norm", variant="fwd", layout="weight+bias", copy_tbps=3.0,
         interpreter=False):
    nbytes = 2 * shape["M"] * shape["N"] * 2
    tbps = nbytes / (ms * 1e-3) / 1e12
    return {"op": op, "provider": provider, "shape": shape, "dtype": "bf16", "layout": layout, "variant": variant,
            "metric": "tbps", "p20": tbps * 0.98, "p50": tbps, "p80": tbps * 1.01, "ms": ms, "config": "",
            "accuracy_ratio": 1.0, "mode": "bench", "timing": "eager", "run_id": "r1",
            "date": "2026-11-22T00:00:00+00:00", "gpu": "cpu-interpreter" if interpreter else H100,
            "torch": "2.11.0", "triton": "3.6.0", "tilekernels": "0.1.0", "python": "3.12", "commit": None,
            "interpreter": interpreter, "bytes_moved": nbytes, "copy_tbps": copy_tbps,
            "copy_fraction": tbps / copy_tbps}


def _rows(times: dict[tuple[int, int], tuple[float, float, float]], **kw) -> list[dict]:
    """(M, N) -> (ours, eager, compile) milliseconds."""
    return [_row(p, {"M": M, "N": N}, ms, **kw) for (M, N), per in times.items()
            for p, ms in zip(("tilekernels", "eager", "compile"), per)]


# ----------------------------------------------------------------------------------------------------
# registration, shapes, bytes


def test_registered():
    for op in OPS:
        module = load_op(op)
        assert module.NAME == op and module.METRIC == "tbps" and module.FLOPS_FORMULA.startswith("bytes moved")
    assert load_op("layer_norm") is norm.LAYER_NORM and load_op("moe_smooth_quant") is norm.MOE_SMOOTH_QUANT


def test_parse_shapes_and_errors():
    assert norm.parse_norm_shapes("32768x4096, 3X1000", "layer_norm") == [{"M": 32768, "N": 4096}, {"M": 3, "N": 1000}]
    assert norm.parse_norm_shapes("16384x8192", "moe_smooth_quant") == [{"T": 16384, "H": 8192}]
    assert norm.parse_norm_shapes(norm.GPU_SHAPES, "rms_norm")[-1] == {"M": 4096, "N": 32768}
    # every default GPU shape holds x in 256 MiB of bf16
    assert {s["M"] * s["N"] * 2 for s in norm.parse_norm_shapes(norm.GPU_SHAPES, "rms_norm")} == {2**28}
    for bad in ("3", "3x0", "3x4x5", "", "axb"):
        with pytest.raises(harness.UsageError):
            norm.parse_norm_shapes(bad, "dynamic_quant")


def test_bytes_moved_by_hand():
    bf16, fp32 = torch.bfloat16, torch.float32
    # x [3, 1000] bf16: 6000 bytes; weight, bias 2000 each
    assert norm.Spec("layer_norm", 3, 1000, bf16).bytes_moved() == 6000 * 2 + 2000 * 2
    assert norm.Spec("layer_norm", 3, 1000, bf16, backward=True).bytes_moved() == 6000 * 3 + 2000 * 3
    assert norm.Spec("rms_norm", 3, 1000, bf16).bytes_moved() == 6000 * 2 + 2000
    assert norm.Spec("rms_norm", 3, 1000, bf16, backward=True).bytes_moved() == 6000 * 3 + 2000 * 2
    # a, b, a + b, q (1 B), row_scale (4 B/row), weight
    assert norm.Spec("add_rms_norm_quant", 3, 1000, bf16).bytes_moved() == 6000 * 3 + 3000 + 12 + 2000
    assert norm.Spec("dynamic_quant", 3, 1000, fp32).bytes_moved() == 12000 + 3000 + 12
    assert norm.Spec("smooth_quant", 3, 1000, bf16, quant_dtype=torch.float8_e4m3fn).bytes_moved() == \
        6000 + 3000 + 12 + 4000
    # x once, k*T rows of q and row_scale, smooth [E, H] fp32, topk_ids [T, k] int32
    assert norm.Spec("moe_smooth_quant", 3, 1000, bf16).bytes_moved() == 6000 + 6000 + 24 + 8 * 4000 + 24
    assert norm.Spec("layer_norm", 32768, 4096, bf16).bytes_moved() == 2**29 + 4 * 4096


def test_spec_names_and_layouts():
    spec = norm.Spec("layer_norm", 3, 8, torch.bfloat16, backward=True, residual=True, x_bias=True)
    assert spec.output_names() == ("dx", "dweight", "dbias", "dresidual", "dx_bias") and spec.variant == "bwd"
    assert norm.Spec("rms_norm", 3, 8, torch.float16, quant="smooth").output_names() == ("q", "row_scale")
    assert norm.Spec("add_rms_norm_quant", 3, 8, torch.float16).output_names() == ("q", "row_scale", "s")
    assert norm.Spec("moe_smooth_quant", 3, 8, torch.bfloat16, quant_dtype=torch.float8_e4m3fn, topk=3,
                     experts=4).layout == "q-fp8e4m3/k3/E4"
    assert norm.Spec("layer_norm", 3, 8, torch.bfloat16).layout == "weight+bias"


# ----------------------------------------------------------------------------------------------------
# the rules for quantised outputs


def test_quantised_output_rules():
    ref = torch.tensor([[-127, -3, 0, 5, 127]], dtype=torch.int8)
    assert norm.compare_steps("q", ref + torch.tensor([[0, 1, -1, 1, 0]], dtype=torch.int8), ref).passed
    off = norm.compare_steps("q", ref + torch.tensor([[0, 2, 0, 0, 0]], dtype=torch.int8), ref)
    assert not off.passed and off.max_err == 2 and off.worst_index == (0, 1)
    e4m3 = torch.float8_e4m3fn
    fp8_ref = torch.tensor([128.0, -0.0, 0.0, 448.0]).to(e4m3)
    neighbours = torch.tensor([120.0, 2.0**-9, -(2.0**-9), 416.0]).to(e4m3)     # one step each, zero crossed
    assert norm.compare_steps("q", neighbours, fp8_ref).passed
    halved = norm.compare_steps("q", torch.tensor([64.0, 0.0, 0.0, 448.0]).to(e4m3), fp8_ref)
    assert not halved.passed and halved.max_err == 8             # a lost carry: 128 -> 64 is 8 steps
    nan = norm.compare_steps("q", torch.tensor([float("nan"), 0.0, 0.0, 448.0]).to(e4m3), fp8_ref)
    assert not nan.passed and "NaN" in nan.parity_detail

    scale_ref = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    assert norm.compare_relative("row_scale", torch.tensor([1.004, 0.0, 2.0]), scale_ref, 0.0078).passed
    assert not norm.compare_relative("row_scale", torch.tensor([1.0, 1e-20, 2.0]), scale_ref, 0.0078).passed
    assert not norm.compare_relative("row_scale", torch.tensor([1.0, 0.0, float("nan")]), scale_ref, 0.5).passed


def test_eager_quant_follows_the_reference():
    from tilekernels.norm import reference

    z = torch.randn(4, 333, dtype=torch.float64) * 3
    z[2] = 0
    for quant_dtype in (torch.int8, torch.float8_e4m3fn):
        q, row_scale = norm.eager_quant(z, quant_dtype)
        q_ref, scale_ref = reference.reference_quant(z, quant_dtype)
        assert norm.compare_steps("q", q, q_ref).passed
        assert norm.compare_relative("row_scale", row_scale, scale_ref, 1e-6).passed
        assert row_scale[2] == 0 and not q[2].float().any()


# ----------------------------------------------------------------------------------------------------
# bench cases, rows, tables


def test_bench_cases_defaults_and_options():
    cases = norm.bench_cases("layer_norm", _opts(), CPU)
    assert [(c.variant, c.shape, c.layout) for c in cases] == [("fwd", {"M": 3, "N": 1000}, "weight+bias"),
                                                              ("bwd", {"M": 3, "N": 1000}, "weight+bias")]
    assert all(c.metric == "tbps" and list(c.providers) == ["tilekernels", "eager"] for c in cases)
    assert cases[0].flops == norm.Spec("layer_norm", 3, 1000, torch.bfloat16).bytes_moved()
    extra = cases[0].row_extra({"p50": 0.5, "ms": 1.0})
    assert extra["bytes_moved"] == cases[0].flops and extra["copy_fraction"] == pytest.approx(0.5 / extra["copy_tbps"])
    quant = norm.bench_cases("dynamic_quant", _opts(quant_dtype="int8,fp8e4m3", passes="bwd", shapes="3x64,5x4099"),
                             CPU)
    assert [(c.variant, c.layout, harness.shape_label(c.shape)) for c in quant] == [
        ("fwd", "q-int8", "3x64"), ("fwd", "q-int8", "5x4099"), ("fwd", "q-fp8e4m3", "3x64"),
        ("fwd", "q-fp8e4m3", "5x4099")]
    (moe,) = norm.bench_cases("moe_smooth_quant", _opts(moe_topk=3, moe_experts=4), CPU)
    assert moe.layout == "q-int8/k3/E4" and moe.shape == {"T": 3, "H": 1000}
    inputs = moe.make_inputs(0)
    ids = inputs["topk_ids"]
    assert ids.dtype == torch.int32 and ids.shape == (3, 3) and all(len(set(r.tolist())) == 3 for r in ids)
    assert bool((inputs["smooth_scale"] >= 0.5).all()) and inputs["smooth_scale"].shape == (4, 1000)
    graph = norm.bench_cases("rms_norm", _opts(cuda_graph=True), CPU)
    assert [c.variant for c in graph] == ["fwd"]
    for op, bad in (("layer_norm", {"dtype": torch.int8}), ("layer_norm", {"passes": "fwd,back"}),
                    ("smooth_quant", {"quant_dtype": "fp8e5m2"}), ("layer_norm", {"providers": "flex"}),
                    ("moe_smooth_quant", {"moe_topk": 9}), ("rms_norm", {"shapes": "3x"})):
        with pytest.raises(harness.UsageError):
            norm.bench_cases(op, _opts(**bad), CPU)


def test_compile_is_left_out_on_a_cpu_where_it_cannot_run(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(norm, "_compile_unavailable", {})
    cases = norm.bench_cases("dynamic_quant", _opts(providers=None), CPU)
    assert list(cases[0].providers) == ["tilekernels", "eager"]
    assert "compile left out: torch.compile does not run on cpu here (RuntimeError: no C++ compiler)" in \
        capsys.readouterr().out
    named = norm.bench_cases("dynamic_quant", _opts(providers="compile"), CPU)   # named: it runs and fails
    assert list(named[0].providers) == ["compile"]


def test_goals_tables_judge_the_goal_at_n_4096_to_32768():
    # ms per (M, N): ours, eager, compile. 65536x2048 is outside the range: its 0.5 fraction is not judged.
    rows = _rows({(32768, 4096): (0.19, 0.3, 0.25), (4096, 32768): (0.195, 0.3, 0.2),
                  (65536, 2048): (0.4, 0.3, 0.3)}, copy_tbps=3.0)
    text = norm.LAYER_NORM.report_rows(rows)
    assert "layer_norm · fwd · bf16 · weight+bias — TB/s (median)" in text and "ours/eager" in text
    goals = text[text.index("fraction of the copy bandwidth"):]
    assert "issue 7: ours/copy >= 0.9, ours/eager >= 1.3 at N 4096..32768" in goals
    assert "tilekernels/copy" in goals and "compile/copy" in goals and "MB moved" in goals
    fraction = rows[3]["copy_fraction"]           # 4096x32768: 2^29 bytes in 0.195 ms, 2.75 TB/s of 3.0
    assert fraction == pytest.approx(2**29 / 0.195e-3 / 1e12 / 3.0) and f"{fraction:.3f}" in goals
    assert (f"worst over N 4096..32768 (2 shape(s)): ours/copy {fraction:.3f} at 4096x32768 (goal >= 0.9), "
            "ours/eager 1.538 at 4096x32768 (goal >= 1.3), ours/compile 1.026 at 4096x32768 (no goal) -> goal met"
            in goals)
    assert f"{rows[6]['copy_fraction']:.3f}" in goals                # 65536x2048 shown, not judged

    slow = _rows({(32768, 4096): (0.25, 0.3, 0.25)})
    line = norm.goals_tables(slow).splitlines()[-1]
    assert "goal MISSED (ours/copy; ours/eager)" in line

    backward = _rows({(32768, 4096): (0.3, 0.3, 0.3)}, variant="bwd")
    text = norm.goals_tables(backward)
    assert "ours/copy >= 0.8 at N" in text and "ours/eager 1.000 at 32768x4096 (no goal)" in text
    assert "goal MISSED (ours/copy)" in text                     # 1.79 TB/s of 3.0

    failed = [r for r in _rows({(32768, 4096): (0.2, 0.3, 0.3)}) if r["provider"] != "tilekernels"]
    assert "goal MISSED (no tilekernels figure at 32768x4096)" in norm.goals_tables(failed)
    assert "no shape with N in that range" in norm.goals_tables(_rows({(3, 1000): (1, 1, 1)}))
    interpreted = _rows({(32768, 4096): (0.2, 0.3, 0.25)}, interpreter=True)
    assert "goals not judged under the CPU interpreter" in norm.goals_tables(interpreted)
    md = norm.LAYER_NORM.report_rows(rows, markdown=True)
    assert "#### layer_norm · fwd · bf16 · weight+bias — fraction" in md and "| shape | MB moved |" in md
    assert "- worst over N 4096..32768" in md


def test_results_md_shows_the_goals(tmp_path):
    results_dir = tmp_path / "benchmarks" / "results"
    run_file = tmp_path / "layer_norm.json"
    run_file.write_text(json.dumps(_rows({(32768, 4096): (0.19, 0.3, 0.25)})))
    results.import_rows(results_dir, [run_file])
    text = results.write_results_md(results_dir).read_text()
    assert "## layer_norm — nvidia-h100-80gb-hbm3" in text and "— TB/s (median)" in text
    assert "fraction of the copy bandwidth" in text and "-> goal met" in text


# ----------------------------------------------------------------------------------------------------
# the accuracy check, through the eager provider


@pytest.mark.parametrize("op, variant", [("add_rms_norm_quant", "fwd"), ("moe_smooth_quant", "fwd"),
                                         ("layer_norm", "bwd")])
def test_run_case_checks_eager_and_rejects_a_wrong_provider(op, variant):
    cases = norm.bench_cases(op, _opts(providers="eager", passes=variant, shapes="5x300"), CPU)
    (case,) = [c for c in cases if c.variant == variant]
    good = case.providers["eager"]

    def off_in_one_element(x):
        outputs = [t.clone() for t in good(x)]
        if variant == "bwd":
            outputs[1][7] += 1.0                                # dweight: every row adds to it
        else:                                                   # q of the last row (last token's last expert)
            outputs[0][-1, 5] = 100 if abs(int(outputs[0][-1, 5])) < 50 else 0
        return tuple(outputs)

    case.providers = {"eager": good, "wrong": off_in_one_element}
    run = harness.Run(op, CPU, "bench")
    harness.run_case(case, run, warmup=1, rep=1)
    assert [r["provider"] for r in run.rows] == ["eager"]
    row = run.rows[0]
    assert {"bytes_moved", "copy_tbps", "copy_fraction"} <= set(row) and row["metric"] == "tbps"
    assert len(run.failures) == 1 and "accuracy check failed, not timed" in run.failures[0]


def test_check_case_names():
    for op in OPS:
        names = [c.name for c in load_op(op).check_cases(CPU)]
        assert names and len(names) == len(set(names))
        assert any("4099" in n for n in names) and any("1000" in n for n in names)
    layer_norm = [c.name for c in norm.LAYER_NORM.check_cases(CPU)]
    assert "fp16-bwd-3x4099-residual-xbias" in layer_norm and "bf16-fwd-5x1000-smooth-qint8" in layer_norm
    assert "bf16-fwd-5x1000-qint8-zero_row" in [c.name for c in norm.DYNAMIC_QUANT.check_cases(CPU)]


# ----------------------------------------------------------------------------------------------------
# the commands end to end (tilekernels kernels under the interpreter)


@needs_kernels
def test_check_rms_norm_command():
    result = _cli("check", "--op", "rms_norm", "--filter", "bf16-*")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed, 0 failed" in result.stdout and "bf16-bwd-5x1000" in result.stdout


@needs_kernels
def test_bench_layer_norm_command(tmp_path):
    result = _cli("bench", "layer_norm", "--shapes", "3x1000", "--no-record", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "layer_norm.json").read_text())
    providers = {r["provider"] for r in rows}
    assert {"tilekernels", "eager"} <= providers <= set(norm.PROVIDERS)
    assert "compile" in providers or "compile left out" in result.stdout
    assert {(r["variant"], r["metric"]) for r in rows} == {("fwd", "tbps"), ("bwd", "tbps")}
    assert all(r["copy_fraction"] > 0 and r["bytes_moved"] > 0 for r in rows)
    text = (tmp_path / "layer_norm.txt").read_text()
    assert "layer_norm · bwd · bf16 · weight+bias — TB/s (median)" in text
    assert "fraction of the copy bandwidth" in text and "goals not judged under the CPU interpreter" in text
