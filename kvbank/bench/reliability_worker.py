"""Client processes for the process-fault cases of ``kvbank bench reliability``.

Run ``python -m kvbank.bench.reliability_worker MODE ...``; every event is one flushed line
on stdout, so the parent can kill a node (or this process) at a known point.

- ``putter CLIENT SAME_HOST`` — prints ``ready``, then reads one JSON command per line on
  stdin: ``{"url", "round", "n", "pace_s"}`` puts pages ``0..n-1`` of the chain
  :func:`chain_tokens` ``(CLIENT, round)``, one page a call, each only after the one
  before was answered; prints ``ok ROUND I T`` once page ``I`` is acknowledged (``T`` the
  ``time.monotonic()`` of the answer), ``down ROUND ERROR`` at the first failure (the node
  was killed) and ``done ROUND`` after the last page. ``{"op": "exit"}`` ends it.
  ``SAME_HOST`` 1 puts through a WRITE lease in shared memory, 0 streams over TCP.
- ``holder URL TTL SEED`` — puts :data:`HOLD_PAGES` pages, takes a HOST READ lease on them
  for ``TTL`` seconds, copies every row out of shared memory, prints ``held LEASE_ID
  EXPIRES_AT ROWS`` (``EXPIRES_AT`` on the node's monotonic clock, which is the host's
  ``CLOCK_MONOTONIC``) and sleeps until it is killed.

Page bytes are :func:`page_bytes` of ``(client, round, page)``: random, so that a codec
frame is stored raw and a byte flipped anywhere in it is a byte of the page.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvbank.builders import full_attention

LAYOUT = full_attention("reliability@1", 1, 1, 64, tokens_per_page=16)  # 4 KiB pages
PAGE = LAYOUT.group_page_bytes[0]
TOKENS_PER_PAGE = LAYOUT.tokens_per_page
HOLD_PAGES = 8


def chain_tokens(client: int, round_: int, n_pages: int) -> list[int]:
    """The token ids of ``n_pages`` pages of one client's prompt in one round: random
    int32 ids from a seed of its own, so a longer chain extends a shorter one."""
    rng = random.Random(f"tokens/{client}/{round_}")
    return [rng.getrandbits(31) for _ in range(n_pages * TOKENS_PER_PAGE)]


def page_bytes(client: int, round_: int, page: int) -> bytes:
    return random.Random(f"{client}/{round_}/{page}").randbytes(PAGE)


def _say(text: str) -> None:
    print(text, flush=True)


def putter(client_id: int, same_host: bool) -> None:
    from kvbank.client.client import Client

    _say("ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            return
        r, n, pace = int(cmd["round"]), int(cmd["n"]), float(cmd.get("pace_s", 0))
        try:
            # retry_s=0: a refused connection is the killed node, not a hiccup to wait out
            with Client(cmd["url"], same_host=same_host, retry_s=0, timeout_s=60) as c:
                lid = c.register(LAYOUT)
                toks = chain_tokens(client_id, r, n)
                for i in range(n):
                    c.put(lid, toks[: (i + 1) * TOKENS_PER_PAGE], group=0,
                          pages=[page_bytes(client_id, r, i)], first_page=i)
                    _say(f"ok {r} {i} {time.monotonic():.6f}")
                    if pace:
                        time.sleep(pace)
        except Exception as exc:  # the node is killed mid-round: say so, wait for the next
            _say(f"down {r} {type(exc).__name__}")
            continue
        _say(f"done {r}")


def holder(url: str, ttl_s: float, seed: int) -> None:
    from kvbank.client.client import Client
    from kvbank.client.shm import Borrower
    from kvbank.lender.base import HostLocation

    c = Client(url, same_host=True)
    lid = c.register(LAYOUT)
    toks = chain_tokens(seed, 0, HOLD_PAGES)
    names = c.put(lid, toks, group=0, pages=[page_bytes(seed, 0, i) for i in range(HOLD_PAGES)])
    lease = c.lend(names, ttl_s=ttl_s)
    borrower = Borrower()
    buf = bytearray(PAGE)
    rows = 0
    for row in lease.rows:
        if isinstance(row.location, HostLocation):
            borrower.read_into(lease, row.name, buf)
            rows += 1
    _say(f"held {lease.id} {lease.expires_at:.6f} {rows}")
    time.sleep(3600)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "putter":
        putter(int(sys.argv[2]), sys.argv[3] == "1")
    elif mode == "holder":
        holder(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
