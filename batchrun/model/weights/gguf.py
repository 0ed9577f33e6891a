"""GGUF checkpoints, through transformers' GGUF support (`pip install 'batchrun[gguf]'`): every tensor dequantized to
the job's dtype (gguf_tensors), or the kernels' types kept as stored, never rounded again (iter_quantized)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.model.errors import ModelLoadError

if TYPE_CHECKING:  # transformers and torch load only when a GGUF file is read (find_gguf needs neither)
    import torch
    from transformers import GenerationConfig, PretrainedConfig

    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf in a folder without config.json."""
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        raise ModelLoadError(f"model path {str(path)!r} holds {len(files)} .gguf files "
                             f"({', '.join(p.name for p in files[:4])}); name one of them")
    return files[0] if files else None


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("reading a .gguf checkpoint needs the gguf package: "
                             "pip install 'batchrun[gguf]'") from None


def gguf_config(file: Path) -> PretrainedConfig:
    """The transformers config of a GGUF file, with `architectures` filled in from its model_type."""
    from transformers import AutoConfig

    require_gguf_package()
    try:
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ModelLoadError(f"cannot read GGUF file {str(file)!r}: {_one_line(e)}") from None
    if not getattr(config, "architectures", None):  # GGUF configs carry a model_type only
        from batchrun.model.arch.registry import architecture_of_model_type

        name = architecture_of_model_type(config.model_type)
        config.architectures = [name or f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    return config


def gguf_tokenizer(file: Path):
    from transformers import AutoTokenizer

    require_gguf_package()
    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ModelLoadError(f"cannot read the tokenizer of GGUF file {str(file)!r}: {_one_line(e)}") from None


def gguf_generation_config(config: PretrainedConfig) -> GenerationConfig:
    """What generation_config.json would hold: the special tokens (a GGUF file has no sampling defaults)."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=getattr(config, "pad_token_id", None))


def gguf_tensors(file: Path, config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor in `dtype` under its Hugging Face name (transformers undoes llama.cpp's q/k permutation)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    require_gguf_package()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"cannot read the tensors of GGUF file {str(file)!r}: {_one_line(e)}") from None
    return parsed["tensors"]


def quantization_types(file: Path) -> list[str]:
    from gguf import GGUFReader

    return sorted({t.tensor_type.name for t in GGUFReader(file).tensors})


def write_checkpoint(file: Path, dest: Path, dtype: torch.dtype) -> None:
    """Dequantize a GGUF file into a Hugging Face checkpoint folder in `dtype`, with its tokenizer."""
    from safetensors.torch import save_file

    config = gguf_config(file)
    config.dtype = dtype
    tensors = gguf_tensors(file, config, dtype)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt", "source": f"dequantized from {file.name}"})
    config.save_pretrained(dest)
    gguf_generation_config(config).save_pretrained(dest)
    gguf_tokenizer(file).save_pretrained(dest)


def read_quantized(file: Path, dtype: torch.dtype | None = None,
                   config: PretrainedConfig | None = None) -> dict[str, QuantizedWeight | torch.Tensor]:
    return dict(iter_quantized(file, dtype, config))


def iter_quantized(file: Path, dtype: torch.dtype | None = None,
                   config: PretrainedConfig | None = None) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """The file's tensors under their Hugging Face names, one at a time. A layer linear in a type the kernels take
    comes as a QuantizedWeight (rows reordered where transformers' processor only reorders them), every other tensor
    dequantized to `dtype` (fp32 when None); a tied lm_head is not yielded."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    from batchrun.model.quant.linear import KEPT
    from batchrun.model.weights.gguf_blocks import STORED_TYPES, quantized_weight

    dtype = dtype or torch.float32
    config = config or gguf_config(file)
    try:
        reader = GGUFReader(file)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read the tensors of GGUF file {str(file)!r}: {_one_line(e)}") from None
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    name_map = _gguf_to_hf_names(skeleton, processor)
    # not the lm_head or routers (KEPT): llama.cpp stores them quantized, the engine keeps them in the model's dtype
    linears = {f"{name}.weight" for name, module in skeleton.named_modules()
               if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in KEPT}
    collected: dict[str, dict] = {"tensors": {}}  # what a processor stores itself (stacked MoE experts)
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        hf_name = name_map.get(tensor.name)
        stored = tensor.tensor_type.name in STORED_TYPES and tensor.data.ndim == 2 and hf_name in linears
        rows = _row_order(processor, tensor.name, tensor.data.shape[0], name_map) if stored else None
        if rows is not None:
            weight = quantized_weight(tensor.tensor_type.name, np.asarray(tensor.data), int(tensor.shape[0]))
            if not np.array_equal(rows, np.arange(len(rows))):
                index = torch.from_numpy(rows)
                weight.qweight, weight.scale = weight.qweight[index], weight.scale[index]
                weight.offset = weight.offset[index] if weight.offset is not None else None
            yield hf_name, weight
            continue
        if tensor.tensor_type.name not in ("F32", "F16", "BF16") and tensor.data.ndim == 2 and hf_name in linears:
            dequantized[tensor.tensor_type.name] = dequantized.get(tensor.tensor_type.name, 0) + 1
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=name_map, parsed_parameters=collected)
        if result.name in name_map:
            yield name_map[result.name], torch.from_numpy(np.copy(result.weights)).to(dtype)
    for name, value in collected["tensors"].items():
        yield name, value.to(dtype)
    if dequantized:
        log.info("%s: %s linear weights dequantized to %s (batchrun's quantized kernels take Q8_0, Q6_K, Q4_0, "
                 "Q4_1 and Q4_K as stored)", file.name,
                 ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items())),
                 str(dtype).removeprefix("torch."))


def _gguf_to_hf_names(skeleton, processor) -> dict[str, str]:
    """transformers' GGUF name map, with gguf's name table (rebuilt per submodule otherwise) cached for the call."""
    import functools

    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        return get_gguf_hf_weights_map(skeleton, processor)
    finally:
        gguf.get_tensor_name_map = build


def _row_order(processor, name: str, rows: int, name_map: dict[str, str]):
    """The row order `processor` gives tensor `name` (run on the row numbers), or None if it does more."""
    import numpy as np

    probe = np.arange(rows, dtype=np.float64)[:, None]
    result = processor.process(weights=probe, name=name, tensor_key_mapping=name_map,
                               parsed_parameters={"tensors": {}})
    order = np.asarray(result.weights)
    if result.name != name or order.shape != (rows, 1):
        return None
    order = order[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) and np.all(order == result.weights[:, 0]) else None
