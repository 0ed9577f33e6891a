"""batchrun's own fp32 linear (cpu_kernels.linears.linear_f32, PackedLinear; fp32 models past 256 MiB of linear weights,
or any with BATCHRUN_F32_LINEAR=1): close
to the exact product, each row's bits independent of the rows beside it at every row count, and a model on it
keeps greedy parity with transformers and its tokens whatever the batch."""

import pytest
import torch
import torch.nn.functional as F
from test_parity import LENGTHS, hf_reference  # transformers' greedy tokens, one prompt at a time
from torch import nn

from batchrun import LLM, SamplingParams
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import PackedLinear

pytestmark = pytest.mark.skipif(not cpu_linears.has_panel_linears(),
                                reason="needs the C kernels built for a CPU with AVX-512, or AVX2 and FMA")

# (in, out): SmolLM2-135M's layer shapes, and widths that are not multiples of the 48-output panels
SHAPES = [(576, 960), (1536, 576), (33, 577), (7, 47)]
ROW_COUNTS = (1, 2, 3, 7, 8, 9, 31, 64, 100, 257, 700)  # 8-row tiles; 700 x 1536 runs in several chunks


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_product_is_as_close_to_the_exact_one_as_mkls(in_features, out_features, bias):
    g = torch.Generator().manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(64, in_features, generator=g)
    exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    mkl_error = (F.linear(x, linear.weight, linear.bias).double() - exact).abs().max().item()
    error = (PackedLinear(linear)(x).double() - exact).abs().max().item()
    # a sum in order over K rounds a little more than MKL's blocked sums (1-3x here); a wrong kernel is off by O(1)
    assert error <= 8 * mkl_error + 1e-6


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_rows_do_not_depend_on_the_row_count(in_features, out_features):
    g = torch.Generator().manual_seed(1)
    layer = PackedLinear(nn.Linear(in_features, out_features))
    wide = torch.randn(max(ROW_COUNTS), in_features + 5, generator=g)
    x = wide[:, 3 : 3 + in_features]  # rows with a stride, as the views of a fused projection come
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in ROW_COUNTS:
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert torch.equal(layer(x.contiguous()), alone)
    assert layer(x[:0]).shape == (0, out_features)  # an empty call (no rows to chunk) returns empty


def test_models_whose_weights_stream_from_memory_take_it(make_ckpt, monkeypatch):
    from batchrun.model.layers.linear import AMX_ALONE_MIN_K, ONEDNN_MIN_BYTES, own_kernel

    small = nn.Sequential(nn.Linear(64, 64))
    def big(dtype=torch.float32, k=1):  # exactly the threshold's bytes of fp32 weights (no memory: on the meta device)
        return nn.Sequential(nn.Linear(k, ONEDNN_MIN_BYTES // 4 // k, bias=False, device="meta", dtype=dtype))

    monkeypatch.delenv("BATCHRUN_F32_LINEAR", raising=False)
    monkeypatch.delenv("BATCHRUN_CPU_MATMUL", raising=False)
    assert own_kernel(big()) and not own_kernel(small)
    # bf16 models take it (at any size) only where oneDNN has no bf16 kernels, where the panels run on vdpbf16ps, or
    # on AMX tiles where every linear's k is a multiple of 32 and at least AMX_ALONE_MIN_K (or in the batch-invariant
    # mode, or without room for the few-row copy): tests/test_small_bf16_linear.py, tests/test_memory_budget.py
    no_onednn, kernel = not torch.ops.mkldnn._is_mkldnn_bf16_supported(), cpu_linears.bf16_kernel()
    wide = AMX_ALONE_MIN_K
    assert own_kernel(big(torch.bfloat16)) == (no_onednn or kernel == "dot")
    assert own_kernel(big(torch.bfloat16, k=wide)) == (no_onednn or kernel in ("dot", "amx"))
    assert own_kernel(big(torch.bfloat16, k=64)) == (no_onednn or kernel == "dot")  # narrow: oneDNN's large calls
    assert own_kernel(nn.Sequential(big(torch.bfloat16, k=wide), big(torch.bfloat16, k=wide + 16))) == \
        (no_onednn or kernel == "dot")  # one linear off AMX tiles keeps oneDNN and its copy
    assert own_kernel(big(torch.bfloat16), batch_invariant=True) and own_kernel(big(torch.bfloat16), few_rows_room=False)
    monkeypatch.setenv("BATCHRUN_CPU_MATMUL", "onednn")  # oneDNN asked for by name
    assert not own_kernel(big())
    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "1")
    assert own_kernel(big()) and own_kernel(small)
    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "0")
    assert not own_kernel(big())
    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "yes")
    with pytest.raises(ValueError, match="BATCHRUN_F32_LINEAR"):
        own_kernel(big())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_model_on_it_keeps_greedy_parity_and_its_tokens_in_any_batch(make_ckpt, arch, monkeypatch):
    path = make_ckpt(arch)
    g = torch.Generator().manual_seed(0)  # the parity suite's prompts (its reference is cached per checkpoint)
    targets = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in LENGTHS]
    _, refs = hf_reference(path, targets)
    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "1")
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), device="cpu", num_kv_blocks=600)  # PackedLinear is the CPU's (batchrun's C kernel)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    alone = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0] for p in targets]
    assert [o.token_ids for o in alone] == refs
    others = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 40, 77, 130, 3, 250)]
    batched = LLM(str(path), device="cpu", num_kv_blocks=600, max_num_batched_tokens=96)  # chunked prefills too
    outs = batched.generate([{"prompt_token_ids": p} for p in others + targets], greedy, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs[len(others):]] == \
        [(o.token_ids, o.logprobs) for o in alone]
