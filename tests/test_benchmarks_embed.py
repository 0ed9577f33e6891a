"""The embedding rows of the benchmark: the texts, the checkpoints, the plans and their worker arguments, the report;
and `--quick` end to end with whichever peers' venvs this machine already has (none on CI: batchrun alone)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def bert_count():
    """The BERT tokenizer's length of a text, [CLS] and [SEP] included."""
    from transformers import AutoTokenizer

    from benchmarks.harness.embed_models import bert_tokenizer_path

    tok = AutoTokenizer.from_pretrained(bert_tokenizer_path())
    return lambda text: len(tok(text)["input_ids"])


# ---- the texts -----------------------------------------------------------------------------------------------


def test_texts_are_the_repositorys_text_built_the_same_every_time(bert_count):
    from benchmarks.harness.embed import DISTINCT_WORDS, EmbedTexts, build_texts, text_sources

    a = build_texts(bert_count, 300)
    assert build_texts(bert_count, 300).texts == a.texts and a.meta["fingerprint"] == build_texts(
        bert_count, 300).meta["fingerprint"]
    assert build_texts(bert_count, 40).texts == a.texts[:40]  # the first n of a larger build
    assert build_texts(bert_count, 40, seed=1).texts != a.texts[:40]
    assert len(a) == 300 and len(set(a.texts)) == 300
    # each text's recorded length is its BERT length, within BERT's positions; the lengths spread as drawn
    assert [bert_count(t) for t in a.texts] == a.tokens
    assert all(16 <= n <= 512 for n in a.tokens)
    assert min(a.tokens) < 32 and max(a.tokens) > 384 and 90 < sorted(a.tokens)[150] < 180
    # no two texts begin alike (nothing for a prefix cache to share between texts)
    assert len({tuple(t.lower().split()[:DISTINCT_WORDS]) for t in a.texts}) == 300
    # texts are the repository's sentences, not made-up words
    words = {w for _, sents in text_sources() for s in sents for w in s.split()}
    assert sum(w in words for t in a.texts for w in t.split()) > 0.95 * sum(len(t.split()) for t in a.texts)
    assert set(a.meta["starts"]) >= {"docs", "benchmarks/harness/chat.py"}
    s = a.summary()
    assert (s["texts"], s["tokens"], s["tokens_min"], s["tokens_max"]) == (300, sum(a.tokens), min(a.tokens),
                                                                          max(a.tokens))
    assert EmbedTexts.from_json(json.loads(json.dumps(a.to_json()))) == a


def test_texts_stay_within_a_short_range(bert_count):
    from benchmarks.harness.embed import build_texts

    t = build_texts(bert_count, 30, median=32, sigma=0.6, length_range=(16, 96))
    assert all(16 <= n <= 96 for n in t.tokens) and [bert_count(x) for x in t.texts] == t.tokens


def test_timed_embedding_keeps_the_first_vectors_and_checks_the_count():
    from benchmarks.harness.embed import KEEP, WARMUP_TEXTS, timed_embedding

    seen = []

    def embed(model, texts):
        seen.append(len(texts))
        return [[float(len(x)), 1.0] for x in texts]

    texts = [f"text {i}" for i in range(KEEP + 5)]
    res = timed_embedding(lambda: "model", embed, texts, lambda: 2, repeat=2, config={"a": 1})
    assert seen == [len(WARMUP_TEXTS), len(texts)] * 2 and len(res["repeat_walls_s"]) == 2
    assert res["items"] == len(texts) and res["dim"] == 2 and len(res["embeddings"]) == KEEP
    assert res["config"] == {"a": 1} and res["wall_s"] == min(res["repeat_walls_s"])
    with pytest.raises(RuntimeError, match="embeddings for"):
        timed_embedding(lambda: "model", lambda m, t: [[1.0]], texts, lambda: 2)


# ---- the checkpoints -----------------------------------------------------------------------------------------


def test_full_shapes_are_the_real_models():
    from benchmarks.harness.embed_models import EMBED_SHAPES
    from benchmarks.harness.plans import PLANS

    bert, qwen = EMBED_SHAPES["bert-base-st"], EMBED_SHAPES["qwen3-embedding-0.6b"]
    assert (bert.family, bert.pooling, bert.max_seq_length) == ("bert", "mean_tokens", 512)
    assert {k: bert.config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                                        "vocab_size", "max_position_embeddings")} == dict(
        num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
        max_position_embeddings=512)
    assert (qwen.family, qwen.pooling) == ("qwen3", "lasttoken")
    assert {k: qwen.config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")} == dict(
        num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151669)
    assert {PLANS[k].checkpoint for k in PLANS if PLANS[k].workload == "embed"} == {"bert-base-st",
                                                                                  "qwen3-embedding-0.6b"}


