"""kvbank as LMCache's L2 tier, against a real ``kvbank serve`` and LMCache 0.5.6's own code.

- LMCache's own checks pass: of an L2 adapter (``basic_check --mode test_l2_adapter``), and
  of its in-process StorageManager with kvbank's storage plugin as its only backend
  (``--mode test_storage_manager``).
- Through LMCache's ``StorageManager`` (L1 + store and prefetch controllers), objects one
  manager stored come back byte for byte into another manager's empty L1.
- Another model, object group, salt or layout is a miss; a lookup's READ lease keeps
  the rows in place until the unlock.
- A SIGKILLed node turns every task into a miss or a failed store, never an exception.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.lmcache.conftest import Driver, plugin_spec, require_lmcache

require_lmcache()

import torch  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kvbank.integrations.lmcache import KvbankL2Adapter  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    # LMCache's StorageManager sets up OpenTelemetry logging with a deprecated handler
    pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[3]
SHAPE = (2, 4, 256, 128)  # [K/V, layers, tokens, hidden]: 512 KiB of bfloat16 a chunk
DTYPE = torch.bfloat16


def _key(i: int, model: str = "org/tiny", group: int = 0, salt: str = "", rank: int = 0,
         world: int = 1) -> ObjectKey:
    h = i.to_bytes(4, "big") * 8  # 32 bytes, as blake3's
    return ObjectKey(chunk_hash=h, model_name=model,
                     kv_rank=ObjectKey.ComputeKVRank(world, rank, world, rank),
                     object_group_id=group, cache_salt=salt)


def _obj(t: torch.Tensor) -> TensorMemoryObj:
    t = t.contiguous()
    meta = MemoryObjMetadata(shape=t.shape, dtype=t.dtype, address=t.data_ptr(),
                             phy_size=t.numel() * t.element_size(), ref_count=1,
                             fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(t.view(-1), meta, parent_allocator=None)


def _data(n: int, seed: int, shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(DTYPE) for _ in range(n)]


def _desc(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = DTYPE) -> dict[int, MemoryLayoutDesc]:
    return {0: MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])}


def _stored(url: str, keys: list[ObjectKey]) -> list[bool]:
    """Whether the node holds each key's row (a pure query: no lease)."""
    from kvbank import Client
    from kvbank.integrations.lmcache.layout import ObjectShape, object_layout, scope_of

    with Client(url) as c:
        out = []
        for k in keys:
            layout = object_layout(k.model_name, k.object_group_id, k.kv_rank,
                                   ObjectShape.of([SHAPE], [DTYPE]))
            lid = c.register(layout)
            name = c.row_names(lid, keys=[k.chunk_hash], group=0, scope=scope_of("", k.cache_salt),
                               shard=layout.shard_index)[0]
            out.append(c.locate([name])[0] is not None)
        return out


def _adapter(url: str, **params: Any) -> KvbankL2Adapter:
    return KvbankL2Adapter({"url": url, **params})


def test_lmcache_basic_check_l2_adapter_passes(node: Any) -> None:
    """LMCache's own adapter check: absent keys miss, a batch stores, is found and loads
    with the same bytes (5/5 in every phase)."""
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter",
         "--kv-dtype", "bfloat16", "--l2-adapter", plugin_spec(node.url)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for line in ("Validation: 5/5 correctly absent", "Batch store OK", "Validation: 5/5 found",
                 "Validation (loaded): 5/5", "Validation (content): 5/5"):
        assert line in text, text[-3000:]
    assert "Test Failed" not in text, text[-3000:]


