"""Structured outputs without the real model: the parameters, the job file and OpenAI input mapping, the
engine's stop rule, and on a tiny random model that the mask is exact (every drawn token is one the
grammar allows) and that unconstrained rows are untouched by constrained ones beside them."""

from __future__ import annotations

import json
import random

import pytest

from batchrun import LLM, SamplingParams, StructuredOutputsParams
from batchrun.config import JobError, parse_job
from batchrun.engine.request import Sequence
from batchrun.engine.stops import INCOMPLETE_AT_LENGTH, INCOMPLETE_AT_STOP, stop_decision, structured_error
from batchrun.io.sources import ROW_ERROR, OpenAIBatchSource

# ---------------------------------------------------------------- parameters


def test_exactly_one_kind_and_each_kind_checked():
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    sp = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams) and sp.structured_outputs.kind == "json"
    for bad, words in [({}, "exactly one"), ({"regex": "a", "choice": ["x"]}, "got regex, choice"),
                       ({"json": "{nope"}, "not valid JSON"), ({"choice": []}, "non-empty list"),
                       ({"grammar": ""}, "non-empty string"), ({"jsn": {}}, "unknown key 'jsn'"),
                       ("text", "a mapping")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(structured_outputs=bad)


def test_the_key_keeps_the_schema_order_and_whitespace_choice():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key == ("json", '{"b": 1, "a": 2}', True)
    assert StructuredOutputsParams(json={"b": 1, "a": 2}, disable_any_whitespace=True).key[2] is False


# ---------------------------------------------------------------- engine rule (no torch)


class FakeGrammar:
    def __init__(self, completed=False, terminated=False):
        self.completed, self.terminated = completed, terminated

    def is_completed(self):
        return self.completed

    def is_terminated(self):
        return self.terminated


def _seq(grammar=None, finish=None, tokenizer=None) -> Sequence:
    seq = Sequence(0, [1, 2, 3], 1, seed=0)
    if tokenizer is not None:
        from batchrun.engine.detokenizer import Detokenizer

        seq.detok = Detokenizer(tokenizer, [1], True, [], False)
    seq.grammar, seq.finish_reason = grammar, finish
    return seq


def test_a_grammar_that_ended_stops_the_sequence_even_before_min_tokens(tokenizer):
    params = SamplingParams(max_tokens=10, min_tokens=5)
    assert stop_decision(_seq(tokenizer=tokenizer), params, 7, (0,), 100, grammar_ended=True) == ("stop", None)
    assert stop_decision(_seq(tokenizer=tokenizer), params, 7, (0,), 100) is None


def test_incomplete_structured_outputs_carry_an_error():
    assert structured_error(_seq()) is None  # unconstrained
    assert structured_error(_seq(FakeGrammar(terminated=True), "stop")) is None
    assert structured_error(_seq(FakeGrammar(completed=True), "length")) is None  # complete at the limit
    assert structured_error(_seq(FakeGrammar(), "length")) == INCOMPLETE_AT_LENGTH
    assert structured_error(_seq(FakeGrammar(), "stop")) == INCOMPLETE_AT_STOP


def test_the_engine_imports_no_grammar_backend():
    from test_architecture import MODULES, _under, imports_of

    assert not [m for m in MODULES if _under(m, "batchrun.engine")
                and any(n.split(".")[0] == "xgrammar" for n in imports_of(m))]


# ---------------------------------------------------------------- job file and inputs


def _job(tmp_path, sampling: str, extra: str = "") -> str:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    return (f"model: {{path: 'builtin:tiny-llama'}}\ninput: {{path: {tmp_path / 'in.jsonl'}{extra}}}\n"
            f"output: {{path: {tmp_path / 'out'}}}\nsampling: {sampling}\n")


def test_job_file_structured_outputs_inline_and_from_a_file(tmp_path):
    cfg = parse_job(_job(tmp_path, "{structured_outputs: {choice: ['a', 'b']}}"))
    assert cfg.sampling_params().structured_outputs.choice == ["a", "b"]
    (tmp_path / "schema.json").write_text('{"type": "object", "properties": {"z": {"type": "integer"}}}')
    cfg = parse_job(_job(tmp_path, f"{{structured_outputs: {{json_file: {tmp_path / 'schema.json'}}}}}"))
    assert cfg.sampling["structured_outputs"] == {"json": {"type": "object", "properties": {"z": {"type": "integer"}}}}
    cases = [("{structured_outputs: {json_file: nowhere.json}}", "json_file: cannot read nowhere.json"),
             ("{structured_outputs: {regex: 'a', choice: ['x']}}", "exactly one"),
             ("{structured_outputs: [1]}", "expected a mapping"),
             ("{structured_outputs: {json: '{bad'}}", "sampling.structured_outputs: json is not valid JSON")]
    for sampling, words in cases:
        with pytest.raises(JobError, match=words):
            parse_job(_job(tmp_path, sampling))
    cfg = parse_job(_job(tmp_path, "{}", ", sampling_columns: {choice: labels, json: schema}"))
    assert cfg.input["sampling_columns"] == {"choice": "labels", "json": "schema"}


def test_openai_response_format_maps_onto_structured_outputs(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              {"response_format": {"type": "json_object"}}, {"response_format": {"type": "text"}},
              {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}}]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"messages": [{"role": "user", "content": "hi"}], **b}}) + "\n"
                            for i, b in enumerate(bodies)))
    rows = [r for batch in OpenAIBatchSource(str(path)).iter_rows() for r in batch]
    assert rows[0]["sampling"]["structured_outputs"] == {"json": schema}
    assert rows[1]["sampling"]["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in rows[2]["sampling"]
    assert "response_format: unsupported type 'xml'" in rows[3][ROW_ERROR]
    assert "needs a `schema`" in rows[4][ROW_ERROR]


# ---------------------------------------------------------------- the tiny random model


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    return LLM(str(tiny_llama_path), num_kv_blocks=256, max_num_seqs=16)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "string", "enum", "boolean", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "integer":
            props[f"i{i}"] = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
        elif kind == "string":
            props[f"s{i}"] = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "cat", "dog"], rng.randint(1, 3))}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "array":
            props[f"a{i}"] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "maxItems": rng.randint(1, 3)}
        else:
            props[f"o{i}"] = random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props)}


