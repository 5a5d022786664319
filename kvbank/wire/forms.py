"""Validated JSON forms of the objects that cross a socket.

Primitives:

- :func:`to_dict` — an object of a wire type (:data:`WIRE_TYPES`) as a dict of JSON-safe
  values: bytes as lowercase hex, enums by name, tuples as lists, nested objects as dicts.
- :func:`from_dict` — ``from_dict(Match, doc)``: the inverse. It rejects a bad document
  (missing or unknown keys, wrong types, bad hex, a row name that is not 54 bytes,
  negative counts, non-finite numbers) with :class:`~kvbank.errors.InvalidInput` whose
  :attr:`~kvbank.errors.KvbankError.field` is the path of the fault, e.g.
  ``match.resume.rows[0]``. Nothing else escapes, whatever the document holds.
- :func:`to_json` / :func:`from_json` — the same through compact JSON text.
- :func:`error_to_dict` / :func:`error_from_dict` — ``{type, field, message}`` for a
  :class:`~kvbank.errors.KvbankError`, and back to an exception of the same class, so a
  service's client raises what :class:`~kvbank.Bank` raises.

One form per type, derived from its dataclass fields, with four exceptions:

- :class:`~kvbank.layout.PageLayout` uses the layout's own description
  (:meth:`~kvbank.layout.PageLayout.to_dict`) plus its ``layout_id``; reading it back
  checks that the id still matches, so two versions of the layout encoding never agree
  on a layout by accident.
- :class:`~kvbank.results.Match`, :class:`~kvbank.lender.resume.ResumeBound` and the rows
  of a :class:`~kvbank.lender.base.Lease` are written in columns
  (:mod:`kvbank.wire.columns`): row names as one base64 blob per group, tiers and
  delivery states as one character per row with their enum names given once, a lease's
  buffer regions once per page shape. Those dominated a service's control calls.
- :class:`~kvbank.lender.base.Lease` carries ``ttl_s``, the seconds left against the
  lender's clock (``now=``), never the lender's monotonic deadline, which means nothing on
  another host. The receiver rebuilds its own deadline (``now + ttl_s`` on its clock): it
  is later than the lender's by the transit time, so the lender's completion check
  (``Bank.check_live``) stays the authority on whether bytes read in place count.
- A :class:`~kvbank.keys.Scope` crosses as its three strings; the digest is recomputed.

A location (a lease row's or pool's) is a host slot or a device location; the form is
told apart by its keys (``segment`` or ``pool``). Every integer on the wire is a count,
size, offset or index, so every one must be non-negative. No pickle, no code-executing
form: ``from_dict`` builds only the classes listed here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import re
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from kvbank import errors as _errors
from kvbank.errors import InvalidInput, KvbankError
from kvbank.keys import ROW_NAME_BYTES, Scope
from kvbank.layout import PageLayout
from kvbank.lender.base import CommitResult, DeviceLocation, HostLocation, Lease, LeaseRow, Region
from kvbank.lender.ledger import FetchInfo
from kvbank.lender.resume import ResumeBound
from kvbank.results import (
    BankStats,
    Bound,
    EvictResult,
    FetchResult,
    Match,
    Presence,
    RowEvent,
    RowInfo,
    StoreHealth,
    StoreStats,
    TierHealth,
    TierStats,
)
from kvbank.wire import columns as cols

T = TypeVar("T")
Doc = dict[str, Any]  # a JSON object as json.loads returns it

LAYOUT_ID_BYTES = 32

# The classes from_dict builds. Anything else is refused, so a document can never name a
# type to construct.
WIRE_TYPES: tuple[type, ...] = (
    PageLayout, Scope, Match, Presence, ResumeBound, FetchResult, FetchInfo, Lease, LeaseRow,
    HostLocation, DeviceLocation, Region, CommitResult, BankStats, StoreStats, TierStats,
    StoreHealth, TierHealth, RowInfo, EvictResult, RowEvent, Bound,
)

# Byte fields with a fixed length, by (class, field): row names and layout ids. Other byte
# fields (a CUDA IPC handle) have no fixed length.
_BYTE_LENGTHS: Mapping[tuple[type, str], int] = {
    (Match, "layout_id"): LAYOUT_ID_BYTES,
    (Match, "names"): ROW_NAME_BYTES,
    (Presence, "layout_id"): LAYOUT_ID_BYTES,
    (FetchInfo, "layout_id"): LAYOUT_ID_BYTES,
    (ResumeBound, "rows"): ROW_NAME_BYTES,
    (LeaseRow, "name"): ROW_NAME_BYTES,
    (CommitResult, "committed"): ROW_NAME_BYTES,
    (CommitResult, "discarded"): ROW_NAME_BYTES,
    (CommitResult, "already_present"): ROW_NAME_BYTES,
    (RowInfo, "name"): ROW_NAME_BYTES,
    (EvictResult, "evicted"): ROW_NAME_BYTES,
    (EvictResult, "locked"): ROW_NAME_BYTES,
    (EvictResult, "missing"): ROW_NAME_BYTES,
    (EvictResult, "pinned"): ROW_NAME_BYTES,
}

_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_LEASE_CLOCK_FIELDS = ("expires_at", "expires_wall")


def from_hex(value: str, field: str, nbytes: int | None = None) -> bytes:
    """``bytes.fromhex(value)``, refused as :class:`InvalidInput` naming ``field`` when it
    is not hex or (with ``nbytes``) not that many bytes: a route's hex field."""
    try:
        out = bytes.fromhex(value)
    except ValueError:
        raise InvalidInput(f"{field}: not hex: {value[:80]!r}") from None
    if nbytes is not None and len(out) != nbytes:
        raise InvalidInput(f"{field}: expected {nbytes} bytes, got {len(out)}")
    return out


