"""The data dir's file system fills under a running ``kvbank serve``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.bench.reliability_disk import CannotMount, SmallFs
from kvbank.bench.reliability_procs import disk_full
from kvbank.testing.servers import in_ci

pytestmark = pytest.mark.slow


def _can_mount(tmp_path: Path) -> None:
    try:
        SmallFs.mount(tmp_path / "probe", 1).umount()
    except CannotMount as exc:
        if in_ci():
            pytest.fail(f"CI=true but no small file system can be mounted: {exc}")
        pytest.skip(f"needs a small mounted file system (root): {exc}")


def test_full_disk_degrades_puts_to_host_only_and_loses_no_stored_row(tmp_path: Path) -> None:
    """Regression: a full file system made LMDB fail its commits with EIO (mapped to
    TierUnavailable), the host tier then waited on dirty victims that could not be
    demoted and every put failed with 503; a restart on the full disk died writing
    admin.token. Now: the disk tier reports the full file system in its health, puts go
    on host-only, every row that was on disk reads back, then and after a restart."""
    _can_mount(tmp_path)
    res = disk_full(tmp_path, size_mib=8, extra_puts=300)
    assert res.stored > 100, res
    assert "full" in res.reason, res.reason
    assert res.refused == 0, f"{res.refused} of {res.puts_after} puts refused on a full disk"
    assert res.lost == 0 and res.restart_lost == 0, res
    assert res.wrong == 0, res
