"""GPU check for the CUDA path, in one run that fits a device call:

1. the kernel tests, compiled on CUDA (`pytest tests/test_kernels.py tests/test_quant_matmul.py`);
2. decode-attention bandwidth: bytes of K/V read per second, and as a share of the GPU's peak, for batch
   64-256 and contexts 512-8192, at the default tiles and a few alternatives (for tuning);
3. end to end: a ~1B-parameter random Llama in bf16 on a ShareGPT-like workload, generated tokens per
   second for batchrun with and without CUDA graphs, and with int8 / int4 weights (the Triton quantized matmul
   in the model), next to transformers' static-batched `generate` and
   transformers' continuous batching, on the same prompts and output lengths (EOS ignored everywhere);
4. the Triton quantized matmul (int8 / int4 weights, GGUF's group sizes) on Llama-3-8B's MLP shapes: weight
   bytes read per second and its time beside torch's bf16 matmul of the same shape, 1 to 256 rows;
5. the same matmul at other tiles, split-K, warps and stages than pick_tiles' (each checked against the
   reference once): the figures a tuning of pick_tiles reads.

    python -m benchmarks.gpu.check [--json-out results.json]
    python -m benchmarks.gpu.check --dry-run      # CPU plumbing check on a tiny model, about a minute

Each part reports its own failure and the script goes on, so one broken baseline still leaves figures for
the rest. Exit code 1 if any part failed. benchmarks/gpu/session.sh runs it after the GPU tests; figures in
docs/performance.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the dry run drives the kernels through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Llama-3.2-1B's shape with the built-in tokenizer's small vocabulary: ~0.98B parameters.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@dataclass
class Report:
    sections: dict[str, object] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run_guarded(report: Report, name: str, fn: Callable[[], object]) -> object | None:
    """Run one part; a failure is printed and recorded, and the check goes on."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark part may fail in any way; report and go on
        traceback.print_exc()
        report.failed.append(name)
        report.sections[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{name}] FAILED after {time.perf_counter() - t0:.1f}s: {type(exc).__name__}: {exc}", flush=True)
        return None
    report.sections[name] = result
    print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    return result


# --- 1. kernel tests -------------------------------------------------------------------------------------


def kernel_tests(dry_run: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
           "tests/test_quant_matmul.py", "tests/test_quant_accuracy.py::test_quantized_linears_on_cuda_equal_the_weight_only_reference"]
    if dry_run:  # the full file runs in `make test`; here only prove the subprocess plumbing
        cmd += ["-k", "store_kv or copy_blocks or round_trip"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-15:]
    print("\n".join(tail))
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        raise RuntimeError(f"pytest exited with {proc.returncode}")
    return {"summary": tail[-1] if tail else ""}


# --- 2. decode bandwidth ---------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], dry_run: bool, graph: bool = False) -> float:
    """Milliseconds per call on the GPU. graph: replayed from a CUDA graph, as the engine's decode steps are, so
    that a call of a few microseconds is not timed at the pace of Python launching it (Triton's launch takes tens
    of microseconds of CPU, torch's matmul a few)."""
    if dry_run:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


# Decode shape of a Llama-3-8B layer: 32 query heads sharing 8 KV heads of 128.
BW_HEADS, BW_KV_HEADS, BW_HEAD_DIM, BW_BLOCK_SIZE = 32, 8, 128, 16


def bandwidth_point(batch: int, context: int, variants: list[tuple[int, int]], device: torch.device,
                    dry_run: bool) -> dict[tuple[int, int], float]:
    """GB/s of K/V read by one decode step at each (block_n, partition_size), blocks shuffled in the pool."""
    from batchrun.kernels.triton import paged_decode_attention
    blocks_per_seq = context // BW_BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, BW_BLOCK_SIZE, BW_KV_HEADS, BW_HEAD_DIM, dtype=torch.bfloat16,
                        device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, BW_HEADS, BW_HEAD_DIM, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    kv_bytes = 2 * batch * context * BW_KV_HEADS * BW_HEAD_DIM * cache.element_size()
    gbps = {}
    for block_n, partition in variants:
        def step(bn: int = block_n, part: int = partition) -> None:
            paged_decode_attention(q, cache, tables, seq_lens, BW_HEAD_DIM**-0.5, context, out=out,
                                   partition_size=part, block_n=bn)

        gbps[(block_n, partition)] = kv_bytes / (time_ms(step, dry_run) * 1e-3) / 1e9
    return gbps


