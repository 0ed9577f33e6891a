"""The lm_head's selection kernels (csrc/logits.c): each row's largest logits with the logits never written whole,
their fp32 refinement, the greedy token from them, a sampled token from each row in cache; fp32 models' greedy token."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import dtype_flag, linears

_P, _I, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "linear_bf16_top": (ctypes.c_int, [_P, _I, _P, _I, _I, _I, _P, _P, _P]),
    "refine_logits": (None, [_P, _I, _I, _P, _P, _I, _I, _P, _I, _B]),
    "top_argmax": (ctypes.c_int, [_P, _P, _P, _I, _I, _P]),
    "greedy_bf16": (ctypes.c_int, [_P, _I, _P, _P, _I, _I, _I, _P]),
    "logits_bf16": (ctypes.c_int, [_P, _I, _P, _P, _I, _I, _I, _P]),
    "sample_bf16": (ctypes.c_int, [_P, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P]),
    "greedy_f32": (ctypes.c_int, [_P, _I, _P, _I, _I, _P]),
    "greedy_f32_screened": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _I, _P]),
}


# The bf16 linear kernels (linears.bf16_kernel()) on which the greedy path through linear_top was measured faster
# than the whole logits (docs/performance.md); on the others compute_logits keeps the step until it is measured there.
MEASURED_KERNELS = ("amx", "dot")
# The same for the sampled rows' path (sample_bf16) against logits_bf16 and the sampler, and for fp32 models' greedy
# path (greedy_f32) against the whole fp32 logits and their argmax.
SAMPLED_MEASURED_KERNELS = ("dot",)
F32_MEASURED_KERNELS = ("dot",)
# The same for fp32 models' greedy path through a bf16 screen (greedy_f32_screened) against greedy_f32.
SCREEN_MEASURED_KERNELS = ("dot",)


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def greedy_measured() -> bool:
    """Whether this CPU's bf16 linear kernel is one the fused greedy path was measured on (MEASURED_KERNELS)."""
    return linears.bf16_kernel() in MEASURED_KERNELS


def sampled_measured() -> bool:
    """Whether this CPU's bf16 linear kernel is one the fused sampled path was measured on."""
    return linears.bf16_kernel() in SAMPLED_MEASURED_KERNELS


def f32_measured() -> bool:
    """Whether this CPU's kind (by its bf16 linear kernel) is one the fp32 greedy path was measured on."""
    return linears.bf16_kernel() in F32_MEASURED_KERNELS


def screen_measured() -> bool:
    """Whether this CPU's kind is one the screened fp32 greedy path was measured on (SCREEN_MEASURED_KERNELS)."""
    return linears.bf16_kernel() in SCREEN_MEASURED_KERNELS


def linear_top(x: torch.Tensor, packed: torch.Tensor, n: int, top: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [rows, k] and a bf16 weight [n, k] packed for linear_bf16 (no bias) -> each row's `top` largest
    outputs of linear_bf16(x), the bits it gives them, as (fp32 values [rows, top], int64 ids [rows, top]) sorted
    by value descending then id ascending, NaN outputs left out; and int64 [rows], each row's first NaN output
    (-1: none)."""
    x = x.contiguous()
    rows, k = x.shape
    values = torch.empty(rows, top, dtype=torch.float32)
    ids = torch.empty(rows, top, dtype=torch.int64)
    nan = torch.empty(rows, dtype=torch.int64)
    if _library().linear_bf16_top(x.data_ptr(), rows, packed.data_ptr(), n, k, top, values.data_ptr(),
                                  ids.data_ptr(), nan.data_ptr()):
        raise MemoryError("linear_bf16_top: no memory for its scratch")
    return values, ids, nan


def refines(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether refine_logits takes these: both fp32 or both bf16, on a CPU, rows contiguous."""
    return (hidden.dtype == weight.dtype and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.device.type == "cpu" and weight.device.type == "cpu" and hidden.dim() == 2
            and hidden.stride(-1) == 1 and weight.is_contiguous())


def refine_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[r, j] = hidden[r] . weight[ids[r, j]] in fp32 (out fp32 [rows, k], unit stride in k; ids int64 with
    unit stride in k): each one dot product, whose bits never depend on the rows beside it (refines() holds)."""
    hidden = hidden.contiguous()
    rows, dim = hidden.shape
    _library().refine_logits(hidden.data_ptr(), rows, dim, weight.data_ptr(), ids.data_ptr(), ids.stride(0),
                             ids.shape[1], out.data_ptr(), out.stride(0), dtype_flag(hidden))


def top_argmax(values: torch.Tensor, ids: torch.Tensor, nan: torch.Tensor) -> torch.Tensor | None:
    """Each row's id of its largest value (the smallest id among equal ones) from contiguous fp32 values and
    int64 ids [rows, top]; None where a value is NaN or a row's nan is set (linear_top's)."""
    rows, top = values.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    if _library().top_argmax(values.data_ptr(), ids.data_ptr(), nan.data_ptr(), rows, top, tokens.data_ptr()):
        return None
    return tokens


def greedy_bf16(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, top: int) -> torch.Tensor | None:
    """linear_top, refine_logits on the first top - 1 and top_argmax in one call: each row's greedy token, int64,
    from bf16 x [rows, k] (contiguous), the lm_head's panels and plain weight [n, k]; None on a NaN."""
    rows = x.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    status = _library().greedy_bf16(x.data_ptr(), rows, packed.data_ptr(), weight.data_ptr(), weight.shape[0],
                                    weight.shape[1], top, tokens.data_ptr())
    if status < 0:
        raise MemoryError("greedy_bf16: no memory for its scratch")
    return None if status else tokens


