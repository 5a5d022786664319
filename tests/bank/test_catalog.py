"""The bank's catalog: layouts by id, registered shards, namespaces learnt into an LRU."""

from __future__ import annotations

import resource
import signal

import pytest

from kvbank.bank.catalog import Catalog
from kvbank.builders import full_attention
from kvbank.errors import InvalidInput, UnknownLayout
from kvbank.keys import DEFAULT_SCOPE, Scope, namespace, row_name

FA = full_attention("cat@1", 2, 4, 64, shard_count=2)


def test_catalog_describes_only_learnt_namespaces() -> None:
    cat = Catalog()
    lid = cat.register(FA)
    name = row_name(namespace(lid, Scope("t")), b"k" * 32, 0, 2, 0)
    assert cat.describe(name) is None  # registered, but the scope was never learnt
    assert cat.learn(lid, Scope("t")) == namespace(lid, Scope("t"))
    shape = cat.describe(name)
    assert shape is not None and shape.size == FA.group_page_bytes[0]
    assert cat.describe(row_name(namespace(lid, Scope("t")), b"k" * 32, 7, 2, 0)) is None  # no group 7


def test_catalog_namespace_table_is_an_lru() -> None:
    cat = Catalog(max_namespaces=2)
    lid = cat.register(FA)
    for salt in ("a", "b", "a", "c"):  # "a" used again before "c": "b" is the oldest
        cat.learn(lid, Scope(cache_salt=salt))
    assert cat.namespaces == 2
    ns = {s: namespace(lid, Scope(cache_salt=s)) for s in "abc"}
    assert cat.describe(ns["b"] + bytes(38)) is None
    assert cat.describe(ns["a"] + bytes(38)) is not None and cat.describe(ns["c"] + bytes(38)) is not None


def test_catalog_shards_and_refusals() -> None:
    cat = Catalog()
    lid = cat.register(FA)
    assert cat.shard(lid, None) == 0
    cat.register(FA.with_shard(1))
    assert cat.shard(lid, 1) == 1
    with pytest.raises(InvalidInput, match="shard"):
        cat.shard(lid, None)
    with pytest.raises(UnknownLayout, match="shard"):
        cat.shard(lid, 3)
    with pytest.raises(UnknownLayout, match="layout_id"):
        cat.layout(b"x" * 32)
    with pytest.raises(InvalidInput, match="layout"):
        cat.register("not a layout")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="scope"):
        cat.learn(lid, DEFAULT_SCOPE.digest)  # type: ignore[arg-type]


def test_catalog_persists_layouts_and_namespaces_and_restores_those_with_rows(tmp_path) -> None:
    """Every registered (layout, shard) and every namespace learnt is on disk; a restore
    registers the layouts again and keeps the namespaces that still have rows."""
    from kvbank.bank.catalog import LAYOUTS_DIR, NAMESPACES_FILE

    other = full_attention("cat-other@1", 1, 2, 64)
    cat = Catalog(data_dir=tmp_path)
    lid = cat.register(FA)
    cat.register(FA.with_shard(1))
    oid = cat.register(other)
    scopes = [Scope("t", cache_salt=str(i)) for i in range(5)]
    for s in scopes:
        cat.learn(lid, s)
    cat.learn(oid, Scope("o"))
    cat.close()
    assert len(list((tmp_path / LAYOUTS_DIR).glob("*.json"))) == 3
    assert (tmp_path / NAMESPACES_FILE).stat().st_size == 6 * 52
    stored = {namespace(lid, s) for s in scopes[:3]} | {namespace(oid, Scope("o"))}

    again = Catalog(data_dir=tmp_path)
    restored = again.restore(lambda layout: None, lambda ns: ns in stored)
    assert {(x.layout_id, x.shard_index) for x in restored} == {(lid, 0), (lid, 1), (oid, 0)}
    assert again.shard(lid, 1) == 1 and again.layout(oid) == other
    assert again.namespaces_of(lid) == sorted(namespace(lid, s) for s in scopes[:3])
    assert again.describe(row_name(namespace(lid, scopes[0]), b"k" * 32, 0, 2, 0)) is not None
    again.learn(lid, scopes[4])  # learnt again after the restore: appended to the compacted log
    again.close()
    assert (tmp_path / NAMESPACES_FILE).stat().st_size == 5 * 52