def _fail(path: str, message: str) -> NoReturn:
    raise InvalidInput(f"{path}: {message}", field=path)


def _root(cls: type) -> str:
    """``FetchResult`` -> ``fetch_result``: the path of a document's top level."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


# ---- encoding ------------------------------------------------------------------------------


def _enc(value: object, now: float) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return [_enc(v, now) for v in value]
    if isinstance(value, frozenset):  # a set crosses as a sorted list: one text per value
        return sorted(_enc(v, now) for v in value)
    if isinstance(value, PageLayout):
        return {**value.to_dict(), "layout_id": value.layout_id.hex()}
    if isinstance(value, Lease):
        doc = {f: _enc(getattr(value, f), now) for f in _init_fields(Lease)
               if f not in (*_LEASE_CLOCK_FIELDS, "rows")}
        doc["rows"] = cols.rows_columns(value.rows, lambda loc: _enc(loc, now))
        doc["ttl_s"] = max(0.0, value.expires_at - now)
        return doc
    if isinstance(value, (ResumeBound, Match)):
        return cols.bound_doc(value, _enc(value.reason, now)) if isinstance(value, ResumeBound) else \
            cols.match_doc(value, _enc(value.scope, now), _enc(value.resume.reason, now))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f: _enc(getattr(value, f), now) for f in _init_fields(type(value))}
    raise InvalidInput(f"value: {type(value).__name__} has no wire form")


def to_dict(obj: object, *, now: float | None = None) -> Doc:
    """``obj`` (one of :data:`WIRE_TYPES`) as a dict of JSON-safe values.

    ``now`` is the lender's clock reading for a :class:`Lease` (default
    ``time.monotonic()``, the lender's default clock); other types ignore it."""
    if type(obj) not in WIRE_TYPES:
        raise InvalidInput(f"obj: {type(obj).__name__} has no wire form")
    doc = _enc(obj, time.monotonic() if now is None else now)
    assert isinstance(doc, dict)  # every wire type is a dataclass: encoded as an object
    return doc


def to_json(obj: object, *, now: float | None = None) -> str:
    return json.dumps(to_dict(obj, now=now), separators=(",", ":"), allow_nan=False)


# ---- decoding ------------------------------------------------------------------------------


