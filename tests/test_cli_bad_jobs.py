"""The bad-job corpus: each exits 2 with one line on stderr, no traceback, before any model is constructed,
without creating the output folder."""

import functools
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import cli_env, run_cli, write_job

from batchrun.cli import main


@pytest.fixture
def data(tmp_path):
    return make_corpus(tmp_path)


def make_corpus(tmp_path):
    """The inputs and model folders the bad jobs point at."""
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), tmp_path / "in.parquet")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "pq" / "p.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really parquet")
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "batch.jsonl").write_text('{"custom_id": "a", "body": {"prompt": "hi"}}\n')
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "max_position_embeddings": 1024}
    for name, files in {
        "bad-json": {"config.json": '{"architectures": ["LlamaForCausalLM"],'},
        "no-weights": {"config.json": json.dumps(llama), "tokenizer.json": "{}", "tokenizer_config.json": "{}"},
        "short-context": {"config.json": json.dumps(llama), "model.safetensors": "x"},
        "bin-weights": {"config.json": json.dumps(llama), "pytorch_model.bin": "x"},
        "gpt2": {"config.json": json.dumps({"architectures": ["GPT2LMHeadModel"]}), "model.safetensors": "x"},
        "missing-shard": {"config.json": json.dumps(llama), "model-00001-of-00002.safetensors": "x",
                          "model.safetensors.index.json": json.dumps({"weight_map": {
                              "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})},
        "two-ggufs": {"a.gguf": "GGUF", "b.gguf": "GGUF"},
        "junk": {},
    }.items():
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    (tmp_path / "junk" / "junk.gguf").write_text("not a gguf file")
    return tmp_path


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def good_job(d, **sections):
    base = {"input": {"path": str(d / "in.parquet")}, "output": {"path": str(d / "out")}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) and k in base else v
    return write_job(d / "job.yaml", **base)


def raw_job(d, text):
    p = d / "job.yaml"
    p.write_text(text)
    return str(p)


CASES = {
    "yaml syntax": (lambda d: raw_job(d, "model: {path: builtin:tiny-llama\ninput: [\n"), [], "invalid YAML (line"),
    "unknown key": (lambda d: good_job(d, sampling={"max_tokenz": 3}), [],
                    "sampling.max_tokenz: unknown key (did you mean max_tokens?)"),
    "unknown section": (lambda d: good_job(d, engnie={"block_size": 8}), [], "engnie: unknown section"),
    "wrong type": (lambda d: good_job(d, engine={"max_num_seqs": "lots"}), [],
                   "engine.max_num_seqs: expected an integer, got 'lots' (str)"),
    "negative max_tokens": (lambda d: good_job(d, sampling={"max_tokens": -3}), [],
                            "sampling.max_tokens: must be an integer >= 0"),
    "missing input": (lambda d: good_job(d, input={"path": str(d / "nope.parquet")}), [],
                      "input.path: {d}/nope.parquet does not exist"),
    "unreadable parquet": (lambda d: good_job(d, input={"path": str(d / "bad.parquet")}), [],
                           "input.path: {d}/bad.parquet is not a readable Parquet file"),
    "missing prompt column": (lambda d: good_job(d, input={"prompt_column": "text"}), [],
                              "input.prompt_column: column 'text' not found in {d}/in.parquet (columns: id, prompt)"),
    "missing keep column": (lambda d: good_job(d, input={"keep_columns": ["lang"]}), [],
                            "input.keep_columns: column 'lang' not found"),
    "missing sampling column": (lambda d: good_job(d, input={"sampling_columns": {"max_tokens": "budget"}}), [],
                                "input.sampling_columns.max_tokens: column 'budget' not found"),
    "missing model": (lambda d: good_job(d, model={"path": str(d / "no-model")}), [],
                      "model.path: {d}/no-model does not exist"),
    "unknown builtin model": (lambda d: good_job(d, model={"path": "builtin:huge-llama"}), [],
                              "model.path: 'builtin:huge-llama' is not a built-in model"),
    "model folder without config": (lambda d: good_job(d, model={"path": str(d)}), [], "has no config.json"),
    "unwritable output": (lambda d: good_job(d, output={"path": str(d / "a_file" / "out")}), [],
                          "output.path: {d}/a_file/out cannot be created: {d}/a_file is not a folder"),
    "set unknown key": (lambda d: good_job(d), ["--set", "sampling.temprature=0.5"],
                        "--set sampling.temprature=0.5: unknown key sampling.temprature (did you mean temperature?)"),
    "set bad value": (lambda d: good_job(d), ["--set", "engine.block_size=-1"], "engine.block_size: must be >= 1"),
    "ray executor without replicas": (lambda d: good_job(d, executor={"kind": "ray", "replicas": 0}), [],
                                      "executor.replicas: must be >= 1, got 0"),
    "bad shard": (lambda d: good_job(d), ["--shard", "3/2"], "--shard 3/2: expected I/N with 0 <= I < N"),
    "shard auto outside slurm": (lambda d: good_job(d), ["--shard", "auto"], "--shard auto: not inside a job array"),
    "output inside the input folder": (lambda d: good_job(d, input={"path": str(d / "pq")},
                                                          output={"path": str(d / "pq" / "o")}),
                                       [], "output.path: {d}/pq/o is inside the input folder {d}/pq"),
    "openai-batch with columns": (lambda d: good_job(d, input={"path": str(d / "batch.jsonl"),
                                                               "keep_columns": ["x"]}), [],
                                  "input.keep_columns: not used with openai-batch input"),
    "missing job file": (lambda d: str(d / "missing.yaml"), [], "{d}/missing.yaml: cannot read the job file"),
    "unknown device": (lambda d: good_job(d, model={"device": "tpu"}), [],
                       "model.device: must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    "cuda without CUDA": (lambda d: good_job(d, model={"device": "cuda"}), [],
                          "model.device: cuda but CUDA is not available on this machine"),
    "unknown kv_cache_dtype": (lambda d: good_job(d, engine={"kv_cache_dtype": "int3"}), [],
                               "engine.kv_cache_dtype: must be one of auto, int8, fp8_e4m3, fp8_e5m2, got 'int3'"),
    "block size not a power of two": (lambda d: good_job(d, engine={"block_size": 12}), [],
                                      "job.yaml: engine.block_size: must be a power of two, got 12"),
    "set block size not a power of two": (lambda d: good_job(d), ["--set", "engine.block_size=48"],
                                          "engine.block_size: must be a power of two, got 48"),
    "max_model_len leaves no room": (lambda d: good_job(d, model={"max_model_len": 1}), [],
                                     "model.max_model_len: must be >= 2, got 1"),
    "config.json not JSON": (lambda d: good_job(d, model={"path": str(d / "bad-json")}), [],
                             "model.path: {d}/bad-json: config.json is not valid JSON (line 1"),
    "checkpoint without weights": (lambda d: good_job(d, model={"path": str(d / "no-weights")}), [],
                                   "model.path: {d}/no-weights has no weights: no model.safetensors"),
    "checkpoint with .bin weights": (lambda d: good_job(d, model={"path": str(d / "bin-weights")}), [],
                                     ".bin weights are not supported"),
    "sharded checkpoint missing a shard": (lambda d: good_job(d, model={"path": str(d / "missing-shard")}), [],
                                           "lists model-00002-of-00002.safetensors, which is missing"),
    "unsupported architecture": (lambda d: good_job(d, model={"path": str(d / "gpt2")}), [],
                                 "model.path: unsupported architecture 'GPT2LMHeadModel'; batchrun supports"),
    "gguf that is not GGUF": (lambda d: good_job(d, model={"path": str(d / "junk" / "junk.gguf")}), [],
                              "model.path: {d}/junk/junk.gguf is not a GGUF file"),
    "folder of two ggufs": (lambda d: good_job(d, model={"path": str(d / "two-ggufs")}), [],
                            "holds 2 .gguf files (a.gguf, b.gguf); name one of them"),
    "max_model_len past the model's positions": (
        lambda d: good_job(d, model={"path": str(d / "short-context"), "max_model_len": 4096}), [],
        "model.max_model_len: 4096 exceeds what the model supports (1024)"),
    "hub id not in the cache": (lambda d: good_job(d, model={"path": "batchrun-tests/no-such-model"}), [],
                                "model.path: batchrun-tests/no-such-model does not exist"),
}
NEEDS_NO_CUDA = {"cuda without CUDA"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_job_exits_2_in_one_line(name, data, monkeypatch, tmp_path):
    make, extra, expect = CASES[name]
    if name in NEEDS_NO_CUDA and cuda_available():
        pytest.skip("this machine has CUDA")
    job = make(data)
    marker = tmp_path / "constructed"
    monkeypatch.setenv("BATCHRUN_LLM_FACTORY", "test_job_fakes:ExplodingLLM")
    monkeypatch.setenv("BATCHRUN_FAKE_MARKER", str(marker))
    for var in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(var, raising=False)
    for command in ("run", "validate"):
        result = CliRunner().invoke(main, [command, job, *extra])
        assert result.exit_code == 2, (command, result.output, result.exception)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("batchrun: error: ")
        assert expect.format(d=data) in lines[0], lines[0]
        assert "Traceback" not in result.output
    assert not marker.exists(), "a model was constructed"
    assert not os.path.exists(data / "out") and not os.path.exists(data / "pq" / "o")


@pytest.mark.parametrize("name", ["yaml syntax", "unreadable parquet", "missing model"])
def test_bad_job_through_the_console_script(name, data, tmp_path):
    make, extra, expect = CASES[name]
    marker = tmp_path / "constructed"
    env = cli_env(fake=True, BATCHRUN_LLM_FACTORY="test_job_fakes:ExplodingLLM", BATCHRUN_FAKE_MARKER=str(marker))
    proc = run_cli(["run", make(data), *extra], env=env)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("batchrun: error: ")
    assert expect.format(d=data) in proc.stderr and proc.stdout == ""
    assert not marker.exists()


def test_messages_without_chat_template_is_a_bad_job(data, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"m": [[{"role": "user", "content": "x"}]]}).save_to_disk(str(data / "ds"))
    job = write_job(data / "job.yaml", input={"path": str(data / "ds"), "messages_column": "m"},
                    output={"path": str(data / "out")})
    monkeypatch.setenv("BATCHRUN_LLM_FACTORY", "test_job_fakes:FakeLLM")
    monkeypatch.setenv("BATCHRUN_FAKE_NO_TEMPLATE", "1")
    result = CliRunner().invoke(main, ["run", job, "--quiet"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "batchrun: error: input.messages_column: the tokenizer of builtin:tiny-llama has no chat template")
