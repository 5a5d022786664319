"""A process holding SGLang's real ``HiCacheController`` over a real host pool, with the
kvbank backend attached: one JSON command a line on stdin, one ``RESULT`` line each.

Commands: ``{"op": "store", "seed": s, "tokens": n}`` (a prompt's pages written to host
slots with random bytes, then ``write_storage``; the pages saved to ``path``),
``{"op": "load", "seed": s, "tokens": n, "path": p}`` (``prefetch``; the loaded pages
compared with the saved ones), ``{"op": "quit"}``.

A real ``MambaPoolHost`` is registered with the backend as SGLang's hybrid controller
registers its sidecar (``register_mem_host_pool_v2``), and driven by the calls that
controller makes: ``{"op": "state_store", "seed": s, "tokens": n, "at": [pages], "path": p}``
(random snapshots in host slots, ``batch_set_v2`` each with its page's key, saved to
``path``); ``{"op": "state_load", ...}`` (``batch_exists_v2`` of the prompt with the pool
as ``TRAILING_PAGES``, then ``batch_get_v2`` of each stored snapshot into a fresh slot,
compared with the saved ones); ``{"op": "diff", "cases": k, "dir": d}``
(``batch_exists_v2`` against SGLang's own ``HiCacheFile`` on ``k`` random cases of KV
holes, snapshots and policies); ``{"op": "layouts", ...}`` (pages stored from a pool of
each host layout, with ``interface_v1`` and with the legacy flat-page calls, loaded into a
pool of every layout, compared as SGLang's own buffers hold them); ``{"op": "threads", ...}`` (four threads
storing, querying and loading prompts of their own through the one backend at once, as
SGLang's backup, prefetch and IO threads do).

Started with ``"hybrid": true``, the process holds SGLang's real ``HybridCacheController``
instead, over a ``HostPoolGroup`` of the KV pool and the Mamba pool (the harness's
:class:`HybridController`), and takes two commands: ``{"op": "store", "seed": s, "tokens":
n, "nodes": [pages], "path": p, "prefix_keys": b}`` (the prompt backed up as radix nodes ending
at those pages, each with its state, with its parent's keys when ``b``; the KV pages and the
states saved to ``path``) and ``{"op": "load",
"seed": s, "tokens": n, "keep": k, "path": p}`` (a prefetch of the prompt, its tokens from
``k`` on replaced when ``k`` is given; the loaded pages and state compared with the saved
ones). Both answer the page counts of the backend's calls (SGLang's ``get_stats``).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

warnings.simplefilter("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def main() -> None:
    arg = json.loads(sys.argv[1])
    if arg.get("hybrid"):
        hybrid_main(arg)
        return
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvbank.integrations.sglang.harness import Controller, mamba_pool, mha_pools

    _, alloc, host = mha_pools(tokens=512)
    cc = Controller(alloc, host, extra=_extra(arg), model_name=arg["model"])
    mamba = mamba_pool()
    cc.backend.register_mem_host_pool_v2(host, PoolName.KV)
    cc.backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    print("RESULT " + json.dumps({"backend": type(cc.backend).__name__}), flush=True)

    def handle(cmd: dict[str, Any], toks: list[int]) -> dict[str, object]:
        out: dict[str, object] = {}
        if cmd["op"] == "store":
            out["stored"] = cc.store(toks)
            torch.save(cc.pages(cc.stored), cmd["path"])
        elif cmd["op"] == "load":
            hit, _, idx = cc.load([*toks, 7])
            out["hit"] = hit
            if idx is not None:
                want = torch.load(cmd["path"])
                got = cc.pages(idx)
                out["pages"] = len(got)
                out["equal"] = len(got) == len(want) and all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(want, got, strict=True))
        elif cmd["op"] == "state_store":
            out.update(state_store(cc, mamba, toks, cmd["at"], cmd["path"]))
        elif cmd["op"] == "state_load":
            out.update(state_load(cc, mamba, toks, cmd["path"]))
        elif cmd["op"] == "layouts":
            out.update(layouts(arg["url"], toks, cmd["seed"]))
        elif cmd["op"] == "threads":
            out.update(threads(cc, toks, cmd["seed"]))
        elif cmd["op"] == "diff":
            out.update(diff(arg["url"], host, mamba, cmd["cases"], cmd["dir"], cmd["seed"]))
        return out

    _serve(handle)
    cc.close()


def hybrid_main(arg: dict[str, object]) -> None:
    """The ``"hybrid": true`` process (module docstring)."""
    import torch

    from kvbank.integrations.sglang.harness import HybridController, mamba_pool, mha_pools

    dev, alloc, host = mha_pools(tokens=512)
    cc = HybridController(dev, alloc, host, mamba_pool(), extra=_extra({**arg, "v1": 1}),
                          model_name=str(arg["model"]))
    print("RESULT " + json.dumps({"backend": type(cc.backend).__name__,
                                  "pools": [str(e.name) for e in cc.group.entries]}), flush=True)

    def handle(cmd: dict[str, Any], toks: list[int]) -> dict[str, object]:
        out: dict[str, object] = {}
        if cmd["op"] == "store":
            out["stored"] = cc.store(toks, cmd["nodes"], seed=cmd["seed"],
                                     prefix_keys=bool(cmd.get("prefix_keys")))
            torch.save({"kv": cc.kv_stored, "states": cc.states_stored}, cmd["path"])
        elif cmd["op"] == "load":
            if cmd.get("keep") is not None:
                toks = toks[: cmd["keep"]] + prompt(len(toks) - cmd["keep"], cmd["seed"] + 1)
            got = cc.load([*toks, 7])
            out.update(hit=got.hit_tokens, restorable=got.restorable, loaded=got.loaded_tokens,
                       pool_hits=got.pool_hits)
            if got.kv_slots is not None and got.state_slot is not None:
                want = torch.load(cmd["path"])
                pages = cc.pages(got.kv_slots)
                out["kv_equal"] = len(pages) <= len(want["kv"]) and all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(pages, want["kv"], strict=False))
                end = got.hit_tokens // cc.page_size
                out["state_equal"] = end in want["states"] and torch.equal(cc.state(got.state_slot),
                                                                            want["states"][end])
        stats = cc.backend.get_stats()
        out["calls"] = {"backup_pages": stats.backup_pgs, "prefetch_pages": stats.prefetch_pgs}
        return out

    _serve(handle)
    cc.close()


def _extra(arg: dict[str, Any]) -> dict[str, object]:
    """The backend's ``--hicache-storage-backend-extra-config``, as ``dynamic`` reads it."""
    return {"backend_name": "kvbank", "module_path": "kvbank.integrations.sglang",
            "class_name": "KvbankHiCacheStorage", "interface_v1": arg.get("v1", 1),
            "kvbank_url": arg["url"], "timeout_s": 2, "retry_s": 0.2}


