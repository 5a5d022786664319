"""The client's zero-copy page I/O over plain ``http.client`` connections.

- :func:`send_put` — a put body sent from the caller's page buffers (no join, no copy).
- :func:`put_head` — the checked prefix, header and token ids of a put body.
- :func:`fetch_stream` — a fetch stream read with ``readinto`` straight into each
  destination row; the positions of the rows that arrived whole, even when the stream
  broke off (those are what the client acknowledges).
- :func:`prompt_doc` — a prompt as the node's JSON match body (``/v1/match``, a fetch's
  ``prompt``), checked first (:func:`check_prompt`).
- :func:`lease_slots` / :func:`merged_copies` — a same-host lease's slots form as the
  copies to make, rows lying back to back merged into one.
- :func:`deadline_of` — a call's ``timeout=`` as a :class:`Deadline` on this process's
  monotonic clock (the node takes none: the client bounds its own waits).

httpx is not used here: it reads a body in 64 KiB ``bytes`` chunks the caller must copy
again, which measured 0.55–0.78× raw TCP against ``readinto``'s 1.0×.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbank import checks, wire
from kvbank.buffers import OutBuffers
from kvbank.codec.frame import checksum
from kvbank.errors import Busy, InvalidInput, KvbankError, TierUnavailable
from kvbank.keys import Scope, TokenIds, engine_keys, tokens_to_bytes
from kvbank.layout import PageLayout
from kvbank.lender.base import LeaseMode, MemoryKind
from kvbank.wire.framing import (
    FETCH_MAGIC,
    FRAME,
    PREFIX,
    FrameKind,
    PutHeader,
    PutKind,
    StreamRow,
    decode_fetch_header,
    decode_frame,
    decode_prefix,
    encode_put_prefix,
)

_SCRATCH = 1 << 20


@dataclass(frozen=True, slots=True)
class StreamRead:
    """What one fetch stream delivered: the plan positions received whole (even when the
    stream broke off: those are what the client acknowledges), the fetch id and stream id
    (None when the node refused the request), and the error that ended it, if any (the
    node's typed error, or the transport's)."""

    got: list[int]
    fetch_id: str | None
    stream: str | None
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Deadline:
    """A call's ``timeout=`` seconds, ending at ``at`` on ``time.monotonic``."""

    timeout: float
    at: float

    def left(self) -> float:
        """Seconds left (<= 0: passed)."""
        return self.at - time.monotonic()

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def busy(self, what: str) -> Busy:
        """The error of a call that gave up: ``what`` happened, not within the deadline."""
        return Busy(f"timeout: {what} within its {self.timeout} s deadline", field="timeout")


def deadline_of(timeout: float | None) -> Deadline | None:
    """``timeout`` (seconds, or None: no deadline), checked as a Bank checks it."""
    if timeout is None:
        return None
    seconds = checks.seconds(timeout, "timeout")
    return Deadline(seconds, time.monotonic() + seconds)


def send_put(conn: http.client.HTTPConnection, path: str, head: bytes,
             pages: Sequence[memoryview], headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """POST ``head`` then every page; the status and body of the answer."""
    conn.putrequest("POST", path, skip_accept_encoding=True)
    conn.putheader("Content-Type", "application/octet-stream")
    for k, v in (headers or {}).items():  # a tenant token
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(head) + sum(len(p) for p in pages)))
    conn.endheaders(head)
    for p in pages:
        conn.send(p)
    resp = conn.getresponse()
    return resp.status, resp.read()


