"""Optional dependencies, grouped as the package's extras, and the one error that says
which to install.

A plain ``pip install kvbank`` is what an embedded worker (``kvbank.Bank``) or a worker
that talks to a node (``kvbank.Client``) needs. The node service brings its HTTP stack
with ``kvbank[serve]``; the Redis remote tier and the fleet bring redis-py with
``kvbank[fleet]``. A module that needs an extra calls :func:`require` before importing
it (or catches the import's ``ModuleNotFoundError`` and raises :func:`missing`), so the
refusal names the extra instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util

EXTRAS = {  # extra -> the importable modules it brings
    "serve": ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"),
    "fleet": ("redis",),
}


class MissingExtra(ImportError):
    """A feature's optional dependencies are not installed; the message names the extra."""


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming ``kvbank[extra]`` when one of its modules is
    missing (``feature`` says what needed it)."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"{feature} needs {', '.join(missing)}: pip install 'kvbank[{extra}]'",
                           name=missing[0])


def missing(extra: str, feature: str, exc: ModuleNotFoundError) -> MissingExtra:
    """The error to raise ``from exc`` when importing one of ``extra``'s modules failed."""
    return MissingExtra(f"{feature} needs {exc.name}: pip install 'kvbank[{extra}]'", name=exc.name)
