"""The lender against its reference model (kvbank.testing.lender_model)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from kvbank.testing.lender_model import LenderMachine

LenderMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLenderMachine = LenderMachine.TestCase
