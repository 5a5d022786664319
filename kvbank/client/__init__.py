"""``kvbank.Client``: a worker's side of a node — the bank's calls over HTTP, the page
bytes through shared memory on the node's host or over the data port from elsewhere.

- :mod:`.client` — :class:`Client`, the calls.
- :mod:`.http` — the pool of keep-alive connections and the control calls on them.
- :mod:`.paths` — the three page paths (shared memory, data port, HTTP stream) behind one protocol.
- :mod:`.io` — request bodies and page I/O (put heads, fetch streams, copy planning).
- :mod:`.shm` — :class:`Borrower`: map a HOST lease's slots and copy through them.
- :mod:`.dataport` — :class:`DataLink`: page bodies over the node's data port.

Nothing here imports the bank, the tiered store or LMDB: a worker that only talks to a
node stays light (``tests/test_layers.py``).
"""

from __future__ import annotations

from kvbank.client.client import Client

__all__ = ["Client"]
