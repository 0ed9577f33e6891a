"""Pooling on decoder models: LLM.embed / encode / classify / reward / score equal to transformers on the same
weights (fp32), and the embed / classify / score jobs."""

import math
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from batchrun import LLM
from batchrun.pooling_params import PoolingParams

TEXTS = ["The farmer reads a letter about the harvest and the rain", "hello",
         "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]
SMALL = dict(dtype="float32", device="cpu", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), max_num_batched_tokens=32, **SMALL)  # the long prompt runs in chunks


def _reference(path):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


@torch.inference_mode()
def test_embeddings_equal_transformers_last_mean_and_first_token(llm, tiny_llama_path):
    model, tok = _reference(tiny_llama_path)
    last = llm.embed(TEXTS, use_tqdm=False)
    mean = llm.encode(TEXTS, PoolingParams(pooling_type="mean", use_activation=False), use_tqdm=False)
    first = llm.encode(TEXTS, PoolingParams(pooling_type="cls", use_activation=False), use_tqdm=False)
    for text, e, m, f in zip(TEXTS, last, mean, first):
        hidden = model(tok(text, return_tensors="pt").input_ids).last_hidden_state[0]
        assert _cos(e.outputs.embedding, hidden[-1]) >= 0.99999
        assert math.isclose(sum(v * v for v in e.outputs.embedding), 1.0, rel_tol=1e-6)  # normalised by default
        assert torch.allclose(torch.tensor(m.outputs.data), hidden.mean(0), atol=1e-5)
        assert torch.allclose(torch.tensor(f.outputs.data), hidden[0], atol=1e-5)


def test_a_pooling_runner_pools_only_without_the_weights_generation_reads(tiny_llama_path):
    """runner="pooling" (vLLM's task="embed" too): generate refused, the same embeddings, a KV pool for the prompts
    in flight, and no bf16 few-row copy or packed tied lm_head beside oneDNN's weights."""
    from batchrun.model.layers.linear import OneDNNLinear

    kw = dict(dtype="bfloat16", device="cpu", max_num_batched_tokens=32, max_num_seqs=8)
    pooled, both = LLM(str(tiny_llama_path), task="embed", **kw), LLM(str(tiny_llama_path), **kw)
    assert pooled.args.runner == "pooling" and both.args.runner == "auto"
    with pytest.raises(ValueError, match="runner='pooling'"):
        pooled.generate(["hello"], use_tqdm=False)
    for a, b in zip(pooled.embed(TEXTS, use_tqdm=False), both.embed(TEXTS, use_tqdm=False), strict=True):
        assert _cos(a.outputs.embedding, b.outputs.embedding) >= 0.999  # (bf16: few-row calls on other kernels)
    assert pooled.metrics()["kv_blocks_total"] < both.metrics()["kv_blocks_total"]
    model, ref = pooled.engine.runner.model, both.engine.runner.model
    assert not any(getattr(m, "small", None) is not None for m in model.modules())
    if any(isinstance(m, OneDNNLinear) for m in ref.modules()):  # where oneDNN runs bf16 beside the panels
        assert any(isinstance(m, OneDNNLinear) for m in model.modules())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_dimensions_keep_the_first_values_then_normalise(llm):
    full = llm.encode(TEXTS[:1], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    cut = llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    norm = math.sqrt(sum(v * v for v in full[:8]))
    assert len(cut) == 8 and all(math.isclose(a, b / norm, rel_tol=1e-6) for a, b in zip(cut, full[:8]))
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=10**6), use_tqdm=False)


def test_score_is_the_cosine_of_the_embeddings_one_to_many(llm):
    scores = llm.score("hello there", ["hello there", "the rain"], use_tqdm=False)
    a, b = (o.outputs.embedding for o in llm.embed(["hello there", "the rain"], use_tqdm=False))
    assert math.isclose(scores[0].outputs.score, 1.0, rel_tol=1e-6)
    assert math.isclose(scores[1].outputs.score, sum(x * y for x, y in zip(a, b)), rel_tol=1e-5)


def test_pooling_and_generation_share_one_engine_with_prefix_caching(llm):
    shared = "The same long instruction before every text, long enough for blocks. " * 3
    before = llm.embed([shared + "one"], use_tqdm=False)[0].outputs.embedding
    out = llm.generate([shared + "two"], use_tqdm=False)
    hits = llm.metrics()["prefix_cache_hit_tokens"]
    again = llm.embed([shared + "one"], use_tqdm=False)[0].outputs.embedding  # its prefix now from the cache
    assert out[0].outputs[0].token_ids
    assert llm.metrics()["prefix_cache_hit_tokens"] > hits and _cos(before, again) >= 0.99999
    hits = llm.metrics()["prefix_cache_hit_tokens"]
    llm.encode([shared + "one"], PoolingParams(pooling_type="mean"), use_tqdm=False)  # every row computed
    assert llm.metrics()["prefix_cache_hit_tokens"] == hits


