"""One system under test, in its own process: `python -m benchmarks.harness.worker SPEC.json RESULT.json`.

The orchestrator (`benchmarks.run`) starts one worker per system and configuration, so that memory (peak RSS
is the process's), allocator state and thread pools never carry over from one system to the next. A worker
loads its model untimed, warms up on a short request, then times only the generation of the workload.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The same OpenMP wait settings for every system under test: importing batchrun chooses them (see
# batchrun/__init__.py), and must come before torch is imported.
import batchrun  # noqa: F401

# isort: split
import torch

from benchmarks.harness.clock import Clock, best_of, peak_rss_mb, rss_mb  # noqa: F401 - re-exported
from benchmarks.harness.loglik import LoglikWorkload, lm_eval_order, score_prompt_logprobs
from benchmarks.harness.workload import Workload

# A short request run before the timed part of every system, so one-off costs (first-call kernel selection,
# lazy allocations, thread start-up) fall outside the timing.
WARMUP_PROMPT = list(range(10, 42))
WARMUP_TOKENS = 4

Result = dict[str, Any]


# ---- the matmul peak ------------------------------------------------------------------------------------


def task_peak(spec: dict[str, Any]) -> Result:
    """FLOP/s of a large fp32 matmul on this machine with the benchmark's threads: the MFU denominator.

    The best of repeated runs is the peak (other load on the machine only ever slows a run down); the median is
    kept to show how noisy the machine was.
    """
    n, seconds = spec["n"], spec["seconds"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    measured = dtype
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # No bf16 matmul instructions (no AVX512-BF16 or AMX, e.g. AMD Zen 3): bf16 work runs on the fp32 FMAs
        # (batchrun widens bf16 weights as it loads them), so the fp32 peak is the bf16 one. torch's own bf16 mm
        # falls back to a path far too slow to time here.
        measured = torch.float32
    a, b = torch.randn(n, n, dtype=measured), torch.randn(n, n, dtype=measured)
    c = torch.empty(n, n, dtype=measured)

    def product() -> None:
        torch.mm(a, b, out=c)

    if measured == torch.bfloat16:  # oneDNN's blocked weights, as batchrun's bf16 linears (torch.mm may not be)
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)

        def product() -> None:  # noqa: F811
            torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    for _ in range(2):
        product()
    rates: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(rates) < 3:
        t = time.perf_counter()
        product()
        rates.append(2.0 * n**3 / (time.perf_counter() - t))
    return {"matmul_n": n, "dtype": str(dtype).removeprefix("torch."), "peak_flops": max(rates),
            "median_flops": statistics.median(rates), "samples": len(rates),
            "measured_as": str(measured).removeprefix("torch."), "bandwidth": read_bandwidth(spec.get("n", 4096))}


def read_bandwidth(n: int) -> float:
    """Bytes a second the benchmark's threads read from memory: the best sum over an fp32 array far larger than the
    caches (256 MiB at the full size; what a decode step's weight stream gets at best)."""
    x = torch.ones((n * n * 4 if n >= 4096 else n * n), dtype=torch.float32)
    x.sum()
    best = 0.0
    for _ in range(8):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


# ---- batchrun -------------------------------------------------------------------------------------------

_COUNTERS = ("num_requests_finished", "prompt_tokens", "generation_tokens", "num_steps", "num_preemptions_recompute",
             "num_preemptions_swap", "blocks_swapped_out", "blocks_swapped_in", "prefix_cache_hit_tokens",
             "model_time_s", "engine_overhead_s", "step_time_s", "draft_tokens", "accepted_draft_tokens",
             "schedule_time_s", "forward_time_s", "logits_time_s", "sampling_time_s", "outputs_time_s")


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The engine's metrics for the timed part only: counters minus the warm-up's; the mean slot utilisation
    re-weighted by steps; peaks and sizes as they are (the warm-up's peaks are far below the workload's)."""
    d = dict(after)
    for k in _COUNTERS:
        if k in after and k in before:
            d[k] = after[k] - before[k]
    steps_b, steps_a = before.get("num_steps", 0), after.get("num_steps", 0)
    if "kv_slot_utilization" in after and steps_a > steps_b:
        d["kv_slot_utilization"] = ((after["kv_slot_utilization"] * steps_a - before["kv_slot_utilization"] * steps_b)
                                    / (steps_a - steps_b))
    if d.get("step_time_s"):
        d["engine_overhead_fraction"] = d.get("engine_overhead_s", 0.0) / d["step_time_s"]
    return d


class StepTrace:
    """Per-step (step seconds, model seconds, tokens sampled) from the engine's own timers.

    It wraps `Engine.step` on the instance and reads the engine's metrics around each call, so the engine's code
    is untouched; the tokens sampled in a step is the number of sequences that advanced in it. If the engine's
    internals change shape, the trace is simply absent from the report.
    """

    def __init__(self, llm: Any) -> None:
        self.rows: list[tuple[float, float, int]] = []
        self.ok = False
        engine = getattr(llm, "engine", None)
        m = getattr(engine, "metrics", None)
        if engine is None or not all(hasattr(m, a) for a in ("step_time_s", "model_time_s", "generation_tokens")):
            return
        inner = engine.step
        rows = self.rows

        def traced_step(*args: Any, **kwargs: Any) -> Any:
            m0 = engine.metrics
            s0, t0, g0 = m0.step_time_s, m0.model_time_s, m0.generation_tokens
            out = inner(*args, **kwargs)
            m1 = engine.metrics
            rows.append((m1.step_time_s - s0, m1.model_time_s - t0, m1.generation_tokens - g0))
            return out

        engine.step = traced_step
        self.ok = True

    def overhead(self, min_seqs: int) -> dict[str, float] | None:
        """Share of step time outside the model forward, over the steps that advanced >= min_seqs sequences."""
        if not self.ok:
            return None
        sel = [(s, m) for s, m, g in self.rows if g >= min_seqs]
        step = sum(s for s, _ in sel)
        return {"min_seqs": min_seqs, "steps": len(sel), "step_time_s": step,
                "overhead_fraction": (step - sum(m for _, m in sel)) / step if step else float("nan")}


def workload_params(wl: Workload) -> list[Any]:
    """Each request's SamplingParams as the workload's decoding says (benchmarks.harness.workload.Decoding)."""
    from batchrun import SamplingParams

    d = wl.decoding
    params = []
    for i, o in enumerate(wl.output_lens):
        kw: dict[str, Any] = dict(n=d.n, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, max_tokens=o)
        if d.temperature > 0:
            kw["seed"] = d.seed + i
        if d.stop_at_eos:
            kw["stop_token_ids"] = list(d.eos_token_ids)
        else:
            kw.update(min_tokens=o, ignore_eos=True)
        params.append(SamplingParams(**kw))
    return params


def _sampling(o: int, greedy: bool = True, seed: int | None = None, n: int = 1) -> Any:
    from batchrun import SamplingParams

    if greedy:
        return SamplingParams(n=n, temperature=0.0, max_tokens=o, min_tokens=o, ignore_eos=True)
    return SamplingParams(n=n, temperature=0.8, top_p=0.95, max_tokens=o, min_tokens=o, ignore_eos=True, seed=seed)


def _make_llm(spec: dict[str, Any], **overrides: Any) -> Any:
    from batchrun import LLM

    kw = {"dtype": "float32", "device": "cpu", **spec.get("llm_kwargs", {}), **overrides}
    return LLM(spec["model_path"], **kw)


def _warm(llm: Any) -> None:
    llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], _sampling(WARMUP_TOKENS), use_tqdm=False)


def _timed_generate(llm: Any, wl: Workload, params: list[Any], trace: bool = False) -> Result:
    """Generate the workload once (timed) after a warm-up; outputs in request order and the run's metrics."""
    from benchmarks.harness.step_profile import StepKinds

    _warm(llm)
    before = llm.metrics()
    tracer = StepTrace(llm) if trace else None
    kinds = StepKinds(llm) if trace else None
    with Clock(torch.get_num_threads()) as clock:
        outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    metrics = metrics_delta(before, llm.metrics())
    res: Result = {**clock.as_dict(), "metrics": metrics,
                   "outputs": [[list(c.token_ids) for c in o.outputs] for o in outs],
                   "max_model_len": getattr(llm, "max_model_len", None)}
    res["gen_tokens"] = sum(len(c) for o in res["outputs"] for c in o)
    if tracer is not None:
        res["overhead_ge_64"] = tracer.overhead(64)
        res["overhead_ge_16"] = tracer.overhead(16)
    if kinds is not None:
        res["step_kinds"] = kinds.summary()
    return res


def task_batchrun(spec: dict[str, Any]) -> Result:
    """The headline run: the whole workload in one `generate`, greedy, exact output lengths. With repeats, each
    on a fresh LLM (a second `generate` on the same one would find every prompt in its prefix cache)."""
    wl = Workload.from_json(spec["workload"])
    runs = []
    for _ in range(spec.get("repeat", 1)):
        t = time.perf_counter()
        llm = _make_llm(spec)
        load_s, load_rss = time.perf_counter() - t, rss_mb()
        res = _timed_generate(llm, wl, workload_params(wl), trace=True)
        if wl.decoding.n == 1:
            res["outputs"] = [o[0] for o in res["outputs"]]
        if spec.get("op_profile"):  # where the forward's time goes, on a pass after the timed one
            from benchmarks.harness.step_profile import op_shares

            res["op_shares"] = op_shares(llm, wl, workload_params(wl), spec["op_profile"])
        runs.append({**res, "load_s": load_s, "load_rss_mb": load_rss, "config": spec.get("llm_kwargs", {})})
        del llm  # free its KV pool before the next LLM is built
        gc.collect()
    return best_of(runs)


def task_scenario_prefix(spec: dict[str, Any]) -> Result:
    """Requests sharing a long system prompt, with prefix caching on and off."""
    wl = Workload.from_json(spec["workload"])
    runs = {}
    for on in (True, False):
        llm = _make_llm(spec, enable_prefix_caching=on)
        r = _timed_generate(llm, wl, [_sampling(o) for o in wl.output_lens])
        r["outputs"] = [o[0] for o in r["outputs"]]
        runs["on" if on else "off"] = r
        del llm  # free its KV pool before the next LLM is built
        gc.collect()
    return {"runs": runs}


def task_scenario_budget(spec: dict[str, Any]) -> Result:
    """A KV budget well below the demand: each preemption mode, against an unconstrained run."""
    wl = Workload.from_json(spec["workload"])
    runs = {}
    variants = [("unconstrained", {"num_kv_blocks": spec["demand_blocks"]})]
    variants += [(mode, {"num_kv_blocks": spec["budget_blocks"], "preemption_mode": mode,
                         "swap_space": spec["swap_bytes"]}) for mode in ("swap", "recompute", "auto")]
    for name, kw in variants:
        llm = _make_llm(spec, **kw)
        r = _timed_generate(llm, wl, [_sampling(o) for o in wl.output_lens])
        r["outputs"] = [o[0] for o in r["outputs"]]
        r["config"] = kw
        runs[name] = r
        del llm  # free its KV pool before the next LLM is built
        gc.collect()
    return {"runs": runs}


def task_scenario_n4(spec: dict[str, Any]) -> Result:
    """Parallel sampling: n=4 per request against the same 4 samples as separate requests.

    Prefix caching is off in both so the blocks saved are the fork's own sharing of the prompt, not the prefix
    cache's. Sampling is random (temperature 0.8, per-request seeds), so outputs are not compared.
    """
    wl = Workload.from_json(spec["workload"])
    n = spec.get("n", 4)
    runs: dict[str, Any] = {}
    llm = _make_llm(spec, enable_prefix_caching=False)
    try:
        r = _timed_generate(llm, wl, [_sampling(o, greedy=False, seed=i, n=n) for i, o in enumerate(wl.output_lens)])
    except (ValueError, NotImplementedError) as e:
        return {"skipped": f"SamplingParams(n={n}) raised: {e}"}
    finally:
        del llm  # free its KV pool before the next LLM is built
        gc.collect()
    r.pop("outputs")
    runs[f"n={n}"] = r
    sep = Workload(wl.name + f" x{n}", [p for p in wl.prompts for _ in range(n)],
                   [o for o in wl.output_lens for _ in range(n)])
    llm = _make_llm(spec, enable_prefix_caching=False)
    r = _timed_generate(llm, sep, [_sampling(o, greedy=False, seed=i) for i, o in enumerate(sep.output_lens)])
    r.pop("outputs")
    runs[f"{n} separate"] = r
    del llm  # free its KV pool before the next LLM is built
    gc.collect()
    return {"runs": runs}


# ---- transformers ---------------------------------------------------------------------------------------


def _hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    # EOS is ignored in this benchmark: no end-of-sequence id may stop a row or be masked out.
    model.generation_config.eos_token_id = None
    return model


def task_hf_static(spec: dict[str, Any]) -> Result:
    """transformers `generate` with static batches at its best: prompts sorted by length, left padding.

    A static batch runs until its longest request is done, so each row generates the batch's maximum and is cut
    to its own length afterwards; the tokens thrown away are counted as waste, not as throughput.
    """
    from transformers import GenerationConfig

    wl = Workload.from_json(spec["workload"])
    bs = spec["batch_size"]
    t = time.perf_counter()
    model = _hf_model(spec["model_path"])
    load_s, load_rss = time.perf_counter() - t, rss_mb()
    pad = 0

    def run_batch(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad,
                               bos_token_id=None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        if out.shape[1] != width + max_new:
            raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, asked for {max_new}")
        return out[:, width:].tolist()

    def run_all() -> Result:
        order = sorted(range(len(wl)), key=lambda i: len(wl.prompts[i]))
        outputs: list[list[int]] = [[] for _ in range(len(wl))]
        pad_tokens = wasted = 0
        with Clock(torch.get_num_threads()) as clock:
            for s in range(0, len(order), bs):
                idx = order[s:s + bs]
                max_new = max(wl.output_lens[i] for i in idx)
                rows = run_batch([wl.prompts[i] for i in idx], max_new)
                width = max(len(wl.prompts[i]) for i in idx)
                for r, i in enumerate(idx):
                    outputs[i] = rows[r][: wl.output_lens[i]]
                    pad_tokens += width - len(wl.prompts[i])
                    wasted += max_new - wl.output_lens[i]
        return {**clock.as_dict(), "outputs": outputs, "gen_tokens": sum(len(o) for o in outputs),
                "prompt_pad_tokens": pad_tokens, "discarded_gen_tokens": wasted}

    run_batch([WARMUP_PROMPT], WARMUP_TOKENS)
    res = best_of([run_all() for _ in range(spec.get("repeat", 1))])
    return {**res, "load_s": load_s, "load_rss_mb": load_rss,
            "config": {"batch_size": bs, "sorted_by_prompt_len": True, "padding": "left"}}


def task_hf_cb(spec: dict[str, Any]) -> Result:
    """transformers' own continuous batching: its paged cache sized to batchrun's KV bytes, sdpa attention.

    Requests go in through `continuous_batching_context_manager` one `add_request` each, with their own
    max_new_tokens and EOS disabled (-1). Building the manager and its cache is untimed, like batchrun's pool.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    wl = Workload.from_json(spec["workload"])
    t = time.perf_counter()
    model = _hf_model(spec["model_path"])
    load_s = time.perf_counter() - t
    page, rps = spec["page_size"], spec["max_requests_per_batch"]
    num_blocks = spec["kv_bytes"] // (page * spec["kv_bytes_per_token"])
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_requests_per_batch=rps,
                                  auto_switch_to_flash=False)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0)
    outputs: dict[str, list[int]] = {}
    errors: list[str] = []

    def drain(mgr: Any, want: set[str]) -> None:
        while want - outputs.keys():
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
                continue
            if r.is_finished():
                outputs[r.request_id] = list(r.generated_tokens)
                if r.error:
                    errors.append(f"{r.request_id}: {r.error}")

    def run_all() -> Result:
        """One manager (a fresh paged cache, so no prefix is shared between repeats) for the whole workload."""
        outputs.clear()
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb) as mgr:
            load_rss = rss_mb()
            mgr.add_request(WARMUP_PROMPT, request_id="warmup", max_new_tokens=WARMUP_TOKENS, eos_token_id=-1)
            drain(mgr, {"warmup"})
            ids = [f"r{i}" for i in range(len(wl))]
            with Clock(torch.get_num_threads()) as clock:
                for rid, p, o in zip(ids, wl.prompts, wl.output_lens):
                    mgr.add_request(p, request_id=rid, max_new_tokens=o, eos_token_id=-1)
                drain(mgr, set(ids))
        out = [outputs[r] for r in ids]
        return {**clock.as_dict(), "outputs": out, "gen_tokens": sum(len(o) for o in out), "load_rss_mb": load_rss}

    res = best_of([run_all() for _ in range(spec.get("repeat", 1))])
    return {**res, "load_s": load_s, "errors": errors[:5],
            "config": {"page_size": page, "num_blocks": num_blocks, "kv_bytes": num_blocks * page *
                       spec["kv_bytes_per_token"], "max_requests_per_batch": rps, "attn_implementation": "sdpa",
                       "max_batch_tokens": cb.max_batch_tokens or "auto"}}


# ---- loglikelihood: four-choice items (benchmarks/harness/loglik.py) -----------------------------------


def _loglik_result(wl: LoglikWorkload, clock: Clock, scores: list[tuple[float, bool]], **extra: Any) -> Result:
    """A scoring run's result: its wall time and each request's (summed log-probability, is greedy) in the
    workload's request order (item by item, choice by choice)."""
    reqs = wl.requests()
    return {**clock.as_dict(), "scores": [[lp, bool(g)] for lp, g in scores], "items": len(wl),
            "requests": len(reqs), "scored_tokens": sum(len(c) for _, c in reqs),
            "request_tokens": sum(len(x) + len(c) for x, c in reqs), **extra}


def _warm_loglik(llm: Any) -> None:
    """A short scored prompt (tokens no item starts with), untimed."""
    from batchrun import SamplingParams

    llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], SamplingParams(max_tokens=0, prompt_logprobs=1,
                                                                      detokenize=False), use_tqdm=False)


