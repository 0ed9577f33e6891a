"""Counters and gauges the engine keeps; LLM.metrics() reports them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineMetrics:
    num_requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    peak_kv_blocks_in_use: int = 0
    peak_running_seqs: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefix_cache_hit_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens checked, and those kept
    accepted_draft_tokens: int = 0
    model_time_s: float = 0.0
    engine_overhead_s: float = 0.0
    step_time_s: float = 0.0
    # where a step's time goes (the runner's forward, logits and sampling timers, copied after each step; the
    # engine's own scheduling and outputs: stop checks, forks, detokenizing, finished requests)
    schedule_time_s: float = 0.0
    forward_time_s: float = 0.0
    logits_time_s: float = 0.0
    sampling_time_s: float = 0.0
    outputs_time_s: float = 0.0
    kv_host_blocks_total: int = 0
    num_running: int = 0  # gauges after the last step: sequences running, waiting, swapped out
    num_waiting: int = 0
    num_swapped: int = 0
    kv_bytes_per_token: int = 0
    # running sums for the utilisation mean
    _util_sum: float = 0.0
    _util_steps: int = 0

    def observe_kv(self, live_tokens: int, blocks_in_use: int, block_size: int, running: int) -> None:
        self.kv_blocks_in_use = blocks_in_use
        self.peak_kv_blocks_in_use = max(self.peak_kv_blocks_in_use, blocks_in_use)
        self.peak_running_seqs = max(self.peak_running_seqs, running)
        if blocks_in_use:
            self._util_sum += live_tokens / (blocks_in_use * block_size)
            self._util_steps += 1

    def as_dict(self) -> dict[str, float | int]:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        # mean over steps of live tokens / (blocks in use x block_size); above 1 when blocks are shared
        d["kv_slot_utilization"] = self._util_sum / self._util_steps if self._util_steps else 0.0
        d["engine_overhead_fraction"] = self.engine_overhead_s / self.step_time_s if self.step_time_s else 0.0
        return d
