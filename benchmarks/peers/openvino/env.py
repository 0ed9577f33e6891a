"""OpenVINO GenAI as a benchmark peer: its own virtualenv, made on first use, and the export of a checkpoint to
OpenVINO's IR, cached.

OpenVINO GenAI runs models in OpenVINO's IR (an .xml graph and a .bin of weights), which optimum-intel's
`optimum-cli export openvino` makes from a Hugging Face checkpoint. optimum-intel 1.27 wants transformers 4.57.x
(the project's venv has 5.x), so the runtime and the exporter live in a venv of their own under the batchrun cache
(`$BATCHRUN_CACHE/openvino-venv`). It is made in steps: the local CPU build of torch first (an unpinned torch,
which optimum pulls, is CUDA's multi-GB build), then OpenVINO, GenAI, its tokenizers and optimum-intel, with torch
held by a constraint so that pip's resolution cannot swap it. optimum-intel 2.x is not used: it needs
torchvision, which pulls a CUDA torch.

`python -m benchmarks.peers.openvino.env` makes the venv (or says why it cannot) and prints its python;
`python -m benchmarks.peers.openvino.env CHECKPOINT [FORMAT]` (a WEIGHT_OPTIONS key, fp32 by default) also
exports that checkpoint and prints the IR's folder.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from batchrun.paths import cache_dir
from benchmarks.peers import venv
from benchmarks.peers.venv import PeerSetup, PeerVenv, checkpoint_key, pip_keeping_torch

log = logging.getLogger(__name__)

OPENVINO = ["openvino==2026.4.1", "openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0",
            "optimum-intel[openvino]==1.27.0"]
# The weight formats an export can take, each with the optimum-cli options that make it; the name is the cache
# folder's suffix. "int8" / "int4" are optimum-cli's own defaults (asymmetric; int4 in groups of 128, its embedding
# and lm_head int8 asymmetric). The "-sym" ones are set to match batchrun's quantized linears for the quantized rows:
# int8 symmetric per output channel; int4 symmetric in groups of 128 on every linear (ratio 1.0: no layer left in
# int8 by a sensitivity rule), the embedding and lm_head (tied in Llama-3.2-1B) int8 symmetric, as nncf keeps them
# unless --all-layers is given.
WEIGHT_OPTIONS: dict[str, tuple[str, ...]] = {
    "fp32": ("--weight-format", "fp32"),
    "fp16": ("--weight-format", "fp16"),
    "int8": ("--weight-format", "int8"),
    "int4": ("--weight-format", "int4"),
    "int8-sym": ("--weight-format", "int8", "--sym"),
    "int4-sym-g128": ("--weight-format", "int4", "--sym", "--group-size", "128", "--ratio", "1.0",
                      "--backup-precision", "int8_sym"),
    # For accuracy beside batchrun's int4 (benchmarks.micro.quant_accuracy --openvino): nncf takes no group that does
    # not divide a linear's inputs (SmolLM2's 576 refuses 128), so groups of 64 and 32; "asym" is nncf's integer
    # zero point; "-r08" leaves 20% of the linears in int8 by nncf's data-free sensitivity rule (its mixed format).
    "int4-sym-g64": ("--weight-format", "int4", "--sym", "--group-size", "64", "--ratio", "1.0",
                     "--backup-precision", "int8_sym"),
    "int4-asym-g64": ("--weight-format", "int4", "--group-size", "64", "--ratio", "1.0"),
    "int4-sym-g32": ("--weight-format", "int4", "--sym", "--group-size", "32", "--ratio", "1.0",
                     "--backup-precision", "int8_sym"),
    "int4-asym-g32": ("--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"),
    "int4-asym-g64-r08": ("--weight-format", "int4", "--group-size", "64", "--ratio", "0.8"),
}
WEIGHT_FORMATS = tuple(WEIGHT_OPTIONS)
VENV = PeerVenv("openvino", "OpenVINO", ".ready-" + "-".join(OPENVINO[:2]).replace("==", "_"), OPENVINO)


def models_dir() -> Path:
    return cache_dir() / "openvino-models"


def is_ready() -> bool:
    """The venv has been made (ensure_venv would not download anything)."""
    return VENV.is_ready()


def _install(py: Path) -> None:
    """OpenVINO, GenAI, its tokenizers and optimum-intel, with the venv's torch held by a constraint."""
    pip_keeping_torch(py, *OPENVINO)


