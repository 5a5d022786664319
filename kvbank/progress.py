"""Progress of long work, on a terminal only: a tqdm bar on stderr, or nothing.

Primitives:

- :func:`enable` — the kvbank command line turns bars on (``kvbank serve``, ``kvbank
  bench`` without ``--json``); a program that embeds a bank never sees one unless it asks.
- :func:`bar` — a bar for ``total`` units (``None``: unknown yet; set ``.total`` later),
  drawn on stderr after ``delay_s`` (:data:`DELAY_S`) when bars are on, stderr is a terminal,
  ``KVBANK_PROGRESS`` is not ``0`` and tqdm is installed (the ``serve`` extra brings it);
  otherwise :class:`Quiet`, which has the same methods and draws nothing.
- :func:`echo` — print a line to stdout without tearing a bar that is being drawn.

Long work that reports through it: a disk tier's salvage (rows read), the write-back of
memory rows at close (rows written), the host reservation (``kvbank serve``), the bench
suites (cases run).
"""

from __future__ import annotations

import os
import sys
from typing import Any

_on = False
DELAY_S = 1.0  # a bar appears only once its work has lasted this long
REDRAW_S = 0.1  # and is redrawn at most this often


def enable(on: bool = True) -> None:
    """Draw bars in this process (when stderr is a terminal)."""
    global _on
    _on = on


def _wanted() -> bool:
    if not _on or os.environ.get("KVBANK_PROGRESS", "") in ("0", "false", "off", "no"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Quiet:
    """A bar that draws nothing."""

    def __init__(self, total: float | None = None) -> None:
        self.total = total
        self.n = 0.0

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total: float | None, desc: str, *, unit: str = "it", unit_scale: bool = False,
        delay_s: float | None = None) -> Any:
    """A tqdm bar on stderr, or :class:`Quiet` (see the module docstring)."""
    if not _wanted():
        return Quiet(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return Quiet(total)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                delay=DELAY_S if delay_s is None else delay_s, mininterval=REDRAW_S,
                file=sys.stderr, leave=False)


def echo(line: str) -> None:
    """``print(line)`` to stdout, around any bar being drawn."""
    if _wanted():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
            return
    print(line, flush=True)
