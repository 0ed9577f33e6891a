"""Killed jobs resume: SIGKILL after the first committed part, SIGTERM / SIGINT (exit 143 / 130), each rerun
giving every input id exactly once, in order, with the completions of an uninterrupted run; a 2-shard array,
merged, gives them too.

The job samples (temperature 0.8, top_p 0.9) and writes each token's log-prob, and rows are compared whole:
the text and every log-prob bit of a resumed (or sharded) run, whose rows ran in other batches than in the
uninterrupted one, are the uninterrupted run's. That holds because the engine is batch invariant (the
default in float32 on a CPU, tests/test_batch_invariance.py: the job sets model.device: cpu, so a machine with
a GPU runs it there too); with engine.batch_invariant: false the SIGKILL and SIGTERM resumes give other log-probs
(checked by hand when this was written)."""

import json
import os
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import batchrun_cmd, cli_env, read_rows, run_cli, write_job

from batchrun.cli import main

N_ROWS = 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    words = "the cat sits on a warm stone near the river while the old farmer reads a long letter".split()
    prompts = [" ".join(words[i % 7: i % 7 + 3 + i % 5]) for i in range(N_ROWS)]
    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(N_ROWS)], "prompt": prompts}), d / "in.parquet",
                   row_group_size=5)
    # model.device cpu: batch invariance is the CPU's promise (docs/reproducibility.md), not cuBLAS's on a GPU
    path = write_job(d / "job.yaml", model={"device": "cpu"}, input={"path": str(d / "in.parquet")},
                     sampling={"max_tokens": 3, "temperature": 0.8, "top_p": 0.9, "logprobs": 0},
                     engine={"max_num_seqs": 8, "num_kv_blocks": 64},
                     output={"path": str(d / "ref"), "rows_per_part": 4})
    proc = run_cli(["run", path])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d, path, read_rows(d / "ref")


