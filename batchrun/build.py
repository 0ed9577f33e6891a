"""build_engine(): EngineArgs -> the model loaded on its runner inside an Engine, the one place an engine is made
(LLM calls it; jobs, `batchrun serve` and the Ray replicas get their engines from LLM).

Every setting and the model path are checked before anything loads; on a CPU the memory is planned from the
checkpoint's headers first, so a model that cannot fit is refused in one line (batchrun.model.runner.memory)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchrun.engine.engine import Engine, EngineConfig
from batchrun.engine.pooling import prompt_only_kv_tokens
from batchrun.engine.scheduler import SchedulerConfig
from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.kernels.cpu.threads import configure_threads
from batchrun.kernels.layouts.kv_rows import KV_CACHE_DTYPES
from batchrun.model.arch.blocks import pooling_architecture
from batchrun.model.arch.registry import model_class
from batchrun.model.errors import InsufficientMemoryError
from batchrun.model.layers.backends import resolve_batch_invariant
from batchrun.model.layers.linear import few_rows_copy_bytes, prepare_cpu_linears, prepare_encoder_linears
from batchrun.model.quant.linear import LM_HEAD_SPEC, QuantSpec, quantized_params
from batchrun.model.runner.memory import (
    WORKING_BYTES,
    MemoryPlan,
    available_memory,
    checkpoint_weight_bytes,
    cpu_default_bytes,
    gib,
    held_weight_bytes,
    keep_freed_host_memory,
    kv_bytes_per_token,
    plan_cpu_memory,
    profile_cuda_kv_bytes,
)
from batchrun.model.runner.model_runner import CacheShape, ModelRunner, cache_shape
from batchrun.model.weights.loader import (
    LoadedModel,
    architecture,
    load_config,
    load_model,
    model_max_len,
    resolve_path,
)
from batchrun.model.weights.locate import check_args
from batchrun.model.weights.pooling_config import read_pooling_config
from batchrun.pooling import PoolingModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# what the scheduler's preemption cost model assumes of a device: FLOP/s of a forward, bytes/s of a block copy
DEVICE_RATES = {"cuda": (2e14, 2e10), "cpu": (5e10, 5e9)}


@dataclass
class BuiltEngine:
    engine: Engine
    tokenizer: Any
    config: Any  # the checkpoint's Hugging Face config
    model_path: str
    eos_token_ids: list[int]
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    batch_invariant: bool
    pooling: PoolingModel  # what the model pools with (every model pools; an encoder only pools)


def resolve_device(device: str) -> torch.device:
    """auto: CUDA when there is one (EngineArgs.check_environment has refused CUDA where there is none)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: Any) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; float32 on CPU (half-precision matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(config_dtype, str):
            config_dtype = DTYPES.get(config_dtype, torch.float32)
        return config_dtype if isinstance(config_dtype, torch.dtype) else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def build_engine(args: EngineArgs) -> BuiltEngine:
    source = check_args(args)
    device = resolve_device(args.device)
    configure_threads(args.num_threads)  # before the weights load: reordering them runs on these threads
    path = resolve_path(source.load_spec)
    config = load_config(path, args.trust_remote_code)  # the dtype and the memory plan need it before the weights
    dtype = resolve_dtype(args.dtype, device, getattr(config, "dtype", None))
    batch_invariant = resolve_batch_invariant(args.batch_invariant, device, dtype)
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    if getattr(model_class(architecture(config)), "is_encoder", False):
        return _encoder_engine(args, source, device, dtype, batch_invariant)
    memory = plan_memory(args, path, config, dtype, batch_invariant, kv_dtype) if device.type == "cpu" else None
    loaded = load_model(source.load_spec, dtype=dtype, device=device, max_model_len=args.max_model_len,
                        quantization=QuantSpec.parse(args.quantization), gguf_as_stored=args.quantization == "gguf",
                        quantize_lm_head=args.quantize_lm_head, calibration=args.calibration,
                        tokenizer=source.tokenizer, trust_remote_code=args.trust_remote_code)
    shape = cache_shape(loaded.model, args.block_size, dtype, kv_dtype)
    num_blocks = kv_blocks(args, memory, shape, loaded.model, device)
    num_host_blocks = args.swap_space_bytes // shape.bytes_per_block
    max_len = _max_model_len(args, loaded, num_blocks)
    log.info("KV cache: %d blocks of %d tokens (%d bytes/token in %s, %.2f GiB), %d host blocks", num_blocks,
             args.block_size, shape.bytes_per_token, str(shape.pool_dtype).removeprefix("torch."),
             num_blocks * shape.bytes_per_block / 2**30, num_host_blocks)
    runner = _runner(loaded.model, shape, num_blocks, num_host_blocks, device, args.attention_backend,
                     batch_invariant)
    n_params = sum(p.numel() for p in loaded.model.parameters()) + quantized_params(loaded.model)
    generates = args.runner != "pooling" and not loaded.model.pooling_only
    room = few_rows_room(loaded.model, memory, device, batch_invariant, generates)
    prepare_cpu_linears(loaded.model, device, dtype, batch_invariant, room, generates)
    if generates:
        keep_lm_screen(loaded.model, memory)
    runner.enable_native_layers()
    if device.type == "cpu":
        keep_freed_host_memory()
    engine_config = EngineConfig(block_size=args.block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                                 max_model_len=max_len, enable_prefix_caching=args.enable_prefix_caching,
                                 kv_bytes_per_token=shape.bytes_per_token, sliding_window=loaded.model.kv_window)
    if not args.enforce_eager:
        runner.enable_cuda_graphs(min(args.max_num_seqs, 256), max_len)
    engine = Engine(runner, loaded.tokenizer, loaded.eos_token_ids, engine_config,
                    scheduler_config(args, n_params, shape, device))
    return BuiltEngine(engine, loaded.tokenizer, loaded.config, loaded.path, loaded.eos_token_ids, max_len, device,
                       dtype, batch_invariant, pooling_model(loaded, generates))


def pooling_model(loaded: LoadedModel, generates: bool = True) -> PoolingModel:
    """What the model pools with; `generates`: the engine may also generate (not runner="pooling")."""
    model = loaded.model
    encoder = bool(getattr(model, "is_encoder", False))
    if encoder:
        labels = model.num_labels if model.has_head else None
    else:
        labels = model.score.out_features if model.score is not None else None
    default = model.default_pooling if encoder else "last"
    return PoolingModel(read_pooling_config(loaded.path, default), labels, encoder,
                        generates=generates and not encoder and not model.pooling_only)


def _encoder_engine(args: EngineArgs, source: Any, device: torch.device, dtype: torch.dtype,
                    batch_invariant: bool) -> BuiltEngine:
    """An encoder pools each prompt whole in one step and keeps no KV cache: the scheduler admits whole prompts
    within the step's token budget, over a block table of bookkeeping only."""
    from batchrun.model.runner.encoder_runner import EncoderRunner

    loaded = load_model(source.load_spec, dtype=dtype, device=device, max_model_len=args.max_model_len,
                        tokenizer=source.tokenizer, trust_remote_code=args.trust_remote_code)
    prepare_encoder_linears(loaded.model, device, dtype)
    if device.type == "cpu":
        keep_freed_host_memory()
    max_len = loaded.max_model_len
    budget = max(args.max_num_batched_tokens, max_len)
    num_blocks = -(-budget // args.block_size) + args.max_num_seqs
    engine_config = EngineConfig(block_size=args.block_size, num_blocks=num_blocks, max_model_len=max_len,
                                 enable_prefix_caching=False)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, whole_prompts=True)
    if hasattr(loaded.model, "sep_token_id"):
        loaded.model.sep_token_id = getattr(loaded.tokenizer, "sep_token_id", None)
    engine = Engine(EncoderRunner(loaded.model, device), loaded.tokenizer, (), engine_config, scheduler)
    return BuiltEngine(engine, loaded.tokenizer, loaded.config, loaded.path, [], max_len, device, dtype,
                       batch_invariant, pooling_model(loaded))


def plan_memory(args: EngineArgs, path: Path, config: Any, dtype: torch.dtype, batch_invariant: bool,
                kv_dtype: torch.dtype | None) -> MemoryPlan:
    """The CPU memory of this engine, from the checkpoint's headers and the config, before anything loads: the KV
    pool's size, or InsufficientMemoryError (one line) when the model cannot fit."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    per_token = kv_bytes_per_token(config, element_size, kv_dtype)
    kv_bytes = args.kv_cache_bytes
    if args.num_kv_blocks is not None:
        kv_bytes = args.num_kv_blocks * args.block_size * per_token
    max_len = args.max_model_len or model_max_len(config)
    kv_tokens, why = args.kv_cache_tokens, f"the job's rows ({args.kv_cache_tokens} tokens)"
    available = available_memory()
    pools_only = args.runner == "pooling" or pooling_architecture(config) is not None
    if kv_tokens is None and kv_bytes is None and pools_only:
        # an engine that only pools holds only its prompts in flight: the default, or less
        need = prompt_only_kv_tokens(args.max_num_batched_tokens, max_len, args.max_num_seqs, args.block_size)
        kv_tokens = min(need, cpu_default_bytes(available.total) // per_token)
        why = f"pooling (one step's prompts and a whole {max_len}-token prompt: {need} tokens)"
    # a tied lm_head's packed copy (none when it goes to int8: the int8 copy instead, quant.linear.LM_HEAD_SPEC)
    packs_tied = (dtype == torch.bfloat16 or batch_invariant) and not args.quantize_lm_head and not pools_only
    held = checkpoint_weight_bytes(path, element_size, QuantSpec.parse(args.quantization),
                                   gguf_as_stored=args.quantization == "gguf")
    weights = held_weight_bytes(held, element_size, config, packs_tied)
    if args.quantize_lm_head:
        weights += LM_HEAD_SPEC.held_bytes(config.vocab_size, config.hidden_size)
    memory = plan_cpu_memory(weights=weights, bytes_per_token=per_token, block_size=args.block_size,
                             max_model_len=max_len, kv_bytes=kv_bytes, kv_tokens=kv_tokens,
                             swap=args.swap_space_bytes, available=available, model=args.model)
    if args.calibration != "none":  # GPTQ holds the checkpoint whole in the dtype first (model/quant/calibration.py)
        full = checkpoint_weight_bytes(path, element_size)
        if full + WORKING_BYTES > memory.available.free:
            raise InsufficientMemoryError(
                f"calibration: {args.calibration} holds {args.model} whole in {str(dtype)[6:]} first ({gib(full)} "
                f"and {gib(WORKING_BYTES)} to work in), and this machine has {memory.available.detail}: use "
                "calibration: none (round to nearest) for this model")
    if kv_bytes is None:
        why = why if kv_tokens else "the default"
        log.info("KV cache sized for %s: %.2f GiB, beside %.2f GiB of weights (%s)", why, memory.kv / 2**30,
                 weights / 2**30, memory.available.detail)
    return memory


def kv_blocks(args: EngineArgs, memory: MemoryPlan | None, shape: CacheShape, model: torch.nn.Module,
              device: torch.device) -> int:
    """Blocks of the KV pool: the CPU memory plan's, the setting's, or what the GPU has free after a probe step."""
    if memory is not None:
        blocks = memory.kv // shape.bytes_per_block
    elif args.num_kv_blocks is not None:
        blocks = args.num_kv_blocks
    else:
        kv_bytes = args.kv_cache_bytes
        if kv_bytes is None:
            def probe() -> ModelRunner:
                return ModelRunner(model, shape, 1, 0, device, args.attention_backend)
            kv_bytes = profile_cuda_kv_bytes(probe, device, args.gpu_memory_utilization, args.max_num_batched_tokens)
        blocks = kv_bytes // shape.bytes_per_block
    if blocks < 1:
        raise EngineArgsError("kv_cache_memory", f"{args.kv_cache_memory!r} holds no block of "
                                                 f"{shape.bytes_per_block} bytes")
    return blocks


def _max_model_len(args: EngineArgs, loaded: LoadedModel, num_blocks: int) -> int:
    """The model's context, capped at what the pool holds. A model whose every layer is windowed holds about a
    window and a step's tokens of blocks per sequence (the block manager gives back the rest)."""
    max_len, window = loaded.max_model_len, loaded.model.kv_window
    needed = max_len if window is None else min(max_len, window + args.max_num_batched_tokens + 2 * args.block_size)
    if needed > num_blocks * args.block_size:
        log.warning("max_model_len %d capped at the KV cache's %d tokens", max_len, num_blocks * args.block_size)
        return num_blocks * args.block_size
    return max_len


def _runner(model: torch.nn.Module, shape: CacheShape, num_blocks: int, num_host_blocks: int, device: torch.device,
            backend: str, batch_invariant: bool) -> ModelRunner:
    try:
        return ModelRunner(model, shape, num_blocks, num_host_blocks, device, backend, batch_invariant=batch_invariant)
    except torch.OutOfMemoryError:  # on CUDA, where the pool was sized from the free memory a moment ago
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        raise InsufficientMemoryError(
            f"the KV cache of {num_blocks} blocks ({num_blocks * shape.bytes_per_block / 2**30:.2f} GiB) did not fit "
            f"on {device} ({free / 2**30:.2f} GiB free now): another process took memory since it was measured; "
            "lower engine.gpu_memory_utilization or set engine.kv_cache_memory") from None


def few_rows_room(model: torch.nn.Module, memory: MemoryPlan | None, device: torch.device,
                  batch_invariant: bool, generates: bool = True) -> bool:
    """Whether bf16 linears on oneDNN may keep a second copy of their weights for few-row steps: only where it fits
    beside the weights, the pools and the working set; else every linear is packed once, for the panel kernels."""
    extra = few_rows_copy_bytes(model, batch_invariant, generates) if device.type == "cpu" else 0
    if extra == 0 or memory is None:
        return True
    room = memory.spare >= extra
    log.info("%s (%.2f GiB; %.2f GiB spare beside the weights and the KV cache)",
             "keeping the few-row copy of the bf16 weights beside oneDNN's" if room else
             "no room for a second copy of the bf16 weights: one copy, on batchrun's panels", extra / 2**30,
             memory.spare / 2**30)
    return room


def keep_lm_screen(model: torch.nn.Module, memory: MemoryPlan | None) -> None:
    """An fp32 lm_head's bf16 screen (CausalLM.keep_lm_screen) where the model takes one and it fits beside the
    weights, the pools and the working set."""
    extra = model.lm_screen_bytes() if hasattr(model, "lm_screen_bytes") else 0
    if extra == 0:
        return
    if memory is not None and memory.spare < extra:
        log.info("no room for the lm_head's bf16 screen (%.2f GiB): the fp32 greedy tokens read the whole lm_head",
                 extra / 2**30)
        return
    model.keep_lm_screen()
    log.info("keeping a bf16 screen of the fp32 lm_head for the greedy tokens (%.2f GiB)", extra / 2**30)


def scheduler_config(args: EngineArgs, n_params: int, shape: CacheShape, device: torch.device) -> SchedulerConfig:
    flops, copy_bytes = DEVICE_RATES["cuda" if device.type == "cuda" else "cpu"]
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, flops_per_token=2.0 * n_params, bytes_per_block=shape.bytes_per_block,
        compute_flops_per_s=flops, copy_bytes_per_s=copy_bytes, num_speculative_tokens=args.num_speculative_tokens or 0,
        speculative_max_rows=args.speculative_max_rows)
