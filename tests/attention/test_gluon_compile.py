"""The Gluon kernels (the Hopper attention forward, backward and paged prefill, the norms' wide-row
backward and moe_smooth_quant's forward) compile for sm_90, on any machine.

The interpreter cannot run Gluon, so these kernels' numerics are tested in the GPU lane only
(``test_fmha_hopper.py``, ``test_fmha_bwd_hopper.py``, ``test_paged_hopper.py``, and
``tests/norm/test_norm.py``'s ``test_gpu_smem_backward``, ``tests/quant/test_quant.py``'s
``test_gpu_smem_quant``). What the CPU lane can
catch is a kernel that no longer compiles with the installed triton (the project supports 3.6 and 3.9,
whose Gluon APIs differ): each case
builds its launch's descriptors with the host helper and compiles to an sm_90 cubin. The compiling runs
in one child process without ``TRITON_INTERPRET`` (under the interpreter triton hands back interpreted
functions, which Gluon cannot call) and with an empty triton cache; run this file as a script to see the
cases' output.
"""

from __future__ import annotations

import json

import pytest

FORWARD_CASES = {"fwd-D128-causal": (128, True), "fwd-D256-full": (256, False)}
# bwd-D64-full compiles the D 64 full entry (2 ring slots, early_dq, stats_ahead); bwd-D128-causal the default
# step order
# (head dim, causal / "window", dQ in the Gluon kernel or None for the table's choice)
BACKWARD_CASES = {"bwd-D128-causal": (128, True, None), "bwd-D64-full": (64, False, None),
                  "bwd-D64-causal-with-dq": (64, True, True), "bwd-D64-full-dkdv-only": (64, False, False),
                  "bwd-D256-causal": (256, True, None), "bwd-D256-window": (256, "window", None)}
PAGED_CASES = {"paged-boxes16": 16, "paged-boxes1024": 1024, "paged-gather1": 1, "paged-gather3": 3}
# (norm, prefetch mode, warps, columns per access, programs per row[, a thread-block cluster[, dw/db in
# registers, ring slots]]): 16384
# columns per program (8192 when four programs share a row)
NORM_CASES = {"norm-bwd-layer-cpasync": ("layer", 2, 32, 8, 1), "norm-bwd-rms-registers": ("rms", 1, 16, 4, 1),
              "norm-bwd-layer-noprefetch": ("layer", 0, 16, 4, 1), "norm-bwd-layer-split4": ("layer", 2, 16, 8, 4),
              "norm-bwd-rms-split2": ("rms", 2, 16, 8, 2),
              "norm-bwd-layer-cluster2": ("layer", 2, 32, 8, 2, True),
              "norm-bwd-rms-cluster4": ("rms", 2, 32, 8, 4, True),
              # dw/db in registers: a ring of two staged rows (the table's layer norm at 16384), x and dy held
              "norm-bwd-layer-regs-ring2": ("layer", 2, 32, 8, 1, False, True, 2),
              "norm-bwd-rms-regs-held": ("rms", 2, 16, 8, 1, False, True, 1),
              "norm-bwd-layer-regs-cluster2": ("layer", 2, 32, 8, 2, True, True, 3)}


