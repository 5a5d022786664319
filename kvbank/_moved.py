"""Import paths that moved in 0.2, kept for one release.

``import kvbank.service.client`` still works: a finder on ``sys.meta_path`` answers each
old path below with the module at its new path (the same module object, so classes
compare equal) and a ``DeprecationWarning`` naming the new path. Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "kvbank.admin_ops": "kvbank.bank.admin",
    "kvbank.bench.redis_procs": "kvbank.procs",
    "kvbank.catalog": "kvbank.bank.catalog",
    "kvbank.cli_admin": "kvbank.cli.admin",
    "kvbank.columns": "kvbank.fastrows",
    "kvbank.cross_shard": "kvbank.bank.cross_shard",
    "kvbank.demo": "kvbank.cli.demo",
    "kvbank.fetching": "kvbank.bank.fetch",
    "kvbank.fleet_ops": "kvbank.bank.fleet",
    "kvbank.lease_ops": "kvbank.bank.leases",
    "kvbank.lender.borrow": "kvbank.client.shm",
    "kvbank.lookup": "kvbank.bank.lookup",
    "kvbank.service.admin_models": "kvbank.service.admin.models",
    "kvbank.service.admin_state": "kvbank.service.admin.state",
    "kvbank.service.auth": "kvbank.service.admin.auth",
    "kvbank.service.client": "kvbank.client.client",
    "kvbank.service.client_io": "kvbank.client.io",
    "kvbank.service.fleet_index": "kvbank.service.fleet.index",
    "kvbank.service.framing": "kvbank.wire.framing",
    "kvbank.service.hot": "kvbank.service.fast_routes",
    "kvbank.service.metrics": "kvbank.service.admin.metrics",
    "kvbank.service.tenants": "kvbank.service.admin.tenants",
    "kvbank.tiers.slots": "kvbank.tiers.allocator",
    "kvbank.tiers.store.memory": "kvbank.tiers.store.inplace",
    "kvbank.tiers.store.pagelocks": "kvbank.tiers.store.rowlocks",
    "kvbank.wire_columns": "kvbank.wire.columns",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self._new}; the old path goes in kvbank 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self._new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in :data:`MOVED`, and nothing else."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
