"""One worker process of the end-to-end test: ``python -m tests.integrations.hf_worker
store|load DIR``.

``store`` (worker A) builds every case's model, saves it under ``DIR/models`` and stores
prompt A through a :class:`~kvbank.Bank` on ``DIR/bank``. ``load`` (worker B, another
process) loads each saved model with ``from_pretrained`` (another load path), resumes
prompt B from what it fetches, recomputes it from scratch, and runs one negative control
per group: the fetched bytes of that group perturbed, the cache rebuilt, the logits
compared. Each writes ``DIR/<command>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kvbank import Bank
from kvbank.integrations import transformers as kt
from tests.integrations import hf_models as M

NEW_TOKENS = 4
CASES = [(f, d) for f in M.FAMILIES for d in M.DTYPES] + [("minilm", "float32")]


def _name(family: str, dtype: str) -> str:
    return f"{family}-{dtype}"


def _model_and_prompts(family: str, dtype: str, root: Path, *, saved: bool) -> tuple[Any, list[int], list[int]]:
    if family == "minilm":
        model, tok = M.minilm(dtype)
        a, b = M.minilm_prompts(tok)
        return model, a, b
    a, b = M.prompts()
    if not saved and dtype == "float32":
        return M.build(family, dtype), a, b
    from transformers import AutoModelForCausalLM

    # Worker A builds and saves each model in float32; a bfloat16 model is loaded from
    # that in both workers. (`.to(bfloat16)` would also cast the rotary buffer, giving
    # other K/V and so, rightly, another fingerprint.)
    path = root / "models" / _name(family, "float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=M.DTYPES[dtype]).eval()
    return model, a, b


def _bank(root: Path) -> Bank:
    return Bank.open(data_dir=root / "bank", host_bytes="64M", device_bytes=0)


def store(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _bank(root) as bank:
        for family, dtype in CASES:
            model, a, _ = _model_and_prompts(family, dtype, root, saved=False)
            if family != "minilm" and dtype == "float32":
                model.save_pretrained(root / "models" / _name(family, dtype))
            hl = kt.layout_for(model, tokens_per_page=M.TOKENS_PER_PAGE)
            got = kt.store(bank, hl, model, a, snapshot_every=M.SNAPSHOT_EVERY)
            out[_name(family, dtype)] = {
                "fingerprint": hl.layout.model, "layout_id": hl.layout_id.hex(),
                "pages": list(got.pages), "snapshots": list(got.snapshots),
                "kinds": [g.kind.name + ("-sliding" if g.window else "") for g in hl.layout.groups],
            }
    return out


def _logits(model: Any, ids: torch.Tensor, cache: Any, last: int) -> torch.Tensor:
    """Float logits of the last ``last`` positions: every position the resumed worker
    computes (a wrong recurrent state shows most at the first of them, then decays)."""
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True).logits[0, -last:].float()


def _generate(model: Any, ids: torch.Tensor, cache: Any) -> list[int]:
    with torch.inference_mode():
        seq = model.generate(ids, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return [int(x) for x in seq[0, -NEW_TOKENS:]]


def _perturbed(hl: kt.ModelLayout, fetched: kt.Fetched, group: int) -> kt.Fetched:
    pages = {g: t.clone() for g, t in fetched.pages.items()}
    for view in hl.layout.views(pages[group], group).values():
        view.mul_(-2).add_(1.0)  # every value of the group changes, and by a lot
    return dataclasses.replace(fetched, pages=pages)


def load(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _bank(root) as bank:
        for family, dtype in CASES:
            model, _, b = _model_and_prompts(family, dtype, root, saved=True)
            hl = kt.layout_for(model, tokens_per_page=M.TOKENS_PER_PAGE)
            fetched = kt.fetch_pages(bank, hl, b)
            got = kt.build_cache(hl, model, b, fetched)
            n = got.rest.shape[1]
            resumed = _logits(model, got.rest, got.cache, n)
            again = kt.load(bank, hl, model, b)
            resumed_tokens = _generate(model, again.generate_ids, again.cache)
            ids = torch.tensor([b])
            recomputed = _logits(model, ids, kt.build_cache(
                hl, model, b, dataclasses.replace(fetched, result=None)).cache, n)
            recomputed_tokens = _generate(model, ids, None)
            controls = {}
            for g in fetched.pages:
                bad = kt.build_cache(hl, model, b, _perturbed(hl, fetched, g))
                diff = (_logits(model, bad.rest, bad.cache, n) - recomputed).abs().max()
                kind = hl.layout.groups[g]
                controls[kind.kind.name + ("-sliding" if kind.window else "")] = float(diff)
            out[_name(family, dtype)] = {
                "fingerprint": hl.layout.model, "layout_id": hl.layout_id.hex(),
                "resume": got.tokens, "reason": str(fetched.match.resume.reason),
                "fetched": [list(p) for p in fetched.match.resume.pages],
                "complete": bool(fetched.result and fetched.result.complete),
                "max_diff": float((resumed - recomputed).abs().max()),
                "scale": float(recomputed.abs().max()),
                "tokens_resumed": resumed_tokens, "tokens_recomputed": recomputed_tokens,
                "controls": controls,
            }
    return out


def main() -> None:
    command, root = sys.argv[1], Path(sys.argv[2])
    result = {"store": store, "load": load}[command](root)
    (root / f"{command}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
