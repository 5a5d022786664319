"""``kvbank bench bank``: the user's data path, ``Bank.put`` / ``match`` + ``fetch``.

64 pages of 2 MiB of a 32-layer x 2 x 16 tokens x 8 heads x 128 bfloat16 layout, random
normal (``bank-*``) or real KV of a trained model (``bank-*-real``,
:mod:`kvbank.bench.realkv`). Every timed call writes into preallocated, already touched
buffers. Each repetition opens a fresh bank (untimed: a user opens it once per process)
and times one call on it; the baseline is a memcpy of the same bytes between two
preallocated tensors in the same process, on 2 torch threads, timed right after it.
Values are medians over the repetitions.

The host baseline is timed after the fetch, not between the put and the fetch: torch's
OpenMP workers keep spinning for a while after a parallel copy returns (libgomp's default
wait policy), so a baseline timed just before the fetch took one of the two cores from
the fetch's copy lanes (3-10 % of ``bank-fetch-host``, measured with
``OMP_WAIT_POLICY=PASSIVE`` as the control). After the fetch it costs nothing timed.

=========================  ===========================================================
case                       what is timed (GB/s of raw page bytes)
=========================  ===========================================================
bank-put-host              ``Bank.put`` of the 64 pages into a freshly opened bank's host
                           tier (``reserve_host``: its budget pre-faulted at open, waited
                           for untimed), hashing of the tokens included
bank-fetch-host            ``match`` + ``fetch`` of those pages into a ``[64, 2 MiB]``
                           buffer
bank-put-disk-durable      ``Bank.put`` with write-through and fsync into a fresh bank and
                           data folder: returns when every page is durable on disk
bank-fetch-disk            a bank reopened on that folder (rows only on disk, none in
                           memory; page cache warm): ``match`` + ``fetch``
bank-disk-footprint-bf16   bytes of the data folder's files (segments and index) / raw
                           bytes after the write-through put (metric ``x``; the baseline
                           is raw bytes, 1.0)
bank-disk-encode-only      the disk tier's codec alone (its level, the layout's dtype:
                           the frames the put wrote, byte for byte) over the same pages
                           on as many lanes as the store's batches (``copy_threads``);
                           no host copy, no LMDB: the ceiling of
                           ``bank-put-disk-durable`` on this machine
bank-disk-decode-only      ``codec.decode_into`` of those frames into the same
                           preallocated buffer, on the same lanes: the ceiling of
                           ``bank-fetch-disk``
bank-put-disk              ``Bank.put`` with write-through, no fsync (``disk_sync`` off),
                           into a fresh bank and data folder; baseline: one ``write`` of
                           the same raw bytes into a new file in the same file system,
                           no fsync, timed right after it
disk-get-warm-vs-raw       the fetch of ``bank-fetch-disk`` (rows only on disk, page
                           cache warm); baseline: one ``readinto`` of the same pages'
                           raw bytes from a file in the page cache into the same
                           preallocated buffer, timed right after it
disk-put-durable-vs-       the put of ``bank-put-disk-durable`` (write-through, until
fdatasync                  durable); baseline: ``write`` + ``fdatasync`` of the same raw
                           bytes into a new file in the same file system, timed right
                           after it
=========================  ===========================================================

Each case also runs on real KV (``-real``). The file baselines are single calls of the
kernel's own copy (no Python loop); a new file each time, as each put gets a fresh folder.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvbank.bank.bank import Bank
from kvbank.bench.common import BenchRow, row
from kvbank.builders import full_attention
from kvbank.codec import decode_into, encode
from kvbank.config import WritePolicy
from kvbank.tiers.disk import DEFAULT_LEVEL as DISK_LEVEL
from kvbank.tiers.store.copier import Lanes, default_copy_threads

SUITE = "bank"
GB = 1e9
LAYOUT = full_attention("bench-bank@1", num_layers=32, num_kv_heads=8, head_dim=128,
                        tokens_per_page=16)
PAGE = LAYOUT.group_page_bytes[0]  # 2 MiB
BASELINE = "memcpy of the same bytes, preallocated, 2 torch threads"
RAW_WRITE = "write of the same raw bytes to a new file on the same file system, no fsync"
RAW_DURABLE = "write + fdatasync of the same raw bytes to a new file on the same file system"
RAW_READ = "readinto of the same raw bytes from a file in the page cache"
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _raw_write(folder: Path, pages: torch.Tensor, *, sync: bool) -> float:
    """Seconds to write the pages' bytes into a new file in ``folder`` (and fdatasync)."""
    path = folder / "raw-baseline.bin"
    data = pages.numpy().data.cast("B")
    fd = os.open(path, _NEW, 0o600)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        if sync:
            os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()


