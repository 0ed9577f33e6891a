"""A finished request group -> its RequestOutput (vLLM's shape)."""

from __future__ import annotations

from batchrun.engine.request import SequenceGroup
from batchrun.engine.stops import structured_error
from batchrun.outputs import CompletionOutput, RequestOutput


def request_output(group: SequenceGroup, tokenizer) -> RequestOutput:
    """Samples in index order; a beam search's best `beam_width` hypotheses, best first."""
    if group.beam is not None:
        prompt_len = len(group.prompt_ids)
        best = sorted(group.hypotheses, key=lambda h: h.score, reverse=True)[: group.beam.beam_width]
        outs = [CompletionOutput(index=i, text=tokenizer.decode(h.tokens[prompt_len:], skip_special_tokens=True),
                                 token_ids=h.tokens[prompt_len:], cumulative_logprob=h.cum_logprob,
                                 logprobs=None, finish_reason=h.finish_reason)
                for i, h in enumerate(best)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True)
    with_logprobs = group.params.logprobs is not None
    outs = [
        CompletionOutput(
            index=s.index, text=s.detok.text, token_ids=s.output_ids,
            cumulative_logprob=s.cumulative_logprob if with_logprobs else None,
            logprobs=s.logprobs if with_logprobs else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=structured_error(s),
        )
        for s in sorted(group.seqs, key=lambda s: s.index)
    ]
    return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True)
