"""`batchrun serve` answering `/v1/embeddings` (OpenAI's bodies, parsed by the `openai` SDK's types), `/v1/score`
and `/v1/rerank` (vLLM's shapes) batches, against LLM.embed / LLM.score on the same tiny model; bad lines; a
pooling-only model refusing completion batches."""

from __future__ import annotations

import base64
import math
import struct

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency (make setup installs it)")
pytest.importorskip("fastapi", reason="batchrun[serve] is not installed (make setup installs it)")

from openai.types import CreateEmbeddingResponse  # noqa: E402
from serve_helpers import lines_of, reference_llm, sdk_client, serving_model, upload, wait  # noqa: E402

from batchrun.pooling_params import PoolingParams  # noqa: E402

KEY = "sk-pool"
ENGINE = ["engine.kv_cache_memory=64MiB", "engine.max_num_seqs=4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    with serving_model(tiny_llama_path, ENGINE, tmp_path_factory.mktemp("state"), api_key=KEY,
                       commit_interval_s=0.2) as built:
        yield built


@pytest.fixture(scope="module")
def client(server):
    return sdk_client(server, KEY)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    return reference_llm(tiny_llama_path, ENGINE)


def line(custom_id: str, url: str, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "any", **body}}


def run_batch(client, lines, endpoint):
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint=endpoint, completion_window="24h")
    batch = wait(client, batch.id)
    assert batch.status == "completed"
    return batch


def close(a, b, tol=1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b))


def test_embeddings_batch_as_openai_answers_it(client, reference):
    texts = ["The farmer reads a letter", "hello there", "rain on the harvest"]
    batch = run_batch(client, [line("one", "/v1/embeddings", input=texts[0]),
                               line("many", "/v1/embeddings", input=texts[1:], dimensions=8),
                               line("b64", "/v1/embeddings", input=texts[0], encoding_format="base64"),
                               line("bad", "/v1/embeddings", input=[]),
                               line("odd", "/v1/embeddings", input="x", temperature=0.5)], "/v1/embeddings")
    out = {x["custom_id"]: x for x in lines_of(client, batch.output_file_id)}
    errors = {x["custom_id"]: x for x in lines_of(client, batch.error_file_id)}
    assert set(out) == {"one", "many", "b64"} and set(errors) == {"bad", "odd"}
    message = {k: x["response"]["body"]["error"]["message"] for k, x in errors.items()}
    assert "body.input" in message["bad"] and "body.temperature" in message["odd"]
    full = reference.embed(texts, use_tqdm=False)
    short = reference.embed(texts[1:], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    one = CreateEmbeddingResponse.model_validate(out["one"]["response"]["body"])
    assert close(one.data[0].embedding, full[0].outputs.embedding)
    assert one.usage.prompt_tokens == len(full[0].prompt_token_ids)
    many = CreateEmbeddingResponse.model_validate(out["many"]["response"]["body"])
    assert [d.index for d in many.data] == [0, 1]
    assert all(close(d.embedding, s.outputs.embedding) for d, s in zip(many.data, short))
    raw = base64.b64decode(out["b64"]["response"]["body"]["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), full[0].outputs.embedding)


def test_score_and_rerank_batches_as_vllm_answers_them(client, reference):
    docs = ["doc about rain", "the farmer reads", "hello there"]
    score = run_batch(client, [line("s", "/v1/score", text_1="the farmer", text_2=docs)], "/v1/score")
    rerank = run_batch(client, [line("r", "/v1/rerank", query="the farmer", documents=docs, top_n=2)], "/v1/rerank")
    want = [o.outputs.score for o in reference.score("the farmer", docs, use_tqdm=False)]
    body = lines_of(client, score.output_file_id)[0]["response"]["body"]
    assert body["object"] == "list" and close([d["score"] for d in body["data"]], want)
    results = lines_of(client, rerank.output_file_id)[0]["response"]["body"]["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in results] == best
    assert [r["document"]["text"] for r in results] == [docs[i] for i in best]
    assert close([r["relevance_score"] for r in results], [want[i] for i in best])


def test_a_pooling_only_model_refuses_completion_batches(tmp_path, classifier_path):
    with serving_model(classifier_path, ENGINE, tmp_path / "state", api_key=KEY) as built:
        client = sdk_client(built, KEY)
        file = upload(client, [line("a", "/v1/completions", prompt="hi")])
        with pytest.raises(openai.BadRequestError, match="pools only"):
            client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        batch = run_batch(client, [line("c", "/v1/embeddings", input="hello")], "/v1/embeddings")
        assert len(lines_of(client, batch.output_file_id)[0]["response"]["body"]["data"][0]["embedding"]) > 0
