"""Compare canonical pages an engine computed with pages a store holds, within the dtype's
tolerance: the check behind the sampled reuse audit (``docs/integrations.md``).

Two engines that compute the same prompt with the same model get the same KV up to
floating-point noise (batch shapes, chunk sizes and kernels change the order of sums); an
engine whose pages came from another model, another config or another layout gets
different numbers altogether. :func:`compare_pages` measures, per buffer (layer, role) over
all the pages given, the error relative to the stored values' scale::

    error = max |computed - stored| / max(max |stored|, tiny)

and answers the worst buffer as a :class:`PageDiff`, with :data:`TOLERANCE` of the
buffer's dtype (a non-finite value on either side is an error of ``inf``). Buffers
declared ``transferred=False`` are not in a page and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbank.errors import InvalidInput
from kvbank.layout import PageLayout, Role

__all__ = ["TOLERANCE", "PageDiff", "compare_pages", "tolerance_of"]

# Relative tolerance by dtype name. float32 recomputes differ by ~1e-6 relative; the
# margin covers reductions in another order over thousands of tokens. Low-precision
# dtypes get a few units of their own rounding step (bf16 has 8 mantissa bits, fp8 3 or 2).
TOLERANCE: dict[str, float] = {
    "float64": 1e-6, "float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2,
    "float8_e4m3fn": 0.15, "float8_e4m3fnuz": 0.15, "float8_e5m2": 0.3, "float8_e5m2fnuz": 0.3,
}
DEFAULT_TOLERANCE = 0.05  # an integer or unknown dtype: compared as numbers, loosely
_TINY = 1e-12


def tolerance_of(dtype: torch.dtype) -> float:
    """The relative tolerance of ``dtype`` (see :data:`TOLERANCE`)."""
    return TOLERANCE.get(str(dtype).removeprefix("torch."), DEFAULT_TOLERANCE)


@dataclass(frozen=True, slots=True)
class PageDiff:
    """The worst buffer of a comparison: its error and its dtype's tolerance."""

    group: int
    layer: int
    role: Role
    error: float
    tolerance: float
    pages: int  # how many pages were compared

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def describe(self) -> str:
        return (f"group {self.group} layer {self.layer} {self.role.name}: relative error "
                f"{self.error:.3g} over {self.pages} page(s), tolerance {self.tolerance:.3g}")


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    a32 = a.to(torch.float64)
    b32 = b.to(torch.float64)
    if not (bool(torch.isfinite(a32).all()) and bool(torch.isfinite(b32).all())):
        return math.inf
    scale = float(b32.abs().max()) if b32.numel() else 0.0
    diff = float((a32 - b32).abs().max()) if a32.numel() else 0.0
    return diff / max(scale, _TINY)


def compare_pages(layout: PageLayout, group: int, computed: torch.Tensor,
                  stored: torch.Tensor) -> PageDiff:
    """The worst buffer of ``computed`` against ``stored`` (both canonical pages of
    ``group``, ``uint8 [n, page bytes]``, page ``k`` of one against page ``k`` of the other)."""
    if computed.shape != stored.shape:
        raise InvalidInput(f"stored: pages of shape {tuple(stored.shape)}, the computed ones are "
                           f"{tuple(computed.shape)}", field="stored")
    n = 1 if computed.dim() == 1 else int(computed.shape[0])
    a = layout.views(computed, group)
    b = layout.views(stored, group)
    worst: PageDiff | None = None
    for (layer, role), va in a.items():
        tol = tolerance_of(va.dtype)
        d = PageDiff(group, layer, role, _error(va, b[(layer, role)]), tol, n)
        if worst is None or d.error / d.tolerance > worst.error / worst.tolerance:
            worst = d
    if worst is None:
        raise InvalidInput(f"group: group {group} has no transferred buffer to compare", field="group")
    return worst
