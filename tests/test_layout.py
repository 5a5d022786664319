"""Layouts: validation, derived regions, canonical encoding and golden layout ids."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank import builders as B
from kvbank import layout as L
from kvbank.errors import InvalidInput, KvbankError, LayoutError, PageSizeMismatch
from tests.golden_specs import DATA, golden_layouts

GOLDEN = json.loads((DATA / "layout_ids_golden.json").read_text())


# ---- golden ids ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_layout_id_matches_golden(name: str) -> None:
    """A layout's id never changes without a LAYOUT_ID_VERSION bump (or old pages mismatch)."""
    built = golden_layouts()[name]
    assert built.layout_id_hex == GOLDEN[name]["layout_id"]
    assert built.to_dict() == GOLDEN[name]["layout"]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_layout_from_dict_reproduces_golden_id(name: str) -> None:
    parsed = L.PageLayout.from_dict(GOLDEN[name]["layout"])
    assert parsed.layout_id_hex == GOLDEN[name]["layout_id"]
    assert parsed == golden_layouts()[name]


def test_golden_covers_every_builder() -> None:
    assert set(golden_layouts()) == set(GOLDEN)


def test_layout_id_equal_across_processes_and_hash_seeds() -> None:
    """Ids are deterministic: no dependence on PYTHONHASHSEED, dict order or the process."""
    script = (
        "import json; from tests.golden_specs import golden_layouts, keys_doc;"
        "print(json.dumps({'ids': {n: l.layout_id_hex for n, l in golden_layouts().items()},"
        " 'keys': keys_doc()}, sort_keys=True))"
    )
    outs = []
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.append(res.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert json.loads(outs[0])["ids"] == {n: v["layout_id"] for n, v in GOLDEN.items()}


def test_layout_id_ignores_shard_index_but_not_shard_count() -> None:
    a = B.full_attention("m", 2, 8, 64, shard_count=4, shard_index=0)
    assert a.with_shard(3).layout_id == a.layout_id
    assert B.full_attention("m", 2, 8, 64, shard_count=2).layout_id != a.layout_id


@dataclasses.dataclass(frozen=True, slots=True)
class _FutureBuffer(L.BufferSpec):
    """A later build's BufferSpec with one more defaulted field."""

    compression_hint: str = "none"


@dataclasses.dataclass(frozen=True, slots=True)
class _FutureLayout(L.PageLayout):
    prefill_chunk: int = 0


def test_layout_new_defaulted_field_keeps_old_ids() -> None:
    """Adding a field with a default must keep every old id (old pages stay hits)."""
    old = golden_layouts()["gqa-llama3-8b-tp2"]
    fields = {f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.init}
    new = _FutureLayout(**fields)
    assert new.layout_id == old.layout_id
    assert _FutureLayout(**{**fields, "prefill_chunk": 512}).layout_id != old.layout_id
    buffers = tuple(
        _FutureBuffer(**{f.name: getattr(b, f.name) for f in dataclasses.fields(b)})
        for b in old.buffers
    )
    assert dataclasses.replace(old, buffers=buffers).layout_id == old.layout_id
    changed = (dataclasses.replace(buffers[0], compression_hint="zstd"), *buffers[1:])
    assert dataclasses.replace(old, buffers=changed).layout_id != old.layout_id


# ---- derived regions ---------------------------------------------------------------------


def test_layout_regions_are_aligned_disjoint_and_fill_the_page() -> None:
    lay = golden_layouts()["hybrid-mamba"]
    for g, regions in enumerate(lay.regions):
        end = 0
        for r in regions:
            assert r.offset % L.ALIGN == 0
            assert r.offset >= end
            end = r.offset + r.nbytes
        assert end <= lay.group_page_bytes[g] < end + L.ALIGN
    attn = lay.region(0, 3, L.Role.KEY)
    assert attn.nbytes == 16 * 8 * 128 * 2
    ssm = lay.region(1, 0, L.Role.SSM_STATE)
    assert ssm.nbytes == 128 * 64 * 128 * 4  # one snapshot, float32, not per token
    assert lay.page_bytes == sum(lay.group_page_bytes)


def test_layout_untransferred_buffer_takes_no_bytes() -> None:
    lay = golden_layouts()["mla-deepseek"]
    assert all(r.buffer.role is L.Role.KEY for r in lay.regions[0])
    assert lay.group_page_bytes[0] == 61 * 64 * 576 * 2
    with pytest.raises(LayoutError, match="INDEX_KEY"):
        lay.region(0, 0, L.Role.INDEX_KEY)


def test_layout_fp4_packs_two_values_a_byte_with_block_scales() -> None:
    lay = golden_layouts()["gqa-nvfp4"]
    k = lay.region(0, 0, L.Role.KEY)
    s = lay.region(0, 0, L.Role.KEY_SCALE)
    assert k.nbytes == 16 * 8 * 64 and s.nbytes == 16 * 8 * 8
    assert lay.quant is L.QuantMode.NVFP4


# ---- validation --------------------------------------------------------------------------


def _layout(**over: object) -> L.PageLayout:
    base: dict[str, object] = {
        "model": "m",
        "tokens_per_page": 16,
        "groups": (L.LayerGroup(L.GroupKind.ATTENTION, (0,)),),
        "buffers": (L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 8)),),
    }
    base.update(over)
    return L.PageLayout(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: L.BufferSpec(0, "ROTARY", "bfloat16", (1,)), "role"),  # type: ignore[arg-type]
        (lambda: L.BufferSpec(0, L.Role.KEY, "float12", (1,)), "dtype"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (0, 4)), "shape"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (-3,)), "shape"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", ()), "shape"),
        (lambda: L.BufferSpec(-1, L.Role.KEY, "bfloat16", (1,)), "layer"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=2), "head_axis"),
        (lambda: _layout(tokens_per_page=0), "tokens_per_page"),
        (lambda: _layout(tokens_per_page=-16), "tokens_per_page"),
        (lambda: _layout(model=""), "model"),
        (
            lambda: _layout(buffers=(L.BufferSpec(5, L.Role.KEY, "bfloat16", (1,)),)),
            "no layer group",
        ),
        (
            lambda: _layout(
                buffers=(
                    L.BufferSpec(0, L.Role.KEY, "bfloat16", (1,)),
                    L.BufferSpec(0, L.Role.KEY, "float16", (1,)),
                )
            ),
            "duplicate",
        ),
        (lambda: _layout(shard_count=2, shard_index=2), "shard_index"),
        (lambda: _layout(shard_count=0), "shard_count"),
        (
            lambda: _layout(
                groups=(L.LayerGroup(L.GroupKind.STATE, (0,)),),
            ),
            "STATE",
        ),
        (lambda: L.LayerGroup(L.GroupKind.STATE, (0,), window=8), "window"),
        (lambda: L.LayerGroup(L.GroupKind.ATTENTION, (0,), sink_tokens=4), "sink"),
        (lambda: L.LayerGroup(L.GroupKind.ATTENTION, (0, 0)), "duplicate layer"),
        (lambda: B.full_attention("m", 2, 6, 64, shard_count=4), "num_kv_heads"),
        (lambda: L.PageLayout.from_dict({"model": "m", "bogus": 1}), "bogus"),
    ],
)
def test_layout_validation_names_the_field(make: object, field: str) -> None:
    with pytest.raises(LayoutError, match=field):
        make()  # type: ignore[operator]


