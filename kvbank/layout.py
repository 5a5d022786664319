"""Page layouts: what the bytes of a page are, declared once by the cache's owner.

Primitives:

- :class:`Role` — the closed set of buffer roles. An undeclared role is refused. It and
  the other vocabularies (:class:`Split`, :class:`GroupKind`, :class:`QuantMode`) live in
  :mod:`kvbank.roles` and are re-exported here.
- :class:`BufferSpec` — one region of a page: ``(layer, role, dtype, shape, head_axis,
  transferred, heads, sections)``. For an ``ATTENTION`` group ``shape`` is per token; for
  a ``STATE`` group it is the whole snapshot, and it is always one shard's shape.
  ``transferred=False`` buffers are rebuilt by the receiver: they take no bytes in the
  canonical page and never block a resume bound.
- :class:`Split` — how a buffer divides over tensor-parallel ranks, derived from its
  fields: ``REPLICATED`` (``head_axis=None``: every rank holds it all), ``HEAD``
  (``head_axis`` names the axis of heads; ``heads`` is the head count over all ranks,
  needed only when ranks outnumber heads and each head is then held by
  ``shard_count / heads`` consecutive ranks) or ``SECTIONED`` (``sections`` are one
  shard's lengths of consecutive sections along ``head_axis``, each split evenly on its
  own: Mamba-2's conv state holds x, B and C channels).
- :class:`LayerGroup` — layers that share a page table: ``ATTENTION`` (optional sliding
  ``window`` and ``sink_tokens``) or ``STATE`` (one snapshot per page boundary). A layer
  is in at most one group of each kind, so a layer that is both attention and recurrent
  (FalconH1-style) sits in one ``ATTENTION`` and one ``STATE`` group; each buffer goes to
  the group of its role's kind (:func:`role_kind`), and ``(layer, role)`` is unique.
- :class:`PageLayout` — model fingerprint, tokens per page, groups, buffers, quant mode,
  shard count and index. Derived: each group's page size and each buffer's region;
  :meth:`PageLayout.views` gives typed zero-copy tensor views of a group's pages.

``window`` (exactly): the number of tokens *before* a position whose keys and values the
query at that position needs, not counting the position itself. Resuming at ``r`` needs
the pages covering ``[max(0, r - window), r)``. transformers' ``sliding_window`` counts
the query's own token (the query at ``q`` attends to keys in ``(q - sliding_window, q]``,
and its cache keeps ``sliding_window - 1`` tokens), so a transformers layer with
``sliding_window = S`` declares ``window = S - 1``.

Dtypes are named as torch spells them (``"bfloat16"``); builders and :class:`BufferSpec`
also take a ``torch.dtype``, and builders take ``quant`` as a :class:`QuantMode` or its
name (``"FP8"``).

Lifecycle: a worker builds a layout (by hand or with a builder such as
:func:`kvbank.builders.full_attention`), registers it, and from then on every page it stores or fetches is
named under ``layout.layout_id``.

Canonical page byte layout: for group ``g`` the page is the concatenation, in declaration
order, of the transferred buffers whose layer is in ``g``; each buffer starts at a
multiple of :data:`ALIGN` bytes and holds ``tokens_per_page × prod(shape)`` items
token-major (``prod(shape)`` for a ``STATE`` group). Padding bytes are zero.

Layout id: SHA-256 over the canonical encoding — JSON with sorted keys, no whitespace,
enums by name, fields equal to their default left out, ``shard_index`` left out, and
:data:`LAYOUT_ID_VERSION` inside. Adding a defaulted field therefore keeps old ids; any
change of the byte layout rules bumps the version so old and new builds share no pages. The
encoding itself is :mod:`kvbank.canonical`.

Logical id: ``PageLayout.logical_id`` is the layout id of :meth:`PageLayout.unsharded`
(the TP 1 form), equal for every shard count of one model layout, so rows stored under
any of them can be found (see :mod:`kvbank.reshard.plan`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbank import checks
from kvbank.canonical import encode, fields_of, list_of
from kvbank.dtypes import DTYPE_ITEMSIZE as DTYPE_ITEMSIZE  # re-exported
from kvbank.dtypes import check_dtype
from kvbank.errors import InvalidInput, LayoutError, PageSizeMismatch

# The layout's vocabularies live in kvbank.roles; re-exported here, where they are used.
from kvbank.roles import STATE_ROLES as STATE_ROLES
from kvbank.roles import GroupKind as GroupKind
from kvbank.roles import QuantMode as QuantMode
from kvbank.roles import Role as Role
from kvbank.roles import Split as Split
from kvbank.roles import role_kind as role_kind

if TYPE_CHECKING:
    import torch

LAYOUT_ID_VERSION = 1
ALIGN = 64  # bytes; every buffer region starts on a cache line (and a DMA-friendly boundary)

# The dtype vocabulary lives in kvbank.dtypes (one table, one validator); re-exported here.


def dtype_name(dtype: object, what: str = "dtype", context: str = "") -> str:
    """The kvbank name of ``dtype``: a name from :mod:`kvbank.dtypes` (torch spelling,
    ``"bfloat16"``) or a ``torch.dtype`` (``torch.bfloat16``). Anything else is a
    :class:`LayoutError` naming ``what``. torch is recognised without importing it, so
    layouts stay usable where torch is not installed."""
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).removeprefix("torch.")
        if name in DTYPE_ITEMSIZE:
            return name
    return check_dtype(dtype, what, LayoutError, context).name


def _count(value: object, what: str, lo: int = 0) -> int:
    """:func:`kvbank.checks.count` for a layout's field: a LayoutError names it."""
    return checks.count(value, what, lo, error=LayoutError)


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One region of a page."""

    layer: int
    role: Role
    dtype: str
    shape: tuple[int, ...]
    head_axis: int | None = None  # axis split over TP ranks by KV head; None = replicated
    transferred: bool = True
    heads: int | None = None  # heads over all ranks; None = shape[head_axis] × shard_count
    sections: tuple[int, ...] = ()  # one shard's section lengths along head_axis

    def __post_init__(self) -> None:
        _count(self.layer, "buffer.layer")
        if isinstance(self.role, str):
            object.__setattr__(self, "role", Role.parse(self.role))
        elif not isinstance(self.role, Role):
            raise LayoutError(f"buffer.role: expected a Role, got {self.role!r}")
        object.__setattr__(
            self, "dtype", dtype_name(self.dtype, "buffer.dtype",
                                      f" (layer {self.layer}, {self.role.name})")
        )
        shape = tuple(self.shape) if isinstance(self.shape, (list, tuple)) else self.shape
        if not isinstance(shape, tuple) or not shape:
            raise LayoutError(f"buffer.shape: must be a non-empty tuple, got {self.shape!r}")
        for dim in shape:
            _count(dim, f"buffer.shape (layer {self.layer}, {self.role.name})", 1)
        object.__setattr__(self, "shape", shape)
        if self.head_axis is not None:
            _count(self.head_axis, "buffer.head_axis")
            if self.head_axis >= len(shape):
                raise LayoutError(
                    f"buffer.head_axis: {self.head_axis} is outside shape {shape} "
                    f"(layer {self.layer}, {self.role.name})"
                )
        if not isinstance(self.transferred, bool):
            raise LayoutError(f"buffer.transferred: must be a bool, got {self.transferred!r}")
        self._check_split()

    def _check_split(self) -> None:
        where = f"(layer {self.layer}, {self.role.name})"
        sections = tuple(self.sections) if isinstance(self.sections, (list, tuple)) else None
        if sections is None:
            raise LayoutError(f"buffer.sections: must be a tuple, got {self.sections!r} {where}")
        for s in sections:
            _count(s, f"buffer.sections {where}", 1)
        object.__setattr__(self, "sections", sections)
        if self.heads is not None:
            _count(self.heads, f"buffer.heads {where}", 1)
        if (self.heads is not None or sections) and self.head_axis is None:
            raise LayoutError(f"buffer.head_axis: heads or sections need a split axis {where}")
        if self.heads is not None and sections:
            raise LayoutError(f"buffer.heads: a sectioned buffer splits its sections evenly, "
                              f"it cannot also declare heads {where}")
        if sections and self.head_axis is not None and sum(sections) != self.shape[self.head_axis]:
            raise LayoutError(
                f"buffer.sections: {sections} sum to {sum(sections)}, axis {self.head_axis} "
                f"of shape {self.shape} is {self.shape[self.head_axis]} {where}"
            )

    @property
    def split(self) -> Split:
        if self.head_axis is None:
            return Split.REPLICATED
        return Split.SECTIONED if self.sections else Split.HEAD

    def segments(self, shard_count: int) -> tuple[int, ...]:
        """Lengths over all ranks of the runs along ``head_axis`` that split on their own:
        the head count of a ``HEAD`` buffer, each section of a ``SECTIONED`` one."""
        if self.head_axis is None:
            return ()
        if self.sections:
            return tuple(s * shard_count for s in self.sections)
        heads = self.heads if self.heads is not None else self.shape[self.head_axis] * shard_count
        return (heads,)

    def resplit(self, shard_count: int, to: int, what: str = "buffer") -> BufferSpec:
        """This buffer, declared for ``shard_count`` ranks, as declared for ``to`` ranks;
        a head count or section that neither divides over ``to`` nor (heads only) is
        duplicated evenly is a :class:`LayoutError` naming ``what``."""
        axis = self.head_axis
        if axis is None or shard_count == to:
            return self
        where = f"{what} (layer {self.layer}, {self.role.name})"
        if self.sections:
            for s in self.segments(shard_count):
                if s % to:
                    raise LayoutError(f"{where}.sections: a section of {s} does not divide "
                                      f"over shard_count {to}")
            sections = tuple(s * shard_count // to for s in self.sections)
            shape = (*self.shape[:axis], sum(sections), *self.shape[axis + 1 :])
            return dataclasses.replace(self, shape=shape, sections=sections)
        (heads,) = self.segments(shard_count)
        local = _shard_heads(heads, to, f"{where}.heads")
        shape = (*self.shape[:axis], local, *self.shape[axis + 1 :])
        return dataclasses.replace(self, shape=shape, heads=None if heads == local * to else heads)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def item_bytes(self) -> int:
        """Bytes of one token's (or one snapshot's) worth of this buffer."""
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share a page table."""

    kind: GroupKind
    layers: tuple[int, ...]
    # tokens before a position that its query attends to (excluding itself; transformers'
    # sliding_window - 1, see the module docstring); None = full attention
    window: int | None = None
    sink_tokens: int = 0  # leading tokens always attended (attention sinks)

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            object.__setattr__(self, "kind", GroupKind.parse(self.kind))
        elif not isinstance(self.kind, GroupKind):
            raise LayoutError(f"group.kind: expected a GroupKind, got {self.kind!r}")
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers
        if not isinstance(layers, tuple) or not layers:
            raise LayoutError(f"group.layers: must be a non-empty tuple, got {self.layers!r}")
        for layer in layers:
            _count(layer, "group.layers")
        if len(set(layers)) != len(layers):
            raise LayoutError(f"group.layers: duplicate layer in {layers}")
        object.__setattr__(self, "layers", layers)
        if self.window is not None:
            _count(self.window, "group.window", 1)
            if self.kind is not GroupKind.ATTENTION:
                raise LayoutError("group.window: only an ATTENTION group has a window")
        _count(self.sink_tokens, "group.sink_tokens")
        if self.sink_tokens and self.kind is not GroupKind.ATTENTION:
            raise LayoutError("group.sink_tokens: only an ATTENTION group has sink tokens")
        if self.sink_tokens and self.window is None:
            raise LayoutError(
                "group.sink_tokens: sinks only mean something with a sliding window "
                f"(got sink_tokens={self.sink_tokens}, window=None)"
            )


