"""Host memory reserved up front: the host tier's budget claimed and pre-faulted at open.

With ``reserve_host`` set, :func:`start_reservation` checks that the budget fits the free
memory (``ConfigError`` naming the setting and what is free otherwise), then a background
thread makes the whole shared-memory segment resident, a step at a time, so open stays
fast and, once it is done, no put pays a page fault (a first touch costs ~10x a memcpy,
machine-limits.md section 1). The slab keeps reserved memory when a chunk is released.

Lifecycle: ``start_reservation(host, config)`` → :class:`Reservation` (``done_bytes``,
``wait(timeout)``) → ``stop()`` at close, before the segment is unmapped.
"""

from __future__ import annotations

import logging
import os
import threading

from kvbank.config import BankConfig
from kvbank.errors import ConfigError, KvbankError
from kvbank.tiers.host import SHM_DIR, HostSlab

logger = logging.getLogger("kvbank.tiers.store.store")

STEP_BYTES = 64 << 20  # pre-faulted per step: a close waits at most one step


def free_memory() -> int:
    """Bytes a reservation can take now: the lesser of /dev/shm's free space and the
    kernel's MemAvailable."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = min(free, int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    return free


class Reservation:
    """The background pre-fault of one host segment."""

    def __init__(self, host: HostSlab) -> None:
        self.target_bytes = host.space_bytes
        self._host = host
        self._done = 0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self.error: str | None = None
        host.keep_memory = True
        self._thread = threading.Thread(target=self._run, name="kvbank-reserve", daemon=True)
        self._thread.start()

    @property
    def done_bytes(self) -> int:
        """Bytes pre-faulted so far."""
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the whole budget is resident (or the reservation stopped); True if
        it finished in time."""
        return self._finished.wait(timeout)

    def _run(self) -> None:
        try:
            while self._done < self.target_bytes and not self._stop.is_set():
                n = min(STEP_BYTES, self.target_bytes - self._done)
                self._host.prefault(self._done, n)
                self._done += n
            logger.debug("host tier: %d bytes reserved", self._done)
        except KvbankError as exc:  # e.g. /dev/shm filled meanwhile: the tier still works
            self.error = str(exc)
            logger.warning("host tier: reservation stopped at %d bytes: %s", self._done, exc)
        finally:
            self._finished.set()

    def stop(self) -> None:
        """Stop after the current step and wait for it (before the segment is closed)."""
        self._stop.set()
        self._thread.join()


def start_reservation(host: HostSlab, config: BankConfig) -> Reservation:
    free = free_memory()
    if host.space_bytes > free:
        raise ConfigError(f"reserve_host: host_bytes {config.host_bytes} cannot be reserved, "
                          f"only {free} bytes of memory are free", field="reserve_host")
    logger.info("host tier: reserving %d bytes in the background", host.space_bytes)
    return Reservation(host)
