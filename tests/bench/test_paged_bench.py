"""The batch_prefill / batch_decode benchmark module on the CPU: shape parsing, FLOP and byte counts, the
TB/s metric and bandwidth floor in rows and tables, FlexAttention's support rules, the accuracy check
(driven through the baselines, which need no tilekernels kernel), and the commands end to end once the
ops exist. Rows built by ``_row`` are synthetic fixtures for the formatting code, not measurements.
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

from tilekernels.bench import harness, load_op, paged, results

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
H100 = "NVIDIA H100 80GB HBM3"


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(__import__(module, fromlist=[name]), name)
    except ImportError:
        return False


def _has_flex() -> bool:
    return _has("torch.nn.attention.flex_attention", "create_block_mask") and _has(
        "torch.nn.attention.experimental._paged_attention", "PagedAttention")


needs_reference = pytest.mark.skipif(not _has("tilekernels.attention.reference", "make_paged_kv"),
                                     reason="tilekernels.attention.reference.make_paged_kv is not there yet")
needs_kernels = pytest.mark.skipif(not (_has("tilekernels", "batch_prefill") and _has("tilekernels", "batch_decode")),
                                   reason="tilekernels.batch_prefill/batch_decode are not exported yet")
needs_flex = pytest.mark.skipif(not _has_flex(), reason="this torch has no FlexAttention paged attention")


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "tilekernels", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _opts(op: str, **kw) -> argparse.Namespace:
    base = {"shapes": None, "dtype": torch.bfloat16, "providers": None, "page_sizes": None, "kv_dtypes": None,
            "kv_scale": "tensor", "kv_layout": "linear", "page_table": "1d", "num_splits": None, "causal": "both",
            "seed": 0, "warmup": 1.0, "rep": 1.0, "cuda_graph": False}
    return argparse.Namespace(**{**base, **kw})


def _row(op, provider, shape, p50, ms, *, variant="page16", layout="linear/1d", interpreter=False, **extra):
    return {"op": op, "provider": provider, "shape": shape, "dtype": "bf16", "layout": layout, "variant": variant,
            "metric": "tbps" if op == paged.DECODE else "tflops", "p20": p50 * 0.98, "p50": p50, "p80": p50 * 1.01,
            "ms": ms, "config": "", "accuracy_ratio": 1.0, "mode": "bench", "timing": "eager", "run_id": "r1",
            "date": "2026-11-22T00:00:00+00:00", "gpu": "cpu-interpreter" if interpreter else H100,
            "torch": "2.11.0", "triton": "3.6.0", "tilekernels": "0.1.0", "python": "3.12", "commit": None,
            "interpreter": interpreter, **extra}


DECODE_SHAPE = {"B": 32, "H": 32, "Hkv": 8, "Sk": 8192, "D": 128}
PREFILL_SHAPE = {"B": 4, "H": 32, "Hkv": 8, "Sq": 4096, "Sk": 4096, "D": 128, "mask": "causal"}


def _decode_rows(ours_ms: float, sdpa_ms: float, shape=DECODE_SHAPE, **kw) -> list[dict]:
    kv_bytes = paged.decode_kv_bytes(shape, torch.bfloat16)
    floor_ms = kv_bytes / 3e12 * 1e3
    return [_row(paged.DECODE, p, shape, kv_bytes / (ms * 1e-3) / 1e12, ms, kv_bytes=kv_bytes, copy_tbps=3.0,
                 floor_ms=floor_ms, floor_ratio=ms / floor_ms, **kw)
            for p, ms in ((harness.OURS, ours_ms), (paged.SDPA, sdpa_ms))]


# ----------------------------------------------------------------------------------------------------
# registration, shapes, counts


def test_registered():
    assert load_op("batch_prefill") is paged.BATCH_PREFILL and paged.BATCH_PREFILL.NAME == "batch_prefill"
    assert load_op("batch_decode") is paged.BATCH_DECODE and paged.BATCH_DECODE.METRIC == "tbps"
    assert paged.BATCH_PREFILL.METRIC == "tflops" and paged.BATCH_DECODE.ANCHOR_PROVIDER == "sdpa"


def test_parse_shapes_and_errors():
    full = {"B": 4, "H": 32, "Hkv": 8, "Sq": 4096, "Sk": 4096, "D": 128, "mask": "full"}
    causal = dict(full, mask="causal")
    assert paged.parse_prefill_shapes("4x32x8x4096x4096x128") == [full, causal]
    assert paged.parse_prefill_shapes("4X32x8×4096x4096x128xcausal", "no") == [causal]
    assert paged.parse_prefill_shapes(harness.shape_label(causal)) == [causal]   # labels parse back
    assert paged.parse_decode_shapes("32x32x8x8192x128, 8x32x8x32768x128") == [
        DECODE_SHAPE, {"B": 8, "H": 32, "Hkv": 8, "Sk": 32768, "D": 128}]
    for bad in ("4x32x8x4096x128", "4x32x8x4096x4096x128xsliding", "4x32x5x64x64x128", ""):
        with pytest.raises(harness.UsageError):
            paged.parse_prefill_shapes(bad)
    for bad in ("32x32x8x8192", "32x32x3x8192x128", "0x32x8x8192x128"):
        with pytest.raises(harness.UsageError):
            paged.parse_decode_shapes(bad)


def test_flops_bytes_and_anchor():
    assert paged.prefill_flops(dict(PREFILL_SHAPE, mask="full")) == 4 * 4 * 32 * 128 * 4096**2
    assert paged.prefill_flops(PREFILL_SHAPE) == 2 * 4 * 32 * 128 * 4096**2        # half when Sq == Sk
    assert paged.attended_pairs(2, 5, causal=True) == 8 and paged.attended_pairs(5, 2, causal=True) == 2
    assert paged.decode_kv_bytes(DECODE_SHAPE, torch.bfloat16) == 32 * 8192 * 8 * 128 * 2 * 2
    assert paged.decode_kv_bytes(DECODE_SHAPE, torch.float8_e4m3fn) == 32 * 8192 * 8 * 128 * 2
    label, tbps = paged.anchor(_decode_rows(1.0, 1.4)[1])
    assert label == "H100 SDPA anchor" and tbps == pytest.approx(32 * 8192 * 8 * 128 * 4 / 1.4e-3 / 1e12)
    assert paged.anchor(_decode_rows(1.0, 1.4, layout="linear/1d/kv-fp8e4m3")[0]) is None
    assert paged.anchor(_decode_rows(1.0, 1.4, shape=dict(DECODE_SHAPE, B=31))[0]) is None
    assert paged.anchor(_row(paged.PREFILL, "tilekernels", PREFILL_SHAPE, 300.0, 1.0)) is None


def test_flex_support_rules():
    def spec(page_size, kv_dtype=torch.bfloat16):
        return paged.Spec(paged.DECODE, DECODE_SHAPE, page_size, "linear", "1d", torch.bfloat16, kv_dtype, None, CPU)

    assert [paged.flex_key_block(p) for p in (1, 3, 16, 48, 64, 1024)] == [1, 1, 16, 16, 64, 64]
    assert paged.flex_unsupported(spec(16), compiled=True) is None
    assert "page size 1 " in paged.flex_unsupported(spec(1), compiled=True)
    assert paged.flex_unsupported(spec(1), compiled=False) is None      # uncompiled: any page size
    assert "fp8e4m3" in paged.flex_unsupported(spec(16, torch.float8_e4m3fn), compiled=False)


# ----------------------------------------------------------------------------------------------------
# the harness's per-case metric, row fields and the op's own tables


def test_tbps_rows_and_tables_floor_and_goals():
    rows = _decode_rows(0.40, 1.40) + _decode_rows(0.50, 1.40, shape=dict(DECODE_SHAPE, Sk=4096, B=64))
    text = paged.report_rows(rows, paged.BATCH_DECODE)
    assert "batch_decode · page16 · bf16 · linear/1d — TB/s (median)" in text and "TFLOP/s" not in text
    assert "ours/sdpa" in text and "H100 SDPA anchor" in text
    floor = text[text.index("bandwidth floor"):]
    assert "tilekernels/floor" in floor and "copy TB/s" in floor
    ratio = rows[0]["floor_ratio"]
    assert f"{ratio:.3f}" in floor and f"ours/floor: max {ratio:.3f} at 32x32x8x8192x128" in floor  # >= 8k only
    assert ("meets" if ratio <= 1.25 else "misses") in floor
    md = paged.report_rows(rows, paged.BATCH_DECODE, markdown=True)
    assert "#### batch_decode · page16" in md and "| shape | KV MB |" in md

    prefill = [_row(paged.PREFILL, p, PREFILL_SHAPE, v, 1.0, variant=variant)
               for variant, ours in (("page1", 250.0), ("page16", 280.0))
               for p, v in (("tilekernels", ours), ("contiguous", 300.0))]
    text = paged.report_rows(prefill, paged.BATCH_PREFILL)
    assert "batch_prefill · page1 · bf16 · linear/1d — TFLOP/s (median)" in text
    assert "page1 · bf16 · linear/1d: min ours/contiguous 0.833 at 4x32x8x4096x4096x128xcausal meets the goal >= 0.8" \
        in text
    assert "page16 · bf16 · linear/1d: min ours/contiguous 0.933 at" in text and "goal >= 0.9" in text
    interpreted = [dict(r, interpreter=True, gpu="cpu-interpreter") for r in prefill]
    assert "goals" not in paged.report_rows(interpreted, paged.BATCH_PREFILL)   # meaningless there


def test_run_row_takes_the_case_metric_and_extra_fields():
    case = harness.BenchCase(op="x", shape={"N": 1}, dtype=torch.bfloat16, variant="v", layout="l", flops=2e9,
                             set_bytes=1, make_inputs=lambda i: {}, providers={}, check=None, metric="tbps",
                             row_extra=lambda row: {"floor_ratio": row["ms"] / 0.5})
    run = harness.Run("x", CPU, "bench")
    row = run.row(case, "p", [1.0, 2.0, 4.0], "", harness.Accuracy(True, 0.5, ""))
    assert row["metric"] == "tbps" and row["p50"] == pytest.approx(1.0) and row["floor_ratio"] == 4.0
    case.metric, case.row_extra = "tflops", None
    assert run.row(case, "p", [1.0, 2.0, 4.0], "", harness.Accuracy(True, 0.5, ""))["metric"] == "tflops"
    assert harness.metric_unit("tbps") == "TB/s" and harness.metric_unit(None) == "TFLOP/s"


def test_results_md_shows_the_floor(tmp_path):
    results_dir = tmp_path / "benchmarks" / "results"
    run_file = tmp_path / "batch_decode.json"
    run_file.write_text(json.dumps(_decode_rows(0.40, 1.40)))
    results.import_rows(results_dir, [run_file])
    text = results.write_results_md(results_dir).read_text()
    assert "## batch_decode — nvidia-h100-80gb-hbm3" in text and "— TB/s (median)" in text
    assert "bandwidth floor" in text and "tilekernels/floor" in text


# ----------------------------------------------------------------------------------------------------
# bench cases


def test_bench_cases_defaults_and_options():
    prefill = paged.bench_cases(paged.PREFILL, _opts(paged.PREFILL), CPU)
    assert [(c.variant, c.shape["mask"]) for c in prefill] == [("page16", "full"), ("page16", "causal")]
    assert all(list(c.providers) == list(paged.PROVIDERS[paged.PREFILL]) and c.metric == "tflops"
               for c in prefill)
    decode = paged.bench_cases(paged.DECODE, _opts(paged.DECODE, kv_dtypes="bf16,fp8e4m3", page_sizes="3,16",
                                                   kv_layout="linear", page_table="2d"), CPU)
    assert [(c.variant, c.layout) for c in decode] == [("page3", "linear/2d"), ("page16", "linear/2d"),
                                                       ("page3", "linear/2d/kv-fp8e4m3"),
                                                       ("page16", "linear/2d/kv-fp8e4m3")]
    assert all(c.metric == "tbps" and c.row_extra is not None for c in decode)
    assert decode[0].flops == 3 * 40 * 2 * 32 * 2 * 2 and decode[2].flops == decode[0].flops / 2
    # flex cannot take an fp8 cache: left out by default, kept (to fail with the reason) when named
    assert paged.FLEX in decode[0].providers and paged.FLEX not in decode[2].providers
    named = paged.bench_cases(paged.DECODE, _opts(paged.DECODE, kv_dtypes="fp8e4m3", providers="flex"), CPU)
    assert all(list(c.providers) == ["flex"] for c in named)
    for bad in ({"page_sizes": "0"}, {"page_sizes": "a"}, {"kv_dtypes": "fp16"}, {"providers": "contiguous"},
                {"dtype": torch.float32}, {"kv_layout": "vectorized", "page_sizes": "3"}, {"num_splits": 0}):
        with pytest.raises(harness.UsageError):
            paged.bench_cases(paged.DECODE, _opts(paged.DECODE, **bad), CPU)


def test_copy_bandwidth_is_measured_once():
    harness._copy_tbps.pop(str(CPU), None)     # the cache lives in the harness, shared with the norms
    first = paged.copy_bandwidth_tbps(CPU, 1.0, 1.0)
    assert first > 0 and paged.copy_bandwidth_tbps(CPU, 1.0, 1.0) == first


@needs_reference
@pytest.mark.parametrize("op", [paged.PREFILL, paged.DECODE])
def test_run_case_checks_baselines_and_rejects_a_wrong_provider(op):
    shapes = "2x4x2x24x40x32xcausal" if op == paged.PREFILL else "3x4x2x40x32"
    baseline = paged.FLEX if _has_flex() and op == paged.PREFILL else (paged.SDPA if op == paged.DECODE else None)
    if baseline is None:
        pytest.skip("no prefill baseline runs without tilekernels kernels or FlexAttention")
    (case,) = paged.bench_cases(op, _opts(op, shapes=shapes, page_sizes="3", providers=baseline,
                                          kv_layout="linear", page_table="2d"), CPU)
    good = case.providers[baseline]

    def off_by_a_little(x):
        out = good(x).clone()
        out[-1, -1, -1, 5] += 1.0        # last sequence, last head, last query: a sampled pair
        return out

    case.providers = {baseline: good, "wrong": off_by_a_little}
    run = harness.Run(op, CPU, "bench")
    harness.run_case(case, run, warmup=1, rep=1)
    assert [r["provider"] for r in run.rows] == [baseline]
    assert run.rows[0]["accuracy_ratio"] <= paged.OUT_RATIO
    assert len(run.failures) == 1 and "accuracy check failed, not timed" in run.failures[0]
    if op == paged.DECODE:
        assert {"kv_bytes", "copy_tbps", "floor_ms", "floor_ratio"} <= set(run.rows[0])


@needs_reference
def test_baseline_copies_are_built_for_every_set_on_the_first_call():
    (case,) = paged.bench_cases(paged.DECODE, _opts(paged.DECODE, shapes="2x4x2x19x16", page_sizes="3",
                                                    providers="sdpa,tilekernels"), CPU)
    sets = [case.make_inputs(i) for i in range(3)]
    case.providers["sdpa"](sets[0])
    assert all(s["derived:sdpa"]["k"].shape == (2, 4, 19, 16) for s in sets)    # none left for the timing
    assert sets[0]["paged"].block_table.equal(sets[2]["paged"].block_table)      # one page table per case
    assert not sets[0]["q"].equal(sets[1]["q"])                                 # but fresh values


@needs_reference
@needs_flex
def test_flex_paged_layout_matches_the_reference_on_a_partial_last_page():
    # Sk = 37 is not a page multiple: the last page's tail holds NaN in our cache, zeros in flex's
    (case,) = paged.bench_cases(paged.DECODE, _opts(paged.DECODE, shapes="2x4x1x37x16", page_sizes="16",
                                                    providers="flex"), CPU)
    x = case.make_inputs(0)
    assert case.check(x, case.providers["flex"](x), "flex").passed
    assert "derived:flex" in x and x["derived:flex"]["k"].shape == (1, 1, x["paged"].num_pages * 16, 16)


def test_check_case_names():
    for op in (paged.PREFILL, paged.DECODE):
        names = [c.name for c in paged.check_cases(op, CPU)]
        assert len(names) == len(set(names)) and names
    names = [c.name for c in paged.BATCH_DECODE.check_cases(CPU)]
    assert any("splits" in n for n in names) and any(n.startswith("merge-") for n in names)
    assert "bf16-q17_0_9_30-k23_11_0_20-H4-Hk2-D32-p1-linear-1d-causal" in [
        c.name for c in paged.BATCH_PREFILL.check_cases(CPU)]


# ----------------------------------------------------------------------------------------------------
# the commands end to end (tilekernels kernels under the interpreter)


@needs_kernels
def test_check_paged_commands():
    result = _cli("check", "--op", "batch_prefill", "--op", "batch_decode", "--filter", "*p3*")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed, 0 failed" in result.stdout and "batch_decode" in result.stdout


@needs_kernels
def test_bench_batch_prefill_command(tmp_path):
    result = _cli("bench", "batch_prefill", "--shapes", "2x4x2x24x40x32xcausal", "--no-record", "--out",
                  str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "batch_prefill.json").read_text())
    expected = set(paged.PROVIDERS[paged.PREFILL]) - (set() if _has_flex() else {paged.FLEX})
    assert {r["provider"] for r in rows} == expected and {r["metric"] for r in rows} == {"tflops"}
    assert "ours/contiguous" in (tmp_path / "batch_prefill.txt").read_text()


@needs_kernels
def test_bench_batch_decode_command(tmp_path):
    result = _cli("bench", "batch_decode", "--kv-dtypes", "fp8e4m3", "--page-sizes", "3", "--no-record",
                  "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "batch_decode.json").read_text())
    assert {r["provider"] for r in rows} == {"tilekernels", "sdpa"}          # flex: no fp8 caches
    assert all(r["metric"] == "tbps" and math.isfinite(r["floor_ratio"]) for r in rows)
    text = (tmp_path / "batch_decode.txt").read_text()
    assert "TB/s (median)" in text and "bandwidth floor" in text and "left out of 1 case(s)" in result.stdout