def test_layout_error_is_a_value_error_and_a_kvbank_error() -> None:
    with pytest.raises(ValueError):
        L.BufferSpec(0, L.Role.KEY, "float12", (1,))
    assert issubclass(LayoutError, InvalidInput) and issubclass(LayoutError, KvbankError)


# ---- split declarations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), heads=4), "head_axis"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), sections=(1, 1)), "head_axis"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, heads=0), "heads"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, heads=True),
         "heads"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, sections=(1, 2)),
         "sections"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, sections=(2, 0)),
         "sections"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, sections=5),  # type: ignore[arg-type]
         "sections"),
        (lambda: L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 4), head_axis=0, heads=4,
                              sections=(1, 1)), "heads"),
        # 2 heads a rank at TP 4 is 8 heads, not 6; 6 heads neither divide nor duplicate
        (lambda: _layout(buffers=(L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 8), head_axis=0,
                                               heads=6),), shard_count=4), r"buffers\[0\]\.heads"),
        (lambda: _layout(buffers=(L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 8), head_axis=0,
                                               heads=4),), shard_count=4), r"buffers\[0\]\.heads"),
        (lambda: B.full_attention("m", 2, 8, 64, shard_count=12), "num_kv_heads"),
    ],
)
def test_layout_split_validation_names_the_field(make: object, field: str) -> None:
    with pytest.raises(LayoutError, match=field):
        make()  # type: ignore[operator]


