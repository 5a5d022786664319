"""Which kvbank row an LMCache object is: the layout holds the object's bytes in order, and
every field LMCache's key lacks (shape, dtype) or holds (model, group, rank) separates rows."""

from __future__ import annotations

import pytest

from tests.integrations.lmcache.conftest import require_lmcache

require_lmcache()

import torch  # noqa: E402

from kvbank.errors import InvalidInput  # noqa: E402
from kvbank.integrations.lmcache.layout import ObjectShape, object_layout, scope_of, shard_of  # noqa: E402
from kvbank.layout import Role  # noqa: E402


def test_kv_2ltd_object_is_a_page_of_its_tokens_in_lmcache_byte_order() -> None:
    shape = ObjectShape.of([(2, 3, 256, 64)], [torch.bfloat16])
    layout = object_layout("m", 0, 0, shape)
    assert layout.tokens_per_page == 256
    assert layout.group_page_bytes[0] == shape.nbytes == 2 * 3 * 256 * 64 * 2
    order = [(r.buffer.role, r.buffer.layer) for r in layout.regions[0]]
    assert order == [(Role.KEY, 0), (Role.KEY, 1), (Role.KEY, 2), (Role.VALUE, 0), (Role.VALUE, 1),
                     (Role.VALUE, 2)]
    assert [r.offset for r in layout.regions[0]] == [i * 256 * 64 * 2 for i in range(6)]


def test_other_objects_are_one_buffer_padded_only_at_the_end() -> None:
    shape = ObjectShape.of([(1, 3, 16, 10), (5,)], [torch.float16, torch.float32])
    layout = object_layout("m", 0, 0, shape)
    assert layout.tokens_per_page == 1
    assert layout.group_page_bytes[0] >= shape.nbytes == 3 * 16 * 10 * 2 + 5 * 4
    assert layout.group_page_bytes[0] % 64 == 0
    assert "1x3x16x10:float16;5:float32" in layout.model


def test_every_field_separates_layouts() -> None:
    base = ObjectShape.of([(2, 2, 16, 32)], [torch.bfloat16])
    ids = {object_layout("m", 0, 0, base).layout_id,
           object_layout("other", 0, 0, base).layout_id,
           object_layout("m", 1, 0, base).layout_id,
           object_layout("m", 0, 2 << 24, base).layout_id,  # world of 2
           object_layout("m", 0, 0, ObjectShape.of([(2, 2, 32, 16)], [torch.bfloat16])).layout_id,
           object_layout("m", 0, 0, ObjectShape.of([(2, 2, 16, 32)], [torch.float16])).layout_id}
    assert len(ids) == 6
    assert scope_of("", "a").digest != scope_of("", "b").digest != scope_of("t", "a").digest


def test_kv_rank_is_world_and_global_rank() -> None:
    assert shard_of(0) == (1, 0)
    assert shard_of((4 << 24) | (3 << 16) | (4 << 8) | 3) == (4, 3)
    with pytest.raises(InvalidInput, match="global rank 5"):
        shard_of((4 << 24) | (5 << 16))