def _object(doc: object, cls: type, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        _fail(path, f"expected an object ({cls.__name__}), got {type(doc).__name__}")
    keys = set(doc)
    if any(not isinstance(k, str) for k in keys):
        _fail(path, "object keys must be strings")
    unknown = sorted(keys - set(allowed))
    if unknown:
        _fail(f"{path}.{unknown[0]}", f"unknown field of {cls.__name__} (allowed: {list(allowed)})")
    missing = [k for k in allowed if k not in keys]
    if missing:
        _fail(f"{path}.{missing[0]}", f"missing field of {cls.__name__}")
    return doc


def _build(cls: type[T], kwargs: dict[str, Any], path: str) -> T:
    """``cls(**kwargs)``; a constructor's own refusal is InvalidInput naming the path."""
    try:
        return cls(**kwargs)
    except KvbankError as exc:
        _refused(exc, cls, path)
    except (TypeError, ValueError) as exc:
        _fail(path, f"not a valid {cls.__name__}: {exc}")


def _refused(exc: KvbankError, cls: type, path: str) -> NoReturn:
    """Re-raise a constructor's refusal with the field's full document path."""
    inner, message = exc.field, str(exc)
    if not inner:
        _fail(path, message)
    message = message.removeprefix(f"{inner}: ")
    head, _, rest = inner.partition(".")
    if rest and head in (_root(cls), cls.__name__.lower()):  # "scope.tenant" inside a Scope
        inner = rest
    _fail(f"{path}.{inner}", message)


def _dataclass(cls: type[T], doc: object, path: str) -> T:
    names = _init_fields(cls)
    obj = _object(doc, cls, path, names)
    hints = _hints(cast(type, cls))  # type[T] is not Hashable to mypy; a class is
    kwargs = {
        n: _dec(hints[n], obj[n], f"{path}.{n}", _BYTE_LENGTHS.get((cls, n))) for n in names
    }
    return _build(cls, kwargs, path)


def _bytes(doc: object, path: str, nbytes: int | None) -> bytes:
    if not isinstance(doc, str) or not _HEX.fullmatch(doc):
        _fail(path, "expected lowercase hex (an even number of 0-9a-f digits)")
    raw = bytes.fromhex(doc)
    if nbytes is not None and len(raw) != nbytes:
        _fail(path, f"expected {nbytes} bytes, got {len(raw)}")
    return raw


def _union(args: tuple[Any, ...], doc: object, path: str, nbytes: int | None) -> Any:
    options = [a for a in args if a is not type(None)]
    if doc is None:
        if len(options) < len(args):
            return None
        _fail(path, "must not be null")
    if len(options) == 1:
        return _dec(options[0], doc, path, nbytes)
    # A union of dataclasses (a location): the member whose fields are the document's keys.
    if isinstance(doc, Mapping):
        for opt in options:
            if isinstance(opt, type) and dataclasses.is_dataclass(opt) and set(doc) == set(_init_fields(opt)):
                return _dec(opt, doc, path, nbytes)
    shown = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    _fail(path, f"expected {shown}")


def _dec(tp: Any, doc: object, path: str, nbytes: int | None = None) -> Any:
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _union(get_args(tp), doc, path, nbytes)
    if origin is tuple:
        args = get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"wire: unsupported tuple type {tp}")  # a bug here, not input
        if not isinstance(doc, list):
            _fail(path, f"expected a list, got {type(doc).__name__}")
        if args[0] is int:  # page indices: every row of a fetch result, checked in C passes
            return cols.read_ints(doc, path)
        return tuple(_dec(args[0], v, f"{path}[{i}]", nbytes) for i, v in enumerate(doc))
    if origin is frozenset:
        if not isinstance(doc, list):
            _fail(path, f"expected a list, got {type(doc).__name__}")
        (arg,) = get_args(tp)
        return frozenset(_dec(arg, v, f"{path}[{i}]", nbytes) for i, v in enumerate(doc))
    if tp is bool:
        if type(doc) is not bool:
            _fail(path, f"expected true or false, got {doc!r}")
        return doc
    if tp is int:
        if type(doc) is not int or doc < 0:
            _fail(path, f"expected a non-negative integer, got {doc!r}")
        return doc
    if tp is float:
        if type(doc) not in (int, float) or not math.isfinite(cast(float, doc)) or cast(float, doc) < 0:
            _fail(path, f"expected a finite non-negative number, got {doc!r}")
        return float(cast(float, doc))
    if tp is str:
        if type(doc) is not str:
            _fail(path, f"expected a string, got {type(doc).__name__}")
        return doc
    if tp is bytes:
        return _bytes(doc, path, nbytes)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if type(doc) is not str or doc not in tp.__members__:
            _fail(path, f"expected one of {list(tp.__members__)}, got {doc!r}")
        return tp[doc]
    if tp in _READERS:
        return _READERS[tp](doc, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, doc, path)
    raise TypeError(f"wire: no reader for {tp!r}")  # a bug here, not input


