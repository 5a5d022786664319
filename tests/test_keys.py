"""Scopes, page-key chains and row names: golden vectors and properties."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank import keys as K
from kvbank.errors import InvalidInput, InvalidRowName, InvalidTokens
from tests.golden_specs import DATA, keys_doc

GOLDEN = json.loads((DATA / "keys_golden.json").read_text())


def test_keys_match_golden_vectors() -> None:
    """Key chains, scope digests, namespaces and row names never change without a
    KEY_VERSION bump: a change would turn every stored page into a miss (or worse)."""
    assert keys_doc() == GOLDEN


def test_keys_partial_last_page_is_not_keyed() -> None:
    assert len(K.page_keys(list(range(47)), 16)) == 2
    assert K.page_keys(list(range(15)), 16) == []
    assert K.page_keys([], 16) == []


def test_keys_list_numpy_and_torch_inputs_agree() -> None:
    tokens = [(i * 31) % 50_000 for i in range(96)]
    a = K.page_keys(tokens, 16)
    assert K.page_keys(np.asarray(tokens, dtype=np.int64), 16) == a
    assert K.page_keys(np.asarray(tokens, dtype=np.int32), 16) == a
    assert K.page_keys(torch.tensor(tokens).numpy(), 16) == a
    assert K.page_keys(tuple(tokens), 16) == a


@pytest.mark.parametrize(
    "tokens",
    [[-1] * 16, [2**31] * 16, [1.5] * 16, np.zeros((2, 16), dtype=np.int32), np.ones(16) * 0.5,
     ["a"] * 16],
)
def test_keys_refuse_tokens_outside_int32(tokens: object) -> None:
    with pytest.raises(InvalidTokens, match="tokens"):
        K.page_keys(tokens, 16)  # type: ignore[arg-type]



@pytest.mark.parametrize(
    "tokens",
    [torch.arange(32, device="meta"), collections.deque([[1], [1, 2]])],
    ids=["tensor-numpy-cannot-read", "ragged"],
)
def test_keys_refuse_tokens_numpy_cannot_read_with_invalid_tokens(tokens: object) -> None:
    """Tokens numpy cannot turn into an array (a device tensor, ragged nesting) are bad
    input: InvalidTokens naming the field, not numpy's TypeError or ValueError."""
    with pytest.raises(InvalidTokens, match="tokens"):
        K.page_keys(tokens, 16)  # type: ignore[arg-type]


def test_scope_refuses_strings_without_a_utf8_form() -> None:
    """A scope field with a lone surrogate is InvalidInput naming the field, not a
    UnicodeEncodeError from hashing it."""
    with pytest.raises(InvalidInput, match=r"scope\.tenant"):
        K.Scope(tenant="\ud800")

@pytest.mark.parametrize("bad", [0, -16, True, 1.5])
def test_keys_refuse_bad_page_size(bad: object) -> None:
    with pytest.raises(InvalidInput, match="tokens_per_page"):
        K.page_keys([1] * 32, bad)  # type: ignore[arg-type]


def test_keys_parent_continues_a_chain() -> None:
    tokens = list(range(128))
    whole = K.page_keys(tokens, 16)
    head = K.page_keys(tokens[:48], 16)
    tail = K.page_keys(tokens[48:], 16, parent=head[-1])
    assert head + tail == whole


def test_keys_scopes_never_share_keys_or_namespaces() -> None:
    tokens = list(range(32))
    scopes = [K.Scope(), K.Scope(tenant="a"), K.Scope(cache_salt="a"), K.Scope(lora="a"),
              K.Scope(tenant="a", cache_salt="b"), K.Scope(tenant="ab")]
    firsts = {K.page_keys(tokens, 16, s)[0] for s in scopes}
    assert len(firsts) == len(scopes)
    lid = bytes(32)
    assert len({K.namespace(lid, s) for s in scopes}) == len(scopes)


def test_keys_extra_changes_only_its_page_and_later() -> None:
    tokens = list(range(64))
    plain = K.page_keys(tokens, 16)
    mm = K.page_keys(tokens, 16, extra=[None, b"image-digest"])
    assert mm[0] == plain[0]
    assert all(a != b for a, b in zip(mm[1:], plain[1:], strict=True))
    with pytest.raises(InvalidInput, match="extra"):
        K.page_keys(tokens, 16, extra=[b""] * 5)


def test_row_name_parse_and_build_are_inverses() -> None:
    ns = K.namespace(bytes(range(32)))
    key = K.page_keys(list(range(16)), 16)[0]
    raw = K.row_name(ns, key, 3, 4, 2)
    assert len(raw) == K.ROW_NAME_BYTES == 54
    parsed = K.RowName.parse(raw)
    assert (parsed.namespace, parsed.page_key, parsed.group, parsed.shard_count,
            parsed.shard_index) == (ns, key, 3, 4, 2)
    assert bytes(parsed) == raw
    assert K.row_names(ns, [key], 3, 4, 2) == [raw]


