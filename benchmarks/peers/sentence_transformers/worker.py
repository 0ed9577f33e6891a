"""sentence-transformers as a system under test, in its own venv:
`python -m benchmarks.peers.sentence_transformers.worker SPEC RESULT`.

It imports nothing of batchrun, only the standard-library clock and the embedding workload's timing
(benchmarks.harness.embed.timed_embedding), so it times and reports as batchrun's and vLLM's embedding workers do:
`SentenceTransformer(path, device="cpu")` in the row's dtype loads untimed, the warm-up texts are embedded, then one
`encode(texts, batch_size=...)` of every text is timed, at its defaults otherwise (padded batches, the Pooling and
Normalize modules its folder names).

The spec: "model_path" (a sentence-transformers folder), "embed" (benchmarks.harness.embed.EmbedTexts as JSON),
"dtype" (float32 / bfloat16: `model_kwargs={"dtype": ...}`), "batch_size", "threads", "repeat".
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.harness.clock import Result
from benchmarks.harness.embed import EmbedTexts, timed_embedding
from benchmarks.peers import worker


def task_sentence_transformers(spec: dict[str, Any]) -> Result:
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(spec.get("threads", 2))
    texts = EmbedTexts.from_json(spec["embed"]).texts
    dtype, batch_size = spec.get("dtype", "float32"), spec["batch_size"]

    def load() -> Any:
        return SentenceTransformer(spec["model_path"], device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})

    def embed(model: Any, batch: list[str]) -> Any:
        return model.encode(batch, batch_size=batch_size, show_progress_bar=False)

    res = timed_embedding(load, embed, texts, torch.get_num_threads, spec.get("repeat", 1),
                          config={"dtype": dtype, "batch_size": batch_size})
    res.update(sentence_transformers_version=sentence_transformers.__version__,
               transformers_version=transformers.__version__, torch_threads=torch.get_num_threads())
    return res


def main(argv: list[str]) -> int:
    return worker.main(argv, "sentence_transformers", task_sentence_transformers)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
