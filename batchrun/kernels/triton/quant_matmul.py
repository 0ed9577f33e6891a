"""y = x @ w.T for a quantized weight in batchrun's plain layout (batchrun.kernels.layouts.quant_weight.QuantizedWeight), the
weight dequantized in the matmul's inner loop: it is read from memory as stored (1 byte or half a byte per
weight, plus a scale, and for 4 bits an offset, per group) and never widened in memory.

The layout (8 bits: w = q * scale[o, g]; 4 bits: w = q * scale[o, g] + offset[o, g], q 0..15 two per byte, the
even input in the low nibble; g = i // group_size) lets a tile of K that lies inside one group factor its
scale out of the dot product:

    sum_k x[m, k] w[n, k] = scale[n, g] * sum_k x[m, k] q[n, k] + offset[n, g] * sum_k x[m, k]

so each group's slice of a K-tile is one `tl.dot` on the integers themselves (exact in fp16/bf16/fp32:
|q| <= 127) and one per-column scale and offset applied to the fp32 partial sum. A K-tile is a slice of one
group or a few whole groups (one dot each: groups of 16 or 32 still get 64- or 128-wide tiles); groups are
any multiple of 16 (16, 32, 128, a whole row...). The dot runs in the activations' dtype, accumulating in
fp32. The reference is batchrun.kernels.layouts.quant_weight.linear_ref.

Three products, one chosen per call by the row count (choose_path): that MMA kernel; for a decode step of one or
two rows of int4, a GEMV on the CUDA cores (quantized_gemv: each weight byte unpacked once and met by the row's
activations in registers, no padding of the rows to a 16-row dot); for many rows, the weight dequantized into the
activations' dtype (dequantize_weight) and handed to torch's matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton._common import dot_dtype, dot_precision

if TYPE_CHECKING:  # the kernels layer sits below the model; the weight is read by its fields only
    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_SPLIT  # split-K: this program's share of the inputs (K_SPLIT == K: all)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # a [K, N] tile's columns (int8)
    q_cols = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn  # an [N, K / 2] tile's rows (int4)
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # A K-tile is either a slice of one group (SUB_K == BLOCK_K) or whole groups, one dot each (SUB_K == GROUP_SIZE)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):  # K_SPLIT is a multiple of BLOCK_K: no K mask
        for sub in tl.static_range(BLOCK_K // SUB_K):
            k_first = k0 + sub * SUB_K
            group = k_first // GROUP_SIZE
            scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)
            if BITS == 8:
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                q = tl.load(q_rows + offs_k[:, None], mask=n_mask[None, :], other=0)
                partial = tl.dot(a.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PREC)
            else:
                # int4: each packed byte read once and its nibbles interleaved back into input order in registers,
                # then one dot over contiguous activations. It replaced (2026-12-04, not yet timed on a GPU) two
                # earlier branches: two dots of the low and high nibbles against the even and odd activations
                # (strided loads; groups >= 64) and each byte read for both its inputs and shifted by their parity
                # (groups of 16 and 32); on an H200 both were slower than the weight dequantized for cuBLAS from 4
                # rows (docs/quantization.md), which is why choose_path sends int4 there.
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                packed = tl.load(q_cols + (k_first // 2 + tl.arange(0, SUB_K // 2))[None, :], mask=n_mask[:, None],
                                 other=0)
                q = tl.interleave(packed & 0x0F, packed >> 4)  # [BLOCK_N, SUB_K]: input 2j low, 2j + 1 high
                partial = tl.dot(a.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), input_precision=DOT_PREC)
                row_sums = tl.sum(a.to(tl.float32), axis=1)
            acc += partial * scale[None, :]
            if BITS == 4:
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)
                acc += row_sums[:, None] * offset[None, :]
    out_rows = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quant_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    N, K_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
):
    # One activation row per program, the row index varying fastest over the grid, so that the programs of the
    # step's few rows read the same weight tile at about the same time: HBM once, L2 for the others.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_SPLIT
    n_mask = offs_n < N
    x_row = x_ptr + row * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    # products summed element-wise over the K-tiles and reduced across the tile's columns once at the end, not
    # per K-tile (shuffles between threads each time; the first version did that, timed only launch-bound)
    if BITS == 8:
        acc = tl.zeros([BLOCK_N, SUB_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, SUB_K // 2], tl.float32)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):  # each SUB_K slice lies in one group
            k_first = k0 + sub * SUB_K
            group = k_first // GROUP_SIZE
            scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
            if BITS == 8:
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_row + offs_k).to(tl.float32)
                q = tl.load(q_rows + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
                acc += q * scale * a[None, :]
            else:  # each byte once: its low nibble against the even input, its high one against the odd
                offs_pair = tl.arange(0, SUB_K // 2)
                packed = tl.load(q_rows + (k_first // 2 + offs_pair)[None, :], mask=n_mask[:, None], other=0)
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
                even = tl.load(x_row + k_first + 2 * offs_pair).to(tl.float32)
                odd = tl.load(x_row + k_first + 2 * offs_pair + 1).to(tl.float32)
                acc += ((packed & 0x0F).to(tl.float32) * scale + offset) * even[None, :]
                acc += ((packed >> 4).to(tl.float32) * scale + offset) * odd[None, :]
    out_row = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + row * stride_om
    tl.store(out_row + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, offset_ptr, out_ptr,
    N, stride_qn, stride_sn, stride_on,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
):
    # Meant to be bound by the bytes written (2 per weight in bf16; on an H200 about 2 TB/s of bytes read and
    # written): each slice of a group takes its scale (and offset) as one value per output row, and each packed
    # byte is read once, its two nibbles joined back into input order.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    out_rows = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on
    for sub in tl.static_range(BLOCK_K // SUB_K):
        k_first = tl.program_id(1) * BLOCK_K + sub * SUB_K
        group = k_first // GROUP_SIZE
        scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
        offs_k = k_first + tl.arange(0, SUB_K)
        if BITS == 8:
            w = tl.load(q_rows + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float32) * scale
        else:
            packed = tl.load(q_rows + (k_first // 2 + tl.arange(0, SUB_K // 2))[None, :], mask=n_mask[:, None],
                             other=0)
            offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
            low = (packed & 0x0F).to(tl.float32) * scale + offset
            high = (packed >> 4).to(tl.float32) * scale + offset
            w = tl.reshape(tl.join(low, high), [BLOCK_N, SUB_K])  # [n, j, 2] -> [n, 2j + nibble]
        tl.store(out_rows + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def block_k_for(group_size: int, in_features: int) -> int:
    """The largest K-tile of 16..128 that is a slice of one group or whole groups and tiles the row (groups
    must be multiples of 16: a dot takes at least 16 inputs)."""
    if group_size % 16:
        raise ValueError(f"the Triton quantized matmul takes groups of a multiple of 16 inputs, not {group_size}")
    for block_k in (128, 64, 32, 16):
        if group_size % block_k == 0 or (block_k % group_size == 0 and in_features % block_k == 0):
            return block_k
    raise AssertionError("unreachable: 16 divides the group size")


@dataclass(frozen=True)
class Tiles:
    """One launch's tiling: output tiles of block_m x block_n, split_k programs per output tile, num_warps each."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4


