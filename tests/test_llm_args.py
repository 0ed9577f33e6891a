"""LLM's constructor arguments (batchrun/llm_args.py): vLLM's, each honoured, accepted where its value changes nothing
here, or refused in one line naming it, before anything loads; the settings behind the honoured ones (another
tokenizer, a Hub id's revision from the local cache, trust_remote_code given to transformers) through check_args, a
job file and a loaded model; get_tokenizer; the `vllm` tree (batchrun/vllm_compat.py) and the page that lists both."""

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from transformers import AutoTokenizer

import batchrun.vllm_compat as vllm_compat
from batchrun import LLM, LoRARequest, SamplingParams, TextPrompt, TokensPrompt
from batchrun.cli import main
from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.llm_args import ANY, INERT, RENAMED, SHARED, engine_args, settings
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights import loader
from batchrun.model.weights.loader import get_tokenizer
from batchrun.model.weights.locate import check_args

REPO = Path(__file__).resolve().parent.parent
FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}
SMALL = dict(dtype="float32", device="cpu", num_kv_blocks=32)


# ---- the table ---------------------------------------------------------------------------------------------------

def test_the_table_is_consistent_with_engine_args():
    assert set(SHARED) <= FIELDS
    assert set(RENAMED.values()) <= FIELDS and not set(RENAMED) & FIELDS
    assert not set(INERT) & FIELDS  # an inert argument never shadows a setting


def _refused_value(inert):
    return next(v for v in (2, True, False, "something-else", {"x": 1}, [0], 4.5) if not inert.accepts(v))


@pytest.mark.parametrize("name", sorted(INERT))
def test_each_inert_argument_is_accepted_or_refused_in_one_line(name):
    inert = INERT[name]
    if inert.accepted is ANY:
        for value in (None, 0, 7, True, "x", {"a": 1}):
            assert settings({name: value}) == {}
        return
    for value in inert.accepted:
        assert settings({name: value}) == {}
    bad = _refused_value(inert)
    with pytest.raises(EngineArgsError) as e:
        settings({name: bad})
    assert e.value.field == name and inert.why in str(e.value) and "\n" not in str(e.value)


def test_true_is_not_one_and_one_float_is():
    with pytest.raises(EngineArgsError, match="tensor_parallel_size: True is not supported"):
        settings({"tensor_parallel_size": True})
    assert settings({"tensor_parallel_size": 1.0, "cpu_offload_gb": 0.0}) == {}


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tensor_parallel_size=2), "tensor_parallel_size: 2 is not supported: one engine per process here; for more "
                                   "replicas use executor: ray (docs/cluster.md)"),
    (dict(enable_lora=True), "enable_lora: True is not supported: LoRA adapters are not supported yet"),
    (dict(skip_tokenizer_init=True), "skip_tokenizer_init: True is not supported: batchrun needs the tokenizer"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb: 4 is not supported: the weights stay on the device"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode: 'mistral' is not supported"),
    (dict(logits_processors=[print]), "logits_processors: "),
    (dict(tensor_paralel_size=1), "tensor_paralel_size: LLM() got an unexpected keyword argument: neither a batchrun "
                                  "setting nor one of vLLM's it knows; did you mean 'tensor_parallel_size'?"),
    (dict(frobnicate=1), "frobnicate: LLM() got an unexpected keyword argument"),
    (dict(kv_cache_memory_bytes=2**20, kv_cache_memory="1MiB"), "kv_cache_memory_bytes: give kv_cache_memory_bytes "
                                                                "or kv_cache_memory, not both"),
    (dict(dtype="float64"), "dtype: must be one of auto, float32, float16, bfloat16"),
])
def test_refused_before_anything_loads(tmp_path, kwargs, message):
    """The argument is named, not the model path (which does not exist): nothing was looked at before it."""
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path / "no-model"), **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_none_takes_the_default():
    given = dict(max_num_seqs=None, max_num_batched_tokens=None, quantization=None, swap_space=None, seed=None,
                 block_size=None, enable_prefix_caching=None, enforce_eager=None, max_model_len=None, dtype=None,
                 kv_cache_memory_bytes=None, gpu_memory_utilization=None, tokenizer=None, revision=None)
    assert engine_args("m", given) == EngineArgs("m")


