"""Byte-plane split/merge for torch tensors: CPU against numpy and the device-generic ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbank.errors import InvalidInput
from kvbank.kernels.planes import (
    _merge_tensor_ops,
    _split_tensor_ops,
    merge_planes_tensor,
    split_planes_tensor,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reference(raw: bytes, k: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, k).T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_split_planes_tensor_matches_numpy_and_generic_ops(dtype: torch.dtype) -> None:
    t = torch.randn(3, 257).to(dtype)
    k = t.element_size()
    planes = split_planes_tensor(t)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert np.array_equal(planes.numpy(), _reference(raw, k))
    generic = torch.empty_like(planes)
    _split_tensor_ops(t.reshape(-1).view(torch.uint8), k, generic)
    assert torch.equal(generic, planes)

    out = torch.empty_like(t)
    merge_planes_tensor(planes, out)
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    generic_out = torch.empty(t.numel() * k, dtype=torch.uint8)
    _merge_tensor_ops(planes, generic_out)
    assert torch.equal(generic_out, t.reshape(-1).view(torch.uint8))


def test_split_planes_tensor_rejects_non_contiguous() -> None:
    t = torch.randn(8, 8).to(torch.bfloat16).t()
    with pytest.raises(InvalidInput, match="contiguous"):
        split_planes_tensor(t)


def test_merge_planes_tensor_wrong_out_size_raises() -> None:
    planes = split_planes_tensor(torch.randn(10).to(torch.bfloat16))
    with pytest.raises(InvalidInput, match="needs 20 bytes"):
        merge_planes_tensor(planes, torch.empty(9, dtype=torch.bfloat16))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_planes_tensor_cuda_matches_cpu(dtype: torch.dtype) -> None:
    t = torch.randn(1000, 33).to(dtype)
    cpu = split_planes_tensor(t)
    dev = split_planes_tensor(t.cuda())
    assert dev.device.type == "cuda"
    assert torch.equal(dev.cpu(), cpu)
    back = merge_planes_tensor(dev, torch.empty_like(t, device="cuda"))
    assert torch.equal(back.cpu(), t.view(torch.uint8).reshape(-1))
