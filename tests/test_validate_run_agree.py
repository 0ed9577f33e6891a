"""`batchrun validate` and `batchrun run` accept exactly the same jobs, and LLM the same models and settings.

Over the whole bad-job corpus (tests/test_cli_bad_jobs.py) both commands give the same one line and exit 2,
and create nothing; LLM refuses the same model paths with the same words. A few good jobs (a built-in, a
local checkpoint folder, a Hub id in the local Hugging Face cache) are accepted by both, and run.
"""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from test_cli_bad_jobs import CASES, NEEDS_NO_CUDA, cuda_available, good_job, make_corpus
from test_job_fakes import REPO, TESTS_DIR, read_rows, write_job

from batchrun.cli import main
from batchrun.config import JobError, load_job
from batchrun.engine_args import EngineArgs, EngineArgsError, job_key
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.locate import locate_model


@pytest.fixture
def data(tmp_path):
    return make_corpus(tmp_path)


def tree(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


def verdicts(job: str, extra: list[str]) -> dict[str, tuple[int, str]]:
    out = {}
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, job, *extra])
        out[command] = (result.exit_code, result.stderr)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_validate_and_run_give_the_same_verdict(name, data, monkeypatch, tmp_path):
    make, extra, _ = CASES[name]
    if name in NEEDS_NO_CUDA and cuda_available():
        pytest.skip("this machine has CUDA")
    job = make(data)
    monkeypatch.setenv("BATCHRUN_LLM_FACTORY", "test_job_fakes:ExplodingLLM")
    monkeypatch.setenv("BATCHRUN_FAKE_MARKER", str(tmp_path / "constructed"))
    for var in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(var, raising=False)
    before = tree(data)
    got = verdicts(job, extra)
    assert got["validate"] == got["run"], got
    code, stderr = got["run"]
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("batchrun: error: "), got
    assert tree(data) == before, "a bad job created files"
    assert not (tmp_path / "constructed").exists()


# The cases about the model or the engine settings (the rest are about the input, output, shards, YAML).
LLM_CASES = ["wrong type", "missing model", "unknown builtin model", "model folder without config", "unknown device",
             "cuda without CUDA", "block size not a power of two", "max_model_len leaves no room",
             "config.json not JSON", "checkpoint without weights", "checkpoint with .bin weights",
             "sharded checkpoint missing a shard", "unsupported architecture", "gguf that is not GGUF",
             "folder of two ggufs", "max_model_len past the model's positions", "hub id not in the cache"]


@pytest.mark.parametrize("name", LLM_CASES)
def test_llm_refuses_the_same_models_with_the_same_words(name, data):
    """The job's one line is LLM's own error, with the key path in front: one check, not two."""
    make, extra, _ = CASES[name]
    if name in NEEDS_NO_CUDA and cuda_available():
        pytest.skip("this machine has CUDA")
    job = make(data)
    try:
        cfg = load_job(job, extra)
        model, kwargs = cfg.model["path"], cfg.llm_kwargs()
    except JobError:  # a value refused by its rule in the job file: LLM gets the raw value
        with open(job) as f:
            raw = yaml.safe_load(f)
        model = raw["model"]["path"]
        kwargs = {**{k: v for k, v in raw["model"].items() if k != "path"}, **raw.get("engine", {})}
    line = verdicts(job, extra)["validate"][1].strip().removeprefix("batchrun: error: ")
    from batchrun.llm import LLM

    with pytest.raises((ModelLoadError, EngineArgsError)) as e:
        LLM(model, **kwargs)
    if isinstance(e.value, EngineArgsError):
        assert line.endswith(f"{job_key(e.value.field)}: {e.value.problem}"), (line, str(e.value))
    else:
        assert line == f"model.path: {e.value}", (line, str(e.value))


def test_triton_without_cuda_is_refused_by_both(data, monkeypatch):
    if cuda_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("BATCHRUN_LLM_FACTORY", "test_job_fakes:ExplodingLLM")
    job = good_job(data, engine={"attention_backend": "triton"})
    got = verdicts(job, [])
    assert got["validate"] == got["run"] == (
        2, "batchrun: error: engine.attention_backend: triton needs a CUDA device (or TRITON_INTERPRET=1 for "
           "tests); use torch or auto on CPU\n")
    assert not (data / "out").exists()
    with pytest.raises(EngineArgsError, match="attention_backend: triton needs a CUDA device"):
        EngineArgs("builtin:tiny-llama", attention_backend="triton").check_environment()


