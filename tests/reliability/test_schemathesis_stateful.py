"""Schemathesis over the whole served spec, statefully: sequences of calls that follow
the spec's OpenAPI links (a registered layout read back, a lend then renewed, committed,
checked and released, a match fetched under a lease and acknowledged, a listed lease
force-released), on a node with tenant tokens. Admin routes carry the admin token, data
routes a tenant's. Every answer: no 5xx, and a body matching its declared schema.

Driven by hand (``schema.as_state_machine()``) as tests/service/test_openapi.py drives
the stateless run: the pytest plugin does not load on this pytest. Bounded: a fixed
number of scenarios of a few steps each, derandomized."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from kvbank import Bank, Scope, wire
from kvbank.service.admin.routes import admin_of
from tests.service.admin_app import FA, TOKEN, P, fill, served

TENANT = "tenant-a-token-0123456789"
SCENARIOS = 160  # ~15 s quiet, about two minutes on a loaded 2-core machine; fewer missed
# the renew and ack links once in four CI runs after the node gained two routes
STEPS = 8
MIN_TTL_S = 60.0  # the shortest lease or handle a scenario takes (longer than any scenario)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any], Bank]]:
    with served(tmp_path_factory.mktemp("stateful"), tenants=(("a", TENANT),)) as (client, node):
        names = fill(node.bank, 3, 1, scope=Scope("a"))
        match = {"layout_id": FA.layout_id.hex(), "tokens": [*range(10_000, 10_000 + 3 * P), 1]}
        # the tenant's own match teaches the node that these rows' namespace is a's
        got = client.post("/v1/match", json=match, headers={"Authorization": f"Bearer {TENANT}"})
        assert got.status_code == 200 and got.json()["resume"]["tokens"] == 3 * P, got.text
        # Valid first steps, used for every other call of these operations, so that the
        # linked follow-ups get real lease ids, fetch ids and matches to work on (random
        # bodies alone almost never register a layout or lend a row).
        seeds = {
            "/v1/match": match,
            "/v1/leases": {"names": [n.hex() for n in names], "mode": "READ", "ttl_s": 60},
            "/v1/layouts": {"layout": wire.to_dict(FA)},
        }
        yield client.app, seeds, node.bank


def _token(path: str) -> str:
    return TENANT if path.startswith("/v1/") else TOKEN


def test_the_spec_links_the_operations_that_follow_each_other(app: tuple[Any, Any, Any]) -> None:
    doc = schemathesis.openapi.from_asgi("/openapi.json", app[0]).raw_schema
    linked = {(m, p): set(op["responses"]["200"].get("links", {}))
              for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert linked[("post", "/v1/leases")] == {"renew", "commit", "check", "release"}
    assert linked[("post", "/v1/layouts")] == {"get_layout"}
    assert linked[("post", "/v1/match")] == {"fetch"} and linked[("post", "/v1/fetch")] == {"ack"}
    ids = {op["operationId"] for ops in doc["paths"].values() for op in ops.values()}
    targets = {link["operationId"] for ops in doc["paths"].values() for op in ops.values()
               for link in op["responses"]["200"].get("links", {}).values()}
    assert targets <= ids  # every link names an operation that exists


def test_stateful_sequences_never_answer_5xx_and_conform(app: tuple[Any, dict[str, Any], Any]) -> None:
    asgi, seeds, bank = app
    schema = schemathesis.openapi.from_asgi("/openapi.json", asgi)
    base = schema.as_state_machine()
    statuses: list[int] = []
    paths: list[str] = []

    class NodeMachine(base):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            # each scenario starts from the same node state (what a link hands on is drawn
            # from answers; answers that depend on earlier scenarios make the run flaky)
            for lease in bank.leases():
                bank.release(lease.id)
            admin_of(asgi).state.set_draining(False)
            for entry in bank.audit.entries():  # a scenario's audit report may quarantine FA
                bank.audit.clear(entry.layout_id)
            fill(bank, 3, 1, scope=Scope("a"))  # the seeded rows, back if a scenario evicted them

        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            if case.path == "/admin/drain":
                case.body = {"wait": False}  # a drained node would refuse the puts that follow
            # chosen from the generated body itself, so a replayed scenario chooses alike
            if case.method == "POST" and case.path in seeds and zlib.crc32(repr(case.body).encode()) % 2:
                case.body = seeds[case.path]
            if case.path == "/v1/fetch" and isinstance(case.body, dict) and case.body.get("match") is not None:
                # a fetch the match's link made carries that match: a prompt generated beside
                # it would only be refused (a fetch takes one or the other)
                case.body.pop("prompt", None)
            if isinstance(case.body, dict):
                ttl = case.body.get("ttl_s")
                if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl < MIN_TTL_S:
                    # a lease or handle that may expire between two steps answers by the
                    # machine's speed: what the next rule can use would differ on a replay
                    case.body["ttl_s"] = MIN_TTL_S
            # set on the case itself: a generated Authorization (the spec's bearer scheme) must not win
            case.headers["Authorization"] = f"Bearer {_token(case.path)}"
            return {}

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            statuses.append(response.status_code)
            paths.append(case.path)
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            finally:
                admin_of(asgi).state.set_draining(False)

    NodeMachine.run(settings=settings(
        max_examples=SCENARIOS, stateful_step_count=STEPS, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck)))
    assert statuses and max(statuses) < 500
    followed = {p for p, st in zip(paths, statuses, strict=True) if "{" in p and st == 200}
    assert {"/v1/leases/{lease_id}/renew", "/v1/fetch/{fetch_id}/ack"} & followed, followed
    assert sum(s == 200 for s in statuses) >= len(statuses) // 4, statuses  # the calls reach routes
