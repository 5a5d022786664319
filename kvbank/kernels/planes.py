"""Byte-plane split and merge for torch tensors on any device.

:func:`split_planes_tensor` / :func:`merge_planes_tensor` — the codec's plane
transposition (:mod:`kvbank.codec.planes`, numpy) for tensors: CPU tensors go through the
numpy kernels (zero-copy views); other devices use a transposing ``copy_``, which is one
strided copy kernel there.
"""

from __future__ import annotations

import torch

from kvbank.codec.planes import check_itemsize, merge_planes, split_planes
from kvbank.errors import InvalidInput


def _tensor_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInput(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise InvalidInput(f"{what}: must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def split_planes_tensor(
    t: torch.Tensor, itemsize: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Planes of a contiguous tensor's bytes, ``uint8 [itemsize, n]`` on ``t``'s device.

    ``itemsize`` defaults to ``t.element_size()``; ``out`` (``uint8 [itemsize, n]``,
    contiguous, same device) is filled and returned.
    """
    k = t.element_size() if itemsize is None else itemsize
    check_itemsize(k)
    raw = _tensor_bytes(t, "t")
    if raw.numel() % k:
        raise InvalidInput(f"t: {raw.numel()} bytes is not a whole number of {k}-byte items")
    n = raw.numel() // k
    if out is None:
        out = torch.empty((k, n), dtype=torch.uint8, device=raw.device)
    _check_plane_tensor(out, k, n, raw.device, "out")
    if raw.device.type == "cpu":
        split_planes(raw.numpy(), k, out.numpy())
    else:
        _split_tensor_ops(raw, k, out)
    return out


def merge_planes_tensor(planes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`split_planes_tensor`: ``uint8 [k, n]`` -> ``uint8 [n * k]``.

    ``out`` may be any contiguous tensor of ``n * k`` bytes on the same device (e.g. the
    page tensor itself); its flat ``uint8`` view is returned.
    """
    if not isinstance(planes, torch.Tensor) or planes.dim() != 2:
        raise InvalidInput("planes: expected a 2-D uint8 tensor [itemsize, n]")
    k, n = planes.shape
    check_itemsize(k)
    _check_plane_tensor(planes, k, n, planes.device, "planes")
    if out is None:
        dst = torch.empty(k * n, dtype=torch.uint8, device=planes.device)
    else:
        dst = _tensor_bytes(out, "out")
        if dst.device != planes.device:
            raise InvalidInput(f"out: on {dst.device}, planes on {planes.device}")
        if dst.numel() != k * n:
            raise InvalidInput(f"out: needs {k * n} bytes, has {dst.numel()}")
    if planes.device.type == "cpu":
        merge_planes(planes.numpy(), dst.numpy())
    else:
        _merge_tensor_ops(planes, dst)
    return dst


def _check_plane_tensor(
    t: torch.Tensor, k: int, n: int, device: torch.device, what: str
) -> None:
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != torch.uint8
        or tuple(t.shape) != (k, n)
        or not t.is_contiguous()
    ):
        got = (getattr(t, "dtype", None), tuple(getattr(t, "shape", ())))
        raise InvalidInput(f"{what}: expected a contiguous uint8 tensor [{k}, {n}], got {got}")
    if t.device != device:
        raise InvalidInput(f"{what}: on {t.device}, data on {device}")


def _split_tensor_ops(raw: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Device-generic split: one transposing copy (a single kernel on CUDA)."""
    out.copy_(raw.view(-1, k).t())


def _merge_tensor_ops(planes: torch.Tensor, dst: torch.Tensor) -> None:
    """Device-generic merge: one transposing copy."""
    k = planes.shape[0]
    dst.view(-1, k).copy_(planes.t())
