"""The exception tree: one root, builtins where natural, the docstring drawing all of it."""

from __future__ import annotations

import inspect

from kvbank import errors


def _classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def test_errors_every_class_descends_from_kvbank_error() -> None:
    for cls in _classes():
        assert issubclass(cls, errors.KvbankError), cls


def test_errors_docstring_draws_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in _classes():
        assert cls.__name__ in doc, f"{cls.__name__} missing from the tree in errors.py"


def test_errors_lookup_misses_are_key_errors_with_readable_messages() -> None:
    for cls in (errors.UnknownLayout, errors.LeaseNotFound, errors.FetchNotFound):
        exc = cls("no such thing: abc")
        assert isinstance(exc, KeyError)
        assert str(exc) == "no such thing: abc"  # not KeyError's quoted repr


def test_errors_bad_input_is_a_value_error() -> None:
    for cls in (errors.LayoutError, errors.InvalidTokens, errors.PageSizeMismatch,
                errors.InvalidRowName, errors.ConfigError):
        assert issubclass(cls, ValueError)