@torch.inference_mode()
def test_classifier_logits_equal_transformers(classifier_path):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    ref = LlamaForSequenceClassification.from_pretrained(classifier_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(classifier_path)
    llm = LLM(str(classifier_path), **SMALL)
    probs = llm.classify(TEXTS, use_tqdm=False)
    rewards = llm.reward(TEXTS, use_tqdm=False)
    for text, p, r in zip(TEXTS, probs, rewards):
        logits = ref(tok(text, return_tensors="pt").input_ids).logits[0]
        assert torch.allclose(torch.tensor(r.outputs.data), logits, atol=1e-4)
        assert torch.allclose(torch.tensor(p.outputs.probs), torch.softmax(logits, -1), atol=1e-5)
    with pytest.raises(ValueError, match="pools only"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="task 'score'"):
        llm.score("a", "b", use_tqdm=False)


def test_a_model_without_a_head_refuses_classify(llm):
    with pytest.raises(ValueError, match="task 'classify'"):
        llm.classify(["hello"], use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dimensions=0), "dimensions"), (dict(pooling_type="max"), "pooling_type"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(use_activation="yes"), "use_activation")])
def test_pooling_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


@torch.inference_mode()
def test_smollm2_last_token_embeddings_equal_transformers(smollm2, smollm2_path):
    model, tok = _reference(smollm2_path)
    for text, e in zip(TEXTS[:2], smollm2.embed(TEXTS[:2], use_tqdm=False)):
        hidden = model(tok(text, return_tensors="pt").input_ids).last_hidden_state[0, -1]
        assert _cos(e.outputs.embedding, hidden) >= 0.99999


# ---- jobs -----------------------------------------------------------------------------------------------------
def _job(tmp_path, task, model, *, input_extra=None, **sections):
    rows = {"id": [0, 1, 2, 3], "prompt": ["The farmer reads a letter", "hello", "", "a b c d " * 40],
            "text_1": ["q one"] * 4, "text_2": ["doc a", "q one", "x", "y"]}
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    job = {"task": task, "model": {"path": str(model), "dtype": "float32"},
           "input": {"path": str(tmp_path / "in.parquet"), **(input_extra or {})},
           "output": {"path": str(tmp_path / "out")}, "engine": {"kv_cache_memory": "64MiB"}, **sections}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return subprocess.run([sys.executable, "-m", "batchrun.cli", "run", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True)


def test_embed_job_writes_fixed_size_embeddings_in_input_order(tmp_path, tiny_llama_path, llm):
    r = _job(tmp_path, "embed", tiny_llama_path, pooling={"dimensions": 16, "embedding_dtype": "float16"})
    assert r.returncode == 0, r.stderr[-2000:]
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), 16)
    rows = table.to_pylist()
    assert [row["id"] for row in rows] == [0, 1, 2, 3]
    assert rows[2]["embedding"] is None and "empty" in rows[2]["error"]
    want = llm.embed(["The farmer reads a letter"], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    assert _cos(rows[0]["embedding"], want[0].outputs.embedding) >= 0.9999  # (float16 values)


def test_classify_and_score_jobs(tmp_path, classifier_path, tiny_llama_path, llm):
    r = _job(tmp_path, "classify", classifier_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert rows[0]["label"] == f"LABEL_{max(range(3), key=rows[0]['logits'].__getitem__)}"
    assert math.isclose(sum(rows[0]["probs"]), 1.0, rel_tol=1e-5)
    r = _job(tmp_path / "s", "score", tiny_llama_path) if (tmp_path / "s").mkdir() is None else None
    assert r.returncode == 0, r.stderr[-2000:]
    rows = pq.read_table(tmp_path / "s" / "out").to_pylist()
    want = llm.score("q one", ["doc a", "q one"], use_tqdm=False)
    assert [round(x["score"], 5) for x in rows[:2]] == [round(o.outputs.score, 5) for o in want]


@pytest.mark.parametrize("task, sections, match", [
    ("classify", {}, "no classification head"),
    ("generate", {"pooling": {"dimensions": 8}}, "pooling.dimensions: used with task: embed"),
    ("embed", {"sampling": {"temperature": 0.5}}, "sampling.temperature: not used with task: embed"),
])
def test_job_mistakes_are_one_line_before_the_model_loads(tmp_path, tiny_llama_path, task, sections, match):
    r = _job(tmp_path, task, tiny_llama_path, **sections)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_embed_job_truncates_long_texts_by_its_policy(tmp_path, tiny_llama_path):
    r = _job(tmp_path, "embed", tiny_llama_path, input_extra={"on_too_long": "truncate_right"})
    assert r.returncode == 0, r.stderr[-2000:]
    full = pq.read_table(tmp_path / "out").to_pylist()
    (tmp_path / "job.yaml").write_text((tmp_path / "job.yaml").read_text().replace("dtype: float32",
                                                                                   "dtype: float32\n  max_model_len: 24"))
    shutil.rmtree(tmp_path / "out")
    r = subprocess.run([sys.executable, "-m", "batchrun.cli", "run", str(tmp_path / "job.yaml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    cut = pq.read_table(tmp_path / "out").to_pylist()
    assert cut[3]["truncated_tokens"] > 0 and cut[3]["prompt_tokens"] == 24 and cut[3]["error"] is None
    assert cut[0]["truncated_tokens"] == 0 and cut[0]["embedding"] == full[0]["embedding"]
    assert _cos(cut[3]["embedding"], full[3]["embedding"]) < 0.9999  # another prompt: its first 24 tokens