def test_vllm_spellings_and_units():
    import torch

    assert engine_args("m", dict(dtype="float")).dtype == "float32"
    assert engine_args("m", dict(dtype="half")).dtype == "float16"
    assert engine_args("m", dict(dtype=torch.bfloat16)).dtype == "bfloat16"
    assert engine_args("m", dict(kv_cache_dtype="fp8")).kv_cache_dtype == "fp8_e4m3"
    assert engine_args("m", dict(kv_cache_memory_bytes=2**26)).kv_cache_memory == 2**26
    # swap_space: vLLM's GiB below 1024, batchrun's bytes and sizes otherwise
    assert engine_args("m", dict(swap_space=4)).swap_space_bytes == 4 * 2**30
    assert engine_args("m", dict(swap_space=0.5)).swap_space_bytes == 2**29
    assert engine_args("m", dict(swap_space=2**20)).swap_space_bytes == 2**20
    assert engine_args("m", dict(swap_space="8GiB")).swap_space_bytes == 8 * 2**30
    assert engine_args("m", dict(swap_space=0)).swap_space_bytes == 0
    with pytest.raises(EngineArgsError, match="swap_space: 4 bytes hold no KV block: give a size like '4GiB'"):
        EngineArgs("m", swap_space=4)  # the job file's and EngineArgs' unit is bytes: a count this small is a mistake
    # LLM(EngineArgs(...), **kwargs) changes the settings given whole by the same rules
    assert engine_args(EngineArgs("m", block_size=32), dict(max_num_seqs=None, swap_space=1)) == \
        EngineArgs("m", block_size=32, swap_space=2**30)


def test_vllm_arguments_reach_the_engine(tiny_llama_path):
    """A construction as a vLLM client writes it: swap_space in GiB sizes the host pool, kv_cache_memory_bytes the
    device pool; llm_engine and get_tokenizer answer what clients read."""
    import torch

    llm = LLM(model=str(tiny_llama_path), tensor_parallel_size=1, dtype="float", max_model_len=200, seed=1234,
              gpu_memory_utilization=0.9, swap_space=0.001, kv_cache_memory_bytes=2**22, max_num_seqs=None,
              quantization=None, enable_lora=False, max_lora_rank=16, tokenizer_mode="auto", trust_remote_code=False,
              revision=None, tokenizer=None, tokenizer_revision=None, skip_tokenizer_init=False, device="cpu",
              enforce_eager=True, disable_log_stats=True)
    m = llm.metrics()
    block_bytes = m["kv_bytes_per_token"] * llm.args.block_size
    assert m["kv_host_blocks_total"] == int(0.001 * 2**30) // block_bytes > 0
    assert m["kv_blocks_total"] == 2**22 // block_bytes
    config = llm.llm_engine.model_config
    assert (config.model, config.tokenizer, config.max_model_len, config.dtype, config.seed) == \
        (str(tiny_llama_path), str(tiny_llama_path), 200, torch.float32, 1234)
    assert config.quantization is None and config.hf_config.architectures == ["LlamaForCausalLM"]
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer is llm.tokenizer
    prompt = llm.get_tokenizer()("The river").input_ids
    plain = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False, lora_request=None)[0]
    older = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)[0]
    text = llm.generate(TextPrompt(prompt="The river"), SamplingParams(max_tokens=4, temperature=0),
                        use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == older.outputs[0].token_ids == text.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"^lora_request: LoRA adapters are not supported yet \('ft'\)"):
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], lora_request=LoRARequest("ft", 1, "/adapters/ft"))
    with pytest.raises(ValueError, match="^lora_request: LoRA adapters are not supported yet"):
        llm.chat([{"role": "user", "content": "hi"}], lora_request=LoRARequest("ft", 1, "/adapters/ft"))
    with pytest.raises(ValueError, match=r"^prompts\[0\]: multi_modal_data is not supported: batchrun runs text-only"):
        llm.generate([{"prompt": "look", "multi_modal_data": {"image": object()}}])
    with pytest.raises(ValueError, match="give prompts or prompt_token_ids, not both"):
        llm.generate(["x"], prompt_token_ids=[prompt])


# ---- where the model and its tokenizer come from ---------------------------------------------------------------------

