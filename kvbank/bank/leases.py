"""A bank's leases: lend rows for in-place reads and fills, and the calls on a lease.

:class:`LeaseOps` is a base of :class:`~kvbank.bank.bank.Bank` (the operator's and the
fleet's calls are objects of their own, ``bank.admin`` and ``bank.fleet``), a thin layer
over :class:`~kvbank.lender.lender.Lender`: :meth:`~LeaseOps.lend` (NAMED rows, or a
match's needed rows, with an optional deadline), :meth:`~LeaseOps.lend_all`, ``renew``,
``release``, ``commit``, in-place ``view``/``device_view``/``write``, the copies
``read``/``read_into`` and the completion check :meth:`~LeaseOps.check_live`, and
:meth:`~LeaseOps.leases` (a snapshot). See docs/lender.md for the lease lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvbank import checks
from kvbank.bank.catalog import Catalog
from kvbank.errors import Busy
from kvbank.layout import PageLayout
from kvbank.lender.base import CommitResult, Lease, LeaseMode, MemoryKind
from kvbank.lender.lender import Lender
from kvbank.results import Match, check_shard


class LeaseOps:
    """Lease operations of a bank (mixed into :class:`~kvbank.bank.bank.Bank`)."""

    _lender: Lender
    _catalog: Catalog
    _clock: Callable[[], float]
    layout: Callable[[bytes], PageLayout]  # Bank's: UnknownLayout for an unregistered id

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None:
            return None
        return self._clock() + checks.seconds(timeout, "timeout")

    def lend(self, rows: Match | Sequence[bytes], *, mode: LeaseMode = LeaseMode.READ,
             kind: MemoryKind = MemoryKind.HOST, ttl_s: float | None = None,
             timeout: float | None = None, shard: int | None = None) -> Lease:
        """A NAMED lease on rows (a Match lends the rows its resume bound needs);
        ``shard``: the caller's rank, rows of another shard are refused."""
        check_shard(rows, shard)
        deadline = self._deadline(timeout)
        if isinstance(rows, Match):
            self.layout(rows.layout_id)
            self._catalog.learn(rows.layout_id, rows.scope)
            names: Sequence[bytes] = rows.needed
        else:
            names = rows
        lease = self._lender.lend(names, kind=kind, mode=mode, ttl_s=ttl_s)
        if deadline is not None and self._clock() > deadline:
            self._lender.release(lease.id)  # the caller gave up: hold nothing for it
            raise Busy(f"timeout: the lease was ready after its {timeout} s deadline and was "
                       "released", field="timeout")
        return lease

    def lend_all(self, *, kind: MemoryKind = MemoryKind.HOST, mode: LeaseMode = LeaseMode.READ,
                 ttl_s: float | None = None) -> Lease:
        """An ALL lease: the tier's pools, for a transfer engine's one-time registration."""
        return self._lender.lend_all(kind=kind, mode=mode, ttl_s=ttl_s)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        return self._lender.renew(lease_id, ttl_s)

    def release(self, lease_id: str) -> bool:
        """End a lease; False if it had already ended (safe in a ``finally``)."""
        return self._lender.release(lease_id)

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool]) -> CommitResult:
        """Publish the WRITE lease's rows that arrived whole; the rest are discarded."""
        return self._lender.commit(lease_id, arrived)

    def commit_summed(self, lease_id: str, arrived: Sequence[bytes], sums: Mapping[bytes, int]) -> CommitResult:
        """:meth:`commit`, with the checksum of each row its writer hashed as it copied
        it into its host slot (a same-host client's, on the node's local channel): kept
        as the row's, so the slot is not read again to hash it. A wrong one makes the row
        fail its readers' checks, a miss; no reader is ever served other bytes."""
        return self._lender.commit(lease_id, arrived, sums)

    def view(self, lease_id: str, name: bytes) -> memoryview:
        """A HOST lease row's bytes in place (READ: read, then :meth:`check_live`; WRITE: fill)."""
        return self._lender.view(lease_id, name)

    def checksums(self, lease_id: str) -> dict[bytes, int]:
        """A READ HOST lease's rows' checksums (xxh3-64 of the committed bytes): what a
        reader that copies the rows out verifies its copies against."""
        return self._lender.checksums(lease_id)

    def device_view(self, lease_id: str, name: bytes) -> torch.Tensor:
        """A DEVICE lease row's bytes in place (a uint8 tensor)."""
        return self._lender.device_view(lease_id, name)

    def write(self, lease_id: str, name: bytes, data: bytes | bytearray | memoryview) -> None:
        """Fill a WRITE lease's reserved row (a copy; :meth:`view` fills in place)."""
        self._lender.write(lease_id, name, data)

    def read(self, lease_id: str, name: bytes) -> bytes:
        """A leased row's bytes, only if the lease outlived the copy (else LeaseExpired)."""
        return self._lender.read(lease_id, name)

    def read_into(self, lease_id: str, name: bytes, out: memoryview | bytearray) -> int:
        """Copy a leased row into ``out``; its size, only if the lease outlived the copy."""
        return self._lender.read_into(lease_id, name, out)

    def check_live(self, lease_id: str) -> None:
        """The completion check after reading in place: :class:`LeaseExpired` (or
        LeaseNotFound) if the lease ended, in which case the bytes read must not be used."""
        self._lender.check_live(lease_id)

    def leases(self) -> tuple[Lease, ...]:
        """A snapshot of every live lease."""
        out: list[Lease] = []
        for lid in self._lender.live_ids():
            try:
                out.append(self._lender.lease(lid))
            except KeyError:  # LeaseNotFound: ended between the two calls
                continue
        return tuple(out)
