"""The benchmark/check harness on the CPU: parsing, tables, JSON rows, RESULTS.md, and the three
commands end to end under the interpreter (where their timings mean nothing; only the plumbing is
tested). Rows built by ``_row`` below are synthetic fixtures for the formatting code, not measurements.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from tilekernels import bench
from tilekernels.bench import check, harness, results
from tilekernels.bench import gemm as gemm_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def _gemm_available() -> bool:
    import tilekernels

    return callable(getattr(tilekernels, "gemm", None))


needs_gemm = pytest.mark.skipif(not _gemm_available(), reason="tilekernels.gemm is not exported yet")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "tilekernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _row(provider, M, N, K, p50, *, gpu=H100, variant="plain", dtype="bf16", run_id="r1", mode="bench",
         date="2026-11-22T00:00:00+00:00", interpreter=False, config="", layout="RR"):
    return {"op": "gemm", "provider": provider, "shape": {"M": M, "N": N, "K": K}, "dtype": dtype,
            "layout": layout, "variant": variant, "metric": "tflops",
            "p20": p50 * 0.98, "p50": p50, "p80": p50 * 1.01,
            "ms": 2.0 * M * N * K / p50 / 1e9, "config": config, "accuracy_ratio": 1.0, "mode": mode,
            "run_id": run_id, "date": date, "gpu": gpu, "torch": "2.11.0", "triton": "3.6.0",
            "tilekernels": "0.1.0", "python": "3.12", "commit": None, "interpreter": interpreter}


# ----------------------------------------------------------------------------------------------------
# parsing and formatting


def test_parse_shapes():
    assert harness.parse_shapes("8192x8192x8192,16x8192x8192") == [
        {"M": 8192, "N": 8192, "K": 8192}, {"M": 16, "N": 8192, "K": 8192}]
    assert harness.parse_shapes(" 64X48×80 ,") == [{"M": 64, "N": 48, "K": 80}]
    assert harness.parse_shapes("2x3x4x5", names="BHSD") == [{"B": 2, "H": 3, "S": 4, "D": 5}]
    for bad in ("8192x8192", "0x8x8", "axbxc", "", "8x8x8x8"):
        with pytest.raises(ValueError):
            harness.parse_shapes(bad)


def test_format_table_plain_and_markdown():
    text = harness.format_table(["shape", "tflops"], [["16x8x8", "1.5"], ["8192x8192x8192", "712"]])
    lines = text.splitlines()
    assert lines[0].startswith("shape") and set(lines[1]) <= {"-", " "}
    assert all(len(line) == len(lines[0]) for line in lines)       # numbers right-aligned to one edge
    md = harness.format_table(["a", "b"], [["x", "1"]], markdown=True)
    assert md.splitlines() == ["| a | b |", "|---|---:|", "| x | 1 |"]
    assert harness.format_value(None) == "-" and harness.format_value(717.2) == "717"


def test_report_ratios_geomean_and_anchor():
    rows = [_row("tilekernels", 8192, 8192, 8192, 700.0), _row("cublas", 8192, 8192, 8192, 700.0),
            _row("tilekernels", 64, 8192, 8192, 100.0), _row("cublas", 64, 8192, 8192, 200.0),
            _row("tilekernels", 16, 8192, 8192, 30.0), _row("cublas", 16, 8192, 8192, 40.0)]
    text = harness.report(rows, gemm_bench)
    assert "ours/cublas" in text and "H100 cuBLAS anchor" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("8192x8192x8192"))
    assert "1.000" in line and "717" in line and f"{700 / 717:.3f}" in line
    # anchor shapes: 8192^3 (1.0) and M=16 (0.75); M=64 has no anchor figure
    assert f"geomean {math.sqrt(0.75):.3f} over 2 anchor shape(s), min 0.750 at 16x8192x8192" in text
    everywhere = (1.0 * 0.5 * 0.75) ** (1 / 3)
    assert f"geomean {everywhere:.3f} over 3 measured shape(s), min 0.500 at 64x8192x8192" in text
    # an H200 run is compared with the H100 anchors, and says so
    assert "measured on an H100" in harness.report([dict(r, gpu="NVIDIA H200") for r in rows], gemm_bench)


def test_report_epilogue_rows_compare_with_each_baseline():
    rows = [_row(p, 4096, 4096, 4096, v, variant="bias+gelu+residual")
            for p, v in (("tilekernels", 600.0), ("torch", 400.0), ("torch.compile", 500.0))]
    text = harness.report(rows, gemm_bench)
    assert "ours/torch" in text and "ours/torch.compile" in text and "anchor" not in text
    line = next(ln for ln in text.splitlines() if ln.startswith("4096x4096x4096"))
    assert "1.500" in line and "1.200" in line


def test_interpreter_rows_carry_a_warning():
    rows = [_row("tilekernels", 64, 48, 80, 1e-5, gpu="cpu-interpreter", interpreter=True)]
    assert "meaningless" in harness.report(rows, gemm_bench)


# ----------------------------------------------------------------------------------------------------
# JSON rows and RESULTS.md


def test_append_rows_creates_folders_appends_and_dedupes(tmp_path):
    path = tmp_path / "results" / "nvidia-h100" / "gemm.json"
    first = [_row("tilekernels", 8, 8, 8, 1.0), _row("cublas", 8, 8, 8, 2.0)]
    assert harness.append_rows(path, first) == 2
    second = [_row("tilekernels", 8, 8, 8, 1.5, run_id="r2")]
    assert harness.append_rows(path, first + second) == 1
    stored = json.loads(path.read_text())
    assert [r["run_id"] for r in stored] == ["r1", "r1", "r2"]
    path.write_text("{}")
    with pytest.raises(ValueError):
        harness.read_rows(path)


def test_results_md_latest_run_per_device(tmp_path):
    results_dir = tmp_path / "benchmarks" / "results"
    assert "No GPU figures have been measured yet" in results.render(results_dir)
    old = [_row("tilekernels", 8192, 8192, 8192, 500.0), _row("cublas", 8192, 8192, 8192, 700.0)]
    new = [_row(p, 8192, 8192, 8192, v, run_id="r2", date="2026-11-23T00:00:00+00:00")
           for p, v in (("tilekernels", 690.0), ("cublas", 700.0))]
    sweep = [_row("cublas", 4096, 4096, 4096, 700.0, mode="sweep", run_id="s1"),
             _row("tilekernels", 4096, 4096, 4096, 650.0, mode="sweep", run_id="s1", config="128x256x64 sk1"),
             _row("tilekernels", 4096, 4096, 4096, 600.0, mode="sweep", run_id="s1",
                  config="default 128x128x64")]
    interp = [_row("tilekernels", 64, 48, 80, 1e-5, gpu="cpu-interpreter", interpreter=True, run_id="i")]
    run_file = tmp_path / "gemm.json"
    run_file.write_text(json.dumps(old + new + sweep + interp))
    messages = results.import_rows(results_dir, [run_file])
    assert any("interpreter" in m for m in messages)
    assert not (results_dir / "cpu-interpreter").exists()
    path = results.write_results_md(results_dir)
    text = path.read_text()
    assert path == tmp_path / "benchmarks" / "RESULTS.md"
    assert "## gemm — nvidia-h100-80gb-hbm3" in text and "run `r2`" in text and "run `r1`" not in text
    assert f"{690 / 700:.3f}" in text and "H100 cuBLAS anchor" in text
    assert "`128x256x64 sk1`" in text and "|  | default | `128x128x64` | 600 | 0.857 |" in text
    assert "No GPU figures" not in text


def test_results_md_keeps_the_latest_run_of_each_layout(tmp_path):
    """A run of one layout (or moe_smooth_quant's k and E) does not hide another layout's latest run; a later run of
    the same variant and layout replaces the earlier one."""
    results_dir = tmp_path / "results"

    def run(run_id, layout, day, value):
        return [_row(p, 4096, 4096, 4096, v, run_id=run_id, layout=layout, date=f"2026-11-{day}T00:00:00+00:00")
                for p, v in (("tilekernels", value), ("cublas", 700.0))]

    run_file = tmp_path / "gemm.json"
    run_file.write_text(json.dumps(run("rr-old", "RR", 21, 600.0) + run("rc", "RC", 22, 650.0)
                                   + run("rr-new", "RR", 23, 680.0)))
    results.import_rows(results_dir, [run_file])
    text = results.write_results_md(results_dir).read_text()
    assert "run `rc`" in text and "run `rr-new`" in text and "run `rr-old`" not in text
    assert "· RR —" in text and "· RC —" in text


def test_update_results_command(tmp_path, capsys):
    from tilekernels.__main__ import main

    run_file = tmp_path / "gemm.json"
    run_file.write_text(json.dumps([_row("tilekernels", 8192, 8192, 8192, 690.0),
                                    _row("cublas", 8192, 8192, 8192, 700.0)]))
    results_dir = tmp_path / "res"
    assert main(["bench", "--update-results", str(run_file), "--results-dir", str(results_dir)]) == 0
    assert (results_dir / "nvidia-h100-80gb-hbm3" / "gemm.json").exists()
    assert "0.986" in (tmp_path / "RESULTS.md").read_text()


# ----------------------------------------------------------------------------------------------------
# check runner


def test_check_counts_a_raising_op_as_a_failure(monkeypatch, capsys):
    def boom():
        raise RuntimeError("kernel exploded")

    fake = types.ModuleType("fake_bench_op")
    fake.NAME = "fake"
    fake.check_cases = lambda device: [check.CheckCase("raises", boom)]
    broken = types.ModuleType("broken_bench_op")
    broken.NAME = "broken"

    def no_cases(device):
        raise ImportError("cannot import the op")

    broken.check_cases = no_cases
    monkeypatch.setitem(sys.modules, "fake_bench_op", fake)
    monkeypatch.setitem(sys.modules, "broken_bench_op", broken)
    monkeypatch.setitem(bench.OPS, "fake", "fake_bench_op")
    monkeypatch.setitem(bench.OPS, "broken", "broken_bench_op")
    assert check.main(["fake", "broken"], torch.device("cpu")) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: kernel exploded" in out and "ImportError: cannot import the op" in out
    assert "0 passed, 2 failed" in out


@needs_gemm
def test_wrong_or_raising_provider_is_reported_and_not_timed(capsys):
    case = gemm_bench._case({"M": 40, "N": 120, "K": 24}, torch.bfloat16, "RC", torch.device("cpu"), 0,
                            epilogue=True, split_k=1, wanted=None)

    def off_by_a_little(x):
        out = gemm_bench._torch_epilogue(x["a"], x["b"], x["bias"], x["residual"])
        out[39, 7] += 1.0      # one wrong element, in the last row: the sampled check must see it
        return out

    def raises(x):
        raise ValueError("unsupported layout")

    case.providers = {"tilekernels": off_by_a_little, "torch": gemm_bench._torch_epilogue_provider,
                      "torch.compile": raises}
    run = harness.Run("gemm", torch.device("cpu"), "bench")
    harness.run_case(case, run, warmup=1, rep=1)
    assert [r["provider"] for r in run.rows] == ["torch"]
    assert len(run.failures) == 2
    assert "accuracy check failed, not timed" in run.failures[0] and "(39, 7)" in run.failures[0]
    assert "ValueError: unsupported layout" in run.failures[1]


@needs_gemm
def test_sweep_notes_configs_that_raise_but_fails_wrong_ones(capsys):
    case = gemm_bench._case({"M": 16, "N": 24, "K": 8}, torch.float32, "RR", torch.device("cpu"), 0,
                            epilogue=False, split_k=1, wanted=None)
    sets = [case.make_inputs(0)]
    run = harness.Run("gemm", torch.device("cpu"), "sweep")

    def out_of_resources(x):
        raise RuntimeError("out of resource: shared memory")

    def wrong(x):
        return torch.zeros(16, 24)

    assert harness.measure(case, "tilekernels", out_of_resources, sets, run, 1, 1, config="big",
                           failures_are_notes=True) is None
    assert harness.measure(case, "tilekernels", wrong, sets, run, 1, 1, config="bad",
                           failures_are_notes=True) is None
    assert len(run.notes) == 1 and "out of resource" in run.notes[0] and "[tilekernels big]" in run.notes[0]
    assert len(run.failures) == 1 and "[tilekernels bad]" in run.failures[0]


def _scripted_case(calls):
    """A BenchCase whose two providers log their calls; flops such that 1 ms is 1 TFLOP/s."""
    def provider(name):
        def fn(x):
            calls.append(name)
            return x["v"] * 2
        return fn

    return harness.BenchCase(
        op="x", shape={"N": 4}, dtype=torch.float32, variant="v", layout="l", flops=1e9, set_bytes=16,
        make_inputs=lambda i: {"v": torch.ones(4)},
        providers={"tilekernels": provider("tilekernels"), "base": provider("base")},
        check=lambda x, out, p: harness.Accuracy(True, 1.0, ""))


def test_run_case_interleaves_rounds_and_keeps_each_rounds_median(monkeypatch):
    calls, timed = [], []
    # ours 1, 4, 2 ms in rounds 0..2; base 2, 2, 5 ms: the medians (2 and 2) hide round 1's slow spell
    script = iter([[1, 1, 1], [2, 2, 2], [4, 4, 4], [2, 2, 2], [2, 2, 2], [5, 5, 5]])

    def fake_time_ms(fn, device, warmup, rep, cuda_graph=False):
        fn()
        timed.append(calls[-1])
        return [float(t) for t in next(script)]

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    run = harness.Run("x", torch.device("cpu"), "bench")
    harness.run_case(_scripted_case(calls), run, warmup=1, rep=1, rounds=3)
    assert calls[:2] == ["tilekernels", "base"]              # both checked before any timing
    assert timed == ["tilekernels", "base"] * 3               # then interleaved rounds
    rows = {r["provider"]: r for r in run.rows}
    assert rows["tilekernels"]["ms"] == 2.0 and rows["base"]["ms"] == 2.0
    assert rows["tilekernels"]["rounds"] == 3
    assert rows["tilekernels"]["p50_rounds"] == pytest.approx([1.0, 0.25, 0.5])
    assert rows["base"]["p50_rounds"] == pytest.approx([0.5, 0.5, 0.2])
    text = harness.report(run.rows)
    # per-round ratios ours/base: 2.0, 0.5, 2.5
    assert "ours/base in single rounds: 0.500 (4) to 2.500 (4), 3 interleaved rounds per shape" in text


def test_run_case_drops_a_provider_that_raises_in_a_later_round(monkeypatch):
    calls = []
    rounds_seen = {"base": 0}

    def fake_time_ms(fn, device, warmup, rep, cuda_graph=False):
        fn()
        if calls[-1] == "base":
            rounds_seen["base"] += 1
            if rounds_seen["base"] == 2:
                raise RuntimeError("device lost")
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(harness, "time_ms", fake_time_ms)
    run = harness.Run("x", torch.device("cpu"), "bench")
    harness.run_case(_scripted_case(calls), run, warmup=1, rep=1, rounds=3)
    assert [r["provider"] for r in run.rows] == ["tilekernels"]
    assert len(run.failures) == 1 and "raised while timing RuntimeError: device lost" in run.failures[0]
    assert rounds_seen["base"] == 2


def test_combine_rounds_takes_each_quantiles_median():
    assert harness.combine_rounds([[1, 2, 3], [10, 20, 30], [2, 3, 4]]) == [2, 3, 4]
    assert harness.combine_rounds([[1, 2, 3]]) == [1, 2, 3]


def test_time_ms_on_the_interpreter_returns_ordered_quantiles():
    p20, p50, p80 = harness.time_ms(lambda: sum(range(1000)), torch.device("cpu"), 1, 1)
    assert 0 < p20 <= p50 <= p80


# ----------------------------------------------------------------------------------------------------
# the commands, end to end under the interpreter


def test_info_command():
    result = _cli("info")
    assert result.returncode == 0, result.stderr
    for key in ("python", "torch", "triton", "tilekernels", "device", "SM count", "interpreter", "TMA"):
        assert key in result.stdout


@needs_gemm
def test_check_gemm_command():
    result = _cli("check", "--op", "gemm", "--filter", "*bf16-RC-33x40x70*")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bf16-RC-33x40x70-bias+gelu+residual" in result.stdout and " failed" in result.stdout


@needs_gemm
def test_bench_gemm_command(tmp_path):
    out, res = tmp_path / "out", tmp_path / "benchmarks" / "results"
    result = _cli("bench", "gemm", "--shapes", "64x48x80", "--out", str(out), "--results-dir", str(res),
                  "--providers", "tilekernels,cublas,torch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "meaningless" in result.stdout
    rows = json.loads((out / "gemm.json").read_text())
    assert {(r["variant"], r["provider"]) for r in rows} == {
        ("plain", "tilekernels"), ("plain", "cublas"), ("bias+gelu+residual", "tilekernels"),
        ("bias+gelu+residual", "torch")}
    for r in rows:
        assert r["shape"] == {"M": 64, "N": 48, "K": 80} and r["metric"] == "tflops"
        assert r["p20"] <= r["p50"] <= r["p80"] and r["interpreter"] is True
    assert "ours/cublas" in (out / "gemm.txt").read_text()
    assert len(json.loads((res / "cpu-interpreter" / "gemm.json").read_text())) == 4
    assert "No GPU figures" in (tmp_path / "benchmarks" / "RESULTS.md").read_text()


@needs_gemm
def test_bench_gemm_sweep_command(tmp_path):
    result = _cli("bench", "gemm", "--sweep", "--shapes", "16x48x80", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "gemm-sweep.json").read_text())
    swept = [r for r in rows if "config_fields" in r]
    assert swept and all(r["mode"] == "sweep" for r in rows)
    assert "best config per shape class" in result.stdout


def test_plot_panels_draws_one_panel_per_key(tmp_path):
    """The shared figure plumbing of the gemm and dist plots: one panel per key, the PNG written."""
    pytest.importorskip("matplotlib")
    rows = [{"variant": v, "provider": p, "p50": 1.0} for v in ("fwd", "bwd") for p in ("a", "b")]
    drawn = []

    def draw(ax, panel, group):
        drawn.append((panel, len(group)))
        ax.bar(range(len(group)), [r["p50"] for r in group])

    path = tmp_path / "plot.png"
    assert harness.plot_panels(rows, lambda r: (r["variant"],), draw, path, "t") == f"wrote {path}"
    assert drawn == [(("fwd",), 2), (("bwd",), 2)] and path.stat().st_size > 0
    assert harness.plot_panels([], lambda r: (), draw, tmp_path / "none.png", "t") == "no rows: PNG skipped"
