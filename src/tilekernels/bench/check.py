"""``python -m tilekernels check``: every registered op against its reference, as a pass/fail table.

A case is a name and a function returning a ``testing.Comparison`` (the error-ratio rule: the op's
error to the fp64 reference against PyTorch's own low-precision error). A case that raises is a FAIL
carrying the exception, never a crash of the runner; so is an op whose cases cannot even be built
(e.g. its module fails to import).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
from collections.abc import Callable, Sequence

import torch

from . import load_op
from .harness import environment, exception_text, format_table


@dataclasses.dataclass
class CheckCase:
    name: str          # readable id: dtype-layout-MxNxK-epilogue
    run: Callable[[], object]   # returns a testing.Comparison


@dataclasses.dataclass
class CheckResult:
    op: str
    case: str
    passed: bool
    ratio: float | None = None
    max_err: float | None = None
    max_err_torch: float | None = None
    seconds: float = 0.0
    note: str = ""


def run_case(op: str, case: CheckCase, device: torch.device) -> CheckResult:
    start = time.perf_counter()
    try:
        comparison = case.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception:  # a sticky CUDA error will fail the next cases too, visibly
                pass
        return CheckResult(op, case.name, False, seconds=time.perf_counter() - start,
                           note=f"raised {exception_text(exc)}")
    seconds = time.perf_counter() - start
    note = ""
    if not comparison.passed:
        note = str(comparison)
    return CheckResult(op, case.name, bool(comparison.passed), comparison.ratio, comparison.max_err,
                       comparison.max_err_torch, seconds, note)


def run_checks(ops: Sequence[str], device: torch.device, pattern: str | None = None,
               echo: bool = True) -> list[CheckResult]:
    results = []
    for op in ops:
        try:
            cases = load_op(op).check_cases(device)
        except Exception as exc:
            result = CheckResult(op, "(building the cases)", False, note=f"raised {exception_text(exc)}")
            results.append(result)
            if echo:
                print(f"FAIL {op}: {result.note}", flush=True)
            continue
        if pattern:
            cases = [c for c in cases if fnmatch.fnmatchcase(c.name, pattern) or pattern in c.name]
        for case in cases:
            result = run_case(op, case, device)
            results.append(result)
            if echo:
                status = "pass" if result.passed else "FAIL"
                ratio = f"ratio {result.ratio:.2f}" if result.ratio is not None else result.note
                print(f"  {status} {op} {case.name} ({result.seconds:.1f}s) {ratio}", flush=True)
    return results


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_results(results: Sequence[CheckResult]) -> str:
    headers = ["op", "case", "result", "ratio", "max err", "torch max err", "time s"]
    body = [[r.op, r.case, "PASS" if r.passed else "FAIL", _num(r.ratio, ".2f"), _num(r.max_err, ".2e"),
             _num(r.max_err_torch, ".2e"), f"{r.seconds:.1f}"] for r in results]
    text = format_table(headers, body, left=3)
    failed = [r for r in results if not r.passed]
    if failed:
        text += "\n\nfailures:\n" + "\n".join(f"  {r.op} {r.case}: {r.note}" for r in failed)
    text += f"\n\n{len(results) - len(failed)} passed, {len(failed)} failed"
    return text


def main(ops: Sequence[str], device: torch.device, pattern: str | None = None) -> int:
    env = environment(device)
    print(f"tilekernels check on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, "
          f"tilekernels {env['tilekernels']})")
    if device.type != "cuda":
        print("CPU interpreter (TRITON_INTERPRET=1): small odd shapes; real sizes, fp8 and int8 are "
              "checked on a GPU.")
    print("rule: max|out - fp64 ref| <= 2 x max|torch low-precision - fp64 ref| (+ a tiny floor); "
          "'ratio' is the first over the second", flush=True)
    start = time.perf_counter()
    results = run_checks(ops, device, pattern)
    print()
    print(format_results(results))
    print(f"({time.perf_counter() - start:.0f} s)")
    if not results:
        print("no cases matched")
        return 1
    return 0 if all(r.passed for r in results) else 1
