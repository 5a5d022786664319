"""The bank's catalog: registered layouts, their shards, and the namespaces it has seen.

Primitives of :class:`Catalog` (thread-safe, one lock):

- :meth:`~Catalog.register` / :meth:`~Catalog.layout` / :meth:`~Catalog.shard` — layouts
  by id, and which tensor-parallel shards of each were registered; at most
  :data:`MAX_LAYOUTS` registrations of at most :data:`MAX_LAYOUT_BYTES` each (its JSON
  form). :meth:`~Catalog.unregister` forgets every shard of a layout id.
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
the process). Beside the disk tier's ``lmdb/``:

- ``layouts/`` — one file per registered (layout, shard), ``<layout id>-<shard>.json``,
  written atomically (a temporary file, fsync, rename, fsync of the folder) before a new
  registration is visible, so a registration that returned survives a crash; a
  registration writes its own file only, an unregistration deletes its files. (The
  ``layouts.json`` of earlier versions, every layout in one file, is read at open, split
  into ``layouts/`` and kept as ``layouts.json.old``.)
- ``namespaces.bin`` — an append-only log of (namespace, layout id) records, each with a
  CRC-32, appended when a pair is first seen (not fsync'd: a crash can lose the last
  pairs, whose rows then list by scope or name prefix until the pair is learnt again).

:meth:`~Catalog.restore` (at open, after the store rebuilt its index) registers the layouts
again and keeps the pairs under them that still have rows, rewriting the log compacted.
A damaged layout file is moved aside (``.damaged``) with a warning, never fatal: the
others load, the rows stay, and workers register their layouts again; a torn log record
ends the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from kvbank.errors import InvalidInput, KvbankError, LayoutError, TierUnavailable, UnknownLayout
from kvbank.keys import NAMESPACE_BYTES, Scope, group_of, namespace, namespace_of
from kvbank.layout import PageLayout
from kvbank.lender.base import PageShape
from kvbank.tiers.datadir import open_private, private_dir, replace_file

logger = logging.getLogger(__name__)

MAX_NAMESPACES = 65_536  # (scope, layout) pairs whose rows a lease can describe
MAX_LAYOUTS = 4096  # registered (layout, shard) pairs: a model and TP size each
MAX_LAYOUT_BYTES = 1 << 20  # a layout's JSON form (a 128-layer hybrid model is ~60 KiB)
LAYOUTS_FILE = "layouts.json"  # every layout in one file (read at open, then split)
LAYOUTS_DIR = "layouts"
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
                if len(self._registered) >= MAX_LAYOUTS:
                    raise LayoutError(f"layout: {MAX_LAYOUTS} layouts (and shards) are registered, "
                                      "the most a bank keeps; unregister one first", field="layout")
                size = len(_layout_json(layout))
                if size > MAX_LAYOUT_BYTES:
                    raise LayoutError(f"layout: {size} bytes as JSON, over the {MAX_LAYOUT_BYTES}-byte "
                                      "limit", field="layout")
                if self._files is not None:  # on disk before the registration is visible
                    self._files.save_layout(layout)
                self._registered[key] = layout
            self._layouts.setdefault(lid, layout)
            self._shards.setdefault(lid, set()).add(layout.shard_index)
        return lid

    def unregister(self, layout_id: bytes) -> int:
        """Forget every shard of ``layout_id`` (and the namespaces learnt under it); how
        many registrations were removed (0: it was not registered)."""
        with self._lock:
            keys = [k for k in self._registered if k[0] == layout_id]
            for key in keys:
                if self._files is not None:  # off disk before the registration is gone
                    self._files.remove_layout(*key)
                del self._registered[key]
            self._layouts.pop(layout_id, None)
            self._shards.pop(layout_id, None)
            for key in [k for k in self._shapes if k[0] == layout_id]:
                del self._shapes[key]
            for ns in self._by_layout.pop(layout_id, set()):
                self._known.pop(ns, None)
                self._namespaces.pop(ns, None)
        return len(keys)

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
                if len(restored) != len(loaded) or files.legacy():
                    files.save_all(list(self._registered.values()))
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


def _read_entry(entry: dict[str, object], what: str) -> PageLayout:
    doc = entry["layout"]
    if not isinstance(doc, dict):
        raise ValueError(f"{what}.layout: expected an object")
    layout = PageLayout.from_dict(doc)
    if layout.layout_id.hex() != entry["layout_id"]:
        raise ValueError(f"{what}.layout_id: does not match the layout")
    return layout


def _layout_json(layout: PageLayout) -> bytes:
    """A registration's file: its layout id and its layout's dict form."""
    doc = {"format": _FORMAT, "layout_id": layout.layout_id.hex(), "layout": layout.to_dict()}
    return json.dumps(doc, sort_keys=True, indent=1).encode()


class _Files:
    """``layouts.json`` and ``namespaces.bin`` in a bank's data dir (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.layouts = folder / LAYOUTS_FILE  # the old single file, read at open only
        self.layouts_dir = folder / LAYOUTS_DIR
        self.namespaces = folder / NAMESPACES_FILE
        self._log: int | None = None  # the namespace log, open for appends
        self._broken = False  # an append failed: warned once, no more appends

    def _replace(self, path: Path, data: bytes) -> None:
        # a temp file no planted symlink can redirect (kvbank.tiers.datadir), removed on
        # failure: a half-written copy must not fill a full disk more
        try:
            private_dir(path.parent)
            replace_file(path, data)
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot write {path}: {exc}") from exc

    def _file(self, layout_id: bytes, shard: int) -> Path:
        return self.layouts_dir / f"{layout_id.hex()}-{shard}.json"

    def save_layout(self, layout: PageLayout) -> None:
        """One registration's own file (the others are not rewritten)."""
        self._replace(self._file(layout.layout_id, layout.shard_index), _layout_json(layout))

    def remove_layout(self, layout_id: bytes, shard: int) -> None:
        path = self._file(layout_id, shard)
        try:
            path.unlink(missing_ok=True)
            dfd = os.open(self.layouts_dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the unlink itself is durable
            finally:
                os.close(dfd)
        except FileNotFoundError:
            pass  # no folder: nothing was ever saved
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot remove {path}: {exc}") from exc

    def legacy(self) -> bool:
        """Whether the single ``layouts.json`` of earlier versions is still there."""
        return self.layouts.exists()

    def save_all(self, layouts: Iterable[PageLayout]) -> None:
        """Exactly ``layouts`` on disk, one file each (the old single file removed)."""
        keep = {self._file(x.layout_id, x.shard_index).name for x in layouts}
        for x in layouts:
            self.save_layout(x)
        if self.layouts_dir.is_dir():
            for f in self.layouts_dir.glob("*.json"):
                if f.name not in keep:
                    with contextlib.suppress(OSError):
                        f.unlink()
        if self.layouts.exists():  # kept beside, as it was, for the operator
            try:
                os.replace(self.layouts, self.layouts.with_name(self.layouts.name + ".old"))
            except OSError as exc:
                raise TierUnavailable(f"catalog: cannot move {self.layouts} aside: {exc}") from exc

    def load_layouts(self) -> list[PageLayout]:
        """The layouts of ``layouts/`` and of an old ``layouts.json``; a damaged file is
        moved aside (``.damaged``) with a warning, the others load."""
        out = self._load_file(self.layouts, many=True)
        try:
            files = sorted(self.layouts_dir.glob("*.json"))
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot list {self.layouts_dir}: {exc}") from exc
        for f in files:
            out += self._load_file(f, many=False)
        return out

    def _load_file(self, path: Path, *, many: bool) -> list[PageLayout]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierUnavailable(f"catalog: cannot read {path}: {exc}") from exc
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError(f"format: expected {_FORMAT}")
            if not many:
                return [_read_entry(doc, "layout")]
            out = []
            for i, entry in enumerate(doc["layouts"]):
                try:  # one bad entry of the old single file costs that layout only
                    out.append(_read_entry(entry, f"layouts[{i}]"))
                except (KvbankError, ValueError, TypeError, KeyError) as exc:
                    logger.warning("catalog: %s: layouts[%d] not restored: %s", path, i, exc)
            return out
        except (KvbankError, ValueError, TypeError, KeyError) as exc:
            aside = path.with_name(path.name + ".damaged")
            logger.warning("catalog: %s is damaged (%s); moved to %s, no layout restored from it",
                           path, exc, aside)
            try:
                os.replace(path, aside)
            except OSError as err:
                raise TierUnavailable(f"catalog: cannot move {path} aside: {err}") from err
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
