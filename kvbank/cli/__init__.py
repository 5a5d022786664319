"""``kvbank serve | admin | bench | demo``: :mod:`.main` parses and dispatches,
:mod:`.admin` is ``kvbank admin``, :mod:`.demo` the guided tour."""

from __future__ import annotations

from kvbank.cli.main import main

__all__ = ["main"]
