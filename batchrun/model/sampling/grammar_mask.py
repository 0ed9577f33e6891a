"""The token bitmask of a step's constrained rows, in one buffer kept and grown: filled by xgrammar in one call,
applied in one (on a CPU by batchrun's C kernel: xgrammar's loop tests a bit per token)."""

from __future__ import annotations

import torch
import xgrammar as xgr

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import sampling as cpu_sampling


class GrammarMask:
    def __init__(self, vocab_size: int, device: torch.device, max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self.host = xgr.allocate_token_bitmask(0, vocab_size)
        self.on_device: torch.Tensor | None = None

    def _buffer(self, rows: int) -> torch.Tensor:
        if self.host.shape[0] < rows:
            cap = max(rows, 2 * self.host.shape[0], 8)
            self.host = xgr.allocate_token_bitmask(cap, self.vocab_size)
            if self.device.type == "cuda":
                self.host = self.host.pin_memory()
                self.on_device = torch.empty_like(self.host, device=self.device)
        return self.host

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Mask logits[rows[j]] (in place) to what matchers[j] allows next."""
        host = self._buffer(logits.shape[0])
        self.batch.batch_fill_next_token_bitmask(matchers, host, rows)
        if self.device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels.available():
            cpu_sampling.apply_token_bitmask(logits, host, rows, self.vocab_size)
            return
        mask = host
        if self.device.type == "cuda":
            self.on_device[: logits.shape[0]].copy_(host[: logits.shape[0]], non_blocking=True)
            mask = self.on_device
        xgr.apply_token_bitmask_inplace(logits, mask[: logits.shape[0]], vocab_size=self.vocab_size,
                                        indices=rows)
