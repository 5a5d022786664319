"""The served ``/openapi.json`` equals the committed ``docs/openapi.json``; schemathesis
drives every route of the served spec (a bounded number of examples each, with the admin
token) and asserts no 5xx and, where a route declares one, responses matching their schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from kvbank.service.admin.routes import admin_of
from kvbank.service.openapi import document, render
from tests.service.admin_app import auth, fill, served

DOC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
EXAMPLES = 8  # per route: ~36 routes on 2 cores within the suite's budget


def test_committed_spec_equals_the_served_one(tmp_path: Path) -> None:
    with served(tmp_path) as (client, _):
        served_doc = client.get("/openapi.json").json()
    assert served_doc == json.loads(DOC.read_text()) == document(), (
        "docs/openapi.json is stale: python -m kvbank.service.openapi > docs/openapi.json")
    assert DOC.read_text() == render(served_doc)
    ops = [op for p in served_doc["paths"].values() for op in p.values()]
    assert all(op.get("responses") for op in ops)


@pytest.fixture(scope="module")
def node_app(tmp_path_factory: pytest.TempPathFactory):
    with served(tmp_path_factory.mktemp("fuzz")) as (client, node):
        fill(node.bank, 3, 1)
        yield client.app


def _operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [r.ok() for r in schema.get_all_operations()]


def test_no_route_answers_5xx_and_responses_match_their_schema(node_app) -> None:
    ops = _operations(node_app)
    assert len(ops) >= 30
    codes: list[int] = []
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            if case.path == "/admin/drain":
                case.body = {"wait": False}  # a drained node would refuse the puts that follow
            response = case.call(headers=auth())
            codes.append(response.status_code)
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
            finally:
                admin_of(node_app).state.set_draining(False)  # the next examples put again

        run()
    assert len(codes) >= 2 * len(ops) and max(codes) < 500
    assert sum(c == 200 for c in codes) > len(ops) // 2  # the examples reach the routes, not only 4xx