def _layout(doc: object, path: str) -> PageLayout:
    if not isinstance(doc, Mapping):
        _fail(path, f"expected an object (PageLayout), got {type(doc).__name__}")
    body = dict(doc)
    if "layout_id" not in body:
        _fail(f"{path}.layout_id", "missing field of PageLayout")
    want = _bytes(body.pop("layout_id"), f"{path}.layout_id", LAYOUT_ID_BYTES)
    try:
        layout = PageLayout.from_dict(body)
    except KvbankError as exc:
        _refused(exc, PageLayout, path)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        _fail(path, f"not a valid PageLayout: {exc}")
    if layout.layout_id != want:
        _fail(f"{path}.layout_id", f"{want.hex()} does not match the layout ({layout.layout_id.hex()}); "
              "a different layout encoding version?")
    return layout


def _device(doc: object, path: str) -> DeviceLocation:
    return cast(DeviceLocation, _dec(DeviceLocation, doc, path))


def _lease(doc: object, path: str, now: float | None = None) -> Lease:
    names = tuple(n for n in _init_fields(Lease) if n not in _LEASE_CLOCK_FIELDS)
    obj = _object(doc, Lease, path, (*names, "ttl_s"))
    hints = _hints(Lease)
    kwargs = {n: _dec(hints[n], obj[n], f"{path}.{n}") for n in names if n != "rows"}
    kwargs["rows"] = cols.read_rows(obj["rows"], f"{path}.rows", _device)
    ttl = _dec(float, obj["ttl_s"], f"{path}.ttl_s")
    base = time.monotonic() if now is None else now
    kwargs["expires_at"] = base + ttl
    kwargs["expires_wall"] = time.time() + ttl
    return _build(Lease, kwargs, path)


_MATCH_FIELDS = ("layout_id", "scope", "prompt_tokens", "resume", "names", "tier_names", "tiers",
                 "boundaries", "via")


def _match(doc: object, path: str) -> Match:
    obj = _object(doc, Match, path, _MATCH_FIELDS)
    names = cols.read_chain_names(obj["names"], f"{path}.names")
    m = _build(Match, {
        "layout_id": _bytes(obj["layout_id"], f"{path}.layout_id", LAYOUT_ID_BYTES),
        "scope": _dec(Scope, obj["scope"], f"{path}.scope"),
        "prompt_tokens": _dec(int, obj["prompt_tokens"], f"{path}.prompt_tokens"),
        "resume": _resume(obj["resume"], f"{path}.resume", names),
        "names": names,
        "tiers": cols.read_tiers(obj["tier_names"], obj["tiers"], f"{path}.tiers", f"{path}.tier_names"),
        "boundaries": cols.read_ints(obj["boundaries"], f"{path}.boundaries"),
        "via": cols.groups(obj["via"], f"{path}.via", cols.read_ints),
    }, path)
    if len(m.tiers) != len(m.names) or any(
        len(t) != len(n) for t, n in zip(m.tiers, m.names, strict=True)
    ):
        _fail(f"{path}.tiers", "must have one entry per row name, group by group")
    if len(m.resume.pages) != len(m.names):
        _fail(f"{path}.resume.pages", f"expected {len(m.names)} groups, got {len(m.resume.pages)}")
    return m


