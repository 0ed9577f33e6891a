"""GGUF tensors read as stored: each of Q8_0, Q6_K, Q4_0, Q4_1, Q4_K becomes a QuantizedWeight whose
dequantization is, bit for bit, what the gguf package's own dequantize gives for the same bytes, and what
transformers' GGUF loader gives under the same Hugging Face name (Llama's q/k rows un-permuted the same way);
on tiny files written with gguf.GGUFWriter and on the built-in SmolLM2's real Q4_1 file."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from batchrun.kernels.layouts.quant_weight import dequantize
from batchrun.model.weights.gguf_blocks import STORED_TYPES, quantized_weight

gguf = pytest.importorskip("gguf")
GGMLType = gguf.GGMLQuantizationType


def block_bytes(kind: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """The bytes of a `kind` tensor [rows, in_features]: quantized by the gguf package where it can (Q8_0,
    Q4_0, Q4_1, Q5_0), else random block bytes with finite fp16 scales (every bit pattern of the integers, 6-bit
    sub-scales and mins is a valid Q4_K / Q6_K block, so random bytes cover the whole layout)."""
    qtype = GGMLType[kind]
    weights = rng.standard_normal((rows, in_features)).astype(np.float32)
    if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        return gguf.quants.quantize(weights, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, in_features // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (rows, in_features // block_size, 2)).astype(np.float16)
    if kind == "Q4_K":  # d and dmin lead the block
        blocks[..., 0:4] = scales.view(np.uint8)
    else:  # Q6_K: d ends it
        blocks[..., -2:] = scales[..., :1].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_file(path, tensors: dict[str, tuple[str, np.ndarray]], arch: str = "llama") -> None:
    """A GGUF file of tensors (name -> (type, block bytes or float32 values)) with the metadata a
    one-layer Llama of hidden size 256 needs (4 heads, 2 of keys and values)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(97 + i) for i in range(8)])
    writer.add_token_types([1] * 8)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, (kind, data) in tensors.items():
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=GGMLType[kind])  # shape: from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_layer(path, layout: dict[str, tuple[str, int, int]], rng: np.random.Generator,
                hidden: int = 256) -> dict[str, tuple[str, np.ndarray]]:
    """write_file of one layer: each tensor of `layout` (name -> (type, rows, inputs)) as block_bytes, and its
    F32 norms; returns the tensors written."""
    tensors = {name: (kind, block_bytes(kind, rows, cols, rng)) for name, (kind, rows, cols) in layout.items()}
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        tensors[name] = ("F32", rng.standard_normal(hidden).astype(np.float32))
    write_file(path, tensors)
    return tensors


@pytest.mark.parametrize("kind", STORED_TYPES)
def test_each_type_dequantizes_as_the_gguf_package_does(kind, tmp_path):
    rng = np.random.default_rng(len(kind) + ord(kind[1]))
    rows, in_features = 5, 512
    write_file(tmp_path / "t.gguf", {"t.weight": (kind, block_bytes(kind, rows, in_features, rng))})
    (tensor,) = gguf.GGUFReader(tmp_path / "t.gguf").tensors
    assert tensor.tensor_type.name == kind and int(tensor.shape[0]) == in_features
    weight = quantized_weight(kind, np.asarray(tensor.data), in_features)
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert weight.shape == (rows, in_features) == want.shape
    assert weight.bits == (8 if kind in ("Q8_0", "Q6_K") else 4)
    assert weight.group_size == (16 if kind == "Q6_K" else 32)
    assert np.array_equal(dequantize(weight).numpy(), want)  # bit for bit: the same float32 products
    assert weight.nbytes < want.nbytes / 3  # stored, not widened


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="a Q4_0 row of 64 inputs is not 20 bytes"):
        quantized_weight("Q4_0", np.zeros((2, 20), dtype=np.uint8), 64)


