"""The ``kvbank`` command: thin argument parsing over library functions.

Subcommands:

- ``kvbank bench SUITE [--json] [--quick]`` — run a benchmark suite; ``--json`` prints one
  JSON row per case (``suite, case, metric, value, baseline, baseline_value, ratio``).
- ``kvbank demo`` — the embedded core end to end: declare a layout, store a prompt's
  pages, match a longer prompt, fetch the prefix, print what happened.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvbank import __version__
from kvbank.bench import SUITES
from kvbank.errors import KvbankError


def _cmd_bench(args: argparse.Namespace) -> int:
    names = list(SUITES) if args.suite == "all" else [args.suite]
    for name in names:
        module = importlib.import_module(SUITES[name])
        for r in module.run(quick=args.quick):
            if args.json:
                print(r.to_json(), flush=True)
            else:
                print(
                    f"{r.suite:8} {r.case:28} {r.value:14.4g} {r.metric:10} "
                    f"vs {r.baseline}: {r.baseline_value:.4g}  ratio {r.ratio:.3f}",
                    flush=True,
                )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbank.demo import run_demo

    return run_demo(data_dir=args.data_dir, out=sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbank",
        description="Storage-tier KV-cache offload and sharing for LLM serving fleets.",
    )
    parser.add_argument("--version", action="version", version=f"kvbank {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser("bench", help="run a benchmark suite against its baselines")
    bench.add_argument("suite", choices=[*SUITES, "all"], help="which suite")
    bench.add_argument("--json", action="store_true", help="one JSON row per case")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="run the embedded core end to end and explain it")
    demo.add_argument("--data-dir", default=None, help="disk tier folder (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args))
    except KvbankError as exc:
        print(f"kvbank: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
