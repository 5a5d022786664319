"""The lease calls of :class:`~kvbank.client.client.Client` (mixed into it): ``lend``,
``lend_all``, ``renew``, ``release``, ``commit``, ``check_live`` and ``leases``, as
:class:`~kvbank.bank.bank.Bank` has them.

On the node's host they go over the local channel (:mod:`kvbank.client.local`) where it
is up — ``lend``, ``release``, ``commit`` and ``check_live``, one binary frame each way —
and over HTTP otherwise (``/v1/leases``). A lease's id crosses as text, checked as its
HTTP path is (:func:`_lease_text`). Lifecycle of a lease a worker holds: ``lend`` →
read or fill in place → ``check_live`` (READ: the completion check) or ``commit``
(WRITE) → ``release``; one not released ends at its ttl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbank import wire
from kvbank.client.io import Deadline, deadline_of, enum_name, lease_path_id, name_hex
from kvbank.errors import Busy, InvalidInput
from kvbank.lender.base import CommitResult, Lease, LeaseMode, MemoryKind
from kvbank.results import Match, check_shard

if TYPE_CHECKING:
    from kvbank.client.local import LocalLink


class LeaseCalls:
    """The lease calls of a client (see the module docstring)."""

    if TYPE_CHECKING:  # the client's (Client): its channel and its HTTP calls
        def _chan(self) -> LocalLink | None: ...

        def _call(self, method: str, path: str, *, body: Any = None, content: bytes | None = None,
                  idempotent: bool = False, deadline: Deadline | None = None,
                  wait_s: float | None = None) -> Any: ...

    def lend(self, rows: Match | Sequence[bytes], *, mode: LeaseMode = LeaseMode.READ,
             kind: MemoryKind = MemoryKind.HOST, ttl_s: float | None = None,
             timeout: float | None = None, shard: int | None = None) -> Lease:
        """A NAMED lease on rows (a Match lends the rows its resume bound needs);
        ``shard``: the caller's rank, rows of another shard are refused before any call.

        ``timeout`` bounds the wait for the node's answer: a lease that comes back after
        it is released at once, then :class:`Busy` (one whose answer never came ends at
        its ttl)."""
        deadline = deadline_of(timeout)
        check_shard(rows, shard)
        names = rows.needed if isinstance(rows, Match) else rows
        if isinstance(names, (bytes, str)) or not isinstance(names, Sequence):
            raise InvalidInput(f"names: expected a sequence of row names, got {type(names).__name__}")
        link = self._chan()
        if link is not None:
            enum_name(mode, LeaseMode, "mode")
            enum_name(kind, MemoryKind, "kind")
            if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                                      or not ttl_s > 0):
                raise InvalidInput(f"ttl_s: expected a positive number of seconds, got {ttl_s!r}", field="ttl_s")
            names = list(names)
            for i, n in enumerate(names):
                name_hex(n, i)
            lease = link.lend(names, mode, kind, ttl_s, deadline)
            if deadline is not None and deadline.passed():
                self.release(lease.id)
                raise deadline.busy("the lease was not ready (it came later and was released)")
            return lease
        hexed = [name_hex(n, i) for i, n in enumerate(names)]
        doc = self._call("POST", "/v1/leases", body={"names": hexed, "mode": enum_name(mode, LeaseMode, "mode"),
                                                     "kind": enum_name(kind, MemoryKind, "kind"), "ttl_s": ttl_s},
                         deadline=deadline)
        lease = wire.from_dict(Lease, doc)
        if deadline is not None and deadline.passed():
            self.release(lease.id)  # the caller gave up: hold nothing for it
            raise deadline.busy("the lease was not ready (it came later and was released)")
        return lease

    def lend_all(self, *, kind: MemoryKind = MemoryKind.HOST, mode: LeaseMode = LeaseMode.READ,
                 ttl_s: float | None = None) -> Lease:
        """An ALL lease: the tier's pools, for a transfer engine's one-time registration."""
        doc = self._call("POST", "/v1/leases", body={"all": True, "mode": enum_name(mode, LeaseMode, "mode"),
                                                     "kind": enum_name(kind, MemoryKind, "kind"), "ttl_s": ttl_s})
        return wire.from_dict(Lease, doc)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        doc = self._call("POST", f"/v1/leases/{lease_path_id(lease_id)}/renew", body={"ttl_s": ttl_s})
        return wire.from_dict(Lease, doc)

    def release(self, lease_id: str) -> bool:
        link = self._chan()
        if link is not None:
            return link.release(_lease_text(lease_id))
        return bool(self._call("DELETE", f"/v1/leases/{lease_path_id(lease_id)}")["released"])

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool]) -> CommitResult:
        """Publish the WRITE lease's rows that arrived whole; the rest are discarded."""
        return self._commit(lease_id, arrived, None)

    def _commit_or_release(self, lease_id: str, arrived: list[bytes], deadline: Deadline | None,
                           sums: Sequence[int] | None = None) -> None:
        """A put's commit; where its deadline passes first, the lease is released (the
        caller gave up: nothing is held for it) and :class:`Busy` raised. ``sums``: each
        arrived row's checksum as this process hashed its slot (the local channel only)."""
        try:
            self._commit(lease_id, arrived, deadline, sums)
        except Busy:
            self.release(lease_id)
            raise

    def _commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool],
                deadline: Deadline | None, sums: Sequence[int] | None = None) -> CommitResult:
        items = list(arrived)
        link = self._chan()
        if link is not None and all(type(a) is bytes for a in items):
            return link.commit(_lease_text(lease_id), items, sums=sums)  # type: ignore[arg-type]  # bytes, checked
        body = items if items and all(isinstance(a, bool) for a in items) else [
            a.hex() if isinstance(a, bytes) else a for a in items]
        doc = self._call("POST", f"/v1/leases/{lease_path_id(lease_id)}/commit", body={"arrived": body},
                         deadline=deadline)
        return wire.from_dict(CommitResult, doc)

    def check_live(self, lease_id: str) -> None:
        """The completion check: :class:`LeaseExpired` if the lease ended before now."""
        link = self._chan()
        if link is not None:
            link.check_live(_lease_text(lease_id))
            return
        self._call("POST", f"/v1/leases/{lease_path_id(lease_id)}/check")

    def leases(self) -> tuple[Lease, ...]:
        """A snapshot of every live lease on the node."""
        doc = self._call("GET", "/v1/leases", idempotent=True)
        return tuple(wire.from_dict(Lease, d) for d in doc["leases"])


def _lease_text(lease_id: object) -> str:
    """A lease id as the local channel sends it (checked as its HTTP path is)."""
    return lease_path_id(lease_id)  # refuses what is not a lease id


__all__ = ["LeaseCalls"]
