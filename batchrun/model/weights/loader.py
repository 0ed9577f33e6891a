"""Hugging Face checkpoint -> our model: config via transformers, weights from safetensors (compressed-tensors
linears as stored) or a GGUF file. The model is made in its dtype unallocated and each tensor copied in as it is
read, through a handle of its own (a file's mapped pages count until it closes): a load holds the model once."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from batchrun.engine_args import EngineArgsError
from batchrun.inputs import TOKENIZER_MODES
from batchrun.kernels.layouts.quant_weight import QuantizedWeight, dequantize
from batchrun.model.arch.blocks import CausalLM
from batchrun.model.arch.registry import SUPPORTED_ARCHITECTURES, family_of, model_class
from batchrun.model.errors import ModelLoadError
from batchrun.model.quant.linear import (
    QuantSpec,
    int8_lm_head,
    linear_targets,
    quantize_linear,
    quantized_bytes,
    quantized_linear_module,
)
from batchrun.model.weights import compressed_tensors, gguf

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    config: PretrainedConfig
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    path: Path


def resolve_path(model: str, gguf_file: bool = False) -> Path:
    """A checkpoint folder, a `.gguf` file or folder, or `builtin:NAME` (a packaged GGUF file with gguf_file)."""
    if model.startswith("builtin:"):
        from batchrun.model.weights.builtin import builtin_path, packaged_gguf

        name = model.split(":", 1)[1]
        packaged = packaged_gguf(name) if gguf_file else None
        return packaged.locate(name) if packaged is not None else builtin_path(name)
    path = Path(model).expanduser()
    file = gguf.find_gguf(path)
    if file is not None:
        return file
    if not path.is_dir():
        raise ModelLoadError(f"model path {model!r} is not a folder or a .gguf file (batchrun loads local "
                             "checkpoints and 'builtin:NAME'; it downloads nothing)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {model!r} has no config.json (nor a .gguf file)")
    return path


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == gguf.GGUF_SUFFIX


def architecture(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__


def load_config(path: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    config = (gguf.gguf_config(path) if is_gguf(path)
              else AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    arch = architecture(config)
    if family_of(arch) is None:
        raise ModelLoadError(f"unsupported architecture {arch!r}; batchrun supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def stored_scheme(path: Path) -> compressed_tensors.StoredScheme | None:
    if is_gguf(path):
        return None
    return compressed_tensors.stored_scheme(json.loads((path / "config.json").read_text()), str(path))


# model types whose positions start at padding_idx + 1 (RoBERTa's): the rows before are never a position
OFFSET_POSITIONS = ("roberta", "xlm-roberta")


def model_max_len(config: PretrainedConfig) -> int:
    """max_position_embeddings (every backend implements sliding windows, so a windowed model is not capped), less
    the rows RoBERTa's positions skip."""
    if getattr(config, "model_type", None) in OFFSET_POSITIONS:
        return int(config.max_position_embeddings) - int(config.pad_token_id) - 1
    return int(config.max_position_embeddings)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no safetensors weights in {path} (model.safetensors or model.safetensors.index.json)")


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, through a handle of its own (its mapping goes when it closes)."""
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def _safetensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read it) for every tensor of the checkpoint: a tensor is read only when it has a place."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
        for name in names:
            yield name, functools.partial(_read_tensor, file, name)


def _given(value):
    """A tensor source's reader for a value already read (gguf.iter_quantized yields values)."""
    return value


