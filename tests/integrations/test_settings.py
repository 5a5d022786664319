"""The keys every engine adapter shares, read by one strict rule (kvbank.integrations.settings)."""

from __future__ import annotations

import logging

import pytest

from kvbank.errors import InvalidInput
from kvbank.integrations.settings import CONNECTION_KEYS, DEFAULT_URL, Reader


def test_defaults_and_the_url_alias() -> None:
    assert Reader(None, "cfg").url() == DEFAULT_URL
    assert Reader({"kvbank_url": "http://h:1"}, "cfg").url() == "http://h:1"
    assert Reader({"url": "http://h:1", "kvbank_url": "http://h:1"}, "cfg").url() == "http://h:1"
    with pytest.raises(InvalidInput, match=r"cfg\.url: .* disagree"):
        Reader({"url": "http://a:1", "kvbank_url": "http://b:1"}, "cfg").url()


@pytest.mark.parametrize(("key", "value"), [
    ("url", 7410), ("kvbank_url", None), ("tenant", 3), ("timeout_s", True), ("timeout_s", "5"),
    ("retry_s", -1), ("breaker_s", float("nan")),
])
def test_a_wrong_type_names_the_key(key: str, value: object) -> None:
    r = Reader({key: value}, "cfg")
    with pytest.raises(InvalidInput, match=rf"cfg\.{key}: "):
        if key in ("url", "kvbank_url"):
            r.url()
        elif key == "tenant":
            r.text("tenant", "")
        else:
            r.seconds(key, 1.0)


def test_numbers_flags_counts_and_fractions() -> None:
    r = Reader({"t": 0, "n": 3, "f": False, "a": 0.25}, "cfg")
    assert r.seconds("t", 5.0) == 0.0
    with pytest.raises(InvalidInput, match=r"cfg\.t: a finite number > 0"):
        r.seconds("t", 5.0, positive=True)
    assert r.count("n", 1) == 3 and r.flag("f", True) is False and r.fraction("a", 0.0) == 0.25
    for bad in ({"n": 0}, {"n": True}, {"n": 1.5}):
        with pytest.raises(InvalidInput, match=r"cfg\.n: an integer >= 1"):
            Reader(bad, "cfg").count("n", 1)
    with pytest.raises(InvalidInput, match=r"cfg\.f: true or false"):
        Reader({"f": 1}, "cfg").flag("f", True)
    with pytest.raises(InvalidInput, match=r"cfg\.a: a number in \[0, 1\]"):
        Reader({"a": 1.5}, "cfg").fraction("a", 0.0)


def test_a_token_of_the_wrong_type_is_refused_without_echoing_it() -> None:
    with pytest.raises(InvalidInput) as err:
        Reader({"token": 123456789}, "cfg").token()
    assert "123456789" not in str(err.value)
    assert Reader({}, "cfg").token() is None


def test_unknown_keys_are_refused_or_logged(caplog: pytest.LogCaptureFixture) -> None:
    doc = {"url": DEFAULT_URL, "timout_s": 5, "backend_name": "kvbank"}
    with pytest.raises(InvalidInput, match=r"cfg: unknown keys \['backend_name', 'timout_s'\]"):
        Reader(doc, "cfg").refuse_unknown(CONNECTION_KEYS)
    with caplog.at_level(logging.WARNING, logger="kvbank.integrations.settings"):
        Reader(doc, "cfg").refuse_unknown(CONNECTION_KEYS, foreign={"backend_name"}, warn_only=True)
    assert "['timout_s']" in caplog.text and "backend_name" not in caplog.text.split("known")[0]
