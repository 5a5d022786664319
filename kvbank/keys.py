"""Scopes, page-key chains and row names: deterministic across processes and nodes.

Primitives:

- :class:`Scope` — tenant, cache salt and LoRA digest. Its :attr:`Scope.digest` is a
  SHA-256 over a length-prefixed encoding, so different scopes never share a key.
- :func:`page_keys` — the chain ``k_0 = H(version, scope)``,
  ``k_i = H(k_{i-1} ‖ tokens of page i as little-endian int32 ‖ extra keys of page i)``,
  SHA-256, 256 bits. Only full pages are keyed; a partial last page is not.
- :class:`RowName` — the 54-byte storage key of one page: ``namespace(16) ‖ page key(32)
  ‖ group(2) ‖ shard count(2) ‖ shard index(2)``, big-endian integers. The namespace is
  ``SHA-256(version ‖ scope ‖ layout id)[:16]``. Equal names mean interchangeable bytes.
- Row-name anatomy, owned here alone: :func:`namespace_of`, :func:`group_of`,
  :func:`shard_of`, :func:`same_chain`, :data:`shape_key` (namespace ‖ group: what fixes
  a page's shape). Other modules never slice a name themselves.
- :func:`engine_keys` — an engine's own page keys as kvbank page keys. A 32-byte key
  (SGLang's SHA-256, kvbank's own) is used as it is. Any other length (vLLM's 16-byte
  xxhash keys) is expanded to ``SHA-256(tag ‖ version ‖ scope digest ‖ layout id ‖
  len(key) as u32 ‖ key)``: deterministic, a different length can never produce the same
  key, and short keys are never padded with zeros (a zero-padded 16-byte key would be a
  32-byte key another engine could send).
- :func:`prompt_keys` — a prompt's chain, from token ids or from an engine's keys.

Nothing here depends on ``PYTHONHASHSEED``, the process or the host; golden vectors in
``tests/data/keys_golden.json`` pin the encoding. Changing it means bumping
:data:`KEY_VERSION`, which turns every old name into a miss, never a wrong hit.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from kvbank import checks
from kvbank.errors import InvalidInput, InvalidRowName, InvalidTokens

KEY_VERSION = 1
ROW_NAME_BYTES = 54
NAMESPACE_BYTES = 16
PAGE_KEY_BYTES = 32

MAX_ENGINE_KEY_BYTES = 1024  # longer engine keys are refused: a key, not a payload

_ROOT_TAG = b"kvbank/page-key\x00"
_ENGINE_TAG = b"kvbank/engine-key\x00"
_SCOPE_TAG = b"kvbank/scope\x00"
_NAMESPACE_TAG = b"kvbank/namespace\x00"
_INT32_MAX = 2**31 - 1

TokenIds = Sequence[int] | npt.NDArray[np.integer]  # a prompt's token ids, 1-D


def _lp(data: bytes) -> bytes:
    """Length-prefixed field: 4-byte little-endian length, then the bytes."""
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True, slots=True)
class Scope:
    """Who may share pages: tenant, cache salt, LoRA adapter digest. Empty = the default."""

    tenant: str = ""
    cache_salt: str = ""
    lora: str = ""  # adapter name or digest; pages of different adapters never mix
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        encoded: list[bytes] = []
        for name in ("tenant", "cache_salt", "lora"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidInput(f"scope.{name}: must be a string, got {type(value).__name__}")
            try:
                encoded.append(value.encode("utf-8"))
            except UnicodeEncodeError as exc:  # lone surrogates have no UTF-8 form
                raise InvalidInput(f"scope.{name}: not encodable as UTF-8: {exc}") from None
        body = _SCOPE_TAG + b"".join(map(_lp, encoded))
        object.__setattr__(self, "digest", hashlib.sha256(body).digest())


DEFAULT_SCOPE = Scope()


def _scope_digest(scope: Scope | bytes) -> bytes:
    if isinstance(scope, Scope):
        return scope.digest
    if isinstance(scope, bytes) and len(scope) == 32:
        return scope
    raise InvalidInput(f"scope: expected a Scope or a 32-byte digest, got {scope!r}")


def tokens_to_bytes(tokens: TokenIds) -> bytes:
    """Token ids as little-endian int32 bytes, refusing ids outside ``[0, 2**31)``."""
    if isinstance(tokens, (list, tuple)):
        # struct packs a list of ints about twice as fast as array('i') or numpy (16,000
        # ids: 0.2 ms) and refuses floats and ids beyond int32 itself; only negatives
        # (and bools) are left to check.
        try:
            packed = struct.pack(f"<{len(tokens)}i", *tokens)
        except struct.error as exc:
            raise InvalidTokens(f"tokens: every id must be an int in [0, {_INT32_MAX}]: {exc}") from None
        ids = np.frombuffer(packed, dtype="<i4")
        if packed and int(ids.min()) < 0:
            raise InvalidTokens(f"tokens: negative id {int(ids.min())}; ids must be in [0, {_INT32_MAX}]")
        _refuse_bools(tokens, ids)
        return packed
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:  # ragged nesting; a tensor numpy cannot read (GPU)
        raise InvalidTokens(
            f"tokens: expected a 1-D sequence or host array of int ids, got "
            f"{type(tokens).__name__} ({exc})"
        ) from None
    if arr.ndim != 1:
        raise InvalidTokens(f"tokens: must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):  # bool arrays included: not ids
        raise InvalidTokens(f"tokens: must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _INT32_MAX:
        bad = lo if lo < 0 else hi
        raise InvalidTokens(f"tokens: id {bad} is outside the int32 range [0, {_INT32_MAX}]")
    if isinstance(tokens, (list, tuple)):
        _refuse_bools(tokens, arr)
    return arr.astype("<i4", copy=False).tobytes()


def _refuse_bools(tokens: list[int] | tuple[int, ...], ids: np.ndarray) -> None:
    """struct and numpy both take True/False as 1/0: a bug upstream, not an id. Only
    the positions holding 0 or 1 can be bools, so only those are looked at."""
    if ids.size and int(ids.min()) <= 1:
        for i in np.flatnonzero(ids <= 1).tolist():
            if type(tokens[i]) is bool:
                raise InvalidTokens(f"tokens[{i}]: {tokens[i]!r} is a bool, not a token id",
                                    field=f"tokens[{i}]")


def root_key(scope: Scope | bytes = DEFAULT_SCOPE) -> bytes:
    """``k_0``: the chain's seed for a scope."""
    return hashlib.sha256(_ROOT_TAG + struct.pack("<I", KEY_VERSION) + _scope_digest(scope)).digest()


