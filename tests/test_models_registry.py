"""The model registry (batchrun/model/arch/registry.py) and `batchrun models` stay true: every family's definition loads,
every claim of `verified` is a test that is parametrized over exactly the families claiming it, and the CLI prints
the registry."""

from __future__ import annotations

import json

import pytest
import test_encoders
import test_families
import test_families_gguf
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.model.arch.registry import (
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    VERIFIED_CHECKS,
    families_verifying,
    model_class,
)

# each verification -> the test functions that hold it (parametrized over families_verifying(check))
CHECK_TESTS = {
    "greedy": [test_families.test_greedy_equals_transformers],
    "logits": [test_families.test_prefill_logits_within_tolerance],
    "bf16": [test_families.test_bf16_teacher_forced_top1],
    "invariant": [test_families.test_rows_do_not_depend_on_the_batch],
    "seeded": [test_families.test_rows_do_not_depend_on_the_batch],
    "triton": [test_families.test_greedy_on_the_triton_kernels],
    "gguf": [test_families_gguf.test_a_gguf_file_gives_the_checkpoints_greedy_tokens],
    "encoder": [test_encoders.test_packed_rows_and_pooled_vectors_equal_transformers,
                test_encoders.test_the_head_gives_transformers_classification_logits],
}


def parametrized_families(test) -> list[str]:
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize" and m.args[0] == "family"]
    assert len(marks) == 1, test.__name__
    return list(marks[0].args[1])


@pytest.mark.parametrize("check", list(VERIFIED_CHECKS))
def test_every_claim_is_a_test_over_exactly_its_families(check):
    claimed = families_verifying(check)
    assert claimed, check
    for test in CHECK_TESTS[check]:
        covered = parametrized_families(test)
        if check == "gguf":  # the llama family's GGUF claim is test_gguf.py's, on SmolLM2's real file
            covered = ["llama", *covered]
        assert sorted(covered) == sorted(claimed), (check, test.__name__)


def test_every_family_has_a_tiny_checkpoint_and_a_definition():
    for family in FAMILIES:
        classes = [model_class(arch) for arch in family.architectures]
        assert all(cls.__name__ == family.model for cls in classes)
        if all(getattr(cls, "is_encoder", False) for cls in classes):
            # encoders do not generate: their tiny checkpoints are test_encoders.py's, not test_families.py's
            assert family.name in test_encoders.CHECKPOINTS
            assert all(callable(cls.pool_head) and callable(cls.weight_target) for cls in classes)
            continue
        assert family.name in test_families.CHECKPOINTS
        assert all(callable(cls.make_layer) for cls in classes)
    assert len(SUPPORTED_ARCHITECTURES) == len(set(SUPPORTED_ARCHITECTURES))
    assert set(test_families_gguf.GGUF_CHECKPOINTS) == set(families_verifying("gguf")) - {"llama"}


def test_batchrun_models_prints_the_registry():
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    for family in FAMILIES:
        assert f"{family.name}: {', '.join(family.architectures)}" in result.output
        assert f"verified: {', '.join(family.verified)}" in result.output
    for meaning in VERIFIED_CHECKS.values():
        assert meaning in result.output


def test_an_unsupported_architecture_names_every_supported_one(tmp_path):
    from batchrun.model.errors import ModelLoadError
    from batchrun.model.weights.locate import locate_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelLoadError) as e:
        locate_model(str(tmp_path))
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)