def pick_tiles(rows: int, out_features: int, in_features: int, bits: int, block_k: int) -> Tiles:
    """Read off `benchmarks.gpu_check`'s tile sweep on an H200 (2026-12-04; Llama-3-8B's MLP shapes 4096 -> 14336
    and 14336 -> 4096, bf16 activations, 1, 16 and 128 rows; docs/quantization.md). A step of a few rows (decode)
    is bound by reading the weight, and with K = 14336 its 4096 outputs in tiles of 64 made 64 programs for 132
    multiprocessors: 128-wide tiles with the K-tiles shared by 8 programs took 0.48-0.50x the time of (16, 64) for
    int8 and 0.21-0.44x for int4; for int4 at K = 4096, 0.71-0.93x (int4's figures are of the two branches the
    interleaved one replaced). int8 at K = 4096 keeps one program per tile, 32 wide (0.91-0.92x; a split lost
    there, its partials' sum being a second launch on a 31 us matmul). From 17 rows on, square
    tiles reuse each weight tile across rows; at 128 rows and K = 14336, 64 x 64 tiles split in two took
    0.42-0.74x the time of (64, 128). Not measured on other shapes: small models keep the narrow tiles. Those
    times had Python launch each call, which under ~0.1 ms may have set their pace (the sweep now times CUDA graph
    replays): to be re-read at the next GPU run."""
    k_tiles = in_features // block_k

    def split(most: int) -> int:  # the largest power of two up to `most` that divides the K-tiles
        while k_tiles % most:
            most //= 2
        return most

    if rows <= 16:
        if in_features >= 8192 or (bits == 4 and out_features >= 4096 and in_features >= 4096):
            return Tiles(16, 128, split(8), num_warps=8)
        return Tiles(16, 32 if bits == 8 and out_features >= 4096 else 64)
    if rows <= 128 and in_features >= 8192:
        return Tiles(64, 64, split(2))
    if rows <= 32:
        return Tiles(32, 64)
    return Tiles(64, 128 if out_features >= 4096 else 64)


