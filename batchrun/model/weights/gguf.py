"""GGUF checkpoints (llama.cpp's single-file format), read through transformers' GGUF support.

Two ways to read the tensors. `gguf_tensors` dequantizes every tensor once, at load, to the job's dtype (the
model then runs at the speed of that dtype). `read_quantized` / `iter_quantized` keep the linear weights of
the types batchrun's kernels take (Q8_0, Q6_K, Q4_0, Q4_1, Q4_K) as stored: each becomes a `QuantizedWeight`
(batchrun.kernels.layouts.quant_weight's plain layout) carrying the file's own integers and scales, repacked, never rounded
again (`gguf_blocks`). The config, the tokenizer and its chat template come from the file's metadata, as
transformers reads them (`gguf_file=`). Reading a GGUF file needs the `gguf` package
(`pip install 'batchrun[gguf]'`).
"""

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
    """The GGUF file `path` names: the file itself, or the one .gguf in a folder without a config.json
    (a folder with a config.json is a Hugging Face checkpoint and loads from its safetensors)."""
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
    """The tokenizer (with its chat template) transformers builds from the GGUF metadata."""
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
    """Every tensor of the file, dequantized and cast to `dtype`, under its Hugging Face name.

    transformers maps GGUF tensor names (blk.N.attn_q ...) to a model's parameter names and undoes
    llama.cpp's q/k permutation; a skeleton model on the meta device gives it the names, allocating nothing.
    """
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
    """The storage types of the file's tensors (e.g. ['F32', 'Q4_1', 'Q6_K']), from its header."""
    from gguf import GGUFReader

    return sorted({t.tensor_type.name for t in GGUFReader(file).tensors})


def write_checkpoint(file: Path, dest: Path, dtype: torch.dtype) -> None:
    """Dequantize a GGUF file into a Hugging Face checkpoint folder: config.json, generation_config.json,
    model.safetensors (in `dtype`) and the tokenizer with its chat template."""
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
    """`iter_quantized` gathered into a dict (Hugging Face name -> weight)."""
    return dict(iter_quantized(file, dtype, config))


def iter_quantized(file: Path, dtype: torch.dtype | None = None,
                   config: PretrainedConfig | None = None) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """The file's tensors under their Hugging Face names, one at a time (the file is memory-mapped, so at most
    one tensor's worth of memory is new at any point beyond what the caller keeps).

    The weight of an nn.Linear stored as Q8_0, Q6_K, Q4_0, Q4_1 or Q4_K comes as a QuantizedWeight (not the
    lm_head's or a router's: quant_linear.KEPT); every other tensor (norms, embeddings, F32/F16/BF16, the other
    quantized types) as transformers dequantizes it, cast to `dtype` (float32 when None). `config`: the file's (gguf_config), when the caller has it already.
    A tied lm_head is not in the file and not yielded. transformers' own name map and tensor processor are reused: a
    processor that only reorders rows (Llama's un-permutation of attn_q / attn_k) is applied to the rows of
    the QuantizedWeight (a group never straddles rows), found by running it on the row numbers; any other
    processing makes that tensor dequantize as transformers would.
    """
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    from batchrun.model.weights.gguf_blocks import STORED_TYPES, quantized_weight
    from batchrun.model.quant.linear import KEPT

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
    # the linears that become quantized ones: not the lm_head or routers (quant_linear.KEPT), which llama.cpp files
    # store quantized too (output.weight in Q6_K or Q8_0) and the engine keeps in the model's dtype
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
    """transformers' map of GGUF tensor names to the skeleton's parameter names. It builds gguf's name table
    once per submodule (hundreds of times: seconds for a small model), and that table depends only on the
    architecture and layer count, so it is built once here for the duration of the call."""
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
    """The order in which `processor` puts the rows of tensor `name` (int64 [rows]), or None when it does
    more than reorder rows: it is run on a column of row numbers, so transformers' own processing (Llama's
    q/k un-permutation) is what decides, not a copy of it."""
    import numpy as np

    probe = np.arange(rows, dtype=np.float64)[:, None]
    result = processor.process(weights=probe, name=name, tensor_key_mapping=name_map,
                               parsed_parameters={"tensors": {}})
    order = np.asarray(result.weights)
    if result.name != name or order.shape != (rows, 1):
        return None
    order = order[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) and np.all(order == result.weights[:, 0]) else None
