"""``kvbank admin …``: the admin API of a running node from a shell.

Subcommands (:data:`COMMANDS`, a table other parts extend with :func:`register`, e.g.
the fleet's ``kvbank admin fleet``): health, stats, tiers, layouts, leases (``--release
ID`` force-releases one), unregister, fetches, rows, evict, flush, drain, undrain, pin,
unpin, check, compact (the disk tier rewritten into segment files: a data dir of the older
layout, and sparse segments), fleet (the nodes of the fleet this node is in: ``*`` marks
this one), quarantine (layouts a reuse audit quarantined; ``--clear LAYOUT_ID`` serves one
again).

``--url`` is the node's root (``http://HOST:PORT``, no path). The token comes from
``--token``, else ``KVBANK_ADMIN_TOKEN``, else the node's token file
(``DATA_DIR/admin.token``, ``--data-dir`` or the embedded default's data dir; a refusal
of a token read from a file says which file, since another node's is a different one).
Output is a human table by default and the route's JSON document with ``--json``; a
reader that stops early (``| head``) ends the output quietly. A layout id may be given
by any prefix of its 64 hex digits that names one registered layout. ``flush`` and
``drain`` draw a progress bar on stderr when it is a terminal and ``--json`` is not given
(the mover's queue, the in-flight requests).
Exit status: 0 done, 1 refused or a problem found (``check``), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:7410"
ENV_TOKEN = "KVBANK_ADMIN_TOKEN"


class AdminError(Exception):
    """The node refused a call (its error document), or could not be reached."""


@dataclass
class Api:
    """The admin routes of one node."""

    url: str
    token: str
    timeout_s: float = 120.0
    token_file: Path | None = None  # where the token was read, when it came from a file

    def call(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        import httpx  # here, so that ``kvbank --help`` stays quick

        try:
            r = httpx.request(method, self.url.rstrip("/") + path, json=body, params=params,
                              headers={"Authorization": f"Bearer {self.token}"}, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise AdminError(f"node: {self.url} unreachable: {exc}") from exc
        try:
            doc = r.json()
        except ValueError:
            doc = {"message": r.text[:200]}
        if r.status_code >= 400 and not (path.endswith("/ready") and r.status_code == 503):
            hint = ""
            if r.status_code == 403 and self.token_file is not None:
                whose = ("this machine's default" if self.token_file == _default_token_file()
                         else "the --data-dir given")
                hint = (f" (the token was read from {self.token_file}, {whose};"
                        f" for another node pass --token, ${ENV_TOKEN} or its --data-dir)")
            raise AdminError(f"{r.status_code} {doc.get('type', '')}: {doc.get('message', doc)}{hint}")
        return doc


Handler = Callable[[Api, argparse.Namespace, TextIO], int]


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    handler: Handler
    arguments: Callable[[argparse.ArgumentParser], None] | None = None


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, handler: Handler,
             arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Add ``kvbank admin NAME`` (the fleet registers ``fleet`` this way)."""
    COMMANDS[name] = Command(help, handler, arguments)


def resolve_token(given: str | None, data_dir: str | None) -> str:
    return _token(given, data_dir)[0]


def _default_token_file() -> Path:
    from kvbank.service.admin.auth import TOKEN_FILE
    from kvbank.service.config import default_data_dir

    return default_data_dir() / TOKEN_FILE


def _token(given: str | None, data_dir: str | None) -> tuple[str, Path | None]:
    """The admin token, and the file it was read from (None: given or from the env)."""
    if given:
        return given, None
    env = os.environ.get(ENV_TOKEN)
    if env:
        return env, None
    from kvbank.service.admin.auth import TOKEN_FILE, read_token_file

    path = Path(data_dir) / TOKEN_FILE if data_dir else _default_token_file()
    token = read_token_file(path)
    if token is None:
        raise AdminError(f"token: none given (--token, {ENV_TOKEN}) and no token file at {path}")
    return token, path


