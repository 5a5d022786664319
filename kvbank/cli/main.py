"""The ``kvbank`` command: thin argument parsing over library functions.

Subcommands:

- ``kvbank serve`` — run the node service (``kvbank.service.server``) on the embedded
  default or on flags, ``KVBANK_*`` and ``--config FILE.toml``; ``--print-config`` prints
  the effective settings and exits.
- ``kvbank bench SUITE [--json] [--quick]`` — run a benchmark suite; ``--json`` prints one
  JSON row per case (``suite, case, metric, value, baseline, baseline_value, ratio``).
  ``kvbank bench trace --trace FILE [--budgets 2,5] [--policies value] [--tiers host+disk]``
  replays a request trace (:mod:`kvbank.bench.trace`).
- ``kvbank demo [--url URL]`` — the demo scenario against a served node (one started on a
  free port unless ``--url`` names a running one).
- ``kvbank admin SUBCOMMAND`` — the admin API of a running node (:mod:`kvbank.cli.admin`).

Every heavy import (torch, the bank, uvicorn) happens inside the subcommand that needs it,
so ``kvbank --help`` and ``kvbank --version`` answer at once. A bare ``kvbank`` prints the
help and exits 2, like any other usage error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbank import progress
from kvbank._version import __version__
from kvbank.bench import SUITES
from kvbank.errors import KvbankError
from kvbank.extras import MissingExtra

SERVE_EPILOG = """\
With no flags this is the embedded default: it listens on 127.0.0.1:7410, keeps its disk
tier in $XDG_CACHE_HOME/kvbank (~/.cache/kvbank), runs without Redis, and sizes its
budgets from the machine at start: the host (shared-memory) tier gets a quarter of
available memory, at most half of what /dev/shm has free and at most 64 GiB; the disk tier
gets half of the data dir file system's free space, at most 1 TiB.