def _resume(doc: object, path: str, match_names: tuple[tuple[bytes, ...], ...] | None = None) -> ResumeBound:
    """A bound; inside a Match (``match_names``) its rows may be ``null``: implied by its
    pages and the match's names."""
    names = _init_fields(ResumeBound)
    obj = _object(doc, ResumeBound, path, names)
    hints = _hints(ResumeBound)
    kwargs = {n: _dec(hints[n], obj[n], f"{path}.{n}") for n in names if n not in ("pages", "rows")}
    kwargs["pages"] = cols.groups(obj["pages"], f"{path}.pages", cols.read_ints)
    if obj["rows"] is None and match_names is not None:
        kwargs["rows"] = cols.rows_from(kwargs["pages"], match_names, path)
    else:
        kwargs["rows"] = cols.groups(obj["rows"], f"{path}.rows", cols.read_names)
    b = _build(ResumeBound, kwargs, path)
    if len(b.rows) != len(b.pages) or any(
        rows and len(rows) != len(pages) for rows, pages in zip(b.rows, b.pages, strict=True)
    ):
        _fail(f"{path}.rows", "must be empty or name every needed page, group by group")
    return b


def _fetch_result(doc: object, path: str) -> FetchResult:
    r = _dataclass(FetchResult, doc, path)
    n = len(r.resume.pages)
    if len(r.delivered) != n or len(r.missing) != n:
        _fail(f"{path}.delivered", f"delivered and missing need one entry per group ({n})")
    return r


_READERS: Mapping[type, Callable[[object, str], Any]] = {
    PageLayout: _layout,
    Lease: _lease,
    Match: _match,
    ResumeBound: _resume,
    FetchResult: _fetch_result,
}


def from_dict(cls: type[T], doc: object, *, now: float | None = None) -> T:
    """The ``cls`` object a :func:`to_dict` document describes; :class:`InvalidInput`
    naming the field path for anything else. ``now`` (a :class:`Lease` only) is the
    receiver's clock reading its deadline is rebuilt from (default ``time.monotonic()``)."""
    if cls not in WIRE_TYPES:
        raise InvalidInput(f"cls: {getattr(cls, '__name__', cls)!r} has no wire form")
    if cls is Lease:
        return cast(T, _lease(doc, _root(cls), now))
    return cast(T, _dec(cls, doc, _root(cls)))


def from_json(cls: type[T], text: str | bytes, *, now: float | None = None) -> T:
    try:
        doc = json.loads(text)
    except (ValueError, TypeError) as exc:  # JSONDecodeError and undecodable bytes
        _fail(_root(cls), f"not JSON: {exc}")
    except RecursionError:  # nested brackets past the parser's depth limit
        _fail(_root(cls), "not JSON: nested too deeply")
    return from_dict(cls, doc, now=now)


# ---- errors --------------------------------------------------------------------------------


def _error_classes() -> dict[str, type[KvbankError]]:
    found: dict[str, type[KvbankError]] = {}
    todo: list[type[KvbankError]] = [KvbankError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == _errors.__name__:
            found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def error_to_dict(exc: KvbankError) -> Doc:
    """``{type, field, message}``: what a service answers for a typed error."""
    if not isinstance(exc, KvbankError):
        raise InvalidInput(f"exc: expected a KvbankError, got {type(exc).__name__}")
    return {"type": type(exc).__name__, "field": exc.field, "message": str(exc)}


def error_from_dict(doc: object) -> KvbankError:
    """The exception an error document describes, of the same :mod:`kvbank.errors` class.

    A type this version does not know (a newer server's) comes back as a plain
    :class:`KvbankError` whose message keeps the type's name."""
    obj = _object(doc, KvbankError, "error", ("type", "field", "message"))
    kind, fld, message = obj["type"], obj["field"], obj["message"]
    if type(kind) is not str or not kind:
        _fail("error.type", "expected a non-empty string")
    if fld is not None and type(fld) is not str:
        _fail("error.field", "expected a string or null")
    if type(message) is not str:
        _fail("error.message", "expected a string")
    cls = _error_classes().get(kind)
    if cls is None:
        return KvbankError(f"{kind}: {message}", field=fld)
    return cls(message, field=fld)