def check_url(url: str) -> str:
    """``url`` if it is a node's root (``http://HOST:PORT``); else an error that says so."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AdminError(f"--url: expected the node's root, http://HOST:PORT, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise AdminError(f"--url: expected the node's root, http://HOST:PORT, without a path "
                         f"(the routes add /admin/...), got {url!r}")
    return url


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


# ---- output ------------------------------------------------------------------------------


def table(rows: Sequence[Sequence[object]], head: Sequence[str], out: TextIO) -> None:
    cells = [[str(c) for c in head], *[[_cell(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for i, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _cell(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ",".join(map(str, v)) or "-"
    return "-" if v is None else str(v)


class _Bar:
    """The progress line of ``flush`` and ``drain``: drawn on stderr only when it is a
    terminal, not under ``--json``, and not with ``KVBANK_PROGRESS=0`` (the rule of
    :mod:`kvbank.progress`); a log or a pipe gets no carriage returns."""

    def __init__(self, as_json: bool) -> None:
        off = os.environ.get("KVBANK_PROGRESS", "") in ("0", "false", "off", "no")
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):  # replaced or closed stderr
            tty = False
        self.on = tty and not as_json and not off
        self.drawn = False

    def draw(self, done: float, total: float, what: str) -> None:
        if not self.on:
            return
        frac = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
        filled = int(frac * 30)
        print(f"\r[{'#' * filled}{' ' * (30 - filled)}] {frac:4.0%} {what}   ", end="",
              file=sys.stderr, flush=True)
        self.drawn = True

    def end(self) -> None:
        """End the bar's line (an error or the result goes on a line of its own)."""
        if self.drawn:
            print(file=sys.stderr, flush=True)
            self.drawn = False


# ---- commands ------------------------------------------------------------------------------