Precedence: defaults < --config FILE.toml < KVBANK_* environment < flags. Every flag has
a KVBANK_<NAME> variable (KVBANK_PORT, KVBANK_HOST_BYTES, ...). Sizes take suffixes: 512M, 4G.
SIGTERM or SIGINT stops accepting, lets in-flight requests finish, closes the bank (host
rows are written to disk) and exits 0.
"""

BENCH_BAR_AFTER_S = 3.0  # a suite shorter than this draws no bar

# flag -> (ServiceConfig / BankConfig field, help)
_SERVE_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--bind", "bind", "address to listen on (default 127.0.0.1)"),
    ("--port", "port", "TCP port (default 7410; 0 = any free port)"),
    ("--data-port", "data_port", "data plane TCP port for remote page bodies (default 0 = any free "
                                 "port, advertised in GET /v1/node; off = page bodies over HTTP)"),
    ("--data-connections", "data_connections", "open data plane connections (default 64)"),
    ("--data-dir", "data_dir", "disk tier folder (default $XDG_CACHE_HOME/kvbank)"),
    ("--host-bytes", "host_bytes", "host tier budget (default: sized, see below)"),
    ("--disk-bytes", "disk_bytes", "disk tier budget (default: sized, see below)"),
    ("--device-bytes", "device_bytes", "device tier budget (default: a share of free GPU memory; 0 = off)"),
    ("--write-policy", "write_policy", "write-back (rows reach disk when demoted or at shutdown) or "
                                       "write-through (every put is on disk before it is answered)"),
    ("--eviction-policy", "eviction_policy", "which rows leave a full tier: value (rows seen "
                                             "before outlive first-time rows; default) or lru"),
    ("--redis", "redis", "join a fleet through this Redis (redis:// or rediss:// URL)"),
    ("--redis-cluster", "redis_cluster", "join a fleet through this Redis Cluster (HOST:PORT,...)"),
    ("--remote-url", "remote_url", "Redis remote tier below the disk (URL or HOST:PORT,... seeds)"),
    ("--remote-bytes", "remote_bytes", "remote tier budget (default 4G)"),
    ("--threads", "threads", "threads for blocking bank calls (default 16)"),
    ("--max-body-bytes", "max_body_bytes", "largest request body (default 1G)"),
    ("--idle-timeout-s", "idle_timeout_s", "close idle connections after this (default 30)"),
    ("--header-timeout-s", "header_timeout_s", "request headers must arrive within this (default 10)"),
    ("--body-timeout-s", "body_timeout_s", "a request body must arrive within this (default 60)"),
    ("--shutdown-timeout-s", "shutdown_timeout_s", "in-flight requests get this long on SIGTERM (default 10)"),
)
_INT_FIELDS = {"port", "threads", "data_connections"}
_FLOAT_FIELDS = {"idle_timeout_s", "header_timeout_s", "body_timeout_s", "shutdown_timeout_s"}


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvbank.service.config import ServiceConfig

    flags: dict[str, object] = {}
    for _, name, _ in _SERVE_FLAGS:
        raw = getattr(args, name)
        if raw is None:
            continue
        try:
            if name == "data_port":
                flags[name] = -1 if raw.strip().lower() == "off" else int(raw)
                continue
            flags[name] = int(raw) if name in _INT_FIELDS else float(raw) if name in _FLOAT_FIELDS else raw
        except ValueError:
            print(f"kvbank serve: --{name.replace('_', '-')}: not a number: {raw!r}", file=sys.stderr)
            return 2
    if args.metrics_auth:
        flags["metrics_auth"] = True
    if args.reserve_host is not None:
        flags["reserve_host"] = args.reserve_host
    config = ServiceConfig.load(args.config, flags=flags)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    from kvbank.service.server import serve

    progress.enable()  # the reservation and the close's write-back, on a terminal
    return serve(config)


def _cmd_bench(args: argparse.Namespace) -> int:
    names = list(SUITES) if args.suite == "all" else [args.suite]
    progress.enable(not args.json)  # --json: the rows alone
    for name in names:
        module = importlib.import_module(SUITES[name])
        extra: dict[str, object] = {}
        if name == "trace":  # the replay's own options (kvbank.bench.trace)
            extra = {"trace": args.trace, "budgets": args.budgets, "policies": args.policies,
                     "tiers": args.tiers, "quiet": args.json}
        with _Ticking(f"bench {name}") as shown:
            for r in module.run(quick=args.quick, **extra):
                shown.update(1)
                if args.json:
                    print(r.to_json(), flush=True)
                else:
                    progress.echo(
                        f"{r.suite:8} {r.case:28} {r.value:14.4g} {r.metric:10} "
                        f"vs {r.baseline}: {r.baseline_value:.4g}  ratio {r.ratio:.3f}")
    return 0


class _Ticking:
    """A suite's bar (cases done, time running), redrawn twice a second so a long case
    shows its clock; drawn only after a few seconds, on a terminal (:mod:`kvbank.progress`)."""

    def __init__(self, desc: str) -> None:
        self.bar = progress.bar(None, desc, unit="case", delay_s=BENCH_BAR_AFTER_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="kvbank-bench-progress", daemon=True)

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.bar.refresh()

    def __enter__(self) -> Any:
        if not isinstance(self.bar, progress.Quiet):
            self._thread.start()
        return self.bar

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.bar.close()


def _numbers(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not out or any(not 0 < x <= 100 for x in out):
        raise argparse.ArgumentTypeError(f"budgets are percent in (0, 100], got {text!r}")
    return out


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbank.cli.demo import run_demo

    return run_demo(url=args.url, data_dir=args.data_dir, out=sys.stdout, model=not args.no_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbank",
        description="Storage-tier KV-cache offload and sharing for LLM serving fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvbank {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the node service (data API over HTTP and shared memory)",
        description="Run one kvbank node: a bank behind the data API under /v1/, for the "
                    "workers of this host (shared memory) and of other hosts (TCP).",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        # Settings share prefixes (--device, --device-bytes): a prefix must not be read as
        # another setting.
        allow_abbrev=False,
    )
    serve.add_argument("--config", metavar="FILE", default=None, help="TOML settings file")
    serve.add_argument("--print-config", action="store_true",
                       help="print the effective settings (TOML) and exit")
    for flag, name, text in _SERVE_FLAGS:
        serve.add_argument(flag, dest=name, default=None, help=text)
    serve.add_argument("--metrics-auth", action="store_true",
                       help="/metrics needs the admin token too (default: open)")
    serve.add_argument("--reserve-host", action=argparse.BooleanOptionalAction, default=None,
                       help="claim and pre-fault the whole host budget at start (default: on for "
                            "a node; --no-reserve-host claims memory as rows arrive)")
    serve.set_defaults(func=_cmd_serve)

    bench = sub.add_parser(
        "bench", help="run a benchmark suite against its baselines",
        description="Run a benchmark suite; every case is measured against a baseline in "
                    "the same run (medians of several runs).",
    )
    bench.add_argument("suite", choices=[*SUITES, "all"], help="which suite")
    bench.add_argument("--json", action="store_true", help="one JSON row per case")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    trace = bench.add_argument_group("trace", "options of the trace suite")
    trace.add_argument("--trace", type=Path, default=None, metavar="FILE",
                       help="a Mooncake JSONL request trace (default: a generated chat trace)")
    trace.add_argument("--budgets", type=_numbers, default=(2.0, 5.0, 10.0, 20.0), metavar="PCT,...",
                       help="host budgets as percent of the trace's distinct blocks (default 2,5,10,20)")
    trace.add_argument("--policies", type=lambda s: tuple(s.split(",")), default=("value",),
                       metavar="NAME,...", help="eviction policies to replay beside lru (default value)")
    trace.add_argument("--tiers", choices=("host", "host+disk"), default="host",
                       help="host only, or host and a disk of four times its rows")
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser(
        "demo", help="store, match and fetch a prompt's pages on a served node, explained",
        description="Run the demo scenario against a kvbank node: declare a layout, store a "
                    "prompt's pages, match a longer prompt, fetch the prefix (over shared "
                    "memory and over TCP) and lend rows; then two workers of a real tiny "
                    "model share a system prompt, with time to first token with and "
                    "without kvbank. Starts a node on a free port unless --url names one.",
    )
    demo.add_argument("--url", default=None, help="a running node (default: start one)")
    demo.add_argument("--data-dir", default=None, help="the started node's disk tier folder (default: a temp dir)")
    demo.add_argument("--no-model", action="store_true",
                      help="skip the real-model part (two workers sharing a system prompt)")
    demo.set_defaults(func=_cmd_demo)

    from kvbank.cli.admin import add_parser as add_admin

    add_admin(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KvbankError as exc:
        print(f"kvbank: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except MissingExtra as exc:  # e.g. --redis without the fleet extra: what to install, no traceback
        print(f"kvbank: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
