"""Timing, input rotation, result rows, tables and plots shared by every op's benchmark.

How a number is made (``run_case``):

1. A case builds ``n`` independent random input sets (never zeros), ``n`` chosen so that the sets in
   rotation hold at least twice the GPU's L2 (H100 50 MB, H200 60 MB), and at least two: consecutive
   timed calls then never find their operands already in L2.
2. Each provider is first run once and checked against the op's reference (``Accuracy``); a provider
   that fails or raises is reported and *not timed*: a fast wrong answer is not a result.
3. ``triton.testing.do_bench(fn, warmup=, rep=, quantiles=[0.2, 0.5, 0.8])`` times the provider, each
   call taking the next input set. (Same signature in triton 3.6 and 3.9.) On a GPU this happens in
   three interleaved rounds (``--rounds``): every provider is timed once per round, so a slow spell of
   the machine falls on all of them alike, and each quantile is the median of its rounds'.
4. One long-format row per (case, provider): ``{op, provider, shape, dtype, layout, variant, metric,
   p20, p50, p80, ms, gpu, torch, triton, tilekernels, commit, date, config, mode, run_id, ...}``.
   ``p20/p50/p80`` are quantiles of the metric, so p20 comes from the *slower* 80th percentile time;
   ``ms`` is the median time; with several rounds, ``rounds`` and ``p50_rounds`` (each round's p50)
   are kept and the tables give the per-round spread of every ratio. The metric is the case's:
   ``tflops`` (TFLOP/s, compute-bound ops) or ``tbps`` (TB/s, memory-bound ops such as decode
   attention), its work per call divided by the time;
   a case may add fields of its own to its rows (e.g. a bandwidth floor).

Under the CPU interpreter the same path runs end to end at tiny shapes, timed with a wall clock: the
figures then measure Python interpreting the kernel and say nothing about performance; every table
says so, and such rows are not recorded unless ``--results-dir`` asks for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import torch

from .._runtime import device_name, device_slug

OURS = "tilekernels"
QUANTILES = (0.2, 0.5, 0.8)
INTERPRETER_WARNING = ("CPU interpreter (TRITON_INTERPRET=1): timings measure Python interpreting the "
                       "kernels, not a GPU; they are meaningless as performance figures.")

DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8e4m3": torch.float8_e4m3fn,
    "fp8e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

# Used when torch does not report the L2 size: the larger of the Hopper parts we run on (H200).
FALLBACK_L2_BYTES = 60 * 2**20
# Input sets in rotation may take at most this share of free GPU memory.
ROTATION_MEMORY_FRACTION = 0.25
MAX_ROTATION = 64

# The copy that measures the device's bandwidth, the ceiling of memory-bound ops (bytes of the source
# tensor; ``copy_bandwidth_tbps``).
COPY_BYTES_GPU = 2**30
COPY_BYTES_CPU = 2**22
COPY_SEED = 97
_copy_tbps: dict[str, float] = {}

# A case's metric -> the unit its rows, tables and plots show: work per call (FLOPs or bytes) / 1e12 / s.
METRIC_UNITS = {"tflops": "TFLOP/s", "tbps": "TB/s"}


class UsageError(ValueError):
    """A bad command-line value (shape, variant, ...): reported as a usage error, not a traceback."""


def metric_unit(metric: str | None) -> str:
    """The unit a row's ``metric`` is shown in (rows written before there was a choice are TFLOP/s)."""
    return METRIC_UNITS.get(metric or "tflops", metric or "tflops")


def tk_function(name: str):
    """``tilekernels.<name>``, imported when a provider first needs it; ImportError saying so if the
    package does not export it."""
    import tilekernels

    try:
        return getattr(tilekernels, name)
    except AttributeError:
        raise ImportError(f"tilekernels.{name} is not available (tilekernels/__init__.py does not export "
                          "it)") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).replace("torch.", "")


def parse_dtype(text: str) -> torch.dtype:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[text]


def device_random(shape, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Benchmark inputs made on the device from ``seed`` (host generation and a copy of GiB-sized
    operands would dominate a run): standard normal, integers in [-8, 8) for int8, fp8 rounded from
    fp32 normals. Never all zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-8, 8, tuple(shape), generator=gen, device=device, dtype=torch.int8)
    if dtype.itemsize == 1:
        return torch.randn(tuple(shape), generator=gen, device=device).to(dtype)
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)


