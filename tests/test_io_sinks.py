"""Ordered Parquet parts and OpenAI batch output: atomic commits, counts, schema, resume state."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.io.rows import RowTask
from batchrun.output.files import SinkError
from batchrun.output.folder import clear_output
from batchrun.output.openai_sink import OpenAIBatchSink
from batchrun.output.parquet import ParquetSink
from batchrun.output.parts import part_files
from batchrun.output.sink import OutputSpec
from batchrun.outputs import CompletionOutput


def out(text, n_tokens, index=0, reason="stop", logprobs=None):
    return CompletionOutput(index=index, text=text, token_ids=list(range(n_tokens)), cumulative_logprob=None,
                            logprobs=logprobs, finish_reason=reason)


def task(pos, error=None, **kw):
    return RowTask(pos=pos, index=pos, id=kw.pop("id", f"r{pos}"), prompt=f"prompt {pos}", prompt_tokens=3,
                   error=error, **kw)


def test_parts_commit_atomically_in_order(tmp_path):
    sink = ParquetSink(tmp_path, OutputSpec(keep_columns=["k"], include_prompt=True), rows_per_part=4, fp_hash="f")
    assert sink.open().end == 0
    for i in range(10):
        t = task(i, keep={"k": i * 10})
        if i == 6:
            t.error = "prompt is empty"
            sink.add(t, None)
        else:
            sink.add(t, [out(f"c{i}", i)])
        if sink.pending_rows >= 4:
            sink.commit()
    sink.commit()
    assert [p.name for p in part_files(tmp_path)] == ["part-00000.parquet", "part-00001.parquet",
                                                        "part-00002.parquet"]
    assert not list(tmp_path.glob(".*"))  # no temporary files left
    rows = pq.read_table(tmp_path).to_pylist()
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(10)]
    assert rows[6]["finish_reason"] == "error" and rows[6]["error"] == "prompt is empty"
    assert rows[6]["completion"] is None and rows[6]["completion_tokens"] == 0
    assert rows[3] == {"id": "r3", "k": 30, "prompt": "prompt 3", "completion": "c3", "finish_reason": "stop",
                       "prompt_tokens": 3, "completion_tokens": 3, "error": None}
    c = ParquetSink(tmp_path, sink.spec, 4, "f").scan()
    assert (c.end, c.rows, c.errors, c.completion_tokens) == (10, 10, 1, sum(range(10)) - 6)


def test_skip_rows_advance_the_position(tmp_path):
    sink = ParquetSink(tmp_path, OutputSpec(), rows_per_part=100, fp_hash="f")
    sink.open()
    sink.add(task(0), [out("a", 1)])
    sink.add(task(1, error="bad"), None, write=False)
    sink.commit()
    c = ParquetSink(tmp_path, OutputSpec(), 100, "f").scan()
    assert (c.end, c.rows, c.errors) == (2, 1, 1)


def test_resume_appends_and_keeps_schema(tmp_path):
    spec = OutputSpec(keep_columns=["k"])
    s1 = ParquetSink(tmp_path, spec, rows_per_part=2, fp_hash="f")
    s1.open()
    for i in range(3):
        s1.add(task(i, keep={"k": None}), [out("x", 1)])  # an all-null column: stored as string
        if s1.pending_rows >= 2:
            s1.commit()
    # rows 2 is pending (not committed) when the "process dies"; a temp file is left behind
    (tmp_path / ".part-00001.parquet.tmp").write_bytes(b"partial")
    s2 = ParquetSink(tmp_path, spec, rows_per_part=2, fp_hash="f")
    assert s2.open().end == 2
    assert not (tmp_path / ".part-00001.parquet.tmp").exists()
    for i in range(2, 4):
        s2.add(task(i, keep={"k": {"nested": i}}), [out("y", 2)])
    s2.commit()
    t = pq.read_table(tmp_path)
    assert t.schema.field("k").type == pa.string()
    assert t.column("k").to_pylist() == [None, None, '{"nested": 2}', '{"nested": 3}']
    assert [r["id"] for r in t.to_pylist()] == ["r0", "r1", "r2", "r3"]


def test_scan_refuses_other_jobs_and_gaps(tmp_path):
    s = ParquetSink(tmp_path, OutputSpec(), rows_per_part=1, fp_hash="f")
    s.open()
    for i in range(3):
        s.add(task(i), [out("x", 1)])
        s.commit()
    with pytest.raises(SinkError, match="different job"):
        ParquetSink(tmp_path, OutputSpec(), 1, "other").scan()
    (tmp_path / "part-00001.parquet").unlink()  # a part lost in the middle: damage, computed again
    s2 = ParquetSink(tmp_path, OutputSpec(), 1, "f")
    assert s2.scan().end == 3 and [(p.index, p.damage, p.start, p.end) for p in s2.inspection.damaged] == [
        (1, "missing", 1, 2)]
    shutil.copy(tmp_path / "part-00002.parquet", tmp_path / "part-00001.parquet")
    (tmp_path / "_manifest.json").unlink()  # nothing left to say which of two parts covering 2..3 is right
    with pytest.raises(SinkError, match="not contiguous"):
        ParquetSink(tmp_path, OutputSpec(), 1, "f").scan()
    (tmp_path / "notes.txt").write_text("mine")
    clear_output(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_samples_token_ids_and_logprobs(tmp_path):
    spec = OutputSpec(sample_index=True, include_token_ids=True, logprobs=True)
    s = ParquetSink(tmp_path, spec, rows_per_part=100, fp_hash="f")
    s.open()
    s.add(task(0), [out("a", 2, 0, logprobs=[{0: -0.1}, {1: -0.2, 7: -3.0}]), out("b", 1, 1, "length",
                                                                                  logprobs=[{0: -1.0}])])
    s.add(task(1, error="too long"), None)
    s.commit()
    rows = pq.read_table(tmp_path).to_pylist()
    assert [(r["id"], r["sample_index"], r["completion"]) for r in rows] == [("r0", 0, "a"), ("r0", 1, "b"),
                                                                             ("r1", 0, None)]
    assert rows[0]["token_ids"] == [0, 1] and rows[1]["finish_reason"] == "length"
    assert rows[0]["logprobs"] == [[(0, -0.1)], [(1, -0.2), (7, -3.0)]]
    assert rows[2]["token_ids"] is None and rows[2]["error"] == "too long"


def test_openai_batch_output_and_truncation_on_resume(tmp_path):
    spec = OutputSpec(model="builtin:tiny-llama")
    s = OpenAIBatchSink(tmp_path, spec, rows_per_part=2, fp_hash="f")
    s.open()
    chat = task(0, extra={"custom_id": "a", "url": "/v1/chat/completions", "model": "m"})
    comp = task(1, extra={"custom_id": "b", "url": "/v1/completions", "model": "m"})
    s.add(chat, [out("hello", 2)])
    s.add(comp, [out("world", 3, reason="length")])
    s.commit()
    s.add(task(2, error="malformed messages", extra={"custom_id": "c"}), None)
    s.commit()
    with open(tmp_path / "output.jsonl", "ab") as f:
        f.write(b'{"half a line')  # a crash after the append, before _progress.json
    lines = (tmp_path / "output.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["custom_id"] == "a" and first["error"] is None
    body = first["response"]["body"]
    assert first["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    second = json.loads(lines[1])["response"]["body"]
    assert second["object"] == "text_completion" and second["choices"][0]["text"] == "world"
    assert second["choices"][0]["finish_reason"] == "length"
    third = json.loads(lines[2])
    assert third["response"]["status_code"] == 400
    assert third["response"]["body"]["error"]["message"] == "malformed messages"
    s2 = OpenAIBatchSink(tmp_path, spec, rows_per_part=2, fp_hash="f")
    assert s2.open().end == 3
    assert len((tmp_path / "output.jsonl").read_text().splitlines()) == 3


def test_openai_lines_carry_logprobs_in_openai_shapes():
    """A request that asked for logprobs gets OpenAI's objects: chat `content` entries, completions' parallel
    lists; the top N are the first N of each token's dict (the engine puts them first, best first)."""
    from batchrun.output.openai_sink import openai_line
    from batchrun.sampling_params import SamplingParams

    words = {0: "Hi", 1: " there", 7: "é", 8: "!"}
    logprobs = [{7: -0.1, 0: -0.5}, {1: -0.2, 8: -0.9}]  # token 0 was drawn outside the top 1
    sample = CompletionOutput(index=0, text="Hi there", token_ids=[0, 1], cumulative_logprob=-0.7,
                              logprobs=logprobs, finish_reason="length")
    chat = task(0, extra={"custom_id": "c", "url": "/v1/chat/completions"}, params=SamplingParams(logprobs=1))
    line = openai_line(chat, [sample], "m", words.__getitem__)
    content = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                          "top_logprobs": [{"token": "é", "logprob": -0.1, "bytes": [195, 169]}]}
    assert [c["token"] for c in content] == ["Hi", " there"] and content[1]["top_logprobs"][0]["logprob"] == -0.2
    completion = task(1, extra={"custom_id": "d", "url": "/v1/completions"}, params=SamplingParams(logprobs=2))
    lp = openai_line(completion, [sample], "m", words.__getitem__)["response"]["body"]["choices"][0]["logprobs"]
    assert lp == {"tokens": ["Hi", " there"], "token_logprobs": [-0.5, -0.2], "text_offset": [0, 2],
                  "top_logprobs": [{"é": -0.1, "Hi": -0.5}, {" there": -0.2, "!": -0.9}]}
    plain = task(2, extra={"custom_id": "e", "url": "/v1/completions"}, params=SamplingParams())
    assert openai_line(plain, [sample], "m", None)["response"]["body"]["choices"][0]["logprobs"] is None
    # a line with no custom_id of its own (not JSON, say) answers with custom_id null, not a row number
    assert openai_line(task(3, error="line 4: invalid JSON"), None, "m")["custom_id"] is None
