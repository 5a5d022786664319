"""``kvbank bench sglang`` is registered, and without SGLang in the venv it says where to get
it instead of failing somewhere inside (the suite itself runs in SGLang's venv)."""

from __future__ import annotations

import importlib.util

import pytest

from kvbank.bench import SUITES, sglang


def test_sglang_suite_is_registered() -> None:
    assert SUITES["sglang"] == "kvbank.bench.sglang"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_sglang_suite_without_sglang_names_the_venv() -> None:
    with pytest.raises(ImportError, match=r"\.ci/sglang"):
        next(iter(sglang.run(quick=True)))