def test_catalog_restore_survives_a_torn_log_a_damaged_layouts_file_and_refusals(tmp_path) -> None:
    from kvbank.bank.catalog import LAYOUTS_DIR, NAMESPACES_FILE

    other = full_attention("cat-other@1", 1, 2, 64)
    cat = Catalog(data_dir=tmp_path)
    lid, oid = cat.register(FA), cat.register(other)
    cat.learn(lid, Scope("a"))
    cat.learn(lid, Scope("b"))
    cat.close()
    log = tmp_path / NAMESPACES_FILE
    raw = bytearray(log.read_bytes())
    raw[-1] ^= 0xFF  # the last record's CRC fails: the log ends before it
    log.write_bytes(bytes(raw) + b"\x01\x02")  # and a torn record after it
    refused = Catalog(data_dir=tmp_path)
    got = refused.restore(lambda layout: "too big" if layout.layout_id == oid else None, lambda ns: True)
    assert [x.layout_id for x in got] == [lid]
    assert refused.namespaces_of(lid) == [namespace(lid, Scope("a"))]
    with pytest.raises(UnknownLayout):
        refused.layout(oid)  # refused at restore: dropped from the file too
    refused.close()
    assert log.stat().st_size == 52

    (file,) = (tmp_path / LAYOUTS_DIR).glob("*.json")  # the refused layout's file is gone
    file.write_text('{"format": 1, "layout_id": "00", "layout": {}}')
    damaged = Catalog(data_dir=tmp_path)
    assert damaged.restore(lambda layout: None, lambda ns: True) == []
    assert file.with_name(file.name + ".damaged").exists()
    assert damaged.namespaces_of(lid) == []  # no layout, so none of its namespaces
    damaged.close()