def task_loglik_batchrun(spec: dict[str, Any]) -> Result:
    """batchrun as its `task: loglikelihood` jobs run: every (item, choice) through the engine's stepping API
    (`add_request` with `score_from` at the continuation, so an item's choices may share their context's KV blocks
    through the prefix cache; `step` until done), keeping in flight what the job executor keeps
    (batchrun.pipeline.executor.max_in_flight). Score: the continuation's summed prompt log-probabilities; greedy:
    each has rank 1."""
    from batchrun import SamplingParams
    from batchrun.pipeline.executor import max_in_flight

    wl = LoglikWorkload.from_json(spec["loglik"])
    reqs = wl.requests()
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, detokenize=False)
    runs = []
    for _ in range(spec.get("repeat", 1)):
        llm, load_s, load_rss = _loglik_llm(spec)
        limit = max_in_flight(llm.args.max_num_seqs)
        before = llm.metrics()
        scores: list[tuple[float, bool] | None] = [None] * len(reqs)
        with Clock(torch.get_num_threads()) as clock:
            added = done = 0
            while done < len(reqs):
                while added < len(reqs) and added - done < limit:
                    ctx, cont = reqs[added]
                    llm.add_request(str(added), ctx + cont, params, score_from=len(ctx))
                    added += 1
                for out in llm.step():
                    i = int(out.request_id)
                    scores[i] = score_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, len(reqs[i][0]),
                                                      by_rank=True)
                    done += 1
        runs.append(_loglik_result(wl, clock, scores, metrics=metrics_delta(before, llm.metrics()), load_s=load_s,
                                   load_rss_mb=load_rss, config={"api": "add_request + step, score_from",
                                                                 "max_in_flight": limit,
                                                                 **spec.get("llm_kwargs", {})}))
        del llm  # free its KV pool before the next LLM is built
        gc.collect()
    return best_of(runs)


