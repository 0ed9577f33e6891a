"""OpenVINO's quantized weights scored the way `benchmarks.micro.quant_accuracy` scores batchrun's, in OpenVINO's venv:
`python -m benchmarks.peers.openvino.accuracy SPEC RESULT`.

The spec: "model_path" (an exported IR folder, `benchmarks.peers.openvino.env.export`), "precision" (the inference
precision hint: bf16 or f32), "threads", and "sequences": [prompt ids, continuation ids] pairs. Each sequence goes
through the model in one forward (optimum-intel's OVModelForCausalLM, prompt and continuation together), and the
result is, per sequence, the argmax and the continuation token's log-probability at each continuation position:
teacher forcing, as batchrun's side does it one decode step at a time. Like the other workers it imports nothing of
batchrun (its venv has none of batchrun's dependencies).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np


def score(logits: np.ndarray, prompt_len: int, continuation: list[int]) -> tuple[list[int], list[float]]:
    """(argmax, log-probability of the continuation's token) at each continuation position, from the logits of one
    forward over prompt + continuation[:-1] ([positions, vocab]; position p predicts token p + 1)."""
    rows = logits[prompt_len - 1: prompt_len - 1 + len(continuation)].astype(np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    logprobs = rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    picked = logprobs[np.arange(len(continuation)), continuation]
    return rows.argmax(axis=-1).tolist(), picked.tolist()


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = (sys.argv[1:] if argv is None else argv)[:2]
    spec = json.loads(Path(spec_path).read_text())
    warnings.filterwarnings("ignore")
    import torch
    from optimum.intel import OVModelForCausalLM

    model = OVModelForCausalLM.from_pretrained(
        spec["model_path"], compile=True,
        ov_config={"INFERENCE_PRECISION_HINT": spec["precision"], "INFERENCE_NUM_THREADS": str(spec["threads"]),
                   "CACHE_DIR": ""})
    top1, logprobs = [], []
    for prompt, continuation in spec["sequences"]:
        ids = torch.tensor([prompt + continuation[:-1]], dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().numpy()
        got, lp = score(logits, len(prompt), continuation)
        top1.append(got)
        logprobs.append(lp)
    Path(out_path).write_text(json.dumps({"top1": top1, "logprobs": logprobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
