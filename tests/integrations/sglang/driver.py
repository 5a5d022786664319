"""A process holding SGLang's real ``HiCacheController`` over a real host pool, with the
kvbank backend attached: one JSON command a line on stdin, one ``RESULT`` line each.

Commands: ``{"op": "store", "seed": s, "tokens": n}`` (a prompt's pages written to host
slots with random bytes, then ``write_storage``; the pages saved to ``path``),
``{"op": "load", "seed": s, "tokens": n, "path": p}`` (``prefetch``; the loaded pages
compared with the saved ones), ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import warnings

warnings.simplefilter("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def main() -> None:
    arg = json.loads(sys.argv[1])
    import torch

    from kvbank.integrations.sglang.harness import Controller, mha_pools

    extra = {"backend_name": "kvbank", "module_path": "kvbank.integrations.sglang",
             "class_name": "KvbankHiCacheStorage", "interface_v1": arg.get("v1", 1),
             "kvbank_url": arg["url"], "timeout_s": 2, "retry_s": 0.2}
    _, alloc, host = mha_pools(tokens=512)
    cc = Controller(alloc, host, extra=extra, model_name=arg["model"])
    print("RESULT " + json.dumps({"backend": type(cc.backend).__name__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, object] = {}
        try:
            if cmd["op"] == "quit":
                break
            toks = prompt(cmd["tokens"], cmd["seed"])
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
        except Exception as exc:  # the test asserts no exception reached the controller
            out["error"] = f"{type(exc).__name__}: {exc}"
        print("RESULT " + json.dumps(out), flush=True)
    cc.close()


if __name__ == "__main__":
    main()
