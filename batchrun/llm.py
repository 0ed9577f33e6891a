"""LLM: the offline Python API, with vLLM's names so a vLLM user changes one import."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from batchrun.beam_search import BeamSearchOutput, BeamSearchParams
from batchrun.build import build_engine
from batchrun.chat import render_conversations
from batchrun.collect import beam_search_output, in_input_order
from batchrun.engine_args import EngineArgs
from batchrun.outputs import RequestOutput
from batchrun.prompts import (
    PreparedRequest,
    PromptInput,
    derive_seed,
    prepare_requests,
    prompt_problem,
    tokenize_prompt,
)
from batchrun.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """Load a model once, then generate for batches of prompts.

    `LLM(model, **kwargs)` takes EngineArgs' fields as keyword arguments (see batchrun.engine_args for each
    one's default and rule), or `LLM(EngineArgs(...))` / `LLM.from_engine_args(args)` the settings whole.
    Every setting and the model path are checked before anything loads (ValueError naming the field).
    """

    def __init__(self, model: str | EngineArgs, **kwargs: Any) -> None:
        if isinstance(model, EngineArgs):
            args = dataclasses.replace(model, **kwargs) if kwargs else model
        else:
            args = EngineArgs(model, **kwargs)
        built = build_engine(args)
        self.args, self.seed = args, args.seed
        self.engine, self.tokenizer, self.config = built.engine, built.tokenizer, built.config
        self.model_path, self.eos_token_ids = built.model_path, built.eos_token_ids
        self.max_model_len = built.max_model_len
        self.device, self.dtype, self.batch_invariant = built.device, built.dtype, built.batch_invariant
        self._requests = 0
        self._structured = None  # batchrun.structured's compiler, made at the first structured request

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(args)

    # ---- inputs (batchrun/prompts.py) ------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput, where: str) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.config.vocab_size, prompt, where)

    def check_prompt(self, prompt_token_ids: list[int]) -> str | None:
        """None when the prompt can run, else a one-line reason (for a row error)."""
        return prompt_problem(prompt_token_ids, self.max_model_len)

    # ---- structured outputs ----------------------------------------------------------------------
    @property
    def structured(self):
        """The grammar compiler of this model (batchrun.structured.compiler.StructuredOutputs)."""
        if self._structured is None:
            from batchrun.structured.compiler import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, self.config.vocab_size, self.eos_token_ids,
                                                 timeout_s=self.args.grammar_compile_timeout_s)
        return self._structured

    def check_structured(self, params: SamplingParams) -> str | None:
        """None when the request's structured output (if any) compiles, else a one-line reason (for a row
        error). Compiled grammars are cached, so the request then starts at once."""
        if params.structured_outputs is None:
            return None
        return self.structured.check(params.structured_outputs)

    def _grammar(self, params: SamplingParams, where: str):
        """A fresh matcher for a structured-output request, None for the others."""
        if params.structured_outputs is None:
            return None
        from batchrun.structured.compiler import StructuredOutputError

        try:
            return self.structured.matcher(params.structured_outputs)
        except StructuredOutputError as e:
            raise ValueError(f"{where}: structured_outputs: {e}") from None

    def _prepare(self, prompts, sampling_params) -> list[PreparedRequest]:
        return prepare_requests(prompts, sampling_params, self._tokenize,
                                lambda ids, params: self.check_prompt(ids) or self.check_structured(params))

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptInput | list[PromptInput],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is checked before anything runs."""
        requests = self._prepare(prompts, sampling_params)
        stream = ((i, {"prompt_token_ids": r.prompt_token_ids, "prompt": r.prompt}, r.params)
                  for i, r in enumerate(requests))
        finished = self.stream(stream, max_in_flight=len(requests), _checked=True)
        return in_input_order(finished, len(requests), desc="generate", use_tqdm=use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation ([{role, content}, ...]) or a list of them (vLLM's `chat`).

        Each conversation is rendered with the tokenizer's chat template (or `chat_template`), then runs as
        `generate` on the rendered text; the template already holds the special tokens, so none are added.
        `continue_final_message` extends the last (assistant) message instead of opening a new one."""
        prompts = render_conversations(self.tokenizer, messages, model_path=self.model_path,
                                       chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, items: Iterable[tuple[Any, PromptInput, SamplingParams]], *, max_in_flight: int = 1024,
               _checked: bool = False) -> Iterator[tuple[Any, RequestOutput]]:
        """Pull (key, prompt, params) lazily, keep at most max_in_flight requests in the engine, and yield
        (key, finished RequestOutput) in completion order. A prompt that cannot run raises ValueError:
        callers that want row errors ask `check_prompt` first. (The job runner drives the engine itself,
        through add_request / step below.)"""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        engine = self.engine
        source = iter(items)
        keys: dict[str, Any] = {}
        exhausted = False
        index = 0
        try:
            while True:
                while not exhausted and len(keys) < max_in_flight:
                    try:
                        key, prompt, sp = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    text, ids = self._tokenize(prompt, f"request {key!r}")
                    if not _checked:
                        reason = self.check_prompt(ids)
                        if reason:
                            raise ValueError(f"request {key!r}: {reason}")
                    rid = f"{self._requests}"
                    seed = sp.seed if sp.seed is not None else derive_seed(self.seed, index)
                    engine.add_request(rid, text, ids, sp, seed, grammar=self._grammar(sp, f"request {key!r}"))
                    keys[rid] = key
                    self._requests += 1
                    index += 1
                if not engine.has_unfinished():
                    return
                for out in engine.step():
                    yield keys.pop(out.request_id), out
        finally:
            if keys:  # abandoned half way (an exception, or the caller stopped iterating)
                engine.abort_all()

    # ---- stepping: what the job layer drives (batchrun.pipeline.engine_api.JobEngine) -------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None) -> None:
        """Queue one request whose prompt passed `check_prompt`; `step()` hands it back as a RequestOutput
        with this `request_id` (the caller's, unique among those in flight). Without `params.seed`, its
        random stream derives from the LLM's seed and the number of requests added before it."""
        _, ids = self._tokenize({"prompt_token_ids": prompt_token_ids}, f"request {request_id!r}")  # in the vocab?
        seed = params.seed if params.seed is not None else derive_seed(self.seed, self._requests)
        grammar = self._grammar(params, f"request {request_id!r}")
        self.engine.add_request(request_id, prompt, ids, params, seed, grammar=grammar)
        self._requests += 1

    def step(self) -> list[RequestOutput]:
        """One engine step; the requests that finished in it."""
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort_all(self) -> None:
        """Drop every request in flight and free its KV blocks."""
        self.engine.abort_all()

    def beam_search(self, prompts: PromptInput | list[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt, in input order. The beams are forked sequences in the engine sharing
        KV blocks (copy-on-write), all prompts batched together."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        carrier = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens, temperature=0.0,
                                 ignore_eos=params.ignore_eos)
        requests = self._prepare(prompts, carrier)
        engine = self.engine
        ids = {}
        for i, r in enumerate(requests):
            rid = f"{self._requests}"
            self._requests += 1
            engine.add_request(rid, r.prompt, r.prompt_token_ids, r.params, derive_seed(self.seed, i), beam=params)
            ids[rid] = i

        def finished():
            try:
                while engine.has_unfinished():
                    for out in engine.step():
                        i = ids.pop(out.request_id)
                        yield i, beam_search_output(requests[i].prompt_token_ids, out)
            finally:
                if ids:
                    engine.abort_all()

        return in_input_order(finished(), len(requests), desc="beam search", use_tqdm=use_tqdm)

    def metrics(self) -> dict[str, float | int]:
        return self.engine.metrics_dict()
