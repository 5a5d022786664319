"""Security checks on real ``kvbank serve`` processes and on the code itself.

- every ``/admin/*`` route of the *served* spec refuses no token (401) and a wrong one
  (403), and every ``/v1/*`` route does the same without a tenant token: a new route
  without auth fails here without anyone listing it;
- tenant B never sees tenant A's rows through the fleet index: two nodes, one real
  redis-server, A's prefix published by node 1 is a miss for B on node 2 (and fetched
  whole by A there, so the miss is not the index being down);
- the node binds 127.0.0.1 unless told otherwise (its listening socket in /proc/net/tcp);
- the generated admin token file is 0600, even over an existing world-readable one;
- nothing in ``kvbank/`` unpickles, unmarshals, evals or execs (an AST scan);
- a lease's segment names cannot open anything but a regular file in the shared-memory
  directory: traversal, absolute paths, NUL bytes, symbolic links and FIFOs are typed
  errors, and an audit hook sees no open outside the directory.
"""

from __future__ import annotations

import ast
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvbank import Client, Scope, full_attention, wire
from kvbank.client.shm import Borrower
from kvbank.errors import Forbidden, InvalidInput, KvbankError
from kvbank.lender.base import (
    Delivery,
    HostLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    MemoryKind,
    Selection,
)
from kvbank.service.admin.auth import TOKEN_FILE
from kvbank.service.launch import NodeProcess
from kvbank.testing.servers import INSTALL_HINT, MissingBinary, RedisServer, in_ci
from kvbank.tiers.host import SHM_DIR, map_segment

ROOT = Path(__file__).resolve().parents[2]
TA, TB = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
NODE_ARGS = ["--host-bytes", "64M", "--disk-bytes", "256M", "--device-bytes", "0",
             "--max-body-bytes", "16M", "--body-timeout-s", "5"]
LAYOUT = full_attention("security@1", num_layers=1, num_kv_heads=2, head_dim=64)
P, PAGE = LAYOUT.tokens_per_page, LAYOUT.group_page_bytes[0]
PUBLIC = {"/metrics"}  # served without a token unless metrics_auth (docs/admin.md)
OPEN = {"/live"}  # the liveness probe: no token on any node, it answers only "alive"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


def _wait(pred: Callable[[], bool], what: str, hang_s: float = 60.0) -> None:
    end = time.monotonic() + hang_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"waited {hang_s}s for {what}")
        time.sleep(0.1)


# ---- one node with tenant tokens and a generated admin token -----------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("secure")
    stale = d / TOKEN_FILE
    stale.write_text("an-old-world-readable-token\n")
    stale.chmod(0o644)
    return d


@pytest.fixture(scope="module")
def node(data_dir: Path) -> Iterator[NodeProcess]:
    env = {k: v for k, v in os.environ.items() if k != "KVBANK_ADMIN_TOKEN"}
    env.update(KVBANK_TENANTS=f"a={TA},b={TB}", KVBANK_METRICS_AUTH="1")
    env.pop("KVBANK_BIND", None)
    proc = NodeProcess.start(["--data-dir", str(data_dir), *NODE_ARGS], env=env)  # no --bind
    try:
        yield proc
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def _spec_routes(node: NodeProcess) -> list[tuple[str, str]]:
    spec = httpx.get(node.url + "/openapi.json", timeout=30).json()
    return [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]


def _concrete(path: str) -> str:
    return path.replace("{", "x-").replace("}", "")  # any path parameter: a made-up id


def test_every_served_route_is_admin_tenant_or_listed_public(node: NodeProcess) -> None:
    routes = _spec_routes(node)
    assert len(routes) >= 30
    odd = [p for _, p in routes if not p.startswith(("/admin/", "/v1/")) and p not in PUBLIC | OPEN]
    assert not odd, f"routes outside /admin/ and /v1/ need a place in this test: {odd}"


