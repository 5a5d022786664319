"""SGLang's real HiCacheController over a real MHATokenToKVPoolHost, with the kvbank backend
attached through SGLang's own ``dynamic`` factory, against a real ``kvbank serve``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.conftest import Engine, require_sglang

require_sglang()

pytestmark = pytest.mark.slow


def test_pages_and_state_stored_by_one_process_load_in_a_fresh_one_byte_for_byte(
        node: Any, tmp_path: Path) -> None:
    """What one SGLang process backs up (its controller's KV pages, its Mamba pool's
    snapshots at pages 2 and 4), another (a fresh process, same model) finds and loads into
    its host pools' slots unchanged, with exactly the resume points SGLang's own file
    backend would answer; pages stored from a host pool of any layout load into a pool of
    any other; four threads at once store and load their own prompts intact; another model
    name finds nothing; and a node killed mid-run turns every
    call into a miss, never an error in the controller."""
    saved, states = tmp_path / "pages.pt", tmp_path / "states.pt"
    a = Engine(node.url, "tiny-llama", tmp_path / "a.log")
    try:
        assert a.ready == {"backend": "KvbankHiCacheStorage"}
        assert a.call(op="store", seed=1, tokens=160, path=str(saved)) == {"stored": 160}
        assert a.call(op="state_store", seed=1, tokens=160, at=[2, 4], path=str(states)) == \
            {"stored": [[True], [True]]}
    finally:
        a.close()
    b = Engine(node.url, "tiny-llama", tmp_path / "b.log")
    other = Engine(node.url, "other-model", tmp_path / "c.log")
    try:
        got = b.call(op="load", seed=1, tokens=160, path=str(saved))
        assert got == {"hit": 160, "pages": 10, "equal": True}
        got = b.call(op="state_load", seed=1, tokens=160, path=str(states))
        assert got == {"kv_hit_pages": 4, "restorable": [2, 4], "pool_hits": {"kv": 10, "mamba": 4},
                       "equal": [True, True]}
        assert b.call(op="load", seed=2, tokens=160, path=str(saved)) == {"hit": 0}
        assert other.call(op="load", seed=1, tokens=160, path=str(saved)) == {"hit": 0}
        assert other.call(op="state_load", seed=1, tokens=160, path=str(states)) == \
            {"kv_hit_pages": 0, "restorable": [], "pool_hits": {}, "equal": []}
        diff = other.call(op="diff", seed=5, tokens=0, cases=24, dir=str(tmp_path / "file"))
        assert diff == {"cases": 24, "mismatches": []}
        assert b.call(op="threads", seed=7, tokens=0) == {"failures": []}
        # every host layout SGLang's MHA pool has, stored and loaded both ways (v1, legacy)
        assert other.call(op="layouts", seed=6, tokens=64) == {"mismatches": []}
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(30)
        assert b.call(op="load", seed=1, tokens=160, path=str(saved)) == {"hit": 0}
        down = b.call(op="store", seed=3, tokens=64, path=str(tmp_path / "p3.pt"))
        assert down == {"stored": 0}
    finally:
        b.close()
        other.close()
    assert "Traceback" not in (tmp_path / "b.log").read_text()
