"""Check cases and benchmark cases for ``tk.batch_prefill`` and ``tk.batch_decode`` (paged KV caches).

Two registered ops share this module (``bench/__init__.py``: ``tilekernels.bench.paged:BATCH_PREFILL`` and
``:BATCH_DECODE``); ``tk.merge_attention_states``, how split-KV decode combines its shares, is checked with
batch_decode.

Shapes (``--shapes``), one length for every sequence of the batch:

- batch_prefill ``BxHxHkvxSqxSkxD``: B sequences of Sq queries over Sk keys (the queries are a sequence's
  last Sq positions, bottom-right as in FlashAttention-2), H query heads over Hkv KV heads, head dim D.
  A mask suffix, ``xcausal`` or ``xfull``, names one mask; without it ``--causal`` picks (both by
  default). GPU default: 4x32x8x4096x4096x128 (GQA 4) and 4x16x16x4096x4096x128, each causal and not.
- batch_decode ``BxHxHkvxSkxD``: one query per sequence, at its last position. GPU default:
  32x32x8x8192x128 and 8x32x8x32768x128 (ANCHORS.md's decode shapes).

Every shape runs at each page size of ``--page-sizes`` (prefill default 1,16,1024; decode 1,16,64): the
rows' ``variant`` is ``page<P>``, so each page size gets its own table and ratio summary. The cache
layout (``--kv-layout`` linear|vectorized), page-table format (``--page-table`` 1d|2d) and KV dtype
(``--kv-dtypes``: the bench dtype and/or fp8e4m3/fp8e5m2 with ``--kv-scale`` tensor|page|none; decode's
default adds fp8e4m3) make the rows' ``layout``: ``linear/1d``, ``linear/1d/kv-fp8e4m3``.

Inputs: q, K and V from ``device_random`` (never zeros) in the bench dtype; ``make_paged_kv`` scatters K
and V into a paged cache whose physical pages are a random permutation of the pool (one permutation
per case, the same for every input set), quantised when the KV dtype is fp8; unused slots hold NaN.
Input sets rotate through more than twice the L2 (``harness.run_case``). Anything a baseline needs
besides the paged cache (a contiguous copy, a layout of its own) is built for every input set on the
provider's first call (the accuracy check: before any timing or CUDA-graph capture) and dropped when the
next provider starts.

Providers, batch_prefill:

- ``tilekernels``: ``tk.batch_prefill(q [total_q, H, D], k_cache, v_cache, qo_indptr, <page table>,
  causal=, k_scale=, v_scale=)``.
- ``contiguous``: ``tk.flash_attn_varlen_func`` on the same keys and values gathered contiguous
  (``gather_paged_kv``; dequantised to the bench dtype for fp8). ``ours/contiguous`` is what paging
  costs (issue 6's goal: >= 0.9 at page sizes >= 16, >= 0.8 at page size 1).
- ``flex``: FlexAttention over a paged physical cache, as ``torch.nn.attention.experimental.
  _paged_attention.PagedAttention`` lays one out and maps it: K, V ``[1, Hkv, num_pages * page_size, D]``
  holding the same physical pages (copied from the same keys, zeros in unused slots), a logical
  ``BlockMask`` from ``create_block_mask`` with ``BLOCK_SIZE=(128, page_size)`` (its KV block is the
  page) converted by ``PagedAttention.convert_logical_block_mask``, after ``page_table`` and
  ``physical_to_logical`` are set from our block table; q as a ``[B, H, Sq, D]`` view, ``enable_gqa``.
  On a GPU ``torch.compile(flex_attention, dynamic=False)``, compiled afresh for each case on its
  first call (``torch._dynamo.reset()``: a run's many block masks would otherwise pass the recompile
  limit and fall back to the unfused path); page sizes that are not multiples of 64 (the H100 bf16
  default key block) pass ``kernel_options={"BLOCK_N": <largest power of two dividing the page, <= 64>}``.
  Unsupported, so a FAIL naming why for that case: fp8 KV (q, k and v must share a dtype), page sizes
  whose largest power-of-two divisor is below 16 (the kernel's key block, >= 16 for ``tl.dot``, must
  divide the block mask's KV block, i.e. the page), a torch without these modules. On the CPU
  ``flex_attention`` runs uncompiled (the unfused implementation, no block-size limit): it checks the
  page mapping there, not performance.

Providers, batch_decode:

- ``tilekernels``: ``tk.batch_decode(q [B, H, D], k_cache, v_cache, <page table>, k_scale=, v_scale=,
  num_splits=)`` (``--num-splits``, default automatic).
- ``sdpa``: ``F.scaled_dot_product_attention(q [B, H, 1, D], K, V [B, H, Sk, D])`` with K and V gathered
  and expanded to the query heads (``repeat_interleave``), ANCHORS.md's decode baseline (1.40 ms at
  32x8192 and 8x32768, bf16, H100): it reads H/Hkv times the KV bytes a GQA kernel reads. fp8 caches
  are dequantised to the bench dtype for it.
- ``flex``: as for prefill, q ``[B, H, 1, D]`` (FlexAttention's decoding kernel).

Metrics:

- batch_prefill, TFLOP/s with FlashAttention's count: ``4 * H * D * B * pairs`` with ``pairs = Sq*Sk``;
  causal ``Sq*Sk - Sq^2/2`` for ``Sq <= Sk`` (exactly half when ``Sq == Sk``), ``Sk^2/2`` for ``Sq > Sk``.
- batch_decode, TB/s = KV bytes / median time, ``KV bytes = B * Sk * Hkv * D * 2 (K and V) * the cache's
  element size`` (q, the output, the page table and scales are not counted); for ``sdpa`` on an fp8
  cache that is an effective rate (it reads bf16 copies). The bandwidth floor: the run measures the
  device's copy bandwidth once (``.copy_`` of a 1 GiB tensor, bytes read + written over the median
  do_bench time), ``floor_ms = KV bytes / copy bandwidth`` (reading K and V once at copy speed); every
  decode row carries ``kv_bytes``, ``copy_tbps``, ``floor_ms`` and ``floor_ratio = ms / floor_ms``
  (goal: <= 1.25 for contexts of 8k keys and more), and a floor table follows the TB/s tables.

The accuracy check before timing: the output of the first and last query head of the first and last
sequence, every query, against ``reference_paged_attention`` in float64 on that sequence and head
alone (its block-table row, its KV head's slice of the cache and scales), under ``testing.compare``'s
error-ratio rule: at most 2x the error of the same reference computed in the bench dtype. The whole
output must also be finite. ``python -m tilekernels check`` compares whole outputs and LSEs at smaller,
odd shapes: page sizes 1/3/16, both layouts and table formats, fp8 with per-tensor and per-page scales,
ragged batches with empty sequences, windows and soft caps, decode with explicit splits, and
``merge_attention_states``.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..testing import Comparison, compare, poisoned, random_tensor
from . import harness
from .attention import parse_masked_shapes
from .check import CheckCase
from .harness import (
    COPY_BYTES_CPU,
    COPY_BYTES_GPU,
    DTYPES,
    OURS,
    Accuracy,
    BenchCase,
    UsageError,
    copy_bandwidth_tbps,
    device_random,
    dtype_name,
    format_table,
    parse_dims,
    shape_items,
    shape_label,
    table_groups,
    tk_function,
)

PREFILL = "batch_prefill"
DECODE = "batch_decode"
CONTIGUOUS = "contiguous"
SDPA = "sdpa"
FLEX = "flex"
PROVIDERS = {PREFILL: (OURS, CONTIGUOUS, FLEX), DECODE: (OURS, SDPA, FLEX)}

PREFILL_DIMS = ("B", "H", "Hkv", "Sq", "Sk", "D")
DECODE_DIMS = ("B", "H", "Hkv", "Sk", "D")
LAYOUTS = ("linear", "vectorized")
TABLES = ("1d", "2d")
KV_SCALES = ("tensor", "page", "none")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

GPU_SHAPES = {PREFILL: ["4x32x8x4096x4096x128", "4x16x16x4096x4096x128"],
              DECODE: ["32x32x8x8192x128", "8x32x8x32768x128"]}
GPU_PAGE_SIZES = {PREFILL: "1,16,1024", DECODE: "1,16,64"}
# Under the interpreter: two or three sequences, GQA, a few key blocks: seconds per provider.
CPU_SHAPES = {PREFILL: ["2x4x2x24x40x32"], DECODE: ["3x4x2x40x32"]}
CPU_PAGE_SIZES = {PREFILL: "16", DECODE: "3,16"}

OUT_RATIO = 2.0
# issue 6's goals, judged under the tables: ours/contiguous at page sizes >= 16 (and below), ours/floor
PREFILL_GOAL, PREFILL_GOAL_SMALL_PAGES = 0.9, 0.8
DECODE_GOAL_RATIO = 1.25
DECODE_GOAL_MIN_KEYS = 8192

# ANCHORS.md: SDPA on GQA-expanded K/V, bf16, one H100, 1.40 ms for both decode shapes.
ANCHOR_SDPA_DECODE_MS = {(32, 32, 8, 8192, 128): 1.40, (8, 32, 8, 32768, 128): 1.40}

FLEX_Q_BLOCK = 128
FLEX_MIN_KEY_BLOCK = 16       # tl.dot's smallest N
FLEX_DEFAULT_KEY_BLOCK = 64   # torch's default BLOCK_N for bf16/fp16, head dim 128, H100


def _paged_reference():
    from ..attention import reference

    return reference


# ----------------------------------------------------------------------------------------------------
# shapes and work


def parse_prefill_shapes(text: str, causal: str = "both") -> list[dict]:
    """``"4x32x8x4096x4096x128,2x4x2x24x40x32xcausal"`` -> ``[{"B": 4, "H": 32, "Hkv": 8, "Sq": 4096, "Sk":
    4096, "D": 128, "mask": "full"}, {..., "mask": "causal"}, {"B": 2, ..., "mask": "causal"}]``: an item
    without a mask suffix takes the masks ``causal`` (both/yes/no) selects."""
    shapes = parse_masked_shapes(text, causal, PREFILL_DIMS, "4x32x8x4096x4096x128xcausal")
    for dims in shapes:
        _check_heads(shape_label(dims), dims)
    return shapes


def parse_decode_shapes(text: str) -> list[dict]:
    """``"32x32x8x8192x128"`` -> ``[{"B": 32, "H": 32, "Hkv": 8, "Sk": 8192, "D": 128}]``."""
    shapes = []
    for item, parts in shape_items(text):
        try:
            dims = parse_dims(item, parts, DECODE_DIMS)
        except UsageError:
            raise UsageError(f"shape {item!r}: expected BxHxHkvxSkxD (5 positive integers joined by 'x'), "
                             "e.g. 32x32x8x8192x128") from None
        _check_heads(item, dims)
        shapes.append(dims)
    return shapes


def _check_heads(item: str, dims: dict) -> None:
    if dims["H"] % dims["Hkv"]:
        raise UsageError(f"shape {item!r}: H ({dims['H']}) must be a multiple of Hkv ({dims['Hkv']})")


def attended_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """(query, key) pairs one head of one sequence computes, FlashAttention's way: all of them, or
    causal (bottom-right) ``Sq*Sk - Sq^2/2`` (half when ``Sq == Sk``), ``Sk^2/2`` when ``Sq > Sk``."""
    if not causal:
        return float(seqlen_q * seqlen_k)
    if seqlen_q <= seqlen_k:
        return seqlen_q * seqlen_k - seqlen_q**2 / 2
    return seqlen_k**2 / 2


def prefill_flops(shape: dict) -> float:
    """``4 * B * H * D * pairs`` (QK^T and PV, 2 FLOPs per multiply-add each)."""
    pairs = attended_pairs(shape["Sq"], shape["Sk"], shape["mask"] == "causal")
    return 4.0 * shape["B"] * shape["H"] * shape["D"] * pairs


def decode_kv_bytes(shape: dict, kv_dtype: torch.dtype) -> int:
    """The bytes of K and V the batch reads once: ``B * Sk * Hkv * D * 2 * element size``."""
    return shape["B"] * shape["Sk"] * shape["Hkv"] * shape["D"] * 2 * kv_dtype.itemsize


def anchor(row: dict):
    """ANCHORS.md's SDPA decode time (1.40 ms on an H100, bf16 K/V expanded to the query heads), as TB/s
    of this row's KV bytes, for the two decode shapes it was measured at."""
    if row.get("interpreter") or row["op"] != DECODE or row["dtype"] != "bf16" or "/kv-" in row["layout"]:
        return None
    shape = row["shape"]
    ms = ANCHOR_SDPA_DECODE_MS.get(tuple(shape[d] for d in DECODE_DIMS))
    if ms is None:
        return None
    return "H100 SDPA anchor", decode_kv_bytes(shape, torch.bfloat16) / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------------
