"""Bad input: a clear exception naming what is wrong, and nothing left behind in the engine."""

import json

import pytest

from batchrun import LLM, SamplingParams
from batchrun.model.weights.loader import ModelLoadError

BAD_FIELDS = [
    ("n", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("prompt_logprobs", -1),
    ("max_tokens", -1), ("min_tokens", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"),
    ("logprobs", -1), ("ignore_eos", "yes"), ("temperature", "hot"), ("max_tokens", 2.5),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), num_kv_blocks=64, max_model_len=256)


def test_empty_prompt_list(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], use_tqdm=False)


def test_over_long_prompt_names_its_index_and_leaves_nothing_behind(llm):
    prompts = [{"prompt_token_ids": [5] * 10}] * 3 + [{"prompt_token_ids": [5] * 300}]
    with pytest.raises(ValueError, match=r"prompts\[3\].*max_model_len"):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.engine.check_idle()
    assert llm.metrics()["num_steps"] == 0  # nothing ran
    assert len(llm.generate(prompts[:3], use_tqdm=False)) == 3


@pytest.mark.parametrize("bad", [{"prompt_token_ids": [1, "a"]}, {"prompt_token_ids": [10**9]}, 5, {"text": "x"}, [""]])
def test_malformed_prompts(llm, bad):
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm.generate(bad if isinstance(bad, list) else [bad], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sampling_params_list_length(llm):
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        LLM(str(tmp_path / "nope"))


def test_unknown_builtin():
    with pytest.raises(ModelLoadError, match="builtin:tiny-llama"):
        LLM("builtin:gigantic")


def test_unsupported_architecture(tmp_path, tiny_llama_path):
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(attention_backend="cuda"), "attention_backend"), (dict(num_kv_blocks=-1), "num_kv_blocks"),
])
def test_invalid_engine_arguments(tiny_llama_path, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama_path), **kw)


def test_invalid_beam_search_params():
    from batchrun import BeamSearchParams

    for kw, field in [(dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
                      (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature")]:
        with pytest.raises(ValueError, match=rf"BeamSearchParams\.{field}"):
            BeamSearchParams(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(device="tpu"), "device: must be auto, cpu, cuda or cuda:N"), (dict(dtype="int8"), "dtype: must be one of"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization: must be >= 0.01"),
    (dict(max_model_len=1), "max_model_len: must be >= 2"), (dict(swap_space="lots"), "swap_space"),
])
def test_invalid_engine_arguments_before_any_load(kw, match):
    """Checked before the model path is even looked at (the path here does not exist)."""
    with pytest.raises(ValueError, match=match):
        LLM("/no/such/model", **kw)


def test_cuda_without_cuda_before_any_load():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="device: cuda but CUDA is not available"):
        LLM("builtin:tiny-llama", device="cuda")


def test_checkpoint_without_weights_or_with_malformed_config(tmp_path, tiny_llama_path):
    for f in tiny_llama_path.iterdir():
        if not f.name.endswith(".safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelLoadError, match="has no weights: no model.safetensors"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{'not': json}")
    with pytest.raises(ModelLoadError, match=r"config.json is not valid JSON \(line 1, column 2"):
        LLM(str(tmp_path))


def test_llm_takes_engine_args_whole(llm, tiny_llama_path):
    from batchrun import EngineArgs

    args = EngineArgs(str(tiny_llama_path), num_kv_blocks=64, max_model_len=256)
    assert llm.args == args  # LLM(model, **kwargs) is EngineArgs(model, **kwargs)
    again = LLM.from_engine_args(args)
    assert again.args is args and again.max_model_len == llm.max_model_len == 256
    assert LLM(args, max_num_seqs=2).args.max_num_seqs == 2
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    assert (again.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    assert llm.check_prompt([]) == "empty prompt" and llm.check_prompt([1] * 300).startswith("prompt has 300")
