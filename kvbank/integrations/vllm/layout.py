"""vLLM's KV-cache groups as a kvbank :class:`~kvbank.PageLayout`, and the engine fingerprint.

Primitives:

- :func:`engine_fingerprint` — the layout's ``model`` field, computable in the scheduler
  process (which never loads weights): SHA-256 over the model name, revision, the HF
  config (minus keys that only say where or with what it was saved), dtype, KV-cache
  dtype, quantization and load format. Two engines whose fingerprints differ share no
  pages.
- :func:`layout_for` — a :class:`VllmLayout`: one kvbank ``ATTENTION`` group per vLLM
  KV-cache group, *in vLLM's order* (vLLM decides the grouping: Gemma3 with four layers
  is four groups of one layer), KEY and VALUE buffers ``(heads, head_size)`` per layer,
  split over TP ranks by head (``shard_count`` = TP, ``shard_index`` = rank),
  ``tokens_per_page`` = vLLM's block size. A group kvbank cannot map (Mamba, MLA,
  quantized or padded pages, …) is :class:`UnsupportedCache` naming it.
- :func:`scope_for` — ``Scope(tenant="vllm/<hash algo>/<tenant>")``: vLLM's block-hash
  chain already holds the cache salt, LoRA and multimodal inputs; the algorithm is in the
  scope because two algorithms' keys must never meet.
- :func:`page_keys_of` — the request's block hashes at page granularity.

Sliding windows: vLLM's ``sliding_window = S`` lets the query at ``q`` see keys in
``(q - S, q]``, so the kvbank window (tokens *before* the query) is ``S - 1``; vLLM then
allocates exactly the blocks kvbank's resume bound asks for.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbank import PageLayout, Scope
from kvbank.errors import InvalidInput
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, Role, dtype_name

__all__ = [
    "UnsupportedCache",
    "VllmLayout",
    "engine_fingerprint",
    "layout_for",
    "page_keys_of",
    "scope_for",
]

# HF config keys that say where or with which library a config was saved, not what the
# model computes: a config saved twice must fingerprint the same.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash",
                                   "_attn_implementation_autoset", "name_or_path"})
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class UnsupportedCache(InvalidInput):
    """vLLM's KV cache has a group, spec or parallel set-up this connector cannot map."""


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """A vLLM engine's cache as kvbank sees it."""

    layout: PageLayout
    group_layers: tuple[tuple[str, ...], ...]  # per kvbank group g: vLLM's layer names
    layer_index: dict[str, int]  # vLLM layer name -> kvbank layer index
    hash_block_size: int  # tokens per entry of request.block_hashes

    @property
    def tokens_per_page(self) -> int:
        return self.layout.tokens_per_page

    @property
    def layout_id(self) -> bytes:
        return self.layout.layout_id