@pytest.mark.parametrize("raw", [b"", b"x" * 53, b"x" * 55, bytes(48) + b"\x00\x00\x00\x00\x00\x00",
                                 bytes(48) + b"\x00\x00\x00\x02\x00\x02"])
def test_row_name_parse_refuses_malformed_bytes(raw: bytes) -> None:
    with pytest.raises(InvalidRowName):
        K.RowName.parse(raw)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=200),
    st.integers(1, 40),
    st.integers(0, 200),
)
def test_keys_prefix_property(tokens: list[int], page: int, cut: int) -> None:
    """Keys of a prefix are a prefix of the keys: the basis of longest-prefix match."""
    full = K.page_keys(tokens, page)
    part = K.page_keys(tokens[:cut], page)
    assert full[: len(part)] == part
    assert len(full) == len(tokens) // page
    assert all(len(k) == 32 for k in full)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=16, max_size=64), st.integers(0, 15))
def test_keys_any_token_change_changes_its_page_and_later(tokens: list[int], pos: int) -> None:
    before = K.page_keys(tokens, 16)
    changed = list(tokens)
    changed[pos] += 1
    after = K.page_keys(changed, 16)
    assert all(a != b for a, b in zip(before, after, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32),
       st.integers(0, 0xFFFF), st.integers(1, 0xFFFF), st.data())
def test_row_name_round_trip_property(ns: bytes, key: bytes, group: int, count: int,
                                      data: st.DataObject) -> None:
    index = data.draw(st.integers(0, count - 1))
    raw = K.row_name(ns, key, group, count, index)
    assert bytes(K.RowName.parse(raw)) == raw


# ---- row-name anatomy and engine keys ------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(ns=st.binary(min_size=16, max_size=16), key=st.binary(min_size=32, max_size=32),
       group=st.integers(0, 0xFFFF), count=st.integers(1, 0xFFFF), data=st.data())
def test_keys_anatomy_reads_back_what_row_name_wrote(ns: bytes, key: bytes, group: int, count: int,
                                                     data: st.DataObject) -> None:
    index = data.draw(st.integers(0, count - 1))
    name = K.row_name(ns, key, group, count, index)
    assert K.namespace_of(name) == ns and K.page_key_of(name) == key
    assert K.group_of(name) == group and K.shard_of(name) == (count, index)
    assert K.shape_key(name) == (ns, group.to_bytes(2, "big"))
    parsed = K.RowName.parse(name)
    assert (parsed.namespace, parsed.group, parsed.shard_count, parsed.shard_index) == (ns, group, count, index)


def test_keys_same_chain_needs_namespace_group_and_shard_equal() -> None:
    a = K.row_name(b"n" * 16, b"a" * 32, 1, 2, 0)
    assert K.same_chain(a, K.row_name(b"n" * 16, b"b" * 32, 1, 2, 0))
    assert not K.same_chain(a, K.row_name(b"m" * 16, b"b" * 32, 1, 2, 0))
    assert not K.same_chain(a, K.row_name(b"n" * 16, b"b" * 32, 2, 2, 0))
    assert not K.same_chain(a, K.row_name(b"n" * 16, b"b" * 32, 1, 2, 1))
    assert not K.same_chain(a, K.row_name(b"n" * 16, b"b" * 32, 1, 4, 0))


def test_keys_engine_keys_rule() -> None:
    """32-byte keys pass through; any other length is SHA-256(tag, version, scope digest,
    layout id, u32 length, key), never zero-padded; scope and layout change the expansion."""
    import hashlib
    import struct

    lid = b"L" * 32
    vllm = [bytes([i]) * 16 for i in range(3)]
    full = [bytes([i]) * 32 for i in range(2)]
    got = K.engine_keys(vllm + full, lid)
    want = [hashlib.sha256(b"kvbank/engine-key\x00" + struct.pack("<I", K.KEY_VERSION)
                           + K.DEFAULT_SCOPE.digest + lid + struct.pack("<I", 16) + k).digest()
            for k in vllm]
    assert got == want + full
    assert got[0] != vllm[0] + bytes(16)  # not padded
    assert K.engine_keys(vllm, lid, K.Scope("t")) != want
    assert K.engine_keys(vllm, b"M" * 32) != want
    assert K.engine_keys([b"\x01" * 8], lid) != K.engine_keys([b"\x01" * 9], lid)
    for bad, field in (([b""], "keys[0]"), ([b"x" * 2000], "keys[0]"), ([b"x" * 16, "s"], "keys[1]"),
                       (b"x" * 32, "keys")):
        with pytest.raises(InvalidInput) as info:
            K.engine_keys(bad, lid)  # type: ignore[arg-type]
        assert info.value.field == field
