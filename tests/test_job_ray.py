"""The Ray executor on a local Ray (2 CPUs, 2 replicas) and the real engine (builtin:tiny-llama): the same
rows as the local executor, in order, row errors included, sampled rows with the same text and log-probs; an
interrupted run resumed; without Ray, exit 2 with the install hint before any model is loaded."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import TESTS_DIR, batchrun_cmd, cli_env, read_rows, write_job

from batchrun.cli import main
from batchrun.config import load_job
from batchrun.job import ShardSpec, plan_job, run_job

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Ray's own, about its own settings
              pytest.mark.slow, pytest.mark.timeout(300)]

RAY = {"kind": "ray", "replicas": 2, "num_cpus_per_replica": 0.5, "batch_size": 4}
# one replica where their number is not what a test checks: each replica starts its own process and engine
RAY_ONE = {**RAY, "replicas": 1}
ENGINE = {"max_num_seqs": 8, "kv_cache_memory": "64MiB"}
# Ray's rows are compared with the local run's bit for bit, though the replicas batch them otherwise: batch invariance,
# the CPU's promise (docs/reproducibility.md), so the model runs on the CPU where there is a GPU too
MODEL = {"device": "cpu"}


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the in-process runs (a job joins a Ray that is already up, and leaves it up)."""
    ray = pytest.importorskip("ray")
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, saved) if p)  # replicas import test fakes
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    finally:
        os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
    yield ray
    ray.shutdown()
    for s, h in old.items():
        signal.signal(s, h)


def run_both(job_path, tmp_path):
    """The job on the local executor and on Ray, in-process; returns both output folders."""
    out = {}
    for kind in ("local", "ray"):
        out[kind] = tmp_path / kind
        cfg = load_job(job_path, [f"executor.kind={kind}", f"output.path={out[kind]}"])
        res = run_job(plan_job(cfg), quiet=True)
        assert res.exit_code == 0, res.message
    return out["local"], out["ray"]


def test_parquet_on_ray_gives_the_local_rows_in_order(ray_cluster, tmp_path):
    n = 22
    prompts = [f"Question {i}: tell me about the river and the old mill" for i in range(n)]
    prompts[3], prompts[10], prompts[17] = None, "", "word " * 3000  # null, empty, too long for the model
    pq.write_table(pa.table({"id": [f"q{i:02d}" for i in range(n)], "prompt": prompts,
                             "topic": [f"t{i % 3}" for i in range(n)]}), tmp_path / "in.parquet", row_group_size=6)
    job = write_job(tmp_path / "job.yaml", model=MODEL,
                    input={"path": str(tmp_path / "in.parquet"), "keep_columns": ["topic"]},
                    sampling={"max_tokens": 6, "temperature": 0.0}, engine=ENGINE, executor=RAY,
                    output={"path": "unused", "rows_per_part": 5, "include_prompt": True})
    local, ray_out = run_both(job, tmp_path)
    rows = read_rows(ray_out)
    assert [r["id"] for r in rows] == [f"q{i:02d}" for i in range(n)]
    assert rows == read_rows(local)
    assert pq.read_schema(next(ray_out.glob("part-*"))).remove_metadata() == \
        pq.read_schema(next(local.glob("part-*"))).remove_metadata()
    assert [r["error"] for r in rows if r["error"]][:2] == ["prompt is null", "prompt is empty"]
    assert rows[17]["finish_reason"] == "error" and "max_model_len" in rows[17]["error"]
    metrics = json.loads((ray_out / "_metrics.json").read_text())
    assert metrics["executor"] == {"kind": "ray", "replicas": 2} and 1 <= metrics["engine"]["replicas_used"] <= 2
    assert metrics["row_errors"] == 3 and metrics["output_rows"] == n and (ray_out / "_SUCCESS").exists()
    assert metrics["engine"]["num_requests_finished"] == n - 3


