"""The binary forms of page bodies on the node's data API.

A **put body** (``POST /v1/put``, ``POST /v1/put_state``) is::

    prefix   "KVBP" | version u8 | 3 zero bytes | header length u32 (little-endian)
    header   UTF-8 JSON: kind, layout_id (hex), scope, group, first_page, shard, at,
             tokens or keys (a count), pages (a count), page_bytes
    tokens   count × int32 little-endian       (or keys: count × 32 bytes)
    pages    pages × page_bytes bytes, in chain order

The header says exactly how long the body is (:meth:`PutHeader.body_bytes`), so a server
refuses a wrong page size or a wrong length from the header alone, before it reads (or
stores) a single page.

A **match body** (``POST /v1/match`` with ``Content-Type: application/octet-stream``, what
:class:`~kvbank.client.client.Client` sends for a prompt given by its tokens) is::

    prefix   "KVBM" | version u8 | 3 zero bytes | header length u32
    header   UTF-8 JSON: layout_id (hex), scope, shard, tokens (a count)
    tokens   count × int32 little-endian

It asks exactly what the JSON body ``{layout_id, scope, shard, tokens_b64}`` asks, without
base64 in JSON around 4 bytes a token (16,000 tokens: 0.5 ms less between the two ends).

A **fetch stream** (the answer to ``POST /v1/fetch``) is::

    prefix   "KVBF" | version u8 | 3 zero bytes | header length u32
    header   UTF-8 JSON: fetch_id, stream (this stream's id, named by its acknowledgement),
             rows = [[position, group, slot, size], ...] in plan order
    frames   one per planned row, in plan order: a 16-byte frame header
             kind u8 | 3 zero bytes | position u32 | length u64, then ``length`` bytes
    end      an END frame whose ``length`` zero bytes pad the stream to its content-length

A ``ROW`` frame carries a row's bytes (``length`` = its size); a row that vanished since
the plan (evicted, or its frame failed its checksum) is a ``MISSING`` frame with length 0,
so a reader can always tell which row each byte belongs to and never takes filler for a
page. The server fixes the content-length before it streams; the END padding keeps that
length when rows go missing mid-stream.

Both decoders take untrusted bytes and raise :class:`~kvbank.errors.InvalidInput` naming
the field; nothing else escapes (fuzzed in ``tests/wire/test_framing.py``).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from kvbank.errors import InvalidInput
from kvbank.keys import PAGE_KEY_BYTES

PUT_MAGIC = b"KVBP"
MATCH_MAGIC = b"KVBM"
FETCH_MAGIC = b"KVBF"
VERSION = 1
PREFIX = struct.Struct("<4sB3xI")  # magic, version, header length
FRAME = struct.Struct("<B3xIQ")  # kind, plan position, length
MAX_HEADER_BYTES = 1 << 20  # a header describes, it never carries pages
MAX_COUNT = 1 << 24  # tokens, keys or pages in one body
LAYOUT_ID_BYTES = 32
TOKEN_BYTES = 4


class PutKind(enum.Enum):
    PAGES = "pages"  # Bank.put: pages first_page, first_page+1, ... of an ATTENTION group
    STATE = "state"  # Bank.put_state: one snapshot of a STATE group at ``at``


class FrameKind(enum.IntEnum):
    ROW = 1
    MISSING = 2
    END = 3


def _int(doc: dict[str, Any], key: str, *, lo: int = 0) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidInput(f"header.{key}: expected an integer >= {lo}, got {v!r}")
    return v


def _opt_int(doc: dict[str, Any], key: str, *, lo: int = 0) -> int | None:
    return None if doc.get(key) is None else _int(doc, key, lo=lo)


def _str(doc: dict[str, Any], key: str) -> str:
    v = doc.get(key, "")
    if not isinstance(v, str):
        raise InvalidInput(f"header.{key}: expected a string, got {type(v).__name__}")
    return v


@dataclass(frozen=True, slots=True)
class PutHeader:
    """What a put body declares before its pages."""

    kind: PutKind
    layout_id: bytes
    tenant: str
    cache_salt: str
    lora: str
    group: int
    first_page: int  # PAGES only
    shard: int | None
    at: int | None  # STATE only: the boundary (None = after every full page)
    tokens: int | None  # count of int32 tokens that follow (None: keys follow)
    keys: int | None  # count of 32-byte page keys that follow
    pages: int
    page_bytes: int

    @property
    def key_bytes(self) -> int:
        """Bytes of the token ids (or page keys) between the header and the pages."""
        return (self.tokens or 0) * TOKEN_BYTES + (self.keys or 0) * PAGE_KEY_BYTES

    def body_bytes(self, header_len: int) -> int:
        """The exact length of a body with this header."""
        return PREFIX.size + header_len + self.key_bytes + self.pages * self.page_bytes

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": self.kind.value, "layout_id": self.layout_id.hex(),
            "scope": {"tenant": self.tenant, "cache_salt": self.cache_salt, "lora": self.lora},
            "group": self.group, "first_page": self.first_page, "shard": self.shard,
            "at": self.at, "pages": self.pages, "page_bytes": self.page_bytes,
        }
        doc["tokens" if self.tokens is not None else "keys"] = (
            self.tokens if self.tokens is not None else self.keys
        )
        return doc


def encode_put_prefix(header: PutHeader) -> bytes:
    """Prefix + JSON header: everything of a put body before its token ids."""
    text = json.dumps(header.to_doc(), separators=(",", ":")).encode()
    return PREFIX.pack(PUT_MAGIC, VERSION, len(text)) + text


def decode_prefix(data: bytes | bytearray | memoryview, magic: bytes) -> int:
    """The header length a body's first :data:`PREFIX` bytes announce."""
    if len(data) < PREFIX.size:
        raise InvalidInput(f"body: {len(data)} bytes, shorter than the {PREFIX.size}-byte prefix")
    got, version, n = PREFIX.unpack_from(data)
    if got != magic:
        raise InvalidInput(f"body.magic: expected {magic!r}, got {bytes(got)!r}")
    if version != VERSION:
        raise InvalidInput(f"body.version: this server speaks version {VERSION}, got {version}")
    if n == 0 or n > MAX_HEADER_BYTES:
        raise InvalidInput(f"body.header_length: must be in [1, {MAX_HEADER_BYTES}], got {n}")
    return int(n)


