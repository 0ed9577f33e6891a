"""batchrun embedding texts, in its own process: `python -m benchmarks.harness.embed_worker SPEC.json RESULT.json`.

Times and reports as the peers' embedding workers do (benchmarks.harness.embed.timed_embedding): `LLM(model=path,
task="embed", dtype=..., seed=0)` loads untimed, the warm-up texts are embedded, then one `embed(texts)` of every text
is timed, vLLM's names throughout.

The spec: "model_path", "embed" (benchmarks.harness.embed.EmbedTexts as JSON), "dtype", "llm_kwargs" (extra LLM
arguments: the plan's and --llm-kwargs), "threads", "repeat".
"""

from __future__ import annotations

import sys
from typing import Any

# The same OpenMP wait settings as batchrun's other benchmark workers: importing batchrun chooses them (see
# batchrun/__init__.py), and must come before torch is imported.
import batchrun

# isort: split
import torch

from benchmarks.harness.clock import Result
from benchmarks.harness.embed import EmbedTexts, timed_embedding
from benchmarks.peers import worker


def task_embed_batchrun(spec: dict[str, Any]) -> Result:
    from batchrun import LLM

    torch.set_num_threads(spec.get("threads", 2))
    texts = EmbedTexts.from_json(spec["embed"]).texts
    kw = {"task": "embed", "dtype": spec.get("dtype", "float32"), "seed": 0, "device": "cpu",
          **spec.get("llm_kwargs", {})}

    def load() -> Any:
        return LLM(model=spec["model_path"], **kw)

    def embed(llm: Any, batch: list[str]) -> list[list[float]]:
        return [o.outputs.embedding for o in llm.embed(batch)]

    res = timed_embedding(load, embed, texts, torch.get_num_threads, spec.get("repeat", 1), config=kw)
    res.update(batchrun_version=batchrun.__version__, torch_threads=torch.get_num_threads())
    return res


def main(argv: list[str]) -> int:
    return worker.main(argv, "embed_batchrun", task_embed_batchrun)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