# ---------------------------------------------------------------- good jobs: accepted by both, and they run


@pytest.fixture
def prompts(tmp_path):
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["The cat sits on the", "Once upon a", "Hello"]}),
                   tmp_path / "in.parquet")
    return tmp_path / "in.parquet"


def hub_cache(root, repo_id: str, checkpoint) -> str:
    """A Hugging Face cache holding `repo_id` at one snapshot, laid out as huggingface_hub lays it out."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in checkpoint.iterdir():
        os.symlink(f, snapshot / f.name)
    return str(snapshot)


def validate_then_run(job: str, out) -> list[dict]:
    got = CliRunner().invoke(main, ["validate", job])
    assert got.exit_code == 0 and got.stdout.startswith("ok: model "), got.output
    assert not out.exists(), "validate created the output folder"
    ran = CliRunner().invoke(main, ["run", job, "--limit", "1", "--quiet"])
    assert ran.exit_code == 0, (ran.output, ran.exception)
    rows = read_rows(out)
    assert len(rows) == 1 and rows[0]["error"] is None and rows[0]["completion_tokens"] >= 1
    return rows


ENGINE = {"max_num_seqs": 4, "num_kv_blocks": 32}


def test_a_builtin_model(tmp_path, prompts, monkeypatch):
    monkeypatch.delenv("BATCHRUN_LLM_FACTORY", raising=False)
    job = write_job(tmp_path / "job.yaml", input={"path": str(prompts)}, output={"path": str(tmp_path / "out")},
                    sampling={"max_tokens": 2}, engine=ENGINE)
    validate_then_run(job, tmp_path / "out")


def test_a_local_checkpoint_folder(tmp_path, prompts, tiny_llama_path, monkeypatch):
    monkeypatch.delenv("BATCHRUN_LLM_FACTORY", raising=False)
    job = write_job(tmp_path / "job.yaml", model={"path": str(tiny_llama_path)}, input={"path": str(prompts)},
                    output={"path": str(tmp_path / "out")}, sampling={"max_tokens": 2}, engine=ENGINE)
    validate_then_run(job, tmp_path / "out")


def test_a_hub_id_in_the_local_cache_runs_from_its_snapshot(tmp_path, prompts, tiny_llama_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = hub_cache(tmp_path / "hf", "batchrun-tests/tiny", tiny_llama_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("BATCHRUN_LLM_FACTORY", raising=False)
    located = locate_model("batchrun-tests/tiny")
    assert (located.kind, str(located.path), located.hub_id) == ("checkpoint", snapshot, "batchrun-tests/tiny")
    job = write_job(tmp_path / "job.yaml", model={"path": "batchrun-tests/tiny"}, input={"path": str(prompts)},
                    output={"path": str(tmp_path / "out")}, sampling={"max_tokens": 2}, engine=ENGINE)
    validate_then_run(job, tmp_path / "out")
    said = CliRunner().invoke(main, ["validate", job]).stdout
    assert said.startswith(f"ok: model batchrun-tests/tiny (from the Hugging Face cache: {snapshot}); input ")
    from batchrun.llm import LLM

    assert str(LLM("batchrun-tests/tiny", num_kv_blocks=8).model_path) == snapshot


def test_a_gguf_file_or_a_folder_holding_one_is_located(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.Q4.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for spec in (str(tmp_path / "m"), str(tmp_path / "m" / "model.Q4.gguf")):
        located = locate_model(spec)
        assert (located.kind, located.path, located.load_spec) == (
            "gguf", tmp_path / "m" / "model.Q4.gguf", str(tmp_path / "m" / "model.Q4.gguf"))
    assert locate_model("builtin:tiny-llama").load_spec == "builtin:tiny-llama"


def test_validate_imports_no_torch(tmp_path, prompts):
    """Checking a job stays light: no torch (nor transformers) is imported to validate a CPU job."""
    job = write_job(tmp_path / "job.yaml", input={"path": str(prompts)}, output={"path": str(tmp_path / "out")},
                    model={"device": "cpu"}, engine={"block_size": 32})
    code = ("import sys\nfrom batchrun.cli import main\ntry:\n    main(['validate', sys.argv[1]])\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\nassert not heavy, heavy\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}
    proc = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: model builtin:tiny-llama")