def ensure_venv() -> Path:
    """The venv's python, making the venv first if needed; raises RuntimeError with the reason if it cannot."""
    return VENV.ensure(_install)


def environment(threads: int) -> dict[str, str]:
    """The worker's and the exporter's environment: nothing of the project's venv on the path, OpenMP-style
    thread counts for whatever reads them (OpenVINO itself takes INFERENCE_NUM_THREADS, set by the worker), and
    no hub access."""
    return venv.environment(threads, TRANSFORMERS_OFFLINE="1")


# ---- exporting a checkpoint to OpenVINO's IR -------------------------------------------------------------


def export_dir(checkpoint: Path, weight_format: str = "fp32") -> Path:
    """Where the IR of this checkpoint in this weight format is cached: <name>-<key>-<format>."""
    return models_dir() / f"{checkpoint.resolve().name}-{checkpoint_key(checkpoint)}-{weight_format}"


def legacy_config(cfg: dict) -> dict:
    """A config.json written by transformers 5 as transformers 4.57 (optimum-intel 1.27's) reads it.

    Pitfall: transformers 5 keeps RoPE's base under `rope_parameters`; 4.57 ignores that key and silently takes
    its default rope_theta (10000). SmolLM2's is 100000, so an export of the file as it is runs with the wrong
    positions and no error. The base (and a scaling, if any) go back to 4.x's top-level keys.
    """
    out = dict(cfg)
    rope = out.pop("rope_parameters", None)
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            out.setdefault("rope_theta", rope["rope_theta"])
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", scaling)
    if "dtype" in out:
        out.setdefault("torch_dtype", out["dtype"])
    return out


def legacy_tokenizer_config(cfg: dict) -> dict:
    """A tokenizer_config.json written by transformers 5 as 4.57 reads it.

    Pitfall: transformers 5 names its tokenizer class `TokenizersBackend`, which 4.57 does not know; optimum-cli
    then leaves the tokenizer out of the export without a word (no openvino_tokenizer.xml, and GenAI's pipeline
    will not load without it). 4.57's class for a tokenizer.json is PreTrainedTokenizerFast.
    """
    out = {k: v for k, v in cfg.items() if k != "backend"}
    if out.get("tokenizer_class") in (None, "TokenizersBackend"):
        out["tokenizer_class"] = "PreTrainedTokenizerFast"
    return out


def _stage(checkpoint: Path, into: Path) -> None:
    """The checkpoint as transformers 4.57 reads it: its files linked, the two configs rewritten."""
    into.mkdir(parents=True, exist_ok=True)
    for p in checkpoint.iterdir():
        if p.is_file():
            (into / p.name).symlink_to(p.resolve())
    for name, fix in (("config.json", legacy_config), ("tokenizer_config.json", legacy_tokenizer_config)):
        if (checkpoint / name).is_file():
            (into / name).unlink()
            (into / name).write_text(json.dumps(fix(json.loads((checkpoint / name).read_text())), indent=1))