def test_layout_split_kinds() -> None:
    lay = golden_layouts()["hybrid-mamba2-sectioned-tp2"]
    conv = next(b for b in lay.buffers if b.role is L.Role.CONV_STATE)
    ssm = next(b for b in lay.buffers if b.role is L.Role.SSM_STATE)
    assert conv.split is L.Split.SECTIONED and conv.segments(2) == (8192, 256, 256)
    assert ssm.split is L.Split.HEAD and ssm.segments(2) == (128,)
    assert golden_layouts()["mla-deepseek"].buffers[0].split is L.Split.REPLICATED
    # sections from JSON lists are tuples again
    assert L.PageLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_layout_logical_id_is_the_tp1_layout_id() -> None:
    """Rows stored at TP 2 and TP 16 of one model layout share the logical id, which is the
    (golden) id of the same layout at TP 1."""
    tp2 = golden_layouts()["gqa-llama3-8b-tp2"]
    tp16 = golden_layouts()["gqa-llama3-8b-tp16-duplicated"]
    tp1 = B.full_attention("meta-llama/Meta-Llama-3-8B@main", 32, 8, 128)
    assert tp2.logical_id == tp16.logical_id == tp1.layout_id == tp1.logical_id
    assert tp2.layout_id != tp16.layout_id != tp1.layout_id
    assert tp16.with_shard(7).logical_id == tp16.logical_id
    for name, lay in golden_layouts().items():
        assert lay.unsharded().layout_id == lay.logical_id, name
        if lay.shard_count == 1:
            assert lay.logical_id == lay.layout_id, name


# ---- properties ---------------------------------------------------------------------------

