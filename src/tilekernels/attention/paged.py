"""``tk.batch_prefill``, ``tk.batch_decode`` and ``tk.merge_attention_states``: attention over paged KV caches.

What aiter's ``mha_batch_prefill_func`` and FlashInfer's paged prefill/decode wrappers do, in one Triton
kernel (``_paged_kernels.py``) built on the FlashAttention forward's online softmax and masks; on Hopper,
prefill takes a Gluon kernel instead where ``_hopper_prefill_applies`` (the Gluon forward's consumers with
a producer that loads each key block page by page: TMA boxes, or rows gathered by cp.async).

Reading order: argument checks -> the launcher -> the torch.library op (it writes into ``out`` and
``lse``, so a caller's buffer is filled in place) -> the public functions.

Nothing here reads a device value on the host: the page tables, sequence lengths and query offsets
stay on the device; grids come from tensor shapes, so every call can be captured in a CUDA graph and
replayed with other tables and lengths of the same shapes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._runtime import (
    CachedLaunch,
    as_template,
    cache_put,
    cdiv,
    check_no_self_overlap,
    check_out_memory,
    check_runnable,
    descriptor_template,
    ensure_cuda_context,
    is_hopper,
    is_interpreter,
    on_current_device,
    plain_eager,
    rebase,
    sm_count,
    supports_tensor_descriptors,
    tensor_key,
)
from . import _fwd
from . import _paged_kernels as kern
from ._fwd import LOG2E, head_dim_pad
from .fmha import check_tensor

MAX_HEAD_DIM = 256
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------------
# argument checks


def _index(name: str, t, shape: tuple[int | None, ...], what: str, device: torch.device) -> torch.Tensor:
    """An int32 index tensor of ``shape`` (None: any size) on ``device``, last dim contiguous."""
    check_tensor(name, t, (len(shape),), what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


class _Cache:
    """Geometry of a (k_cache, v_cache) pair: page count and size, KV heads, and the kernel's strides."""

    def __init__(self, k_cache, v_cache, head_dim: int, q_dtype: torch.dtype, device: torch.device):
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, t, (4, 5), "4-D linear [num_pages, page_size, H_kv, D] or 5-D vectorized")
        if k_cache.dim() != v_cache.dim():
            raise ValueError(f"k_cache and v_cache must have one layout, got {k_cache.dim()}-D and "
                             f"{v_cache.dim()}-D")
        if k_cache.dtype != v_cache.dtype:
            raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
        if k_cache.dtype != q_dtype and k_cache.dtype not in FP8_DTYPES:
            raise TypeError(f"k_cache and v_cache must be q's dtype {q_dtype} or float8_e4m3fn/float8_e5m2, "
                            f"got {k_cache.dtype}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.device != device:
                raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
        self.vectorized = k_cache.dim() == 5
        x = 16 // k_cache.element_size()
        if self.vectorized:
            pages, kv_heads, d_x, page_size, x_k = k_cache.shape
            want_k = (pages, kv_heads, head_dim // x, page_size, x)
            want_v = (pages, kv_heads, page_size // x, head_dim, x)
            if head_dim % x or page_size % x:
                raise ValueError(f"the vectorized layout needs D ({head_dim}) and page_size ({page_size}) to be "
                                 f"multiples of x = 16 bytes / element = {x}")
            for name, t, want, form in (("k_cache", k_cache, want_k, "[num_pages, H_kv, D // x, page_size, x]"),
                                        ("v_cache", v_cache, want_v, "[num_pages, H_kv, page_size // x, D, x]")):
                if tuple(t.shape) != want:
                    raise ValueError(f"{name} (vectorized) must be {form} = {list(want)}, got {tuple(t.shape)}")
            sk, sv = k_cache.stride(), v_cache.stride()
            # (page, head, slot // XS, slot % XS, d // XD, d % XD) strides and XS, XD
            self.k_strides = (sk[0], sk[1], sk[3], 0, sk[2], sk[4])
            self.k_x = (1, x)
            self.v_strides = (sv[0], sv[1], sv[2], sv[4], sv[3], 0)
            self.v_x = (x, 1)
        else:
            pages, page_size, kv_heads, d = k_cache.shape
            if d != head_dim:
                raise ValueError(f"k_cache's head dim (last) must be q's {head_dim}, got {d}")
            if tuple(v_cache.shape) != tuple(k_cache.shape):
                raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                                 f"{tuple(v_cache.shape)}")
            sk, sv = k_cache.stride(), v_cache.stride()
            self.k_strides = (sk[0], sk[2], sk[1], 0, sk[3], 0)
            self.k_x = (1, 1)
            self.v_strides = (sv[0], sv[2], sv[1], 0, sv[3], 0)
            self.v_x = (1, 1)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if kv_heads == 0:
            raise ValueError(f"k_cache and v_cache must have at least one KV head, got H_kv = 0 "
                             f"(shape {tuple(k_cache.shape)})")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            # the kernels keep in-page offsets in 32 bits (only the page term is 64-bit): prove it here
            extent = sum((n - 1) * abs(s) for n, s in zip(t.shape[1:], t.stride()[1:]))
            if extent > INT32_MAX:
                raise ValueError(f"one page of {name} spans {extent + 1} elements; at most 2^31 are supported")
        self.num_pages, self.page_size, self.kv_heads = pages, page_size, kv_heads
        self.dtype = k_cache.dtype


def _split_scale(name: str, scale) -> tuple[Optional[torch.Tensor], float]:
    """A k_scale / v_scale argument as the op takes it: (tensor, 1.0) or (None, host value)."""
    if scale is None:
        return None, 1.0
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not math.isfinite(scale):
            raise ValueError(f"{name} must be finite, got {scale!r}")
        return None, float(scale)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be None, a float or a float32 tensor, got {type(scale).__name__}")
    return scale, 1.0


def _scale(name: str, scale: Optional[torch.Tensor], value: float, cache: _Cache,
           device: torch.device) -> tuple[Optional[torch.Tensor], float, int]:
    """(tensor or None, host value, mode) of a split k_scale / v_scale."""
    if scale is None:
        return None, value, kern.SCALE_NONE
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {scale.device}")
    if scale.numel() == 1 and scale.dim() <= 1:
        return scale, 1.0, kern.SCALE_TENSOR
    if tuple(scale.shape) == (cache.num_pages, cache.kv_heads):
        return scale.contiguous(), 1.0, kern.SCALE_PAGE
    raise ValueError(f"{name} must be a scalar (0-d or [1]) or per page and KV head [num_pages, H_kv] = "
                     f"[{cache.num_pages}, {cache.kv_heads}], got {tuple(scale.shape)}")


def _table(batch: int, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
           device: torch.device) -> dict:
    one_d = (kv_indptr, kv_page_indices, kv_last_page_len)
    two_d = (block_table, seqlen_k)
    has_1d, has_2d = any(t is not None for t in one_d), any(t is not None for t in two_d)
    if has_1d == has_2d:
        raise ValueError("pass one page table: kv_indptr + kv_page_indices + kv_last_page_len (1-D), or "
                         "block_table + seqlen_k (2-D)" + (", not both" if has_1d else ""))
    if has_1d:
        missing = [n for n, t in zip(("kv_indptr", "kv_page_indices", "kv_last_page_len"), one_d) if t is None]
        if missing:
            raise ValueError(f"the 1-D page table needs {', '.join(missing)} too")
        return dict(kv_indptr=_index("kv_indptr", kv_indptr, (batch + 1,), f"[B + 1] = [{batch + 1}]", device),
                    page_table=_index("kv_page_indices", kv_page_indices, (None,), "1-D [total_pages]", device),
                    last_page_len=_index("kv_last_page_len", kv_last_page_len, (batch,), f"[B] = [{batch}]",
                                         device),
                    table_2d=False)
    missing = [n for n, t in zip(("block_table", "seqlen_k"), two_d) if t is None]
    if missing:
        raise ValueError(f"the 2-D page table needs {', '.join(missing)} too")
    return dict(page_table=_index("block_table", block_table, (batch, None), f"[B, max_pages] with B = {batch}",
                                  device),
                seqlen_k=_index("seqlen_k", seqlen_k, (batch,), f"[B] = [{batch}]", device), table_2d=True)


def _check_q(q, decode: bool) -> None:
    check_tensor("q", q, 3, "[B, H, D]" if decode else "[total_q, H, D]")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    check_runnable(q.device, "q")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (q.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {q.shape[-1]}")


def _check_no_grad(op: str, **tensors) -> None:
    """ValueError naming the first tensor that requires grad while grad mode is on: ``op`` has no backward,
    so its result would silently drop out of the autograd graph (or fail only at ``backward``)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{op} has no backward, but {name} requires grad; call it under torch.no_grad() "
                             f"or pass {name}.detach()")


def _check_options(causal, softmax_scale, logits_soft_cap, window_left, return_lse) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite float > 0 or None, got {softmax_scale!r}")
    if (not isinstance(logits_soft_cap, (int, float)) or not math.isfinite(logits_soft_cap)
            or logits_soft_cap < 0):
        raise ValueError(f"logits_soft_cap must be a finite float >= 0 (0: off), got {logits_soft_cap!r}")
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: unlimited), got {window_left!r}")


def _check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {list(q.shape)} on {q.device} (q's), got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError(f"out's last dim must be contiguous, got strides {out.stride()}")
    check_no_self_overlap("out", out)


def _check_out_memory(out, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table,
                      seqlen_k, k_scale, v_scale) -> None:
    """``out`` must share no memory with any input: the kernels read them while other programs write out.
    Addresses only, so plain tensors only (the op's body checks traced calls when they run)."""
    check_out_memory(out, dict(q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                               kv_page_indices=kv_page_indices, kv_last_page_len=kv_last_page_len,
                               block_table=block_table, seqlen_k=seqlen_k, k_scale=k_scale, v_scale=v_scale),
                     "pass an out that shares no memory with q, the caches, the page table or the scales")


# ----------------------------------------------------------------------------------------------------
# launcher


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _auto_splits(device: torch.device, programs: int, keys_estimate: int, fp8: bool) -> int:
    """Decode: one share per (sequence, KV head) when those alone cover every SM (on an H100, 32 x 8
    of them: 1.05x the bandwidth floor unsplit, 1.20x in 2 shares); otherwise enough shares to fill the
    GPU about twice (fp8 caches, latency-bound: four times; 8 x 32768 keys: 8 shares 1.56x the floor,
    5 shares 2.19x), each of at least 256 keys."""
    if is_interpreter():
        return 1
    sms = sm_count(device)
    if programs >= sms:
        return 1
    waves = 4 if fp8 else 2
    return max(1, min(cdiv(waves * sms, max(programs, 1)), keys_estimate // 256, 64))


def _use_tma(cache: _Cache, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """TMA loads of whole key blocks: the linear layout, pages a multiple of the key block, Hopper or
    newer, 16-byte aligned base and strides, unit stride along D."""
    if cache.vectorized or cache.page_size % block_n or cache.num_pages == 0:
        return False
    if kern.tma_mode is False:
        return False
    if kern.tma_mode is None and not (k_cache.is_cuda and supports_tensor_descriptors(k_cache.device)):
        return False
    esize = k_cache.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.shape[-1] * esize >= 16
               and all((st * esize) % 16 == 0 for st in t.stride()[:-1]) for t in (k_cache, v_cache))


def _page_descriptor(cache: torch.Tensor, block_n: int, pad: int):
    """A descriptor template over a linear cache ``[pages, page_size, H_kv, D]``, block ``[1, block_n, 1,
    pad]`` (columns past D read as 0); ``rebase`` puts each call's cache under it."""
    return descriptor_template(cache, cache.shape, cache.stride(), [1, block_n, 1, pad])


def _hopper_prefill_applies(q, k_cache, v_cache, cache: _Cache, scales, out, logits_soft_cap: float) -> bool:
    """Whether the Gluon prefill (``kern._paged_prefill_hopper``) takes this call: Hopper, a cache of q's
    dtype (fp16/bf16) in the linear layout with heads contiguous and pages that flatten into rows, head dim
    128 or 256, no softcap and no device-side scales (any page size: powers of two >= 8 load TMA boxes,
    others gather rows). Where it does not, the Triton kernel runs (``kern.hopper_mode`` True raises
    instead: tests)."""
    if kern.hopper_mode is False:
        return False
    head_dim = q.shape[-1]
    page = cache.page_size
    esize = q.element_size()

    def rows_ok(t, row_stride):  # [.., H, D] with heads contiguous, 16-byte aligned rows
        return (t.stride(-1) == 1 and t.stride(-2) == head_dim and t.data_ptr() % 16 == 0
                and (row_stride * esize) % 16 == 0)

    ok = (_fwd.HAVE_GLUON and not is_interpreter() and q.is_cuda and is_hopper(q.device)
          and q.dtype in (torch.float16, torch.bfloat16) and cache.dtype == q.dtype and not cache.vectorized
          and head_dim in _fwd.HOPPER_FWD_CONFIGS and cache.num_pages * page <= INT32_MAX and logits_soft_cap == 0
          and scales[0][2] == kern.SCALE_NONE and scales[1][2] == kern.SCALE_NONE
          and rows_ok(q, q.stride(0)) and out.stride(-1) == 1
          and all(rows_ok(t, t.stride(1)) and t.stride(0) == page * t.stride(1) for t in (k_cache, v_cache)))
    if kern.hopper_mode is True and not ok:
        raise RuntimeError("hopper_mode=True, but the Gluon prefill does not apply to this call")
    return ok


class _Plan:
    """Everything about one paged-attention launch that its signature fixes (shapes, strides, dtypes,
    alignments, options): worked out and checked once, then reused by every call with that signature,
    whose host cost is then little more than the launches (``CachedLaunch``: triton's compiled launcher
    directly). Eager decode at 8 x 32768 keys runs ~0.4 ms on an H100; the dispatcher, the checks and
    two binder passes cost about as much on the device host, which made eager timings host-bound."""

    __slots__ = ("attn", "merge", "num_splits", "use_tma", "k_desc", "v_desc", "ints", "part_shapes", "scale_modes",
                 "hopper")


# call signature -> _Plan (``_plan_key``)
_PLANS: dict = {}


def _plan_key(q, k_cache, v_cache, qo_indptr, tables, k_scale, v_scale, out, causal, logits_soft_cap, window_left,
              num_splits):
    """What a plan depends on: everything triton specialises on (dtypes, integer values, 16-byte
    alignment, None-ness), everything the launch is worked out from and every tensor's device (a call
    that hits a plan skips the checks, so a tensor on another device must miss it), plus the test knobs."""
    return (*((None, None) if t is None else (tensor_key(t), t.device)
              for t in (q, k_cache, v_cache, qo_indptr, *tables, k_scale, v_scale, out)),
            causal, logits_soft_cap > 0, window_left, num_splits, kern.config_override, kern.tma_mode,
            kern.hopper_mode)


def _make_plan(q, k_cache, v_cache, qo_indptr, table: dict, cache: _Cache, scales, out, causal: bool,
               logits_soft_cap: float, window_left: int, num_splits: int | None) -> _Plan:
    decode = qo_indptr is None
    total_q, num_heads, head_dim = q.shape
    batch = total_q if decode else qo_indptr.shape[0] - 1
    (_, _, k_mode), (_, _, v_mode) = scales
    group = num_heads // cache.kv_heads
    if not decode and _hopper_prefill_applies(q, k_cache, v_cache, cache, scales, out, logits_soft_cap):
        return _make_hopper_plan(q, k_cache, v_cache, batch, table, cache, scales, out, causal, window_left)
    pad = head_dim_pad(head_dim)
    cfg = kern.paged_config(pad, decode, _use_tma(cache, k_cache, v_cache, 64), k_cache.element_size(),
                            causal and not decode, total_q / max(batch, 1))
    if decode:
        # pack the query heads of one KV head into the tile's rows: each key block is read once per group
        heads_per_tile = _largest_divisor_at_most(group, 64)
        block_m = max(cfg.block_m, 1 << (heads_per_tile - 1).bit_length())
    else:
        heads_per_tile, block_m = 1, cfg.block_m
    queries_per_tile = block_m // heads_per_tile
    if decode:
        grid0 = batch
        if num_splits is None:
            pages = table["page_table"]
            keys = (pages.shape[1] if table["table_2d"] else cdiv(pages.shape[0], batch)) * cache.page_size
            num_splits = _auto_splits(q.device, batch * (num_heads // heads_per_tile), keys,
                                      k_cache.element_size() == 1)
    else:
        grid0 = total_q // queries_per_tile + batch
        num_splits = 1
    plan = _Plan()
    plan.num_splits = num_splits
    plan.scale_modes = (k_mode, v_mode)
    plan.hopper = None
    l_strides = (num_heads, 1)   # lse and the partial lse are [.., total_q, H], contiguous
    if num_splits > 1:
        plan.part_shapes = ((num_splits, *q.shape), (num_splits, total_q, num_heads))
        o_strides = (num_heads * head_dim, head_dim)
        split_strides = (total_q * num_heads * head_dim, total_q * num_heads)
    else:
        plan.part_shapes = None
        o_strides = (out.stride(-3), out.stride(-2))
        split_strides = (0, 0)
    page_table = table["page_table"]
    plan.use_tma = _use_tma(cache, k_cache, v_cache, cfg.block_n)
    plan.k_desc = _page_descriptor(k_cache, cfg.block_n, pad) if plan.use_tma else None
    plan.v_desc = _page_descriptor(v_cache, cfg.block_n, pad) if plan.use_tma else None
    # per-page scales are [num_pages, H_kv], contiguous (``_scale`` made them so): strides (H_kv, 1)
    plan.ints = (q.stride(0), q.stride(1), *o_strides, *l_strides, *split_strides, *cache.k_strides,
                 *cache.v_strides, page_table.stride(0) if table["table_2d"] and page_table.numel() else 0,
                 cache.kv_heads, 1, batch, num_heads, group)
    plan.attn = CachedLaunch(kern._paged_attn, (grid0, num_heads // heads_per_tile, num_splits), dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, PAGE_SIZE=cache.page_size,
        K_XS=cache.k_x[0], K_XD=cache.k_x[1], V_XS=cache.v_x[0], V_XD=cache.v_x[1],
        HP=heads_per_tile, BLOCK_M=block_m, BLOCK_N=cfg.block_n, DECODE=decode,
        SEARCH_STEPS=max(1, batch.bit_length()), TABLE_2D=table["table_2d"], CAUSAL=causal and not decode,
        HAS_LEFT=window_left >= 0, HAS_SOFTCAP=logits_soft_cap > 0, K_SCALE=k_mode, V_SCALE=v_mode,
        NUM_SPLITS=num_splits, USE_TMA=plan.use_tma,
        SAME_ROWS=cache.k_strides[:4] == cache.v_strides[:4] and cache.k_x[0] == cache.v_x[0]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    plan.merge = None
    if num_splits > 1:
        block_h = min(16, 1 << (num_heads - 1).bit_length())
        plan.merge = CachedLaunch(kern._merge_splits, (total_q, cdiv(num_heads, block_h)), dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, BLOCK_H=block_h, NUM_SPLITS=num_splits))
    return plan


def _make_hopper_plan(q, k_cache, v_cache, batch: int, table: dict, cache: _Cache, scales, out, causal: bool,
                      window_left: int) -> _Plan:
    """The plan of a Gluon prefill (``_hopper_prefill_applies``): its config is the contiguous forward's."""
    total_q, num_heads, head_dim = q.shape
    cfg = _fwd.HOPPER_FWD_CONFIGS[head_dim]
    page = cache.page_size
    # pages that are powers of two >= 8 arrive as TMA boxes of one page (or one key block); others are
    # gathered by cp.async, and their descriptors serve only for the shared layout
    gather = page < 8 or page & (page - 1) != 0
    page_table = table["page_table"]
    plan = _Plan()
    plan.num_splits = 1
    plan.scale_modes = (scales[0][2], scales[1][2])
    plan.attn = plan.merge = plan.part_shapes = plan.k_desc = plan.v_desc = plan.ints = None
    plan.use_tma = False  # the Triton kernel's TMA path; the Gluon kernel has its own descriptors
    box_rows = cfg.block_n if gather else min(page, cfg.block_n)
    ensure_cuda_context(q.device.index)
    rows = k_cache.shape[0] * k_cache.shape[1]
    descs = (as_template(_fwd.hopper_descriptor(q, total_q, _fwd.HOPPER_BLOCK_M)),
             as_template(_fwd.hopper_descriptor(k_cache, rows, box_rows, cfg.block_n)),
             as_template(_fwd.hopper_descriptor(v_cache, rows, box_rows, cfg.block_n)))
    launch = CachedLaunch(kern._paged_prefill_hopper, (total_q // _fwd.HOPPER_BLOCK_M + batch, num_heads), dict(
        HEAD_DIM=head_dim, BLOCK_M=_fwd.HOPPER_BLOCK_M, BLOCK_N=cfg.block_n, STAGES=cfg.stages, PAGE_SIZE=page,
        GATHER=gather, SEARCH_STEPS=max(1, batch.bit_length()), TABLE_2D=table["table_2d"], CAUSAL=causal,
        HAS_LEFT=window_left >= 0, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs), num_warps=4)
    plan.hopper = (launch, descs, (k_cache.stride(1), v_cache.stride(1), out.stride(0), out.stride(1), num_heads, 1,
                                   page_table.stride(0) if table["table_2d"] and page_table.numel() else 0, batch,
                                   num_heads, num_heads // cache.kv_heads))
    return plan


def _launch(plan: _Plan, q, k_cache, v_cache, qo_indptr, table: dict, scales, out, lse, softmax_scale: float,
            logits_soft_cap: float, window_left: int) -> None:
    """One call of ``plan`` on these tensors (which match the signature the plan was made for)."""
    (k_scale, k_value, _), (v_scale, v_value, _) = scales
    if plan.hopper is not None:
        _launch_hopper(plan, q, k_cache, v_cache, qo_indptr, table, out, lse, softmax_scale * k_value * LOG2E,
                       v_value, window_left)
        return
    if logits_soft_cap > 0:
        scalars = (0.0, logits_soft_cap * LOG2E, softmax_scale * k_value / logits_soft_cap)
    else:
        scalars = (softmax_scale * k_value * LOG2E, 0.0, 0.0)
    if plan.num_splits > 1:
        dst = torch.empty(plan.part_shapes[0], dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(plan.part_shapes[1], dtype=torch.float32, device=q.device)
    else:
        dst, dst_lse = out, lse
    if plan.use_tma:
        if q.is_cuda:
            ensure_cuda_context(q.device.index)
        k_src, v_src = rebase(plan.k_desc, k_cache), rebase(plan.v_desc, v_cache)
    else:
        k_src, v_src = k_cache, v_cache
    page_table = table["page_table"] if table["page_table"].numel() else q  # a stand-in that is never read
    plan.attn((q, k_src, v_src, dst, dst_lse, q if qo_indptr is None else qo_indptr,
               table.get("kv_indptr", page_table), page_table, table.get("last_page_len", page_table),
               table.get("seqlen_k", page_table), q if k_scale is None else k_scale,
               q if v_scale is None else v_scale, *plan.ints, *scalars, v_value, window_left), q.device)
    if plan.merge is not None:
        total_q, num_heads = q.shape[:2]
        plan.merge((dst, dst_lse, out, lse, total_q, num_heads, dst.stride(0), dst_lse.stride(0), dst.stride(1),
                    dst.stride(2), dst_lse.stride(1), dst_lse.stride(2), out.stride(0), out.stride(1),
                    lse.stride(0), lse.stride(1)), q.device)


def _launch_hopper(plan: _Plan, q, k_cache, v_cache, qo_indptr, table: dict, out, lse, qk_scale_log2: float,
                   v_value: float, window_left: int) -> None:
    """One call of the Gluon prefill: the plan's descriptors over this call's tensors, then the launch."""
    launch, descs, ints = plan.hopper
    q_desc, k_desc, v_desc = _fwd.rebased(descs, (q, k_cache, v_cache))
    page_table = table["page_table"] if table["page_table"].numel() else q  # a stand-in that is never read
    launch((q_desc, k_desc, v_desc, k_cache, v_cache, out, lse, qo_indptr, table.get("kv_indptr", page_table),
            page_table, table.get("last_page_len", page_table), table.get("seqlen_k", page_table), *ints,
            qk_scale_log2, v_value, window_left), q.device)


def _run(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
         k_scale, v_scale, out, lse, causal, softmax_scale, logits_soft_cap, window_left, k_scale_value,
         v_scale_value, num_splits) -> None:
    """The op's body (and the eager path's, without the dispatcher): check the caches, page table and
    scales once per call signature (their geometry is shapes and strides only), then launch."""
    if not on_current_device(q):
        with torch.cuda.device(q.device):  # triton launches on the current device
            return _run(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table,
                        seqlen_k, k_scale, v_scale, out, lse, causal, softmax_scale, logits_soft_cap, window_left,
                        k_scale_value, v_scale_value, num_splits)
    decode = qo_indptr is None
    total_q = q.shape[0]
    batch = total_q if decode else qo_indptr.shape[0] - 1
    tables = (kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k)
    key = _plan_key(q, k_cache, v_cache, qo_indptr, tables, k_scale, v_scale, out, causal, logits_soft_cap,
                    window_left, num_splits)
    plan = _PLANS.get(key)
    if plan is not None:
        table = ({"kv_indptr": kv_indptr, "page_table": kv_page_indices, "last_page_len": kv_last_page_len}
                 if block_table is None else {"page_table": block_table, "seqlen_k": seqlen_k})
        scales = ((k_scale, k_scale_value, plan.scale_modes[0]), (v_scale, v_scale_value, plan.scale_modes[1]))
    else:
        cache = _Cache(k_cache, v_cache, q.shape[-1], q.dtype, q.device)
        if q.shape[1] % cache.kv_heads:
            raise ValueError(f"q's head count ({q.shape[1]}) must be a multiple of the caches' ({cache.kv_heads})")
        table = _table(batch, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k, q.device)
        scales = tuple(_scale(name, t, value, cache, q.device) for name, t, value in
                       (("k_scale", k_scale, k_scale_value), ("v_scale", v_scale, v_scale_value)))
    if out.numel() == 0:   # no queries, or no heads (q [.., 0, D])
        return
    if batch == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, qo_indptr, table, cache, scales, out, causal, logits_soft_cap,
                          window_left, num_splits or None)
        # cache the plan only where the checks handed back the caller's own tensors (an index tensor with
        # a strided last dim, or a per-page scale that is not contiguous, is copied on every call)
        given = {id(t) for t in (*tables, k_scale, v_scale) if t is not None}
        handed = {id(t) for t in (*(v for v in table.values() if isinstance(v, torch.Tensor)),
                                  scales[0][0], scales[1][0]) if t is not None}
        if handed <= given:
            cache_put(_PLANS, key, plan, 256)
    _launch(plan, q, k_cache, v_cache, qo_indptr, table, scales, out, lse, softmax_scale, logits_soft_cap,
            window_left)


# ----------------------------------------------------------------------------------------------------
# the torch.library op: fills out and lse in place


@torch.library.custom_op("tilekernels::paged_attention", mutates_args=("out", "lse"))
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: Optional[torch.Tensor],
              kv_indptr: Optional[torch.Tensor], kv_page_indices: Optional[torch.Tensor],
              kv_last_page_len: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
              seqlen_k: Optional[torch.Tensor], k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
              out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, logits_soft_cap: float,
              window_left: int, k_scale_value: float, v_scale_value: float, num_splits: int) -> None:
    """The call behind both functions, which have checked q, the options and ``out``; the caches, page
    table and scales are checked in ``_run``, once per call signature (``_PLANS``). ``qo_indptr``
    None means decode (one query per sequence); ``num_splits`` 0 is automatic; host-float scales arrive
    as ``*_scale_value`` with the tensor None."""
    _check_out_memory(out, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table,
                      seqlen_k, k_scale, v_scale)
    _run(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
         k_scale, v_scale, out, lse, causal, softmax_scale, logits_soft_cap, window_left, k_scale_value,
         v_scale_value, num_splits)


@_paged_op.register_fake
def _(*args):
    return None


# ----------------------------------------------------------------------------------------------------
# public


def _paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
           causal, softmax_scale, logits_soft_cap, window_left, k_scale, v_scale, return_lse, out, num_splits):
    decode = qo_indptr is None
    _check_q(q, decode)
    _check_options(causal, softmax_scale, logits_soft_cap, window_left, return_lse)
    _check_out(out, q)
    _check_no_grad("batch_decode" if decode else "batch_prefill", q=q, k_cache=k_cache, v_cache=v_cache,
                  k_scale=k_scale, v_scale=v_scale, out=out)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1 or None (automatic), got {num_splits!r}")
    device = q.device
    if not decode:
        qo_indptr = _index("qo_indptr", qo_indptr, (None,), "1-D [B + 1]", device)
        if qo_indptr.shape[0] < 1:
            raise ValueError("qo_indptr must hold B + 1 >= 1 offsets, got none")
    (k_tensor, k_value), (v_tensor, v_value) = _split_scale("k_scale", k_scale), _split_scale("v_scale", v_scale)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if q.numel() and q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    elif all(plain_eager(t) for t in (q, k_cache, v_cache)):
        # the eager path (below); q as the kernel reads it (a copy when its last dim was strided); the op
        # path checks in its body
        _check_out_memory(out, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len,
                          block_table, seqlen_k, k_tensor, v_tensor)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    # plain eager calls skip the dispatcher (~40 us of host time per call on the H100 host, measured with
    # a cached plan); torch.compile, fake tensors and subclasses go through the op
    run = _run if all(plain_eager(t) for t in (q, k_cache, v_cache)) else _paged_op
    run(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
        k_tensor, v_tensor, out, lse, causal, float(softmax_scale), float(logits_soft_cap), int(window_left),
        k_value, v_value, int(num_splits or 0))
    return (out, lse) if return_lse else out


def batch_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr=None, kv_page_indices=None, kv_last_page_len=None, *,
                  causal=False, softmax_scale=None, logits_soft_cap=0.0, window_left=-1, k_scale=None,
                  v_scale=None, return_lse=False, out=None, block_table=None, seqlen_k=None):
    """Attention of ragged queries over a paged KV cache (aiter's ``mha_batch_prefill_func``, FlashInfer's
    ``BatchPrefillWithPagedKVCacheWrapper``).

    - q ``[total_q, H, D]`` fp16/bf16; sequence b's queries are rows ``qo_indptr[b]:qo_indptr[b+1]``
      (int32 ``[B + 1]``); they are the *last* ``qo_len`` positions of the sequence.
    - Caches, by rank: linear ``[num_pages, page_size, H_kv, D]``; vectorized K
      ``[num_pages, H_kv, D // x, page_size, x]``, V ``[num_pages, H_kv, page_size // x, D, x]`` with
      x = 16 bytes / element. Any page size >= 1. dtype q's, or fp8 (e4m3fn, e5m2) with ``k_scale`` /
      ``v_scale``: a float, a one-element float32 tensor, or float32 ``[num_pages, H_kv]`` per page and
      head. H a multiple of H_kv (GQA/MQA).
    - Page table, 1-D: sequence b's pages are ``kv_page_indices[kv_indptr[b]:kv_indptr[b+1]]``, the last
      one holding ``kv_last_page_len[b]`` keys; or 2-D: ``block_table[b, :]`` with ``seqlen_k[b]`` keys.
      All int32 on q's device.
    - ``causal``: query i of a sequence with ``qo_len`` queries and ``kv_len`` keys sees keys
      ``j <= i + kv_len - qo_len``; ``window_left >= 0`` also drops keys ``j < i + kv_len - qo_len - window_left``.
      ``logits_soft_cap > 0``: scores become ``cap * tanh(s / cap)``; ``softmax_scale`` default ``D ** -0.5``.

    Returns out ``[total_q, H, D]`` (written into ``out`` when given: last dim contiguous, no two elements at one
    address, no memory shared with q, the caches, the page table or the scales), or ``(out, lse)`` with
    ``return_lse=True``: lse ``[total_q, H]`` fp32 in natural log; a row that sees no key gets out 0 and lse
    ``-inf`` (``flash_attn_*`` report ``+inf``, FA2's backward convention; ``merge_attention_states`` weighs
    either 0). No backward: with grad mode on, an input that requires grad raises ValueError.

    Not checked per element, because that would read the device (a host sync, and no graph capture):
    page indices within ``[0, num_pages)``, ``kv_last_page_len`` in ``1..page_size``, ``seqlen_k[b]``
    within its table row, monotone offsets, ``qo_indptr[0] == 0``, ``qo_indptr[-1] == total_q`` (rows past it
    are not written).
    Out-of-range values read other memory or fault. Addresses are 64-bit in the page index, so caches
    past 4 GB are exact.
    """
    if qo_indptr is None:
        raise ValueError("qo_indptr (int32 [B + 1]) is required; batch_decode takes one query per sequence")
    return _paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_len, block_table,
                  seqlen_k, causal, softmax_scale, logits_soft_cap, window_left, k_scale, v_scale, return_lse, out,
                  None)


def batch_decode(q, k_cache, v_cache, kv_indptr=None, kv_page_indices=None, kv_last_page_len=None, *,
                 softmax_scale=None, logits_soft_cap=0.0, window_left=-1, k_scale=None, v_scale=None,
                 return_lse=False, out=None, block_table=None, seqlen_k=None, num_splits=None):
    """One query per sequence over a paged KV cache: q ``[B, H, D]``, the query at its sequence's last
    position (it sees every key, or the last ``window_left + 1``). Caches, tables and options as
    ``batch_prefill``; returns out ``[B, H, D]`` or ``(out, lse [B, H])``.

    The keys of each sequence are split over ``num_splits`` programs (None: enough to fill the GPU,
    from the table's shape) whose fp32 partial states are merged by a second kernel; the query heads of
    one KV head share each program, so each key block is read once per group.
    """
    return _paged(q, k_cache, v_cache, None, kv_indptr, kv_page_indices, kv_last_page_len, block_table, seqlen_k,
                  False, softmax_scale, logits_soft_cap, window_left, k_scale, v_scale, return_lse, out, num_splits)


@torch.library.custom_op("tilekernels::merge_attention_states", mutates_args=())
def _merge_op(v_a: torch.Tensor, lse_a: torch.Tensor, v_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, heads, head_dim = v_a.shape
    out = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=v_a.device)
    if out.numel():
        block_h = min(16, 1 << (heads - 1).bit_length())
        kern._merge_states[(rows, cdiv(heads, block_h))](
            v_a, lse_a, v_b, lse_b, out, lse, heads, v_a.stride(0), v_a.stride(1), lse_a.stride(0), lse_a.stride(1),
            v_b.stride(0), v_b.stride(1), lse_b.stride(0), lse_b.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim), BLOCK_H=block_h)
    elif lse.numel():
        lse.fill_(float("-inf"))
    return out, lse


@_merge_op.register_fake
def _(v_a, lse_a, v_b, lse_b):
    return v_a.new_empty(v_a.shape), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


def merge_attention_states(v_a, lse_a, v_b, lse_b):
    """Attention over the union of two key sets from the attention over each (cascade / split KV).

    v_a, v_b ``[N, H, D]`` (fp16, bf16 or fp32, one dtype), lse_a, lse_b ``[N, H]`` fp32 in natural log.
    Returns ``(v, lse)``: ``v = (w_a v_a + w_b v_b) / (w_a + w_b)`` with ``w = exp(lse - max)``, computed
    in fp32 and stored in v's dtype, and ``lse = log(exp(lse_a) + exp(lse_b))``. A state with no keys
    weighs 0, whether its lse says so as ``-inf`` (``batch_prefill`` / ``batch_decode``) or as ``+inf``
    (``flash_attn_*``, FA2's convention); two such states give v 0 and lse ``-inf``. No backward: inputs
    that require grad raise ValueError unless grad mode is off.
    """
    for name, t in (("v_a", v_a), ("v_b", v_b)):
        check_tensor(name, t, 3, "[N, H, D]")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, t, 2, "[N, H]")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if v_a.dtype != v_b.dtype:
        raise TypeError(f"v_a and v_b must have one dtype, got {v_a.dtype} and {v_b.dtype}")
    if v_a.shape != v_b.shape:
        raise ValueError(f"v_a and v_b must have one shape, got {tuple(v_a.shape)} and {tuple(v_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(v_a.shape[:2]):
            raise ValueError(f"{name} must be [N, H] = {list(v_a.shape[:2])}, got {tuple(t.shape)}")
    for name, t in (("lse_a", lse_a), ("v_b", v_b), ("lse_b", lse_b)):
        if t.device != v_a.device:
            raise ValueError(f"{name} must be on v_a's device {v_a.device}, got {t.device}")
    _check_no_grad("merge_attention_states", v_a=v_a, lse_a=lse_a, v_b=v_b, lse_b=lse_b)
    check_runnable(v_a.device, "v_a")
    if not 1 <= v_a.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (v_a.shape[-1]) must be in 1..{MAX_HEAD_DIM}, got {v_a.shape[-1]}")
    if v_a.numel() and v_a.stride(-1) != 1:
        v_a = v_a.contiguous()
    if v_b.numel() and v_b.stride(-1) != 1:
        v_b = v_b.contiguous()
    return _merge_op(v_a, lse_a, v_b, lse_b)