def _raw_read(path: Path, out: torch.Tensor) -> float:
    """Seconds to ``readinto`` the file's bytes (in the page cache) into ``out``."""
    dst = out.numpy().data.cast("B")
    with open(path, "rb", buffering=0) as f:
        t0 = time.perf_counter()
        got = f.readinto(dst)
        took = time.perf_counter() - t0
    assert got == len(dst), "bench: the raw file is short"
    return took


def _folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (the data dir's footprint)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _random_pages(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10)
    vals = torch.randn(n, PAGE // 2, generator=g).to(torch.bfloat16)
    return vals.view(torch.uint8).reshape(n, PAGE).contiguous()


class _Memcpy:
    """The baseline: the same bytes copied between two preallocated, touched tensors."""

    def __init__(self, pages: torch.Tensor) -> None:
        self.src = pages
        self.dst = torch.empty_like(pages)
        self.dst.copy_(pages)  # touched: no page faults in the timed copies

    def __call__(self) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rates(nbytes: int, ours: list[float], base: list[float]) -> tuple[float, float]:
    return nbytes / statistics.median(ours) / GB, nbytes / statistics.median(base) / GB


def _host(pages: torch.Tensor, tokens: list[int], repeat: int, tail: str) -> Iterator[BenchRow]:
    n = pages.shape[0]
    memcpy = _Memcpy(pages)
    out = torch.empty_like(pages)
    out.zero_()
    put_t: list[float] = []
    fetch_t: list[float] = []
    base_t: list[float] = []
    for _ in range(repeat):
        with Bank.open(host_bytes=2 * n * PAGE, device_bytes=0, data_dir=None,
                       reserve_host=True) as b:
            r = b.reservation
            if r is not None:
                r.wait(60)
            lid = b.register(LAYOUT)
            put_t.append(_timed(functools.partial(b.put, lid, tokens, group=0, pages=pages)))
            t0 = time.perf_counter()
            got = b.fetch(b.match(lid, tokens), out={0: out})
            fetch_t.append(time.perf_counter() - t0)
            base_t.append(memcpy())  # after the fetch: see the module docstring
            assert got.complete, "bench: the fetch missed rows"
    nbytes = n * PAGE
    v, bv = _rates(nbytes, put_t, base_t)
    yield row(SUITE, "bank-put-host" + tail, "GB/s", v, BASELINE, bv)
    v, bv = _rates(nbytes, fetch_t, base_t)
    yield row(SUITE, "bank-fetch-host" + tail, "GB/s", v, BASELINE, bv)


def _disk(pages: torch.Tensor, tokens: list[int], repeat: int, tail: str) -> Iterator[BenchRow]:
    n = pages.shape[0]
    memcpy = _Memcpy(pages)
    out = torch.empty_like(pages)
    out.zero_()
    t: dict[str, list[float]] = {k: [] for k in (
        "put", "base", "fsync", "fetch", "readinto", "put_nosync", "write", "enc", "dec")}
    footprint = 0.0
    root = Path(tempfile.mkdtemp(prefix="kvbank-bench-bank-"))
    try:
        for i in range(repeat):
            folder = root / f"put-{i}"
            with Bank.open(host_bytes=2 * n * PAGE, device_bytes=0, data_dir=folder,
                           disk_bytes=4 * n * PAGE, disk_sync=True, reserve_host=True,
                           write_policy=WritePolicy.WRITE_THROUGH) as b:
                r = b.reservation
                if r is not None:
                    r.wait(60)
                lid = b.register(LAYOUT)
                t["put"].append(_timed(functools.partial(b.put, lid, tokens, group=0,
                                                         pages=pages)))
                t["fsync"].append(_raw_write(root, pages, sync=True))
                t["base"].append(memcpy())
            footprint = _folder_bytes(folder / "lmdb") + _folder_bytes(folder / "segments")
            footprint /= n * PAGE
            if i:
                shutil.rmtree(folder, ignore_errors=True)
        for i in range(repeat):
            folder = root / f"nosync-{i}"
            with Bank.open(host_bytes=2 * n * PAGE, device_bytes=0, data_dir=folder,
                           disk_bytes=4 * n * PAGE, disk_sync=False, reserve_host=True,
                           write_policy=WritePolicy.WRITE_THROUGH) as b:
                r = b.reservation
                if r is not None:
                    r.wait(60)
                lid = b.register(LAYOUT)
                t["put_nosync"].append(_timed(functools.partial(b.put, lid, tokens, group=0,
                                                                pages=pages)))
                t["write"].append(_raw_write(root, pages, sync=False))
            shutil.rmtree(folder, ignore_errors=True)
        raw = root / "raw-pages.bin"  # the readinto baseline's file, in the page cache
        raw.write_bytes(pages.numpy().data.cast("B"))
        _raw_read(raw, out)
        keep = root / "put-0"  # rows only on disk: each reopened bank starts host-empty
        for _ in range(repeat):
            with Bank.open(host_bytes=2 * n * PAGE, device_bytes=0, data_dir=keep,
                           disk_bytes=4 * n * PAGE, reserve_host=True) as b:
                r = b.reservation
                if r is not None:
                    r.wait(60)
                lid = b.register(LAYOUT)
                t0 = time.perf_counter()
                got = b.fetch(b.match(lid, tokens), out={0: out})
                t["fetch"].append(time.perf_counter() - t0)
                assert got.complete, "bench: the disk fetch missed rows"
                assert torch.equal(out, pages), "bench: the disk fetch returned other bytes"
                t["readinto"].append(_raw_read(raw, out))
        # Not right after a memcpy: torch's OpenMP workers still spin then (see above).
        _codec_ceilings(pages, out, repeat, t["enc"], t["dec"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = n * PAGE

    def rated(case: str, ours: str, base: str, baseline: str) -> BenchRow:
        v, bv = _rates(nbytes, t[ours], t[base])
        return row(SUITE, case + tail, "GB/s", v, baseline, bv)

    yield rated("bank-put-disk-durable", "put", "base", BASELINE)
    yield rated("bank-fetch-disk", "fetch", "base", BASELINE)
    yield row(SUITE, "bank-disk-footprint-bf16" + tail, "x", footprint, "raw bytes", 1.0)
    yield rated("bank-disk-encode-only", "enc", "base", BASELINE)
    yield rated("bank-disk-decode-only", "dec", "base", BASELINE)
    yield rated("bank-put-disk", "put_nosync", "write", RAW_WRITE)
    yield rated("disk-get-warm-vs-raw", "fetch", "readinto", RAW_READ)
    yield rated("disk-put-durable-vs-fdatasync", "put", "fsync", RAW_DURABLE)


def _codec_ceilings(pages: torch.Tensor, out: torch.Tensor, repeat: int,
                    enc_t: list[float], dec_t: list[float]) -> None:
    """Time the disk tier's codec alone (its level, the layout's dtype) over the pages
    and over the frames it made (decoded into ``out``), on as many lanes as a bank's
    batches use."""
    dtype = LAYOUT.page_dtype(0)
    src = [pages[i].numpy().data for i in range(pages.shape[0])]
    dst = [out[i].numpy().data for i in range(out.shape[0])]

    def enc(p: memoryview) -> bytes:
        return encode(p, dtype, level=DISK_LEVEL)

    lanes = Lanes(default_copy_threads())
    try:
        frames = lanes.map(enc, src)
        for _ in range(repeat):
            enc_t.append(_timed(functools.partial(lanes.map, enc, src)))
            dec_t.append(_timed(functools.partial(
                lanes.map, lambda i: decode_into(frames[i], dst[i]), range(len(frames)))))
    finally:
        lanes.close()
    assert torch.equal(out, pages), "bench: the decode returned other bytes"


def run(quick: bool = False) -> Iterator[BenchRow]:
    logging.getLogger("kvbank.tiers").setLevel(logging.ERROR)  # "device tier off" once
    n = 16 if quick else 64
    repeat = 3 if quick else 7
    tokens = list(range(n * LAYOUT.tokens_per_page + 1))
    sources: tuple[tuple[str, Callable[[int], torch.Tensor]], ...] = (
        ("", _random_pages), ("-real", _real_pages))
    for tail, make in sources:
        p = make(n)
        yield from _host(p, tokens, repeat, tail)
        yield from _disk(p, tokens, repeat, tail)


def _real_pages(n: int) -> torch.Tensor:
    from kvbank.bench.realkv import real_pages

    return real_pages("bfloat16", PAGE, n).contiguous()
