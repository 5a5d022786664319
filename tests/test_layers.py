"""The layer rules of DESIGN.md, held against the code.

Dependencies point down: ``service → bank → lender → tiers → codec, kernels → layout,
keys``; ``client → wire → layout, keys, errors``, never into the bank, the tiered store
or the node. Only ``tiers/`` (and the bench harness) imports LMDB or Redis; only
``service/`` imports the HTTP server stack; only ``integrations/`` (and the bench and the
demo) imports an engine. No import circle, lazy imports inside functions included (only
``if TYPE_CHECKING:`` blocks are left out: they never run). And a worker that only talks
to a node pays for no storage engine: importing ``kvbank.client`` loads no LMDB and no
bank.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvbank

PACKAGE = Path(kvbank.__file__).parent

# The floor of each part of the package (the first dotted name below ``kvbank`` that is
# listed, longest first): a module may import its own floor and those below it, never
# one above. Circles within a floor are caught by the circle test.
FLOORS: dict[str, int] = {
    "errors": 0, "_version": 0, "extras": 0, "dtypes": 0, "_moved": 0, "progress": 0,
    "checks": 1, "config": 1, "keys": 1, "roles": 1, "canonical": 1, "layout": 1, "builders": 1,
    "fastrows": 1,
    "codec": 2, "kernels": 2, "reshard": 2,
    # values and contracts every engine floor and the client share
    "tiers.base": 3, "lender.resume": 3, "results": 3, "buffers": 3,
    "tiers": 4,
    "lender": 5,
    "wire": 6,
    "client": 7, "bank": 7,
    "api": 8,
    "service": 9, "procs": 9,
    "integrations": 10, "testing": 10,
    "bench": 11,
    "cli": 12,
}

# Imports allowed up the floors' order (importer, imported module), each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# Parts that must never reach another part, whatever the floors say.
NEVER: dict[str, tuple[str, ...]] = {
    "client": ("bank", "tiers.store", "tiers.disk", "tiers.remote", "service", "lender.lender"),
    "wire": ("bank", "tiers.store", "tiers.disk", "tiers.remote", "service", "client"),
    "results": ("bank", "tiers.store", "tiers.disk", "service", "client", "wire"),
    "bench": ("testing",),
    "tiers": ("bank", "lender.lender", "service", "client"),
    "lender": ("bank", "service", "client"),
}

# Third-party modules only some parts may import.
ONLY: dict[str, tuple[str, ...]] = {
    "lmdb": ("tiers", "bench"),
    "redis": ("tiers", "bench"),
    "fastapi": ("service",),
    "starlette": ("service",),
    "uvicorn": ("service",),
    "prometheus_client": ("service",),
    "httpx": ("service", "cli", "bench"),
    "transformers": ("integrations", "bench", "cli"),
    "vllm": ("integrations", "bench"),
    "sglang": ("integrations",),
    "lmcache": ("integrations", "bench"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import that can run, lazy ones included."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            yield from ((node.lineno, s) for s in subs)  # `from kvbank.tiers import disk`
            if len(subs) < len(node.names):  # and names from the module itself
                yield node.lineno, base


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def part_of(name: str) -> str:
    """``kvbank.tiers.store.writes`` → ``tiers``; the package face → ``""``."""
    parts = name.split(".")[1:]
    return parts[0] if parts else ""


def floor_of(name: str) -> int:
    """The floor of the longest listed prefix of ``name`` below ``kvbank``."""
    parts = name.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    raise KeyError(name)


def edges() -> list[tuple[str, int, str]]:
    """(importer, line, imported kvbank module) for every kvbank → kvbank import."""
    out = []
    known = modules()
    for name, path in known.items():
        for line, target in imports_of(path):
            if target == "kvbank" or not target.startswith("kvbank."):
                continue
            while target not in known and "." in target:  # `from kvbank.x import Name`
                target = target.rpartition(".")[0]
            out.append((name, line, target))
    return out


def test_layers_every_part_has_a_floor() -> None:
    missing = sorted({part_of(m) for m in modules()} - set(FLOORS) - {""})
    assert not missing, f"parts of kvbank with no floor in tests/test_layers.py: {missing}"


def test_layers_no_import_up_a_floor() -> None:
    bad = []
    for src, line, dst in edges():
        if part_of(src) in ("", ) or part_of(dst) == "":
            continue  # the package face is lazy: it names every public class
        if floor_of(dst) > floor_of(src) and (src, dst) not in EXCEPTIONS:
            bad.append(f"{src}:{line} imports {dst} (floor {floor_of(src)} → {floor_of(dst)})")
    assert not bad, "imports up a floor:\n" + "\n".join(bad)


def test_layers_forbidden_reaches() -> None:
    bad = []
    for src, line, dst in edges():
        for part, never in NEVER.items():
            if src == f"kvbank.{part}" or src.startswith(f"kvbank.{part}."):
                bad += [f"{src}:{line} imports {dst}" for n in never
                        if dst == f"kvbank.{n}" or dst.startswith(f"kvbank.{n}.")]
    assert not bad, "\n".join(bad)


def test_layers_third_party_stays_in_its_part() -> None:
    bad = []
    for name, path in modules().items():
        for line, target in imports_of(path):
            top = target.split(".")[0]
            if top in ONLY and part_of(name) not in ONLY[top]:
                bad.append(f"{name}:{line} imports {target} (only {', '.join(ONLY[top])} may)")
    assert not bad, "\n".join(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, _, dst in edges():
        if src != dst and src not in ("kvbank", "kvbank._moved"):
            graph.setdefault(src, set()).add(dst)
    return graph


def test_layers_no_import_circle() -> None:
    found = circles(module_graph())
    assert not found, f"import circles: {found}"


def test_layers_circle_finder_finds_one() -> None:
    """The check above can fail: a planted two-module circle is found."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def _loaded_by(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


