"""Compact, validated column forms for the bulky parts of :mod:`kvbank.wire.forms` documents.

A 64-row lease listed every buffer region of every row (~288 KB of JSON for 64 × 64
regions) and a 1,000-page match one hex string and one tier name per page; encoding and
decoding those dominated the service's control calls. These helpers write the same
information once per distinct value and per column:

- :func:`names_blob` / :func:`read_names` — row names as one base64 string of the names
  concatenated (every row name is 54 bytes, so the split is implied, and base64 of a
  multiple of 3 bytes has no padding: one canonical form).
- :func:`tiers_column` / :func:`read_tiers` — per group, one character per page: the
  index of its tier in a ``tier_names`` list given once, or ``.`` for a miss.
- :func:`read_ints` — a list of non-negative integers, checked in C-speed passes.
- :func:`rows_columns` / :func:`read_rows` — lease rows as columns: names (a blob),
  ``present`` and ``state`` (one character per row; ``state`` indexes a ``delivery`` list
  of enum names given once), ``shape`` (per row, an index into ``shapes``, the distinct
  region lists, each written once), ``at`` (per row, ``null``, a host slot
  ``[segment index, offset, size]`` into ``segments``, or a device location object).

Every reader takes untrusted JSON values and raises :class:`~kvbank.errors.InvalidInput`
whose field is the document path of the fault; nothing else escapes. Pure functions,
no state.
"""

from __future__ import annotations

import base64
import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from kvbank.errors import InvalidInput
from kvbank.keys import ROW_NAME_BYTES, sized_bytes
from kvbank.lender.base import (
    Delivery,
    DeviceLocation,
    HostLocation,
    LeaseRow,
    Location,
    Region,
    lease_rows,
)
from kvbank.lender.resume import ResumeBound, picked
from kvbank.results import Match
from kvbank.tiers.base import TierKind

T = TypeVar("T")
MISS = "."  # a page no tier holds, in a tiers column
_DIGITS = "0123456789"
ROWS_FIELDS = ("names", "present", "delivery", "state", "shapes", "shape", "segments", "at")


def _fail(path: str, message: str) -> NoReturn:
    raise InvalidInput(f"{path}: {message}", field=path)


# ---- names ---------------------------------------------------------------------------------


def names_blob(names: Sequence[bytes]) -> str:
    return base64.b64encode(b"".join(names)).decode("ascii")


def read_names(doc: object, path: str) -> tuple[bytes, ...]:
    """The row names of a :func:`names_blob` string (standard base64 of the names
    concatenated; 54 bytes is a multiple of 3, so there is never padding)."""
    if not isinstance(doc, str) or not doc.isascii():
        _fail(path, "expected base64 of concatenated row names")
    try:
        raw = base64.b64decode(doc, validate=True)
    except ValueError:
        _fail(path, "expected base64 of concatenated row names")
    if len(raw) % ROW_NAME_BYTES or base64.b64encode(raw) != doc.encode("ascii"):
        _fail(path, f"{len(raw)} bytes, not a whole number of {ROW_NAME_BYTES}-byte row names")
    return split(raw, ROW_NAME_BYTES)


@functools.lru_cache(maxsize=64)
def _splitter(size: int, n: int) -> struct.Struct:
    return struct.Struct(f"{size}s" * n)


def split(raw: bytes, size: int) -> tuple[bytes, ...]:
    """``raw`` cut into ``size``-byte pieces (its length a multiple of ``size``): one C
    call for the common counts (7x faster than slicing 1,000 names in a loop)."""
    n = len(raw) // size
    if n > 4096:
        return tuple(raw[i : i + size] for i in range(0, len(raw), size))
    return _splitter(size, n).unpack(raw)


_NS, _KEY = 16, 32  # a row name: namespace + page key + tail (group, shard count, shard index)


def chain_names(names: Sequence[Sequence[bytes]]) -> dict[str, Any] | None:
    """A Match's names in chain form, when every group names the same page keys under
    one namespace with one tail per group (what a match builds): ``{"ns", "keys",
    "tails"}`` — the keys once instead of once per group, 32 bytes a page instead of 54.
    None when the names do not have that shape (the per-group blobs are written then)."""
    if not names or not names[0]:
        return None
    n = len(names[0])
    # Each group as an [n, 54] byte array: its namespace and tail columns must be one
    # value each and its key column the first group's (numpy passes, not a name at a time).
    cols = []
    for g in names:
        if len(g) != n or not sized_bytes(g, ROW_NAME_BYTES):
            return None
        cols.append(np.frombuffer(b"".join(g), np.uint8).reshape(n, ROW_NAME_BYTES))
    first = cols[0]
    ns, keys = first[0, :_NS], first[:, _NS : _NS + _KEY]
    tails: list[str] = []
    for c in cols:
        tail = c[0, _NS + _KEY :]
        if not ((c[:, :_NS] == ns).all() and (c[:, _NS + _KEY :] == tail).all()
                and (c is first or (c[:, _NS : _NS + _KEY] == keys).all())):
            return None
        tails.append(tail.tobytes().hex())
    return {"ns": ns.tobytes().hex(), "keys": base64.b64encode(keys.tobytes()).decode("ascii"), "tails": tails}


