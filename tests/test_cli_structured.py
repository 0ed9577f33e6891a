"""Structured outputs end to end through the console script (builtin:tiny-llama): the job file, per-row
columns, OpenAI batch response_format, and the bad inputs (a job-level spec that does not compile is exit 2
before the model loads; a bad or too slow per-row one is that row's error)."""

from __future__ import annotations

import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
from test_job_fakes import read_rows, run_cli, write_job

ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 64}
LABELS = ["alpha", "beta", "gamma"]


def check_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def test_job_level_and_per_row_structured_outputs(tmp_path):
    bounded = json.dumps({"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "ok": {"type": "boolean"}},
                          "required": ["k", "ok"]})
    unbounded = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    pq.write_table(pa.table({
        "prompt": ["the cat", "a river", "once upon", "the machine", "a small", "the end"],
        "labels": [None, ["red", "blue"], None, None, None, None],
        "schema": [None, None, bounded, unbounded, "{not json", None],
        "pattern": [None, None, None, None, None, "(((" ],
    }), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(tmp_path / "in.parquet"),
                           "sampling_columns": {"choice": "labels", "json": "schema", "regex": "pattern"}},
                    sampling={"max_tokens": 24, "temperature": 0.0,
                              "structured_outputs": {"choice": LABELS, "disable_any_whitespace": True}},
                    engine=ENGINE, output={"path": str(tmp_path / "out")})
    check_ok(run_cli(["run", job, "--set", "engine.grammar_compile_timeout_s=20"]))
    rows = read_rows(tmp_path / "out")
    assert rows[0]["completion"] in LABELS and rows[0]["finish_reason"] == "stop" and rows[0]["error"] is None
    assert rows[1]["completion"] in ("red", "blue")
    assert rows[2]["error"] is None
    jsonschema.validate(json.loads(rows[2]["completion"]), json.loads(bounded))
    # a random model writes digits until max_tokens: the text is kept, the row is marked
    assert rows[3]["finish_reason"] == "length" and rows[3]["completion"].startswith('{"n"')
    assert rows[3]["error"] == "structured output is incomplete: max_tokens reached before the grammar completed"
    assert rows[4]["finish_reason"] == "error" and "json is not valid JSON" in rows[4]["error"]
    assert rows[5]["finish_reason"] == "error"
    assert rows[5]["error"].startswith("structured_outputs: the regex does not compile: Regex parsing error")


def test_openai_batch_response_format(tmp_path):
    schema = {"enum": ["yes", "no"]}  # a JSON string: no room for whitespace the random model could loop on
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
               "max_tokens": 32},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
               "max_tokens": 2},
              {"response_format": {"type": "bogus"}}]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "m", "messages": [{"role": "user", "content": "ok?"}],
                                                 "temperature": 0, **b}}) + "\n"
                            for i, b in enumerate(bodies)))
    job = write_job(tmp_path / "job.yaml", input={"path": str(path)}, engine=ENGINE,
                    output={"path": str(tmp_path / "out")})
    check_ok(run_cli(["run", job]))
    lines = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    first = lines[0]["response"]["body"]["choices"][0]
    assert lines[0]["error"] is None and first["finish_reason"] == "stop"
    jsonschema.validate(json.loads(first["message"]["content"]), schema)
    cut = lines[1]
    assert cut["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert cut["error"]["code"] == "structured_output_incomplete"
    assert lines[2]["response"]["status_code"] == 400
    assert "unsupported type 'bogus'" in lines[2]["response"]["body"]["error"]["message"]


def test_a_job_level_spec_that_does_not_compile_is_exit_2_before_the_model_loads(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out"
    for spec, words in [({"regex": "((("}, "sampling.structured_outputs: the regex does not compile"),
                        ({"json": {"type": "nonsense"}}, 'the json does not compile: Unsupported type "nonsense"')]:
        job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.jsonl")},
                        sampling={"structured_outputs": spec}, output={"path": str(out)})
        for command in ("validate", "run") if "regex" in spec else ("validate",):
            proc = run_cli([command, job])
            assert proc.returncode == 2, proc.stderr
            # (a built-in model is made on first use: its progress bar may come first)
            errors = [x for x in proc.stderr.splitlines() if x.startswith("batchrun: error")]
            assert len(errors) == 1 and words in errors[0] and "Traceback" not in proc.stderr, proc.stderr
        assert not out.exists()


def test_a_per_row_spec_that_compiles_too_slowly_is_a_row_error(tmp_path):
    huge = json.dumps({"enum": [f"value-{i}" for i in range(20000)]})
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hi", "schema": huge}) + "\n"
                                       + json.dumps({"prompt": "there", "schema": None}) + "\n")
    job = write_job(tmp_path / "job.yaml",
                    input={"path": str(tmp_path / "in.jsonl"), "sampling_columns": {"json": "schema"}},
                    sampling={"max_tokens": 8, "structured_outputs": {"choice": LABELS}},
                    engine={**ENGINE, "grammar_compile_timeout_s": 0.3}, output={"path": str(tmp_path / "out")})
    check_ok(run_cli(["run", job]))
    rows = read_rows(tmp_path / "out")
    assert rows[0]["error"] == ("structured_outputs: the json did not compile within 0.3 s "
                                "(engine.grammar_compile_timeout_s)")
    assert rows[1]["completion"] in LABELS and rows[1]["error"] is None
