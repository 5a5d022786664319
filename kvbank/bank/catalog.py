"""The bank's catalog: registered layouts, their shards, and the namespaces it has seen.

Primitives of :class:`Catalog` (thread-safe, one lock):

- :meth:`~Catalog.register` / :meth:`~Catalog.layout` / :meth:`~Catalog.shard` — layouts
  by id, and which tensor-parallel shards of each were registered.
- :meth:`~Catalog.learn` — record a (scope, layout) namespace; :meth:`~Catalog.describe`
  — a row name's page size and buffer regions, for names under a namespace learnt.

Why a table: a row name starts with ``SHA-256(scope, layout id)[:16]``, a one-way digest,
so a name alone cannot say which layout it belongs to. The bank learns pairs on commands
(register, put, lend of a match, register_scope), never on a query, into a bounded LRU of
:data:`MAX_NAMESPACES` for :meth:`~Catalog.describe`: a fleet with a cache salt per
request would otherwise grow it forever. A pair that fell out is learnt again by the next
command under it. Listings (:meth:`~Catalog.namespaces_of`) use every pair known instead:
those restored at open (pairs that still had rows) and those learnt since, about 100
bytes a pair.

Persistence (``Catalog(data_dir=...)``, when the bank has a disk tier, whose rows outlive
the process). Two files beside the disk tier's ``lmdb/``:

- ``layouts.json`` — every registered (layout, shard), rewritten atomically (a temporary
  file, fsync, rename, fsync of the folder) before a new registration is visible, so a
  registration that returned survives a crash;
- ``namespaces.bin`` — an append-only log of (namespace, layout id) records, each with a
  CRC-32, appended when a pair is first seen (not fsync'd: a crash can lose the last
  pairs, whose rows then list by scope or name prefix until the pair is learnt again).

:meth:`~Catalog.restore` (at open, after the store rebuilt its index) registers the layouts
again and keeps the pairs under them that still have rows, rewriting the log compacted.
A damaged ``layouts.json`` is moved aside (``.damaged``) with a warning, never fatal: the
rows stay, and workers register their layouts again; a torn log record ends the log.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from kvbank.errors import InvalidInput, KvbankError, TierUnavailable, UnknownLayout
from kvbank.keys import NAMESPACE_BYTES, Scope, group_of, namespace, namespace_of
from kvbank.layout import PageLayout
from kvbank.lender.base import PageShape
from kvbank.tiers.datadir import open_private, private_dir, replace_file

logger = logging.getLogger(__name__)

MAX_NAMESPACES = 65_536  # (scope, layout) pairs whose rows a lease can describe
LAYOUTS_FILE = "layouts.json"
NAMESPACES_FILE = "namespaces.bin"
_FORMAT = 1
_LID = 32
_RECORD = struct.Struct(f"<{NAMESPACE_BYTES}s{_LID}sI")  # namespace, layout id, CRC-32 of both


class Catalog:
    """Layouts, shards and namespaces of one bank. See the module docstring."""

    def __init__(self, max_namespaces: int | None = None, *, data_dir: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._files = None if data_dir is None else _Files(Path(data_dir))
        self._registered: dict[tuple[bytes, int], PageLayout] = {}  # what layouts.json holds
        # Every (namespace -> layout id) pair known, by layout: listings by layout alone
        # cover all of them, not only those still in the LRU.
        self._known: dict[bytes, bytes] = {}
        self._by_layout: dict[bytes, set[bytes]] = {}
        self._max = MAX_NAMESPACES if max_namespaces is None else max_namespaces
        self._layouts: dict[bytes, PageLayout] = {}
        # Shards registered per layout id. The id leaves the shard index out (every rank of
        # a layout shares it), so the shard a call names must come from the caller: taking
        # the first registration's index would hand one rank another rank's rows.
        self._shards: dict[bytes, set[int]] = {}
        self._namespaces: OrderedDict[bytes, bytes] = OrderedDict()  # ns -> layout id, LRU last
        self._shapes: dict[tuple[bytes, int], PageShape] = {}
        self.persisted_pairs = 0  # (namespace, layout) pairs namespaces.bin held at restore

    def register(self, layout: PageLayout) -> bytes:
        if not isinstance(layout, PageLayout):
            raise InvalidInput(f"layout: expected a PageLayout, got {type(layout).__name__}")
        lid = layout.layout_id
        with self._lock:
            key = (lid, layout.shard_index)
            if key not in self._registered:
                if self._files is not None:  # on disk before the registration is visible
                    self._files.save_layouts([*self._registered.values(), layout])
                self._registered[key] = layout
            self._layouts.setdefault(lid, layout)
            self._shards.setdefault(lid, set()).add(layout.shard_index)
        return lid

    def __len__(self) -> int:
        with self._lock:
            return len(self._layouts)

    @property
    def namespaces(self) -> int:
        with self._lock:
            return len(self._namespaces)

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout ``layout_id`` (:class:`UnknownLayout` otherwise)."""
        with self._lock:
            layout = self._layouts.get(layout_id) if isinstance(layout_id, bytes) else None
        if layout is None:
            shown = layout_id.hex() if isinstance(layout_id, bytes) else repr(layout_id)
            raise UnknownLayout(f"layout_id: {shown} was never registered with this bank")
        return layout

    def shard(self, layout_id: bytes, shard: int | None) -> int:
        """The shard a call means: the one given (it must be registered), or the only one."""
        with self._lock:
            shards = sorted(self._shards.get(layout_id, ()))
        if shard is None:
            if len(shards) == 1:
                return shards[0]
            raise InvalidInput(f"shard: layout {layout_id.hex()[:16]}… is registered for shards "
                               f"{shards}; name the shard this call is for")
        if isinstance(shard, bool) or not isinstance(shard, int) or shard not in shards:
            raise UnknownLayout(f"shard: shard {shard!r} of layout {layout_id.hex()[:16]}… was never "
                                f"registered (registered shards: {shards})")
        return shard

    def learn(self, layout_id: bytes, scope: Scope) -> bytes:
        """Record the (scope, layout) namespace so leases can describe its rows."""
        if not isinstance(scope, Scope):
            raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
        ns = namespace(layout_id, scope)
        with self._lock:
            if ns not in self._known:
                self._know(ns, layout_id)
                if self._files is not None:
                    self._files.append_namespace(ns, layout_id)
            self._namespaces[ns] = layout_id
            self._namespaces.move_to_end(ns)
            if len(self._namespaces) > self._max:
                self._namespaces.popitem(last=False)
        return ns

    def layout_ids(self) -> list[bytes]:
        """Every registered layout id (for admin listings)."""
        with self._lock:
            return list(self._layouts)

    def namespaces_of(self, layout_id: bytes) -> list[bytes]:
        """Every namespace known under ``layout_id`` (learnt, or restored at open), sorted."""
        with self._lock:
            return sorted(self._by_layout.get(layout_id, ()))

    def _know(self, ns: bytes, layout_id: bytes) -> None:
        self._known[ns] = layout_id
        self._by_layout.setdefault(layout_id, set()).add(ns)

    def restore(self, refuses: Callable[[PageLayout], str | None],
                has_rows: Callable[[bytes], bool]) -> list[PageLayout]:
        """Register the persisted layouts again (those ``refuses`` does not refuse, each
        refusal a warning) and keep the persisted namespaces under them that ``has_rows``
        says still have rows; the layouts restored. Call once, before any other call."""
        files = self._files
        if files is None:
            return []
        restored: list[PageLayout] = []
        loaded = files.load_layouts()
        for layout in loaded:
            why = refuses(layout)
            if why is not None:
                logger.warning("catalog: layout %s… not restored: %s", layout.layout_id.hex()[:16], why)
                continue
            restored.append(layout)
        with self._lock:
            for layout in restored:
                lid = layout.layout_id
                self._registered[(lid, layout.shard_index)] = layout
                self._layouts.setdefault(lid, layout)
                self._shards.setdefault(lid, set()).add(layout.shard_index)
            known = set(self._layouts)
        # has_rows asks the store (its lock): never called under the catalog's lock.
        pairs = files.load_namespaces()
        self.persisted_pairs = len(pairs)
        kept = {ns: lid for ns, lid in pairs.items() if lid in known and has_rows(ns)}
        with self._lock:
            for ns, lid in kept.items():
                self._know(ns, lid)
                self._namespaces[ns] = lid
                if len(self._namespaces) > self._max:
                    self._namespaces.popitem(last=False)
            # Both files rewritten: refused layouts and pairs without rows are dropped,
            # and a torn last log record is cut before anything is appended after it. The
            # old files stay valid when that fails (a full disk must not stop the start):
            # only appending stops, since a record after a torn one would not be read.
            try:
                if len(restored) != len(loaded):
                    files.save_layouts(list(self._registered.values()))
                files.rewrite_namespaces(kept.items())
            except TierUnavailable as exc:
                files.stop_appending()
                logger.warning("catalog: kept the files as they were at open (%s); namespaces "
                               "learnt from now on are not kept across a restart", exc)
        if restored:
            logger.debug("catalog: restored %d layouts, %d namespaces", len(restored), len(kept))
        return restored

    def close(self) -> None:
        if self._files is not None:
            self._files.close()

    def describe(self, name: bytes) -> PageShape | None:
        """A row's page size and regions, for names under a namespace learnt. It depends
        on the name's namespace and group only (the lender keeps answers per pair)."""
        with self._lock:
            lid = self._namespaces.get(namespace_of(name))
            if lid is None:
                return None
            group = group_of(name)
            shape = self._shapes.get((lid, group))
            if shape is None:
                layout = self._layouts[lid]
                if group >= len(layout.groups):
                    return None
                shape = self._shapes[(lid, group)] = PageShape.of(layout, group)
            return shape


