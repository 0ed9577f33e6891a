"""`batchrun serve` driven with the real `openai` SDK: a server in this process (uvicorn in a thread) on a tiny
random Llama, the answers checked against `LLM.chat` / `LLM.generate` on the same weights and settings."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency (make setup installs it)")
pytest.importorskip("fastapi", reason="batchrun[serve] is not installed (make setup installs it)")

from serve_helpers import (  # noqa: E402
    chat_line,
    lines_of,
    raw_request,
    reference_llm,
    sdk_client,
    serving_model,
    upload,
    wait,
)

from batchrun.sampling_params import SamplingParams  # noqa: E402

KEY = "sk-test"
ENGINE = ["engine.kv_cache_memory=64MiB", "engine.max_num_seqs=4"]
MAX_FILE_BYTES = 1_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path):
    with serving_model(tiny_llama_path, ENGINE, tmp_path_factory.mktemp("state"), api_key=KEY,
                       commit_interval_s=0.2, max_file_bytes=MAX_FILE_BYTES) as built:
        yield built


@pytest.fixture(scope="module")
def client(server):
    return sdk_client(server, KEY)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """The same weights and engine settings, through the Python API."""
    return reference_llm(tiny_llama_path, ENGINE)


def run_batch(client, lines, endpoint="/v1/chat/completions", **kwargs):
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h", **kwargs)
    assert batch.status == "validating" and batch.input_file_id == file.id
    return wait(client, batch.id)


QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Tell me about the sea.",
             "How do birds fly?"]


def test_greedy_chat_answers_equal_llm_chat(client, reference):
    lines = [chat_line(f"q{i}", q, max_tokens=12, temperature=0) for i, q in enumerate(QUESTIONS)]
    batch = run_batch(client, lines, metadata={"project": "test"})
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 4, "failed": 0}
    assert batch.metadata == {"project": "test"} and batch.model == str(reference.model_path)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    out = lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["q0", "q1", "q2", "q3"]
    expected = reference.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                              SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    prompt_tokens = completion_tokens = 0
    for line, ref in zip(out, expected):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == batch.model
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": ref.outputs[0].text}
        assert choice["finish_reason"] == ref.outputs[0].finish_reason and choice["logprobs"] is None
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)
        prompt_tokens += body["usage"]["prompt_tokens"]
        completion_tokens += body["usage"]["completion_tokens"]
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens, completion_tokens)
    assert batch.usage.total_tokens == prompt_tokens + completion_tokens
    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes > 0


def test_sampling_fields_stop_n_seed_and_logprobs(client, reference):
    """n, seed, temperature, top_p, stop, presence / frequency penalties and logprobs reach the engine: the
    answers are those of LLM.generate with the same SamplingParams."""
    prompt = "The story begins"
    body = dict(max_tokens=10, n=2, seed=11, temperature=0.9, top_p=0.95, presence_penalty=0.5,
                frequency_penalty=0.25, logprobs=2)
    ref = reference.generate(prompt, SamplingParams(**body), use_tqdm=False)[0]
    text = ref.outputs[0].text
    stop_word = text[len(text) // 2:][:3]  # a stop string inside the first sample
    assert stop_word.strip()
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompt, **body, "stop": [stop_word]}}]
    batch = run_batch(client, lines, endpoint="/v1/completions")
    assert batch.status == "completed" and batch.request_counts.completed == 2
    a, b = lines_of(client, batch.output_file_id)
    assert a["response"]["body"]["object"] == "text_completion"
    choices = a["response"]["body"]["choices"]
    assert [c["text"] for c in choices] == [o.text for o in ref.outputs]
    for choice, sample in zip(choices, ref.outputs):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(sample.token_ids) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        assert "".join(lp["tokens"]) == sample.text and lp["text_offset"][0] == 0
        want = [entry[t] for t, entry in zip(sample.token_ids, sample.logprobs)]
        assert lp["token_logprobs"] == pytest.approx(want, abs=1e-5)
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
    stopped = reference.generate(prompt, SamplingParams(**body, stop=[stop_word]), use_tqdm=False)[0]
    first = b["response"]["body"]["choices"][0]
    assert first["text"] == stopped.outputs[0].text and first["finish_reason"] == "stop"
    assert stop_word not in first["text"]


def test_chat_logprobs_and_json_schema(client, reference):
    messages = [{"role": "user", "content": "Answer yes or no."}]
    schema = {"enum": ["yes", "no"]}  # a JSON string: no room for whitespace the random model could loop on
    lines = [chat_line("lp", messages[0]["content"], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3),
             chat_line("js", messages[0]["content"], max_tokens=32, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})]
    batch = run_batch(client, lines)
    assert batch.request_counts.completed == 2
    lp_line, js_line = lines_of(client, batch.output_file_id)
    ref = reference.chat(messages, SamplingParams(max_tokens=6, temperature=0, logprobs=3), use_tqdm=False)[0].outputs[0]
    content = lp_line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == ref.text
    for c, token_id, entry in zip(content, ref.token_ids, ref.logprobs):
        assert c["logprob"] == pytest.approx(entry[token_id], abs=1e-5)
        assert c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][-1]["logprob"]
    choice = js_line["response"]["body"]["choices"][0]
    ref = reference.chat(messages, SamplingParams(max_tokens=32, temperature=0, structured_outputs={"json": schema}),
                         use_tqdm=False)[0].outputs[0]
    assert choice["message"]["content"] == ref.text and choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_bad_lines_go_to_the_error_file_and_the_others_complete(client):
    lines = [chat_line("ok", "hello", max_tokens=4),
             "this is not json",
             {**chat_line("wrong-url", "hi", max_tokens=4), "url": "/v1/embeddings"},
             chat_line("ok", "the same custom_id again", max_tokens=4),
             chat_line("tools", "hi", tools=[{"type": "function", "function": {"name": "f"}}]),
             chat_line("hot", "hi", temperature=-1),
             chat_line("long", "word " * 1500, max_tokens=4),
             {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
             {"custom_id": "bad-messages", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"content": "no role"}]}},
             chat_line("ok-2", "fine", max_tokens=4)]
    batch = run_batch(client, lines)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 10, "completed": 2, "failed": 8}
    out, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert [x["custom_id"] for x in out] == ["ok", "ok-2"]
    assert [x["custom_id"] for x in errors] == [None, "wrong-url", "ok", "tools", "hot", "long", None, "bad-messages"]
    messages = [x["response"]["body"]["error"]["message"] for x in errors]
    assert all(x["response"]["status_code"] == 400 and x["error"] is None for x in errors)
    assert messages[0].startswith("line 2: not valid JSON")
    assert messages[1] == "line 3: url '/v1/embeddings' is not the batch's endpoint /v1/chat/completions"
    assert messages[2] == "line 4: duplicate custom_id 'ok' (first on line 1)"
    assert messages[3] == "line 5: body.tools is not supported by batchrun serve"
    assert "temperature" in messages[4]
    assert "prompt has" in messages[5] and "max_model_len" in messages[5]
    assert messages[6] == "line 8: custom_id must be a non-empty string"
    assert "malformed messages" in messages[7]
    assert client.models.list().data[0].id == batch.model  # and the server lives on


def test_api_errors_are_openai_errors(server, client):
    base = f"http://127.0.0.1:{server.options.port}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong-key", max_retries=0).batches.list()
    status, answer = raw_request("GET", f"{base}/batches")
    assert status == 401 and "API key" in answer["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    file = upload(client, [chat_line("a", "hi", max_tokens=2)])
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="48h")
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={f"k{i}": "v" for i in range(17)})
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    status, answer = raw_request("POST", f"{base}/batches", key=KEY, body=b"{not json")
    assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}
    status, answer = raw_request("POST", f"{base}/batches", key=KEY, body=b'{"endpoint": "/v1/completions"}')
    assert status == 400 and answer["error"]["param"] == "input_file_id"
    status, answer = raw_request("GET", f"{base}/nowhere", key=KEY)
    assert status == 404 and answer["error"]["message"] == "Invalid URL (GET /v1/nowhere)"
    status, answer = raw_request("GET", f"{base}/models", key="wrong")
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"


def test_files_over_the_limits_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="more than 50,000 requests"):
        client.files.create(file=("many.jsonl", b"{}\n" * 50_001), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="larger than the limit"):
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert client.files.create(file=("max.jsonl", b"{}\n" * 50_000), purpose="batch").bytes == 150_000


def test_a_file_with_no_request_fails_validation(client):
    file = client.files.create(file=("empty.jsonl", b"\n  \n"), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert batch.errors.data[0].code == "empty_file"


def long_lines(prefix: str, count: int) -> list[dict]:
    return [chat_line(f"{prefix}{i}", f"request {i}", max_tokens=200, ignore_eos=True, temperature=0)
            for i in range(count)]


def test_cancel_stops_within_seconds_and_keeps_what_finished(client):
    running = client.batches.create(input_file_id=upload(client, long_lines("c", 40)).id,
                                    endpoint="/v1/chat/completions", completion_window="24h")
    queued = client.batches.create(input_file_id=upload(client, long_lines("q", 3)).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    wait(client, running.id, until=lambda b: b.request_counts.completed >= 1)
    queued = client.batches.cancel(queued.id)  # waiting behind the running one: ended at once
    assert queued.status == "cancelled" and queued.cancelling_at and queued.cancelled_at
    assert [x["error"]["code"] for x in lines_of(client, queued.error_file_id)] == ["batch_cancelled"] * 3
    t0 = time.monotonic()
    cancelling = client.batches.cancel(running.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait(client, running.id, timeout=10)
    assert batch.status == "cancelled" and time.monotonic() - t0 < 10
    out, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert 1 <= len(out) < 40 and len(out) == batch.request_counts.completed
    assert sorted(x["custom_id"] for x in out + errors) == sorted(f"c{i}" for i in range(40))
    assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled" for x in errors)
    assert all(len(x["response"]["body"]["choices"][0]["message"]["content"]) for x in out)
    assert client.batches.cancel(running.id).status == "cancelled"  # again: no change
    done = run_batch(client, [chat_line("x", "hi", max_tokens=2)])
    with pytest.raises(openai.BadRequestError, match="cannot cancel a batch that is completed"):
        client.batches.cancel(done.id)


def test_lists_paginate_and_deleted_inputs_do_not_matter(client):
    ids = []
    for i in range(3):
        file = upload(client, [chat_line(f"p{i}", "hi", max_tokens=2)], name=f"page{i}.jsonl")
        ids.append(client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
        assert client.files.delete(file.id).deleted  # the batch keeps its own link to the bytes
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file.id)
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    second = client.batches.list(limit=2, after=page.data[-1].id)
    assert second.data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the pages
    assert every[:3] == ids[::-1] and len(every) == len(set(every))
    for batch_id in ids:
        assert wait(client, batch_id).request_counts.completed == 1
    files = client.files.list(purpose="batch_output", limit=2, order="asc")
    assert len(files.data) == 2 and files.data[0].created_at <= files.data[1].created_at
    everything = [f.id for f in client.files.list(order="desc")]
    assert len(everything) == len(set(everything)) and client.files.retrieve(everything[0]).id == everything[0]
