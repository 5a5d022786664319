"""The node service: one ``kvbank serve`` per node owns one :class:`~kvbank.bank.bank.Bank`.

Modules:

- :mod:`kvbank.service.config` — :class:`ServiceConfig` (flags, ``KVBANK_*``, TOML).
- :mod:`kvbank.wire.framing` — the binary put body and fetch stream forms.
- :mod:`kvbank.service.app` — the data API under ``/v1/`` (FastAPI for JSON control
  routes, raw streamed bodies for pages).
- :mod:`kvbank.service.dataplane` — the data port: remote page bodies over a plain
  socket, each transfer allowed by a single-use ticket from an HTTP control call.
- :mod:`kvbank.service.server` — the uvicorn lifecycle: ready line, graceful shutdown,
  the bounded thread pool blocking bank calls run on.
- :mod:`kvbank.service.sockets` — the node's listening sockets (HTTP port, data port),
  bound one way.
- :mod:`kvbank.client.client` — :class:`Client`, the same calls as ``Bank`` over HTTP
  (page bodies over the data port where the node has one) and, on the node's own host,
  through shared memory.

Nothing here is imported by ``import kvbank``: the HTTP stack loads only when asked for.
"""

from kvbank.extras import require

require("serve", "the node service (kvbank serve)")
