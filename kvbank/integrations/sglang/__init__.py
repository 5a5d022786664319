"""kvbank as SGLang's HiCache storage backend (SGLang 0.5.23): :class:`KvbankHiCacheStorage`.

Modules: :mod:`.storage` (the backend SGLang loads), :mod:`.pools` (SGLang's host pools as
kvbank layouts and views), :mod:`.harness` (SGLang's cache controller on a CPU host, for
the tests and ``kvbank bench sglang``). Importing this package imports SGLang.
"""

from __future__ import annotations

from kvbank.integrations.sglang.storage import KvbankHiCacheStorage

__all__ = ["KvbankHiCacheStorage"]
