"""Rows -> requests: prompts, chat templates, per-row sampling, seeds and row errors."""

import pytest
from test_job_fakes import FakeLLM, make_tokenizer

from batchrun.config import JobError, parse_job
from batchrun.io.rows import RequestBuilder
from batchrun.io.sources import ROW_ERROR


def builder(extra="", fmt="parquet", tokenizer=None, id_column="id"):
    cfg = parse_job("model: {path: builtin:tiny-llama}\noutput: {path: o}\n" + extra)
    llm = FakeLLM("fake", max_model_len=64)
    return RequestBuilder(cfg, source_format=fmt, tokenizer=tokenizer or llm.tokenizer,
                          check_prompt=llm.check_prompt, id_column=id_column)


def build(b, rows):
    return b.build([(i, 100 + i, r) for i, r in enumerate(rows)])


def test_prompts_tokenized_in_batches_with_ids_keep_and_seeds():
    b = builder("input: {path: x, keep_columns: [k]}\nsampling: {seed: 5, max_tokens: 4}")
    assert b.columns() == ["prompt", "id", "k"]
    tasks = build(b, [{"id": "a", "prompt": "hi", "k": 1}, {"id": "b", "prompt": "yo", "k": 2}])
    tok = make_tokenizer()
    assert [t.prompt_ids for t in tasks] == [tok("hi")["input_ids"], tok("yo")["input_ids"]]
    assert [t.id for t in tasks] == ["a", "b"] and [t.keep for t in tasks] == [{"k": 1}, {"k": 2}]
    assert [t.params.seed for t in tasks] == [105, 106]  # job seed + global row index
    assert all(t.params.max_tokens == 4 and t.prompt_tokens == 3 and t.error is None for t in tasks)


def test_row_errors():
    b = builder("input: {path: x}")
    tasks = build(b, [{"prompt": None}, {"prompt": ""}, {"prompt": "   "}, {"prompt": 7}, {"other": "x"},
                      {"prompt": "x" * 100}, {ROW_ERROR: "line 3: invalid JSON"}, {"prompt": "fine"}])
    errors = [t.error for t in tasks]
    assert errors[0] == "prompt is null" and errors[1] == errors[2] == "prompt is empty"
    assert errors[3] == "prompt is not a string (int)" and "missing in this row" in errors[4]
    assert errors[5].startswith("prompt too long") and errors[6] == "line 3: invalid JSON"
    assert errors[7] is None and tasks[7].prompt_ids
    assert all(t.prompt_ids is None and t.params is None for t in tasks[:7])


def test_chat_messages():
    b = builder("input: {path: x, messages_column: msgs, id_column: null}", id_column=None)
    good = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tasks = build(b, [{"msgs": good}, {"msgs": []}, {"msgs": "hi"}, {"msgs": [{"role": "user"}]},
                      {"msgs": [{"content": "x"}]}, {"msgs": None}])
    assert tasks[0].error is None and tasks[0].id == 100
    assert tasks[0].prompt == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tasks[0].prompt_ids == make_tokenizer()(tasks[0].prompt, add_special_tokens=False)["input_ids"]
    assert all(t.error.startswith("malformed messages") for t in tasks[1:]), [t.error for t in tasks]


def test_messages_need_a_chat_template():
    with pytest.raises(JobError, match="has no chat template"):
        builder("input: {path: x, messages_column: m}", tokenizer=make_tokenizer(False))


def test_sampling_columns_per_row():
    b = builder("input: {path: x, sampling_columns: {max_tokens: budget, temperature: temp, seed: s}}")
    assert b.columns() == ["prompt", "id", "budget", "temp", "s"]
    tasks = build(b, [{"prompt": "a", "budget": 3, "temp": 0.5, "s": 9},
                      {"prompt": "b", "budget": None, "temp": None, "s": None},
                      {"prompt": "c", "budget": 4.0},
                      {"prompt": "d", "budget": -1},
                      {"prompt": "e", "budget": "many"}])
    assert (tasks[0].params.max_tokens, tasks[0].params.temperature, tasks[0].params.seed) == (3, 0.5, 9)
    assert (tasks[1].params.max_tokens, tasks[1].params.temperature, tasks[1].params.seed) == (128, 0.0, 101)
    assert tasks[2].params.max_tokens == 4
    assert tasks[3].error.startswith("sampling max_tokens: must be an integer >= 0")
    assert tasks[4].error.startswith("sampling max_tokens: expected an integer")


def test_openai_rows():
    b = builder("input: {path: x}", fmt="openai-batch", id_column=None)
    assert b.columns() is None
    rows = [{"custom_id": "a", "url": "/v1/chat/completions", "messages": [{"role": "user", "content": "hi"}],
             "sampling": {"max_tokens": 2}},
            {"custom_id": "b", "url": "/v1/completions", "prompt": [0, 70, 71], "sampling": {}},
            {"custom_id": "c", "url": "/v1/completions", "prompt": "", "sampling": {}},
            {ROW_ERROR: "line 4: missing the request body", "custom_id": "d"}]
    tasks = build(b, rows)
    assert [t.id for t in tasks] == ["a", "b", "c", "d"]
    assert tasks[0].params.max_tokens == 2 and tasks[0].prompt.startswith("<|user|>hi")
    assert tasks[1].prompt_ids == [0, 70, 71] and tasks[1].prompt_tokens == 3
    assert tasks[2].error == "prompt is empty"
    assert tasks[3].extra["custom_id"] == "d" and tasks[3].error.endswith("missing the request body")
