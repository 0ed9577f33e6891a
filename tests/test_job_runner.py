"""The runner's logic on the fake engine, in-process: ordering, on_error, shards, --limit, progress."""

import io
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_job_fakes import FakeLLM, read_rows

from batchrun.config import JobError, parse_job
from batchrun.job import ShardSpec, plan_job, run_job
from batchrun.progress import Progress, engine_gauges


def make_input(d, n=40, bad=()):
    prompts = [None if i in bad else f"prompt number {i} " + "x" * (i % 9) for i in range(n)]
    pq.write_table(pa.table({"id": list(range(100, 100 + n)), "prompt": prompts}), d / "in.parquet",
                   row_group_size=7)
    return d / "in.parquet"


def job(d, extra="", out="out"):
    return parse_job(f"model: {{path: builtin:tiny-llama}}\ninput: {{path: {d / 'in.parquet'}}}\n"
                     f"output: {{path: {d / out}, rows_per_part: 6}}\nsampling: {{max_tokens: 6}}\n"
                     f"engine: {{max_num_seqs: 4}}\n" + extra)


def run(cfg, **kw):
    plan = plan_job(cfg, **{k: kw.pop(k) for k in ("shard", "limit", "resume") if k in kw})
    return run_job(plan, quiet=True, llm_factory=kw.pop("factory", FakeLLM), **kw)


def test_rows_come_out_in_input_order_in_parts(tmp_path):
    make_input(tmp_path)
    res = run(job(tmp_path))
    assert res.exit_code == 0 and "wrote 40 rows" in res.message
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == list(range(100, 140))
    sizes = [pq.read_metadata(p).num_rows for p in sorted((tmp_path / "out").glob("part-*.parquet"))]
    assert sizes == [6] * 6 + [4]


@pytest.mark.parametrize("on_error", ["record", "skip", "fail"])
def test_row_errors_under_each_on_error(tmp_path, on_error):
    make_input(tmp_path, bad={3, 17})
    cfg = job(tmp_path, extra=f"input: {{path: {tmp_path / 'in.parquet'}, on_error: {on_error}}}\n")
    res = run(cfg)
    rows = read_rows(tmp_path / "out")
    ids = [r["id"] for r in rows]
    metrics = json.loads((tmp_path / "out" / "_metrics.json").read_text())
    if on_error == "record":
        assert res.exit_code == 0 and ids == list(range(100, 140))
        errs = [r for r in rows if r["error"]]
        assert [r["id"] for r in errs] == [103, 117]
        assert all(r["finish_reason"] == "error" and r["error"] == "prompt is null" for r in errs)
        assert metrics["row_errors"] == 2 and metrics["output_rows"] == 40
    elif on_error == "skip":
        assert res.exit_code == 0 and ids == [i for i in range(100, 140) if i not in (103, 117)]
        assert all(r["error"] is None for r in rows)
        assert metrics["row_errors"] == 2 and metrics["input_rows"] == 40 and metrics["output_rows"] == 38
        assert (tmp_path / "out" / "_SUCCESS").exists()
    else:
        assert res.exit_code == 1
        assert "row 3 (id 103): prompt is null (input.on_error: fail)" in res.message
        assert ids == [100, 101, 102]  # everything before the bad row is committed
        assert not (tmp_path / "out" / "_SUCCESS").exists() and metrics["complete"] is False
        again = run(cfg)  # a rerun resumes and stops at the same row
        assert again.exit_code == 1 and [r["id"] for r in read_rows(tmp_path / "out")] == [100, 101, 102]


def test_prompt_too_long_is_a_row_error(tmp_path):
    pq.write_table(pa.table({"prompt": ["short", "y" * 300, "fine"]}), tmp_path / "in.parquet")
    res = run(job(tmp_path))
    rows = read_rows(tmp_path / "out")
    assert res.exit_code == 0 and [r["id"] for r in rows] == [0, 1, 2]
    assert rows[1]["error"].startswith("prompt too long") and rows[1]["prompt_tokens"] == 301


def test_shards_cover_the_input_exactly_once(tmp_path):
    make_input(tmp_path, n=23)
    cfg = job(tmp_path)
    for i in range(3):
        assert run(cfg, shard=ShardSpec(i, 3)).exit_code == 0
    dirs = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert dirs == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    per_shard = [[r["id"] for r in read_rows(tmp_path / "out" / d)] for d in dirs]
    assert [len(s) for s in per_shard] == [7, 8, 8]
    assert sum(per_shard, []) == list(range(100, 123))  # contiguous slices, in order
    res = run(cfg, shard=ShardSpec(1, 3))
    assert res.exit_code == 0 and "already complete" in res.message