def read_chain_names(doc: object, path: str) -> tuple[tuple[bytes, ...], ...]:
    """The names of a :func:`chain_names` object, or of a list of per-group blobs."""
    if isinstance(doc, list):
        return groups(doc, path, read_names)
    if not isinstance(doc, dict) or set(doc) != {"ns", "keys", "tails"}:
        _fail(path, "expected a list of name blobs or {ns, keys, tails}")
    tail_len = ROW_NAME_BYTES - _NS - _KEY
    ns = _hexed(doc["ns"], f"{path}.ns", _NS)
    tails = doc["tails"]
    if not isinstance(tails, list) or not tails:
        _fail(f"{path}.tails", "expected a non-empty list (one tail per group)")
    tail_bytes = [_hexed(t, f"{path}.tails[{g}]", tail_len) for g, t in enumerate(tails)]
    raw_doc = doc["keys"]
    try:
        if not isinstance(raw_doc, str) or not raw_doc.isascii():
            raise ValueError
        raw = base64.b64decode(raw_doc, validate=True)
    except ValueError:
        _fail(f"{path}.keys", "expected base64 of concatenated 32-byte page keys")
    if not raw or len(raw) % _KEY or base64.b64encode(raw) != raw_doc.encode("ascii"):
        _fail(f"{path}.keys", f"{len(raw)} bytes, not a non-zero whole number of {_KEY}-byte page keys")
    keys = np.frombuffer(raw, np.uint8).reshape(-1, _KEY)
    built = np.empty((len(keys), ROW_NAME_BYTES), np.uint8)
    built[:, :_NS] = np.frombuffer(ns, np.uint8)
    built[:, _NS : _NS + _KEY] = keys
    out = []
    for t in tail_bytes:
        built[:, _NS + _KEY :] = np.frombuffer(t, np.uint8)
        out.append(split(built.tobytes(), ROW_NAME_BYTES))
    return tuple(out)


def _hexed(doc: object, path: str, nbytes: int) -> bytes:
    try:
        if not isinstance(doc, str):
            raise ValueError
        out = bytes.fromhex(doc)
    except ValueError:
        _fail(path, f"expected {nbytes} bytes as hex")
    if len(out) != nbytes or out.hex() != doc:
        _fail(path, f"expected {nbytes} bytes as lowercase hex")
    return out


def implied_rows(b: ResumeBound, names: Sequence[Sequence[bytes]]) -> bool:
    """Whether a bound's rows are exactly ``names[g][j]`` for its pages (then a Match's
    form leaves them out: the reader rebuilds them from the names)."""
    return len(b.rows) == len(b.pages) == len(names) and all(
        tuple(r) == picked(n, p) for r, p, n in zip(b.rows, b.pages, names, strict=True))


def rows_from(pages: Sequence[Sequence[int]], names: Sequence[Sequence[bytes]],
              path: str) -> tuple[tuple[bytes, ...], ...]:
    """The rows a Match's bound needs, rebuilt from its names (see :func:`implied_rows`)."""
    if len(pages) != len(names):
        _fail(f"{path}.pages", f"expected {len(names)} groups, got {len(pages)}")
    out = []
    for g, (p, n) in enumerate(zip(pages, names, strict=True)):
        if p and (p[-1] >= len(n) or list(p) != sorted(set(p))):
            _fail(f"{path}.pages[{g}]", f"expected ascending key indices below {len(n)}")
        out.append(picked(n, p))
    return tuple(out)


# ---- integers ------------------------------------------------------------------------------


def read_ints(doc: object, path: str) -> tuple[int, ...]:
    """A list of non-negative integers (``true`` is not one)."""
    if not isinstance(doc, list):
        _fail(path, f"expected a list, got {type(doc).__name__}")
    if set(map(type, doc)) <= {int} and (not doc or min(doc) >= 0):  # C-speed passes
        return tuple(doc)
    i = next(i for i, x in enumerate(doc) if type(x) is not int or x < 0)
    _fail(f"{path}[{i}]", f"expected a non-negative integer, got {doc[i]!r}")


