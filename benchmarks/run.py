"""`python -m benchmarks.run`: batchrun against transformers, side by side, in one run (what `make bench` runs).

For each model: the matmul peak of this machine first, then batchrun, transformers `generate` with static
batches (batch 16 and 32) and transformers' continuous batching (16 and 32 requests per step) on the same
prompts, each in its own process; then batchrun-only scenarios (shared system prompt, a KV budget of a quarter
of the demand, n=4 sampling). Writes results.json, report.md and throughput.png into --out.

    python -m benchmarks.run                      # tiny and small models, all scenarios (~20 min on 2 cores)
    python -m benchmarks.run --model tiny         # the tiny model only (~5 min)
    python -m benchmarks.run --quick              # a seconds-long end-to-end check of the harness
    python -m benchmarks.run --rounds 2 --model quant   # issue 33's quantized 1B rows beside the bf16 one
    python -m benchmarks.run --model tiny --scenarios none --llm-kwargs '{"max_num_seqs": 128}'
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.clock import best_of
from benchmarks.vllm_env import VllmSetup
from benchmarks.workload import (
    Decoding,
    LengthDist,
    ModelShape,
    Workload,
    contiguous_preallocation,
    model_flops,
    shared_prefix,
    sharegpt_like,
)

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("prefix", "budget", "n4")
# batchrun's KV block: 8 tokens wastes half as many slots in each sequence's last block as 16 (KV slot
# utilisation 98.6% against 97.2% on the headline workload) at no measurable cost in speed on this machine.
BLOCK_SIZE = 8
# transformers' paged cache keeps its own page size (same KV bytes as batchrun).
HF_PAGE_SIZE = 16
THREADS = 2


@dataclass
class Plan:
    """What to run on one model. Lengths follow issue 6: prompt 16..512, output 16..256, log-normal."""

    key: str
    builtin: str
    num_requests: int
    prompt: LengthDist
    output: LengthDist
    static_batches: tuple[int, ...] = (16, 32)
    cb_requests_per_step: tuple[int, ...] = (16, 32)
    scenarios: tuple[str, ...] = SCENARIOS
    scenario_requests: int = 32  # the budget scenario's share of the headline workload
    prefix_requests: int = 64
    prefix_len: int = 512
    suffix: LengthDist = field(default_factory=lambda: LengthDist(48, 0.6, 16, 128))
    prefix_output: LengthDist = field(default_factory=lambda: LengthDist(32, 0.5, 16, 64))
    n4_requests: int = 16
    seed: int = 0
    note: str = ""
    dtype: str = "float32"  # batchrun's and vLLM's; transformers' baselines run only in fp32 plans
    vllm: bool = True
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM arguments
    # also batchrun without draft tokens, and vLLM with n-gram drafts like batchrun's (VLLM_NGRAM)
    speculation_variants: bool = True
    vllm_ngram: bool = True  # (with speculation_variants) the vLLM + n-gram row
    # what the requests are: "sharegpt" (random token ids, ShareGPT-like lengths) or "chat" (benchmarks/chat.py's
    # questions in the model's chat template, replies to EOS of at most 256 tokens); and how they decode
    workload: str = "sharegpt"
    decoding: Decoding = field(default_factory=Decoding)
    checkpoint: str = ""  # a random-weight model of benchmarks/models.py instead of the built-in `builtin`
    openvino: bool = True  # OpenVINO GenAI as a peer (benchmarks/openvino_env.py)
    openvino_u8: bool = False  # also OpenVINO with its CPU default u8 KV cache, a row of its own
    batchrun_kwargs: dict[str, Any] = field(default_factory=dict)  # extra LLM arguments for this plan's rows
    op_profile: int = 32  # requests of batchrun's op-profile pass after its timed run (0: none)
    # Quantized rows (issue 33): what every system's row runs, named in the report ("int8 weights", "int8 KV")
    fmt: str = ""
    openvino_weights: str = "fp32"  # the export's weight format (benchmarks.openvino_env.WEIGHT_OPTIONS)
    openvino_kv: str = ""  # the OpenVINO row's KV cache precision ("": the row's dtype; "u8": its CPU default)
    vllm_checkpoint: str = ""  # "w8a8-int8" / "w4a16-g128": vLLM runs benchmarks.vllm_checkpoint's copy
    baseline: str = ""  # the plan whose batchrun row this plan's batchrun row is compared with (its bf16 row)
    baseline_target: float = 0.0  # decode tok/s over the baseline's that issue 33 asks
    weight_bytes_per_param: float = 0.0  # bytes a decode step streams per weight (0: the dtype's), for the roofline
    lm_head_bytes_per_param: float = 0.0  # the same for batchrun's lm_head (0: the dtype's; int8: quantize_lm_head)


# vLLM's prompt-lookup speculative decoding set like batchrun's default on a CPU (batchrun/engine/ngram.py):
# up to 8 draft tokens from a match of the last 3 down to 1 tokens. Off by default in vLLM.
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# Medians and spreads like ShareGPT's, scaled so that the whole tiny-model run (where transformers' static
# batches, which run each batch to its longest output, cost the most) stays near 5 minutes on 2 cores.
PROMPT = LengthDist(median=96, sigma=0.8, lo=16, hi=512)
OUTPUT = LengthDist(median=48, sigma=0.7, lo=16, hi=256)

# The work users bring (issue 32): SmolLM2-135M-Instruct's real weights answering CHAT_QUESTIONS, greedy and sampled.
SAMPLED = Decoding(temperature=0.8, top_p=0.95, seed=0)
CHAT = dict(workload="chat", builtin="smollm2-135m-instruct", num_requests=0, prompt=PROMPT, output=OUTPUT,
            static_batches=(), cb_requests_per_step=(), scenarios=(), vllm_ngram=False)

# The 1B-class rows: Llama-3.2-1B's shape (benchmarks/models.py), random bf16 weights, random text, EOS ignored.
LLAMA1B = dict(builtin="", num_requests=48, prompt=PROMPT, output=OUTPUT, static_batches=(), cb_requests_per_step=(),
               scenarios=(), dtype="bfloat16", checkpoint="llama-3.2-1b", speculation_variants=False)

PLANS: dict[str, Plan] = {
    "tiny": Plan("tiny", "tiny-llama", 128, PROMPT, OUTPUT),
    # The small model costs ~10x the tiny one per token: 64 requests keep its run near 15 minutes on 2 cores,
    # and the scenarios (batchrun only) are left to the tiny model.
    "small": Plan("small", "small-llama", 64, PROMPT, OUTPUT, scenarios=(),
                  note="Small-model workload reduced to 64 requests (issue 6 asks 128) to keep its run near 15 "
                       "minutes on 2 cores; the scenarios run on the tiny model only."),
    # bf16 plans: batchrun against vLLM only (transformers' bf16 CPU paths are not what a user picks for speed).
    "small-bf16": Plan("small-bf16", "small-llama", 64, PROMPT, OUTPUT, static_batches=(), cb_requests_per_step=(),
                       scenarios=(), dtype="bfloat16"),
    # The real model (SmolLM2-135M-Instruct's weights): the workload a user would run, fp32 and bf16.
    "smollm2": Plan("smollm2", "smollm2-135m-instruct", 64, PROMPT, OUTPUT, static_batches=(32,),
                    cb_requests_per_step=(32,), scenarios=()),
    "smollm2-bf16": Plan("smollm2-bf16", "smollm2-135m-instruct", 64, PROMPT, OUTPUT, static_batches=(),
                         cb_requests_per_step=(), scenarios=(), dtype="bfloat16"),
    "smollm2-256": Plan("smollm2-256", "smollm2-135m-instruct", 256, PROMPT, OUTPUT, static_batches=(),
                        cb_requests_per_step=(), scenarios=(), seed=1),
    "smollm2-256-bf16": Plan("smollm2-256-bf16", "smollm2-135m-instruct", 256, PROMPT, OUTPUT, static_batches=(),
                             cb_requests_per_step=(), scenarios=(), seed=1, dtype="bfloat16"),
    "chat-bf16": Plan("chat-bf16", **CHAT, dtype="bfloat16", openvino_u8=True),
    "chat-fp32": Plan("chat-fp32", **CHAT),
    "chat-bf16-sampled": Plan("chat-bf16-sampled", **CHAT, dtype="bfloat16", decoding=SAMPLED),
    # no drafts-on row: a request of n > 1 never drafts, so it would time the default again
    "chat-bf16-n4": Plan("chat-bf16-n4", **CHAT, dtype="bfloat16", decoding=Decoding(**{**SAMPLED.__dict__, "n": 4}),
                         speculation_variants=False),
    # the int8 KV cache (docs/kv-cache.md) on the chat work, beside OpenVINO's u8 KV cache; asked for by name (any
    # plan takes it too: --llm-kwargs '{"kv_cache_dtype": "int8"}')
    "chat-bf16-kv-int8": Plan("chat-bf16-kv-int8", **CHAT, dtype="bfloat16", openvino_u8=True, fmt="int8 KV",
                              batchrun_kwargs={"kv_cache_dtype": "int8"}, note="batchrun's KV cache in int8"),
    # Where the weights set the pace: Llama-3.2-1B's shape, random bf16 weights, random text with EOS ignored;
    # drafts off on both sides (random weights repeat themselves, so drafts would be accepted as on no real text).
    "llama1b-bf16": Plan("llama1b-bf16", **LLAMA1B, batchrun_kwargs={"num_speculative_tokens": 0}),
    # The same row quantized (issue 33), each beside its peers on the same format; asked for by name
    # (--model llama1b-bf16,llama1b-int8,llama1b-int4,llama1b-kv8: the bf16 row gives the ratios to batchrun's own).
    # int8 weights: batchrun's symmetric int8 in groups of 128 (W8A8 where VNNI runs it), lm_head int8 as OpenVINO's
    # exports keep it (quantize_lm_head); OpenVINO's
    # --weight-format int8 --sym (per channel); vLLM's CPU W8A8 int8 (compressed-tensors, benchmarks.vllm_checkpoint).
    "llama1b-int8": Plan("llama1b-int8", **LLAMA1B, batchrun_kwargs={"num_speculative_tokens": 0,
                                                                     "quantization": "int8", "quantize_lm_head": True},
                         fmt="int8 weights", openvino_weights="int8-sym", vllm_checkpoint="w8a8-int8",
                         vllm_kwargs={"quantization": "compressed-tensors"},
                         baseline="llama1b-bf16", baseline_target=1.7, weight_bytes_per_param=1.0 + 4 / 128,
                         lm_head_bytes_per_param=1.0 + 4 / 128,
                         note="int8 weights, KV cache bf16. batchrun: quantization int8 (symmetric, a scale per 128 "
                              "inputs of a row) and quantize_lm_head (the lm_head int8 too, each row's top 8 logits "
                              "recomputed from the bf16 embedding). OpenVINO GenAI: the IR exported with "
                              "--weight-format int8 --sym (per channel, the tied embedding and lm_head int8 too). vLLM "
                              "CPU: W8A8 int8 (compressed-tensors: weights per channel, activations per token at run "
                              "time; its lm_head bf16), written by benchmarks.vllm_checkpoint."),
    # int4 weights: batchrun's grouped int4 (group 128); OpenVINO's --weight-format int4 --sym --group-size 128
    # --ratio 1.0 (every linear int4; its embedding and tied lm_head int8 symmetric, as nncf keeps them); vLLM's CPU
    # W4A16 (compressed-tensors int4 symmetric in groups of 128, bf16 activations).
    "llama1b-int4": Plan("llama1b-int4", **LLAMA1B, batchrun_kwargs={"num_speculative_tokens": 0,
                                                                     "quantization": "int4", "quantize_lm_head": True},
                         fmt="int4 weights", openvino_weights="int4-sym-g128", vllm_checkpoint="w4a16-g128",
                         vllm_kwargs={"quantization": "compressed-tensors"},
                         baseline="llama1b-bf16", baseline_target=2.5, weight_bytes_per_param=0.5 + 8 / 128,
                         lm_head_bytes_per_param=1.0 + 4 / 128,
                         note="int4 weights in groups of 128, KV cache bf16. batchrun: quantization int4 "
                              "(a scale and an offset per 128 inputs) and quantize_lm_head (the lm_head int8, each "
                              "row's top 8 logits recomputed from the bf16 embedding). OpenVINO "
                              "GenAI: the IR exported with --weight-format int4 --sym --group-size 128 --ratio 1.0 "
                              "--backup-precision int8_sym (every decoder linear int4 symmetric in groups of 128, the "
                              "embedding and tied lm_head int8 symmetric per channel). vLLM CPU: W4A16 "
                              "(compressed-tensors, int4 symmetric in groups of 128, bf16 scales and activations; its "
                              "lm_head bf16), written by benchmarks.vllm_checkpoint."),
    # int8 KV cache, bf16 weights: batchrun's int8 (a scale per token and head); OpenVINO's u8 (its CPU default:
    # keys by channel, values by token, with zero points); vLLM's fp8 (e4m3, the CPU attention backend's).
    "llama1b-kv8": Plan("llama1b-kv8", **LLAMA1B, batchrun_kwargs={"num_speculative_tokens": 0,
                                                                   "kv_cache_dtype": "int8"},
                        fmt="int8 KV", openvino_kv="u8", vllm_kwargs={"kv_cache_dtype": "fp8"},
                        baseline="llama1b-bf16",
                        note="bf16 weights, 8-bit KV cache: batchrun kv_cache_dtype int8, OpenVINO GenAI "
                             "KV_CACHE_PRECISION u8, vLLM CPU kv_cache_dtype fp8 (e4m3). The KV budget is the bf16 "
                             "row's bytes: every system holds the whole workload at once."),
    # The newer families beside vLLM (issue 29), random weights at real small shapes (batchrun/model/weights/builtin.py):
    # a Gemma (sliding and global layers, GeGLU, a 262k vocabulary) and a mixture of experts. Asked for by name.
    "gemma3-270m": Plan("gemma3-270m", "gemma3-270m", 64, PROMPT, OUTPUT, static_batches=(), cb_requests_per_step=(),
                        scenarios=(), note="Gemma 3 270M's shape, random weights"),
    "gemma3-270m-bf16": Plan("gemma3-270m-bf16", "gemma3-270m", 64, PROMPT, OUTPUT, static_batches=(),
                             cb_requests_per_step=(), scenarios=(), dtype="bfloat16",
                             note="Gemma 3 270M's shape, random weights"),
    "qwen3-moe": Plan("qwen3-moe", "small-qwen3-moe", 64, PROMPT, OUTPUT, static_batches=(), cb_requests_per_step=(),
                      scenarios=(), note="Qwen3-MoE scaled down (32 experts, top 2, 12 layers), random weights"),
    "qwen3-moe-bf16": Plan("qwen3-moe-bf16", "small-qwen3-moe", 64, PROMPT, OUTPUT, static_batches=(),
                           cb_requests_per_step=(), scenarios=(), dtype="bfloat16",
                           note="Qwen3-MoE scaled down (32 experts, top 2, 12 layers), random weights"),
}
# What `--model all` (make bench) runs, in this order: the work users bring first, then random text with EOS
# ignored on the same real model (a second view); the other plans are asked for by name.
DEFAULT_PLANS = ("chat-bf16", "chat-fp32", "chat-bf16-sampled", "chat-bf16-n4", "llama1b-bf16", "smollm2-bf16",
                 "smollm2")
# Issue 33's quantized rows with the bf16 row they are compared with: `--model quant` (make bench BENCH_PLANS=quant).
QUANT_PLANS = ("llama1b-bf16", "llama1b-int8", "llama1b-int4", "llama1b-kv8")
PLAN_GROUPS = {"all": DEFAULT_PLANS, "quant": QUANT_PLANS}

QUICK = Plan("tiny", "tiny-llama", 12, LengthDist(24, 0.6, 8, 48), LengthDist(8, 0.5, 4, 12),
             static_batches=(8,), cb_requests_per_step=(8,), scenario_requests=8, prefix_requests=6,
             prefix_len=48, suffix=LengthDist(12, 0.5, 4, 24), prefix_output=LengthDist(6, 0.3, 4, 8), n4_requests=3,
             vllm_kwargs={"enforce_eager": True},  # no torch.compile: the check stays seconds long
             speculation_variants=False, openvino=False, op_profile=3,
             note="Quick mode: a harness check on a toy workload, not a measurement.")


# ---- running workers ------------------------------------------------------------------------------------


class Runner:
    """Starts workers, one process each, and keeps their specs, results and logs under out/work/."""

    def __init__(self, out: Path, timeout_s: float, verbose: bool = True) -> None:
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.verbose = verbose
        self.env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
                        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def __call__(self, name: str, spec: dict[str, Any], python: str | None = None, env: dict[str, str] | None = None,
                 module: str = "benchmarks.worker") -> dict[str, Any]:
        """Run one worker (`module`, by default batchrun's and transformers'; another python and environment
        for systems in their own venv) and return its result, or {"error": why}."""
        spec = {"threads": THREADS, **spec}
        spec_path, out_path, log_path = (self.work / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
        spec_path.write_text(json.dumps(spec))
        out_path.unlink(missing_ok=True)
        t = time.perf_counter()
        with log_path.open("w") as log:
            try:
                proc = subprocess.run([python or sys.executable, "-m", module, str(spec_path), str(out_path)],
                                      cwd=ROOT, env={**(env or self.env), "PYTHONPATH": str(ROOT)} if env else self.env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        took = time.perf_counter() - t
        if rc == 0 and out_path.is_file():
            res = json.loads(out_path.read_text())
            shown = f"{res['gen_tokens'] / res['wall_s']:.1f} gen tok/s" if "wall_s" in res else "done"
            self.log(f"  {name}: {shown} ({took:.0f} s in all)")
            return res
        tail = log_path.read_text().strip().splitlines()[-3:] if log_path.is_file() else []
        why = f"timed out after {self.timeout_s:.0f} s" if rc is None else f"exit code {rc}"
        err = f"{why}: {' | '.join(tail)} (log: {log_path.relative_to(self.work.parent)})"
        self.log(f"  {name}: FAILED, {err}")
        return {"error": err}


# ---- one model ------------------------------------------------------------------------------------------


def _vocab_for_prompts(path: Path, shape: ModelShape) -> int:
    """Prompt ids come from the tokenizer's range: the small model's vocab (32000) is wider than its tokenizer."""
    from tokenizers import Tokenizer

    try:
        n = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    except Exception:  # noqa: BLE001 - any unreadable tokenizer: fall back to the model's vocab
        n = shape.vocab
    return min(n, shape.vocab)


def headline_workload(plan: Plan) -> tuple[Path, ModelShape, int, Workload]:
    """The plan's model (path, shape), the vocabulary its prompts draw from, and its workload."""
    from batchrun.model.weights.builtin import builtin_path

    if plan.checkpoint:
        from benchmarks.models import bench_checkpoint

        path = bench_checkpoint(plan.checkpoint)
    else:
        path = builtin_path(plan.builtin)
    shape = ModelShape.from_checkpoint(path)
    vocab = _vocab_for_prompts(path, shape)
    if plan.workload == "chat":
        from benchmarks.chat import chat_workload

        return path, shape, vocab, chat_workload(path, plan.decoding)
    wl = sharegpt_like(plan.num_requests, vocab, plan.seed, plan.prompt, plan.output)
    wl.decoding = plan.decoding
    return path, shape, vocab, wl


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
    # rounds > 1: every headline system once per round, in turn, and each keeps its fastest run. This VM's
    # speed drifts by 20-30% over minutes, so systems that run minutes apart are compared at different speeds;
    # within a round they run back to back.
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