def test_every_drawn_token_is_one_the_grammar_allows(tiny):
    """Replays each output through a fresh matcher: at every step the drawn token's bit is set in the
    bitmask the grammar gives for that state (temperature 1 on a random model draws all over the vocab)."""
    import jsonschema
    import xgrammar as xgr

    rng = random.Random(5)
    specs = [StructuredOutputsParams(json=random_schema(rng), disable_any_whitespace=bool(i % 2)) for i in range(8)]
    specs += [StructuredOutputsParams(regex=r"[a-f]{2,5}-\d{1,3}"), StructuredOutputsParams(choice=["yes", "no"]),
              StructuredOutputsParams(grammar='root ::= ("ab" | "c")+ "!"'), StructuredOutputsParams(json_object=True)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=100 + i, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = tiny.generate(["the river", "a cat"] * (len(specs) // 2), params, use_tqdm=False)
    bitmask = xgr.allocate_token_bitmask(1, tiny.config.vocab_size)
    stopped = 0
    for spec, out in zip(specs, outs):
        completion = out.outputs[0]
        matcher = tiny.structured.matcher(spec)
        for token in completion.token_ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, (spec.kind, completion.token_ids)
            assert matcher.accept_token(token)
        if completion.finish_reason == "stop":
            stopped += 1
            assert matcher.is_terminated() and completion.error is None
            if spec.kind == "json":
                jsonschema.validate(json.loads(completion.text), spec.json)
        else:
            assert completion.error == INCOMPLETE_AT_LENGTH and not matcher.is_completed()
    assert stopped >= 4


def test_unconstrained_rows_are_unchanged_by_constrained_rows_beside_them(tiny):
    prompts = ["the river", "a cat sat", "once upon", "the machine"]
    free = [SamplingParams(max_tokens=12, temperature=t, seed=i, ignore_eos=True)
            for i, t in enumerate([0.0, 0.9, 0.0, 0.9])]
    alone = tiny.generate(prompts, free, use_tqdm=False)
    spec = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    constrained = [SamplingParams(max_tokens=12, temperature=0.9, seed=50 + i, structured_outputs=spec)
                   for i in range(4)]
    mixed = tiny.generate(prompts + prompts, free + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text.startswith('{') for o in mixed[4:])


def test_a_spec_that_does_not_compile_is_one_clear_error(tiny):
    for spec, words in [({"regex": "((("}, "the regex does not compile: Regex parsing error"),
                        ({"json": {"type": "nonsense"}}, "the json does not compile"),
                        ({"grammar": "root ::= missing"}, 'Rule "missing" is not defined')]:
        with pytest.raises(ValueError, match=words) as info:
            tiny.generate("hi", SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert "\n" not in str(info.value) and str(info.value).startswith("prompts[0]: ")
    assert not tiny.has_unfinished()


def test_compilation_has_a_time_limit(tiny):
    from batchrun.structured.compiler import StructuredOutputs

    slow = StructuredOutputs(tiny.tokenizer, tiny.config.vocab_size, tiny.eos_token_ids, timeout_s=0.001)
    spec = StructuredOutputsParams(json={"enum": [f"value-{i}" for i in range(20000)]})
    why = slow.check(spec)
    assert why == "the json did not compile within 0.001 s (engine.grammar_compile_timeout_s)"
    assert slow.check(spec) == why  # the failure is cached: it is not compiled again


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_the_cpu_bitmask_kernel_bans_exactly_the_tokens_whose_bit_is_off(vocab):
    """batchrun's C kernel against the bits unpacked by torch, bitwise, on random masks (all-ones words, a
    vocabulary that is not a multiple of 32) and a subset of the rows. (xgrammar's own CPU kernel is not the
    reference: on this case at vocab 37 it bans token 2 of row 3, whose bit is on, after a row of all-ones
    words; xgrammar 0.2.9.)"""
    import torch

    from batchrun.kernels import cpu as cpu_kernels
    from batchrun.kernels.cpu import sampling as cpu_sampling

    if not cpu_kernels.available():
        pytest.skip("no C compiler: the CPU kernels are not built")
    g = torch.Generator().manual_seed(vocab)
    rows, words = 6, (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bits[1] = -1  # every token allowed
    bits[2, : words // 2] = -1
    logits = torch.randn(rows, vocab, generator=g)
    got = logits.clone()
    chosen = [0, 2, 3, 5]
    cpu_sampling.apply_token_bitmask(got, bits, chosen, vocab)
    off = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(rows, -1)[:, :vocab] == 0
    want = logits.clone()
    want[chosen] = logits[chosen].masked_fill(off[chosen], float("-inf"))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows not listed are untouched
    assert bool(torch.isinf(got[0]).any()) and not bool(torch.isinf(got[1]).any())