def _compile_sm90(fn, args: dict, constexprs: dict, num_warps: int = 4, maxnreg: int | None = None):
    """Compile the Gluon kernel ``fn`` for sm_90 with these runtime ``args`` (tensors, descriptors, ints,
    floats, by name) and ``constexprs``, specialised as a launch would be: ints that are multiples of 16
    and 16-byte aligned pointers marked divisible by 16; ``maxnreg``: triton's register cap, as the launch
    passes it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = fn.arg_names
    # a pointer passed as None specialises to a constexpr, as at a launch
    constexprs = {**constexprs, **{n: None for n, v in args.items() if v is None}}
    args = {n: v for n, v in args.items() if v is not None}
    missing = set(names) - set(args) - set(constexprs)
    assert not missing, f"no value for {sorted(missing)}"
    signature = {n: "constexpr" if n in constexprs else mangle_type(args[n]) for n in names}

    def divisible(value) -> bool:
        if isinstance(value, torch.Tensor):
            return value.data_ptr() % 16 == 0
        return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0

    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in args and divisible(args[n])}
    source = GluonASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, maxnreg=maxnreg))

# moe_smooth_quant's Gluon forward (norm/_gluon._moe_rows_smem): (N, x dtype name, quant dtype name, k, ids dtype
# name); the widths with an SMEM_QUANT_CONFIGS entry take it (and its register cap), the others a config of their own
QUANT_CASES = {"moe-quant-4096": (4096, "bfloat16", "int8", 2, "int32"),
               "moe-quant-4096-int64-ids": (4096, "bfloat16", "int8", 2, "int64"),
               "moe-quant-8192-int64-ids": (8192, "bfloat16", "float8_e4m3fn", 2, "int64"),
               "moe-quant-16384": (16384, "bfloat16", "int8", 2, "int32"),
               "moe-quant-masked": (7168, "float16", "float8_e4m3fn", 1, "int32"),
               "moe-quant-fp32": (2048, "float32", "int8", 3, "int32"),
               "moe-quant-k8-1024": (1024, "bfloat16", "int8", 8, "int32"),
               "moe-quant-k8-16384": (16384, "bfloat16", "float8_e4m3fn", 8, "int64")}

def _compile_forward(head_dim: int, causal: bool):
    import torch

    from tilekernels.attention import _fwd

    cfg = _fwd.HOPPER_FWD_CONFIGS[head_dim]
    rows, heads = 512, 4
    qkv = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)
    args = dict(q_desc=_fwd.hopper_descriptor(qkv, rows, _fwd.HOPPER_BLOCK_M),
                k_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_n),
                v_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_n),
                Out=qkv, Lse=torch.empty(heads, rows), CuSeqlensQ=torch.zeros(3, dtype=torch.int32),
                CuSeqlensK=torch.zeros(3, dtype=torch.int32), stride_ob=0, stride_os=heads * head_dim,
                stride_oh=head_dim, stride_lb=0, stride_lh=rows, seqlen_q_batch=0, seqlen_k_batch=0,
                num_heads=heads, head_group=2, qk_scale_log2=0.1, window_left=-1, window_right=0)
    return _compile_sm90(_fwd._attn_fwd_hopper, args, dict(
        HEAD_DIM=head_dim, BLOCK_M=_fwd.HOPPER_BLOCK_M, BLOCK_N=cfg.block_n, STAGES=cfg.stages, IS_VARLEN=True,
        HAS_LEFT=False, HAS_RIGHT=causal, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs))


def _compile_backward(head_dim: int, causal: bool, with_dq: bool | None):
    import dataclasses

    import torch

    from tilekernels.attention import _bwd, _fwd

    cfg = _bwd.hopper_bwd_config(head_dim, bool(causal))
    if with_dq is not None:
        cfg = dataclasses.replace(cfg, with_dq=with_dq)
    window = causal == "window"
    rows, heads = 512, 4
    qkv = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(heads, rows)
    args = dict(q_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_m),
                k_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_n),
                v_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_n),
                do_desc=_fwd.hopper_descriptor(qkv, rows, cfg.block_m),
                dq_desc=_fwd.hopper_descriptor(torch.empty(rows, heads, head_dim), rows, cfg.block_m),
                DK=qkv, DV=qkv, Lse=lse, Delta=lse,
                CuSeqlensQ=torch.zeros(3, dtype=torch.int32), CuSeqlensK=torch.zeros(3, dtype=torch.int32),
                stride_dkb=0, stride_dks=heads * head_dim, stride_dkh=head_dim, stride_dvb=0,
                stride_dvs=heads * head_dim, stride_dvh=head_dim, stride_lb=0,
                stride_lh=rows, seqlen_q_batch=0, seqlen_k_batch=0, num_kv_heads=2, head_group=2,
                qk_scale_log2=0.1, scale=0.1, window_left=100 if window else -1, window_right=0 if causal else -1)
    return _compile_sm90(_bwd._attn_bwd_hopper, args, dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, IS_VARLEN=True,
        HAS_LEFT=window, HAS_RIGHT=bool(causal), SPLIT_D=cfg.split_d, CONSUMER_REGS=cfg.consumer_regs,
        WORKER_REGS=cfg.worker_regs, EARLY_DQ=cfg.early_dq, FRESH_KV=cfg.fresh_kv, WITH_DQ=cfg.with_dq,
        STATS_AHEAD=cfg.stats_ahead))


def _compile_paged(page_size: int):
    import torch

    from tilekernels.attention import _fwd, _paged_kernels

    head_dim, heads, pages = 128, 4, 8
    cfg = _fwd.HOPPER_FWD_CONFIGS[head_dim]
    gather = page_size < 8 or page_size & (page_size - 1) != 0
    box_rows = cfg.block_n if gather else min(page_size, cfg.block_n)
    q = torch.empty(300, heads, head_dim, dtype=torch.bfloat16)
    cache = torch.empty(pages, page_size, 2, head_dim, dtype=torch.bfloat16)
    rows = pages * page_size
    ints = torch.zeros(4, dtype=torch.int32)
    args = dict(q_desc=_fwd.hopper_descriptor(q, q.shape[0], _fwd.HOPPER_BLOCK_M),
                k_desc=_fwd.hopper_descriptor(cache, rows, box_rows, cfg.block_n),
                v_desc=_fwd.hopper_descriptor(cache, rows, box_rows, cfg.block_n),
                K=cache, V=cache, Out=q, Lse=torch.empty(q.shape[0], heads), QoIndptr=ints, KvIndptr=ints,
                PageTable=ints, LastPageLen=ints, SeqlenK=ints, stride_kr=cache.stride(1),
                stride_vr=cache.stride(1), stride_ot=q.stride(0), stride_oh=q.stride(1), stride_lt=heads,
                stride_lh=1, stride_table=0, num_seqs=3, num_heads=heads, head_group=2, qk_scale_log2=0.1,
                v_scale_value=1.0, window_left=-1)
    return _compile_sm90(_paged_kernels._paged_prefill_hopper, args, dict(
        HEAD_DIM=head_dim, BLOCK_M=_fwd.HOPPER_BLOCK_M, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        PAGE_SIZE=page_size, GATHER=gather, SEARCH_STEPS=2, TABLE_2D=False, CAUSAL=True, HAS_LEFT=False,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs))


def _compile_norm_backward(norm: str, prefetch: int, num_warps: int, vec: int, split: int, cluster: bool = False,
                           acc_regs: bool = False, stages: int = 1):
    import torch

    from tilekernels.norm import _gluon, _kernels

    M, block_n = 64, 16384 if split < 4 else 8192
    N = block_n * split
    x = torch.empty(M, N, dtype=torch.bfloat16)
    vector, stats = torch.empty(N, dtype=torch.bfloat16), torch.empty(M)
    part = torch.empty(4, N)
    args = dict(x_ptr=x, xbias_ptr=vector, dy_ptr=x, ds_ptr=x, w_ptr=vector, mean_ptr=stats, rstd_ptr=stats, dx_ptr=x,
                dw_part_ptr=part, db_part_ptr=part, M=M, N=N, stride_xm=N, stride_dym=N, stride_dsm=N)
    layer = norm == "layer"
    return _compile_sm90(_gluon._row_backward_smem, dict(
        args, xchg_ptr=torch.zeros(M, split, 2, dtype=torch.int64) if split > 1 else None, max_spins=100), dict(
        NORM=_kernels.NORMS[norm], HAS_W=True, HAS_XBIAS=layer, HAS_DS=True, WANT_DW=True, WANT_DB=layer,
        PREFETCH=prefetch, BLOCK_N=block_n, VEC=vec, SPLIT=split, CLUSTER=cluster, ACC_REGS=acc_regs,
        STAGES=stages), num_warps=num_warps)


def _compile_quant(N: int, dtype: str, quant_dtype: str, k: int, ids_dtype: str):
    import torch
    import triton

    from tilekernels.norm import _gluon, _kernels
    from tilekernels.norm.norm import QUANT_MAX

    T, E = 64, 8
    x_dtype, q_dtype = getattr(torch, dtype), getattr(torch, quant_dtype)
    block_n = triton.next_power_of_2(N)
    config = _kernels.smem_quant_config(N, "moe", k) or _kernels.SmemQuantConfig(8, 3, 2)
    args = dict(x_ptr=torch.empty(T, N, dtype=x_dtype), smooth_ptr=torch.empty(E, N),
                topk_ptr=torch.empty(T, k, dtype=getattr(torch, ids_dtype)),
                q_ptr=torch.empty(T * k, N, dtype=q_dtype), scale_ptr=torch.empty(T * k), T=T, N=N, num_experts=E,
                stride_xm=N, stride_sm=N, stride_tk_t=k, stride_tk_j=1)
    return _compile_sm90(_gluon._moe_rows_smem, args, dict(
        QMAX=QUANT_MAX[q_dtype], TOPK=k, BLOCK_N=block_n, VEC=16 // x_dtype.itemsize, STAGES=config.stages,
        EVEN_N=N == block_n, WARP_REDUCE=config.warp_reduce), num_warps=config.num_warps, maxnreg=config.maxnreg)


def _main() -> None:
    """Compile every case; print one JSON object: case -> "ok" (a non-empty cubin) or the error."""
    from tilekernels.attention import _fwd

    if not _fwd.HAVE_GLUON:
        print("RESULTS " + json.dumps({"skip": "this triton has no Gluon"}))
        return
    jobs = {**{name: (_compile_forward, case) for name, case in FORWARD_CASES.items()},
            **{name: (_compile_backward, case) for name, case in BACKWARD_CASES.items()},
            **{name: (_compile_paged, (page,)) for name, page in PAGED_CASES.items()},
            **{name: (_compile_norm_backward, case) for name, case in NORM_CASES.items()},
            **{name: (_compile_quant, case) for name, case in QUANT_CASES.items()}}
    results = {}
    for name, (build, case) in jobs.items():
        try:
            results[name] = "ok" if build(*case).asm["cubin"] else "empty cubin"
        except Exception as error:  # reported per case by the test
            results[name] = f"{type(error).__name__}: {str(error)[-2000:]}"
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def compiled(compile_in_child) -> dict:
    results = compile_in_child(__file__)
    if "skip" in results:
        pytest.skip(results["skip"])
    return results


@pytest.mark.parametrize("case", [*FORWARD_CASES, *BACKWARD_CASES, *PAGED_CASES, *NORM_CASES, *QUANT_CASES])
def test_gluon_kernel_compiles_for_sm90(case, compiled):
    assert compiled[case] == "ok", f"{case}: {compiled[case]}"


if __name__ == "__main__":
    _main()
