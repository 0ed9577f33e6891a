"""ModelRunner: one SchedulerOutput -> block moves, one forward over the paged KV pool, logits of the sampling rows
only, their samples (sampling/step.py) -> a StepOutput of plain lists, with one host sync. It decides nothing."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from operator import attrgetter

import torch

from batchrun.engine.contract import RunnerTimers, ScheduledSeq, SchedulerOutput, StepOutput
from batchrun.kernels.layouts.kv_rows import as_bytes, row_width
from batchrun.model.arch.blocks import CausalLM
from batchrun.model.arch.native_layers import NativeLayers
from batchrun.model.layers.attention import AttentionMetadata
from batchrun.model.layers.backends import select_backend
from batchrun.model.layers.context import ForwardContext
from batchrun.model.layers.ops import select_ops
from batchrun.model.runner.block_tables import BlockTableRows, decode_slots, int32_tensor, int64_tensor
from batchrun.model.runner.host_decode import HostDecode
from batchrun.model.runner.pooling import pool_rows
from batchrun.model.sampling.batch import SamplingBatch
from batchrun.model.sampling.prompt_logprobs import score_prompts
from batchrun.model.sampling.step import argmax_output, plan_sampling, sample_step

log = logging.getLogger(__name__)

_samples = attrgetter("sample")
_num_draft = attrgetter("num_draft")


@dataclass
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype | None = None  # the pool's when not the model's: int8 (batchrun/kernels/layouts/kv_rows.py)

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def row_width(self) -> int:
        """Elements of one (slot, kv head) row: head_dim, plus the fp32 scale's 4 bytes in an int8 pool."""
        return row_width(self.head_dim, self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        item = torch.empty(0, dtype=self.pool_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * item

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def pool(self, num_blocks: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)
        # zeros, not empty: unused slots are read (then masked) by batched attention, and garbage NaNs
        # would leak through a zero attention weight (an int8 row of zeros has scale 0: zeros too)
        return torch.zeros(shape, dtype=self.pool_dtype, device=device, pin_memory=pin)


def cache_shape(model: CausalLM, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> CacheShape:
    attn = model.layers[0].self_attn
    return CacheShape(len(model.layers), attn.num_kv_heads, attn.head_dim, block_size, dtype, kv_dtype)


class ModelRunner:
    def __init__(self, model: CausalLM, shape: CacheShape, num_blocks: int, num_host_blocks: int,
                 device: torch.device, attention_backend: str = "auto", batch_invariant: bool = False) -> None:
        self.model = model
        self.shape = shape
        self.device = device
        self.block_size = shape.block_size
        self.backend = select_backend(attention_backend, device, shape.dtype, batch_invariant)
        self.ops = select_ops(device, shape.dtype)
        self.kv_cache = shape.pool(num_blocks, device)
        self.on_cuda = device.type == "cuda"
        self.host_cache = shape.pool(num_host_blocks, torch.device("cpu"), pin=self.on_cuda) \
            if num_host_blocks else None
        # CUDA: swaps run on a side stream; a swap-out lands in a pinned staging buffer and is scattered
        # into the host pool only when the host pool is next read (the copy overlaps the forward).
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._pending_out: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None
        self.graphs = None
        self.model_time_s = 0.0
        self.timers = RunnerTimers()
        self.grammar_mask = None  # made at the first constrained row (structured outputs import xgrammar)
        # the step's block tables, kept across steps (rows as wide as the longest sequence the model takes)
        self.block_rows = BlockTableRows(-(-model.cos.shape[0] // shape.block_size))
        self._count = torch.arange(256, dtype=torch.int32)
        self.host_decode: HostDecode | None = None  # decode steps planned as host arrays (host_decode.py)

    def enable_native_layers(self) -> None:
        """On a CPU, once the linears are packed: the steps' decoder layers in one native call where the model's
        layers are what it runs (model/arch/native_layers.py), the Python loop elsewhere."""
        if self.device.type == "cpu":
            native = self.model.native_layers = NativeLayers.build(self.model, self.backend, self.ops, self.kv_cache)
            if native is not None:
                self.host_decode = HostDecode(self.model, native, self.block_rows, self.block_size)

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture decode graphs (CUDA with a graph-safe backend only); on failure stay eager."""
        from batchrun.model.runner.cuda_graphs import DecodeGraphs

        if not self.on_cuda or self.backend.name != "triton":
            return
        try:
            graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_model_len, self.block_size,
                                  self.backend, self.ops)
            graphs.capture()
            self.graphs = graphs
        except Exception as e:  # noqa: BLE001 - a capture failure must not stop the job: run eagerly
            log.warning("CUDA graph capture failed (%s); running decode steps eagerly", e)
            self.graphs = None

    # ---- block moves ---------------------------------------------------------------------------------
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([d for d, _ in pairs], device=self.device)
        dst = torch.tensor([h for _, h in pairs])
        moved = as_bytes(self.kv_cache).index_select(2, src)  # ordered before this step's forward overwrites them
        if not self.on_cuda:
            as_bytes(self.host_cache).index_copy_(2, dst, moved)
            return
        self._flush_pending_out()
        staging = torch.empty(moved.shape, dtype=moved.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            staging.copy_(moved, non_blocking=True)
            moved.record_stream(self.copy_stream)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self._pending_out = (staging, dst, done)

    def _flush_pending_out(self) -> None:
        if self._pending_out is not None:
            staging, dst, done = self._pending_out
            done.synchronize()
            as_bytes(self.host_cache).index_copy_(2, dst, staging)
            self._pending_out = None

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._flush_pending_out()
        src = torch.tensor([h for h, _ in pairs])
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        moved = as_bytes(self.host_cache).index_select(2, src)
        if not self.on_cuda:
            as_bytes(self.kv_cache).index_copy_(2, dst, moved)
            return
        moved = moved.pin_memory()
        with torch.cuda.stream(self.copy_stream):
            on_device = moved.to(self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)  # before the forward reads them
        on_device.record_stream(torch.cuda.current_stream(self.device))
        as_bytes(self.kv_cache).index_copy_(2, dst, on_device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if self.backend.name == "triton":
            from batchrun.model.layers.triton_backend import copy_blocks

            copy_blocks(self.kv_cache, pairs)
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        pool = as_bytes(self.kv_cache)
        pool.index_copy_(2, dst, pool.index_select(2, src))

    # ---- one step ------------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, ForwardContext, torch.Tensor | None]:
        """Token ids, ForwardContext and the sampling rows (None: all) of a step; block tables from persistent rows."""
        bs = self.block_size
        seqs = out.seqs
        num_seqs = len(seqs)
        starts = [s.start for s in seqs]
        decode_only = out.num_decodes == num_seqs
        if decode_only:  # one token per sequence, at its start
            input_ids = [s.token_ids[0] for s in seqs]
            qlens = [1] * num_seqs
            slens = [p + 1 for p in starts]
            num_tokens = num_seqs
        else:
            input_ids = []
            for s in seqs:
                input_ids.extend(s.token_ids)
            qlens = [len(s.token_ids) for s in seqs]
            slens = [p + q for p, q in zip(starts, qlens)]
            num_tokens = len(input_ids)
        max_seq_len = max(slens)
        block_tables = self.block_rows.gather(seqs, (max_seq_len + bs - 1) // bs)
        start_t = int64_tensor(starts)
        seq_lens = int32_tensor(slens)
        if decode_only:  # a token's slot: its block and the offset in it (host ints: each torch op costs more)
            positions = start_t
            slots = int64_tensor(decode_slots(seqs, bs))
            qsl = self._counting(num_seqs + 1)
            # the CPU kernel's rows (AttentionMetadata.query_rows): one per sequence, over its whole context
            row_seq, row_len = qsl[:num_seqs], seq_lens
        else:
            qlen_t = int64_tensor(qlens)
            qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
            torch.cumsum(qlen_t, 0, out=qsl[1:])
            seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlen_t, output_size=num_tokens)
            positions = start_t[seq_of_token] + (torch.arange(num_tokens) - qsl[:-1].long()[seq_of_token])
            slots = block_tables[seq_of_token, positions // bs].long() * bs + positions % bs
            # a row at position p attends to keys [0, p]
            row_seq, row_len = seq_of_token.to(torch.int32), (positions + 1).to(torch.int32)
        num_verifies = 0
        if decode_only and all(map(_samples, seqs)):
            logits_idx = None  # every row samples: the hidden states are the logits' rows
        else:
            # a sampling sequence's row: its last, or with drafts the one before them; then every draft's row
            rows, draft_rows, end = [], [], 0
            for s, qlen in zip(seqs, qlens):
                end += qlen
                if s.sample:
                    rows.append(end - 1 - s.num_draft)
                    if s.num_draft:
                        draft_rows.extend(range(end - s.num_draft, end))
                        num_verifies += 1
            logits_idx = int64_tensor(rows + draft_rows)

        dev = self.device
        nb = dev.type == "cuda"
        if dev.type != "cpu":  # (on a CPU .to() would only return each tensor, an op each)
            slots, block_tables, seq_lens, qsl, positions = (
                t.to(dev, non_blocking=nb) for t in (slots, block_tables, seq_lens, qsl, positions))
            if logits_idx is not None:
                logits_idx = logits_idx.to(dev, non_blocking=nb)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            num_decodes=out.num_decodes,
            max_query_len=1 if decode_only else max(qlens),
            max_seq_len=max_seq_len,
            seq_lens_host=slens,
            query_lens_host=qlens,
            row_seq=row_seq,
            row_len=row_len,
            num_verifies=num_verifies,
        )
        ids = int64_tensor(input_ids)
        if dev.type != "cpu":
            ids = ids.to(dev, non_blocking=nb)
        ctx = ForwardContext(meta, self.kv_cache, self.model.rotary(positions), self.backend, self.ops)
        return ids, ctx, logits_idx

    def _counting(self, n: int) -> torch.Tensor:
        """int32 [0, 1, ..., n - 1], a view of one kept host tensor (read-only)."""
        if self._count.shape[0] < n:
            self._count = torch.arange(max(n, 2 * self._count.shape[0]), dtype=torch.int32)
        return self._count[:n]

    def profile_forward(self, num_tokens: int) -> None:
        """One forward at the step-token budget, into a throw-away pool (CUDA memory profiling)."""
        out, nblk = profile_out(num_tokens, self.model.cos.shape[0], self.block_size)
        saved, self.kv_cache = self.kv_cache, self.shape.pool(nblk, self.device)
        try:
            self.compute_logits(out)
        finally:
            self.kv_cache = saved

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Apply block moves, run the forward, sample what out.sampling asks and score out.prompt_logprobs' rows
        (one host sync)."""
        t0 = time.perf_counter()
        plan = None
        if out.sampling:
            num_drafts = list(map(_num_draft, filter(_samples, out.seqs))) if any(map(_num_draft, out.seqs)) else None
            plan = plan_sampling(out.sampling, self.model.config.vocab_size, self.device, num_drafts)
        planned = time.perf_counter() - t0
        argmax = plan is not None and plan.argmax_only and not out.prompt_logprobs and not out.pooling
        # sampled rows drawn in the lm_head's call: no draft rows, nothing but the draws asked
        draw = plan.batch if (plan is not None and not argmax and plan.draws_only and num_drafts is None
                              and not out.prompt_logprobs and not out.pooling) else None
        logits, hidden, tokens = self._forward(out, argmax, draw)
        if tokens is not None:
            t1 = time.perf_counter()
            result = argmax_output(tokens, len(out.sampling))
            self.timers.sampling_s += planned + time.perf_counter() - t1
            return result
        prompt = pooled = None
        if out.prompt_logprobs or out.pooling:
            t = time.perf_counter()
            starts = list(itertools.accumulate((len(s.token_ids) for s in out.seqs), initial=0))
            if out.prompt_logprobs:
                prompt = score_prompts(self.model.compute_logits, hidden, out.prompt_logprobs, starts)
            if out.pooling:
                pooled = pool_rows(hidden, out.pooling, starts, self.model.classifier)
            self.timers.logits_s += time.perf_counter() - t
        if (logits is None or plan is None) and prompt is None and pooled is None:
            return StepOutput()
        t1 = time.perf_counter()
        drafts = None
        if plan is not None:
            num_sampling = len(out.sampling)
            drafts = logits[num_sampling:] if logits.shape[0] > num_sampling else None  # draft rows come last
            logits = logits[:num_sampling]
            if plan.grammars:  # filled after the forward is queued: on CUDA the fill overlaps it
                self._mask_grammar_rows(logits, plan.grammar_rows, plan.grammars)
        result = sample_step(logits, plan, drafts, prompt, pooled)
        self.timers.sampling_s += planned + time.perf_counter() - t1
        return result

    def _mask_grammar_rows(self, logits: torch.Tensor, rows: list[int], grammars: list) -> None:
        if self.grammar_mask is None:
            from batchrun.model.sampling.grammar_mask import GrammarMask

            self.grammar_mask = GrammarMask(logits.shape[-1], self.device)
        self.grammar_mask.apply(logits, rows, grammars)

    @torch.inference_mode()
    def compute_logits(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Block moves, then the forward: fp32 logits of each sampling sequence, in order, then its draft rows'."""
        return self._forward(out)[0]

    def _forward(self, out: SchedulerOutput, argmax: bool = False, draw: SamplingBatch | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | list[int] | None]:
        """compute_logits' logits, the step's hidden states (None: no forward), and with `argmax` each row's argmax
        where found without the logits (greedy_tokens, or host_decode: a list, no hidden states; logits None), with
        `draw` each row's draw (sampled_tokens)."""
        if out.swap_out:
            self.swap_out(out.swap_out)
        if out.swap_in:
            self.swap_in(out.swap_in)
        if out.copies:
            self.copy_blocks(out.copies)
        if not out.seqs:
            return None, None, None
        hidden = tokens = logits_idx = None
        host = self.host_decode  # a decode-only step is planned on the host
        if host is not None and not (out.num_decodes == len(out.seqs) and all(map(_samples, out.seqs))
                                     and not out.prompt_logprobs and not out.pooling):
            host = None
        t0 = time.perf_counter()
        if host is not None and argmax:
            tokens = host.run(out.seqs, self.kv_cache)
            if tokens is not None:
                seconds = time.perf_counter() - t0
                self.timers.forward_s += seconds  # (the greedy lm_head's time with it)
                self.model_time_s += seconds
                return None, None, tokens
        if host is not None:  # (also where the call found no greedy tokens: an fp32 model's, a NaN's step again)
            hidden = host.hidden(out.seqs, self.kv_cache)
        if hidden is None:
            ids, ctx, logits_idx = self.prepare(out)
            meta = ctx.attn
            t0 = time.perf_counter()
            if self.graphs is not None and meta.num_decodes == meta.num_seqs and self.graphs.fits(
                    meta.num_seqs, meta.max_seq_len):
                hidden = self.graphs.run(ids, ctx.positions, meta)
            elif argmax and logits_idx is None:  # every row's argmax: the model may find them in its forward
                hidden, tokens = self.model.forward_greedy(ids, ctx)
            else:
                hidden = self.model(ids, ctx)
        t1 = time.perf_counter()
        rows = hidden if logits_idx is None else hidden[logits_idx]
        if argmax and tokens is None:  # (a NaN the native call met is met here again: the logits' own path)
            tokens = self.model.greedy_tokens(rows)
        elif draw is not None:
            tokens = self.model.sampled_tokens(rows, draw)
        logits = self.model.compute_logits(rows) if tokens is None else None
        t2 = time.perf_counter()
        # (on CUDA the forward is queued, not run, by t1: the logits' time then holds most of it)
        self.timers.forward_s += t1 - t0
        self.timers.logits_s += t2 - t1
        self.model_time_s += t2 - t0
        return logits, hidden, tokens


def profile_out(num_tokens: int, max_len: int, block_size: int):
    """A SchedulerOutput of fresh prefills totalling num_tokens (for peak-memory profiling)."""
    seqs, block = [], 0
    while num_tokens > 0:
        n = min(num_tokens, max_len)
        nblk = -(-n // block_size)
        seqs.append(ScheduledSeq(len(seqs), [0] * n, 0, list(range(block, block + nblk)), True))
        block += nblk
        num_tokens -= n
    return SchedulerOutput(seqs=seqs, num_decodes=sum(1 for s in seqs if len(s.token_ids) == 1)), block
