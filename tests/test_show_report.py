"""Results you can look at: the run's time series in _metrics.json, `batchrun report` (a PNG of the stated
size), `batchrun show` (rows of an output folder or of a job array's shards), and progress tok/s counted as
tokens are generated."""

import io
import json
import struct
import sys

import pytest
from click.testing import CliRunner
from test_job_fakes import FakeLLM, read_rows, write_job

from batchrun.cli import main
from batchrun.config import load_job
from batchrun.job import plan_job, run_job
from batchrun.progress import Progress
from batchrun.timeseries import COLUMNS, MAX_POINTS, TimeSeries

N_ROWS = 24


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real run (builtin:tiny-llama) with a point every engine step, and its output rows."""
    tmp = tmp_path_factory.mktemp("series")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"The story {i} of the river"}) + "\n" for i in range(N_ROWS)))
    job = write_job(tmp / "job.yaml", input={"path": str(src)}, output={"path": str(tmp / "out"), "include_prompt": True},
                    sampling={"max_tokens": 12, "temperature": 0.0}, engine={"max_num_seqs": 8, "num_kv_blocks": 64})
    mp = pytest.MonkeyPatch()
    mp.setenv("BATCHRUN_SERIES_INTERVAL", "0")
    try:
        assert run_job(plan_job(load_job(job)), quiet=True).exit_code == 0
    finally:
        mp.undo()
    out = tmp / "out"
    return out, json.loads((out / "_metrics.json").read_text()), read_rows(out)


def test_metrics_keep_a_time_series_with_the_runs_counts(finished_run):
    _, metrics, rows = finished_run
    s = metrics["series"]
    n = len(s["t_s"])
    assert set(COLUMNS) <= set(s) and all(len(s[c]) == n for c in COLUMNS)
    assert n >= metrics["engine"]["num_steps"] // 2  # a point per step (interval 0), plus the last one
    assert s["t_s"] == sorted(s["t_s"]) and s["rows_done"] == sorted(s["rows_done"])
    assert s["generated_tokens"] == sorted(s["generated_tokens"])
    assert s["rows_done"][-1] == N_ROWS == len(rows)
    assert s["generated_tokens"][-1] == sum(r["completion_tokens"] for r in rows) == metrics["engine"]["generation_tokens"]
    assert max(s["running"]) == 8 and s["running"][-1] == 0 and s["kv_blocks_in_use"][-1] == 0
    assert 0 < max(s["kv_blocks_in_use"]) <= s["kv_blocks_total"] == 64
    assert max(s["waiting"]) > 0 and s["preemptions"][-1] == 0


def test_a_long_run_keeps_a_bounded_series():
    ts = TimeSeries(interval=1.0, start=0.0)
    for i in range(3 * MAX_POINTS):
        ts.maybe_sample(float(i), i, lambda i=i: {"generation_tokens": 10 * i})
    d = ts.as_dict()
    assert len(d["t_s"]) <= MAX_POINTS and d["interval_s"] >= 2.0 and d["t_s"] == sorted(d["t_s"])
    assert d["t_s"][0] == 0.0 and d["rows_done"][-1] > 3 * MAX_POINTS - 1 - d["interval_s"]
    assert all(tokens == 10 * rows for rows, tokens in zip(d["rows_done"], d["generated_tokens"]))
    end = ts.finish(3 * MAX_POINTS, {"generation_tokens": 1})  # the last point is the run's end
    assert end["rows_done"][-1] == 3 * MAX_POINTS and end["generated_tokens"][-1] == 1


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_draws_a_png_of_the_stated_size(finished_run, tmp_path):
    out, _, _ = finished_run
    dest = tmp_path / "run.png"
    result = CliRunner().invoke(main, ["report", str(out), "--out", str(dest), "--size", "640x480"])
    assert result.exit_code == 0, result.output
    assert f"wrote {dest} (640x480)" in result.stdout
    assert png_size(dest) == (640, 480)
    assert CliRunner().invoke(main, ["report", str(out)]).exit_code == 0
    assert png_size(out / "report.png") == (1200, 900)


def test_report_mistakes_are_one_line(finished_run, tmp_path, monkeypatch):
    out, _, _ = finished_run
    for args, words in [([str(tmp_path)], "has no _metrics.json"), ([str(out), "--size", "big"], "--size"),
                        ([str(tmp_path / "nope")], "not an output folder")]:
        result = CliRunner().invoke(main, ["report", *args])
        assert result.exit_code == 2 and words in result.stderr and result.stderr.count("\n") == 1, result.output
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    result = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "pip install 'batchrun[plot]'" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_show_prints_the_first_rows(finished_run):
    out, _, rows = finished_run
    result = CliRunner().invoke(main, ["show", str(out), "-n", "3"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["id", "|", "prompt", "|", "completion"] and set(lines[1]) <= {"-", "+"}
    assert "The story 2 of the river" in result.stdout and "The story 3 " not in result.stdout
    picked = CliRunner().invoke(main, ["show", str(out), "--columns", "id,finish_reason,completion_tokens"])
    assert picked.exit_code == 0 and picked.stdout.splitlines()[0].split() == [
        "id", "|", "finish_reason", "|", "completion_tokens"]
    assert len(picked.stdout.splitlines()) == 2 + 5  # header, rule, 5 rows (the default -n)
    bad = CliRunner().invoke(main, ["show", str(out), "--columns", "id,answer"])
    assert bad.exit_code == 2 and "no column 'answer'" in bad.stderr and "completion" in bad.stderr


def test_show_wraps_long_cells_and_reads_shards(tmp_path):
    from batchrun.show import format_table

    table = format_table([{"id": 1, "completion": "word " * 40}], ["id", "completion"], width=40)
    assert all(len(line) <= 40 for line in table.splitlines()) and len(table.splitlines()) > 4
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
                           + "\n" for i in range(6)))
    job = write_job(tmp_path / "job.yaml", input={"path": str(src), "messages_column": "messages",
                                                  "keep_columns": ["messages"]},
                    output={"path": str(tmp_path / "out")})
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"}
    for shard in ("0/2", "1/2"):
        assert CliRunner().invoke(main, ["run", job, "--shard", shard, "-q"], env=env).exit_code == 0
    result = CliRunner().invoke(main, ["show", str(tmp_path / "out"), "-n", "6"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["shard", "|", "id", "|", "messages", "|", "completion"]
    body = [line for line in lines[2:] if line.startswith("shard")]
    assert [line.split()[2] for line in body] == [f"r{i}" for i in range(6)]
    assert "shard-1-of-2" in body[3] and "question 3" in body[3]  # a conversation shows as its question
    empty = CliRunner().invoke(main, ["show", str(tmp_path)])
    assert empty.exit_code == 2 and "holds no committed rows" in empty.stderr
    # the report of a job array: one line per shard (the fake engine's tokens come from its finished rows)
    from batchrun.report import load_series

    series = load_series(tmp_path / "out")
    assert [label for label, _ in series] == ["shard-0-of-2", "shard-1-of-2"]
    assert [s["rows_done"][-1] for _, s in series] == [3, 3] and all(s["generated_tokens"][-1] > 0 for _, s in series)
    drawn = CliRunner().invoke(main, ["report", str(tmp_path / "out"), "--size", "400x300"])
    assert drawn.exit_code == 0, drawn.output
    assert png_size(tmp_path / "out" / "report.png") == (400, 300)


def test_progress_counts_tokens_as_they_are_generated():
    """No row has finished yet, but the engine has generated 500 tokens: the rate is not 0 tok/s."""
    engine = {"generation_tokens": 500, "num_running": 4, "num_waiting": 2, "num_swapped": 0,
              "kv_blocks_in_use": 10, "kv_blocks_total": 40}
    p = Progress(total=8, initial=0, quiet=False, metrics=lambda: engine, interval=0, stream=io.StringIO())
    p.t0 -= 10.0  # ten seconds in
    line = p.line()
    assert "0/8 rows" in line and " 50 tok/s" in line
    assert "running 4, waiting 2, swapped 0" in line and "KV cache 25% used" in line
    assert " 0 tok/s" in Progress(total=8, initial=0, quiet=False, metrics=dict, stream=io.StringIO()).line()
    assert isinstance(FakeLLM, type)


def test_show_reads_an_openai_batch_output(tmp_path):
    src = tmp_path / "batch.jsonl"
    reqs = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}},
            {"custom_id": "bad-2", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "x", "messages": "not a list"}}]
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    job = write_job(tmp_path / "job.yaml", input={"path": str(src)}, output={"path": str(tmp_path / "out")})
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"}
    assert CliRunner().invoke(main, ["run", job, "-q"], env=env).exit_code == 0
    result = CliRunner().invoke(main, ["show", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["custom_id", "|", "completion", "|", "error"]
    assert lines[2].startswith("chat-1") and " r" in lines[2]  # the fake engine's text
    assert any(line.startswith("bad-2") for line in lines) and "malformed" in result.stdout
