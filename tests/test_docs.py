"""The docs point only at what the repository holds, and install what the README installs.

W21 of a new user's sweep: lender.md and tiers.md referred to a DESIGN.md the repository
does not have. W23: integrations.md installed kvbank from the package registry, where the
README installs the checkout."""

from __future__ import annotations

import argparse
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


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def test_every_kvbank_option_a_doc_names_exists() -> None:
    """An operator copies ``kvbank admin rows --layout-id …`` from integrations.md and gets
    ``unrecognized arguments`` (the option is ``--layout``). Every ``--option`` written after
    ``kvbank COMMAND [SUBCOMMAND]`` in the docs is one that command line takes."""
    from kvbank.cli.main import build_parser

    commands = _subparsers(build_parser())
    wrong: list[str] = []
    for doc in DOCS:
        text = doc.read_text()
        spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
        for span in spans:
            for line in span.splitlines():
                for m in re.finditer(r"\bkvbank (\w+)((?: +[^\s#|;&]+)*)", line.split("#")[0]):
                    cmd = commands.get(m.group(1))
                    if cmd is None:
                        continue
                    subs, sub = _subparsers(cmd), None
                    for w in m.group(2).split():  # "pin NAME… / leases --release ID": the latest one
                        sub = subs.get(w, sub)
                        known = {*cmd._option_string_actions, *(sub._option_string_actions if sub else ())}
                        flag = w.split("=")[0]
                        if flag.startswith("--") and flag.rstrip("…,.:;)") not in known:
                            wrong.append(f"{doc.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not wrong, wrong
