"""``kvbank bench vllm`` is registered, and without vLLM in the venv it says what to install
instead of failing somewhere inside (the suite itself runs in vLLM's venv)."""

from __future__ import annotations

import importlib.util

import pytest

from kvbank.bench import SUITES, vllm


def test_vllm_suite_is_registered() -> None:
    assert SUITES["vllm"] == "kvbank.bench.vllm"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_suite_without_vllm_names_the_install() -> None:
    with pytest.raises(ImportError, match=r"kvbank\[vllm\]"):
        next(iter(vllm.run(quick=True)))
