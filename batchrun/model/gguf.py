"""GGUF checkpoints (llama.cpp's single-file format), read through transformers' GGUF support.

batchrun has no quantized kernels: the tensors of a GGUF file are dequantized once, at load, to the job's
dtype, so the model runs at the speed of that dtype, not of the quantized format. The config, the tokenizer
and its chat template come from the file's metadata, as transformers reads them (`gguf_file=`). Reading a
GGUF file needs the `gguf` package (`pip install 'batchrun[gguf]'`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.model.errors import ModelLoadError

if TYPE_CHECKING:  # transformers and torch load only when a GGUF file is read (find_gguf needs neither)
    import torch
    from transformers import GenerationConfig, PretrainedConfig

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
        from batchrun.model.registry import architecture_of_model_type

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