HEAVY = ("lmdb", "redis", "fastapi", "uvicorn", "kvbank.bank", "kvbank.tiers.store",
         "kvbank.tiers.disk", "kvbank.service", "kvbank.lender.lender")


@pytest.mark.parametrize("module", ["kvbank.client", "kvbank.wire", "kvbank.results",
                                    "kvbank.api", "kvbank.tiers.base", "kvbank.lender.base"])
def test_layers_light_imports_load_no_engine(module: str) -> None:
    loaded = _loaded_by(f"import {module}")
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert not heavy, f"import {module} loaded {heavy}"


# A process where the serve and fleet extras are not installed: their modules refuse to
# import, as a plain `pip install kvbank` leaves them.
_NO_EXTRAS = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # import and find_spec then answer as for a missing module
"""
_EXTRA_MODULES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client",
                  "httpx", "redis")


def _run_without_extras(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    prog = _NO_EXTRAS.format(blocked=sorted(_EXTRA_MODULES)) + code
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=tmp_path)


def test_layers_plain_install_runs_bank_and_imports_client(tmp_path: Path) -> None:
    res = _run_without_extras(
        "import torch, kvbank\n"
        "from kvbank import Bank, Client, full_attention\n"
        "lay = full_attention('m@1', num_layers=1, num_kv_heads=1, head_dim=16)\n"
        "with Bank.open(host_bytes='8M', data_dir='d') as bank:\n"
        "    lid = bank.register(lay)\n"
        "    pages = torch.zeros((2, lay.group_page_bytes[0]), dtype=torch.uint8)\n"
        "    bank.put(lid, list(range(40)), group=0, pages=pages)\n"
        "    print(bank.match(lid, list(range(40))).resume.tokens)\n", tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "32"


@pytest.mark.parametrize(("module", "extra"), [("kvbank.service.app", "serve"),
                                               ("kvbank.tiers.remote", "fleet")])
def test_layers_missing_extra_is_named(module: str, extra: str, tmp_path: Path) -> None:
    res = _run_without_extras(
        f"from kvbank.extras import MissingExtra\n"
        f"try:\n    import {module}\nexcept MissingExtra as exc:\n    print(exc)\n", tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"pip install 'kvbank[{extra}]'" in res.stdout


def _env_without_redis(tmp_path: Path) -> dict[str, str]:
    """An environment whose processes cannot import ``redis``, as where the fleet extra is
    not installed."""
    import os

    shadow = tmp_path / "no-redis"
    (shadow / "redis").mkdir(parents=True)
    (shadow / "redis" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'redis'\", name='redis')\n")
    root = Path(kvbank.__file__).parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(root)])}


def test_layers_node_serves_without_the_fleet_extra(tmp_path: Path) -> None:
    """Regression: the README's set-up installs the ``serve`` extra only, and ``kvbank
    serve`` then failed at import (``... needs redis: pip install 'kvbank[fleet]'``): the
    node loaded the fleet, and with it Redis, whether or not it was in one. A node started
    where ``redis`` cannot be imported serves; only a node given ``--redis`` needs it."""
    import httpx

    from kvbank.service.launch import NodeProcess

    env = _env_without_redis(tmp_path)
    node = NodeProcess.start(["--data-dir", str(tmp_path / "data"), "--host-bytes", "16M", "--disk-bytes", "64M",
                              "--device-bytes", "0", "--no-reserve-host"], env=env, timeout_s=300)
    try:
        assert httpx.get(node.url + "/live", timeout=60).text.strip() == "alive"
    finally:
        assert node.stop() == 0, "".join(node.lines)[-3000:]
    assert "kvbank[fleet]" not in "".join(node.lines)


def test_layers_a_fleet_without_the_fleet_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    """``kvbank serve --redis URL`` where the fleet extra is missing: the command says what
    to install in one line and exits 2 (it printed a traceback)."""
    res = subprocess.run([sys.executable, "-m", "kvbank.cli", "serve", "--port", "0", "--data-dir", str(tmp_path / "d"),
                          "--device-bytes", "0", "--no-reserve-host", "--redis", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, env=_env_without_redis(tmp_path), timeout=600)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "pip install 'kvbank[fleet]'" in res.stderr, res.stderr