# inputs


class Spec:
    """What one bench case runs: op, shape, page size, cache layout, table format, dtypes."""

    def __init__(self, op: str, shape: dict, page_size: int, layout: str, table: str, dtype: torch.dtype,
                 kv_dtype: torch.dtype, kv_scale: str | None, device: torch.device, num_splits: int | None = None):
        self.op, self.shape, self.page_size, self.layout, self.table = op, shape, page_size, layout, table
        self.device = device
        self.dtype, self.kv_dtype, self.kv_scale, self.num_splits = dtype, kv_dtype, kv_scale, num_splits
        self.decode = op == DECODE
        self.batch, self.heads, self.heads_kv = shape["B"], shape["H"], shape["Hkv"]
        self.seqlen_q = 1 if self.decode else shape["Sq"]
        self.seqlen_k, self.head_dim = shape["Sk"], shape["D"]
        self.causal = not self.decode and shape["mask"] == "causal"
        self.sets: list[weakref.ref] = []     # the case's input sets, for building baselines' copies

    @property
    def layout_label(self) -> str:
        label = f"{self.layout}/{self.table}"
        if self.kv_dtype != self.dtype:
            label += f"/kv-{dtype_name(self.kv_dtype)}" + (f"-{self.kv_scale}" if self.kv_scale != "tensor" else "")
        return label

    def set_bytes(self) -> int:
        """q, the paged K and V (every page used) and the output."""
        q_bytes = self.batch * self.seqlen_q * self.heads * self.head_dim * self.dtype.itemsize
        pages = self.batch * -(-self.seqlen_k // self.page_size)
        kv_bytes = 2 * pages * self.page_size * self.heads_kv * self.head_dim * self.kv_dtype.itemsize
        return 2 * q_bytes + kv_bytes

    def make_inputs(self, i: int, seed: int) -> dict:
        reference = _paged_reference()
        device = self.device
        base = 1000 * seed + 10 * i
        B, H, Hkv, D = self.batch, self.heads, self.heads_kv, self.head_dim
        q = device_random((B * self.seqlen_q, H, D), self.dtype, device, base)
        k = device_random((B * self.seqlen_k, Hkv, D), self.dtype, device, base + 1)
        v = device_random((B * self.seqlen_k, Hkv, D), self.dtype, device, base + 2)
        cu_seqlens_k = torch.arange(B + 1, dtype=torch.int32, device=device) * self.seqlen_k
        # one page permutation per case: every input set shares the page table (flex's block mask too)
        order = torch.Generator().manual_seed(seed)
        scale = None if self.kv_dtype not in FP8 or self.kv_scale == "none" else self.kv_scale
        paged = reference.make_paged_kv(k, v, cu_seqlens_k, self.page_size, layout=self.layout,
                                        kv_dtype=self.kv_dtype, scale=scale, generator=order)
        del k, v
        x = InputSet(q=q, paged=paged)
        if not self.decode:
            x["qo_indptr"] = torch.arange(B + 1, dtype=torch.int32, device=device) * self.seqlen_q
        if i == 0:
            self.sets = []
        self.sets.append(weakref.ref(x))
        return x


class InputSet(dict):
    """One input set (a dict, as the harness wants); weakly referenced by its case's ``Spec.sets``."""


def _derived(spec: Spec, x: dict, provider: str, build: Callable[[dict], dict]) -> dict:
    """What ``provider`` needs besides the paged cache, kept in each input set. On the provider's first
    call (the accuracy check, before any timing or graph capture) it is built for every live set of the
    case, after another provider's is dropped, so at most one baseline's copies take memory at a time."""
    key = f"derived:{provider}"
    if key not in x:
        live = [s for s in (ref() for ref in spec.sets) if s is not None]
        for target in live if any(s is x for s in live) else [x]:
            for other in [k for k in target if k.startswith("derived:")]:
                del target[other]
            target[key] = build(target)
    return x[key]


def _gathered(x: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The set's keys and values contiguous ``[total_k, Hkv, D]`` in ``dtype`` (dequantised), and
    cu_seqlens_k."""
    paged = x["paged"]
    return _paged_reference().gather_paged_kv(paged.k_cache, paged.v_cache, **paged.table("2d"),
                                              k_scale=paged.k_scale, v_scale=paged.v_scale, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# providers: functions of one input set -> the provider's own output (unpacked by the check)


def _tk_provider(spec: Spec):
    op = tk_function(spec.op)

    def run(x: dict) -> torch.Tensor:
        paged = x["paged"]
        options = dict(paged.table(spec.table), k_scale=paged.k_scale, v_scale=paged.v_scale)
        if spec.decode:
            return op(x["q"], paged.k_cache, paged.v_cache, **options, num_splits=spec.num_splits)
        return op(x["q"], paged.k_cache, paged.v_cache, x["qo_indptr"], **options, causal=spec.causal)

    return run


def _contiguous_provider(spec: Spec):
    flash_attn_varlen_func = tk_function("flash_attn_varlen_func")

    def build(x: dict) -> dict:
        k, v, cu_seqlens_k = _gathered(x, spec.dtype)
        return {"k": k, "v": v, "cu_seqlens_k": cu_seqlens_k}

    def run(x: dict) -> torch.Tensor:
        d = _derived(spec, x, CONTIGUOUS, build)
        return flash_attn_varlen_func(x["q"], d["k"], d["v"], x["qo_indptr"], d["cu_seqlens_k"], spec.seqlen_q,
                                      spec.seqlen_k, causal=spec.causal)

    return run


def _sdpa_provider(spec: Spec):
    group = spec.heads // spec.heads_kv

    def build(x: dict) -> dict:
        k, v, _ = _gathered(x, spec.dtype)

        def expand(t):   # [B*Sk, Hkv, D] -> [B, H, Sk, D], contiguous
            t = t.view(spec.batch, spec.seqlen_k, spec.heads_kv, spec.head_dim).transpose(1, 2)
            return t.repeat_interleave(group, dim=1).contiguous()

        return {"k": expand(k), "v": expand(v)}

    def run(x: dict) -> torch.Tensor:
        d = _derived(spec, x, SDPA, build)
        return F.scaled_dot_product_attention(x["q"].unsqueeze(2), d["k"], d["v"])

    return run


def _flex_modules():
    """``(flex_attention module, PagedAttention)``, or NotImplementedError naming what this torch lacks."""
    try:
        from torch.nn.attention import flex_attention
        from torch.nn.attention.experimental._paged_attention import PagedAttention
    except ImportError as exc:
        raise NotImplementedError(f"flex unsupported: torch {torch.__version__} lacks FlexAttention's paged "
                                  f"attention ({exc})") from None
    return flex_attention, PagedAttention


def flex_key_block(page_size: int) -> int:
    """The key block FlexAttention's kernel can use with a page of ``page_size`` keys: the largest power
    of two dividing it, at most the default 64."""
    return min(page_size & -page_size, FLEX_DEFAULT_KEY_BLOCK)


def flex_unsupported(spec: Spec, compiled: bool) -> str | None:
    """Why the flex provider cannot run ``spec`` (None if it can)."""
    if spec.kv_dtype != spec.dtype:
        return (f"flex unsupported: an {dtype_name(spec.kv_dtype)} cache (flex_attention takes q, k and v of "
                "one dtype)")
    if compiled and flex_key_block(spec.page_size) < FLEX_MIN_KEY_BLOCK:
        return (f"flex unsupported: page size {spec.page_size} (FlexAttention's key block, >= "
                f"{FLEX_MIN_KEY_BLOCK}, must divide the block mask's KV block, which is the page)")
    return None


def _flex_cache(x: dict, spec: Spec) -> dict:
    """PagedAttention's physical layout of the set's cache: K, V ``[1, Hkv, num_pages * page_size, D]``,
    key ``j`` of sequence ``b`` at ``block_table[b, j // P] * P + j % P`` (zeros where no key is), and q
    as a ``[B, H, Sq, D]`` view."""
    paged = x["paged"]
    k, v, _ = _gathered(x, spec.dtype)
    P = spec.page_size
    position = torch.arange(spec.seqlen_k, device=k.device)
    pages = paged.block_table[:, position // P].long()                                   # [B, Sk]
    address = (pages * P + position % P).reshape(-1)                                      # [B * Sk]
    caches = []
    for t in (k, v):
        cache = torch.zeros(1, spec.heads_kv, paged.num_pages * P, spec.head_dim, dtype=spec.dtype,
                            device=k.device)
        cache[0, :, address] = t.transpose(0, 1)
        caches.append(cache)
    q = x["q"].view(spec.batch, spec.seqlen_q, spec.heads, spec.head_dim).transpose(1, 2)
    return {"q": q, "k": caches[0], "v": caches[1]}


def _flex_block_mask(spec: Spec, paged, flex_attention, paged_attention_class):
    """The logical block mask of the case (bottom-right causal or none, keys past ``Sk`` out), converted
    to the physical pages by ``PagedAttention`` with its tables set from ``paged.block_table``."""
    device = paged.block_table.device
    P, B, Sq, Sk = spec.page_size, spec.batch, spec.seqlen_q, spec.seqlen_k
    pages_per_seq = -(-Sk // P)
    attention = paged_attention_class(paged.num_pages, P, B, device=device)
    table = paged.block_table[:, :pages_per_seq].long()
    attention.page_table[:, :pages_per_seq] = table
    logical = torch.arange(pages_per_seq, device=device).expand(B, -1)
    attention.physical_to_logical.scatter_(1, table, logical)
    attention.capacity[:] = pages_per_seq * P
    seqlen_k = torch.full((B,), Sk, dtype=torch.int64, device=device)
    if hasattr(attention, "seq_lens"):     # the torch versions whose mask_mod bounds keys by it
        attention.seq_lens[:] = seqlen_k
    causal = spec.causal

    def mask_mod(b, h, q_idx, kv_idx):
        inside = kv_idx < seqlen_k[b]
        if causal:
            inside = inside & (kv_idx <= q_idx + seqlen_k[b] - Sq)
        return inside

    block_mask = flex_attention.create_block_mask(mask_mod, B, None, Sq, pages_per_seq * P, device=device,
                                                  BLOCK_SIZE=(FLEX_Q_BLOCK, P))
    extra = {"kv_len": seqlen_k} if "kv_len" in inspect.signature(attention.convert_logical_block_mask).parameters \
        else {}
    return attention.convert_logical_block_mask(block_mask, **extra)


def _flex_provider(spec: Spec):
    """Everything but the call happens on the first call of the case (modules, support, compilation) or
    of an input set (its cache copy and block mask): the timed calls only call."""
    state: dict = {}

    def setup(device: torch.device) -> None:
        flex_attention, paged_attention = _flex_modules()
        compiled = device.type == "cuda"
        reason = flex_unsupported(spec, compiled)
        if reason:
            raise NotImplementedError(reason)
        state["modules"] = (flex_attention, paged_attention)
        state["options"] = {"enable_gqa": spec.heads != spec.heads_kv}
        if compiled and spec.page_size % FLEX_DEFAULT_KEY_BLOCK:
            state["options"]["kernel_options"] = {"BLOCK_N": flex_key_block(spec.page_size)}
        if compiled:
            torch._dynamo.reset()
            state["fn"] = torch.compile(flex_attention.flex_attention, dynamic=False)
        else:
            state["fn"] = flex_attention.flex_attention

    def build(x: dict) -> dict:
        d = _flex_cache(x, spec)
        table = x["paged"].block_table          # the same in every set of a case: one mask serves them all
        if "table" not in state or not torch.equal(state["table"], table):
            state["table"] = table.clone()
            state["mask"] = _flex_block_mask(spec, x["paged"], *state["modules"])
        d["mask"] = state["mask"]
        return d

    def run(x: dict) -> torch.Tensor:
        if "fn" not in state:
            setup(x["q"].device)
        d = _derived(spec, x, FLEX, build)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            return state["fn"](d["q"], d["k"], d["v"], block_mask=d["mask"], **state["options"])

    return run


def _unpack(spec: Spec, provider: str, output: torch.Tensor) -> torch.Tensor:
    """A provider's output as ``[total_q, H, D]`` (prefill) or ``[B, H, D]`` (decode)."""
    if provider in (SDPA, FLEX):
        if spec.decode:
            return output[:, :, 0]
        return output.transpose(1, 2).reshape(spec.batch * spec.seqlen_q, spec.heads, spec.head_dim)
    return output


# ----------------------------------------------------------------------------------------------------
# the accuracy check before timing


def _sample_pairs(batch: int, heads: int) -> list[tuple[int, int]]:
    return [(b, h) for b in sorted({0, batch - 1}) for h in sorted({0, heads - 1})]


def _head_slice(t, layout: str, kv_head: int):
    """KV head ``kv_head`` of a cache (keeping the dim) or of a per-page scale; other scales as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return t
    if t.dim() == 2:                                        # per page and head [num_pages, Hkv]
        return t[:, kv_head:kv_head + 1]
    if layout == "linear":                                  # [P, page, Hkv, D]
        return t[:, :, kv_head:kv_head + 1]
    return t[:, kv_head:kv_head + 1]                        # vectorized: [P, Hkv, ...]


def _reference_pair(spec: Spec, x: dict, b: int, h: int, compute_dtype: torch.dtype) -> torch.Tensor:
    """Output ``[Sq, D]`` of sequence ``b``, query head ``h``, by ``reference_paged_attention`` on that
    sequence's row of the 2-D table and its KV head's slice of the cache."""
    paged = x["paged"]
    kv_head = h // (spec.heads // spec.heads_kv)
    rows = slice(b * spec.seqlen_q, (b + 1) * spec.seqlen_q)
    q = x["q"][rows, h:h + 1]
    qo_indptr = torch.tensor([0, spec.seqlen_q], dtype=torch.int32, device=q.device)
    out, _ = _paged_reference().reference_paged_attention(
        q, _head_slice(paged.k_cache, paged.layout, kv_head), _head_slice(paged.v_cache, paged.layout, kv_head),
        qo_indptr, block_table=paged.block_table[b:b + 1], seqlen_k=paged.seqlen_k[b:b + 1], causal=spec.causal,
        k_scale=_head_slice(paged.k_scale, paged.layout, kv_head),
        v_scale=_head_slice(paged.v_scale, paged.layout, kv_head), compute_dtype=compute_dtype)
    return out[:, 0]


def _make_check(spec: Spec):
    """``check(inputs, output, provider)``; the references are computed once per input set."""
    pairs = _sample_pairs(spec.batch, spec.heads)
    expected = (spec.batch * spec.seqlen_q, spec.heads, spec.head_dim)
    cache: dict[int, tuple] = {}

    def check(inputs: dict, output, provider: str) -> Accuracy:
        out = _unpack(spec, provider, output)
        if tuple(out.shape) != expected:
            return Accuracy(False, math.inf, f"out shape {tuple(out.shape)}, expected {expected}")
        key = id(inputs)
        if key not in cache:
            ref = torch.stack([_reference_pair(spec, inputs, b, h, torch.float64) for b, h in pairs])
            low = torch.stack([_reference_pair(spec, inputs, b, h, spec.dtype) for b, h in pairs])
            cache.clear()
            cache[key] = (ref, low)
        ref, low = cache[key]
        sample = torch.stack([out[b * spec.seqlen_q:(b + 1) * spec.seqlen_q, h] for b, h in pairs])
        comparison = compare(f"{provider} out", sample, ref, low, ratio=OUT_RATIO)
        detail = str(comparison)
        nonfinite = int((~torch.isfinite(out)).sum())
        if nonfinite:
            detail += f"; {nonfinite} non-finite elements in the whole output"
        return Accuracy(comparison.passed and not nonfinite, comparison.ratio, detail)

    return check


# ----------------------------------------------------------------------------------------------------
# benchmark cases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-sizes",
                        help="batch_prefill/batch_decode: comma-separated page sizes (default: prefill "
                             f"{GPU_PAGE_SIZES[PREFILL]}, decode {GPU_PAGE_SIZES[DECODE]}; on the CPU "
                             f"{CPU_PAGE_SIZES[PREFILL]} and {CPU_PAGE_SIZES[DECODE]})")
    parser.add_argument("--kv-dtypes",
                        help="batch_prefill/batch_decode: cache dtypes, the bench dtype and/or fp8e4m3, fp8e5m2 "
                             "(default: prefill the bench dtype; decode the bench dtype and fp8e4m3)")
    parser.add_argument("--kv-scale", default="tensor", choices=KV_SCALES,
                        help="batch_prefill/batch_decode: fp8 cache scales, one per tensor, per page and KV "
                             "head, or none (1.0); default tensor")
    parser.add_argument("--kv-layout", default="linear", choices=LAYOUTS,
                        help="batch_prefill/batch_decode: cache layout (default linear)")
    parser.add_argument("--page-table", default="1d", choices=TABLES,
                        help="batch_prefill/batch_decode: page-table format, 1d (indptr + indices + last "
                             "page lengths) or 2d (block table + lengths); default 1d")
    parser.add_argument("--num-splits", type=int,
                        help="batch_decode: key splits per sequence (default: the op's automatic choice)")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"),
                        help="flash_attn/batch_prefill: masks for shapes given without an xfull/xcausal "
                             "suffix (default both)")


def _split(text: str, allowed: Sequence[str], option: str) -> list[str]:
    items = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in items if p not in allowed]
    if unknown or not items:
        raise UsageError(f"{option}: {', '.join(unknown) or 'nothing given'}; choose from {', '.join(allowed)}")
    return items


def _page_sizes(text: str) -> list[int]:
    try:
        sizes = list(dict.fromkeys(int(p) for p in text.split(",") if p.strip()))
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"--page-sizes: {text!r}; expected comma-separated positive integers, e.g. 1,16,64")
    return sizes


def _kv_dtypes(text: str, dtype: torch.dtype) -> list[torch.dtype]:
    allowed = [dtype_name(dtype), "fp8e4m3", "fp8e5m2"]
    return [DTYPES[name] for name in _split(text, allowed, "--kv-dtypes")]


def _case(spec: Spec, providers: Sequence[str], seed: int, copy_tbps: float | None) -> BenchCase:
    builders = {OURS: _tk_provider, CONTIGUOUS: _contiguous_provider, SDPA: _sdpa_provider, FLEX: _flex_provider}
    fns = {p: builders[p](spec) for p in providers}
    case = BenchCase(op=spec.op, shape=dict(spec.shape), dtype=spec.dtype, variant=f"page{spec.page_size}",
                     layout=spec.layout_label, flops=prefill_flops(spec.shape) if not spec.decode else 0.0,
                     set_bytes=spec.set_bytes(), make_inputs=lambda i: spec.make_inputs(i, seed), providers=fns,
                     check=_make_check(spec))
    if spec.decode:
        kv_bytes = decode_kv_bytes(spec.shape, spec.kv_dtype)
        floor_ms = kv_bytes / (copy_tbps * 1e12) * 1e3
        case.flops, case.metric = float(kv_bytes), "tbps"
        case.row_extra = lambda row: {"kv_bytes": kv_bytes, "copy_tbps": copy_tbps, "floor_ms": floor_ms,
                                      "floor_ratio": row["ms"] / floor_ms}
    return case


def bench_cases(op: str, opts: argparse.Namespace, device: torch.device) -> list[BenchCase]:
    interpreter = device.type != "cuda"
    dtype = opts.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise UsageError(f"{op}: --dtype {dtype_name(dtype)}; q runs in fp16 or bf16 (fp8 caches: --kv-dtypes)")
    explicit = bool(opts.providers)
    providers = _split(opts.providers, PROVIDERS[op], "--providers") if explicit else list(PROVIDERS[op])
    page_sizes = _page_sizes(getattr(opts, "page_sizes", None)
                             or (CPU_PAGE_SIZES if interpreter else GPU_PAGE_SIZES)[op])
    default_kv = dtype_name(dtype) + (",fp8e4m3" if op == DECODE and not interpreter else "")
    kv_dtypes = _kv_dtypes(getattr(opts, "kv_dtypes", None) or default_kv, dtype)
    kv_scale = getattr(opts, "kv_scale", "tensor")
    layout = getattr(opts, "kv_layout", "linear")
    table = getattr(opts, "page_table", "1d")
    num_splits = getattr(opts, "num_splits", None)
    if num_splits is not None and num_splits < 1:
        raise UsageError(f"--num-splits: {num_splits}; expected a positive integer")
    sizes = opts.shapes or ",".join((CPU_SHAPES if interpreter else GPU_SHAPES)[op])
    if op == PREFILL:
        shapes = parse_prefill_shapes(sizes, getattr(opts, "causal", "both"))
    else:
        shapes = parse_decode_shapes(sizes)
    if layout == "vectorized":
        for kv_dtype in kv_dtypes:
            x = 16 // kv_dtype.itemsize
            bad = [p for p in page_sizes if p % x] + [s["D"] for s in shapes if s["D"] % x]
            if bad:
                raise UsageError(f"--kv-layout vectorized needs page sizes and head dims that are multiples of "
                                 f"x = {x} ({dtype_name(kv_dtype)}); not {', '.join(map(str, bad))}")
    copy_tbps = None
    if op == PREFILL:
        print(f"{op}: TFLOP/s = 4*B*H*D*pairs, pairs = Sq*Sk (causal: Sq*Sk - Sq^2/2, half when Sq == Sk); "
              "ours/contiguous = paged over tk.flash_attn_varlen_func on the same KV gathered contiguous",
              flush=True)
    else:
        copy_tbps = copy_bandwidth_tbps(device, opts.warmup or 50.0, opts.rep or 200.0)
        print(f"{op}: TB/s = KV bytes (B*Sk*Hkv*D*2*element size) / median time; device copy bandwidth "
              f"{copy_tbps:.3g} TB/s (.copy_ of {COPY_BYTES_GPU if not interpreter else COPY_BYTES_CPU} bytes, "
              "read + written / median time); floor = KV bytes / that bandwidth", flush=True)
    if interpreter and FLEX in providers:
        print(f"{op}: flex runs uncompiled on the CPU (the unfused implementation)", flush=True)
    cases, left_out = [], {}
    for kv_dtype, page_size, shape in itertools.product(kv_dtypes, page_sizes, shapes):
        spec = Spec(op, shape, page_size, layout, table, dtype, kv_dtype,
                    kv_scale if kv_dtype in FP8 else None, device, num_splits)
        case_providers = providers
        reason = flex_unsupported(spec, compiled=not interpreter) if FLEX in providers else None
        if reason and not explicit:     # asked for by name, it runs and fails with the reason instead
            case_providers = [p for p in providers if p != FLEX]
            left_out.setdefault(reason, []).append(f"page{page_size}/{dtype_name(kv_dtype)}")
        cases.append(_case(spec, case_providers, opts.seed, copy_tbps))
    for reason, where in left_out.items():
        print(f"{op}: {reason}: left out of {len(where)} case(s) ({', '.join(dict.fromkeys(where))})", flush=True)
    return cases


# ----------------------------------------------------------------------------------------------------
# tables: the harness's, then the goals (prefill) or the bandwidth floor (decode)


def _page_size_of(variant: str) -> int:
    return int(variant.removeprefix("page"))


def _prefill_goals(rows: Sequence[dict], markdown: bool) -> str:
    ratios: dict[tuple, list[tuple[float, str]]] = {}
    cells = {(r["variant"], r["dtype"], r["layout"], shape_label(r["shape"]), r["provider"]): r for r in rows}
    for (variant, dtype, layout, shape, provider), r in cells.items():
        base = cells.get((variant, dtype, layout, shape, CONTIGUOUS))
        if provider == OURS and base is not None and not r.get("interpreter"):
            ratios.setdefault((variant, dtype, layout), []).append((r["p50"] / base["p50"], shape))
    if not ratios:
        return ""
    lines = []
    for (variant, dtype, layout), values in ratios.items():
        goal = PREFILL_GOAL_SMALL_PAGES if _page_size_of(variant) < 16 else PREFILL_GOAL
        worst, shape = min(values)
        verdict = "meets" if worst >= goal else "misses"
        lines.append(f"{variant} · {dtype} · {layout}: min ours/contiguous {worst:.3f} at {shape} {verdict} "
                     f"the goal >= {goal}")
    head = (f"goals (issue 6: ours/contiguous >= {PREFILL_GOAL} at page sizes >= 16, >= {PREFILL_GOAL_SMALL_PAGES} "
            "below):")
    return "\n".join([head] + [("- " if markdown else "  ") + line for line in lines])


def _decode_floor(rows: Sequence[dict], markdown: bool) -> str:
    blocks = []
    for (op, variant, dtype, layout), group, providers, cells, shapes in table_groups(
            [r for r in rows if "floor_ms" in r]):
        headers = ["shape", "KV MB", "copy TB/s", "floor ms"] + [f"{p} ms" for p in providers]
        headers += [f"{p}/floor" for p in providers]
        body, worst = [], None
        for s in shapes:
            first = next(cells[(s, p)] for p in providers if (s, p) in cells)
            line = [s, f"{first['kv_bytes'] / 1e6:.4g}", f"{first['copy_tbps']:.3g}", f"{first['floor_ms']:.4g}"]
            line += [f"{cells[(s, p)]['ms']:.4g}" if (s, p) in cells else "-" for p in providers]
            line += [f"{cells[(s, p)]['floor_ratio']:.3f}" if (s, p) in cells else "-" for p in providers]
            body.append(line)
            ours = cells.get((s, OURS))
            long_context = (ours is not None and ours["shape"]["Sk"] >= DECODE_GOAL_MIN_KEYS
                            and not ours.get("interpreter"))
            if long_context and (worst is None or ours["floor_ratio"] > worst[0]):
                worst = (ours["floor_ratio"], s)
        title = (f"{op} · {variant} · {dtype} · {layout} — time against the bandwidth floor (KV bytes read "
                 "once at the measured copy bandwidth)")
        text = ("#### " if markdown else "") + title + "\n\n" + format_table(headers, body, markdown)
        if worst is not None:
            verdict = "meets" if worst[0] <= DECODE_GOAL_RATIO else "misses"
            text += (f"\n\n{'- ' if markdown else '  '}ours/floor: max {worst[0]:.3f} at {worst[1]} over "
                     f">= {DECODE_GOAL_MIN_KEYS // 1024}k-key shapes, {verdict} the goal <= {DECODE_GOAL_RATIO}")
        blocks.append(text)
    return "\n\n".join(blocks)


def report_rows(rows: Sequence[dict], op_module=None, markdown: bool = False, interpreter_note: bool = True) -> str:
    text = harness.report(rows, op_module, markdown=markdown, interpreter_note=interpreter_note)
    extra = [_prefill_goals([r for r in rows if r["op"] == PREFILL], markdown),
             _decode_floor([r for r in rows if r["op"] == DECODE], markdown)]
    return "\n\n".join([text] + [e for e in extra if e])


# ----------------------------------------------------------------------------------------------------
# check cases


def _worst(comparisons: list[Comparison]) -> Comparison:
    """A failing comparison if any, else the one nearest its limit."""
    return max(comparisons, key=lambda c: (not c.passed, c.ratio))


def _paged_check(name: str, device: torch.device, seed: int, *, decode: bool, heads: int, heads_k: int,
                 head_dim: int, seqlens_q: list[int], seqlens_k: list[int], page_size: int, layout: str = "linear",
                 table: str = "1d", dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
                 scale: str | None = None, num_splits: int | None = None, **options) -> CheckCase:
    """tk.batch_prefill (or tk.batch_decode, one query per sequence) on a cache from ``make_paged_kv``
    (shuffled pages, NaN in unused slots, two extra pages), into a NaN-poisoned ``out``, against
    ``reference_paged_attention``: out and LSE, every element, under the 2x error-ratio rule.
    ``options``: causal, window_left, logits_soft_cap."""

    def run() -> Comparison:
        reference = _paged_reference()
        gen = torch.Generator().manual_seed(seed)
        lens_q = [1] * len(seqlens_k) if decode else seqlens_q
        q = random_tensor((sum(lens_q), heads, head_dim), dtype, device, generator=gen)
        k = random_tensor((sum(seqlens_k), heads_k, head_dim), dtype, device, generator=gen)
        v = random_tensor((sum(seqlens_k), heads_k, head_dim), dtype, device, generator=gen)
        cu_k = torch.tensor([0, *itertools.accumulate(seqlens_k)], dtype=torch.int32, device=device)
        qo_indptr = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
        paged = reference.make_paged_kv(k, v, cu_k, page_size, layout=layout, kv_dtype=kv_dtype, scale=scale,
                                        extra_pages=2, generator=gen)
        kwargs = dict(paged.table(table), k_scale=paged.k_scale, v_scale=paged.v_scale, return_lse=True,
                      out=poisoned(q.shape, q.dtype, device), **options)
        if decode:
            out, lse = tk_function("batch_decode")(q, paged.k_cache, paged.v_cache, num_splits=num_splits, **kwargs)
        else:
            out, lse = tk_function("batch_prefill")(q, paged.k_cache, paged.v_cache, qo_indptr, **kwargs)
        ref_kwargs = dict(paged.table(table), k_scale=paged.k_scale, v_scale=paged.v_scale, **options)
        ref, ref_lse = reference.reference_paged_attention(q, paged.k_cache, paged.v_cache, qo_indptr,
                                                           compute_dtype=torch.float64, **ref_kwargs)
        low, low_lse = reference.reference_paged_attention(q, paged.k_cache, paged.v_cache, qo_indptr,
                                                           compute_dtype=dtype, **ref_kwargs)
        return _worst([compare("out", out, ref, low, ratio=OUT_RATIO),
                       compare("lse", lse, ref_lse, low_lse, ratio=OUT_RATIO)])

    return CheckCase(name, run)


def _merge_fp32(v_a, lse_a, v_b, lse_b):
    """The merge formula as PyTorch computes it in float32 (the error rule's low-precision answer)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    v = (w_a.unsqueeze(-1) * torch.nan_to_num(v_a.float()) + w_b.unsqueeze(-1) * torch.nan_to_num(v_b.float()))
    v = torch.where((total > 0).unsqueeze(-1), v / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1),
                    0.0)
    return v, torch.where(total > 0, m + torch.log(total), -math.inf)


def _merge_check(name: str, device: torch.device, seed: int, rows: int, heads: int, head_dim: int,
                 dtype: torch.dtype) -> CheckCase:
    """tk.merge_attention_states on random states, some rows with one or both LSEs -inf (no keys),
    against ``reference_merge_states`` (fp64); the low-precision answer is the same formula on the
    inputs in fp32 rounded to ``dtype``."""

    def run() -> Comparison:
        reference = _paged_reference()
        gen = torch.Generator().manual_seed(seed)
        v_a = random_tensor((rows, heads, head_dim), dtype, device, generator=gen)
        v_b = random_tensor((rows, heads, head_dim), dtype, device, generator=gen)
        lse_a = (torch.randn(rows, heads, generator=gen) * 4).to(device)
        lse_b = (torch.randn(rows, heads, generator=gen) * 4).to(device)
        lse_a[0] = -math.inf
        lse_b[1] = -math.inf
        lse_a[2, 0] = lse_b[2, 0] = -math.inf
        v, lse = tk_function("merge_attention_states")(v_a, lse_a, v_b, lse_b)
        ref_v, ref_lse = reference.reference_merge_states(v_a, lse_a, v_b, lse_b)
        low_v, low_lse = _merge_fp32(v_a, lse_a, v_b, lse_b)
        return _worst([compare("v", v, ref_v, low_v.to(dtype), ratio=OUT_RATIO),
                       compare("lse", lse, ref_lse, low_lse, ratio=OUT_RATIO)])

    return CheckCase(name, run)


def _case_name(decode: bool, dtype, heads, heads_k, head_dim, seqlens_q, seqlens_k, page_size, layout, table,
               kv_dtype, scale, num_splits, options) -> str:
    lens = (f"k{'_'.join(map(str, seqlens_k))}" if decode
            else f"q{'_'.join(map(str, seqlens_q))}-k{'_'.join(map(str, seqlens_k))}")
    name = f"{dtype_name(dtype)}-{lens}-H{heads}" + (f"-Hk{heads_k}" if heads_k != heads else "")
    name += f"-D{head_dim}-p{page_size}-{layout}-{table}"
    if kv_dtype is not None and kv_dtype != dtype:
        name += f"-kv{dtype_name(kv_dtype)}" + (f"-{scale}" if scale else "")
    if num_splits:
        name += f"-splits{num_splits}"
    if options.get("causal"):
        name += "-causal"
    if options.get("window_left", -1) >= 0:
        name += f"-window{options['window_left']}"
    if options.get("logits_soft_cap"):
        name += f"-softcap{options['logits_soft_cap']:g}"
    return name


def check_cases(op: str, device: torch.device) -> list[CheckCase]:
    on_gpu = device.type == "cuda"
    cases: list[CheckCase] = []
    seed = iter(range(1, 10_000))
    bf16, fp16, e4m3, e5m2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
    decode = op == DECODE

    def add(heads, head_dim, seqlens_k, page_size, *, seqlens_q=(), heads_k=None, layout="linear", table="1d",
            dtype=bf16, kv_dtype=None, scale=None, num_splits=None, **options):
        heads_k = heads_k or heads
        name = _case_name(decode, dtype, heads, heads_k, head_dim, list(seqlens_q), list(seqlens_k), page_size,
                          layout, table, kv_dtype, scale, num_splits, options)
        cases.append(_paged_check(name, device, next(seed), decode=decode, heads=heads, heads_k=heads_k,
                                  head_dim=head_dim, seqlens_q=list(seqlens_q), seqlens_k=list(seqlens_k),
                                  page_size=page_size, layout=layout, table=table, dtype=dtype,
                                  kv_dtype=kv_dtype, scale=scale, num_splits=num_splits, **options))

    if op == PREFILL:
        if on_gpu:
            lens_q, lens_k = [1000, 0, 517, 1], [1500, 200, 517, 3000]
            add(32, 128, lens_k, 1, seqlens_q=lens_q, heads_k=8, causal=True)
            add(32, 128, lens_k, 16, seqlens_q=lens_q, heads_k=8, causal=True, table="2d")
            add(16, 128, lens_k, 64, seqlens_q=lens_q, layout="vectorized")
            add(32, 128, lens_k, 16, seqlens_q=lens_q, heads_k=8, layout="vectorized", table="2d", causal=True,
                kv_dtype=e4m3, scale="page")
            add(8, 64, lens_k, 1024, seqlens_q=lens_q, heads_k=2, dtype=fp16, kv_dtype=e5m2, scale="tensor")
            add(8, 128, [2048, 3000], 16, seqlens_q=[2048, 1000], heads_k=2, causal=True, window_left=256,
                logits_soft_cap=30.0)
            add(8, 256, [777, 1025], 7, seqlens_q=[777, 1025], heads_k=4, dtype=fp16, causal=True)
        else:
            # a sequence without queries, one without keys (its rows give out 0, lse -inf), one with more
            # queries than keys under the causal mask
            lens_q, lens_k = [17, 0, 9, 30], [23, 11, 0, 20]
            add(4, 32, lens_k, 1, seqlens_q=lens_q, heads_k=2, causal=True)
            add(4, 32, lens_k, 3, seqlens_q=lens_q, heads_k=1, table="2d")
            add(2, 32, [40, 19], 16, seqlens_q=[24, 19], layout="vectorized", causal=True)
            add(4, 32, [40, 19], 16, seqlens_q=[24, 19], heads_k=2, layout="vectorized", table="2d",
                kv_dtype=e4m3, scale="page")
            add(2, 40, [37], 3, seqlens_q=[29], dtype=fp16, kv_dtype=e5m2, scale="tensor", causal=True,
                window_left=8, logits_soft_cap=2.0)
        return cases

    if on_gpu:
        lens = [8192, 1, 0, 3000, 16384, 77]
        add(32, 128, lens, 16, heads_k=8)
        add(32, 128, lens, 1, heads_k=8, table="2d")
        add(32, 128, lens, 64, heads_k=8, layout="vectorized", kv_dtype=e4m3, scale="tensor")
        add(32, 128, lens, 16, heads_k=8, table="2d", kv_dtype=e4m3, scale="page", num_splits=7)
        add(16, 64, lens, 3, heads_k=16, dtype=fp16, num_splits=1)
        add(32, 128, [32768, 100], 16, heads_k=8, window_left=1000, logits_soft_cap=30.0)
        cases.append(_merge_check("merge-bf16-N4096-H32-D128", device, next(seed), 4096, 32, 128, bf16))
        cases.append(_merge_check("merge-fp16-N333-H5-D80", device, next(seed), 333, 5, 80, fp16))
    else:
        lens = [40, 1, 0, 23, 7]
        add(4, 32, lens, 1, heads_k=2)
        add(4, 32, lens, 16, heads_k=2, layout="vectorized", table="2d", num_splits=3)
        add(4, 32, lens, 3, heads_k=1, kv_dtype=e4m3, scale="page", num_splits=2)
        add(2, 40, lens, 3, dtype=fp16, table="2d", window_left=5, logits_soft_cap=2.0, num_splits=2)
        cases.append(_merge_check("merge-bf16-N5-H3-D40", device, next(seed), 5, 3, 40, bf16))
        cases.append(_merge_check("merge-fp32-N4-H2-D16", device, next(seed), 4, 2, 16, torch.float32))
    return cases


# ----------------------------------------------------------------------------------------------------
# registration (bench/__init__.py: "tilekernels.bench.paged:BATCH_PREFILL", ":BATCH_DECODE")


class PagedBench(harness.SharedModuleOp):
    """The harness's op interface for one of the two paged ops."""

    def __init__(self, name: str):
        super().__init__(name, sys.modules[__name__])
        self.METRIC = "tbps" if name == DECODE else "tflops"
        self.ANCHOR_PROVIDER = SDPA if name == DECODE else None
        self.FLOPS_FORMULA = ("KV bytes B*Sk*Hkv*D*2*element size" if name == DECODE
                              else "4*B*H*D*Sq*Sk (causal: Sq*Sk - Sq^2/2 pairs)")

    def anchor(self, row: dict):
        return anchor(row)


BATCH_PREFILL = PagedBench(PREFILL)
BATCH_DECODE = PagedBench(DECODE)
