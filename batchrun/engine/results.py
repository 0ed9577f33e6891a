"""A finished request group -> its RequestOutput (vLLM's shape)."""

from __future__ import annotations

from batchrun.engine.request import SequenceGroup
from batchrun.engine.stops import structured_error
from batchrun.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput


def request_output(group: SequenceGroup, tokenizer) -> RequestOutput | PoolingRequestOutput:
    """Samples in index order; a beam search's best `beam_width` hypotheses, best first; a pooled request's
    vector as it was pooled (LLM applies the request's PoolingParams)."""
    if group.pooling is not None:
        return PoolingRequestOutput(group.request_id, PoolingOutput(group.pooling.vector), group.prompt_ids,
                                    prompt=group.prompt)
    if group.beam is not None:
        prompt_len = len(group.prompt_ids)
        best = sorted(group.hypotheses, key=lambda h: h.score, reverse=True)[: group.beam.beam_width]
        outs = [CompletionOutput(index=i, text=tokenizer.decode(h.tokens[prompt_len:], skip_special_tokens=True),
                                 token_ids=h.tokens[prompt_len:], cumulative_logprob=h.cum_logprob,
                                 logprobs=None, finish_reason=h.finish_reason)
                for i, h in enumerate(best)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True)
    params = group.params
    decode = _token_decoder(tokenizer) if params.detokenize else None
    with_logprobs = params.logprobs is not None
    outs = [
        CompletionOutput(
            index=s.index, text=s.detok.text if params.detokenize else "", token_ids=s.output_ids,
            cumulative_logprob=s.cumulative_logprob if with_logprobs else None,
            logprobs=_decoded(s.logprobs, decode) if with_logprobs else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=structured_error(s),
        )
        for s in sorted(group.seqs, key=lambda s: s.index)
    ]
    return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True,
                         prompt_logprobs=_prompt_logprobs(group, decode), num_cached_tokens=group.num_cached_tokens)


def _token_decoder(tokenizer):
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id])
        return text

    return decode


def _decoded(entries: list[dict[int, Logprob]], decode) -> list[dict[int, Logprob]]:
    if decode is None:
        return entries
    return [{t: Logprob(lp, lp.rank, decode(t)) for t, lp in entry.items()} for entry in entries]


def _prompt_logprobs(group: SequenceGroup, decode) -> list[dict[int, Logprob] | None] | None:
    """None for the prompt tokens before score_from (the first at least), then {its token: Logprob, and the K most
    likely: Logprob} per position."""
    if group.prompt_scores is None:
        return None
    out: list[dict[int, Logprob] | None] = [None] * group.score_from
    for target, (logprob, rank, top_ids, top_lps) in zip(group.prompt_ids[group.score_from:], group.prompt_scores):
        entry = {target: Logprob(logprob, rank, decode(target) if decode else None)}
        for r, (t, lp) in enumerate(zip(top_ids, top_lps), start=1):
            if t not in entry:
                entry[t] = Logprob(lp, r, decode(t) if decode else None)
        out.append(entry)
    return out
