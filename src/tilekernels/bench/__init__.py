"""The benchmark and check harness behind ``python -m tilekernels bench|check``.

One module per op family, registered in ``OPS`` by name; adding an op is that module plus one line
here. The harness (``harness.py``: timing, input rotation, rows, tables, plots; ``check.py``: the
pass/fail runner; ``results.py``: ``benchmarks/RESULTS.md``) knows nothing op-specific. An op module
provides:

- ``NAME``: the op's name (the key in ``OPS``, the JSON file's stem).
- ``check_cases(device) -> list[check.CheckCase]``: cases run against the op's reference, sized for
  the device (real sizes on a GPU, small odd shapes on the CPU interpreter).
- ``bench_cases(opts, device) -> list[harness.BenchCase]``: what ``bench OP`` times; ``opts`` is the
  parsed command line (``harness.add_common_arguments`` plus the op's ``add_arguments``).
- optional ``add_arguments(parser)``: op-specific ``bench`` options.
- optional ``sweep(opts, device, run) -> list[row]``: ``bench OP --sweep`` (launch-config tuning).
- optional ``anchor(row) -> (label, value) | None``: a published/measured reference figure
  (ANCHORS.md) for the row's shape, compared in tables; ``ANCHOR_PROVIDER`` names the provider that
  figure was measured for.
- optional ``run_bench(opts, device) -> int``: replaces the harness's single-process timing (the
  tk.dist ops time across ranks under torchrun).
- optional ``report_rows(rows, markdown=False, interpreter_note=True)``: the op's own tables, printed
  by ``bench`` and used by ``RESULTS.md`` (the paged ops add their goals and bandwidth floor to the
  harness's tables).
- optional ``METRIC``: ``"tflops"`` (default) or ``"tbps"`` for the header; each ``BenchCase`` says
  its own ``metric``, which its rows, tables and plots show.

An entry ``"module:ATTRIBUTE"`` names an object in a module that provides the above, for op families
that share one bench module (``bench/dist.py``, ``bench/paged.py``, ``bench/norm.py``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module; the order is the order `check` and `bench` run them in.
OPS: dict[str, str] = {
    "gemm": "tilekernels.bench.gemm",
    "all_gather_matmul": "tilekernels.bench.dist:ALL_GATHER_MATMUL",
    "matmul_reduce_scatter": "tilekernels.bench.dist:MATMUL_REDUCE_SCATTER",
    "flash_attn": "tilekernels.bench.attention",
    "batch_prefill": "tilekernels.bench.paged:BATCH_PREFILL",
    "batch_decode": "tilekernels.bench.paged:BATCH_DECODE",
    "layer_norm": "tilekernels.bench.norm:LAYER_NORM",
    "rms_norm": "tilekernels.bench.norm:RMS_NORM",
    "add_rms_norm_quant": "tilekernels.bench.norm:ADD_RMS_NORM_QUANT",
    "dynamic_quant": "tilekernels.bench.norm:DYNAMIC_QUANT",
    "smooth_quant": "tilekernels.bench.norm:SMOOTH_QUANT",
    "moe_smooth_quant": "tilekernels.bench.norm:MOE_SMOOTH_QUANT",
}


def op_names() -> list[str]:
    return list(OPS)


def load_op(name: str) -> ModuleType:
    """The bench module (or module attribute) of op ``name``; ValueError naming the registered ops
    otherwise."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; registered ops: {', '.join(OPS)}")
    module_name, _, attribute = OPS[name].partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module
