"""`batchrun serve` as a user runs it: the command (a subprocess) killed with SIGKILL mid-batch and started again
on the same state folder answers every request exactly once; the command's one-line errors (exit 2) before
any model loads; a batch past its completion window; finishing a batch twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from serve_helpers import chat_line, free_port, jsonl, raw_request, upload, wait
from test_job_fakes import batchrun_cmd, cli_env

from batchrun.config import load_engine_settings
from batchrun.serve import shapes
from batchrun.serve.checks import check_input
from batchrun.serve.finish import finish
from batchrun.serve.options import ServeOptions
from batchrun.serve.runner import BatchRunner
from batchrun.serve.store import StateStore, StoreError

KEY = "sk-restart"


def start(state, model, port, log):
    cmd = batchrun_cmd() + ["serve", "--model", str(model), "--port", str(port), "--state-dir", str(state),
                            "--commit-interval", "0.2", "--set", "engine.max_num_seqs=2",
                            "--set", "engine.kv_cache_memory=64MiB"]
    proc = subprocess.Popen(cmd, env=cli_env(fake=False, BATCHRUN_API_KEY=KEY), stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if raw_request("GET", f"http://127.0.0.1:{port}/v1/models", key=KEY)[0] == 200:
                return proc
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not start in 180 s"
        time.sleep(0.2)


def test_kill_9_mid_batch_then_restart_answers_every_request_once(tmp_path, tiny_llama_path):
    openai = pytest.importorskip("openai", reason="the openai SDK is a dev dependency (make setup installs it)")
    pytest.importorskip("fastapi", reason="batchrun[serve] is not installed (make setup installs it)")
    from batchrun import LLM
    from batchrun.sampling_params import SamplingParams

    state, port = tmp_path / "state", free_port()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    questions = [f"Question number {i}: what comes next?" for i in range(32)]
    lines = [chat_line(f"r{i}", q, max_tokens=64, ignore_eos=True, temperature=0) for i, q in enumerate(questions)]
    with open(tmp_path / "server.log", "wb") as log:
        first = start(state, tiny_llama_path, port, log)
        try:
            batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            wait(client, batch.id, until=lambda b: b.request_counts.completed >= 2)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(30)
        on_disk = json.loads((state / "batches" / batch.id / "batch.json").read_text())
        committed = json.loads((state / "batches" / batch.id / "job" / "_progress.json").read_text())["end"]
        assert on_disk["status"] == "in_progress" and 2 <= committed < 32, (on_disk["status"], committed)
        second = start(state, tiny_llama_path, port, log)
        try:
            batch = wait(client, batch.id, timeout=120)
            listed = client.batches.list()
        finally:
            second.send_signal(signal.SIGTERM)
            code = second.wait(60)
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), code
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts.model_dump() == {"total": 32, "completed": 32, "failed": 0}
    assert [b.id for b in listed.data] == [batch.id]
    out = [json.loads(x) for x in (state / "files" / batch.output_file_id).read_text().splitlines()]  # server gone
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(32)]
    said = (tmp_path / "server.log").read_text()  # the model loads at each start, never for a batch
    assert said.count("loading model") == 2, said
    assert f"batch {batch.id}: running 32 requests on the loaded model {tiny_llama_path}" in said, said
    assert f"batch {batch.id}: running {32 - committed} requests on the loaded model {tiny_llama_path} " \
           f"({committed} of 32 done before)" in said, said
    llm = LLM(str(tiny_llama_path), **load_engine_settings(
        str(tiny_llama_path), None, ["engine.kv_cache_memory=64MiB"]).engine_args().llm_kwargs())
    expected = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(max_tokens=64, ignore_eos=True, temperature=0), use_tqdm=False)
    assert [x["response"]["body"]["choices"][0]["message"]["content"] for x in out] == \
        [r.outputs[0].text for r in expected]


@pytest.mark.parametrize("args, words", [
    (["--set", "sampling.n=2"], "--set sampling.n=2: batchrun serve takes model.* and engine.* settings only"),
    (["--model", "m", "--set", "engine.block_size=3"], "engine.block_size: must be a power of two, got 3"),
    (["--model", "m", "--set", "engine.max_num_seq=3"], "unknown key engine.max_num_seq (did you mean max_num_seqs?)"),
    (["--model", "/nowhere/model"], "model.path: /nowhere/model does not exist"),
    ([], "--model: required"),
])
def test_bad_settings_are_one_line_and_exit_2(args, words):
    proc = subprocess.run(batchrun_cmd() + ["serve", *args], env=cli_env(fake=True), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_config_gives_the_model_and_engine_sections_only(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {path: builtin:tiny-llama}\nengine: {max_num_seqs: 7}\n"
                   "input: {path: nowhere.parquet}\noutput: {path: out}\nsampling: {max_tokens: 3}\n")
    settings = load_engine_settings(None, job, ["engine.block_size=32"])
    assert settings.model["path"] == "builtin:tiny-llama"
    assert (settings.engine["max_num_seqs"], settings.engine["block_size"]) == (7, 32)
    assert load_engine_settings("other", job).model["path"] == "other"  # --model wins
    job.write_text("engine: {kv_cache_memory: lots}\n")
    proc = subprocess.run(batchrun_cmd() + ["serve", "--config", str(job), "--model", "x"], env=cli_env(fake=True),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{job}: engine.kv_cache_memory: expected a byte count" in proc.stderr


def test_one_server_per_state_folder(tmp_path):
    store = StateStore(tmp_path).open()
    try:
        with pytest.raises(StoreError, match=f"in use by another batchrun serve \\(pid {os.getpid()}\\)"):
            StateStore(tmp_path).open()
    finally:
        store.close()
    StateStore(tmp_path).open().close()  # free again once closed


def new_batch(store: StateStore, lines: list, window_s: int = shapes.COMPLETION_WINDOW_S) -> str:
    import io

    file = store.save_upload(io.BytesIO(jsonl(lines)), filename="in.jsonl", purpose="batch", max_bytes=10**6,
                             max_lines=100)
    record = shapes.batch_object(shapes.new_batch_id(), input_file_id=file["id"], endpoint="/v1/chat/completions",
                                 metadata=None, model="m", created_at=shapes.now(), window_s=window_s)
    return store.create_batch(record)["id"]


def test_a_batch_past_its_window_expires_with_every_request_in_the_error_file(tmp_path):
    store = StateStore(tmp_path).open()
    try:
        runner = BatchRunner(store, load_engine_settings("builtin:tiny-llama"), engine=None, options=ServeOptions())
        batch_id = new_batch(store, [chat_line("a", "hi"), "not json", chat_line("b", "hi")], window_s=0)
        assert runner._check_next() and store.batch(batch_id)["status"] == "in_progress"
        assert runner._run_next()  # the window is over before it could start: no engine needed
        record = store.batch(batch_id)
        assert record["status"] == "expired" and record["expired_at"] and record["output_file_id"] is None
        errors = [json.loads(x) for x in store.file_path(record["error_file_id"]).read_text().splitlines()]
        assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
            ("a", "batch_expired"), (None, "batch_expired"), ("b", "batch_expired")]
        assert record["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    finally:
        store.close()


def test_finishing_again_after_a_crash_rewrites_the_same_files(tmp_path):
    store = StateStore(tmp_path).open()
    try:
        batch_id = new_batch(store, [chat_line("a", "hi"), chat_line("b", "hi")])
        check_input(store.input_path(batch_id), "/v1/chat/completions").save(store.checks_path(batch_id))
        first = finish(store, batch_id, "cancelled")
        files = {f["id"] for f in store.files()}
        assert finish(store, batch_id, "cancelled") == first and {f["id"] for f in store.files()} == files
        assert len(store.file_path(first["error_file_id"]).read_text().splitlines()) == 2
    finally:
        store.close()
    reopened = StateStore(tmp_path).open()  # and a restarted server sees the same records
    try:
        assert {f["id"] for f in reopened.files()} == files and reopened.batch(batch_id)["status"] == "validating"
    finally:
        reopened.close()


def test_a_stopped_runner_leaves_its_batch_in_progress_and_the_next_one_finishes_it(tmp_path, tiny_llama_path):
    """What SIGTERM does to a server (uvicorn's shutdown stops the runner): the running batch commits its
    finished lines and stays in_progress; a new runner on the same folder and engine answers the rest."""
    from batchrun import LLM
    from batchrun.serve.finish import progress

    settings = load_engine_settings(str(tiny_llama_path), None, ["engine.kv_cache_memory=64MiB",
                                                                 "engine.max_num_seqs=2"])
    engine = LLM(settings.model["path"], **settings.engine_args().llm_kwargs())
    store = StateStore(tmp_path).open()
    options = ServeOptions(commit_interval_s=0.1)
    lines = [chat_line(f"s{i}", f"stop test {i}", max_tokens=64, ignore_eos=True, temperature=0) for i in range(24)]
    try:
        batch_id = new_batch(store, lines)
        runner = BatchRunner(store, settings, engine, options)
        runner.start()
        deadline = time.monotonic() + 60
        while (progress(store.job_dir(batch_id)) or {}).get("end", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        runner.stop()
        committed = progress(store.job_dir(batch_id))["end"]
        assert store.batch(batch_id)["status"] == "in_progress" and 2 <= committed < 24
        runner = BatchRunner(store, settings, engine, options)
        runner.start()
        while store.batch(batch_id)["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runner.stop()
        record = store.batch(batch_id)
        out = [json.loads(x) for x in store.file_path(record["output_file_id"]).read_text().splitlines()]
        assert [x["custom_id"] for x in out] == [f"s{i}" for i in range(24)]
        assert record["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    finally:
        store.close()
