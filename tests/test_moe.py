"""Mixture-of-experts layers: the Triton grouped GEMM (interpreted without CUDA) against its fp64 reference, the
expert layout it runs on, and a whole MoE model's logits through the grouped path against the per-expert path
(the CPU's). The families' parity with transformers is tests/test_families.py's."""

from __future__ import annotations

import pytest
import torch

from batchrun import LLM
from batchrun.kernels.cpu import moe as cpu_moe
from batchrun.kernels.triton import grouped_gemm, grouped_gemm_ref, moe_align, tiles_bound
from batchrun.model.arch.moe import GROUPED_BLOCK_M, SparseMoE
from batchrun.model.layers.ops import CpuKernelOps, TorchOps, uses_cpu_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [(1, 2, 8, 16), (37, 2, 5, 16),
                                                                              (64, 3, 6, 32), (5, 1, 9, 16)])
def test_moe_align_lays_each_expert_in_whole_tiles(num_tokens, top_k, num_experts, block_m):
    g = torch.Generator().manual_seed(num_tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    flat = experts.reshape(-1)
    pair_of_row, row_of_pair, tile_expert = moe_align(flat, num_experts, block_m)
    assert pair_of_row.shape[0] == tiles_bound(flat.shape[0], num_experts, block_m) * block_m
    assert torch.equal(pair_of_row[row_of_pair], torch.arange(flat.shape[0], device=DEVICE))  # each pair once
    used = pair_of_row >= 0
    assert int(used.sum()) == flat.shape[0]
    tile_of_row = torch.arange(pair_of_row.shape[0], device=DEVICE) // block_m
    assert torch.equal(tile_expert[tile_of_row][used].long(), flat[pair_of_row[used]])  # a tile is one expert's
    # within an expert, pairs keep their (token) order
    for e in range(num_experts):
        rows = pair_of_row[used & (tile_expert[tile_of_row] == e)]
        assert torch.equal(rows, rows.sort().values)


@pytest.mark.parametrize(("dtype", "k", "n"), [(torch.float32, 64, 80), (torch.float32, 40, 33),
                                               (torch.bfloat16, 64, 48)])
def test_grouped_gemm_matches_its_reference(dtype, k, n):
    g = torch.Generator().manual_seed(k + n)
    num_experts, block_m = 5, 16
    x = torch.randn(29, k, generator=g).to(dtype=dtype, device=DEVICE)
    weight = (torch.randn(num_experts, n, k, generator=g) / k**0.5).to(dtype=dtype, device=DEVICE)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(29)]).to(DEVICE)
    pair_of_row, _, tile_expert = moe_align(experts.reshape(-1), num_experts, block_m)
    rows = torch.where(pair_of_row >= 0, pair_of_row // 2, -1)
    got = grouped_gemm(x, rows, tile_expert, weight, block_m=block_m, block_n=32, block_k=16)
    ref = grouped_gemm_ref(x, rows, tile_expert, weight, block_m)
    used = rows >= 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[used], ref[used], atol=tol, rtol=tol)


needs_c = pytest.mark.skipif(not uses_cpu_kernels(torch.device("cpu"), torch.float32), reason="needs the C kernels")


@pytest.mark.parametrize("ops", [TorchOps(), pytest.param(CpuKernelOps(), marks=needs_c)])
def test_combine_adds_in_ascending_expert_order(ops):
    """transformers adds each expert's rows into zeros, expert by expert: (0 + a) + b with a the lower expert's."""
    outputs = torch.tensor([[[1e8], [1.0]], [[1.0], [1e8]]])
    weights = torch.ones(2, 2)
    experts = torch.tensor([[3, 1], [1, 3]])
    got = ops.moe_combine(outputs, weights, experts)
    assert torch.equal(got, torch.tensor([[1.0 + 1e8], [1.0 + 1e8]]))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("experts", "top_k", "normalize"), [(5, 2, True), (8, 1, False), (33, 3, False),
                                                             (128, 8, True)])
