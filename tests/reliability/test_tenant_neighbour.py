"""A hostile neighbour on the node's host, against a real ``kvbank serve``.

The served-node review's D1: tenant B's worker runs on the node's host under the node's
uid, opens the host segment by its name, maps it writable without any lease and
overwrites a page of tenant A's. On a node with tenant tokens the segment has no name
(unlinked at start, named in no answer): the attack finds nothing to open, and A still
fetches its own bytes on every path. On a node without tenant tokens (one trust domain,
the segment named) a neighbour process can still write into it; what must hold on every
path a client fetches by — the local channel, same-host shared memory, the data port,
the HTTP stream — is that it is never handed the neighbour's bytes: the changed row is a
miss (or the fetch a typed error), and its host copy is dropped on the node. And the
node process is not dumpable: a process of its uid opens none of its
``/proc/<pid>/fd`` entries or its memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from kvbank import Client, full_attention
from kvbank.client.shm import Borrower
from kvbank.errors import KvbankError, TierUnavailable
from kvbank.service.launch import NodeProcess
from kvbank.service.server import READY
from kvbank.tiers.host import SHM_DIR

TA, TB = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
LAYOUT = full_attention("neighbour@1", num_layers=1, num_kv_heads=2, head_dim=64)
P, PAGE = LAYOUT.tokens_per_page, LAYOUT.group_page_bytes[0]
SCRIBBLE = b"\xee" * 64  # what the neighbour writes over the start of A's page
ARGS = ["--host-bytes", "64M", "--disk-bytes", "256M", "--device-bytes", "0"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVBANK_ADMIN_TOKEN"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node with two tenants."""
    d = tmp_path_factory.mktemp("neighbour")
    proc = NodeProcess.start(["--data-dir", str(d), *ARGS], env={**_env(), "KVBANK_TENANTS": f"a={TA},b={TB}"})
    try:
        yield proc
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


@pytest.fixture(scope="module")
def open_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node without tenant tokens: its segment is named."""
    d = tmp_path_factory.mktemp("open-neighbour")
    proc = NodeProcess.start(["--data-dir", str(d), *ARGS], env=_env())
    try:
        yield proc
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def _pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


def _client(url: str, path: str, token: str | None = None) -> Client:
    if path == "local":  # the node's local channel (its socket), found by the client itself
        return Client(url, token=token)
    if path == "shm":  # the HTTP same-host path
        return Client(url, token=token, same_host=True, channel="http")
    return Client(url, token=token, same_host=False, data_plane=path == "data", channel="http")


def _scribble(url: str, page: bytes, token: str | None = None) -> None:
    """The neighbour: the segment named in ``GET /v1/node``, mapped writable with no
    lease, A's page found by its bytes and its first 64 bytes overwritten."""
    auth = {} if token is None else {"Authorization": f"Bearer {token}"}
    segment = httpx.get(url + "/v1/node", headers=auth, timeout=30).json()["host"]["segment"]
    with Borrower(writable=True) as b:
        mm = b.segment(segment)
        at = bytes(mm).find(page)
        assert at >= 0, "A's page is not in the segment"
        mm[at : at + len(SCRIBBLE)] = SCRIBBLE


def _served_pages(url: str, path: str, lid: bytes, toks: list[int], token: str | None = None) -> list[bytes]:
    """A's fetch of its prompt on ``path``: the bytes of each row it was told arrived
    whole (a typed refusal of the whole fetch delivers none)."""
    with _client(url, path, token) as a:
        try:
            f = a.fetch_prefix(lid, [*toks, 0])
        except KvbankError:
            return []
        if f.result is None:
            return []
        rows = f.pages[0]
        planned = f.match.resume.pages[0]
        return [rows[planned.index(k)].numpy().tobytes() for k in f.result.delivered[0]]


@pytest.mark.parametrize("path", ["local", "shm", "data", "http"])
def test_a_neighbours_write_into_the_segment_is_never_served_to_the_owner(
        open_node: NodeProcess, path: str) -> None:
    """A neighbour overwrites one of A's committed pages in the named segment; A's next
    fetch on each path returns only A's own bytes (the changed row a miss, never the
    neighbour's bytes), the node drops that host copy, and a fetch after that is still
    never the neighbour's bytes."""
    node = open_node
    seed = {"local": 4, "shm": 1, "data": 2, "http": 3}[path]
    pages = _pages(4, seed)
    toks = list(range(1000 * seed, 1000 * seed + 4 * P))
    with Client(node.url, same_host=False, data_plane=False, channel="http") as a:
        lid = a.register(LAYOUT)
        a.put(lid, toks, group=0, pages=pages)
    own = [pages[k].numpy().tobytes() for k in range(4)]
    _scribble(node.url, own[1])
    before = sum("host copy dropped" in line for line in node.lines)
    for attempt in range(2):
        served = _served_pages(node.url, path, lid, toks)
        assert not any(p.startswith(SCRIBBLE) for p in served), f"{path}: the neighbour's bytes served to A"
        assert all(p in own for p in served), f"{path}: bytes that are not A's served"
        if attempt == 0:
            assert len(served) < 4, f"{path}: the changed page counted as delivered"
    dropped = sum("host copy dropped" in line for line in node.lines)
    assert dropped > before, f"{path}: the changed row's host copy was not dropped"


