"""Linear layers on a CPU, each weight packed once at load in place of the plain one: oneDNN's blocked layout or
batchrun's panel kernels, by dtype, CPU and size (own_kernel, use_onednn). The batch-invariant mode takes the panels:
one multiply-add chain per output, the same bits at any row count (docs/cpu-kernels.md; figures: docs/performance.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.cpu import linears as cpu_linears

log = logging.getLogger(__name__)

# fp32 linear weights past which a decode step streams them from memory, where MKL reads slowly: they are packed
ONEDNN_MIN_BYTES = 256 * 2**20
_BATCH_HINT = 128  # the row count oneDNN plans the layout for; any row count works with it


# The least k (inputs) at which the AMX panels measured at least oneDNN's speed at every row count: a bf16 model
# whose every linear has it (and k a multiple of 32) takes the panels alone on AMX, one copy of its weights. Below
# it, oneDNN's large-row kernels are faster, so oneDNN keeps the large calls beside the few-row copy.
AMX_ALONE_MIN_K = 2048

# Row counts between which oneDNN keeps one kernel, for the batch-invariant mode without the panels: fewer rows
# are padded (a 1-row fp32 call takes another kernel for long rows), more cut into tiles. bf16 has no such range.
INVARIANT_ROWS = {torch.float32: (2, None)}


class PackedLinear(nn.Module):
    """y = x W^T + b on the panel kernels, W packed once: batch invariant at every row count without padding."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = cpu_linears.pack_linear(linear.weight)
        self.bias = linear.bias
        self._kernel = cpu_linears.linear_f32 if linear.weight.dtype == torch.float32 else cpu_linears.linear_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return self._kernel(flat, self.packed, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """The bf16 panels a bias-free call of `rows` rows runs on (linear_bf16), else None."""
        return self.packed if self.packed.dtype == torch.bfloat16 and self.bias is None else None


class OneDNNLinear(nn.Module):
    """y = x W^T + b, W in oneDNN's layout. `invariant` (fp32): calls padded to `min_rows` or tiled by `max_rows`,
    so every row takes one kernel. `few_rows_copy`: bf16 keeps a second copy for linear_bf16's few-row calls."""

    def __init__(self, linear: nn.Linear, invariant: bool = False, few_rows_copy: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias
        self.min_rows, self.max_rows = INVARIANT_ROWS.get(linear.weight.dtype, (1, None)) if invariant \
            else (1, None)
        # Few-row calls read the weights at memory speed on the panels: a second copy. Not in the batch-invariant
        # mode, whose rows must all take one kernel.
        self.small = cpu_linears.pack_linear(linear.weight) \
            if few_rows_copy and not invariant and _takes_small(linear) else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _few(self, rows: int) -> bool:
        """Whether a call of `rows` rows takes the few-row copy."""
        return self.small is not None and rows <= cpu_linears.SMALL_ROWS

    def panels_for(self, rows: int) -> torch.Tensor | None:
        """The bf16 panels a bias-free call of `rows` rows runs on (the few-row copy), else None: oneDNN's."""
        return self.small if self._few(rows) and self.bias is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        if self._few(rows) and x.dim() == 2:
            return cpu_linears.linear_bf16(x, self.small, self.out_features, self.bias)
        if rows >= self.min_rows and (self.max_rows is None or rows <= self.max_rows):
            return self._matmul(x)
        flat = x.reshape(rows, self.in_features)
        if rows < self.min_rows:
            padded = flat.new_zeros(self.min_rows, self.in_features)
            padded[:rows] = flat
            out = self._matmul(padded)[:rows]
        else:
            out = flat.new_empty(rows, self.out_features)
            for start in range(0, rows, self.max_rows):
                out[start : start + self.max_rows] = self._matmul(flat[start : start + self.max_rows])
        return out.view(*x.shape[:-1], self.out_features)


def _takes_small(linear: nn.Linear) -> bool:
    """Whether linear_bf16 can serve this linear's few-row calls (unless BATCHRUN_SMALL_BF16_LINEAR=0)."""
    return (linear.weight.dtype == torch.bfloat16
            and (linear.bias is None or linear.bias.dtype == torch.bfloat16)
            and os.environ.get("BATCHRUN_SMALL_BF16_LINEAR", "1") != "0" and cpu_linears.has_panel_linears())


def own_kernel(model: nn.Module, batch_invariant: bool = False, few_rows_room: bool = True) -> bool:
    """Whether the linears go to PackedLinear (the panels built). bf16: in the batch-invariant mode, without oneDNN
    bf16 kernels, where the panels run on vdpbf16ps (AVX512-BF16, no AMX: faster than oneDNN), where every linear
    runs on AMX tiles with k at least AMX_ALONE_MIN_K (one copy, as fast as oneDNN at every row count) or without
    room for the few-row copy (the last three unless BATCHRUN_CPU_MATMUL=onednn). fp32 (BATCHRUN_F32_LINEAR=auto): in the
    batch-invariant mode, or past ONEDNN_MIN_BYTES with BATCHRUN_CPU_MATMUL=auto; 1: always; 0: never."""
    choice = os.environ.get("BATCHRUN_F32_LINEAR", "auto")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"BATCHRUN_F32_LINEAR must be auto, 0 or 1, got {choice!r}")
    linears = [m for _, _, m in _linears(model)]
    if not linears or not cpu_linears.has_panel_linears():
        return False
    dtype = linears[0].weight.dtype
    if dtype == torch.bfloat16:
        if batch_invariant or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return True
        if os.environ.get("BATCHRUN_CPU_MATMUL", "auto") == "onednn":
            return False
        kernel = cpu_linears.bf16_kernel()
        ks = [m.in_features for _, _, m in _linears(model, True)]
        all_amx = kernel == "amx" and all(k % cpu_linears.AMX_K == 0 and k >= AMX_ALONE_MIN_K for k in ks)
        return not few_rows_room or kernel == "dot" or all_amx
    if choice == "0" or dtype != torch.float32:
        return False
    return choice == "1" or batch_invariant or (os.environ.get("BATCHRUN_CPU_MATMUL", "auto") == "auto"
                                                and _weight_bytes(linears) >= ONEDNN_MIN_BYTES)


def _weight_bytes(linears: list[nn.Linear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def _linears(model: nn.Module, with_tied: bool = False) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every nn.Linear whose weight is not shared with another module (and,
    with_tied, of those whose weight is the embedding's too)."""
    tied = None if with_tied else getattr(getattr(model, "embed_tokens", None), "weight", None)
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child.weight is not tied:
                out.append((parent, name, child))
    return out


def _works(linear: nn.Linear) -> bool:
    """One reordered forward agrees with F.linear (the ops are private to torch: check before relying on them)."""
    try:
        x = torch.randn(cpu_linears.SMALL_ROWS + 3, linear.in_features, dtype=linear.weight.dtype)  # oneDNN's rows
        tol = 1e-4 if linear.weight.dtype == torch.float32 else 3e-2  # bf16: a few roundings of the sum apart
        got, ref = OneDNNLinear(linear)(x).float(), F.linear(x, linear.weight, linear.bias).float()
        return torch.allclose(got, ref, atol=tol * ref.abs().max().item(), rtol=tol)
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN linear unavailable (%s); using MKL", e)
        return False


def use_onednn(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False,
               few_rows_room: bool = True) -> bool:
    """Whether to pack the linears; the batch-invariant mode packs wherever oneDNN works (MKL's kernels vary)."""
    choice = os.environ.get("BATCHRUN_CPU_MATMUL", "auto")
    if choice not in ("auto", "mkl", "onednn"):
        raise ValueError(f"BATCHRUN_CPU_MATMUL must be auto, mkl or onednn, got {choice!r}")
    if batch_invariant:
        if choice == "mkl":
            log.warning("BATCHRUN_CPU_MATMUL=mkl ignored: the batch-invariant mode needs oneDNN's linears")
        choice = "onednn"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or choice == "mkl":
        return False
    if own_kernel(model, batch_invariant, few_rows_room):
        return True
    if batch_invariant and dtype == torch.bfloat16:
        log.warning("batch_invariant in bfloat16 needs batchrun's C kernels (a C compiler, a CPU with AVX-512 or "
                    "AVX2), which are not built here: oneDNN's bf16 linears are used, whose kernels change with "
                    "the number of rows, so a row's logits can depend on its batch")
    elif batch_invariant:
        log.warning("batch_invariant in float32 without batchrun's C kernels (not built here, or "
                    "BATCHRUN_F32_LINEAR=0): oneDNN's linears are used, which keep one kernel for every row count "
                    "on some CPUs only, so a row's logits may depend on its batch")
    if not torch.backends.mkldnn.is_available() or \
            (dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    linears = _linears(model)
    if not linears:
        return False
    weight_bytes = _weight_bytes([m for _, _, m in linears])
    wanted = choice == "onednn" or dtype == torch.bfloat16 or weight_bytes >= ONEDNN_MIN_BYTES
    works = wanted and _works(linears[0][2])
    if batch_invariant and not works:
        log.warning("batch_invariant: oneDNN's linears do not work here, so MKL's are used, whose kernels change "
                    "with the number of rows: a row's logits can depend on its batch")
    return works


def few_rows_copy_bytes(model: nn.Module, batch_invariant: bool = False, generates: bool = True) -> int:
    """Bytes of the bf16 few-row copies, the tied lm_head's too, kept where they fit and the engine generates."""
    if not generates or own_kernel(model, batch_invariant):
        return 0
    linears = _linears(model, with_tied=_packs_tied(model, batch_invariant))
    return _weight_bytes([m for _, _, m in linears if _takes_small(m)])


def _packs_tied(model: nn.Module, batch_invariant: bool, generates: bool = True) -> bool:
    """Whether a tied lm_head gets a packed copy: in bf16 and batch-invariant where the engine generates."""
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    return generates and weight is not None and (batch_invariant or weight.dtype == torch.bfloat16)


def reorder_linears(model: nn.Module, batch_invariant: bool = False, few_rows_room: bool = True,
                    generates: bool = True) -> int:
    """Pack every unshared nn.Linear, one at a time so the model is never held twice; returns how many. A tied
    lm_head gets a packed copy (_packs_tied); an engine that only pools (not `generates`) no few-row copy."""
    own = own_kernel(model, batch_invariant, few_rows_room)
    return _replace_linears(_linears(model, with_tied=_packs_tied(model, batch_invariant, generates)),
                            lambda linear: PackedLinear(linear) if own
                            else OneDNNLinear(linear, invariant=batch_invariant, few_rows_copy=generates))


def _replace_linears(linears: list[tuple[nn.Module, str, nn.Linear]], pack: Callable[[nn.Linear], nn.Module]) -> int:
    """Each (parent, attribute, linear) replaced by pack(linear), one at a time so the model is never held twice."""
    count = len(linears)
    while linears:
        parent, name, linear = linears.pop()
        setattr(parent, name, pack(linear))
        del linear  # the last reference to its plain weight (unless tied to the embedding)
    return count


def prepare_cpu_linears(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_invariant: bool,
                        few_rows_room: bool, generates: bool = True) -> None:
    """Pack every linear once for the kernel chosen for it on this CPU (use_onednn, own_kernel), and say which."""
    if not use_onednn(model, device, dtype, batch_invariant, few_rows_room):
        return
    kinds = linear_kernels(model, batch_invariant, few_rows_room, generates)
    count = reorder_linears(model, batch_invariant, few_rows_room, generates)
    log.info("%d linear layers reordered%s; on this CPU: %s (docs/performance.md: linear kernels on a CPU)", count,
             ", batch invariant" if batch_invariant else "",
             "; ".join(f"{', '.join(names)}: {kernel}" for kernel, names in kinds.items()))


def prepare_encoder_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """An encoder's bf16 linears packed once in oneDNN's layout where it runs bf16 (no few-row copy); how many."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("BATCHRUN_CPU_MATMUL", "auto") == "mkl" \
            or not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    linears = _linears(model)
    if not linears or not _works(linears[0][2]):
        return 0
    count = _replace_linears(linears, lambda linear: OneDNNLinear(linear, few_rows_copy=False))
    log.info("%d encoder linear layers in oneDNN's layout", count)
    return count


# transformers' GELU activations -> oneDNN's fused GELU algorithm (erf: "none"; tanh's approximation: "tanh")
_ONEDNN_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def linear_act(module: nn.Module, x: torch.Tensor, activation: str, act: nn.Module) -> torch.Tensor:
    """act(module(x)), for `activation` (transformers' name of `act`): in the linear's own pass where oneDNN runs it."""
    algorithm = _ONEDNN_GELU.get(activation)
    if isinstance(module, OneDNNLinear) and algorithm is not None and module.small is None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, module.bias, "gelu", [], algorithm)
    return act(module(x))


def linear_add(module: nn.Module, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """module(x) + other, the add in the linear's own pass where oneDNN runs it."""
    if isinstance(module, OneDNNLinear) and module.small is None and x.dim() == 2 and other.shape[0] == x.shape[0] \
            and other.dtype == x.dtype and other.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, module.packed, module.bias, "add")
    return module(x) + other


def linear_kernels(model: nn.Module, batch_invariant: bool = False, few_rows_room: bool = True,
                   generates: bool = True) -> dict[str, list[str]]:
    """The kernel each class of linear (its attribute name: q_proj, down_proj, lm_head, ...) takes here."""
    own = own_kernel(model, batch_invariant, few_rows_room)
    kinds: dict[str, list[str]] = {}
    for _, name, linear in _linears(model, with_tied=_packs_tied(model, batch_invariant, generates)):
        if not own:
            few = generates and not batch_invariant and _takes_small(linear)
            kernel = "oneDNN" + (", few rows on batchrun's panels" if few else "")
        elif linear.weight.dtype != torch.bfloat16:
            kernel = "batchrun's fp32 panels"
        else:
            kernel = _BF16_PANELS.get(_bf16_panel_kernel(linear.in_features), "?")
        names = kinds.setdefault(kernel, [])
        if name not in names:
            names.append(name)
    return kinds


_BF16_PANELS = {"amx": "batchrun's panels on AMX tiles", "dot": "batchrun's panels on vdpbf16ps",
                "widened": "batchrun's panels (widened to fp32)"}


def _bf16_panel_kernel(k: int) -> str:
    """linear_bf16's kernel for a linear of k inputs here: AMX tiles take k a multiple of 32, vdpbf16ps even k."""
    kernel = cpu_linears.bf16_kernel()
    if kernel == "amx" and k % cpu_linears.AMX_K:
        kernel = "dot"
    return "widened" if kernel == "dot" and k % 2 else kernel
