"""The embedding rows' figures and Markdown: texts/s and BERT tokens/s of every run, its peak RSS, batchrun's ratio
to the fastest peer, and how far each system's vectors agree with sentence-transformers' (cosine over the first
texts). Pure functions of the results dict, like benchmarks/harness/report.py, which calls them."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.embed import cosine

EMBED_LABELS = {"batchrun": "batchrun", "sentence_transformers": "sentence-transformers",
                "vllm": "vLLM CPU, runner=pooling"}
EMBED_PEERS = ("sentence_transformers", "vllm")
REFERENCE = "sentence_transformers"  # the system whose vectors the others are compared with


def compare_vectors(ref: list[list[float]], other: list[list[float]]) -> dict[str, Any]:
    """The cosine of each text's vector with the reference's, over the texts both kept: min and mean."""
    cos = [cosine(a, b) for a, b in zip(ref, other)]
    return {"texts": len(cos), "min_cosine": min(cos, default=float("nan")),
            "mean_cosine": sum(cos) / len(cos) if cos else float("nan")}


def _norms(vecs: list[list[float]]) -> tuple[float, float]:
    norms = [sum(x * x for x in v) ** 0.5 for v in vecs]
    return (min(norms), max(norms)) if norms else (float("nan"), float("nan"))


def derive_embed(m: dict[str, Any]) -> dict[str, Any]:
    """An embedding plan's figures: each run's rates and memory, each run's vectors against sentence-transformers'
    (its fastest run's), and batchrun's texts/s over the fastest peer's."""
    w = m["workload"]
    derived: dict[str, Any] = {"systems": {}, "ratios": {}, "targets": []}
    ref_runs = [v for v in m["runs"].get(REFERENCE, []) if not v.get("error")]
    ref_run = min(ref_runs, key=lambda v: v["wall_s"]) if ref_runs else None
    ref = ref_run.get("embeddings") if ref_run else None
    for system, variants in m["runs"].items():
        rows = []
        for v in variants:
            row: dict[str, Any] = {"config": v.get("config", {}), "error": v.get("error")}
            if not v.get("error"):
                wall = v["wall_s"]
                vecs = v.get("embeddings") or []
                row.update(wall_s=wall, texts_s=v["items"] / wall, tokens_s=w["tokens"] / wall,
                           model_tokens_s=w["model_tokens"] / wall, peak_rss_mb=v.get("peak_rss_mb"),
                           load_rss_mb=v.get("load_rss_mb"), load_s=v.get("load_s"), cpu_share=v.get("cpu_share"),
                           other_load=v.get("other_load"), repeat_walls_s=v.get("repeat_walls_s"),
                           round_walls_s=v.get("round_walls_s"), dim=v.get("dim"), norms=_norms(vecs))
                if v["items"] != w["texts"]:
                    row["error"] = f"embedded {v['items']} texts, the workload has {w['texts']}"
                elif ref is not None and vecs and ref and len(vecs[0]) != len(ref[0]):
                    row["error"] = f"vectors of {len(vecs[0])} dimensions, sentence-transformers' have {len(ref[0])}"
                elif ref is not None and v is not ref_run:
                    row["vs_reference"] = compare_vectors(ref, vecs)
            rows.append(row)
        ok = [r for r in rows if not r.get("error")]
        derived["systems"][system] = {"variants": rows, "best": max(ok, key=lambda r: r["texts_s"]) if ok else None}
    br = derived["systems"].get("batchrun", {}).get("best")
    peers = [(p, derived["systems"][p]["best"]) for p in EMBED_PEERS if derived["systems"].get(p, {}).get("best")]
    for name, s in peers:
        if br:
            derived["ratios"][name] = br["texts_s"] / s["texts_s"]
    if br and peers:
        name, fastest = max(peers, key=lambda p: p[1]["texts_s"])
        derived["fastest_peer"] = {"system": name, "config": fastest["config"], "texts_s": fastest["texts_s"],
                                   "ratio": br["texts_s"] / fastest["texts_s"]}
    return derived


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _dt(dtype: str | None) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype or "", dtype or "")


def _cos_str(cmp: dict[str, Any] | None) -> str:
    return f"{cmp['min_cosine']:.6f} / {cmp['mean_cosine']:.6f}" if cmp else "-"


def _cfg(c: dict[str, Any]) -> str:
    parts = []
    if "batch_size" in c:
        parts.append(f"batch {c['batch_size']}")
    if c.get("kv_cache_memory_bytes"):
        parts.append(f"KV {c['kv_cache_memory_bytes'] / 2**20:.0f} MiB")
    if c.get("max_model_len"):
        parts.append(f"max_model_len {c['max_model_len']}")
    parts += [f"{k} {v}" for k, v in c.items() if k in ("max_num_batched_tokens", "max_num_seqs", "enforce_eager")]
    return ", ".join(parts) or "defaults"