def _weight_operands(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's tensors as the kernels index them: contiguous; for 8 bits the scale stands in for the offset,
    which they never read."""
    qweight, scale = qweight.contiguous(), scale.contiguous()
    return qweight, scale, offset.contiguous() if offset is not None else scale


def _prepare(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
             group_size: int, bits: int, block_k: int, split_k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The products' shared start: the operands checked, (x, qweight, scale, offset) as the kernels index them,
    and the output [M, N] in x's dtype."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantized matmul takes float32, float16 or bfloat16 activations, got {x.dtype}")
    in_features = x.shape[1]
    if min(block_k, group_size) < 16 or (group_size % block_k and (block_k % group_size or in_features % block_k)):
        raise ValueError(f"block_k {block_k} must be a slice of the groups of {group_size} or whole groups, "
                         f"dividing {in_features} inputs, and at least 16")
    if split_k < 1 or (in_features // block_k) % split_k:
        raise ValueError(f"split_k {split_k} must divide the {in_features // block_k} K-tiles of {block_k}")
    if qweight.shape[1] * (2 if bits == 4 else 1) != in_features:
        raise ValueError(f"activations of {in_features} inputs for a weight of shape {tuple(qweight.shape)}")
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    return (x if x.stride(1) == 1 else x.contiguous(), *_weight_operands(qweight, scale, offset), out)


def _split_target(out: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where the programs write: `out` itself, or one fp32 partial per K-share, summed by _sum_partials."""
    if split_k == 1:
        return out
    return torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)


