"""Triton kernels (paged KV cache, MoE, quantized matmul), each beside the torch reference the tests hold it to;
TRITON_INTERPRET=1, set before this package is imported, runs them interpreted on CPU tensors."""

from batchrun.kernels.triton.block_copy import copy_blocks, copy_blocks_ref
from batchrun.kernels.triton.decode_attention import paged_decode_attention, paged_decode_attention_ref
from batchrun.kernels.triton.grouped_gemm import grouped_gemm, grouped_gemm_ref, moe_align, tiles_bound
from batchrun.kernels.triton.kv_store import store_kv, store_kv_ref
from batchrun.kernels.triton.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from batchrun.kernels.triton.quant_matmul import quantized_linear

__all__ = [
    "copy_blocks",
    "copy_blocks_ref",
    "grouped_gemm",
    "grouped_gemm_ref",
    "moe_align",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "quantized_linear",
    "store_kv",
    "store_kv_ref",
    "tiles_bound",
]