class _Files:
    """``layouts.json`` and ``namespaces.bin`` in a bank's data dir (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.layouts = folder / LAYOUTS_FILE
        self.namespaces = folder / NAMESPACES_FILE
        self._log: int | None = None  # the namespace log, open for appends
        self._broken = False  # an append failed: warned once, no more appends

    def _replace(self, path: Path, data: bytes) -> None:
        # a temp file no planted symlink can redirect (kvbank.tiers.datadir), removed on
        # failure: a half-written copy must not fill a full disk more
        try:
            private_dir(self.folder)
            replace_file(path, data)
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot write {path}: {exc}") from exc

    def save_layouts(self, layouts: Iterable[PageLayout]) -> None:
        doc = {"format": _FORMAT, "layouts": [{"layout_id": x.layout_id.hex(), "layout": x.to_dict()}
                                              for x in layouts]}
        self._replace(self.layouts, json.dumps(doc, sort_keys=True, indent=1).encode())

    def load_layouts(self) -> list[PageLayout]:
        try:
            raw = self.layouts.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot read {self.layouts}: {exc}") from exc
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError(f"format: expected {_FORMAT}")
            out = []
            for i, entry in enumerate(doc["layouts"]):
                layout = PageLayout.from_dict(entry["layout"])
                if layout.layout_id.hex() != entry["layout_id"]:
                    raise ValueError(f"layouts[{i}].layout_id: does not match the layout")
                out.append(layout)
            return out
        except (KvbankError, ValueError, TypeError, KeyError) as exc:
            aside = self.layouts.with_name(self.layouts.name + ".damaged")
            logger.warning("catalog: %s is damaged (%s); moved to %s, no layout restored",
                           self.layouts, exc, aside)
            try:
                os.replace(self.layouts, aside)
            except OSError as err:
                raise TierUnavailable(f"catalog: cannot move {self.layouts} aside: {err}") from err
            return []

    def load_namespaces(self) -> dict[bytes, bytes]:
        try:
            raw = self.namespaces.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot read {self.namespaces}: {exc}") from exc
        out: dict[bytes, bytes] = {}
        size = _RECORD.size
        for at in range(0, len(raw) - size + 1, size):
            ns, lid, crc = _RECORD.unpack_from(raw, at)
            if zlib.crc32(ns + lid) != crc:
                logger.warning("catalog: %s: record at byte %d fails its CRC; the log ends there",
                               self.namespaces, at)
                break
            out[ns] = lid
        return out

    def rewrite_namespaces(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        self.close()
        self._replace(self.namespaces, b"".join(_RECORD.pack(ns, lid, zlib.crc32(ns + lid))
                                                for ns, lid in pairs))

    def stop_appending(self) -> None:
        self._broken = True

    def append_namespace(self, ns: bytes, layout_id: bytes) -> None:
        if self._broken:
            return
        try:
            if self._log is None:
                private_dir(self.folder)
                self._log = open_private(self.namespaces, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(self._log, _RECORD.pack(ns, layout_id, zlib.crc32(ns + layout_id)))
        except OSError as exc:
            # Listing by layout alone degrades (rows stay readable and listable by scope
            # or prefix); failing the put that learnt the pair would lose more.
            self._broken = True
            logger.warning("catalog: cannot append to %s (%s); namespaces learnt from now on are "
                           "not kept across a restart", self.namespaces, exc)

    def close(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None