def groups(doc: object, path: str, read: Callable[[object, str], T]) -> tuple[T, ...]:
    """One ``read`` value per group of a list."""
    if not isinstance(doc, list):
        _fail(path, f"expected a list (one entry per group), got {type(doc).__name__}")
    return tuple(read(v, f"{path}[{g}]") for g, v in enumerate(doc))


def _index(doc: object, path: str, n: int, what: str) -> int:
    if type(doc) is not int or not 0 <= doc < n:
        _fail(path, f"expected an index into {what} (0..{n - 1}), got {doc!r}")
    return doc


# ---- tiers ---------------------------------------------------------------------------------


def tiers_column(tiers: Sequence[Sequence[TierKind | None]]) -> tuple[list[str], list[str]]:
    """``(tier_names, per-group strings)`` for a Match's tiers."""
    # By identity: an enum's __hash__ is Python code, and a match has a tier per page.
    seen: set[int] = set()
    for g in tiers:
        seen.update(map(id, g))
    used = [t for t in TierKind if id(t) in seen]
    code = {id(t): _DIGITS[i] for i, t in enumerate(used)}
    code[id(None)] = MISS
    return [t.name for t in used], ["".join(map(code.__getitem__, map(id, g))) for g in tiers]


def read_tiers(names_doc: object, doc: object, path: str,
               names_path: str) -> tuple[tuple[TierKind | None, ...], ...]:
    if not isinstance(names_doc, list) or len(names_doc) > len(TierKind):
        _fail(names_path, f"expected a list of at most {len(TierKind)} tier names")
    kinds: list[TierKind] = []
    for i, n in enumerate(names_doc):
        if type(n) is not str or n not in TierKind.__members__ or TierKind[n] in kinds:
            _fail(f"{names_path}[{i}]", f"expected a distinct one of {list(TierKind.__members__)}, got {n!r}")
        kinds.append(TierKind[n])
    lut: dict[str, TierKind | None] = {_DIGITS[i]: k for i, k in enumerate(kinds)}
    lut[MISS] = None
    if not isinstance(doc, list):
        _fail(path, f"expected a list, got {type(doc).__name__}")
    out = []
    for g, s in enumerate(doc):
        if type(s) is not str or not set(s) <= lut.keys():
            _fail(f"{path}[{g}]", f"expected a string of {sorted(lut)} (one character per page)")
        out.append(tuple(map(lut.__getitem__, s)))
    return tuple(out)


# ---- match and resume bound ---------------------------------------------------------------


def bound_doc(b: ResumeBound, reason: Any, rows: bool = True) -> dict[str, Any]:
    """A ResumeBound's form (``reason`` already encoded; its rows ``null`` without ``rows``)."""
    return {"tokens": b.tokens, "prompt_tokens": b.prompt_tokens, "tokens_per_page": b.tokens_per_page,
            "keyed_pages": b.keyed_pages, "matched_tokens": b.matched_tokens,
            "pages": [list(p) for p in b.pages], "rows": [names_blob(r) for r in b.rows] if rows else None,
            "reason": reason, "blocking_group": b.blocking_group}


def match_doc(m: Match, scope: Any, reason: Any) -> dict[str, Any]:
    """A Match's form (``scope`` and its bound's ``reason`` already encoded). Its names in
    chain form where they have that shape, and its bound's rows left out (``null``) where
    they are implied by its pages and names: together 3x smaller for a one-group match."""
    tier_names, tiers = tiers_column(m.tiers)
    names: Any = chain_names(m.names)
    if names is None:
        names = [names_blob(n) for n in m.names]
    resume = bound_doc(m.resume, reason, rows=not implied_rows(m.resume, m.names))
    return {"layout_id": m.layout_id.hex(), "scope": scope, "prompt_tokens": m.prompt_tokens,
            "resume": resume, "names": names, "tier_names": tier_names,
            "tiers": tiers, "boundaries": list(m.boundaries), "via": [list(v) for v in m.via]}


# ---- lease rows ----------------------------------------------------------------------------


def rows_columns(rows: Sequence[LeaseRow], location: Callable[[Location], Any]) -> dict[str, Any]:
    """A lease's rows as columns. ``location`` writes a device location's object form."""
    deliveries = list(dict.fromkeys(r.delivery for r in rows))
    code = {d: _DIGITS[i] for i, d in enumerate(deliveries)}
    shapes: dict[tuple[Region, ...], int] = {}
    # Rows of one group share one regions tuple: look it up by identity first, since
    # hashing 64 regions per row was most of a 64-row lease's encoding time.
    seen: dict[int, int] = {}
    shape: list[int] = []
    segments: dict[str, int] = {}
    at: list[Any] = []
    for r in rows:
        k = seen.get(id(r.regions))
        if k is None:
            k = seen[id(r.regions)] = shapes.setdefault(r.regions, len(shapes))
        shape.append(k)
        loc = r.location
        if loc is None:
            at.append(None)
        elif isinstance(loc, HostLocation):
            at.append([segments.setdefault(loc.segment, len(segments)), loc.offset, loc.size])
        else:
            at.append(location(loc))
    return {
        "names": names_blob([r.name for r in rows]),
        "present": "".join("1" if r.present else "0" for r in rows),
        "delivery": [d.name for d in deliveries],
        "state": "".join(code[r.delivery] for r in rows),
        "shape": shape,
        "shapes": [[[g.layer, g.role, g.offset, g.nbytes] for g in s] for s in shapes],
        "segments": list(segments),
        "at": at,
    }


