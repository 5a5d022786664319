"""The node's listening sockets: the HTTP port and the data port, bound the same way.

:func:`listen` binds ``bind:port`` (``port`` 0: a free one; an address with ``:`` is
IPv6) with ``SO_REUSEADDR`` and listens; a port that cannot be bound is a
:class:`~kvbank.errors.ConfigError` naming the setting, before anything else of the node
starts.
"""

from __future__ import annotations

import socket

from kvbank.errors import ConfigError


def listen(bind: str, port: int, *, field: str, backlog: int) -> socket.socket:
    """A listening TCP socket on ``bind:port``; ``field`` names the setting in the error."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{field}: cannot bind {bind}:{port}: {exc}", field=field) from exc
    sock.listen(backlog)
    return sock


__all__ = ["listen"]
