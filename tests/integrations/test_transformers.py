"""The transformers adapter in one process: fingerprints, layer mapping, bad input, a
partial fetch, a miss, and the storing worker's own cache."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbank import Bank, Fetched
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.integrations import transformers as kt
from kvbank.integrations._hf_cache import classify, restore
from kvbank.layout import GroupKind
from kvbank.results import FetchResult, Match
from tests.integrations import hf_models as M

pytestmark = pytest.mark.slow


@pytest.fixture
def bank(tmp_path: Path) -> Iterator[Bank]:
    with Bank.open(data_dir=tmp_path / "bank", host_bytes="32M", device_bytes=0) as b:
        yield b


def _logits(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]


# ---- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_survives_save_and_reload(tmp_path: Path) -> None:
    """Another load path of the same weights (from_pretrained after save_pretrained, which
    rewrites _name_or_path, architectures and the dtype keys) gives the same fingerprint."""
    from transformers import AutoModelForCausalLM

    model = M.build("llama", "float32")
    model.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert again.config._name_or_path != model.config._name_or_path
    assert kt.model_fingerprint(again) == kt.model_fingerprint(model)


def test_fingerprint_changes_with_weights_dtype_and_attention() -> None:
    base = M.build("llama", "float32")
    fp = kt.model_fingerprint(base)
    other = M.build("llama", "float32")
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight[0, 0] += 1e-3
    assert kt.model_fingerprint(other) != fp
    assert kt.model_fingerprint(M.build("llama", "bfloat16")) != fp
    eager = M.build("llama", "float32")
    eager.set_attn_implementation("eager" if base.config._attn_implementation != "eager" else "sdpa")
    assert kt.model_fingerprint(eager) != fp
    # With a revision the weights' bytes are not hashed (the revision names them) ...
    assert kt.model_fingerprint(other, revision="abc123") == kt.model_fingerprint(
        base, revision="abc123")
    # ... but the revision, names, shapes and dtypes are.
    assert kt.model_fingerprint(base, revision="abc124") != kt.model_fingerprint(
        base, revision="abc123")
    renamed = M.build("llama", "float32")
    renamed.config._name_or_path = "someone/else"
    assert kt.model_fingerprint(renamed, revision="abc123") != kt.model_fingerprint(
        base, revision="abc123")
    with pytest.raises(InvalidInput, match="revision"):
        kt.model_fingerprint(base, revision="")


# ---- layer mapping -----------------------------------------------------------------------


def test_layout_for_maps_layer_kinds_from_the_cache() -> None:
    bamba = kt.layout_for(M.build("bamba", "float32"), tokens_per_page=8)
    assert [(g.kind, g.layers) for g in bamba.layout.groups] == [
        (GroupKind.ATTENTION, (1,)), (GroupKind.STATE, (0, 2))]
    mistral = kt.layout_for(M.build("mistral", "float32"))
    (group,) = mistral.layout.groups
    assert group.window == 23  # transformers' sliding_window 24 minus the query itself
    falcon = kt.layout_for(M.build("falcon_h1", "float32"))
    assert [(g.kind, g.layers) for g in falcon.layout.groups] == [
        (GroupKind.ATTENTION, (0, 1)), (GroupKind.STATE, (0, 1))]
    stored_bf16 = kt.layout_for(M.build("llama", "float32"), dtype=torch.bfloat16)
    assert {b.dtype for b in stored_bf16.layout.buffers} == {"bfloat16"}


def test_unmappable_layers_are_refused_naming_layer_and_type() -> None:
    from transformers import cache_utils as cu

    with pytest.raises(kt.UnmappableLayer, match=r"layer 3: .*'full_attention'.*StaticLayer"):
        classify(cu.StaticLayer(max_cache_len=8), 3, "full_attention")
    with pytest.raises(kt.UnmappableLayer, match="layer 1"):
        classify(cu.LinearAttentionLayer(number_of_states=2), 1, "linear_attention")
    with pytest.raises(kt.UnmappableLayer, match="layer 0"):
        classify(cu.DynamicIndexedLayer(), 0, "indexed_attention")
    assert classify(cu.DummyLayer(), 2, "moe") is kt.LayerKind.NONE


def test_layout_for_refuses_a_model_with_unmappable_layers() -> None:
    """A sparse-attention model (GLM MoE DSA) keeps indexer keys kvbank would drop: the
    layout is refused naming the layer and its type, never built without them."""
    import transformers

    config = transformers.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_n_heads=2,
        index_head_dim=16, index_topk=4, first_k_dense_replace=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config).eval()
    with pytest.raises(kt.UnmappableLayer,
                       match=r"layer 0: .*'indexed_attention'.*DynamicIndexedLayer"):
        kt.layout_for(model)


@pytest.mark.parametrize("family", ["mamba2", "bamba", "falcon_h1"])
def test_layout_for_declares_mamba2_conv_sections_and_reshards_them_section_by_section(
    family: str,
) -> None:
    """A Mamba-2 conv state is x (heads * head_dim channels) then B and C (n_groups *
    d_state each). Declared as sections, a TP 1 row rebuilt for rank r of TP 2 holds
    half of each section; split as one axis, rank 0 would hold all of x and no C."""
    from kvbank.kernels.reshard import reshard_pages
    from kvbank.layout import Role
    from kvbank.reshard.plan import plan_reshard, shard_layout

    hl = kt.layout_for(M.build(family, "float32"))
    conv = [b for b in hl.layout.buffers if b.role is Role.CONV_STATE]
    assert conv and all(b.sections == (128, 16, 16) for b in conv)  # 8 heads x 16; 1 x 16
    g = hl.state_group
    assert g is not None
    page = torch.randint(0, 256, (1, hl.layout.group_bytes(g)), dtype=torch.uint8)
    src = hl.layout.views(page, g)
    for rank in (0, 1):
        dst_layout = shard_layout(hl.layout, 2, rank)
        out = torch.empty((1, dst_layout.group_bytes(g)), dtype=torch.uint8)
        reshard_pages(plan_reshard(hl.layout, dst_layout), g, {0: page}, out)
        got = dst_layout.views(out, g)
        for b in conv:
            full = src[(b.layer, Role.CONV_STATE)][0]
            x, bb, c = full[:128], full[128:144], full[144:]
            want = torch.cat([x[rank * 64:(rank + 1) * 64], bb[rank * 8:(rank + 1) * 8],
                              c[rank * 8:(rank + 1) * 8]])
            # random bytes make NaNs as floats: compare the bits
            assert torch.equal(got[(b.layer, Role.CONV_STATE)][0].view(torch.int32),
                               want.view(torch.int32))


def test_layout_for_declares_no_sections_for_attention_models() -> None:
    from kvbank.layout import Role

    hl = kt.layout_for(M.build("llama", "float32"))
    assert all(b.sections == () for b in hl.layout.buffers)
    assert not any(b.role is Role.CONV_STATE for b in hl.layout.buffers)


# ---- bad input -------------------------------------------------------------------------------


def test_build_cache_refuses_another_layouts_pages(bank: Bank) -> None:
    llama, mistral = M.build("llama", "float32"), M.build("mistral", "float32")
    a, b = M.prompts()
    hl_l, hl_m = kt.layout_for(llama, tokens_per_page=8), kt.layout_for(mistral, tokens_per_page=8)
    kt.store(bank, hl_l, llama, a)
    fetched = kt.fetch_pages(bank, hl_l, b)
    with pytest.raises(InvalidInput, match="layout"):
        kt.build_cache(hl_m, mistral, b, fetched)
    with pytest.raises(InvalidInput, match="tokens"):
        kt.build_cache(hl_l, llama, b[:-1], fetched)
    other = [*b[:8], (b[8] + 1) % M.VOCAB, *b[9:]]  # same length, another prompt
    with pytest.raises(InvalidInput, match="tokens"):
        kt.build_cache(hl_l, llama, other, fetched)


def test_wrong_size_pages_are_refused_before_any_tensor_is_written(bank: Bank) -> None:
    model = M.build("bamba", "float32")
    a, b = M.prompts()
    hl = kt.layout_for(model, tokens_per_page=8)
    kt.store(bank, hl, model, a, snapshot_every=5)
    fetched = kt.fetch_pages(bank, hl, b)
    assert fetched.tokens == 40
    state = hl.state_group
    assert state is not None
    short = dict(fetched.pages)
    short[state] = fetched.pages[state][:, :-64]  # the attention group's pages are fine
    cache = kt.fresh_cache(model)
    with pytest.raises(PageSizeMismatch, match=f"pages\\[{state}\\]"):
        restore(hl.layout, hl.layers, cache, short, fetched.match.resume.pages,
                fetched.result.resume.pages if fetched.result else (), 40, model.device)
    assert not any(getattr(layer, "is_initialized", False) for layer in cache.layers)
    assert not any(any(getattr(layer, "has_previous_state", {}).values())
                   for layer in cache.layers)
    with pytest.raises(InvalidInput, match="hl"):
        kt.store(bank, hl.layout, model, a)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="tokens"):
        kt.store(bank, hl, model, [])
    with pytest.raises(InvalidInput, match="snapshot_every"):
        kt.store(bank, hl, model, a, snapshot_every=0)


def test_store_refuses_a_layout_made_for_another_dtype(bank: Bank) -> None:
    """A float32 model's layout used with its bfloat16 twin would name bfloat16 K/V as
    float32 pages: refused before anything is put."""
    hl = kt.layout_for(M.build("llama", "float32"), tokens_per_page=8)
    a, _ = M.prompts()
    with pytest.raises(InvalidInput, match="layout was made for"):
        kt.store(bank, hl, M.build("llama", "bfloat16"), a)
    assert bank.match(hl.layout_id, a).resume.tokens == 0


# ---- partial fetch, miss, the storing worker's cache ----------------------------------------


@dataclasses.dataclass
class _ShortFetch:
    """A real bank whose fetches deliver at most ``rows`` rows (a broken transfer)."""

    bank: Bank
    rows: int

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bank, name)

    def fetch(self, match: Match, *, out: Any, fetch_id: str | None = None,
              max_rows: int | None = None, timeout: float | None = None,
              shard: int | None = None) -> FetchResult:
        return self.bank.fetch(match, out=out, fetch_id=fetch_id, max_rows=self.rows, timeout=timeout,
                               shard=shard)

    def fetch_prefix(self, layout_id: bytes, tokens: Any = None, **kw: Any) -> Fetched:
        return self.bank.fetch_prefix(layout_id, tokens, **kw, max_rows=self.rows)


def test_partial_fetch_resumes_at_what_arrived_whole(bank: Bank) -> None:
    model = M.build("llama", "float32")
    a, b = M.prompts()
    hl = kt.layout_for(model, tokens_per_page=8)
    kt.store(bank, hl, model, a)
    got = kt.load(_ShortFetch(bank, 3), hl, model, b)
    assert got.match.resume.tokens == 40
    assert got.fetch is not None and not got.fetch.complete
    assert got.tokens == 24  # pages 0..2 arrived
    assert got.cache.get_seq_length() == 24
    ref = _logits(model, torch.tensor([b]), None)
    assert torch.allclose(_logits(model, got.rest, got.cache), ref, atol=1e-5)


def test_miss_gives_an_empty_cache_and_the_whole_prompt(bank: Bank) -> None:
    model = M.build("mamba2", "float32")
    _, b = M.prompts()
    got = kt.load(bank, kt.layout_for(model, tokens_per_page=8), model, b)
    assert got.tokens == 0 and got.fetch is None
    assert got.rest.tolist() == [b] and got.generate_ids.tolist() == [b]
    assert torch.allclose(_logits(model, got.rest, got.cache),
                          _logits(model, torch.tensor([b]), None), atol=1e-6)


def test_store_hands_back_a_cache_that_goes_on_generating(bank: Bank) -> None:
    """The storing worker's cache (sliding layers trimmed back after recording) decodes
    like a plain prefill's."""
    model = M.build("mistral", "float32")
    a, _ = M.prompts()
    stored = kt.store(bank, hl := kt.layout_for(model, tokens_per_page=8), model, a)
    assert stored.pages == (len(a) // 8,)
    assert stored.nbytes == stored.pages[0] * hl.layout.group_bytes(0)
    nxt = torch.tensor([[int(stored.logits.argmax())]])
    plain = _logits(model, torch.tensor([[*a, int(nxt)]]), None)
    assert torch.allclose(_logits(model, nxt, stored.cache), plain, atol=1e-5)
    assert stored.cache.layers[0].keys.shape[-2] == 23  # back to keeping S - 1 tokens


def test_shared_prompt_scenario_resumes_the_system_prompt(bank: Bank) -> None:
    from kvbank.integrations.scenario import shared_prompt_scenario, tiny_llama

    result = shared_prompt_scenario(bank, tiny_llama(max_tokens=512), system_tokens=256,
                                    question_tokens=24, new_tokens=4)
    assert result.prompt_tokens == 280 and result.shared_tokens == 256
    assert result.tokens_resumed == 256
    assert result.hit_rate == pytest.approx(256 / 280)
    assert result.bytes_fetched == 16 * (4 * 2 * 2 * 32 * 16 * 4)  # 16 pages of 32 KiB
    assert result.same_tokens
    assert result.ttft_with_s > 0 and result.ttft_without_s > 0
    text = result.summary()
    for words in ("hit rate", "tokens resumed", "bytes fetched", "first token", "same answer"):
        assert words in text


def test_stored_recurrent_cache_decodes_outside_inference_mode(bank: Bank) -> None:
    """A recurrent layer updates its state in place (copy_); the storing prefill must not
    leave inference tensors behind, or the next forward under no_grad refuses them."""
    model = M.build("mamba2", "float32")
    a, _ = M.prompts()
    stored = kt.store(bank, kt.layout_for(model, tokens_per_page=8), model, a)
    nxt = torch.tensor([[int(stored.logits.argmax())]])
    with torch.no_grad():
        step = model(input_ids=nxt, cache=stored.cache, use_cache=True).logits[0, -1]
    assert torch.allclose(step, _logits(model, torch.tensor([[*a, int(nxt)]]), None), atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_on_a_cuda_model_from_host_pages(bank: Bank) -> None:
    """Pages live in host memory; the restored cache lands on the model's device."""
    model = M.build("bamba", "float32").to("cuda")
    a, b = M.prompts()
    hl = kt.layout_for(model, tokens_per_page=8)
    kt.store(bank, hl, model, a, snapshot_every=5)
    got = kt.load(bank, hl, model, b)
    assert got.tokens == 40
    assert got.cache.layers[1].keys.device.type == "cuda"
    ref = _logits(model, torch.tensor([b], device="cuda"), None)
    assert torch.allclose(_logits(model, got.rest, got.cache), ref, atol=5e-3)


class _Recording:
    """A real bank that records the names of the calls the adapter makes on it."""

    def __init__(self, bank: Bank) -> None:
        self.bank, self.calls = bank, list[str]()

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.bank, name)


def test_store_puts_every_snapshot_in_one_call_and_load_fetches_in_one(bank: Bank) -> None:
    """The adapter takes a WorkerAPI, so it uses the batch calls every bank has: one
    put_states for all snapshots, one fetch_prefix for the match and the fetch."""
    model = M.build("mamba2", "float32")
    a, b = M.prompts()
    hl = kt.layout_for(model, tokens_per_page=8)
    rec = _Recording(bank)
    stored = kt.store(rec, hl, model, a, snapshot_every=5)
    assert stored.snapshots == (40, 48)
    assert rec.calls.count("put_states") == 1 and "put_state" not in rec.calls
    rec.calls.clear()
    got = kt.load(rec, hl, model, b)
    assert rec.calls == ["fetch_prefix"]
    assert got.tokens == 40
    assert torch.allclose(_logits(model, got.rest, got.cache),
                          _logits(model, torch.tensor([b]), None), atol=1e-4)
