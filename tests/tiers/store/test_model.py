"""The tiered store against a dict model (see kvbank.testing.store_model)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from kvbank.testing.store_model import DeviceMachine, StoreMachine, WriteThroughMachine

_SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])

TestStoreWriteBack = StoreMachine.TestCase
TestStoreWriteBack.settings = _SETTINGS
TestStoreWriteThrough = WriteThroughMachine.TestCase
TestStoreWriteThrough.settings = _SETTINGS
TestStoreWithDevice = DeviceMachine.TestCase
TestStoreWithDevice.settings = _SETTINGS


class LruMachine(StoreMachine):
    """The same machine under the LRU rule (the value rule is the default)."""

    config_overrides = {"eviction_policy": "lru"}  # noqa: RUF012 (a ClassVar in the base)


TestStoreLru = LruMachine.TestCase
TestStoreLru.settings = _SETTINGS
