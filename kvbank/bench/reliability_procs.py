"""Process and disk faults against a running ``kvbank serve``: the ``procs`` part of
``kvbank bench reliability``.

Every case runs real processes: the node is ``kvbank serve`` (:class:`NodeProcess`), the
clients are ``python -m kvbank.bench.reliability_worker`` processes, and the faults are
SIGKILL, bytes flipped in ``data.mdb`` and a file system that fills. Each case is a
function that returns what it observed (the CI tests in ``tests/reliability`` call the
same functions with smaller sizes and assert on the observations); :func:`run_part`
turns them into rows.

Cases (``value`` against its goal, see :mod:`kvbank.bench.reliability`):

- ``crash-puts`` — share of acknowledged puts read back bit-exactly after SIGKILL and a
  restart, write-through, over every round (goal 1.0);
- ``crash-puts-write-back`` — seconds between the kill and the oldest acknowledged put a
  write-back node lost (goal ``dirty_expire_s``, docs/tiers.md);
- ``disk-rot`` — share of damaged frames counted and served as misses (goal 1.0);
- ``disk-rot-startup`` — share of startup faults (lock files deleted, ``data.mdb``
  truncated, with and without salvage) answered by a clean start or a clear error (1.0);
- ``lease-holder-killed`` — seconds past the lease's expiry until a SIGKILLed borrower's
  rows unlock, worst round (goal 1.0);
- ``disk-full`` — acknowledged rows lost when the data dir's file system fills (goal 0);
- ``disk-full-puts-refused`` — puts refused after it filled: host-only goes on (goal 0).
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbank.bench.common import BenchRow
from kvbank.bench.reliability_disk import SmallFs, rot_values
from kvbank.bench.reliability_worker import LAYOUT, PAGE, TOKENS_PER_PAGE, chain_tokens, page_bytes
from kvbank.client.client import Client
from kvbank.keys import DEFAULT_SCOPE, namespace, page_keys, row_names
from kvbank.service.launch import NodeProcess
from kvbank.tiers.base import TierKind

WORKER = "kvbank.bench.reliability_worker"
HANG_S = 120.0  # a hang detector, never a timing target


def node_args(data: Path, *extra: str, host: str = "64M", disk: str = "1G") -> list[str]:
    return ["--data-dir", str(data), "--host-bytes", host, "--disk-bytes", disk,
            "--device-bytes", "0", "--threads", "16", *extra]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def chain_names(client: int, round_: int, n_pages: int) -> list[bytes]:
    toks = chain_tokens(client, round_, n_pages)
    return row_names(namespace(LAYOUT.layout_id, DEFAULT_SCOPE), page_keys(toks, TOKENS_PER_PAGE), 0)


def wrong_bytes(got: bytes | bytearray | memoryview, want: bytes) -> int:
    a, b = bytes(got), want
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


@dataclass(frozen=True, slots=True)
class Readback:
    """One chain read back after a restart."""

    present: tuple[bool, ...]  # per page: the node holds the row
    wrong: int  # wrong bytes among the rows read


def read_chain(c: Client, client: int, round_: int, n_pages: int) -> Readback:
    """Which of a chain's first ``n_pages`` rows the node holds, and every held row's
    bytes checked: the matched prefix through ``match`` + ``fetch``, rows after a gap
    through a READ lease (a fetch only reaches a contiguous prefix)."""
    if n_pages <= 0:
        return Readback((), 0)
    names = chain_names(client, round_, n_pages)
    present = tuple(t is not None for t in c.locate(names))
    m = c.match(LAYOUT.layout_id, [*chain_tokens(client, round_, n_pages), 1])
    pages = m.resume.pages[0] if m.resume.pages else ()
    wrong = 0
    if pages:
        out = [bytearray(PAGE) for _ in pages]
        got = c.fetch(m, out={0: out})
        delivered = set(got.delivered[0]) if got.delivered else set()
        for k, i in enumerate(pages):
            if i in delivered:
                wrong += wrong_bytes(out[k], page_bytes(client, round_, i))
    rest = [i for i in range(len(pages), n_pages) if present[i]]
    if rest:
        from kvbank.client.shm import Borrower
        from kvbank.lender.base import HostLocation

        lease = c.lend([names[i] for i in rest], ttl_s=60)
        try:
            with Borrower() as b:
                buf = bytearray(PAGE)
                for row, i in zip(lease.rows, rest, strict=True):
                    if isinstance(row.location, HostLocation):
                        n = b.read_into(lease, row.name, buf)
                        wrong += wrong_bytes(memoryview(buf)[:n], page_bytes(client, round_, i))
        finally:
            c.release(lease.id)
    return Readback(present, wrong)


# ---- crash-puts ----------------------------------------------------------------------


@dataclass
class CrashRound:
    round: int
    acked: int  # puts acknowledged before the kill
    lost: int  # acknowledged puts missing after the restart
    wrong: int  # wrong bytes read back
    failed_puts: int  # puts refused while the node was alive (should be 0)
    lost_ages: list[float] = field(default_factory=list)  # s from each lost ack to the kill


@dataclass
class CrashResult:
    policy: str
    rounds: list[CrashRound]
    restart_failures: int
    restart_error: str = ""


class _Putters:
    """The client processes, alive across rounds; their lines on one queue."""

    def __init__(self, n: int) -> None:
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.procs = [subprocess.Popen([sys.executable, "-m", WORKER, "putter", str(i), str(i % 2)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for i in range(n)]
        self.pumps = [threading.Thread(target=self._pump, args=(i, p), daemon=True)
                      for i, p in enumerate(self.procs)]
        for t in self.pumps:
            t.start()
        for _ in self.procs:
            _, line = self.next(HANG_S)
            if line != "ready":
                raise RuntimeError(f"reliability putter did not start: {line!r}")

    def _pump(self, i: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None  # PIPE was asked for
        for line in p.stdout:
            self.lines.put((i, line.strip()))
        self.lines.put((i, "eof"))

    def next(self, timeout: float) -> tuple[int, str]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"reliability putters silent for {timeout:.0f} s") from None

    def send(self, cmd: dict[str, object]) -> None:
        for p in self.procs:
            assert p.stdin is not None  # PIPE was asked for
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # by pid, each one this object started
            p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


def crash_puts(workdir: Path, *, policy: str = "write-through", rounds: int = 20,
               clients: int = 8, puts: int = 1000, seed: int = 16,
               dirty_expire_s: float | None = None, pace_s: float = 0.0,
               kill_between: tuple[float, float] = (0.1, 0.9)) -> CrashResult:
    """Rounds of: ``clients`` processes put ``puts`` pages each (chains, one page a call,
    odd clients through shared memory, even ones over TCP); SIGKILL the node once a random
    share (``kill_between``) of them is acknowledged; restart it on the same data dir;
    read every chain back. The restarted node serves the next round."""
    rng = random.Random(seed)
    data = workdir / "data"
    extra = {} if dirty_expire_s is None else {"KVBANK_DIRTY_EXPIRE_S": str(dirty_expire_s)}
    env = _env(**extra)
    args = node_args(data, "--write-policy", policy)
    result = CrashResult(policy, [], 0)
    putters = _Putters(clients)
    node = NodeProcess.start(args, env=env)
    try:
        for r in range(rounds):
            lo, hi = (max(1, int(clients * puts * f)) for f in kill_between)
            target = rng.randint(lo, hi)
            putters.send({"url": node.url, "round": r, "n": puts, "pace_s": pace_s})
            acks: dict[int, dict[int, float]] = {i: {} for i in range(clients)}
            ended: set[int] = set()
            failed = 0
            t_kill: float | None = None
            while len(ended) < clients:
                i, line = putters.next(HANG_S)
                word = line.split() or [""]
                if word[0] == "ok" and int(word[1]) == r:
                    acks[i][int(word[2])] = float(word[3])
                    if t_kill is None and sum(map(len, acks.values())) >= target:
                        t_kill = time.monotonic()
                        node.kill()
                elif word[0] in ("down", "done") and int(word[1]) == r:
                    ended.add(i)
                    if word[0] == "down" and t_kill is None:
                        failed += 1  # a put refused by a live node
                elif word[0] == "eof":
                    raise RuntimeError(f"reliability putter {i} exited")
            if t_kill is None:  # every client finished first (too few puts): kill now
                t_kill = time.monotonic()
                node.kill()
            try:
                node = NodeProcess.start(args, env=env)
            except Exception as exc:  # the restart must never fail: count it and stop
                result.restart_failures += 1
                result.restart_error = str(exc)[-2000:]
                raise
            cr = CrashRound(r, sum(map(len, acks.values())), 0, 0, failed)
            with Client(node.url, same_host=True) as c:
                c.register(LAYOUT)
                for i in range(clients):
                    got = acks[i]
                    n = (max(got) + 2) if got else 1  # the acknowledged pages and one in flight
                    back = read_chain(c, i, r, min(n, puts))
                    cr.wrong += back.wrong
                    for k, t in got.items():
                        if not back.present[k]:
                            cr.lost += 1
                            cr.lost_ages.append(t_kill - t)
            result.rounds.append(cr)
    finally:
        putters.send({"op": "exit"})
        putters.close()
        node.stop()
    return result


# ---- lease-holder-killed -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HolderRound:
    locked_after_kill: int  # rows still locked just after the borrower died
    past_expiry_s: float  # from the lease's expiry to the rows found unlocked
    expired: int  # the node's leases_expired counter grew by this


def lease_holder_killed(workdir: Path, *, rounds: int = 10, ttl_s: float = 2.0) -> list[HolderRound]:
    """A borrower process (same-host ``Client``) takes a HOST READ lease on 8 rows, copies
    them out of shared memory and is SIGKILLed; the node's lock count is polled until its
    rows unlock."""
    out: list[HolderRound] = []
    node = NodeProcess.start(node_args(workdir / "data", host="32M", disk="64M"))
    try:
        with Client(node.url, same_host=False) as c:
            for r in range(rounds):
                before = c.stats()
                holder = subprocess.Popen([sys.executable, "-m", WORKER, "holder", node.url,
                                           str(ttl_s), str(r + 1)], stdout=subprocess.PIPE, text=True)
                try:
                    assert holder.stdout is not None  # PIPE was asked for
                    word = holder.stdout.readline().split()
                    if not word or word[0] != "held":
                        raise RuntimeError(f"lease holder did not take its lease: {word}")
                    expires_at = float(word[2])
                finally:
                    holder.kill()
                    holder.wait()
                    if holder.stdout is not None:
                        holder.stdout.close()
                locked = c.stats().store.locked_names - before.store.locked_names
                while c.stats().store.locked_names > before.store.locked_names:
                    if time.monotonic() > expires_at + HANG_S:
                        raise RuntimeError("a dead borrower's rows stayed locked past the hang bound")
                    time.sleep(0.005)
                past = time.monotonic() - expires_at
                expired = c.stats().leases_expired - before.leases_expired
                out.append(HolderRound(locked, past, expired))
    finally:
        node.stop()
    return out


# ---- disk-rot ------------------------------------------------------------------------


@dataclass
class RotResult:
    rows: int
    damaged: int
    missed: int  # damaged rows served as misses
    counted: int  # rows the node counted corrupt
    wrong: int  # wrong bytes served, over every row
    healthy_lost: int  # undamaged rows that did not read back


def _put_rows(url: str, rows: int, round_: int) -> None:
    with Client(url, same_host=False) as c:
        lid = c.register(LAYOUT)
        for i in range(rows):  # one page per prompt: a damaged row hides no other row
            c.put(lid, chain_tokens(i, round_, 1), group=0, pages=[page_bytes(i, round_, 0)])


def _read_rows(url: str, rows: int, round_: int) -> tuple[list[bool], int]:
    """Per row, whether it read back (match + fetch), and wrong bytes in all."""
    got: list[bool] = []
    wrong = 0
    with Client(url, same_host=False) as c:
        c.register(LAYOUT)
        buf = bytearray(PAGE)
        for i in range(rows):
            m = c.match(LAYOUT.layout_id, [*chain_tokens(i, round_, 1), 1])
            if not m.resume.tokens:
                got.append(False)
                continue
            res = c.fetch(m, out={0: [buf]})
            ok = bool(res.delivered and 0 in res.delivered[0])
            if ok:
                wrong += wrong_bytes(buf, page_bytes(i, round_, 0))
            got.append(ok)
    return got, wrong


def disk_rot(workdir: Path, *, rows: int = 3000, fraction: float = 0.01, seed: int = 16) -> RotResult:
    data = workdir / "data"
    env = _env(KVBANK_DISK_SYNC="0")
    args = node_args(data, "--write-policy", "write-through", host="64M", disk="256M")
    node = NodeProcess.start(args, env=env)
    try:
        _put_rows(node.url, rows, 0)
    finally:
        code = node.stop()
    if code != 0:
        raise RuntimeError(f"kvbank serve exited {code} at SIGTERM: {''.join(node.lines)[-2000:]}")
    rot = rot_values(data, fraction, seed)
    names = chain_names_one(rows, 0)
    damaged = {names.index(n) for n in rot.names}
    node = NodeProcess.start(args, env=env)
    try:
        got, wrong = _read_rows(node.url, rows, 0)
        with Client(node.url, same_host=False) as c:
            counted = c.stats().store.tier(TierKind.DISK).corrupt_rows
    finally:
        node.stop()
    missed = sum(1 for i in damaged if not got[i])
    healthy_lost = sum(1 for i in range(rows) if i not in damaged and not got[i])
    return RotResult(rows, len(damaged), missed, counted, wrong, healthy_lost)


def chain_names_one(rows: int, round_: int) -> list[bytes]:
    """The row names of ``rows`` one-page prompts (clients ``0..rows-1``)."""
    return [chain_names(i, round_, 1)[0] for i in range(rows)]


@dataclass(frozen=True, slots=True)
class StartupFault:
    fault: str
    ok: bool  # a clean start serving the rows, or a clear error (never a crash, never empty)
    detail: str


def _serve_once(args: Sequence[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``kvbank serve`` expecting it to refuse to start: its exit code and output."""
    try:
        done = subprocess.run([sys.executable, "-m", "kvbank.cli", "serve", "--port", "0", *args],
                              capture_output=True, text=True, env=env, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        return -1, "still running: it started on a data dir it should have refused"
    return done.returncode, done.stdout + done.stderr


def disk_startup_faults(workdir: Path, *, rows: int = 200) -> list[StartupFault]:
    """Lock files deleted; ``data.mdb`` truncated to half (refused, then salvaged)."""
    data = workdir / "data"
    env = _env(KVBANK_DISK_SYNC="0")
    args = node_args(data, "--write-policy", "write-through", host="64M", disk="256M")
    node = NodeProcess.start(args, env=env)
    try:
        _put_rows(node.url, rows, 1)
    finally:
        node.stop()
    out: list[StartupFault] = []
    (data / "kvbank.lock").unlink(missing_ok=True)
    (data / "lmdb" / "lock.mdb").unlink(missing_ok=True)
    node = NodeProcess.start(args, env=env)
    try:
        got, wrong = _read_rows(node.url, rows, 1)
    finally:
        node.stop()
    out.append(StartupFault("lock files deleted", all(got) and not wrong,
                            f"{sum(got)} of {rows} rows back, {wrong} wrong bytes"))
    mdb = data / "lmdb" / "data.mdb"
    os.truncate(mdb, mdb.stat().st_size // 2)
    code, text = _serve_once(args, env)
    clear = code > 0 and str(mdb) in text and "truncated" in text  # an exit, not a signal
    out.append(StartupFault("data.mdb truncated", clear,
                            f"exit {code}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}"))
    node = NodeProcess.start(args, env=_env(KVBANK_DISK_SYNC="0", KVBANK_DISK_SALVAGE="1"))
    try:
        got, wrong = _read_rows(node.url, rows, 1)
        with Client(node.url, same_host=False) as c:
            health = c.health()
    finally:
        node.stop()
    notes = " ".join(health.notes)
    said = "salvage" in notes.lower()
    # The index is rebuilt from the segment files, which a cut data.mdb leaves whole:
    # every row may come back (an older-layout dir loses those past the cut).
    out.append(StartupFault("data.mdb truncated, salvage on", said and not wrong and 0 < sum(got) <= rows,
                            f"{sum(got)} of {rows} rows salvaged, {wrong} wrong bytes; "
                            f"health notes: {notes[:300]}"))
    return out


# ---- disk-full -----------------------------------------------------------------------


@dataclass
class FullResult:
    stored: int  # rows on disk before it filled
    lost: int  # of those, missing after the fill (and after a restart)
    wrong: int
    puts_after: int  # puts made after the disk filled
    refused: int  # of those, refused
    reason: str  # the disk tier's health detail once full
    restart_lost: int


def disk_full(workdir: Path, *, size_mib: int = 8, extra_puts: int = 600) -> FullResult:
    """A write-back node on a ``size_mib`` file system (its disk budget 8x larger, so the
    file system fills first): one-page prompts put until a disk write fails (the host
    tier, 2 MiB, demotes all the time), then ``extra_puts`` more. Every row that was on
    disk when it filled must still be there, then and after a restart."""
    small = SmallFs.mount(workdir / "small", size_mib)
    try:
        data = small.path / "data"
        env = _env(KVBANK_DISK_SYNC="0", KVBANK_DIRTY_EXPIRE_S="0")
        args = node_args(data, host="2M", disk=f"{size_mib * 8}M")
        node = NodeProcess.start(args, env=env)
        reason = ""
        refused = 0
        try:
            with Client(node.url, same_host=False) as c:
                lid = c.register(LAYOUT)
                n = 0
                while not reason:
                    if n > size_mib * 1024:  # more 4 KiB pages than the file system holds
                        raise RuntimeError("the disk never filled")
                    c.put(lid, chain_tokens(n, 0, 1), group=0, pages=[page_bytes(n, 0, 0)])
                    n += 1
                    if n % 32 == 0:
                        disk = next(t for t in c.health().tiers if t.kind is TierKind.DISK)
                        reason = disk.detail if disk.state.value == "degraded" else ""
                where = c.locate(chain_names_one(n, 0))
                on_disk = [i for i, t in enumerate(where) if t is TierKind.DISK]
                for k in range(extra_puts):
                    try:
                        c.put(lid, chain_tokens(k, 2, 1), group=0, pages=[page_bytes(k, 2, 0)])
                    except Exception:
                        refused += 1
            got, wrong = _read_rows(node.url, n, 0)
            lost = sum(1 for i in on_disk if not got[i])
        finally:
            node.stop()
        node = NodeProcess.start(args, env=env)
        try:
            again, more = _read_rows(node.url, n, 0)
            restart_lost = sum(1 for i in on_disk if not again[i])
            wrong += more
        finally:
            node.stop()
        return FullResult(len(on_disk), lost, wrong, extra_puts, refused, reason, restart_lost)
    finally:
        small.umount()


# ---- the part ------------------------------------------------------------------------


def run_part(quick: bool) -> tuple[list[BenchRow], int]:
    from kvbank.bench.reliability import goal_row

    rows: list[BenchRow] = []
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="kvbank-reliability-") as tmp:
        root = Path(tmp)
        crash = crash_puts(root / "wt", rounds=3 if quick else 20, clients=4 if quick else 8,
                           puts=200 if quick else 1000)
        acked = sum(r.acked for r in crash.rounds)
        lost = sum(r.lost for r in crash.rounds)
        wrong += sum(r.wrong for r in crash.rounds)
        rows.append(goal_row("crash-puts", "fraction of acknowledged puts read back bit-exactly",
                             (acked - lost) / max(1, acked), 1.0))
        expire = 2.0
        wb = crash_puts(root / "wb", policy="write-back", rounds=2 if quick else 5,
                        clients=4, puts=400 if quick else 1000, dirty_expire_s=expire, pace_s=0.004)
        wrong += sum(r.wrong for r in wb.rounds)
        ages = [a for r in wb.rounds for a in r.lost_ages]
        rows.append(goal_row("crash-puts-write-back", "s from the oldest lost ack to the kill",
                             max(ages, default=0.0), expire))
        rot = disk_rot(root / "rot", rows=500 if quick else 3000)
        wrong += rot.wrong
        rows.append(goal_row("disk-rot", "fraction of damaged frames detected and served as misses",
                             min(rot.missed, rot.counted) / max(1, rot.damaged), 1.0))
        faults = disk_startup_faults(root / "start", rows=100 if quick else 300)
        rows.append(goal_row("disk-rot-startup", "fraction of startup faults answered cleanly",
                             sum(f.ok for f in faults) / len(faults), 1.0))
        held = lease_holder_killed(root / "lease", rounds=3 if quick else 10)
        rows.append(goal_row("lease-holder-killed", "s past the TTL until the rows unlock (worst)",
                             max(h.past_expiry_s for h in held), 1.0))
        full = disk_full(root / "full", extra_puts=300 if quick else 1500)
        wrong += full.wrong
        rows.append(goal_row("disk-full", "acknowledged rows lost when the disk fills",
                             full.lost + full.restart_lost, 0))
        rows.append(goal_row("disk-full-puts-refused", "puts refused after the disk filled",
                             full.refused, 0))
    return rows, wrong
