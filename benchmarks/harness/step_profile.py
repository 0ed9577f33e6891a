"""Where batchrun's step time goes, for the benchmark report: the decode steps against the roofline, and the forward
split into linears, attention and element-wise ops.

The engine's own timers (LLM.metrics(): schedule, forward, logits, sampling and outputs seconds) give the step's
split; these two add what the engine does not time itself, by wrapping methods on the instance around a run, so
the engine's code is untouched:
  - StepKinds: the decode-only steps and the steps with a prompt chunk, each kind's tokens, the context its
    attention reads and its time (ModelRunner.execute): roofline() sets the bytes a step must move (every weight
    once, the K/V of every context) and its FLOPs against this machine's memory bandwidth and matmul peak, and
    gives the floor of a step beside its measured time;
  - op_shares: a second, short pass after the timed one, with every linear module, the attention backend and the
    element-wise ops timed (CPU ops are synchronous, so a wrapper's clock is the op's time).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


class StepKinds:
    """The runner's steps timed around `execute` (block moves, forward, logits, sampling), by kind: decode-only
    steps (one token per sequence, no draft) and steps with a prompt chunk; per kind its steps, tokens, the
    context each sequence's attention reads (its cached tokens plus its chunk) and the (query, key) pairs that
    attention multiplies (causal within a chunk)."""

    KINDS = ("decode", "prefill")

    def __init__(self, llm: Any) -> None:
        self.kinds = {k: {"steps": 0, "tokens": 0, "context_tokens": 0, "attention_pairs": 0.0, "seconds": 0.0}
                      for k in self.KINDS}
        self.ok = False
        runner = getattr(getattr(llm, "engine", None), "runner", None)
        if runner is None or not hasattr(runner, "execute"):
            return
        inner = runner.execute

        def traced(out: Any) -> Any:
            t = time.perf_counter()
            result = inner(out)
            seconds = time.perf_counter() - t
            if out.seqs and not any(s.num_draft for s in out.seqs):
                kind = self.kinds["decode" if out.num_decodes == len(out.seqs) else "prefill"]
                kind["steps"] += 1
                kind["seconds"] += seconds
                for s in out.seqs:
                    q = len(s.token_ids)
                    kind["tokens"] += q
                    kind["context_tokens"] += s.start + q
                    kind["attention_pairs"] += q * (s.start + (q + 1) / 2)
            return result

        runner.execute = traced
        self.ok = True

    def summary(self) -> dict[str, Any] | None:
        if not self.ok:
            return None
        return {k: dict(v) for k, v in self.kinds.items() if v["steps"]} or None  # later passes count on


def roofline(steps: dict[str, Any], weight_bytes: float, kv_bytes_per_token: float, params: float,
             attention_flops_per_pair: float, bandwidth: float, peak_flops: float,
             isa_flops: float | None = None) -> dict[str, Any]:
    """Steps that each stream every weight once and read the K/V of their context, and compute 2 x params a token
    plus attention over their (query, key) pairs: per step their time and the floor the machine allows, the larger
    of bytes over the measured bandwidth and FLOPs over the measured matmul peak (isa_floor_ms: over the ISA's
    peak instead, where given); their bytes and FLOPs a second as shares of those two."""
    n = steps["steps"]
    bytes_moved = n * weight_bytes + steps["context_tokens"] * kv_bytes_per_token
    flops = 2 * params * steps["tokens"] + attention_flops_per_pair * steps["attention_pairs"]
    s = steps["seconds"]
    memory_s = bytes_moved / bandwidth if bandwidth else 0.0
    compute_s = flops / peak_flops if peak_flops else 0.0
    return {"steps": n, "rows_per_step": steps["tokens"] / n, "step_ms": 1e3 * s / n,
            "floor_ms": 1e3 * max(memory_s, compute_s) / n if bandwidth and peak_flops else None,
            "bound": "bandwidth" if memory_s >= compute_s else "compute",
            "isa_floor_ms": 1e3 * max(memory_s, flops / isa_flops) / n if bandwidth and isa_flops else None,
            "bytes_per_s": bytes_moved / s, "flops_per_s": flops / s,
            "bandwidth_share": bytes_moved / s / bandwidth if bandwidth else None,
            "peak_share": flops / s / peak_flops if peak_flops else None}


def _timed(fn: Any, seconds: dict[str, float], key: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - t

    return wrapper


def op_shares(llm: Any, wl: Any, params: list[Any], num_requests: int) -> dict[str, float] | None:
    """Shares of the forward's time in linears, attention, element-wise ops and the rest, over a pass of the first
    num_requests requests after the timed run (their first prompt token moved, so the prefix cache does not
    shorten their prefill). The pass takes the Python path: the native call (model/arch/native_layers.py) makes the
    same kernel calls, but inside one C call where no module is timed. None where the engine's parts are not where
    this expects them."""
    runner = getattr(getattr(llm, "engine", None), "runner", None)
    model = getattr(runner, "model", None)
    if model is None or not hasattr(runner, "backend") or not hasattr(runner, "ops"):
        return None
    seconds: dict[str, float] = defaultdict(float)
    wrapped: list[tuple[Any, str]] = []  # (object, method) wrapped by an instance attribute, removed after

    def wrap(obj: Any, method: str, key: str) -> None:
        if method not in vars(obj):  # (an instance attribute already there is left alone)
            setattr(obj, method, _timed(getattr(obj, method), seconds, key))
            wrapped.append((obj, method))

    lm_head = getattr(model, "lm_head", None)
    taken: list[str] = []  # linear modules timed (not their children: a wrapper may hold an nn.Linear)
    for name, module in model.named_modules():
        if module is lm_head or not type(module).__name__.endswith("Linear") or any(
                name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        wrap(module, "forward", "linears")
    wrap(runner.backend, "forward", "attention")
    for op in ("rms_norm", "silu_mul", "apply_rope"):
        if hasattr(runner.ops, op):
            wrap(runner.ops, op, "elementwise")
    native = (getattr(model, "native_layers", None), getattr(runner, "host_decode", None))
    if native[0] is not None:
        model.native_layers = None
    if native[1] is not None:
        runner.host_decode = None
    forward0 = runner.timers.forward_s
    try:
        n = min(num_requests, len(wl.prompts))
        prompts = [[(p[0] + 1) % 3 + 3] + p[1:] if p else p for p in wl.prompts[:n]]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params[:n], use_tqdm=False)
    finally:
        for obj, method in wrapped:
            delattr(obj, method)
        if native[0] is not None:
            model.native_layers = native[0]
        if native[1] is not None:
            runner.host_decode = native[1]
    forward = runner.timers.forward_s - forward0
    if forward <= 0:
        return None
    shares = {k: v / forward for k, v in seconds.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares
