"""The one table of what torch raises under a copy or an allocation, and its mapping to
kvbank's errors: used by the kernels and the device tier, which sits above them.

``RuntimeError`` covers CUDA faults (``torch.AcceleratorError``,
``torch.cuda.CudaError``), ``torch.OutOfMemoryError`` (mapped to :class:`TierFull`
first) and ``NotImplementedError`` (a tensor with no storage). Every torch call of the
device tier and of the page kernels catches exactly these and maps them through
:func:`torch_fault`, so only :class:`~kvbank.errors.KvbankError` leaves them.
"""

from __future__ import annotations

import torch

from kvbank.errors import TierFull, TierUnavailable

TORCH_ERRORS: tuple[type[Exception], ...] = (RuntimeError,)


def torch_fault(what: str, exc: BaseException) -> TierFull | TierUnavailable:
    """The typed error for a torch failure ``exc`` during ``what`` (``raise … from exc``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return TierFull(f"device tier: {what}: out of device memory: {exc}")
    return TierUnavailable(f"device tier: {what}: {exc}")


__all__ = ["TORCH_ERRORS", "torch_fault"]
