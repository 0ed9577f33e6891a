"""GPTQ calibration (EngineArgs.calibration) before the engine's model is built: transformers runs the checkpoint
layer by layer over the calibration tokens, each layer's linears are rounded with H = X^T X of their inputs
(gptq.py), and the rounded layer feeds the next. The rounded weights replace the checkpoint's at load."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from batchrun.kernels.layouts.quant_weight import QuantizedWeight, dequantize
from batchrun.model.errors import ModelLoadError
from batchrun.model.quant.gptq import gptq_quantize, split_rows
from batchrun.model.quant.linear import KEPT, QuantSpec, group_for

log = logging.getLogger(__name__)

BUILTIN = Path(__file__).resolve().parent / "data" / "calibration.json"
SEQUENCE_TOKENS = 256
MAX_TOKENS = 8192
BATCH_SEQUENCES = 8  # per layer call: 2048 tokens' activations at a time


def calibration_tokens(source: str, tokenizer) -> list[list[int]]:
    """The calibration text (`builtin` or a text file's path) as token sequences of SEQUENCE_TOKENS."""
    if source == "builtin":
        pairs = json.loads(BUILTIN.read_text())
        if getattr(tokenizer, "chat_template", None):
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["question"]},
                                                    {"role": "assistant", "content": p["answer"]}], tokenize=False)
                     for p in pairs]
        else:
            texts = [f"{p['question']}\n{p['answer']}" for p in pairs]
    else:
        texts = [t.strip() for t in Path(source).read_text(encoding="utf-8").split("\n\n") if t.strip()]
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= MAX_TOKENS:
            break
    ids = ids[:MAX_TOKENS]
    sequences = [ids[i : i + SEQUENCE_TOKENS] for i in range(0, len(ids) - SEQUENCE_TOKENS + 1, SEQUENCE_TOKENS)]
    if not sequences:
        raise ModelLoadError(f"calibration {source!r} holds {len(ids)} tokens: GPTQ needs at least "
                             f"{SEQUENCE_TOKENS}")
    return sequences


class _Hessians:
    """Pre-hooks summing X^T X per distinct input tensor (q, k, v share one), held per batch so no address repeats."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.owner: dict[str, str] = {}  # linear -> the linear whose sum it shares (itself for an owner)
        self._seen: dict[tuple[int, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in linears.items()]

    def new_batch(self) -> None:
        self._seen = {}

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            key = (x.data_ptr(), tuple(x.shape))
            if name not in self.owner:
                self.owner[name] = self._seen[key][0] if key in self._seen else name
            self._seen.setdefault(key, (name, x))
            if self.owner[name] != name:
                return
            rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            total = self.sums.get(name)
            self.sums[name] = rows.T @ rows if total is None else total.addmm_(rows.T, rows)
        return record

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _quiet_load(auto_class, path: Path, dtype: torch.dtype) -> nn.Module:
    """transformers' model, without its loading progress bar in the job's log."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return auto_class.from_pretrained(path, dtype=dtype).eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The causal LM's decoder (its model without the lm_head) and the decoder's layers."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ModelLoadError(f"calibration cannot find the decoder layers of a {type(model).__name__}")
    return decoder, layers


def _layer_inputs(decoder: nn.Module, layers: nn.ModuleList, sequences: list[list[int]]
                  ) -> tuple[list[torch.Tensor], list[dict]]:
    """The first layer's input per sequence, and each layer's keyword arguments, taken by pre-hooks."""
    hidden: list[torch.Tensor] = []
    layer_kwargs: list[dict] = [{} for _ in layers]

    class _Stop(Exception):
        pass

    def capture(index: int, stop: bool):
        def hook(module, args, kwargs):
            state = args[0] if args else kwargs["hidden_states"]
            if index == 0:
                hidden.append(state.detach())
            layer_kwargs[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if stop:
                raise _Stop
        return hook

    for n, sequence in enumerate(sequences):
        first_only = n > 0
        handles = [layer.register_forward_pre_hook(capture(i, first_only and i == 0), with_kwargs=True)
                   for i, layer in enumerate(layers) if not first_only or i == 0]
        try:
            decoder(input_ids=torch.tensor([sequence]), use_cache=False)
        except _Stop:
            pass
        finally:
            for handle in handles:
                handle.remove()
    return hidden, layer_kwargs


def _run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _quantized_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The layer's linears that quantization replaces (KEPT stay in the model's dtype)."""
    return {name: m for name, m in layer.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in KEPT}


@torch.no_grad()
def calibrate(path: Path, spec: QuantSpec, dtype: torch.dtype, source: str, tokenizer
              ) -> dict[str, QuantizedWeight]:
    """Checkpoint tensor name (`...q_proj.weight`) -> its GPTQ-rounded weight, for every linear of the decoder
    layers that quantization replaces."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()  # (LLM refuses a model that cannot be held whole for this, before the load)
    sequences = calibration_tokens(source, tokenizer)
    model = _quiet_load(AutoModelForCausalLM, path, dtype)
    decoder, layers = _decoder(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    hidden, layer_kwargs = _layer_inputs(decoder, layers, sequences)
    # the sequences in batches of BATCH_SEQUENCES per layer call (the kwargs' batch dimension of 1 broadcasts)
    hidden = [torch.cat(hidden[i : i + BATCH_SEQUENCES]) for i in range(0, len(hidden), BATCH_SEQUENCES)]
    result: dict[str, QuantizedWeight] = {}
    for index, layer in enumerate(layers):
        linears = _quantized_linears(layer)
        hessians = _Hessians(linears)
        for state in hidden:
            hessians.new_batch()
            _run_layer(layer, state, layer_kwargs[index])
        hessians.remove()
        for owner, total in hessians.sums.items():
            names = [name for name, o in hessians.owner.items() if o == owner]
            weights = [linears[name].weight for name in names]
            group = group_for(weights[0].shape[1], spec.group_size)
            rounded = gptq_quantize(torch.cat(weights), total, spec.bits, group)
            for name, part, weight in zip(names, split_rows(rounded, [w.shape[0] for w in weights]), weights):
                result[f"{prefix}.{index}.{name}.weight"] = part
                weight.copy_(dequantize(part).to(weight.dtype))  # the next layers see the rounded outputs
        hidden = [_run_layer(layer, state, layer_kwargs[index]) for state in hidden]
    del model, hidden
    log.info("GPTQ over %d calibration tokens (%s): %d linears in %.1f s", len(sequences) * SEQUENCE_TOKENS,
             source, len(result), time.perf_counter() - started)
    return result
