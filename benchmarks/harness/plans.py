"""The benchmark's plans: what each row runs (model, workload, decoding, systems, formats), by name."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.workload import Decoding, LengthDist, ModelShape, Workload, sharegpt_like

SCENARIOS = ("prefix", "budget", "n4")
# batchrun's KV block: 8 tokens wastes half as many slots in each sequence's last block as 16, at no measurable
# cost in speed.
BLOCK_SIZE = 8
# transformers' paged cache keeps its own page size (same KV bytes as batchrun).
HF_PAGE_SIZE = 16
# threads every system runs with (its worker's OMP / torch threads, vLLM's bound cores, OpenVINO's inference
# threads): BENCH_THREADS, for the same rows at several core counts (`make bench BENCH_THREADS=1`)
THREADS = int(os.environ.get("BENCH_THREADS", "2"))


@dataclass
class Plan:
    """What to run on one model. Lengths are log-normal: prompt 16..512, output 16..256."""

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
    # what the requests are: "sharegpt" (random token ids, ShareGPT-like lengths), "chat" (benchmarks/harness/chat.py's
    # questions in the model's chat template, replies to EOS of at most 256 tokens), "loglik" (num_requests
    # four-choice items scored, benchmarks/harness/loglik.py; static_batches: transformers' batch sizes), or "embed"
    # (num_requests texts embedded, benchmarks/harness/embed.py, lengths from `prompt`; checkpoint: an
    # embed_models.py name; static_batches: sentence-transformers' batch sizes); and how they decode
    workload: str = "sharegpt"
    decoding: Decoding = field(default_factory=Decoding)
    checkpoint: str = ""  # a random-weight model of benchmarks/harness/models.py instead of the built-in `builtin`
    openvino: bool = True  # OpenVINO GenAI as a peer (benchmarks/peers/openvino/env.py)
    openvino_u8: bool = False  # also OpenVINO with its CPU default u8 KV cache, a row of its own
    batchrun_kwargs: dict[str, Any] = field(default_factory=dict)  # extra LLM arguments for this plan's rows
    op_profile: int = 32  # requests of batchrun's op-profile pass after its timed run (0: none)
    # Quantized rows: what every system's row runs, named in the report ("int8 weights", "int8 KV")
    fmt: str = ""
    openvino_weights: str = "fp32"  # the export's weight format (benchmarks.peers.openvino.env.WEIGHT_OPTIONS)
    openvino_kv: str = ""  # the OpenVINO row's KV cache precision ("": the row's dtype; "u8": its CPU default)
    vllm_checkpoint: str = ""  # "w8a8-int8" / "w4a16-g128": vLLM runs benchmarks.peers.vllm.checkpoint's copy
    baseline: str = ""  # the plan whose batchrun row this plan's batchrun row is compared with (its bf16 row)
    baseline_target: float = 0.0  # the decode tok/s over the baseline's that the row aims at
    weight_bytes_per_param: float = 0.0  # bytes a decode step streams per weight (0: the dtype's), for the roofline
    lm_head_bytes_per_param: float = 0.0  # the same for batchrun's lm_head (0: the dtype's; int8: quantize_lm_head)
    # the memory the hungriest system's row needs: a machine with less available skips the plan, saying why
    memory_gib: float = 0.0


# vLLM's prompt-lookup speculative decoding set like batchrun's default on a CPU (batchrun/engine/ngram.py):
# up to 8 draft tokens from a match of the last 3 down to 1 tokens. Off by default in vLLM.
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# Medians and spreads like ShareGPT's, scaled so that the whole tiny-model run stays short (transformers' static
# batches, which run each batch to its longest output, cost the most there).
PROMPT = LengthDist(median=96, sigma=0.8, lo=16, hi=512)
OUTPUT = LengthDist(median=48, sigma=0.7, lo=16, hi=256)

# The work users bring: SmolLM2-135M-Instruct's real weights answering CHAT_QUESTIONS, greedy and sampled.
SAMPLED = Decoding(temperature=0.8, top_p=0.95, seed=0)
CHAT = dict(workload="chat", builtin="smollm2-135m-instruct", num_requests=0, prompt=PROMPT, output=OUTPUT,
            static_batches=(), cb_requests_per_step=(), scenarios=(), vllm_ngram=False)

# Scoring multiple-choice continuations, an evaluation harness's work: SmolLM2-135M-Instruct's real weights on 500
# four-choice items of the repository's text. batchrun as its loglikelihood jobs run (and through vLLM's names as a
# vLLM client), vLLM's prompt_logprobs, transformers as lm-eval's HF backend (batches of 32).
LOGLIK = dict(workload="loglik", builtin="smollm2-135m-instruct", num_requests=500, prompt=PROMPT, output=OUTPUT,
              static_batches=(32,), cb_requests_per_step=(), scenarios=(), speculation_variants=False,
              vllm_ngram=False, openvino=False, op_profile=0)

# Embedding texts (benchmarks/harness/embed.py): the repository's text in texts whose lengths, in the BERT tokenizer's
# tokens, are log-normal within BERT's 512 positions.
EMBED_TEXTS = LengthDist(median=128, sigma=0.8, lo=16, hi=512)
# The embedding rows: ~2,000 texts embedded by batchrun (LLM(task="embed").embed), sentence-transformers (encode in
# batches of 32, its default; the reference for the vectors) and vLLM CPU (LLM(runner="pooling").embed), each in its
# own process and venv, at its defaults in the row's dtype, on random-weight sentence-transformers checkpoints
# (benchmarks/harness/embed_models.py). static_batches: sentence-transformers' batch sizes (--no-hf leaves it out).
EMBED = dict(builtin="", num_requests=2000, prompt=EMBED_TEXTS, output=EMBED_TEXTS, workload="embed",
             static_batches=(32,), cb_requests_per_step=(), scenarios=(), speculation_variants=False, vllm_ngram=False,
             openvino=False, op_profile=0)
EMBED_BERT = dict(checkpoint="bert-base-st", note="A BERT-base encoder (BertModel: 12 layers, hidden 768), random "
                  "weights; mean pooling, normalised.")
EMBED_QWEN3 = dict(checkpoint="qwen3-embedding-0.6b", note="Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, "
                   "16 heads, 8 KV heads), random weights; last-token pooling, normalised.")

# The 1B-class rows: Llama-3.2-1B's shape (benchmarks/harness/models.py), random bf16 weights, random text, EOS ignored.
LLAMA1B = dict(builtin="", num_requests=48, prompt=PROMPT, output=OUTPUT, static_batches=(), cb_requests_per_step=(),
               scenarios=(), dtype="bfloat16", checkpoint="llama-3.2-1b", speculation_variants=False)

# The 8B-class row: Llama-3.1-8B's shape, random bf16 weights (15.0 GiB, one copy held), 16 prompts of about 80 tokens,
# 512 greedy tokens each with EOS ignored; drafts off as on the 1B row. OpenVINO GenAI is left out: the harness
# exports its IR in fp32 (benchmarks/peers/openvino/env.py), twice the checkpoint, 30 GiB here.
LLAMA8B = dict(builtin="", num_requests=16, prompt=LengthDist(80, 0.3, 48, 128), output=LengthDist(512, 0.0, 512, 512),
               static_batches=(), cb_requests_per_step=(), scenarios=(), dtype="bfloat16", checkpoint="llama-3.1-8b",
               speculation_variants=False, openvino=False, op_profile=0, memory_gib=21.0,
               batchrun_kwargs={"num_speculative_tokens": 0},
               note="Llama-3.1-8B's shape, random bf16 weights: 16 prompts, 512 greedy tokens each (EOS ignored). "
                    "OpenVINO GenAI not run (its fp32 IR of this model is 30 GiB).")

PLANS: dict[str, Plan] = {
    "tiny": Plan("tiny", "tiny-llama", 128, PROMPT, OUTPUT),
    # The small model costs far more per token than the tiny one: half the requests, and the scenarios (batchrun
    # only) are left to the tiny model.
    "small": Plan("small", "small-llama", 64, PROMPT, OUTPUT, scenarios=(),
                  note="Small-model workload of 64 requests (half the tiny model's) to keep its run short on "
                       "2 cores; the scenarios run on the tiny model only."),
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
    # The size of model a CPU machine can only just hold, one copy of its weights (docs/memory.md)
    "llama8b-bf16": Plan("llama8b-bf16", **LLAMA8B),
    # The 1B row quantized, each beside its peers on the same format; asked for by name
    # (--model llama1b-bf16,llama1b-int8,llama1b-int4,llama1b-kv8: the bf16 row gives the ratios to batchrun's own).
    # int8 weights: batchrun's symmetric int8 in groups of 128 (W8A8 where VNNI runs it), lm_head int8 as OpenVINO's
    # exports keep it (quantize_lm_head); OpenVINO's
    # --weight-format int8 --sym (per channel); vLLM's CPU W8A8 int8 (compressed-tensors, benchmarks.peers.vllm.checkpoint).
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
                              "time; its lm_head bf16), written by benchmarks.peers.vllm.checkpoint."),
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
                              "lm_head bf16), written by benchmarks.peers.vllm.checkpoint."),
    # int8 KV cache, bf16 weights: batchrun's int8 (a scale per token and head); OpenVINO's u8 (its CPU default:
    # keys by channel, values by token, with zero points); vLLM's fp8 (e4m3, the CPU attention backend's).
    "llama1b-kv8": Plan("llama1b-kv8", **LLAMA1B, batchrun_kwargs={"num_speculative_tokens": 0,
                                                                   "kv_cache_dtype": "int8"},
                        fmt="int8 KV", openvino_kv="u8", vllm_kwargs={"kv_cache_dtype": "fp8"},
                        baseline="llama1b-bf16",
                        note="bf16 weights, 8-bit KV cache: batchrun kv_cache_dtype int8, OpenVINO GenAI "
                             "KV_CACHE_PRECISION u8, vLLM CPU kv_cache_dtype fp8 (e4m3). The KV budget is the bf16 "
                             "row's bytes: every system holds the whole workload at once."),
    # The newer families beside vLLM, random weights at real small shapes (batchrun/model/weights/builtin.py):
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
    "loglik-bf16": Plan("loglik-bf16", **LOGLIK, dtype="bfloat16"),
    "loglik-fp32": Plan("loglik-fp32", **LOGLIK),
    "embed-bert-bf16": Plan("embed-bert-bf16", **EMBED, **EMBED_BERT, dtype="bfloat16"),
    "embed-bert-fp32": Plan("embed-bert-fp32", **EMBED, **EMBED_BERT),
    "embed-qwen3-bf16": Plan("embed-qwen3-bf16", **EMBED, **EMBED_QWEN3, dtype="bfloat16"),
    "embed-qwen3-fp32": Plan("embed-qwen3-fp32", **EMBED, **EMBED_QWEN3),
}
# What `--model all` (make bench) runs, in this order: the work users bring first, then random text with EOS
# ignored on the same real model (a second view); the other plans are asked for by name.
DEFAULT_PLANS = ("chat-bf16", "chat-fp32", "chat-bf16-sampled", "chat-bf16-n4", "llama1b-bf16", "llama8b-bf16",
                 "smollm2-bf16", "smollm2")
# The quantized rows with the bf16 row they are compared with: `--model quant` (make bench BENCH_PLANS=quant).
QUANT_PLANS = ("llama1b-bf16", "llama1b-int8", "llama1b-int4", "llama1b-kv8")
# The loglikelihood row (`--model loglik`): many minutes on 2 cores (every peer computes each choice's whole prompt),
# so not in the default set; its fp32 twin (longer still) is asked for by name.
LOGLIK_PLANS = ("loglik-bf16",)
# The embedding rows (`--model embed`, or one model's two dtypes: embed-bert, embed-qwen3): asked for by name.
EMBED_GROUPS = {"embed-bert": ("embed-bert-bf16", "embed-bert-fp32"),
                "embed-qwen3": ("embed-qwen3-bf16", "embed-qwen3-fp32")}
EMBED_PLANS = EMBED_GROUPS["embed-bert"] + EMBED_GROUPS["embed-qwen3"]
PLAN_GROUPS = {"all": DEFAULT_PLANS, "quant": QUANT_PLANS, "loglik": LOGLIK_PLANS, "embed": EMBED_PLANS,
               **EMBED_GROUPS}

QUICK = Plan("tiny", "tiny-llama", 12, LengthDist(24, 0.6, 8, 48), LengthDist(8, 0.5, 4, 12),
             static_batches=(8,), cb_requests_per_step=(8,), scenario_requests=8, prefix_requests=6,
             prefix_len=48, suffix=LengthDist(12, 0.5, 4, 24), prefix_output=LengthDist(6, 0.3, 4, 8), n4_requests=3,
             vllm_kwargs={"enforce_eager": True},  # no torch.compile: the check stays seconds long
             speculation_variants=False, openvino=False, op_profile=3,
             note="Quick mode: a harness check on a toy workload, not a measurement.")


# Quick mode's loglikelihood plan (`--quick --model loglik`): a few items on the tiny model, every system.
QUICK_LOGLIK = Plan("loglik-tiny", "tiny-llama", 6, PROMPT, OUTPUT, workload="loglik", static_batches=(4,),
                    cb_requests_per_step=(), scenarios=(), speculation_variants=False, vllm_ngram=False,
                    openvino=False, op_profile=0, vllm_kwargs={"enforce_eager": True},
                    note="Quick mode: a harness check on a few items of the tiny random model, not a measurement.")


# Quick mode's embedding plans: a few dozen short texts on toy checkpoints of the same two families, each full plan's
# stand-in in the same dtype.
QUICK_EMBED = dict(EMBED, num_requests=24, prompt=LengthDist(32, 0.6, 16, 96), output=LengthDist(32, 0.6, 16, 96),
                   vllm_kwargs={"enforce_eager": True},
                   note="Quick mode: a harness check on a few dozen texts of a toy checkpoint, not a measurement.")
QUICK_EMBED_PLANS: dict[str, Plan] = {
    k: Plan(k.replace("embed-bert", "embed-bert-tiny").replace("embed-qwen3", "embed-qwen3-tiny"), **QUICK_EMBED,
            checkpoint="bert-tiny-st" if "bert" in k else "qwen3-embedding-tiny", dtype=PLANS[k].dtype)
    for k in EMBED_PLANS}


def quick_plans(keys: tuple[str, ...]) -> list[Plan]:
    """Quick mode's stand-ins for the plans asked for: QUICK_LOGLIK for loglikelihood plans, QUICK_EMBED_PLANS' for
    embedding plans, QUICK for the others."""
    out: list[Plan] = []
    for k in keys:
        p = (QUICK_LOGLIK if PLANS[k].workload == "loglik" else QUICK_EMBED_PLANS[k] if PLANS[k].workload == "embed"
             else QUICK)
        if all(q is not p for q in out):
            out.append(p)
    return out


def select_plans(spec: str) -> tuple[str, ...]:
    """Plan keys from --model: a comma-separated list of plans and groups (PLAN_GROUPS: all, quant, loglik, embed,
    embed-bert, embed-qwen3), in order, each once."""
    keys: list[str] = []
    for k in (k.strip() for k in spec.split(",") if k.strip()):
        keys.extend(PLAN_GROUPS.get(k, (k,)))
    return tuple(dict.fromkeys(keys))


def why_not_here(plan: Plan) -> str | None:
    """Why this machine cannot run the plan (None: it can): less memory available than the plan's memory_gib, or
    too little disk for its random-weight checkpoint where that is not made yet."""
    from batchrun.model.runner.memory import available_memory
    from benchmarks.harness.models import GIB, bench_dir, bytes_to_make

    if plan.memory_gib:
        memory = available_memory()
        if memory.free < plan.memory_gib * GIB:
            return f"needs {plan.memory_gib:.0f} GiB of memory, this machine has {memory.detail}"
    need = bytes_to_make(plan.checkpoint) if plan.checkpoint else 0
    if need:
        folder = bench_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder).free < need:
            return f"its checkpoint needs {need / GIB:.1f} GiB of disk in {folder}"
    return None


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
        from benchmarks.harness.models import bench_checkpoint

        path = bench_checkpoint(plan.checkpoint)
    else:
        path = builtin_path(plan.builtin)
    shape = ModelShape.from_checkpoint(path)
    vocab = _vocab_for_prompts(path, shape)
    if plan.workload == "chat":
        from benchmarks.harness.chat import chat_workload

        return path, shape, vocab, chat_workload(path, plan.decoding)
    wl = sharegpt_like(plan.num_requests, vocab, plan.seed, plan.prompt, plan.output)
    wl.decoding = plan.decoding
    return path, shape, vocab, wl