_dtypes = st.sampled_from(sorted(L.DTYPE_ITEMSIZE))
_shapes = st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn) -> L.PageLayout:
    n_layers = draw(st.integers(1, 6))
    n_state = draw(st.integers(0, n_layers - 1))
    state_layers = tuple(range(n_state))
    attn_layers = tuple(range(n_state, n_layers))
    window = draw(st.none() | st.integers(1, 4096))
    sinks = draw(st.integers(0, 8)) if window else 0
    groups = [L.LayerGroup(L.GroupKind.ATTENTION, attn_layers, window=window, sink_tokens=sinks)]
    if state_layers:
        groups.append(L.LayerGroup(L.GroupKind.STATE, state_layers))
    buffers = []
    for layer in attn_layers:
        for role in draw(
            st.lists(
                st.sampled_from([L.Role.KEY, L.Role.VALUE, L.Role.KEY_SCALE, L.Role.INDEX_KEY]),
                min_size=1,
                max_size=3,
                unique=True,
            )
        ):
            shape = draw(_shapes)
            buffers.append(
                L.BufferSpec(
                    layer,
                    role,
                    draw(_dtypes),
                    shape,
                    head_axis=draw(st.none() | st.integers(0, len(shape) - 1)),
                    transferred=draw(st.booleans()),
                )
            )
    for layer in state_layers:
        buffers.append(L.BufferSpec(layer, L.Role.SSM_STATE, draw(_dtypes), draw(_shapes)))
    shard_count = draw(st.integers(1, 8))
    return L.PageLayout(
        model=draw(st.text(min_size=1, max_size=20)),
        tokens_per_page=draw(st.integers(1, 256)),
        groups=tuple(groups),
        buffers=tuple(buffers),
        quant=draw(st.sampled_from(L.QuantMode)),
        shard_count=shard_count,
        shard_index=draw(st.integers(0, shard_count - 1)),
    )


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_canonical_encoding_invariants(lay: L.PageLayout) -> None:
    raw = lay.canonical()
    doc = json.loads(raw)
    # sorted keys, no whitespace, version inside, shard index out, defaults out
    assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert doc["layout_id_version"] == L.LAYOUT_ID_VERSION
    assert "shard_index" not in doc
    assert ("quant" in doc) == (lay.quant is not L.QuantMode.NONE)
    assert all("transferred" not in b or b["transferred"] is False for b in doc["buffers"])
    # round trip through the JSON-ready form keeps equality and the id
    again = L.PageLayout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert again == lay and again.layout_id == lay.layout_id
    assert lay.with_shard(0).layout_id == lay.layout_id
    assert dataclasses.replace(lay, tokens_per_page=lay.tokens_per_page + 1).layout_id != lay.layout_id
    assert dataclasses.replace(lay, model=lay.model + "x").layout_id != lay.layout_id


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_regions_cover_exactly_transferred_buffers(lay: L.PageLayout) -> None:
    for g, group in enumerate(lay.groups):
        want = [b for b in lay.buffers if b.layer in group.layers and b.transferred]
        assert [r.buffer for r in lay.regions[g]] == want
        per = lay.tokens_per_page if group.kind is L.GroupKind.ATTENTION else 1
        assert all(r.nbytes == per * r.buffer.item_bytes for r in lay.regions[g])
        assert lay.group_page_bytes[g] % L.ALIGN == 0


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_padding_and_regions_tile_each_group_page(lay: L.PageLayout) -> None:
    """Regions and padding cover every byte of a group's page once, in order, and no gap
    is empty (kernels zero the padding, so a missed byte would leak stale memory)."""
    for g in range(len(lay.groups)):
        spans = sorted([(r.offset, r.offset + r.nbytes) for r in lay.regions[g]]
                       + list(lay.padding(g)))
        assert all(start < end for start, end in lay.padding(g))
        assert [s for s, _ in spans] == [0, *[e for _, e in spans[:-1]]][: len(spans)]
        assert (spans[-1][1] if spans else 0) == lay.group_page_bytes[g]
    with pytest.raises(LayoutError, match="group"):
        lay.padding(len(lay.groups))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["model", "tokens_per_page", "groups", "buffers", "quant", "shard_count",
                         "shard_index", "extra"]),
        st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                  st.lists(st.dictionaries(st.text(max_size=6), st.integers(-2, 4), max_size=4), max_size=2)),
    )
)
def test_layout_from_dict_refuses_junk_with_layout_error(doc: dict[str, object]) -> None:
    """Whatever a client sends, a bad declaration is a LayoutError, never a crash."""
    with contextlib.suppress(LayoutError):
        L.PageLayout.from_dict(doc)


# ---- builders take torch dtypes and quant names; layers in two groups; typed views ----------


def test_builders_take_quant_names_as_the_docs_spell_them() -> None:
    """quant="FP8" builds the FP8 layout (it used to fail with "unsupported FP8")."""
    for name in ("FP8", "INT8", "NVFP4", "MXFP4", "NONE"):
        by_name = B.full_attention("m", 2, 8, 64, quant=name)
        by_enum = B.full_attention("m", 2, 8, 64, quant=L.QuantMode[name])
        assert by_name.layout_id == by_enum.layout_id
        assert by_name.quant is L.QuantMode[name]
    assert {b.role for b in B.full_attention("m", 1, 8, 64, quant="FP8").buffers} == {
        L.Role.KEY, L.Role.VALUE, L.Role.KEY_SCALE, L.Role.VALUE_SCALE
    }
    with pytest.raises(LayoutError, match="quant"):
        B.sliding_window("m", 2, 8, 64, window=8, quant="fp9")


def test_builders_and_buffers_take_torch_dtypes_with_the_same_id() -> None:
    assert (
        B.full_attention("m", 2, 8, 64, dtype=torch.float16).layout_id
        == B.full_attention("m", 2, 8, 64, dtype="float16").layout_id
    )
    mamba_t = B.hybrid_mamba("m", [1], [0], 2, 8, conv_shape=(4, 3), ssm_shape=(2, 4, 8),
                             dtype=torch.bfloat16, state_dtype=torch.float32)
    mamba_s = B.hybrid_mamba("m", [1], [0], 2, 8, conv_shape=(4, 3), ssm_shape=(2, 4, 8))
    assert mamba_t.layout_id == mamba_s.layout_id
    spec = L.BufferSpec(0, L.Role.KEY, torch.float8_e4m3fn, (2, 4))  # type: ignore[arg-type]
    assert spec.dtype == "float8_e4m3fn"
    for bad in (torch.complex64, "torch.float16", 16):
        with pytest.raises(LayoutError, match="dtype"):
            B.full_attention("m", 2, 8, 64, dtype=bad)  # type: ignore[arg-type]