def _serve(handle: Callable[[dict[str, Any], list[int]], dict[str, object]]) -> None:
    """One ``RESULT`` line for each command line on stdin, until ``quit``: what ``handle``
    answers for the command and its prompt, or the exception it raised (the tests assert
    none reached the controller)."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            out = handle(cmd, prompt(cmd["tokens"], cmd["seed"]))
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print("RESULT " + json.dumps(out), flush=True)


def _mamba(keys: list[str], n: int = 1, host_indices: object = None, all_pages: bool = False) -> object:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    policy = PoolHitPolicy.ALL_PAGES if all_pages else PoolHitPolicy.TRAILING_PAGES
    return PoolTransfer(name=PoolName.MAMBA, host_indices=host_indices, keys=keys[-n:] if n else keys,
                        hit_policy=policy)


def state_store(cc: object, mamba: object, toks: list[int], at: list[int], path: str) -> dict[str, object]:
    import torch

    from kvbank.integrations.sglang.harness import page_hashes

    keys = page_hashes(toks, 16)
    g = torch.Generator().manual_seed(len(toks))
    saved, ok = {}, []
    for p in at:
        slot = mamba.alloc(1)  # type: ignore[attr-defined]
        data = torch.randint(0, 255, (mamba.get_dummy_flat_data_page().numel(),), generator=g,  # type: ignore[attr-defined]
                             dtype=torch.uint8)
        mamba.set_from_flat_data_page(int(slot[0]), data)  # type: ignore[attr-defined]
        saved[p] = mamba.get_data_page(int(slot[0])).clone()  # type: ignore[attr-defined]
        got = cc.backend.batch_set_v2([_mamba(keys[:p], 1, slot)])  # type: ignore[attr-defined]
        ok.append(got["mamba"])
    torch.save(saved, path)
    return {"stored": ok}


def state_load(cc: object, mamba: object, toks: list[int], path: str) -> dict[str, object]:
    import torch

    from kvbank.integrations.sglang.harness import page_hashes

    keys = page_hashes(toks, 16)
    res = cc.backend.batch_exists_v2(keys, [_mamba(keys)])  # type: ignore[attr-defined]
    want = torch.load(path)
    equal = []
    for p in res.restorable_prefix_pages or []:
        slot = mamba.alloc(1)  # type: ignore[attr-defined]
        got = cc.backend.batch_get_v2([_mamba(keys[:p], 1, slot)])  # type: ignore[attr-defined]
        equal.append(got["mamba"] == [True] and torch.equal(
            mamba.get_data_page(int(slot[0])), want[p]))  # type: ignore[attr-defined]
    return {"kv_hit_pages": res.kv_hit_pages, "restorable": res.restorable_prefix_pages,
            "pool_hits": {str(k): v for k, v in res.extra_pool_hit_pages.items()}, "equal": equal}


def diff(url: str, host: object, mamba: object, cases: int, root: str, seed: int) -> dict[str, object]:
    """``batch_exists_v2`` of kvbank and of SGLang's HiCacheFile on the same random cases."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvbank.integrations.sglang import KvbankHiCacheStorage
    from kvbank.integrations.sglang.harness import file_backend, page_hashes, storage_config

    rng = random.Random(seed)
    mismatches = []
    for case in range(cases):
        model = f"diff-{seed}-{case}"
        ours = KvbankHiCacheStorage(storage_config(model, {"kvbank_url": url}), {})
        theirs = file_backend(model, f"{root}/{case}")
        for b in (ours, theirs):
            b.register_mem_pool_host(host)
            b.register_mem_host_pool_v2(host, PoolName.KV)
            b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        n = rng.randrange(2, 9)
        keys = page_hashes(prompt(n * 16, rng.randrange(1 << 30)), 16)
        kv = [rng.random() < 0.85 for _ in range(n)]
        states = [rng.random() < 0.5 for _ in range(n)]
        slots = host.alloc(16)  # type: ignore[attr-defined]
        slot = mamba.alloc(1)  # type: ignore[attr-defined]
        for i in range(n):
            if kv[i]:
                assert ours.batch_set_v1([keys[i]], slots) == [True]
                assert theirs.batch_set([keys[i]], [host.get_data_page(int(slots[0]))])  # type: ignore[attr-defined]
            if states[i]:
                for b in (ours, theirs):
                    assert b.batch_set_v2([_mamba(keys[: i + 1], 1, slot)]) == {"mamba": [True]}
        trailing, all_pages = rng.choice([(1, False), (2, False), (0, True)])
        t = [_mamba(keys, trailing, None, all_pages)]
        a, b = ours.batch_exists_v2(keys, t), theirs.batch_exists_v2(keys, t)
        got = (a.kv_hit_pages, dict(a.extra_pool_hit_pages), list(a.restorable_prefix_pages or []))
        want = (b.kv_hit_pages, {str(k): v for k, v in b.extra_pool_hit_pages.items()},
                list(b.restorable_prefix_pages or []))
        if got != want:
            mismatches.append({"kv": kv, "states": states, "policy": [trailing, all_pages],
                               "kvbank": repr(got), "file": repr(want)})
        host.free(slots)  # type: ignore[attr-defined]
        mamba.free(slot)  # type: ignore[attr-defined]
        ours.close()
    return {"cases": cases, "mismatches": mismatches}