def _region(doc: object, path: str) -> Region:
    if (not isinstance(doc, list) or len(doc) != 4 or type(doc[1]) is not str
            or any(type(doc[i]) is not int or doc[i] < 0 for i in (0, 2, 3))):
        _fail(path, "expected [layer, role, offset, nbytes] (non-negative integers, role a string)")
    return Region(doc[0], doc[1], doc[2], doc[3])


def read_rows(doc: object, path: str, device: Callable[[object, str], DeviceLocation]) -> tuple[LeaseRow, ...]:
    """The lease rows of a :func:`rows_columns` object. ``device`` reads a device location."""
    if not isinstance(doc, dict):
        _fail(path, f"expected an object (lease rows as columns), got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(ROWS_FIELDS), key=str)
    if unknown:
        _fail(f"{path}.{unknown[0]}", f"unknown field of lease rows (allowed: {list(ROWS_FIELDS)})")
    missing = [k for k in ROWS_FIELDS if k not in doc]
    if missing:
        _fail(f"{path}.{missing[0]}", "missing field of lease rows")
    names = read_names(doc["names"], f"{path}.names")
    n = len(names)

    def column(key: str, kind: type) -> Any:
        v = doc[key]
        if not isinstance(v, (str, list)) or type(v) is not kind or len(v) != n:
            _fail(f"{path}.{key}", f"expected a {kind.__name__} with one entry per row ({n})")
        return v

    present = column("present", str)
    if not set(present) <= {"0", "1"}:
        _fail(f"{path}.present", "expected one '0' or '1' per row")
    kinds = doc["delivery"]
    if not isinstance(kinds, list) or len(kinds) > len(Delivery):
        _fail(f"{path}.delivery", f"expected a list of at most {len(Delivery)} delivery states")
    lut: dict[str, Delivery] = {}
    for i, k in enumerate(kinds):
        if type(k) is not str or k not in Delivery.__members__:
            _fail(f"{path}.delivery[{i}]", f"expected one of {list(Delivery.__members__)}, got {k!r}")
        lut[_DIGITS[i]] = Delivery[k]
    state = column("state", str)
    if not set(state) <= lut.keys():
        _fail(f"{path}.state", f"expected one character of {sorted(lut)} per row")
    shapes_doc = doc["shapes"]
    if not isinstance(shapes_doc, list):
        _fail(f"{path}.shapes", "expected a list of region lists")
    shapes: list[tuple[Region, ...]] = []
    for i, s in enumerate(shapes_doc):
        if not isinstance(s, list):
            _fail(f"{path}.shapes[{i}]", "expected a list of regions")
        shapes.append(tuple(_region(g, f"{path}.shapes[{i}][{j}]") for j, g in enumerate(s)))
    shape = column("shape", list)
    for i, k in enumerate(shape):
        _index(k, f"{path}.shape[{i}]", len(shapes), "shapes")
    segments = doc["segments"]
    if not isinstance(segments, list) or any(type(s) is not str for s in segments):
        _fail(f"{path}.segments", "expected a list of segment names")
    at: list[Location | None] = []
    for i, a in enumerate(column("at", list)):
        p = f"{path}.at[{i}]"
        if a is None:
            at.append(None)
        elif isinstance(a, list):
            if (len(a) != 3 or any(type(x) is not int or x < 0 for x in a)):
                _fail(p, "expected [segment index, offset, size] (non-negative integers)")
            at.append(HostLocation(segments[_index(a[0], p, len(segments), "segments")], a[1], a[2]))
        else:
            at.append(device(a, p))
    return lease_rows(names, map("1".__eq__, present), at, map(shapes.__getitem__, shape),
                      map(lut.__getitem__, state)) if n else ()


__all__ = [
    "MISS",
    "bound_doc",
    "chain_names",
    "groups",
    "implied_rows",
    "match_doc",
    "names_blob",
    "read_chain_names",
    "read_ints",
    "read_names",
    "read_rows",
    "read_tiers",
    "rows_columns",
    "rows_from",
    "tiers_column",
]
