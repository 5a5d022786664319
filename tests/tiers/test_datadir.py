"""The data dir's private files (kvbank.tiers.datadir): modes whatever the umask, and no
file written through a planted symlink (served-node review D4, D6)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbank.tiers.datadir import open_private, private_dir, replace_file, tighten


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_private_dir_and_files_are_owner_only_at_umask_022(tmp_path: Path, loose_umask: None) -> None:
    d = tmp_path / "a" / "b"
    private_dir(d)
    assert mode(d) == 0o700 and mode(d.parent) == 0o700
    replace_file(d / "f", b"x")
    fd = open_private(d / "g", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    assert mode(d / "f") == 0o600 and mode(d / "g") == 0o600
    (d / "old").write_bytes(b"made 0644 by an older version")
    assert mode(d / "old") == 0o644
    tighten([d / "old", d / "missing"])
    assert mode(d / "old") == 0o600


def test_replace_file_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o644)
    target = tmp_path / "layouts.json"
    target.symlink_to(victim)  # planted at the target: the rename replaces the link
    for old_tmp in ("layouts.json.tmp", ".layouts.json.tmp"):
        (tmp_path / old_tmp).symlink_to(victim)  # planted at the names once used
    replace_file(target, b"new")
    assert victim.read_bytes() == b"precious" and mode(victim) == 0o644
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".layouts.json.tmp", "layouts.json", "layouts.json.tmp", "victim"]  # no temp file left
    link = tmp_path / "log"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        open_private(link, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # refused, not followed
    assert victim.read_bytes() == b"precious"
