"""kvbank as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1`` + ``SupportsHMA``).

Start vLLM with::

    --kv-transfer-config '{"kv_connector":"KvbankConnector",
      "kv_connector_module_path":"kvbank.integrations.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"url":"http://127.0.0.1:7410"}}'

Modules: :mod:`.layout` (vLLM's groups as a kvbank layout, the engine fingerprint),
:mod:`.blocks` (paged cache <-> canonical pages), :mod:`.scheduler` and :mod:`.worker`
(the two halves), :mod:`.audit` (the sampled reuse audit), :mod:`.metadata` (what crosses
between them), :mod:`.config` (``kv_connector_extra_config`` and the failure guard),
:mod:`.connector` (the class vLLM loads). Importing this package imports vLLM; :mod:`.layout`'s and :mod:`.blocks`'s
functions import it only where they need it.
"""

from __future__ import annotations

from kvbank.integrations.vllm.connector import KvbankConnector

__all__ = ["KvbankConnector"]
