"""tk.dist's cost model (bench/costmodel.py) on the CPU: its pieces against hand-computed values, its
fit recovering the parameters of synthetic timings made by the model itself, the rule that leaves out
what it cannot predict, and the command on the repository's measured results. The synthetic rows are
fixtures, not measurements."""

from __future__ import annotations

import json
import math

import pytest

from tilekernels.bench import costmodel as cm

AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
SHAPES = [(4096, 3584, 8192), (8192, 3584, 8192), (16384, 3584, 8192), (8192, 14336, 8192)]


def _synthetic(kappa=1.05, overhead=20e-6, worlds=(2, 4), slow=()):
    """Measured-like rows made by the model: comm from a known NCCL line, matmul from a known roofline,
    every algorithm from its timeline plus ``overhead``; ``slow`` shapes are 3x slower (a pathology)."""
    ms = {}
    comms = {2: cm.Comm(10e-6, 250e9), 4: cm.Comm(20e-6, 300e9)}
    for op in cm.OPS:
        for w in worlds:
            for M, N, K in SHAPES:
                shape = cm.gemm_shape(op, M, N, K, w)
                ms[(op, w, M, N, K, "matmul")] = 5e-6 + 2 * math.prod(shape) / 700e12
                ms[(op, w, M, N, K, "comm")] = comms[w].time(cm.comm_bytes(op, M, N, K), w)
    measured = cm.Measured(ms)
    matmul = cm.Matmul(measured)
    for op in cm.OPS:
        for w in worlds:
            comm = cm.comm_model(measured, op, w)
            for M, N, K in SHAPES:
                for algorithm in cm.ALGORITHMS:
                    t = cm.timeline(op, algorithm, M, N, K, w, kappa, comm, matmul)
                    if algorithm != "nccl":
                        t += overhead
                    if (M, N) in slow and algorithm == "copy_engine":
                        t *= 3
                    ms[(op, w, M, N, K, f"tk.{algorithm}")] = t
    return cm.Measured(ms)


def test_pieces():
    comm = cm.Comm(10e-6, 200e9)
    assert comm.time(4e9, 4) == pytest.approx(10e-6 + 3e9 / 200e9)
    measured = _synthetic()
    assert cm.fit_comm(measured, AG, 4).busbw == pytest.approx(300e9, rel=1e-6)
    assert cm.fit_comm(measured, AG, 4).alpha == pytest.approx(20e-6, rel=1e-6)
    # an unmeasured world size: the bus bandwidth of the largest measured one, latency per ring step
    at8 = cm.comm_model(measured, AG, 8)
    assert at8.busbw == pytest.approx(300e9, rel=1e-6) and at8.alpha == pytest.approx(20e-6 * 7 / 3, rel=1e-6)
    matmul = cm.Matmul(measured)
    assert matmul.peak == pytest.approx(700e12, rel=1e-6) and matmul.t0 == pytest.approx(5e-6, rel=1e-3)
    assert matmul(4096, 3584, 1024) == pytest.approx(5e-6 + 2 * 4096 * 3584 * 1024 / 700e12, rel=1e-3)
    # nccl is the sum; every overlapped timeline is at least the GEMM and at most the unoverlapped sum
    nccl = cm.timeline(AG, "nccl", 8192, 3584, 8192, 4, 1.0, at8, matmul)
    assert nccl == pytest.approx(at8.time(8192 * 8192 * 2, 4) + matmul(8192, 3584, 8192))
    ce = cm.timeline(AG, "copy_engine", 8192, 3584, 8192, 4, 1.0, cm.comm_model(measured, AG, 4), matmul)
    assert matmul(8192, 3584, 8192) < ce < nccl
    assert cm._chunked([0.0, 5.0], 0.0, 1.0) == 6.0 and cm._chunked([0.5, 1.0], 0.0, 1.0) == 3.0


def test_fit_recovers_synthetic_parameters_and_predicts_another_world():
    measured = _synthetic(kappa=1.07, overhead=30e-6)
    matmul = cm.Matmul(measured)
    for op, algorithm in ((AG, "copy_engine"), (RS, "copy_engine"), (AG, "pipelined")):
        f = cm.fit(measured, op, algorithm, [2], matmul)
        assert f.kappa == pytest.approx(1.07, abs=0.006) and f.overhead == pytest.approx(30e-6, rel=0.05)
    points = cm.validation(measured, matmul, 2, 4)
    assert points and all(abs(p["predicted_ms"] / p["measured_ms"] - 1) < 0.01 for p in points)


def test_what_it_cannot_model_is_not_predicted():
    slow = {(4096, 3584)}
    measured = _synthetic(slow=slow)
    points = cm.validation(measured, cm.Matmul(measured), 2, 4)
    rows, _ = cm.predictions(measured, 8, points)
    by_shape = {(r["op"], r["M"], r["N"]): r["ms"] for r in rows}
    assert by_shape[(AG, 4096, 3584)]["copy_engine"] is None      # 3x off the timeline at 4 GPUs
    assert by_shape[(AG, 8192, 3584)]["copy_engine"] is not None
    assert all(r["ms"]["nccl"] is not None for r in rows)
    # an algorithm whose 2 -> 4 GPU prediction misses is not predicted at all
    missed = [dict(p, predicted_ms=p["measured_ms"] * 0.7) if p["algorithm"] == "fetch" else p for p in points]
    rows, _ = cm.predictions(measured, 8, missed)
    assert all(r["ms"]["fetch"] is None for r in rows)


def test_command_on_the_measured_results(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert cm.main(["--world", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["world"] == 8 and report["validation"] and report["predictions"]
    text = capsys.readouterr().out
    assert "predicted ms at 8 GPUs" in text and "fit on 2 GPUs, predicted 4 GPUs" in text


def test_markdown_marks_predictions_and_compares_once_measured():
    """Before the predicted world size is measured the section says PREDICTED; after, every prediction
    stands next to what its algorithm measured (speedup over measured nccl)."""
    report = {"world": 8, "validation": [],
              "predictions": [{"op": "all_gather_matmul", "M": 8192, "N": 3584, "K": 8192,
                               "ms": {"nccl": 1.0, "pipelined": None, "copy_engine": 0.5, "fetch": None}}]}
    text = cm.markdown(report)
    assert "PREDICTED by the cost model, not measured" in text and "2.00x (copy_engine)" in text
    shape = ("all_gather_matmul", 8, 8192, 3584, 8192)
    measured = cm.Measured({shape + ("tk.nccl",): 1.0e-3, shape + ("tk.copy_engine",): 4.0e-3})
    text = cm.markdown(report, measured)
    assert "not measured" not in text and "against the later measurement" in text
    assert "| 2.00x (copy_engine) | 0.25x |" in text
