"""Adapters between kvbank and real inference engines.

Each adapter is its own module and imports its engine; the core never imports one.

- :mod:`kvbank.integrations.transformers` — Hugging Face transformers (``DynamicCache``):
  install with ``pip install 'kvbank[transformers]'``.
"""

from __future__ import annotations
