"""The local channel's frames: round trips of frames and of the result forms, and hostile
bytes refused as :class:`InvalidInput` (nothing else escapes)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.errors import Busy, InvalidInput, KvbankError, LeaseExpired
from kvbank.keys import ROW_NAME_BYTES, Scope
from kvbank.lender.base import CommitResult
from kvbank.lender.resume import Obstacle, ResumeBound
from kvbank.results import FetchResult, Match, Presence
from kvbank.tiers.base import TierKind
from kvbank.wire import local as fr

DTYPES = ["<i1", "<u1", "<i4", "<i8", "<f8", "<u8"]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: st.lists(st.integers(0, 100), max_size=40).map(lambda xs: np.asarray(xs, dtype=dt)))
columns = st.lists(st.one_of(st.binary(max_size=100), st.text(max_size=30), arrays), max_size=12)


def _roundtrip(kind: fr.Kind, op: int, cols: list[fr.Column]) -> tuple[fr.Kind, int, list[fr.Column]]:
    raw = fr.encode_bytes(kind, op, cols)
    k, o, n, body = fr.decode_header(raw[: fr.HEADER.size])
    assert body == len(raw) - fr.HEADER.size
    return k, o, fr.decode_body(raw[fr.HEADER.size :], n)


@given(kind=st.sampled_from(fr.Kind), op=st.integers(0, 65535), cols=columns)
@settings(max_examples=200, deadline=None)
def test_a_frame_comes_back_column_for_column(kind: fr.Kind, op: int, cols: list[fr.Column]) -> None:
    k, o, got = _roundtrip(kind, op, cols)
    assert (k, o, len(got)) == (kind, op, len(cols))
    for a, b in zip(cols, got, strict=True):
        if isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray) and b.dtype == a.dtype and b.tolist() == a.tolist()
        else:
            assert type(a) is type(b) and a == b


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_hostile_bytes_are_refused_as_invalid_input(data: bytes) -> None:
    try:
        if len(data) >= fr.HEADER.size:
            _, _, n, _ = fr.decode_header(data[: fr.HEADER.size])
            fr.decode_body(data[fr.HEADER.size :], n)
        else:
            fr.decode_header(data)
    except InvalidInput:
        pass


@given(cols=columns, cut=st.integers(0, 10_000))
@settings(max_examples=200, deadline=None)
def test_a_truncated_body_is_refused(cols: list[fr.Column], cut: int) -> None:
    raw = fr.encode_bytes(fr.Kind.REQUEST, 2, cols)
    _, _, n, body = fr.decode_header(raw[: fr.HEADER.size])
    if body == 0:
        return
    short = raw[fr.HEADER.size : fr.HEADER.size + cut % body]
    with pytest.raises(InvalidInput):
        fr.decode_body(short, n)


def test_headers_refused_before_any_body() -> None:
    good = fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, 2, 1, 8)
    fr.decode_header(good)
    for bad, why in ((b"XX" + good[2:], "magic"), (good[:2] + b"\x09" + good[3:], "version"),
                     (fr.HEADER.pack(fr.MAGIC, fr.VERSION, 7, 2, 1, 8), "kind"),
                     (fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, 2, 1, fr.MAX_FRAME_BYTES + 1), "limit"),
                     (fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, 2, 500, 8000), "columns"),
                     (fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, 2, 3, 8), "cannot describe"),
                     (good[:5], "header is")):
        with pytest.raises(InvalidInput, match=why):
            fr.decode_header(bad)


def test_a_column_of_unknown_dtype_or_ragged_items_is_refused() -> None:
    with pytest.raises(InvalidInput, match="unknown dtype"):
        fr.decode_body(struct.pack("<B3xI", 99, 0), 1)
    with pytest.raises(InvalidInput, match="whole"):  # 3 bytes of int32
        fr.decode_body(struct.pack("<B3xI", 4, 3) + b"abc\0\0\0\0\0", 1)
    with pytest.raises(InvalidInput, match="UTF-8"):
        fr.decode_body(struct.pack("<B3xI", 1, 2) + b"\xff\xfe" + b"\0" * 6, 1)
    with pytest.raises(InvalidInput, match="after the last column"):
        fr.decode_body(struct.pack("<B3xI", 0, 0) + b"\0" * 8, 1)


def test_a_typed_error_crosses_as_its_own_class() -> None:
    for exc in (LeaseExpired("lease_id: gone", field="lease_id"), Busy("node: draining"),
                InvalidInput("tokens: bad", field="tokens")):
        k, _, cols = _roundtrip(fr.Kind.ERROR, 5, fr.error_columns(exc))
        got = fr.raise_error(cols)
        assert k is fr.Kind.ERROR and type(got) is type(exc) and str(got) == str(exc)
        assert got.field == exc.field
    unknown = fr.raise_error(["FromTheFuture", "", "x"])
    assert type(unknown) is KvbankError and "FromTheFuture" in str(unknown)


def _name(i: int) -> bytes:
    return i.to_bytes(4, "little") * (ROW_NAME_BYTES // 4) + b"\x01" * (ROW_NAME_BYTES % 4)


tiers_st = st.sampled_from([None, *TierKind])


@st.composite
def matches(draw: st.DrawFn) -> Match:
    n_groups = draw(st.integers(1, 3))
    names, tiers, pages, rows = [], [], [], []
    for g in range(n_groups):
        n = draw(st.integers(0, 20))
        ns = tuple(_name(g * 100 + i) for i in range(n))
        names.append(ns)
        tiers.append(tuple(draw(tiers_st) for _ in range(n)))
        ps = tuple(sorted(draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n)))) if n else ()
        pages.append(ps)
        rows.append(tuple(ns[i] for i in ps))
    reason = draw(st.sampled_from([None, *Obstacle]))
    bound = ResumeBound(draw(st.integers(0, 500)), 500, 16, 31, draw(st.integers(0, 500)), tuple(pages),
                        tuple(rows), reason, draw(st.sampled_from([None, 0, 2])))
    via = draw(st.sampled_from([(), tuple(tuple(0 for _ in ns) for ns in names)]))
    scope = Scope(draw(st.text(max_size=5)), draw(st.text(max_size=5)), "")
    return Match(bytes(range(32)), scope, 500, bound, tuple(names), tuple(tiers),
                 tuple(draw(st.lists(st.integers(1, 500), max_size=5))), via)


@given(matches())
@settings(max_examples=100, deadline=None)
def test_a_match_comes_back_equal(m: Match) -> None:
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.MATCH, fr.match_columns(m))
    assert fr.match_from(cols) == m


@given(matches(), st.booleans())
@settings(max_examples=50, deadline=None)
def test_a_fetch_result_and_a_commit_come_back_equal(m: Match, complete: bool) -> None:
    r = FetchResult("f-1", tuple(m.resume.pages), tuple(() for _ in m.resume.pages), m.resume, 4096, complete)
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.ACK, fr.result_columns(r))
    assert fr.result_from(cols) == r
    c = CommitResult("l-1", tuple(n for g in m.names for n in g), (), (_name(7),))
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.COMMIT, fr.commit_columns(c))
    assert fr.commit_from(cols) == c


@pytest.mark.parametrize("tier", [TierKind.HOST, TierKind.DISK, None])
def test_a_one_group_match_of_one_tier_comes_back_equal(tier: TierKind | None) -> None:
    """The common shape (one group, every row in one tier, or all misses) takes the
    encoder's and decoder's one-group paths; it reads back as any other."""
    a = tuple(_name(i) for i in range(300))
    hit = 0 if tier is None else 300
    bound = ResumeBound(hit * 16, 4_801, 16, 300, hit * 16, (tuple(range(hit)),), (a[:hit],), None, None)
    m = Match(bytes(32), Scope("t"), 4_801, bound, (a,), ((tier,) * 300,), tuple(range(16, hit * 16 + 1, 16)), ())
    cols = fr.match_columns(m)
    assert fr.ints(cols, 7, "tiers").tolist() == [-1 if tier is None else fr._TIER_ID[id(tier)]] * 300
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.MATCH, cols)
    assert fr.match_from(cols) == m


def test_a_bounds_rows_that_lead_its_matchs_names_come_back_as_those_names() -> None:
    """The rows a resume bound needs are mostly its match's first names: decoded once and
    shared, not decoded again. Rows that are not (another group's, or none) come back
    equal all the same, and the tiers of long runs and of single rows alike."""
    a = tuple(_name(i) for i in range(1000))
    b = tuple(_name(5000 + i) for i in range(6))
    tiers = ((TierKind.HOST,) * 700 + (TierKind.DISK,) * 200 + (None,) * 100,
             (None, TierKind.HOST, None, TierKind.DISK, TierKind.DISK, None))
    bound = ResumeBound(700 * 16, 16_001, 16, 1000, 700 * 16, (tuple(range(700)), (1, 3)),
                        (a[:700], (b[1], b[3])), None, None)
    m = Match(bytes(32), Scope("t"), 16_001, bound, (a, b), tiers, tuple(range(16, 700 * 16 + 1, 16)), ())
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.MATCH, fr.match_columns(m))
    back = fr.match_from(cols)
    assert back == m
    assert all(r is n for r, n in zip(back.resume.rows[0], back.names[0], strict=False))
    assert back.resume.rows[1] == (b[1], b[3])


def test_a_presence_comes_back_equal() -> None:
    p = Presence(bytes(32), Scope("t"), 40, (0, 2), (((TierKind.HOST, None), (None,)), ((TierKind.DISK, None), ())),
                 (16, 0), 0)
    _, _, cols = _roundtrip(fr.Kind.OK, fr.Op.PRESENCE, fr.presence_columns(p))
    assert fr.presence_from(cols) == p


def test_a_match_form_with_counts_that_do_not_add_up_is_refused() -> None:
    m = Match(bytes(32), Scope(), 32, ResumeBound(0, 32, 16, 2, 0, ((),), ((),), None, None),
              ((_name(1), _name(2)),), ((TierKind.HOST, None),), (), ())
    cols = fr.match_columns(m)
    cols[5] = np.array([3], dtype="<i8")  # three names in a blob of two
    with pytest.raises(InvalidInput, match=r"match\.names"):
        fr.match_from(cols)
    cols = fr.match_columns(m)
    cols[7] = np.array([0, 9], dtype="<i1")  # no tier has code 9
    with pytest.raises(InvalidInput, match=r"match\.tiers"):
        fr.match_from(cols)
    with pytest.raises(InvalidInput, match=r"match\.prompt_tokens"):
        fr.match_from([*cols[:4], "not ints", *cols[5:]])


def test_a_lent_fetch_carries_its_checksums_and_an_ack_its_changed_rows() -> None:
    """A lent fetch's answer ends with each slot's xxh3-64 as a uint64 column (every bit
    kept: values past 2**63 too; 0 for none recorded), and an ACK carries the positions
    whose copies failed it after the positions read."""
    sums = np.array([0, 1, 2**63 + 5, 2**64 - 1], dtype="<u8")
    lent: list[fr.Column] = ["fid", np.arange(4, dtype="<i8"), np.zeros(4, "<i8"), np.arange(4, dtype="<i8"), "lease",
            np.array([9.5]), np.arange(4, dtype="<i8"), np.arange(4, dtype="<i8") * 4096,
            np.full(4, 4096, dtype="<i8"), sums]
    k, o, got = _roundtrip(fr.Kind.OK, fr.Op.FETCH, lent)
    assert (k, o, len(got)) == (fr.Kind.OK, fr.Op.FETCH, 10)
    back = fr.ints(got, 9, "slots.sums", 4)
    assert back.dtype == np.dtype("<u8") and back.tolist() == [0, 1, 2**63 + 5, 2**64 - 1]
    with pytest.raises(InvalidInput, match=r"slots\.sums"):
        fr.ints(got, 9, "slots.sums", 3)
    ack: list[fr.Column] = ["fid", "lease", np.array([0, 1, 3], dtype="<i8"), np.array([2], dtype="<i8")]
    _, o, got = _roundtrip(fr.Kind.REQUEST, fr.Op.ACK, ack)
    assert o == fr.Op.ACK and fr.ints(got, 2, "rows").tolist() == [0, 1, 3]
    assert fr.ints(got, 3, "changed").tolist() == [2]
