"""Frozen, validated settings for a bank (the embedded core, and the bank ``kvbank serve`` owns).

Every field has a ``DEFAULT_*`` constant and an environment override under the ``KVBANK_``
prefix; :meth:`BankConfig.from_env` reads them and CLI flags map onto the same names. A
``KVBANK_*`` variable that misspells a setting (``KVBANK_HOST_BYTE``) is ``ConfigError``
naming it and the setting meant, never silently ignored.

==========================  =========================  =====================================
field                       environment                meaning
==========================  =========================  =====================================
data_dir                    KVBANK_DATA_DIR            disk tier folder; unset = no disk tier
host_bytes                  KVBANK_HOST_BYTES          host (shared-memory) tier budget
disk_bytes                  KVBANK_DISK_BYTES          disk (LMDB) tier budget
device_bytes                KVBANK_DEVICE_BYTES        device tier budget; unset = a fraction
                                                       of free GPU memory read through NVML;
                                                       0 = off
device_fraction             KVBANK_DEVICE_FRACTION     that fraction
device                      KVBANK_DEVICE              torch device of the device tier
high_watermark              KVBANK_HIGH_WATERMARK      fill ratio that starts demotion
low_watermark               KVBANK_LOW_WATERMARK       fill ratio demotion stops at
write_policy                KVBANK_WRITE_POLICY        write-back (demote on eviction) or
                                                       write-through (every put also to disk)
eviction_policy             KVBANK_EVICTION_POLICY     which rows leave a full tier: value
                                                       (reuse-aware, the default) or lru
disk_sync                   KVBANK_DISK_SYNC           fsync every disk commit (true) or
                                                       leave it to the OS (false)
dirty_expire_s              KVBANK_DIRTY_EXPIRE_S      write-back: a memory row not on disk
                                                       this long is written there (its memory
                                                       copy kept), so a crash loses at most
                                                       this many seconds of puts; 0 = never
disk_salvage                KVBANK_DISK_SALVAGE        at open, if the LMDB environment is
                                                       damaged or truncated, set it aside and
                                                       copy every row that can still be read
                                                       into a fresh one (true); refuse to
                                                       start (false, the default)
reshard_store               KVBANK_RESHARD_STORE       store a row a fetch built from another
                                                       shard count's rows under the caller's
                                                       own shard (true), or not (false)
lease_ttl_s                 KVBANK_LEASE_TTL_S         default lease time to live
max_lease_ttl_s             KVBANK_MAX_LEASE_TTL_S     the longest TTL a lease may ask for
fetch_ttl_s                 KVBANK_FETCH_TTL_S         how long a fetch-ledger entry lives
reaper_interval_s           KVBANK_REAPER_INTERVAL_S   how often expired leases are reaped
movement_queue_bytes        KVBANK_MOVEMENT_QUEUE_BYTES  bytes waiting for the background
                                                       mover before puts feel backpressure
pin_bytes                   KVBANK_PIN_BYTES           raw bytes of rows pinned by the admin;
                                                       unset = a quarter of host_bytes
wait_timeout_s              KVBANK_WAIT_TIMEOUT_S      how long a store call waits for the
                                                       mover or for room before ``Busy``
copy_threads                KVBANK_COPY_THREADS        threads a batch's copies and codec
                                                       work run on; unset = the core count
reserve_host                KVBANK_RESERVE_HOST        claim and pre-fault the whole host
                                                       budget at open, in the background
remote_url                  KVBANK_REMOTE_URL          Redis remote tier below the disk:
                                                       ``redis://…`` or cluster seeds
                                                       ``host:port,host:port``; unset = off
remote_bytes                KVBANK_REMOTE_BYTES        remote tier budget (0 = off)
==========================  =========================  =====================================

Byte sizes accept a plain integer or a suffix: ``512M``, ``4G``, ``1.5GiB`` (powers of 1024).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbank import checks
from kvbank.errors import ConfigError

ENV_PREFIX = "KVBANK_"

DEFAULT_HOST_BYTES = 1 << 30
DEFAULT_DISK_BYTES = 8 << 30
DEFAULT_DEVICE_FRACTION = 0.10
DEFAULT_DEVICE = "cuda"
DEFAULT_REMOTE_BYTES = 4 << 30
DEFAULT_HIGH_WATERMARK = 0.95
DEFAULT_LOW_WATERMARK = 0.80
DEFAULT_LEASE_TTL_S = 30.0
DEFAULT_MAX_LEASE_TTL_S = 600.0
DEFAULT_FETCH_TTL_S = 120.0
DEFAULT_REAPER_INTERVAL_S = 0.25
DEFAULT_MOVEMENT_QUEUE_BYTES = 256 << 20
DEFAULT_PIN_FRACTION = 0.25  # pin_bytes when unset: this share of host_bytes
DEFAULT_DIRTY_EXPIRE_S = 30.0  # the kernel's dirty_expire_centisecs default
DEFAULT_WAIT_TIMEOUT_S = 60.0  # how long a store call may wait for the mover or for room


class EvictionPolicy(enum.Enum):
    VALUE = "value"  # rows seen again before (history) outlive first-time rows; LRU within
    LRU = "lru"  # least recently used first, chains from their tail


class WritePolicy(enum.Enum):
    WRITE_BACK = "write-back"  # rows reach disk when demoted
    WRITE_THROUGH = "write-through"  # every committed row is also written to disk at once


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: str | int, name: str = "size") -> int:
    """``"4G"`` → 4294967296. Refuses negatives and junk with a message naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size, got {value!r}")
    if isinstance(value, int):
        return checks.count(value, name, error=ConfigError)
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a byte size (an int, or a string like 512M), "
                          f"got {value!r}", field=name)
    m = _SIZE.match(value)
    if not m:
        raise ConfigError(f"{name}: not a byte size: {value!r} (try 512M, 4G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _number(value: object, name: str) -> float:
    """A real number (bool and strings refused: ``"0.5"`` is a typo in code, not a value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number, got {value!r}", field=name)
    return float(value)


_DEVICE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def _check_device(device: object) -> None:
    """A torch device string; the common ones without importing torch."""
    if not isinstance(device, str):
        raise ConfigError(f"device: expected a torch device string, got {device!r}", field="device")
    if _DEVICE.match(device):
        return
    import torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"device: not a torch device: {device!r} ({exc})".split("\n")[0],
                          field="device") from None


def _parse_bool(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true/false, got {value!r}")


@dataclass(frozen=True, slots=True)
class BankConfig:
    """Settings of one bank. Validated on construction; use ``replace`` to change."""

    data_dir: Path | None = None
    host_bytes: int = DEFAULT_HOST_BYTES
    disk_bytes: int = DEFAULT_DISK_BYTES
    device_bytes: int | None = None
    device_fraction: float = DEFAULT_DEVICE_FRACTION
    device: str = DEFAULT_DEVICE
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    eviction_policy: EvictionPolicy = EvictionPolicy.VALUE
    disk_sync: bool = True
    dirty_expire_s: float = DEFAULT_DIRTY_EXPIRE_S  # write-back: 0 = rows reach disk on demotion only
    disk_salvage: bool = False  # salvage a damaged disk tier at open instead of refusing
    reshard_store: bool = True  # keep rows a fetch resharded under the caller's shard
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    max_lease_ttl_s: float = DEFAULT_MAX_LEASE_TTL_S
    fetch_ttl_s: float = DEFAULT_FETCH_TTL_S
    reaper_interval_s: float = DEFAULT_REAPER_INTERVAL_S
    movement_queue_bytes: int = DEFAULT_MOVEMENT_QUEUE_BYTES
    pin_bytes: int | None = None  # raw bytes of pinned rows; None = host_bytes x 0.25
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    copy_threads: int | None = None  # None = the core count
    reserve_host: bool = False  # pre-fault host_bytes at open (kvbank serve: on)
    remote_url: str | None = None  # the Redis remote tier (frames spilled from the disk)
    remote_bytes: int = DEFAULT_REMOTE_BYTES

    def __post_init__(self) -> None:
        if self.data_dir is not None and not isinstance(self.data_dir, Path):
            if not isinstance(self.data_dir, str):
                raise ConfigError(f"data_dir: expected a path, got {self.data_dir!r}")
            if not self.data_dir.strip():  # Path("") is ".": a silent ./lmdb
                raise ConfigError("data_dir: empty; give a directory, or None for no disk tier")
            object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not isinstance(self.write_policy, (str, WritePolicy)):
            raise ConfigError(f"write_policy: expected one of {[p.value for p in WritePolicy]}, "
                              f"got {self.write_policy!r}")
        if not isinstance(self.eviction_policy, EvictionPolicy):
            try:
                object.__setattr__(self, "eviction_policy", EvictionPolicy(self.eviction_policy))
            except ValueError:
                raise ConfigError(
                    f"eviction_policy: expected one of {[p.value for p in EvictionPolicy]}, "
                    f"got {self.eviction_policy!r}", field="eviction_policy") from None
        _check_device(self.device)
        if _number(self.dirty_expire_s, "dirty_expire_s") < 0:
            raise ConfigError(f"dirty_expire_s: must be >= 0 seconds, got {self.dirty_expire_s!r}")
        for name in ("device_fraction", "high_watermark", "low_watermark"):
            object.__setattr__(self, name, _number(getattr(self, name), name))
        if isinstance(self.write_policy, str):
            try:
                object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
            except ValueError:
                raise ConfigError(
                    f"write_policy: expected one of {[p.value for p in WritePolicy]}, "
                    f"got {self.write_policy!r}"
                ) from None
        for name in ("host_bytes", "disk_bytes", "movement_queue_bytes", "remote_bytes"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        if self.device_bytes is not None:
            object.__setattr__(self, "device_bytes", parse_bytes(self.device_bytes, "device_bytes"))
        if not 0.0 < self.device_fraction <= 0.95:
            raise ConfigError(f"device_fraction: must be in (0, 0.95], got {self.device_fraction}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks: need 0 < low_watermark < high_watermark <= 1, got "
                f"low={self.low_watermark}, high={self.high_watermark}"
            )
        if self.pin_bytes is not None:
            object.__setattr__(self, "pin_bytes", parse_bytes(self.pin_bytes, "pin_bytes"))
        for name in ("lease_ttl_s", "max_lease_ttl_s", "fetch_ttl_s", "reaper_interval_s",
                     "wait_timeout_s"):
            checks.seconds(getattr(self, name), name, positive=True, error=ConfigError)
        if not isinstance(self.reshard_store, bool):
            raise ConfigError(f"reshard_store: must be a bool, got {self.reshard_store!r}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ConfigError(
                f"lease_ttl_s: {self.lease_ttl_s} exceeds max_lease_ttl_s {self.max_lease_ttl_s}"
            )
        for name in ("disk_sync", "disk_salvage"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.copy_threads is not None:
            checks.count(self.copy_threads, "copy_threads", 1, 256, error=ConfigError)
        if not isinstance(self.reserve_host, bool):
            raise ConfigError(f"reserve_host: must be a bool, got {self.reserve_host!r}")

    @property
    def pin_budget(self) -> int:
        """The pin budget in bytes: ``pin_bytes``, or a share of the host budget."""
        if self.pin_bytes is not None:
            return self.pin_bytes
        return int(self.host_bytes * DEFAULT_PIN_FRACTION)

    def replace(self, **changes: Any) -> BankConfig:
        """A copy with ``changes``; a key that is not a setting is ``ConfigError`` naming
        it (with the closest setting's name)."""
        check_settings(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> BankConfig:
        """Defaults, then ``KVBANK_*`` variables, then ``overrides`` (CLI flags)."""
        env = os.environ if env is None else env
        check_env_names(env, {f.name for f in dataclasses.fields(cls)})
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _from_text(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        check_settings(values)
        return cls(**values)


def check_env_names(env: Mapping[str, str], names: set[str]) -> None:
    """``ConfigError`` naming a ``KVBANK_*`` variable that is a misspelling of a setting
    in ``names`` (``KVBANK_HOST_BYTE``): ignored, it would leave the default in force
    unnoticed. Other ``KVBANK_*`` variables (a client's ``KVBANK_URL``, a node's own
    settings) are not this config's to judge, and no setting is that close to them."""
    for key in env:
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in names:
            continue
        near = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.8)
        if near:
            raise ConfigError(f"{key}: not a setting; did you mean {ENV_PREFIX}{near[0].upper()}?",
                              field=key)


def check_settings(keys: Mapping[str, object]) -> None:
    """``ConfigError`` naming the first key that is not a BankConfig setting."""
    settings = sorted(f.name for f in dataclasses.fields(BankConfig))
    for key in keys:
        if key not in settings:
            near = difflib.get_close_matches(key, settings, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; settings: {settings}"
            raise ConfigError(f"{key}: not a BankConfig setting{hint}", field=key)


def _from_text(name: str, raw: str) -> Any:
    if name == "data_dir":
        return Path(raw)
    if name in ("host_bytes", "disk_bytes", "device_bytes", "movement_queue_bytes", "pin_bytes",
                "remote_bytes"):
        return parse_bytes(raw, ENV_PREFIX + name.upper())
    if name in ("disk_sync", "disk_salvage"):
        return _parse_bool(raw, ENV_PREFIX + name.upper())
    if name in ("device", "remote_url"):
        return raw
    if name in ("write_policy", "eviction_policy"):
        return raw
    if name in ("reshard_store", "reserve_host"):
        return _parse_bool(raw, ENV_PREFIX + name.upper())
    if name == "copy_threads":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{ENV_PREFIX}COPY_THREADS: expected an integer, got {raw!r}") from None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}: expected a number, got {raw!r}") from None
