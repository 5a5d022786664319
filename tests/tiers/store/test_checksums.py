"""Committed memory rows carry a checksum: recorded at every publish, verified on reads.

Another process of the segment's uid can write into a committed host slot (the
served-node review's D1). What must hold: the row's checksum is recorded whatever path
put its bytes in host memory (a put, a WRITE lease's commit, a stage from disk), a read
of changed bytes is a miss and never the changed bytes, the changed host copy is dropped
once nothing holds it, and the mover never encodes changed bytes into a fresh frame.
"""

from __future__ import annotations

import pytest
import torch

from kvbank.codec import checksum
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.host import map_segment

from ..conftest import MakeStore

P = 4096


def _scribble(store, i: int) -> None:
    """Overwrite the start of row ``i``'s host slot from another mapping of the segment,
    as a process of the segment's uid can (found by its bytes: no lookup, no lease)."""
    seg = store.host.segment
    assert seg is not None
    mm = map_segment(seg.segment, writable=True)
    try:
        at = mm.find(page_of(i, P))
        assert at >= 0
        mm[at : at + 8] = b"\xee" * 8
    finally:
        mm.close()


def _read(store, i: int) -> bytes | None:
    out = bytearray(P)
    n = store.get_into(name_of(i), out)
    return None if n is None else bytes(out[:n])


def test_every_publish_into_host_records_the_rows_checksum(make_store: MakeStore) -> None:
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))  # a put
    slot = s.host.reserve(P, "w")  # a WRITE lease's commit
    view = s.host.view(slot)
    view[:] = page_of(2, P)
    view.release()
    s.host.commit(name_of(2), slot)
    assert s.host.checksums([name_of(1), name_of(2), name_of(3)]) == [
        checksum(page_of(1, P)), checksum(page_of(2, P)), None]
    for i in range(10, 60):  # pressure: the first rows go down to disk
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert s.locate([name_of(10)]) == [TierKind.DISK]
    s.locks.lock([name_of(10)], "r")
    assert s.host.stage(name_of(10)) is not None  # staged back from disk
    assert s.host.checksums([name_of(10)]) == [checksum(page_of(10, P))]
    s.locks.unlock_all("r")


def test_a_read_of_changed_host_bytes_is_a_miss_and_the_copy_is_dropped(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    for i in range(3):
        s.put(name_of(i), page_of(i, P))
    _scribble(s, 1)
    assert _read(s, 0) == page_of(0, P)
    assert _read(s, 1) is None  # never the scribbled bytes
    assert s.locate([name_of(1)]) == [None]  # dropped: no disk copy to fall back on
    outs = [bytearray(P) for _ in range(3)]
    _scribble(s, 2)
    assert s.get_many_into([name_of(0), name_of(1), name_of(2)], outs) == [P, None, None]
    assert s.locate([name_of(2)]) == [None]


def test_a_changed_row_held_by_a_lease_is_dropped_only_when_the_lease_ends(
        make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    _scribble(s, 1)
    s.locks.lock([name_of(1)], "reader")
    assert s.host.quarantine([name_of(1)]) == []  # held: left for its next read
    slot = s.host.stage(name_of(1))
    assert slot is not None
    view = s.host.view(slot)
    assert not s.host.verify(name_of(1), view)
    view.release()
    s.locks.unlock_all("reader")
    assert s.host.quarantine([name_of(1)]) == [name_of(1)]
    assert s.locate([name_of(1)]) == [None]


def test_a_good_row_is_never_dropped_by_quarantine(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    assert s.host.quarantine([name_of(1), name_of(2)]) == []
    assert _read(s, 1) == page_of(1, P)


def test_the_mover_never_writes_changed_host_bytes_to_disk(make_store: MakeStore) -> None:
    """A demotion encodes the slot's bytes: a frame whose checksum is not the row's is not
    written (it would launder the change into a valid frame), and the copy is dropped."""
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i in range(4):
        s.put(name_of(i), page_of(i, P))
    _scribble(s, 1)
    for i in range(10, 60):  # pressure: the first rows go down to disk
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert s.locate([name_of(0)]) == [TierKind.DISK]
    assert s.locate([name_of(1)]) == [None]
    assert _read(s, 1) is None
    assert _read(s, 0) == page_of(0, P) and _read(s, 2) == page_of(2, P)


def test_a_device_commit_gets_its_checksum_when_the_mover_copies_it_to_host(
        make_store: MakeStore) -> None:
    """A device commit records none (device memory is mapped by no other process); the
    mover's copy down into a host slot records the host copy's."""
    s = make_store(device="cpu", device_bytes=32 * 1024, host_bytes=1 << 20, disk_bytes=1 << 20)
    w = s.device.reserve(P, "dw")
    s.device.view(w).copy_(torch.frombuffer(bytearray(page_of(1, P)), dtype=torch.uint8))
    s.device.commit(name_of(1), w)
    assert s.host.checksums([name_of(1)]) == [None]  # not in host yet
    for i in range(10, 30):  # pressure on the device: its rows go down to host
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert s.locate([name_of(1)]) == [TierKind.HOST]
    assert s.host.checksums([name_of(1)]) == [checksum(page_of(1, P))]


def test_a_commit_keeps_the_writers_checksums_and_a_wrong_one_is_a_miss(make_store: MakeStore,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``commit_many`` with the checksums a writer hashed as it copied: they are the rows'
    (the slots are not hashed again: a row whose sum was given is never hashed here), a
    row with none given is hashed as before, and a wrong one makes the row fail its read
    (a miss, the copy dropped): other bytes are never served."""
    s = make_store(data_dir=None, host_bytes=1 << 20)
    slots = [s.host.reserve(P, "w") for _ in range(3)]
    for i, slot in enumerate(slots):
        view = s.host.view(slot)
        view[:] = page_of(i, P)
        view.release()
    hashed: list[int] = []

    def counted(data: memoryview) -> int:
        hashed.append(len(data))
        return checksum(data)

    monkeypatch.setattr("kvbank.tiers.store.inplace.checksum", counted)
    published: list[bytes] = []
    s.host.commit_many([(name_of(i), slot, "uint8", None) for i, slot in enumerate(slots)], published,
                       {name_of(0): checksum(page_of(0, P)), name_of(1): checksum(page_of(1, P)) ^ 1})
    assert published == [name_of(0), name_of(1), name_of(2)]
    assert hashed == [P]  # only row 2, whose writer sent none
    assert s.host.checksums([name_of(i) for i in range(3)]) == [
        checksum(page_of(0, P)), checksum(page_of(1, P)) ^ 1, checksum(page_of(2, P))]
    assert _read(s, 0) == page_of(0, P) and _read(s, 2) == page_of(2, P)
    assert _read(s, 1) is None  # its writer's sum does not match its bytes: a miss
    assert s.locate([name_of(1)]) == [None]