def test_catalog_restore_opens_when_its_files_cannot_be_rewritten(tmp_path) -> None:
    """Regression: a node restarted on a full disk failed to start, because the restore
    rewrote its files (``TierUnavailable: cannot write layouts.json``). The rewrite is
    housekeeping: the files stay as they were, the layouts come back, and appending stops
    (a record after a torn one would never be read)."""
    from kvbank.bank.catalog import LAYOUTS_DIR, NAMESPACES_FILE

    cat = Catalog(data_dir=tmp_path)
    lid = cat.register(FA)
    cat.learn(lid, Scope("t"))
    cat.close()
    (layout_file,) = (tmp_path / LAYOUTS_DIR).glob("*.json")
    before = layout_file.read_bytes(), (tmp_path / NAMESPACES_FILE).read_bytes()

    again = Catalog(data_dir=tmp_path)
    # the kernel refuses every write past 16 bytes (EFBIG), as a full disk refuses them
    # (the rewrite's temp file has an unpredictable name: nothing can be planted there)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, limit[1]))
    try:
        restored = again.restore(lambda layout: None, lambda ns: True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert [x.layout_id for x in restored] == [lid]
    assert again.namespaces_of(lid) == [namespace(lid, Scope("t"))]
    again.learn(lid, Scope("u"))  # not appended after a log it could not tidy
    again.close()
    assert (layout_file.read_bytes(), (tmp_path / NAMESPACES_FILE).read_bytes()) == before


def test_catalog_reads_an_old_layouts_json_and_splits_it(tmp_path) -> None:
    """A data dir of an earlier version (every layout in ``layouts.json``) opens with its
    layouts, and from then on each has its own file under ``layouts/``."""
    import json

    from kvbank.bank.catalog import LAYOUTS_DIR, LAYOUTS_FILE

    other = full_attention("cat-other@1", 1, 2, 64)
    bad = {**FA.to_dict(), "model": "x\ud800y"}  # what B1 let in: restored by no version now
    (tmp_path / LAYOUTS_FILE).write_text(json.dumps({"format": 1, "layouts": [
        *({"layout_id": x.layout_id.hex(), "layout": x.to_dict()} for x in (FA, other)),
        {"layout_id": "00" * 32, "layout": bad}]}))
    cat = Catalog(data_dir=tmp_path)
    assert {x.layout_id for x in cat.restore(lambda layout: None, lambda ns: True)} == {
        FA.layout_id, other.layout_id}
    cat.close()
    assert not (tmp_path / LAYOUTS_FILE).exists() and (tmp_path / (LAYOUTS_FILE + ".old")).exists()
    assert len(list((tmp_path / LAYOUTS_DIR).glob("*.json"))) == 2
    again = Catalog(data_dir=tmp_path)
    assert len(again.restore(lambda layout: None, lambda ns: True)) == 2
    again.close()


def test_catalog_registration_writes_only_its_own_file(tmp_path) -> None:
    """W14: each registration rewrote every registered layout; now it writes its own file,
    and the others are untouched (same inode, same bytes)."""
    from kvbank.bank.catalog import LAYOUTS_DIR

    cat = Catalog(data_dir=tmp_path)
    cat.register(FA)
    (first,) = (tmp_path / LAYOUTS_DIR).glob("*.json")
    ino, data = first.stat().st_ino, first.read_bytes()
    for i in range(5):
        cat.register(full_attention(f"cat-more-{i}@1", 1, 2, 64))
    assert first.stat().st_ino == ino and first.read_bytes() == data
    assert len(list((tmp_path / LAYOUTS_DIR).glob("*.json"))) == 6
    cat.close()


def test_catalog_limits_layout_count_and_size(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W14: a layout's JSON form and the number of registrations are bounded; a refusal
    writes nothing, and unregistering makes room again."""
    import kvbank.bank.catalog as catalog
    from kvbank.errors import LayoutError

    monkeypatch.setattr(catalog, "MAX_LAYOUTS", 3)
    monkeypatch.setattr(catalog, "MAX_LAYOUT_BYTES", 3000)
    cat = Catalog(data_dir=tmp_path)
    ids = [cat.register(full_attention(f"cat-n-{i}@1", 1, 2, 64)) for i in range(3)]
    cat.register(full_attention("cat-n-0@1", 1, 2, 64))  # again: no new registration
    with pytest.raises(LayoutError, match="unregister one"):
        cat.register(full_attention("cat-n-3@1", 1, 2, 64))
    assert cat.unregister(ids[0]) == 1 and cat.unregister(ids[0]) == 0
    with pytest.raises(UnknownLayout):
        cat.layout(ids[0])
    with pytest.raises(LayoutError, match="3000-byte limit"):
        cat.register(full_attention("m" * 4000, 1, 2, 64))
    cat.register(full_attention("cat-n-3@1", 1, 2, 64))
    cat.close()
    again = Catalog(data_dir=tmp_path)
    assert ids[0] not in {x.layout_id for x in again.restore(lambda layout: None, lambda ns: True)}
    again.close()


def test_layout_model_names_must_be_utf8_and_bounded() -> None:
    """B1: a lone surrogate in the model name was accepted, persisted, and made every
    listing of layouts fail to serialize (for good: it was restored at each start)."""
    from kvbank.errors import LayoutError
    from kvbank.layout import MAX_MODEL_BYTES

    with pytest.raises(LayoutError, match="model: not encodable as UTF-8"):
        full_attention("x\ud800y", 1, 1, 8)
    with pytest.raises(LayoutError, match=f"model: at most {MAX_MODEL_BYTES}"):
        full_attention("m" * (MAX_MODEL_BYTES + 1), 1, 1, 8)
    assert full_attention("é" * (MAX_MODEL_BYTES // 2), 1, 1, 8).model  # 2 bytes each: fits
