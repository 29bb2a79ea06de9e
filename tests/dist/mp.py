"""Run a test body on several processes, one per rank: gloo on CPU (kernels under the interpreter),
NCCL with one GPU per rank on a multi-GPU machine.

``run_ranks(body, world, *args)`` spawns ``world`` processes that each init a process group, call
``body(rank, world, *args)`` and tear down; an exception on any rank fails the test with that rank's
traceback. ``body`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _entry(rank, world, backend, init_file, body, args, errors):
    os.environ.update(NVLINK_ENV)
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


def run_ranks(body, world: int, *args, backend: str | None = None, timeout_s: float = 600.0) -> None:
    backend = backend or ("nccl" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                          else "gloo")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world, backend, init_file, body, args, errors))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
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