def test_a_score_job_on_ray_gives_the_local_rows(ray_cluster, tmp_path):
    """A pooling job whose rows pool two prompts each (the cosine of two embeddings): both requests of a row meet
    on its replica, and the rows come back in order, the same as locally (the pooled rows are batch invariant)."""
    n = 10
    pq.write_table(pa.table({"id": list(range(n)), "text_1": [f"the river by mill {i}" for i in range(n)],
                             "text_2": [f"an old mill on river {i % 3}" if i != 4 else None for i in range(n)]}),
                   tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", task="score", model=MODEL, sampling=None, engine=ENGINE, executor=RAY,
                    input={"path": str(tmp_path / "in.parquet")}, output={"path": "unused", "rows_per_part": 3})
    local, ray_out = run_both(job, tmp_path)
    rows = read_rows(ray_out)
    assert rows == read_rows(local) and [r["id"] for r in rows] == list(range(n))
    assert rows[4]["score"] is None and "text_2 is null" in rows[4]["error"]
    assert all(-1.0 <= r["score"] <= 1.0 for r in rows if r["error"] is None)


def test_jsonl_on_ray_keeps_bad_lines_and_per_row_seeds(ray_cluster, tmp_path):
    lines = [json.dumps({"id": i, "prompt": f"Once upon a time in village {i}"}) for i in range(9)]
    lines[4] = '{"id": 4, "prompt": "broken'  # a bad line is a row error, not a failed read
    lines.insert(6, "   ")  # blank lines are not rows
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n\n")
    job = write_job(tmp_path / "job.yaml", model=MODEL, input={"path": str(tmp_path / "in.jsonl")}, engine=ENGINE,
                    sampling={"max_tokens": 5, "temperature": 0.9, "top_p": 0.9, "seed": 7, "logprobs": 0},
                    executor=RAY_ONE,
                    output={"path": "unused"})
    local, ray_out = run_both(job, tmp_path)
    rows = read_rows(ray_out)
    # sampled, so the seeds (7 + row index) are the local ones; and every log-prob bit, though the replicas
    # batch the rows otherwise than the local engine (batch invariance)
    assert rows == read_rows(local) and all(r["logprobs"] for r in rows if r["error"] is None)
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7, 8] and rows[4]["id"] == 4
    assert rows[4]["error"].startswith("in.jsonl line 5: invalid JSON") and rows[5]["error"] is None


def test_saved_dataset_shard_on_ray_gives_the_local_rows(ray_cluster, tmp_path):
    import datasets

    msgs = [[{"role": "user", "content": f"Question {i}?"}] for i in range(9)]
    msgs[6] = [{"role": "user"}]  # malformed: no content
    datasets.Dataset.from_dict({"messages": msgs, "topic": list("abcdefghi")}).save_to_disk(str(tmp_path / "ds"))
    job = write_job(tmp_path / "job.yaml", model=MODEL, executor=RAY_ONE, engine=ENGINE, sampling={"max_tokens": 4},
                    input={"path": str(tmp_path / "ds"), "messages_column": "messages", "keep_columns": ["topic"]},
                    output={"path": "unused", "include_prompt": True})
    out = {}
    for kind in ("local", "ray"):
        cfg = load_job(job, [f"executor.kind={kind}", f"output.path={tmp_path / kind}"])
        plan = plan_job(cfg, shard=ShardSpec(1, 2))  # rows 4..8: Ray gets only this slice
        assert run_job(plan, quiet=True).exit_code == 0
        out[kind] = read_rows(plan.out_dir)
    assert out["ray"] == out["local"] and [r["id"] for r in out["ray"]] == [4, 5, 6, 7, 8]
    assert out["ray"][2]["error"].startswith("malformed messages") and "Question 5?" in out["ray"][1]["prompt"]


