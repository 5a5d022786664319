"""Settings of one ``kvbank serve`` node: a frozen :class:`ServiceConfig` holding a
:class:`~kvbank.config.BankConfig`.

Sources, later ones winning: built-in defaults (with budgets sized from the machine, see
below) → a TOML file (``--config FILE``, read with :mod:`tomllib`) → ``KVBANK_*``
environment variables → command-line flags. ``kvbank serve --print-config`` prints the
effective result in the TOML form ``--config`` reads back.

===================  ==========================  =========================================
field                environment                 meaning
===================  ==========================  =========================================
bind                 KVBANK_BIND                 address to listen on (127.0.0.1)
port                 KVBANK_PORT                 TCP port (7410; 0 = a free one)
data_port            KVBANK_DATA_PORT            the data plane's TCP port for remote page
                                                 bodies (0 = a free one, the default;
                                                 ``off`` or -1 = none: bodies go over HTTP)
data_connections     KVBANK_DATA_CONNECTIONS     open data-plane connections (one more is
                                                 refused ``Busy`` and closed)
threads              KVBANK_THREADS              bounded pool for blocking bank calls
max_body_bytes       KVBANK_MAX_BODY_BYTES       largest put body (413 above it)
max_json_bytes       KVBANK_MAX_JSON_BYTES       largest JSON request body (413 above it)
max_headers          KVBANK_MAX_HEADERS          most request headers (431 above it)
max_header_bytes     KVBANK_MAX_HEADER_BYTES     largest request line + headers (431)
max_connections      KVBANK_MAX_CONNECTIONS      open connections (503 and closed above it)
idle_timeout_s       KVBANK_IDLE_TIMEOUT_S       an idle keep-alive connection is closed
header_timeout_s     KVBANK_HEADER_TIMEOUT_S     request headers must arrive within this
                                                 (408 and closed past it)
body_timeout_s       KVBANK_BODY_TIMEOUT_S       a request body must arrive within this
shutdown_timeout_s   KVBANK_SHUTDOWN_TIMEOUT_S   SIGTERM: in-flight requests get this long
redis                KVBANK_REDIS                join a fleet through this Redis URL
redis_cluster        KVBANK_REDIS_CLUSTER        or through this cluster (HOST:PORT,...)
admin_token          KVBANK_ADMIN_TOKEN          the admin API's bearer token (unset: one
                                                 is generated into ``DATA_DIR/admin.token``)
metrics              KVBANK_METRICS              serve ``/metrics`` (on by default)
metrics_auth         KVBANK_METRICS_AUTH         ``/metrics`` needs the admin token too
series_interval_s    KVBANK_SERIES_INTERVAL_S    the status page's sampling interval (1 s;
                                                 600 samples are kept)
tenants              KVBANK_TENANTS              ``tenant = token`` pairs (TOML table
                                                 ``[tenants]``; env ``a=tok1,b=tok2``):
                                                 when set, every data call needs a token
===================  ==========================  =========================================

Secrets (``admin_token``, ``tenants``) are never printed by ``--print-config``.

The bank's own fields (``data_dir``, ``host_bytes``, ``disk_bytes``, ...) keep their
``KVBANK_*`` names (:mod:`kvbank.config`) and sit under ``[bank]`` in the TOML file.

**The embedded default.** With nothing set, the node binds 127.0.0.1:7410, keeps its disk
tier under ``$XDG_CACHE_HOME/kvbank`` (``~/.cache/kvbank``), and sizes its budgets from
the machine at start: the host tier gets a quarter of available memory, capped by half of
what ``/dev/shm`` has free (the tier lives there) and by 64 GiB; the disk tier gets half
of the free space of the data dir's file system, capped at 1 TiB. No Redis.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbank.config import ENV_PREFIX, BankConfig, check_env_names, parse_bytes
from kvbank.errors import ConfigError
from kvbank.wire.node import DEFAULT_BIND, DEFAULT_PORT

DEFAULT_DATA_PORT = 0  # a free port, advertised in GET /v1/node
DATA_PORT_OFF = -1
DEFAULT_DATA_CONNECTIONS = 64
DEFAULT_THREADS = 16
DEFAULT_MAX_BODY_BYTES = 1 << 30
DEFAULT_MAX_JSON_BYTES = 16 << 20  # a 1M-token match as a JSON list is ~7 MiB
DEFAULT_MAX_HEADERS = 64
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_IDLE_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_SERIES_INTERVAL_S = 1.0

MIN_BUDGET = 64 << 20
HOST_SHARE, HOST_CAP = 0.25, 64 << 30  # of MemAvailable; /dev/shm's free half caps it too
DISK_SHARE, DISK_CAP = 0.50, 1 << 40  # of the data dir file system's free space

_INTS = ("port", "data_port", "threads", "max_headers", "max_connections", "data_connections")
_SIZES = ("max_body_bytes", "max_json_bytes", "max_header_bytes")
_SECONDS = ("idle_timeout_s", "header_timeout_s", "body_timeout_s", "shutdown_timeout_s", "series_interval_s")


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/kvbank``, else ``~/.cache/kvbank``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvbank"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30  # not Linux, or an unreadable /proc: a modest guess


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the data dir may not exist yet: ask its nearest parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 0


def sized_host_bytes() -> int:
    """The host tier budget the embedded default picks on this machine now."""
    want = int(_mem_available() * HOST_SHARE)
    shm = _free_bytes(Path("/dev/shm"))
    if shm:
        want = min(want, shm // 2)
    return max(MIN_BUDGET, min(want, HOST_CAP))


def sized_disk_bytes(data_dir: Path) -> int:
    """The disk tier budget the embedded default picks for ``data_dir`` now."""
    return max(MIN_BUDGET, min(int(_free_bytes(data_dir) * DISK_SHARE), DISK_CAP))


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Settings of one node. Validated on construction; build it with :meth:`load`."""

    bank: BankConfig = field(default_factory=BankConfig)
    bind: str = DEFAULT_BIND
    port: int = DEFAULT_PORT
    data_port: int = DEFAULT_DATA_PORT  # DATA_PORT_OFF: no data plane
    data_connections: int = DEFAULT_DATA_CONNECTIONS
    threads: int = DEFAULT_THREADS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    redis: str | None = None  # the fleet's Redis (registry and prefix index)
    redis_cluster: str | None = None  # or its Redis Cluster seeds, HOST:PORT,...
    admin_token: str | None = None
    metrics: bool = True
    metrics_auth: bool = False
    series_interval_s: float = DEFAULT_SERIES_INTERVAL_S
    tenants: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _check_secrets(self)
        if not isinstance(self.bank, BankConfig):
            raise ConfigError(f"bank: expected a BankConfig, got {type(self.bank).__name__}")
        if not isinstance(self.bind, str) or not self.bind:
            raise ConfigError(f"bind: expected an address, got {self.bind!r}")
        for name in _SIZES:
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        if isinstance(self.data_port, str) and self.data_port.strip().lower() in _OFF:
            object.__setattr__(self, "data_port", DATA_PORT_OFF)  # TOML and flags may say "off"
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name}: expected an integer, got {v!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if not DATA_PORT_OFF <= self.data_port <= 65535:
            raise ConfigError(f"data_port: must be in [0, 65535] (or off / -1), got {self.data_port}")
        for name in ("threads", "max_headers", "max_connections", "data_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes < 1 << 20:
            raise ConfigError(f"max_body_bytes: must be >= 1 MiB, got {self.max_body_bytes}")
        if self.max_json_bytes < 64 << 10:  # the limit a JSON route applies: min(this, max_body_bytes)
            raise ConfigError(f"max_json_bytes: must be >= 64 KiB, got {self.max_json_bytes}")
        if self.max_header_bytes < 4 << 10:
            raise ConfigError(f"max_header_bytes: must be >= 4 KiB, got {self.max_header_bytes}")
        if self.redis is not None and self.redis_cluster is not None:
            raise ConfigError("redis: give --redis or --redis-cluster, not both")
        # Refused at start, not answered by a fleet loop that fails forever in the log.
        if self.redis is not None and not self.redis.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis: expected a redis://, rediss:// or unix:// URL, got {self.redis!r}",
                              field="redis")
        if self.redis_cluster is not None:
            seeds = [x.strip() for x in self.redis_cluster.split(",")]
            for seed in seeds:
                host, _, port = seed.rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ConfigError(f"redis_cluster: expected HOST:PORT,..., got {seed!r}",
                                      field="redis_cluster")
        for name in _SECONDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name}: must be a positive number of seconds, got {v!r}")

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}"

    def replace(self, **changes: Any) -> ServiceConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"{sorted(unknown)[0]}: not a service setting")
        return dataclasses.replace(self, **changes)

    @classmethod
    def load(
        cls,
        config_file: Path | str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> ServiceConfig:
        """Defaults → ``config_file`` (TOML) → ``KVBANK_*`` in ``env`` → ``flags``.

        ``flags`` hold service and bank field names alike (``None`` values are unset).
        Budgets nobody set are sized from the machine (see the module docstring).
        """
        env = os.environ if env is None else env
        doc = _read_toml(Path(config_file)) if config_file is not None else {}
        bank_doc = doc.pop("bank", {})
        if not isinstance(bank_doc, dict):
            raise ConfigError("bank: expected a [bank] table")
        service_names = {f.name for f in dataclasses.fields(cls)} - {"bank"}
        if "tenants" in doc and isinstance(doc["tenants"], dict):
            doc["tenants"] = tuple(doc["tenants"].items())
        bank_names = {f.name for f in dataclasses.fields(BankConfig)}
        for key in doc:
            if key not in service_names:
                raise ConfigError(f"{key}: not a service setting (bank settings go under [bank])")
        for key in bank_doc:
            if key not in bank_names:
                raise ConfigError(f"bank.{key}: not a bank setting")
        check_env_names(env, service_names | bank_names)
        service: dict[str, Any] = dict(doc)
        bank: dict[str, Any] = dict(bank_doc)
        for name in service_names:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw:
                service[name] = _service_from_text(name, raw)
        # BankConfig parses its own variables; take only the ones the environment sets.
        bank_env = {k: v for k, v in env.items()
                    if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() in bank_names and v}
        parsed = BankConfig.from_env(bank_env)
        for key in bank_env:
            bank[key[len(ENV_PREFIX):].lower()] = getattr(parsed, key[len(ENV_PREFIX):].lower())
        for key, value in (flags or {}).items():
            if value is None:
                continue
            if key in service_names:
                service[key] = value
            elif key in bank_names:
                bank[key] = value
            else:
                raise ConfigError(f"{key}: not a setting")
        bank.setdefault("data_dir", default_data_dir(env))
        bank.setdefault("reserve_host", True)  # a node owns its host budget: pre-fault it at open
        data_dir = Path(bank["data_dir"])
        if "host_bytes" not in bank:
            bank["host_bytes"] = sized_host_bytes()
        if "disk_bytes" not in bank:
            bank["disk_bytes"] = sized_disk_bytes(data_dir)
        try:
            return cls(BankConfig(**bank), **service)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    def to_toml(self) -> str:
        """The effective settings in the form :meth:`load` reads back."""
        lines = [f"{f.name} = {_toml_value(getattr(self, f.name))}"
                 for f in dataclasses.fields(self)
                 if f.name not in _NOT_PRINTED and getattr(self, f.name) is not None]
        lines += ["", "[bank]"]
        for f in dataclasses.fields(self.bank):
            v = getattr(self.bank, f.name)
            if v is not None:  # TOML has no null: an unset field is left out
                lines.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc


_NOT_PRINTED = ("bank", "admin_token", "tenants")
_OFF = ("off", "none", "false", "no")


def _check_secrets(c: ServiceConfig) -> None:
    if c.admin_token is not None and (not isinstance(c.admin_token, str) or len(c.admin_token) < 16):
        raise ConfigError("admin_token: expected a string of at least 16 characters", field="admin_token")
    for name in ("metrics", "metrics_auth"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"{name}: expected true or false, got {getattr(c, name)!r}", field=name)
    pairs = c.tenants
    if isinstance(pairs, Mapping):
        pairs = tuple(pairs.items())
    if not isinstance(pairs, tuple) or any(
            not isinstance(p, tuple) or len(p) != 2 or not all(isinstance(x, str) and x for x in p)
            for p in pairs):
        raise ConfigError("tenants: expected tenant = token pairs of non-empty strings", field="tenants")
    if any(len(tok) < 16 for _, tok in pairs):
        raise ConfigError("tenants: every tenant token needs at least 16 characters", field="tenants")
    tokens = [tok for _, tok in pairs]
    if len(set(tokens)) != len(tokens) or len({t for t, _ in pairs}) != len(pairs):
        raise ConfigError("tenants: each tenant once, each token for one tenant", field="tenants")
    object.__setattr__(c, "tenants", tuple(sorted(pairs)))


def _service_from_text(name: str, raw: str) -> Any:
    var = ENV_PREFIX + name.upper()
    if name in ("bind", "redis", "redis_cluster", "admin_token"):
        return raw
    if name in ("metrics", "metrics_auth"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if name == "tenants":
        pairs = [p.partition("=") for p in raw.split(",") if p.strip()]
        return tuple((t.strip(), k.strip()) for t, _, k in pairs)
    if name in _SIZES:
        return parse_bytes(raw, var)
    if name == "data_port" and raw.strip().lower() in _OFF:
        return DATA_PORT_OFF
    try:
        return int(raw) if name in _INTS else float(raw)
    except ValueError:
        raise ConfigError(f"{var}: expected a number, got {raw!r}") from None


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, enum.Enum):
        v = v.value
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