@dataclass(frozen=True, slots=True)
class BufferRegion:
    """Where one buffer lies inside its group's canonical page."""

    buffer: BufferSpec
    offset: int
    nbytes: int


MAX_MODEL_BYTES = 4096  # a fingerprint: name, revision and what changes the KV values
MAX_BUFFERS = 1 << 16  # buffers of one layout (a model's layers x roles)


@dataclass(frozen=True, slots=True)
class PageLayout:
    """The declaration of a cache's pages. ``layout_id`` is derived, 32 bytes."""

    model: str  # model fingerprint: name + revision + anything that changes the KV values
    tokens_per_page: int
    groups: tuple[LayerGroup, ...]
    buffers: tuple[BufferSpec, ...]
    quant: QuantMode = QuantMode.NONE
    shard_count: int = 1
    shard_index: int = field(default=0, metadata={"identity": False})

    # derived, filled in __post_init__
    regions: tuple[tuple[BufferRegion, ...], ...] = field(
        init=False, repr=False, compare=False
    )
    group_page_bytes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    layout_id: bytes = field(init=False, repr=False, compare=False)
    logical_id: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise LayoutError(f"model: must be a non-empty fingerprint string, got {self.model!r}")
        try:  # the layout is persisted and listed as JSON: a lone surrogate has no UTF-8 form
            model_bytes = len(self.model.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise LayoutError(f"model: not encodable as UTF-8: {exc}") from None
        if model_bytes > MAX_MODEL_BYTES:
            raise LayoutError(f"model: at most {MAX_MODEL_BYTES} bytes of UTF-8, got {model_bytes}")
        _count(self.tokens_per_page, "tokens_per_page", 1)
        groups = tuple(self.groups) if isinstance(self.groups, (list, tuple)) else self.groups
        buffers = tuple(self.buffers) if isinstance(self.buffers, (list, tuple)) else self.buffers
        if not isinstance(groups, tuple) or not groups:
            raise LayoutError("groups: a layout needs at least one layer group")
        if not isinstance(buffers, tuple) or not buffers:
            raise LayoutError("buffers: a layout needs at least one buffer")
        buffers = _fit_splits(buffers, self.shard_count)
        for g in groups:
            if not isinstance(g, LayerGroup):
                raise LayoutError(f"groups: expected LayerGroup items, got {g!r}")
        for b in buffers:
            if not isinstance(b, BufferSpec):
                raise LayoutError(f"buffers: expected BufferSpec items, got {b!r}")
        if len(groups) > 0xFFFF:
            raise LayoutError(f"groups: at most 65535 groups, got {len(groups)}")
        if len(buffers) > MAX_BUFFERS:
            raise LayoutError(f"buffers: at most {MAX_BUFFERS} buffers, got {len(buffers)}")
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "buffers", buffers)
        if not isinstance(self.quant, QuantMode):
            object.__setattr__(self, "quant", QuantMode.parse(self.quant))
        _count(self.shard_count, "shard_count", 1)
        _count(self.shard_index, "shard_index")
        if self.shard_count > 0xFFFF:
            raise LayoutError(f"shard_count: at most 65535, got {self.shard_count}")
        if self.shard_index >= self.shard_count:
            raise LayoutError(
                f"shard_index: {self.shard_index} is out of range for shard_count "
                f"{self.shard_count}"
            )

        # A layer is in at most one group of each kind: a FalconH1-style layer that is both
        # attention and recurrent sits in one ATTENTION and one STATE group, and its
        # buffers go to the group of their role's kind.
        group_of_layer: dict[tuple[int, GroupKind], int] = {}
        for gi, g in enumerate(groups):
            for layer in g.layers:
                other = group_of_layer.get((layer, g.kind))
                if other is not None:
                    raise LayoutError(
                        f"groups: layer {layer} is in {g.kind.name} group {other} and "
                        f"{g.kind.name} group {gi} (a layer has at most one group per kind)"
                    )
                group_of_layer[(layer, g.kind)] = gi
        seen: set[tuple[int, Role]] = set()
        per_group: list[list[BufferRegion]] = [[] for _ in groups]
        cursor = [0] * len(groups)
        for b in buffers:
            if (b.layer, b.role) in seen:
                raise LayoutError(f"buffers: duplicate (layer, role) ({b.layer}, {b.role.name})")
            seen.add((b.layer, b.role))
            kind = role_kind(b.role)
            gi_or_none = group_of_layer.get((b.layer, kind))
            if gi_or_none is None:
                kinds = sorted(k.name for layer, k in group_of_layer if layer == b.layer)
                if kinds:
                    raise LayoutError(
                        f"buffers: role {b.role.name} (layer {b.layer}) does not belong in a "
                        f"{' or '.join(kinds)} group; it needs a {kind.name} group holding "
                        f"layer {b.layer}"
                    )
                raise LayoutError(
                    f"buffers: buffer (layer {b.layer}, {b.role.name}) is in no layer group"
                )
            gi = gi_or_none
            if not b.transferred:
                continue
            count = self.tokens_per_page if kind is GroupKind.ATTENTION else 1
            nbytes = count * b.item_bytes
            offset = cursor[gi]
            per_group[gi].append(BufferRegion(b, offset, nbytes))
            cursor[gi] = -(-(offset + nbytes) // ALIGN) * ALIGN
        for gi, g in enumerate(groups):
            if not any(b.layer in g.layers and role_kind(b.role) is g.kind for b in buffers):
                raise LayoutError(f"groups: group {gi} ({g.kind.name}) has no buffers")
        object.__setattr__(self, "regions", tuple(tuple(r) for r in per_group))
        object.__setattr__(self, "group_page_bytes", tuple(cursor))
        object.__setattr__(self, "layout_id", hashlib.sha256(self.canonical()).digest())
        object.__setattr__(
            self, "logical_id",
            self.layout_id if self.shard_count == 1 else self.unsharded().layout_id,
        )

    # ---- identity -------------------------------------------------------------------

    def canonical(self) -> bytes:
        """The canonical encoding the layout id hashes (see the module docstring)."""
        doc = encode(self, identity=True)
        assert isinstance(doc, dict)  # _encode of a dataclass is a dict
        doc["layout_id_version"] = LAYOUT_ID_VERSION
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def layout_id_hex(self) -> str:
        return self.layout_id.hex()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (defaults left out, shard index kept)."""
        doc = encode(self, identity=False)
        assert isinstance(doc, dict)
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PageLayout:
        """Inverse of :meth:`to_dict`; unknown or missing fields raise :class:`LayoutError`."""
        if not isinstance(doc, Mapping):
            raise LayoutError(f"layout: expected an object, got {type(doc).__name__}")
        top = fields_of(cls, doc, "layout")
        try:
            groups = tuple(
                LayerGroup(**fields_of(LayerGroup, g, "group")) for g in list_of(doc, "groups")
            )
            buffers = tuple(
                BufferSpec(
                    **{
                        **fields_of(BufferSpec, b, "buffer"),
                        "shape": tuple(list_of(b, "shape")),
                    }
                )
                for b in list_of(doc, "buffers")
            )
        except TypeError as exc:
            raise LayoutError(f"layout: {exc}") from exc
        top["groups"] = groups
        top["buffers"] = buffers
        if "quant" in top:
            top["quant"] = QuantMode.parse(top["quant"])
        return cls(**top)

    def with_shard(self, shard_index: int) -> PageLayout:
        """The same layout as seen by another tensor-parallel rank (same layout id)."""
        return dataclasses.replace(self, shard_index=shard_index)

    def unsharded(self) -> PageLayout:
        """The TP 1 form of this layout: every split buffer at its size over all ranks.
        Its layout id is :attr:`logical_id`."""
        if self.shard_count == 1:
            return self
        buffers = tuple(
            b.resplit(self.shard_count, 1, f"buffers[{i}]") for i, b in enumerate(self.buffers)
        )
        return dataclasses.replace(self, buffers=buffers, shard_count=1, shard_index=0)

    # ---- derived sizes --------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page position over all groups (sum of the group pages)."""
        return sum(self.group_page_bytes)

    def page_dtype(self, group: int) -> str:
        """The one dtype of the group's page buffers, or ``uint8`` when they mix dtypes:
        what the codec is told a page holds (it splits byte planes by item size)."""
        dtypes = {r.buffer.dtype for r in self.regions[group]}
        return dtypes.pop() if len(dtypes) == 1 else "uint8"

    def group_bytes(self, group: int) -> int:
        if not 0 <= group < len(self.groups):
            raise LayoutError(f"group: {group} is out of range for {len(self.groups)} groups")
        return self.group_page_bytes[group]

    def group_of(self, layer: int, role: Role | None = None) -> int:
        """The group holding ``layer``'s buffers of ``role`` (any role: the layer's only
        group; a layer in an ATTENTION and a STATE group needs the role)."""
        hits = [
            gi for gi, g in enumerate(self.groups)
            if layer in g.layers and (role is None or g.kind is role_kind(role))
        ]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            what = f"layer {layer}" if role is None else f"(layer {layer}, {role.name})"
            raise LayoutError(f"layer: {what} is in no group of this layout")
        raise LayoutError(
            f"role: layer {layer} is in groups {hits}; name the role to pick one"
        )

    def views(self, pages: torch.Tensor, group: int) -> dict[tuple[int, Role], torch.Tensor]:
        """Typed, zero-copy views of ``group``'s buffers inside canonical ``pages``.

        ``pages`` is ``uint8 [n, group_page_bytes]`` (or one page, ``[group_page_bytes]``).
        The answer maps each transferred buffer's ``(layer, role)`` to a tensor of the
        buffer's dtype sharing ``pages``'s memory: ``[n, tokens_per_page, *shape]`` for an
        ``ATTENTION`` group, ``[n, *shape]`` for a ``STATE`` group (without the ``n`` axis
        for one page). Writing a view writes the page. Regions start on :data:`ALIGN`
        bytes, so every view is aligned for its dtype when ``pages`` is.
        """
        import torch  # here, not at module level: layouts are usable without torch

        rows = self.page_rows(pages, group)
        one = pages.dim() == 1
        per_token = self.groups[group].kind is GroupKind.ATTENTION
        out: dict[tuple[int, Role], torch.Tensor] = {}
        for r in self.regions[group]:
            b = r.buffer
            dtype = getattr(torch, b.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidInput(f"dtype: torch {torch.__version__} has no dtype {b.dtype!r}")
            block = rows[:, r.offset : r.offset + r.nbytes]
            try:
                typed = block.view(dtype)
            except RuntimeError as exc:  # a base pointer not aligned for the dtype
                raise InvalidInput(
                    f"pages: region (layer {b.layer}, {b.role.name}) cannot be viewed as "
                    f"{b.dtype}: {exc}"
                ) from exc
            shape = (self.tokens_per_page, *b.shape) if per_token else b.shape
            view = typed.view(rows.shape[0], *shape)
            out[(b.layer, b.role)] = view[0] if one else view
        return out

    def page_rows(self, pages: torch.Tensor, group: int) -> torch.Tensor:
        """``pages`` checked as :meth:`views` checks them, as ``uint8 [n, group_page_bytes]``
        (one page: ``n`` is 1): what a kernel that moves a page's regions as bytes reads."""
        import torch

        size = self.group_bytes(group)
        if not isinstance(pages, torch.Tensor):
            raise InvalidInput(f"pages: expected a uint8 tensor, got {type(pages).__name__}")
        rows = pages.unsqueeze(0) if pages.dim() == 1 else pages
        if pages.dtype != torch.uint8 or rows.dim() != 2:
            raise InvalidInput(
                f"pages: expected uint8 [n, {size}] or [{size}], got {pages.dtype} "
                f"{tuple(pages.shape)}"
            )
        if rows.shape[1] != size:
            raise PageSizeMismatch(
                f"pages: pages of {rows.shape[1]} bytes, group {group}'s page is {size} bytes"
            )
        if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) % ALIGN):
            raise InvalidInput(
                f"pages: each page must be contiguous and pages {ALIGN}-byte strided "
                f"(strides {tuple(rows.stride())})"
            )
        return rows

    def region(self, group: int, layer: int, role: Role) -> BufferRegion:
        for r in self.regions[group]:
            if r.buffer.layer == layer and r.buffer.role is role:
                return r
        raise LayoutError(
            f"region: no transferred buffer (layer {layer}, {role.name}) in group {group}"
        )

    def padding(self, group: int) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` byte ranges of the group's canonical page that no region covers:
        the alignment gaps, zero in every page a kernel builds."""
        page = self.group_bytes(group)
        gaps = []
        cursor = 0
        for region in self.regions[group]:
            if region.offset > cursor:
                gaps.append((cursor, region.offset))
            cursor = region.offset + region.nbytes
        if cursor < page:
            gaps.append((cursor, page))
        return tuple(gaps)


# ---- shard arithmetic --------------------------------------------------------------------


def _shard_heads(heads: int, shard_count: int, what: str) -> int:
    """Heads one rank holds: ``heads / shard_count``, or 1 when ranks outnumber heads and
    each head is duplicated on ``shard_count / heads`` ranks (GQA with 8 KV heads at TP 16)."""
    _count(heads, what, 1)
    _count(shard_count, "shard_count", 1)
    if heads % shard_count == 0:
        return heads // shard_count
    if shard_count % heads == 0:
        return 1
    raise LayoutError(
        f"{what}: {heads} heads neither divide over shard_count {shard_count} nor duplicate "
        f"evenly onto it"
    )



def _fit_splits(buffers: tuple[BufferSpec, ...], shard_count: object) -> tuple[BufferSpec, ...]:
    """Check each declared head count against ``shard_count`` and drop the ones the
    default already says, so one split has one encoding (and one layout id)."""
    if isinstance(shard_count, bool) or not isinstance(shard_count, int) or shard_count <= 0:
        return buffers  # the shard_count check reports it
    out = []
    for i, b in enumerate(buffers):
        if isinstance(b, BufferSpec) and b.heads is not None and b.head_axis is not None:
            local = _shard_heads(b.heads, shard_count, f"buffers[{i}].heads")
            if b.shape[b.head_axis] != local:
                raise LayoutError(
                    f"buffers[{i}].heads: {b.heads} heads over shard_count {shard_count} "
                    f"put {local} on a rank, shape {b.shape} holds {b.shape[b.head_axis]} "
                    f"(layer {b.layer}, {b.role.name})"
                )
            if b.heads == local * shard_count:
                b = dataclasses.replace(b, heads=None)
        out.append(b)
    return tuple(out)
