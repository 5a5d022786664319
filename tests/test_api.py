"""Bank and Client hold one worker contract, :class:`kvbank.api.WorkerAPI`: every method of
it has the same signature on both (parameter names, kinds, defaults; annotations compared
as strings), except where the tables below, which mirror the numbered differences in
``kvbank.api``'s docstring, say otherwise; and no entry in those tables is stale."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from typing import Any

import pytest

import kvbank.api
from kvbank.api import WorkerAPI
from kvbank.bank.bank import Bank
from kvbank.client.client import Client

# Where Bank and Client differ inside the contract: (method, parameter) → the docstring's
# item. A parameter names a signature difference the parity test excuses; None marks a
# method whose behaviour differs while its signature must not.
DIFFERENCES: dict[tuple[str, str | None], int] = {
    ("put", None): 3,  # timeout: bounded on the client's side, Busy without a page count
    ("fetch", None): 3,  # timeout: bounded on the client's side
    ("lend", None): 3,  # timeout: a lease whose answer never came ends at its ttl
    ("row_names", None): 5,  # computed on the client: shard default from the layout
    ("put_states", None): 6,  # one put_state call per snapshot
    ("fetch_into", None): 8,  # off the node's host: through staging (timeout: as item 3)
    ("put_from", None): 3,  # timeout: bounded on the client's side
    ("match_many", None): 7,  # a default deadline, no retries, a circuit breaker
}

# Public calls outside the contract, by the docstring's item: in-place calls (1), an
# embedded bank's housekeeping or a client's page path (2).
NOT_IN_CONTRACT: dict[str, int] = {
    "view": 1, "device_view": 1, "write": 1, "read": 1, "read_into": 1, "get_into": 1,
    "open": 2, "fetches": 2, "reshard_rows": 2, "lend_put": 2, "check_invariants": 2,
    "reservation": 2,
    "clock": 2, "same_host": 2, "map_host": 2,
    "held": 2, "load_match": 2, "match_with": 2, "lend_load": 2, "lend_put_groups": 2, "breaker": 2,
    "checksums": 2, "prepare_load": 2, "load_prepared": 2, "release_prepared": 2, "commit_summed": 2,
}

Diff = tuple[str, str | None, str]  # (method, parameter or None for the return, what differs)


def contract() -> list[str]:
    """The methods WorkerAPI declares, in order (``__enter__``/``__exit__`` included)."""
    return [name for name, v in vars(WorkerAPI).items()
            if inspect.isfunction(v) and v.__qualname__ == f"WorkerAPI.{name}"]


def _params(fn: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def signature_differences(a: type, b: type, names: list[str]) -> list[Diff]:
    """Every difference between ``a``'s and ``b``'s signatures of the methods ``names``."""
    out: list[Diff] = []
    for name in names:
        fa, fb = getattr(a, name, None), getattr(b, name, None)
        if fa is None or fb is None:
            out.append((name, None, f"missing on {(a if fa is None else b).__name__}"))
            continue
        pa, pb = _params(fa), _params(fb)
        if list(pa) != list(pb):
            out.append((name, None, f"parameters {list(pa)} != {list(pb)}"))
        for p in pa.keys() & pb.keys():
            x, y = pa[p], pb[p]
            for what, u, v in (("kind", x.kind, y.kind), ("default", x.default, y.default),
                               ("annotation", str(x.annotation), str(y.annotation))):
                if u != v:
                    out.append((name, p, f"{what} {u!r} != {v!r}"))
        ra = str(inspect.signature(fa).return_annotation)
        rb = str(inspect.signature(fb).return_annotation)
        if ra != rb:
            out.append((name, None, f"returns {ra!r} != {rb!r}"))
    return sorted(out, key=str)


def _excused(diff: Diff) -> bool:
    return diff[1] is not None and (diff[0], diff[1]) in DIFFERENCES


def test_every_contract_method_has_the_same_signature_on_bank_and_client() -> None:
    unexcused = [d for d in signature_differences(Bank, Client, contract()) if not _excused(d)]
    assert not unexcused, (
        "Bank and Client differ where kvbank.api names no difference (make them equal, or "
        f"name it in kvbank.api's docstring and in DIFFERENCES): {unexcused}")


def test_the_contract_declares_bank_s_parameters() -> None:
    """The Protocol's own parameters (names, kinds, whether defaulted) are Bank's: the
    contract cannot drift from the class it was taken from."""
    for name in contract():
        mine, bank = _params(getattr(WorkerAPI, name)), _params(getattr(Bank, name))
        assert [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in mine.values()] == \
               [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in bank.values()], name


def _public(cls: type) -> set[str]:
    """Public class-level names of ``cls``, less the admin and fleet calls."""
    out = set()
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = getattr(inspect.getattr_static(cls, name), "__module__", None)
        if owner in ("kvbank.bank.admin", "kvbank.bank.fleet"):
            continue  # the operator's and the fleet's calls: not the worker's
        out.add(name)
    return out


def test_every_public_call_is_in_the_contract_or_named_outside_it() -> None:
    public = _public(Bank) | _public(Client)
    named = set(contract()) | set(NOT_IN_CONTRACT)
    assert public - named == set(), "a public call neither in WorkerAPI nor in NOT_IN_CONTRACT"


def _docstring_items() -> dict[int, str]:
    doc = kvbank.api.__doc__ or ""
    items = re.split(r"^(\d+)\. ", doc.split("Where Bank and Client differ", 1)[1], flags=re.M)
    return {int(n): text for n, text in zip(items[1::2], items[2::2], strict=True)}


def test_the_difference_tables_have_no_stale_entries() -> None:
    items = _docstring_items()
    actual = {(m, p) for m, p, _ in signature_differences(Bank, Client, contract()) if p is not None}
    for (method, param), item in DIFFERENCES.items():
        assert method in contract(), f"DIFFERENCES: {method} is not a WorkerAPI method"
        assert f"``{method}``" in items[item], f"DIFFERENCES: kvbank.api item {item} does not name {method}"
        if param is not None:
            assert (method, param) in actual, f"DIFFERENCES: {method}({param}) no longer differs"
    public = _public(Bank) | _public(Client)
    for name, item in NOT_IN_CONTRACT.items():
        assert name in public, f"NOT_IN_CONTRACT: neither Bank nor Client has {name}"
        assert name not in contract(), f"NOT_IN_CONTRACT: {name} is in WorkerAPI"
        assert name in items[item], f"NOT_IN_CONTRACT: kvbank.api item {item} does not name {name}"
    cited = set(DIFFERENCES.values()) | set(NOT_IN_CONTRACT.values())
    assert cited | {4} == set(items), "a numbered difference in kvbank.api that no table mirrors"


def test_the_parity_check_reports_a_drifted_signature() -> None:
    """The comparison the parity test rests on sees a renamed parameter, a changed default
    and a changed annotation."""

    class A:
        def put(self, layout_id: bytes, *, group: int, timeout: float | None = None) -> list[bytes]:
            return []

    class B:
        def put(self, layout_id: bytes, *, groups: int, timeout: int | None = 5) -> list[bytes]:
            return []

    got = signature_differences(A, B, ["put"])
    assert sorted((m, str(p)) for m, p, _ in got) == [("put", "None"), ("put", "timeout"), ("put", "timeout")]


def test_importing_the_contract_loads_no_bank_store_or_lmdb() -> None:
    code = ("import sys, kvbank.api; bad = [m for m in sys.modules if m == 'lmdb' or "
            "m.startswith(('kvbank.bank', 'kvbank.tiers.store', 'kvbank.client', 'torch'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", ["resume_at", "row_names"])
def test_pure_contract_calls_take_no_node_route(name: str) -> None:
    """row_names and resume_at are computed on the client from the layout: their code
    makes no control call (see kvbank.api, item 5)."""
    assert "_call(" not in inspect.getsource(getattr(Client, name))
