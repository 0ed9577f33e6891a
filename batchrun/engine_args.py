"""EngineArgs: every model and engine setting, declared once with its default, type, rule and user doc (`doc=`,
rendered into docs/jobs.md). `LLM(model, **kwargs)` and the job file's `model:` and `engine:` sections derive from
it. No torch import, so `batchrun validate` stays light: only check_environment imports it, when it must."""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


class EngineArgsError(ValueError):
    """A bad model or engine setting: `field` is the EngineArgs field, `problem` what is wrong with it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.field = name
        self.problem = problem


# ---------------------------------------------------------------- sizes


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | str | None) -> int | None:
    """Bytes from an int or a size like '2GiB' or '1.5GB' (K/M/G/T: powers of 1000, Ki/Mi/Gi/Ti: of 1024)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


# ---------------------------------------------------------------- rules


def show(value: Any) -> str:
    """A value as a message shows it: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Rule:
    """What one setting may be. `problem(value)` says what is wrong, or None; the caller adds the name."""

    default: Any = None
    kind: str = "any"  # str | int | number | bool | size | device (and the job file's own kinds, config.Key)
    choices: tuple = ()
    nullable: bool = False
    min: float | None = None
    max: float | None = None
    required: bool = False
    power_of_two: bool = False
    # what the setting means, for a user: docs/jobs.md is generated from it (docs/gen_jobs.py), so it is written here
    doc: str = field(default="", compare=False)

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must not be null"
        why = self.kind_problem(value)
        if why:
            return why
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.min is not None and value < self.min:
                return f"must be >= {self.min:g}, got {value}"
            if self.max is not None and value > self.max:
                return f"must be <= {self.max:g}, got {value}"
            if self.power_of_two and value & (value - 1):
                return f"must be a power of two, got {value}"
        return None

    def kind_problem(self, value: Any) -> str | None:
        kind = self.kind
        if kind == "str":
            if not isinstance(value, str):
                return f"expected a string, got {show(value)}"
            if not value.strip():
                return "must not be empty"
        elif kind == "device":
            if not isinstance(value, str) or not _DEVICE_RE.fullmatch(value):
                return f"must be auto, cpu, cuda or cuda:N, got {value!r}"
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                return f"expected an integer, got {show(value)}"
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                return f"expected a number, got {show(value)}"
        elif kind == "bool":
            if not isinstance(value, bool):
                return f"expected true or false, got {show(value)}"
        elif kind == "size":
            try:
                size = parse_size(value)
            except ValueError:
                return f"expected a byte count or a size like '4GiB', got {show(value)}"
            if size is not None and size < 0:
                return f"must be >= 0, got {value}"
        return None


def _setting(default: Any, kind: str, job_key: str | None, **rule: Any) -> Any:
    """A dataclass field carrying its Rule and the job-file key it is known by (None: not in job files)."""
    required = default is MISSING
    spec = Rule(None if required else default, kind, required=required, **rule)
    return field(default=default, metadata={"rule": spec, "job_key": job_key})


# ---------------------------------------------------------------- the settings


# model.quantization's values (batchrun/model/quant/linear.py: QuantSpec.parse reads them)
QUANTIZATIONS = ("none", "int8", "int4", "int4-g32", "gguf")

# Spellings LLM(dtype=...) also takes (vLLM's); the job file names the canonical ones only.
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


@dataclass
class EngineArgs:
    """How to load the model and size the engine (the KV pool: docs/memory.md). Invalid values raise
    EngineArgsError at construction."""

    # resolved by batchrun.model.weights.locate
    model: str = _setting(MISSING, "str", "model.path",
        doc='The model: `builtin:NAME`, a local Hugging Face checkpoint folder, a `.gguf` file (or a folder '
            'holding one), or a Hub id already in the local Hugging Face cache. Nothing is downloaded.')
    # where the tokenizer comes from and which snapshot of a Hub id: batchrun.model.weights.locate: check_args
    tokenizer: str | None = _setting(None, "str", "model.tokenizer", nullable=True,
        doc="Another tokenizer than the model's own: a folder holding one, `builtin:NAME`, a `.gguf` file, or a Hub "
            "id already in the local Hugging Face cache. null: the model's own. Its ids must fit the model's "
            "vocabulary.")
    revision: str | None = _setting(None, "str", "model.revision", nullable=True,
        doc="Which snapshot of a Hub id `path` is read from the local Hugging Face cache: a branch, a tag or a "
            "commit hash, as huggingface_hub names them (nothing is downloaded). null: `main`. Only for a Hub id.")
    tokenizer_revision: str | None = _setting(None, "str", "model.tokenizer_revision", nullable=True,
        doc="The same for the tokenizer's Hub id (`tokenizer`, or the model's own); null: `revision`.")
    trust_remote_code: bool = _setting(False, "bool", "model.trust_remote_code",
        doc="Let transformers run the Python code a checkpoint ships for its config or tokenizer (`auto_map`). The "
            "model itself always runs on batchrun's own code for its family.")
    # auto: float32 on CPU (half-precision matmuls are slow there), the checkpoint's dtype on CUDA
    dtype: str = _setting("auto", "str", "model.dtype", choices=("auto", "float32", "float16", "bfloat16"),
        doc="The weights' and activations' dtype. auto: float32 on a CPU, the checkpoint's dtype on CUDA.")
    # batchrun/model/quant/linear.py, docs/quantization.md
    quantization: str = _setting("none", "str", "model.quantization", choices=QUANTIZATIONS,
        doc="Weight-only quantized linears: `int8` (a scale per group of 128 inputs), `int4` (groups of 128 "
            "inputs, a scale and an offset each) or `int4-g32` (groups of 32: closer to bf16, a little larger). "
            "On a CPU the activations are quantized per row on the fly (W8A8); on CUDA a Triton kernel dequantizes "
            "the weights in its inner loop (weight-only). The lm_head (unless `quantize_lm_head`), "
            "embeddings and norms stay in `dtype`. `gguf`: a `.gguf` model's Q8_0, Q6_K, Q4_0, Q4_1 and Q4_K linears as the file stores them (on the "
            "same kernels; its other tensors in `dtype`; `builtin:smollm2-135m-instruct` then runs from its Q4_1 "
            "file). `none`: the weights in `dtype`, or a checkpoint quantized already (compressed-tensors int8 / int4) "
            "as it is stored. docs/quantization.md has the accuracy measured per format.")
    # batchrun/model/quant/linear.py: int8_lm_head
    quantize_lm_head: bool = _setting(False, "bool", "model.quantize_lm_head",
        doc="The lm_head in int8 too (CPU only; with any `quantization`): a decode step of Llama-3.2-1B reads a sixth "
            "fewer bytes with int8 layers, a quarter fewer with int4 (the lm_head is then its largest matrix). Each "
            "row's 8 largest logits are recomputed from the plain weights (the embedding's, when tied), so a greedy "
            "token changes only where the model's own first choice is not among the int8 logits' 8 largest; sampling "
            "sees the int8 logits of the rest. Memory: the int8 copy beside the plain weight, which stays for that "
            "(in a bf16 model it replaces the packed copy of a tied lm_head). docs/quantization.md.")
    # GPTQ at load: batchrun/model/quant/calibration.py
    calibration: str = _setting("none", "str", "model.calibration",
        doc="How `quantization` int8 / int4 / int4-g32 rounds the weights: `none` rounds each to nearest; "
            "`builtin` (batchrun's own chat text, ~4k tokens) or the path of a UTF-8 text file (passages split by "
            "blank lines) runs GPTQ over that text, layer by layer, so that each linear's outputs on it stay close "
            "(the same format and speed; the load takes longer and holds the checkpoint once in `dtype` while it "
            "runs). A safetensors checkpoint or a built-in model only. docs/quantization.md has what it gains.")
    device: str = _setting("auto", "device", "model.device",
        doc='auto: CUDA when there is one, else the CPU.')
    # longest prompt + completion; None: the model's own limit. A prompt needs a token and room for one more.
    max_model_len: int | None = _setting(None, "int", "model.max_model_len", nullable=True, min=2,
        doc="The longest prompt + completion, in tokens; null: the model's own limit (capped, with a warning, at "
            'what the KV cache holds).')
    # tokens per KV block; a power of two so that kernels split a slot into block and offset with shifts
    block_size: int = _setting(16, "int", "engine.block_size", min=1, power_of_two=True,
        doc='Tokens per KV-cache block.')
    kv_cache_memory: int | str | None = _setting(None, "size", "engine.kv_cache_memory", nullable=True,
        doc='The KV pool, in bytes or a size like `"4GiB"`. null: on a CPU, what the job\'s rows need (`LLM` outside a '
            "job: 2 GiB, or an eighth of the memory if less), shrunk to what is free beside the weights "
            "(docs/memory.md); on CUDA, `gpu_memory_utilization` of the GPU less the weights and a profiled peak "
            "forward.")
    num_kv_blocks: int | None = _setting(None, "int", "engine.num_kv_blocks", nullable=True, min=1,
        doc='The KV pool in blocks; overrides `kv_cache_memory`.')
    # how the KV pool stores K and V (batchrun/kernels/layouts/kv_rows.py); auto: the model's dtype
    kv_cache_dtype: str = _setting("auto", "str", "engine.kv_cache_dtype", choices=("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
        doc="How the KV cache stores keys and values. auto: in the model's dtype. int8: one byte per value plus a "
            "float32 scale per token and KV head, so the same memory holds about 1.9x the tokens of bf16 (3.8x of "
            "float32) at a small cost in accuracy. fp8_e4m3 / fp8_e5m2: one byte per value, cast on its own with no scale "
            "(coarser than int8) (docs/kv-cache.md).")
    # what the engine is for (vLLM's `runner`; a job's task sets it): build.py reads it for the KV pool's default,
    # the linears' few-row copy and the tied lm_head's, llm.py for what it refuses
    runner: str = _setting("auto", "str", None, choices=("auto", "generate", "pooling"))
    # tokens the CPU KV pool is sized for when neither of the two above is set (a job's: batchrun.plan:
    # job_kv_tokens); None: 2 GiB, or an eighth of the memory if less; either within what is free (runner/memory.py)
    kv_cache_tokens: int | None = _setting(None, "int", None, nullable=True, min=1)
    gpu_memory_utilization: float = _setting(0.9, "number", "engine.gpu_memory_utilization", min=0.01, max=1.0,
        doc="CUDA, when neither `kv_cache_memory` nor `num_kv_blocks` is set: the share of the GPU's memory the "
            'engine may take.')
    swap_space: int | str = _setting(0, "size", "engine.swap_space",
        doc='Host memory for swap preemption, in bytes or a size like `"8GiB"`; 0: no host pool, so a preempted '
            'sequence is recomputed. (`LLM(swap_space=4)` is 4 GiB, as vLLM means it: batchrun/llm_args.py.)')
    max_num_seqs: int = _setting(256, "int", "engine.max_num_seqs", min=1,
        doc='The most sequences running in one step.')
    max_num_batched_tokens: int = _setting(4096, "int", "engine.max_num_batched_tokens", min=1,
        doc='The most tokens one step computes (decode tokens, drafts and prompt chunks); longer prompts are '
            'prefilled in chunks.')
    preemption_mode: str = _setting("auto", "str", "engine.preemption_mode", choices=("auto", "swap", "recompute"),
        doc="What frees KV blocks when the pool is full: swap a sequence's blocks to host memory (needs "
            '`swap_space`), recompute them later, or auto: whichever the scheduler estimates is cheaper for that '
            'sequence.')
    enable_prefix_caching: bool = _setting(True, "bool", "engine.enable_prefix_caching",
        doc='Requests whose prompts share a prefix share its KV blocks, computed once.')
    attention_backend: str = _setting("auto", "str", "engine.attention_backend", choices=("auto", "torch", "triton"),
        doc="auto: torch with batchrun's C kernels on a CPU, Triton on CUDA.")
    enforce_eager: bool = _setting(False, "bool", "engine.enforce_eager",
        doc='CUDA: run without CUDA graphs.')
    # None: on where it is nearly free (float32 on a CPU)
    batch_invariant: bool | None = _setting(None, "bool", "engine.batch_invariant", nullable=True,
        doc="A row's output independent of what else runs in its batch; null: on in float32 on a CPU, off "
            'elsewhere. What each mode guarantees: docs/reproducibility.md.')
    # batchrun/engine/ngram.py; the same tokens either way in the batch-invariant mode (docs/reproducibility.md)
    num_speculative_tokens: int | None = _setting(0, "int", "engine.num_speculative_tokens", nullable=True, min=0,
        doc='Speculative decoding by prompt lookup: up to this many draft tokens per sequence (greedy or seeded), '
            'checked in the same forward, each step only those expected to pay for their rows; 0 or null: off '
            '(the default: on natural replies they do not pay on a CPU). They pay on repetitive text '
            '(extraction, quoting, code edits): try 8.')
    speculative_max_rows: int = _setting(128, "int", "engine.speculative_max_rows", min=1,
        doc='A step adds drafts only while its decode rows plus drafts stay within this many rows.')
    # threads of torch, OpenMP and the C kernels: batchrun/kernels/cpu/threads.py
    num_threads: int | None = _setting(None, "int", "engine.num_threads", nullable=True, min=1,
        doc='CPU threads; null: the CPUs this process may use (affinity mask, cgroup CPU quota, '
            '`SLURM_CPUS_PER_TASK`; `OMP_NUM_THREADS` when set), logged at start.')
    grammar_compile_timeout_s: float = _setting(30.0, "number", "engine.grammar_compile_timeout_s", min=0.001,
        doc='Seconds one structured-output grammar may take to compile; a slower one is refused (a row error; '
            "exit 2 for the job's own `sampling.structured_outputs`).")
    # base of the per-request seeds of requests without their own (a job takes it from sampling.seed)
    seed: int = _setting(0, "int", None)

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):  # a torch.dtype
            self.dtype = str(self.dtype).removeprefix("torch.")
        if isinstance(self.dtype, str):
            self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        self.validate()

    def validate(self) -> None:
        """Raise EngineArgsError for the first field whose value breaks its rule."""
        for f in fields(self):
            why = f.metadata["rule"].problem(getattr(self, f.name))
            if why:
                raise EngineArgsError(f.name, why)
        swap = self.swap_space
        if isinstance(swap, int) and not isinstance(swap, bool) and 0 < swap < 1024:
            raise EngineArgsError("swap_space", f"{swap} bytes hold no KV block: give a size like '{swap}GiB'")
        if self.calibration != "none":
            if self.quantization not in ("int8", "int4", "int4-g32"):
                raise EngineArgsError("calibration", f"{self.calibration} calibrates quantization int8, int4 or "
                                                     f"int4-g32, not {self.quantization}")
            if self.calibration != "builtin" and not os.path.isfile(self.calibration):
                raise EngineArgsError("calibration", f"{self.calibration} is not a file (use none, builtin or the "
                                                     "path of a text file)")

    def check_environment(self) -> None:
        """What depends on this machine: CUDA is there when asked for (torch is imported only then)."""
        wants_cuda = self.device.startswith("cuda")
        # CPU only: an int8 lm_head
        may_be_cuda = self.device == "auto" and self.quantize_lm_head
        if not wants_cuda and self.attention_backend != "triton" and not may_be_cuda:
            return
        import torch

        has_cuda = torch.cuda.is_available()
        if self.quantize_lm_head and (wants_cuda or (self.device == "auto" and has_cuda)):
            raise EngineArgsError("quantize_lm_head", "runs on a CPU only for now (set model.device: cpu, or "
                                                      "quantize_lm_head: false on CUDA)")
        if wants_cuda and not has_cuda:
            raise EngineArgsError("device", f"{self.device} but CUDA is not available on this machine "
                                            "(use auto or cpu)")
        if wants_cuda and ":" in self.device:
            index, count = int(self.device.partition(":")[2]), torch.cuda.device_count()
            if index >= count:
                raise EngineArgsError("device", f"{self.device} but this machine has {count} CUDA "
                                                f"device{'s' * (count != 1)}")
        on_cuda = wants_cuda or (self.device == "auto" and has_cuda)
        if self.attention_backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise EngineArgsError("attention_backend", "triton needs a CUDA device (or TRITON_INTERPRET=1 for "
                                                       "tests); use torch or auto on CPU")

    @property
    def kv_cache_bytes(self) -> int | None:
        return parse_size(self.kv_cache_memory)

    @property
    def swap_space_bytes(self) -> int:
        return parse_size(self.swap_space) or 0

    def llm_kwargs(self) -> dict[str, Any]:
        """Every field but `model`, as keyword arguments for LLM(model, **kwargs)."""
        values = asdict(self)
        del values["model"]
        return values


# ---------------------------------------------------------------- the job file's view


def job_rules(section: str) -> dict[str, Rule]:
    """The keys of the job file's `section` (model or engine) and their rules, in declaration order."""
    return {key.partition(".")[2]: f.metadata["rule"] for f, key in _job_fields() if key.startswith(section + ".")}


def job_key(name: str) -> str | None:
    """The job-file key of EngineArgs field `name` (block_size -> engine.block_size), None if it has none."""
    return next((key for f, key in _job_fields() if f.name == name), None)


def field_of(key: str) -> str:
    """The EngineArgs field of a job-file key (model.path -> model)."""
    return next(f.name for f, k in _job_fields() if k == key)


def _job_fields() -> list[tuple[Any, str]]:
    return [(f, f.metadata["job_key"]) for f in fields(EngineArgs) if f.metadata["job_key"]]
