"""GGUF checkpoints: a .gguf file (or a folder holding one) loads through transformers' GGUF support,
dequantized to the job's dtype, and gives the greedy tokens of the built-in model made from the same file;
architectures batchrun does not run get the one-line error."""

import logging

import numpy as np
import pytest
from click.testing import CliRunner
from test_job_fakes import write_job

from batchrun import LLM, SamplingParams
from batchrun.cli import main
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.builtin import BUILTIN_MODELS
from batchrun.model.weights.loader import load_config, resolve_path
from batchrun.model.weights.locate import locate_model

PROMPTS = ["The capital of France is", "Here is a short poem about the moon:",
           "<|im_start|>user\nHow do plants grow?<|im_end|>\n<|im_start|>assistant\n", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def gguf_file():
    return BUILTIN_MODELS["smollm2-135m-instruct"].locate("smollm2-135m-instruct")


def test_gguf_file_gives_the_builtins_greedy_tokens(gguf_file, smollm2, caplog):
    with caplog.at_level(logging.INFO, logger="batchrun"):
        llm = LLM(str(gguf_file), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert said and "Q4_1" in said[0] and "float32" in said[0] and "not at the quantized" in said[0]
    assert llm.eos_token_ids == smollm2.eos_token_ids == (2,)
    assert llm.tokenizer.chat_template == smollm2.tokenizer.chat_template
    greedy = SamplingParams(max_tokens=32, temperature=0)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in smollm2.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text and chat[0].outputs[0].finish_reason == "stop"


def test_a_folder_holding_one_gguf_file_resolves_to_it(gguf_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text("a model")
    (folder / gguf_file.name).symlink_to(gguf_file)
    assert resolve_path(str(folder)) == folder / gguf_file.name
    assert resolve_path(str(gguf_file)) == gguf_file
    assert locate_model(str(folder)).path == folder / gguf_file.name  # a job file may name it (no exit 2)
    assert locate_model(str(gguf_file)).kind == "gguf"
    (folder / "other.gguf").symlink_to(gguf_file)
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        resolve_path(str(folder))
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        locate_model(str(folder))
    with pytest.raises(ModelLoadError, match="is not a folder or a .gguf file"):
        resolve_path(str(folder / "README.md"))


def write_gguf(path, arch):
    """A minimal GGUF file of `arch`: the metadata transformers reads and one tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_token_types([1, 1, 1, 1])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_architectures_batchrun_does_not_run_get_one_line(tmp_path):
    tiny_llama = load_config(write_gguf(tmp_path / "tiny-llama.gguf", "llama"))
    assert tiny_llama.architectures == ["LlamaForCausalLM"] and tiny_llama.num_hidden_layers == 1
    phi3 = load_config(write_gguf(tmp_path / "phi3.gguf", "phi3"))  # a family of the registry's, by model_type
    assert phi3.architectures == ["Phi3ForCausalLM"]
    with pytest.raises(ModelLoadError, match=r"^unsupported architecture 'StableLmForCausalLM'; batchrun supports "
                                             r"Llama"):
        load_config(write_gguf(tmp_path / "stablelm.gguf", "stablelm"))
    with pytest.raises(ModelLoadError, match=r"cannot read GGUF file .*architecture mamba-x is not supported") as e:
        load_config(write_gguf(tmp_path / "mamba.gguf", "mamba-x"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unsupported architecture 'StableLmForCausalLM'"):
        LLM(str(tmp_path / "stablelm.gguf"), device="cpu")
    # in a job: the file passes the checks before the model loads; loading it is exit 2, one line
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    job = write_job(tmp_path / "job.yaml", model={"path": str(tmp_path / "stablelm.gguf")}, input={"path": str(src)},
                    output={"path": str(tmp_path / "out")})
    result = CliRunner().invoke(main, ["run", job, "-q"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "model.path: unsupported architecture 'StableLmForCausalLM'" in result.stderr