def start_paced(job_path, out, delay, fake=None):
    env = cli_env(fake=fake, BATCHRUN_FAKE_DELAY=str(delay))
    env["BATCHRUN_LLM_FACTORY"] = "test_job_fakes:PacedLLM"
    return subprocess.Popen(batchrun_cmd() + ["run", job_path, "--set", f"output.path={out}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_first_part(proc, out, timeout=120):
    deadline = time.monotonic() + timeout
    while not (out / "part-00000.parquet").exists():
        assert proc.poll() is None, f"the run ended before committing a part: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "no part committed in time"
        time.sleep(0.01)


def resume_and_compare(job_path, out, ref_rows):
    proc = run_cli(["run", job_path, "--set", f"output.path={out}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming" in proc.stderr
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"r{i:03d}" for i in range(N_ROWS)]
    assert rows == ref_rows
    assert (out / "_SUCCESS").exists() and not list(out.glob(".*tmp"))
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["input_rows"] == N_ROWS and metrics["output_rows"] == N_ROWS
    assert metrics["this_run"]["input_rows"] < N_ROWS  # the rerun did only what was missing


def test_sigkill_after_first_part_then_resume(job):
    d, job_path, ref = job
    out = d / "killed"
    proc = start_paced(job_path, out, delay=0.3)
    wait_for_first_part(proc, out)
    proc.kill()
    proc.wait(timeout=30)
    assert not (out / "_SUCCESS").exists()
    committed = read_rows(out)
    assert 4 <= len(committed) < N_ROWS and committed == ref[:len(committed)]
    resume_and_compare(job_path, out, ref)


def test_two_shard_array_merged_gives_the_uninterrupted_rows(job):
    """Each shard runs its rows in its own batches (and its own process); merged, they are the single run's."""
    d, job_path, ref = job
    out = d / "array"
    for shard in ("0/2", "1/2"):
        proc = run_cli(["run", job_path, "--set", f"output.path={out}", "--shard", shard, "--quiet"])
        assert proc.returncode == 0, proc.stderr[-2000:]
    merged = run_cli(["merge", out])
    assert merged.returncode == 0, merged.stderr[-2000:]
    rows = read_rows(d / "array-merged")
    assert [r["id"] for r in rows] == [f"r{i:03d}" for i in range(N_ROWS)]
    assert rows == ref and all(r["logprobs"] for r in rows)


def test_sigterm_commits_finished_rows_exits_143_then_resumes(job):
    d, job_path, ref = job
    out = d / "terminated"
    proc = start_paced(job_path, out, delay=0.3)
    wait_for_first_part(proc, out)
    time.sleep(0.2)  # let a few more rows finish than the part holds
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["complete"] is False and not (out / "_SUCCESS").exists()
    committed = read_rows(out)
    assert metrics["input_rows"] == len(committed) and committed == ref[:len(committed)]
    resume_and_compare(job_path, out, ref)


def test_sigint_exits_130(job, tmp_path):
    d, job_path, _ = job
    out = tmp_path / "interrupted"
    proc = start_paced(job_path, out, delay=0.05, fake=True)
    wait_for_first_part(proc, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted by SIGINT" in err and "Traceback" not in err
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"r{i:03d}" for i in range(len(rows))]


def cli(args, **env):
    """In-process on the fake engine: these tests are about the runner, not the engine or the process."""
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM", **env}
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_changed_job_refuses_to_resume_unless_no_resume(job, tmp_path):
    d, job_path, _ = job
    out = tmp_path / "out"
    first = cli(["run", job_path, "--set", f"output.path={out}", "--limit", "6"])
    assert first.exit_code == 0, first.output
    assert "stopped at --limit 6" in first.stdout and not (out / "_SUCCESS").exists()
    assert len(read_rows(out)) == 6
    changed = cli(["run", job_path, "--set", f"output.path={out}", "--set", "sampling.max_tokens=2"])
    assert changed.exit_code == 2
    assert changed.stderr.count("\n") == 1 and "holds rows of a different job" in changed.stderr
    assert "sampling.max_tokens: 3 -> 2" in changed.stderr and "--no-resume" in changed.stderr
    fresh = cli(["run", job_path, "--set", f"output.path={out}", "--set", "sampling.max_tokens=2", "--no-resume"])
    assert fresh.exit_code == 0, fresh.output
    rows = read_rows(out)
    assert len(rows) == N_ROWS and all(r["completion_tokens"] <= 2 for r in rows)
    again = cli(["run", job_path, "--set", f"output.path={out}", "--set", "sampling.max_tokens=2"])
    assert again.exit_code == 0 and "already complete" in again.stdout


def test_a_change_of_weights_or_kv_format_refuses_to_resume_other_engine_settings_do_not(job, tmp_path):
    """Quantized weights or another KV cache format change the completions: the rest of the rows would come from
    another model, so a rerun is refused as for a changed sampling section. Batch sizes may change."""
    from batchrun.config import load_job
    from batchrun.plan import plan_job

    d, job_path, _ = job
    out = tmp_path / "out"
    first = cli(["run", job_path, "--set", f"output.path={out}", "--limit", "6"])
    assert first.exit_code == 0, first.output
    for setting, change in (("model.quantization=int8", "model.quantization: None -> 'int8'"),
                            ("model.quantize_lm_head=true", "model.quantize_lm_head: None -> True"),
                            ("engine.kv_cache_dtype=fp8_e4m3", "engine.kv_cache_dtype: None -> 'fp8_e4m3'")):
        changed = cli(["run", job_path, "--set", f"output.path={out}", "--set", setting])
        assert changed.exit_code == 2, (setting, changed.output)
        assert "holds rows of a different job" in changed.stderr and change in changed.stderr, changed.stderr
    resumed = cli(["run", job_path, "--set", f"output.path={out}", "--set", "engine.max_num_seqs=3"])
    assert resumed.exit_code == 0, resumed.output
    assert len(read_rows(out)) == N_ROWS
    # at their defaults the new settings are not in the fingerprint: outputs written before they were added resume
    plan = plan_job(load_job(job_path, [f"output.path={tmp_path / 'other'}"]))
    assert set(plan.output.fingerprint["model"]) == {"path", "dtype", "max_model_len"} and "engine" not in plan.output.fingerprint


def test_engine_failure_exits_1_keeps_committed_rows_and_resumes(job, tmp_path):
    d, job_path, _ = job
    out = tmp_path / "out"
    failed = cli(["run", job_path, "--set", f"output.path={out}"], BATCHRUN_FAKE_FAIL_AFTER="12")
    assert failed.exit_code == 1
    assert "RuntimeError: fake engine failure" in failed.stderr and "a rerun resumes" in failed.stderr
    committed = read_rows(out)
    assert committed and [r["id"] for r in committed] == [f"r{i:03d}" for i in range(len(committed))]
    ok = cli(["run", job_path, "--set", f"output.path={out}"])
    assert ok.exit_code == 0, ok.output
    assert [r["id"] for r in read_rows(out)] == [f"r{i:03d}" for i in range(N_ROWS)]


def test_no_temp_files_survive_and_parts_are_whole(job):
    d, _, ref = job
    for p in (d / "ref").iterdir():
        assert not p.name.startswith("."), p
    sizes = [pq.read_metadata(p).num_rows for p in sorted((d / "ref").glob("part-*.parquet"))]
    assert sizes == [4] * (N_ROWS // 4) and sum(sizes) == len(ref)
    assert os.path.exists(d / "ref" / "_job.json")
