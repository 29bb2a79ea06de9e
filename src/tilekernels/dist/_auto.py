"""``algorithm="auto"``: pick a tk.dist algorithm from measured timings (``auto_table.json``).

The table holds rows measured by ``python -m tilekernels bench all_gather_matmul|matmul_reduce_scatter``
on real machines, one per (op, gpu, world, dtype, M, N, K), with each algorithm's time in ms. M, N, K
are the problem's global GEMM sizes, ``[M, N] = [M, K] @ [K, N]`` before sharding:

- ``all_gather_matmul``: M = world * a_shard rows (the gathered A's rows), K = a_shard columns,
  N = b columns.
- ``matmul_reduce_scatter``: M = a rows (before the scatter), K = world * a columns, N = b columns.

Rule (``choose``):

1. Candidate rows: this op, world size and dtype, measured on a GPU of this name if there are any,
   else on any other GPU (a CUDA device) — CPU rows only ever serve the CPU, and GPU rows never do.
2. Take the nearest row in log space (sum over M, N, K of ``log(x / x_row)^2``); if it is more than
   ``MAX_RATIO`` (2x) away in any of M, N, K, there is no close measurement: ``"nccl"``.
3. At that row, the fastest algorithm among those allowed, but never one that did not beat ``nccl``
   there by at least ``MIN_GAIN`` (timings are noisy, and ANCHORS.md's rule is that ``auto`` must not
   pick a path slower than the unfused baseline), nor one whose p80 is more than ``TAIL_SLACK``
   above nccl's. Rows the cost model predicted (``"source": "model"``: world sizes not measured)
   need ``MODEL_MIN_GAIN``. No ``nccl`` time at that row: ``"nccl"``.

No table, an unreadable table, or no close row: ``"nccl"``. The table is read once per path and
cached (``clear_cache()`` after rewriting it); ``TILEKERNELS_AUTO_TABLE`` points at another file.

Table schema (``"schema": 1``)::

    {"schema": 1,
     "doc": "...",
     "rows": [{"op": "all_gather_matmul", "gpu": "NVIDIA H200", "world": 2, "dtype": "bf16",
               "M": 8192, "N": 3584, "K": 8192,
               "ms": {"nccl": 0.934, "pipelined": 0.84, "copy_engine": 0.71, "fetch": null},
               "run_id": "20261122T...", "date": "2026-11-22T..."}]}

``ms`` values are medians over repetitions of the slowest rank's time; ``null`` or a missing key is
an algorithm that failed or was not measured (never chosen). ``update_table`` merges a bench run's
rows (``rows_from_results``) into the file, replacing rows with the same key.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
from collections.abc import Iterable, Sequence

import torch

ALGORITHMS = ("nccl", "pipelined", "copy_engine", "fetch")
OPS = ("all_gather_matmul", "matmul_reduce_scatter")
TABLE_PATH = pathlib.Path(__file__).with_name("auto_table.json")
TABLE_ENV = "TILEKERNELS_AUTO_TABLE"
SCHEMA = 1
MAX_RATIO = 2.0
MIN_GAIN = 0.02
TAIL_SLACK = 0.10
# Rows predicted by the cost model (``"source": "model"``, world sizes no machine here had) must promise
# more: the model's error against measurements at 2 and 4 GPUs is in benchmarks/NOTES.md.
MODEL_MIN_GAIN = 0.10
CPU_GPU_NAME = "cpu-interpreter"
DOC = ("Measured tk.dist algorithm times (ms, median over reps of the slowest rank) per (op, gpu, world, "
       "dtype, M, N, K); M, N, K are the global GEMM sizes before sharding. Read by tilekernels.dist._auto "
       "(see its docstring for the rule); written by `python -m tilekernels bench all_gather_matmul "
       "--update-auto-table RUN.json`. Do not edit by hand.")

# What each field means, kept in the file itself for whoever opens it.
SCHEMA_DOC = {
    "rows[]": "one per (op, gpu, world, dtype, M, N, K)",
    "op": "all_gather_matmul | matmul_reduce_scatter",
    "gpu": "torch.cuda.get_device_properties().name, e.g. 'NVIDIA H200' ('cpu-interpreter' for CPU rows)",
    "world": "process-group size",
    "dtype": "bf16 | fp16 | fp32",
    "M, N, K": ("global GEMM sizes before sharding: all_gather_matmul M = world * a_shard rows, K = a_shard "
                "cols; matmul_reduce_scatter M = a rows, K = world * a cols"),
    "ms": ("{algorithm: median ms of the slowest rank, or null}; algorithms nccl, pipelined, copy_engine, "
           "fetch"),
    "p80": "{algorithm: 80th percentile ms} (measured rows)",
    "source": "'model' for rows predicted by tilekernels.bench.costmodel (no machine of that size), else absent",
    "run_id, date": "the bench run the row came from",
}

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

_cache: dict[str, dict] = {}


def table_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(TABLE_ENV) or TABLE_PATH)


def empty_table() -> dict:
    return {"schema": SCHEMA, "doc": DOC, "schema_doc": SCHEMA_DOC, "rows": []}


def load_table(path=None) -> dict:
    """The table at ``path`` (default ``table_path()``), cached; an empty table if missing or unreadable."""
    key = str(path or table_path())
    if key not in _cache:
        try:
            table = json.loads(pathlib.Path(key).read_text())
            if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
                raise ValueError("no 'rows' list")
        except (OSError, ValueError):
            table = empty_table()
        _cache[key] = table
    return _cache[key]


def clear_cache() -> None:
    _cache.clear()


def dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def device_gpu_name(device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_GPU_NAME
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).name


def _is_cpu(gpu: str) -> bool:
    return gpu == CPU_GPU_NAME or gpu.startswith("cpu")


def _distance(row: dict, M: int, N: int, K: int) -> tuple[float, float]:
    """(squared log distance, largest ratio in any dimension)."""
    logs = [abs(math.log(max(x, 1) / max(int(row[d]), 1))) for x, d in ((M, "M"), (N, "N"), (K, "K"))]
    return sum(v * v for v in logs), math.exp(max(logs))


def nearest_row(rows: Sequence[dict], op: str, M: int, N: int, K: int, world: int, dtype,
                gpu: str) -> dict | None:
    """The row ``choose`` reads (rule steps 1-2), or None."""
    dtype = dtype_name(dtype)
    same = [r for r in rows if r.get("op") == op and r.get("world") == world and r.get("dtype") == dtype]
    candidates = [r for r in same if r.get("gpu") == gpu]
    if not candidates and not _is_cpu(gpu):
        candidates = [r for r in same if not _is_cpu(str(r.get("gpu", "")))]
    scored = []
    for r in candidates:
        try:
            dist2, ratio = _distance(r, M, N, K)
        except (KeyError, TypeError, ValueError):
            continue
        if ratio <= MAX_RATIO * (1 + 1e-9):
            scored.append((dist2, r))
    if not scored:
        return None
    nearest = min(d for d, _ in scored)
    # Among equally near rows, the newest measurement wins.
    return max((r for d, r in scored if d <= nearest + 1e-12), key=lambda r: str(r.get("date", "")))


def pick(ms: dict, allowed: Iterable[str] = ALGORITHMS, p80: dict | None = None, min_gain: float = MIN_GAIN) -> str:
    """Rule step 3 on one row's ``ms``: the fastest allowed algorithm that beats nccl by ``min_gain``
    and, where the row has ``p80`` times, whose p80 is within ``TAIL_SLACK`` of nccl's (a median that
    wins over a tail of slow calls is not a win: seen at 4 GPUs, p50 0.065 ms and p80 2.2 ms)."""
    base = ms.get("nccl")
    if not _valid(base):
        return "nccl"
    p80 = p80 or {}
    base_tail = p80.get("nccl")
    best, best_ms = "nccl", float(base)
    for algorithm in allowed:
        value = ms.get(algorithm)
        if algorithm == "nccl" or algorithm not in ALGORITHMS or not _valid(value):
            continue
        tail = p80.get(algorithm)
        if _valid(base_tail) and _valid(tail) and float(tail) > float(base_tail) * (1 + TAIL_SLACK):
            continue
        if float(value) <= base * (1 - min_gain) and float(value) < best_ms:
            best, best_ms = algorithm, float(value)
    return best


def _valid(value) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def choose(op: str, M: int, N: int, K: int, world: int, dtype, device, *, allowed: Iterable[str] = ALGORITHMS,
           table: dict | None = None) -> str:
    """The algorithm ``auto`` runs for this problem (see the module docstring); always one of
    ``ALGORITHMS``, ``"nccl"`` whenever nothing measured says another is faster."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    table = load_table() if table is None else table
    row = nearest_row(table.get("rows", []), op, int(M), int(N), int(K), int(world), dtype,
                      device_gpu_name(device))
    if row is None or not isinstance(row.get("ms"), dict):
        return "nccl"
    predicted = row.get("source") == "model"
    return pick(row["ms"], allowed, row.get("p80") if isinstance(row.get("p80"), dict) else None,
                MODEL_MIN_GAIN if predicted else MIN_GAIN)


