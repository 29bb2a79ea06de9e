"""``python -m tilekernels check|bench|info``.

- ``check [--op OP] [--filter PATTERN]``: every registered op against its reference on whatever
  device is present (a GPU at real sizes, or the CPU interpreter at small odd shapes); a pass/fail
  table with error ratios; exit status 1 if any case fails.
- ``bench [OP] [--shapes ...] [--dtype ...] [--sweep] [--out DIR] ...``: time ours against the
  baselines (see ``tilekernels.bench``); ``bench --update-results [RUN.json ...]`` imports run files
  from another machine and regenerates ``benchmarks/RESULTS.md``; ``bench costmodel`` fits tk.dist's
  cost model to the measured results and predicts other world sizes (``tilekernels.bench.costmodel``).
- ``info``: versions, device, SM count, capability, interpreter, TMA support.

Without a CUDA device, kernels can only run under Triton's CPU interpreter, which triton reads when it
is imported, and importing this package imports triton: so ``check``/``bench`` on such a machine
restart themselves once with ``TRITON_INTERPRET=1`` rather than fail.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys

import torch

from ._runtime import default_device, is_interpreter

RUN_COMMANDS = ("check", "bench")


def _restart_under_interpreter(argv: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    print("no CUDA device: restarting with TRITON_INTERPRET=1 (kernels run on the CPU interpreter)",
          file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "tilekernels", *argv])


def _info(args: list[str]) -> int:
    import triton

    from . import bench
    from ._runtime import capability, device_name, sm_count, supports_tensor_descriptors
    from .bench.harness import git_commit, l2_bytes, tilekernels_version

    parser = argparse.ArgumentParser(prog="python -m tilekernels info",
                                     description="Versions, device and what the kernels can use here.")
    parser.parse_args(args)
    device = default_device()
    commit = git_commit()
    lines = [
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("triton", triton.__version__),
        ("tilekernels", tilekernels_version() + (f" (commit {commit})" if commit else "")),
        ("device", f"{device_name(device)} ({device})"),
        ("CUDA devices", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"),
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        major, minor = capability(device)
        lines += [
            ("SM count", str(sm_count(device))),
            ("capability", f"{major}.{minor}"),
            ("memory", f"{props.total_memory / 2**30:.1f} GiB"),
            ("L2", f"{l2_bytes(device) / 2**20:.0f} MiB"),
        ]
    else:
        lines += [("SM count", f"{sm_count(device)} (interpreter stand-in)"), ("capability", "none (CPU)")]
    if is_interpreter():
        lines.append(("interpreter", "yes (TRITON_INTERPRET=1): kernels run on CPU tensors"))
    elif device.type == "cuda":
        lines.append(("interpreter", "no"))
    else:
        lines.append(("interpreter", ("no, and no CUDA device: kernels cannot run; `check`/`bench` switch to "
                                      "the interpreter themselves, other code needs TRITON_INTERPRET=1")))
    lines.append(("TMA descriptors", "yes" if supports_tensor_descriptors(device) else "no"))
    lines.append(("registered ops", ", ".join(bench.op_names())))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key.ljust(width)}  {value}")
    return 0


def _check(args: list[str]) -> int:
    from . import bench
    from .bench import check

    parser = argparse.ArgumentParser(prog="python -m tilekernels check",
                                     description="Run every registered op against its reference.")
    parser.add_argument("--op", action="append", choices=bench.op_names(),
                        help="only this op (repeatable); default: all registered ops")
    parser.add_argument("--filter", help="only cases whose name matches this glob or contains this text")
    opts = parser.parse_args(args)
    return check.main(opts.op or bench.op_names(), default_device(), opts.filter)


def _bench_parser(op_modules=()) -> argparse.ArgumentParser:
    from . import bench
    from .bench.harness import add_common_arguments

    parser = argparse.ArgumentParser(
        prog="python -m tilekernels bench", conflict_handler="resolve",
        description="Time tilekernels against its baselines; rows go to "
                    "benchmarks/results/<device>/<op>.json.")
    parser.add_argument("op", nargs="?", choices=bench.op_names(), help="op to time (default: all)")
    add_common_arguments(parser)
    parser.add_argument("--update-results", nargs="*", type=pathlib.Path, metavar="RUN_JSON",
                        help="import these run files (e.g. a GPU lane's $OUT/gemm.json) into the results "
                             "folder and regenerate benchmarks/RESULTS.md; times nothing")
    for module in op_modules:
        if hasattr(module, "add_arguments"):
            module.add_arguments(parser.add_argument_group(f"{module.NAME} options"))
    return parser


def _bench(args: list[str]) -> int:
    from . import bench
    from .bench import harness, results

    if args[:1] == ["costmodel"]:  # tk.dist's cost model: reads measured results, times nothing
        from .bench import costmodel

        return costmodel.main(args[1:])
    # An op's own options are known once the op is (`bench gemm --layout RC`); with no op named, every
    # op's options are accepted and each op reads its own.
    op_name = args[0] if args and not args[0].startswith("-") else None
    names = [op_name] if op_name in bench.OPS else bench.op_names()
    modules = [bench.load_op(name) for name in names]
    opts = _bench_parser(modules).parse_args(args)
    if opts.update_results is not None:
        return results.main(opts.results_dir or harness.default_results_dir(), opts.update_results)
    device = default_device()
    if device.type != "cuda" and not is_interpreter():
        print("no CUDA device and TRITON_INTERPRET is not 1: nothing can run the kernels", file=sys.stderr)
        return 2
    status = 0
    for module in modules:
        try:
            module_opts = argparse.Namespace(**vars(opts))
            own_run = getattr(module, "run_bench", None)   # ops timed across ranks (bench/dist.py)
            status = max(status, own_run(module_opts, device) if own_run else
                         harness.run_bench(module, module_opts, device))
        except harness.UsageError as exc:
            print(f"python -m tilekernels bench {module.NAME}: error: {exc}", file=sys.stderr)
            return 2
    return status


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"info": _info, "check": _check, "bench": _bench}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip().split("\n\n", 1)[0])
        print("\nusage: python -m tilekernels {check,bench,info} [options]   (each takes --help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    wants_kernels = (command in RUN_COMMANDS and "--update-results" not in rest and rest[:1] != ["costmodel"]
                     and not {"-h", "--help"} & set(rest))
    if wants_kernels and from_command_line and not torch.cuda.is_available() and not is_interpreter():
        _restart_under_interpreter(argv)
    return commands[command](rest)


if __name__ == "__main__":
    sys.exit(main())