def shape_items(text: str) -> list[tuple[str, list[str]]]:
    """The comma-separated items of a ``--shapes`` value, each as (item as given, its lower-cased
    'x'-separated parts); ``UsageError`` when there are none."""
    items = []
    for item in text.split(","):
        item = item.strip()
        if item:
            items.append((item, item.lower().replace("×", "x").split("x")))
    if not items:
        raise UsageError(f"no shapes in {text!r}")
    return items


def parse_dims(item: str, parts: Sequence[str], names: Sequence[str], defaults: dict | None = None) -> dict:
    """``parts`` as positive integers named ``names``; trailing names in ``defaults`` may be left out."""
    defaults = defaults or {}
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    fewest = len(names) - len(defaults)
    if not fewest <= len(values) <= len(names) or any(v < 1 for v in values):
        if defaults:
            given = ", ".join(f"{n} = {v}" for n, v in defaults.items())
            raise UsageError(f"shape {item!r}: expected {'x'.join(names[:fewest])} ({given}) or "
                             f"{'x'.join(names)}, positive integers")
        raise UsageError(f"shape {item!r}: expected {len(names)} positive integers joined by 'x' "
                         f"({'x'.join(names)}), e.g. {'x'.join(['64'] * len(names))}")
    dims = dict(zip(names, values))
    for name in names[len(values):]:
        dims[name] = defaults[name]
    return dims


def parse_shapes(text: str, names: Sequence[str] = ("M", "N", "K"), defaults: dict | None = None) -> list[dict]:
    """``"8192x8192x8192,16x8192x8192"`` -> ``[{"M": 8192, "N": 8192, "K": 8192}, ...]``; with
    ``defaults={"K": 8192}``, ``"4096x3584"`` is ``{"M": 4096, "N": 3584, "K": 8192}``."""
    return [parse_dims(item, parts, names, defaults) for item, parts in shape_items(text)]


def shape_label(shape: dict) -> str:
    return "x".join(str(v) for v in shape.values())


# ----------------------------------------------------------------------------------------------------
# environment


def repo_root() -> pathlib.Path | None:
    """The checkout this package runs from (src layout), if it is one."""
    for parent in pathlib.Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src" / "tilekernels").is_dir():
            return parent
    return None


def default_results_dir() -> pathlib.Path:
    root = repo_root() or pathlib.Path.cwd()
    return root / "benchmarks" / "results"


def tilekernels_version() -> str:
    try:
        import tilekernels

        version = getattr(tilekernels, "__version__", None)
        if version:
            return str(version)
    except Exception:  # the harness must report even when the package's own import is broken
        pass
    try:
        from importlib.metadata import version

        return version("tilekernels")
    except Exception:
        return "unknown"


def git_commit() -> str | None:
    root = repo_root()
    if root is None or not (root / ".git").exists():
        return None
    try:
        result = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return result.stdout.strip() + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict:
    import triton

    return {
        "gpu": device_name(device),
        "gpu_slug": device_slug(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tilekernels": tilekernels_version(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "interpreter": device.type != "cuda",
    }


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)


def rotation_count(set_bytes: int, device: torch.device) -> int:
    """How many input sets to rotate through: together >= 2x L2, at least 2, within a memory budget."""
    if device.type != "cuda":
        return 2
    want = max(2, math.ceil(2 * l2_bytes(device) / max(set_bytes, 1)))
    free, _ = torch.cuda.mem_get_info(device)
    fits = int(ROTATION_MEMORY_FRACTION * free // max(set_bytes, 1))
    return max(1, min(want, fits, MAX_ROTATION))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------
# cases, accuracy, timing


@dataclasses.dataclass
class Accuracy:
    """Outcome of a provider's check against the op's reference (``testing.compare`` underneath)."""

    passed: bool
    ratio: float
    detail: str


class SharedModuleOp:
    """The harness's op interface for one of several ops whose bench code shares one module (bench/norm.py:
    six ops, bench/paged.py: two): each method hands the op's NAME (the op itself, for its report) to
    the module's function of the same name. Subclasses add METRIC, FLOPS_FORMULA and the like."""

    def __init__(self, name: str, module):
        self.NAME = name
        self._module = module

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self._module.add_arguments(parser)

    def check_cases(self, device: torch.device) -> list:
        return self._module.check_cases(self.NAME, device)

    def bench_cases(self, opts: argparse.Namespace, device: torch.device) -> list:
        return self._module.bench_cases(self.NAME, opts, device)

    def report_rows(self, rows: Sequence[dict], markdown: bool = False, interpreter_note: bool = True) -> str:
        return self._module.report_rows(rows, self, markdown, interpreter_note)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.NAME!r})"