def test_the_c_router_chooses_torchs_experts(dtype, experts, top_k, normalize):
    """The C router (both CPU paths') against transformers' torch ops: the same experts, weights within a few ulp
    (its own exp); with exact ties (bf16 logits) the lower expert first."""
    logits = (torch.randn(70, experts, generator=torch.Generator().manual_seed(experts)) * 3).to(dtype)
    weights, chosen = cpu_moe.route(logits, top_k, normalize)
    want_weights, want = TorchOps().moe_route(logits, top_k, normalize)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, chosen), probs.gather(1, want))  # (ties may differ in id only)
    for row, value in zip(chosen, probs.gather(1, chosen)):
        for j in range(1, top_k):  # descending, and of equal probabilities the lower expert first
            assert value[j - 1] > value[j] or (value[j - 1] == value[j] and row[j - 1] < row[j])
    alone_weights, alone = cpu_moe.route(logits[3:9].clone(), top_k, normalize)  # rows in another batch
    assert torch.equal(alone, chosen[3:9]) and torch.equal(alone_weights, weights[3:9])


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [37, 64])
def test_the_c_sum_has_torchs_bits(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    outputs = (torch.randn(45, 4, hidden, generator=g) * 10).to(dtype)
    weights = torch.rand(45, 4, generator=g)
    experts = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(45)])
    got = cpu_moe.combine(outputs, weights, experts)
    assert got.dtype == dtype and torch.equal(got, TorchOps().moe_combine(outputs, weights, experts))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_shared_expert_gate_has_torchs_bits(dtype):
    """Qwen2-MoE's gated shared expert, out + sigmoid(gate) * shared: the C kernel (the CPU's ops, the native call)
    against the torch reference, every bit, over gate logits from saturated to near zero."""
    g = torch.Generator().manual_seed(5)
    rows, hidden = 300, 37
    out, shared = ((torch.randn(rows, hidden, generator=g) * 4).to(dtype) for _ in range(2))
    gate = (torch.randn(rows, 1, generator=g) * torch.logspace(-3, 1.5, rows).unsqueeze(1)).to(dtype)
    want = TorchOps().moe_add_shared(out, shared, gate)
    got = CpuKernelOps().moe_add_shared(out.clone(), shared, gate)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_grouped_experts_give_the_per_expert_logits(make_ckpt, arch, monkeypatch):
    """A whole MoE model (Mixtral: renormalised top-2 of 5; Qwen2-MoE: top-3 of 6 not renormalised, a shared expert,
    a dense layer between) with its experts stacked for the Triton grouped GEMM gives the logits of the per-expert
    path; the stacked weights replace the per-expert ones (one copy)."""
    from batchrun.engine.contract import ScheduledSeq, SchedulerOutput

    path = make_ckpt(arch)
    monkeypatch.setenv("BATCHRUN_CPU_MATMUL", "mkl")  # plain nn.Linear experts, as on CUDA (nothing reordered)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, num_speculative_tokens=0,
              batch_invariant=False)
    runner = llm.engine.runner
    ids = torch.randint(3, 2000, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    step = SchedulerOutput(seqs=[ScheduledSeq(0, ids, 0, [0, 1], True), ScheduledSeq(1, ids[:5], 0, [2], True)],
                           num_decodes=0)
    per_expert = runner.compute_logits(step)
    if DEVICE.type == "cuda":  # compiled kernels take GPU tensors: there the model is grouped as it loads
        gpu = LLM(str(path), dtype="float32", device="cuda", num_kv_blocks=32, num_speculative_tokens=0)
        assert gpu.engine.runner.model.group_experts() == 0  # (already done)
        runner = gpu.engine.runner
    else:
        before = sum(p.numel() for p in runner.model.parameters())
        assert runner.model.group_experts() > 0
        assert sum(p.numel() for p in runner.model.parameters()) == before
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.experts is None and b.w13.shape[1] == 2 * b.w2.shape[2] for b in blocks)
    grouped = runner.compute_logits(step).cpu()
    torch.testing.assert_close(grouped, per_expert, atol=1e-4, rtol=1e-4)
    assert GROUPED_BLOCK_M == 16
