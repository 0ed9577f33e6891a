"""`python -m benchmarks.run` (`make bench`): batchrun beside vLLM CPU, OpenVINO GenAI and transformers.

For each plan (harness/plans.py): this machine's matmul peak first, then every system's rows on the same
prompts, each in its own worker process (harness/runner.py); then batchrun-only scenarios
(harness/scenarios.py: a shared system prompt, a KV budget of a quarter of the demand, n=4 sampling). Writes
results.json, report.md and throughput.png into --out.

    python -m benchmarks.run                      # the default plans (--model all)
    python -m benchmarks.run --model tiny         # one plan
    python -m benchmarks.run --quick              # a seconds-long end-to-end check of the harness
    python -m benchmarks.run --rounds 2 --model quant   # the quantized 1B rows beside the bf16 one
    python -m benchmarks.run --rounds 2 --model loglik  # scoring four-choice items (an evaluation harness's work)
    python -m benchmarks.run --quick --model loglik     # a seconds-long check of the loglikelihood rows
    python -m benchmarks.run --rounds 2 --model embed   # embedding texts: batchrun, sentence-transformers, vLLM
    python -m benchmarks.run --quick --model embed-bert-fp32   # a quick check of one embedding row (toy model)
    python -m benchmarks.run --model tiny --scenarios none --llm-kwargs '{"max_num_seqs": 128}'
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import report
from benchmarks.harness.clock import best_of
from benchmarks.harness.embed_report import derive_embed
from benchmarks.harness.loglik import build_items
from benchmarks.harness.plans import (
    BLOCK_SIZE,
    DEFAULT_PLANS,
    EMBED_PLANS,
    HF_PAGE_SIZE,
    LOGLIK_PLANS,
    PLANS,
    QUANT_PLANS,
    QUICK,
    SCENARIOS,
    THREADS,
    VLLM_NGRAM,
    Plan,
    headline_workload,
    quick_plans,
    select_plans,
    why_not_here,
)
from benchmarks.harness.runner import ROOT, Runner
from benchmarks.harness.scenarios import run_scenarios
from benchmarks.harness.workload import (
    LengthDist,
    ModelShape,
    Workload,
    contiguous_preallocation,
    model_flops,
)
from benchmarks.micro import isa_peak
from benchmarks.peers.venv import PeerSetup
from benchmarks.peers.vllm.env import VllmSetup


def _fastest(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs over the rounds: the fastest of those that ran (clock.best_of), with their wall times
    when there were rounds; a failure only when every round failed."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    return best_of(ok, "round_walls_s") if len(results) > 1 else ok[0]


def run_model(plan: Plan, runner: Runner, scenarios: tuple[str, ...], llm_kwargs: dict[str, Any],
              kv_scale: float, repeat: int = 1, vllm: VllmSetup | None = None, rounds: int = 1,
              openvino: Any = None) -> dict[str, Any]:
    path, shape, vocab, wl = headline_workload(plan)
    shape = ModelShape(**{**shape.__dict__, "dtype_bytes": 2 if plan.dtype == "bfloat16" else 4})
    demand = wl.blocks_needed(BLOCK_SIZE)
    kv_blocks = max(math.ceil(demand * kv_scale), math.ceil(wl.max_len / BLOCK_SIZE))
    kv_bytes = kv_blocks * BLOCK_SIZE * shape.kv_bytes_per_token
    base = {"model_path": str(path), "workload": wl.to_json(), "repeat": repeat}
    br_kwargs = {"num_kv_blocks": kv_blocks, "block_size": BLOCK_SIZE, "dtype": plan.dtype, **plan.batchrun_kwargs,
                 **llm_kwargs}
    params = shape.body_params + shape.lm_head_params + shape.hidden * shape.vocab
    model_name = plan.checkpoint or plan.builtin
    runner.log(f"[{plan.key}] {model_name}: {len(wl)} requests ({wl.decoding.label}), {wl.prompt_tokens} prompt + "
               f"up to {wl.output_tokens * wl.decoding.n} output tokens, KV {kv_blocks} blocks "
               f"({kv_bytes / 2**20:.1f} MiB)")

    runs: dict[str, list[dict[str, Any]]] = {"batchrun": [], "vllm": [], "openvino": [], "hf_static": [], "hf_cb": []}
    # the headline systems: (kind, worker name, run it under this name)
    headline: list[tuple[str, str, Callable[[str], dict[str, Any]]]] = [
        ("batchrun", f"{plan.key}-batchrun", lambda name: runner(name, {**base, "task": "batchrun",
                                                                        "llm_kwargs": br_kwargs,
                                                                        "op_profile": plan.op_profile}))]
    if plan.speculation_variants:  # drafts are off by default: with them on too (8, as vLLM's n-gram row)
        kw = {**br_kwargs, "num_speculative_tokens": 8}
        headline.append(("batchrun", f"{plan.key}-batchrun-drafts",
                         lambda name: runner(name, {**base, "task": "batchrun", "llm_kwargs": kw})))
    if plan.vllm and vllm is not None:
        # the same bytes, or more where vLLM's 16-token blocks need more for the same requests
        vllm_kv = max(kv_bytes, wl.blocks_needed(16) * 16 * shape.kv_bytes_per_token)
        vbase = vllm_base(plan, base)
        headline.append(("vllm", f"{plan.key}-vllm", lambda name: vbase if "error" in vbase else vllm.run(
            runner, name, vbase, plan.dtype, vllm_kv, wl.max_len, plan.vllm_kwargs)))
        if plan.speculation_variants and plan.vllm_ngram:  # vLLM with n-gram drafting (off by default there)
            ngram = {**plan.vllm_kwargs, "speculative_config": VLLM_NGRAM}
            headline.append(("vllm", f"{plan.key}-vllm-ngram",
                             lambda name: vllm.run(runner, name, base, plan.dtype, vllm_kv, wl.max_len, ngram)))
    if plan.openvino and openvino is not None:
        # KV cache in the row's dtype; its CPU default (u8) as a row of its own where the plan asks. Its blocks are
        # 32 tokens: the same bytes, or what its blocks need for the same requests
        ov_kv = max(kv_bytes, wl.blocks_needed(32) * 32 * shape.kv_bytes_per_token)
        headline.append(("openvino", f"{plan.key}-openvino",
                         lambda name: openvino.run(runner, name, base, plan.dtype, ov_kv,
                                                   kv_cache_precision=plan.openvino_kv or None,
                                                   weight_format=plan.openvino_weights)))
        if plan.openvino_u8:
            headline.append(("openvino", f"{plan.key}-openvino-u8",
                             lambda name: openvino.run(runner, name, base, plan.dtype, ov_kv, kv_cache_precision="u8")))
    # rounds > 1: every headline system once per round, in turn, and each keeps its fastest run. A shared machine's
    # speed drifts over minutes, so systems that run minutes apart are compared at different speeds; within a
    # round they run back to back.
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for _, name, _ in headline}
    for r in range(rounds):
        for _, name, call in headline:
            per_round[name].append(call(name if rounds == 1 else f"{name}-round{r + 1}"))
    for kind, name, _ in headline:
        runs[kind].append(_fastest(per_round[name]))
    for bs in plan.static_batches:
        r = runner(f"{plan.key}-hf_static-b{bs}", {**base, "task": "hf_static", "batch_size": bs})
        runs["hf_static"].append(r if "error" not in r else {**r, "config": {"batch_size": bs}})
    for rps in plan.cb_requests_per_step:
        r = runner(f"{plan.key}-hf_cb-r{rps}", {**base, "task": "hf_cb", "max_requests_per_batch": rps,
                                                  "page_size": HF_PAGE_SIZE, "kv_bytes": kv_bytes,
                                                  "kv_bytes_per_token": shape.kv_bytes_per_token})
        runs["hf_cb"].append(r if "error" not in r else {**r, "config": {"max_requests_per_batch": rps}})

    # The preallocation reserves the longest sequence the model serves (the paper's comparison): the configured
    # max_model_len, else the model's context length, not batchrun's (which is capped to its KV pool).
    max_model_len = llm_kwargs.get("max_model_len") or json.loads((path / "config.json").read_text()).get(
        "max_position_embeddings", 2048)
    flops_wl = wl
    if wl.decoding.stop_at_eos and "outputs" in runs["batchrun"][0]:
        # replies end at EOS: the useful FLOPs are those of batchrun's replies (each sample with its prompt)
        outs = runs["batchrun"][0]["outputs"]
        samples = [(p, o) for p, out in zip(wl.prompts, outs) for o in (out if wl.decoding.n > 1 else [out])]
        flops_wl = Workload(wl.name, [p for p, _ in samples], [max(len(o), 1) for _, o in samples])
    m = {"key": plan.key, "model": model_name, "model_path": str(path), "params": params, "dtype": plan.dtype,
         "shape": shape.__dict__, "workload": wl.summary(), "flops": model_flops(shape, flops_wl),
         "eos_token_ids": list(wl.decoding.eos_token_ids) if wl.decoding.stop_at_eos else [],
         "block_size": BLOCK_SIZE, "kv_blocks": kv_blocks, "kv_bytes": kv_bytes, "demand_blocks": demand,
         "contiguous": contiguous_preallocation(kv_bytes, shape, max_model_len, wl), "runs": runs,
         "llm_kwargs": br_kwargs, "note": plan.note, "plan": {"workload": plan.workload, "decoding": wl.decoding.label},
         "format": plan.fmt, "baseline": plan.baseline, "baseline_target": plan.baseline_target,
         "weight_bytes_per_param": plan.weight_bytes_per_param, "lm_head_bytes_per_param": plan.lm_head_bytes_per_param}
    todo = [s for s in scenarios if s in plan.scenarios]
    if todo:
        m["scenarios"] = run_scenarios(plan, runner, todo, wl, shape, vocab, llm_kwargs)
    return m


def run_loglik(plan: Plan, runner: Runner, llm_kwargs: dict[str, Any], repeat: int = 1,
               vllm: VllmSetup | None = None, rounds: int = 1) -> dict[str, Any]:
    """A loglikelihood plan: its items (harness/loglik.py) scored by batchrun as its jobs run, batchrun through vLLM's
    names and vLLM, in turn (`rounds` times, each keeping its fastest), then transformers once; each in its own
    process. batchrun and vLLM get the KV budget a batchrun job would size: max_num_seqs sequences of the longest
    request."""
    from batchrun.engine_args import EngineArgs
    from batchrun.model.weights.builtin import builtin_path

    path = builtin_path(plan.builtin)
    wl = build_items(path, plan.num_requests, plan.seed)
    shape = ModelShape.from_checkpoint(path)
    shape = ModelShape(**{**shape.__dict__, "dtype_bytes": 2 if plan.dtype == "bfloat16" else 4})
    br_kwargs = {"block_size": BLOCK_SIZE, "dtype": plan.dtype, **plan.batchrun_kwargs, **llm_kwargs}
    seqs = br_kwargs.get("max_num_seqs") or {f.name: f.default for f in dataclasses.fields(EngineArgs)}["max_num_seqs"]
    kv_blocks = seqs * math.ceil(wl.max_len / BLOCK_SIZE)
    kv_bytes = kv_blocks * BLOCK_SIZE * shape.kv_bytes_per_token
    br_kwargs = {"num_kv_blocks": kv_blocks, **br_kwargs}
    base = {"model_path": str(path), "loglik": wl.to_json(), "repeat": repeat}
    s = wl.summary()
    runner.log(f"[{plan.key}] {plan.builtin}: {len(wl)} items x {wl.num_choices} choices, {s['request_tokens']} "
               f"request tokens ({s['scored_tokens']} scored), KV {kv_blocks} blocks ({kv_bytes / 2**20:.1f} MiB)")
    headline: list[tuple[str, str, Callable[[str], dict[str, Any]]]] = [
        ("batchrun", f"{plan.key}-batchrun", lambda name: runner(name, {**base, "task": "loglik_batchrun",
                                                                        "llm_kwargs": br_kwargs})),
        ("batchrun", f"{plan.key}-batchrun-generate",
         lambda name: runner(name, {**base, "task": "loglik_batchrun_generate", "llm_kwargs": br_kwargs}))]
    if plan.vllm and vllm is not None:
        vllm_kv = max(kv_bytes, seqs * math.ceil(wl.max_len / 16) * 16 * shape.kv_bytes_per_token)
        headline.append(("vllm", f"{plan.key}-vllm", lambda name: vllm.run(
            runner, name, {**base, "task": "loglik"}, plan.dtype, vllm_kv, wl.max_len, plan.vllm_kwargs)))
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for _, name, _ in headline}
    for r in range(rounds):
        for _, name, call in headline:
            per_round[name].append(call(name if rounds == 1 else f"{name}-round{r + 1}"))
    runs: dict[str, list[dict[str, Any]]] = {"batchrun": [], "vllm": [], "hf": []}
    for kind, name, _ in headline:
        runs[kind].append(_fastest(per_round[name]))
    for bs in plan.static_batches:  # once, after the rounds, as the generation plans' transformers rows
        runs["hf"].append(runner(f"{plan.key}-hf-b{bs}", {**base, "task": "loglik_hf", "batch_size": bs,
                                                           "dtype": plan.dtype}))
    return {"key": plan.key, "kind": "loglik", "model": plan.builtin, "model_path": str(path), "dtype": plan.dtype,
            "shape": shape.__dict__, "workload": s, "gold": [it["gold"] for it in wl.items], "block_size": BLOCK_SIZE,
            "kv_blocks": kv_blocks, "kv_bytes": kv_bytes, "runs": runs, "llm_kwargs": br_kwargs, "note": plan.note,
            "plan": {"workload": "loglik"}}


# vLLM's KV space on the embedding rows, beside the longest text: two of its default CPU steps' tokens (4096 each, for
# up to 256 requests of 16-token blocks). Its CPU default (a share of the machine's memory) would put most of the
# machine in its peak RSS; with this much, KV space never limits its batches (a request frees its blocks once pooled).
VLLM_EMBED_KV_TOKENS = 2 * 4096


@functools.cache
def embed_texts(num_texts: int, seed: int, dist: LengthDist) -> Any:
    """The embedding texts (harness/embed.py) of these settings, built once a run: every plan asking for them embeds
    the same texts even if the docs they come from change during the run."""
    from transformers import AutoTokenizer

    from benchmarks.harness.embed import build_texts
    from benchmarks.harness.embed_models import bert_tokenizer_path

    bert = AutoTokenizer.from_pretrained(bert_tokenizer_path())
    return build_texts(lambda t: len(bert(t)["input_ids"]), num_texts, seed, dist.median, dist.sigma,
                       (dist.lo, dist.hi))


def run_embed(plan: Plan, runner: Runner, llm_kwargs: dict[str, Any], repeat: int = 1, vllm: VllmSetup | None = None,
              st: Any = None, rounds: int = 1, num_texts: int | None = None) -> dict[str, Any]:
    """An embedding plan: its texts (harness/embed.py; num_texts, else the plan's) embedded by batchrun,
    sentence-transformers and vLLM in turn (`rounds` times, each keeping its fastest), each in its own process, at its
    defaults in the plan's dtype; the first texts' vectors are compared with sentence-transformers' in the report."""
    from transformers import AutoTokenizer

    from batchrun.model.arch.registry import model_class
    from benchmarks.harness.embed_models import embed_checkpoint

    texts = embed_texts(num_texts or plan.num_requests, plan.seed, plan.prompt)
    path = embed_checkpoint(plan.checkpoint)
    model_tokens = [len(ids) for ids in AutoTokenizer.from_pretrained(path)(texts.texts)["input_ids"]]
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    shape = {"architecture": cfg["architectures"][0], "num_layers": cfg["num_hidden_layers"],
             "hidden": cfg["hidden_size"], "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads", heads),
             "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads, "vocab": cfg["vocab_size"]}
    kv_per_token = (2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"]
                    * (2 if plan.dtype == "bfloat16" else 4))
    max_len = max(model_tokens)
    vllm_kv = (VLLM_EMBED_KV_TOKENS + max_len) * kv_per_token
    base = {"model_path": str(path), "embed": texts.to_json(), "repeat": repeat}
    br_kwargs = {**plan.batchrun_kwargs, **llm_kwargs}
    if not getattr(model_class(shape["architecture"]), "is_encoder", False):  # a decoder: vLLM's KV bytes
        br_kwargs = {"kv_cache_memory_bytes": vllm_kv, **br_kwargs}
    s = texts.summary()
    runner.log(f"[{plan.key}] {plan.checkpoint}: {len(texts)} texts, {s['tokens']} BERT tokens ({s['tokens_min']}.."
               f"{s['tokens_max']}), {sum(model_tokens)} of the model's tokens (up to {max_len})")
    headline: list[tuple[str, str, Callable[[str], dict[str, Any]]]] = [
        ("batchrun", f"{plan.key}-batchrun", lambda name: runner(
            name, {**base, "dtype": plan.dtype, "llm_kwargs": br_kwargs}, module="benchmarks.harness.embed_worker"))]
    if st is not None:
        for bs in plan.static_batches:
            headline.append(("sentence_transformers", f"{plan.key}-st-b{bs}",
                             lambda name, bs=bs: st.run(runner, name, base, plan.dtype, bs)))
    if plan.vllm and vllm is not None:
        headline.append(("vllm", f"{plan.key}-vllm", lambda name: vllm.run(
            runner, name, {**base, "task": "embed"}, plan.dtype, vllm_kv, max_len, plan.vllm_kwargs)))
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for _, name, _ in headline}
    for r in range(rounds):
        for _, name, call in headline:
            per_round[name].append(call(name if rounds == 1 else f"{name}-round{r + 1}"))
    runs: dict[str, list[dict[str, Any]]] = {"batchrun": [], "sentence_transformers": [], "vllm": []}
    for kind, name, _ in headline:
        runs[kind].append(_fastest(per_round[name]))
    return {"key": plan.key, "kind": "embed", "model": plan.checkpoint, "model_path": str(path), "dtype": plan.dtype,
            "shape": shape, "workload": {**s, "model_tokens": sum(model_tokens), "model_tokens_max": max_len},
            "runs": runs, "llm_kwargs": br_kwargs, "vllm_kv_bytes": vllm_kv, "note": plan.note,
            "plan": {"workload": "embed"}}


