"""A real ``kvbank serve`` keeps its data dir private (served-node review D4, D6)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from kvbank import Client
from kvbank.builders import full_attention
from tests.service.conftest import start_node

LAYOUT = full_attention("private@1", num_layers=1, num_kv_heads=1, head_dim=64)


@pytest.mark.slow
def test_the_data_dir_is_owner_only_and_follows_no_planted_symlink(tmp_path: Path) -> None:
    """Regression: at umask 022 the node created the data dir 0755 and ``data.mdb``,
    ``lock.mdb``, ``kvbank.lock`` 0644 (every tenant's pages world-readable, D4), and it
    wrote ``layouts.json`` through ``layouts.json.tmp``, a predictable name a planted
    symlink redirected onto any file the node may write (D6)."""
    data = tmp_path / "data"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    old = os.umask(0o022)
    try:
        data.mkdir()
        os.chmod(data, 0o700)  # an attacker needs write access here to plant: the setup only
        (data / "layouts.json.tmp").symlink_to(victim)
        node = start_node(data)
    finally:
        os.umask(old)
    try:
        with Client(node.url, same_host=False) as c:
            lid = c.register(LAYOUT)
            c.put(lid, list(range(LAYOUT.tokens_per_page)), group=0,
                  pages=torch.zeros((1, LAYOUT.group_page_bytes[0]), dtype=torch.uint8))
    finally:
        assert node.stop() == 0, "".join(node.lines)[-3000:]
    assert victim.read_text() == "precious"
    assert not (data / "layouts.json").is_symlink()
    loose = []
    for p in [data, *data.rglob("*")]:
        st = os.lstat(p)
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        kept = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
        if kept and stat.S_IMODE(st.st_mode) != want:
            loose.append(f"{p.relative_to(data)} {oct(stat.S_IMODE(st.st_mode))}")
    assert not loose, loose
