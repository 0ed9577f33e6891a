"""No finished row thrown away: rows finished behind a slow earlier row are kept aside at a SIGTERM and at every
commit interval (`_ahead.parquet`, `_ahead.jsonl`), and the rerun computes only the rows that had not finished,
writing every row once, in input order, as an uninterrupted run does (fake engine: row 0 is slow)."""

import json
import os
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import FakeLLM, batchrun_cmd, cli_env, read_rows

from batchrun.cli import main
from batchrun.config import parse_job
from batchrun.job import plan_job, run_job

N_ROWS = 40


class SlowHeadLLM(FakeLLM):
    """Row 0 takes BATCHRUN_FAKE_HEAD_STEPS steps (default: 10**6), every other row 2; with
    BATCHRUN_FAKE_TERM_AT, the engine sends its own process SIGTERM at that step (a scheduler's warning)."""

    def request_steps(self, ids, params):
        head = int(os.environ.get("BATCHRUN_FAKE_HEAD_STEPS", 10**6))
        return head if self.tokenizer.decode(ids).startswith("<s>row 0 ") else 2

    def step(self):
        term_at = os.environ.get("BATCHRUN_FAKE_TERM_AT")
        if term_at and self.steps + 1 == int(term_at):
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step()


class Recorder:
    """An engine factory that notes which rows the engine was asked to compute."""

    def __init__(self, cls=FakeLLM):
        self.cls, self.rows = cls, []

    def __call__(self, model, **kw):
        engine = self.cls(model, **kw)
        add = engine.add_request

        def add_request(request_id, ids, params):
            self.rows.append(int(engine.tokenizer.decode(ids).split()[1]))
            add(request_id, ids, params)

        engine.add_request = add_request
        return engine


def write_input(d, fmt="parquet"):
    prompts = [f"row {i} says hello" for i in range(N_ROWS)]
    if fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(N_ROWS)), "prompt": prompts}), d / "in.parquet")
        return "{path: " + str(d / "in.parquet") + "}"
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": p, "max_tokens": 6}} for i, p in enumerate(prompts)]
    (d / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return "{path: " + str(d / "in.jsonl") + ", format: openai-batch}"


def cfg_for(d, inp, out, commit="60"):
    return parse_job(f"model: {{path: builtin:tiny-llama}}\ninput: {inp}\n"
                     f"output: {{path: {out}, rows_per_part: 8, commit_interval_s: {commit}}}\n"
                     "sampling: {max_tokens: 6}\nengine: {max_num_seqs: 8}\n")


def read_out(out):
    if (out / "output.jsonl").exists():
        return [json.loads(x)["response"]["body"]["choices"] for x in (out / "output.jsonl").read_text().splitlines()]
    return read_rows(out)


@pytest.mark.parametrize("fmt", ["parquet", "openai-batch"])
def test_sigterm_keeps_rows_finished_out_of_order(tmp_path, monkeypatch, fmt):
    inp = write_input(tmp_path, fmt)
    ref = tmp_path / "ref"
    assert run_job(plan_job(cfg_for(tmp_path, inp, ref)), quiet=True, llm_factory=FakeLLM).exit_code == 0
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHRUN_FAKE_TERM_AT", "12")
    first = Recorder(SlowHeadLLM)
    res = run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=first)
    assert res.exit_code == 143 and "interrupted by SIGTERM" in res.message
    assert not list(out.glob("part-*")) and res.counts["input_rows"] == 0  # row 0 never finished: none in order
    side = out / ("_ahead.jsonl" if fmt == "openai-batch" else "_ahead.parquet")
    assert side.exists()
    monkeypatch.delenv("BATCHRUN_FAKE_TERM_AT")
    second = Recorder()
    res = run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=second)
    assert res.exit_code == 0, res.message
    kept = set(range(N_ROWS)) - set(second.rows)
    assert 0 in second.rows and len(kept) >= 8  # the rows finished behind row 0 were not computed again
    assert not set(second.rows) & kept and sorted(second.rows) == sorted(set(second.rows))
    assert read_out(out) == read_out(ref) and not side.exists()
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    this_run = json.loads((out / "_metrics.json").read_text())["this_run"]
    assert this_run["input_rows"] == len(second.rows)  # the rows kept aside are not this run's work


def test_timed_commits_keep_rows_ahead_so_sigkill_loses_little(tmp_path):
    inp = write_input(tmp_path)
    ref = tmp_path / "ref"
    assert run_job(plan_job(cfg_for(tmp_path, inp, ref)), quiet=True, llm_factory=FakeLLM).exit_code == 0
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{path: builtin:tiny-llama}}\ninput: {inp}\noutput: {{path: {out}, rows_per_part: 8, "
                   "commit_interval_s: 0.2}\nsampling: {max_tokens: 6}\nengine: {max_num_seqs: 8}\n")
    env = cli_env(fake=True, BATCHRUN_FAKE_DELAY="0.05", BATCHRUN_LLM_FACTORY="test_rows_ahead:SlowHeadLLM")
    proc = subprocess.Popen(batchrun_cmd() + ["run", str(job), "-q"], env=env, stderr=subprocess.PIPE, text=True)
    side = out / "_ahead.parquet"
    deadline = time.monotonic() + 60
    while not side.exists() or pq.read_metadata(side).num_rows < 10:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "no rows kept aside in time"
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    kept = set(pq.read_table(side).column("id").to_pylist())
    assert len(kept) >= 10 and 0 not in kept
    second = Recorder()
    res = run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=second)
    assert res.exit_code == 0, res.message
    assert not set(second.rows) & kept and 0 in second.rows
    assert read_rows(out) == read_rows(ref) and not side.exists()


def test_a_part_committed_after_the_side_file_leaves_no_duplicate(tmp_path, monkeypatch):
    """Rows kept aside that a later commit put into a part (the run killed before the side file was written
    again) are not written twice."""
    inp = write_input(tmp_path)
    ref = tmp_path / "ref"
    assert run_job(plan_job(cfg_for(tmp_path, inp, ref)), quiet=True, llm_factory=FakeLLM).exit_code == 0
    out = tmp_path / "out"
    monkeypatch.setenv("BATCHRUN_FAKE_TERM_AT", "12")
    assert run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=SlowHeadLLM).exit_code == 143
    stale = (out / "_ahead.parquet").read_bytes()
    monkeypatch.delenv("BATCHRUN_FAKE_TERM_AT")
    assert run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=FakeLLM).exit_code == 0
    (out / "_ahead.parquet").write_bytes(stale)  # as if killed between the last part's commit and the side file's
    (out / "_SUCCESS").unlink()
    again = Recorder()
    assert run_job(plan_job(cfg_for(tmp_path, inp, out)), quiet=True, llm_factory=again).exit_code == 0
    assert again.rows == [] and read_rows(out) == read_rows(ref) and not (out / "_ahead.parquet").exists()


def test_verify_and_merge_see_rows_kept_aside(tmp_path, monkeypatch):
    inp = write_input(tmp_path)
    out = tmp_path / "arr"
    monkeypatch.setenv("BATCHRUN_FAKE_TERM_AT", "6")
    plan = plan_job(cfg_for(tmp_path, inp, out), shard=__import__("batchrun.shards").shards.ShardSpec(0, 2))
    assert run_job(plan, quiet=True, llm_factory=SlowHeadLLM).exit_code == 143
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1 and "are kept in _ahead.parquet" in result.stderr and "not complete" in result.stderr
    merged = CliRunner().invoke(main, ["merge", str(out)])
    assert merged.exit_code == 2 and "not complete: 0" in merged.stderr
