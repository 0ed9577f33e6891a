"""The step on an encoder: whole prompts packed without padding, one forward, each PoolingRequest's rows reduced
(and the classification head where asked), one host transfer. Encoders keep no KV cache: the block tables and
block moves of a SchedulerOutput are not theirs."""

from __future__ import annotations

import itertools
import time

import torch
from torch import nn

from batchrun.engine.contract import RunnerTimers, SchedulerOutput, StepOutput
from batchrun.model.runner.pooling import pool_rows


class EncoderRunner:
    """Runs SchedulerOutputs of whole prompts (every ScheduledSeq starts at 0) on an encoder (model.is_encoder)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = torch.device(device)
        self.model_time_s = 0.0
        self.timers = RunnerTimers()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepOutput:
        """The pooled vectors of out.pooling, in order (plain float lists)."""
        if not out.seqs:
            return StepOutput()
        for s in out.seqs:
            if s.start != 0:
                raise ValueError(f"sequence {s.seq_id} is scheduled from position {s.start}: an encoder takes whole "
                                 "prompts (it keeps no cache)")
        lengths = [len(s.token_ids) for s in out.seqs]
        starts = list(itertools.accumulate(lengths, initial=0))
        ids = torch.tensor([t for s in out.seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).to(self.device)
        t0 = time.perf_counter()
        hidden = self.model(ids, positions, starts)
        t1 = time.perf_counter()
        self.timers.forward_s += t1 - t0
        if not out.pooling:
            self.model_time_s += t1 - t0
            return StepOutput()
        head = self.model.pool_head if self.model.has_head else None
        vectors = pool_rows(hidden, out.pooling, starts, head)
        sizes = [v.shape[0] for v in vectors]
        flat = torch.cat(vectors).tolist()  # the step's one host transfer
        self.timers.logits_s += time.perf_counter() - t1  # the pooling, the head and the transfer
        self.model_time_s += time.perf_counter() - t0
        return StepOutput(pooled=[flat[a:b] for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))])