def test_bert_checkpoint_is_a_sentence_transformers_folder(tmp_path):
    import torch
    from transformers import AutoModel, AutoTokenizer

    from benchmarks.harness.embed_models import EMBED_SHAPES, make_embed_checkpoint

    path = make_embed_checkpoint(tmp_path / "bert", EMBED_SHAPES["bert-tiny-st"])
    modules = json.loads((path / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pool = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_mean_tokens"] and not pool["pooling_mode_lasttoken"] and pool[
        "word_embedding_dimension"] == 128
    assert json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"] == 512
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The Scheduler batches rows.")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id and tok.unk_token_id not in ids
    assert tok("HELLO")["input_ids"] == tok("hello")["input_ids"]  # uncased, as bert-base-uncased
    model, info = AutoModel.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == "BertModel" and not info["missing_keys"] and len(tok) <= model.config.vocab_size
    # the same weights from the same seed: a second folder holds equal tensors
    again = AutoModel.from_pretrained(make_embed_checkpoint(tmp_path / "bert2", EMBED_SHAPES["bert-tiny-st"]))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_qwen3_checkpoint_is_laid_out_as_qwen3_embedding(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModel, AutoTokenizer

    from benchmarks.harness.embed_models import EMBED_SHAPES, make_embed_checkpoint

    path = make_embed_checkpoint(tmp_path / "qwen3", EMBED_SHAPES["qwen3-embedding-tiny"])
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    pool = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_lasttoken"] and not pool["pooling_mode_mean_tokens"]
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("a short text")["input_ids"][-1] == tok.eos_token_id  # the pooled last token is the end of text
    assert tok.padding_side == "left" and len(tok) <= cfg["vocab_size"]
    model, info = AutoModel.from_pretrained(path, output_loading_info=True)  # as sentence-transformers loads it
    assert type(model).__name__ == "Qwen3Model" and not info["missing_keys"] and not info["unexpected_keys"]


# ---- the plans and their rows (no worker runs) ----------------------------------------------------------------


def test_embed_plans_are_asked_for_by_name_and_leave_the_default_set_alone():
    from benchmarks.harness.plans import (
        DEFAULT_PLANS,
        EMBED_PLANS,
        PLANS,
        QUICK_EMBED_PLANS,
        quick_plans,
        select_plans,
    )

    assert select_plans("embed") == EMBED_PLANS and not set(EMBED_PLANS) & set(DEFAULT_PLANS)
    assert select_plans("embed-bert") == ("embed-bert-bf16", "embed-bert-fp32")
    assert select_plans("embed-qwen3") == ("embed-qwen3-bf16", "embed-qwen3-fp32")
    for k in EMBED_PLANS:
        p = PLANS[k]
        assert p.workload == "embed" and p.num_requests == 2000 and p.static_batches == (32,) and p.vllm
        assert (p.prompt.lo, p.prompt.hi) == (16, 512) and not p.openvino and not p.scenarios
        q = QUICK_EMBED_PLANS[k]  # quick mode: the same family and dtype, a toy model, a few dozen short texts
        assert q.dtype == p.dtype and q.num_requests <= 48 and q.prompt.hi <= 128
        assert q.checkpoint == ("bert-tiny-st" if "bert" in k else "qwen3-embedding-tiny")
        assert q.vllm_kwargs == {"enforce_eager": True}
    assert {PLANS[k].dtype for k in EMBED_PLANS} == {"bfloat16", "float32"}
    assert quick_plans(("embed-bert-fp32", "embed-bert-fp32", "tiny")) == [QUICK_EMBED_PLANS["embed-bert-fp32"],
                                                                        quick_plans(("tiny",))[0]]


class _Rows:
    """Stands in for the runner and the peers' setups: records each row's arguments, runs nothing."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict]] = []

    def __call__(self, name, spec, **kw):  # the Runner: batchrun's row
        self.rows.append(("batchrun", {**spec, **kw}))
        return {"error": "not run in this test"}

    def log(self, msg: str) -> None:
        pass

    def peer(self, kind: str):
        outer = self

        class Setup:
            def run(self, runner, name, base, dtype, *args):
                assert runner is outer
                outer.rows.append((kind, {"base": base, "dtype": dtype, "args": args}))
                return {"error": "not run in this test"}

        return Setup()


def test_embed_plans_build_their_rows(monkeypatch, tmp_path):
    from benchmarks import run
    from benchmarks.harness import embed_models
    from benchmarks.harness.plans import PLANS

    path = embed_models.make_embed_checkpoint(tmp_path / "qwen3", embed_models.EMBED_SHAPES["qwen3-embedding-tiny"])
    monkeypatch.setattr(embed_models, "embed_checkpoint", lambda name: path)
    cap = _Rows()
    plan = dataclasses.replace(PLANS["embed-qwen3-bf16"], num_requests=2000)
    m = run.run_embed(plan, cap, {"max_num_batched_tokens": 2048}, vllm=cap.peer("vllm"), st=cap.peer("st"),
                      num_texts=12)
    (br, br_spec), (st, st_row), (vl, vl_row) = cap.rows
    assert (br, st, vl) == ("batchrun", "st", "vllm")
    assert br_spec["module"] == "benchmarks.harness.embed_worker" and br_spec["dtype"] == "bfloat16"
    assert len(br_spec["embed"]["texts"]) == 12
    assert st_row["dtype"] == "bfloat16" and st_row["args"] == (32,) and st_row["base"]["embed"] == br_spec["embed"]
    kv_bytes, max_len, vllm_kwargs = vl_row["args"]
    assert vl_row["base"]["task"] == "embed" and vl_row["dtype"] == "bfloat16" and vllm_kwargs == {}
    assert max_len == m["workload"]["model_tokens_max"] > m["workload"]["tokens_max"]  # the BPE's tokens, not BERT's
    assert kv_bytes == (run.VLLM_EMBED_KV_TOKENS + max_len) * 2 * 2 * 1 * 64 * 2  # K and V, layers, KV heads, dim, bf16
    assert br_spec["llm_kwargs"] == {"kv_cache_memory_bytes": kv_bytes, "max_num_batched_tokens": 2048}  # the same KV
    assert m["kind"] == "embed" and m["workload"]["texts"] == 12 and m["shape"]["architecture"] == "Qwen3ForCausalLM"
    assert set(m["runs"]) == {"batchrun", "sentence_transformers", "vllm"}
    cap.rows.clear()  # without peers: batchrun's row alone
    run.run_embed(plan, cap, {}, num_texts=12)
    assert [k for k, _ in cap.rows] == ["batchrun"]
    cap.rows.clear()  # an encoder keeps no KV cache: no KV setting
    path = embed_models.make_embed_checkpoint(tmp_path / "bert", embed_models.EMBED_SHAPES["bert-tiny-st"])
    run.run_embed(PLANS["embed-bert-bf16"], cap, {}, num_texts=12)
    assert cap.rows[0][1]["llm_kwargs"] == {}


# ---- the report ----------------------------------------------------------------------------------------------


def test_embed_report_compares_vectors_with_sentence_transformers_and_the_fastest_peer():
    from benchmarks.harness.embed_report import derive_embed
    from benchmarks.harness.report import markdown

    ref = [[1.0, 0.0], [0.0, 1.0]]
    tilted = [[math.cos(0.01), math.sin(0.01)], [0.0, 1.0]]

    def run(vecs, wall, **kw):
        return {"embeddings": vecs, "wall_s": wall, "items": 4, "dim": 2, "peak_rss_mb": 100.0, **kw}

    m = {"key": "embed", "kind": "embed", "model": "bert-x", "dtype": "float32", "note": "",
         "shape": {"architecture": "BertModel", "num_layers": 2, "hidden": 2},
         "workload": {"texts": 4, "tokens": 400, "tokens_min": 50, "tokens_max": 150, "tokens_mean": 100,
                      "tokens_median": 100, "model_tokens": 400, "model_tokens_max": 150},
         "runs": {"batchrun": [run(tilted, 1.0, config={"task": "embed"})],
                  "sentence_transformers": [run(ref, 4.0, config={"batch_size": 32})],
                  "vllm": [run(ref, 2.0), {"error": "exit code 1", "config": {"dtype": "float32"}}]}}
    d = derive_embed(m)
    br = d["systems"]["batchrun"]["best"]
    assert br["texts_s"] == 4.0 and br["tokens_s"] == 400.0
    assert br["vs_reference"]["min_cosine"] == pytest.approx(math.cos(0.01))
    assert br["vs_reference"]["mean_cosine"] == pytest.approx((math.cos(0.01) + 1) / 2)
    assert d["systems"]["vllm"]["best"]["vs_reference"]["min_cosine"] == pytest.approx(1.0)
    assert "vs_reference" not in d["systems"]["sentence_transformers"]["best"]
    assert d["fastest_peer"]["system"] == "vllm" and d["fastest_peer"]["ratio"] == pytest.approx(2.0)
    assert d["ratios"] == {"sentence_transformers": pytest.approx(4.0), "vllm": pytest.approx(2.0)}
    # a run that embedded another count, or vectors of another size, is a failed row
    m["runs"]["vllm"][0]["items"] = 3
    m["runs"]["batchrun"][0]["embeddings"] = [[1.0, 0.0, 0.0]]
    bad = derive_embed(m)
    assert bad["systems"]["vllm"]["best"] is None and "fastest_peer" not in bad  # batchrun failed too
    assert "3 dimensions" in bad["systems"]["batchrun"]["variants"][0]["error"]
    m["runs"]["vllm"][0]["items"] = 4
    m["runs"]["batchrun"][0]["embeddings"] = tilted
    m["derived"] = d
    res = {"mode": "full", "command": "x", "started": "now", "peak": {"matmul_n": 1, "peak_flops": 1, "median_flops": 1,
                                                                    "samples": 1},
           "env": {"cpu": "c", "threads": 2, "torch": "t", "transformers": "t", "python": "p", "loadavg_start": "0"},
           "models": {"embed": m}}
    md = markdown(res)
    assert "## Summary: embeddings" in md and "## Embeddings: bert-x (BertModel" in md
    assert "| bert-x 4 texts, fp32 | 4.00 | 1.00 | 2.00 | 2.00x |" in md and "failed: exit code 1" in md
    assert "generated tokens/s" not in md


def test_a_workers_peak_rss_is_its_own():
    """A worker's peak RSS is its own process's, not the orchestrator's that started it (Linux keeps ru_maxrss
    across execve)."""
    from benchmarks.harness.clock import peak_rss_mb
    from benchmarks.harness.runner import ROOT

    ballast = bytearray(400 * 2**20)  # the parent's peak: at least this
    ballast[::4096] = b"x" * len(ballast[::4096])
    code = "from benchmarks.harness.clock import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout)
    assert peak_rss_mb() > 400 and child < 200, (peak_rss_mb(), child)
    del ballast


# ---- end to end -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_embed_benchmark_end_to_end(tmp_path):
    """`--quick --model embed-bert-fp32`: every system whose venv is made embeds the toy model's texts; in fp32
    their vectors agree with sentence-transformers' (cosine >= 0.99999)."""
    from benchmarks.peers.sentence_transformers import env as st_env
    from benchmarks.peers.vllm import env as vllm_env
    from benchmarks.run import main

    with_vllm, with_st = vllm_env.is_ready(), st_env.is_ready()  # a test never makes a peer's venv
    args = ["--quick", "--model", "embed-bert-fp32", "--out", str(tmp_path), *([] if with_vllm else ["--no-vllm"]),
            *([] if with_st else ["--no-hf"])]
    assert main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    m = res["models"]["embed-bert-tiny-fp32"]
    d = m["derived"]
    assert "## Embeddings: bert-tiny-st (BertModel" in (tmp_path / "report.md").read_text()
    systems = ["batchrun", *(["sentence_transformers"] if with_st else []), *(["vllm"] if with_vllm else [])]
    for s in systems:
        best = d["systems"][s]["best"]
        assert best and best["texts_s"] > 0 and best["peak_rss_mb"] > 0 and best["dim"] == 128, d["systems"][s]
        assert "embeddings" not in m["runs"][s][0]  # the vectors stay out of results.json
    assert m["workload"]["texts"] == 24
    if with_st:
        for s in systems[2:] + ["batchrun"]:
            assert d["systems"][s]["best"]["vs_reference"]["min_cosine"] >= 0.99999
        assert "ratio" in d["fastest_peer"]
