"""Reusable test machinery: conformance suites, state-machine models, real-server fixtures.

Importable by the project's tests and by anyone who writes a new tier or engine adapter.
"""
