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


def test_hybrid_controller_pages_and_state_stored_by_one_process_load_in_a_fresh_one_byte_for_byte(
        node: Any, tmp_path: Path) -> None:
    """SGLang's real ``HybridCacheController`` (a ``HostPoolGroup`` of the KV pool and the
    Mamba pool, kvbank attached through the ``dynamic`` factory) backs a prompt up as two
    radix nodes, pages 0-3 and 4-9, each with the state after it: per node its backup
    thread stores the state (``batch_set_v2``, one page) before the KV pages
    (``batch_set_v1``). A second one, in a fresh process, prefetches the prompt: the hit
    query finds both resume points, the IO thread loads the ten KV pages (``batch_get_v1``)
    then the state at page 10 (``batch_get_v2``), byte for byte. A prompt that leaves the
    stored one inside page 7 resumes at page 4, the last with a state, and gets that state;
    nodes backed up with their parents' keys load the same way; another model name finds
    nothing."""
    saved, chained = tmp_path / "hybrid.pt", tmp_path / "chained.pt"
    a = Engine(node.url, "tiny-mamba", tmp_path / "a.log", hybrid=True)
    try:
        assert a.ready == {"backend": "KvbankHiCacheStorage", "pools": ["kv", "mamba"]}
        got = a.call(op="store", seed=1, tokens=160, nodes=[4, 10], path=str(saved))
        assert got == {"stored": [[64, {"mamba": 1}], [96, {"mamba": 1}]],
                       "calls": {"backup_pages": [1, 4, 1, 6], "prefetch_pages": []}}
        # the nodes' backups carrying their parents' keys (hicache_storage_pass_prefix_keys)
        got = a.call(op="store", seed=2, tokens=96, nodes=[2, 6], prefix_keys=True, path=str(chained))
        assert got == {"stored": [[32, {"mamba": 1}], [64, {"mamba": 1}]],
                       "calls": {"backup_pages": [1, 2, 1, 4], "prefetch_pages": []}}
    finally:
        a.close()
    b = Engine(node.url, "tiny-mamba", tmp_path / "b.log", hybrid=True)
    other = Engine(node.url, "other-model", tmp_path / "c.log", hybrid=True)
    try:
        got = b.call(op="load", seed=1, tokens=160, path=str(saved))
        assert got == {"hit": 160, "restorable": [4, 10], "loaded": 160, "pool_hits": {"mamba": 1},
                       "kv_equal": True, "state_equal": True,
                       "calls": {"backup_pages": [], "prefetch_pages": [10, 1]}}
        got = b.call(op="load", seed=1, tokens=160, keep=100, path=str(saved))
        assert got == {"hit": 64, "restorable": [4], "loaded": 64, "pool_hits": {"mamba": 1},
                       "kv_equal": True, "state_equal": True,
                       "calls": {"backup_pages": [], "prefetch_pages": [4, 1]}}
        got = b.call(op="load", seed=2, tokens=96, path=str(chained))
        assert got == {"hit": 96, "restorable": [2, 6], "loaded": 96, "pool_hits": {"mamba": 1},
                       "kv_equal": True, "state_equal": True,
                       "calls": {"backup_pages": [], "prefetch_pages": [6, 1]}}
        assert other.call(op="load", seed=1, tokens=160, path=str(saved)) == \
            {"hit": 0, "restorable": [], "loaded": 0, "pool_hits": {},
             "calls": {"backup_pages": [], "prefetch_pages": []}}
    finally:
        b.close()
        other.close()
    for log in ("a.log", "b.log", "c.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