def decode_bandwidth(dry_run: bool, peak_gbps: float) -> list[dict]:
    device = torch.device("cpu" if dry_run else "cuda")
    batches, contexts = ([2], [64]) if dry_run else ([64, 128, 256], [512, 1024, 2048, 4096, 8192])
    # (block_n, partition_size): the default first, then the alternatives worth knowing about when tuning
    variants = [(16, 32)] if dry_run else [(64, 512), (32, 512), (128, 512), (64, 256), (64, 1024)]
    print(f"Hq={BW_HEADS} Hkv={BW_KV_HEADS} D={BW_HEAD_DIM} block_size={BW_BLOCK_SIZE} bf16, shuffled blocks; "
          f"peak {peak_gbps:.0f} GB/s; default tiles block_n/partition = {variants[0][0]}/{variants[0][1]}")
    print(f"{'batch':>6} {'context':>8} {'GB/s':>8} {'of peak':>8} {'best GB/s':>10} {'best tiles':>11}")
    rows = []
    for batch in batches:
        for context in contexts:
            gbps = bandwidth_point(batch, context, variants, device, dry_run)
            default = gbps[variants[0]]
            (best_n, best_part), best = max(gbps.items(), key=lambda item: item[1])
            rows.append({"batch": batch, "context": context, "gbps": default,
                         "fraction_of_peak": default / peak_gbps, "best_gbps": best,
                         "best_block_n": best_n, "best_partition": best_part})
            print(f"{batch:>6} {context:>8} {default:>8.0f} {default / peak_gbps:>8.1%} {best:>10.0f} "
                  f"{f'{best_n}/{best_part}':>11}", flush=True)
    return rows


# --- 3. end to end ---------------------------------------------------------------------------------------


# The end-to-end runs' keys for --e2e-runs, in the order they run (end_to_end)
E2E_RUNS = ("graphs", "eager", "int8", "int4", "hf-static", "hf-cb", "kv-int8", "kv-fp8")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def gen_tokens(self) -> int:
        return sum(self.output_lens)


