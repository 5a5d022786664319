"""``kvbank bench keys``: key chaining against bare SHA-256 over the same bytes.

Case ``chain-128k``: key a 131,072-token prompt with 16-token pages (8,192 pages) from an
int32 array (how a tensor of token ids reaches kvbank), validation included. Case
``chain-128k-list``: the same from a Python list, whose conversion to bytes alone
(``array.array``, the fastest here) costs about 0.7 of the baseline's whole time.
Baseline: bare ``hashlib.sha256`` over each page's bytes in one loop, the bytes already
prepared — the floor for any SHA-256 chain in Python.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvbank.bench.common import BenchRow, paired_rates, row
from kvbank.keys import DEFAULT_SCOPE, page_keys, tokens_to_bytes

SUITE = "keys"


def run(quick: bool = False) -> Iterator[BenchRow]:
    tokens_per_page = 16
    n_tokens = 131_072
    rng = random.Random(0)
    tokens = [rng.randrange(0, 152_064) for _ in range(n_tokens)]
    data = tokens_to_bytes(tokens)
    step = 4 * tokens_per_page
    n_pages = n_tokens // tokens_per_page
    chunks = [memoryview(data)[i : i + step] for i in range(0, len(data), step)]

    def bare() -> None:
        sha = hashlib.sha256
        for c in chunks:
            sha(c).digest()

    repeat = 3 if quick else 9
    cases: list[tuple[str, Sequence[int] | npt.NDArray[np.int32]]] = [
        ("chain-128k", np.asarray(tokens, dtype=np.int32)),
        ("chain-128k-list", tokens),
    ]
    for case, source in cases:

        def ours(source: Sequence[int] | npt.NDArray[np.int32] = source) -> None:
            page_keys(source, tokens_per_page, DEFAULT_SCOPE)

        value, base = paired_rates(n_pages, ours, bare, repeat=repeat)
        yield row(SUITE, case, "pages/s", value, "hashlib.sha256 loop", base)