def _health(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/health")
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        print(f"live {_cell(doc['live'])}  ready {_cell(doc['ready'])}  draining {_cell(doc['draining'])}  "
              f"in flight {doc['in_flight']}", file=out)
        for r in doc["degraded"]:
            print(f"  degraded: {r}", file=out)
        table([[t["kind"], t["state"], t["detail"]] for t in doc["store"]["tiers"]], ["tier", "state", "detail"], out)
    return 0


_TIER_COLS = ["kind", "enabled", "budget_bytes", "used_bytes", "rows", "hits", "misses", "evictions",
              "demotions", "promotions", "corrupt_frames"]


def _tiers(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/tiers")
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        table([[t[c] for c in _TIER_COLS] for t in doc["tiers"]], _TIER_COLS, out)
    return 0


def _stats(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/stats")
    if a.json:
        print(json.dumps(doc), file=out)
        return 0
    b, s = doc["bank"], doc["bank"]["store"]
    table([[b["layouts"], b["live_leases"], s["rows"], s["puts"], s["gets"], s["hits"], s["misses"],
            s["pinned_rows"], s["queued_jobs"], doc["in_flight"], doc["draining"]]],
          ["layouts", "leases", "rows", "puts", "gets", "hits", "misses", "pinned", "queued", "in_flight",
           "draining"], out)
    print(file=out)
    table([[t[c] for c in _TIER_COLS] for t in doc["tiers"]], _TIER_COLS, out)
    return 0


def _layouts(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/layouts")
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        # the whole id: it is what --layout takes (a unique prefix of it works too)
        table([[x["layout_id"], x.get("model", ""), x.get("tokens_per_page", ""), len(x.get("groups", []))]
               for x in doc["layouts"]], ["layout_id", "model", "tokens_per_page", "groups"], out)
    return 0


def _layout_id(api: Api, given: str | None) -> str | None:
    """A whole layout id for ``--layout``: given whole, or the one registered layout whose
    id starts with the given hex digits."""
    if given is None or len(given) == 64:
        return given
    low = given.lower()
    ids = [x["layout_id"] for x in api.call("GET", "/admin/layouts")["layouts"]
           if x["layout_id"].startswith(low)]
    if len(ids) != 1:
        raise AdminError(f"--layout: {given!r} is the start of {len(ids)} registered layout ids, "
                         "not of exactly one (kvbank admin layouts lists them)")
    return str(ids[0])


def _unregister(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    lid = _layout_id(api, a.layout)
    doc = api.call("DELETE", f"/admin/layouts/{lid}")
    print(json.dumps(doc) if a.json else f"unregistered {lid} ({doc['unregistered']} shards)", file=out)
    return 0


def _leases(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("DELETE", f"/admin/leases/{a.release}") if a.release else api.call("GET", "/admin/leases")
    if a.json:
        print(json.dumps(doc), file=out)
    elif a.release:
        print(f"released {_cell(doc['released'])}", file=out)
    else:
        # ``rows`` is the lease's rows as columns (names, present, state, ...): one
        # character of ``present`` per row
        table([[x["id"], x["mode"], x["kind"], len(x["rows"]["present"]), f"{x['ttl_s']:.1f}"]
               for x in doc["leases"]], ["id", "mode", "kind", "rows", "ttl_s"], out)
    return 0


def _fetches(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/fetches")
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        table([[x["fetch_id"], x["where"], x["layout_id"][:16], x["prompt_tokens"], x["planned_rows"],
                x["delivered_rows"], f"{x['ttl_s']:.1f}"] for x in doc["fetches"]],
              ["fetch_id", "where", "layout", "prompt_tokens", "planned", "delivered", "ttl_s"], out)
    return 0


def _scope_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", dest="layout_id", help="layout id (hex)")
    p.add_argument("--tenant", help="scope: tenant (naming any scope field lists that scope)")
    p.add_argument("--cache-salt", help="scope: cache salt")
    p.add_argument("--lora", help="scope: LoRA adapter")
    p.add_argument("--prefix", help="row-name prefix (hex)")


def _rows_args(p: argparse.ArgumentParser) -> None:
    _scope_args(p)
    p.add_argument("--limit", type=int, default=100, help="rows a page (1..1000)")
    p.add_argument("--cursor", help="the next_cursor of the previous page")


def _rows(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    params = {k: v for k, v in (("layout_id", _layout_id(api, a.layout_id)), ("tenant", a.tenant),
                                ("cache_salt", a.cache_salt), ("lora", a.lora), ("prefix", a.prefix),
                                ("limit", a.limit), ("cursor", a.cursor)) if v is not None}
    doc = api.call("GET", "/admin/rows", params=params)
    if a.json:
        print(json.dumps(doc), file=out)
        return 0
    table([[r["name"], r["size"], r["tiers"], f"{r['age_s']:.1f}", r["holders"], r["pinned"]] for r in doc["rows"]],
          ["name", "size", "tiers", "age_s", "holders", "pinned"], out)
    if doc["next_cursor"]:
        print(f"next page: --cursor {doc['next_cursor']}", file=out)
    return 0


def _evict_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="row names (hex)")
    _scope_args(p)


def _evict(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    body: dict[str, Any] = {}
    if a.names:
        body["names"] = a.names
    if a.prefix:
        body["prefix"] = a.prefix
    if a.layout_id:
        body["layout_id"] = _layout_id(api, a.layout_id)
    if any(x is not None for x in (a.tenant, a.cache_salt, a.lora)):
        body["scope"] = {"tenant": a.tenant or "", "cache_salt": a.cache_salt or "", "lora": a.lora or ""}
    doc = api.call("POST", "/admin/evict", body)
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        print(f"evicted {len(doc['evicted'])}, locked (left) {len(doc['locked'])}, pinned (left) "
              f"{len(doc['pinned'])}, missing {len(doc['missing'])}", file=out)
        for n in doc["locked"]:
            print(f"  locked: {n}", file=out)
    return 0


def _timeout_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_positive_seconds, default=300.0,
                   help="give up after this many seconds (> 0)")


def _flush(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["doc"] = api.call("POST", "/admin/flush", {"timeout_s": a.timeout})
        except AdminError as exc:
            result["err"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    start = None
    bar = _Bar(a.json)
    try:
        while t.is_alive():
            q = api.call("GET", "/admin/stats")["bank"]["store"]["queued_jobs"]
            start = max(start or 0, q)
            bar.draw(start - q, start, f"{q} moves queued")
            t.join(0.2)
        bar.draw(1, 1, "flushed")
    finally:
        bar.end()
    if "err" in result:
        raise result["err"]
    print(json.dumps(result["doc"]) if a.json else "flushed", file=out)
    return 0


def _drain(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/drain", {"wait": False})
    first = max(doc["in_flight"], 1)
    end = time.monotonic() + a.timeout
    bar = _Bar(a.json)
    try:
        while True:
            h = api.call("GET", "/admin/health")
            bar.draw(first - h["in_flight"], first, f"{h['in_flight']} requests in flight")
            if h["in_flight"] == 0 or time.monotonic() > end:
                break
            time.sleep(0.2)
    finally:
        bar.end()
    doc = {"draining": True, "in_flight": h["in_flight"], "done": h["in_flight"] == 0}
    print(json.dumps(doc) if a.json else ("drained" if doc["done"] else
                                         f"draining; {doc['in_flight']} requests still in flight"), file=out)
    return 0 if doc["done"] else 1


def _undrain(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/undrain")
    print(json.dumps(doc) if a.json else "accepting puts again", file=out)
    return 0


def _names_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="+", help="row names (hex)")


def _pin(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/pin", {"names": a.names})
    print(json.dumps(doc) if a.json else f"pinned {doc['pinned']} ({doc['pinned_bytes']} of "
          f"{doc['pin_budget_bytes']} pin budget bytes); not stored: {len(doc['missing'])}", file=out)
    return 0


def _unpin(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/unpin", {"names": a.names})
    print(json.dumps(doc) if a.json else f"unpinned {doc['unpinned']}", file=out)
    return 0


def _check(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/check")
    if a.json:
        print(json.dumps(doc), file=out)
    else:
        print("ok" if doc["ok"] else "problems found:", file=out)
        for p in doc["problems"]:
            print(f"  {p}", file=out)
    return 0 if doc["ok"] else 1


def _compact(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("POST", "/admin/compact")
    if a.json:
        print(json.dumps(doc), file=out)
    elif not doc["disk"]:
        print("no disk tier: nothing to compact", file=out)
    else:
        print(f"compacted {doc['moved']} rows ({doc['written_bytes']} bytes written): "
              f"{doc['legacy_moved']} from the older layout, {doc['segments_freed']} segments "
              "freed", file=out)
    return 0


def _quarantine(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    if a.clear:
        doc = api.call("DELETE", f"/admin/quarantine/{a.clear}")
        if a.json:
            print(json.dumps(doc), file=out)
        else:
            print(f"cleared {_cell(doc['cleared'])}" + ("" if doc["cleared"] else " (it was not quarantined)"),
                  file=out)
        return 0 if doc["cleared"] else 1
    doc = api.call("GET", "/admin/quarantine")
    if a.json:
        print(json.dumps(doc), file=out)
        return 0
    print(f"audits: {doc['audits_ok']} ok, {doc['audits_mismatched']} mismatched", file=out)
    table([[x["layout_id"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x["since"])), x["mismatches"],
            x["detail"][:80]] for x in doc["layouts"]], ["layout_id", "since (UTC)", "mismatches", "detail"], out)
    return 0


def _quarantine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clear", metavar="LAYOUT_ID", help="serve this layout's rows again (hex layout id)")


def _fleet(api: Api, a: argparse.Namespace, out: TextIO) -> int:
    doc = api.call("GET", "/admin/fleet")
    if a.json:
        print(json.dumps(doc), file=out)
        return 0
    me = doc.get("self")
    rows = [["*" if n["node_id"] == me else "", n["node_id"], n["address"], n["state"],
             round(float(n["heartbeat_age_s"]), 1), n["rows"], n["version"], len(n["layouts"])]
            for n in sorted(doc["nodes"], key=lambda n: n["node_id"])]
    table(rows, ["", "node", "address", "state", "heartbeat_age_s", "rows", "version", "layouts"], out)
    if me is None:
        print("this node has not registered yet (Redis unreachable?)", file=out)
    return 0


for _name, _help, _fn, _args in (
    ("health", "liveness, readiness, degraded reasons", _health, None),
    ("stats", "the bank's counters and each tier's", _stats, None),
    ("tiers", "per tier: budget, used, rows, counters", _tiers, None),
    ("layouts", "registered layouts", _layouts, None),
    ("unregister", "forget a layout that holds no rows (evict them first)", _unregister,
     lambda p: p.add_argument("layout", help="layout id (hex), or a prefix naming one")),
    ("leases", "live leases (--release ID ends one)",
     _leases, lambda p: p.add_argument("--release", metavar="ID", help="force-release this lease")),
    ("rows", "one page of rows by layout, scope or prefix", _rows, _rows_args),
    ("evict", "evict rows by name, prefix, layout or scope", _evict, _evict_args),
    ("fetches", "open fetches: in this process and served to clients", _fetches, None),
    ("flush", "wait until the mover is idle: every queued demotion written", _flush, _timeout_arg),
    ("drain", "refuse new puts, turn unready, wait for in-flight requests", _drain, _timeout_arg),
    ("undrain", "accept puts again", _undrain, None),
    ("pin", "pin rows (never evicted) under the pin budget", _pin, _names_arg),
    ("unpin", "unpin rows", _unpin, _names_arg),
    ("check", "run the bank's invariant check", _check, None),
    ("compact", "rewrite the disk tier into segments (older-layout rows, sparse segments)",
     _compact, None),
    ("fleet", "the fleet's nodes: state, heartbeat age, rows published", _fleet, None),
    ("quarantine", "layouts a reuse audit quarantined (--clear LAYOUT_ID serves one again)",
     _quarantine, _quarantine_args),
):
    register(_name, _help, _fn, _args)


def add_parser(sub: Any) -> None:
    """``kvbank admin`` and its subcommands, on the ``kvbank`` parser's subparsers."""
    admin = sub.add_parser("admin", help="administer a running node (the /admin/ API)",
                           description="Call the admin API of a running kvbank node.")
    admin.add_argument("--url", default=os.environ.get("KVBANK_URL", DEFAULT_URL), help="the node")
    admin.add_argument("--token", default=None, help=f"admin token (else ${ENV_TOKEN}, else the token file)")
    admin.add_argument("--data-dir", default=None, help="the node's data dir, where its token file is")
    admin.add_argument("--json", action="store_true", help="the JSON document instead of a table")
    cmds = admin.add_subparsers(dest="admin_command", metavar="SUBCOMMAND")
    for name, cmd in COMMANDS.items():
        p = cmds.add_parser(name, help=cmd.help, description=cmd.help)
        if cmd.arguments is not None:
            cmd.arguments(p)
        p.set_defaults(admin_handler=cmd.handler)
    admin.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    handler = getattr(args, "admin_handler", None)
    if handler is None:
        print("kvbank admin: name a subcommand: " + ", ".join(COMMANDS), file=sys.stderr)
        return 2
    try:
        token, token_file = _token(args.token, args.data_dir)
        api = Api(check_url(args.url), token, token_file=token_file)
        return int(handler(api, args, out))
    except AdminError as exc:
        print(f"kvbank admin: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (``| head``): the rest of the output is not wanted, and the
        # interpreter's own flush at exit must not fail on the closed pipe either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
