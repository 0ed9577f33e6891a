"""`batchrun serve` answering `/v1/completions` with `echo` as OpenAI's legacy API did: the request evaluation
clients send to score a continuation (`echo: true`, `logprobs: k`, `max_tokens: 0`) through the real server path,
its lines against the engine's prompt_logprobs on the same tiny model and against the `openai` package's legacy
Completion type; echo before a completion, echo without logprobs; bad echo lines; what the serve log says."""

from __future__ import annotations

import copy
import logging

import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency (make setup installs it)")
pytest.importorskip("fastapi", reason="batchrun[serve] is not installed (make setup installs it)")

from openai.types import Completion  # noqa: E402
from serve_helpers import chat_line, lines_of, reference_llm, sdk_client, serving_model, upload, wait  # noqa: E402

from batchrun.sampling_params import SamplingParams  # noqa: E402

KEY = "sk-echo"
ENGINE = ["engine.kv_cache_memory=64MiB", "engine.max_num_seqs=4"]
K = 3
TOL = 1e-5
# (context, continuation): the prompt scored is their concatenation
ITEMS = [("The capital of France is", " Paris"), ("Two plus two makes", " four"),
         ("She opened the door and", " walked into the garden")]


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
    """The same weights and engine settings, through the Python API."""
    return reference_llm(tiny_llama_path, ENGINE)


def completion_line(custom_id: str, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "any", "prompt": prompt, **body}}


def run_batch(client, lines, endpoint="/v1/completions"):
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint=endpoint, completion_window="24h")
    return wait(client, batch.id)


def legacy(body) -> Completion:
    """The body as the SDK reads it. Its type declares token_logprobs / top_logprobs without the null OpenAI's
    legacy API gave the first prompt token: all else is validated strictly, those entries dropped."""
    strict = copy.deepcopy(body)
    for choice in strict["choices"]:
        lp = choice["logprobs"]
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                del lp[name][0]
    Completion.model_validate(strict)
    return Completion.construct(**body)


def most_likely(entry, k: int, decode) -> dict[str, float]:
    """{text: log-prob} of the k most likely tokens of an engine entry ({token id: Logprob with its rank})."""
    top: dict[str, float] = {}
    for token_id, lp in sorted(entry.items(), key=lambda item: item[1].rank)[:k]:
        top.setdefault(decode(token_id), float(lp))
    return top


def check_prompt_part(lp, prompt_ids, prompt_logprobs, k, decode):
    """The first len(prompt_ids) entries of a legacy logprobs object: the prompt's tokens and the engine's
    log-probabilities of them, None for the first."""
    n = len(prompt_ids)
    assert lp.tokens[:n] == [decode(t) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, n):
        entry = prompt_logprobs[pos]
        assert lp.token_logprobs[pos] == pytest.approx(float(entry[prompt_ids[pos]]), abs=TOL)
        want = most_likely(entry, k, decode)
        assert lp.top_logprobs[pos].keys() == want.keys()
        assert list(lp.top_logprobs[pos].values()) == pytest.approx(list(want.values()), abs=TOL)


def offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for text in tokens:
        out.append(at)
        at += len(text)
    return out


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, reference):
    """What an evaluation client sends to score a continuation: the prompt back as the text, each of its
    tokens with the engine's prompt log-probability and the k most likely there, nothing generated."""
    tokenizer = reference.tokenizer
    decode = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    prompts = [context + continuation for context, continuation in ITEMS]
    ids = tokenizer(prompts[0])["input_ids"]
    lines = [completion_line(f"s{i}", p, echo=True, logprobs=K, max_tokens=0) for i, p in enumerate(prompts)]
    lines.append(completion_line("ids", ids, echo=True, logprobs=1, max_tokens=0))  # a prompt as token ids
    batch = run_batch(client, lines)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {
        "total": 4, "completed": 4, "failed": 0}
    out = lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["s0", "s1", "s2", "ids"]
    refs = reference.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=K), use_tqdm=False)
    for line, prompt, ref in zip(out, prompts, refs):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = legacy(line["response"]["body"])
        assert body.object == "text_completion" and len(body.choices) == 1
        choice = body.choices[0]
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.prompt_token_ids)
        check_prompt_part(lp, ref.prompt_token_ids, ref.prompt_logprobs, K, decode)
        assert lp.text_offset == offsets(lp.tokens)
        assert body.usage.prompt_tokens == body.usage.total_tokens == len(ref.prompt_token_ids)
        assert body.usage.completion_tokens == 0
    # the continuation's score as a client sums it: the tokens after the context's
    context_len = len(tokenizer(ITEMS[0][0])["input_ids"])
    first = legacy(out[0]["response"]["body"]).choices[0].logprobs
    want = sum(float(e[t]) for e, t in zip(refs[0].prompt_logprobs[context_len:], refs[0].prompt_token_ids[context_len:]))
    assert sum(first.token_logprobs[context_len:]) == pytest.approx(want, abs=TOL)
    by_ids = legacy(out[3]["response"]["body"]).choices[0]
    assert by_ids.text == tokenizer.decode(ids) and by_ids.logprobs.tokens == first.tokens
    assert by_ids.logprobs.token_logprobs[1:] == pytest.approx(first.token_logprobs[1:], abs=TOL)
    assert all(len(top) == 1 for top in by_ids.logprobs.top_logprobs[1:])
    assert batch.usage.input_tokens == sum(len(r.prompt_token_ids) for r in refs) + len(ids)
    assert batch.usage.output_tokens == 0


def test_echo_before_a_completion_and_without_logprobs(client, reference):
    """echo with max_tokens >= 1: the prompt then the completion, in the text and in the logprobs (prompt
    tokens first, then the generated ones); without logprobs only the text; logprobs 0: no alternatives."""
    tokenizer = reference.tokenizer
    decode = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    prompt = "Once upon a time"
    lines = [completion_line("gen", prompt, echo=True, logprobs=1, max_tokens=5, temperature=0),
             completion_line("text", prompt, echo=True, max_tokens=5, temperature=0),
             completion_line("zero", prompt, echo=True, logprobs=0, max_tokens=0),
             completion_line("plain", prompt, echo=False, logprobs=1, max_tokens=5, temperature=0)]
    batch = run_batch(client, lines)
    assert batch.request_counts.completed == 4
    gen, text, zero, plain = (legacy(x["response"]["body"]) for x in lines_of(client, batch.output_file_id))
    ref = reference.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=1),
                             use_tqdm=False)[0]
    sample, n = ref.outputs[0], len(ref.prompt_token_ids)
    assert sample.token_ids  # something was generated after the echo
    choice = gen.choices[0]
    assert choice.text == prompt + sample.text and choice.finish_reason == sample.finish_reason
    lp = choice.logprobs
    assert len(lp.tokens) == n + len(sample.token_ids)
    check_prompt_part(lp, ref.prompt_token_ids, ref.prompt_logprobs, 1, decode)
    assert lp.tokens[n:] == [decode(t) for t in sample.token_ids]
    assert lp.token_logprobs[n:] == pytest.approx([float(e[t]) for e, t in zip(sample.logprobs, sample.token_ids)],
                                                  abs=TOL)
    assert lp.top_logprobs[n:] == [most_likely(e, 1, decode) for e in sample.logprobs]
    assert lp.text_offset == offsets(lp.tokens)
    assert (gen.usage.prompt_tokens, gen.usage.completion_tokens) == (n, len(sample.token_ids))
    assert text.choices[0].text == prompt + sample.text and text.choices[0].logprobs is None
    zero_lp = zero.choices[0].logprobs
    assert zero.choices[0].text == prompt and len(zero_lp.tokens) == n
    assert zero_lp.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=TOL)
    assert zero_lp.top_logprobs[1:] == [{}] * (n - 1)
    assert plain.choices[0].text == sample.text and plain.choices[0].logprobs.tokens == lp.tokens[n:]


def test_bad_echo_lines_are_their_lines_errors(client):
    completions = [completion_line("ok", "hello", echo=True, logprobs=1, max_tokens=0),
                   completion_line("echo-text", "hello", echo="yes", max_tokens=0),
                   completion_line("prompt-lp", "hello", prompt_logprobs=2, max_tokens=0),
                   completion_line("too-many", "hello", echo=True, logprobs=21, max_tokens=0)]
    batch = run_batch(client, completions)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {
        "total": 4, "completed": 1, "failed": 3}
    assert [x["custom_id"] for x in lines_of(client, batch.output_file_id)] == ["ok"]
    errors = {x["custom_id"]: x["response"]["body"]["error"]["message"] for x in lines_of(client, batch.error_file_id)}
    assert errors == {"echo-text": "line 2: body.echo must be true or false, got 'yes'",
                      "prompt-lp": "line 3: body.prompt_logprobs is not supported by batchrun serve; /v1/completions "
                                   "with echo: true and logprobs: k returns the prompt's log-probabilities",
                      "too-many": "line 4: body.logprobs must be an integer from 0 to 20 for completions, got 21"}
    chats = [chat_line("ok", "hi", max_tokens=2), chat_line("echo", "hi", echo=True, max_tokens=2),
             chat_line("none", "hi", max_tokens=0), chat_line("no-echo", "hi", echo=False, max_tokens=2)]
    batch = run_batch(client, chats, endpoint="/v1/chat/completions")
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 2, "failed": 2}
    errors = {x["custom_id"]: x["response"]["body"]["error"]["message"] for x in lines_of(client, batch.error_file_id)}
    assert errors == {"echo": "line 2: body.echo is for /v1/completions; chat completions do not echo the prompt",
                      "none": "line 3: body.max_tokens must be at least 1 for chat completions, got 0"}


def test_the_log_says_a_batch_runs_on_the_loaded_model(client, server, caplog):
    """The model loads once, at start: a batch's log says it runs on it, and no "loading model" line."""
    with caplog.at_level(logging.INFO, logger="batchrun"):
        batch = run_batch(client, [completion_line(f"r{i}", "hi", max_tokens=1) for i in range(3)])
    assert batch.status == "completed"
    said = [r.getMessage() for r in caplog.records]
    assert f"batch {batch.id}: running 3 requests on the loaded model {server.settings.model['path']}" in said
    assert not [m for m in said if m.startswith("loading model")]


def test_the_openai_batch_source_maps_echo_and_logprobs(tmp_path):
    """Without the server's checks (`batchrun run` on an openai-batch file): echo + logprobs k asks the prompt's
    log-probabilities k, echo alone asks none, a completion's logprobs 0 still asks the tokens' own; a bad
    echo is that row's error."""
    import json

    from batchrun.io.sources import ROW_ERROR, open_source

    bodies = [dict(prompt="a", echo=True, logprobs=2, max_tokens=0), dict(prompt="b", echo=True),
              dict(prompt="c", logprobs=0), dict(prompt="d", echo="yes"), dict(prompt="e", prompt_logprobs=3),
              dict(messages=[{"role": "user", "content": "f"}], echo=True)]
    lines = [completion_line(f"r{i}", None) | {"body": body} for i, body in enumerate(bodies)]
    lines[-1]["url"] = "/v1/chat/completions"
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = [r for batch in open_source({"path": str(path), "format": "openai-batch", "split": "train",
                                        "data_files": None}).iter_rows() for r in batch]
    assert rows[0]["echo"] is True and rows[0]["sampling"] == {"max_tokens": 0, "logprobs": 2, "prompt_logprobs": 2}
    assert rows[1]["echo"] is True and rows[1]["sampling"] == {}
    assert "echo" not in rows[2] and rows[2]["sampling"] == {"logprobs": 0}
    assert rows[3][ROW_ERROR].endswith("body.echo must be true or false, got 'yes'")
    assert rows[4]["sampling"] == {}  # prompt log-probabilities come from echo alone
    assert rows[5][ROW_ERROR].endswith("body.echo is for /v1/completions only")