def _cfg(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _hf_config_doc(hf_config: Any) -> Any:
    if hf_config is None:
        return None
    to_dict = getattr(hf_config, "to_dict", None)
    doc = to_dict() if callable(to_dict) else dict(vars(hf_config))
    return {k: v for k, v in doc.items() if k not in _VOLATILE_CONFIG_KEYS}


def engine_fingerprint(vllm_config: Any) -> str:
    """``vllm/<model>@<revision>/<sha256>``: see the module docstring for what is hashed."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    doc = {
        "model": str(_cfg(mc, "model", "")),
        "revision": _cfg(mc, "revision"),
        "hf_config": _hf_config_doc(_cfg(mc, "hf_config")),
        "dtype": str(_cfg(mc, "dtype")),
        "kv_cache_dtype": str(_cfg(cc, "cache_dtype")),
        "quantization": _cfg(mc, "quantization"),
        "load_format": str(_cfg(vllm_config.load_config, "load_format")),
    }
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(body.encode()).hexdigest()
    return f"vllm/{doc['model']}@{doc['revision'] or ''}/{digest}"


def scope_for(vllm_config: Any, tenant: str = "") -> Scope:
    """Pages of one hash algorithm and tenant (see the module docstring)."""
    algo = str(_cfg(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    return Scope(tenant=f"vllm/{algo}/{tenant}")


def layer_index(name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3 (the one integer between dots)."""
    found = _LAYER_INDEX.findall(f".{name}.")
    if len(found) != 1:
        raise UnsupportedCache(f"layer {name!r}: expected exactly one layer index in the name, "
                               f"found {found}")
    return int(found[0])


def _group(spec: Any, g: int) -> int | None:
    """The kvbank window of vLLM group ``g``'s spec (None = full attention); refuses the rest."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kind = type(spec).__name__
    if "Mamba" in kind:
        raise UnsupportedCache(
            f"kv_cache_groups[{g}]: {kind} (recurrent state) is not supported by the kvbank "
            "connector yet; hybrid SSM models must run without it")
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise UnsupportedCache(f"kv_cache_groups[{g}]: {kind} is not supported; the kvbank "
                               "connector maps FullAttentionSpec and SlidingWindowSpec")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", "NONE") != "NONE":
        raise UnsupportedCache(f"kv_cache_groups[{g}]: quantized KV cache ({quant}) is not supported")
    for extra in ("page_size_padded", "state_content_bytes", "num_head_slots"):
        if getattr(spec, extra, None) is not None:
            raise UnsupportedCache(f"kv_cache_groups[{g}]: {kind}.{extra}="
                                   f"{getattr(spec, extra)!r} is not supported")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedCache(f"kv_cache_groups[{g}]: tokens_per_state="
                               f"{spec.tokens_per_state} is not supported")
    if isinstance(spec, SlidingWindowSpec):
        return max(int(spec.sliding_window) - 1, 0)
    return None


def layout_for(vllm_config: Any, kv_cache_config: Any, shard_index: int = 0) -> VllmLayout:
    """The :class:`VllmLayout` of this engine (see the module docstring)."""
    pc = vllm_config.parallel_config
    tp = int(_cfg(pc, "tensor_parallel_size", 1))
    if int(_cfg(pc, "pipeline_parallel_size", 1)) != 1:
        raise UnsupportedCache("pipeline_parallel_size > 1 is not supported by the kvbank connector")
    groups_in = list(kv_cache_config.kv_cache_groups)
    if not groups_in:
        raise UnsupportedCache("kv_cache_groups: the engine has no KV cache")
    sizes = {int(gs.kv_cache_spec.block_size) for gs in groups_in}
    if len(sizes) != 1:
        raise UnsupportedCache(f"kv_cache_groups: block sizes {sorted(sizes)} differ; kvbank "
                               "pages have one size")
    p = sizes.pop()
    hbs = int(_cfg(kv_cache_config, "hash_block_size", None) or p)
    if p % hbs:
        raise UnsupportedCache(f"hash_block_size {hbs} does not divide the block size {p}")
    total_heads = int(vllm_config.model_config.get_total_num_kv_heads())
    groups: list[LayerGroup] = []
    buffers: list[BufferSpec] = []
    names: list[tuple[str, ...]] = []
    index: dict[str, int] = {}
    for g, gs in enumerate(groups_in):
        spec = gs.kv_cache_spec
        window = _group(spec, g)
        layers: list[int] = []
        for name in gs.layer_names:
            i = layer_index(name)
            if i in index.values():
                raise UnsupportedCache(f"layer {name!r}: index {i} is in two KV-cache groups")
            index[name] = i
            layers.append(i)
        heads = int(spec.num_kv_heads)
        # heads over all ranks: only needed when ranks outnumber heads (vLLM replicates)
        all_heads = total_heads if heads * tp != total_heads else None
        dt = dtype_name(spec.dtype)
        hv = int(spec.head_size_v if spec.head_size_v is not None else spec.head_size)
        for i in layers:
            buffers.append(BufferSpec(i, Role.KEY, dt, (heads, int(spec.head_size)), head_axis=0,
                                      heads=all_heads))
            buffers.append(BufferSpec(i, Role.VALUE, dt, (heads, hv), head_axis=0, heads=all_heads))
        groups.append(LayerGroup(GroupKind.ATTENTION, tuple(layers), window=window))
        names.append(tuple(gs.layer_names))
    layout = PageLayout(model=engine_fingerprint(vllm_config), tokens_per_page=p,
                        groups=tuple(groups), buffers=tuple(buffers), shard_count=tp,
                        shard_index=shard_index)
    return VllmLayout(layout, tuple(names), index, hbs)


def page_keys_of(block_hashes: Sequence[bytes], vl: VllmLayout, pages: int) -> list[bytes]:
    """The first ``pages`` page keys: block ``j`` ends at hash ``(j+1)·P/hbs − 1``."""
    ratio = vl.tokens_per_page // vl.hash_block_size
    keys = [bytes(h) for h in block_hashes[ratio - 1 :: ratio]]
    return keys[:pages]
