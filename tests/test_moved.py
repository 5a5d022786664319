"""The import paths that moved in 0.2 keep working for one release: the old path is the
same module as the new one, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvbank
from kvbank._moved import MOVED

PACKAGE = Path(kvbank.__file__).parent


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_moved_path_is_the_new_module_with_a_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        was = importlib.import_module(old)
    assert was is importlib.import_module(new)


def test_moved_paths_have_no_file_left_to_shadow_them() -> None:
    left = [old for old in MOVED if (PACKAGE.parent / old.replace(".", "/")).with_suffix(".py").exists()]
    assert not left


def test_moved_client_keeps_its_classes_identical() -> None:
    """A caller that still writes ``from kvbank.service.client import Client`` gets the
    class ``kvbank.Client`` is, so isinstance checks and type identity hold."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from kvbank.service.client import Client as Old\n"
            "import kvbank; print(Old is kvbank.Client)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
