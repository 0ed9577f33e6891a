"""Triton kernels for the paged KV cache, each beside the plain torch reference the tests hold it to.

- `store_kv`: the step's K/V into their slots (kv_store.py)
- `paged_decode_attention`: one query per sequence, GQA-aware, split-context for long ones (decode_attention.py)
- `paged_prefill_attention`: new tokens over cached context + themselves, causal (prefill_attention.py)
- `copy_blocks`: copy-on-write block copies over all layers in one launch (block_copy.py)
- `grouped_gemm` / `moe_align`: every expert's rows of a mixture-of-experts layer in one launch (grouped_gemm.py)
- `quantized_linear`: x @ w.T for an int8 / int4 QuantizedWeight, dequantized in the inner loop (quant_matmul.py)

Kernels are defined at import, and Triton decides then whether they run compiled or interpreted: set
TRITON_INTERPRET=1 before importing this package to run them on CPU tensors.
"""

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
