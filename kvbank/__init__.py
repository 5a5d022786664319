"""kvbank: storage-tier KV-cache offload and sharing for LLM serving fleets."""

from __future__ import annotations

__version__ = "0.1.0"
