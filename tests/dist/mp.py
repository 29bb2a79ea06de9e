"""Run a test body on several processes, one per rank: gloo on CPU (kernels under the interpreter),
NCCL with one GPU per rank on a multi-GPU machine.

``run_ranks(body, world, *args)`` spawns ``world`` processes that each init a process group, call
``body(rank, world, *args)`` and tear down; an exception on any rank fails the test with that rank's
traceback. ``body`` must be a module-level function (it is pickled by name). ``gpu_world()`` is the world size
of the GPU lane: every visible GPU, or ``TILEKERNELS_TEST_WORLD`` when set.
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank, world, backend, init_file, body, args, errors, stack_dump_s):
    os.environ.update(NVLINK_ENV)
    # A rank still running shortly before the parent gives up prints where it is (then is killed).
    faulthandler.dump_traceback_later(stack_dump_s, exit=False)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
        try:
            body(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def gpu_world() -> int:
    """Ranks for the multigpu tests: ``TILEKERNELS_TEST_WORLD`` if set, else every visible GPU."""
    world = int(os.environ.get("TILEKERNELS_TEST_WORLD") or torch.cuda.device_count())
    if world > torch.cuda.device_count():
        raise ValueError(f"TILEKERNELS_TEST_WORLD={world}, but only {torch.cuda.device_count()} GPUs are visible")
    return world


def run_ranks(body, world: int, *args, backend: str | None = None, timeout_s: float | None = None) -> None:
    """``timeout_s``: how long the ranks may take together (default ``TILEKERNELS_TEST_TIMEOUT_S`` or
    600); ranks still alive then print their Python stacks and are killed, and the test fails."""
    timeout_s = float(timeout_s or os.environ.get("TILEKERNELS_TEST_TIMEOUT_S") or 600.0)
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                          else "gloo")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world, backend, init_file, body, args, errors,
                                                    max(1.0, timeout_s - 5.0)))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        if failures:
            rank, tb = sorted(failures)[0]
            raise AssertionError(f"rank {rank} of {world} failed:\n{tb}")
        if hung:
            raise AssertionError(f"ranks {hung} of {world} did not finish within {timeout_s} s")
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited abnormally (rank, exit code): {bad}")
