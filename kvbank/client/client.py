"""``kvbank.Client(url)``: the calls of :class:`~kvbank.bank.bank.Bank`, made on a served node.

Same names, same arguments, same result types, same exceptions: the server answers a
typed error as ``{type, field, message}`` and the client raises that
:class:`~kvbank.errors.KvbankError` class (:func:`kvbank.wire.forms.error_from_dict`); a
transport failure is :class:`~kvbank.errors.TierUnavailable`. Switching a worker from
``Bank.open(...)`` to ``Client(url)`` is a one-line change: both hold
:class:`kvbank.api.WorkerAPI`, whose docstring names where they differ (``timeout=`` is
bounded on this side; ``row_names`` and ``resume_at`` are computed here, from the layout;
``put_states`` is one ``put_state`` call a snapshot).

Paths, chosen per client (``same_host=None``: automatically), each a handler in
:mod:`kvbank.client.paths` behind one protocol; a call picks one (``_path``) and falls back
to the HTTP stream where it answers None:

- **shared memory** — the node runs on this host (same boot id and uid, and its host
  segment maps here): ``fetch`` takes a READ HOST lease on the rows, copies them from the
  node's segment straight into ``out``, and acknowledges them with the lease, which the
  node checks is still live (bytes read after expiry are refused). ``put`` takes a WRITE
  HOST lease, fills the reserved slots in place and commits what arrived whole.
- **data plane** — another host, and the node advertises a data port
  (:mod:`kvbank.service.dataplane`): the same control calls as on the shared-memory
  path, with ``via=data``, answer a ticket; the page bodies go over the data port
  (``recv_into`` each destination row, ``sendall`` each page buffer), and the client
  commits or acknowledges with the lease exactly as above. ``data_plane=False`` turns it
  off, ``True`` requires it; rows the node cannot lend at once stream over HTTP.
- **TCP** — page bodies go over a plain ``http.client`` connection: a fetch stream is
  read with ``readinto`` straight into each destination row, a put body is sent from the
  caller's page buffers. JSON control calls go over the same pool of keep-alive
  ``http.client`` connections (:mod:`kvbank.client.http`); a pooled connection the node
  closed while idle is dropped before use.

**The local channel** (:mod:`kvbank.client.local`): where the node runs on this host (its
``/v1/node`` names a socket, with this host's boot id and this uid), the per-request calls
— ``match``, ``presence``, ``fetch_prefix``, ``lend`` / ``check_live`` / ``release`` /
``commit`` and a put's reserve and commit — go over the node's Unix socket as binary
frames, and the page bodies through the host memory the node passed over it as a file
descriptor (a tenant-bound client gets none: its bodies take the paths above).
``channel=None`` picks it by itself and falls back to HTTP with a logged reason;
``channel="local"`` requires it; ``channel="http"`` (or ``same_host=False``) never uses it.

Retries only where a call is idempotent (``match``, GETs, ``fetch`` — which resumes under
its fetch id), until ``retry_s`` has passed.

The calls live in this module and three mixins: :mod:`kvbank.client.puts` (``put``,
``put_state``, ``put_states``), :mod:`kvbank.client.leases` (the lease calls) and
:mod:`kvbank.client.engine` (a paged engine's calls).

Lifecycle: ``Client(url)`` (no connection yet) → calls → ``close()`` (or ``with``).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import torch

from kvbank import checks, wire
from kvbank.buffers import (
    OutBuffers,
    fetched,
    out_buffers,
    out_views,
)
from kvbank.client.audit import ClientAudit
from kvbank.client.dataport import DataLink
from kvbank.client.engine import EngineCalls
from kvbank.client.http import Pool
from kvbank.client.io import (
    Deadline,
    check_prompt,
    deadline_of,
    name_hex,
    page_size,
    prompt_doc,
    scope_doc,
)
from kvbank.client.leases import LeaseCalls
from kvbank.client.local import ChannelBroken, LocalLink
from kvbank.client.paths import DataPort, PagePath, SharedMemory, Stream
from kvbank.client.puts import PutCalls
from kvbank.errors import InvalidInput, KvbankError, TierFull, TierUnavailable
from kvbank.keys import DEFAULT_SCOPE, Scope, TokenIds, namespace, prompt_keys, tokens_to_bytes
from kvbank.keys import row_names as _row_names
from kvbank.layout import PageLayout
from kvbank.lender.resume import resumed_at
from kvbank.results import (
    BankStats,
    Fetched,
    FetchResult,
    Match,
    Presence,
    StoreHealth,
    check_shard,
)
from kvbank.tiers.base import TierKind
from kvbank.wire.framing import encode_match
from kvbank.wire.node import DEFAULT_BIND, DEFAULT_PORT

logger = logging.getLogger(__name__)

DEFAULT_URL = f"http://{DEFAULT_BIND}:{DEFAULT_PORT}"
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RETRY_S = 5.0
# a same-host client a failure put off shared memory asks whether it maps again after this
# long (a node restart or a passing fault must not keep a worker on the slow path for good)
LOCAL_RETRY_S = 30.0

_MATCH_DOCS = 64  # matches whose documents a client keeps for their fetches


class Client(PutCalls, LeaseCalls, EngineCalls):
    """A served node, called like a :class:`~kvbank.bank.bank.Bank`. See the module docstring."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
        same_host: bool | None = None,
        token: str | None = None,
        data_plane: bool | None = None,
        channel: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise InvalidInput(f"url: expected http://HOST:PORT, got {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise InvalidInput(f"url: expected the node's root, http://HOST:PORT, without a path "
                               f"(the calls add /v1/...), got {url!r}", field="url")
        # checked here, as Bank checks its own settings: not at the first call, untyped
        timeout_s = checks.seconds(timeout_s, "timeout_s", positive=True)
        retry_s = checks.seconds(retry_s, "retry_s")
        if channel not in (None, "local", "http"):
            raise InvalidInput(f"channel: expected 'local', 'http' or None, got {channel!r}", field="channel")
        self.url = url.rstrip("/")
        # the local channel: None = pick it where the node is on this host
        self._channel = "http" if channel is None and same_host is False else channel
        self._link: LocalLink | None = None
        self._link_off = self._channel == "http"
        self._token = token
        self._timeout_s = float(timeout_s)
        # ``token``: a tenant token, sent on every call (the node binds the caller to it)
        auth = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._tenant_token = token is not None
        self._closed = False
        self._pool = Pool(self.url, parts.hostname, parts.port or 80, timeout_s=float(timeout_s),
                          retry_s=float(retry_s), auth=auth)
        self._layouts: dict[bytes, PageLayout] = {}
        self._local: bool | None = None if same_host is None else same_host
        self._local_retry_at: float | None = None  # when an _off_host client asks again
        self._lock = threading.Lock()
        # the latest matches this client decoded, with the node's documents of them
        self._matches: OrderedDict[int, tuple[Match, dict[str, Any]]] = OrderedDict()
        # page bodies to another host over the node's data port (None: if it has one)
        self._want_data = data_plane
        self._data = DataLink(parts.hostname, float(timeout_s))
        self._data_known = data_plane is False  # whether /v1/node told us the port yet
        # a port given up as unreachable is asked for again from this monotonic time on
        self._data_retry_at: float | None = None
        self._instance: object = None  # the node process /v1/node last described
        # the three page paths (:mod:`kvbank.client.paths`); ``_path`` picks one a call
        self._shm = SharedMemory(self, required=same_host is True)
        self._dataport = DataPort(self, self._data, required=data_plane is True)
        self._stream = Stream(self)
        # the reuse audit's report (kvbank.client.audit), as a bank's ``bank.audit``
        self.audit = ClientAudit(self._call)

    # ---- plumbing --------------------------------------------------------------------

    def _call(self, method: str, path: str, *, body: Any = None, content: bytes | None = None,
              idempotent: bool = False, deadline: Deadline | None = None,
              wait_s: float | None = None) -> Any:
        """One control call (:meth:`kvbank.client.http.Pool.call`); the page paths make
        theirs through here too. This thread's one-way acknowledgements on the local
        channel are applied first (:meth:`LocalLink.settle`): what the call reads of the
        node (its counters, its leases) includes the fetches this thread saw return."""
        self._check_open()
        link = self._link
        if link is not None:
            link.settle()
        return self._pool.call(method, path, body=body, content=content, idempotent=idempotent,
                               deadline=deadline, wait_s=wait_s)

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        """A pooled (or new) connection whose waits end after ``timeout`` (default
        ``timeout_s``); this thread's one-way acknowledgements applied first, as in
        :meth:`_call`."""
        self._check_open()
        link = self._link
        if link is not None:
            link.settle()
        return self._pool.conn(timeout)

    def _check_open(self) -> None:
        if self._closed:  # as a closed Bank answers: no call reopens a connection
            raise TierUnavailable(f"client: closed (the client of {self.url})", field="client")

    def _chan(self) -> LocalLink | None:
        """The local channel, connected on first use; None where calls go over HTTP (the
        reason logged once)."""
        link = self._link
        if link is not None or self._link_off:
            return link
        self._check_open()
        with self._lock:
            if self._link is not None or self._link_off:
                return self._link
            info = self._host_info()
            path = info.get("socket")
            reason = None
            if not isinstance(path, str) or not path:
                reason = "the node serves no local channel"
            elif not SharedMemory.same_machine(info):
                reason = "the node runs on another host, or as another uid"
            else:
                link = LocalLink(path, self._token, self._timeout_s)
                link.layout_of = self.layout
                try:
                    link.open()
                except TierUnavailable as exc:
                    reason = str(exc)
                else:
                    self._link = link
                    return link
            if self._channel == "local":
                raise TierUnavailable(f"node: no local channel to {self.url}: {reason}", field="channel")
            logger.info("client: calls to %s go over HTTP: %s", self.url, reason)
            self._link_off = True
            return None

    def _local_memory(self) -> LocalLink | None:
        """The local channel where the node passed it its host memory."""
        link = self._chan()
        return link if link is not None and link.memory else None

    def _path(self) -> PagePath:
        """The way page bodies go now: shared memory on the node's host, else its data port
        where it has one, else the HTTP stream."""
        if self.same_host:
            return self._shm
        if self._data_on():
            return self._dataport
        return self._stream

    @property
    def same_host(self) -> bool:
        """Whether page bodies take the shared-memory path (decided on first use, and
        again :data:`LOCAL_RETRY_S` after a failure put the client off it)."""
        if self._local is None:
            self._local = self._detect()
        elif self._local_retry_at is not None and time.monotonic() >= self._local_retry_at:
            self._local_retry_at = None
            try:
                self._local = self._detect()
            except KvbankError as exc:  # the node still away: off, and asked again later
                logger.info("client: the node's memory is still out of reach: %s", exc)
                self._off_host()
        return self._local

    def _off_host(self) -> None:
        """A same-host transfer failed (the segment would not map, the node went away):
        the next calls go over the network until :attr:`same_host` asks again."""
        self._local = False
        self._local_retry_at = time.monotonic() + LOCAL_RETRY_S

    def _host_info(self) -> dict[str, Any]:
        doc = self._call("GET", "/v1/node", idempotent=True)
        instance = doc.get("instance")
        if instance != self._instance:  # first read, or the node restarted since
            self._instance = instance
            self._data_known = self._want_data is False
        if not self._data_known:
            port = doc.get("data_port")
            self._data.port = port if isinstance(port, int) and not isinstance(port, bool) else None
            self._data_known = True
            self._data_retry_at = None
        info: dict[str, Any] = doc["host"]
        self._shm.learn(info)
        return info

    def _data_moved(self) -> bool:
        """The data port refused a connection: read ``/v1/node`` again (a restarted node
        listens on a new port). True when it now advertises another port to try."""
        before = self._data.port
        self._data_known = self._want_data is False
        self._host_info()
        return self._data.port is not None and self._data.port != before

    def _detect(self) -> bool:
        return SharedMemory.maps_here(self._host_info())

    def map_host(self, wait_s: float | None = None) -> bool:
        """Map the node's host segment now, for reading and for writing, as the first
        same-host fetch and put would; where the node keeps it resident, wait up to
        ``wait_s`` seconds for this process's page tables of it to be built (a worker
        does this once at start, so no put later pays a fault per 4 KiB page). Whether
        it is ready; False on the TCP path."""
        link = self._local_memory()
        if link is not None:
            return link.wait_populated(wait_s)
        if not self.same_host:
            return False
        return self._shm.map(wait_s)

    # ---- layouts ---------------------------------------------------------------------

    def register(self, layout: PageLayout) -> bytes:
        """Declare a layout on the node; returns its layout id."""
        if not isinstance(layout, PageLayout):
            raise InvalidInput(f"layout: expected a PageLayout, got {type(layout).__name__}")
        doc = self._call("POST", "/v1/layouts", body={"layout": wire.to_dict(layout)}, idempotent=True)
        lid = bytes.fromhex(doc["layout_id"])
        self._layouts[lid] = layout
        return lid

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout ``layout_id`` (:class:`UnknownLayout` otherwise)."""
        if not isinstance(layout_id, bytes):
            raise InvalidInput(f"layout_id: expected bytes, got {type(layout_id).__name__}")
        got = self._layouts.get(layout_id)
        if got is None:
            doc = self._call("GET", f"/v1/layouts/{layout_id.hex()}", idempotent=True)
            got = self._layouts[layout_id] = wire.from_dict(PageLayout, doc)
        return got

    def register_scope(self, layout_id: bytes, scope: Scope) -> bytes:
        """Let the node's leases describe rows of ``scope`` under ``layout_id``; the 16-byte
        namespace."""
        if not isinstance(layout_id, bytes):
            raise InvalidInput(f"layout_id: expected bytes, got {type(layout_id).__name__}")
        if not isinstance(scope, Scope):
            raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
        doc = self._call("POST", f"/v1/layouts/{layout_id.hex()}/scopes", body=scope_doc(scope),
                         idempotent=True)
        return bytes.fromhex(doc["namespace"])

    def row_names(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                  scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
                  shard: int | None = None) -> list[bytes]:
        """The row names of every full page of ``tokens`` (or of ``keys``) for ``group``,
        computed here from the layout. ``shard``: the tensor-parallel rank (default: 0 of
        a layout of one shard; a layout of several needs it named)."""
        layout = self.layout(layout_id)
        page_size(layout, group)
        count = layout.shard_count
        if shard is None and count != 1:
            raise InvalidInput(f"shard: layout {layout_id.hex()[:16]}… has {count} shards; name the "
                               "shard this call is for")
        index = 0 if shard is None else shard
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise InvalidInput(f"shard: expected a shard index in [0, {count}), got {shard!r}")
        chain = prompt_keys(tokens, keys, layout.tokens_per_page, layout_id, scope)
        return _row_names(namespace(layout_id, scope), chain, group, count, index)

    # ---- matching and fetching -------------------------------------------------------

    def match(self, layout_id: bytes, tokens: TokenIds | None = None, *, scope: Scope = DEFAULT_SCOPE,
              shard: int | None = None, keys: Sequence[bytes] | None = None,
              prompt_tokens: int | None = None) -> Match:
        """:meth:`Bank.match` on the node (by tokens, or by an engine's key chain). Never leases."""
        link = self._chan()
        if link is not None:
            prompt = self._prompt_columns(layout_id, tokens, scope, shard, keys, prompt_tokens)
            if prompt is not None:
                try:
                    return link.match(prompt)
                except ChannelBroken as exc:  # idempotent: over HTTP this once
                    logger.info("client: match over HTTP: %s", exc)
        if tokens is not None and prompt_tokens is None:
            check_prompt(layout_id, scope, tokens, keys)
            # the binary form: the ids as they are, no base64 in JSON around them
            doc = self._call("POST", "/v1/match", idempotent=True,
                             content=encode_match(layout_id, scope_doc(scope), shard, tokens_to_bytes(tokens)))
            return self._matched(doc)
        body = prompt_doc(layout_id, tokens, scope, shard, keys, prompt_tokens)
        return self._matched(self._call("POST", "/v1/match", body=body, idempotent=True))

    @staticmethod
    def _prompt_columns(layout_id: bytes, tokens: TokenIds | None, scope: Scope, shard: int | None,
                        keys: Sequence[bytes] | None, prompt_tokens: int | None) -> list[Any] | None:
        """A prompt's columns on the local channel (checked as its HTTP body is); None
        where it has no binary form (engine keys that are not all 32 bytes)."""
        check_prompt(layout_id, scope, tokens, keys)
        if keys is not None:
            if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
                raise InvalidInput(f"keys: expected a sequence of page keys, got {type(keys).__name__}")
            if keys and set(map(type, keys)) != {bytes}:  # one pass at C speed; the loop names the first
                for i, k in enumerate(keys):
                    if type(k) is not bytes:
                        raise InvalidInput(f"keys[{i}]: expected a page key (bytes), got {type(k).__name__}")
            return LocalLink.prompt_columns(layout_id, scope, shard, None, keys, prompt_tokens)
        assert tokens is not None  # one of the two, checked above
        return LocalLink.prompt_columns(layout_id, scope, shard, tokens_to_bytes(tokens), None, prompt_tokens)

    def resume_at(self, match: Match, tokens: int) -> Match:
        """:meth:`Bank.resume_at`, computed here: ``match`` resumed at ``tokens``, one of
        ``match.boundaries`` (or 0), from the tiers the match already found."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        return resumed_at(self.layout(match.layout_id), match, tokens)

    def presence(self, layout_id: bytes, tokens: TokenIds | None = None, *,
                 scope: Scope = DEFAULT_SCOPE, shards: Sequence[int] | None = None,
                 keys: Sequence[bytes] | None = None, prompt_tokens: int | None = None) -> Presence:
        """:meth:`Bank.presence` on the node: where the prompt's rows are for every shard
        (default: all of the layout's), and the boundary all of them can resume at."""
        if shards is not None and (isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence)):
            raise InvalidInput(f"shards: expected a non-empty sequence of shard indices, got {shards!r}")
        link = self._chan()
        if link is not None and (shards is None or (shards and all(
                type(x) is int and x >= 0 for x in shards))):
            prompt = self._prompt_columns(layout_id, tokens, scope, None, keys, prompt_tokens)
            if prompt is not None:
                return link.presence(prompt, shards)
        body = prompt_doc(layout_id, tokens, scope, None, keys, prompt_tokens)
        del body["shard"]
        if shards is not None:
            body["shards"] = list(shards)
        return wire.from_dict(Presence, self._call("POST", "/v1/presence", body=body, idempotent=True))

    def out_buffers(self, match: Match) -> dict[int, torch.Tensor]:
        """:meth:`Bank.out_buffers`: new buffers for :meth:`fetch`, sized from the layout."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        return out_buffers(self.layout(match.layout_id), match.resume.pages)

    def fetch_prefix(self, layout_id: bytes, tokens: TokenIds | None = None, *,
                     scope: Scope = DEFAULT_SCOPE, shard: int | None = None,
                     keys: Sequence[bytes] | None = None, prompt_tokens: int | None = None,
                     out: OutBuffers | None = None, max_rows: int | None = None) -> Fetched:
        """:meth:`Bank.fetch_prefix` on the node. On the same host, and over the data port,
        one control call matches and lends (then the copies, then the acknowledgement);
        over HTTP streams it is :meth:`match`, then :meth:`fetch`."""
        link = self._local_memory()
        full = False  # the channel's lend did not fit the host tier
        if link is not None:
            prompt = self._prompt_columns(layout_id, tokens, scope, shard, keys, prompt_tokens)
            if prompt is not None:
                def out_of(m: Match) -> OutBuffers:
                    if not any(m.resume.pages):
                        return {} if out is None else out
                    return out_buffers(self.layout(m.layout_id), m.resume.pages) if out is None else out
                try:
                    m, result, bufs = link.fetch_prefix(prompt, max_rows, out_of)
                    return Fetched(m, result, bufs)
                except TierFull:  # more rows than the host tier can lend at once: as on HTTP,
                    full = True  # match, then the fetch streams them in batches
        if not full:
            body = prompt_doc(layout_id, tokens, scope, shard, keys, prompt_tokens)
            fast = self._path().prefix(body, out, max_rows)
            if fast is not None:
                return fast
        m = self.match(layout_id, tokens, scope=scope, shard=shard, keys=keys, prompt_tokens=prompt_tokens)
        return fetched(self.layout(layout_id), m, out, lambda bufs: self.fetch(m, out=bufs, max_rows=max_rows))

    def _matched(self, doc: Any) -> Match:
        m = wire.from_dict(Match, doc)
        with self._lock:  # a fetch of this very Match sends the node's document back as is
            self._matches[id(m)] = (m, doc)
            while len(self._matches) > _MATCH_DOCS:
                self._matches.popitem(last=False)
        return m

    def _match_doc(self, match: Match) -> dict[str, Any]:
        """``match``'s wire form: the node's own document when ``match`` is the object a
        :meth:`match` call decoded from it (encoding a 1,000-row match again costs about
        as much as the fetch's control call), else encoded anew."""
        with self._lock:
            kept = self._matches.get(id(match))
        if kept is not None and kept[0] is match:
            return kept[1]
        return wire.to_dict(match)

    def fetch(self, match: Match, *, out: OutBuffers, fetch_id: str | None = None,
              max_rows: int | None = None, timeout: float | None = None,
              shard: int | None = None) -> FetchResult:
        """:meth:`Bank.fetch` on the node: ``out[g][k]`` receives ``match.resume.pages[g][k]``.

        A broken TCP stream is acknowledged up to its last whole row and resumed under
        the same fetch id until ``retry_s`` has passed. ``timeout`` bounds this client's
        waits: a stream still running then is cut, and the rows that arrived whole are
        acknowledged and answered (resume with the same fetch id); :class:`Busy` where the
        node had not answered at all. ``shard``: the caller's rank; a match of another
        shard's rows is refused here, before any call."""
        deadline = deadline_of(timeout)
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        check_shard(match, shard)
        views = out_views(self.layout(match.layout_id), match.resume.pages, out)
        link = self._local_memory() if fetch_id is None and any(match.resume.pages) else None
        if link is not None:  # one call lends, the copies, a one-way acknowledgement
            try:
                return link.fetch(match, out, max_rows, deadline)
            except TierFull:
                pass  # the host tier cannot lend every row at once: the stream sends them in batches
        req = {"match": self._match_doc(match), "fetch_id": fetch_id, "max_rows": max_rows}
        got = None if link is not None else self._path().fetch(req, views, out, deadline)
        return self._stream.fetch(req, views, out, deadline) if got is None else got

    def _ack(self, fetch_id: str, rows: list[int], lease_id: str | None,
             stream: str | None = None, changed: list[int] | None = None) -> FetchResult:
        body: dict[str, Any] = {"rows": rows, "lease_id": lease_id, "stream": stream}
        if changed:
            body["changed"] = changed
        doc = self._call("POST", f"/v1/fetch/{fetch_id}/ack", body=body, idempotent=True)
        return wire.from_dict(FetchResult, doc)

    def stats(self) -> BankStats:
        return wire.from_dict(BankStats, self._call("GET", "/v1/stats", idempotent=True))

    def health(self) -> StoreHealth:
        """The node store's health: each tier's state and the mover's."""
        return wire.from_dict(StoreHealth, self._call("GET", "/v1/health", idempotent=True))

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]:
        """The fastest tier holding each row (None = a miss). A pure query."""
        hexed = [name_hex(n, i) for i, n in enumerate(names)]
        doc = self._call("POST", "/v1/locate", body={"names": hexed}, idempotent=True)
        return [None if t is None else TierKind[t] for t in doc["tiers"]]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the node store's mover is idle; ``Busy`` after ``timeout_s`` (default:
        the node store's ``wait_timeout_s``)."""
        wait = None if timeout_s is None else checks.seconds(timeout_s, "timeout_s")
        self._call("POST", "/v1/flush", body={"timeout_s": wait}, wait_s=wait)

    # ---- the data plane --------------------------------------------------------------

    def _data_on(self) -> bool:
        """Whether page bodies to this (remote) node take its data port."""
        if self._want_data is False:
            return False
        if self._data_retry_at is not None and time.monotonic() >= self._data_retry_at:
            self._data_known = False  # given up a while ago: the node may be back on a new port
        if not self._data_known:
            self._host_info()
        if self._data.port is None and self._want_data:
            raise TierUnavailable(f"node: {self.url} serves no data port (data_plane=True)")
        return self._data.port is not None

    # ---- the rest --------------------------------------------------------------------

    def close(self) -> None:
        """Close every connection and unmap the node's segments; every call after it raises
        :class:`TierUnavailable`, as a closed Bank's do. Idempotent."""
        self._closed = True
        if self._link is not None:
            self._link.close()
        self._pool.close()
        self._data.close()
        self._shm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["DEFAULT_URL", "Client"]