def embed_summary_table(models: list[dict[str, Any]]) -> list[str]:
    """One line per embedding plan: texts/s of each system, batchrun's ratio to the fastest peer, the vectors'
    lowest cosine with sentence-transformers', and peak RSS."""
    lines = ["| row | batchrun texts/s | sentence-transformers | vLLM CPU | batchrun / fastest peer | min cosine vs "
             "sentence-transformers (batchrun / vLLM) | peak RSS MiB (batchrun / sentence-transformers / vLLM) |",
             "|---|---:|---:|---:|---:|---|---|"]
    for m in models:
        d = m["derived"]
        rows = [d["systems"].get(s, {}).get("best") for s in ("batchrun", "sentence_transformers", "vllm")]
        fp = d.get("fastest_peer")
        rate = " | ".join(_f(r["texts_s"], "{:.2f}") if r else "-" for r in rows)
        cos = " / ".join(_f((r.get("vs_reference") or {}).get("min_cosine") if r else None, "{:.6f}")
                         for r in (rows[0], rows[2]))
        rss = " / ".join(_f(r.get("peak_rss_mb"), "{:.0f}") if r else "-" for r in rows)
        lines.append(f"| {m['model']} {m['workload']['texts']} texts, {_dt(m.get('dtype'))} | {rate} | "
                     f"{_f(fp['ratio'], '{:.2f}x') if fp else '-'} | {cos} | {rss} |")
    return lines


def embed_markdown(m: dict[str, Any], noisy: Any = None, mark: str = "") -> list[str]:
    """An embedding plan's section: the texts, the model, and every run. `noisy(run)` says whether a run ran beside
    other work (marked with `mark`)."""
    d, w, sh = m["derived"], m["workload"], m["shape"]
    starts = ", ".join(f"{k} {v}" for k, v in (w.get("starts") or {}).items())
    lines = [f"## Embeddings: {m['model']} ({sh['architecture']}, {sh['num_layers']} layers, hidden {sh['hidden']}; "
             f"{_dt(m.get('dtype'))})", "",
             f"Workload: {w['texts']} texts of the repository's text (starting in {starts}; fingerprint "
             f"{w.get('fingerprint')}), {w['tokens_min']}..{w['tokens_max']} BERT tokens (mean {w['tokens_mean']:.0f}, "
             f"median {w['tokens_median']}), {w['tokens']} in all; {w['model_tokens']} of this model's tokens (the "
             f"longest {w['model_tokens_max']}). Texts/s and tokens/s (BERT tokens) are over one timed embedding of "
             "every text, model load and two warm-up texts untimed; each system at its defaults in this dtype, in its "
             "own process. Cosine: each of the first texts' vectors with sentence-transformers' (min / mean).", ""]
    if m.get("note"):
        lines += [m["note"], ""]
    lines += ["| system | config | wall s | texts/s | tokens/s | batchrun / this | peak RSS MiB | load s | others' CPU "
              "| dim | cosine vs sentence-transformers |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    br = d["systems"].get("batchrun", {}).get("best")
    for system, s in d["systems"].items():
        for v in s["variants"]:
            name = EMBED_LABELS.get(system, system)
            if v.get("error"):
                lines.append(f"| {name} | {_cfg(v['config'])} | failed: {v['error'][:120]} | | | | | | | | |")
                continue
            rounds = v.get("round_walls_s")
            wall = f"{v['wall_s']:.2f}" + (" (rounds: " + ", ".join(f"{x:.2f}" for x in rounds) + ")"
                                           if rounds else "")
            ratio = br["texts_s"] / v["texts_s"] if br and system != "batchrun" else None
            other = v.get("other_load")
            cos = "(reference)" if system == REFERENCE else _cos_str(v.get("vs_reference"))
            lines.append(f"| {name} | {_cfg(v['config'])} | {wall} | {v['texts_s']:.2f} | {v['tokens_s']:.0f} | "
                         f"{_f(ratio, '{:.2f}x')} | {_f(v.get('peak_rss_mb'), '{:.0f}')} | "
                         f"{_f(v.get('load_s'), '{:.1f}')} | {_f(None if other is None else 100 * other, '{:.0f}%')}"
                         f"{mark if noisy and noisy(v) else ''} | {v.get('dim')} | {cos} |")
    return lines + [""]