def _loglik_llm(spec: dict[str, Any]) -> tuple[Any, float, float]:
    """The LLM of a loglikelihood row, warmed, with its load seconds and the RSS after loading."""
    t = time.perf_counter()
    llm = _make_llm(spec)
    load_s, load_rss = time.perf_counter() - t, rss_mb()
    _warm_loglik(llm)
    return llm, load_s, load_rss


def task_loglik_batchrun_generate(spec: dict[str, Any]) -> Result:
    """batchrun through vLLM's names, as lm-eval's vLLM backend drives vLLM: one `generate` of TokensPrompts (in its
    order: longest first) with SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False);
    score and greedy read from prompt_logprobs as that backend reads them."""
    from batchrun import SamplingParams, TokensPrompt

    wl = LoglikWorkload.from_json(spec["loglik"])
    reqs = wl.requests()
    order = lm_eval_order(reqs)
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    runs = []
    for _ in range(spec.get("repeat", 1)):
        llm, load_s, load_rss = _loglik_llm(spec)
        before = llm.metrics()
        with Clock(torch.get_num_threads()) as clock:
            outs = llm.generate([TokensPrompt(prompt_token_ids=reqs[i][0] + reqs[i][1]) for i in order], params,
                                use_tqdm=False)
            scores: list[tuple[float, bool] | None] = [None] * len(reqs)
            for i, out in zip(order, outs):
                scores[i] = score_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids, len(reqs[i][0]))
        runs.append(_loglik_result(wl, clock, scores, metrics=metrics_delta(before, llm.metrics()), load_s=load_s,
                                   load_rss_mb=load_rss, config={"api": "generate, prompt_logprobs=1",
                                                                 **spec.get("llm_kwargs", {})}))
        del llm
        gc.collect()
    return best_of(runs)