def _read_exact(resp: http.client.HTTPResponse, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = resp.readinto(view[got:])
        if not k:
            raise http.client.IncompleteRead(bytes(view[:0]), n - got)
        got += k


def fetch_stream(conn: http.client.HTTPConnection, body: bytes, views: Mapping[int, list[memoryview]],
                 headers: Mapping[str, str] | None = None) -> StreamRead:
    """What one fetch stream delivered (see :class:`StreamRead`); ``headers``: a tenant token."""
    try:
        conn.request("POST", "/v1/fetch", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        return StreamRead([], None, None, exc)
    if resp.status != 200:
        try:
            return StreamRead([], None, None, wire.error_from_dict(json.loads(resp.read())))
        except (ValueError, RecursionError, KvbankError, OSError, http.client.HTTPException) as exc:
            resp.close()
            return StreamRead([], None, None, TierUnavailable(f"node: fetch answered {resp.status}: {exc}"))
    got: list[int] = []
    fid: str | None = None
    sid: str | None = None
    try:
        head = bytearray(PREFIX.size)
        _read_exact(resp, memoryview(head))
        header = bytearray(decode_prefix(head, FETCH_MAGIC))
        _read_exact(resp, memoryview(header))
        fid, sid, rows = decode_fetch_header(header)
        where = _check_rows(rows, views)
        frame = bytearray(FRAME.size)
        seen: set[int] = set()
        while True:
            _read_exact(resp, memoryview(frame))
            kind, pos, length = decode_frame(frame)
            if kind is FrameKind.END:
                scratch = memoryview(bytearray(min(length, _SCRATCH) or 1))
                while length:
                    k = min(length, len(scratch))
                    _read_exact(resp, scratch[:k])
                    length -= k
                break
            row = where.get(pos)
            if row is None or (kind is FrameKind.ROW and length != row.size) \
                    or (kind is FrameKind.MISSING and length != 0):
                raise InvalidInput(f"stream.frame: position {pos} / length {length} is not in the plan")
            if pos in seen:
                raise InvalidInput(f"stream.frame: position {pos} framed twice")
            seen.add(pos)
            if kind is FrameKind.ROW:
                _read_exact(resp, views[row.group][row.slot][: row.size])
                got.append(pos)
        if resp.read(1):
            raise InvalidInput("stream: bytes after the END frame")
    except (OSError, http.client.HTTPException, InvalidInput) as exc:
        resp.close()  # a broken stream: let its socket go now, not when it is collected
        return StreamRead(got, fid, sid, exc)
    return StreamRead(got, fid, sid, None)


def _check_rows(rows: list[StreamRow], views: Mapping[int, list[memoryview]]) -> dict[int, StreamRow]:
    """The stream's planned rows by position, each checked against the caller's buffers:
    a group or slot the caller has no buffer for, or a row larger than its buffer, is
    refused before a byte lands (a row read short would misalign every frame after it)."""
    where: dict[int, StreamRow] = {}
    for i, r in enumerate(rows):
        slots = views.get(r.group)
        if slots is None or r.slot >= len(slots) or r.size > len(slots[r.slot]):
            raise InvalidInput(f"stream.rows[{i}]: group {r.group} slot {r.slot} size {r.size} "
                               "does not fit the fetch's output buffers")
        if r.position in where:
            raise InvalidInput(f"stream.rows[{i}]: position {r.position} planned twice")
        where[r.position] = r
    return where


def put_head(kind: PutKind, layout_id: bytes, tokens: TokenIds | None,
              keys: Sequence[bytes] | None, scope: Scope, group: int, first_page: int,
              shard: int | None, at: int | None, views: list[memoryview], size: int,
              tenant_token: bool = False) -> bytes:
    """A put body's prefix, header and token ids (or keys), checked as Bank checks them.
    ``tenant_token``: the client sends a tenant token (the node may fill in the tenant)."""
    if (tokens is None) == (keys is None):
        raise InvalidInput("tokens: give either tokens or keys (a page-key chain), not both or neither")
    if not isinstance(scope, Scope):
        raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
    if keys is not None:
        # The rule match uses (kvbank.keys.engine_keys): an engine's keys of any length
        # become 32-byte page keys here, so the node receives the chain it would match.
        expanded = engine_keys(keys, layout_id, scope)
        if tenant_token and not scope.tenant and expanded != list(keys):
            # the expansion hashes the scope; the node would match under its bound tenant
            raise InvalidInput("scope.tenant: a put by engine keys that are not 32 bytes under a "
                               "tenant token must name the token's tenant in scope")
        keys = expanded
        key_bytes = b"".join(keys)
    else:
        key_bytes = tokens_to_bytes(tokens)  # type: ignore[arg-type]  # None excluded above
    for name, v in (("group", group), ("first_page", first_page)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidInput(f"{name}: must be a non-negative integer, got {v!r}")
    header = PutHeader(kind, layout_id, scope.tenant, scope.cache_salt, scope.lora, group,
                       first_page, shard, at, None if keys is not None else len(key_bytes) // 4,
                       None if keys is None else len(keys), len(views), size)
    return encode_put_prefix(header) + key_bytes


def page_size(layout: PageLayout, group: int) -> int:
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(layout.groups):
        raise InvalidInput(f"group: expected a group index in [0, {len(layout.groups)}), got {group!r}")
    return layout.group_page_bytes[group]


def enum_name(value: object, cls: type[LeaseMode] | type[MemoryKind], what: str) -> str:
    if not isinstance(value, cls):
        raise InvalidInput(f"{what}: expected a {cls.__name__}, got {value!r}")
    return value.name


def name_hex(name: object, i: int) -> str:
    if type(name) is not bytes:
        raise InvalidInput(f"names[{i}]: expected a row name (bytes), got {type(name).__name__}")
    return name.hex()


def lease_path_id(lease_id: object) -> str:
    if not isinstance(lease_id, str) or not lease_id or "/" in lease_id:
        raise InvalidInput(f"lease_id: expected a lease id string, got {lease_id!r}")
    return lease_id


# ---- prompts and same-host copies -------------------------------------------------------


def scope_doc(scope: Scope) -> dict[str, str]:
    """A scope as the node's JSON ``scope`` object."""
    return {"tenant": scope.tenant, "cache_salt": scope.cache_salt, "lora": scope.lora}


def check_prompt(layout_id: object, scope: object, tokens: object, keys: object) -> None:
    """The checks every prompt a client sends passes first (``InvalidInput`` names the argument)."""
    if not isinstance(layout_id, bytes):
        raise InvalidInput(f"layout_id: expected bytes, got {type(layout_id).__name__}")
    if not isinstance(scope, Scope):
        raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
    if (tokens is None) == (keys is None):
        raise InvalidInput("tokens: give either tokens or keys (a page-key chain), not both or neither")


def prompt_doc(layout_id: bytes, tokens: TokenIds | None, scope: Scope, shard: int | None,
                keys: Sequence[bytes] | None, prompt_tokens: int | None) -> dict[str, Any]:
    """A prompt as the node's JSON match body (``/v1/match``, and a fetch's ``prompt``)."""
    check_prompt(layout_id, scope, tokens, keys)
    body: dict[str, Any] = {
        "layout_id": layout_id.hex(), "shard": shard, "prompt_tokens": prompt_tokens, "scope": scope_doc(scope)}
    if keys is not None:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise InvalidInput(f"keys: expected a sequence of page keys, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if type(k) is not bytes:
                raise InvalidInput(f"keys[{i}]: expected a page key (bytes), got {type(k).__name__}")
        body["keys"] = [k.hex() for k in keys]
    elif tokens is not None:
        body["tokens_b64"] = base64.b64encode(tokens_to_bytes(tokens)).decode()
    return body


Slot = tuple[str, int, int, memoryview]  # (segment, offset, size, buffer): one copy of a leased row


def lease_slots(doc: dict[str, Any], bufs: Sequence[memoryview]) -> list[tuple[int, Slot]]:
    """A lease's slots form (``kvbank.service.node.slots_doc``) → ``(i, (segment, offset,
    size, bufs[i]))`` for each slot; an answer of another shape is the node's fault."""
    try:
        segments = doc["segments"]
        out = []
        for i, seg, offset, size in doc["slots"]:
            out.append((i, (str(segments[seg]), int(offset), int(size), bufs[i])))
        return out
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TierUnavailable(f"node: a lease answer of an unexpected shape: {exc!r}") from exc


def changed_copies(doc: dict[str, Any], bufs: Sequence[memoryview],
                   only: Container[int] | None = None,
                   digests: Mapping[int, int] | None = None) -> set[int]:
    """The entries ``i`` (of ``only``, default all) of a READ lease's slots form whose copy
    in ``bufs[i]`` does not match the checksum the node sent for it (``sums``, 16 hex
    digits of the xxh3-64 the row was committed with): bytes changed in the node's host
    memory since commit. A form without ``sums`` (an older node) checks nothing.
    ``digests``: entry ``i``'s checksum taken as its copy landed (default: each buffer
    hashed now)."""
    only = range(len(bufs)) if only is None else only
    sums = doc.get("sums")
    if sums is None:
        return set()
    try:
        todo = [(int(i), int(size), want) for (i, _, _, size), want
                in zip(doc["slots"], sums, strict=True) if want is not None and i in only]
        got = ([digests[i] for i, _, _ in todo] if digests is not None
               else [checksum(bufs[i][:size]) for i, size, _ in todo])
        return {i for (i, _, want), h in zip(todo, got, strict=True) if f"{h:016x}" != want}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TierUnavailable(f"node: a lease answer of an unexpected shape: {exc!r}") from exc


def merged_copies(slots: list[tuple[int, Slot]], rows: Sequence[Sequence[int]], out: OutBuffers,
                  sizes: list[int] | None = None) -> list[Slot]:
    """The copies of a same-host fetch, rows merged into one copy where they lie back to
    back both in the node's segment and in one destination tensor (rows ``k, k+1, ...``
    of ``out[g]``): a lease's slots are usually handed out in order, and a copy per 32 KiB
    row costs more in per-row work than in bytes. ``sizes`` gets each copy's row size
    (a checked read hashes each row of a merged copy on its own)."""
    jobs: list[Slot] = []
    # the open run: its group, destination rows, first row, segment, offset, row size, rows
    run: tuple[int, np.ndarray, int, str, int, int] | None = None
    count = 0

    def close() -> None:
        if run is not None:
            _, arr, first, seg, off, size = run
            jobs.append((seg, off, count * size, arr[first : first + count].data.cast("B")))
            if sizes is not None:
                sizes.append(size)

    for i, job in slots:
        seg, off, size, _ = job
        _, g, slot, _ = rows[i]
        dst = out.get(g)
        whole = isinstance(dst, torch.Tensor) and size == dst.shape[1]
        if run is not None and whole and run[0] == g and seg == run[3] and slot == run[2] + count \
                and off == run[4] + count * size:
            count += 1
            continue
        close()
        run, count = None, 0
        if isinstance(dst, torch.Tensor) and whole:
            run, count = (g, dst.numpy(), slot, seg, off, size), 1
        else:
            jobs.append(job)
            if sizes is not None:
                sizes.append(size)
    close()
    return jobs