def test_every_admin_route_of_the_spec_refuses_no_token_401_and_a_wrong_one_403(node: NodeProcess) -> None:
    """Enumerated from the served spec; /metrics is admin-only here (metrics_auth)."""
    routes = [(m, p) for m, p in _spec_routes(node) if p.startswith("/admin/") or p in PUBLIC]
    assert len(routes) >= 17
    admin = Path(_token_file(node)).read_text().strip()
    for method, path in routes:
        url = node.url + _concrete(path)
        none = httpx.request(method, url, json={}, timeout=30)
        assert none.status_code == 401, (method, path, none.status_code, none.text)
        for wrong in (TA, "x" * 40, admin[:-1] + ("A" if admin[-1] != "A" else "B")):
            got = httpx.request(method, url, json={}, headers=_bearer(wrong), timeout=30)
            assert got.status_code == 403, (method, path, got.status_code, got.text)
        basic = httpx.request(method, url, json={}, headers={"Authorization": f"Basic {admin}"}, timeout=30)
        assert basic.status_code == 401, (method, path)
    assert httpx.get(node.url + "/admin/health", headers=_bearer(admin), timeout=30).status_code == 200


def test_every_data_route_of_the_spec_refuses_no_tenant_token_401_and_a_wrong_one_403(
        node: NodeProcess) -> None:
    """With tenant tokens set, every /v1/ route; the admin token is not a tenant token."""
    routes = [(m, p) for m, p in _spec_routes(node) if p.startswith("/v1/")]
    assert len(routes) >= 19
    admin = Path(_token_file(node)).read_text().strip()
    for method, path in routes:
        url = node.url + _concrete(path)
        none = httpx.request(method, url, json={}, timeout=30)
        assert none.status_code == 401, (method, path, none.status_code, none.text)
        for wrong in ("z" * 30, TA + "x", admin):
            got = httpx.request(method, url, json={}, headers=_bearer(wrong), timeout=30)
            assert got.status_code == 403, (method, path, got.status_code, got.text)


def _token_file(node: NodeProcess) -> str:
    line = next(x for x in node.lines if "ready on" in x)
    return line.split("admin token in ")[1].rstrip(")\n ")


def test_the_generated_token_file_is_0600_over_an_old_world_readable_one(
        node: NodeProcess, data_dir: Path) -> None:
    path = data_dir / TOKEN_FILE
    assert _token_file(node) == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert token != "an-old-world-readable-token" and len(token) >= 32
    assert token not in "".join(node.lines)  # the ready line names the file, never the token
    assert not [p for p in data_dir.iterdir() if p.name.startswith(f".{TOKEN_FILE}")]  # no temp left


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(addr)
    return found


def test_the_node_binds_loopback_unless_told_otherwise(node: NodeProcess) -> None:
    port = int(node.url.rsplit(":", 1)[1])
    assert node.url.startswith("http://127.0.0.1:")
    assert _listening(port) == ["0100007F"]  # 127.0.0.1, little-endian hex; nothing on 0.0.0.0 or ::


