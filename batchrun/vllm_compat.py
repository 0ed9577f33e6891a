"""`vllm` as batchrun: `install()` registers in `sys.modules` a `vllm` module tree whose names are batchrun's objects,
so code written against vLLM's offline API runs on batchrun with one line added before it imports vllm:

    import batchrun.vllm_compat; batchrun.vllm_compat.install()

or unchanged, as `python -m batchrun.vllm_compat SCRIPT ARGS` (or `-m MODULE ARGS`). TREE is the whole surface:
each module and the names it holds (docs/python-api.md's table is generated from it). Names resolve on first use,
so `import vllm` loads no torch. `importlib.metadata.version("vllm")` answers VLLM_VERSION, the vLLM release whose
offline names these follow."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import runpy
import socket
import sys
import types
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.11.0"

_PROMPTS = {"TokensPrompt": "batchrun.inputs:TokensPrompt", "TextPrompt": "batchrun.inputs:TextPrompt",
            "PromptType": "batchrun.inputs:PromptType"}
_TEARDOWN = {"destroy_model_parallel": "batchrun.vllm_compat:destroy_model_parallel",
             "destroy_distributed_environment": "batchrun.vllm_compat:destroy_distributed_environment"}

# vLLM's module -> {name: "batchrun module:attribute"}. A module with no names is a package on the way to others.
TREE: dict[str, dict[str, str]] = {
    "vllm": {
        "LLM": "batchrun.llm:LLM",
        "SamplingParams": "batchrun.sampling_params:SamplingParams",
        "RequestOutput": "batchrun.outputs:RequestOutput",
        "CompletionOutput": "batchrun.outputs:CompletionOutput",
        **_PROMPTS,
        "EngineArgs": "batchrun.engine_args:EngineArgs",
        "BeamSearchParams": "batchrun.beam_search:BeamSearchParams",
        "PoolingParams": "batchrun.pooling_params:PoolingParams",
        "PoolingRequestOutput": "batchrun.outputs:PoolingRequestOutput",
        "EmbeddingRequestOutput": "batchrun.outputs:EmbeddingRequestOutput",
        "ClassificationRequestOutput": "batchrun.outputs:ClassificationRequestOutput",
        "ScoringRequestOutput": "batchrun.outputs:ScoringRequestOutput",
    },
    "vllm.pooling_params": {"PoolingParams": "batchrun.pooling_params:PoolingParams"},
    "vllm.inputs": dict(_PROMPTS),
    "vllm.sampling_params": {"SamplingParams": "batchrun.sampling_params:SamplingParams",
                             "StructuredOutputsParams": "batchrun.sampling_params:StructuredOutputsParams",
                             "BeamSearchParams": "batchrun.beam_search:BeamSearchParams"},
    "vllm.outputs": {"RequestOutput": "batchrun.outputs:RequestOutput",
                     "CompletionOutput": "batchrun.outputs:CompletionOutput",
                     **{name: f"batchrun.outputs:{name}" for name in (
                         "PoolingRequestOutput", "PoolingOutput", "EmbeddingRequestOutput", "EmbeddingOutput",
                         "ClassificationRequestOutput", "ClassificationOutput", "ScoringRequestOutput",
                         "ScoringOutput")}},
    "vllm.logprobs": {"Logprob": "batchrun.outputs:Logprob"},
    "vllm.sequence": {"Logprob": "batchrun.outputs:Logprob"},
    "vllm.beam_search": {"BeamSearchOutput": "batchrun.beam_search:BeamSearchOutput",
                         "BeamSearchSequence": "batchrun.beam_search:BeamSearchSequence"},
    "vllm.lora": {},
    "vllm.lora.request": {"LoRARequest": "batchrun.inputs:LoRARequest"},
    "vllm.transformers_utils": {},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": "batchrun.model.weights.loader:get_tokenizer"},
    "vllm.distributed": dict(_TEARDOWN),
    "vllm.distributed.parallel_state": dict(_TEARDOWN),
    "vllm.utils": {"get_open_port": "batchrun.vllm_compat:get_open_port"},
    "vllm.entrypoints": {},
    "vllm.entrypoints.chat_utils": {"resolve_hf_chat_template": "batchrun.vllm_compat:resolve_hf_chat_template"},
}


# ---- what vLLM's names do that batchrun has nothing behind -------------------------------------------------------

def destroy_model_parallel() -> None:
    """vLLM frees its tensor-parallel groups here; batchrun has none (one engine per process): nothing to do.
    `del llm` (and gc.collect()) frees the model."""


def destroy_distributed_environment() -> None:
    """vLLM tears down torch.distributed here; batchrun never starts it: nothing to do."""


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def resolve_hf_chat_template(tokenizer: Any, chat_template: str | None = None, tools: Any = None,
                             **_model_config: Any) -> str | None:
    """The chat template a conversation is rendered with: the one given, else the tokenizer's (as `LLM.chat`)."""
    return chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)


# ---- the module tree ---------------------------------------------------------------------------------------------

def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _module(name: str, names: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType(name, f"vLLM's {name}, served by batchrun (batchrun.vllm_compat).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # a package: `import vllm.x` finds only the modules of TREE
    module.__batchrun__ = True
    module.__all__ = list(names)
    if name == "vllm":
        module.__version__ = VLLM_VERSION

    def __getattr__(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}: batchrun serves vLLM's names listed "
                                 "in docs/python-api.md (batchrun.vllm_compat.TREE)")
        value = _resolve(names[attr])
        setattr(module, attr, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(module.__dict__) | set(names))

    module.__getattr__, module.__dir__ = __getattr__, __dir__
    return module


class _Distribution(importlib.metadata.Distribution):
    """What `importlib.metadata` says of `vllm` while batchrun serves it."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
                    "Summary: vLLM's offline names, served by batchrun (batchrun.vllm_compat)\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds no module; answers `importlib.metadata` for the name vllm."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") == "vllm":
            return [_Distribution()]
        return []


_FINDER = _Finder()


def installed() -> bool:
    return getattr(sys.modules.get("vllm"), "__batchrun__", False)


def install() -> types.ModuleType:
    """Register the `vllm` tree (TREE) in sys.modules and return its root; a second call returns the same root.
    RuntimeError (one line) when a real vllm is imported already: its objects are in use, and mixing the two
    would hand batchrun's outputs to vLLM's code."""
    if installed():
        return sys.modules["vllm"]
    real = next((m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")), None)
    if real is not None:
        where = getattr(real, "__file__", None) or real.__name__
        raise RuntimeError(f"a real vllm is imported already ({where}): call batchrun.vllm_compat.install() before "
                           "anything imports vllm, or run the script as python -m batchrun.vllm_compat SCRIPT")
    modules = {name: _module(name, names) for name, names in TREE.items()}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    sys.modules.update(modules)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return modules["vllm"]


def uninstall() -> None:
    """Take the tree out of sys.modules again (code that imported its names keeps them)."""
    for name in TREE:
        if getattr(sys.modules.get(name), "__batchrun__", False):
            del sys.modules[name]
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


USAGE = "usage: python -m batchrun.vllm_compat SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str]) -> int:
    """Run a script (or a module, with -m) as __main__ with `vllm` served by batchrun."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr if not argv or argv[0] == "-m" else sys.stdout)
        return 2 if not argv or argv[0] == "-m" else 0
    install()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
