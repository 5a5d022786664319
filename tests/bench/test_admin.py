"""``kvbank bench admin``: the suite is registered and its rows-list case prints the
contract name with a baseline measured in the same run (a small bank here)."""

from __future__ import annotations

from kvbank.bench import SUITES, admin


def test_bench_admin_rows_list_row() -> None:
    assert SUITES["admin"] == "kvbank.bench.admin"
    r = admin._rows_list(2_000, 1)
    assert (r.suite, r.case, r.metric) == ("admin", "rows-list-1m", "ms")
    assert r.value > 0 and r.baseline_value > 0 and "2,000 rows" in r.baseline
    assert abs(r.ratio - r.value / r.baseline_value) < 1e-3


def test_page_poller_asks_what_the_status_page_asks_at_its_pace() -> None:
    """Without chromium, metrics-overhead-ui polls what ``static/status.html``'s refresh
    does: the series (then only the points after the last one seen), and on the first of
    every five polls the usage table and, on a node in a fleet, the fleet table."""
    import threading

    import httpx

    asked: list[str] = []
    two = threading.Event()

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {admin.ADMIN_TOKEN}"
        asked.append(request.url.path + ("?" + request.url.query.decode() if request.url.query else ""))
        if request.url.path == "/admin/series":
            if sum(a.startswith("/admin/series") for a in asked) == 2:
                two.set()
            return httpx.Response(200, json={"interval_s": 0.01, "fleet": True,
                                             "points": [{"n": 7 * len(asked)}]})
        return httpx.Response(200, json={})

    poller = admin._PagePoller("http://node", transport=httpx.MockTransport(answer))
    try:
        assert two.wait(60), asked  # a hang bound only
    finally:
        poller.close()
    assert asked[:4] == ["/admin/series", "/admin/usage", "/admin/fleet", "/admin/series?after=7"], asked
