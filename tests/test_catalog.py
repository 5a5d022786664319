"""The bank's catalog: layouts by id, registered shards, namespaces learnt into an LRU."""

from __future__ import annotations

import pytest

from kvbank.builders import full_attention
from kvbank.catalog import Catalog
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
