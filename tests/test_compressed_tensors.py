"""Checkpoints quantized in compressed-tensors' int8 and int4 layouts run as stored (batchrun.model.weights.compressed_tensors).

The copies are written by benchmarks.peers.vllm.checkpoint (the layouts vLLM's CPU build reads: int-quantized int8 per
output channel, pack-quantized int4 in groups of 128). On a model whose linears all have 128 inputs, those are
exactly the integers and scales batchrun's own `quantization: int8 | int4` computes at load, so the two runs must
agree token for token: a slip in the reader (a nibble order, a scale per group) would not."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from batchrun import LLM, SamplingParams
from batchrun.engine_args import EngineArgsError
from batchrun.kernels.layouts.quant_weight import dequantize, unpack_int4
from batchrun.model.errors import ModelLoadError
from batchrun.model.quant.linear import QuantLinear, quantized_bytes
from batchrun.model.runner import memory
from batchrun.model.weights import compressed_tensors
from batchrun.model.weights.loader import load_model, weight_files
from batchrun.model.weights.locate import locate_model

FORMATS = {"int8": "w8a8-int8", "int4": "w4a16-g128"}


@pytest.fixture(scope="module")
def plain(make_ckpt):
    # every linear has 128 inputs: one int8 group per row either way, int4 groups of 128 either way
    return make_ckpt("llama", hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def stored(plain, tmp_path_factory):
    """{"int8" | "int4": the compressed-tensors copy of `plain`}."""
    from benchmarks.peers.vllm.checkpoint import make_quantized

    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for fmt, layout in FORMATS.items():
        ckpt = root / fmt
        shutil.copytree(plain, ckpt)
        out[fmt] = make_quantized(ckpt, layout)
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_reader_gives_the_stored_integers_and_scales(stored, fmt):
    path = stored[fmt]
    (file,) = weight_files(path)
    read = dict(compressed_tensors.stored_tensors([file]))
    with safe_open(str(file), "pt") as f:
        names = set(f.keys())
        quantized = [n for n in names if compressed_tensors.linear_stem(n, names)]
        assert len(quantized) == 7 * 2  # 7 linears x 2 layers
        for name in quantized:
            stem = compressed_tensors.linear_stem(name, names)
            weight = read.pop(stem + "weight")()
            scale = f.get_tensor(stem + "weight_scale").float()
            assert torch.equal(weight.scale, scale)
            if fmt == "int8":
                values = f.get_tensor(name).float()
                assert weight.bits == 8 and torch.equal(weight.qweight, f.get_tensor(name))
            else:
                words = f.get_tensor(name).to(torch.int64) & 0xFFFFFFFF
                nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=2).flatten(1)
                values = (nibbles - 8).float()
                assert weight.bits == 4 and torch.equal(unpack_int4(weight.qweight).long(), nibbles)
                assert torch.equal(weight.offset, -8 * scale)
            want = values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)
            # u * s - 8 s against (u - 8) * s: equal up to fp32 rounding
            assert torch.allclose(dequantize(weight), want, rtol=0, atol=1e-6 * float(scale.abs().max()))
    assert not [n for n in read if n.endswith(("weight_scale", "weight_packed", "weight_shape"))]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_compressed_checkpoint_runs_as_batchrun_quantizes_the_same_weights(plain, stored, fmt):
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = []
    for llm in (LLM(str(stored[fmt]), dtype="float32", num_kv_blocks=64),
                LLM(str(plain), dtype="float32", num_kv_blocks=64, quantization=fmt)):
        model = llm.engine.runner.model
        linear = model.layers[0].mlp.down_proj
        assert isinstance(linear, QuantLinear) and linear.bits == (8 if fmt == "int8" else 4)
        assert not isinstance(model.lm_head, QuantLinear)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(list(o.outputs[0].token_ids), [lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)])
                     for o in outs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_memory_plan_counts_the_stored_linears_packed(stored, fmt):
    planned = memory.checkpoint_weight_bytes(stored[fmt], 4)
    model = load_model(str(stored[fmt]), dtype=torch.float32, device=torch.device("cpu"), max_model_len=None).model
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + quantized_bytes(model)
    assert quantized_bytes(model) > 0
    assert held <= planned <= 1.02 * held


def test_a_quantized_checkpoint_takes_quantization_none_only(stored):
    source = locate_model(str(stored["int8"]))
    assert source.stored_quantization == compressed_tensors.StoredScheme(8, None)
    assert locate_model(str(stored["int4"])).stored_quantization == compressed_tensors.StoredScheme(4, 128)
    with pytest.raises(EngineArgsError, match="quantized already"):
        LLM(str(stored["int8"]), quantization="int4")


SCHEME_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("change,why", [
    ({"quant_method": "gptq"}, "quantized with 'gptq'"),
    ({"format": "float-quantized"}, "format 'float-quantized' is not supported"),
    ({"config_groups": {"g": {"weights": {**SCHEME_INT4, "symmetric": False}}}}, "asymmetric"),
    ({"config_groups": {"g": {"weights": {**SCHEME_INT4, "actorder": "group"}}}}, "activation-ordered"),
    ({"config_groups": {"g": {"weights": {**SCHEME_INT4, "num_bits": 8}}}}, "8-bit int weights in format"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_a_scheme_batchrun_cannot_run_is_refused_in_one_line_before_loading(stored, tmp_path, change, why):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stored["int4"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"].update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=why) as err:
        locate_model(str(ckpt))
    assert "\n" not in str(err.value)

