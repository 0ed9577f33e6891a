"""CUDA graphs of decode steps, once per batch size of a ladder, replayed with padding: padded rows write nowhere
(slot -1) and attend to nothing (seq_len 0). Needs the Triton backend (no host reads of device values)."""

from __future__ import annotations

import logging

import torch

from batchrun.model.layers.attention import AttentionBackend, AttentionMetadata
from batchrun.model.layers.context import ForwardContext
from batchrun.model.layers.ops import TorchOps

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_batch: int, max_model_len: int, block_size: int,
                 backend: AttentionBackend, ops: TorchOps) -> None:
        dev = kv_cache.device
        self.model = model
        self.kv_cache = kv_cache
        self.backend, self.ops = backend, ops
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.sizes = batch_ladder(max_batch)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b], block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=self.qsl[: b + 1], num_decodes=b, max_query_len=1, max_seq_len=self.max_model_len,
            seq_lens_host=[self.max_model_len] * b, query_lens_host=[1] * b, has_padding=True)

    def _forward(self, b: int) -> torch.Tensor:
        """The model on the buffers' first b rows, with a fresh context: the rotary rows must be made inside the capture."""
        ctx = ForwardContext(self._meta(b), self.kv_cache, self.model.rotary(self.positions[:b]), self.backend,
                             self.ops)
        return self.model(self.input_ids[:b], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the largest size first so the smaller ones share its memory pool."""
        for b in reversed(self.sizes):
            for _ in range(2):  # warm up (Triton compiles outside the capture)
                self._forward(b)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[b] = self._forward(b)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def fits(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_seq_len <= self.max_model_len

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        b = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:b].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]