def sharegpt_like(tokenizer, num_prompts: int, seed: int, max_prompt: int, max_output: int) -> Workload:
    """Prompt and output lengths log-normal like ShareGPT conversations (means ~240 and ~175 tokens,
    long tails), prompts cut from English-like text. No dataset download: the GPU box is offline."""
    from batchrun.model.weights.builtin import synthetic_corpus

    gen = torch.Generator().manual_seed(seed)

    def lognormal(median: float, sigma: float, lo: int, hi: int) -> list[int]:
        x = torch.randn(num_prompts, generator=gen) * sigma + math.log(median)
        return [int(min(hi, max(lo, round(v)))) for v in x.exp().tolist()]

    prompt_lens = lognormal(160, 0.9, 8, max_prompt)
    output_lens = lognormal(128, 0.8, 8, max_output)
    text_ids = tokenizer(" ".join(synthetic_corpus(num_sentences=4000, seed=seed)))["input_ids"]
    prompts, pos = [], 0
    for n in prompt_lens:
        if pos + n > len(text_ids):
            pos = 0
        prompts.append(text_ids[pos : pos + n])
        pos += n
    return Workload(prompts, output_lens)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_batchrun(path: Path, work: Workload, device: str, enforce_eager: bool, quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> dict:
    from batchrun import LLM, SamplingParams
    from benchmarks.harness.worker import metrics_delta

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    t0 = time.perf_counter()
    llm = LLM(str(path), dtype="bfloat16", device=device, enforce_eager=enforce_eager,
              gpu_memory_utilization=0.5, seed=0, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    startup_s = time.perf_counter() - t0
    requests = [{"prompt_token_ids": p} for p in work.prompts]
    # warm-up: the whole workload once, untimed. Triton compiles a kernel specialisation at its first use, and the
    # eager steps (prefill chunks beside decodes) reach specialisations that neither the graphs' capture nor a few
    # short prompts do: with a short warm-up, the first configuration of a process pays its compiles in the timed run
    llm.generate(requests, [params(n) for n in work.output_lens], use_tqdm=False)
    sync()
    before = llm.metrics()
    t0 = time.perf_counter()
    outs = llm.generate(requests, [params(n) for n in work.output_lens], use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "gen_tokens": produced, "startup_s": startup_s,
            "metrics": metrics_delta(before, llm.metrics())}  # the timed run's counters


# The engine's timers that say where a run's host time went, per step (batchrun/engine/metrics.py). On a GPU the
# step waits for the device in sampling (its results come back to the host there): "sampling" holds the GPU's
# compute that the host did not overlap, "forward" the host's time to launch it.
STEP_TIMERS = ("step_time_s", "schedule_time_s", "forward_time_s", "logits_time_s", "sampling_time_s",
               "outputs_time_s")


def run_hf_static(path: Path, work: Workload, device: str, batch_size: int) -> dict:
    """Static batches in input order, left-padded; each batch runs to its longest output. Only the tokens a
    request asked for count (what a batch generates past a request's length is the static-batching waste)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(prompts: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad)

    with torch.inference_mode():
        generate(work.prompts[:4], 8)
        sync()
        t0 = time.perf_counter()
        for i in range(0, len(work.prompts), batch_size):
            generate(work.prompts[i : i + batch_size], max(work.output_lens[i : i + batch_size]))
        sync()
        elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "gen_tokens": work.gen_tokens, "batch_size": batch_size}


def run_hf_continuous(path: Path, work: Workload, device: str) -> dict:
    """transformers' continuous batching manager (what `generate_batch` drives), with each request's own
    output length and no EOS; warm-up (graph capture) happens when the manager starts, before the clock."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens),
                              pad_token_id=model.config.pad_token_id)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in work.prompts),
                          max_generated_length=max(work.output_lens), num_requests=len(work.prompts))
    produced, done = 0, 0
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=10,
                                                   workload_hints=hints) as manager:
        t0 = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while done < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
                continue
            if result.is_finished():
                if result.error:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                produced += len(result.generated_tokens)
                done += 1
        sync()
        elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "gen_tokens": produced}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def count_parameters(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total


def end_to_end(args: argparse.Namespace, report: Report, deadline: float) -> dict:
    from batchrun.model.weights.builtin import make_checkpoint, train_tokenizer

    device = "cpu" if args.dry_run else "cuda"
    shape = TINY if args.dry_run else LLAMA_1B
    tmp = Path(tempfile.mkdtemp(prefix="batchrun-gpu-check-"))
    t0 = time.perf_counter()
    tokenizer = train_tokenizer()
    path = make_checkpoint(tmp / "llama-1b", "llama", seed=0, tokenizer=tokenizer, dtype=torch.bfloat16,
                           **shape)
    n_params = count_parameters(path)
    print(f"random Llama: {n_params / 1e9:.2f}B parameters, made in {time.perf_counter() - t0:.0f}s at {path}")
    work = sharegpt_like(tokenizer, args.num_prompts, seed=0, max_prompt=1024 if not args.dry_run else 48,
                         max_output=512 if not args.dry_run else 12)
    print(f"workload: {len(work.prompts)} prompts, {sum(map(len, work.prompts))} prompt tokens, "
          f"{work.gen_tokens} tokens to generate (max prompt {max(map(len, work.prompts))}, "
          f"max output {max(work.output_lens)})", flush=True)

    static_name = f"HF generate, static batches of {args.static_batch_size}"
    runs: list[tuple[str, str, Callable[[], dict]]] = [  # (key: E2E_RUNS, name, run)
        ("graphs", "batchrun (CUDA graphs)", lambda: run_batchrun(path, work, device, enforce_eager=False)),
        ("eager", "batchrun (eager)", lambda: run_batchrun(path, work, device, enforce_eager=True)),
        ("int8", "batchrun, int8 weights (CUDA graphs)", lambda: run_batchrun(path, work, device, False, "int8")),
        ("int4", "batchrun, int4 weights (CUDA graphs)", lambda: run_batchrun(path, work, device, False, "int4")),
        ("hf-static", static_name, lambda: run_hf_static(path, work, device, args.static_batch_size)),
        ("hf-cb", "HF continuous batching", lambda: run_hf_continuous(path, work, device)),
        # the 8-bit KV caches last: the time budget reaches them after the peers' rows (--e2e-runs picks them)
        ("kv-int8", "batchrun, int8 KV cache (CUDA graphs)",
         lambda: run_batchrun(path, work, device, False, kv_cache_dtype="int8")),
        ("kv-fp8", "batchrun, fp8_e4m3 KV cache (CUDA graphs)",
         lambda: run_batchrun(path, work, device, False, kv_cache_dtype="fp8_e4m3")),
    ]
    assert tuple(key for key, _, _ in runs) == E2E_RUNS
    results = {}
    for key, name, fn in runs:
        if args.e2e_runs and key not in args.e2e_runs:
            results[name] = {"error": "not asked for (--e2e-runs)"}
            continue
        if time.perf_counter() > deadline:
            print(f"[{name}] skipped: time budget spent")
            results[name] = {"error": "skipped: time budget spent"}
            continue
        section(name)
        run_guarded(report, f"e2e: {name}", fn)
        results[name] = report.sections[f"e2e: {name}"]
        free_device_memory()  # each run's model and caches are gone once its function returned
    section("end to end: generated tokens per second")
    hf_static = results[static_name].get("seconds")
    hf_cb = results["HF continuous batching"].get("seconds")
    print(f"{'system':<40} {'gen tok/s':>10} {'seconds':>8} {'x static':>9} {'x HF CB':>8}")
    for name, r in results.items():
        if "seconds" not in r:
            print(f"{name:<40} {r.get('error', '?')}")
            continue
        r["gen_tok_per_s"] = r["gen_tokens"] / r["seconds"]
        x_static = f"{hf_static / r['seconds']:.2f}" if hf_static else "-"
        x_cb = f"{hf_cb / r['seconds']:.2f}" if hf_cb else "-"
        print(f"{name:<40} {r['gen_tok_per_s']:>10.0f} {r['seconds']:>8.1f} {x_static:>9} {x_cb:>8}")
        if "step_time_s" in r.get("metrics", {}):  # batchrun's runs: ms per step of the timed run
            m = r["metrics"]
            per_step = {k.removesuffix("_time_s"): 1e3 * m[k] / max(1, m["num_steps"]) for k in STEP_TIMERS}
            print(f"  {m['num_steps']} steps; ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items()))
        if r["gen_tokens"] != work.gen_tokens:
            print(f"  note: produced {r['gen_tokens']} tokens, {work.gen_tokens} were asked for")
    return {"params": n_params, "num_prompts": len(work.prompts), "gen_tokens": work.gen_tokens, "runs": results}


# --- 4. quantized matmul ---------------------------------------------------------------------------------

# (bits, group_size): Q8_0's groups, int8 per output row, Q4_0/Q4_1/Q4_K's groups, int4 in groups of 128.
QUANT_FORMATS = [(8, 32), (8, 0), (4, 32), (4, 128)]  # group 0: a whole row


def random_quantized_weight(bits: int, group_size: int, out_features: int, in_features: int,
                            device: torch.device):
    """A QuantizedWeight of random integers, scales and (4 bits) offsets; group_size 0: a whole row."""
    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

    group = group_size or in_features
    groups = (out_features, in_features // group)
    if bits == 8:
        q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device)
        return QuantizedWeight(8, q, torch.rand(groups, device=device) * 0.01, None, group)
    q = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, device=device)
    return QuantizedWeight(4, q, torch.rand(groups, device=device) * 0.01, torch.rand(groups, device=device) * -0.08,
                           group)


def check_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A quantized product against linear_ref's fp32 one, within bf16 activations' rounding."""
    err = (got.float() - want).abs().max().item()
    if err > 3e-2 * max(1.0, want.abs().max().item()):
        raise AssertionError(f"{what}: error {err} against the reference")


def quant_matmul_point(bits: int, group_size: int, rows: int, out_features: int, in_features: int,
                       device: torch.device, dry_run: bool) -> dict:
    """Each of quantized_linear's three products (the CUDA-core GEMV, the MMA kernel, the weight dequantized for
    torch's matmul) checked against the reference and timed, beside torch's bf16 matmul of the same shape."""
    from batchrun.kernels.layouts.quant_weight import linear_ref
    from batchrun.kernels.triton import quantized_linear
    from batchrun.kernels.triton.quant_matmul import PATHS, choose_path

    weight = random_quantized_weight(bits, group_size, out_features, in_features, device)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
    want = linear_ref(x, weight)
    ms = {}
    for path in PATHS:
        check_close(quantized_linear(x, weight, path), want, f"{path} at {rows} rows")
        ms[path] = time_ms(lambda p=path: quantized_linear(x, weight, p), dry_run, graph=True)
    dense = torch.randn(out_features, in_features, dtype=torch.bfloat16, device=device)
    bf16_ms = time_ms(lambda: x @ dense.T, dry_run, graph=True)
    chosen = choose_path(rows, bits)
    return {"bits": bits, "group_size": weight.group_size, "rows": rows, "out": out_features, "in": in_features,
            "path_ms": ms, "chosen": chosen, "best": min(ms, key=ms.get), "ms": ms[chosen],
            "weight_gbps": weight.nbytes / (ms[chosen] * 1e-3) / 1e9, "bf16_ms": bf16_ms,
            "speedup_vs_bf16": bf16_ms / ms[chosen]}


def quant_matmul(dry_run: bool, peak_gbps: float) -> list[dict]:
    device = torch.device("cpu" if dry_run else "cuda")
    shapes = [(48, 64)] if dry_run else [(14336, 4096), (4096, 14336)]
    row_counts = [1, 5] if dry_run else [1, 2, 4, 8, 16, 32, 64, 256, 1024]
    formats = QUANT_FORMATS[::2] if dry_run else QUANT_FORMATS
    print(f"bf16 activations, times of CUDA graph replays; weight GB/s (of peak {peak_gbps:.0f}) and speedup "
          "(torch bf16 time / ours) of the chosen product")
    print(f"{'bits':>4} {'group':>6} {'out x in':>12} {'rows':>5} {'gemv ms':>8} {'mma ms':>8} {'deq ms':>8} "
          f"{'bf16 ms':>8} {'chosen':>10} {'best':>10} {'GB/s':>7} {'of peak':>8} {'vs bf16':>8}")
    points = []
    for bits, group_size in formats:
        for out_features, in_features in shapes:
            for rows in row_counts:
                p = quant_matmul_point(bits, group_size, rows, out_features, in_features, device, dry_run)
                points.append(p)
                ms = p["path_ms"]
                print(f"{bits:>4} {p['group_size']:>6} {f'{out_features}x{in_features}':>12} {rows:>5} "
                      f"{ms['gemv']:>8.3f} {ms['mma']:>8.3f} {ms['dequantize']:>8.3f} {p['bf16_ms']:>8.3f} "
                      f"{p['chosen']:>10} {p['best']:>10} {p['weight_gbps']:>7.0f} "
                      f"{p['weight_gbps'] / peak_gbps:>8.1%} {p['speedup_vs_bf16']:>7.2f}x", flush=True)
    return points


# Tile choices tried per point by the sweep (part 5; `--skip sweep` leaves it out): (block_m, block_n, split_k, num_warps, num_stages)
FEW_ROW_TILES = [(16, 64, 1, 4, 3), (16, 32, 1, 4, 3), (16, 16, 1, 4, 3), (16, 64, 4, 4, 3), (16, 32, 4, 4, 3),
                 (16, 64, 8, 4, 3), (16, 32, 8, 4, 4), (16, 128, 8, 8, 3)]
MANY_ROW_TILES = [(64, 128, 1, 4, 3), (64, 64, 1, 4, 3), (128, 128, 1, 8, 3), (64, 128, 1, 8, 4), (64, 64, 2, 4, 3),
                  (32, 64, 4, 4, 3)]


def quant_sweep(dry_run: bool, peak_gbps: float) -> list[dict]:
    """The quantized matmul at tile choices besides the default (pick_tiles), each checked against the reference
    once: what a tuning of pick_tiles reads."""
    from batchrun.kernels.layouts.quant_weight import linear_ref
    from batchrun.kernels.triton.quant_matmul import block_k_for, pick_tiles, quantized_matmul

    device = torch.device("cpu" if dry_run else "cuda")
    shapes = [(48, 64)] if dry_run else [(14336, 4096), (4096, 14336)]
    row_counts = [1] if dry_run else [1, 16, 128]
    formats = [(4, 32)] if dry_run else [(8, 0), (4, 128), (4, 32)]
    print(f"{'bits':>4} {'group':>6} {'out x in':>12} {'rows':>5} {'default ms':>10} {'GB/s':>6} {'best ms':>8} "
          f"{'GB/s':>6} {'of peak':>8} best (block_m, block_n, split_k, warps, stages)")
    points = []
    for bits, group_size in formats:
        for out_features, in_features in shapes:
            weight = random_quantized_weight(bits, group_size, out_features, in_features, device)
            group = weight.group_size
            block_k = block_k_for(group, in_features)
            for rows in row_counts:
                x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
                want = linear_ref(x, weight)
                chosen = pick_tiles(rows, out_features, in_features, bits, block_k)
                default = (chosen.block_m, chosen.block_n, chosen.split_k, chosen.num_warps, 3)
                tiles = [default] + [t for t in (FEW_ROW_TILES if rows <= 16 else MANY_ROW_TILES) if t != default]
                if dry_run:
                    tiles = [default, (16, 16, 2, 4, 3)]
                timed = {}
                for bm, bn, split, warps, stages in tiles:
                    if (in_features // block_k) % split:
                        continue
                    call = functools.partial(quantized_matmul, x, weight.qweight, weight.scale, weight.offset, group,
                                             bits, block_m=bm, block_n=bn, block_k=block_k, split_k=split,
                                             num_warps=warps, num_stages=stages)
                    check_close(call(), want, f"tiles {(bm, bn, split, warps, stages)}")
                    timed[(bm, bn, split, warps, stages)] = time_ms(call, dry_run, graph=True)
                best = min(timed, key=timed.get)
                gbps = {t: weight.nbytes / (ms * 1e-3) / 1e9 for t, ms in timed.items()}
                points.append({"bits": bits, "group_size": group, "out": out_features, "in": in_features,
                               "rows": rows, "default": list(default), "default_ms": timed[default],
                               "best": list(best), "best_ms": timed[best],
                               "all": {str(t): ms for t, ms in timed.items()}})
                print(f"{bits:>4} {group:>6} {f'{out_features}x{in_features}':>12} {rows:>5} {timed[default]:>10.3f} "
                      f"{gbps[default]:>6.0f} {timed[best]:>8.3f} {gbps[best]:>6.0f} {gbps[best] / peak_gbps:>8.1%} "
                      f"{best}", flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU plumbing check: tiny model, interpreted kernels, a few prompts")
    parser.add_argument("--skip", action="append", default=[], choices=["tests", "bandwidth", "e2e", "quant", "sweep"],
                        help="skip a part (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=None, help="end-to-end prompts (default 256; dry run 6)")
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--e2e-runs", type=lambda v: v.split(","), default=None,
                        help=f"end-to-end runs to do, comma-separated, of {', '.join(E2E_RUNS)} (default all)")
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak for the fraction (H200: 4800)")
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds from the start after which no further end-to-end run is started")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = set(args.e2e_runs or ()) - set(E2E_RUNS)
    if unknown:
        parser.error(f"--e2e-runs: unknown {', '.join(sorted(unknown))}")
    if args.num_prompts is None:
        args.num_prompts = 6 if args.dry_run else 256
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --dry-run to check the plumbing on CPU")

    start = time.perf_counter()
    report = Report()
    print(f"torch {torch.__version__}, device: "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (dry run)'}")
    if "tests" not in args.skip:
        section("1. kernel tests")
        run_guarded(report, "kernel tests", lambda: kernel_tests(args.dry_run))
    if "bandwidth" not in args.skip:
        section("2. decode attention bandwidth")
        run_guarded(report, "decode bandwidth", lambda: decode_bandwidth(args.dry_run, args.peak_gbps))
    if "e2e" not in args.skip:
        section("3. end to end")
        run_guarded(report, "end to end", lambda: end_to_end(args, report, start + args.time_budget))
    if "quant" not in args.skip:
        section("4. quantized matmul")
        run_guarded(report, "quantized matmul", lambda: quant_matmul(args.dry_run, args.peak_gbps))
    if "sweep" not in args.skip:
        section("5. quantized matmul: tile sweep")
        run_guarded(report, "quantized matmul sweep", lambda: quant_sweep(args.dry_run, args.peak_gbps))
    total = time.perf_counter() - start
    print(f"\ntotal {total:.0f}s; failed parts: {', '.join(report.failed) or 'none'}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"total_s": total, "failed": report.failed, **report.sections},
                                            indent=2, default=str))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
