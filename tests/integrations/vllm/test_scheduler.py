"""The connector's scheduler half inside vLLM's own ``Scheduler`` (no model, no worker):
a real ``VllmConfig`` from a config folder, the connector built by vLLM's factory from
``kv_transfer_config``, real ``Request`` objects with vLLM's block hasher, a real node.

What must hold: a prompt kvbank holds is scheduled from kvbank's bound (only the tail
computed) with a load of exactly the blocks vLLM allocated; a miss is scheduled whole
with a save of every full prompt page; an audited hit is declined (scheduled whole, no
load) and its saves are marked for the audit up to the declined bound.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import HERE, Node, free_port, prompt, require_vllm

require_vllm()

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvbank import Client  # noqa: E402
from kvbank.integrations.vllm.metadata import KvbankMetadata  # noqa: E402

P = 32
BLOCKS = 128
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("node"), free_port())
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text((HERE / "llama.json").read_text())  # a config, no weights
    return d


@pytest.fixture
def make(model_dir: Path, node: Node) -> Iterator[Any]:
    """``make(**extra)``: a Scheduler with the connector; its connector shut down after."""
    made: list[Scheduler] = []

    def build(**extra: Any) -> Scheduler:
        made.append(scheduler(model_dir, node.url, **extra))
        return made[-1]

    yield build
    for s in made:
        s.connector.shutdown()


def scheduler(model_dir: Path, url: str, **extra: Any) -> Scheduler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                         max_model_len=2048, seed=0)
        cc = CacheConfig(block_size=P, enable_prefix_caching=True)
        cc.num_gpu_blocks = BLOCKS
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                             is_encoder_decoder=False)
        kt = KVTransferConfig(kv_connector="KvbankConnector", kv_role="kv_both",
                              kv_connector_module_path="kvbank.integrations.vllm",
                              kv_connector_extra_config={"url": url, **extra})
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=kt,
                        device_config=DeviceConfig("cpu"))
        spec = FullAttentionSpec(block_size=P, num_kv_heads=2, head_size=64, dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])
        return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=P, log_stats=False)


def request(rid: str, ids: list[int], params: dict[str, Any] | None = None) -> Request:
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, ids, sp, None, block_hasher=get_request_block_hasher(P, sha256))


def store(s: Scheduler, node: Node, req: Request, pages: int) -> None:
    """Put ``pages`` pages of ``req`` on the node under the connector's own layout and keys."""
    half = s.connector.sched
    keys = half.keys(req, pages)
    with Client(node.url) as c:
        c.register(half.vl.layout)
        c.put(half.vl.layout_id, group=0, pages=torch.zeros((pages, half.vl.layout.group_page_bytes[0]),
                                                              dtype=torch.uint8),
              keys=keys, scope=half.scope)


def meta_of(out: Any) -> KvbankMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvbankMetadata)
    return meta


def test_hit_is_scheduled_from_kvbanks_bound_with_a_load_of_the_allocated_blocks(
        node: Node, make: Any) -> None:
    s = make()
    ids = prompt(300, 21)  # 9 full pages and 12 tokens
    req = request("hit", ids)
    store(s, node, req, 6)  # kvbank holds the first 6 pages
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens["hit"] == 300 - 6 * P  # only the tail is computed
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == 6 * P
    meta = meta_of(out)
    [load] = meta.loads
    assert (load.req_id, load.tokens, load.local_tokens, load.is_async) == ("hit", 6 * P, 0, False)
    assert load.block_ids == tuple(tuple(g) for g in new.block_ids)
    assert len(load.keys) == 6
    [save] = meta.saves  # the pages computed now; the loaded ones are in kvbank already
    assert (save.first_page, len(save.keys)) == (6, 9)
    assert save.block_ids == (tuple(new.block_ids[0][6:9]),)
    assert meta.audits == {}
    assert pickle.loads(pickle.dumps(meta)) == meta  # vLLM pickles it to the workers


def test_miss_is_scheduled_whole_with_a_save_of_every_full_page(node: Node, make: Any) -> None:
    s = make()
    s.add_request(request("miss", prompt(300, 22)))
    out = s.schedule()
    assert out.num_scheduled_tokens["miss"] == 300
    meta = meta_of(out)
    assert meta.loads == []
    [save] = meta.saves
    assert (save.first_page, len(save.keys)) == (0, 9)
    assert save.block_ids == (tuple(out.scheduled_new_reqs[0].block_ids[0][:9]),)


def test_audited_hit_is_declined_and_its_saves_marked(node: Node, make: Any) -> None:
    s = make(audit_fraction=1.0)
    held = request("held", prompt(300, 23))
    skip = request("skip", prompt(300, 24), {"kvbank_audit": False})
    for r in (held, skip):
        store(s, node, r, 9)
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens["held"] == 300  # declined: computed whole
    meta = meta_of(out)
    assert [ld.req_id for ld in meta.loads] == ["skip"]  # the one that opted out of the audit
    assert meta.audits == {"held": 9}
    assert [(sv.req_id, sv.first_page) for sv in meta.saves] == [("held", 0)]  # skip loaded all 9