def test_a_llama_file_reads_as_transformers_dequantizes_it(tmp_path, caplog):
    """Every stored type on a projection of one Llama layer, q and k permuted by llama.cpp's layout (k with
    fewer heads), a Q5_0 down projection (no kernel takes it: dequantized, said in the log), F32 norms and a
    Q8_0 embedding (an embedding, not a linear: dequantized)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from batchrun.kernels.cpu.quant import packed_nbytes
    from batchrun.kernels.layouts.quant_weight import QuantizedWeight
    from batchrun.model.runner.memory import checkpoint_weight_bytes
    from batchrun.model.weights.gguf import gguf_config, read_quantized

    rng = np.random.default_rng(0)
    hidden, inter = 256, 512
    layout = {"blk.0.attn_q.weight": ("Q8_0", hidden, hidden), "blk.0.attn_k.weight": ("Q4_K", 128, hidden),
              "blk.0.attn_v.weight": ("Q6_K", 128, hidden), "blk.0.attn_output.weight": ("Q4_0", hidden, hidden),
              "blk.0.ffn_gate.weight": ("Q4_1", inter, hidden), "blk.0.ffn_up.weight": ("Q4_K", inter, hidden),
              "blk.0.ffn_down.weight": ("Q5_0", hidden, inter), "token_embd.weight": ("Q8_0", 8, hidden)}
    tensors = write_layer(tmp_path / "tiny.gguf", layout, rng)

    with caplog.at_level(logging.INFO, logger="batchrun"):
        ours = read_quantized(tmp_path / "tiny.gguf", torch.float32)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(gguf_config(tmp_path / "tiny.gguf"))
    theirs = load_gguf_checkpoint(str(tmp_path / "tiny.gguf"), return_tensors=True, model_to_load=skeleton,
                                  torch_dtype=torch.float32)["tensors"]
    assert set(ours) == set(theirs) and len(ours) == 11
    stored = {name for name, value in ours.items() if isinstance(value, QuantizedWeight)}
    assert stored == {f"model.layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    for name, value in ours.items():
        got = dequantize(value) if name in stored else value
        assert got.dtype == torch.float32 and torch.equal(got, theirs[name]), name
    # the permutation is not the identity: reading q's rows in file order would differ
    q_file = gguf.quants.dequantize(tensors["blk.0.attn_q.weight"][1], GGMLType.Q8_0)
    assert not np.array_equal(q_file, theirs["model.layers.0.self_attn.q_proj.weight"].numpy())
    # the memory plan, from the tensor table alone, counts what the load holds: the stored linears packed
    held = sum(packed_nbytes(v.bits, *v.shape, v.group_size) if isinstance(v, QuantizedWeight) else v.numel() * 4
               for v in ours.values())
    assert checkpoint_weight_bytes(tmp_path / "tiny.gguf", 4, gguf_as_stored=True) == held
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert said == ["tiny.gguf: 1 Q5_0 linear weights dequantized to float32 (batchrun's quantized kernels take "
                    "Q8_0, Q6_K, Q4_0, Q4_1 and Q4_K as stored)"]


def test_the_builtin_file_reads_as_its_dequantized_checkpoint(smollm2_path):
    """SmolLM2's real file: its 210 Q4_1 linears are stored (q/k un-permuted as transformers does), its Q8_0
    embedding and F32 norms dequantized; all equal the float32 checkpoint transformers dequantized from it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from batchrun.kernels.layouts.quant_weight import QuantizedWeight
    from batchrun.model.weights.builtin import BUILTIN_MODELS
    from batchrun.model.weights.gguf import iter_quantized

    file = BUILTIN_MODELS["smollm2-135m-instruct"].locate("smollm2-135m-instruct")
    seen, stored = set(), 0
    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as want:
        for name, value in iter_quantized(file, torch.float32, AutoConfig.from_pretrained(smollm2_path)):
            seen.add(name)
            if isinstance(value, QuantizedWeight):
                stored += 1
                assert value.bits == 4 and value.group_size == 32
                value = dequantize(value)
            assert torch.equal(value, want.get_tensor(name)), name
        assert seen == set(want.keys())
    assert stored == 30 * 7