def test_on_a_tenant_node_the_segment_has_no_name_to_open_and_tenants_fetch_exact(node: NodeProcess) -> None:
    """D1 on a node with tenant tokens: B finds no segment to open — none named in
    ``GET /v1/node``, no file of the node's under the shm directory (its name was
    unlinked at start), opening the segments there finds none holding A's page — and a
    same-host lease is refused as the typed TierUnavailable; A fetches its pages byte for
    byte on the local channel (control calls there, bodies through the node's copies),
    the data port and HTTP."""
    pages = _pages(4, 9)
    toks = list(range(9000, 9000 + 4 * P))
    with Client(node.url, token=TA, same_host=False, data_plane=False) as a:
        lid = a.register(LAYOUT)
        a.put(lid, toks, group=0, pages=pages)
    own = [pages[k].numpy().tobytes() for k in range(4)]
    info = httpx.get(node.url + "/v1/node", headers={"Authorization": f"Bearer {TB}"}, timeout=30).json()
    assert info["host"]["segment"] is None
    ours = [p for p in SHM_DIR.iterdir() if p.name.startswith(f"kvbank-{node.pid}-")]
    assert ours == [], f"the node's segment is still named: {ours}"
    with pytest.raises(KvbankError, match="not a shared-memory name"):
        _scribble(node.url, own[1], TB)  # the review's attack: there is no name to open
    for path in ("local", "data", "http"):
        with _client(node.url, path, TA) as a:
            f = a.fetch_prefix(lid, [*toks, 0])
            assert f.result is not None and f.result.complete, path
            assert [f.pages[0][k].numpy().tobytes() for k in range(4)] == own, path
            if path == "local":
                link = a._link
                assert link is not None and not link.memory  # the socket passed it no memory
    with _client(node.url, "shm", TA) as a, pytest.raises(TierUnavailable, match="no name"):
        a.fetch_prefix(lid, [*toks, 0])


PR_CAPBSET_DROP, CAP_SYS_PTRACE = 24, 19
PROBE = """
import os, sys
pid = int(sys.argv[1])
out = []
for what, fn in (("fd", lambda: os.readlink(f"/proc/{pid}/fd/0")),
                 ("mem", lambda: open(f"/proc/{pid}/mem", "rb").close())):
    try:
        fn()
        out.append(what + ":open")
    except PermissionError:
        out.append(what + ":refused")
print(" ".join(out))
"""


def _without_ptrace() -> None:
    """In a child before exec: a root process keeps every capability but CAP_SYS_PTRACE
    (root with it opens any process's /proc entries, dumpable or not); a process of
    another uid has none to drop."""
    if os.getuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(
            PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _probe(pid: int) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(pid)], preexec_fn=_without_ptrace,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_a_process_of_the_nodes_uid_cannot_open_its_fds_or_memory(tmp_path: Path) -> None:
    """``kvbank serve`` makes itself non-dumpable at start: a process of its uid (without
    CAP_SYS_PTRACE, as a tenant's worker runs) cannot open the node's descriptors through
    ``/proc/<pid>/fd`` (the host segment's among them) nor its memory through
    ``/proc/<pid>/mem``. The control: the same probe opens both of a dumpable process of
    the same uid and capabilities."""
    env = {k: v for k, v in os.environ.items() if k != "KVBANK_ADMIN_TOKEN"}
    cmd = [sys.executable, "-m", "kvbank.cli", "serve", "--port", "0", "--data-dir",
           str(tmp_path / "node"), "--host-bytes", "8M", "--device-bytes", "0",
           "--disk-bytes", "64M"]
    node = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, preexec_fn=_without_ptrace)
    peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, preexec_fn=_without_ptrace)
    try:
        assert node.stdout is not None
        lines: list[str] = []
        for line in node.stdout:  # until the ready line: the node has run forbid_dumps
            lines.append(line)
            if READY in line:
                break
        assert any(READY in ln for ln in lines), "".join(lines)
        assert _probe(node.pid) == ["fd:refused", "mem:refused"]
        assert _probe(peer.pid) == ["fd:open", "mem:open"]
    finally:
        assert peer.stdin is not None
        peer.stdin.close()  # it reads to the end: this ends it
        peer.wait(timeout=60)
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=60)


def test_the_tenant_neighbour_row_counts_no_fetch_that_served_a_neighbours_bytes(
        tmp_path: Path) -> None:
    """The reliability bench's ``tenant-neighbour`` case, one round: every overwrite is
    attempted on the three paths and none is served back to its owner."""
    from kvbank.bench.reliability_node import tenant_neighbour

    res = tenant_neighbour(tmp_path, rounds=1)
    assert res.attacks == 3 and res.served == 0 and res.wrong == 0, res
