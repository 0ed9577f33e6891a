"""LLM: the offline Python API, with vLLM's names so a vLLM user changes one import."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchrun.beam_search import BeamSearchOutput, BeamSearchParams
from batchrun.build import build_engine
from batchrun.chat import render_conversations
from batchrun.collect import beam_search_output, in_input_order
from batchrun.engine_args import EngineArgs
from batchrun.inputs import TokensPrompt, check_lora_request
from batchrun.llm_args import engine_args
from batchrun.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from batchrun.pooling import POOLED, cosine, truncate
from batchrun.pooling_params import PoolingParams
from batchrun.prompts import (
    PreparedRequest,
    PromptInput,
    derive_seed,
    prepare_requests,
    prompt_problem,
    tokenize_prompt,
)
from batchrun.sampling_params import SamplingParams, scores_prompt

log = logging.getLogger(__name__)


class LLM:
    """Load a model once, then generate for batches of prompts.

    `LLM(model, **kwargs)` takes EngineArgs' fields as keyword arguments (see batchrun.engine_args for each
    one's default and rule) and vLLM's constructor arguments (batchrun.llm_args: each honoured, accepted where it
    changes nothing here, or refused), or `LLM(EngineArgs(...))` / `LLM.from_engine_args(args)` the settings whole.
    Every setting and the model path are checked before anything loads (ValueError naming the argument)."""

    def __init__(self, model: str | EngineArgs, **kwargs: Any) -> None:
        args = engine_args(model, kwargs)
        built = build_engine(args)
        self.args, self.seed = args, args.seed
        self.engine, self.tokenizer, self.config = built.engine, built.tokenizer, built.config
        self.model_path, self.eos_token_ids = built.model_path, built.eos_token_ids
        self.max_model_len = built.max_model_len
        self.device, self.dtype, self.batch_invariant = built.device, built.dtype, built.batch_invariant
        self.pooling = built.pooling
        self._pooled: dict[str, tuple[str, PoolingParams]] = {}  # request id -> (task, params) of pooled requests
        self._requests = 0
        self._structured = None  # batchrun.structured's compiler, made at the first structured request

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(args)

    # ---- vLLM's views of the loaded model ---------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer prompts are tokenized with (transformers')."""
        return self.tokenizer

    @functools.cached_property
    def llm_engine(self) -> LLMEngine:
        """vLLM's `llm.llm_engine`: its `model_config` and `tokenizer`, what clients read of it."""
        return LLMEngine(self)

    # ---- inputs (batchrun/prompts.py) ------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput, where: str) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.config.vocab_size, prompt, where)

    def check_prompt(self, prompt_token_ids: list[int], scored: bool = False) -> str | None:
        """None when the prompt can run, else a one-line reason (for a row error); `scored`: see prompt_problem."""
        return prompt_problem(prompt_token_ids, self.max_model_len, scored)

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
                                lambda ids, params: self.check_prompt(ids, scores_prompt(params)) or self.check_structured(params))

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: PromptInput | list[PromptInput] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None, *,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is checked before anything runs. `lora_request`: None (adapters are
        refused); `prompt_token_ids`: vLLM's older way to give TokensPrompts."""
        check_lora_request(lora_request)
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("give prompts or prompt_token_ids, not both")
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        if prompts is None:
            raise ValueError("prompts is missing: give at least one prompt")
        self._check_generates()
        requests = self._prepare(prompts, sampling_params)
        stream = ((i, {"prompt_token_ids": r.prompt_token_ids, "prompt": r.prompt}, r.params)
                  for i, r in enumerate(requests))
        finished = self.stream(stream, max_in_flight=len(requests), _checked=True)
        return in_input_order(finished, len(requests), desc="generate", use_tqdm=use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: Any = None, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation ([{role, content}, ...]) or a list of them (vLLM's `chat`).

        Each conversation is rendered with the tokenizer's chat template (or `chat_template`), then runs as
        `generate` on the rendered text; the template already holds the special tokens, so none are added.
        `continue_final_message` extends the last (assistant) message instead of opening a new one.
        `lora_request`: None (adapters are refused)."""
        check_lora_request(lora_request)
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
        self._check_generates()
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
                        reason = self.check_prompt(ids, scores_prompt(sp))
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

    def _check_generates(self) -> None:
        if not self.pooling.generates:
            why = "it was made with runner='pooling'" if self.args.runner == "pooling" \
                else "it has no language-model head"
            raise ValueError(f"this model pools only ({why}): it runs {', '.join(self.pooling.tasks())}")

    # ---- stepping: what the job layer drives (batchrun.pipeline.engine_api.JobEngine) -------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, score_from: int = 1) -> None:
        """Queue one request whose prompt passed `check_prompt`; `step()` hands it back as a RequestOutput
        with this `request_id` (the caller's, unique among those in flight). Without `params.seed`, its
        random stream derives from the LLM's seed and the number of requests added before it. `score_from`: with
        `prompt_logprobs`, the first prompt token scored (a loglikelihood row's continuation: its context may come
        from the prefix cache)."""
        self._check_generates()
        _, ids = self._tokenize({"prompt_token_ids": prompt_token_ids}, f"request {request_id!r}")  # in the vocab?
        seed = params.seed if params.seed is not None else derive_seed(self.seed, self._requests)
        grammar = self._grammar(params, f"request {request_id!r}")
        self.engine.add_request(request_id, prompt, ids, params, seed, grammar=grammar, score_from=score_from)
        self._requests += 1

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], task: str, params: PoolingParams,
                            *, prompt: str | None = None) -> None:
        """Queue one prompt to pool for `task` (embed, classify, reward, score, encode); `step()` hands it back as a
        PoolingRequestOutput whose vector is the task's answer."""
        self.pooling.check(task)
        state = self.pooling.state(task, params)
        _, ids = self._tokenize({"prompt_token_ids": prompt_token_ids}, f"request {request_id!r}")
        self.engine.add_request(request_id, prompt, ids, POOLED, 0, pooling=state)
        self._pooled[request_id] = (task, params)
        self._requests += 1

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step; the requests that finished in it."""
        finished = self.engine.step()
        if self._pooled:
            for out in finished:
                if isinstance(out, PoolingRequestOutput):
                    task, params = self._pooled.pop(out.request_id)
                    out.outputs = PoolingOutput(self.pooling.finish(task, params, out.outputs.data))
        return finished

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort_all(self) -> None:
        """Drop every request in flight and free its KV blocks."""
        self._pooled.clear()
        self.engine.abort_all()

    # ---- pooling: vLLM's embed / classify / score / reward / encode --------------------------------
    def encode(self, prompts: PromptInput | list[PromptInput], pooling_params: PoolingParams | list[PoolingParams]
               | None = None, *, use_tqdm: bool = True, lora_request: Any = None, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None, tokenization_kwargs: dict | None = None
               ) -> list[PoolingRequestOutput]:
        """Pool each prompt for `pooling_task` (None: embed, or classify for a classifier); outputs in input
        order, `outputs.data` the task's vector. Every prompt is checked before anything runs."""
        check_lora_request(lora_request)
        task = pooling_task or ("classify" if self.pooling.num_labels else "embed")
        self.pooling.check(task)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        params = pooling_params if isinstance(pooling_params, list) else [pooling_params or PoolingParams()] * \
            len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params has {len(params)} entries for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [PoolingParams(**{**vars(p), "truncate_prompt_tokens": truncate_prompt_tokens}) for p in params]
        kwargs = tokenization_kwargs or {}
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            where = f"prompts[{i}]"
            if not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params[{i}]: expected a PoolingParams, got {type(p).__name__}")
            self.pooling.state(task, p)  # its checks, before anything runs
            if kwargs and isinstance(prompt, str):
                text, ids = prompt, self.tokenizer(prompt, **kwargs).input_ids
            else:
                text, ids = self._tokenize(prompt, where)
            ids = truncate(ids, p, self.max_model_len)
            reason = self.check_prompt(ids, scored=True)
            if reason:
                raise ValueError(f"{where}: {reason}")
            requests.append((text, ids, p))
        return self._pool(requests, task, use_tqdm)

    def _pool(self, requests: list[tuple[str | None, list[int], PoolingParams]], task: str,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        index: dict[str, int] = {}
        for i, (text, ids, p) in enumerate(requests):
            rid = f"{self._requests}"
            self.add_pooling_request(rid, ids, task, p, prompt=text)
            index[rid] = i

        return in_input_order(self._drain(index), len(requests), desc=task, use_tqdm=use_tqdm)

    def embed(self, prompts: PromptInput | list[PromptInput], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request: Any = None,
              truncate_prompt_tokens: int | None = None, tokenization_kwargs: dict | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), pooled as the checkpoint says (sentence-transformers'
        Pooling / Normalize, else the last token, normalised)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="embed", truncate_prompt_tokens=truncate_prompt_tokens,
                           tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data), o.prompt_token_ids)
                for o in outs]

    def classify(self, prompts: PromptInput | list[PromptInput], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request: Any = None,
                 truncate_prompt_tokens: int | None = None, tokenization_kwargs: dict | None = None
                 ) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities per prompt (`outputs.probs`: softmax, sigmoid for one label)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify", truncate_prompt_tokens=truncate_prompt_tokens,
                           tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data), o.prompt_token_ids)
                for o in outs]

    def reward(self, prompts: PromptInput | list[PromptInput], *, use_tqdm: bool = True,
               pooling_params: PoolingParams | list[PoolingParams] | None = None, lora_request: Any = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """A reward model's raw head outputs per prompt (`outputs.data`)."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="reward", truncate_prompt_tokens=truncate_prompt_tokens)

    def score(self, data_1: str | list[str], data_2: str | list[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: Any = None,
              truncate_prompt_tokens: int | None = None, chat_template: str | None = None
              ) -> list[ScoringRequestOutput]:
        """A score per pair (1 -> 1, 1 -> N or N -> N): a cross-encoder's (one-label classifier over the pair,
        sigmoid) or the cosine of the two texts' embeddings. `chat_template`: None (pairs are not templated)."""
        if chat_template is not None:
            raise ValueError("score: chat_template is not supported (a pair is the tokenizer's pair encoding)")
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1 and len(second) > 1:
            first = first * len(second)
        if len(first) != len(second) or not first:
            raise ValueError(f"score: {len(first)} first texts for {len(second)} second texts (give 1 -> 1, "
                             "1 -> N or N -> N)")
        for name, texts in (("data_1", first), ("data_2", second)):
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"score: {name}[{bad}] is not a string")
        p = pooling_params or PoolingParams()
        if self.pooling.scores_by_head():
            ids = self.tokenizer(first, second, truncation=False)["input_ids"]
            outs = self.encode([{"prompt_token_ids": list(x)} for x in ids], p, use_tqdm=use_tqdm,
                               lora_request=lora_request, pooling_task="score",
                               truncate_prompt_tokens=truncate_prompt_tokens)
            scores = [o.outputs.data[0] for o in outs]
        else:
            self.pooling.check("score")
            embedded = self.encode(first + second, p, use_tqdm=use_tqdm, lora_request=lora_request,
                                   pooling_task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
            n = len(first)
            outs = embedded[n:]
            scores = [cosine(a.outputs.data, b.outputs.data) for a, b in zip(embedded[:n], embedded[n:])]
        return [ScoringRequestOutput(o.request_id, ScoringOutput(s), o.prompt_token_ids) for o, s in zip(outs, scores)]

    def beam_search(self, prompts: PromptInput | list[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt, in input order. The beams are forked sequences in the engine sharing
        KV blocks (copy-on-write), all prompts batched together."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        self._check_generates()
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

        finished = ((i, beam_search_output(requests[i].prompt_token_ids, out)) for i, out in self._drain(ids))
        return in_input_order(finished, len(requests), desc="beam search", use_tqdm=use_tqdm)

    def _drain(self, ids: dict[str, int]) -> Iterator[tuple[int, Any]]:
        """(index, output) of the requests in `ids` (request id -> index), in completion order, stepping until all
        are back; abandoned half way, every request in flight is dropped."""
        try:
            while self.engine.has_unfinished():
                for out in self.step():
                    yield ids.pop(out.request_id), out
        finally:
            if ids:
                self.abort_all()

    def metrics(self) -> dict[str, float | int]:
        return self.engine.metrics_dict()


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's `llm.llm_engine.model_config`: the loaded model as clients read it (the chat template is the
    tokenizer's: `llm.get_tokenizer().chat_template`)."""

    model: str  # as given to LLM
    tokenizer: str  # the tokenizer as given (the model's when none was)
    tokenizer_mode: str
    trust_remote_code: bool
    revision: str | None
    tokenizer_revision: str | None
    dtype: Any  # a torch.dtype
    seed: int
    max_model_len: int  # the engine's: the model's limit, or max_model_len, capped at what the KV cache holds
    quantization: str | None  # None when the weights are plain
    enforce_eager: bool
    hf_config: Any = field(repr=False)  # the checkpoint's transformers config

    @property
    def hf_text_config(self) -> Any:
        return self.hf_config

    @property
    def served_model_name(self) -> str:
        return self.model

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_sliding_window(self) -> int | None:
        return getattr(self.hf_config, "sliding_window", None)


class LLMEngine:
    """vLLM's `llm.llm_engine`, the parts clients read: `model_config`, `tokenizer`, `get_tokenizer()`."""

    def __init__(self, llm: LLM) -> None:
        args = llm.args
        self.model_config = ModelConfig(
            model=args.model, tokenizer=args.tokenizer or args.model, tokenizer_mode="auto",
            trust_remote_code=args.trust_remote_code, revision=args.revision,
            tokenizer_revision=args.tokenizer_revision if args.tokenizer_revision is not None else args.revision,
            dtype=llm.dtype, seed=args.seed, max_model_len=llm.max_model_len,
            quantization=None if args.quantization == "none" else args.quantization,
            enforce_eager=args.enforce_eager, hf_config=llm.config)
        self.tokenizer = llm.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.model_config
