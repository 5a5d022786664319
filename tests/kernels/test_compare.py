"""The reuse audit's comparison: recomputed pages within the dtype's tolerance pass, pages of
another model fail, non-finite values fail, and the worst buffer is named."""

from __future__ import annotations

import math

import pytest
import torch

from kvbank import full_attention
from kvbank.errors import InvalidInput
from kvbank.kernels.compare import compare_pages, tolerance_of
from kvbank.layout import Role


def pages_of(layout, values: dict[tuple[int, Role], torch.Tensor], n: int) -> torch.Tensor:
    pages = torch.zeros((n, layout.group_page_bytes[0]), dtype=torch.uint8)
    for key, view in layout.views(pages, 0).items():
        view.copy_(values[key])
    return pages


def kv(layout, n: int, seed: int) -> dict[tuple[int, Role], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {key: torch.randn(view.shape, generator=g).to(view.dtype)
            for key, view in layout.views(torch.zeros((n, layout.group_page_bytes[0]), dtype=torch.uint8), 0).items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compare_recompute_noise_passes_and_another_model_fails(dtype: str) -> None:
    layout = full_attention("cmp@1", num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype)
    stored_kv = kv(layout, 3, 1)
    stored = pages_of(layout, stored_kv, 3)
    same = compare_pages(layout, 0, stored.clone(), stored)
    assert same.ok and same.error == 0.0 and same.pages == 3
    # recompute noise: a relative 1e-6 wobble (float32) or one rounding step (bf16)
    step = 1e-6 if dtype == "float32" else 2 ** -8
    noisy = {k: (v.float() * (1 + step)).to(v.dtype) for k, v in stored_kv.items()}
    near = compare_pages(layout, 0, pages_of(layout, noisy, 3), stored)
    assert near.ok, near.describe()
    other = compare_pages(layout, 0, pages_of(layout, kv(layout, 3, 2), 3), stored)
    assert not other.ok
    assert other.error > 10 * tolerance_of(getattr(torch, dtype))
    assert "relative error" in other.describe()


def test_compare_names_the_worst_buffer_and_fails_on_nan() -> None:
    layout = full_attention("cmp@2", num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32")
    values = kv(layout, 2, 3)
    stored = pages_of(layout, values, 2)
    changed = dict(values)
    changed[(1, Role.VALUE)] = values[(1, Role.VALUE)] * 1.5
    d = compare_pages(layout, 0, pages_of(layout, changed, 2), stored)
    assert (d.layer, d.role, d.ok) == (1, Role.VALUE, False)
    changed = dict(values)
    bad = values[(2, Role.KEY)].clone()
    bad[0, 0, 0, 0] = float("nan")
    changed[(2, Role.KEY)] = bad
    d = compare_pages(layout, 0, pages_of(layout, changed, 2), stored)
    assert (d.layer, d.role, d.error, d.ok) == (2, Role.KEY, math.inf, False)


def test_compare_refuses_pages_of_another_shape() -> None:
    layout = full_attention("cmp@3", num_layers=1, num_kv_heads=2, head_dim=64, dtype="float32")
    a = torch.zeros((2, layout.group_page_bytes[0]), dtype=torch.uint8)
    with pytest.raises(InvalidInput, match="stored"):
        compare_pages(layout, 0, a, a[:1])
