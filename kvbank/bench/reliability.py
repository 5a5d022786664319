"""``kvbank bench reliability``: faults, load and bad luck against running processes.

The suite is made of parts, each a module with ``run_part(quick) -> (rows, wrong_bytes)``
(:data:`PARTS`, imported by name when reached, so one part's failure to import names
that part only). The runner prints every part's rows, then ``wrong-bytes``: the wrong
bytes every part saw returned, summed.

A row's ``baseline`` is ``"goal"`` and ``baseline_value`` the goal; ``ratio`` is
value / goal, or the value itself when the goal is 0 (so a row passes at ratio 1.0 for a
fraction goal, ratio <= 1 for an upper bound, and ratio 0 for a zero goal).

Run one part: ``python -m kvbank.bench.reliability --part procs [--quick]`` (JSON rows).
Rewrite the figures table of ``docs/reliability.md`` from saved rows:

    kvbank bench reliability --json > rows.jsonl
    python -m kvbank.bench.reliability --doc docs/reliability.md < rows.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

from kvbank.bench.common import BenchRow

SUITE = "reliability"
PARTS: dict[str, str] = {
    "procs": "kvbank.bench.reliability_procs",  # crash-puts, disk-rot, lease-holder-killed, disk-full
    "node": "kvbank.bench.reliability_node",  # crash-puts-partial, client-restart, tenant-neighbour
    "fleet": "kvbank.bench.reliability_fleet",  # redis-flap, peer-killed, soak-16x60(-rss)
}
BEGIN, END = "<!-- reliability figures: begin -->", "<!-- reliability figures: end -->"


class PartUnavailable(RuntimeError):
    """A part of the suite could not be imported."""


def goal_row(case: str, metric: str, value: float, goal: float) -> BenchRow:
    """A row measured against its goal (see the module docstring for the ratio)."""
    ratio = value / goal if goal else value
    return BenchRow(SUITE, case, metric, round(float(value), 6), "goal", float(goal),
                    round(float(ratio), 4))


def load_part(name: str) -> ModuleType:
    if name not in PARTS:
        raise PartUnavailable(f"part: no reliability part {name!r} (parts: {', '.join(PARTS)})")
    module = PARTS[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PartUnavailable(f"part {name!r}: {module} is not importable: {exc}") from exc


def run(quick: bool = False, parts: Sequence[str] | None = None) -> Iterator[BenchRow]:
    wrong = 0
    for name in parts or list(PARTS):
        rows, seen = load_part(name).run_part(quick)
        yield from rows
        wrong += seen
    yield goal_row("wrong-bytes", "wrong bytes returned across every case", wrong, 0)


def markdown(rows: Sequence[dict[str, object]]) -> str:
    # A row measured against something other than its goal (a latency against the idle
    # node's, a count against the operations run) names that baseline beside its figure.
    lines = ["| case | metric | value | goal (or baseline) | ratio |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("suite") != SUITE:
            continue
        base = f"{float(str(r['baseline_value'])):.4g}"
        if r.get("baseline") != "goal":
            base += f" ({r['baseline']})"
        lines.append(f"| `{r['case']}` | {r['metric']} | {float(str(r['value'])):.4g} | "
                     f"{base} | {float(str(r['ratio'])):.4g} |")
    return "\n".join(lines)


def rewrite_doc(path: Path, table: str, note: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{note}\n\n{table}\n{END}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbank.bench.reliability")
    p.add_argument("--part", action="append", choices=list(PARTS), help="run only this part")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--markdown", action="store_true", help="JSON rows on stdin -> a table")
    p.add_argument("--doc", type=Path, help="JSON rows on stdin -> this file's figures table")
    p.add_argument("--load", default="", help="with --doc: the load average during the run")
    args = p.parse_args(argv)
    if args.markdown or args.doc:
        rows = [json.loads(line) for line in sys.stdin if line.strip().startswith("{")]
        table = markdown(rows)
        if args.doc:
            note = "Measured on a shared 2-core machine" + (
                f"; load average: {args.load}." if args.load else ".")
            rewrite_doc(args.doc, table, note)
        else:
            print(table)
        return 0
    for r in run(quick=args.quick, parts=args.part):
        print(r.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