MAIN, OLD = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch, make_ckpt):
    """A local Hugging Face cache holding acme/tiny at two commits: main (the llama checkpoint) and tag v0 (qwen2)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(make_ckpt("llama"), repo / "snapshots" / MAIN)
    shutil.copytree(make_ckpt("qwen2"), repo / "snapshots" / OLD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v0").write_text(OLD)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return "acme/tiny"


def test_revision_picks_the_snapshot(hub, tiny_llama_path):
    assert check_args(EngineArgs(hub)).path.name == MAIN
    assert check_args(EngineArgs(hub, revision="v0")).path.name == OLD
    assert check_args(EngineArgs(hub, revision=OLD)).path.name == OLD
    with pytest.raises(EngineArgsError, match=r"^revision: acme/tiny is in the local Hugging Face cache, but not at "
                                              r"revision 'v9' \(batchrun downloads nothing\)$"):
        check_args(EngineArgs(hub, revision="v9"))
    with pytest.raises(EngineArgsError, match="^revision: 'v0' names a snapshot of a Hub id, and .* is a local path"):
        check_args(EngineArgs(str(tiny_llama_path), revision="v0"))
    with pytest.raises(EngineArgsError, match="^revision: 'v0' names a snapshot of a Hub id, and builtin:tiny-llama "
                                              "is a built-in model"):
        check_args(EngineArgs("builtin:tiny-llama", revision="v0"))
    with pytest.raises(ModelLoadError, match="acme/other does not exist"):
        check_args(EngineArgs("acme/other", revision="v0"))
    llm = LLM(hub, revision="v0", **SMALL)
    assert llm.config.architectures == ["Qwen2ForCausalLM"] and llm.llm_engine.model_config.revision == "v0"
    assert llm.llm_engine.model_config.tokenizer_revision == "v0"


def test_tokenizer_revision_and_tokenizer_hub_ids(hub, tiny_llama_path, tmp_path):
    """No tokenizer_revision is the model's revision; the model's own tokenizer may come from another snapshot."""
    assert check_args(EngineArgs(hub, revision="v0")).tokenizer is None  # the model's own, at its revision
    assert Path(check_args(EngineArgs(hub, tokenizer_revision="v0")).tokenizer).name == OLD
    assert Path(check_args(EngineArgs(str(tiny_llama_path), tokenizer=hub)).tokenizer).name == MAIN
    assert Path(check_args(EngineArgs(str(tiny_llama_path), tokenizer=hub, tokenizer_revision=OLD)).tokenizer).name \
        == OLD
    with pytest.raises(EngineArgsError, match="^tokenizer_revision: acme/tiny is in the local Hugging Face cache, but "
                                              "not at revision 'v9'"):
        check_args(EngineArgs(str(tiny_llama_path), tokenizer=hub, tokenizer_revision="v9"))
    with pytest.raises(EngineArgsError, match="^tokenizer_revision: 'v0' names a snapshot of a Hub id"):
        check_args(EngineArgs(str(tiny_llama_path), tokenizer_revision="v0"))
    # a local tokenizer beside a Hub model at a revision: the inherited revision has nothing to pick
    folder = tmp_path / "tok"
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(folder)
    assert check_args(EngineArgs(hub, revision="v0", tokenizer=str(folder))).tokenizer == str(folder)


def test_another_tokenizer_is_the_one_prompts_use(tiny_llama_path, tmp_path):
    from batchrun.model.weights.builtin import train_tokenizer

    other = train_tokenizer(vocab_size=1000, seed=1)
    other.save_pretrained(tmp_path / "other")
    own = AutoTokenizer.from_pretrained(tiny_llama_path)
    text = "The river flows into the sea"
    assert other(text).input_ids != own(text).input_ids  # else this test would show nothing
    llm = LLM(str(tiny_llama_path), tokenizer=str(tmp_path / "other"), **SMALL)
    out = llm.generate(text, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == other(text).input_ids
    assert llm.llm_engine.model_config.tokenizer == str(tmp_path / "other")
    assert get_tokenizer(str(tmp_path / "other"))(text).input_ids == other(text).input_ids


def test_a_tokenizer_that_cannot_serve_is_refused(tiny_llama_path, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineArgsError, match=r"^tokenizer: .*/empty holds no tokenizer \(none of tokenizer.json"):
        LLM(str(tiny_llama_path), tokenizer=str(tmp_path / "empty"), **SMALL)
    with pytest.raises(EngineArgsError, match="^tokenizer: .*/missing does not exist"):
        LLM(str(tiny_llama_path), tokenizer=str(tmp_path / "missing"), **SMALL)
    big = AutoTokenizer.from_pretrained(tiny_llama_path)
    big.add_tokens([f"<extra_{i}>" for i in range(100)])
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(EngineArgsError, match=r"^tokenizer: .*/big has 2148 tokens, more than the model's vocabulary "
                                              r"\(2048\)$"):
        LLM(str(tiny_llama_path), tokenizer=str(tmp_path / "big"), **SMALL)


def test_trust_remote_code_reaches_transformers(tiny_llama_path, monkeypatch):
    seen = []

    def spy(kind, real):
        def call(*args, **kwargs):
            seen.append((kind, kwargs.get("trust_remote_code")))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(loader.AutoConfig, "from_pretrained", spy("config", loader.AutoConfig.from_pretrained))
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", spy("tokenizer", loader.AutoTokenizer.from_pretrained))
    LLM(str(tiny_llama_path), trust_remote_code=True, **SMALL)
    assert ("config", True) in seen and ("tokenizer", True) in seen and ("config", False) not in seen
    seen.clear()
    get_tokenizer(str(tiny_llama_path), trust_remote_code=True)
    assert seen[0] == ("tokenizer", True) and {trust for _, trust in seen} == {True}  # (AutoTokenizer reads the config)
    seen.clear()
    LLM(str(tiny_llama_path), **SMALL)
    assert {trust for _, trust in seen} == {False}


def test_get_tokenizer_as_clients_call_it(tiny_llama_path, hub):
    own = AutoTokenizer.from_pretrained(tiny_llama_path)
    text = "Once upon a time"
    # as an evaluation harness calls it (its extra keyword arguments go to transformers)
    tok = get_tokenizer(str(tiny_llama_path), tokenizer_mode="auto", trust_remote_code=False, revision=None,
                        add_bos_token=False)
    assert tok(text).input_ids == own(text).input_ids
    assert get_tokenizer(hub, revision="v0")(text).input_ids == own(text).input_ids
    builtin = get_tokenizer("builtin:tiny-llama")
    assert builtin.eos_token == "<|endoftext|>" and builtin(text).input_ids
    with pytest.raises(EngineArgsError, match="^revision: acme/tiny is in the local Hugging Face cache, but not at"):
        get_tokenizer(hub, revision="v9")
    with pytest.raises(ValueError, match="^tokenizer_mode: 'slow' is not supported: batchrun loads the tokenizer"):
        get_tokenizer(str(tiny_llama_path), tokenizer_mode="slow")
    with pytest.raises(ValueError, match="^download_dir: '/models' is not supported: nothing is downloaded"):
        get_tokenizer(str(tiny_llama_path), download_dir="/models")
    with pytest.raises(EngineArgsError, match="^tokenizer_name: nowhere/at-all does not exist"):
        get_tokenizer("nowhere/at-all")


def test_the_job_file_takes_the_model_keys(tiny_llama_path, tmp_path):
    """model.tokenizer / revision / tokenizer_revision / trust_remote_code are job keys with the same checks:
    `validate` accepts a good one and refuses a bad one (exit 2, one line naming the key)."""
    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "in.parquet")

    def validate(**model):
        job = {"model": {"path": str(tiny_llama_path), **model}, "input": {"path": str(tmp_path / "in.parquet")},
               "output": {"path": str(tmp_path / "out")}}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        return CliRunner().invoke(main, ["validate", str(tmp_path / "job.yaml")])

    ok = validate(tokenizer=str(tiny_llama_path), trust_remote_code=False, tokenizer_revision=None)
    assert ok.exit_code == 0, ok.output
    for model, message in [
        (dict(tokenizer=str(tmp_path / "nope")), f"model.tokenizer: {tmp_path / 'nope'} does not exist"),
        (dict(revision="v1"), "model.revision: 'v1' names a snapshot of a Hub id"),
        (dict(tokenizer_revision="v1"), "model.tokenizer_revision: 'v1' names a snapshot of a Hub id"),
        (dict(trust_remote_code="yes"), "model.trust_remote_code: expected true or false"),
    ]:
        bad = validate(**model)
        assert bad.exit_code == 2 and message in bad.output, (model, bad.output)
        assert len(bad.output.strip().splitlines()) == 1


# ---- `vllm` as batchrun ----------------------------------------------------------------------------------------------

@pytest.fixture
def served():
    yield vllm_compat.install()
    vllm_compat.uninstall()


def test_every_name_of_the_tree_is_batchruns(served):
    for module, names in vllm_compat.TREE.items():
        loaded = importlib.import_module(module)
        assert loaded is sys.modules[module] and loaded.__all__ == list(names)
        for name, target in names.items():
            where, _, attr = target.partition(":")
            assert getattr(loaded, name) is getattr(importlib.import_module(where), attr), (module, name)
        parent, _, child = module.rpartition(".")
        if parent:
            assert getattr(sys.modules[parent], child) is loaded
    assert vllm_compat.install() is served  # a second call changes nothing
    assert importlib.metadata.version("vllm") == vllm_compat.VLLM_VERSION == served.__version__
    assert importlib.util.find_spec("vllm") is not None
    with pytest.raises(ImportError, match="cannot import name 'AsyncLLMEngine' from 'vllm'"):
        exec("from vllm import AsyncLLMEngine", {})
    with pytest.raises(ModuleNotFoundError, match="No module named 'vllm.entrypoints.openai'"):
        importlib.import_module("vllm.entrypoints.openai")
    vllm_compat.destroy_model_parallel()
    vllm_compat.destroy_distributed_environment()
    assert 0 < vllm_compat.get_open_port() < 65536


def test_uninstall_takes_it_out():
    vllm_compat.install()
    vllm_compat.uninstall()
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def test_a_real_vllm_imported_first_is_refused(monkeypatch):
    real = types.ModuleType("vllm")
    real.__file__ = "/site-packages/vllm/__init__.py"
    monkeypatch.setitem(sys.modules, "vllm", real)
    with pytest.raises(RuntimeError, match=r"^a real vllm is imported already \(/site-packages/vllm/__init__.py\): "
                                           r"call batchrun.vllm_compat.install\(\) before anything imports vllm"):
        vllm_compat.install()
    assert sys.modules["vllm"] is real


def test_the_runner_serves_a_script_unchanged(tmp_path):
    """`python -m batchrun.vllm_compat script.py ARGS`: the script imports vllm as it is (no torch until a name that
    needs it is used) and gets its arguments."""
    script = tmp_path / "client.py"
    script.write_text("import sys\nimport vllm\nfrom vllm.lora.request import LoRARequest\n"
                      "print('torch' in sys.modules, vllm.__version__, LoRARequest('a', 1).lora_name, sys.argv[1:])\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "batchrun.vllm_compat", str(script), "--n", "3"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == f"False {vllm_compat.VLLM_VERSION} a ['--n', '3']"
    usage = subprocess.run([sys.executable, "-m", "batchrun.vllm_compat"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python -m batchrun.vllm_compat")


# ---- the page ----------------------------------------------------------------------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("gen_python_api", REPO / "docs" / "gen_python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_api_md_lists_the_arguments_and_the_tree(monkeypatch):
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.render(page) == page, "docs/python-api.md is out of date: run python docs/gen_python_api.py"
    assert gen.main(["--check"]) == 0
    for name in [*SHARED, *RENAMED, *INERT]:
        assert f"| `{name}` |" in page
    for module, names in vllm_compat.TREE.items():
        assert not names or f"| `{module}` |" in page
    # the tables follow the data: a new inert argument or vLLM name shows
    monkeypatch.setitem(INERT, "new_vllm_argument", INERT["enable_lora"])
    monkeypatch.setitem(vllm_compat.TREE, "vllm.new", {"Thing": "batchrun.llm:LLM"})
    changed = gen.render(page)
    assert "| `new_vllm_argument` | accepted: `False`, `None`;" in changed
    assert "| `vllm.new` | `Thing` (`batchrun/llm.py: LLM`) |" in changed