def lm_eval_hf_scores(model: Any, requests: list[tuple[list[int], list[int]]], batch_size: int
                      ) -> list[tuple[float, bool]]:
    """lm-eval's HF backend's loglikelihood: requests sorted longest first, batched, each input its context and
    continuation less the last token, right-padded (no attention mask: causal attention never reads the padding
    after a row's tokens), one forward per batch, log_softmax over the vocabulary in the logits' dtype, the
    continuation's positions gathered and summed; greedy: each continuation token is its position's argmax. Returns
    (summed log-probability, is greedy) in the requests' order."""
    import torch.nn.functional as F

    out: list[tuple[float, bool] | None] = [None] * len(requests)
    order = lm_eval_order(requests)
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            inps = [(requests[i][0] + requests[i][1])[:-1] for i in idx]
            width = max(len(x) for x in inps)
            batch = torch.zeros((len(idx), width), dtype=torch.long)
            for r, x in enumerate(inps):
                batch[r, :len(x)] = torch.tensor(x)
            multi_logits = F.log_softmax(model(batch).logits, dim=-1)
            for r, i in enumerate(idx):
                cont = torch.tensor(requests[i][1])
                n, inplen = len(cont), len(inps[r])
                logits = multi_logits[r, inplen - n:inplen]  # [continuation, vocab]
                greedy = bool((logits.argmax(dim=-1) == cont).all())
                out[i] = (float(logits.gather(1, cont.unsqueeze(1)).sum()), greedy)
    return out


