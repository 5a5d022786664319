"""The README's promise that a Client behaves like a Bank (same results, same exceptions),
held where a new user's sweep found them apart: a meta tensor to put, a non-contiguous
``out`` buffer, any call after ``close``, page keys of odd lengths, and a bad timeout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvbank import Bank, Client, full_attention
from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.service.launch import NodeProcess

FA = full_attention("like-bank@1", num_layers=1, num_kv_heads=2, head_dim=64)
PAGE = FA.group_page_bytes[0]


@pytest.fixture(params=["bank", "client-local", "client-shm", "client-tcp"])
def api(request: pytest.FixtureRequest, node: NodeProcess, tmp_path: Any) -> Iterator[Any]:
    if request.param == "bank":
        with Bank.open(host_bytes="64M", data_dir=tmp_path, device_bytes=0) as bank:
            yield bank
        return
    # client-local: the node's Unix socket (required); client-shm: HTTP calls, shared memory
    paths: dict[str, dict[str, Any]] = {"client-local": {"channel": "local"},
                                        "client-shm": {"same_host": True, "channel": "http"},
                                        "client-tcp": {"same_host": False}}
    kw = paths[request.param]
    with Client(node.url, **kw) as client:
        yield client


def test_a_meta_tensor_to_put_is_invalid_input(api: Any) -> None:
    """W15: the Client raised NotImplementedError ("Cannot copy out of meta tensor")."""
    lid = api.register(FA)
    meta = torch.empty((2, PAGE), dtype=torch.uint8, device="meta")
    with pytest.raises(InvalidInput, match="a tensor on meta has no bytes to store"):
        api.put(lid, list(range(32)), group=0, pages=meta)
    assert api.match(lid, [*range(32), 1]).resume.tokens == 0  # nothing was stored


def test_a_non_contiguous_out_buffer_is_named_as_such(api: Any) -> None:
    """W16: the message said "expected a contiguous CPU tensor, got cpu"."""
    lid = api.register(FA)
    toks = list(range(100, 132))
    api.put(lid, toks, group=0, pages=torch.ones((2, PAGE), dtype=torch.uint8))
    m = api.match(lid, [*toks, 1])
    strided = torch.zeros((PAGE, 2), dtype=torch.uint8).t()
    with pytest.raises(InvalidInput, match="non-contiguous"):
        api.fetch(m, out={0: strided})


def test_every_call_after_close_is_tier_unavailable(api: Any) -> None:
    """W17: a closed Client still matched, put and answered stats; a closed Bank refuses."""
    lid = api.register(FA)
    api.close()
    api.close()  # idempotent
    for call in (lambda: api.match(lid, list(range(40))), api.stats,
                 lambda: api.put(lid, list(range(16)), group=0, pages=torch.zeros((1, PAGE), dtype=torch.uint8)),
                 lambda: api.register(FA)):
        with pytest.raises(TierUnavailable, match="closed"):
            call()


def test_page_keys_of_odd_lengths_store_and_match_alike(api: Any) -> None:
    """W19 (already fixed on main: put expands engine keys as match does): a 31-byte and
    a 33-byte key store two rows, and match finds both, on Bank and Client alike."""
    lid = api.register(FA)
    keys = [b"k" * 31, b"q" * 33]
    assert len(api.put(lid, keys=keys, group=0, pages=torch.zeros((2, PAGE), dtype=torch.uint8))) == 2
    assert api.match(lid, keys=keys, prompt_tokens=33).resume.tokens == 32


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), True, "5"])
def test_a_client_timeout_is_checked_when_the_client_is_made(node: NodeProcess, bad: object) -> None:
    """W18: ``Client(url, timeout_s=-1)`` was accepted, and the first call raised
    ``ValueError: Timeout value out of range`` from the socket module."""
    with pytest.raises(InvalidInput, match="timeout_s"):
        Client(node.url, timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="retry_s"):
        Client(node.url, retry_s=-1)


def test_a_client_url_with_a_path_is_refused_naming_the_root(node: NodeProcess) -> None:
    """W8 (the library's side): a URL with a path is not a node's root."""
    with pytest.raises(InvalidInput, match="node's root"):
        Client(node.url + "/v1")
