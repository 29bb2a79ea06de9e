"""Async-input GEMM: compute ``a @ b`` while A's rows are still arriving.

In tensor-parallel overlap, A is gathered from peers chunk by chunk. ``tk.async_input_mm`` launches
straight away: its persistent programs start with the pivot chunk (the one already local) and wait for
each chunk's signal before reading its rows. Here a producer stream plays the peers: it copies the
chunks in from pinned host memory, in a random order with random gaps, and sets each chunk's signal
after its rows. A is refilled with NaN before every repetition, so a row read before it arrived would
show up in the result; the script checks that every result is bit-identical to ``tk.gemm`` on the
complete A, and exits 1 if not.

On a CUDA machine (bf16, M=4096 in 8 chunks, N=2048, K=4096 by default):
    PYTHONPATH=src python examples/async_input_gemm.py [--m --n --k --chunks --pivot --reps --seed]
Without a GPU, on Triton's CPU interpreter (tiny fp32 sizes), where TRITON_INTERPRET must be set in
the environment because triton reads it when it is imported:
    TRITON_INTERPRET=1 PYTHONPATH=src python examples/async_input_gemm.py
"""

import argparse
import os
import random
import sys
import time

import torch

import tilekernels as tk


def parse_args(on_gpu: bool) -> argparse.Namespace:
    """Sizes default to a realistic shape on a GPU and to a tiny one under the interpreter."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=4096 if on_gpu else 96, help="rows of A (split into chunks)")
    p.add_argument("--n", type=int, default=2048 if on_gpu else 40)
    p.add_argument("--k", type=int, default=4096 if on_gpu else 48)
    p.add_argument("--chunks", type=int, default=8 if on_gpu else 4, help="chunks A's rows arrive in")
    p.add_argument("--pivot", type=int, default=0, help="chunk the GEMM computes first")
    p.add_argument("--reps", type=int, default=10 if on_gpu else 2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def produce(a, host_a, signals, epoch, order, stream):
    """Enqueue on ``stream`` (None: the current one) each chunk of ``order``: its rows, then its signal.
    Returns the pinned epoch tensor, which must stay alive until the copies have run."""
    rows = a.shape[0] // signals.numel()
    epoch_host = torch.full((1,), epoch, dtype=torch.int32, pin_memory=a.is_cuda)
    with torch.cuda.stream(stream):
        for c in order:
            # Host-side gaps stagger the arrivals, so the GEMM really waits on chunks in flight.
            time.sleep(random.uniform(0, 200e-6))
            # Both writes are copy-engine transfers from pinned memory, not kernels: while they wait,
            # the GEMM's persistent programs occupy every SM, so a producer kernel would queue behind
            # them until their waits time out (and a kernel's first launch in a process loads its
            # module, which itself waits for the running GEMM). torch.ops.symm_mem.stream_write_value32_
            # is the other SM-free way to set a signal. Stream order puts the signal after the rows.
            a[c * rows:(c + 1) * rows].copy_(host_a[c * rows:(c + 1) * rows], non_blocking=True)
            signals[c:c + 1].copy_(epoch_host, non_blocking=True)
    return epoch_host


def main() -> int:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    on_gpu = torch.cuda.is_available() and not interpret
    if not on_gpu and not interpret:
        print("No CUDA device: rerun with TRITON_INTERPRET=1 in the environment to use Triton's CPU "
              "interpreter (it must be set before triton is imported).")
        return 2
    args = parse_args(on_gpu)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    host_a = torch.randn(args.m, args.k).to(dtype)
    if on_gpu:
        host_a = host_a.pin_memory()  # pageable memory would make the copies synchronous staging
    b = torch.randn(args.k, args.n).to(device=device, dtype=dtype)
    a = torch.empty(args.m, args.k, device=device, dtype=dtype)
    # Signals are epochs: rep r waits for r + 1, so they are never zeroed between reps.
    signals = torch.zeros(args.chunks, dtype=torch.int32, device=device)
    producer = torch.cuda.Stream() if on_gpu else None
    consumer_order = [(args.pivot + i) % args.chunks for i in range(args.chunks)]

    outs, epoch_tensors = [], []
    for rep in range(args.reps):
        epoch = rep + 1
        order = consumer_order[:]
        while order == consumer_order and args.chunks > 1:
            random.shuffle(order)
        # On the consumer stream the NaN fill runs after the previous GEMM (whose end means every
        # earlier copy has landed) and before this one; the producer waits for it before copying.
        a.fill_(float("nan"))
        if on_gpu:
            producer.wait_stream(torch.cuda.current_stream())
            outs.append(tk.async_input_mm(a, b, signals, chunk_pivot=args.pivot, signal_value=epoch))
            epoch_tensors.append(produce(a, host_a, signals, epoch, order, producer))
        else:
            # The interpreter runs programs one after another, so nothing could arrive while one
            # waits: deliver every chunk before the call.
            produce(a, host_a, signals, epoch, order, None)
            outs.append(tk.async_input_mm(a, b, signals, chunk_pivot=args.pivot, signal_value=epoch))
        print(f"rep {rep}: epoch {epoch}, chunks arrive in order {order}, GEMM starts at chunk {args.pivot}")

    if on_gpu:
        torch.cuda.synchronize()
    tk.raise_pending_errors()

    a_full = host_a.to(device)
    ref = tk.gemm(a_full, b)
    ref32 = torch.matmul(a_full.float(), b.float())
    exact = all(torch.equal(y, ref) for y in outs)
    diff = max((y.float() - ref.float()).abs().max().item() for y in outs)
    err = max((y.float() - ref32).abs().max().item() for y in outs)
    print(f"{args.reps} reps of {args.m}x{args.k} @ {args.k}x{args.n} {dtype} on {device}, "
          f"{args.chunks} chunks of {args.m // args.chunks} rows")
    print(f"bit-exact vs tk.gemm on the full A: {exact} (max |diff| {diff:.3g})")
    print(f"max |diff| vs fp32 torch.matmul: {err:.3g} (max |ref| {ref32.abs().max().item():.3g})")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
