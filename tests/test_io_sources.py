"""Input readers: formats, inference, streaming from an offset, bad rows, and what makes an input unreadable."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.config import JobError
from batchrun.io.sources import ROW_ERROR, infer_format, open_source


def inp(path, **kw):
    base = {"path": str(path), "format": None, "split": "train", "data_files": None}
    return {**base, **kw}


def collect(source, start=0, columns=None, batch_size=7):
    return [r for batch in source.iter_rows(start, columns, batch_size) for r in batch]


def write_parquet(path, n, start=0, row_group_size=10):
    t = pa.table({"id": list(range(start, start + n)), "prompt": [f"p{i}" for i in range(start, start + n)],
                  "extra": [i * 0.5 for i in range(start, start + n)]})
    pq.write_table(t, path, row_group_size=row_group_size)


def test_parquet_file_folder_glob_and_offsets(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    write_parquet(d / "a.parquet", 25)
    write_parquet(d / "b.parquet", 13, start=25)
    (d / "_SUCCESS").write_text("")
    for path in (d, d / "*.parquet"):
        src = open_source(inp(path))
        assert src.format == "parquet" and src.num_rows() == 38
        assert src.arrow_types()["id"] == pa.int64()
        assert [r["id"] for r in collect(src)] == list(range(38))
        for start in (0, 9, 10, 24, 25, 26, 37, 38):
            rows = collect(src, start, ["prompt"])
            assert [r["prompt"] for r in rows] == [f"p{i}" for i in range(start, 38)]
            assert all(set(r) == {"prompt"} for r in rows)
    assert open_source(inp(d / "a.parquet")).num_rows() == 25


def test_parquet_batches_are_bounded(tmp_path):
    write_parquet(tmp_path / "a.parquet", 100, row_group_size=100)
    src = open_source(inp(tmp_path / "a.parquet"))
    assert max(len(b) for b in src.iter_rows(0, None, 16)) <= 16


def test_unreadable_parquet(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet at all")
    with pytest.raises(JobError, match="bad.parquet is not a readable Parquet file"):
        open_source(inp(bad))


def test_missing_input(tmp_path):
    with pytest.raises(JobError, match="input.path: .*nope.parquet does not exist"):
        open_source(inp(tmp_path / "nope.parquet"))
    with pytest.raises(JobError, match="no Parquet files match"):
        open_source(inp(tmp_path / "*.parquet"))


def test_jsonl_rows_bad_lines_and_offsets(tmp_path):
    p = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"p{i}"}) for i in range(10)]
    lines[3] = "{not json"
    lines[5] = "[1, 2]"
    p.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")
    src = open_source(inp(p))
    assert src.format == "jsonl" and src.columns == ["id", "prompt"] and src.count_rows() == 10
    rows = collect(src)
    assert len(rows) == 10
    assert "line 4: invalid JSON" in rows[3][ROW_ERROR] and "expected a JSON object" in rows[5][ROW_ERROR]
    assert [r["id"] for r in collect(src, 6)] == [6, 7, 8, 9]  # blank lines do not count as rows
    assert collect(src, 0, ["prompt"])[0] == {"prompt": "p0"}


def test_jsonl_first_line_must_be_json(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("garbage\n")
    with pytest.raises(JobError, match="line 1 is not valid JSON"):
        open_source(inp(p))


def test_openai_batch_format(tmp_path):
    p = tmp_path / "batch.jsonl"
    reqs = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                  "temperature": 0.5, "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "hello", "max_completion_tokens": 3, "seed": 1}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions"},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    assert infer_format(str(p)) == "openai-batch"
    src = open_source(inp(p))
    rows = collect(src)
    assert rows[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert rows[0]["sampling"] == {"max_tokens": 5, "temperature": 0.5, "logprobs": 2}
    assert rows[1]["prompt"] == "hello" and rows[1]["sampling"] == {"max_tokens": 3, "seed": 1}
    assert "missing the request body" in rows[2][ROW_ERROR] and rows[2]["custom_id"] == "c"


def test_saved_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(30)), "prompt": [f"p{i}" for i in range(30)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    src = open_source(inp(tmp_path / "ds"))
    assert src.format == "dataset" and src.num_rows() == 30 and src.columns == ["id", "prompt"]
    assert [r["id"] for r in collect(src, 12, ["id"])] == list(range(12, 30))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    assert open_source(inp(tmp_path / "dd", split="test")).num_rows() == 5
    with pytest.raises(JobError, match="input.split: 'valid' is not a split"):
        open_source(inp(tmp_path / "dd", split="valid"))


def test_load_dataset_builder_with_data_files(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(9)))
    src = open_source(inp("json", format="dataset", data_files=str(p)))
    assert src.columns == ["prompt"]
    assert [r["prompt"] for r in collect(src, 4)] == [f"p{i}" for i in range(4, 9)]
    with pytest.raises(JobError, match="input.data_files: .* does not exist"):
        open_source(inp("json", format="dataset", data_files=str(tmp_path / "nope.jsonl")))
    with pytest.raises(JobError, match="needs data_files"):
        open_source(inp("json", format="dataset"))


def test_format_inference(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n')
    write_parquet(tmp_path / "b.bin", 3)  # no suffix: detected by its magic bytes
    assert infer_format(str(tmp_path / "a.jsonl")) == "jsonl"
    assert infer_format(str(tmp_path / "b.bin")) == "parquet"
    with pytest.raises(JobError, match="cannot tell the format"):
        infer_format(str(tmp_path / "missing-no-suffix"))
