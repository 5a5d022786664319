"""The user's data path: the layout's dtype reaches the codec on every path that stores
pages, and batched puts and fetches keep the single-row guarantees."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvbank import Bank, full_attention
from kvbank.builders import hybrid_mamba
from kvbank.codec import Method, frame_info
from kvbank.config import BankConfig, WritePolicy
from kvbank.errors import ConfigError, TierFull
from kvbank.lender.base import LeaseMode
from kvbank.tiers.disk import DiskTier, FrameWrite
from kvbank.tiers.store.copier import Lanes
from kvbank.tiers.store.reserve import free_memory

LAYOUT = full_attention("data-path@1", num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_page=16)
PAGE = LAYOUT.group_page_bytes[0]


def bf16_pages(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(n, PAGE // 2, generator=g).to(torch.bfloat16)
    return vals.view(torch.uint8).reshape(n, PAGE).contiguous()


def tokens(n_pages: int, seed: int = 0) -> list[int]:
    return [seed * 100_000 + i for i in range(n_pages * 16)]


def _headers(bank: Bank, names: list[bytes]) -> list[tuple[str, Method]]:
    out = []
    for name in names:
        frame = bank._store.read_frame(name)
        assert frame is not None, "row has no disk frame"
        info = frame_info(frame)
        out.append((info.dtype, info.method))
    return out


def test_put_write_through_frames_carry_the_layout_dtype(tmp_path: Path) -> None:
    """Frames of a bf16 layout are bf16 byte-plane frames, read back from the disk tier."""
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path,
                   write_policy=WritePolicy.WRITE_THROUGH) as b:
        lid = b.register(LAYOUT)
        names = b.put(lid, tokens(4), group=0, pages=bf16_pages(4, 1))
        assert _headers(b, names) == [("bfloat16", Method.PLANES)] * 4


def test_demoted_and_written_back_rows_carry_the_layout_dtype(tmp_path: Path) -> None:
    """Rows that reach the disk by demotion (write-back at close included) keep the dtype."""
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path) as b:
        lid = b.register(LAYOUT)
        names = b.put(lid, tokens(3), group=0, pages=bf16_pages(3, 2))
    disk = DiskTier(tmp_path, 64 << 20)
    try:
        infos = [frame_info(disk.read_frame(n) or b"") for n in names]
    finally:
        disk.close()
    assert [(i.dtype, i.method) for i in infos] == [("bfloat16", Method.PLANES)] * 3


def test_put_state_and_lease_commit_carry_the_layout_dtype(tmp_path: Path) -> None:
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path,
                   write_policy=WritePolicy.WRITE_THROUGH) as b:
        lid = b.register(LAYOUT)
        names = b.row_names(lid, tokens(2, 5), group=0)
        lease = b.lend(names, mode=LeaseMode.WRITE, ttl_s=30)
        pages = bf16_pages(2, 3)
        for i, n in enumerate(names):
            b.write(lease.id, n, pages[i].numpy().tobytes())
        assert b.commit(lease.id, names).committed == tuple(names)
        assert _headers(b, names) == [("bfloat16", Method.PLANES)] * 2
        out = torch.zeros(2, PAGE, dtype=torch.uint8)
        got = b.fetch(b.match(lid, [*tokens(2, 5), 0]), out={0: out})
        assert got.complete and torch.equal(out, pages)

    hybrid = hybrid_mamba("data-path-hybrid@1", [0], [1], 2, 64, conv_shape=(8, 4),
                          ssm_shape=(2, 16, 8), state_dtype="bfloat16")
    mixed = hybrid_mamba("data-path-mixed@1", [0], [1], 2, 64, conv_shape=(8, 4),
                         ssm_shape=(2, 16, 8))
    assert hybrid.page_dtype(1) == "bfloat16" and mixed.page_dtype(1) == "uint8"
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path / "h",
                   write_policy=WritePolicy.WRITE_THROUGH) as b:
        dtypes = []
        for layout in (hybrid, mixed):
            lid = b.register(layout)
            size = layout.group_page_bytes[1]
            name = b.put_state(lid, tokens(2, 7), group=1, state=bytes(range(256)) * (size // 256)
                               + bytes(size % 256))
            dtypes.append(_headers(b, [name])[0][0])
        assert dtypes == ["bfloat16", "uint8"]


def test_batched_put_and_fetch_match_bytes_and_counters(tmp_path: Path) -> None:
    """A 70-page put and fetch (more than one put and fetch batch) give back the exact
    bytes, and the store counts one put and one hit per row, as row by row would."""
    pages = bf16_pages(70, 4)
    with Bank.open(host_bytes="64M", device_bytes=0, copy_threads=2) as b:
        lid = b.register(LAYOUT)
        b.put(lid, tokens(70), group=0, pages=pages)
        out = torch.zeros(70, PAGE, dtype=torch.uint8)
        got = b.fetch(b.match(lid, [*tokens(70), 0]), out={0: out})
        assert got.complete and torch.equal(out, pages)
        st = b.stats().store
        assert (st.puts, st.gets, st.hits, st.misses) == (70, 70, 70, 0)
        b.check_invariants()


def test_group_commit_is_durable_and_fetched_from_disk_after_reopen(tmp_path: Path) -> None:
    """An acknowledged write-through put is on disk even if memory rows are dropped as a
    crash would drop them (close without write-back); a reopened bank fetches it."""
    pages = bf16_pages(12, 5)
    b = Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path,
                  write_policy=WritePolicy.WRITE_THROUGH)
    lid = b.register(LAYOUT)
    b.put(lid, tokens(12), group=0, pages=pages)
    b._lender.close()
    b._store.close(persist=False)
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path) as b2:
        lid = b2.register(LAYOUT)
        m = b2.match(lid, [*tokens(12), 0])
        assert m.resume.tokens == 12 * 16
        out = torch.zeros(12, PAGE, dtype=torch.uint8)
        assert b2.fetch(m, out={0: out}).complete and torch.equal(out, pages)
        b2.check_invariants()


def test_write_through_batch_commits_chunk_by_chunk(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-through batch larger than a chunk is committed a chunk per transaction
    (the next chunk encodes while one commits), every page durable when the put returns."""
    import lmdb

    from kvbank.tiers.store import writes

    monkeypatch.setattr(writes, "WRITE_CHUNK_BYTES", 4 * PAGE)
    pages = bf16_pages(12, 8)
    b = Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path, copy_threads=2,
                  write_policy=WritePolicy.WRITE_THROUGH)
    lid = b.register(LAYOUT)
    before = b._store._st.disk()._env.info()["last_txnid"]  # type: ignore[attr-defined]
    b.put(lid, tokens(12), group=0, pages=pages)
    b._lender.close()
    b._store.close(persist=False)  # memory rows dropped, as a crash would drop them
    env = lmdb.open(str(tmp_path / "lmdb"), subdir=True, max_dbs=2, lock=True)
    commits = env.info()["last_txnid"] - before
    env.close()
    assert commits == 3, f"{commits} transactions for 3 chunks of 4 pages"
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path) as b2:
        lid = b2.register(LAYOUT)
        out = torch.zeros(12, PAGE, dtype=torch.uint8)
        assert b2.fetch(b2.match(lid, [*tokens(12), 0]), out={0: out}).complete
        assert torch.equal(out, pages)