def threads(cc: object, toks: list[int], seed: int, workers: int = 4, rounds: int = 3) -> dict[str, object]:
    """Each worker: a prompt of its own stored (``batch_set_v1``), found (``batch_exists``)
    and loaded into other slots (``batch_get_v1``), ``rounds`` times; the failures."""
    import threading

    import torch

    from kvbank.integrations.sglang.harness import page_hashes

    backend, host = cc.backend, cc.host  # type: ignore[attr-defined]
    slots = [(host.alloc(64), host.alloc(64)) for _ in range(workers)]  # the pool's alloc is not thread-safe
    bad: list[str] = []

    def work(w: int) -> None:
        src, dst = slots[w]
        for r in range(rounds):
            keys = page_hashes(prompt(64, seed * 1000 + w * 10 + r), 16)
            g = torch.Generator().manual_seed(w * 10 + r)
            for i in range(4):
                page = host.get_data_page(int(src[i * 16]), flat=True)
                host.set_from_flat_data_page(int(src[i * 16]), torch.randn(page.numel(), generator=g).to(page.dtype))
            if not all(backend.batch_set_v1(keys, src)) or backend.batch_exists(keys) != 4 \
                    or not all(backend.batch_get_v1(keys, dst)):
                bad.append(f"worker {w} round {r}: a call failed")
                continue
            for i in range(4):
                if not torch.equal(host.get_data_page(int(src[i * 16])).view(torch.uint8),
                                   host.get_data_page(int(dst[i * 16])).view(torch.uint8)):
                    bad.append(f"worker {w} round {r}: page {i} differs")

    ts = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for src, dst in slots:
        host.free(src)
        host.free(dst)
    return {"failures": bad}


