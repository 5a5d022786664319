"""Shipped bench code stands on the package, never on test scaffolding."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbank.bench

BENCH = Path(kvbank.bench.__file__).parent


def test_bench_never_imports_kvbank_testing() -> None:
    bad = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbank.testing"):
                bad.append(f"{path.name}:{node.lineno} {node.module}")
            if isinstance(node, ast.Import):
                bad += [f"{path.name}:{node.lineno} {a.name}" for a in node.names
                        if a.name.startswith("kvbank.testing")]
    assert not bad, bad