def task_loglik_hf(spec: dict[str, Any]) -> Result:
    """transformers as lm-eval's HF backend runs it (lm_eval_hf_scores): AutoModelForCausalLM in the plan's dtype,
    batches of `batch_size`."""
    from transformers import AutoModelForCausalLM

    wl = LoglikWorkload.from_json(spec["loglik"])
    reqs = wl.requests()
    bs = spec["batch_size"]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=getattr(torch, spec["dtype"])).eval()
    load_s, load_rss = time.perf_counter() - t, rss_mb()
    lm_eval_hf_scores(model, [(WARMUP_PROMPT[:24], WARMUP_PROMPT[24:])], 1)
    runs = []
    for _ in range(spec.get("repeat", 1)):
        with Clock(torch.get_num_threads()) as clock:
            scores = lm_eval_hf_scores(model, reqs, bs)
        runs.append(_loglik_result(wl, clock, scores))
    return {**best_of(runs), "load_s": load_s, "load_rss_mb": load_rss,
            "config": {"batch_size": bs, "dtype": spec["dtype"], "attn_implementation":
                       model.config._attn_implementation, "sorted": "longest first", "padding": "right"}}


TASKS: dict[str, Callable[[dict[str, Any]], Result]] = {
    "peak": task_peak,
    "batchrun": task_batchrun,
    "hf_static": task_hf_static,
    "hf_cb": task_hf_cb,
    "scenario_prefix": task_scenario_prefix,
    "scenario_budget": task_scenario_budget,
    "scenario_n4": task_scenario_n4,
    "loglik_batchrun": task_loglik_batchrun,
    "loglik_batchrun_generate": task_loglik_batchrun_generate,
    "loglik_hf": task_loglik_hf,
}


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    threads = spec.get("threads", 2)
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    t = time.perf_counter()
    result = TASKS[spec["task"]](spec)
    result.update(task=spec["task"], threads=torch.get_num_threads(), peak_rss_mb=peak_rss_mb(),
                  process_s=time.perf_counter() - t)
    out_path.write_text(json.dumps(result, default=_jsonable))
    return 0


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
