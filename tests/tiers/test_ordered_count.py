"""OrderedNames.count: rows under a name prefix from two bisects, equal to a count of the
names themselves (what the status page's usage table reads, per namespace)."""

from __future__ import annotations

import random

from kvbank.tiers.index import OrderedNames


def test_count_by_prefix_equals_counting_the_names() -> None:
    rng = random.Random(7)
    heads = [b"\x00", b"\x12\x34", b"\x12\xff", b"\xff", b"\xff\xff", b"\x7f"]
    names = {rng.choice(heads) + rng.randbytes(rng.randint(0, 4)) for _ in range(5000)}
    ordered = OrderedNames()
    for n in names:
        ordered.add(n)
    for n in list(names)[:1500]:  # removals split and empty sublists too
        ordered.discard(n)
        names.discard(n)
    ordered.check()
    for prefix in [b"", *heads, b"\x12", b"\x13", b"\xff\xff\xff", b"\x00\x00", b"\x80"]:
        assert ordered.count(prefix) == sum(n.startswith(prefix) for n in names), prefix
    assert OrderedNames().count(b"\x12") == 0
