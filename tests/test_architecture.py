"""docs/architecture.md is the map of the package: every module under ``kvbank/`` is
named on it (by its path below ``kvbank/``, a package by its folder), and the README's
Concepts list opens with it."""

from __future__ import annotations

import re
from pathlib import Path

import kvbank

PACKAGE = Path(kvbank.__file__).parent
ROOT = PACKAGE.parent
PAGE = ROOT / "docs" / "architecture.md"


def named_on_page() -> set[str]:
    return set(re.findall(r"`([\w/.]+)`", PAGE.read_text()))


def module_names() -> list[str]:
    """Each module as the page names it: ``tiers/store/writes.py``, a package
    ``tiers/store/``; ``__main__`` and the package face itself are left out."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ("__init__.py", "cli/__main__.py"):
            continue
        out.append(rel.removesuffix("__init__.py") if rel.endswith("__init__.py") else rel)
    return out


def test_architecture_names_every_module() -> None:
    named = named_on_page()
    missing = [m for m in module_names() if m not in named]
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_architecture_names_no_module_that_is_gone() -> None:
    gone = sorted(n for n in named_on_page()
                  if re.fullmatch(r"[a-z_]+(/[a-z_]+)+\.py|[a-z_]+(/[a-z_]+)*/", n) and not (PACKAGE / n).exists()
                  and not (ROOT / n).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


def test_readme_concepts_open_with_the_architecture_page() -> None:
    readme = (ROOT / "README.md").read_text()
    concepts = readme.split("## Concepts", 1)[1]
    first = re.search(r"\]\((docs/[\w-]+\.md)", concepts)
    assert first is not None and first.group(1) == "docs/architecture.md"
