"""An int8 copy of a bench checkpoint in the compressed-tensors W8A8 layout, the int8 format vLLM's CPU build runs.

vLLM 0.32's CPU build has no int8 weight-only linear: its CPU weight-only kernel (CPUWNA16LinearKernel,
vllm/model_executor/kernels/linear/mixed_precision/cpu.py) takes 4-bit weights only. Its int8 path is W8A8:
CompressedTensorsW8A8Int8 (vllm/model_executor/layers/quantization/compressed_tensors/schemes/
compressed_tensors_w8a8_int8.py) on CPUInt8ScaledMMLinearKernel (vllm/model_executor/kernels/linear/scaled_mm/
cpu.py: oneDNN, or its AMX kernel), weights int8 symmetric per output channel, activations quantized per token on the
fly. That is batchrun's int8 scheme too (issue 33: per-output-channel int8, activations per row where VNNI/AMX run
it), so the copy is made here rather than by llm-compressor (whose install pulls its own torch): the seven linears
of each layer rounded to int8 with a scale per output row; embeddings, norms and the tied lm_head as they are.

`python -m benchmarks.w8a8_checkpoint CHECKPOINT` makes (or finds) the copy and prints its folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUFFIX = "-w8a8-int8"
# The compressed-tensors config vLLM reads (config.json's quantization_config): int8 weights, symmetric, one scale
# per output channel, static; int8 activations, symmetric, one scale per token, computed at run time.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


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


def w8a8_dir(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + SUFFIX)


def make_w8a8(checkpoint: str | Path) -> Path:
    """The W8A8 copy of `checkpoint` (a HF folder with one model.safetensors), beside it, made once; tensor by
    tensor, so no more than the output and one input tensor are in memory."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    checkpoint = Path(checkpoint)
    target = w8a8_dir(checkpoint)
    if (target / "config.json").is_file():
        return target
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"{checkpoint} has no .safetensors file to quantize")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log.info("writing the W8A8 int8 copy of %s into %s (once)", checkpoint, target)
    for f in files:
        out = {}
        with safe_open(str(f), "pt") as src:
            for name in src.keys():
                t = src.get_tensor(name)
                if is_quantized_linear(name):
                    q, scale = quantize_rows(t)
                    out[name] = q
                    out[name.removesuffix("weight") + "weight_scale"] = scale
                else:
                    out[name] = t
        save_file(out, str(tmp / f.name), metadata={"format": "pt"})
        del out
    for p in checkpoint.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "config.json":
            shutil.copy2(p, tmp / p.name)
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(target)
    return target


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO)
    if len(argv) != 1:
        print("usage: python -m benchmarks.w8a8_checkpoint CHECKPOINT", file=sys.stderr)
        return 2
    try:
        print(make_w8a8(argv[0]))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
