"""The reuse audit's node side, reached as ``bank.audit``: audit reports in, quarantined
layouts out.

An engine adapter that audits a sampled hit (it declined the hit, recomputed the pages
and compared them with the stored rows, :func:`kvbank.kernels.compare.compare_pages`)
reports the verdict with :meth:`BankAudit.report`. A mismatch means the rows under that
layout are not what an engine claiming the layout computes — another model's weights
under the same fingerprint, a wrong layout, a bug — so the layout is **quarantined**:
:meth:`Bank.match <kvbank.bank.bank.Bank.match>` and ``presence`` find none of its rows
(a miss, never an error), and a ``fetch`` of a match taken before (the bank's, or a
served node's) delivers nothing. The rows stay in the store (for an operator to look at) until evicted. Only an
operator lifts it: :meth:`BankAudit.clear` (``DELETE /admin/quarantine/{layout_id}``,
``kvbank admin quarantine --clear LAYOUT_ID``).

Primitives: :meth:`~BankAudit.report`, :meth:`~BankAudit.holds` (one set lookup, on the
match path), :meth:`~BankAudit.entries`, :meth:`~BankAudit.clear`,
:meth:`~BankAudit.counts`. With a disk tier the quarantine persists in the data dir
(``quarantine.json``, 0600, rewritten atomically), so a restart does not serve the rows
again; a damaged file is :class:`~kvbank.errors.ConfigError` at open (never silently an
empty quarantine).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbank.bank.closing import refused_once_closed
from kvbank.errors import ConfigError, InvalidInput, TierUnavailable

__all__ = ["QUARANTINE_FILE", "AuditCounts", "BankAudit", "QuarantineEntry"]

logger = logging.getLogger(__name__)

QUARANTINE_FILE = "quarantine.json"
_FORMAT = 1
MAX_DETAIL = 1000  # characters of a report's detail kept


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    """A quarantined layout: the first mismatch that put it there, and how many followed."""

    layout_id: bytes
    since: float  # seconds since the epoch
    detail: str
    error: float
    tolerance: float
    pages: int
    mismatches: int

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["layout_id"] = self.layout_id.hex()
        doc["error"] = self.error if math.isfinite(self.error) else None  # JSON has no inf
        return doc


@dataclass(frozen=True, slots=True)
class AuditCounts:
    ok: int  # audits whose pages matched the stored rows
    mismatched: int
    quarantined: int  # layouts quarantined now


def _check_id(layout_id: object) -> bytes:
    if not isinstance(layout_id, bytes) or len(layout_id) != 32:
        raise InvalidInput(f"layout_id: expected 32 bytes, got {layout_id!r:.80}", field="layout_id")
    return layout_id


def _number(name: str, v: object, lo: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < lo:
        raise InvalidInput(f"{name}: a number >= {lo}, got {v!r}", field=name)
    return float(v)


@refused_once_closed("bank.audit")
class BankAudit:
    """Audit reports and the quarantine of a bank (``bank.audit``). See the module docstring."""

    def __init__(self, data_dir: Path | None, *, known: Callable[[bytes], object],
                 closed: Callable[[], bool], clock: Callable[[], float] = time.time) -> None:
        self._path = None if data_dir is None else Path(data_dir) / QUARANTINE_FILE
        self._known = known  # raises UnknownLayout for a layout never registered
        self._is_closed = closed
        self._clock = clock
        self._lock = threading.Lock()
        self._ok = 0
        self._mismatched = 0
        self._held: dict[bytes, QuarantineEntry] = self._load()

    @property
    def _closed(self) -> bool:
        return self._is_closed()

    def report(self, layout_id: bytes, *, ok: bool, pages: int = 0, error: float = 0.0,
               tolerance: float = 0.0, detail: str = "") -> bool:
        """Count an audit of ``layout_id``'s rows; a mismatch (``ok=False``) quarantines the
        layout. Whether the layout is quarantined now."""
        _check_id(layout_id)
        if not isinstance(ok, bool):
            raise InvalidInput(f"ok: true or false, got {ok!r}", field="ok")
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0:
            raise InvalidInput(f"pages: an integer >= 0, got {pages!r}", field="pages")
        err = math.inf if error == math.inf else _number("error", error)
        tol = _number("tolerance", tolerance)
        if not isinstance(detail, str):
            raise InvalidInput(f"detail: a string, got {type(detail).__name__}", field="detail")
        self._known(layout_id)
        with self._lock:
            if ok:
                self._ok += 1
                return layout_id in self._held
            self._mismatched += 1
            old = self._held.get(layout_id)
            if old is not None:
                self._held[layout_id] = QuarantineEntry(
                    old.layout_id, old.since, old.detail, old.error, old.tolerance, old.pages,
                    old.mismatches + 1)
                return True
            self._held[layout_id] = QuarantineEntry(layout_id, self._clock(), detail[:MAX_DETAIL],
                                                    err, tol, pages, 1)
            self._save()
        logger.warning("audit: layout %s quarantined: its stored rows differ from what an engine "
                       "computed (%s); clear it with kvbank admin quarantine --clear", layout_id.hex(),
                       detail[:200])
        return True

    def holds(self, layout_id: bytes) -> bool:
        """Whether ``layout_id`` is quarantined (its rows are not served)."""
        return layout_id in self._held

    def entries(self) -> tuple[QuarantineEntry, ...]:
        """Every quarantined layout, oldest first."""
        with self._lock:
            return tuple(sorted(self._held.values(), key=lambda e: e.since))

    def clear(self, layout_id: bytes) -> bool:
        """Serve ``layout_id``'s rows again; False if it was not quarantined."""
        _check_id(layout_id)
        with self._lock:
            if self._held.pop(layout_id, None) is None:
                return False
            self._save()
        logger.warning("audit: layout %s cleared from quarantine by an operator", layout_id.hex())
        return True

    def counts(self) -> AuditCounts:
        with self._lock:
            return AuditCounts(self._ok, self._mismatched, len(self._held))

    # ---- the file ------------------------------------------------------------------------

    def _load(self) -> dict[bytes, QuarantineEntry]:
        if self._path is None:
            return {}
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(f"quarantine: cannot read {self._path}: {exc}") from exc
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError(f"format: expected {_FORMAT}")
            out = {}
            for e in doc["layouts"]:
                lid = bytes.fromhex(e["layout_id"])
                _check_id(lid)
                err = e["error"]
                out[lid] = QuarantineEntry(lid, float(e["since"]), str(e["detail"]),
                                           math.inf if err is None else float(err),
                                           float(e["tolerance"]), int(e["pages"]), int(e["mismatches"]))
            return out
        except (ValueError, TypeError, KeyError, InvalidInput) as exc:
            raise ConfigError(f"quarantine: {self._path} is damaged ({exc}); the layouts it held "
                              "would be served again: inspect it, then remove it to start with "
                              "none quarantined") from exc

    def _save(self) -> None:
        if self._path is None:
            return
        doc = {"format": _FORMAT, "layouts": [e.to_json() for e in self._held.values()]}
        data = json.dumps(doc, sort_keys=True, indent=1).encode()
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            # the quarantine holds in memory; only a restart would forget it
            raise TierUnavailable(f"quarantine: cannot write {self._path}: {exc}") from exc
