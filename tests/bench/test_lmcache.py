"""``kvbank bench lmcache`` is registered, and without LMCache in the venv it says what to
install instead of failing somewhere inside (the suite itself runs in LMCache's venv)."""

from __future__ import annotations

import importlib.util

import pytest

from kvbank.bench import SUITES, lmcache


def test_lmcache_suite_is_registered() -> None:
    assert SUITES["lmcache"] == "kvbank.bench.lmcache"


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="LMCache is installed here")
def test_lmcache_suite_without_lmcache_names_the_install() -> None:
    with pytest.raises(ImportError, match=r"lmcache==0\.5\.6"):
        next(iter(lmcache.run(quick=True)))