def _both_kinds_layout() -> L.PageLayout:
    """Layer 0 is attention and recurrent (FalconH1-style); layer 1 is attention only."""
    return L.PageLayout(
        model="falcon-h1-like",
        tokens_per_page=16,
        groups=(
            L.LayerGroup(L.GroupKind.ATTENTION, (0, 1)),
            L.LayerGroup(L.GroupKind.STATE, (0,)),
        ),
        buffers=(
            L.BufferSpec(0, L.Role.KEY, "float32", (2, 8)),
            L.BufferSpec(0, L.Role.VALUE, "float32", (2, 8)),
            L.BufferSpec(0, L.Role.CONV_STATE, "float32", (24, 4)),
            L.BufferSpec(0, L.Role.SSM_STATE, "float32", (4, 8, 16)),
            L.BufferSpec(1, L.Role.KEY, "float32", (2, 8)),
            L.BufferSpec(1, L.Role.VALUE, "float32", (2, 8)),
        ),
    )


def test_layout_layer_in_an_attention_and_a_state_group() -> None:
    lay = _both_kinds_layout()
    assert [(r.buffer.layer, r.buffer.role) for r in lay.regions[0]] == [
        (0, L.Role.KEY), (0, L.Role.VALUE), (1, L.Role.KEY), (1, L.Role.VALUE)
    ]
    assert [(r.buffer.layer, r.buffer.role) for r in lay.regions[1]] == [
        (0, L.Role.CONV_STATE), (0, L.Role.SSM_STATE)
    ]
    assert lay.group_bytes(1) == 24 * 4 * 4 + 4 * 8 * 16 * 4
    assert lay.group_of(0, L.Role.KEY) == 0
    assert lay.group_of(0, L.Role.SSM_STATE) == 1
    assert lay.group_of(1) == 0
    with pytest.raises(LayoutError, match="name the role"):
        lay.group_of(0)
    with pytest.raises(LayoutError, match="no group"):
        lay.group_of(1, L.Role.CONV_STATE)
    # The same layout spelled through to_dict/from_dict keeps its id.
    assert L.PageLayout.from_dict(lay.to_dict()).layout_id == lay.layout_id


@pytest.mark.parametrize(
    ("groups", "buffers", "field"),
    [
        (  # one layer in two ATTENTION groups
            (L.LayerGroup(L.GroupKind.ATTENTION, (0,)), L.LayerGroup(L.GroupKind.ATTENTION, (0,))),
            (L.BufferSpec(0, L.Role.KEY, "float32", (1,)),),
            "at most one group per kind",
        ),
        (  # a state role for a layer that is only in an ATTENTION group
            (L.LayerGroup(L.GroupKind.ATTENTION, (0,)),),
            (L.BufferSpec(0, L.Role.KEY, "float32", (1,)),
             L.BufferSpec(0, L.Role.SSM_STATE, "float32", (1,))),
            "SSM_STATE",
        ),
        (  # a STATE group whose layer only has attention buffers
            (L.LayerGroup(L.GroupKind.ATTENTION, (0,)), L.LayerGroup(L.GroupKind.STATE, (0,))),
            (L.BufferSpec(0, L.Role.KEY, "float32", (1,)),),
            "no buffers",
        ),
        (  # (layer, role) stays unique even across groups
            (L.LayerGroup(L.GroupKind.ATTENTION, (0,)), L.LayerGroup(L.GroupKind.STATE, (0,))),
            (L.BufferSpec(0, L.Role.CONV_STATE, "float32", (1,)),
             L.BufferSpec(0, L.Role.CONV_STATE, "float32", (2,)),
             L.BufferSpec(0, L.Role.KEY, "float32", (1,))),
            "duplicate",
        ),
    ],
)
def test_layout_two_kind_membership_refusals(
    groups: tuple[L.LayerGroup, ...], buffers: tuple[L.BufferSpec, ...], field: str
) -> None:
    with pytest.raises(LayoutError, match=field):
        L.PageLayout("m", 16, groups, buffers)