def test_only_a_processor_that_reorders_rows_is_applied_to_stored_rows():
    """A tensor processor is probed on the row numbers: a permutation of rows is taken, anything else (values
    changed, a transpose, a rename) sends the tensor through transformers' dequantizing path."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, LlamaTensorProcessor

    from batchrun.model.weights.gguf import _row_order

    class Processor:
        def __init__(self, change):
            self.change = change

        def process(self, weights, name, **kwargs):
            return GGUFTensor(*self.change(weights, name), {})

    assert np.array_equal(_row_order(Processor(lambda w, n: (w, n)), "x", 6, {}), np.arange(6))
    assert np.array_equal(_row_order(Processor(lambda w, n: (w[::-1], n)), "x", 6, {}), np.arange(6)[::-1])
    for change in (lambda w, n: (w - 1, n), lambda w, n: (w.T, n), lambda w, n: (w, "y"), lambda w, n: (w / 2, n)):
        assert _row_order(Processor(change), "x", 6, {}) is None
    llama = LlamaTensorProcessor(config={"num_attention_heads": 2, "num_key_value_heads": 1})
    # llama.cpp interleaves the two rotary halves of each head; transformers puts them back in halves
    assert _row_order(llama, "blk.0.attn_k.weight", 8, {}).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert _row_order(llama, "blk.0.attn_q.weight", 8, {}).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert _row_order(llama, "blk.0.attn_v.weight", 8, {}).tolist() == list(range(8))


def test_a_quantized_output_weight_stays_a_plain_lm_head(tmp_path):
    """llama.cpp files store output.weight quantized (Q6_K in Q4_K_M files): the engine keeps the lm_head in the
    model's dtype (model/quant/linear.py: KEPT), so it comes dequantized, and the memory plan counts it so."""
    from batchrun.kernels.cpu.quant import packed_nbytes
    from batchrun.kernels.layouts.quant_weight import QuantizedWeight
    from batchrun.model.runner.memory import checkpoint_weight_bytes
    from batchrun.model.weights.gguf import read_quantized

    rng = np.random.default_rng(1)
    hidden, inter = 256, 512
    layout = {"blk.0.attn_q.weight": ("Q8_0", hidden, hidden), "blk.0.attn_k.weight": ("Q8_0", 128, hidden),
              "blk.0.attn_v.weight": ("Q8_0", 128, hidden), "blk.0.attn_output.weight": ("Q8_0", hidden, hidden),
              "blk.0.ffn_gate.weight": ("Q4_0", inter, hidden), "blk.0.ffn_up.weight": ("Q4_0", inter, hidden),
              "blk.0.ffn_down.weight": ("Q4_0", hidden, inter), "token_embd.weight": ("Q8_0", 8, hidden),
              "output.weight": ("Q6_K", 8, hidden)}
    write_layer(tmp_path / "untied.gguf", layout, rng)
    ours = read_quantized(tmp_path / "untied.gguf", torch.float32)
    assert isinstance(ours["lm_head.weight"], torch.Tensor) and ours["lm_head.weight"].shape == (8, hidden)
    assert sum(isinstance(v, QuantizedWeight) for v in ours.values()) == 7
    held = sum(packed_nbytes(v.bits, *v.shape, v.group_size) if isinstance(v, QuantizedWeight) else v.numel() * 4
               for v in ours.values())
    assert checkpoint_weight_bytes(tmp_path / "untied.gguf", 4, gguf_as_stored=True) == held


def test_a_fused_linear_whose_parts_differ_in_type_runs_as_stored(tmp_path):
    """llama.cpp's Q4_K_M files keep v in Q6_K beside q and k in Q4_K (here gate|up mixes the two as well):
    the fused q|k|v and gate|up run as one kernel call per type (model/quant/linear.py: MixedQuantLinear), each part on the
    file's own integers, their rows where the plain fused weight has them."""
    from batchrun.model.arch.registry import model_class
    from batchrun.model.quant.linear import MixedQuantLinear, QuantLinear
    from batchrun.model.weights.gguf import gguf_config, iter_quantized, read_quantized
    from batchrun.model.weights.loader import architecture, load_weights

    rng = np.random.default_rng(2)
    hidden, inter = 256, 512
    layout = {"blk.0.attn_q.weight": ("Q4_K", hidden, hidden), "blk.0.attn_k.weight": ("Q4_K", 128, hidden),
              "blk.0.attn_v.weight": ("Q6_K", 128, hidden), "blk.0.attn_output.weight": ("Q4_K", hidden, hidden),
              "blk.0.ffn_gate.weight": ("Q4_K", inter, hidden), "blk.0.ffn_up.weight": ("Q6_K", inter, hidden),
              "blk.0.ffn_down.weight": ("Q6_K", hidden, inter), "token_embd.weight": ("Q8_0", 8, hidden)}
    write_layer(tmp_path / "mixed.gguf", layout, rng)
    file = tmp_path / "mixed.gguf"
    config = gguf_config(file)
    with torch.device("meta"):  # as loader.load_model makes it (whose GGUF tokenizer this tiny file lacks)
        model = model_class(architecture(config))(config).to(torch.float32)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    load_weights(model, file, ((name, lambda value=value: value)
                               for name, value in iter_quantized(file, torch.float32, config)))
    plain = read_quantized(tmp_path / "mixed.gguf", torch.float32)
    layer = model.layers[0]
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    for module, parts, bits in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj",
                                                              "self_attn.v_proj"), [4, 8]),
                                (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"), [4, 8])):
        assert isinstance(module, MixedQuantLinear) and [p.bits for p in module.parts] == bits
        assert all(isinstance(p, QuantLinear) and p.packed is not None for p in module.parts)
        weight = torch.cat([dequantize(plain[f"model.layers.0.{p}.weight"]) for p in parts])
        got, want = module(x), x @ weight.T
        assert got.shape == want.shape
        # the activations' int8 rounding apart (per group of 32), each row is the plain weight's
        assert (got - want).norm(dim=0).max() <= 0.02 * want.norm(dim=0).max()
        assert (got - want).norm() <= 0.01 * want.norm()
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.bits == 8
