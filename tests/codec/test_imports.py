"""The codec is torch-free: a reader that only needs frames (a client, a remote tier)
must not pay for importing torch, the tiers or the bank."""

from __future__ import annotations

import subprocess
import sys


def test_codec_import_pulls_in_no_torch() -> None:
    code = (
        "import sys, kvbank.codec, kvbank.codec.planes, kvbank.dtypes\n"
        "frame = kvbank.codec.encode(bytes(range(256)) * 8, 'bfloat16')\n"
        "assert kvbank.codec.decode(frame) == bytes(range(256)) * 8\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith(('kvbank.tiers', 'kvbank.bank.bank', 'kvbank.lender')))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import kvbank.codec pulled in: {out.stdout.strip()}"
