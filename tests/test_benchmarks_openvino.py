"""The OpenVINO GenAI peer of the benchmark: its pure parts (export cache key, config translation, decoding ->
GenerationConfig, EOS normalisation, KV sizing, warm-up prompt), its failure rows, and the real worker where
its venv exists.

OpenVINO lives in a venv of its own (`python -m benchmarks.peers.openvino.env` makes it, a 1.8 GB download), which CI
does not have: the one test that runs the worker is skipped there, and nothing here downloads anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.peers.openvino import env as openvino_env
from benchmarks.peers.openvino.worker import (
    CPU_BLOCK_SIZE,
    generation_fields,
    kv_block_bytes,
    kv_blocks,
    strip_eos,
    warmup_prompt,
)

TINY_CFG = {"num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
            "hidden_size": 384}
EOS = [2, 7]


def _checkpoint(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (path / "README.md").write_text("notes")
    return path


# ---- export cache ---------------------------------------------------------------------------------------


def test_export_key_follows_config_and_weights_not_other_files(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    ckpt = _checkpoint(tmp_path / "my-model")
    key = openvino_env.checkpoint_key(ckpt)
    assert openvino_env.export_dir(ckpt, "fp32") == tmp_path / "cache" / "openvino-models" / f"my-model-{key}-fp32"
    assert openvino_env.export_dir(ckpt, "int8").name == f"my-model-{key}-int8"
    (ckpt / "README.md").write_text("other notes, another size")
    assert openvino_env.checkpoint_key(ckpt) == key
    (ckpt / "model.safetensors").write_bytes(b"\0" * 65)  # weights rewritten
    key2 = openvino_env.checkpoint_key(ckpt)
    assert key2 != key
    os.utime(ckpt / "config.json", ns=(1, 1))  # config touched
    assert openvino_env.checkpoint_key(ckpt) not in (key, key2)


def test_export_reuses_a_made_ir_without_the_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(openvino_env, "ensure_venv", lambda: pytest.fail("a made export needs no venv"))
    ckpt = _checkpoint(tmp_path / "m")
    made = openvino_env.export_dir(ckpt, "fp32")
    made.mkdir(parents=True)
    (made / "openvino_model.xml").write_text("<net/>")
    assert openvino_env.export(ckpt) == made
    with pytest.raises(ValueError, match="weight format"):
        openvino_env.export(ckpt, "q3")
    with pytest.raises(RuntimeError, match="no config.json"):
        openvino_env.export(tmp_path)


def test_transformers5_configs_are_translated_for_the_exporter(tmp_path):
    cfg = {"model_type": "llama", "dtype": "float32", "rope_parameters": {"rope_theta": 100000.0,
                                                                          "rope_type": "default"}}
    out = openvino_env.legacy_config(cfg)
    assert out["rope_theta"] == 100000.0 and "rope_scaling" not in out and "rope_parameters" not in out
    assert out["torch_dtype"] == "float32"
    llama3 = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0}}
    assert openvino_env.legacy_config(llama3)["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0}
    assert openvino_env.legacy_config({"rope_theta": 10.0}) == {"rope_theta": 10.0}  # a 4.x config as it is
    tok = openvino_env.legacy_tokenizer_config({"tokenizer_class": "TokenizersBackend", "backend": "tokenizers",
                                                "eos_token": "<|im_end|>"})
    assert tok == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    assert openvino_env.legacy_tokenizer_config({"tokenizer_class": "LlamaTokenizerFast"})["tokenizer_class"] == (
        "LlamaTokenizerFast")

    ckpt = _checkpoint(tmp_path / "m")
    openvino_env._stage(ckpt, tmp_path / "staged")
    staged = tmp_path / "staged"
    assert (staged / "model.safetensors").resolve() == (ckpt / "model.safetensors").resolve()
    assert not (staged / "config.json").is_symlink()
    assert json.loads((staged / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"


# ---- decoding -> GenerationConfig -----------------------------------------------------------------------


def test_old_workload_is_greedy_with_exact_lengths():
    for decoding in (None, {}):
        f = generation_fields(decoding, 12, 3)
        assert f == {"max_new_tokens": 12, "min_new_tokens": 12, "ignore_eos": True, "do_sample": False,
                     "stop_token_ids": set()}


def test_greedy_ended_by_eos_stops_on_every_eos_id():
    f = generation_fields({"temperature": 0.0, "stop_at_eos": True, "eos_token_ids": EOS}, 256, 0)
    assert f["do_sample"] is False and f["max_new_tokens"] == 256 and f["min_new_tokens"] == 0
    assert f["ignore_eos"] is False and f["stop_token_ids"] == {2, 7} and f["eos_token_id"] == 2
    assert "rng_seed" not in f and "num_return_sequences" not in f


def test_sampled_requests_get_their_own_seed_and_filters():
    dec = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "seed": 100, "n": 4, "stop_at_eos": True,
           "eos_token_ids": EOS}
    a, b = generation_fields(dec, 64, 0), generation_fields(dec, 64, 5)
    assert a["do_sample"] and a["temperature"] == 0.8 and a["top_p"] == 0.95 and "top_k" not in a
    assert a["num_return_sequences"] == 4 and (a["rng_seed"], b["rng_seed"]) == (100, 105)
    f = generation_fields({"temperature": 1.0, "top_p": 1.0, "top_k": 40}, 8, 0)
    assert f["top_k"] == 40 and "top_p" not in f and f["min_new_tokens"] == 8 and f["ignore_eos"]


def test_bad_decoding_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        generation_fields({"temperature": 0.0, "n": 2}, 8, 0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        generation_fields({"stop_at_eos": True}, 8, 0)


def test_eos_that_ended_a_request_is_not_a_generated_token():
    dec = {"stop_at_eos": True, "eos_token_ids": EOS}
    assert strip_eos([5, 6, 7], dec) == [5, 6]  # GenAI returns the stop token last
    assert strip_eos([5, 2, 6], dec) == [5, 2, 6]  # ran to max_new_tokens: nothing to take off
    assert strip_eos([], dec) == []
    assert strip_eos([5, 6, 2], {"stop_at_eos": False, "eos_token_ids": EOS}) == [5, 6, 2]  # EOS ignored
    assert strip_eos([5, 6, 2], None) == [5, 6, 2]


# ---- warm-up and KV sizing ------------------------------------------------------------------------------


def test_warmup_prompt_starts_no_workload_prompt():
    prompts = [[99, 1, 2], [98, 3], [99, 4], []]
    w = warmup_prompt(prompts, vocab_size=100)
    assert len(w) == 32 and w[0] == 97 and all(0 <= t < 100 for t in w)
    assert not any(p and p[0] == w[0] for p in prompts)
    with pytest.raises(ValueError):
        warmup_prompt([[0], [1]], vocab_size=2)


def test_kv_block_bytes_match_what_openvino_allocated():
    # PipelineMetrics.kv_cache_size_in_bytes of the tiny model's cache, 10 blocks, OpenVINO 2026.4.1
    assert 10 * kv_block_bytes(TINY_CFG, "f32") == 1966080
    assert 10 * kv_block_bytes(TINY_CFG, "u8") == 583680
    assert kv_block_bytes(TINY_CFG, "bf16") * 2 == kv_block_bytes(TINY_CFG, "f32")
    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert 45 * kv_block_bytes(smollm2, "f32") == 66355200  # 64 MiB asked, 45 whole blocks allocated
    block = kv_block_bytes(TINY_CFG, "f32")
    assert kv_blocks(10 * block + block // 2, block, max_len=40) == 10  # rounded down
    assert kv_blocks(block, block, max_len=3 * CPU_BLOCK_SIZE + 1) == 4  # the longest request always fits


# ---- rows that cannot run -------------------------------------------------------------------------------


def test_openvino_without_its_venv_is_a_failed_row_not_a_crash(monkeypatch):
    def no_network():
        raise RuntimeError("making the OpenVINO venv failed: no network")

    monkeypatch.setattr(openvino_env, "ensure_venv", no_network)
    setup = openvino_env.OpenvinoSetup(threads=2)
    row = setup.run(lambda *a, **k: pytest.fail("no worker may start"), "x", {"model_path": "/nowhere"}, "float32",
                    1 << 20, kv_cache_precision="u8")
    assert "no network" in row["error"] and row["config"] == {"dtype": "float32", "kv_cache_precision": "u8",
                                                                "weight_format": "fp32"}


def test_failed_export_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.setattr(openvino_env, "ensure_venv", lambda: tmp_path / "python")
    setup = openvino_env.OpenvinoSetup(threads=2)
    row = setup.run(lambda *a, **k: pytest.fail("no worker may start"), "x", {"model_path": str(tmp_path)},
                    "bfloat16", 1 << 20)
    assert "no config.json" in row["error"] and row["config"]["kv_cache_precision"] == "bfloat16"


def test_environment_leaves_the_project_venv_out(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VIRTUAL_ENV", "/work/main/.venv")
    env = openvino_env.environment(threads=2)
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"


# ---- the real worker ------------------------------------------------------------------------------------


@pytest.mark.skipif(not openvino_env.is_ready(),
                    reason="no OpenVINO venv in $BATCHRUN_CACHE (`python -m benchmarks.peers.openvino.env` makes it; CI has none)")
def test_openvino_worker_matches_transformers_greedy_and_ends_at_eos(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from batchrun.model.weights.builtin import builtin_path
    from benchmarks.harness.runner import Runner

    path = builtin_path("tiny-llama")
    prompts = [[5 + i, 17, 301, 44, 1000 + i, 9] * 4 for i in range(3)]
    eos = [int(json.loads((path / "config.json").read_text())["eos_token_id"])]
    base = {"model_path": str(path), "workload": {"name": "t", "prompts": prompts, "output_lens": [12, 20, 7],
                                                  "decoding": {"temperature": 0.0, "stop_at_eos": True,
                                                               "eos_token_ids": eos}}}
    setup = openvino_env.OpenvinoSetup(threads=2)
    res = setup.run(Runner(tmp_path, 900, verbose=False), "ov-greedy", base, "float32", 4 << 20)
    assert "error" not in res, res["error"]
    assert res["kv_cache_bytes"] == res["kv_blocks"] * res["kv_block_bytes"]
    assert res["openvino_genai_version"].startswith("2026.4.1")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, o, got in zip(prompts, [12, 20, 7], res["outputs"]):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=o, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos[0])[0, len(p):].tolist()
        assert got == strip_eos(want, base["workload"]["decoding"])
    assert res["gen_tokens"] == sum(len(x) for x in res["outputs"])

    sampled = {**base, "workload": {**base["workload"], "decoding": {"temperature": 0.8, "top_p": 0.95, "seed": 3,
                                                                     "n": 2, "stop_at_eos": False}}}
    res = setup.run(Runner(tmp_path, 900, verbose=False), "ov-n2", sampled, "float32", 4 << 20,
                    kv_cache_precision="u8")
    assert "error" not in res, res["error"]
    assert [[len(s) for s in o] for o in res["outputs"]] == [[12, 12], [20, 20], [7, 7]]
    assert res["config"]["kv_cache_precision"] == "u8" and res["gen_tokens"] == 2 * 39


def test_score_reads_each_continuation_position_from_the_position_before():
    import numpy as np
    import torch

    from benchmarks.peers.openvino.accuracy import score

    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(0))
    continuation = [7, 3, 41, 0]  # prompt of 5 tokens: position 4 predicts the first
    top1, logprobs = score(logits.numpy().astype(np.float32), 5, continuation)
    want = torch.log_softmax(logits.double(), dim=-1)[4:8]
    assert top1 == want.argmax(-1).tolist()
    assert logprobs == pytest.approx(want[torch.arange(4), continuation].tolist(), abs=1e-6)


@pytest.mark.skipif(not openvino_env.is_ready(),
                    reason="no OpenVINO venv in $BATCHRUN_CACHE (`python -m benchmarks.peers.openvino.env` makes it; CI has none)")
def test_openvino_teacher_forcing_matches_transformers_in_fp32():
    import torch
    from transformers import AutoModelForCausalLM

    from batchrun.model.weights.builtin import builtin_path

    path = builtin_path("tiny-llama")
    sequences = [([5 + i, 17, 301, 44, 1000 + i, 9], [12, 400 + i, 7, 88, 3]) for i in range(2)]
    top1, logprobs = openvino_env.teacher_forced(path, "fp32", sequences, precision="f32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for (prompt, cont), got, lp in zip(sequences, top1, logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + cont[:-1]])).logits[0, len(prompt) - 1:].double()
        want = torch.log_softmax(logits, dim=-1)
        assert got == want.argmax(-1).tolist()
        assert lp == pytest.approx(want[torch.arange(len(cont)), cont].tolist(), abs=1e-3)