# ----------------------------------------------------------------------------------------------------
# writing the table from bench results


def rows_from_results(results: Sequence[dict]) -> list[dict]:
    """Auto-table rows from a bench run's long-format rows (providers ``tk.<algorithm>``, metric ms).

    Rows that failed, came from the interpreter, or are not tk algorithms are left out; each
    (op, gpu, world, dtype, shape, run) becomes one row with its algorithms' ``p50`` (``ms``) and
    ``p80``.
    """
    grouped: dict[tuple, dict] = {}
    for r in results:
        algorithm = r.get("algorithm")
        if (r.get("op") not in OPS or algorithm not in ALGORITHMS or r.get("metric") != "ms"
                or r.get("status", "ok") != "ok" or not _valid(r.get("p50")) or r.get("interpreter")):
            continue
        shape = r["shape"]
        key = (r["op"], r["gpu"], int(r["world"]), r["dtype"], int(shape["M"]), int(shape["N"]),
               int(shape["K"]))
        entry = grouped.setdefault(key, {
            **dict(zip(("op", "gpu", "world", "dtype", "M", "N", "K"), key)),
            "ms": {}, "p80": {}, "run_id": r.get("run_id"), "date": r.get("date")})
        entry["ms"][algorithm] = float(r["p50"])
        if _valid(r.get("p80")):
            entry["p80"][algorithm] = float(r["p80"])
    return list(grouped.values())


