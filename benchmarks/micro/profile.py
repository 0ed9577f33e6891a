"""Where batchrun's time goes on a benchmark workload: `python -m benchmarks.micro.profile [--model tiny|small]`.

Runs the same headline workload as `benchmarks.run` (batchrun only, in this process) and prints:
  - prefill-carrying steps against decode-only steps (wall and model-forward seconds);
  - decode step time by number of running sequences, in bins of 8 (the decode tail of a long-tailed
    workload is many steps with few sequences, each paying the whole weight read and per-step overhead);
  - with --ops, torch profiler tables of one prefill step and ten decode steps (the C kernels are ctypes
    calls, so they show as the gap between the op total and the step time).
Use it before and after an engine change.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch

from benchmarks.harness.plans import BLOCK_SIZE, PLANS, QUICK, THREADS, Plan, headline_workload
from benchmarks.harness.worker import _warm, workload_params


def _setup(plan: Plan) -> tuple[Any, Any]:
    """The headline batchrun setup of `benchmarks.run`, warmed up, with the workload queued in the engine."""
    from batchrun import LLM

    path, _, _, wl = headline_workload(plan)
    torch.set_num_threads(THREADS)
    llm = LLM(str(path), dtype=plan.dtype, device="cpu", num_kv_blocks=wl.blocks_needed(BLOCK_SIZE),
              block_size=BLOCK_SIZE, **plan.batchrun_kwargs)  # the plan's own settings (quantization, drafts off)
    _warm(llm)
    for i, (p, params) in enumerate(zip(wl.prompts, workload_params(wl))):  # the plan's decoding (chat: to EOS)
        llm.engine.add_request(f"r{i}", None, p, params, i)
    return llm, wl


def step_breakdown(plan: Plan) -> None:
    llm, wl = _setup(plan)
    eng = llm.engine
    schedule, last = eng.scheduler.schedule, {}

    def traced_schedule():  # remember whether the step carries prompt tokens (a chunk that checks drafts does not)
        out = schedule()
        last["prefill"] = any(len(s.token_ids) > 1 + s.num_draft for s in out.seqs)
        last["rows"] = out.num_tokens
        return out

    eng.scheduler.schedule = traced_schedule
    pre, dec = [], collections.defaultdict(list)  # (step s, model s, rows); decode steps by running sequences
    steps, t0 = 0, time.perf_counter()
    while eng.scheduler.has_unfinished():
        t, m0 = time.perf_counter(), eng.metrics.model_time_s
        eng.step()
        row = (time.perf_counter() - t, eng.metrics.model_time_s - m0, last["rows"])
        (pre if last.get("prefill") else dec[min(eng.metrics.num_running // 8 * 8, 128)]).append(row)
        steps += 1
    wall = time.perf_counter() - t0
    generated = eng.metrics.generation_tokens
    print(f"{plan.checkpoint or plan.builtin}: {len(wl)} requests, wall {wall:.2f} s, "
          f"{generated / wall:.1f} gen tok/s, {steps} steps")
    print(f"  steps with prefill: {len(pre)}, {sum(r[0] for r in pre):.2f} s (model {sum(r[1] for r in pre):.2f} s)")
    n = sum(len(v) for v in dec.values())
    m = eng.metrics
    print(f"  decode-only steps: {n}, {sum(r[0] for v in dec.values() for r in v):.2f} s "
          f"(model {sum(r[1] for v in dec.values() for r in v):.2f} s); draft tokens {m.draft_tokens}, "
          f"{m.accepted_draft_tokens} kept")
    for k in sorted(dec):
        v = dec[k]
        print(f"    running {k:3d}-{k + 7:<3d} after the step: {len(v):3d} steps, "
              f"{1e3 * sum(r[0] for r in v) / len(v):6.2f} ms/step (model {1e3 * sum(r[1] for r in v) / len(v):6.2f}), "
              f"{sum(r[2] for r in v) / len(v):5.1f} rows")


def op_tables(plan: Plan) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm, _ = _setup(plan)
    eng = llm.engine
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    print("one prefill step:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    while eng.scheduler.waiting:
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            eng.step()
    print("ten decode steps:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


# The C functions timed as linears by shape, and where their rows, outputs and inputs are among the arguments
LINEAR_ARGS = {"linear_bf16": (1, 3, 4), "linear_f32": (2, 4, 5), "greedy_f32": (1, 3, 4), "greedy_bf16": (1, 4, 5),
               "logits_bf16": (1, 4, 5), "sample_bf16": (1, 4, 5), "greedy_f32_screened": (1, 5, 6)}


def kernel_times(plan: Plan, warm_steps: int = 30, steps: int = 60) -> None:
    """The C kernels' share of the step: every function of the CPU kernel library timed, around each call, over
    `steps` steps taken after `warm_steps` (the batch still full); the rest of the step's time is Python and torch
    between them. Linears also by shape, against this CPU's multiply-add ceiling (benchmarks.micro.isa_peak) when it has
    one for the model's dtype; and that rest by where it falls, between which two calls (a linear named by its
    outputs), the largest first: the Python a fused kernel would take out. Where the layers run in one native call
    (decoder_forward), the kernels inside it are not seen one by one: BATCHRUN_NATIVE_LAYERS=0 times each."""
    import ctypes

    from batchrun.kernels import cpu as cpu_kernels
    llm, _ = _setup(plan)
    eng = llm.engine
    for _ in range(warm_steps):
        if eng.scheduler.has_unfinished():
            eng.step()
    lib = cpu_kernels.library({})  # the one shared library, its functions as declared
    if lib is None:
        print("no C kernels here")
        return
    seconds: dict[str, float] = collections.defaultdict(float)
    shapes: dict[tuple[int, int], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])  # seconds, MACs
    gaps: dict[tuple[str, str], float] = collections.defaultdict(float)  # (previous call, next call): seconds
    last = {"name": "step start", "at": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            t = time.perf_counter()
            label = name
            if name in LINEAR_ARGS:  # a linear, or the lm_head with its selection: its rows, n, k by position
                rows, n, k = (args[i] for i in LINEAR_ARGS[name])
                label = f"{name} {n}"
            gaps[(last["name"], label)] += t - last["at"]
            result = fn(*args)
            done = time.perf_counter()
            seconds[name] += done - t
            if label != name:
                shapes[(n, k)][0] += done - t
                shapes[(n, k)][1] += rows * n * k
            last["name"], last["at"] = label, done
            return result
        return call

    originals = {name: fn for name, fn in vars(lib).items() if isinstance(fn, ctypes._CFuncPtr)}
    for name, fn in originals.items():
        setattr(lib, name, timed(name, fn))
    try:
        t0, rows, taken = time.perf_counter(), 0, 0
        while taken < steps and eng.scheduler.has_unfinished():
            rows += eng.metrics.num_running
            last["name"], last["at"] = "step start", time.perf_counter()
            eng.step()
            gaps[(last["name"], "step end")] += time.perf_counter() - last["at"]
            taken += 1
        wall = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)
    if not taken:
        print("the workload ended in the warm-up steps: nothing timed")
        return
    in_c = sum(seconds.values())
    print(f"{plan.key}: {taken} steps of {rows / taken:.1f} sequences, {1e3 * wall / taken:.1f} ms a step, "
          f"{in_c / wall:.1%} of it in the C kernels")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"    {name:22s} {1e3 * s / taken:7.2f} ms a step ({s / wall:5.1%})")
    from batchrun.kernels.cpu import linears as cpu_linears

    bf16_ceiling = "tdpbf16ps" if cpu_linears.bf16_kernel() == "amx" else "vdpbf16ps"
    ceiling = {"bfloat16": bf16_ceiling, "float32": "vfmadd231ps"}.get(plan.dtype)
    peak = _isa_peak(ceiling) if ceiling else None
    for (n, k), (s, macs) in sorted(shapes.items()):
        share = f", {macs / s / peak:.0%} of {ceiling}'s ceiling on {THREADS} cores" if peak else ""
        print(f"    linear {n:6d} x {k:5d}: {macs / s * 1e-9:6.1f} G multiply-adds/s{share}")
    print(f"  outside them, {1e3 * sum(gaps.values()) / taken:.2f} ms a step, between:")
    for (before, after), s in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {before:22s} -> {after:22s} {1e3 * s / taken:6.2f} ms a step")


def _isa_peak(instruction: str) -> float | None:
    """THREADS cores' multiply-adds/s for `instruction` (benchmarks.micro.isa_peak, one core's, times the cores)."""
    from benchmarks.micro import isa_peak

    per_core = isa_peak.measure_here()
    return per_core[instruction][1] * 1e9 * THREADS if instruction in per_core else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PLANS), default="tiny")
    ap.add_argument("--ops", action="store_true", help="also print torch profiler tables")
    ap.add_argument("--quick", action="store_true", help="the toy workload of `benchmarks.run --quick`")
    ap.add_argument("--kernels", action="store_true",
                    help="also time each C kernel inside the engine's steps (kernel_times)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else PLANS[args.model]
    step_breakdown(plan)
    if args.kernels:
        kernel_times(plan, *((2, 8) if args.quick else ()))
    if args.ops:
        op_tables(plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
