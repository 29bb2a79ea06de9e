"""A cost model of tk.dist's algorithms, for world sizes no machine here had (8 GPUs).

``python -m tilekernels bench costmodel`` reads the measured tk.dist rows in
``benchmarks/results/<gpu>/{all_gather_matmul,matmul_reduce_scatter}.json`` (2 and 4 H200s), fits
the model's few free parameters on the 2-GPU rows, reports its error on the 4-GPU rows (a prediction
it never saw), refits on both and predicts every algorithm at ``--world`` (default 8) on the same
shapes. ``--write-auto-table`` stores the predictions in ``auto_table.json`` as rows with
``"source": "model"``, which ``auto`` trusts only with a larger margin (``_auto.MODEL_MIN_GAIN``).

The model (times in seconds; W ranks; bf16; S = bytes)
-------------------------------------------------------
Measured constants (``PARAMS``; 4x and 2x H200, 2026-11-22, probes described in benchmarks/NOTES.md):

- copy-engine push of S bytes to one peer: ``CE_LATENCY + S / CE_BW`` (5.2 us + S / 378 GB/s fits
  0.25-64 MiB within 10%, the same at 2 and 4 ranks: each rank pushes to one peer at a time, a
  permutation, so links do not share); a flag write is one such copy of 4 bytes.
- HBM copy (own shard, return_a clone): ``2 S / HBM_COPY_BW`` (read + write).
- NCCL all-gather / reduce-scatter of a total of S bytes: ``alpha_W + S (W-1)/W / busbw_W``, fitted
  per W from the measured ``comm`` rows; at W = 8 (not measured) ``busbw_8 = busbw_4`` (an NVSwitch
  gives every GPU its full NVLink bandwidth at any W; NCCL's ring bus bandwidth is flat from 4 to 8
  GPUs on such systems) and ``alpha_8 = alpha_4 * 7/3`` (latency grows with the ring's steps).
- cuBLAS matmul: the measured ``matmul`` row where the GEMM's shape was measured (all-gather: the
  global M x N x K, the same at every W), else ``t0 + 2MNK / peak`` fitted on every measured matmul.

Free parameters, fitted per (op, algorithm): ``kappa`` (our GEMM's time relative to cuBLAS inside that
algorithm: tile shape, the SMs NCCL's kernels take, HBM the copies take) and ``overhead`` (launches,
begin/end flags, the host-visible gaps between kernels).

Algorithms, each a timeline of chunk arrivals and GEMMs (g = kappa * matmul / W per chunk):

- ``nccl``: comm + matmul + overhead.
- all_gather ``copy_engine``: own-shard copy, then the GEMM of chunk j (own first) starts at
  ``max(end of chunk j-1, arrival_j)``, ``arrival_j = j * push(S_shard)`` (peers push in pivot
  order); then the return_a clone.
- all_gather ``pipelined``: the same with NCCL P2P steps (``alpha_W / (W-1) + S_shard / busbw_W``).
- all_gather ``fetch``: the same with SM fetchers (``FETCH_BW``) on 1/8 of the SMs (g / (7/8)).
- reduce_scatter ``copy_engine``: W-1 partial GEMMs (rows M/W, K/W), each pushed after it is computed
  (pushes queue on one stream), own partial last, then the fp32 reduction reads W partials.
- reduce_scatter ``fetch``: the partial GEMMs store over NVLink (``max(g, S_partial / CE_BW)``).
- reduce_scatter ``pipelined``: each partial sent by NCCL P2P after its GEMM.

What it does not capture (so its rows say so): at small M the measured copy_engine/fetch
all-gathers are 2-5x slower than this timeline (copy-engine pushes run ~10x slower while the waiting
GEMM of the "medium" config runs; cause not found yet, benchmarks/NOTES.md). Where the model
underestimates a measured time at W = 4 by more than ``UNRELIABLE`` for a shape, the prediction for
that (algorithm, shape) at other W is dropped (``null``), so ``auto`` never picks it; an algorithm whose
fit on 2 GPUs predicted the 4-GPU times of the shapes it models with a median error above
``VALIDATION_LIMIT``, or modelled fewer than half of them, is not predicted at all (``pipelined`` of
both ops missed by 12-48% and the reduce-scatter ``fetch`` by 24%: NCCL's P2P steps and remote
stores cost more at 4 ranks than this timeline says).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
ALGORITHMS = ("nccl", "pipelined", "copy_engine", "fetch")
ITEMSIZE = 2  # bf16
UNRELIABLE = 0.30
VALIDATION_LIMIT = 0.10


@dataclasses.dataclass(frozen=True)
class Params:
    """Measured constants (see the module docstring for where each comes from)."""

    ce_latency: float = 5.2e-6
    ce_bw: float = 378e9
    hbm_copy_bw: float = 3.0e12
    fetch_bw: float = 330e9
    sms_for_fetch: float = 1 / 8


PARAMS = Params()


@dataclasses.dataclass
class Comm:
    """NCCL collective time ``alpha + S (W-1)/W / busbw`` for one world size."""

    alpha: float
    busbw: float

    def time(self, nbytes: float, world: int) -> float:
        return self.alpha + nbytes * (world - 1) / world / self.busbw


@dataclasses.dataclass
class Measured:
    """The newest measured ms per (op, world, M, N, K, provider) from the results files."""

    ms: dict

    def get(self, op, world, M, N, K, provider):
        return self.ms.get((op, world, M, N, K, provider))

    def shapes(self, op, world):
        return sorted({k[2:5] for k in self.ms if k[0] == op and k[1] == world})

    def worlds(self, op):
        return sorted({k[1] for k in self.ms if k[0] == op})


def load_measured(results_dir: pathlib.Path, gpu: str = "nvidia-h200") -> Measured:
    """The newest p50 (ms -> s) of each provider per shape; bf16, status ok, GPU rows only."""
    newest: dict = {}
    for op in OPS:
        path = results_dir / gpu / f"{op}.json"
        if not path.exists():
            continue
        for r in json.loads(path.read_text()):
            if r.get("status") != "ok" or r.get("dtype") != "bf16" or r.get("interpreter") or not r.get("p50"):
                continue
            shape = r["shape"]
            key = (op, int(r["world"]), int(shape["M"]), int(shape["N"]), int(shape["K"]), r["provider"])
            if key not in newest or str(r.get("date")) >= newest[key][0]:
                newest[key] = (str(r.get("date")), float(r["p50"]) * 1e-3)
    return Measured({k: v for k, (_, v) in newest.items()})


# ----------------------------------------------------------------------------------------------------
# the pieces


def comm_bytes(op: str, M: int, N: int, K: int) -> float:
    """Bytes of the collective's whole buffer: the gathered A, or the full output before scattering."""
    return (M * K if op == "all_gather_matmul" else M * N) * ITEMSIZE