def _json_object(data: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"{what}: not UTF-8 JSON ({exc})") from None
    except RecursionError:  # a header of nested brackets: the parser's depth limit
        raise InvalidInput(f"{what}: JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _layout_id(doc: dict[str, Any]) -> bytes:
    lid = doc.get("layout_id")
    try:
        layout_id = bytes.fromhex(lid) if isinstance(lid, str) else b""
    except ValueError:
        layout_id = b""
    if len(layout_id) != LAYOUT_ID_BYTES:
        raise InvalidInput(f"header.layout_id: expected {LAYOUT_ID_BYTES} bytes as hex, got {lid!r}")
    return layout_id


def _scope(doc: dict[str, Any]) -> dict[str, Any]:
    scope = doc.get("scope") or {}
    if not isinstance(scope, dict) or set(scope) - {"tenant", "cache_salt", "lora"}:
        raise InvalidInput("header.scope: expected {tenant, cache_salt, lora} strings")
    return scope


def decode_put_header(data: bytes | bytearray | memoryview) -> PutHeader:
    """Validate a put body's JSON header (every field; unknown fields are refused)."""
    doc = _json_object(data, "header")
    known = {"kind", "layout_id", "scope", "group", "first_page", "shard", "at", "tokens",
             "keys", "pages", "page_bytes"}
    extra = sorted(set(doc) - known)
    if extra:
        raise InvalidInput(f"header.{extra[0]}: not a put header field")
    try:
        kind = PutKind(doc.get("kind"))
    except ValueError:
        raise InvalidInput(f"header.kind: expected 'pages' or 'state', got {doc.get('kind')!r}") from None
    layout_id = _layout_id(doc)
    scope = _scope(doc)
    tokens = _opt_int(doc, "tokens")
    keys = _opt_int(doc, "keys")
    if (tokens is None) == (keys is None):
        raise InvalidInput("header.tokens: give either tokens or keys (a count), not both or neither")
    pages = _int(doc, "pages")
    page_bytes = _int(doc, "page_bytes", lo=1)
    for name, v in (("tokens", tokens), ("keys", keys), ("pages", pages)):
        if v is not None and v > MAX_COUNT:
            raise InvalidInput(f"header.{name}: at most {MAX_COUNT}, got {v}")
    if kind is PutKind.STATE and pages != 1:
        raise InvalidInput(f"header.pages: a state put carries one snapshot, got {pages}")
    return PutHeader(
        kind, layout_id, _str(scope, "tenant"), _str(scope, "cache_salt"), _str(scope, "lora"),
        _int(doc, "group"), _opt_int(doc, "first_page") or 0,
        _opt_int(doc, "shard"), _opt_int(doc, "at", lo=1),
        tokens, keys, pages, page_bytes,
    )


@dataclass(frozen=True, slots=True)
class MatchHeader:
    """What a match body declares before its token ids."""

    layout_id: bytes
    tenant: str
    cache_salt: str
    lora: str
    shard: int | None
    tokens: int  # count of int32 tokens that follow


def encode_match(layout_id: bytes, scope: dict[str, str], shard: int | None, tokens: bytes) -> bytes:
    """A whole match body: prefix, header, ``tokens`` (int32 little-endian ids)."""
    doc = {"layout_id": layout_id.hex(), "scope": scope, "shard": shard, "tokens": len(tokens) // TOKEN_BYTES}
    text = json.dumps(doc, separators=(",", ":")).encode()
    return b"".join((PREFIX.pack(MATCH_MAGIC, VERSION, len(text)), text, tokens))


def decode_match(data: bytes) -> tuple[MatchHeader, bytes]:
    """A match body's header and its token bytes, every field and the length checked."""
    n = decode_prefix(data, MATCH_MAGIC)
    if len(data) < PREFIX.size + n:
        raise InvalidInput(f"body: {len(data)} bytes, shorter than its {n}-byte header says")
    doc = _json_object(memoryview(data)[PREFIX.size : PREFIX.size + n], "header")
    extra = sorted(set(doc) - {"layout_id", "scope", "shard", "tokens"})
    if extra:
        raise InvalidInput(f"header.{extra[0]}: not a match header field")
    layout_id = _layout_id(doc)
    scope = _scope(doc)
    count = _int(doc, "tokens")
    if count > MAX_COUNT:
        raise InvalidInput(f"header.tokens: at most {MAX_COUNT}, got {count}")
    tokens = data[PREFIX.size + n :]
    if len(tokens) != count * TOKEN_BYTES:
        raise InvalidInput(f"body: {len(tokens)} bytes of token ids, the header says {count} tokens "
                           f"({count * TOKEN_BYTES} bytes)")
    header = MatchHeader(layout_id, _str(scope, "tenant"), _str(scope, "cache_salt"), _str(scope, "lora"),
                         _opt_int(doc, "shard"), count)
    return header, tokens


@dataclass(frozen=True, slots=True)
class StreamRow:
    """One planned row of a fetch stream."""

    position: int  # index into the fetch's plan (what an acknowledgement names)
    group: int
    slot: int  # where it goes in the caller's output buffers of that group
    size: int


def encode_fetch_prefix(fetch_id: str, rows: list[StreamRow], stream: str) -> bytes:
    doc = {"fetch_id": fetch_id, "stream": stream,
           "rows": [[r.position, r.group, r.slot, r.size] for r in rows]}
    text = json.dumps(doc, separators=(",", ":")).encode()
    return PREFIX.pack(FETCH_MAGIC, VERSION, len(text)) + text


def decode_fetch_header(data: bytes | bytearray | memoryview) -> tuple[str, str, list[StreamRow]]:
    """The fetch id, stream id and planned rows of a fetch stream's header."""
    doc = _json_object(data, "stream.header")
    fid = doc.get("fetch_id")
    if not isinstance(fid, str) or not fid:
        raise InvalidInput(f"stream.fetch_id: expected a non-empty string, got {fid!r}")
    sid = doc.get("stream")
    if not isinstance(sid, str) or not sid:
        raise InvalidInput(f"stream.stream: expected a non-empty string, got {sid!r}")
    raw = doc.get("rows")
    if not isinstance(raw, list):
        raise InvalidInput("stream.rows: expected a list")
    rows: list[StreamRow] = []
    for i, r in enumerate(raw):
        if (not isinstance(r, list) or len(r) != 4
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in r)):
            raise InvalidInput(f"stream.rows[{i}]: expected [position, group, slot, size] >= 0")
        rows.append(StreamRow(*r))
    return fid, sid, rows


def fetch_stream_bytes(prefix_len: int, rows: list[StreamRow]) -> int:
    """The content-length of a stream: prefix, every row framed whole, the END frame."""
    return prefix_len + sum(FRAME.size + r.size for r in rows) + FRAME.size


def encode_frame(kind: FrameKind, position: int, length: int) -> bytes:
    return FRAME.pack(kind, position, length)


def decode_frame(data: bytes | bytearray | memoryview) -> tuple[FrameKind, int, int]:
    """``(kind, position, length)`` of a 16-byte frame header."""
    if len(data) != FRAME.size:
        raise InvalidInput(f"stream.frame: expected {FRAME.size} bytes, got {len(data)}")
    kind, position, length = FRAME.unpack(data)
    try:
        return FrameKind(kind), int(position), int(length)
    except ValueError:
        raise InvalidInput(f"stream.frame.kind: unknown frame kind {kind}") from None