def load_weights(model: CausalLM, path: Path,
                 tensors: Iterable[tuple[str, Callable[[], torch.Tensor | QuantizedWeight]]] | None = None,
                 quantization: QuantSpec | None = None, device: torch.device | str = "cpu") -> None:
    """Copy checkpoint tensors into the model (CausalLM.weight_target), fusing q/k/v and gate/up. With
    `quantization` each layer linear is quantized once its rows are in; QuantizedWeight parts become
    quantized_linear_module(parts), or are dequantized for a module kept in the model's dtype."""
    params = dict(model.named_parameters())
    shapes = {n: p.shape for n, p in params.items()}
    rows_filled = dict.fromkeys(params, 0)
    targets = linear_targets(model)
    quantized_parts: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    for name, read in model.checkpoint_tensors(_safetensors(path) if tensors is None else tensors):
        target = model.weight_target(name)
        if target is None:
            continue
        dst, offset = target
        if dst not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in a {model.config.model_type} model")
        t = read()
        shape = shapes[dst]
        if t.shape[1:] != shape[1:] or offset + t.shape[0] > shape[0]:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"which does not fit {dst} {tuple(shape)}")
        if isinstance(t, QuantizedWeight) and dst not in targets:
            # a module the engine keeps in the model's dtype (a quantized lm_head or router): dequantized once
            t = dequantize(t).to(params[dst].dtype)
        if isinstance(t, QuantizedWeight):
            quantized_parts.setdefault(dst, []).append((offset, t))
        else:
            with torch.no_grad():
                params[dst].data[offset : offset + t.shape[0]].copy_(t)
        rows_filled[dst] += t.shape[0]
        del t  # before the next one is read
        if dst in targets and rows_filled[dst] == shape[0] and (quantization is not None or dst in quantized_parts):
            parent, attr = targets[dst]
            linear = getattr(parent, attr)
            if dst in quantized_parts:
                if sum(part.shape[0] for _, part in quantized_parts[dst]) != shape[0]:
                    raise ModelLoadError(f"{dst} has quantized and plain parts: batchrun takes one or the other")
                parts = [part for _, part in sorted(quantized_parts.pop(dst), key=lambda p: p[0])]
                setattr(parent, attr, quantized_linear_module(parts, linear.bias, device))
                del parts
            else:
                setattr(parent, attr, quantize_linear(linear, quantization, device))
            del linear
            params.pop(dst)  # the last references to the full-precision weight: its memory goes now
    missing = [n for n, shape in shapes.items() if rows_filled[n] != shape[0]]
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks or repeats tensors for {', '.join(missing[:3])}")


def load_tokenizer(path: Path, trust_remote_code: bool = False, **kwargs):
    """The tokenizer of a folder or a .gguf file; `kwargs` go to transformers' AutoTokenizer (e.g. add_bos_token)."""
    if is_gguf(path):
        return gguf.gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)


def tokenizer_path(spec: str) -> Path:
    """Where a tokenizer's load spec (locate.locate_tokenizer) lives: a built-in model's folder (made on first use),
    a .gguf file, or a folder."""
    if spec.startswith("builtin:"):
        return resolve_path(spec)
    path = Path(spec).expanduser()
    return gguf.find_gguf(path) or path


def get_tokenizer(tokenizer_name: str | Path, *args, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  revision: str | None = None, download_dir: str | None = None, **kwargs):
    """vLLM's `get_tokenizer`: the tokenizer LLM loads for `tokenizer_name` (a folder, builtin:NAME, a .gguf file, or
    a Hub id in the local Hugging Face cache at `revision`). Other keyword arguments go to transformers'
    AutoTokenizer, as vLLM passes them. ValueError (one line) for what it cannot honour."""
    if args:
        raise ValueError(f"get_tokenizer takes the tokenizer's name and keyword arguments, got {len(args)} more "
                         "positional arguments")
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode: {tokenizer_mode!r} is not supported: batchrun loads the tokenizer "
                         f"transformers' AutoTokenizer picks ({' or '.join(map(repr, TOKENIZER_MODES))})")
    if download_dir is not None:
        raise ValueError(f"download_dir: {download_dir!r} is not supported: nothing is downloaded; a Hub id is read "
                         "from the local Hugging Face cache (HF_HUB_CACHE)")
    from batchrun.model.weights.locate import locate_tokenizer

    spec = locate_tokenizer(str(tokenizer_name), revision, field="tokenizer_name", revision_field="revision")
    return load_tokenizer(tokenizer_path(spec), trust_remote_code, **kwargs)


def check_vocabulary(tokenizer, config: PretrainedConfig, spec: str) -> None:
    """Another tokenizer than the model's own must give ids the embedding has rows for."""
    size, vocab = len(tokenizer), getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and size > vocab:
        raise EngineArgsError("tokenizer", f"{spec} has {size} tokens, more than the model's vocabulary ({vocab})")


def eos_ids(path: Path, config: PretrainedConfig, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        gen = gguf.gguf_generation_config(config) if is_gguf(path) else GenerationConfig.from_pretrained(path)
        e = gen.eos_token_id
        ids += e if isinstance(e, list) else ([e] if e is not None else [])
    except OSError:
        pass
    e = getattr(config, "eos_token_id", None)
    ids += e if isinstance(e, list) else ([e] if e is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _calibrated(tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]], calibrated: dict[str, QuantizedWeight]
                ) -> Iterator[tuple[str, Callable[[], torch.Tensor | QuantizedWeight]]]:
    for name, read in tensors:
        yield name, (functools.partial(_given, calibrated.pop(name)) if name in calibrated else read)
    if calibrated:  # names transformers gave its modules that the checkpoint does not use: rounded to nearest
        log.warning("%d calibrated linears have no checkpoint tensor of their name (e.g. %s): those take round to "
                    "nearest", len(calibrated), next(iter(calibrated)))


