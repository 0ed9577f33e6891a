"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE): transformers' router, gated-MLP experts, and
Qwen2-MoE's gated shared expert. Each expert runs once over its rows (on CUDA all in the grouped GEMM), and expert
outputs are summed in ascending expert order, as transformers does: a row's result depends on that row only. The
router, the sum and the shared expert's gate are the ops' (on a CPU the C kernels the native call makes too)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from batchrun.model.arch.blocks import CausalLM, GatedMLP
from batchrun.model.layers.ops import TorchOps

GROUPED_BLOCK_M = 16  # rows per tile of the grouped GEMM (an expert's rows are padded to a multiple of it)


class MoECausalLM(CausalLM):
    def checkpoint_tensors(self, tensors):
        return split_stacked_experts(tensors)

    def group_experts(self) -> int:
        # quantized experts (QuantLinear) stay per expert: the grouped GEMM takes full-precision weights only
        blocks = [m for m in self.modules() if isinstance(m, SparseMoE) and m.w13 is None
                  and isinstance(m.experts[0].down_proj, nn.Linear)]
        for block in blocks:
            block.group_experts()
        return len(blocks)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, normalize: bool,
                 activation: str, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size, activation) for _ in range(num_experts))
        self.act = self.experts[0].act
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, activation) \
            if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        self.w13: nn.Parameter | None = None  # [E, 2I, H] and [E, H, I] once grouped (group_experts)
        self.w2: nn.Parameter | None = None

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        weights, experts = ops.moe_route(self.gate(x), self.top_k, self.normalize)
        outputs = self._grouped(x, experts, ops) if self.w13 is not None else self._per_expert(x, experts, ops)
        out = ops.moe_combine(outputs, weights, experts)
        if self.shared_expert is not None:
            out = ops.moe_add_shared(out, self.shared_expert(x, ops), self.shared_expert_gate(x))
        return out

    def _per_expert(self, x: torch.Tensor, experts: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """Each pair's expert output [N, top_k, H]: the pairs sorted by expert, one call per expert with rows."""
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # (host tensors here: no sync)
        rows = x[order // self.top_k]
        done = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                done[start : start + count] = self.experts[expert](rows[start : start + count], ops)
                start += count
        outputs = torch.empty_like(done)
        outputs[order] = done
        return outputs.view(*experts.shape, -1)

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        from batchrun.kernels.triton import (  # imports triton: only where the experts are grouped
            grouped_gemm,
            moe_align,
        )

        pair_of_row, row_of_pair, tile_expert = moe_align(experts.reshape(-1), self.num_experts, GROUPED_BLOCK_M)
        used = pair_of_row >= 0
        source = torch.where(used, pair_of_row // self.top_k, -1)
        gate_up = grouped_gemm(x, source, tile_expert, self.w13, block_m=GROUPED_BLOCK_M)
        hidden = getattr(ops, self.act)(gate_up)
        itself = torch.where(used, torch.arange(used.shape[0], device=x.device), -1)  # (padding rows: never read)
        down = grouped_gemm(hidden, itself, tile_expert, self.w2, block_m=GROUPED_BLOCK_M)
        return down[row_of_pair].view(*experts.shape, -1)

    def group_experts(self) -> None:
        """Stack the experts' weights for the grouped GEMM (one copy: the per-expert modules go)."""
        with torch.no_grad():
            w13 = torch.stack([e.gate_up_proj.weight for e in self.experts])
            w2 = torch.stack([e.down_proj.weight for e in self.experts])
        self.experts = None
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)


_STACKED = re.compile(r"(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)")


def split_stacked_experts(tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]]
                          ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Stacked expert tensors ([E, 2I, H] gate|up, [E, H, I] down) split into each expert's; others as they come."""
    for name, read in tensors:
        match = _STACKED.fullmatch(name)
        if match is None:
            yield name, read
            continue
        stacked = read()
        for e in range(stacked.shape[0]):
            yield f"{match['prefix']}.{e}.{match['proj']}.weight", (lambda t=stacked[e]: t)
