"""The layouts and key inputs whose ids and vectors are pinned in tests/data/.

Regenerate (only on purpose, when LAYOUT_ID_VERSION or KEY_VERSION is bumped):
``python -m tests.golden_specs`` writes tests/data/layout_ids_golden.json and
tests/data/keys_golden.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbank import builders as B
from kvbank import keys as K
from kvbank import layout as L

DATA = Path(__file__).parent / "data"


def golden_layouts() -> dict[str, L.PageLayout]:
    return {
        "mha-llama-7b": B.full_attention("meta-llama/Llama-2-7b@main", 32, 32, 128),
        "gqa-llama3-8b-tp2": B.full_attention(
            "meta-llama/Meta-Llama-3-8B@main", 32, 8, 128, shard_count=2
        ),
        "gqa-fp8": B.full_attention("m@fp8", 4, 8, 128, quant=L.QuantMode.FP8),
        "gqa-nvfp4": B.full_attention("m@nvfp4", 4, 8, 128, quant=L.QuantMode.NVFP4),
        "mla-deepseek": B.mla("deepseek-ai/DeepSeek-V3@main", 61, 576, index_key_dim=128),
        "swa-sinks": B.sliding_window("m@swa", 8, 8, 64, window=4096, sink_tokens=4),
        "hybrid-swa-full": B.sliding_window(
            "google/gemma-3-12b@main", 12, 8, 256, window=1024, full_layers=[5, 11]
        ),
        "hybrid-mamba": B.hybrid_mamba(
            "nvidia/Nemotron-H-8B@main",
            attention_layers=[3, 7],
            mamba_layers=[0, 1, 2, 4, 5, 6],
            num_kv_heads=8,
            head_dim=128,
            conv_shape=(8192, 3),
            ssm_shape=(128, 64, 128),
        ),
        "hand-written": L.PageLayout(
            model="hand",
            tokens_per_page=32,
            groups=(L.LayerGroup(L.GroupKind.ATTENTION, (0, 1)),),
            buffers=(
                L.BufferSpec(0, L.Role.KEY, "float16", (4, 64), head_axis=0),
                L.BufferSpec(0, L.Role.VALUE, "float16", (4, 64), head_axis=0),
                L.BufferSpec(1, L.Role.KEY, "float16", (4, 64), head_axis=0),
                L.BufferSpec(1, L.Role.VALUE, "float16", (4, 64), head_axis=0),
                L.BufferSpec(1, L.Role.INDEX_KEY, "float16", (64,), transferred=False),
            ),
        ),
        # split declarations: duplicated heads, sections, per-buffer head counts
        "gqa-llama3-8b-tp16-duplicated": B.full_attention(
            "meta-llama/Meta-Llama-3-8B@main", 32, 8, 128, shard_count=16
        ),
        "hybrid-mamba2-sectioned-tp2": B.hybrid_mamba(
            "nvidia/Nemotron-H-8B@main",
            attention_layers=[3, 7],
            mamba_layers=[0, 1, 2, 4, 5, 6],
            num_kv_heads=8,
            head_dim=128,
            conv_shape=(4096 + 128 + 128, 3),
            conv_sections=(4096, 128, 128),
            ssm_shape=(64, 64, 128),
            shard_count=2,
        ),
        "per-buffer-heads-tp4": L.PageLayout(
            model="hand+draft",
            tokens_per_page=16,
            groups=(L.LayerGroup(L.GroupKind.ATTENTION, (0, 1)),),
            buffers=(
                L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 128), head_axis=0, heads=8),
                L.BufferSpec(0, L.Role.VALUE, "bfloat16", (2, 128), head_axis=0),
                L.BufferSpec(1, L.Role.KEY, "bfloat16", (1, 64), head_axis=0, heads=2),
                L.BufferSpec(1, L.Role.VALUE, "bfloat16", (1, 64), head_axis=0, heads=2),
                L.BufferSpec(1, L.Role.INDEX_KEY, "bfloat16", (32,)),
            ),
            shard_count=4,
            shard_index=1,
        ),
    }


def golden_token_cases() -> dict[str, list[int]]:
    return {
        "empty": [],
        "one-page": list(range(16)),
        "partial": list(range(40)),
        "four-pages": [(i * 7919) % 152_064 for i in range(64)],
        "max-id": [2**31 - 1] * 16,
    }


SCOPES = {
    "default": K.Scope(),
    "tenant": K.Scope(tenant="acme"),
    "salted": K.Scope(tenant="acme", cache_salt="s3cret"),
    "lora": K.Scope(tenant="acme", lora="sql-adapter@v2"),
}


def layout_doc() -> dict[str, object]:
    return {
        name: {"layout": lay.to_dict(), "layout_id": lay.layout_id_hex}
        for name, lay in golden_layouts().items()
    }


def keys_doc() -> dict[str, object]:
    lay = golden_layouts()["gqa-llama3-8b-tp2"]
    out: dict[str, object] = {
        "scopes": {n: s.digest.hex() for n, s in SCOPES.items()},
        "roots": {n: K.root_key(s).hex() for n, s in SCOPES.items()},
        "chains": {},
        "namespaces": {n: K.namespace(lay.layout_id, s).hex() for n, s in SCOPES.items()},
    }
    chains: dict[str, object] = {}
    for scope_name in ("default", "salted"):
        for case, tokens in golden_token_cases().items():
            chains[f"{scope_name}/{case}"] = [
                k.hex() for k in K.page_keys(tokens, 16, SCOPES[scope_name])
            ]
    tokens = golden_token_cases()["four-pages"]
    chains["default/four-pages/extra"] = [
        k.hex() for k in K.page_keys(tokens, 16, extra=[b"", b"img:1234", None, b"img:5678"])
    ]
    out["chains"] = chains
    ns = K.namespace(lay.layout_id)
    first = K.page_keys(tokens, 16)[0]
    out["row_names"] = {
        "g0-s2-0": K.row_name(ns, first, 0, 2, 0).hex(),
        "g0-s2-1": K.row_name(ns, first, 0, 2, 1).hex(),
        "g3-s1-0": K.row_name(ns, first, 3, 1, 0).hex(),
    }
    return out


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    (DATA / "layout_ids_golden.json").write_text(json.dumps(layout_doc(), indent=1, sort_keys=True) + "\n")
    (DATA / "keys_golden.json").write_text(json.dumps(keys_doc(), indent=1, sort_keys=True) + "\n")
    print("wrote", DATA)
