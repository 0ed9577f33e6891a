"""The job file schema: defaults, key-path errors, --set, ${VAR} expansion (no model, no input needed)."""

import pytest

from batchrun.config import SAMPLING_DEFAULTS, JobError, parse_job, size_to_bytes
from batchrun.sampling_params import SamplingParams

BASE = """
model: {path: builtin:tiny-llama}
input: {path: data/prompts.parquet}
output: {path: out/x}
"""


def parse(extra: str = "", overrides=()):
    return parse_job(BASE + extra, source="job.yaml", overrides=overrides)


def error_of(extra: str = "", overrides=(), text: str | None = None) -> str:
    with pytest.raises(JobError) as e:
        if text is not None:
            parse_job(text, source="job.yaml", overrides=overrides)
        else:
            parse(extra, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults():
    cfg = parse()
    assert cfg.model == {"path": "builtin:tiny-llama", "tokenizer": None, "revision": None,
                         "tokenizer_revision": None, "trust_remote_code": False, "dtype": "auto",
                         "quantization": "none", "quantize_lm_head": False, "calibration": "none", "device": "auto",
                         "max_model_len": None}
    assert cfg.input["prompt_column"] == "prompt" and cfg.input["on_error"] == "record"
    assert cfg.input["keep_columns"] == [] and cfg.input["sampling_columns"] == {}
    assert cfg.engine["block_size"] == 16 and cfg.engine["preemption_mode"] == "auto"
    assert cfg.output["rows_per_part"] == 10000 and cfg.output["commit_interval_s"] == 60
    assert cfg.executor == {"kind": "local", "replicas": 1, "address": None, "num_gpus_per_replica": 0,
                            "num_cpus_per_replica": 1, "batch_size": 256}
    assert cfg.sampling == SAMPLING_DEFAULTS
    p = cfg.sampling_params()
    assert isinstance(p, SamplingParams) and p.max_tokens == 128 and p.temperature == 0.0
    kw = cfg.llm_kwargs()
    assert kw["max_num_seqs"] == 256 and kw["seed"] == 0 and kw["dtype"] == "auto"


def test_every_sampling_field_is_accepted():
    cfg = parse("sampling: {n: 2, temperature: 0.7, top_p: 0.9, top_k: 5, min_p: 0.1, repetition_penalty: 1.1,"
                " presence_penalty: 0.5, frequency_penalty: 0.5, max_tokens: 10, min_tokens: 1, stop: ['\\n'],"
                " stop_token_ids: [2], ignore_eos: true, seed: 3, logprobs: 2,"
                " include_stop_str_in_output: true, skip_special_tokens: false,"
                " structured_outputs: {choice: [a, b]}, prompt_logprobs: 1}")
    assert set(cfg.sampling) == set(SamplingParams.field_names())
    assert cfg.sampling_params().n == 2


@pytest.mark.parametrize("extra,expect", [
    ("modle: {path: x}", "modle: unknown section (did you mean model?)"),
    ("engine: {max_num_seq: 4}", "engine.max_num_seq: unknown key (did you mean max_num_seqs?)"),
    ("sampling: {max_token: 4}", "sampling.max_token: unknown key (did you mean max_tokens?)"),
    ("sampling: {max_tokens: -5}", "sampling.max_tokens: must be an integer >= 0"),
    ("sampling: {max_tokens: ten}", "sampling.max_tokens: expected an integer or null, got 'ten'"),
    ("sampling: {temperature: -1}", "sampling.temperature: must be >= 0"),
    ("sampling: {top_p: 0}", "sampling.top_p: must be in (0, 1]"),
    ("sampling: {stop: 5}", "sampling.stop: expected a string or a list of strings or null"),
    ("sampling: [1, 2]", "sampling: expected a mapping"),
    ("engine: {block_size: 0}", "engine.block_size: must be >= 1, got 0"),
    ("engine: {block_size: '16'}", "engine.block_size: expected an integer, got '16'"),
    ("engine: {enable_prefix_caching: yes please}", "engine.enable_prefix_caching: expected true or false"),
    ("engine: {preemption_mode: sometimes}", "engine.preemption_mode: must be one of auto, swap, recompute"),
    ("engine: {kv_cache_dtype: int4}", "engine.kv_cache_dtype: must be one of auto, int8"),
    ("engine: {kv_cache_memory: lots}", "engine.kv_cache_memory: expected a byte count or a size"),
    ("output: {path: out/x, rows_per_part: -1}", "output.rows_per_part: must be >= 1"),
    ("input: {path: x.parquet, keep_columns: text}", "input.keep_columns: expected a list of column names"),
    ("input: {path: x.parquet, on_error: ignore}", "input.on_error: must be one of record, skip, fail"),
    ("input: {path: x.parquet, format: csv}", "input.format: must be one of parquet, jsonl, dataset, openai-batch"),
    ("input: {path: x.parquet, sampling_columns: {max_token: b}}",
     "input.sampling_columns.max_token: not a SamplingParams field (did you mean max_tokens?)"),
    ("input: {path: x.parquet, prompt_column: p, messages_column: m}", "set either prompt_column or messages_column"),
    ("input: {path: x.parquet, keep_columns: [completion]}", "input.keep_columns: 'completion' clashes"),
    ("executor: {kind: ray, num_gpus_per_replica: -1}", "executor.num_gpus_per_replica: must be >= 0, got -1"),
    ("executor: {kind: ray, adress: auto}", "executor.adress: unknown key (did you mean address?)"),
    ("output: {path: out/x, commit_interval_s: 0}", "output.commit_interval_s: must be >= 0.1, got 0"),
    ("executor: {kind: slurm}", "executor.kind: must be one of local, ray"),
    ("model: {dtype: float16}", "model.path: required key is missing"),
])
def test_errors_name_the_key(extra, expect):
    # later sections replace the base ones (YAML: the last duplicate key wins)
    assert expect in error_of(extra)


def test_yaml_syntax_error_is_one_line_with_position():
    msg = error_of(text="model: {path: x\ninput: [")
    assert msg.startswith("job.yaml: invalid YAML (line")


@pytest.mark.parametrize("text,expect", [("", "the job file is empty"), ("- a\n- b\n", "must be a mapping")])
def test_not_a_mapping(text, expect):
    assert expect in error_of(text=text)


def test_set_overrides_parse_yaml_values():
    cfg = parse(overrides=["sampling.max_tokens=7", "sampling.stop=[a, b]", "engine.enable_prefix_caching=false",
                           "input.sampling_columns.max_tokens=budget", "model.max_model_len=null",
                           "output.path=elsewhere"])
    assert cfg.sampling["max_tokens"] == 7 and cfg.sampling["stop"] == ["a", "b"]
    assert cfg.engine["enable_prefix_caching"] is False
    assert cfg.input["sampling_columns"] == {"max_tokens": "budget"}
    assert cfg.output["path"] == "elsewhere"
    assert "sampling.max_tokens" in cfg.explicit


@pytest.mark.parametrize("item,expect", [
    ("sampling.max_tokenz=5", "--set sampling.max_tokenz=5: unknown key sampling.max_tokenz (did you mean max_tokens?)"),
    ("engin.block_size=4", "unknown section 'engin'"),
    ("engine=4", "name a key inside engine"),
    ("engine.block_size.x=4", "engine.block_size has no sub-keys"),
    ("no_equals_sign", "expected key.path=value"),
    ("sampling.max_tokens=[", "the value is not valid YAML"),
])
def test_set_unknown_keys(item, expect):
    assert expect in error_of(overrides=[item])


def test_set_value_is_validated():
    assert "sampling.max_tokens: must be an integer >= 0" in error_of(overrides=["sampling.max_tokens=-1"])


def test_env_expansion(monkeypatch):
    monkeypatch.setenv("BR_DATA", "/data/set")
    cfg = parse_job("model: {path: builtin:tiny-llama}\ninput: {path: '${BR_DATA}/p.parquet'}\n"
                    "output: {path: 'out/${BR_RUN:-default}'}\n")
    assert cfg.input["path"] == "/data/set/p.parquet" and cfg.output["path"] == "out/default"
    monkeypatch.delenv("BR_MISSING", raising=False)
    msg = error_of(text="model: {path: builtin:tiny-llama}\ninput: {path: '${BR_MISSING}/x'}\noutput: {path: o}\n")
    assert "input.path: environment variable BR_MISSING is not set" in msg


def test_env_expansion_applies_to_set_values(monkeypatch):
    monkeypatch.setenv("BR_OUT", "o2")
    assert parse(overrides=["output.path=${BR_OUT}"]).output["path"] == "o2"


def test_sizes():
    assert parse("engine: {kv_cache_memory: 512MiB, swap_space: 1GB}").engine["kv_cache_memory"] == "512MiB"
    assert size_to_bytes("512MiB") == 512 * 2**20 and size_to_bytes("1GB") == 10**9 and size_to_bytes(5) == 5


def test_model_and_engine_sections_are_engine_args_fields():
    """The job file declares no engine setting of its own: its model:/engine: keys, defaults and rules are
    EngineArgs' (seed, the one field without a key, comes from sampling.seed)."""
    from dataclasses import fields

    from batchrun.config import SCHEMA
    from batchrun.engine_args import EngineArgs, job_key

    keys = {f"{section}.{k}" for section in ("model", "engine") for k in SCHEMA[section]}
    assert keys == {job_key(f.name) for f in fields(EngineArgs)} - {None}
    assert job_key("seed") is None and job_key("model") == "model.path"
    cfg = parse("engine: {block_size: 32, swap_space: 1GiB}\nsampling: {seed: 7}")
    args = cfg.engine_args()
    assert args == EngineArgs("builtin:tiny-llama", block_size=32, swap_space="1GiB", seed=7)
    assert args.swap_space_bytes == 2**30 and args.kv_cache_bytes is None
    assert cfg.engine == {"block_size": 32, "kv_cache_memory": None, "num_kv_blocks": None, "kv_cache_dtype": "auto",
                          "gpu_memory_utilization": 0.9, "swap_space": "1GiB", "max_num_seqs": 256,
                          "max_num_batched_tokens": 4096, "preemption_mode": "auto", "enable_prefix_caching": True,
                          "attention_backend": "auto", "enforce_eager": False, "batch_invariant": None,
                          "num_speculative_tokens": 0, "speculative_max_rows": 128,
                          "num_threads": None, "grammar_compile_timeout_s": 30.0}
    assert parse("sampling: {seed: null}").llm_kwargs()["seed"] == 0


@pytest.mark.parametrize("extra,expect", [
    ("engine: {block_size: 12}", "job.yaml: engine.block_size: must be a power of two, got 12"),
    ("model: {path: builtin:tiny-llama, device: tpu}", "job.yaml: model.device: must be auto, cpu, cuda or cuda:N, "
                                                       "got 'tpu'"),
    ("model: {path: builtin:tiny-llama, device: 'cuda:x'}", "model.device: must be auto, cpu, cuda or cuda:N"),
    ("model: {path: builtin:tiny-llama, dtype: int8}", "model.dtype: must be one of auto, float32, float16, bfloat16"),
    ("model: {path: builtin:tiny-llama, max_model_len: 1}", "model.max_model_len: must be >= 2, got 1"),
    ("engine: {gpu_memory_utilization: 1.5}", "engine.gpu_memory_utilization: must be <= 1, got 1.5"),
    ("engine: {swap_space: -1}", "engine.swap_space: must be >= 0, got -1"),
    ("engine: {swap_space: null}", "engine.swap_space: must not be null"),
    ("engine: {enforce_eager: 1}", "engine.enforce_eager: expected true or false, got 1 (int)"),
    ("engine: {batch_invariant: yes please}", "engine.batch_invariant: expected true or false, got 'yes please' (str)"),
])
def test_engine_rules_name_the_key(extra, expect):
    assert expect in error_of(extra)


def test_engine_args_validate_themselves():
    from batchrun.engine_args import EngineArgs, EngineArgsError

    with pytest.raises(EngineArgsError, match=r"^block_size: must be a power of two, got 12$") as e:
        EngineArgs("m", block_size=12)
    assert (e.value.field, e.value.problem) == ("block_size", "must be a power of two, got 12")
    assert isinstance(e.value, ValueError)
    assert EngineArgs("m", dtype="bf16").dtype == "bfloat16" and EngineArgs("m", dtype="half").dtype == "float16"
    with pytest.raises(TypeError):
        EngineArgs("m", block_sise=16)
    with pytest.raises(EngineArgsError, match="model: must not be null"):
        EngineArgs(None)
