"""The docs point only at what the repository holds, and install what the README installs.

W21 of a new user's sweep: lender.md and tiers.md referred to a DESIGN.md the repository
does not have. W23: integrations.md installed kvbank from the package registry, where the
README installs the checkout."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_markdown_file_a_doc_names_or_links_exists() -> None:
    missing: list[str] = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for name in set(re.findall(r"(?<![\w/.-])([\w-]+\.md)\b", text)):
            if not any(p.exists() for p in (doc.parent / name, ROOT / name, ROOT / "docs" / name)):
                missing.append(f"{doc.relative_to(ROOT)}: names {name}")
    assert not missing, missing


def test_docs_install_kvbank_from_the_checkout_as_the_readme_does() -> None:
    """A ``pip install 'kvbank[extra]'`` in a set-up step fetches a release from the
    registry, not this checkout; the README's ``pip install -e '.[extra]'`` is the one."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", text, re.S))
    assert "pip install -e '.[transformers]'" in blocks
    assert not re.search(r"pip install[^\n]*'kvbank\[", blocks), blocks
