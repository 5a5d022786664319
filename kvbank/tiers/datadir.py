"""The data dir's files are private, and no file in it follows a symlink.

The data dir holds every tenant's pages (``lmdb/data.mdb``), the admin token and the
catalog; it is readable by the node's uid only, whatever the umask:

- :func:`private_dir` — create a folder (and missing parents) mode 0700;
- :func:`open_private` — ``os.open`` a file mode 0600 with ``O_NOFOLLOW`` (a symlink
  planted at its name is refused, never followed);
- :func:`replace_file` — write a file whole: a fresh temp file beside it, with an
  unpredictable name, created ``O_CREAT | O_EXCL | O_NOFOLLOW`` mode 0600, fsynced, then
  renamed over the target (``rename`` replaces a planted symlink, never writes through
  it), and the folder fsynced;
- :func:`tighten` — files an older version created 0644 are made 0600 at open.

Every function raises ``OSError``; the caller maps it at its boundary.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) 0700; an existing folder keeps its mode."""
    if path.is_dir():
        return
    if not path.parent.exists():
        private_dir(path.parent)
    with contextlib.suppress(FileExistsError):  # created meanwhile by another opener
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask; this does not


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0600)``; a file it creates is
    0600 whatever the umask."""
    fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_file(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Make ``path`` hold exactly ``data``, 0600 (see the module docstring)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself is durable
        finally:
            os.close(dfd)


def tighten(paths: Iterable[Path]) -> None:
    """``chmod 0600`` each regular file of ``paths`` that exists (a symlink is left)."""
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(p, FILE_MODE)