def test_layout_views_are_typed_zero_copy_and_match_the_kernels() -> None:
    """views() reads exactly the bytes gather_pages wrote, and writes land in the page."""
    from kvbank.kernels.pages import gather_pages

    lay = _both_kinds_layout()
    gen = torch.Generator().manual_seed(3)
    pool = {
        (b.layer, b.role): torch.randn((5, 16, *b.shape), generator=gen)
        for b in lay.buffers if b.role not in L.STATE_ROLES
    }
    pages = torch.empty((3, lay.group_bytes(0)), dtype=torch.uint8)
    gather_pages(pool, [4, 0, 2], lay, 0, pages)
    views = lay.views(pages, 0)
    assert set(views) == set(pool)
    for key, view in views.items():
        assert view.dtype == torch.float32
        assert view.shape == (3, 16, *pool[key].shape[2:])
        assert torch.equal(view, pool[key][[4, 0, 2]])
        start = view.data_ptr() - pages.data_ptr()
        assert 0 <= start < pages.numel() and start % L.ALIGN == 0  # a view, not a copy
    views[(1, L.Role.VALUE)][1].fill_(7.0)
    assert torch.equal(lay.views(pages, 0)[(1, L.Role.VALUE)][1], torch.full((16, 2, 8), 7.0))

    state = torch.zeros(lay.group_bytes(1), dtype=torch.uint8)
    one = lay.views(state, 1)
    assert one[(0, L.Role.CONV_STATE)].shape == (24, 4)
    assert one[(0, L.Role.SSM_STATE)].shape == (4, 8, 16)
    one[(0, L.Role.SSM_STATE)].fill_(1.5)
    region = lay.region(1, 0, L.Role.SSM_STATE)
    assert torch.equal(
        state[region.offset : region.offset + region.nbytes].view(torch.float32),
        torch.full((4 * 8 * 16,), 1.5),
    )


@pytest.mark.parametrize("how", ["views", "page_rows"])
def test_layout_views_refuse_bad_pages(how: str) -> None:
    """``page_rows`` (what a byte kernel reads: the checked rows, no typed view) refuses
    exactly what ``views`` refuses."""
    lay = _both_kinds_layout()
    size = lay.group_bytes(0)
    check = getattr(lay, how)
    with pytest.raises(PageSizeMismatch, match="pages"):
        check(torch.zeros((2, size - 64), dtype=torch.uint8), 0)
    with pytest.raises(InvalidInput, match="uint8"):
        check(torch.zeros((2, size // 4), dtype=torch.float32), 0)
    with pytest.raises(InvalidInput, match="strided"):
        check(torch.zeros((2, size + 8), dtype=torch.uint8)[:, :size], 0)
    with pytest.raises(InvalidInput, match="uint8 tensor"):
        check(bytearray(size), 0)
    with pytest.raises(LayoutError, match="group"):
        check(torch.zeros((1, size), dtype=torch.uint8), 2)


def test_layout_page_rows_are_the_pages_as_rows() -> None:
    lay = _both_kinds_layout()
    size = lay.group_bytes(0)
    pages = torch.arange(3 * size, dtype=torch.int64).to(torch.uint8).view(3, size)
    rows = lay.page_rows(pages, 0)
    assert rows.data_ptr() == pages.data_ptr() and rows.shape == (3, size)
    one = lay.page_rows(pages[1], 0)
    assert one.shape == (1, size) and torch.equal(one[0], pages[1])


@pytest.mark.parametrize("quant", ["FP8", "NVFP4", "MXFP4", "INT8"])
def test_layout_views_of_quantized_pages_have_the_declared_dtypes(quant: str) -> None:
    lay = B.full_attention("m", 1, 2, 64, quant=quant)
    pages = torch.zeros((2, lay.group_bytes(0)), dtype=torch.uint8)
    views = lay.views(pages, 0)
    for b in lay.buffers:
        v = views[(b.layer, b.role)]
        assert str(v.dtype) == f"torch.{b.dtype}"
        assert v.shape == (2, lay.tokens_per_page, *b.shape)
        assert v.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()
