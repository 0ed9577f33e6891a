"""Quantized copies of a bench checkpoint in the compressed-tensors layouts vLLM's CPU build runs (the quantized rows).

vLLM 0.32's CPU build has no int8 weight-only linear: its CPU weight-only kernel (CPUWNA16LinearKernel,
vllm/model_executor/kernels/linear/mixed_precision/cpu.py) takes 4-bit weights only (uint4 / uint4b8). Its int8 path
is W8A8: CompressedTensorsW8A8Int8 (vllm/model_executor/layers/quantization/compressed_tensors/schemes/
compressed_tensors_w8a8_int8.py) on CPUInt8ScaledMMLinearKernel (vllm/model_executor/kernels/linear/scaled_mm/
cpu.py: oneDNN, or its AMX kernel), weights int8 symmetric per output channel, activations quantized per token at
run time. So:
- "w8a8-int8": the seven linears of each layer int8 with a scale per output row (batchrun's int8 scheme too);
- "w4a16-g128": the same linears int4 symmetric in groups of 128 (bf16 scales), packed eight to an int32 as
  compressed-tensors' pack-quantized format stores them; vLLM runs it as W4A16 (CompressedTensorsWNA16, uint4b8).
Embeddings, norms and the tied lm_head stay as they are. The copies are written here rather than by llm-compressor
(whose install pulls its own torch and is not in either venv).

`python -m benchmarks.peers.vllm.checkpoint CHECKPOINT [w8a8-int8|w4a16-g128]` makes (or finds) the copy and prints its
folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
SOURCE_KEY = "source-key.txt"  # peers.venv.checkpoint_key of the checkpoint the copy was made from
_INT8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_INT8_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_INT4_GROUPS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                "dynamic": False}
# config.json's quantization_config for each format, as vLLM's compressed-tensors loader reads it.
FORMATS: dict[str, dict] = {
    "w8a8-int8": {"quant_method": "compressed-tensors", "format": "int-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": _INT8_WEIGHTS,
                                                "input_activations": _INT8_TOKENS}}},
    "w4a16-g128": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "quantization_status": "compressed", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": _INT4_GROUPS}}},
}
QUANTIZATION_CONFIG = FORMATS["w8a8-int8"]


def is_quantized_linear(name: str) -> bool:
    """A decoder linear's weight (model.layers.N.{self_attn,mlp}.X_proj.weight): the tensors made int8."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in LINEARS and ".layers." in name


def quantize_rows(weight):  # noqa: ANN001, ANN201 - torch tensors; torch is imported lazily
    """int8 weight and float32 scale [rows, 1] with weight ~= int8 * scale: symmetric, per output row."""
    import torch

    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(weight, group: int = GROUP):  # noqa: ANN001, ANN201
    """int8 values in [-8, 7] and scales [rows, cols / group] in the weight's dtype, symmetric, per group of a row."""
    import torch

    rows, cols = weight.shape
    if cols % group:
        raise RuntimeError(f"a linear of {cols} inputs does not split into groups of {group}")
    w = weight.float().reshape(rows, cols // group, group)
    scale = (w.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 7.0).to(weight.dtype)
    q = torch.round(w / scale.float()).clamp_(-8, 7).to(torch.int8)
    return q.reshape(rows, cols), scale.reshape(rows, cols // group)


def pack_int4(q):  # noqa: ANN001, ANN201
    """[rows, cols] int8 in [-8, 7] -> [rows, cols / 8] int32: value + 8 in 4 bits, column 8j + i at bits 4i of
    word j (compressed-tensors' pack-quantized layout)."""
    import torch

    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (u << shifts).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantized(name: str, t, fmt: str) -> dict:  # noqa: ANN001
    """The tensors that replace linear weight `name` in format `fmt`."""
    import torch

    stem = name.removesuffix("weight")
    if fmt == "w8a8-int8":
        q, scale = quantize_rows(t)
        return {name: q, stem + "weight_scale": scale}
    q, scale = quantize_groups(t)
    return {stem + "weight_packed": pack_int4(q), stem + "weight_scale": scale,
            stem + "weight_shape": torch.tensor(list(t.shape), dtype=torch.int64)}


def quantized_dir(checkpoint: Path, fmt: str = "w8a8-int8") -> Path:
    return checkpoint.with_name(f"{checkpoint.name}-{fmt}")


def make_quantized(checkpoint: str | Path, fmt: str = "w8a8-int8") -> Path:
    """The `fmt` copy of `checkpoint` (a HF folder of .safetensors files), beside it, made once; tensor by tensor,
    so no more than the output and one input tensor are in memory."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose from {', '.join(FORMATS)}")
    from benchmarks.peers.venv import checkpoint_key

    checkpoint = Path(checkpoint)
    target = quantized_dir(checkpoint, fmt)
    key = checkpoint_key(checkpoint)  # a checkpoint rewritten in place gets a new copy
    if (target / "config.json").is_file() and (target / SOURCE_KEY).is_file() and (
            (target / SOURCE_KEY).read_text().strip() == key):
        return target
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"{checkpoint} has no .safetensors file to quantize")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log.info("writing the %s copy of %s into %s (once)", fmt, checkpoint, target)
    for f in files:
        out = {}
        with safe_open(str(f), "pt") as src:
            for name in src.keys():
                t = src.get_tensor(name)
                out.update(_quantized(name, t, fmt) if is_quantized_linear(name) else {name: t})
        save_file(out, str(tmp / f.name), metadata={"format": "pt"})
        del out
    for p in checkpoint.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy2(p, tmp / p.name)
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["quantization_config"] = FORMATS[fmt]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / SOURCE_KEY).write_text(key + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO)
    if len(argv) not in (1, 2):
        print(f"usage: python -m benchmarks.peers.vllm.checkpoint CHECKPOINT [{'|'.join(FORMATS)}]", file=sys.stderr)
        return 2
    try:
        print(make_quantized(*argv))
    except (RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
