"""LLM: the offline Python API, with vLLM's names so a vLLM user changes one import."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from batchrun.beam_search import BeamSearchOutput, BeamSearchParams
from batchrun.chat import render_conversations
from batchrun.collect import beam_search_output, in_input_order
from batchrun.engine.engine import Engine, EngineConfig
from batchrun.engine.scheduler import SchedulerConfig
from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.kernels.cpu.linears import bf16_kernel
from batchrun.kernels.cpu.threads import configure_threads
from batchrun.kernels.layouts.kv_rows import KV_CACHE_DTYPES
from batchrun.model.errors import InsufficientMemoryError
from batchrun.model.layers.backends import resolve_batch_invariant
from batchrun.model.layers.linear import few_rows_copy_bytes, own_kernel, reorder_linears, use_onednn
from batchrun.model.quant.linear import LM_HEAD_SPEC, QuantSpec, quantized_params
from batchrun.model.runner.memory import (
    WORKING_BYTES,
    MemoryPlan,
    available_memory,
    checkpoint_weight_bytes,
    gib,
    held_weight_bytes,
    kv_bytes_per_token,
    plan_cpu_memory,
    profile_cuda_kv_bytes,
)
from batchrun.model.runner.model_runner import ModelRunner, cache_shape
from batchrun.model.weights.loader import load_config, load_model, model_max_len, resolve_path
from batchrun.model.weights.locate import locate_model
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


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _resolve_device(device: str) -> torch.device:
    """auto: CUDA when there is one. (EngineArgs.check_environment has refused CUDA where there is none.)"""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; float32 on CPU (half-precision matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(config_dtype, str):
            config_dtype = _DTYPES.get(config_dtype, torch.float32)
        return config_dtype if isinstance(config_dtype, torch.dtype) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


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
        args.check_environment()
        source = locate_model(args.model)  # the checks `batchrun validate` makes, before anything loads
        source.check_max_model_len(args.max_model_len)
        source.check_quantization(args.quantization)
        source.check_calibration(args.calibration)
        self.args = args
        num_kv_blocks = args.num_kv_blocks
        kv_bytes = args.kv_cache_bytes
        swap_bytes = args.swap_space_bytes
        self.device = _resolve_device(args.device)
        configure_threads(args.num_threads)  # before the weights load: reordering them runs on these threads
        self.seed = args.seed
        self._requests = 0

        path = resolve_path(source.load_spec)
        cfg = load_config(path)  # the dtype decision and the memory check need the config before the weights
        self.dtype = _resolve_dtype(args.dtype, self.device, getattr(cfg, "dtype", None))
        self.batch_invariant = resolve_batch_invariant(args.batch_invariant, self.device, self.dtype)
        self.kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
        block_size = args.block_size
        memory = self._plan_memory(args, path, cfg) if self.device.type == "cpu" else None  # refuses what can't fit
        loaded = load_model(source.load_spec, dtype=self.dtype, device=self.device, max_model_len=args.max_model_len,
                            quantization=QuantSpec.parse(args.quantization),
                            gguf_as_stored=args.quantization == "gguf", quantize_lm_head=args.quantize_lm_head,
                            calibration=args.calibration)
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        shape = cache_shape(loaded.model, block_size, self.dtype, self.kv_dtype)

        if memory is not None:
            num_kv_blocks = memory.kv // shape.bytes_per_block
        elif num_kv_blocks is None:
            if kv_bytes is None:
                def probe():
                    return ModelRunner(loaded.model, shape, 1, 0, self.device, args.attention_backend)
                kv_bytes = profile_cuda_kv_bytes(probe, self.device, args.gpu_memory_utilization,
                                                 args.max_num_batched_tokens)
            num_kv_blocks = kv_bytes // shape.bytes_per_block
        if num_kv_blocks < 1:
            raise EngineArgsError("kv_cache_memory", f"{args.kv_cache_memory!r} holds no block of "
                                                     f"{shape.bytes_per_block} bytes")
        num_host_blocks = swap_bytes // shape.bytes_per_block
        self.max_model_len = loaded.max_model_len
        window = loaded.model.kv_window
        # a sequence of a model whose every layer is windowed holds about window + a step's tokens of blocks
        # (the block manager gives back the rest), so the pool need not hold max_model_len tokens
        needed = self.max_model_len if window is None else min(
            self.max_model_len, window + args.max_num_batched_tokens + 2 * block_size)
        if needed > num_kv_blocks * block_size:
            log.warning("max_model_len %d capped at the KV cache's %d tokens", self.max_model_len,
                        num_kv_blocks * block_size)
            self.max_model_len = num_kv_blocks * block_size
        log.info("KV cache: %d blocks of %d tokens (%d bytes/token in %s, %.2f GiB), %d host blocks", num_kv_blocks,
                 block_size, shape.bytes_per_token, str(shape.pool_dtype).removeprefix("torch."),
                 num_kv_blocks * shape.bytes_per_block / 2**30, num_host_blocks)

        try:
            runner = ModelRunner(loaded.model, shape, num_kv_blocks, num_host_blocks, self.device,
                                 args.attention_backend, batch_invariant=self.batch_invariant)
        except torch.OutOfMemoryError:  # on CUDA, where the pool was sized from the free memory a moment ago
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            raise InsufficientMemoryError(
                f"the KV cache of {num_kv_blocks} blocks ({num_kv_blocks * shape.bytes_per_block / 2**30:.2f} GiB) "
                f"did not fit on {self.device} ({free / 2**30:.2f} GiB free now): another process took memory "
                f"since it was measured; lower engine.gpu_memory_utilization or set engine.kv_cache_memory") from None
        n_params = sum(p.numel() for p in loaded.model.parameters()) + quantized_params(loaded.model)
        room = self._few_rows_room(loaded.model, memory)
        if use_onednn(loaded.model, self.device, self.dtype, self.batch_invariant, room):
            kernel = "oneDNN"
            if own_kernel(loaded.model, self.batch_invariant, room):
                kernel = f"batchrun's panel kernel ({bf16_kernel()})" if self.dtype == torch.bfloat16 else \
                    "batchrun's panel kernel"
            log.info("%d linear layers reordered for %s%s (see batchrun/model/layers/linear.py)",
                     reorder_linears(loaded.model, self.batch_invariant, room), kernel,
                     ", batch invariant" if self.batch_invariant else "")
        on_cuda = self.device.type == "cuda"
        num_speculative = args.num_speculative_tokens or 0
        sched_cfg = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            preemption_mode=args.preemption_mode, flops_per_token=2.0 * n_params,
            bytes_per_block=shape.bytes_per_block,
            compute_flops_per_s=2e14 if on_cuda else 5e10, copy_bytes_per_s=2e10 if on_cuda else 5e9,
            num_speculative_tokens=num_speculative, speculative_max_rows=args.speculative_max_rows,
        )
        eng_cfg = EngineConfig(block_size=block_size, num_blocks=num_kv_blocks, num_host_blocks=num_host_blocks,
                               max_model_len=self.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                               kv_bytes_per_token=shape.bytes_per_token, sliding_window=window)
        if not args.enforce_eager:
            runner.enable_cuda_graphs(min(args.max_num_seqs, 256), self.max_model_len)
        self.engine = Engine(runner, self.tokenizer, loaded.eos_token_ids, eng_cfg, sched_cfg)
        self.eos_token_ids = loaded.eos_token_ids
        self._structured = None  # batchrun.structured's compiler, made at the first structured request

    def _plan_memory(self, args: EngineArgs, path, config) -> MemoryPlan:
        """The CPU memory of this engine, from the checkpoint's headers and the config, before anything loads:
        the KV pool's size, or InsufficientMemoryError (one line) when the model cannot fit (batchrun.model.runner.memory)."""
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        per_token = kv_bytes_per_token(config, element_size, self.kv_dtype)
        kv_bytes = args.kv_cache_bytes
        if args.num_kv_blocks is not None:
            kv_bytes = args.num_kv_blocks * args.block_size * per_token
        max_len = args.max_model_len or model_max_len(config)
        # a tied lm_head's packed copy (none when it goes to int8: the int8 copy instead, quant_linear.LM_HEAD_SPEC)
        packs_tied = (self.dtype == torch.bfloat16 or self.batch_invariant) and not args.quantize_lm_head
        held = checkpoint_weight_bytes(path, element_size, QuantSpec.parse(args.quantization),
                                       gguf_as_stored=args.quantization == "gguf")
        weights = held_weight_bytes(held, element_size, config, packs_tied)
        if args.quantize_lm_head:
            weights += LM_HEAD_SPEC.held_bytes(config.vocab_size, config.hidden_size)
        memory = plan_cpu_memory(weights=weights, bytes_per_token=per_token, block_size=args.block_size,
                                 max_model_len=max_len, kv_bytes=kv_bytes, kv_tokens=args.kv_cache_tokens,
                                 swap=args.swap_space_bytes, available=available_memory(), model=args.model)
        if args.calibration != "none":  # GPTQ holds the checkpoint whole in the dtype first (model/quant/calibration.py)
            full = checkpoint_weight_bytes(path, element_size)
            if full + WORKING_BYTES > memory.available.free:
                raise InsufficientMemoryError(
                    f"calibration: {args.calibration} holds {args.model} whole in {str(self.dtype)[6:]} first ({gib(full)} "
                    f"and {gib(WORKING_BYTES)} to work in), and this machine has {memory.available.detail}: use "
                    "calibration: none (round to nearest) for this model")
        if kv_bytes is None:
            why = f"the job's rows need {args.kv_cache_tokens} tokens" if args.kv_cache_tokens else "the default"
            log.info("KV cache sized for %s: %.2f GiB, beside %.2f GiB of weights (%s)", why, memory.kv / 2**30,
                     weights / 2**30, memory.available.detail)
        return memory

    def _few_rows_room(self, model, memory: MemoryPlan | None) -> bool:
        """Whether bf16 linears on oneDNN may keep a second copy of their weights for few-row steps (cpu_linear:
        faster decode tails): only where it fits what is left beside the weights, the pools and the working set;
        else every linear is packed once, for batchrun's panels."""
        extra = few_rows_copy_bytes(model, self.batch_invariant) if self.device.type == "cpu" else 0
        if extra == 0 or memory is None:
            return True
        room = memory.spare >= extra
        log.info("%s (%.2f GiB; %.2f GiB spare beside the weights and the KV cache)",
                 "keeping the few-row copy of the bf16 weights beside oneDNN's" if room else
                 "no room for a second copy of the bf16 weights: one copy, on batchrun's panels", extra / 2**30,
                 memory.spare / 2**30)
        return room

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
