"""Where a node listens unless told otherwise: what ``kvbank serve`` binds and what a
``Client`` built without a URL dials."""

from __future__ import annotations

DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 7410