def gemm_shape(op: str, M: int, N: int, K: int, world: int) -> tuple[int, int, int]:
    return (M, N, K) if op == "all_gather_matmul" else (M, N, K // world)


def _line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = intercept + slope * x``; the intercept is clamped at 0 (a time)."""
    n = len(points)
    sx, st = sum(x for x, _ in points), sum(t for _, t in points)
    sxx, sxt = sum(x * x for x, _ in points), sum(x * t for x, t in points)
    slope = (n * sxt - sx * st) / (n * sxx - sx * sx)
    return max(0.0, (st - slope * sx) / n), slope


def fit_comm(measured: Measured, op: str, world: int) -> Comm | None:
    """Least squares of ``t = alpha + x / busbw`` over the measured comm rows at this world size."""
    xs, ts = [], []
    for M, N, K in measured.shapes(op, world):
        t = measured.get(op, world, M, N, K, "comm")
        if t:
            xs.append(comm_bytes(op, M, N, K) * (world - 1) / world)
            ts.append(t)
    if len(xs) < 2:
        return None
    alpha, slope = _line_fit(list(zip(xs, ts)))
    return Comm(alpha, 1 / slope)


def comm_model(measured: Measured, op: str, world: int) -> Comm:
    fitted = fit_comm(measured, op, world)
    if fitted is not None:
        return fitted
    known = [w for w in measured.worlds(op) if fit_comm(measured, op, w) is not None]
    if not known:
        raise ValueError(f"no measured comm rows for {op}")
    base_world = max(known)
    base = fit_comm(measured, op, base_world)
    return Comm(base.alpha * (world - 1) / (base_world - 1), base.busbw)


class Matmul:
    """cuBLAS time: measured where that GEMM shape was measured, else ``t0 + 2MNK / peak``."""

    def __init__(self, measured: Measured):
        self.table = {}
        points = []
        for (op, world, M, N, K, provider), t in measured.ms.items():
            if provider == "matmul":
                shape = gemm_shape(op, M, N, K, world)
                self.table[shape] = t
                points.append((2 * math.prod(shape), t))
        self.t0, slope = _line_fit(points)
        self.peak = 1 / slope

    def __call__(self, M: int, N: int, K: int) -> float:
        return self.table.get((M, N, K), self.t0 + 2 * M * N * K / self.peak)


# ----------------------------------------------------------------------------------------------------
# algorithm timelines (without the fitted overhead; kappa scales our GEMMs)


def _push(nbytes: float, p: Params) -> float:
    return p.ce_latency + nbytes / p.ce_bw


def _chunked(arrivals: Sequence[float], start: float, g: float) -> float:
    """End of GEMMs over chunks in order: chunk j starts at max(previous end, its arrival)."""
    end = start + g
    for arrival in arrivals:
        end = max(end, arrival) + g
    return end


def timeline(op: str, algorithm: str, M: int, N: int, K: int, world: int, kappa: float, comm: Comm,
             matmul: Matmul, p: Params = PARAMS) -> float:
    W = world
    mm = matmul(*gemm_shape(op, M, N, K, W))
    if algorithm == "nccl":
        return comm.time(comm_bytes(op, M, N, K), W) + mm
    if op == "all_gather_matmul":
        shard = M // W * K * ITEMSIZE
        g = kappa * mm / W
        own = 2 * shard / p.hbm_copy_bw
        clone = 2 * M * K * ITEMSIZE / p.hbm_copy_bw
        if algorithm == "copy_engine":
            arrivals = [j * (_push(shard, p) + p.ce_latency) for j in range(1, W)]
            return _chunked(arrivals, own, g) + clone
        if algorithm == "pipelined":
            step = comm.alpha / max(1, W - 1) + shard / comm.busbw
            return _chunked([j * step for j in range(1, W)], 0.0, g)
        if algorithm == "fetch":
            step = shard / p.fetch_bw
            return _chunked([j * step for j in range(1, W)], own, g / (1 - p.sms_for_fetch))
        raise ValueError(algorithm)
    partial = M // W * N * ITEMSIZE
    g = kappa * mm / W
    reduce = (W * partial + 2 * partial) / p.hbm_copy_bw  # W-1 partials + own fp32 read, one write
    if algorithm in ("copy_engine", "pipelined"):
        if algorithm == "copy_engine":
            send = _push(partial, p) + p.ce_latency
        else:
            send = comm.alpha / max(1, W - 1) + partial / comm.busbw
        pushed = 0.0
        for j in range(1, W):
            pushed = max(pushed, j * g) + send
        return max(W * g, pushed) + reduce
    if algorithm == "fetch":
        g_remote = max(g, partial / p.ce_bw)
        return (W - 1) * g_remote + g + p.ce_latency + reduce
    raise ValueError(algorithm)


# ----------------------------------------------------------------------------------------------------
# fitting and predicting


@dataclasses.dataclass
class Fit:
    kappa: float
    overhead: float
    reliable: dict  # (M, N, K) -> bool, from the newest measured world


def _provider(algorithm: str) -> str:
    return f"tk.{algorithm}"


def fit(measured: Measured, op: str, algorithm: str, worlds: Sequence[int], matmul: Matmul) -> Fit | None:
    """kappa (grid 0.90-1.50) and overhead (median residual) minimising squared log error over the
    measured shapes of ``worlds``, leaving out shapes the timeline cannot describe (UNRELIABLE)."""
    samples = []
    for w in worlds:
        comm = comm_model(measured, op, w)
        for M, N, K in measured.shapes(op, w):
            t = measured.get(op, w, M, N, K, _provider(algorithm))
            if t:
                samples.append((w, M, N, K, t, comm))
    if not samples:
        return None
    best = None
    for step in range(61):
        kappa = 0.90 + 0.01 * step
        bases = [timeline(op, algorithm, M, N, K, w, kappa, comm, matmul) for w, M, N, K, _, comm in samples]
        # Shapes the timeline underestimates badly are the pathology it does not model: not fitted.
        keep = [(b, s[4]) for b, s in zip(bases, samples) if _modelled(b, s[4])]
        if not keep:
            continue
        residuals = sorted(t - b for b, t in keep)
        overhead = max(0.0, residuals[len(residuals) // 2])
        err = sum(math.log((b + overhead) / t) ** 2 for b, t in keep) / len(keep)
        if best is None or err < best[0]:
            best = (err, kappa, overhead)
    if best is None:
        return None
    _, kappa, overhead = best
    reliable = {}
    newest = max(worlds)
    comm = comm_model(measured, op, newest)
    for M, N, K in measured.shapes(op, newest):
        t = measured.get(op, newest, M, N, K, _provider(algorithm))
        if t:
            model = timeline(op, algorithm, M, N, K, newest, kappa, comm, matmul) + overhead
            reliable[(M, N, K)] = _modelled(model, t)
    return Fit(kappa, overhead, reliable)


def predict(op: str, algorithm: str, M: int, N: int, K: int, world: int, f: Fit, measured: Measured,
            matmul: Matmul) -> float | None:
    if not f.reliable.get((M, N, K), True):
        return None
    comm = comm_model(measured, op, world)
    return timeline(op, algorithm, M, N, K, world, f.kappa, comm, matmul) + f.overhead


def validation(measured: Measured, matmul: Matmul, train: int, test: int) -> list[dict]:
    """Fit on ``train`` ranks, predict ``test``: per (op, algorithm, shape) measured vs predicted."""
    out = []
    for op in OPS:
        for algorithm in ALGORITHMS:
            f = fit(measured, op, algorithm, [train], matmul)
            if f is None:
                continue
            f.reliable = {}
            for M, N, K in measured.shapes(op, test):
                t = measured.get(op, test, M, N, K, _provider(algorithm))
                if t:
                    p = predict(op, algorithm, M, N, K, test, f, measured, matmul)
                    out.append({"op": op, "algorithm": algorithm, "M": M, "N": N, "K": K,
                                "measured_ms": t * 1e3, "predicted_ms": p * 1e3,
                                "modelled": _modelled(p, t)})
    return out


def _modelled(predicted: float, measured: float) -> bool:
    """False where the measurement is far above the timeline: the pathology the model leaves out."""
    return measured <= predicted * (1 + UNRELIABLE) + 50e-6


def validated(points: list[dict], op: str, algorithm: str) -> float | None:
    """Median |predicted / measured - 1| over one algorithm's modelled validation points; None when
    fewer than half its shapes are modelled."""
    mine = [p for p in points if p["op"] == op and p["algorithm"] == algorithm and p["predicted_ms"]]
    errs = sorted(abs(p["predicted_ms"] / p["measured_ms"] - 1) for p in mine if p["modelled"])
    return errs[len(errs) // 2] if errs and 2 * len(errs) >= len(mine) else None


def predictions(measured: Measured, world: int, points: list[dict]) -> tuple[list[dict], dict]:
    """Predicted ms of every algorithm at ``world`` on the measured shapes (fit on every measured W).
    An algorithm whose 2 -> 4 GPU validation (``points``) missed by more than ``VALIDATION_LIMIT`` (median)
    is not predicted (null); nccl always is."""
    matmul = Matmul(measured)
    rows, fits = [], {}
    for op in OPS:
        worlds = measured.worlds(op)
        shapes = sorted({s for w in worlds for s in measured.shapes(op, w)})
        op_fits = {}
        for a in ALGORITHMS:
            error = validated(points, op, a)
            if a == "nccl" or (error is not None and error <= VALIDATION_LIMIT):
                op_fits[a] = fit(measured, op, a, worlds, matmul)
        fits[op] = {a: dataclasses.asdict(f) | {"reliable": {f"{k[0]}x{k[1]}x{k[2]}": v for k, v in f.reliable.items()}}
                    for a, f in op_fits.items() if f is not None}
        for M, N, K in shapes:
            ms = {}
            for algorithm in ALGORITHMS:
                f = op_fits.get(algorithm)
                value = predict(op, algorithm, M, N, K, world, f, measured, matmul) if f else None
                ms[algorithm] = None if value is None else round(value * 1e3, 4)
            rows.append({"op": op, "world": world, "M": M, "N": N, "K": K, "ms": ms})
    return rows, fits


# ----------------------------------------------------------------------------------------------------
# command line


def _error_summary(points: list[dict]) -> str:
    lines = []
    for op in OPS:
        for algorithm in ALGORITHMS:
            mine = [p for p in points if p["op"] == op and p["algorithm"] == algorithm and p["predicted_ms"]]
            errs = sorted(p["predicted_ms"] / p["measured_ms"] - 1 for p in mine if p["modelled"])
            missed = [f"{p['M']}x{p['N']} {p['predicted_ms'] / p['measured_ms'] - 1:+.0%}" for p in mine
                      if not p["modelled"]]
            if mine:
                used = validated(points, op, algorithm)
                lines.append(f"  {op:22s} {algorithm:12s} "
                             + (f"median {errs[len(errs) // 2]:+.0%}, range {errs[0]:+.0%} .. {errs[-1]:+.0%} over "
                                f"{len(errs)} modelled shapes" if errs else "no modelled shapes")
                             + (f"; not modelled: {', '.join(missed)}" if missed else "")
                             + ("" if used is not None and used <= VALIDATION_LIMIT else " -> not predicted"))
    return "\n".join(lines)


def markdown(report: dict, measured: Measured | None = None) -> str:
    """The RESULTS.md section for a saved report (``--json``): predictions, marked as such, and, once
    that world size has been measured (``measured``), each prediction next to its measurement."""
    world = report["world"]
    rows = report["predictions"]
    seen = [r for r in rows if measured is not None
            and measured.get(r["op"], world, r["M"], r["N"], r["K"], "tk.nccl") is not None]
    if seen:
        lines = [f"### tk.dist at {world} GPUs — the cost model's predictions against the later measurement",
                 "",
                 f"These ms were predicted before any {world}-GPU machine was lent (`python -m tilekernels bench "
                 "costmodel`, fitted on the 2- and 4-GPU rows); the measured tables above came later and "
                 "replace them in `auto`'s table. `predicted best` is the model's pick and its speedup over "
                 "nccl; `measured` is what that algorithm then measured, as speedup over measured nccl."]
    else:
        lines = [f"### tk.dist at {world} GPUs — PREDICTED by the cost model, not measured",
                 "",
                 f"No machine with {world} GPUs was available. `python -m tilekernels bench costmodel` fits the "
                 "model (`tilekernels/bench/costmodel.py`) to the measured 2- and 4-GPU rows above and predicts "
                 "these ms; `-` is an algorithm or shape it does not predict. Fit on 2 GPUs, it predicted the "
                 "measured 4-GPU times within the median errors listed below. `auto` reads these rows (source: "
                 "model) only with a 10% predicted margin over nccl."]
    lines += ["",
              "| op | shape (MxNxK) | " + " | ".join(ALGORITHMS) + " | predicted best vs nccl |"
              + (" measured |" if seen else ""),
              "|---|---|" + "---:|" * (len(ALGORITHMS) + 1 + bool(seen))]
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms[a]:.3f}" if ms.get(a) is not None else "-" for a in ALGORITHMS]
        best = min((v, a) for a, v in ms.items() if v is not None)
        ratio = f"{ms['nccl'] / best[0]:.2f}x ({best[1]})" if ms.get("nccl") else "-"
        line = f"| {r['op']} | {r['M']}x{r['N']}x{r['K']} | " + " | ".join(cells) + f" | {ratio} |"
        if seen:
            shape = (r["op"], world, r["M"], r["N"], r["K"])
            nccl, pick = measured.get(*shape, "tk.nccl"), measured.get(*shape, f"tk.{best[1]}")
            line += f" {nccl / pick:.2f}x |" if nccl and pick else " - |"
        lines.append(line)
    lines += ["", "Validation (fit on 2 GPUs, predicted 4 GPUs; predicted / measured - 1):", "",
              "```", _error_summary(report["validation"]), "```"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilekernels bench costmodel", description=__doc__.split("\n")[0])
    parser.add_argument("--results-dir", type=pathlib.Path, help="default: the repository's benchmarks/results")
    parser.add_argument("--gpu", default="nvidia-h200")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--json", type=pathlib.Path,
                        help="write validation and predictions here (benchmarks/results/<gpu>/costmodel.json is "
                             "shown in RESULTS.md, marked as predictions)")
    parser.add_argument("--write-auto-table", action="store_true",
                        help="store the predictions in auto_table.json as 'source: model' rows")
    opts = parser.parse_args(argv)
    from .harness import default_results_dir

    measured = load_measured(opts.results_dir or default_results_dir(), opts.gpu)
    matmul = Matmul(measured)
    report = {"validation": validation(measured, matmul, 2, 4)}
    print("fit on 2 GPUs, predicted 4 GPUs vs measured (predicted / measured - 1):")
    print(_error_summary(report["validation"]))
    rows, fits = predictions(measured, opts.world, report["validation"])
    report.update(world=opts.world, predictions=rows, fits=fits)
    print(f"\npredicted ms at {opts.world} GPUs (fit on every measured world size; null: not modelled there)")
    for r in rows:
        ms = "  ".join(f"{a} {v:.3f}" if v is not None else f"{a} -" for a, v in r["ms"].items())
        print(f"  {r['op']:22s} {r['M']}x{r['N']}x{r['K']}: {ms}")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=1) + "\n")
    if opts.write_auto_table:
        from ..dist import _auto

        gpu_name = "NVIDIA H200" if opts.gpu == "nvidia-h200" else opts.gpu
        print(_auto.add_model_rows([dict(r, gpu=gpu_name, dtype="bf16") for r in rows]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