def test_interrupted_ray_run_resumes_without_redoing_committed_rows(ray_cluster, tmp_path):
    n = 24
    pq.write_table(pa.table({"id": list(range(n)), "prompt": [f"The farmer reads letter {i}" for i in range(n)]}),
                   tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", model=MODEL, input={"path": str(tmp_path / "in.parquet")}, engine=ENGINE,
                    sampling={"max_tokens": 4, "temperature": 0.8, "top_p": 0.9, "logprobs": 0}, executor=RAY_ONE,
                    output={"path": str(tmp_path / "out"), "rows_per_part": 4, "commit_interval_s": 3600})
    # (parts of 4 rows only: on a loaded machine the first row can take longer than the default commit interval)
    # A subprocess joining the module's Ray by address; each finished request waits 0.4 s (the BATCHRUN_*
    # variables travel to the replicas), so the run is cut half way.
    env = cli_env(fake=False, BATCHRUN_LLM_FACTORY="test_job_fakes:PacedLLM", BATCHRUN_FAKE_DELAY="0.4")
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.Popen(batchrun_cmd() + ["run", job, "--set", f"executor.address={address}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "part-00000.parquet").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no part committed in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in batchrun_lines(err)
    done = len(read_rows(tmp_path / "out"))
    assert 4 <= done < n and not (tmp_path / "out" / "_SUCCESS").exists()

    res = run_job(plan_job(load_job(job)), quiet=True)  # the rerun, on the module's Ray
    assert res.exit_code == 0, res.message
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == list(range(n))
    metrics = json.loads((tmp_path / "out" / "_metrics.json").read_text())
    assert metrics["this_run"]["input_rows"] == n - done
    assert metrics["engine"]["num_requests_finished"] == n - done, metrics  # committed rows: not generated again
    ref = tmp_path / "ref"
    cfg = load_job(job, ["executor.kind=local", f"output.path={ref}"])
    assert run_job(plan_job(cfg), quiet=True).exit_code == 0
    assert rows == read_rows(ref) and all(r["logprobs"] for r in rows)  # sampled: text and log-probs exact


def test_an_engine_failure_in_a_replica_exits_1_naming_it(ray_cluster, tmp_path, monkeypatch):
    from test_job_fakes import FakeLLM

    monkeypatch.setenv("BATCHRUN_FAKE_FAIL_AFTER", "5")  # BATCHRUN_* variables reach the replicas
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(12)]}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")}, executor=RAY_ONE,
                    output={"path": str(tmp_path / "out")})
    res = run_job(plan_job(load_job(job)), quiet=True, llm_factory=FakeLLM)  # the class travels to the replicas
    assert res.exit_code == 1
    assert res.message.startswith("RuntimeError: a Ray worker failed: RuntimeError: fake engine failure; ")
    assert "a rerun resumes" in res.message and not (tmp_path / "out" / "_SUCCESS").exists()


def test_without_ray_kind_ray_exits_2_with_the_install_hint(tmp_path, monkeypatch):
    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                    output={"path": str(tmp_path / "out")})
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    marker = tmp_path / "constructed"
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:ExplodingLLM", "BATCHRUN_FAKE_MARKER": str(marker)}
    for args in (["run", job, "--executor", "ray"], ["validate", job, "--set", "executor.kind=ray"]):
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and "pip install 'batchrun[ray]'" in result.stderr
        assert result.stderr.startswith("batchrun: error: executor.kind: ray needs Ray Data")
    assert not marker.exists() and not (tmp_path / "out").exists()
    ok = CliRunner().invoke(main, ["validate", job], env=env)  # the local executor does not need it
    assert ok.exit_code == 0, ok.output


RAY_WORKER_LINE = re.compile(r"^(\x1b\[\d+m)?\([^)]*pid=[^)]*\)")


def batchrun_lines(err: str) -> str:
    """The driver's own stderr: without the lines Ray forwards from its workers (`(Name pid=N) ...`), where Ray
    Data's own threads may log a traceback of theirs (its file-listing pool racing at shutdown)."""
    return "\n".join(line for line in err.splitlines() if not RAY_WORKER_LINE.match(line))
