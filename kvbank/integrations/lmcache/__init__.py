"""kvbank as LMCache's L2 tier: an ``L2AdapterInterface`` plugin (LMCache 0.5.6).

Add to ``lmcache server``::

    --l2-adapter '{"type":"plugin","module_path":"kvbank.integrations.lmcache",
                   "class_name":"KvbankL2Adapter","adapter_params":{"url":"http://127.0.0.1:7410"}}'

Modules: :mod:`.adapter` (the class LMCache loads, and its ``adapter_params``),
:mod:`.inproc` (the same work as a storage plugin of LMCache's in-process engine),
:mod:`.layout` (which kvbank row an LMCache object is). Importing this package imports
LMCache.
"""

from __future__ import annotations

from kvbank.integrations.lmcache.adapter import KvbankL2Adapter, KvbankL2AdapterConfig

__all__ = ["KvbankL2Adapter", "KvbankL2AdapterConfig"]
