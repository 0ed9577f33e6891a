"""Rows that do not fit (input.on_too_long: error | truncate_left | truncate_right | skip) and
`batchrun run --retry-errors`: only the rows of a complete output whose error is set are computed again, in
place, once each and in order, every other row kept byte for byte; a kill during a retry leaves a whole
output (fake engine: max_model_len is the engine's, prompts are one token per byte)."""

import errno
import json
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import batchrun_cmd, cli_env, read_rows, write_job
from test_write_failures import FailingOs

from batchrun.cli import main
from batchrun.output import files

N_ROWS = 24
LONG = {3, 10, 11, 17}  # rows whose prompt is longer than max_model_len (64 tokens)
IDS = [f"r{i:02d}" for i in range(N_ROWS)]


def prompt(i):
    return ("a long prompt that goes on " * 4 + f"number {i}") if i in LONG else f"prompt number {i}"


def cli(*args, **env):
    return CliRunner().invoke(main, [str(a) for a in args],
                              env={"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM", **env})


@pytest.fixture
def job(tmp_path):
    pq.write_table(pa.table({"id": IDS, "prompt": [prompt(i) for i in range(N_ROWS)]}), tmp_path / "in.parquet")
    return write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                     model={"path": "builtin:tiny-llama", "max_model_len": 64}, sampling={"max_tokens": 8},
                     output={"path": str(tmp_path / "out"), "rows_per_part": 5, "include_token_ids": True})


def test_on_too_long_choices(job, tmp_path):
    byte_len = {i: len(prompt(i)) + 1 for i in range(N_ROWS)}  # one token per byte, and <s>
    for choice in ("error", "truncate_left", "truncate_right", "skip"):
        out = tmp_path / choice
        result = cli("run", job, "--set", f"output.path={out}", "--set", f"input.on_too_long={choice}")
        assert result.exit_code == 0, result.output
        rows = read_rows(out)
        assert [r["id"] for r in rows] == IDS
        for i, r in enumerate(rows):
            if i not in LONG:
                assert r["error"] is None and r["finish_reason"] in ("stop", "length")
                assert r.get("truncated_tokens", 0) == 0
            elif choice == "error":
                assert r["error"].startswith("prompt too long") and r["finish_reason"] == "error"
            elif choice == "skip":
                assert r["finish_reason"] == "skipped" and r["error"] is None and r["completion"] is None
                assert r["prompt_tokens"] == byte_len[i]
            else:  # cut to 64 - max_tokens 8 = 56 tokens, generated in full
                assert r["error"] is None and r["prompt_tokens"] == 56
                assert r["truncated_tokens"] == byte_len[i] - 56 and r["completion_tokens"] >= 1
        metrics = json.loads((out / "_metrics.json").read_text())
        assert metrics["row_errors"] == (len(LONG) if choice == "error" else 0)
    left, right = read_rows(tmp_path / "truncate_left"), read_rows(tmp_path / "truncate_right")
    assert all(left[i]["completion"] != right[i]["completion"] for i in LONG)  # different ends of the prompt kept
    changed = cli("run", job, "--set", f"output.path={tmp_path / 'error'}", "--set", "input.on_too_long=skip")
    assert changed.exit_code == 2 and "input.on_too_long: None -> 'skip'" in changed.stderr


