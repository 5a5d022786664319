"""Golden codec frames: one small deterministic input per method and transform.

The inputs are stored with the frames (base64) so the test does not depend on a random
generator's stream. Regenerate only on purpose (a FORMAT_VERSION bump, or a libzstd
release that emits different bytes): ``python -m tests.codec.golden`` writes
tests/data/codec_golden.json.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from kvbank.codec import encode, frame_info

PATH = Path(__file__).parent.parent / "data" / "codec_golden.json"
ITEMS = 1024


def _inputs() -> dict[str, tuple[str, int, bytes]]:
    """name -> (dtype, level, raw bytes)."""
    rng = np.random.default_rng(20240607)
    normal = rng.standard_normal(ITEMS).astype(np.float32)
    bf16 = (normal.view(np.uint32) >> 16).astype("<u2").tobytes()
    text = (b"kvbank cold-page codec golden frame " * 64)[: 2 * ITEMS]
    return {
        "raw-level0-bf16": ("bfloat16", 0, bf16),
        "zstd-uint8-text": ("uint8", 1, text),
        "zstd-odd-length-bf16": ("bfloat16", 1, bf16[:-1]),
        "planes-zstd-int32": ("int32", 1, np.arange(ITEMS // 2, dtype="<i4").tobytes()),
        "planes-bf16": ("bfloat16", 1, bf16),
        "planes-swap-bf16": ("bfloat16", 2, bf16),
        "planes-swap-float32": ("float32", 2, normal.astype("<f4").tobytes()),
        "planes-fp16": ("float16", 1, normal.astype("<f2").tobytes()),
    }


def build() -> list[dict[str, object]]:
    out = []
    for name, (dtype, level, raw) in _inputs().items():
        frame = encode(raw, dtype, level=level)
        out.append(
            {
                "name": name,
                "dtype": dtype,
                "level": level,
                "method": frame_info(frame).method.name,
                "input": base64.b64encode(raw).decode(),
                "frame": base64.b64encode(frame).decode(),
            }
        )
    return out


if __name__ == "__main__":
    PATH.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {PATH}")
