"""The shipped examples work: jobs/example.yaml validates, the Slurm array script runs a shard, and the
two-stage Makefile pipeline reruns stage two only when stage one's _SUCCESS is newer (fake engine)."""

import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from test_job_fakes import REPO, batchrun_cmd, cli_env, read_rows

from batchrun.cli import main


def test_example_job_validates(monkeypatch):
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, ["validate", "jobs/example.yaml"])
    assert result.exit_code == 0, result.output
    assert "jobs/data/questions.jsonl (jsonl, 16 rows)" in result.stdout


def test_slurm_array_script_runs_its_shard(tmp_path):
    env = cli_env(fake=True, SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_COUNT="2", SLURM_ARRAY_TASK_MIN="0",
                  BATCHRUN=f"{sys.executable} -m batchrun.cli")  # the script's own choice needs make setup
    proc = subprocess.run(["bash", "jobs/slurm_array.sh", "jobs/example.yaml", "--set",
                           f"output.path={tmp_path / 'out'}", "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path / "out") == ["shard-1-of-2"]
    assert [r["id"] for r in read_rows(tmp_path / "out" / "shard-1-of-2")] == [f"p{i:03d}" for i in range(8, 16)]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_two_stage_pipeline_reruns_stage_two_only_when_stage_one_is_newer(tmp_path):
    env = cli_env(fake=True, PIPELINE_OUT=str(tmp_path))
    batchrun = " ".join(batchrun_cmd()) if batchrun_cmd()[0] != sys.executable else f"{sys.executable} -m batchrun.cli"

    def make():
        proc = subprocess.run(["make", "-f", "jobs/pipeline.mk", f"BATCHRUN={batchrun}"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    s1, s2 = tmp_path / "answers" / "_SUCCESS", tmp_path / "followups" / "_SUCCESS"
    out = make()
    assert out.count(" run jobs/pipeline/stage") == 2 and s1.exists() and s2.exists()
    rows = read_rows(tmp_path / "followups")
    answers = read_rows(tmp_path / "answers")
    assert [r["id"] for r in rows] == [r["id"] for r in answers]
    assert [r["prompt"] for r in rows] == [r["completion"] for r in answers]

    assert " run " not in make()  # both up to date
    stamp = s2.stat().st_mtime_ns
    time.sleep(0.05)
    os.utime(s1)  # stage one is newer: stage two runs again, afresh
    out = make()
    assert "stage1.yaml" not in out and "run jobs/pipeline/stage2.yaml --no-resume" in out
    assert s2.stat().st_mtime_ns > stamp
