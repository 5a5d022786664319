"""LMCache's objects as kvbank rows: the layout, scope, shard and page key of an ``ObjectKey``.

An LMCache L2 object is one chunk (256 tokens by default) of one object group of one
``kv_rank``: its bytes are the tensors a ``MemoryLayoutDesc`` names (shapes and dtypes).
None of that is in LMCache's key (``chunk_hash``, ``model_name``, ``kv_rank``,
``object_group_id``, ``cache_salt``), so kvbank puts it in the row name:

- :func:`object_layout` — a :class:`~kvbank.PageLayout` whose ``model`` names the LMCache
  model and object group, and whose buffers are the object's tensors. An object of one
  ``[2, layers, tokens, hidden]`` tensor (LMCache's ``KV_2LTD``) is declared as what it is:
  ``tokens`` tokens a page, a KEY and a VALUE buffer of ``(hidden,)`` per layer, in
  LMCache's byte order (every K layer, then every V layer), so kvbank's codec sees the
  dtype of every byte. Any other object (several tensors, another rank) is one page of one
  token holding the object's bytes as one buffer, its shapes in the fingerprint. Either
  way the canonical page is the object's bytes in order (zero padding at the end up to
  kvbank's 64-byte alignment, never between).
  Another model, group, shape or dtype is another layout id, so its rows never meet:
  a wrong layout is a miss, never a hit.
- :func:`shard_of` — ``(world size, global rank)`` unpacked from ``kv_rank``
  (``world_size << 24 | global_rank << 16 | …``); a rank of 0 (LMCache's tests) is
  shard 0 of 1.
- :func:`scope_of` — ``Scope(tenant="lmcache/<tenant>", cache_salt=key.cache_salt)``:
  per-user salts stay apart, and LMCache's chunk hashes never meet kvbank's own chains.
- Page keys are the chunk hashes themselves (:func:`kvbank.keys.engine_keys` expands a
  hash that is not 32 bytes long).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbank import PageLayout, Scope
from kvbank.errors import InvalidInput
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, Role, dtype_name

__all__ = ["ObjectShape", "object_layout", "scope_of", "shard_of"]

SCOPE_PREFIX = "lmcache/"


@dataclass(frozen=True, slots=True)
class ObjectShape:
    """The tensors of one LMCache object: a shape and a dtype name each."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], dtypes: Sequence[object]) -> ObjectShape:
        if len(shapes) != len(dtypes) or not shapes:
            raise InvalidInput(f"object: {len(shapes)} shapes and {len(dtypes)} dtypes; expected "
                               "one dtype per shape, at least one")
        return cls(tuple(tuple(int(d) for d in s) for s in shapes),
                   tuple(dtype_name(d, "object.dtype") for d in dtypes))

    @property
    def nbytes(self) -> int:
        from kvbank.layout import DTYPE_ITEMSIZE

        return sum(math.prod(s) * DTYPE_ITEMSIZE[d] for s, d in zip(self.shapes, self.dtypes, strict=True))


def shard_of(kv_rank: int) -> tuple[int, int]:
    """``(shard count, shard index)`` of an LMCache ``kv_rank``."""
    world, rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    if world == 0:
        return 1, 0
    if rank >= world:
        raise InvalidInput(f"kv_rank: global rank {rank} is not below the world size {world} "
                           f"(kv_rank {kv_rank:#x})")
    return world, rank


@functools.lru_cache(maxsize=1024)
def scope_of(tenant: str, cache_salt: str) -> Scope:
    return Scope(tenant=SCOPE_PREFIX + tenant, cache_salt=cache_salt)


@functools.lru_cache(maxsize=1024)
def object_layout(model_name: str, group: int, kv_rank: int, shape: ObjectShape) -> PageLayout:
    """The kvbank layout of LMCache objects of ``shape`` (see the module docstring).
    Cached: building a layout hashes its canonical form (about 5 ms for 12 buffers on a
    busy core), and a load of 64 chunks names 64 rows of one layout."""
    count, index = shard_of(kv_rank)
    model = f"lmcache/{model_name}#group{group}"
    if len(shape.shapes) == 1 and len(shape.shapes[0]) == 4 and shape.shapes[0][0] == 2:
        _, layers, tokens, hidden = shape.shapes[0]
        dt = shape.dtypes[0]
        from kvbank.layout import ALIGN, DTYPE_ITEMSIZE

        if tokens * hidden * DTYPE_ITEMSIZE[dt] % ALIGN == 0:  # no padding between buffers
            buffers = tuple(BufferSpec(layer, role, dt, (hidden,))
                            for role in (Role.KEY, Role.VALUE) for layer in range(layers))
            return PageLayout(model=model, tokens_per_page=tokens,
                              groups=(LayerGroup(GroupKind.ATTENTION, tuple(range(layers))),),
                              buffers=buffers, shard_count=count, shard_index=index)
    # one buffer holding the object's bytes in order: its dtype where all tensors share
    # one, else bytes; the shapes themselves go into the fingerprint
    described = ";".join(f"{'x'.join(map(str, s))}:{d}" for s, d in zip(shape.shapes, shape.dtypes,
                                                                         strict=True))
    if len(set(shape.dtypes)) == 1:
        dt, items = shape.dtypes[0], sum(math.prod(s) for s in shape.shapes)
    else:
        dt, items = "uint8", shape.nbytes
    return PageLayout(model=f"{model}#whole#{described}", tokens_per_page=1,
                      groups=(LayerGroup(GroupKind.ATTENTION, (0,)),),
                      buffers=(BufferSpec(0, Role.KEY, dt, (items,)),),
                      shard_count=count, shard_index=index)
