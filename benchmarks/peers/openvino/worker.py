"""OpenVINO GenAI as a system under test, in its own venv: `python -m benchmarks.peers.openvino.worker SPEC RESULT`.

Like `benchmarks.peers.vllm.worker`, it imports nothing of batchrun (OpenVINO's venv does not have batchrun's
dependencies), only the standard-library clock and the workload format, so it times and reports as every other
worker does: the pipeline loads (and compiles) untimed, a short warm-up request runs, then ONE
`ContinuousBatchingPipeline.generate(list[ov.Tensor], list[GenerationConfig])` over the whole workload is timed,
token ids in (int64 [1, len] each), one GenerationConfig per request.

The spec: "model_path" (an OpenVINO IR folder, `benchmarks.peers.openvino.env.export`), "workload", "dtype"
(float32 / bfloat16: the inference precision), "kv_bytes" (the KV cache's size), optional "kv_cache_precision"
(u8, f32 or bf16; the row's dtype by default), "prefix_caching" (default on, like batchrun's), "threads",
"repeat", and "scheduler" / "properties" (extra SchedulerConfig fields / compile properties, for experiments).
How each request decodes comes from workload["decoding"] (see `generation_fields`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.clock import Clock, Result, best_of, rss_mb
from benchmarks.harness.workload import Workload
from benchmarks.peers import worker

log = logging.getLogger(__name__)

WARMUP_LEN = 32
WARMUP_TOKENS = 4
# OpenVINO's paged KV cache on a CPU holds 32 tokens a block (GenAI's block size for the CPU plugin; measured:
# a 10-block cache of the tiny model reports 10 x 32 x 6144 bytes in PipelineMetrics.kv_cache_size_in_bytes).
CPU_BLOCK_SIZE = 32
PRECISIONS = {"float32": "f32", "bfloat16": "bf16"}


# ---- pure parts (tested without OpenVINO) ------------------------------------------------------------------


def generation_fields(decoding: dict[str, Any] | None, max_new_tokens: int, index: int) -> dict[str, Any]:
    """The GenerationConfig fields of request `index`, as a plain dict (applied by `generation_config`).

    decoding = {"temperature": float (0 = greedy), "top_p": float (1 = off), "top_k": int (0 = off),
    "seed": int (request i samples with seed + i), "n": int, "stop_at_eos": bool, "eos_token_ids": [int]};
    None (or {}) is the benchmark's old workload: greedy, exactly max_new_tokens tokens.

    Exact lengths (stop_at_eos false): min_new_tokens = max_new_tokens and ignore_eos, and no stop tokens.
    Ended by EOS: every id in eos_token_ids is a stop token (GenAI stops on stop_token_ids; eos_token_id alone is
    one id, set to the first so that nothing of the pipeline's own default is used). Sampled requests get their
    own rng_seed (seed + i), which GenAI keeps per request, so a request's samples do not depend on the batch.
    """
    d = decoding or {}
    temperature = float(d.get("temperature", 0.0))
    n = int(d.get("n", 1))
    fields: dict[str, Any] = {"max_new_tokens": int(max_new_tokens)}
    if temperature <= 0.0:
        if n != 1:
            raise ValueError(f"n = {n} samples per request needs a temperature > 0 (greedy gives one answer)")
        fields["do_sample"] = False
    else:
        fields.update(do_sample=True, temperature=temperature, num_return_sequences=n,
                      rng_seed=int(d.get("seed", 0)) + index)
        top_p, top_k = float(d.get("top_p", 1.0)), int(d.get("top_k", 0))
        if top_p < 1.0:
            fields["top_p"] = top_p
        if top_k > 0:  # GenAI's "off" is its default (the largest size_t), not 0
            fields["top_k"] = top_k
    if d.get("stop_at_eos", False):
        eos = [int(t) for t in d.get("eos_token_ids", [])]
        if not eos:
            raise ValueError("stop_at_eos needs eos_token_ids")
        fields.update(ignore_eos=False, min_new_tokens=0, eos_token_id=eos[0], stop_token_ids=set(eos))
    else:
        fields.update(ignore_eos=True, min_new_tokens=int(max_new_tokens), stop_token_ids=set())
    return fields


def strip_eos(ids: list[int], decoding: dict[str, Any] | None) -> list[int]:
    """A sample's generated ids without the EOS that ended it, as vLLM and batchrun report them.

    GenAI 2026.4.1 keeps the stop token that ended a request as the last generated id (measured on SmolLM2's
    chat replies: each reply that stopped ends with <|im_end|>); a request that ran to max_new_tokens has none.
    With EOS ignored every id is a generated token, EOS ids included."""
    d = decoding or {}
    if d.get("stop_at_eos", False) and ids and ids[-1] in set(d.get("eos_token_ids", [])):
        return ids[:-1]
    return ids


def warmup_prompt(prompts: list[list[int]], vocab_size: int, length: int = WARMUP_LEN) -> list[int]:
    """A warm-up prompt that no workload prompt starts with.

    Pitfall: GenAI 2026.4.1's prefix cache lets several requests restore the same cached partial block at once
    without copy-on-write, so a warm-up whose prompt begins the workload's prompts (e.g. a chat template's
    system prompt) corrupts their answers. A first token that starts no workload prompt shares no block with
    any of them (the cache's blocks are keyed by everything before them)."""
    firsts = {p[0] for p in prompts if p}
    first = next((t for t in range(vocab_size - 1, -1, -1) if t not in firsts), None)
    if first is None:
        raise ValueError("every token id starts some prompt: no warm-up prompt shares nothing with them")
    return [first] + [(first + 1 + i) % vocab_size for i in range(length - 1)]


def kv_block_bytes(config: dict[str, Any], precision: str, block_size: int = CPU_BLOCK_SIZE) -> int:
    """Bytes of one KV block (every layer's keys and values for block_size tokens) in OpenVINO's CPU layout.

    f32 / bf16 / f16: the plain elements. u8 (the CPU plugin's default): one byte an element, plus a scale and a
    zero point (two f32) for each key channel of a block (keys are quantised by channel) and for each value
    token (values by token). Checked against PipelineMetrics.kv_cache_size_in_bytes (the worker reports both)."""
    layers = config["num_hidden_layers"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if precision == "u8":
        per_head = 2 * block_size * head_dim + 8 * head_dim + 8 * block_size
    else:
        per_head = 2 * block_size * head_dim * {"f32": 4, "bf16": 2, "f16": 2}[precision]
    return layers * kv_heads * per_head


def kv_blocks(kv_bytes: int, block_bytes: int, max_len: int, block_size: int = CPU_BLOCK_SIZE) -> int:
    """Blocks in kv_bytes (rounded down: never more memory than the other systems get), but at least what the
    longest request needs alone (GenAI cannot finish a request that does not fit)."""
    return max(kv_bytes // block_bytes, math.ceil(max_len / block_size))


# ---- the run --------------------------------------------------------------------------------------------


def generation_config(fields: dict[str, Any]) -> Any:
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    for k, v in fields.items():
        setattr(cfg, k, v)
    cfg.validate()
    return cfg


def _tensors(prompts: list[list[int]]) -> list[Any]:
    import numpy as np
    import openvino as ov

    return [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]


def task_openvino(spec: dict[str, Any]) -> Result:
    import openvino
    import openvino_genai as ov_genai

    wl = Workload.from_json(spec["workload"])
    decoding = spec["workload"].get("decoding")
    model_path = Path(spec["model_path"])
    model_cfg = json.loads((model_path / "config.json").read_text())
    dtype = spec.get("dtype", "float32")
    precision = PRECISIONS[dtype]
    kv_precision = spec.get("kv_cache_precision") or precision
    block_bytes = kv_block_bytes(model_cfg, kv_precision)
    num_blocks = kv_blocks(int(spec["kv_bytes"]), block_bytes, wl.max_len)
    threads = int(spec.get("threads", 2))
    n = int((decoding or {}).get("n", 1))
    scheduler = {"num_kv_blocks": num_blocks, "cache_size": 0, "max_num_seqs": max(256, len(wl) * n),
                 "enable_prefix_caching": bool(spec.get("prefix_caching", True)), **spec.get("scheduler", {})}
    # the KV cache precision must agree with the inference precision: f32 inference refuses a bf16 cache
    # ("expect kvcache type f32, current: bf16"), so the row's dtype sets both, or u8 where asked
    properties = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": kv_precision,
                  "INFERENCE_NUM_THREADS": threads, **spec.get("properties", {})}
    fields = [generation_fields(decoding, o, i) for i, o in enumerate(wl.output_lens)]
    warm = warmup_prompt(wl.prompts, int(model_cfg["vocab_size"]))
    runs = []
    for _ in range(spec.get("repeat", 1)):
        t = time.perf_counter()
        sc = ov_genai.SchedulerConfig()
        for k, v in scheduler.items():
            setattr(sc, k, v)
        pipe = ov_genai.ContinuousBatchingPipeline(str(model_path), sc, "CPU", properties)
        load_s, load_rss = time.perf_counter() - t, rss_mb()
        pipe.generate(_tensors([warm]), [generation_config({"max_new_tokens": WARMUP_TOKENS, "do_sample": False,
                                                            "min_new_tokens": WARMUP_TOKENS,
                                                            "ignore_eos": True})])
        configs = [generation_config(f) for f in fields]
        prompts = _tensors(wl.prompts)
        with Clock(threads) as clock:
            outs = pipe.generate(prompts, configs)
        # one EncodedGenerationResult per request, in request order; with n > 1 its samples come best score
        # first (GenAI sorts them by cumulative log-probability), not in the order they were drawn
        samples = [[strip_eos(list(ids), decoding) for ids in o.m_generation_ids] for o in outs]
        outputs = [s[0] if n == 1 else s for s in samples]
        metrics = pipe.get_metrics()
        runs.append({**clock.as_dict(), "outputs": outputs, "gen_tokens": sum(len(x) for s in samples for x in s),
                     "load_s": load_s, "load_rss_mb": load_rss,
                     "kv_cache_bytes": int(metrics.kv_cache_size_in_bytes), "kv_blocks": num_blocks,
                     "kv_block_bytes": block_bytes, "max_cache_usage_pct": float(metrics.max_cache_usage),
                     "config": {"dtype": dtype, "kv_cache_precision": kv_precision,
                                "prefix_caching": scheduler["enable_prefix_caching"], "kv_bytes": spec["kv_bytes"],
                                "scheduler": dict(scheduler), "properties": properties,
                                "decoding": decoding}})
        if runs[-1]["kv_cache_bytes"] != num_blocks * block_bytes:
            log.warning("KV cache: %d bytes allocated, %d x %d expected (kv_block_bytes is out of date)",
                        runs[-1]["kv_cache_bytes"], num_blocks, block_bytes)
        del pipe
    res = best_of(runs)
    res["openvino_version"] = openvino.__version__
    res["openvino_genai_version"] = ov_genai.__version__
    return res


def main(argv: list[str]) -> int:
    return worker.main(argv, "openvino", task_openvino)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