def vllm_base(plan: Plan, base: dict[str, Any]) -> dict[str, Any]:
    """The vLLM worker's base spec: the plan's checkpoint, or the quantized copy the plan asks for (made here, once);
    {"error": ..., "config": ...} (a failed row) when the copy cannot be made."""
    if not plan.vllm_checkpoint:
        return base
    from benchmarks.vllm_checkpoint import make_quantized

    try:
        return {**base, "model_path": str(make_quantized(base["model_path"], plan.vllm_checkpoint))}
    except (OSError, RuntimeError) as e:
        return {"error": f"vLLM not run: its {plan.vllm_checkpoint} checkpoint could not be made: {e}",
                "config": {"dtype": plan.dtype, "quantization": plan.vllm_checkpoint}}


def select_plans(spec: str) -> tuple[str, ...]:
    """Plan keys from --model: a comma-separated list of plans and groups (all, quant), in order, each once."""
    keys: list[str] = []
    for k in (k.strip() for k in spec.split(",") if k.strip()):
        keys.extend(PLAN_GROUPS.get(k, (k,)))
    return tuple(dict.fromkeys(keys))


def run_scenarios(plan: Plan, runner: Runner, todo: list[str], wl: Workload, shape: ModelShape, vocab: int,
                  llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """batchrun-only scenarios; each in its own process, its variants one after another in that process."""
    from batchrun.model.weights.builtin import builtin_path
    from benchmarks.report import compare_outputs

    out: dict[str, Any] = {}
    block_bytes = BLOCK_SIZE * shape.kv_bytes_per_token
    kw = {"block_size": BLOCK_SIZE, **llm_kwargs}
    base = {"model_path": str(builtin_path(plan.builtin)), "llm_kwargs": kw}
    if "prefix" in todo:
        pw = shared_prefix(plan.prefix_requests, plan.prefix_len, vocab, plan.seed + 1, plan.suffix,
                           plan.prefix_output)
        spec = {**base, "task": "scenario_prefix", "workload": pw.to_json(),
                "llm_kwargs": {**kw, "num_kv_blocks": pw.blocks_needed(BLOCK_SIZE)}}
        r = runner(f"{plan.key}-scenario-prefix", spec)
        if "runs" in r:
            r["outputs_equal"] = {"off": compare_outputs(r["runs"]["on"]["outputs"], r["runs"]["off"]["outputs"])}
        r["description"] = (f"{len(pw)} requests sharing a {plan.prefix_len}-token system prompt, prefix "
                            f"caching on vs off (outputs of 'off' compared with 'on')")
        out["prefix"] = r
    if "budget" in todo:
        bw = wl.head(plan.scenario_requests, f"{wl.name}[:{plan.scenario_requests}]")
        demand = bw.blocks_needed(BLOCK_SIZE)
        budget = max(math.ceil(0.25 * demand), math.ceil(bw.max_len / BLOCK_SIZE) + 1)
        spec = {**base, "task": "scenario_budget", "workload": bw.to_json(), "demand_blocks": demand,
                "budget_blocks": budget, "swap_bytes": demand * block_bytes}
        r = runner(f"{plan.key}-scenario-budget", spec)
        if "runs" in r:
            ref = r["runs"]["unconstrained"]["outputs"]
            r["outputs_equal"] = {k: compare_outputs(ref, v["outputs"]) for k, v in r["runs"].items()
                                  if k != "unconstrained"}
        r["description"] = (f"the first {len(bw)} headline requests with {budget} KV blocks, "
                            f"{budget / demand:.0%} of their demand of {demand}, swap space for all of them; "
                            f"preemption modes swap, recompute, auto against an unconstrained pool (outputs "
                            f"compared with the unconstrained run)")
        out["budget"] = r
    if "n4" in todo:
        nw = wl.head(plan.n4_requests)
        spec = {**base, "task": "scenario_n4", "workload": nw.to_json(), "n": 4,
                "llm_kwargs": {**kw, "num_kv_blocks": 4 * nw.blocks_needed(BLOCK_SIZE)}}
        r = runner(f"{plan.key}-scenario-n4", spec)
        r["description"] = (f"{len(nw)} prompts sampled with n=4 (temperature 0.8) against the same as "
                            f"{4 * len(nw)} separate requests, prefix caching off in both: compare peak KV blocks")
        out["n4"] = r
    for s in out.values():  # token ids have been compared; the report keeps the figures only
        for run in s.get("runs", {}).values():
            run.pop("outputs", None)
    return out


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all",
                    help=f"comma-separated plans of {','.join(PLANS)}, and groups: 'all' ({','.join(DEFAULT_PLANS)}), "
                         f"'quant' ({','.join(QUANT_PLANS)})")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out (no venv is made)")
    ap.add_argument("--no-openvino", action="store_true", help="leave OpenVINO GenAI out (no venv is made)")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers' baselines out")
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
    args = ap.parse_args(argv)

    scenarios = SCENARIOS if args.scenarios == "all" else () if args.scenarios == "none" else tuple(
        s.strip() for s in args.scenarios.split(",") if s.strip())
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    if args.quick:
        plans = [QUICK]
    else:
        keys = select_plans(args.model)
        if set(keys) - set(PLANS):
            ap.error(f"unknown plans {sorted(set(keys) - set(PLANS))}; choose from {','.join(PLANS)}")
        plans = [PLANS[k] for k in keys]
    if args.no_hf:
        plans = [dataclasses.replace(p, static_batches=(), cb_requests_per_step=()) for p in plans]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, (args.timeout or (300.0 if args.quick else 1800.0)) * max(1, args.repeat))

    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "command": cmd.strip(), "started": started,
                           "repeat": max(1, args.repeat), "rounds": max(1, args.rounds), "env": environment(),
                           "models": {}}
    t0 = time.perf_counter()
    runner.log(f"benchmark ({res['mode']}), results into {out}")
    # the MFU denominators: a large matmul in each dtype the plans use
    peaks: dict[str, Any] = {}
    for dtype in dict.fromkeys(["float32", *(p.dtype for p in plans)]):
        peaks[dtype] = runner(f"peak-{dtype}", {"task": "peak", "dtype": dtype, "n": 1024 if args.quick else 4096,
                                                "seconds": 0.5 if args.quick else 4.0})
        if "error" in peaks[dtype]:
            print(f"the {dtype} matmul peak measurement failed; see the log above", file=sys.stderr)
            return 1
        runner.log(f"  {dtype} matmul peak: {peaks[dtype]['peak_flops'] / 1e9:.1f} GFLOP/s")
    res["peak"], res["peaks"] = peaks["float32"], peaks
    vllm = None
    if not args.no_vllm and any(p.vllm for p in plans):
        runner.log("vLLM CPU: making (or finding) its venv")
        vllm = VllmSetup(THREADS)
        res["vllm"] = {"python": str(vllm.python) if vllm.python else None, "error": vllm.error}
        if vllm.error:
            runner.log(f"  vLLM is left out: {vllm.error}")
    openvino = None
    if not args.no_openvino and any(p.openvino for p in plans):
        from benchmarks.openvino_env import OpenvinoSetup

        runner.log("OpenVINO GenAI: making (or finding) its venv")
        openvino = OpenvinoSetup(THREADS)
        res["openvino"] = {"python": str(openvino.python) if openvino.python else None, "error": openvino.error}
        if openvino.error:
            runner.log(f"  OpenVINO GenAI is left out: {openvino.error}")
    for plan in plans:
        m = run_model(plan, runner, scenarios, args.llm_kwargs, args.kv_scale, max(1, args.repeat), vllm,
                      max(1, args.rounds), openvino)
        m["derived"] = report.derive_model(m, peaks[plan.dtype]["peak_flops"], peaks[plan.dtype].get("bandwidth"))
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
