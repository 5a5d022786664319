"""Resharding across tensor-parallel sizes: :mod:`.plan` says which bytes of which source
rows make each page of another shard layout (pure; no torch). The copies run in
:mod:`kvbank.kernels.reshard`; the bank's matches and fetches across TP sizes are
:mod:`kvbank.bank.cross_shard`."""

from __future__ import annotations

from kvbank.reshard.plan import (
    Copy,
    GroupPlan,
    ReshardPlan,
    check_compatible,
    plan_reshard,
    refusal,
    shard_layout,
)

__all__ = [
    "Copy",
    "GroupPlan",
    "ReshardPlan",
    "check_compatible",
    "plan_reshard",
    "refusal",
    "shard_layout",
]