def _sum_partials(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target is not out:
        out.copy_(target.sum(dim=0))  # the partials added in fp32 in a fixed order, rounded once into x's dtype
    return out


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group_size: int, bits: int, *, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                     num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) @ w.T -> [M, N] in x's dtype, fp32 accumulation; the weight as
    QuantizedWeight holds it (qweight, scale, offset, group_size, bits). block_k: a slice of a group or whole
    groups, dividing K (block_k_for). split_k > 1: the K-tiles are shared among that many programs per output
    tile, each writing an fp32 partial sum, added up afterwards in a fixed order (for decode shapes, whose few
    output tiles would leave most of a GPU idle)."""
    x, qweight, scale, offset, out = _prepare(x, qweight, scale, offset, group_size, bits, block_k, split_k)
    (rows, in_features), out_features = x.shape, qweight.shape[0]
    if rows == 0:
        return out
    target = _split_target(out, split_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scale, offset, target, rows, out_features, in_features, in_features // split_k,
        x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SUB_K=min(block_k, group_size),
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return _sum_partials(out, target)


def quantized_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   group_size: int, bits: int, *, block_n: int, block_k: int, split_k: int = 1,
                   num_warps: int = 4) -> torch.Tensor:
    """The same product as quantized_matmul for a few rows, without tensor cores: each program multiplies one
    row by a [block_n, block_k] weight tile on the CUDA cores and reduces along K. A dot pads a decode step's
    1-2 rows to 16 and unpacks every tile into the MMA's layout; here the unpacked integers meet the activations
    where they lie. On an H200 one int4 row (groups of 32, 14336 x 4096) took 0.039 ms: 0.75 TB/s, a sixth of the
    bandwidth, so something besides the bytes still sets its pace."""
    x, qweight, scale, offset, out = _prepare(x, qweight, scale, offset, group_size, bits, block_k, split_k)
    (rows, in_features), out_features = x.shape, qweight.shape[0]
    if rows == 0:
        return out
    target = _split_target(out, split_k)
    grid = (rows, triton.cdiv(out_features, block_n), split_k)
    _quant_gemv_kernel[grid](
        x, qweight, scale, offset, target, out_features, in_features // split_k,
        x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=min(block_k, group_size),
        num_warps=num_warps,
    )
    return _sum_partials(out, target)


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
                      bits: int, dtype: torch.dtype, block_n: int = 64) -> torch.Tensor:
    """The weight [N, K] in `dtype` (w = q * scale (+ offset) per group, computed in fp32, rounded once)."""
    out_features, in_features = qweight.shape[0], qweight.shape[1] * (2 if bits == 4 else 1)
    block_k = block_k_for(group_size, in_features)
    qweight, scale, offset = _weight_operands(qweight, scale, offset)
    out = torch.empty(out_features, in_features, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(out_features, block_n), in_features // block_k)
    _dequantize_kernel[grid](qweight, scale, offset, out, out_features, qweight.stride(0), scale.stride(0),
                             out.stride(0), GROUP_SIZE=group_size, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k,
                             SUB_K=min(block_k, group_size))
    return out


# Which product a step takes by its row count (quantized_linear), from `benchmarks.gpu_check` part 4 on an H200
# (2026-12-04, Llama-3-8B's MLP shapes, bf16 activations, times of CUDA graph replays; docs/quantization.md):
# - int4: the CUDA-core GEMV at 1-2 rows (groups of 32, 1 row: 0.039 ms against the MMA kernel's 0.122), then the
#   weight dequantized into the activations' dtype for torch's matmul (cuBLAS): from 4 rows 0.105 ms, flat up to
#   64 rows, where the MMA kernel's nibble unpacking took 0.12-0.19 ms and the GEMV 0.135 ms and more.
# - int8: the MMA kernel up to 64 rows (0.023-0.105 ms, at 8-16 rows of a whole-row scale 1.3x the speed of
#   bf16's matmul), the dequantized weight from 256 (0.095-0.123 ms against 0.12-0.27); between them untimed.
# The dequantized weight is a transient [out, in] tensor from torch's caching allocator (counted by the memory
# profile, which runs the step-token budget through it); vLLM's AWQ path makes the same trade for many rows.
GEMV_MAX_ROWS = {4: 2, 8: 0}
DEQUANTIZE_FROM_ROWS = {4: 3, 8: 128}
PATHS = ("gemv", "mma", "dequantize")


def choose_path(rows: int, bits: int) -> str:
    """The product quantized_linear takes for a step of `rows` rows of a `bits`-bit weight."""
    if rows <= GEMV_MAX_ROWS[bits]:
        return "gemv"
    return "dequantize" if rows >= DEQUANTIZE_FROM_ROWS[bits] else "mma"


def gemv_tiles(rows: int, out_features: int, in_features: int, block_k: int) -> Tiles:
    """64 outputs per program, the K-tiles shared among up to 8 programs until some 1024 programs cover the GPU's
    multiprocessors several times over (a decode step's 4096 outputs alone make only 64 tiles)."""
    k_tiles = in_features // block_k
    split = 1
    while split < 8 and k_tiles % (2 * split) == 0 and rows * triton.cdiv(out_features, 64) * split * 2 <= 1024:
        split *= 2
    return Tiles(1, 64, split)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, path: str | None = None) -> torch.Tensor:
    """x [..., in_features] @ w.T for a QuantizedWeight (any leading dims); the product and its tiles picked from
    the shapes (choose_path), or `path` (one of PATHS) for the benchmarks."""
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    rows, in_features = flat.shape
    path = path or choose_path(rows, weight.bits)
    fields = (weight.qweight, weight.scale, weight.offset, weight.group_size, weight.bits)
    if path == "dequantize":
        out = torch.nn.functional.linear(flat, dequantize_weight(*fields, dtype=flat.dtype))
        return out.reshape(*leading, out.shape[-1])
    block_k = block_k_for(weight.group_size, in_features)
    if path == "gemv":
        tiles = gemv_tiles(rows, weight.qweight.shape[0], in_features, block_k)
        out = quantized_gemv(flat, *fields, block_n=tiles.block_n, block_k=block_k, split_k=tiles.split_k)
    elif path == "mma":
        tiles = pick_tiles(rows, weight.qweight.shape[0], in_features, weight.bits, block_k)
        out = quantized_matmul(flat, *fields, block_m=tiles.block_m, block_n=tiles.block_n, block_k=block_k,
                               split_k=tiles.split_k, num_warps=tiles.num_warps)
    else:
        raise ValueError(f"path {path!r} is not one of {PATHS}")
    return out.reshape(*leading, out.shape[-1])
