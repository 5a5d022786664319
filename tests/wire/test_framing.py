"""The binary put body, match body and fetch stream forms: round trips, and hostile bytes
fuzzed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.errors import InvalidInput
from kvbank.keys import tokens_to_bytes
from kvbank.wire.framing import (
    FETCH_MAGIC,
    FRAME,
    MATCH_MAGIC,
    PREFIX,
    PUT_MAGIC,
    FrameKind,
    MatchHeader,
    PutHeader,
    PutKind,
    StreamRow,
    decode_fetch_header,
    decode_frame,
    decode_match,
    decode_prefix,
    decode_put_header,
    encode_fetch_prefix,
    encode_frame,
    encode_match,
    encode_put_prefix,
    fetch_stream_bytes,
)

headers = st.builds(
    PutHeader,
    kind=st.sampled_from(PutKind),
    layout_id=st.binary(min_size=32, max_size=32),
    tenant=st.text(max_size=8), cache_salt=st.text(max_size=8), lora=st.text(max_size=8),
    group=st.integers(0, 8), first_page=st.integers(0, 1000),
    shard=st.none() | st.integers(0, 7), at=st.none() | st.integers(1, 10_000),
    tokens=st.integers(0, 5000), keys=st.none(), pages=st.just(1),
    page_bytes=st.integers(1, 1 << 22),
)


@given(headers)
def test_put_header_round_trips(h: PutHeader) -> None:
    blob = encode_put_prefix(h)
    n = decode_prefix(blob, PUT_MAGIC)
    assert PREFIX.size + n == len(blob)
    got = decode_put_header(blob[PREFIX.size:])
    assert got == h
    assert got.body_bytes(n) == len(blob) + 4 * h.tokens + h.page_bytes  # type: ignore[operator]


@given(st.binary(max_size=64))
def test_decode_prefix_never_raises_anything_but_invalid_input(data: bytes) -> None:
    try:
        n = decode_prefix(data, PUT_MAGIC)
    except InvalidInput:
        return
    assert n > 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300)
@given(st.dictionaries(
    st.sampled_from(["kind", "layout_id", "scope", "group", "first_page", "shard", "at", "tokens",
                     "keys", "pages", "page_bytes", "other"]),
    json_values, max_size=11))
def test_decode_put_header_refuses_hostile_documents_with_invalid_input(doc: dict[str, object]) -> None:
    try:
        h = decode_put_header(json.dumps(doc).encode())
    except InvalidInput as exc:
        assert str(exc).startswith(("header", "header."))
        return
    assert len(h.layout_id) == 32 and h.page_bytes >= 1 and h.pages >= 0


@given(st.binary(max_size=200))
def test_decode_put_header_refuses_junk_bytes(data: bytes) -> None:
    with pytest.raises(InvalidInput):
        decode_put_header(data)


def test_decode_put_header_names_the_bad_field() -> None:
    good = PutHeader(PutKind.PAGES, b"\1" * 32, "", "", "", 0, 0, None, None, 16, None, 1, 64)
    doc = good.to_doc()
    for key, bad, field in [("layout_id", "abc", "layout_id"), ("group", -1, "group"),
                            ("page_bytes", 0, "page_bytes"), ("keys", 3, "tokens"),
                            ("kind", "blob", "kind"), ("extra", 1, "extra")]:
        with pytest.raises(InvalidInput, match=f"header.{field}"):
            decode_put_header(json.dumps({**doc, key: bad}).encode())
    with pytest.raises(InvalidInput, match=r"header\.pages"):
        decode_put_header(json.dumps({**doc, "kind": "state", "pages": 2}).encode())


@given(st.text(min_size=1, max_size=40),
       st.lists(st.builds(StreamRow, st.integers(0, 2**31), st.integers(0, 9),
                          st.integers(0, 2**31), st.integers(0, 2**40)), max_size=20))
def test_fetch_header_round_trips(fid: str, rows: list[StreamRow]) -> None:
    blob = encode_fetch_prefix(fid, rows, "s1")
    n = decode_prefix(blob, FETCH_MAGIC)
    assert decode_fetch_header(blob[PREFIX.size:PREFIX.size + n]) == (fid, "s1", rows)
    assert fetch_stream_bytes(len(blob), rows) == len(blob) + sum(16 + r.size for r in rows) + 16


@given(st.binary(min_size=16, max_size=16))
def test_decode_frame_is_total(data: bytes) -> None:
    try:
        kind, pos, length = decode_frame(data)
    except InvalidInput:
        assert data[0] not in (1, 2, 3)
        return
    assert encode_frame(kind, pos, length)[:1] + encode_frame(kind, pos, length)[4:] == data[:1] + data[4:]


def test_frames_and_prefixes_refuse_wrong_magic_and_sizes() -> None:
    assert FRAME.size == 16
    with pytest.raises(InvalidInput, match="frame"):
        decode_frame(b"\1" * 15)
    blob = encode_fetch_prefix("f", [], "s")
    with pytest.raises(InvalidInput, match="magic"):
        decode_prefix(blob, PUT_MAGIC)
    with pytest.raises(InvalidInput, match="rows"):
        decode_fetch_header(b'{"fetch_id": "f", "stream": "s", "rows": [[1, 2, 3]]}')
    with pytest.raises(InvalidInput, match=r"stream\.stream"):
        decode_fetch_header(b'{"fetch_id": "f", "rows": []}')
    assert decode_frame(encode_frame(FrameKind.END, 0, 5)) == (FrameKind.END, 0, 5)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=300), st.one_of(st.none(), st.integers(0, 7)),
       st.text(max_size=8))
def test_match_body_round_trips(tokens: list[int], shard: int | None, tenant: str) -> None:
    raw = tokens_to_bytes(tokens)
    scope = {"tenant": tenant, "cache_salt": "s", "lora": ""}
    head, got = decode_match(encode_match(b"\x07" * 32, scope, shard, raw))
    assert got == raw and head == MatchHeader(b"\x07" * 32, tenant, "s", "", shard, len(tokens))


@given(st.binary(max_size=300))
def test_decode_match_refuses_junk_with_invalid_input(data: bytes) -> None:
    for body in (data, MATCH_MAGIC + data, encode_match(b"\1" * 32, {}, None, b"")[:12] + data):
        try:
            head, tokens = decode_match(body)
        except InvalidInput:
            continue
        assert len(tokens) == 4 * head.tokens and len(head.layout_id) == 32


def test_decode_match_names_what_is_wrong() -> None:
    good = encode_match(b"\1" * 32, {}, None, tokens_to_bytes([5, 6, 7]))
    for body, field in (
        (good[:-1], "3 tokens"),  # a token short of what the header says
        (good + b"\0\0\0\0", "3 tokens"),  # one too many
        (PREFIX.pack(PUT_MAGIC, 1, 2) + b"{}", "magic"),
        (PREFIX.pack(MATCH_MAGIC, 1, 40) + b"{}", "shorter than its 40-byte header"),
        (_match_with({"layout_id": "ab", "tokens": 0}), "layout_id"),
        (_match_with({"layout_id": "01" * 32, "tokens": 0, "keys": 3}), r"header\.keys: not a match header"),
        (_match_with({"layout_id": "01" * 32, "tokens": -1}), r"header\.tokens"),
        (_match_with({"layout_id": "01" * 32, "tokens": 0, "scope": {"x": ""}}), r"header\.scope"),
        (_match_with({"layout_id": "01" * 32, "tokens": 0, "shard": "one"}), r"header\.shard"),
    ):
        with pytest.raises(InvalidInput, match=field):
            decode_match(body)


def _match_with(doc: dict[str, object]) -> bytes:
    text = json.dumps(doc).encode()
    return PREFIX.pack(MATCH_MAGIC, 1, len(text)) + text