def logits_bf16(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, top: int) -> torch.Tensor:
    """compute_logits' three calls in one: fp32 logits [rows, n] from bf16 x, the lm_head's panels and weight."""
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    if _library().logits_bf16(x.data_ptr(), rows, packed.data_ptr(), weight.data_ptr(), n, weight.shape[1], top,
                              out.data_ptr()) < 0:
        raise MemoryError("logits_bf16: no memory for its scratch")
    return out


def sample_bf16(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, top: int, temperature: torch.Tensor,
                top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                u: torch.Tensor) -> torch.Tensor:
    """sampling.sample_rows(logits_bf16(x, packed, weight, top), ...) in one call, the logits never written whole:
    each row's int64 token, the same bits."""
    rows = x.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    filters = [None if t is None else t.contiguous() for t in (top_k, top_p, min_p)]
    if _library().sample_bf16(x.data_ptr(), rows, packed.data_ptr(), weight.data_ptr(), weight.shape[0],
                              weight.shape[1], top, temperature.contiguous().data_ptr(),
                              *(None if t is None else t.data_ptr() for t in filters), u.contiguous().data_ptr(),
                              tokens.data_ptr()) < 0:
        raise MemoryError("sample_bf16: no memory for its scratch")
    return tokens


def greedy_f32(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 x [rows, k] and an fp32 weight [n, k] packed for linear_f32 (no bias) -> each row's argmax of
    linear_f32(x) (int64, torch's argmax: the first maximum, a NaN the largest), the outputs never written whole."""
    x = x.contiguous()
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    if _library().greedy_f32(x.data_ptr(), x.shape[0], packed.data_ptr(), n, x.shape[1], tokens.data_ptr()):
        raise MemoryError("greedy_f32: no memory for its scratch")
    return tokens


def lm_screen(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """greedy_f32_screened's screen of an fp32 weight [n, k] on the panels: the weight rounded to bf16 and packed
    for linear_bf16, and each row's norm rounded up (fp32 [n]); None where a norm is not finite. Made a group of
    panels at a time: no fp32 copy of the weight."""
    panels = linears.panel_view(packed, k)
    plain = torch.empty(panels.shape[0] * panels.shape[1], k, dtype=torch.bfloat16)
    norms = torch.empty(plain.shape[0], dtype=torch.float64)
    group = max(1, (1 << 24) // (panels.shape[1] * k * 8))  # 16 MiB of float64 at a time
    for start in range(0, panels.shape[0], group):
        chunk = panels[start:start + group]
        rows = slice(start * panels.shape[1], (start + chunk.shape[0]) * panels.shape[1])
        plain[rows] = chunk.flatten(0, 1)
        norms[rows] = torch.linalg.vector_norm(chunk.double(), dim=2).flatten()
    norms = norms[:n].float()
    if not torch.isfinite(norms).all():
        return None
    norms = torch.nextafter(norms, torch.tensor(float("inf")))  # at least the float64 norm, which is within it
    return linears.pack_linear(plain[:n]), norms


def greedy_f32_screened(x: torch.Tensor, screen: tuple[torch.Tensor, torch.Tensor], packed: torch.Tensor,
                        n: int) -> torch.Tensor:
    """greedy_f32's tokens, found through lm_screen's bf16 copy: only the outputs its bound leaves are computed in
    fp32 (a row it cannot bound takes greedy_f32)."""
    x = x.contiguous()
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    if _library().greedy_f32_screened(x.data_ptr(), x.shape[0], screen[0].data_ptr(), screen[1].data_ptr(),
                                      packed.data_ptr(), n, x.shape[1], tokens.data_ptr()):
        raise MemoryError("greedy_f32_screened: no memory for its scratch")
    return tokens