def export(checkpoint: str | Path, weight_format: str = "fp32", threads: int = 2) -> Path:
    """The OpenVINO IR folder of a HF checkpoint folder, exported once (`optimum-cli export openvino --task
    text-generation-with-past`) and then reused; raises RuntimeError with the reason if it cannot.

    The weight format is always passed: without it optimum-cli compresses the weights of a model over 1B
    parameters to int8 on its own. fp32 of a bf16 checkpoint is exact (the weights are widened; the IR is twice
    the checkpoint's size, ~5 GB for a 1.2B model); a bf16 row then runs in bf16 through
    INFERENCE_PRECISION_HINT, which converts the weights as the model compiles. The export goes to a folder beside
    the cache entry and is renamed into place when complete, so a killed export is never taken for a made one."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: choose from {', '.join(WEIGHT_FORMATS)}")
    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise RuntimeError(f"{checkpoint} is not a checkpoint folder (no config.json)")
    target = export_dir(checkpoint, weight_format)
    if (target / "openvino_model.xml").is_file():
        return target
    py = ensure_venv()
    models_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".export-") as tmp:
        staged, out = Path(tmp) / "checkpoint", Path(tmp) / "ir"
        _stage(checkpoint, staged)
        cmd = [str(py.parent / "optimum-cli"), "export", "openvino", "--model", str(staged),
               "--task", "text-generation-with-past", *WEIGHT_OPTIONS[weight_format], str(out)]
        log.info("exporting %s to OpenVINO IR (%s)", checkpoint, weight_format)
        proc = subprocess.run(cmd, env=environment(threads), capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not (out / "openvino_model.xml").is_file():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"exporting {checkpoint} to OpenVINO failed: {tail}")
        if not (out / "openvino_tokenizer.xml").is_file():
            raise RuntimeError(f"exporting {checkpoint} to OpenVINO made no tokenizer (openvino_tokenizer.xml), "
                               "which GenAI's pipeline needs")
        # the staged copy's links are not part of the IR: every file the export wrote is a plain file
        out.rename(target)
    return target


class OpenvinoSetup(PeerSetup):
    """The OpenVINO GenAI peer for one benchmark run: the venv made (or the reason it could not be), each
    checkpoint exported once, then one worker per row through the orchestrator's runner."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, ensure_venv)

    def run(self, runner, name: str, base: dict, dtype: str, kv_bytes: int, kv_cache_precision: str | None = None,
            prefix_caching: bool = True, weight_format: str = "fp32", scheduler: dict | None = None,
            properties: dict | None = None) -> dict:
        """One OpenVINO worker on the row's workload (base["workload"], base["model_path"]: a HF checkpoint,
        exported here); {"error": ...} (a failed row in the report) without a venv or an export.

        kv_bytes is the KV cache's size; the worker rounds it down to OpenVINO's 32-token CPU blocks
        (worker.CPU_BLOCK_SIZE), so a caller that wants every request to fit at once passes at least
        the workload's demand in 32-token blocks. kv_cache_precision None is the row's dtype; "u8" is the CPU
        plugin's own default, a row of its own."""
        config = {"dtype": dtype, "kv_cache_precision": kv_cache_precision or dtype, "weight_format": weight_format}
        if self.python is None:
            return {"error": f"OpenVINO GenAI not run: {self.error}", "config": config}
        try:
            ir = export(base["model_path"], weight_format, self.threads)
        except RuntimeError as e:
            return {"error": f"OpenVINO GenAI not run: {e}", "config": config}
        spec = {**base, "model_path": str(ir), "checkpoint": str(base["model_path"]), "dtype": dtype,
                "kv_bytes": int(kv_bytes), "kv_cache_precision": kv_cache_precision, "prefix_caching": prefix_caching,
                "scheduler": scheduler or {}, "properties": properties or {}}
        res = runner(name, spec, python=str(self.python), env=environment(self.threads),
                     module="benchmarks.peers.openvino.worker")
        if "error" in res:
            res["config"] = config
        else:
            res.setdefault("config", {})["weight_format"] = weight_format
        return res


def teacher_forced(checkpoint: str | Path, weight_format: str, sequences: list[tuple[list[int], list[int]]],
                   precision: str = "bf16", threads: int = 2) -> tuple[list[list[int]], list[list[float]]]:
    """The checkpoint exported in `weight_format`, each (prompt, continuation) fed through it by OpenVINO with
    `precision` as its inference precision (benchmarks.peers.openvino.accuracy): per sequence, the argmax and the
    continuation token's log-probability at each continuation position. Raises RuntimeError with the reason where
    the venv, the export or the worker fails."""
    ir = export(checkpoint, weight_format, threads)
    with tempfile.TemporaryDirectory(prefix="batchrun-ov-accuracy-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model_path": str(ir), "precision": precision, "threads": threads,
                                    "sequences": [[list(p), list(c)] for p, c in sequences]}))
        root = Path(__file__).resolve().parents[3]
        proc = subprocess.run([str(VENV.python), "-m", "benchmarks.peers.openvino.accuracy", str(spec), str(out)],
                              cwd=root, env={**environment(threads), "PYTHONPATH": str(root)}, capture_output=True,
                              text=True, timeout=3600)
        if proc.returncode != 0 or not out.is_file():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"OpenVINO's teacher-forced pass over {ir.name} failed: {tail}")
        result = json.loads(out.read_text())
    return result["top1"], result["logprobs"]


def main(argv: list[str] | None = None) -> int:
    """Make the venv and print its python; with a checkpoint folder (or builtin:NAME), export it too and print
    the IR's folder."""
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO)
    try:
        py = ensure_venv()
        print(py)
        if args:
            ckpt = args[0]
            if ckpt.startswith("builtin:"):
                from batchrun.model.weights.builtin import builtin_path

                ckpt = str(builtin_path(ckpt.removeprefix("builtin:")))
            print(export(ckpt, args[1] if len(args) > 1 else "fp32"))
    except (RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
