"""batchrun-only scenarios beside a plan's headline rows: a shared system prompt, a KV budget below the demand,
n=4 sampling."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.harness.plans import BLOCK_SIZE, Plan
from benchmarks.harness.runner import Runner
from benchmarks.harness.workload import ModelShape, Workload, shared_prefix


def run_scenarios(plan: Plan, runner: Runner, todo: list[str], wl: Workload, shape: ModelShape, vocab: int,
                  llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """batchrun-only scenarios; each in its own process, its variants one after another in that process."""
    from batchrun.model.weights.builtin import builtin_path
    from benchmarks.harness.report import compare_outputs

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