@dataclasses.dataclass
class BenchCase:
    """One shape of one op, with the providers to time on it.

    ``make_inputs(i)`` builds input set ``i`` on the device; every provider takes one set (a dict) and
    returns the op's output. ``check(inputs, output, provider)`` compares an output with the reference.
    ``flops`` is the work per call that the metric divides by: FLOPs for ``metric="tflops"``, bytes
    moved for ``"tbps"``. ``set_bytes`` sizes the rotation. ``row_extra(row)``, if given, returns fields
    to add to each of the case's rows once it is measured.
    """

    op: str
    shape: dict
    dtype: torch.dtype
    variant: str
    layout: str
    flops: float
    set_bytes: int
    make_inputs: Callable[[int], dict]
    providers: dict[str, Callable[[dict], torch.Tensor]]
    check: Callable[[dict, torch.Tensor, str], Accuracy]
    configs: dict[str, str] = dataclasses.field(default_factory=dict)
    metric: str = "tflops"
    row_extra: Callable[[dict], dict] | None = None

    def label(self) -> str:
        return f"{self.op} {shape_label(self.shape)} {self.variant} {dtype_name(self.dtype)} {self.layout}"


def time_ms(fn: Callable[[], object], device: torch.device, warmup: float, rep: float,
            cuda_graph: bool = False) -> list[float]:
    """[p20, p50, p80] of ``fn``'s run time in milliseconds.

    ``cuda_graph``: time replays of a captured graph of calls (the input rotation is captured with
    them), which removes host launch overhead from every provider alike: kernel against kernel, as in
    a CUDA-graphed serving step. Without it, eager calls: what a plain PyTorch program sees.
    """
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            fn()
            synchronize(device)
            times = triton.testing.do_bench_cudagraph(fn, rep=rep, quantiles=list(QUANTILES))
        else:
            times = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES))
        return [float(t) for t in times]
    # The interpreter has no device events; a wall clock over a few calls is all there is.
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return [cuts[1], statistics.median(samples), cuts[7]]


def copy_bandwidth_tbps(device: torch.device, warmup: float, rep: float) -> float:
    """The device's copy bandwidth in TB/s, (bytes read + bytes written) / median time of a large
    device-to-device ``.copy_``; measured once per process and device. Memory-bound ops compare their
    own TB/s with it (batch_decode's floor, the norms' copy fraction)."""
    key = str(device)
    if key not in _copy_tbps:
        nbytes = COPY_BYTES_GPU if device.type == "cuda" else COPY_BYTES_CPU
        src = device_random((nbytes // 2,), torch.bfloat16, device, COPY_SEED)
        dst = torch.empty_like(src)
        # the median of three timings: one slow spell must not move every ratio taken against it
        ms50 = statistics.median(time_ms(lambda: dst.copy_(src), device, warmup, rep)[1] for _ in range(3))
        _copy_tbps[key] = 2 * nbytes / (ms50 * 1e-3) / 1e12
        del src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return _copy_tbps[key]


class Run:
    """Rows, failures and notes of one ``bench`` invocation."""

    def __init__(self, op: str, device: torch.device, mode: str, cuda_graph: bool = False):
        self.cuda_graph = cuda_graph
        self.op = op
        self.device = device
        self.mode = mode
        self.env = environment(device)
        now = datetime.datetime.now(datetime.timezone.utc)
        self.date = now.isoformat(timespec="seconds")
        self.run_id = now.strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.notes: list[str] = []

    def fail(self, what: str, message: str) -> None:
        line = f"FAIL {what}: {message}"
        self.failures.append(line)
        print(line, flush=True)

    def note(self, message: str) -> None:
        self.notes.append(message)
        print(f"note: {message}", flush=True)

    def row(self, case: BenchCase, provider: str, times: Sequence[float], config: str,
            accuracy: Accuracy) -> dict:
        ms20, ms50, ms80 = times
        rates = [case.flops / (t * 1e-3) / 1e12 for t in (ms80, ms50, ms20)]
        row = {
            "op": case.op,
            "provider": provider,
            "shape": dict(case.shape),
            "dtype": dtype_name(case.dtype),
            "layout": case.layout,
            "variant": case.variant,
            "metric": case.metric,
            "p20": rates[0],
            "p50": rates[1],
            "p80": rates[2],
            "ms": ms50,
            "config": config,
            "accuracy_ratio": accuracy.ratio,
            "mode": self.mode,
            "timing": "cuda_graph" if self.cuda_graph else "eager",
            "run_id": self.run_id,
            "date": self.date,
            **{k: v for k, v in self.env.items() if k != "gpu_slug"},
        }
        if case.row_extra is not None:
            row.update(case.row_extra(row))
        self.rows.append(row)
        return row


def exception_text(exc: BaseException) -> str:
    """One line per exception: its first line, and its last where the cause is (triton's compile errors
    put the source excerpt first and the reason last)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " ... " + lines[-1]
    if len(text) > 400:
        text = text[:400] + "..."
    text = f"{type(exc).__name__}: {text}"
    # triton's CompilationError names the call site; the reason is in the exception it was raised from
    if exc.__cause__ is not None and exc.__cause__ is not exc:
        text += f" (caused by {exception_text(exc.__cause__)})"
    return text


def _recover(device: torch.device) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # a sticky CUDA error shows up again on the next call; nothing to do here
            pass
        torch.cuda.empty_cache()


def build_inputs(case: BenchCase, run: Run) -> list[dict] | None:
    n = rotation_count(case.set_bytes, run.device)
    try:
        sets = [case.make_inputs(i) for i in range(n)]
    except torch.OutOfMemoryError as exc:
        run.fail(case.label(), f"inputs do not fit in memory ({exception_text(exc)})")
        _recover(run.device)
        return None
    synchronize(run.device)
    return sets


def _check(case: BenchCase, provider: str, fn: Callable[[dict], torch.Tensor], sets: list[dict], run: Run,
           what: str, complain: Callable[[str], None]) -> Accuracy | None:
    """Run ``fn`` once on ``sets[0]`` and check it; None (reported) when it raises or is wrong."""
    try:
        out = fn(sets[0])
        synchronize(run.device)
        accuracy = case.check(sets[0], out, provider)
        del out
    except Exception as exc:
        complain(f"raised {exception_text(exc)}")
        _recover(run.device)
        return None
    if not accuracy.passed:
        # A wrong answer is a failure even in a sweep: that config must never win.
        run.fail(what, f"accuracy check failed, not timed: {accuracy.detail}")
        return None
    return accuracy


def _time(fn: Callable[[dict], torch.Tensor], sets: list[dict], run: Run, warmup: float, rep: float,
          complain: Callable[[str], None]) -> list[float] | None:
    """[p20, p50, p80] ms of ``fn`` rotating through ``sets``; None (reported) when it raises."""
    cycle = itertools.cycle(sets)
    try:
        return time_ms(lambda: fn(next(cycle)), run.device, warmup, rep, run.cuda_graph)
    except Exception as exc:
        complain(f"raised while timing {exception_text(exc)}")
        _recover(run.device)
        return None


def _complainer(run: Run, what: str, failures_are_notes: bool) -> Callable[[str], None]:
    def complain(message: str) -> None:
        # In a sweep, a config that cannot compile or launch is expected: a note, not a failure.
        if failures_are_notes:
            run.note(f"{what}: {message}")
        else:
            run.fail(what, message)
    return complain


def measure(case: BenchCase, provider: str, fn: Callable[[dict], torch.Tensor], sets: list[dict], run: Run,
            warmup: float, rep: float, config: str = "", failures_are_notes: bool = False) -> dict | None:
    """Check ``fn`` on ``sets[0]``, then time it rotating through ``sets``; one row, or None."""
    what = f"{case.label()} [{provider}{' ' + config if config else ''}]"
    complain = _complainer(run, what, failures_are_notes)
    accuracy = _check(case, provider, fn, sets, run, what, complain)
    if accuracy is None:
        return None
    times = _time(fn, sets, run, warmup, rep, complain)
    return None if times is None else run.row(case, provider, times, config, accuracy)


def combine_rounds(rounds: Sequence[Sequence[float]]) -> list[float]:
    """One [p20, p50, p80] from several rounds' (each quantile's median over the rounds)."""
    return [statistics.median(r[i] for r in rounds) for i in range(len(QUANTILES))]


def run_case(case: BenchCase, run: Run, warmup: float, rep: float, rounds: int = 1) -> None:
    """Check every provider, then time them ``rounds`` times, interleaved (round r times every provider
    before round r + 1 starts), so a slow spell of the machine falls on all providers alike. A row's
    quantiles are the medians of its rounds'; with several rounds it also keeps each round's ``p50``
    (``p50_rounds``), so the spread stays visible."""
    sets = build_inputs(case, run)
    if sets is None:
        return
    live = {}
    for provider, fn in case.providers.items():
        config = case.configs.get(provider, "")
        what = f"{case.label()} [{provider}{' ' + config if config else ''}]"
        complain = _complainer(run, what, False)
        accuracy = _check(case, provider, fn, sets, run, what, complain)
        if accuracy is not None:
            live[provider] = (fn, config, accuracy, complain, [])
    for _ in range(max(1, rounds)):
        for provider, (fn, _, _, complain, times) in list(live.items()):
            t = _time(fn, sets, run, warmup, rep, complain)
            if t is None:
                del live[provider]
            else:
                times.append(t)
    for provider, (fn, config, accuracy, _, times) in live.items():
        row = run.row(case, provider, combine_rounds(times), config, accuracy)
        if len(times) > 1:
            row["rounds"] = len(times)
            row["p50_rounds"] = [case.flops / (t[1] * 1e-3) / 1e12 for t in times]
        spread = ""
        if len(times) > 1:
            spread = f", rounds {min(row['p50_rounds']):.4g}..{max(row['p50_rounds']):.4g}"
        print(f"  {case.label()} {provider:>14}: {format_value(row['p50'])} {metric_unit(case.metric)} "
              f"({row['ms']:.4g} ms{spread}, check ratio {row['accuracy_ratio']:.2f})", flush=True)
    del sets
    _recover(run.device)


# ----------------------------------------------------------------------------------------------------
# tables


def format_value(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def format_table(headers: Sequence[str], body: Sequence[Sequence[str]], markdown: bool = False,
                 left: int = 1) -> str:
    """Aligned text or a GitHub markdown table: the first ``left`` columns (labels) aligned left, the
    others (numbers) right."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join(["---"] * left + ["---:"] * (len(headers) - left)) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *body)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(cells) for cells in body])


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _ratio_summary(name: str, ratios: dict[str, float], scope: str) -> str | None:
    if not ratios:
        return None
    worst = min(ratios, key=ratios.get)
    return (f"{name}: geomean {geomean(ratios.values()):.3f} over {len(ratios)} {scope} shape(s), "
            f"min {ratios[worst]:.3f} at {worst}")


def _round_spread(name: str, cells: dict, shapes: Sequence[str], provider: str) -> str | None:
    """The lowest and highest per-round ratio ``ours/provider`` over the shapes whose rows kept their
    rounds (``run_case`` with several rounds pairs round r of each provider)."""
    seen = []
    for s in shapes:
        ours, other = cells.get((s, OURS)), cells.get((s, provider))
        if ours is None or other is None:
            continue
        a, b = ours.get("p50_rounds"), other.get("p50_rounds")
        if a and b and len(a) == len(b):
            seen += [(x / y, s, len(a)) for x, y in zip(a, b)]
    if not seen:
        return None
    lo, hi = min(seen), max(seen)
    return (f"{name} in single rounds: {lo[0]:.3f} ({lo[1]}) to {hi[0]:.3f} ({hi[1]}), "
            f"{lo[2]} interleaved rounds per shape")


def table_groups(rows: Sequence[dict]) -> list[tuple[tuple, list[dict], list[str], dict, list[str]]]:
    """Rows as the tables show them: per (op, variant, dtype, layout), in first-seen order,
    ``(key, rows, providers with ours first, {(shape label, provider): row}, shape labels)``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["variant"], r["dtype"], r["layout"]), []).append(r)
    tables = []
    for key, group in groups.items():
        providers = list(dict.fromkeys(r["provider"] for r in group))
        if OURS in providers:
            providers.remove(OURS)
            providers.insert(0, OURS)
        cells = {(shape_label(r["shape"]), r["provider"]): r for r in group}
        shapes = list(dict.fromkeys(shape_label(r["shape"]) for r in group))
        tables.append((key, group, providers, cells, shapes))
    return tables


def report(rows: Sequence[dict], op_module=None, markdown: bool = False,
           interpreter_note: bool = True) -> str:
    """Tables of one run's rows: one table per (variant, dtype, layout), ours first, then ratios.

    Ratio columns are ``ours/<provider>`` for every other provider in the table; where the op module
    has an ``anchor`` figure for a shape, ``ours/anchor`` and ``<ANCHOR_PROVIDER>/anchor`` follow (the
    latter tells how this machine compares with the one the anchor was measured on).
    """
    anchor_fn = getattr(op_module, "anchor", None)
    anchor_provider = getattr(op_module, "ANCHOR_PROVIDER", None)
    blocks = []
    if interpreter_note and any(r.get("interpreter") for r in rows):
        blocks.append(("> " if markdown else "") + INTERPRETER_WARNING)
    for (op, variant, dtype, layout), group, providers, cells, shapes in table_groups(rows):
        others = [p for p in providers if p != OURS] if OURS in providers else []
        anchors: dict[str, tuple[str, float]] = {}
        if anchor_fn is not None:
            for r in group:
                found = anchor_fn(r)
                if found is not None:
                    anchors[shape_label(r["shape"])] = found
        headers = ["shape (MxNxK)" if op == "gemm" else "shape"] + [f"{p}" for p in providers]
        headers += [f"ours/{p}" for p in others]
        anchor_label = next(iter(anchors.values()))[0] if anchors else None
        if anchors:
            headers += [anchor_label, "ours/anchor"]
            if anchor_provider in providers:
                headers.append(f"{anchor_provider}/anchor")
        ratios: dict[str, dict[str, float]] = {p: {} for p in others}
        anchor_ratios: dict[str, float] = {}
        body = []
        for s in shapes:
            line = [s] + [format_value(cells[(s, p)]["p50"]) if (s, p) in cells else "-" for p in providers]
            ours = cells.get((s, OURS))
            for p in others:
                if ours is not None and (s, p) in cells:
                    ratios[p][s] = ours["p50"] / cells[(s, p)]["p50"]
                    line.append(f"{ratios[p][s]:.3f}")
                else:
                    line.append("-")
            if anchors:
                if s in anchors:
                    value = anchors[s][1]
                    line.append(format_value(value))
                    if ours is not None:
                        anchor_ratios[s] = ours["p50"] / value
                    line.append(f"{anchor_ratios[s]:.3f}" if s in anchor_ratios else "-")
                    if anchor_provider in providers:
                        base = cells.get((s, anchor_provider))
                        line.append(f"{base['p50'] / value:.3f}" if base else "-")
                else:
                    line += ["-"] * (3 if anchor_provider in providers else 2)
            body.append(line)
        title = f"{op} · {variant} · {dtype} · {layout} — {metric_unit(group[0].get('metric'))} (median)"
        summary = []
        for p in others:
            if anchors:
                at_anchors = {s: v for s, v in ratios[p].items() if s in anchors}
                summary.append(_ratio_summary(f"ours/{p}", at_anchors, "anchor"))
            summary.append(_ratio_summary(f"ours/{p}", ratios[p], "measured"))
            summary.append(_round_spread(f"ours/{p}", cells, shapes, p))
        if anchor_ratios:
            summary.append(_ratio_summary(f"ours/{anchor_label}", anchor_ratios, "anchor"))
        gpus = {r["gpu"] for r in group}
        if anchors and not any("H100" in g for g in gpus):
            summary.append("anchor figures were measured on an H100; this run is on "
                           + ", ".join(sorted(gpus)))
        summary = [s for s in summary if s]
        text = ("#### " if markdown else "") + title + "\n\n" + format_table(headers, body, markdown)
        if summary:
            text += "\n\n" + "\n".join(("- " if markdown else "  ") + s for s in summary)
        blocks.append(text)
    return "\n\n".join(blocks)


# ----------------------------------------------------------------------------------------------------
# files


def read_rows(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    data = json.loads(path.read_text() or "[]")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows, found {type(data).__name__}")
    return data


def write_rows(path: pathlib.Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(list(rows), indent=1) + "\n")
    os.replace(tmp, path)  # a crash mid-write must not truncate the accumulated history


def append_rows(path: pathlib.Path, rows: Sequence[dict]) -> int:
    """Append ``rows`` to the JSON list at ``path`` (created with its folders), skipping rows already
    there (same run_id, provider, shape, variant, dtype, layout, config). Returns how many were added."""
    existing = read_rows(path)
    seen = {_row_key(r) for r in existing}
    new = [r for r in rows if _row_key(r) not in seen]
    if new or not path.exists():
        write_rows(path, existing + new)
    return len(new)


def _row_key(r: dict) -> tuple:
    return (r.get("run_id"), r.get("op"), r.get("provider"), json.dumps(r.get("shape"), sort_keys=True),
            r.get("variant"), r.get("dtype"), r.get("layout"), r.get("config"))


NO_MATPLOTLIB = "matplotlib is not installed: PNG skipped (pip install matplotlib, or the [bench] extra)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_panels(rows: Sequence[dict], key: Callable[[dict], tuple], draw: Callable, path: pathlib.Path, title: str,
                width: float = 11, panel_height: float = 3.6) -> str:
    """A PNG with one panel per distinct ``key(row)``, filled by ``draw(ax, key, rows_of_panel)``;
    returns what happened (written, or why not)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    if not groups:
        return "no rows: PNG skipped"
    fig, axes = plt.subplots(len(groups), 1, figsize=(width, panel_height * len(groups)), squeeze=False)
    for ax, (panel, group) in zip(axes[:, 0], groups.items()):
        draw(ax, panel, group)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def plot_rows(rows: Sequence[dict], path: pathlib.Path, title: str) -> str:
    """Bar chart of the metric (TFLOP/s, TB/s) per shape and provider, one panel per table; returns
    what happened."""

    def draw(ax, panel, group):
        variant, dtype, layout = panel
        providers = list(dict.fromkeys(r["provider"] for r in group))
        shapes = list(dict.fromkeys(shape_label(r["shape"]) for r in group))
        cells = {(shape_label(r["shape"]), r["provider"]): r for r in group}
        width = 0.8 / len(providers)
        for i, p in enumerate(providers):
            xs = [j + i * width for j, s in enumerate(shapes) if (s, p) in cells]
            p50 = [cells[(s, p)]["p50"] for s in shapes if (s, p) in cells]
            lo = [cells[(s, p)]["p50"] - cells[(s, p)]["p20"] for s in shapes if (s, p) in cells]
            hi = [cells[(s, p)]["p80"] - cells[(s, p)]["p50"] for s in shapes if (s, p) in cells]
            ax.bar(xs, p50, width, yerr=[lo, hi], label=p, capsize=2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(f"{metric_unit(group[0].get('metric'))} (p20-p50-p80)")
        ax.set_title(f"{variant} · {dtype} · {layout}", fontsize=10)
        ax.legend(fontsize=8)

    return plot_panels(rows, lambda r: (r["variant"], r["dtype"], r["layout"]), draw, path, title)


def write_outputs(out_dir: pathlib.Path, stem: str, rows: Sequence[dict], text: str, title: str,
                  plot: bool = True) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    messages = []
    write_rows(out_dir / f"{stem}.json", rows)
    messages.append(f"wrote {out_dir / (stem + '.json')} ({len(rows)} rows)")
    (out_dir / f"{stem}.txt").write_text(text + "\n")
    messages.append(f"wrote {out_dir / (stem + '.txt')}")
    if plot:
        messages.append(plot_rows(rows, out_dir / f"{stem}.png", title))
    return messages


# ----------------------------------------------------------------------------------------------------
# command line


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", help="comma-separated shapes, e.g. 8192x8192x8192,16x8192x8192 "
                                         "(gemm: MxNxK); default: the op's standard set")
    parser.add_argument("--dtype", type=parse_dtype, default=torch.bfloat16,
                        help=f"input dtype: {', '.join(DTYPES)} (default bf16)")
    parser.add_argument("--providers", help="comma-separated providers to time (default: all the op has)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="do_bench warmup in ms (default 50; sweep 10)")
    parser.add_argument("--rep", type=float, default=None,
                        help="do_bench repetition time in ms (default 200; sweep 30)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="time every provider this many times, interleaved, and keep each quantile's "
                             "median over the rounds (default 3 on a GPU, 1 under the interpreter and in "
                             "sweeps)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time replays of CUDA-graph-captured calls (no host launch overhead, for "
                             "every provider alike) instead of eager calls")
    parser.add_argument("--sweep", action="store_true",
                        help="time every candidate launch config per shape instead of the default one")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="sweep: stop starting new configs after this many seconds (default 480)")
    parser.add_argument("--top", type=int, default=5, help="sweep: configs listed per shape (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="also write this run's rows (.json), table (.txt) and plot (.png) here")
    parser.add_argument("--results-dir", type=pathlib.Path,
                        help="append rows to RESULTS_DIR/<device>/<op>.json and regenerate the RESULTS.md "
                             "beside it (default on a GPU: benchmarks/results; under the interpreter rows "
                             "are not recorded unless this is given)")
    parser.add_argument("--no-record", action="store_true", help="do not append rows to the results folder")


def run_bench(op_module, opts: argparse.Namespace, device: torch.device) -> int:
    """``bench OP``: time, print, write, record. Returns the exit status (1 if anything failed)."""
    from . import results

    sweep = bool(opts.sweep)
    if sweep and not hasattr(op_module, "sweep"):
        print(f"{op_module.NAME} has no --sweep")
        return 2
    if opts.warmup is None:
        opts.warmup = 10.0 if sweep else 50.0
    if opts.rep is None:
        opts.rep = 30.0 if sweep else 200.0
    if getattr(opts, "rounds", None) is None:
        opts.rounds = 3 if device.type == "cuda" and not sweep else 1
    if opts.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {opts.rounds}")
    run = Run(op_module.NAME, device, "sweep" if sweep else "bench", cuda_graph=opts.cuda_graph)
    env = run.env
    header = [f"tilekernels bench {op_module.NAME}{' --sweep' if sweep else ''} on {env['gpu']} — {run.date}",
              (f"torch {env['torch']} · triton {env['triton']} · tilekernels {env['tilekernels']}"
               f"{' · commit ' + env['commit'] if env['commit'] else ''} · run {run.run_id}")]
    if device.type == "cuda":
        header.append(f"{'CUDA-graph replays (do_bench_cudagraph)' if opts.cuda_graph else 'eager calls'}; "
                      f"do_bench warmup {opts.warmup:g} ms, rep {opts.rep:g} ms, {opts.rounds} interleaved "
                      f"round(s), medians over rounds; inputs rotate through >= 2x "
                      f"L2 ({l2_bytes(device) / 2**20:.0f} MiB); "
                      f"{metric_unit(getattr(op_module, 'METRIC', 'tflops'))} = "
                      f"{getattr(op_module, 'FLOPS_FORMULA', '2*M*N*K')} / median time")
    else:
        header.append(INTERPRETER_WARNING)
    print("\n".join(header), flush=True)

    if sweep:
        text = op_module.sweep(opts, device, run)
    else:
        for case in op_module.bench_cases(opts, device):
            run_case(case, run, opts.warmup, opts.rep, opts.rounds)
        own_report = getattr(op_module, "report_rows", None)   # an op's own tables (RESULTS.md uses them too)
        text = (own_report(run.rows, interpreter_note=False) if own_report
                else report(run.rows, op_module, interpreter_note=False))  # the header says it already
    footer = []
    if run.notes:
        footer.append("notes:\n" + "\n".join(f"  {n}" for n in run.notes))
    if run.failures:
        footer.append(f"{len(run.failures)} failure(s):\n" + "\n".join(f"  {f}" for f in run.failures))
    full = "\n\n".join(["\n".join(header), text or "(no rows)"] + footer)
    # A sweep prints its tables as it goes (a killed run still leaves them in the log).
    print("\n" + "\n\n".join(([] if sweep else [text or "(no rows)"]) + footer), flush=True)

    # An eager run and a CUDA-graph run into one --out folder must not overwrite each other.
    stem = op_module.NAME + ("-sweep" if sweep else "") + ("-graph" if getattr(opts, "cuda_graph", False) else "")
    if opts.out is not None:
        title = f"tilekernels {op_module.NAME} on {env['gpu']}, {run.date}"
        if device.type != "cuda":
            title += " (CPU interpreter: timings meaningless)"
        for message in write_outputs(opts.out, stem, run.rows, full, title, plot=not sweep):
            print(message)
    results_dir = opts.results_dir
    if results_dir is None and device.type == "cuda":
        results_dir = default_results_dir()
    if results_dir is not None and not opts.no_record and run.rows:
        path = results_dir / env["gpu_slug"] / f"{op_module.NAME}.json"
        added = append_rows(path, run.rows)
        print(f"appended {added} rows to {path}")
        md = results.write_results_md(results_dir)
        print(f"regenerated {md}")
    elif device.type != "cuda" and results_dir is None:
        print("rows not recorded (CPU interpreter); pass --results-dir to record them anyway")
    return 1 if run.failures else 0