def _key(row: dict) -> tuple:
    return (row["op"], row["gpu"], row["world"], row["dtype"], row["M"], row["N"], row["K"])


def update_table(results: Sequence[dict], path=None) -> list[str]:
    """Merge a bench run's rows into the table file (replacing rows with the same key); messages."""
    path = pathlib.Path(path or table_path())
    try:
        table = json.loads(path.read_text()) if path.exists() else empty_table()
    except ValueError as error:
        raise ValueError(f"{path}: not a JSON auto table ({error})") from error
    new = rows_from_results(results)
    if not new:
        return [f"{path}: no tk.dist algorithm rows with timings in the results; table unchanged"]
    by_key = {_key(r): r for r in table.get("rows", [])}
    replaced = sum(1 for r in new if _key(r) in by_key)
    for r in new:
        by_key[_key(r)] = r
    table = {"schema": SCHEMA, "doc": DOC, "schema_doc": SCHEMA_DOC,
             "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "rows": sorted(by_key.values(), key=lambda r: tuple(str(v) for v in _key(r)))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    _cache.pop(str(path), None)
    return [f"{path}: {len(new) - replaced} new rows, {replaced} replaced, {len(table['rows'])} in all"]


def add_model_rows(rows: Sequence[dict], path=None) -> str:
    """Store cost-model predictions (``tilekernels.bench.costmodel``) as ``"source": "model"`` rows,
    replacing rows with the same key that were predicted before; never a measured row."""
    path = pathlib.Path(path or table_path())
    table = json.loads(path.read_text()) if path.exists() else empty_table()
    by_key = {_key(r): r for r in table.get("rows", [])}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    added = kept = 0
    for r in rows:
        row = {k: r[k] for k in ("op", "gpu", "world", "dtype", "M", "N", "K")}
        row.update(ms=dict(r["ms"]), source="model", date=date)
        old = by_key.get(_key(row))
        if old is not None and old.get("source") != "model":
            kept += 1  # a measurement always wins over a prediction
            continue
        by_key[_key(row)] = row
        added += 1
    table.update(schema=SCHEMA, doc=DOC, schema_doc=SCHEMA_DOC, updated=date,
                 rows=sorted(by_key.values(), key=lambda r: tuple(str(v) for v in _key(r))))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    _cache.pop(str(path), None)
    return f"{path}: {added} predicted rows written, {kept} left to measurements"