# ---- tenants through the fleet index ------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    try:
        rds = RedisServer.start()
    except MissingBinary:
        if in_ci():
            pytest.fail("CI=true but " + INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    env = {**os.environ, "KVBANK_TENANTS": f"a={TA},b={TB}"}
    procs: list[NodeProcess] = []
    try:
        for tag in ("one", "two"):
            procs.append(NodeProcess.start(["--data-dir", str(tmp_path_factory.mktemp(f"fleet-{tag}")),
                                            *NODE_ARGS, "--redis", rds.url], env=env))
        for p in procs:
            # mypy infers no lambda with defaults
            _wait(lambda p=p: _health(p).get("fleet", {}).get("state") == "ok",  # type: ignore[misc]
                  "the node to register")
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()
        rds.stop()


def _health(node: NodeProcess) -> dict[str, Any]:
    return dict(httpx.get(node.url + "/v1/health", headers=_bearer(TA), timeout=30).json())


def test_tenant_b_never_sees_tenant_a_rows_through_the_fleet_index(
        fleet: tuple[NodeProcess, NodeProcess]) -> None:
    one, two = fleet
    data = _pages(4, 11)
    toks = list(range(7000, 7000 + 4 * P))
    with Client(one.url, token=TA, same_host=False) as a1:
        lid = a1.register(LAYOUT)
        names = a1.put(lid, toks, group=0, pages=data)
    _wait(lambda: int(_health(one)["fleet"]["published"]) >= 4, "node one to publish A's rows")
    with Client(two.url, token=TB, same_host=False) as b2, Client(two.url, token=TA, same_host=False) as a2:
        assert b2.register(LAYOUT) == lid and a2.register(LAYOUT) == lid
        mb = b2.match(lid, [*toks, 1])
        assert mb.scope.tenant == "b" and mb.resume.tokens == 0  # B's own scope: other rows
        with pytest.raises(Forbidden):
            b2.match(lid, [*toks, 1], scope=Scope("a"))
        with pytest.raises(Forbidden):
            b2.locate(names)
        with pytest.raises(Forbidden):
            b2.lend(names)
        ma = a2.match(lid, [*toks, 1])  # A on node two: the index works, from node one
        assert ma.resume.tokens == 4 * P
        with pytest.raises(Forbidden):
            b2.fetch(ma, out={0: torch.empty((4, PAGE), dtype=torch.uint8)})
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        assert a2.fetch(ma, out={0: out}).complete and torch.equal(out, data)
        assert b2.match(lid, [*toks, 1]).resume.tokens == 0  # still a miss after A's fetch
        # the fleet listing is an admin route: a tenant's token is refused there
        listing = httpx.get(two.url + "/admin/fleet", headers=_bearer(TB), timeout=30)
        assert listing.status_code == 403
        assert not any(n.hex() in listing.text for n in names)
        assert httpx.get(two.url + "/v1/fleet", headers=_bearer(TB), timeout=30).status_code == 404


# ---- nothing received is executed ---------------------------------------------------------

_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                   "jsonpickle", "joblib"}
_BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every place ``source`` deserialises or executes code-bearing data."""
    found = []
    for n in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Import):
            found += [f"{where} import {a.name}" for a in n.names if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in _BANNED_MODULES:
            found.append(f"{where} from {n.module} import")
        elif isinstance(n, ast.Call):
            name = _dotted(n.func)
            last = name.rsplit(".", 1)[-1]
            banned_call = isinstance(n.func, ast.Name) and name in _BANNED_CALLS
            if banned_call or (last in ("load", "loads") and name.split(".")[0] in _BANNED_MODULES):
                found.append(f"{where} {name}()")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
                loader = _kw(n, "Loader")
                if not (loader is not None and _dotted(loader).endswith("SafeLoader")):
                    found.append(f"{where} {name}() without SafeLoader")
            elif name == "torch.load" or (last == "load" and name.startswith("torch.")):
                w = _kw(n, "weights_only")
                if not (isinstance(w, ast.Constant) and w.value is True):
                    found.append(f"{where} {name}() without weights_only=True")
            elif last == "load" and name.split(".")[0] in ("np", "numpy"):
                a = _kw(n, "allow_pickle")
                if isinstance(a, ast.Constant) and a.value is not False:
                    found.append(f"{where} {name}(allow_pickle=...)")
            elif name in ("torch.save", "os.system", "os.popen"):
                found.append(f"{where} {name}()")
            else:
                shell = _kw(n, "shell")
                if shell is not None and not (isinstance(shell, ast.Constant) and shell.value is False):
                    found.append(f"{where} {name}(shell=...)")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = ("import pickle\nfrom marshal import loads\nimport yaml, torch, numpy as np\n"
           "eval(x)\nexec(y)\nyaml.load(s)\ntorch.load(f)\nnp.load(f, allow_pickle=True)\n"
           "torch.save(t, f)\nsubprocess.run(c, shell=True)\n__import__(m)\n")
    assert len(unsafe_uses(bad)) == 10
    good = ("import json\njson.loads(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
            "torch.load(f, weights_only=True)\nnp.load(f)\nre.compile(p)\n")
    assert unsafe_uses(good) == []


def test_nothing_in_kvbank_unpickles_evals_or_execs() -> None:
    found = []
    for path in sorted((ROOT / "kvbank").rglob("*.py")):
        found += unsafe_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "\n".join(found)


# ---- segment names in a lease --------------------------------------------------------------

_OPENED: list[str] = []
_WATCH = threading.Event()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _WATCH.is_set() and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # a hook cannot be removed; it records only while _WATCH is set

HOSTILE_NAMES = ["../../etc/passwd", "/etc/passwd", "..", ".", "", "a\x00b", "\x00",
                 "kvbank/../../../etc/passwd", ".hidden", "x/y", "..\\..\\etc\\passwd",
                 "kvbank-\x00/../../etc/shadow", "/dev/shm/../etc/passwd"]


def _lease_doc(segment: str, writable: bool = False) -> dict[str, Any]:
    name = bytes(range(54))
    lease = Lease("hostile-lease", MemoryKind.HOST, LeaseMode.WRITE if writable else LeaseMode.READ,
                  Selection.NAMED, time.monotonic() + 60, time.time() + 60,
                  (LeaseRow(name, True, HostLocation("placeholder", 0, 16), (),
                            Delivery.RESERVED if writable else Delivery.READY),))
    doc = wire.to_dict(lease, now=time.monotonic())
    doc["rows"]["segments"] = [segment]
    return doc


def _outside_shm(paths: list[str]) -> list[str]:
    shm = str(SHM_DIR) + "/"
    return [p for p in paths if not (os.path.realpath(p).startswith(shm) and p.startswith(shm))]


@pytest.mark.parametrize("segment", HOSTILE_NAMES, ids=repr)
@pytest.mark.parametrize("writable", [False, True], ids=["read", "write"])
def test_a_lease_segment_name_cannot_open_another_file(segment: str, writable: bool) -> None:
    """The name crosses as lease JSON; decoding and borrowing it either refuse it with a
    typed error or look only inside the shared-memory directory."""
    _OPENED.clear()
    _WATCH.set()
    try:
        try:
            lease = wire.from_json(Lease, wire.to_json(wire.from_dict(Lease, _lease_doc(segment, writable))))
        except InvalidInput:
            lease = None
        if lease is not None:
            with Borrower(writable=writable) as b, pytest.raises(KvbankError):
                b.read_into(lease, bytes(range(54)), bytearray(16))
        with pytest.raises(KvbankError):
            map_segment(segment, writable=writable)
    finally:
        _WATCH.clear()
    assert _outside_shm(_OPENED) == []


@pytest.fixture
def shm_trap() -> Iterator[tuple[str, Path]]:
    """A symbolic link in the shared-memory directory to a private file outside it."""
    fd, target = tempfile.mkstemp(prefix="kvbank-secret-")
    os.write(fd, b"do not overwrite me" * 8)
    os.close(fd)
    name = f"kvbank-trap-{os.getpid()}-{time.monotonic_ns()}"
    (SHM_DIR / name).symlink_to(target)
    try:
        yield name, Path(target)
    finally:
        (SHM_DIR / name).unlink()
        os.unlink(target)


def test_a_symlink_planted_in_the_shm_dir_is_refused_not_followed(shm_trap: tuple[str, Path]) -> None:
    """Regression: map_segment followed links, so a lease naming one could map (and, on a
    WRITE lease, overwrite) any file the borrower can write."""
    name, target = shm_trap
    before = target.read_bytes()
    lease = wire.from_dict(Lease, _lease_doc(name, writable=True))
    with Borrower(writable=True) as b, pytest.raises(InvalidInput, match="symbolic link"):
        b.view(lease, bytes(range(54)))[:] = b"\xff" * 16
    assert target.read_bytes() == before


def test_a_fifo_in_the_shm_dir_is_refused_without_blocking() -> None:
    """Regression: opening a FIFO named by a lease blocked the borrower forever."""
    name = f"kvbank-fifo-{os.getpid()}-{time.monotonic_ns()}"
    os.mkfifo(SHM_DIR / name)
    errors: list[BaseException] = []

    def borrow() -> None:
        try:
            with Borrower() as b:
                b.read_into(wire.from_dict(Lease, _lease_doc(name)), bytes(range(54)), bytearray(16))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=borrow, daemon=True)
    try:
        t.start()
        t.join(30)  # a hang bound
        assert not t.is_alive(), "the borrower blocked opening a FIFO"
    finally:
        if t.is_alive():  # unblock it so the thread ends
            with open(SHM_DIR / name, "wb"):
                pass
        os.unlink(SHM_DIR / name)
    assert len(errors) == 1 and isinstance(errors[0], InvalidInput), errors