def test_write_frames_is_all_or_nothing(tmp_path: Path) -> None:
    """A group commit over the budget writes none of its frames."""
    disk = DiskTier(tmp_path, 3000)
    try:
        raw = [os.urandom(1000) for _ in range(4)]  # incompressible: RAW frames of 1040 bytes
        rows = [FrameWrite(bytes([i + 1]) * 54, disk.frame(r, "uint8"), 1000, "uint8")
                for i, r in enumerate(raw)]
        with pytest.raises(TierFull):
            disk.write_frames(rows)
        assert disk.used_bytes == 0 and disk.names() == []
        disk.write_frames(rows[:2])
        assert sorted(disk.names()) == sorted(r.name for r in rows[:2])
        out = bytearray(1000)
        assert disk.read_into(rows[1].name, out) == 1000 and bytes(out) == raw[1]
    finally:
        disk.close()


def test_lanes_never_run_more_threads_than_configured() -> None:
    seen: set[int] = set()
    lock = threading.Lock()
    active = [0, 0]  # now, most at once

    def work(i: int) -> int:
        with lock:
            seen.add(threading.get_ident())
            active[0] += 1
            active[1] = max(active[1], active[0])
        time.sleep(0.002)  # gives other lanes a chance to overlap (no timing asserted)
        with lock:
            active[0] -= 1
        return i * 2

    for threads in (1, 3):
        lanes = Lanes(threads)
        try:
            seen.clear()
            active[1] = 0
            assert lanes.map(work, list(range(12))) == [i * 2 for i in range(12)]
            assert len(seen) <= threads and active[1] <= threads
            seen.clear()
            assert lanes.map(work, [5]) == [10]
            assert seen == {threading.get_ident()}  # one item stays on the caller's thread
        finally:
            lanes.close()


