"""Where batchrun's step time goes, for the benchmark report: the decode steps against the roofline, and the forward
split into linears, attention and element-wise ops.

The engine's own timers (LLM.metrics(): schedule, forward, logits, sampling and outputs seconds) give the step's
split; these two add what the engine does not time itself, by wrapping methods on the instance around a run, so
the engine's code is untouched:
  - DecodeSteps: for the steps that only decode (one token per sequence, no prompt chunk, no draft), their rows,
    the context they read and their forward time: the bytes a decode step must move (every weight once, the K/V
    of every context) and its FLOPs, over its time, against this machine's memory bandwidth and matmul peak;
  - op_shares: a second, short pass after the timed one, with every linear module, the attention backend and the
    element-wise ops timed (CPU ops are synchronous, so a wrapper's clock is the op's time).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


class DecodeSteps:
    def __init__(self, llm: Any) -> None:
        self.steps = 0
        self.rows = 0
        self.context_tokens = 0
        self.seconds = 0.0
        self.ok = False
        engine = getattr(llm, "engine", None)
        runner = getattr(engine, "runner", None)
        if runner is None or not hasattr(runner, "compute_logits"):
            return
        inner = runner.compute_logits

        def traced(out: Any) -> Any:
            decode_only = bool(out.seqs) and out.num_decodes == len(out.seqs) and not any(s.num_draft for s in out.seqs)
            t = time.perf_counter()
            logits = inner(out)
            if decode_only:
                self.steps += 1
                self.rows += len(out.seqs)
                self.context_tokens += sum(s.start + 1 for s in out.seqs)
                self.seconds += time.perf_counter() - t
            return logits

        runner.compute_logits = traced
        self.ok = True

    def summary(self) -> dict[str, Any] | None:
        if not self.ok or not self.steps:
            return None
        return {"steps": self.steps, "rows": self.rows, "context_tokens": self.context_tokens,
                "forward_s": self.seconds}


def roofline(decode: dict[str, Any], weight_bytes: float, kv_bytes_per_token: float, params: float,
             attention_flops_per_context_token: float, bandwidth: float, peak_flops: float) -> dict[str, Any]:
    """A decode step streams every weight once and reads each row's K/V: its bytes over its time against the measured
    bandwidth, and its FLOPs (2 x params a row, attention over each row's context) against the matmul peak."""
    bytes_moved = decode["steps"] * weight_bytes + decode["context_tokens"] * kv_bytes_per_token
    flops = 2 * params * decode["rows"] + attention_flops_per_context_token * decode["context_tokens"]
    s = decode["forward_s"]
    return {"decode_steps": decode["steps"], "rows_per_step": decode["rows"] / decode["steps"],
            "step_ms": 1e3 * s / decode["steps"], "bytes_per_s": bytes_moved / s, "flops_per_s": flops / s,
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
    shorten their prefill). None where the engine's parts are not where this expects them."""
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
    forward0 = runner.timers.forward_s
    try:
        n = min(num_requests, len(wl.prompts))
        prompts = [[(p[0] + 1) % 3 + 3] + p[1:] if p else p for p in wl.prompts[:n]]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params[:n], use_tqdm=False)
    finally:
        for obj, method in wrapped:
            delattr(obj, method)
    forward = runner.timers.forward_s - forward0
    if forward <= 0:
        return None
    shares = {k: v / forward for k, v in seconds.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares
