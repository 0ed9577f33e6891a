"""End to end through the console script, on the real engine (builtin:tiny-llama) once it works, else on
the fake one: Parquet, JSONL, a saved HF dataset with chat messages, the OpenAI batch format."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
from test_job_fakes import read_rows, run_cli, write_job

ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 64}


def check_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def test_parquet_keep_columns_sampling_columns_and_row_errors(tmp_path):
    prompts = ["The cat sits on the", "Write one word:", None, "Tell me about the river", "",
               "The machine learns", "Once upon a time", "A small village near the sea"]
    pq.write_table(pa.table({
        "id": [f"q{i}" for i in range(8)], "prompt": prompts, "lang": ["en"] * 8,
        "budget": [1, 2, 3, 4, 5, None, 2, 3],
    }), tmp_path / "in.parquet", row_group_size=3)
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(tmp_path / "in.parquet"), "keep_columns": ["lang"],
                           "sampling_columns": {"max_tokens": "budget"}},
                    sampling={"max_tokens": 4, "temperature": 0.0},
                    engine=ENGINE,
                    output={"path": str(tmp_path / "out"), "rows_per_part": 3, "include_prompt": True,
                            "include_token_ids": True})
    proc = check_ok(run_cli(["run", job]))
    out = tmp_path / "out"
    assert f"to {out}" in proc.stdout
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(8)]
    assert all(r["lang"] == "en" for r in rows)
    assert [r["prompt"] for r in rows] == prompts
    assert rows[2]["error"] == "prompt is null" and rows[2]["finish_reason"] == "error"
    assert rows[4]["error"] == "prompt is empty" and rows[4]["completion"] is None
    budgets = [1, 2, None, 4, None, 4, 2, 3]
    for r, b in zip(rows, budgets):
        if b is None:
            continue
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["completion_tokens"] <= b and len(r["token_ids"]) == r["completion_tokens"]
        assert isinstance(r["completion"], str) and r["prompt_tokens"] > 0
    assert rows[0]["completion_tokens"] == 1
    assert len(list(out.glob("part-*.parquet"))) == 3 and (out / "_SUCCESS").exists()
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["input_rows"] == 8 and metrics["output_rows"] == 8 and metrics["row_errors"] == 2
    assert metrics["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert metrics["complete"] is True and "wall_time_s" in metrics["this_run"] and metrics["engine"]


def test_jsonl_with_n_samples(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"Story number {i} begins"}) + "\n" for i in range(5)))
    job = write_job(tmp_path / "job.yaml", input={"path": str(src)},
                    sampling={"n": 3, "temperature": 0.8, "max_tokens": 3, "seed": 7}, engine=ENGINE,
                    output={"path": str(tmp_path / "out")})
    check_ok(run_cli(["run", job]))
    rows = read_rows(tmp_path / "out")
    assert [(r["id"], r["sample_index"]) for r in rows] == [(i, j) for i in range(5) for j in range(3)]
    assert all(r["error"] is None and 1 <= r["completion_tokens"] <= 3 for r in rows)


def test_saved_dataset_with_chat_messages(tmp_path):
    import datasets

    msgs = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"Question {i}?"}]
            for i in range(5)]
    msgs[3] = [{"role": "user"}]  # malformed: no content
    datasets.Dataset.from_dict({"messages": msgs, "topic": list("abcde")}).save_to_disk(str(tmp_path / "ds"))
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(tmp_path / "ds"), "messages_column": "messages", "keep_columns": ["topic"]},
                    sampling={"max_tokens": 3}, engine=ENGINE,
                    output={"path": str(tmp_path / "out"), "include_prompt": True})
    check_ok(run_cli(["run", job]))
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4]  # no id column: the row numbers
    assert [r["topic"] for r in rows] == list("abcde")
    assert "Question 2?" in rows[2]["prompt"] and rows[2]["prompt"] != "Question 2?"  # the chat template ran
    assert rows[3]["error"].startswith("malformed messages") and rows[3]["finish_reason"] == "error"
    assert all(r["error"] is None for i, r in enumerate(rows) if i != 3)


def test_openai_batch_format(tmp_path):
    src = tmp_path / "batch.jsonl"
    reqs = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}},
            {"custom_id": "comp-2", "method": "POST", "url": "/v1/completions",
             "body": {"model": "x", "prompt": "The river", "max_tokens": 3, "n": 2, "temperature": 0.5}},
            {"custom_id": "bad-3", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": "not a list"}}]
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    job = write_job(tmp_path / "job.yaml", input={"path": str(src)}, engine=ENGINE,
                    output={"path": str(tmp_path / "out")})
    check_ok(run_cli(["run", job]))
    out = tmp_path / "out"
    assert not list(out.glob("part-*")) and (out / "_SUCCESS").exists()
    lines = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["chat-1", "comp-2", "bad-3"]
    chat = lines[0]["response"]["body"]
    assert lines[0]["response"]["status_code"] == 200 and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] <= 2
    comp = lines[1]["response"]["body"]
    assert comp["object"] == "text_completion" and [c["index"] for c in comp["choices"]] == [0, 1]
    assert lines[2]["response"]["status_code"] == 400
    assert "malformed messages" in lines[2]["response"]["body"]["error"]["message"]


def test_validate_does_not_load_the_model(tmp_path):
    from click.testing import CliRunner

    from batchrun.cli import main

    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                    output={"path": str(tmp_path / "out")})
    marker = tmp_path / "constructed"
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:ExplodingLLM", "BATCHRUN_FAKE_MARKER": str(marker)}
    result = CliRunner().invoke(main, ["validate", job], env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok: ") and "3 rows" in result.stdout and "starts afresh" in result.stdout
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_version():
    proc = run_cli(["--version"])
    assert proc.returncode == 0 and proc.stdout.startswith("batchrun, version ")
