"""Job arrays, the Slurm recipe: every task of jobs/slurm_array.sh writes its shard, a complete shard is
skipped when the array is resubmitted, and `batchrun merge` gives the rows of an unsharded run, in order
(fake engine: this is about slicing and merging, not generation)."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
from click.testing import CliRunner
from test_job_fakes import REPO, cli_env, read_rows, write_job

from batchrun.cli import main

EXAMPLE_IDS = [f"p{i:03d}" for i in range(16)]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env={"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"})


def array_task(task, count, out, *extra):
    env = cli_env(fake=True, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT=str(count),
                  SLURM_ARRAY_TASK_MIN="0", BATCHRUN=f"{sys.executable} -m batchrun.cli")
    return subprocess.run(["bash", "jobs/slurm_array.sh", "jobs/example.yaml", "--set", f"output.path={out}",
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_slurm_array_skips_complete_shards_and_merges_in_order(tmp_path, monkeypatch):
    out = tmp_path / "out"
    for task in range(3):
        proc = array_task(task, 3, out)
        assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["shard-0-of-3", "shard-1-of-3", "shard-2-of-3"]
    again = array_task(1, 3, out)  # the array resubmitted: this task has nothing left to do
    assert again.returncode == 0 and "already complete" in again.stdout

    merged = cli("merge", out)
    assert merged.exit_code == 0, merged.output
    dest = tmp_path / "out-merged"
    assert f"merged 3 shards (16 rows, 0 row errors) into {dest}" in merged.stdout
    ref = tmp_path / "ref"
    monkeypatch.chdir(REPO)
    assert cli("run", "jobs/example.yaml", "--set", f"output.path={ref}", "--quiet").exit_code == 0
    rows = read_rows(dest)
    assert [r["id"] for r in rows] == EXAMPLE_IDS and rows == read_rows(ref)
    assert pq.read_table(out).to_pylist() == rows  # the documented one-liner reads the shards in order too
    metrics = json.loads((dest / "_metrics.json").read_text())
    assert metrics["output_rows"] == 16 and metrics["shards"] == 3 and (dest / "_SUCCESS").exists()
    assert cli("merge", out).exit_code == 0  # merging again replaces the earlier merge
    assert read_rows(dest) == rows


def test_merge_refuses_missing_or_incomplete_shards(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    for shard in ("0/3", "2/3"):
        assert cli("run", "jobs/example.yaml", "--set", f"output.path={out}", "--shard", shard, "-q").exit_code == 0
    missing = cli("merge", out)
    assert missing.exit_code == 2 and "shards of 3 missing: 1; rerun the array" in missing.stderr
    assert cli("run", "jobs/example.yaml", "--set", f"output.path={out}", "--shard", "1/3", "--limit", "2",
               "-q").exit_code == 0
    partial = cli("merge", out)
    assert partial.exit_code == 2 and "not complete: 1" in partial.stderr
    assert cli("run", "jobs/example.yaml", "--set", f"output.path={out}", "--shard", "1/4", "-q").exit_code == 0
    both = cli("merge", out)
    assert both.exit_code == 2 and "arrays of 3, 4 tasks; choose one with --shards N" in both.stderr
    inside = cli("merge", out, "--to", out / "all", "--shards", "4")
    assert inside.exit_code == 2 and "must be outside" in inside.stderr
    assert not (tmp_path / "out-merged").exists()


def test_merge_interleaves_strided_shards(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(11)))
    job = write_job(tmp_path / "job.yaml", input={"path": "json", "format": "dataset", "data_files": str(src)},
                    output={"path": str(tmp_path / "out")}, sampling={"max_tokens": 2})
    for i in range(3):
        assert cli("run", job, "--shard", f"{i}/3", "-q").exit_code == 0
    assert [r["id"] for r in read_rows(tmp_path / "out" / "shard-1-of-3")] == [1, 4, 7, 10]  # strided
    merged = cli("merge", tmp_path / "out", "--to", tmp_path / "all")
    assert merged.exit_code == 0, merged.output
    assert [r["id"] for r in read_rows(tmp_path / "all")] == list(range(11))


def test_merge_and_verify_openai_batch_shards(tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"hello {i}", "max_tokens": 3}} for i in range(7)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.jsonl"), "format": "openai-batch"},
                    output={"path": str(tmp_path / "out")})
    for i in range(2):
        assert cli("run", job, "--shard", f"{i}/2", "-q").exit_code == 0
    assert cli("verify", tmp_path / "out").exit_code == 0
    merged = cli("merge", tmp_path / "out")
    assert merged.exit_code == 0, merged.output
    got = (tmp_path / "out-merged" / "output.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in got] == [f"c{i}" for i in range(7)]
    result = cli("verify", tmp_path / "out-merged")
    assert result.exit_code == 0, result.output