def test_lmcache_basic_check_storage_manager_passes(node: Any, tmp_path: Path) -> None:
    """LMCache's own check of its in-process StorageManager with kvbank as its only
    storage backend (the in-process plugin, LMCache's CPU cache off): absent keys are
    absent, puts land, are found, and gets return the same bytes (5/5 in every phase)."""
    conf = tmp_path / "lmcache.yaml"
    conf.write_text("\n".join([
        "chunk_size: 256", "local_cpu: false", "max_local_cpu_size: 1", 'storage_plugins: ["kvbank"]',
        "extra_config:",
        "  storage_plugin.kvbank.module_path: kvbank.integrations.lmcache.inproc",
        "  storage_plugin.kvbank.class_name: KvbankStoragePlugin",
        f"  storage_plugin.kvbank.url: {node.url}", ""]))
    out = subprocess.run([sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_storage_manager"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "LMCACHE_CONFIG_FILE": str(conf)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Created dynamic backend: kvbank" in text, text[-3000:]
    assert text.count("Validation: 5/5 passed (100.0%)") == 3, text[-3000:]  # absent, put, exists
    assert "Validation (content correct): 5/5 passed (100.0%)" in text, text[-3000:]
    assert "Test Failed" not in text, text[-3000:]


def test_store_lookup_load_roundtrip_byte_exact_and_locked(node: Any) -> None:
    """Stored objects come back byte for byte into a second adapter (another process's
    view: its own clients, no shapes learned); the lookup's READ lease holds the rows on
    the node until the unlock, and a load without a lookup takes a lease of its own."""
    data = _data(4, seed=1)
    keys = [_key(i) for i in range(4)]
    writer = _adapter(node.url)
    try:
        assert Driver(writer).store(keys, [_obj(t) for t in data])
    finally:
        writer.close()
    reader = _adapter(node.url)
    d = Driver(reader)
    try:
        from kvbank import Client

        with Client(node.url) as c:
            before = {lease.id for lease in c.leases()}  # other tests' leases, if any

            def ours() -> list[str]:
                return [lease.id for lease in c.leases() if lease.id not in before]

            assert d.lookup([*keys, _key(99)], _desc()) == [True] * 4 + [False]
            assert len(ours()) == 1  # one READ lease for the whole lookup
            out = [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(4)]
            assert d.load(keys, [_obj(t) for t in out]) == [True] * 4
            for got, want in zip(out, data, strict=True):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            reader.submit_unlock(keys[:2])
            time.sleep(0.2)
            assert len(ours()) == 1  # two keys still locked
            reader.submit_unlock([*keys[2:], _key(99)])  # a miss's unlock is a no-op
            for _ in range(100):
                if not ours():
                    break
                time.sleep(0.05)
            assert not ours()
            again = [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(2)]
            assert d.load(keys[:2], [_obj(t) for t in again]) == [True, True]
            assert torch.equal(again[1].view(torch.int16), data[1].view(torch.int16))
            assert not ours()  # the load's own lease ended with it
    finally:
        reader.close()


def test_a_row_changed_in_the_nodes_memory_is_a_miss_never_wrong_bytes(node: Any) -> None:
    """A stored object whose bytes changed in the node's host segment after commit (as
    another process of the node's uid can write them) fails its checksum when LMCache
    loads it: that key is a miss, and the other keys of the load come back byte exact."""
    from kvbank import Client, wire
    from kvbank.client.shm import Borrower
    from kvbank.lender.base import Lease

    data = _data(4, seed=41)
    keys = [_key(400 + i) for i in range(4)]
    writer = _adapter(node.url)
    try:
        assert Driver(writer).store(keys, [_obj(t) for t in data])
    finally:
        writer.close()
    reader = _adapter(node.url)
    try:
        shape = reader._desc_shape(keys[0], _desc())
        rows = reader._rows(keys, [shape] * 4)
        victim = rows[2]
        assert victim is not None
        with Client(node.url, channel="http") as c:
            doc = c._call("POST", "/v1/leases", body={"names": [victim.name.hex()], "mode": "READ"})
            try:
                lease = wire.from_dict(Lease, doc)
            finally:
                c.release(lease.id)
            with Borrower(writable=True) as b:
                b.view(lease, victim.name)[:64] = b"\xee" * 64
        d = Driver(reader)
        out = [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(4)]
        assert d.lookup(keys, _desc()) == [True] * 4
        assert d.load(keys, [_obj(t) for t in out]) == [True, True, False, True]
        reader.submit_unlock(keys)
        for i in (0, 1, 3):
            assert torch.equal(out[i].view(torch.int16), data[i].view(torch.int16))
        again = [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(4)]
        assert d.load(keys, [_obj(t) for t in again]) == [True, True, False, True]  # its own lease
    finally:
        reader.close()


def test_other_model_group_salt_rank_or_layout_misses(node: Any) -> None:
    """Negative controls: the same chunk hashes under another model, object group, cache
    salt or kv rank, or with another shape or dtype, are misses; and a load into a buffer
    of another layout fails instead of filling it with the stored bytes."""
    data = _data(2, seed=2)
    a = _adapter(node.url)
    d = Driver(a)
    try:
        assert d.store([_key(200 + i) for i in range(2)], [_obj(t) for t in data])
        assert d.lookup([_key(200 + i) for i in range(2)], _desc()) == [True, True]
        a.submit_unlock([_key(200 + i) for i in range(2)])
        assert d.lookup([_key(200 + i, model="org/other") for i in range(2)], _desc()) == [False, False]
        assert d.lookup([_key(200 + i, group=1) for i in range(2)], {1: _desc()[0]}) == [False, False]
        assert d.lookup([_key(200 + i, salt="user-b") for i in range(2)], _desc()) == [False, False]
        assert d.lookup([_key(200 + i, rank=0, world=2) for i in range(2)], _desc()) == [False, False]
        other = (2, 4, 128, 256)  # the same bytes a chunk, another layout
        assert d.lookup([_key(200 + i) for i in range(2)], _desc(other)) == [False, False]
        assert d.lookup([_key(200 + i) for i in range(2)], _desc(dtype=torch.float16)) == [False, False]
        wrong = torch.zeros(other, dtype=DTYPE)
        assert d.load([_key(200)], [_obj(wrong)]) == [False]
        assert not wrong.any()
    finally:
        a.close()


def test_killed_node_gives_misses_and_failed_stores(own_node: Any) -> None:
    """After SIGKILL of the node: lookups miss, loads fail, stores report failure, unlocks
    of held keys return at once; nothing raises into LMCache, and close() returns."""
    data = _data(2, seed=3)
    keys = [_key(i) for i in range(2)]
    a = _adapter(own_node.url, timeout_s=2, retry_s=0.2, breaker_s=1)
    d = Driver(a)
    try:
        assert d.store(keys, [_obj(t) for t in data])
        assert d.lookup(keys, _desc()) == [True, True]
        own_node.kill()
        a.submit_unlock(keys)  # the release fails: retried, then left to the lease's TTL
        assert d.lookup(keys, _desc()) == [False, False]
        out = torch.zeros(SHAPE, dtype=DTYPE)
        assert d.load(keys[:1], [_obj(out)]) == [False]
        assert d.store([_key(7)], [_obj(data[0])]) is False
        time.sleep(1.2)  # past the breaker: the node is asked again, and is still gone
        assert d.lookup(keys, _desc()) == [False, False]
        assert a.report_status()["is_healthy"] is False
    finally:
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 30


def test_storage_manager_roundtrip_through_kvbank_is_byte_exact(node: Any) -> None:
    """LMCache's StorageManager with kvbank as its L2: objects written into one manager's L1
    are stored to kvbank by its store controller; a second manager (empty L1) prefetches
    them from kvbank and reads the same bytes; keys never stored miss."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    def manager() -> StorageManager:
        with warnings.catch_warnings():  # the cloud clients LMCache's config imports warn
            warnings.simplefilter("ignore")
            return StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                                              "--l2-adapter", plugin_spec(node.url)]))

    n = 6
    data = _data(n, seed=4)
    keys = [_key(100 + i) for i in range(n)]
    desc = _desc()[0]
    first = manager()
    try:
        objs = first.reserve_write(keys, desc)
        assert len(objs) == n
        for k, t in zip(keys, data, strict=True):
            objs[k].tensor.copy_(t)
        first.finish_write(keys)
        for _ in range(600):  # the store controller writes to kvbank in the background
            if all(_stored(node.url, keys)):
                break
            time.sleep(0.05)
        assert all(_stored(node.url, keys))
    finally:
        first.close()

    second = manager()
    try:
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[*keys, _key(999)], object_group_id=0,
                                                              layout_desc=desc)],
                                fetching_policy="full")
        handle = second.submit_prefetch_task(spec)
        assert second.wait_prefetch_status(handle, 60)
        result = second.query_prefetch_status(handle)
        assert result is not None
        hits = [result.hit_cells[0].test(i) for i in range(n + 1)]
        assert hits == [True] * n + [False]
        assert [result.l2_hit_cells[0].test(i) for i in range(n)] == [True] * n
        with second.read_prefetched_results(keys, result.l1_owners) as got:
            assert got is not None
            for obj, want in zip(got, data, strict=True):
                assert torch.equal(obj.tensor.view(torch.int16), want.view(torch.int16))
    finally:
        second.close()