def test_lanes_raise_after_every_lane_finished() -> None:
    """The first exception is raised only once no lane runs an item any more, and no lane
    starts an item after it."""
    lock = threading.Lock()
    running = [0]
    started: list[int] = []
    def work(i: int) -> int:
        with lock:
            started.append(i)
            running[0] += 1
        try:
            if i == 0:
                time.sleep(0.01)  # the other lane is inside an item when this raises
                raise ValueError("boom")
            time.sleep(0.002)
            return i
        finally:
            with lock:
                running[0] -= 1

    lanes = Lanes(2)
    try:
        with pytest.raises(ValueError, match="boom"):
            lanes.map(work, list(range(200)))
        assert running[0] == 0  # every lane finished its item before map raised
        assert 0 in started and len(started) < 200  # the rest were never started
    finally:
        lanes.close()


def test_lanes_share_the_work_when_a_lane_is_slow() -> None:
    """Lanes take the next item when free: a lane stuck on one item does not hold back
    the items another lane can run (results stay in item order)."""
    release = threading.Event()
    ran_by: dict[int, int] = {}

    def work(i: int) -> int:
        ran_by[i] = threading.get_ident()
        if i == 0:
            assert release.wait(30), "the other lane never ran the rest"
        elif i == 9:
            release.set()
        return -i

    lanes = Lanes(2)
    try:
        assert lanes.map(work, list(range(10))) == [-i for i in range(10)]
        assert {ran_by[i] for i in range(1, 10)} == {ran_by[9]} != {ran_by[0]}
    finally:
        lanes.close()


def test_copy_threads_setting_is_checked() -> None:
    assert BankConfig.from_env({"KVBANK_COPY_THREADS": "3"}).copy_threads == 3
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="copy_threads"):
            BankConfig(copy_threads=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="COPY_THREADS"):
        BankConfig.from_env({"KVBANK_COPY_THREADS": "many"})


def test_reserve_host_prefaults_the_budget_in_the_background() -> None:
    with Bank.open(host_bytes="96M", device_bytes=0, reserve_host=True) as b:
        r = b.reservation
        assert r is not None and r.target_bytes > 0
        assert r.wait(60) and r.error is None and r.done_bytes == r.target_bytes
        lid = b.register(LAYOUT)
        pages = bf16_pages(4, 6)
        b.put(lid, tokens(4), group=0, pages=pages)
        out = torch.zeros(4, PAGE, dtype=torch.uint8)
        assert b.fetch(b.match(lid, [*tokens(4), 0]), out={0: out}).complete
        assert torch.equal(out, pages)
    with Bank.open(host_bytes="96M", device_bytes=0) as b:
        assert b.reservation is None  # off unless asked for


def test_reserve_larger_than_free_memory_is_a_config_error() -> None:
    too_much = free_memory() + (1 << 30)
    with pytest.raises(ConfigError, match=r"reserve_host.*free") as info:
        Bank.open(host_bytes=too_much, device_bytes=0, reserve_host=True)
    assert info.value.field == "reserve_host"
    assert BankConfig.from_env({"KVBANK_RESERVE_HOST": "true"}).reserve_host is True


def test_mover_demotions_group_commit_and_keep_the_dtype(tmp_path: Path) -> None:
    """Puts past the host budget are demoted by the mover (several per transaction):
    every row is then readable with its bytes, and its disk frame is a bf16 frame."""
    pages = bf16_pages(40, 8)
    with Bank.open(host_bytes=24 * PAGE, device_bytes=0, data_dir=tmp_path) as b:
        lid = b.register(LAYOUT)
        names = b.put(lid, tokens(40), group=0, pages=pages)
        b.flush()
        on_disk = [n for n in names if b._store.read_frame(n) is not None]
        assert len(on_disk) >= 16  # the budget holds 24 pages at most
        assert set(_headers(b, on_disk)) == {("bfloat16", Method.PLANES)}
        out = torch.zeros(40, PAGE, dtype=torch.uint8)
        got = b.fetch(b.match(lid, [*tokens(40), 0]), out={0: out})
        assert got.complete and torch.equal(out, pages)
        b.check_invariants()


def test_put_of_no_pages_stores_nothing() -> None:
    with Bank.open(host_bytes="64M", device_bytes=0) as b:
        lid = b.register(LAYOUT)
        assert b.put(lid, tokens(2), group=0, pages=torch.empty(0, PAGE, dtype=torch.uint8)) == []
        assert b.stats().store.puts == 0
