"""The element-wise ops, chosen once at load (select_ops): torch's, op for op as transformers (the reference), or for
fp32 / bf16 CPU tensors C kernels doing the same arithmetic in one pass each."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import elementwise
from batchrun.kernels.cpu import moe as cpu_moe


@dataclass
class Rotary:
    """The step's positions, the fp32 cos/sin tables [max_pos, rotary_dim] and `variants` (Gemma 3's local table)."""

    positions: torch.Tensor  # int64 [num_tokens]
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    dtype: torch.dtype
    variants: dict[str, Rotary] = field(default_factory=dict)

    def of(self, name: str) -> Rotary:
        return self if name == "global" else self.variants[name]

    @property
    def rotary_dim(self) -> int:
        return self.cos_table.shape[-1]

    @cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_table[self.positions].to(self.dtype).unsqueeze(1)
        sin = self.sin_table[self.positions].to(self.dtype).unsqueeze(1)
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    name = "torch"

    # The dtype of the residual stream for activations of `dtype` (start_residual starts it from the embeddings).
    def residual_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """weight * x / rms(x); with a residual, (norm(h), h) for h = residual + x (the kernels write h into it)."""
        dtype = x.dtype
        if residual is not None:
            x = residual + x
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def apply_rope(self, q: torch.Tensor, k: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q [N, H, D], k [N, Hkv, D] over rot.rotary_dim dims; the kernels rotate in place."""
        cos, sin = rot.rows
        dim = rot.rotary_dim
        if dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, k_rot = q[..., :dim], k[..., :dim]
        return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., dim:]), dim=-1),
                torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., dim:]), dim=-1))

    def moe_route(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [N, top_k], experts int64 [N, top_k]) from router logits [N, E]: transformers' router."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def moe_combine(self, outputs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * outputs[:, j] of [N, top_k, H], in its dtype, by ascending expert (transformers')."""
        terms = (outputs * weights.unsqueeze(-1)).to(outputs.dtype)
        if terms.shape[1] > 1:
            terms = terms.gather(1, experts.argsort(dim=1).unsqueeze(-1).expand_as(terms))
        out = terms[:, 0].clone()
        for j in range(1, terms.shape[1]):
            out += terms[:, j]
        return out

    def moe_add_shared(self, out: torch.Tensor, shared: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
        """out + sigmoid(gate_logits) * shared (Qwen2-MoE's shared expert; the C kernel adds into out); the sigmoid
        in float64, rounded once: torch's fp32 sigmoid's bits depend on where a value falls in the tensor."""
        return out + torch.sigmoid(gate_logits.double()).to(out.dtype) * shared


class CpuKernelOps(TorchOps):
    """The C kernels, for fp32 and bf16 models on a CPU; a layout a kernel does not take goes to the torch op."""

    name = "cpu_kernels"

    def residual_dtype(self, dtype):
        """fp32 for bf16: a bf16 stream would round every residual add to 8 bits (tests/test_bf16_accuracy.py)."""
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def rms_norm(self, x, weight, eps, residual=None):
        if x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = elementwise.rms_norm(x, weight, eps, residual)
            return out if residual is None else (out, residual)
        if residual is None and _token_strided(x):
            return elementwise.rms_norm_heads(x, weight, eps)
        return super().rms_norm(x, weight, eps, residual)

    def silu_mul(self, gate_up):
        if gate_up.is_contiguous():
            return elementwise.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        if gate_up.is_contiguous():
            return elementwise.gelu_tanh_mul(gate_up)
        return super().gelu_tanh_mul(gate_up)

    def moe_route(self, logits, top_k, normalize):
        if logits.dim() == 2 and logits.is_contiguous():
            return cpu_moe.route(logits, top_k, normalize)
        return super().moe_route(logits, top_k, normalize)

    def moe_combine(self, outputs, weights, experts):
        if outputs.is_contiguous() and weights.is_contiguous() and experts.is_contiguous():
            return cpu_moe.combine(outputs, weights, experts)
        return super().moe_combine(outputs, weights, experts)

    def moe_add_shared(self, out, shared, gate_logits):
        if out.dim() == 2 and out.is_contiguous() and shared.is_contiguous() and gate_logits.is_contiguous() \
                and shared.shape == out.shape and gate_logits.numel() == out.shape[0] \
                and shared.dtype == gate_logits.dtype == out.dtype:
            return cpu_moe.add_shared(out, shared, gate_logits)
        return super().moe_add_shared(out, shared, gate_logits)

    def apply_rope(self, q, k, rot):
        if rot.rotary_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == q.shape[2] \
                and k.stride(1) == k.shape[2]:
            for x in (q, k):
                elementwise.rope_(x, x.shape[1], x.shape[2], rot.positions, rot.cos_table, rot.sin_table)
            return q, k
        return super().apply_rope(q, k, rot)


def _token_strided(x: torch.Tensor) -> bool:
    """x [N, D] or [N, H, D] dense but for its token stride (a slice of a fused projection's rows)."""
    if x.dim() == 2:
        return x.stride(1) == 1 and x.stride(0) >= x.shape[1]
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in cpu_kernels.DTYPES and cpu_kernels.available()


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    return CpuKernelOps() if uses_cpu_kernels(device, dtype) else TorchOps()