def page_keys(
    tokens: TokenIds,
    tokens_per_page: int,
    scope: Scope | bytes = DEFAULT_SCOPE,
    extra: Sequence[bytes | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of every full page of ``tokens``: ``len(tokens) // tokens_per_page`` of them.

    ``extra[i]`` (multimodal hashes, …) is mixed into page ``i``'s key. ``parent`` continues
    a chain whose earlier pages were keyed before (it replaces ``k_0``).
    """
    checks.count(tokens_per_page, "tokens_per_page", 1)
    data = tokens_to_bytes(tokens)
    n_pages = len(data) // (4 * tokens_per_page)
    if extra is not None and len(extra) > n_pages:
        raise InvalidInput(f"extra: {len(extra)} entries for {n_pages} full pages")
    if parent is None:
        prev = root_key(scope)
    elif isinstance(parent, bytes) and len(parent) == PAGE_KEY_BYTES:
        prev = parent
    else:
        raise InvalidInput(f"parent: expected a 32-byte page key, got {parent!r}")
    step = 4 * tokens_per_page
    sha = hashlib.sha256
    keys: list[bytes] = []
    append = keys.append
    if extra is None:
        for start in range(0, n_pages * step, step):
            prev = sha(prev + data[start : start + step]).digest()
            append(prev)
        return keys
    mv = memoryview(data)
    for i, start in enumerate(range(0, n_pages * step, step)):
        h = sha(prev)
        h.update(mv[start : start + step])
        e = extra[i] if i < len(extra) else None
        if e:
            h.update(e)
        prev = h.digest()
        append(prev)
    return keys


def namespace(layout_id: bytes, scope: Scope | bytes = DEFAULT_SCOPE) -> bytes:
    """The 16-byte namespace that prefixes every row name of a (scope, layout)."""
    if not isinstance(layout_id, bytes) or len(layout_id) != 32:
        raise InvalidInput(f"layout_id: expected 32 bytes, got {layout_id!r}")
    body = _NAMESPACE_TAG + struct.pack("<I", KEY_VERSION) + _scope_digest(scope) + layout_id
    return hashlib.sha256(body).digest()[:NAMESPACE_BYTES]


_TAIL = struct.Struct(">HHH")

NAMESPACE_SLICE = slice(0, NAMESPACE_BYTES)
PAGE_KEY_SLICE = slice(NAMESPACE_BYTES, NAMESPACE_BYTES + PAGE_KEY_BYTES)
GROUP_SLICE = slice(NAMESPACE_BYTES + PAGE_KEY_BYTES, NAMESPACE_BYTES + PAGE_KEY_BYTES + 2)
_CHAIN_TAIL = slice(NAMESPACE_BYTES + PAGE_KEY_BYTES, ROW_NAME_BYTES)  # group ‖ shard count ‖ index

# name -> (namespace, group bytes): rows with equal keys have the same page shape. An
# itemgetter so a lease of 64 rows maps it at C speed.
shape_key = itemgetter(NAMESPACE_SLICE, GROUP_SLICE)


def namespace_of(name: bytes) -> bytes:
    """The 16-byte namespace (scope and layout) a row name belongs to."""
    return name[NAMESPACE_SLICE]


def page_key_of(name: bytes) -> bytes:
    return name[PAGE_KEY_SLICE]


def group_of(name: bytes) -> int:
    """The layer group index a row name's page belongs to."""
    return int.from_bytes(name[GROUP_SLICE], "big")


def shard_of(name: bytes) -> tuple[int, int]:
    """``(shard_count, shard_index)`` of a row name."""
    _, count, index = _TAIL.unpack_from(name, NAMESPACE_BYTES + PAGE_KEY_BYTES)
    return count, index


def same_chain(a: bytes, b: bytes) -> bool:
    """The two rows can be links of one chain: same namespace, group and shard."""
    return a[NAMESPACE_SLICE] == b[NAMESPACE_SLICE] and a[_CHAIN_TAIL] == b[_CHAIN_TAIL]


@dataclass(frozen=True, slots=True)
class RowName:
    """A parsed row name; ``bytes(row)`` and :meth:`parse` are inverses."""

    namespace: bytes
    page_key: bytes
    group: int
    shard_count: int
    shard_index: int

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != NAMESPACE_BYTES:
            raise InvalidRowName(f"namespace: expected {NAMESPACE_BYTES} bytes, got {self.namespace!r}")
        if not isinstance(self.page_key, bytes) or len(self.page_key) != PAGE_KEY_BYTES:
            raise InvalidRowName(f"page_key: expected {PAGE_KEY_BYTES} bytes, got {self.page_key!r}")
        for name in ("group", "shard_count", "shard_index"):
            checks.count(getattr(self, name), name, 0, 0xFFFF, error=InvalidRowName)
        if self.shard_count == 0 or self.shard_index >= self.shard_count:
            raise InvalidRowName(
                f"shard_index: {self.shard_index} out of range for shard_count {self.shard_count}"
            )

    def __bytes__(self) -> bytes:
        return self.namespace + self.page_key + _TAIL.pack(
            self.group, self.shard_count, self.shard_index
        )

    @classmethod
    def parse(cls, raw: bytes) -> RowName:
        if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != ROW_NAME_BYTES:
            size = len(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else None
            raise InvalidRowName(f"row name: expected {ROW_NAME_BYTES} bytes, got {size}")
        raw = bytes(raw)
        group, count, index = _TAIL.unpack_from(raw, NAMESPACE_BYTES + PAGE_KEY_BYTES)
        return cls(raw[:NAMESPACE_BYTES], raw[NAMESPACE_BYTES : NAMESPACE_BYTES + PAGE_KEY_BYTES],
                   group, count, index)


def row_name(
    ns: bytes, page_key: bytes, group: int, shard_count: int = 1, shard_index: int = 0
) -> bytes:
    """The raw 54-byte row name (the form tiers and indexes store)."""
    return bytes(RowName(ns, page_key, group, shard_count, shard_index))


def engine_keys(
    keys: Sequence[bytes], layout_id: bytes, scope: Scope | bytes = DEFAULT_SCOPE
) -> list[bytes]:
    """An engine's page-key chain as 32-byte kvbank page keys (see the module docstring).

    Keys are expanded one by one, not re-chained: an engine's keys already chain (vLLM
    and SGLang hash each page with its parent's key), and expanding keeps that."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise InvalidInput(f"keys: expected a sequence of page keys, got {type(keys).__name__}")
    if not isinstance(layout_id, bytes) or len(layout_id) != 32:
        raise InvalidInput(f"layout_id: expected 32 bytes, got {layout_id!r}")
    prefix = _ENGINE_TAG + struct.pack("<I", KEY_VERSION) + _scope_digest(scope) + layout_id
    sha = hashlib.sha256
    out: list[bytes] = []
    for i, k in enumerate(keys):
        if type(k) is not bytes or not 0 < len(k) <= MAX_ENGINE_KEY_BYTES:
            shown = len(k) if isinstance(k, (bytes, bytearray)) else type(k).__name__
            raise InvalidInput(f"keys[{i}]: expected a page key of 1..{MAX_ENGINE_KEY_BYTES} bytes, got {shown}")
        out.append(k if len(k) == PAGE_KEY_BYTES else sha(prefix + _lp(k)).digest())
    return out


def prompt_keys(
    tokens: TokenIds | None, keys: Sequence[bytes] | None, tokens_per_page: int,
    layout_id: bytes, scope: Scope = DEFAULT_SCOPE,
) -> list[bytes]:
    """A prompt's page-key chain: :func:`page_keys` of its token ids, or :func:`engine_keys`
    of an engine's own chain ``keys`` (exactly one of the two is given)."""
    if not isinstance(scope, Scope):
        raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
    if tokens is not None and keys is None:
        return page_keys(tokens, tokens_per_page, scope)
    if keys is not None and tokens is None:
        return engine_keys(keys, layout_id, scope)
    raise InvalidInput("tokens: give either tokens or keys (a page-key chain), not both or neither")


def sized_bytes(values: Sequence[object], size: int) -> bool:
    """Whether every one of ``values`` is ``bytes`` of exactly ``size`` bytes: two C
    passes (a whole prompt's keys or row names), where a loop of checks costs ~0.1 ms a
    thousand."""
    return set(map(type, values)) <= {bytes} and set(map(len, values)) <= {size}  # type: ignore[arg-type]


def row_names(
    ns: bytes, keys: Sequence[bytes], group: int, shard_count: int = 1, shard_index: int = 0
) -> list[bytes]:
    """Row names of a key chain for one group and shard, validated once."""
    tail = bytes(RowName(ns, b"\0" * PAGE_KEY_BYTES, group, shard_count, shard_index))[
        NAMESPACE_BYTES + PAGE_KEY_BYTES :
    ]
    if not sized_bytes(keys, PAGE_KEY_BYTES):
        for k in keys:
            if not isinstance(k, bytes) or len(k) != PAGE_KEY_BYTES:
                raise InvalidInput(f"page key: expected {PAGE_KEY_BYTES} bytes, got {k!r}")
    return [ns + k + tail for k in keys]