def load_model(model: str, *, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
               quantization: QuantSpec | None = None, gguf_as_stored: bool = False,
               quantize_lm_head: bool = False, calibration: str = "none", tokenizer: str | None = None,
               trust_remote_code: bool = False) -> LoadedModel:
    """gguf_as_stored: a GGUF file's linears of the kernels' types run as stored. quantize_lm_head: an int8 lm_head.
    calibration (with `quantization`): GPTQ rounding (quant/calibration.py) instead of round to nearest.
    tokenizer: another tokenizer's load spec (locate.locate_tokenizer); None: the model's own. trust_remote_code:
    passed to transformers' AutoConfig and AutoTokenizer."""
    path = resolve_path(model, gguf_file=gguf_as_stored)
    if gguf_as_stored and not is_gguf(path):
        raise ModelLoadError(f"quantization gguf needs a .gguf model file, and {path} is not one")
    config = load_config(path, trust_remote_code)
    limit = model_max_len(config)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise ModelLoadError(f"max_model_len={max_model_len} exceeds what the model supports ({limit})")
    if tokenizer is None:
        tokenizer = load_tokenizer(path, trust_remote_code)
    else:
        spec, tokenizer = tokenizer, load_tokenizer(tokenizer_path(tokenizer), trust_remote_code)
        check_vocabulary(tokenizer, config, spec)
    stored = None if gguf_as_stored or is_gguf(path) else stored_scheme(path)
    quantized = quantization is not None or gguf_as_stored or stored is not None
    calibrated = None
    if calibration != "none":
        if quantization is None or is_gguf(path) or stored is not None:
            raise ModelLoadError(f"calibration rounds a full-precision safetensors checkpoint to int8 or int4, and "
                                 f"{path.name} with quantization {'gguf' if gguf_as_stored else 'none'} is not that")
        from batchrun.model.quant.calibration import (
            calibrate,  # transformers' model classes, only where asked for
        )

        calibrated = calibrate(path, quantization, dtype, calibration, tokenizer)
    # A quantized model bound for a GPU is built in host memory, where an unwritten tensor's pages are not resident:
    # on the GPU every linear would take its full-precision size first.
    build_device = torch.device("cpu") if quantized and device.type != "cpu" else device
    with torch.device("meta"):
        m = model_class(architecture(config))(config).to(dtype)  # in the job's dtype from the start: no fp32 copy
    m = m.to_empty(device=build_device)  # unwritten pages are not resident: each fills as its tensors are copied in
    m.tie_weights()
    if gguf_as_stored:
        stored_tensors = gguf.iter_quantized(path, dtype, config)
        load_weights(m, path, ((name, functools.partial(_given, value)) for name, value in stored_tensors),
                     device=device)
        log.info("GGUF %s: its quantized linears run as stored: %.1f MiB", path.name, quantized_bytes(m) / 2**20)
    elif is_gguf(path):
        # Dequantized straight to the job's dtype: no quantized kernels, so the speed is that dtype's. transformers
        # returns them all at once; each goes as it is copied into the model, so two copies are never held whole.
        tensors = gguf.gguf_tensors(path, config, dtype)
        load_weights(m, path, ((name, functools.partial(tensors.pop, name)) for name in list(tensors)),
                     quantization, device)
        del tensors
        log.info("GGUF %s: %s weights dequantized to %s at load (it runs at %s speed, not at the quantized "
                 "format's)", path.name, "/".join(gguf.quantization_types(path)), str(dtype).removeprefix("torch."),
                 str(dtype).removeprefix("torch."))
    elif stored is not None:
        if quantization is not None:
            raise ModelLoadError(f"{path} is quantized already ({stored.describe()}): leave quantization at none")
        load_weights(m, path, compressed_tensors.stored_tensors(weight_files(path)), device=device)
        log.info("%s: its quantized linears run as stored (%s): %.1f MiB", path.name, stored.describe(),
                 quantized_bytes(m) / 2**20)
    else:
        tensors = None if calibrated is None else _calibrated(_safetensors(path), calibrated)
        load_weights(m, path, tensors, quantization=quantization, device=device)
    if quantization is not None:
        log.info("linears quantized to int%d (groups of %d inputs%s) at load: %.1f MiB", quantization.bits,
                 quantization.group_size, ", GPTQ" if calibrated is not None else "", quantized_bytes(m) / 2**20)
    m.finish_load()
    m = m.to(device=device, dtype=dtype).eval().requires_grad_(False)  # (QuantLinears are on `device` already)
    if quantize_lm_head:
        log.info("lm_head quantized to int8 at load: %.1f MiB (its top logits recomputed from the plain weights)",
                 int8_lm_head(m) / 2**20)
    m.prepare(max_model_len)
    return LoadedModel(m, config, tokenizer, eos_ids(path, config, tokenizer), max_model_len, path)
