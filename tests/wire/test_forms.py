"""The wire forms: every type round-trips through JSON, and a hostile document is refused
with InvalidInput naming the field path (nothing else escapes)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbank import errors, wire
from kvbank.builders import full_attention, hybrid_mamba, mla, sliding_window
from kvbank.errors import InvalidInput, KvbankError
from kvbank.keys import Scope, namespace, row_names
from kvbank.layout import PageLayout
from kvbank.lender.base import (
    CommitResult,
    Delivery,
    DeviceLocation,
    HostLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    MemoryKind,
    Region,
    Selection,
)
from kvbank.lender.ledger import FetchInfo
from kvbank.lender.resume import ResumeBound, resume_bound, resume_boundaries
from kvbank.results import (
    BankStats,
    Bound,
    EventKind,
    EvictResult,
    FetchResult,
    HealthState,
    Match,
    Presence,
    RowEvent,
    RowInfo,
    StoreHealth,
    StoreStats,
    TierHealth,
    TierStats,
)
from kvbank.tiers.base import TierKind
from kvbank.wire.columns import names_blob

counts = st.integers(0, 2**40)
small = st.integers(0, 64)
names54 = st.binary(min_size=54, max_size=54)
text = st.text(max_size=12)

scopes = st.builds(Scope, text, text, text)


@st.composite
def layouts(draw: st.DrawFn) -> PageLayout:
    heads = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["fa", "mla", "swa", "mamba"]))
    if kind == "fa":
        lay = full_attention("w@1", draw(st.integers(1, 3)), heads, 16 * draw(st.integers(1, 4)),
                             shard_count=draw(st.sampled_from([1, heads])))
    elif kind == "mla":
        lay = mla("w-mla@1", draw(st.integers(1, 3)), 64, index_key_dim=draw(st.sampled_from([None, 32])))
    elif kind == "swa":
        lay = sliding_window("w-swa@1", 2, heads, 32, window=32, sink_tokens=16)
    else:
        lay = hybrid_mamba("w-mamba@1", [0, 2], [1], heads, 32, conv_shape=(8, 3), ssm_shape=(4, 8))
    return lay.with_shard(draw(st.integers(0, lay.shard_count - 1)))


@st.composite
def bounds(draw: st.DrawFn, layout: PageLayout | None = None
           ) -> tuple[PageLayout, ResumeBound, tuple[tuple[bytes, ...], ...]]:
    lay = layout or draw(layouts())
    t = draw(st.integers(0, 8 * lay.tokens_per_page))
    keyed = t // lay.tokens_per_page
    ns = namespace(lay.layout_id, draw(scopes))
    keys = [draw(st.binary(min_size=32, max_size=32)) for _ in range(keyed)]
    names = tuple(tuple(row_names(ns, keys, g, lay.shard_count, lay.shard_index))
                  for g in range(len(lay.groups)))
    have = draw(st.lists(st.booleans(), min_size=len(lay.groups) * keyed,
                         max_size=len(lay.groups) * keyed))
    present = lambda g, j: have[g * keyed + j]  # noqa: E731
    with_names = draw(st.booleans())
    return lay, resume_bound(lay, t, present, names if with_names else None), names


@st.composite
def matches(draw: st.DrawFn) -> Match:
    lay, _, names = draw(bounds())
    tier = st.sampled_from([None, *TierKind])
    tiers = tuple(tuple(draw(tier) for _ in g) for g in names)
    have = lambda g, j: tiers[g][j] is not None  # noqa: E731
    t = draw(st.integers(len(names[0]) * lay.tokens_per_page, (len(names[0]) + 1) * lay.tokens_per_page - 1))
    b = resume_bound(lay, t, have, names)
    return Match(lay.layout_id, draw(scopes), t, b, names, tiers, resume_boundaries(lay, t, have))


@st.composite
def presences(draw: st.DrawFn) -> Presence:
    shards = tuple(sorted(draw(st.sets(small, min_size=1, max_size=3))))
    groups, pages = draw(st.integers(1, 3)), draw(st.integers(0, 4))
    tier = st.sampled_from([None, *TierKind])
    tiers = tuple(tuple(tuple(draw(tier) for _ in range(pages)) for _ in range(groups)) for _ in shards)
    per = tuple(draw(small) for _ in shards)
    return Presence(draw(st.binary(min_size=32, max_size=32)), draw(scopes), draw(counts), shards,
                    tiers, per, min(per))


@st.composite
def fetch_results(draw: st.DrawFn) -> FetchResult:
    _, b, _ = draw(bounds())
    per_group = st.lists(small, max_size=4).map(tuple)
    n = len(b.pages)
    return FetchResult(draw(st.text(min_size=1, max_size=32)),
                       tuple(draw(per_group) for _ in range(n)), tuple(draw(per_group) for _ in range(n)),
                       b, draw(counts), draw(st.booleans()))


host_locs = st.builds(HostLocation, st.text(min_size=1, max_size=20), counts, counts)
dev_locs = st.builds(DeviceLocation, text, st.sampled_from(["cpu", "cuda:0"]), counts, counts,
                     st.none() | st.binary(max_size=64))
locations = host_locs | dev_locs
regions = st.builds(Region, small, st.sampled_from(["KEY", "VALUE", "SSM_STATE"]), counts, counts)
lease_rows = st.builds(LeaseRow, names54, st.booleans(), st.none() | locations,
                       st.lists(regions, max_size=3).map(tuple), st.sampled_from(Delivery))
leases = st.builds(
    Lease, st.text(min_size=1, max_size=32), st.sampled_from(MemoryKind), st.sampled_from(LeaseMode),
    st.sampled_from(Selection), st.floats(0, 1e6), st.floats(0, 2e9),
    st.lists(lease_rows, max_size=4).map(tuple), st.lists(locations, max_size=2).map(tuple),
)
commits = st.builds(CommitResult, st.text(min_size=1, max_size=32),
                    *(st.lists(names54, max_size=3).map(tuple) for _ in range(3)))
tier_stats = st.builds(TierStats, st.sampled_from(TierKind), st.booleans(), *(counts for _ in range(10)))
store_stats = st.builds(StoreStats, st.lists(tier_stats, max_size=3).map(tuple), *(counts for _ in range(9)))
bank_stats = st.builds(BankStats, counts, counts, counts, counts, store_stats)
tier_health = st.builds(TierHealth, st.sampled_from(TierKind), st.booleans(),
                        st.sampled_from(HealthState), text)
store_health = st.builds(StoreHealth, st.booleans(), st.lists(tier_health, max_size=3).map(tuple),
                         st.booleans(), st.lists(text, max_size=3).map(tuple))

row_infos = st.builds(RowInfo, names54, counts, st.frozensets(st.sampled_from(TierKind)),
                      st.floats(0, 1e9), st.frozensets(st.text(min_size=1, max_size=8), max_size=3),
                      st.booleans())
evict_results = st.builds(EvictResult, *(st.lists(names54, max_size=3).map(tuple) for _ in range(4)))
row_events = st.builds(RowEvent, st.sampled_from(EventKind), names54 | st.just(b""), counts, counts)

EXAMPLES: dict[type, st.SearchStrategy[Any]] = {
    PageLayout: layouts(),
    Scope: scopes,
    ResumeBound: bounds().map(lambda x: x[1]),
    Match: matches(),
    Presence: presences(),
    FetchInfo: st.builds(FetchInfo, st.text(min_size=1, max_size=8), st.binary(min_size=32, max_size=32),
                         counts, counts, counts, st.floats(0, 1e6)),
    FetchResult: fetch_results(),
    LeaseRow: lease_rows,
    HostLocation: host_locs,
    DeviceLocation: dev_locs,
    Region: regions,
    CommitResult: commits,
    BankStats: bank_stats,
    StoreStats: store_stats,
    TierStats: tier_stats,
    StoreHealth: store_health,
    TierHealth: tier_health,
    RowInfo: row_infos,
    EvictResult: evict_results,
    RowEvent: row_events,
    Bound: st.builds(Bound, counts, st.lists(small, max_size=4).map(tuple),
                     st.lists(st.lists(small, max_size=3).map(tuple), max_size=3).map(tuple),
                     st.none() | st.text(min_size=1, max_size=32), st.booleans()),
}

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def through_json(doc: dict[str, Any]) -> Any:
    return json.loads(json.dumps(doc, allow_nan=False))


def test_wire_every_type_has_a_round_trip_strategy() -> None:
    assert set(EXAMPLES) | {Lease} == set(wire.WIRE_TYPES)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_wire_round_trip(cls: type) -> None:
    @SETTINGS
    @given(EXAMPLES[cls])
    def check(obj: Any) -> None:
        doc = through_json(wire.to_dict(obj))
        back: Any = wire.from_dict(cls, doc)
        assert back == obj
        if isinstance(obj, Scope):
            assert back.digest == obj.digest
        if isinstance(obj, PageLayout):
            assert back.layout_id == obj.layout_id and back.shard_index == obj.shard_index
        assert wire.to_dict(back) == doc

    check()


@SETTINGS
@given(leases, st.floats(0, 1e6), st.floats(0, 1e6))
def test_wire_lease_carries_ttl_not_the_lenders_deadline(lease: Lease, lender_now: float, here: float) -> None:
    doc = through_json(wire.to_dict(lease, now=lender_now))
    assert "expires_at" not in doc and "expires_wall" not in doc
    assert doc["ttl_s"] == max(0.0, lease.expires_at - lender_now)
    back = wire.from_dict(Lease, doc, now=here)
    assert back.expires_at == here + doc["ttl_s"]  # rebuilt on the receiver's own clock
    same_clock = dataclasses.replace(back, expires_at=lease.expires_at, expires_wall=lease.expires_wall)
    assert same_clock == lease
    again = wire.from_json(Lease, wire.to_json(lease, now=lender_now), now=here)
    assert dataclasses.replace(again, expires_wall=back.expires_wall) == back


# ---- hostile documents ---------------------------------------------------------------------


def _paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*path, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


JUNK = [None, True, -1, 1.5, float("nan"), "zz", "", [], {}, [None], {"bogus": 1}, 2**70, "0" * 108]


@pytest.mark.parametrize("cls", [*EXAMPLES, Lease], ids=lambda c: c.__name__)
def test_wire_hostile_documents_raise_only_invalid_input(cls: type) -> None:
    """Whatever replaces any node of a valid document, from_dict answers an object of the
    class or InvalidInput with a field path; never another exception."""
    strategy = leases if cls is Lease else EXAMPLES[cls]

    @SETTINGS
    @given(strategy, st.data())
    def check(obj: Any, data: st.DataObject) -> None:
        doc = through_json(wire.to_dict(obj))
        path = data.draw(st.sampled_from(_paths(doc)))
        bad = _set(copy.deepcopy(doc), path, data.draw(st.sampled_from(JUNK)))
        objects = [p for p in _paths(bad) if isinstance(_get(bad, p), dict) and _get(bad, p)]
        if bool(objects) and data.draw(st.booleans()):  # and drop a key somewhere
            node = _get(bad, data.draw(st.sampled_from(objects)))
            del node[data.draw(st.sampled_from(sorted(node)))]
        try:
            back: object = wire.from_dict(cls, bad)
        except InvalidInput as exc:
            assert exc.field and exc.field.split(".")[0].split("[")[0] == wire.forms._root(cls)
        else:
            assert isinstance(back, cls)

    check()


def _match_doc(chain: bool = False) -> dict[str, Any]:
    """A match's form: by default with its names as per-group blobs and its bound's rows
    written out (the general form); ``chain=True``: as a match writes them (chain form,
    rows implied)."""
    lay = full_attention("w@1", 1, 1, 16)
    ns = namespace(lay.layout_id)
    names = (tuple(row_names(ns, [bytes([i]) * 32 for i in range(2)], 0)),)
    tiers = ((TierKind.HOST, None),)
    b = resume_bound(lay, 40, lambda g, j: tiers[g][j] is not None, names)
    doc = through_json(wire.to_dict(Match(lay.layout_id, Scope("t"), 40, b, names, tiers, (16,))))
    assert isinstance(doc["names"], dict) and doc["resume"]["rows"] is None
    if not chain:
        doc["names"] = [names_blob(g) for g in names]
        doc["resume"]["rows"] = [names_blob(r) for r in b.rows]
    return doc


def test_wire_match_both_name_forms_read_back_the_same() -> None:
    assert wire.from_dict(Match, _match_doc()) == wire.from_dict(Match, _match_doc(chain=True))


def test_wire_match_chain_form_is_used_only_where_it_fits() -> None:
    """Names that are not one key chain under one namespace (per group one tail) keep
    the per-group blobs, and rows that are not implied by the pages are written out."""
    lay = full_attention("w@1", 1, 1, 16)
    odd = ((bytes([1]) * 54, bytes([2]) * 54),)
    tiers = ((TierKind.HOST, TierKind.HOST),)
    b = resume_bound(lay, 40, lambda g, j: True, odd)
    doc = through_json(wire.to_dict(Match(lay.layout_id, Scope("t"), 40, b, odd, tiers, (16, 32))))
    assert isinstance(doc["names"], list) and doc["resume"]["rows"] is None
    assert wire.from_dict(Match, doc).names == odd
    other = dataclasses.replace(b, rows=((bytes([3]) * 54, bytes([4]) * 54),))
    doc = through_json(wire.to_dict(Match(lay.layout_id, Scope("t"), 40, other, odd, tiers, (16, 32))))
    assert wire.from_dict(Match, doc).resume.rows == other.rows


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["names"].__setitem__("ns", "00"), "match.names.ns"),
        (lambda d: d["names"].__setitem__("ns", "AB" * 16), "match.names.ns"),
        (lambda d: d["names"].__setitem__("keys", d["names"]["keys"][:-4]), "match.names.keys"),
        (lambda d: d["names"].__setitem__("keys", ""), "match.names.keys"),
        (lambda d: d["names"].__setitem__("keys", 7), "match.names.keys"),
        (lambda d: d["names"].__setitem__("tails", []), "match.names.tails"),
        (lambda d: d["names"].__setitem__("tails", ["00"]), "match.names.tails[0]"),
        (lambda d: d["names"].pop("tails"), "match.names"),
        (lambda d: d["resume"]["pages"][0].append(5), "match.resume.pages[0]"),
        (lambda d: d["resume"]["pages"][0].insert(0, 0), "match.resume.pages[0]"),
    ],
)
def test_wire_bad_match_chain_names_the_field(edit: Any, field: str) -> None:
    doc = _match_doc(chain=True)
    edit(doc)
    with pytest.raises(InvalidInput) as info:
        wire.from_dict(Match, doc)
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.pop("scope"), "match.scope"),
        (lambda d: d.__setitem__("extra", 1), "match.extra"),
        (lambda d: d.__setitem__("layout_id", "ab"), "match.layout_id"),
        (lambda d: d.__setitem__("layout_id", "XY" * 32), "match.layout_id"),
        (lambda d: d["names"].__setitem__(0, d["names"][0][:-4]), "match.names[0]"),
        (lambda d: d["names"].__setitem__(0, d["names"][0][:-1] + "="), "match.names[0]"),
        (lambda d: d["names"].__setitem__(0, d["names"][0][:-1] + "\u00e9"), "match.names[0]"),
        (lambda d: d["names"].__setitem__(0, "00" * 54), "match.names[0]"),
        (lambda d: d["names"].__setitem__(0, ["00" * 54]), "match.names[0]"),
        (lambda d: d.__setitem__("prompt_tokens", -3), "match.prompt_tokens"),
        (lambda d: d.__setitem__("prompt_tokens", True), "match.prompt_tokens"),
        (lambda d: d["resume"].__setitem__("reason", "NOPE"), "match.resume.reason"),
        (lambda d: d["tiers"].__setitem__(0, "h."), "match.tiers[0]"),
        (lambda d: d["tiers"].__setitem__(0, d["tiers"][0][:-1]), "match.tiers"),
        (lambda d: d["tier_names"].append("HOST"), "match.tier_names[1]"),
        (lambda d: d["tier_names"].__setitem__(0, "host"), "match.tier_names[0]"),
        (lambda d: d["resume"]["pages"][0].append(-1), "match.resume.pages[0][1]"),
        (lambda d: d["boundaries"].append(True), "match.boundaries[1]"),
        (lambda d: d["scope"].__setitem__("tenant", 7), "match.scope.tenant"),
        (lambda d: d["scope"].__setitem__("tenant", "\udc80"), "match.scope.tenant"),
    ],
)
def test_wire_bad_match_names_the_field(edit: Any, field: str) -> None:
    doc = _match_doc()
    edit(doc)
    with pytest.raises(InvalidInput) as info:
        wire.from_dict(Match, doc)
    assert info.value.field == field, str(info.value)


def _lease_doc() -> dict[str, Any]:
    shape = (Region(0, "KEY", 0, 64), Region(0, "VALUE", 64, 64))
    rows = tuple(LeaseRow(bytes([i]) * 54, True, HostLocation("seg", i * 128, 128), shape, Delivery.READY)
                 for i in range(3))
    lease = Lease("L", MemoryKind.HOST, LeaseMode.READ, Selection.NAMED, 10.0, 0.0, rows)
    return through_json(wire.to_dict(lease, now=0.0))


def test_wire_lease_writes_each_page_shape_once() -> None:
    doc = _lease_doc()
    cols = doc["rows"]
    assert len(cols["shapes"]) == 1 and cols["shape"] == [0, 0, 0]
    assert cols["segments"] == ["seg"] and cols["delivery"] == ["READY"] and cols["state"] == "000"
    assert base64.b64decode(cols["names"]) == b"".join(bytes([i]) * 54 for i in range(3))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.__setitem__("shape", [0, 1, 0]), "lease.rows.shape[1]"),
        (lambda c: c.__setitem__("shape", [0, 0]), "lease.rows.shape"),
        (lambda c: c.__setitem__("state", "0x0"), "lease.rows.state"),
        (lambda c: c.__setitem__("present", "111 "), "lease.rows.present"),
        (lambda c: c.__setitem__("delivery", ["READY", "LOST"]), "lease.rows.delivery[1]"),
        (lambda c: c["shapes"][0][1].__setitem__(2, -64), "lease.rows.shapes[0][1]"),
        (lambda c: c["at"].__setitem__(2, [1, 0, 128]), "lease.rows.at[2]"),
        (lambda c: c["at"].__setitem__(2, [0, 0]), "lease.rows.at[2]"),
        (lambda c: c["at"].__setitem__(0, {"pool": "p"}), "lease.rows.at[0].device"),
        (lambda c: c.pop("segments"), "lease.rows.segments"),
        (lambda c: c.__setitem__("extra", 1), "lease.rows.extra"),
        (lambda c: c.__setitem__("names", c["names"][:-4]), "lease.rows.names"),
    ],
)
def test_wire_bad_lease_rows_name_the_field(edit: Any, field: str) -> None:
    doc = _lease_doc()
    edit(doc["rows"])
    with pytest.raises(InvalidInput) as info:
        wire.from_dict(Lease, doc)
    assert info.value.field == field, str(info.value)


def test_wire_layout_id_must_match_the_layout() -> None:
    doc = wire.to_dict(full_attention("w@1", 1, 1, 16))
    doc["layout_id"] = "00" * 32
    with pytest.raises(InvalidInput) as info:
        wire.from_dict(PageLayout, doc)
    assert info.value.field == "page_layout.layout_id"
    doc = wire.to_dict(full_attention("w@1", 1, 1, 16))
    doc["tokens_per_page"] = "16"
    with pytest.raises(InvalidInput) as info:
        wire.from_dict(PageLayout, doc)
    assert info.value.field == "page_layout.tokens_per_page"


def test_wire_lease_ttl_must_be_finite() -> None:
    lease = Lease("a", MemoryKind.HOST, LeaseMode.READ, Selection.NAMED, 5.0, 5.0, ())
    for junk in (float("inf"), float("nan"), -1.0, "5"):
        doc = wire.to_dict(lease, now=0.0)
        doc["ttl_s"] = junk
        with pytest.raises(InvalidInput) as info:
            wire.from_dict(Lease, doc)
        assert info.value.field == "lease.ttl_s"


def test_wire_refuses_types_without_a_form() -> None:
    with pytest.raises(InvalidInput):
        wire.to_dict(object())
    with pytest.raises(InvalidInput):
        wire.from_dict(dict, {})
    with pytest.raises(InvalidInput) as info:
        wire.from_json(Scope, b"\xff{")
    assert info.value.field == "scope"


# ---- errors --------------------------------------------------------------------------------


def _error_classes() -> list[type[KvbankError]]:
    return [c for c in vars(errors).values()
            if isinstance(c, type) and issubclass(c, KvbankError) and c.__module__ == errors.__name__]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_wire_error_round_trips_to_the_same_class(cls: type[KvbankError]) -> None:
    exc = cls("scope.tenant: must be a string, got int")
    doc = through_json(wire.error_to_dict(exc))
    assert doc == {"type": cls.__name__, "field": "scope.tenant", "message": str(exc)}
    back = wire.error_from_dict(doc)
    assert type(back) is cls and str(back) == str(exc) and back.field == "scope.tenant"


def test_wire_error_field_given_explicitly_or_absent() -> None:
    assert errors.InvalidInput("no field here").field is None
    assert errors.InvalidInput("row name: 3 bytes", field="names[2]").field == "names[2]"
    back = wire.error_from_dict({"type": "FutureError", "field": None, "message": "m"})
    assert type(back) is KvbankError and "FutureError" in str(back)
    bad: object
    for bad in ({"type": "InvalidInput"}, {"type": 1, "field": None, "message": ""},
                {"type": "InvalidInput", "field": 3, "message": ""}, [], None):
        with pytest.raises(InvalidInput):
            wire.error_from_dict(bad)


def test_wire_row_info_sets_cross_as_sorted_lists() -> None:
    info = RowInfo(b"\x01" * 54, 10, frozenset({TierKind.DISK, TierKind.HOST}), 1.5,
                   frozenset({"b", "a"}), True)
    doc = wire.to_dict(info)
    assert doc["tiers"] == sorted(["DISK", "HOST"]) and doc["holders"] == ["a", "b"]
    assert wire.from_dict(RowInfo, through_json(doc)) == info
    with pytest.raises(InvalidInput) as e:
        wire.from_dict(RowInfo, {**doc, "tiers": "HOST"})
    assert e.value.field == "row_info.tiers"
    with pytest.raises(InvalidInput) as e:
        wire.from_dict(EvictResult, {"evicted": ["00"], "locked": [], "missing": [], "pinned": []})
    assert e.value.field == "evict_result.evicted[0]"


def test_split_cuts_any_count_of_names_exactly() -> None:
    """Names are cut with one C call up to 4,096 of them, by slicing beyond: the same."""
    from kvbank.wire.columns import split

    for n in (0, 1, 3, 4096, 4097, 5000):
        raw = bytes(i % 251 for i in range(n * 54))
        assert split(raw, 54) == tuple(raw[i : i + 54] for i in range(0, len(raw), 54))
