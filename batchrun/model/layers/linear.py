"""Linear layers on a CPU on weights packed once: oneDNN's blocked layout for bf16 models (and fp32 ones in the
batch-invariant mode), batchrun's own panel kernel for fp32 models whose weights do not stay in cache, for
bf16 models on CPUs where oneDNN has no bf16 kernels, for bf16 models in the batch-invariant mode, and for bf16
models whose few-row second copy does not fit the memory.

A decode step multiplies a handful of rows by every weight matrix. When the weights are larger than the
caches, each step streams them from memory, and MKL's plain sgemm (what `F.linear` calls) reads them far
below the memory bandwidth for 4 to 64 rows: measured here on the 125M-parameter built-in model, a step of
8-15 sequences took 61 ms with MKL and 37 ms on weights reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn`, the ops torch's own inductor uses on CPU), with prefill unchanged and the greedy
outputs of all 64 benchmark requests identical. On weights that stay in cache (the 11M-parameter model)
oneDNN's per-call cost makes it ~4% slower end to end, so `auto` reorders only fp32 models whose linear
weights exceed ONEDNN_MIN_BYTES. The reordered copy replaces the original: memory is unchanged.

In bf16, torch's F.linear on a CPU is far from what the hardware does: measured on one core on SmolLM2-135M's
shapes, oneDNN's reordered bf16 weights (AMX / AVX512_BF16 kernels) take 0.5-0.65x F.linear's time at every
row count from 1 to 300, and 0.55x on the 49152 x 576 lm_head at 64 rows. So every bf16 model is reordered,
and the lm_head too when it shares its weight with the embedding (a reordered copy: the embedding keeps the
plain one; vocab x hidden x 2 bytes more). fp32 models keep a tied lm_head on F.linear, so that their logits
stay those transformers computes (the greedy parity tests).

A bf16 decode step of at most cpu_linears.SMALL_ROWS rows (the tail of a workload, when few sequences are left,
and its draft rows) goes to batchrun's own C kernel instead (cpu_linears.linear_bf16): oneDNN's bf16 kernels read SmolLM2's weights at 9 GB/s for 1 row, where this kernel reads 17. It is
the fp32 one (linear_f32) on bf16 panels, widened to fp32 as they load: 0.52-0.98x oneDNN's time at 1 to 24
rows (cpu_linears.SMALL_ROWS has the figures), and 0.66-0.73x the time of the AVX512_BF16 dot-product kernel it
replaced at 8-24 rows, 0.94x at 1 (`python -m benchmarks.linears --baseline 98a4306`; that one served at most
6 rows). Its packed copy is a second copy of the weights (206 MB more for SmolLM2-135M, 56 MB more for its
lm_head). Not in the batch-invariant mode. BATCHRUN_SMALL_BF16_LINEAR=0 turns it off. (Changed 2026-12, issue 33:
the engine keeps this second copy only where it fits the free memory beside the KV cache, and logs its choice;
docs/memory.md.)
On a CPU with AMX the same call runs on AMX tiles instead (csrc/linears.c, amx_panel; weights packed in AMX's pair
layout), up to cpu_linears.AMX_SMALL_ROWS = 64 rows: a pass over SmolLM2's linears took 11.2-11.5 ms from 1 to 16
rows where the widened panels took 10.4-18.4 ms (the 9.2-row decode tail: 15.3), 0.65-0.87x oneDNN's time at 1-64
rows (`python -m benchmarks.linears`, 2026-12-02).

On a CPU without AVX512-BF16 or AMX (AMD Zen 3 here), oneDNN has no bf16 kernels and torch's bf16 F.linear
falls back to a path that ran at 16 GFLOP/s (SmolLM2's gate|up at 8-512 rows, 2 threads), 0.13x its fp32 speed.
There every linear of a bf16 model, the tied lm_head's packed copy too, goes to the same panels at every row count
(PackedLinear, own_kernel): on SmolLM2's linears 0.21-0.26x F.linear's time at 8-2048 rows, 0.64x at 1 row
(`python -m benchmarks.linears`, AMD EPYC, 2026-12-02), at the fp32 kernel's speed where compute-bound and twice
it where the weights stream.

On a CPU with AVX512-BF16 and no AMX (AMD Zen 4 here) the bf16 panels run on vdpbf16ps instead of widening to
fp32 (csrc/linears.c, dot_tile; added 2026-12, issue 33): it does twice the multiply-adds a cycle of an fp32 FMA
there (a loop of independent chains of each, in turn), the instruction oneDNN's bf16 kernels use. Measured rough
(SmolLM2's four layer linears x 4, weights streamed, oneDNN's calls in turn with it, best of 4, on a machine with
a load average of 5-9 on its 2 cores from other jobs): one thread, 0.95-1.02x oneDNN's time at 256 and 1024 rows
(the widening kernel 1.46-2.09x), 0.29-0.30x at 1 row, 0.83-1.20x at 16; two threads (after the chunks lost their
barrier), 0.87-1.07x at 256, 0.96-1.00x at 1024, 1.02-1.03x at 4096. End to end, SmolLM2-135M bf16 (32 prompts of
64-300 tokens, 32 tokens each, the same load) ran 7-27% longer with every linear on them than on oneDNN with the
few-row copy (two rounds), so outside the batch-invariant mode oneDNN keeps bf16 models where the copy fits, and
the copy is on vdpbf16ps: that default then took 0.67-0.89x the time of the one before (oneDNN with the widened
copy; three pairs, same workload and load). BATCHRUN_BF16_DOT=0 keeps the widening kernel. Where the few-row copy does not fit the
free memory (llm.py), every linear takes the panels (AMX tiles on a CPU with AMX: 0.65-0.87x oneDNN's time up to
64 rows and 1.01-1.16x at 96-256, the figures above; larger prefills were not measured): a model too large for
two copies streams them in every decode step, where the panels read at up to twice oneDNN's speed.

BATCHRUN_CPU_MATMUL=mkl|onednn|auto (default auto) overrides the choice.

fp32 models whose linear weights pass ONEDNN_MIN_BYTES go to batchrun's own kernel instead (PackedLinear,
cpu_linears.linear_f32, on CPUs with AVX-512, or AVX2 and FMA): its weights stream with a software prefetch, which
oneDNN's fp32 kernels lack. On the AVX2 machine (AMD EPYC, `python -m benchmarks.linears --dtypes float32`): 0.33-0.74x
oneDNN's time at 1-64 rows, 1.01x at 512 and 2048 (with the k-blocked chunks of csrc/linears.c; 1.64x before). Each output is one multiply-add chain over the inputs in order, so it is batch invariant at every
row count, 1 included. Measured on SmolLM2-135M's and small-llama's layer shapes (30 and 12 layers, weights
streamed from memory as in a step), 2 threads, oneDNN's calls in turn with it, median of 7 pairs: 0.46-0.74x
oneDNN's time at 8 rows, 0.84-0.98x at 128, 0.95-1.05x at 1024 and 0.75-1.08x at 4096 (the 4096-row gate|up
and small's 4096-wide projections 0.75-0.81x, the rest 1.03-1.08x). End to end (`python -m benchmarks.profile
--model M` with BATCHRUN_F32_LINEAR=1 and 0 in turn): SmolLM2 fp32 wall 23.47/19.70/21.65/20.94 s against
23.59/25.89/24.31/22.38 s, small-llama 14.88/14.03 s against 15.81/15.79 s. The tiny model (weights in cache)
was slower on it in three of four pairs (4.81/4.45/4.51 s against 3.82/3.93/4.45 s), hence the size rule.
BATCHRUN_F32_LINEAR=1 puts every fp32 model on it, 0 none.

Batch invariance (EngineArgs.batch_invariant): a row's product must not depend on how many rows share the call,
or a sequence's logits depend on its batch (issue 14). Measured with torch 2.13 on an AVX512-BF16/AMX Xeon, 1
and 2 threads, on every shape of the built-in models and SmolLM2-135M and M in 1..4096, bitwise against the
same rows computed in 2-row calls (tests/test_batch_invariance.py holds these facts):
- fp32 MKL (F.linear) gives different bits at almost every row count: it is never used in that mode;
- fp32 oneDNN gives the same bits for every M >= 2; M = 1 differs for K = 1536 and 2048 (a matrix-vector
  kernel for long rows), so a 1-row call is padded to 2 rows (min_rows). That did not hold on another CPU: on
  the Intel Xeon (AMX) host of an H200 machine, with torch 2.11, oneDNN left the 64 x 2048 and 128 x 2048 weights
  in their plain layout and ran them through its jit sgemm, whose rows differ from the same rows alone at 285 of
  the row counts 1..300 (every count from 16 up; 2 and 16 threads alike; 576 x 960, 1536 x 576, 2048 x 200 and
  64 x 256 held). (Changed 2026-12-04: from then on the mode puts fp32 linears on batchrun's kernel too, below.)
- bf16 oneDNN does not keep one kernel for any range of row counts that can be relied on. It was measured above
  to give the same bits for M in 1..32, so the mode ran it in 32-row tiles; that did not hold (issue 27): on an
  AMD EPYC (Zen 4, AVX512-BF16, no AMX) 3 rows of K = 1536 differ from the same rows alone, and on the AMX Xeon
  1 to 7 of 10 requests of a bf16 model changed tokens inside a batch. (Changed 2026-12: the figures above this
  line are from before.)
So in that mode every fp32 linear, the tied lm_head's packed copy too, takes batchrun's kernel (PackedLinear,
cpu_linears.linear_f32), whatever the weights' size: one multiply-add chain per output in input order, the same
bits at every row count on every CPU, with no padding. The cost is on models whose weights stay in cache, where
oneDNN was faster: tiny-llama (11M) fp32, 64 prompts x 64 tokens, 1.63 s against oneDNN's 1.57 s (medians of 5
pairs, AMD EPYC Zen 4, 2 threads, 2026-12-04); from ONEDNN_MIN_BYTES up the kernel was the default anyway. Where
the C kernels are not built (no compiler, or a CPU without AVX2) fp32 linears stay on oneDNN, padded to 2 rows
(BATCHRUN_F32_LINEAR=0 keeps them there). Every bf16
linear, the tied lm_head's packed copy too, takes batchrun's bf16 panels (PackedLinear, cpu_linears.linear_bf16)
at every row count: its sums are fixed chains over k whatever the row count (AMX tile products on a CPU with AMX
where k is a multiple of 32, vdpbf16ps on pairs of k where the CPU has AVX512-BF16, fp32 multiply-adds of the
widened weights elsewhere; which one a linear takes depends on its shape and the CPU only), and it holds one copy
of the weights. The cost is prefill speed where oneDNN's bf16 kernels are faster than the panels (CPUs with AMX,
or without AVX512-BF16): docs/reproducibility-kernels.md has the figures.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.cpu import linears as cpu_linears

log = logging.getLogger(__name__)

ONEDNN_MIN_BYTES = 256 * 2**20
_BATCH_HINT = 128  # the row count oneDNN plans the layout for; any row count works with it


# Row counts between which oneDNN keeps one kernel per dtype (measured, see the module docstring): a call
# of fewer rows is padded, one of more is cut into tiles. bf16 has none: the batch-invariant mode puts bf16
# linears on batchrun's panels (own_kernel).
INVARIANT_ROWS = {torch.float32: (2, None)}


class PackedLinear(nn.Module):
    """y = x W^T + b for fp32 or bf16, through batchrun's own kernel (cpu_linears.linear_f32 / linear_bf16) on W
    packed once into its column panels; the packed copy replaces the original. Batch invariant at every row count
    by construction (each output is one multiply-add chain over the inputs in order), so it needs no padding or
    tiling."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = cpu_linears.pack_linear(linear.weight)
        self.bias = linear.bias
        self._kernel = cpu_linears.linear_f32 if linear.weight.dtype == torch.float32 else cpu_linears.linear_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return self._kernel(flat, self.packed, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque mkldnn tensor).

    Batch-invariant (`invariant=True`, fp32): a call of fewer than `min_rows` rows is padded with zero rows, and
    one of more than `max_rows` is computed `max_rows` rows at a time, so every row goes through the one kernel
    whatever the call's row count. `few_rows_copy`: a bf16 linear keeps a second copy of its weights for
    linear_bf16's few-row calls (see below), where the engine found the memory for it (llm.py)."""

    def __init__(self, linear: nn.Linear, invariant: bool = False, few_rows_copy: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias
        self.min_rows, self.max_rows = INVARIANT_ROWS.get(linear.weight.dtype, (1, None)) if invariant \
            else (1, None)
        # A decode step of a few rows reads the weights once, at memory speed, through the C kernel's own packing
        # (cpu_linears.linear_bf16): a second copy of the weights. Not in the batch-invariant mode, whose rows must
        # all go through one kernel.
        self.small = cpu_linears.pack_linear(linear.weight) \
            if few_rows_copy and not invariant and _takes_small(linear) else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        if self.small is not None and rows <= cpu_linears.SMALL_ROWS and x.dim() == 2:
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
    """Whether linear_bf16 can stand in for this linear at a few rows (bf16, the panel kernels built;
    BATCHRUN_SMALL_BF16_LINEAR=0 turns it off)."""
    return (linear.weight.dtype == torch.bfloat16
            and (linear.bias is None or linear.bias.dtype == torch.bfloat16)
            and os.environ.get("BATCHRUN_SMALL_BF16_LINEAR", "1") != "0" and cpu_linears.has_panel_linears())


def own_kernel(model: nn.Module, batch_invariant: bool = False, few_rows_room: bool = True) -> bool:
    """Whether the model's linears go to PackedLinear (the C kernels built for a CPU with AVX-512, or AVX2 and FMA).

    bf16: in the batch-invariant mode, always (oneDNN's bf16 kernels change with the row count: module docstring);
    where oneDNN has no bf16 kernels (a CPU without AVX512-BF16 or AMX, e.g. AMD Zen 3): there torch's bf16
    F.linear ran at 16 GFLOP/s at every row count from 8 to 512 on SmolLM2's gate|up shape, 0.13x its fp32
    speed at 512 rows, where the panels run bf16 at the fp32 kernel's speed; where the panels run on vdpbf16ps
    (bf16_kernel "dot": AVX512-BF16 and no AMX, AMD Zen 4), which took 0.62-0.98x oneDNN's time at every row count
    measured (`python -m benchmarks.linears --dtypes bfloat16`, weights streamed, 2 threads, median of 3-5, AMD
    EPYC Zen 4, 2026-12-04: SmolLM2's 120 linears and lm_head 0.62x at 16 rows, 0.82x at 64, 0.91x at 128, 0.94x
    at 512, 0.90x at 2048; Llama-3.2-1B's shapes 0.77x at 16, 0.93x at 64, 0.98x at 128, 0.87x at 512); and where
    the few-row copy beside oneDNN's layout does not fit the memory (`few_rows_room` False, llm.py). Each is one
    copy that serves every row count.
    BATCHRUN_CPU_MATMUL=onednn keeps bf16 models on oneDNN outside the batch-invariant mode.
    fp32, BATCHRUN_F32_LINEAR=auto (the default): in the batch-invariant mode, always (oneDNN's fp32 kernels
    change with the row count on some CPUs: module docstring); else when the linears' weights pass
    ONEDNN_MIN_BYTES, so that a decode step streams them from memory (unless BATCHRUN_CPU_MATMUL asks for oneDNN
    or MKL); 1: every fp32 model; 0: none (the batch-invariant mode then takes oneDNN's)."""
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
        return not few_rows_room or cpu_linears.bf16_kernel() == "dot"
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
    """Whether to reorder (pack) the model's linears, for oneDNN or batchrun's panels (own_kernel). batch_invariant:
    always where oneDNN works (fp32 and bf16 on a CPU), since MKL's kernels change with the row count;
    BATCHRUN_CPU_MATMUL=mkl is then ignored."""
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


def few_rows_copy_bytes(model: nn.Module, batch_invariant: bool = False) -> int:
    """Bytes the second copies of the weights would take (OneDNNLinear's few-row panels: bf16 linears on oneDNN's
    bf16 kernels), the tied lm_head's included; 0 where there are none. The engine keeps them only where they fit
    the free memory, else packs every linear once for the panels (llm.py, own_kernel's few_rows_room)."""
    if own_kernel(model, batch_invariant):
        return 0
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    with_tied = weight is not None and weight.dtype == torch.bfloat16
    return _weight_bytes([m for _, _, m in _linears(model, with_tied=with_tied) if _takes_small(m)])


def reorder_linears(model: nn.Module, batch_invariant: bool = False, few_rows_room: bool = True) -> int:
    """Replace every unshared nn.Linear by a OneDNNLinear, or a PackedLinear where own_kernel says (in bf16
    models, and in batch-invariant mode, the tied lm_head too); returns how many. `few_rows_room`: whether bf16
    OneDNNLinears may keep their few-row copy (few_rows_copy_bytes; without room bf16 models take the panels).
    One linear at a time: each plain weight is released as soon as its packed copy is made, so the model is never
    held twice."""
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    with_tied = weight is not None and (batch_invariant or weight.dtype == torch.bfloat16)
    own = own_kernel(model, batch_invariant, few_rows_room)
    linears = _linears(model, with_tied=with_tied)
    count = len(linears)
    del weight
    while linears:
        parent, name, linear = linears.pop()
        setattr(parent, name, PackedLinear(linear) if own else OneDNNLinear(linear, invariant=batch_invariant))
        del linear  # the last reference to its plain weight (unless tied to the embedding)
    return count