def test_shard_auto_reads_slurm_variables():
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "3"}
    assert ShardSpec.parse("auto", env) == ShardSpec(2, 4)
    assert ShardSpec.parse("0/1", {}) == ShardSpec(0, 1) and ShardSpec.parse(None) is None
    assert ShardSpec(3, 12).dirname == "shard-03-of-12"
    for bad in ("2", "a/b", "-1/2", "2/2"):
        with pytest.raises(JobError):
            ShardSpec.parse(bad, {})


def test_strided_shards_when_the_row_count_is_unknown(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(11)))
    cfg = parse_job(f"model: {{path: builtin:tiny-llama}}\ninput: {{path: json, format: dataset, data_files: {src}}}\n"
                    f"output: {{path: {tmp_path / 'out'}}}\nsampling: {{max_tokens: 2}}\n")
    got = []
    for i in range(2):
        plan = plan_job(cfg, shard=ShardSpec(i, 2))
        assert plan.strided
        assert run_job(plan, quiet=True, llm_factory=FakeLLM).exit_code == 0
        got.append([r["id"] for r in read_rows(plan.out_dir)])
    assert got == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]


def test_limit_then_continue(tmp_path):
    make_input(tmp_path, n=20)
    cfg = job(tmp_path)
    res = run(cfg, limit=7)
    assert res.exit_code == 0 and "--limit 7" in res.message
    assert [r["id"] for r in read_rows(tmp_path / "out")] == list(range(100, 107))
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    assert run(cfg, limit=25).exit_code == 0  # a limit past the end completes the job
    assert [r["id"] for r in read_rows(tmp_path / "out")] == list(range(100, 120))
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_in_flight_is_bounded(tmp_path):
    make_input(tmp_path, n=200)
    seen = []

    def factory(model, **kw):
        llm = FakeLLM(model, **kw)
        seen.append(llm)
        return llm

    assert run(job(tmp_path), factory=factory).exit_code == 0
    assert 0 < seen[0].max_seen_in_flight <= 64  # max(2 * max_num_seqs, 64)


def test_progress_log_lines_and_bar(tmp_path, caplog):
    make_input(tmp_path, n=12)
    plan = plan_job(job(tmp_path))
    with caplog.at_level(logging.INFO, logger="batchrun"):
        assert run_job(plan, quiet=False, llm_factory=FakeLLM, progress_interval=0).exit_code == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert lines and "12/12 rows (100.0%)" in lines[-1] and "tok/s" in lines[-1]
    assert "KV" in lines[-1] and "running" in lines[-1]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress(total=10, initial=2, quiet=False, metrics=lambda: {"num_running": 3, "kv_blocks_in_use": 1, "kv_blocks_total": 2},
                 stream=tty)
    p.update(8, 100, 0)
    p.close()
    assert p.mode == "bar" and "10/10" in tty.getvalue()
    quiet = Progress(total=10, initial=0, quiet=True, metrics=dict)
    assert quiet.mode == "off"


def test_engine_gauges():
    g = engine_gauges({"kv_blocks_in_use": 5, "kv_blocks_total": 20, "num_running": 2, "num_waiting": 1})
    assert g == {"kv": 25.0, "running": 2, "waiting": 1}
    assert engine_gauges({}) == {}


def test_stop_ends_the_run_within_a_step_and_a_rerun_resumes(tmp_path):
    """run_job(stop=...) (batchrun serve's cancel and shutdown): the finished rows in order are committed,
    nothing after the stop is generated, the run is not complete, and a rerun answers the rest once."""
    import threading

    from batchrun.job import EXIT_STOPPED

    make_input(tmp_path)
    stop = threading.Event()
    engines = []

    class StoppingLLM(FakeLLM):
        def step(self):
            if self.steps == 30:
                stop.set()
            return super().step()

    def factory(model, **kwargs):
        engines.append(StoppingLLM(model, **kwargs))
        return engines[-1]

    cfg = job(tmp_path)
    res = run(cfg, factory=factory, stop=stop)
    assert res.exit_code == EXIT_STOPPED and "stopped" in res.message
    assert engines[0].steps == 31  # the step that was under way when stop was set, and no more
    committed = [r["id"] for r in read_rows(tmp_path / "out")]
    assert 0 < len(committed) < 40 and committed == list(range(100, 100 + len(committed)))
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    res = run(cfg)
    assert res.exit_code == 0 and [r["id"] for r in read_rows(tmp_path / "out")] == list(range(100, 140))
