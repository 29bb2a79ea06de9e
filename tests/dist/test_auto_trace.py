"""``algorithm="auto"`` (dist/_auto.py), Chrome traces (dist/trace.py) and the tk.dist benchmark
(bench/dist.py) on the CPU: the choice rules on temporary tables, trace files from synthetic spans and
from the device helper under the interpreter, the bench's parsing and tables, and one smoke run of
the bench on two gloo ranks (its timings mean nothing; the plumbing is what is tested). Rows and
tables built here are synthetic fixtures, not measurements.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
import triton
import triton.language as tl

from tilekernels import bench
from tilekernels.bench import dist as dist_bench
from tilekernels.bench import results
from tilekernels.dist import _auto
from tilekernels.dist import trace as tk_trace

from .mp import run_ranks

H200 = "NVIDIA H200"
AG, RS = "all_gather_matmul", "matmul_reduce_scatter"


# ----------------------------------------------------------------------------------------------------
# auto


def _auto_row(M, N, K=8192, *, op=AG, gpu=H200, world=2, dtype="bf16", date="2026-11-22", **ms):
    return {"op": op, "gpu": gpu, "world": world, "dtype": dtype, "M": M, "N": N, "K": K, "ms": ms,
            "date": date}


TABLE = {"schema": 1, "rows": [
    _auto_row(4096, 3584, nccl=0.50, pipelined=0.48, copy_engine=0.40, fetch=0.45),
    _auto_row(16384, 3584, nccl=1.80, pipelined=1.70, copy_engine=1.60, fetch=1.30),
    _auto_row(1024, 3584, nccl=0.20, pipelined=0.25, copy_engine=0.30, fetch=None),          # all slower
    _auto_row(2048, 3584, nccl=0.30, pipelined=0.299, copy_engine=0.31),                    # within noise
    _auto_row(8192, 3584, op=RS, world=2, nccl=0.49, pipelined=0.45, copy_engine=0.52),
    _auto_row(64, 48, 80, gpu="cpu-interpreter", nccl=1.0, pipelined=0.5),
]}


def _choose(M, N, K=8192, *, op=AG, world=2, dtype=torch.bfloat16, device="cpu", table=TABLE, **kw):
    return _auto.choose(op, M, N, K, world, dtype, torch.device(device), table=table, **kw)


def test_auto_nearest_shape_fastest_algorithm():
    # Only CPU rows serve a CPU device, so the GPU rows are exercised through nearest_row + pick.
    rows = TABLE["rows"]
    assert _auto.nearest_row(rows, AG, 4096, 3584, 8192, 2, "bf16", H200)["M"] == 4096
    assert _auto.nearest_row(rows, AG, 5000, 3584, 8192, 2, "bf16", H200)["M"] == 4096
    assert _auto.nearest_row(rows, AG, 12000, 3584, 8192, 2, torch.bfloat16, H200)["M"] == 16384
    assert _auto.pick(_auto.nearest_row(rows, AG, 5000, 3584, 8192, 2, "bf16", H200)["ms"]) == "copy_engine"
    assert _auto.pick(_auto.nearest_row(rows, AG, 12000, 3584, 8192, 2, "bf16", H200)["ms"]) == "fetch"
    # algorithms the caller cannot run are never picked
    assert _auto.pick(rows[1]["ms"], allowed=("nccl", "pipelined")) == "pipelined"


def test_auto_never_slower_than_nccl():
    rows = TABLE["rows"]
    assert _auto.pick(_auto.nearest_row(rows, AG, 1024, 3584, 8192, 2, "bf16", H200)["ms"]) == "nccl"
    # 0.299 vs 0.300 is inside MIN_GAIN: noise, not a win
    assert _auto.pick(_auto.nearest_row(rows, AG, 2048, 3584, 8192, 2, "bf16", H200)["ms"]) == "nccl"
    assert _auto.pick({"pipelined": 0.1}) == "nccl"                  # no nccl time to compare with
    assert _auto.pick({"nccl": 1.0, "copy_engine": float("nan"), "fetch": -1}) == "nccl"
    assert _auto.pick({"nccl": 1.0, "auto": 0.1, "bogus": 0.1}) == "nccl"


def test_auto_falls_back_to_nccl_when_nothing_is_close():
    rows = TABLE["rows"]
    assert _auto.nearest_row(rows, AG, 256, 3584, 8192, 2, "bf16", H200) is None       # > 2x in M
    assert _auto.nearest_row(rows, AG, 4096, 3584, 2048, 2, "bf16", H200) is None      # > 2x in K
    assert _auto.nearest_row(rows, AG, 4096, 3584, 8192, 4, "bf16", H200) is None      # another world size
    assert _auto.nearest_row(rows, AG, 4096, 3584, 8192, 2, "fp16", H200) is None      # another dtype
    assert _auto.nearest_row(rows, AG, 2 * 16384, 3584, 8192, 2, "bf16", H200)["M"] == 16384   # 2x: close
    assert _choose(64, 48, 80) == "pipelined"                       # a CPU table serves the CPU
    assert _choose(4096, 3584) == "nccl"                            # GPU rows never do
    assert _choose(64, 48, 80, world=3) == "nccl"
    assert _choose(64, 48, 80, table={"rows": []}) == "nccl"
    with pytest.raises(ValueError, match="op must be"):
        _choose(64, 48, 80, op="gemm")


def test_auto_prefers_the_same_gpu_then_any_gpu():
    rows = [_auto_row(4096, 3584, gpu="NVIDIA H100 80GB HBM3", nccl=1.0, fetch=0.5),
            _auto_row(8192, 3584, gpu=H200, nccl=1.0, copy_engine=0.5)]
    assert _auto.nearest_row(rows, AG, 4096, 3584, 8192, 2, "bf16", H200)["gpu"] == H200
    other = _auto.nearest_row(rows, AG, 4096, 3584, 8192, 2, "bf16", "NVIDIA B200")
    assert other["gpu"].startswith("NVIDIA H100")
    assert _auto.nearest_row(rows, AG, 4096, 3584, 8192, 2, "bf16", "cpu-interpreter") is None
    # equally near rows: the newest wins
    twins = [_auto_row(4096, 3584, date="2026-11-01", nccl=1.0, fetch=0.5),
             _auto_row(4096, 3584, date="2026-11-20", nccl=1.0, copy_engine=0.5)]
    assert _auto.pick(_auto.nearest_row(twins, AG, 4096, 3584, 8192, 2, "bf16", H200)["ms"]) == "copy_engine"


def test_auto_rejects_a_slow_tail_and_asks_more_of_predictions(tmp_path, monkeypatch):
    ms = {"nccl": 0.067, "copy_engine": 0.065}
    assert _auto.pick(ms) == "copy_engine"                                   # 3% faster at p50
    assert _auto.pick(ms, p80={"nccl": 0.068, "copy_engine": 2.2}) == "nccl"  # but a tail of slow calls
    assert _auto.pick(ms, p80={"nccl": 0.068, "copy_engine": 0.070}) == "copy_engine"
    assert _auto.pick({"nccl": 1.0, "copy_engine": 0.92}, min_gain=_auto.MODEL_MIN_GAIN) == "nccl"
    assert _auto.pick({"nccl": 1.0, "copy_engine": 0.85}, min_gain=_auto.MODEL_MIN_GAIN) == "copy_engine"
    cpu = "cpu-interpreter"
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"rows": [_auto_row(64, 48, 80, gpu=cpu, world=4, nccl=1.0, pipelined=0.5)]}))
    monkeypatch.setenv(_auto.TABLE_ENV, str(path))
    _auto.clear_cache()
    try:
        predicted = [_auto_row(64, 48, 80, gpu=cpu, world=w, nccl=1.0, pipelined=p) for w, p in ((4, 0.1), (8, 0.92))]
        assert "1 predicted rows written, 1 left to measurements" in _auto.add_model_rows(predicted)
        rows = {r["world"]: r for r in json.loads(path.read_text())["rows"]}
        assert rows[4]["ms"]["pipelined"] == 0.5 and "source" not in rows[4]      # the measurement stays
        assert rows[8]["source"] == "model"
        assert _auto.choose(AG, 64, 48, 80, 4, torch.bfloat16, "cpu") == "pipelined"
        assert _auto.choose(AG, 64, 48, 80, 8, torch.bfloat16, "cpu") == "nccl"    # 8% predicted: not enough
    finally:
        _auto.clear_cache()


def test_auto_table_file_cache_env_and_update(tmp_path, monkeypatch):
    shipped = json.loads(_auto.TABLE_PATH.read_text())
    assert shipped["schema"] == _auto.SCHEMA and "ms" in shipped["schema_doc"]
    for row in shipped["rows"]:  # measured rows: every field auto reads, and nccl measured for each
        assert {"op", "gpu", "world", "dtype", "M", "N", "K", "ms"} <= set(row) and row["ms"].get("nccl")

    path = tmp_path / "table.json"
    monkeypatch.setenv(_auto.TABLE_ENV, str(path))
    _auto.clear_cache()
    try:
        assert _auto.load_table()["rows"] == []                       # missing file: empty, nccl
        assert _auto.choose(AG, 64, 48, 80, 2, torch.bfloat16, "cpu") == "nccl"
        bench_rows = [
            {"op": AG, "provider": "tk." + alg, "algorithm": alg, "shape": {"M": 64, "N": 48, "K": 80},
             "dtype": "bf16", "metric": "ms", "p50": ms, "status": status, "world": 2,
             "gpu": "cpu-interpreter", "run_id": "r1", "date": "2026-11-22T00:00:00+00:00"}
            for alg, ms, status in (("nccl", 1.0, "ok"), ("pipelined", 0.6, "ok"), ("fetch", None, "failed"))]
        bench_rows.append(dict(bench_rows[0], provider="nccl+cublas", algorithm=None, p50=0.1))
        messages = _auto.update_table(bench_rows)
        assert "1 new rows" in messages[0]
        stored = json.loads(path.read_text())
        assert stored["rows"] == [{"op": AG, "gpu": "cpu-interpreter", "world": 2, "dtype": "bf16", "M": 64,
                                   "N": 48, "K": 80, "ms": {"nccl": 1.0, "pipelined": 0.6}, "p80": {},
                                   "run_id": "r1",
                                   "date": "2026-11-22T00:00:00+00:00"}]
        assert _auto.choose(AG, 64, 48, 80, 2, torch.bfloat16, "cpu") == "pipelined"
        path.write_text(json.dumps({"rows": []}))                      # cached until clear_cache()
        assert _auto.choose(AG, 64, 48, 80, 2, torch.bfloat16, "cpu") == "pipelined"
        _auto.clear_cache()
        assert _auto.choose(AG, 64, 48, 80, 2, torch.bfloat16, "cpu") == "nccl"
        path.write_text("not json")
        _auto.clear_cache()
        assert _auto.choose(AG, 64, 48, 80, 2, torch.bfloat16, "cpu") == "nccl"
    finally:
        _auto.clear_cache()


# ----------------------------------------------------------------------------------------------------
# traces


def _spans():
    return [tk_trace.Span("gather", "stream 1", 0.0, 50.0, rank=0),
            tk_trace.Span("gemm chunk 0", "stream 0", 10.0, 30.0, rank=0, args={"chunk": 0}),
            tk_trace.Span("compute", "gemm program 10", 12.0, 5.0, rank=0, cat="gemm"),
            tk_trace.Span("wait", "gemm program 2", 11.0, 3.0, rank=0, cat="gemm"),
            tk_trace.Span("gather", "stream 1", 1.0, 40.0, rank=1)]


def test_chrome_trace_structure_from_synthetic_spans(tmp_path):
    trace = tk_trace.chrome_trace(_spans(), {"title": "t"})
    assert trace["otherData"] == {"title": "t"}
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 5
    for e in spans:
        assert set(e) >= {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}
        assert isinstance(e["tid"], int) and e["pid"] in (0, 1) and e["dur"] >= 0
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    # streams first, then programs in numeric order (2 before 10)
    assert [lanes[(0, t)] for t in range(4)] == ["stream 0", "stream 1", "gemm program 2", "gemm program 10"]
    assert lanes[(1, 0)] == "stream 1"
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    chunk = next(e for e in spans if e["name"] == "gemm chunk 0")
    assert chunk["ts"] == 10.0 and chunk["dur"] == 30.0 and chunk["args"] == {"lane": "stream 0", "chunk": 0}

    rank0 = tk_trace.write_chrome_trace(tmp_path / "r0.json", [s for s in _spans() if s.rank == 0])
    rank1 = tk_trace.write_chrome_trace(tmp_path / "r1.json", [s for s in _spans() if s.rank == 1])
    merged = tk_trace.read_chrome_trace(tk_trace.merge_chrome_traces([rank0, rank1], tmp_path / "all.json"))
    assert {e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"} == {0, 1}
    with pytest.raises(ValueError, match="not a Chrome trace"):
        tk_trace.read_chrome_trace({"events": []})


def test_resolve_trace_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tk_trace.resolve_trace_path(False, 0) is None and tk_trace.resolve_trace_path(None, 3) is None
    assert tk_trace.resolve_trace_path(True, 1) == tmp_path / "tilekernels-trace-rank1.json"
    assert tk_trace.resolve_trace_path("out/t-{rank}.json", 2) == pathlib.Path("out/t-2.json")
    assert tk_trace.resolve_trace_path("out/t.json", 2) == pathlib.Path("out/t-rank2.json")
    with pytest.raises(TypeError):
        tk_trace.resolve_trace_path(3, 0)


@triton.jit
def _traced_kernel(events, clock, MAX_EVENTS: tl.constexpr, TRACE: tl.constexpr):
    pid = tl.program_id(0)
    slot = 0
    for step in range(3):
        if TRACE:
            t_wait = tk_trace.trace_clock(clock)
        # (a wait would spin here)
        if TRACE:
            slot = tk_trace.trace_event(events, clock, pid, slot, tk_trace.TRACE_WAIT, t_wait, step,
                                        MAX_EVENTS)
            t_compute = tk_trace.trace_clock(clock)
            slot = tk_trace.trace_event(events, clock, pid, slot, tk_trace.TRACE_COMPUTE, t_compute,
                                        10 * pid + step, MAX_EVENTS)


def test_device_trace_helper_under_the_interpreter(tmp_path):
    tracer = tk_trace.Tracer("cpu", rank=1)
    with tracer.span("setup", lane="stream 0"):
        torch.randn(8, 8).sum()
    dev = tracer.device_trace("gemm", programs=3, max_events=4)
    _traced_kernel[(3,)](dev.events, dev.clock, MAX_EVENTS=dev.max_events, TRACE=dev.enabled)
    events = dev.events
    assert events.shape == (3, 4, tk_trace.FIELDS)
    # 6 events per program, 4 rows: the last two dropped; kinds alternate wait, compute
    assert events[:, :, 0].tolist() == [[2, 3, 2, 3]] * 3
    assert events[:, :, 3].tolist() == [[0, 0, 1, 1], [0, 10, 1, 11], [0, 20, 1, 21]]
    starts, ends = events[:, :, 1], events[:, :, 2]
    assert bool((ends > starts).all())                                  # counter ticks: start before end
    flat = torch.stack([starts, ends], -1).flatten()
    for program in range(3):                                            # programs ran one after another
        ticks = torch.stack([starts[program], ends[program]], -1).flatten()
        assert bool((ticks[1:] > ticks[:-1]).all())
    assert int(flat.max()) < int(dev.clock.item())

    spans = tracer.spans()
    device = [s for s in spans if s.cat == "gemm"]
    setup = next(s for s in spans if s.name == "setup")
    assert len(device) == 12 and {s.name for s in device} == {"wait", "compute"}
    assert {s.lane for s in device} == {"gemm program 0", "gemm program 1", "gemm program 2"}
    assert all(s.rank == 1 and s.dur_us == 1.0 for s in device)
    assert min(s.start_us for s in device) >= setup.start_us + setup.dur_us   # aligned after the setup span

    path = tracer.finish(tmp_path / "k.json", title="kernel")
    assert path == tmp_path / "k-rank1.json"
    trace = json.loads(path.read_text())
    assert trace["otherData"]["title"] == "kernel" and "counter" in trace["otherData"]["clock"]
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 13


def test_disabled_tracer_and_traced_call(tmp_path):
    off = tk_trace.Tracer("cpu", rank=0, enabled=False)
    with off.span("nothing"):
        pass
    placeholder = off.device_trace("gemm", programs=100)
    assert not placeholder.enabled and placeholder.events.numel() == tk_trace.FIELDS
    assert off.spans() == [] and off.finish(True) is None
    # outside traced_call the module functions are no-ops
    assert tk_trace.active_tracer() is None
    assert not tk_trace.device_trace("gemm", 4, "cpu").enabled
    with tk_trace.span("ignored"):
        pass

    def op(x, scale, *, algorithm, trace):
        assert trace is False and tk_trace.active_tracer() is not None
        with tk_trace.span("step 1", lane="stream 1"):
            y = x * scale
        dev = tk_trace.device_trace("gemm", 2, x.device, max_events=2)
        _traced_kernel[(2,)](dev.events, dev.clock, MAX_EVENTS=dev.max_events, TRACE=dev.enabled)
        return y

    out = tk_trace.traced_call(op, str(tmp_path / "op-{rank}.json"), 3, torch.ones(4), 2.0,
                               algorithm="pipelined")
    assert torch.equal(out, torch.full((4,), 2.0)) and tk_trace.active_tracer() is None
    trace = json.loads((tmp_path / "op-3.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"call", "stream 1", "gemm program 0", "gemm program 1"}
    call = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["lane"] == "call")
    assert call["name"] == "op (pipelined)" and call["pid"] == 3
    assert trace["otherData"]["algorithm"] == "pipelined"


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib")
    source = tk_trace.write_chrome_trace(tmp_path / "t.json", _spans())
    png = tk_trace.render_png(source, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_samples_program_lanes():
    """A kernel of many programs is drawn as at most max_program_lanes of them, evenly spaced and
    including the first and the last; stream lanes all stay."""
    names = {(0, 0): "stream 0", (0, 1): "stream 1"}
    names.update({(0, 2 + p): f"GEMM 0 program {p}" for p in range(132)})
    names.update({(1, p): f"GEMM 0 program {p}" for p in range(3)})
    lanes = sorted(names)
    kept, dropped = tk_trace._sampled_lanes(lanes, names, 8)
    programs = [names[lane] for lane in kept if lane[0] == 0 and "program" in names[lane]]
    assert len(programs) == 8 and programs[0] == "GEMM 0 program 0" and programs[-1] == "GEMM 0 program 131"
    assert (0, 0) in kept and (0, 1) in kept and all((1, p) in kept for p in range(3))
    assert dropped == 132 - 8


# ----------------------------------------------------------------------------------------------------
# the bench: parsing and tables


def test_dist_bench_is_registered_and_parses():
    module = bench.load_op(AG)
    assert module is dist_bench.ALL_GATHER_MATMUL and module.NAME == AG
    assert bench.load_op(RS).NAME == RS and module.check_cases(torch.device("cpu")) == []
    assert dist_bench.parse_shapes("4096x3584, 64X48×80") == [{"M": 4096, "N": 3584, "K": 8192},
                                                              {"M": 64, "N": 48, "K": 80}]
    for bad in ("4096", "0x8", "axb", "", "1x2x3x4"):
        with pytest.raises(ValueError):
            dist_bench.parse_shapes(bad)
    assert dist_bench.parse_algorithms(None, on_gpu=False) == ["nccl", "pipelined"]
    assert dist_bench.parse_algorithms(None, on_gpu=True) == list(dist_bench.ALGORITHMS)
    assert dist_bench.parse_algorithms("fetch, auto", on_gpu=True) == ["fetch", "auto"]
    with pytest.raises(ValueError, match="unknown"):
        dist_bench.parse_algorithms("nccl,magic", on_gpu=True)
    assert dist_bench.shape_problem(AG, {"M": 64, "N": 8, "K": 9}, 2) is None
    assert "K = 9" in dist_bench.shape_problem(RS, {"M": 64, "N": 8, "K": 9}, 2)
    assert "M = 33" in dist_bench.shape_problem(AG, {"M": 33, "N": 8, "K": 8}, 2)


def _bench_row(provider, M, N, p50, *, op=AG, status="ok", error="", world=2, gpu=H200, run_id="r1"):
    algorithm = provider[3:] if provider.startswith("tk.") else None
    timed = status == "ok"
    return {"op": op, "provider": provider, "algorithm": algorithm, "shape": {"M": M, "N": N, "K": 8192},
            "dtype": "bf16", "layout": "RR", "variant": f"world {world}", "metric": "ms",
            "p20": p50 * 0.98 if timed else None, "p50": p50 if timed else None,
            "p80": p50 * 1.02 if timed else None, "ms": p50 if timed else None, "status": status,
            "error": error, "world": world, "mode": "bench",
            "timing": "eager", "run_id": run_id, "date": "2026-11-22T00:00:00+00:00", "gpu": gpu,
            "torch": "2.13", "triton": "3.9", "tilekernels": "0.1.0", "commit": None, "interpreter": False}


SYNTHETIC = [_bench_row("nccl+cublas", 8192, 3584, 0.934), _bench_row("comm", 8192, 3584, 0.308),
             _bench_row("matmul", 8192, 3584, 0.616), _bench_row("tk.copy_engine", 8192, 3584, 0.700),
             _bench_row("torch.fused", 8192, 3584, 0.900),
             _bench_row("tk.fetch", 8192, 3584, 0, status="failed", error="raised RuntimeError: boom"),
             _bench_row("nccl+cublas", 512, 3584, 0.100), _bench_row("tk.copy_engine", 512, 3584, 0.125)]


def test_report_rows_ms_speedup_and_limit():
    text = dist_bench.report_rows(SYNTHETIC)
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("shape (MxNxK)"))
    # tk algorithms first, then torch, baseline, comm, matmul, limit
    assert header.split() == ["shape", "(MxNxK)", "tk.copy_engine", "tk.fetch", "torch.fused", "nccl+cublas",
                              "comm", "matmul", "limit"]
    ms_line = next(ln for ln in lines if ln.startswith("8192x3584x8192"))
    assert ms_line.split() == ["8192x3584x8192", "0.700", "failed", "0.900", "0.934", "0.308", "0.616",
                               "0.616"]
    ratio_line = [ln for ln in lines if ln.startswith("8192x3584x8192")][1]
    assert f"{0.934 / 0.7:.2f}x · {0.616 / 0.7:.2f}" in ratio_line
    assert f"{0.934 / 0.616:.2f}x · 1.00" in ratio_line                 # the limit column
    small = [ln for ln in lines if ln.startswith("512x3584x8192")]
    assert small[0].split()[-1] == "-" and "0.80x · -" in small[1]         # no comm/matmul: no limit
    speed = math.sqrt(0.934 / 0.7 * 0.1 / 0.125)
    assert (f"tk.copy_engine vs nccl+cublas: geomean {speed:.3f}x over 2 shape(s), min 0.800x at "
            "512x3584x8192") in text
    assert "failed: tk.fetch at 8192x3584x8192: raised RuntimeError: boom" in text
    assert f"geomean {0.934 / 0.934:.3f} over 1 shape(s)" in text            # vs the ANCHORS.md baseline
    markdown = dist_bench.report_rows(SYNTHETIC, markdown=True)
    assert "| 8192x3584x8192 | 0.700 | failed |" in markdown and markdown.startswith("#### ")


def test_results_md_uses_the_dist_tables(tmp_path):
    run_file = tmp_path / "all_gather_matmul.json"
    run_file.write_text(json.dumps(SYNTHETIC))
    results_dir = tmp_path / "benchmarks" / "results"
    results.import_rows(results_dir, [run_file])
    text = results.write_results_md(results_dir).read_text()
    assert "## all_gather_matmul — nvidia-h200" in text
    assert "speedup vs nccl+cublas" in text and "| 8192x3584x8192 | 0.700 | failed |" in text
    traces = results_dir / "nvidia-h200" / "traces"
    traces.mkdir()
    (traces / "ag-8192x3584.png").write_bytes(b"\x89PNG")
    (traces / "ag-8192x3584.txt").write_text("copy_engine, 2 ranks: the pushes end before the GEMM needs them.\n")
    text = results.write_results_md(results_dir).read_text()
    assert ("## tk.dist timelines — nvidia-h200\n\ncopy_engine, 2 ranks: the pushes end before the GEMM needs them."
            "\n\n![ag-8192x3584](results/nvidia-h200/traces/ag-8192x3584.png)") in text


# ----------------------------------------------------------------------------------------------------
# the bench on two gloo ranks


def _smoke_body(rank, world, out_dir):
    import argparse

    from tilekernels.bench.harness import Accuracy, Run

    out_dir = pathlib.Path(out_dir)
    common = {"shapes": "64x48x80", "warmup": 1.0, "rep": 5.0, "seed": 0, "dtype": torch.bfloat16,
              "no_record": True}
    status = dist_bench.bench_in_group(AG, argparse.Namespace(out=out_dir / "ag", algorithms="nccl,pipelined",
                                                              trace=True, **common))
    assert status in (0, 1)
    dist_bench.bench_in_group(RS, argparse.Namespace(out=out_dir / "rs", algorithms="nccl", **common))

    # A provider that fails on one rank only: every rank reports it, and the ranks stay in step.
    opts = dist_bench._defaults(argparse.Namespace(**common))
    group = torch.distributed.group.WORLD
    ctx = dist_bench.Context(AG, rank, world, torch.device("cpu"), group, group.group_name, opts,
                             Run(AG, torch.device("cpu"), "bench"), flag=torch.zeros(1))
    calls = []

    def flaky(x):
        calls.append(1)
        if rank == 1 and len(calls) > 2:
            raise RuntimeError("lost a peer")
        return torch.ones(2)

    def wrong_on_rank_0(name, out):
        return Accuracy(rank != 0, 5.0 if rank == 0 else 1.0, "far off")

    case = dist_bench.Case(AG, {"M": 4, "N": 4, "K": 4}, torch.bfloat16, [{}], [], check=wrong_on_rank_0)
    row = dist_bench.measure(ctx, case, dist_bench.Provider("flaky", flaky, checked=False))
    assert row["status"] == "failed" and "rank 1: RuntimeError: lost a peer" in row["error"], row
    row = dist_bench.measure(ctx, case, dist_bench.Provider("wrong", lambda x: torch.ones(2)))
    assert row["status"] == "wrong" and row["accuracy_ratio"] == 5.0 and "rank 0" in row["error"], row
    row = dist_bench.measure(ctx, case, dist_bench.Provider("ok", lambda x: torch.ones(2), checked=False))
    assert row["status"] == "ok" and row["p20"] <= row["p50"] <= row["p80"] and row["reps"] >= 3


def test_bench_smoke_on_two_gloo_ranks(tmp_path):
    run_ranks(_smoke_body, 2, str(tmp_path), backend="gloo", timeout_s=300)
    rows = json.loads((tmp_path / "ag" / "all_gather_matmul.json").read_text())
    by_provider = {r["provider"]: r for r in rows}
    assert set(by_provider) == {"tk.nccl", "tk.pipelined", "nccl+cublas", "comm", "matmul"}
    for name in ("nccl+cublas", "comm", "matmul"):
        r = by_provider[name]
        assert r["status"] == "ok" and r["p20"] <= r["p50"] <= r["p80"] and r["world"] == 2
        assert r["metric"] == "ms" and r["backend"] == "gloo" and r["interpreter"] is True
    assert by_provider["nccl+cublas"]["accuracy_ratio"] is not None
    assert by_provider["nccl+cublas"]["speedup"] == 1.0 and "of_limit" in by_provider["nccl+cublas"]
    for name in ("tk.nccl", "tk.pipelined"):          # tk.dist may still be in progress: ok or reported
        assert by_provider[name]["status"] == "ok" or by_provider[name]["error"]
    text = (tmp_path / "ag" / "all_gather_matmul.txt").read_text()
    assert "speedup vs nccl+cublas" in text and "64x48x80" in text
    if by_provider["tk.nccl"]["status"] == "ok":
        assert (tmp_path / "ag" / "traces" / "all_gather_matmul-64x48x80-nccl.json").exists()
    rs = {r["provider"]: r for r in json.loads((tmp_path / "rs" / "matmul_reduce_scatter.json").read_text())}
    assert set(rs) == {"tk.nccl", "nccl+cublas", "comm", "matmul"} and rs["nccl+cublas"]["status"] == "ok"
