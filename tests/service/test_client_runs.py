"""A same-host fetch merges rows lying back to back in the node's segment and in one
destination tensor into one copy (``kvbank.client.io.merged_copies``), and nothing else."""

from __future__ import annotations

import torch

from kvbank.client.io import merged_copies

SIZE = 64


def _slot(i: int, seg: str, off: int, buf: memoryview) -> tuple[int, tuple[str, int, int, memoryview]]:
    return i, (seg, off, SIZE, buf)


def test_back_to_back_rows_become_one_copy_and_every_break_splits_it() -> None:
    out = torch.zeros((8, SIZE), dtype=torch.uint8)
    rows = [[p, 0, k, SIZE] for p, k in enumerate([0, 1, 2, 3, 5, 6, 7])]  # row 4 of out skipped
    views = [memoryview(out.numpy()[k]) for _, _, k, _ in rows]
    offs = [0, 64, 128, 1000, 1064, 1128, 1192]  # a gap in the segment after the third row
    segs = ["a", "a", "a", "a", "a", "a", "b"]  # the last row lies in another segment
    slots = [_slot(i, segs[i], offs[i], views[i]) for i in range(len(rows))]
    jobs = merged_copies(slots, rows, {0: out})
    assert [(seg, off, size) for seg, off, size, _ in jobs] == [
        ("a", 0, 3 * SIZE),  # rows 0-2
        ("a", 1000, SIZE),  # row 3: its destination is out[3], the next row's out[5]
        ("a", 1064, 2 * SIZE),  # rows 5-6 of out
        ("b", 1192, SIZE),
    ]
    # each job's buffer is exactly the destination rows it covers
    for (_, _, size, buf), first in zip(jobs, [0, 3, 5, 7], strict=True):
        assert len(buf) == size
        buf[:] = bytes([first + 1]) * size
    got = out[:, 0].tolist()
    assert got == [1, 1, 1, 4, 0, 6, 6, 8]


def test_rows_into_separate_buffers_are_copied_one_by_one() -> None:
    bufs = [bytearray(SIZE) for _ in range(3)]
    rows = [[p, 0, p, SIZE] for p in range(3)]
    slots = [_slot(i, "a", i * SIZE, memoryview(bufs[i])) for i in range(3)]
    jobs = merged_copies(slots, rows, {0: bufs})
    assert [job[:3] for job in jobs] == [("a", 0, SIZE), ("a", SIZE, SIZE), ("a", 2 * SIZE, SIZE)]
    assert all(job[3].obj is b for job, b in zip(jobs, bufs, strict=True))


def test_groups_do_not_merge() -> None:
    out0 = torch.zeros((2, SIZE), dtype=torch.uint8)
    out1 = torch.zeros((2, SIZE), dtype=torch.uint8)
    rows = [[0, 0, 0, SIZE], [1, 1, 1, SIZE]]
    slots = [_slot(0, "a", 0, memoryview(out0.numpy()[0])), _slot(1, "a", SIZE, memoryview(out1.numpy()[1]))]
    assert len(merged_copies(slots, rows, {0: out0, 1: out1})) == 2