HOST_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


def logical(host: object) -> object:
    """A host pool's K and V as ``[2, layers, slots, heads, dim]``, read from its
    ``kv_buffer`` by the dims SGLang's ``init_kv_buffer`` gives each layout."""
    kv = host.kv_buffer  # type: ignore[attr-defined]
    lay = host.layout  # type: ignore[attr-defined]
    if lay == "layer_first":
        return kv
    if lay == "page_first":
        return kv.permute(0, 2, 1, 3, 4)
    two, pages, layers, p, h, d = (kv.shape if lay == "page_first_direct" else
                                   (kv.shape[0], kv.shape[1], kv.shape[4], kv.shape[3], kv.shape[2], kv.shape[5]))
    t = kv.permute(0, 2, 1, 3, 4, 5) if lay == "page_first_direct" else kv.permute(0, 4, 1, 3, 2, 5)
    return t.reshape(two, layers, pages * p, h, d)


def layouts(url: str, toks: list[int], seed: int) -> dict[str, object]:
    """Every (stored from, loaded into, call kind) combination: whether the loaded slots
    hold what the stored slots held."""
    import torch

    from kvbank.integrations.sglang import KvbankHiCacheStorage
    from kvbank.integrations.sglang.harness import mha_pools, page_hashes, storage_config

    keys = page_hashes(toks, 16)
    n = len(keys)
    bad = []
    for v1 in (True, False):
        for src_layout in HOST_LAYOUTS:
            model = f"layouts-{seed}-{src_layout}-{v1}"
            _, _, src = mha_pools(tokens=128, layout=src_layout)
            w = KvbankHiCacheStorage(storage_config(model, {"kvbank_url": url}), {})
            w.register_mem_pool_host(src)
            idx = src.alloc(n * 16)
            g = torch.Generator().manual_seed(seed)
            for i in range(n):
                page = src.get_data_page(int(idx[i * 16]), flat=True)
                src.set_from_flat_data_page(int(idx[i * 16]), torch.randn(page.numel(), generator=g).to(page.dtype))
            ok = all(w.batch_set_v1(keys, idx)) if v1 else w.batch_set(
                keys, [src.get_data_page(int(idx[i * 16]), flat=True) for i in range(n)])
            if not ok:
                bad.append(f"store from {src_layout} (v1={v1})")
                continue
            want = logical(src)[:, :, idx]  # type: ignore[index]
            for dst_layout in HOST_LAYOUTS:
                _, _, dst = mha_pools(tokens=128, layout=dst_layout)
                r = KvbankHiCacheStorage(storage_config(model, {"kvbank_url": url}), {})
                r.register_mem_pool_host(dst)
                didx = dst.alloc(n * 16 + 16)[16:]  # other slots than the source's
                if v1:
                    loaded = r.batch_exists(keys) == n and all(r.batch_get_v1(keys, didx))
                else:
                    pages = r.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
                    loaded = all(p is not None for p in pages)
                    for i, p in enumerate(pages):
                        if p is not None:
                            dst.set_from_flat_data_page(int(didx[i * 16]), p)
                if not loaded or not torch.equal(logical(dst)[:, :, didx].view(torch.uint8),  # type: ignore[index]
                                                 want.view(torch.uint8)):
                    bad.append(f"{src_layout} -> {dst_layout} (v1={v1})")
                r.close()
            w.close()
    return {"mismatches": bad}


if __name__ == "__main__":
    main()
