"""The element-wise ops of a decoder layer: a torch implementation, and fused CPU kernels for fp32 and bf16 CPU models.

Which one a model uses is decided once, at load (`select_ops(device, dtype)`), and travels to the layers in
the step's ForwardContext: no op re-decides per call. The torch ops follow transformers' modules op for op
(they run on CUDA, in other dtypes, and are the reference the kernels are tested against). On fp32 and bf16 CPU
tensors the C kernels (cpu_kernels/elementwise.py, csrc/elementwise.c) do the same arithmetic in one pass and one
call each: at decode batch sizes a layer is a few dozen small ops, and on a CPU their dispatch and memory passes
cost as much as the matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import elementwise


@dataclass
class Rotary:
    """The step's positions and the model's cos/sin tables ([max_pos, rotary_dim], fp32; rotary_dim < head_dim
    for partial rotary, whose last head_dim - rotary_dim dims are not rotated). The kernel reads the tables by
    position; the torch path gathers the rows once per step and reuses them in every layer. `variants`: the
    model's other tables by name (Gemma 3's sliding layers rotate with a local base), over the same positions."""

    positions: torch.Tensor  # int64 [num_tokens]
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    dtype: torch.dtype
    variants: dict[str, Rotary] = field(default_factory=dict)

    def of(self, name: str) -> Rotary:
        """The rotary embedding with table `name` ("global": this one)."""
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
    """The reference implementations, for any device and dtype."""

    name = "torch"

    # The dtype of the residual stream for activations of `dtype` (DecoderLayer starts it from the embeddings).
    def residual_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """weight * x / rms(x). With a residual: h = residual + x, returns (weight * h / rms(h), h); the
        kernel ops write h into `residual` itself, which the caller must own. The residual may be fp32 for bf16
        activations (CpuKernelOps.residual_dtype): h is then fp32, and only the result is x's dtype."""
        dtype = x.dtype
        if residual is not None:
            x = residual + x
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for the fused [N, 2I] gate|up projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up (gelu's tanh approximation, transformers' gelu_pytorch_tanh) for a fused [N, 2I]
        gate|up projection: GeGLU (Gemma)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def apply_rope(self, q: torch.Tensor, k: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q [N, H, D] and k [N, Hkv, D]; the kernel ops rotate in place (q and k may be
        views into the fused qkv projection, which the caller owns). With partial rotary only the first
        rot.rotary_dim dims of each head turn."""
        cos, sin = rot.rows
        dim = rot.rotary_dim
        if dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, k_rot = q[..., :dim], k[..., :dim]
        return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., dim:]), dim=-1),
                torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., dim:]), dim=-1))


class CpuKernelOps(TorchOps):
    """The C kernels, for fp32 and bf16 models on a CPU with the kernels built. A tensor laid out in a way the kernel
    does not take (never the case in our layers, but cheap to check) goes to the torch op."""

    name = "cpu_kernels"

    def residual_dtype(self, dtype):
        """fp32 for a bf16 model: each layer adds its output to the residual stream, and a bf16 stream rounds
        every sum to 8 bits, 60 times in a 30-layer model. Kept in fp32 (as the kernel's sums already are),
        only each norm's output is bf16. This is more exact than transformers' bf16 forward, not the same: on
        SmolLM2-135M, teacher-forced top-1 agreement with the fp32 model over 1,024 positions went from 1006 to
        1010 with 16 sequences per decode step, and from 1001 to 1007 with 4 (where the few-row linear kernel
        runs; tests/test_bf16_accuracy.py), for 4 bytes instead of 2 per hidden value of the step's rows."""
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def rms_norm(self, x, weight, eps, residual=None):
        if x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = elementwise.rms_norm(x, weight, eps, residual)
            return out if residual is None else (out, residual)
        return super().rms_norm(x, weight, eps, residual)

    def silu_mul(self, gate_up):
        if gate_up.is_contiguous():
            return elementwise.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        if gate_up.is_contiguous():
            return elementwise.gelu_tanh_mul(gate_up)
        return super().gelu_tanh_mul(gate_up)

    def apply_rope(self, q, k, rot):
        if rot.rotary_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == q.shape[2] \
                and k.stride(1) == k.shape[2]:
            for x in (q, k):
                elementwise.rope_(x, x.shape[1], x.shape[2], rot.positions, rot.cos_table, rot.sin_table)
            return q, k
        return super().apply_rope(q, k, rot)


def uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 or bf16 on the CPU with the kernels built."""
    return device.type == "cpu" and dtype in cpu_kernels.DTYPES and cpu_kernels.available()


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The element-wise ops for a model on `device` in `dtype`, chosen once at load."""
    return CpuKernelOps() if uses_cpu_kernels(device, dtype) else TorchOps()
