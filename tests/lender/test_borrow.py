"""The borrower's mappings: page tables built up front (``populate=True``) show the
owner's bytes, and a close during population stops it before unmapping."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator

import numpy as np
import pytest

from kvbank.lender.borrow import POPULATE_STEP, Borrower
from kvbank.tiers.host import SHM_DIR


@pytest.fixture
def segment() -> Iterator[tuple[str, np.ndarray]]:
    """A resident shared-memory segment of three populate steps, filled by its owner."""
    name = f"kvbank-test-borrow-{secrets.token_hex(4)}"
    size = 3 * POPULATE_STEP
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    np.frombuffer(mm, dtype=np.uint8)[:] = data
    try:
        yield name, data
    finally:
        mm.close()
        os.unlink(SHM_DIR / name)


@pytest.mark.parametrize("writable", [False, True])
def test_borrow_populated_mapping_shows_the_owners_bytes(segment: tuple[str, np.ndarray],
                                                         writable: bool) -> None:
    name, data = segment
    with Borrower(writable=writable, populate=True) as b:
        assert b.wait_populated(name, timeout=120.0)
        assert np.array_equal(np.frombuffer(b.segment(name), dtype=np.uint8), data)


def test_borrow_close_during_population_unmaps_cleanly(segment: tuple[str, np.ndarray]) -> None:
    name, data = segment
    b = Borrower(populate=True)
    view = b.segment(name)
    assert view[:16] == data[:16].tobytes()
    b.close()  # joins the populating thread (at most one step) before unmapping
    assert b.wait_populated(name, timeout=120.0)  # maps it again, populates again
    b.close()


def test_borrow_without_populate_starts_no_thread(segment: tuple[str, np.ndarray]) -> None:
    name, _ = segment
    with Borrower() as b:
        assert b.wait_populated(name, timeout=0.0)  # nothing to wait for
