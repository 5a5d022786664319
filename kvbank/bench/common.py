"""Shared benchmark machinery: the row shape and robust timing.

A row is ``{"suite", "case", "metric", "value", "baseline", "baseline_value", "ratio"}``
with ``ratio = value / baseline_value``. The machine is shared and noisy, so every figure
is the median of several repetitions, and callers time into preallocated buffers.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class BenchRow:
    suite: str
    case: str
    metric: str  # unit of value and baseline_value, e.g. "GB/s", "pages/s"
    value: float
    baseline: str  # what the baseline is, e.g. "hashlib.sha256 loop"
    baseline_value: float
    ratio: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)


def row(
    suite: str, case: str, metric: str, value: float, baseline: str, baseline_value: float
) -> BenchRow:
    """A row with its ratio computed (0 when the baseline is 0)."""
    ratio = value / baseline_value if baseline_value else 0.0
    return BenchRow(suite, case, metric, round(value, 6), baseline, round(baseline_value, 6),
                    round(ratio, 4))


def median_seconds(fn: Callable[[], object], repeat: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_seconds(
    fn: Callable[[], object],
    baseline_fn: Callable[[], object],
    repeat: int = 7,
    warmup: int = 1,
) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``baseline_fn``, interleaved run by run so that
    noise from the shared machine hits both alike."""
    for _ in range(warmup):
        fn()
        baseline_fn()
    ours: list[float] = []
    base: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        baseline_fn()
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        base.append(t2 - t1)
    return statistics.median(ours), statistics.median(base)


def paired_rates(
    work: float,
    fn: Callable[[], object],
    baseline_fn: Callable[[], object],
    repeat: int = 7,
    warmup: int = 1,
) -> tuple[float, float]:
    """``work / seconds`` for ``fn`` and ``baseline_fn`` (:func:`paired_seconds`)."""
    ours, base = paired_seconds(fn, baseline_fn, repeat, warmup)
    return work / ours, work / base
