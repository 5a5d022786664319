"""Bit rot under a closed disk tier, for tests.

- :func:`flip_frame_byte` — damage one byte of one row's frame where it lies
  (:func:`kvbank.tiers.diskfile.frame_spans`: its segment file, or ``data.mdb`` for a row
  of the older layout) with plain file writes: neither LMDB nor the tier sees the change,
  exactly like rot under a closed data dir. The tier must then detect it (checksums) and
  serve a miss.
"""

from __future__ import annotations

from pathlib import Path

from kvbank.tiers.diskfile import frame_spans


def flip_frame_byte(data_dir: Path, name: bytes, at: int, xor: int = 0x5A) -> None:
    """XOR byte ``at`` of the row's frame (negative: from its end) with ``xor``."""
    span = frame_spans(data_dir)[name]
    pos = span.offset + (at if at >= 0 else span.length + at)
    with open(span.path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ xor]))