def vllm_base(plan: Plan, base: dict[str, Any]) -> dict[str, Any]:
    """The vLLM worker's base spec: the plan's checkpoint, or the quantized copy the plan asks for (made here, once);
    {"error": ..., "config": ...} (a failed row) when the copy cannot be made."""
    if not plan.vllm_checkpoint:
        return base
    from benchmarks.peers.vllm.checkpoint import make_quantized

    try:
        return {**base, "model_path": str(make_quantized(base["model_path"], plan.vllm_checkpoint))}
    except (OSError, RuntimeError) as e:
        return {"error": f"vLLM not run: its {plan.vllm_checkpoint} checkpoint could not be made: {e}",
                "config": {"dtype": plan.dtype, "quantization": plan.vllm_checkpoint}}



# ---- environment, main ----------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": THREADS, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "loadavg_start": _loadavg()}


def _loadavg() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def _strip_outputs(m: dict[str, Any]) -> None:
    for variants in m["runs"].values():
        for v in variants:
            v.pop("outputs", None)
            v.pop("scores", None)
            v.pop("embeddings", None)


def _peer(res: dict[str, Any], runner: Runner, key: str, label: str, setup: Callable[[int], PeerSetup]
          ) -> PeerSetup:
    """A peer's setup for this run (its venv made or found), noted in res[key]; its rows fail where it failed."""
    runner.log(f"{label}: making (or finding) its venv")
    peer = setup(THREADS)
    res[key] = {"python": str(peer.python) if peer.python else None, "error": peer.error}
    if peer.error:
        runner.log(f"  {label} is left out: {peer.error}")
    return peer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"comma-separated plans of {','.join(PLANS)}, and groups: 'all' ({','.join(DEFAULT_PLANS)}, "
                         f"the default), 'quant' ({','.join(QUANT_PLANS)}), 'loglik' ({','.join(LOGLIK_PLANS)}), "
                         f"'embed' ({','.join(EMBED_PLANS)}), 'embed-bert', 'embed-qwen3' (one model's two dtypes); "
                         "with --quick, a loglikelihood or embedding plan asks for its quick check")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out (no venv is made)")
    ap.add_argument("--no-openvino", action="store_true", help="leave OpenVINO GenAI out (no venv is made)")
    ap.add_argument("--no-hf", action="store_true",
                    help="leave transformers' baselines out (and sentence-transformers from the embedding rows)")
    ap.add_argument("--scenarios", default="all",
                    help=f"comma-separated subset of {','.join(SCENARIOS)}, or 'all' or 'none'")
    ap.add_argument("--quick", action="store_true", help="a toy workload on the tiny model: checks the harness")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--kv-scale", type=float, default=1.0,
                    help="KV budget as a multiple of the workload's demand (blocks to hold every request at once)")
    ap.add_argument("--llm-kwargs", type=json.loads, default={},
                    help="JSON of extra batchrun.LLM arguments for the batchrun runs, e.g. '{\"max_num_seqs\": 64}'")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time each headline system N times (fresh instance each) and keep the fastest: for a "
                         "machine shared with other work")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run batchrun's and vLLM's rows N times in turn (each keeps its fastest): on a machine "
                         "whose speed drifts, systems are then compared at the same speed")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before one worker is abandoned")
    ap.add_argument("--embed-texts", type=int, default=None,
                    help="texts of each embedding row (the first N of the same texts; default: the plan's)")
    args = ap.parse_args(argv)

    scenarios = SCENARIOS if args.scenarios == "all" else () if args.scenarios == "none" else tuple(
        s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    keys = select_plans(args.model or "all")
    if set(keys) - set(PLANS):
        ap.error(f"unknown plans {sorted(set(keys) - set(PLANS))}; choose from {','.join(PLANS)}")
    if args.quick:
        plans = quick_plans(keys) if args.model else [QUICK]
    else:
        plans = [PLANS[k] for k in keys]
    skipped = {p.key: why for p in plans if (why := why_not_here(p))}
    plans = [p for p in plans if p.key not in skipped]
    if args.no_hf:
        plans = [dataclasses.replace(p, static_batches=(), cb_requests_per_step=()) for p in plans]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, (args.timeout or (300.0 if args.quick else 1800.0)) * max(1, args.repeat))

    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "command": cmd.strip(), "started": started,
                           "repeat": max(1, args.repeat), "rounds": max(1, args.rounds), "env": environment(),
                           "models": {}, "skipped": skipped}
    t0 = time.perf_counter()
    runner.log(f"benchmark ({res['mode']}), results into {out}")
    for key, why in skipped.items():
        runner.log(f"[{key}] not run on this machine: {why}")
    # the MFU denominators: a large matmul in each dtype the plans use
    peaks: dict[str, Any] = {}
    for dtype in dict.fromkeys(["float32", *(p.dtype for p in plans)]):
        peaks[dtype] = runner(f"peak-{dtype}", {"task": "peak", "dtype": dtype, "n": 1024 if args.quick else 4096,
                                                "seconds": 0.5 if args.quick else 4.0})
        if "error" in peaks[dtype]:
            print(f"the {dtype} matmul peak measurement failed; see the log above", file=sys.stderr)
            return 1
        runner.log(f"  {dtype} matmul peak: {peaks[dtype]['peak_flops'] / 1e9:.1f} GFLOP/s")
    # the same dtypes' ceiling by instruction (each core's multiply-add loop in registers, times the threads)
    for dtype, flops in isa_peak.linear_flops(THREADS).items():
        if dtype in peaks:
            peaks[dtype]["isa_flops"] = flops
    res["peak"], res["peaks"] = peaks["float32"], peaks
    vllm = openvino = None
    if not args.no_vllm and any(p.vllm for p in plans):
        vllm = _peer(res, runner, "vllm", "vLLM CPU", VllmSetup)
    if not args.no_openvino and any(p.openvino for p in plans):
        from benchmarks.peers.openvino.env import OpenvinoSetup

        openvino = _peer(res, runner, "openvino", "OpenVINO GenAI", OpenvinoSetup)
    st = None
    if any(p.workload == "embed" and p.static_batches for p in plans):
        from benchmarks.peers.sentence_transformers.env import SentenceTransformersSetup

        st = _peer(res, runner, "sentence_transformers", "sentence-transformers", SentenceTransformersSetup)
    for plan in plans:
        if plan.workload == "loglik":
            m = run_loglik(plan, runner, args.llm_kwargs, max(1, args.repeat), vllm, max(1, args.rounds))
            m["derived"] = report.derive_loglik(m)
        elif plan.workload == "embed":
            m = run_embed(plan, runner, args.llm_kwargs, max(1, args.repeat), vllm, st, max(1, args.rounds),
                          args.embed_texts)
            m["derived"] = derive_embed(m)
        else:
            m = run_model(plan, runner, scenarios, args.llm_kwargs, args.kv_scale, max(1, args.repeat), vllm,
                          max(1, args.rounds), openvino)
            m["derived"] = report.derive_model(m, peaks[plan.dtype]["peak_flops"], peaks[plan.dtype].get("bandwidth"),
                                               peaks[plan.dtype].get("isa_flops"))
        _strip_outputs(m)
        res["models"][plan.key] = m
    report.link_baselines(res)
    env = res["env"]
    env["loadavg_end"] = _loadavg()
    env["contended"] = any(float(x.split()[0]) > THREADS + 0.5 for x in (env["loadavg_start"], env["loadavg_end"])
                           if x != "n/a")
    res["elapsed_s"] = time.perf_counter() - t0
    if report.plot(res, out / "throughput.png"):
        res["plot"] = "throughput.png"
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = report.markdown(res)
    (out / "report.md").write_text(md)
    print()
    print(md)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'}" + (f", {out / res['plot']}" if res.get("plot")
                                                                       else "") + f" in {res['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
