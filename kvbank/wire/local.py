"""The binary frames of the node's local channel (a Unix socket beside the HTTP port).

A **frame** is a fixed 12-byte header and a body of typed columns::

    header   "KL" | version u8 | kind u8 | op u16 | columns u16 | body length u32
    body     columns × (dtype u8 | 3 zero bytes | length u32), then each column's
             bytes, each padded with zeros to a multiple of 8

``kind`` is REQUEST, OK (an answer), ERROR (a typed error: three text columns, the
same ``type``, ``field`` and ``message`` as HTTP's ``{type, field, message}``, raised as
the same :class:`~kvbank.errors.KvbankError` class by :func:`raise_error`) or ONEWAY (a
request no frame answers: a lent fetch's acknowledgement, where the client builds its
result itself; an error in one is logged by the node). A column is
raw bytes, UTF-8 text or a little-endian numpy array (``int8`` .. ``float64``): row names
go as one blob of 32-byte names, tiers, states and slot offsets as arrays, so neither side
builds a Python object per row to cross the socket. Every call's columns are positional
(:mod:`kvbank.service.local` and :mod:`kvbank.client.local` name them).

:func:`decode_body` takes untrusted bytes and raises :class:`~kvbank.errors.InvalidInput`
naming what is wrong; nothing else escapes (``tests/wire/test_local.py``). A frame
declaring more than ``MAX_FRAME_BYTES`` is refused from its header alone, before its body
is read.

The match form (:func:`match_columns` / :func:`match_from`) carries a
:class:`~kvbank.results.Match` as 15 columns; a fetch result and a commit result have
theirs. Lifecycle of one call: the client sends a REQUEST frame; the node answers exactly
one OK or ERROR frame on the same connection, in order. The node reads a connection's
frames in order and applies each before it reads the next, so a ONEWAY frame is applied
before any later call of that connection is answered (:data:`Op.SYNC` is such a call
that does nothing else), and before the node sees that connection's end.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from itertools import chain, groupby
from typing import Any

import numpy as np

from kvbank.errors import InvalidInput, KvbankError
from kvbank.keys import PAGE_KEY_BYTES, ROW_NAME_BYTES, Scope
from kvbank.lender.base import CommitResult
from kvbank.lender.resume import Obstacle, ResumeBound
from kvbank.results import FetchResult, Match, Presence
from kvbank.tiers.base import TierKind
from kvbank.wire.columns import split

MAGIC = b"KL"
VERSION = 1
HEADER = struct.Struct("<2sBBHHI")  # magic, version, kind, op, columns, body length
COLUMN = struct.Struct("<B3xI")  # dtype, length in bytes
MAX_COLUMNS = 64
MAX_FRAME_BYTES = 64 << 20  # a frame's body; a longer one is refused from its header
NAME_BYTES = ROW_NAME_BYTES  # a row name
KEY_BYTES = PAGE_KEY_BYTES  # a page key (an engine's keys of this length go as they are)


class Kind(enum.IntEnum):
    REQUEST = 0
    OK = 1
    ERROR = 2
    ONEWAY = 3  # a request nothing answers (only the ops of ONEWAY_OPS)


class Op(enum.IntEnum):
    """The calls of the local channel."""

    HELLO = 1  # token -> tenant bound, the host segment's fd (SCM_RIGHTS) where allowed
    MATCH = 2  # a prompt (tokens or keys) -> a Match
    FETCH_PREFIX = 3  # a prompt -> a Match, a fetch id, its rows, their READ lease's slots and checksums
    ACK = 4  # fetch id, lease id, positions read, positions whose copy failed its checksum -> a FetchResult
    LEND = 5  # row names -> a Lease (its wire form)
    CHECK = 6  # lease id -> nothing (LeaseExpired if it ended)
    RELEASE = 7  # lease id -> whether it was live
    PUT_RESERVE = 8  # a put head -> row names, a WRITE lease's slots (or fallback)
    COMMIT = 9  # lease id, names that arrived, [their checksums: FEATURE_COMMIT_SUMS] -> a CommitResult
    PRESENCE = 10  # a prompt, shards -> a Presence
    FETCH = 11  # a Match -> a fetch id, its rows, their READ lease's slots and checksums
    SYNC = 12  # nothing -> nothing, answered once every earlier frame of the connection was applied
    LOAD = 13  # a /v1/engine/load body (JSON text) -> its answer (JSON text): a load's plan, its READ lease
    LOADED = 14  # a /v1/engine/loaded body (JSON text) -> its answer (JSON text): the FetchResult
    LOAD_KEYS = 15  # a prompt, [ttl_s] -> a Match, then its load's plan and READ lease (binary columns)


ONEWAY_OPS = frozenset({Op.ACK, Op.LOADED})  # the ops a ONEWAY frame may carry
# what a node's HELLO answer says it takes (its second column, a bit mask; an older node
# sends none): FEATURE_ONEWAY_ACK, acknowledgements as ONEWAY frames and SYNC;
# FEATURE_ENGINE_LOAD, LOAD and LOADED (a paged engine's fetch_into); FEATURE_ONEWAY_LOADED,
# LOADED as a ONEWAY frame too; FEATURE_LOAD_KEYS, LOAD_KEYS; FEATURE_COMMIT_SUMS, a
# COMMIT's third column (each arrived row's checksum as the writer hashed its copy)
FEATURE_ONEWAY_ACK = 1
FEATURE_ENGINE_LOAD = 2
FEATURE_ONEWAY_LOADED = 4
FEATURE_LOAD_KEYS = 8  # LOAD_KEYS: a hit query and its load's lease in one call (Client.prepare_load)
FEATURE_COMMIT_SUMS = 16


# dtype codes: 0 raw bytes, 1 text, then numpy arrays
_BYTES, _TEXT = 0, 1
_DTYPES: tuple[np.dtype[Any], ...] = tuple(np.dtype(t) for t in ("<i1", "<u1", "<i4", "<i8", "<f8", "<u8"))
_CODE = {dt: i + 2 for i, dt in enumerate(_DTYPES)}

Column = bytes | str | np.ndarray[Any, Any]


def _pad(n: int) -> int:
    return -n % 8


def encode(kind: Kind, op: int, cols: Sequence[Column]) -> list[bytes | memoryview]:
    """A frame as buffers to ``sendmsg`` (no copy of a column's bytes)."""
    if len(cols) > MAX_COLUMNS:
        raise InvalidInput(f"frame: {len(cols)} columns, at most {MAX_COLUMNS}")
    descs = bytearray()
    parts: list[bytes | memoryview] = [b"", b""]
    body = 0
    for c in cols:
        if isinstance(c, str):
            raw: bytes | memoryview = c.encode("utf-8")
            code = _TEXT
        elif isinstance(c, (bytes, bytearray, memoryview)):
            raw, code = bytes(c) if isinstance(c, bytearray) else c, _BYTES
        elif isinstance(c, np.ndarray):
            arr = c if c.dtype in _CODE else c.astype("<i8")
            code = _CODE[arr.dtype]
            raw = np.ascontiguousarray(arr).data.cast("B")
        else:
            raise InvalidInput(f"frame: a column of type {type(c).__name__}")
        n = len(raw)
        descs += COLUMN.pack(code, n)
        parts.append(raw)
        pad = _pad(n)
        if pad:
            parts.append(b"\0" * pad)
        body += n + pad
    body += len(descs)
    if body > MAX_FRAME_BYTES:
        raise InvalidInput(f"frame: {body} bytes, over the {MAX_FRAME_BYTES}-byte limit")
    parts[0] = HEADER.pack(MAGIC, VERSION, int(kind), int(op), len(cols), body)
    parts[1] = bytes(descs)
    return parts


def encode_bytes(kind: Kind, op: int, cols: Sequence[Column]) -> bytes:
    return b"".join(encode(kind, op, cols))


def decode_header(data: bytes | bytearray | memoryview, limit: int = MAX_FRAME_BYTES) -> tuple[Kind, int, int, int]:
    """``(kind, op, columns, body length)`` of a frame header; refused before the body."""
    if len(data) != HEADER.size:
        raise InvalidInput(f"frame: a header is {HEADER.size} bytes, got {len(data)}", field="frame")
    magic, version, kind, op, ncols, body = HEADER.unpack(data)
    if magic != MAGIC:
        raise InvalidInput(f"frame: bad magic {bytes(magic)!r} (expected {MAGIC!r})", field="frame")
    if version != VERSION:
        raise InvalidInput(f"frame: version {version}, this end speaks {VERSION}", field="frame")
    if kind not in (0, 1, 2, 3):
        raise InvalidInput(f"frame: unknown kind {kind}", field="frame")
    if ncols > MAX_COLUMNS:
        raise InvalidInput(f"frame: {ncols} columns, at most {MAX_COLUMNS}", field="frame")
    if body > limit:
        raise InvalidInput(f"frame: a body of {body} bytes, over the {limit}-byte limit", field="frame")
    if body < ncols * COLUMN.size:
        raise InvalidInput(f"frame: a body of {body} bytes cannot describe {ncols} columns", field="frame")
    return Kind(kind), op, ncols, body


def decode_body(body: bytes | bytearray | memoryview, ncols: int) -> list[Column]:
    """The columns of a frame body (arrays are read-only views of ``body``)."""
    mv = memoryview(body).cast("B")
    at = ncols * COLUMN.size
    if len(mv) < at:
        raise InvalidInput(f"frame: truncated column table ({len(mv)} of {at} bytes)", field="frame")
    out: list[Column] = []
    for i in range(ncols):
        code, n = COLUMN.unpack_from(mv, i * COLUMN.size)
        end = at + n
        if end > len(mv):
            raise InvalidInput(f"frame: column {i} runs past the body ({end} > {len(mv)})", field="frame")
        raw = mv[at:end]
        if code == _BYTES:
            out.append(bytes(raw))
        elif code == _TEXT:
            try:
                out.append(str(raw, "utf-8"))
            except UnicodeDecodeError:
                raise InvalidInput(f"frame: column {i} is not UTF-8 text", field="frame") from None
        elif 2 <= code < 2 + len(_DTYPES):
            dt = _DTYPES[code - 2]
            if n % dt.itemsize:
                raise InvalidInput(f"frame: column {i} of {n} bytes is not whole {dt} items", field="frame")
            out.append(np.frombuffer(raw, dtype=dt))
        else:
            raise InvalidInput(f"frame: column {i} has unknown dtype code {code}", field="frame")
        at = end + _pad(n)
    if at != len(mv):
        raise InvalidInput(f"frame: {len(mv) - at} bytes after the last column", field="frame")
    return out


# ---- reading columns ---------------------------------------------------------------------


def take(cols: Sequence[Column], i: int, kind: type, what: str) -> Any:
    """Column ``i`` of ``cols``, which must be a ``kind`` (bytes, str or np.ndarray)."""
    if i >= len(cols):
        raise InvalidInput(f"{what}: missing (column {i} of {len(cols)})", field=what)
    c = cols[i]
    if not isinstance(c, kind):
        raise InvalidInput(f"{what}: expected {kind.__name__}, got {type(c).__name__}", field=what)
    return c


def ints(cols: Sequence[Column], i: int, what: str, n: int | None = None) -> np.ndarray[Any, Any]:
    arr: np.ndarray[Any, Any] = take(cols, i, np.ndarray, what)
    if arr.dtype.kind not in "iu":
        raise InvalidInput(f"{what}: expected integers, got {arr.dtype}", field=what)
    if n is not None and len(arr) != n:
        raise InvalidInput(f"{what}: expected {n} integers, got {len(arr)}", field=what)
    return arr


def names_of(blob: bytes, what: str, size: int = NAME_BYTES) -> tuple[bytes, ...]:
    """A blob of ``size``-byte names (row names by default) cut into names."""
    if len(blob) % size:
        raise InvalidInput(f"{what}: {len(blob)} bytes, not whole {size}-byte names", field=what)
    return split(blob, size) if blob else ()


def _cut(flat: np.ndarray[Any, Any], counts: np.ndarray[Any, Any], what: str) -> list[np.ndarray[Any, Any]]:
    if (counts < 0).any() or int(counts.sum()) != len(flat):
        raise InvalidInput(f"{what}: counts {counts.tolist()[:8]} do not cover {len(flat)} items", field=what)
    if len(counts) == 1:  # one group (most layouts): the column itself, no split
        return [flat]
    return np.split(flat, np.cumsum(counts)[:-1]) if len(counts) else []


def _blobs(blob: bytes, counts: np.ndarray[Any, Any], what: str,
           like: tuple[bytes, tuple[tuple[bytes, ...], ...]] | None = None) -> tuple[tuple[bytes, ...], ...]:
    """A blob of row names cut into groups of ``counts``. ``like``: another column's
    blob and groups (a match's names); a group whose bytes are the leading names of that
    column's same group is those names, not new objects (a resume bound's rows mostly are
    its match's first names: decoding them again cost as much as the names)."""
    if len(blob) % NAME_BYTES:
        raise InvalidInput(f"{what}: {len(blob)} bytes, not whole {NAME_BYTES}-byte names", field=what)
    ns = counts.tolist()
    if any(n < 0 for n in ns) or sum(ns) * NAME_BYTES != len(blob):
        raise InvalidInput(f"{what}: counts do not cover {len(blob) // NAME_BYTES} names", field=what)
    if like is not None and len(like[1]) == len(ns):
        known, groups = like
        out: list[tuple[bytes, ...]] = []
        at = base = 0
        for n, group in zip(ns, groups, strict=True):
            size = n * NAME_BYTES
            if n <= len(group) and blob[at : at + size] == known[base : base + size]:
                out.append(group[:n])
            else:
                out.append(names_of(blob[at : at + size], what))
            at += size
            base += len(group) * NAME_BYTES
        return tuple(out)
    names = names_of(blob, what)
    cut: list[tuple[bytes, ...]] = []
    at = 0
    for n in ns:
        cut.append(names[at : at + n])
        at += n
    return tuple(cut)


# ---- errors ------------------------------------------------------------------------------


def error_columns(exc: KvbankError) -> list[Column]:
    return [type(exc).__name__, exc.field or "", str(exc)]


def raise_error(cols: Sequence[Column]) -> KvbankError:
    """The exception an ERROR frame carries, of the same class HTTP's answer raises."""
    from kvbank.wire.forms import error_from_dict

    kind = take(cols, 0, str, "error.type")
    fld = take(cols, 1, str, "error.field")
    msg = take(cols, 2, str, "error.message")
    return error_from_dict({"type": kind, "field": fld or None, "message": msg})


# ---- the forms of results ----------------------------------------------------------------

_TIERS = tuple(TierKind)
# by identity: an enum member's own __hash__ is Python code, 1,000 lookups cost 0.1 ms
_TIER_ID = {id(t): i for i, t in enumerate(_TIERS)} | {id(None): -1}
_OBSTACLES = tuple(Obstacle)
_OBSTACLE_CODE = {o: i for i, o in enumerate(_OBSTACLES)}


def _i64(values: Any) -> np.ndarray[Any, Any]:
    return np.asarray(values, dtype="<i8")


def bound_columns(b: ResumeBound) -> list[Column]:
    """A ResumeBound as 5 columns (scalars, page counts, pages, row counts, rows)."""
    scalars = _i64([b.tokens, b.prompt_tokens, b.tokens_per_page, b.keyed_pages, b.matched_tokens,
                    -1 if b.reason is None else _OBSTACLE_CODE[b.reason],
                    -1 if b.blocking_group is None else b.blocking_group])
    pages = _i64([len(p) for p in b.pages])
    flat = np.fromiter(chain.from_iterable(b.pages), dtype="<i8")
    return [scalars, pages, flat, _i64([len(r) for r in b.rows]), b"".join(chain.from_iterable(b.rows))]


def bound_from(cols: Sequence[Column], at: int, what: str = "resume",
               names: tuple[bytes, tuple[tuple[bytes, ...], ...]] | None = None) -> ResumeBound:
    """``names``: its match's names (blob and groups), which its rows reuse (``_blobs``)."""
    s = ints(cols, at, f"{what}.scalars", 7).tolist()
    counts = ints(cols, at + 1, f"{what}.pages")
    pages = tuple(tuple(p.tolist()) for p in _cut(ints(cols, at + 2, f"{what}.pages"), counts, f"{what}.pages"))
    rows = _blobs(take(cols, at + 4, bytes, f"{what}.rows"), ints(cols, at + 3, f"{what}.rows"), f"{what}.rows",
                  names)
    if not -1 <= s[5] < len(_OBSTACLES):
        raise InvalidInput(f"{what}.reason: unknown code {s[5]}", field=f"{what}.reason")
    return ResumeBound(s[0], s[1], s[2], s[3], s[4], pages, rows,
                       None if s[5] < 0 else _OBSTACLES[s[5]], None if s[6] < 0 else s[6])


def _tiers_array(tiers: Sequence[Sequence[TierKind | None]]) -> np.ndarray[Any, Any]:
    """Each row's tier code (-1: a miss), run by run: a match's rows lie in long runs of
    one tier, and ``groupby`` walks them in C (per row in Python, 1,000 rows cost 0.1 ms)."""
    if len(tiers) == 1 and tiers[0] and tiers[0].count(tiers[0][0]) == len(tiers[0]):  # one run: counted in C
        return np.full(len(tiers[0]), _TIER_ID[id(tiers[0][0])], dtype="<i1")
    codes: list[int] = []
    lengths: list[int] = []
    for tier, run in groupby(chain.from_iterable(tiers)):
        codes.append(_TIER_ID[id(tier)])
        lengths.append(len(list(run)))
    return np.repeat(np.array(codes, dtype="<i1"), lengths)


def _tiers_from(arr: np.ndarray[Any, Any], counts: Sequence[int], what: str) -> tuple[tuple[TierKind | None, ...], ...]:
    if len(arr) != sum(counts) or (len(arr) and (int(arr.min()) < -1 or int(arr.max()) >= len(_TIERS))):
        raise InvalidInput(f"{what}: tier codes do not match the names", field=what)
    lut: list[TierKind | None] = [*_TIERS, None]  # -1 indexes the last
    flat: list[TierKind | None] = []
    if len(arr) < 256:  # a few rows: one lookup each costs less than finding the runs
        flat = list(map(lut.__getitem__, arr.tolist()))
    else:  # run by run, as they were written
        starts = [0, *(np.flatnonzero(arr[1:] != arr[:-1]) + 1).tolist(), len(arr)]
        for code, a, b in zip(arr[starts[:-1]].tolist(), starts, starts[1:], strict=False):  # one start more
            flat += [lut[code]] * (b - a)
    out: list[tuple[TierKind | None, ...]] = []
    at = 0
    for n in counts:
        out.append(tuple(flat[at : at + n]))
        at += n
    return tuple(out)


def match_columns(m: Match) -> list[Column]:
    """A Match as 16 columns."""
    s = m.scope
    return [m.layout_id, s.tenant, s.cache_salt, s.lora, _i64([m.prompt_tokens]),
            _i64([len(n) for n in m.names]), b"".join(chain.from_iterable(m.names)), _tiers_array(m.tiers),
            _i64(m.boundaries), _i64([len(v) for v in m.via]), _i64([x for v in m.via for x in v]),
            *bound_columns(m.resume)]


MATCH_COLUMNS = 16


def match_from(cols: Sequence[Column], at: int = 0) -> Match:
    lid = take(cols, at, bytes, "match.layout_id")
    scope = Scope(take(cols, at + 1, str, "match.scope.tenant"), take(cols, at + 2, str, "match.scope.cache_salt"),
                  take(cols, at + 3, str, "match.scope.lora"))
    prompt = int(ints(cols, at + 4, "match.prompt_tokens", 1)[0])
    counts = ints(cols, at + 5, "match.names")
    blob = take(cols, at + 6, bytes, "match.names")
    names = _blobs(blob, counts, "match.names")
    tiers = _tiers_from(ints(cols, at + 7, "match.tiers"), counts.tolist(), "match.tiers")
    bounds = tuple(ints(cols, at + 8, "match.boundaries").tolist())
    via = tuple(tuple(v.tolist()) for v in _cut(ints(cols, at + 10, "match.via"), ints(cols, at + 9, "match.via"),
                                                 "match.via"))
    resume = bound_from(cols, at + 11, "match.resume", (blob, names))
    return Match(lid, scope, prompt, resume, names, tiers, bounds, via)


def result_columns(r: FetchResult) -> list[Column]:
    """A FetchResult as 11 columns: 6, then its ResumeBound's 5 (docs/wire.md)."""
    return [r.fetch_id, _i64([r.nbytes, int(r.complete)]), _i64([len(d) for d in r.delivered]),
            _i64([i for d in r.delivered for i in d]), _i64([len(d) for d in r.missing]),
            _i64([i for d in r.missing for i in d]), *bound_columns(r.resume)]


def result_from(cols: Sequence[Column], at: int = 0) -> FetchResult:
    fid = take(cols, at, str, "result.fetch_id")
    nbytes, complete = ints(cols, at + 1, "result.scalars", 2).tolist()
    got = tuple(tuple(x.tolist()) for x in _cut(ints(cols, at + 3, "result.delivered"),
                                                ints(cols, at + 2, "result.delivered"), "result.delivered"))
    lost = tuple(tuple(x.tolist()) for x in _cut(ints(cols, at + 5, "result.missing"),
                                                 ints(cols, at + 4, "result.missing"), "result.missing"))
    return FetchResult(fid, got, lost, bound_from(cols, at + 6, "result.resume"), nbytes, bool(complete))


def commit_columns(r: CommitResult) -> list[Column]:
    return [r.lease_id, b"".join(r.committed), b"".join(r.discarded), b"".join(r.already_present)]


def commit_from(cols: Sequence[Column]) -> CommitResult:
    return CommitResult(take(cols, 0, str, "commit.lease_id"),
                        names_of(take(cols, 1, bytes, "commit.committed"), "commit.committed"),
                        names_of(take(cols, 2, bytes, "commit.discarded"), "commit.discarded"),
                        names_of(take(cols, 3, bytes, "commit.already_present"), "commit.already_present"))


def presence_columns(p: Presence) -> list[Column]:
    s = p.scope
    groups = [len(t) for t in p.tiers]
    pages = [len(g) for t in p.tiers for g in t]
    return [p.layout_id, s.tenant, s.cache_salt, s.lora, _i64([p.prompt_tokens, p.tokens]), _i64(p.shards),
            _i64(p.shard_tokens), _i64(groups), _i64(pages), _tiers_array([g for t in p.tiers for g in t])]


def presence_from(cols: Sequence[Column]) -> Presence:
    lid = take(cols, 0, bytes, "presence.layout_id")
    scope = Scope(take(cols, 1, str, "presence.scope.tenant"), take(cols, 2, str, "presence.scope.cache_salt"),
                  take(cols, 3, str, "presence.scope.lora"))
    prompt, tokens = ints(cols, 4, "presence.scalars", 2).tolist()
    shards = tuple(ints(cols, 5, "presence.shards").tolist())
    shard_tokens = tuple(ints(cols, 6, "presence.shard_tokens").tolist())
    groups = ints(cols, 7, "presence.groups").tolist()
    pages = ints(cols, 8, "presence.pages").tolist()
    if len(groups) != len(shards) or sum(groups) != len(pages) or any(g < 0 for g in groups):
        raise InvalidInput("presence.groups: do not match the shards", field="presence.groups")
    flat = _tiers_from(ints(cols, 9, "presence.tiers"), pages, "presence.tiers")
    tiers: list[tuple[tuple[TierKind | None, ...], ...]] = []
    at = 0
    for n in groups:
        tiers.append(flat[at : at + n])
        at += n
    return Presence(lid, scope, prompt, shards, tuple(tiers), shard_tokens, tokens)


__all__ = [
    "FEATURE_COMMIT_SUMS",
    "FEATURE_ENGINE_LOAD",
    "FEATURE_LOAD_KEYS",
    "FEATURE_ONEWAY_ACK",
    "FEATURE_ONEWAY_LOADED",
    "HEADER",
    "MAX_FRAME_BYTES",
    "ONEWAY_OPS",
    "Column",
    "Kind",
    "Op",
    "bound_columns",
    "bound_from",
    "commit_columns",
    "commit_from",
    "decode_body",
    "decode_header",
    "encode",
    "encode_bytes",
    "error_columns",
    "match_columns",
    "match_from",
    "presence_columns",
    "presence_from",
    "raise_error",
    "result_columns",
    "result_from",
]
