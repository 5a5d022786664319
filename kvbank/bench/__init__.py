"""Benchmark suites behind ``kvbank bench SUITE --json``.

Each suite module exposes ``run(quick: bool) -> Iterator[BenchRow]``; every row carries its
baseline measured in the same run (see :mod:`kvbank.bench.common`). Suites are registered
in :data:`SUITES` by module name and imported only when asked for, so a suite's heavy
dependencies never load for another.
"""

from __future__ import annotations

SUITES: dict[str, str] = {
    "admin": "kvbank.bench.admin",
    "codec": "kvbank.bench.codec",
    "e2e": "kvbank.bench.e2e",
    "kernels": "kvbank.bench.kernels",
    "keys": "kvbank.bench.keys",
    "lender": "kvbank.bench.lender",
    "service": "kvbank.bench.service",
    "tiers": "kvbank.bench.tiers",
    "reshard": "kvbank.bench.reshard",
    "bank": "kvbank.bench.bank",
    "fleet": "kvbank.bench.fleet",
    "reliability": "kvbank.bench.reliability",
    "trace": "kvbank.bench.trace",
    "vllm": "kvbank.bench.vllm",
    "sglang": "kvbank.bench.sglang",
    "lmcache": "kvbank.bench.lmcache",
}
