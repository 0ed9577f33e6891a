"""vLLM's CPU build as a system under test, in vLLM's own venv: `python -m benchmarks.peers.vllm.worker SPEC RESULT`.

It imports nothing of batchrun (vLLM's venv does not have batchrun's dependencies), only the standard-library
clock and the workload format, so it times and reports exactly as `benchmarks.harness.worker` does: the model loads
untimed, a short warm-up request runs, then one `generate` of the whole workload is timed. Requests are token
ids with exact output lengths (greedy, EOS ignored, min_tokens = max_tokens), like every other system's. A spec with
`task: loglik` scores the loglikelihood items instead (task_vllm_loglik), `task: embed` embeds texts (task_vllm_embed).
The environment (tcmalloc and Intel OpenMP preloaded, thread binding, KV space, the engine in-process) is
set by `benchmarks.peers.vllm.env.environment` before this process starts.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from benchmarks.harness.clock import Clock, Result, best_of, rss_mb
from benchmarks.harness.embed import EmbedTexts, timed_embedding
from benchmarks.harness.loglik import LoglikWorkload, lm_eval_order, score_prompt_logprobs
from benchmarks.harness.workload import Decoding, Workload
from benchmarks.peers import worker

WARMUP_PROMPT = list(range(10, 42))  # the same as benchmarks.harness.worker's
WARMUP_TOKENS = 4


def _params(o: int, d: Decoding | None = None) -> Any:
    """Request i's SamplingParams as the workload's decoding says (the same fields as batchrun's worker)."""
    from vllm import SamplingParams

    if d is None:
        return SamplingParams(temperature=0.0, max_tokens=o, min_tokens=o, ignore_eos=True)
    kw: dict[str, Any] = dict(n=d.n, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, max_tokens=o)
    # No per-request seed: vLLM 0.32's CPU runner fails on a seeded request whose sampled token it discards (a
    # prompt prefilled in chunks, a preempted request: it rewinds the request's generator by an offset, and "CPU
    # Generator does not use offset"). Its rows draw from the engine's generator (LLM(seed=0)) instead: the same
    # distribution, reproducible for the whole run, and vLLM's cheaper path (no generator per request).
    if d.stop_at_eos:
        kw["stop_token_ids"] = list(d.eos_token_ids)
    else:
        kw.update(min_tokens=o, ignore_eos=True)
    return SamplingParams(**kw)


def _versions(res: Result) -> Result:
    """A result with the vLLM version and the torch threads it ran with."""
    import torch
    import vllm

    res["vllm_version"] = vllm.__version__
    res["torch_threads"] = torch.get_num_threads()
    return res


def _prompts(prompts: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def task_vllm(spec: dict[str, Any]) -> Result:
    import torch
    from vllm import LLM

    wl = Workload.from_json(spec["workload"])
    runs = []
    for _ in range(spec.get("repeat", 1)):
        t = time.perf_counter()
        llm = LLM(model=spec["model_path"], dtype=spec.get("dtype", "float32"), seed=0,
                  max_model_len=spec["max_model_len"], **spec.get("vllm_kwargs", {}))
        load_s, load_rss = time.perf_counter() - t, rss_mb()
        llm.generate(_prompts([WARMUP_PROMPT]), _params(WARMUP_TOKENS), use_tqdm=False)
        params = [_params(o, wl.decoding) for o in wl.output_lens]
        prompts = _prompts(wl.prompts)
        with Clock(torch.get_num_threads()) as clock:
            outs = llm.generate(prompts, params, use_tqdm=False)
        outputs = [[list(c.token_ids) for c in o.outputs] for o in outs]
        gen_tokens = sum(len(c) for o in outputs for c in o)
        if wl.decoding.n == 1:
            outputs = [o[0] for o in outputs]
        runs.append({**clock.as_dict(), "outputs": outputs, "gen_tokens": gen_tokens,
                     "load_s": load_s, "load_rss_mb": load_rss,
                     "config": {"dtype": spec.get("dtype", "float32"), **spec.get("vllm_kwargs", {}),
}})
        del llm
    res = best_of(runs)
    return _versions(res)


def task_vllm_loglik(spec: dict[str, Any]) -> Result:
    """The loglikelihood items as lm-eval's vLLM backend sends them: one `generate` of TokensPrompts (longest first)
    with SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False); each continuation's summed
    prompt log-probability and whether each of its tokens was the most likely, read as that backend reads them."""
    import torch
    from vllm import LLM, SamplingParams

    wl = LoglikWorkload.from_json(spec["loglik"])
    reqs = wl.requests()
    order = lm_eval_order(reqs)
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    runs = []
    for _ in range(spec.get("repeat", 1)):
        t = time.perf_counter()
        llm = LLM(model=spec["model_path"], dtype=spec.get("dtype", "float32"), seed=0,
                  max_model_len=spec["max_model_len"], **spec.get("vllm_kwargs", {}))
        load_s, load_rss = time.perf_counter() - t, rss_mb()
        llm.generate(_prompts([WARMUP_PROMPT]), params, use_tqdm=False)
        with Clock(torch.get_num_threads()) as clock:
            outs = llm.generate(_prompts([reqs[i][0] + reqs[i][1] for i in order]), params, use_tqdm=False)
            scores: list[Any] = [None] * len(reqs)
            for i, out in zip(order, outs):
                scores[i] = score_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, len(reqs[i][0]))
        runs.append({**clock.as_dict(), "scores": [[lp, bool(g)] for lp, g in scores], "items": len(wl),
                     "requests": len(reqs), "scored_tokens": sum(len(c) for _, c in reqs),
                     "request_tokens": sum(len(x) + len(c) for x, c in reqs), "load_s": load_s,
                     "load_rss_mb": load_rss, "config": {"dtype": spec.get("dtype", "float32"),
                                                         **spec.get("vllm_kwargs", {})}})
        del llm
    res = best_of(runs)
    return _versions(res)


def task_vllm_embed(spec: dict[str, Any]) -> Result:
    """The embedding texts (benchmarks/harness/embed.py) as vLLM's offline API embeds them: one
    `LLM(runner="pooling").embed(texts)`, the pooling and normalisation read from the checkpoint's sentence-transformers
    files, its defaults otherwise (max_model_len the longest text's and the KV space the spec's)."""
    import torch
    from vllm import LLM

    texts = EmbedTexts.from_json(spec["embed"]).texts
    kw = {"runner": "pooling", "dtype": spec.get("dtype", "float32"), "seed": 0, "max_model_len": spec["max_model_len"],
          **spec.get("vllm_kwargs", {})}

    def load() -> Any:
        return LLM(model=spec["model_path"], **kw)

    def embed(llm: Any, batch: list[str]) -> list[list[float]]:
        return [o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)]

    res = timed_embedding(load, embed, texts, torch.get_num_threads, spec.get("repeat", 1), config=kw)
    return _versions(res)


TASKS = {"vllm": task_vllm, "loglik": task_vllm_loglik, "embed": task_vllm_embed}


def main(argv: list[str]) -> int:
    return worker.main(argv, "vllm", lambda spec: TASKS[spec.get("task", "vllm")](spec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