def test_retry_errors_recomputes_only_error_rows_in_place(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    before = read_rows(out)
    assert {i for i, r in enumerate(before) if r["error"]} == LONG
    same = cli("run", job, "--retry-errors")  # nothing fixed: the rows fail again, nothing else moves
    assert same.exit_code == 0, same.output
    assert f"retried {len(LONG)} rows with an error in {out}: 0 now without, {len(LONG)} row errors left" in same.stdout
    assert read_rows(out) == before
    fixed = cli("run", job, "--retry-errors", "--set", "model.max_model_len=256")
    assert fixed.exit_code == 0, fixed.output
    assert f"{len(LONG)} now without, 0 row errors left" in fixed.stdout
    assert "the job changed since the output was written (model.max_model_len: 64 -> 256)" in fixed.stderr
    after = read_rows(out)
    assert [r["id"] for r in after] == IDS
    for i in range(N_ROWS):
        if i in LONG:
            assert after[i]["error"] is None and after[i]["completion_tokens"] >= 1
        else:
            assert after[i] == before[i]
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["row_errors"] == 0 and metrics["output_rows"] == N_ROWS and metrics["complete"] is True
    assert cli("verify", out).exit_code == 0
    assert "already complete" in cli("run", job, "--set", "model.max_model_len=256").stdout
    nothing = cli("run", job, "--retry-errors", "--set", "model.max_model_len=256")
    assert nothing.exit_code == 0 and "retried 0 rows" in nothing.stdout


def test_retry_errors_refusals(job, tmp_path):
    out = tmp_path / "out"
    none = cli("run", job, "--retry-errors")
    assert none.exit_code == 2 and "holds no output yet" in none.stderr
    assert cli("run", job, "--limit", "10").exit_code == 0
    partial = cli("run", job, "--retry-errors")
    assert partial.exit_code == 2 and "is not complete" in partial.stderr
    both = cli("run", job, "--retry-errors", "--no-resume")
    assert both.exit_code == 2 and "--retry-errors: not with --no-resume" in both.stderr
    assert len(read_rows(out)) == 10


def test_a_rewrite_cut_off_before_its_rename_leaves_the_old_part(job, tmp_path, monkeypatch):
    """The manifest names the new part with the old one as `previous`: the old file still reads as whole."""
    out = tmp_path / "out"
    assert cli("run", job).exit_code == 0
    before = read_rows(out)
    monkeypatch.setattr(files, "os", FailingOs("replace", "part-", errno.EIO))
    failed = cli("run", job, "--retry-errors", "--set", "model.max_model_len=256")
    monkeypatch.undo()
    assert failed.exit_code == 1 and "Input/output error (EIO)" in failed.stderr
    assert read_rows(out) == before
    manifest = json.loads((out / "_manifest.json").read_text())
    assert any("previous" in e for e in manifest["parts"].values())
    assert cli("verify", out).exit_code == 0
    done = cli("run", job, "--retry-errors", "--set", "model.max_model_len=256")
    assert done.exit_code == 0 and "0 row errors left" in done.stdout
    assert cli("verify", out).exit_code == 0


def test_sigkill_during_retry_leaves_a_whole_output(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job, "--set", "output.commit_interval_s=0.1").exit_code == 0
    before = read_rows(out)
    env = cli_env(fake=True, BATCHRUN_FAKE_DELAY="0.4")
    proc = subprocess.Popen(batchrun_cmd() + ["run", job, "--retry-errors", "--set", "model.max_model_len=256",
                                              "--set", "output.commit_interval_s=0.1", "--set",
                                              "engine.max_num_seqs=1", "-q"], env=env, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while sum(r["error"] is None for r in _rows_quietly(out)) == N_ROWS - len(LONG):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    mid = read_rows(out)
    fixed = [i for i in LONG if mid[i]["error"] is None]
    assert 1 <= len(fixed) < len(LONG)  # killed half way through the retry
    assert [r["id"] for r in mid] == IDS and all(mid[i] == before[i] for i in range(N_ROWS) if i not in LONG)
    checked = cli("verify", out)
    assert checked.exit_code == 0, checked.output  # whole at every moment
    done = cli("run", job, "--retry-errors", "--set", "model.max_model_len=256")
    assert done.exit_code == 0 and f"retried {len(LONG) - len(fixed)} rows" in done.stdout
    final = read_rows(out)
    assert all(final[i]["error"] is None for i in range(N_ROWS))
    assert all(final[i] == mid[i] for i in fixed) and all(final[i] == before[i] for i in range(N_ROWS)
                                                          if i not in LONG)


def _rows_quietly(out):
    try:
        return read_rows(out)
    except Exception:  # noqa: BLE001 - a part being renamed while read
        return []
