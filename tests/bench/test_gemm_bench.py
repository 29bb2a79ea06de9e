"""The gemm bench's case list (no timing): variants, the medium shapes, and the config each row reports."""

from __future__ import annotations

import argparse

import pytest
import torch

from tilekernels.bench import gemm
from tilekernels.bench.harness import UsageError
from tilekernels.gemm import configs

CPU = torch.device("cpu")


def _opts(**kw) -> argparse.Namespace:
    base = {"shapes": None, "dtype": torch.bfloat16, "providers": None, "seed": 0, "layout": "RR",
            "variants": "plain,epilogue", "split_k": "1"}
    return argparse.Namespace(**{**base, **kw})


def test_variants_and_medium_shapes():
    cases = gemm.bench_cases(_opts(variants="plain,medium,epilogue,async"), CPU)
    variants = [c.variant for c in cases]
    assert variants == (["plain"] * len(gemm.INTERPRETER_SHAPES) + [gemm.MEDIUM] * len(gemm.INTERPRETER_MEDIUM_SHAPES)
                        + [gemm.EPILOGUE] * len(gemm.INTERPRETER_EPILOGUE_SHAPES)
                        + [gemm.ASYNC] * len(gemm.INTERPRETER_ASYNC_SHAPES))
    medium = [c for c in cases if c.variant == gemm.MEDIUM]
    assert [f"{c.shape['M']}x{c.shape['N']}x{c.shape['K']}" for c in medium] == gemm.INTERPRETER_MEDIUM_SHAPES
    assert all(set(c.providers) == {gemm.OURS, "cublas"} for c in medium)
    with pytest.raises(UsageError, match="medium"):
        gemm.bench_cases(_opts(variants="plain,wide"), CPU)


def test_reported_config_names_the_row_tail(monkeypatch):
    """The config a row reports is the launch plan: with a row tail both launches (the async kernel's too, with its
    own large tile); split-K (which takes no tail) its single config."""
    monkeypatch.setattr(configs, "capability", lambda device: (9, 0))
    monkeypatch.setattr(configs, "sm_count", lambda device: 132)
    hopper = torch.device("cuda", 0)
    cfg, tail = configs.select_plan(3072, 3072, 4096, torch.bfloat16, hopper)
    assert tail is not None
    text = gemm._default_config(3072, 3072, 4096, torch.bfloat16, hopper, 1)
    assert text == configs.describe_plan(cfg, tail) and f"rows<{tail.rows}" in text
    single = configs.select_config(3072, 3072, 4096, torch.bfloat16, hopper).describe()
    assert gemm._default_config(3072, 3072, 4096, torch.bfloat16, hopper, 2) == f"{single} split_k=2"
    text = gemm._default_config(3072, 3072, 4096, torch.bfloat16, hopper, 1, async_input=True)
    assert text == configs.describe_plan(*configs.select_plan(3072, 3072, 4096, torch.bfloat16, hopper,
                                                              async_input=True))
    assert "rows<" in text and f" g{configs.ASYNC_LARGE_GROUP_M} " in text
