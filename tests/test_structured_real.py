"""Structured outputs on the real model (builtin:smollm2-135m-instruct): every completion parses and
validates, greedy and sampled; regex, choice and EBNF outputs match; n=3 and forced preemption (swap and
recompute) give the unpreempted run's outputs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchrun import LLM, SamplingParams, StructuredOutputsParams
from benchmarks.micro.structured import SCHEMA as PERSON  # nested object, enum, integer, array

NAMES = ["Alice", "Bob", "Carla", "Dan", "Eve", "Farid", "Gina", "Hugo"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo"]
HOBBIES = ["chess and hiking", "painting", "football, cooking and jazz", "reading"]
MOODS = ["is happy", "feels sad today", "is calm", "is in a great mood"]


def extraction_prompts(llm: LLM, n: int = 32) -> list[str]:
    texts = [f"Extract the person as JSON with name, age, mood, hobbies and address.city: {NAMES[i % 8]} is "
             f"{19 + 2 * i} years old, lives in {CITIES[i % 4]}, likes {HOBBIES[(i // 2) % 4]} and "
             f"{MOODS[(i // 3) % 4]}." for i in range(n)]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                              add_generation_prompt=True) for t in texts]


def valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("temperature, compact", [(0.0, True), (0.8, False)])
def test_every_extraction_parses_and_validates(smollm2, temperature, compact):
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=compact)
    sp = SamplingParams(max_tokens=128, temperature=temperature, seed=7, structured_outputs=spec)
    outs = smollm2.generate(extraction_prompts(smollm2), sp, use_tqdm=False)
    bad = [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs if not valid_json(o.outputs[0].text, PERSON)]
    assert bad == []
    assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].error is None for o in outs)
    # greedy, the model reads the prompt: most names come out right (the mask is not all there is)
    assert temperature > 0 or sum(json.loads(o.outputs[0].text)["name"].startswith(NAMES[i % 8]) for i, o in enumerate(outs)) >= 16


def test_regex_choice_and_grammar_outputs_match(smollm2):
    tok = smollm2.tokenizer

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    date = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    labels = ["positive", "negative", "neutral"]
    ebnf = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    reviews = ["I loved this film, wonderful!", "Terrible service, never again.", "It was a movie.",
               "Best pizza in town!", "The battery died after a day.", "The package arrived on Tuesday."]
    dates = ["When did the French revolution start? Give a date.", "What is today's date?",
             "Give the date of the moon landing.", "Write any date."]
    sums = ["What is 2 + 3?", "What is 7 + 8?", "How many legs does a spider have?", "What is 10 - 4?"]
    prompts, params, checks = [], [], []
    for text in dates:
        prompts.append(chat(text))
        params.append(SamplingParams(max_tokens=16, temperature=0, structured_outputs={"regex": date}))
        checks.append(lambda s: re.fullmatch(date, s))
    for i, text in enumerate(reviews):
        prompts.append(chat(f"Is this review positive, negative or neutral? {text}"))
        params.append(SamplingParams(max_tokens=8, temperature=0.8 * (i % 2), seed=i,
                                     structured_outputs={"choice": labels}))
        checks.append(lambda s: s in labels)
    for text in sums:
        prompts.append(chat(text))
        params.append(SamplingParams(max_tokens=12, temperature=0, structured_outputs={"grammar": ebnf}))
        checks.append(lambda s: re.fullmatch(r"The answer is \d\d?\.", s))
    outs = smollm2.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(check(t) for check, t in zip(checks, texts)), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert texts[4] == "positive", texts  # greedy on a clear review


def test_n3_and_forced_preemption_keep_outputs_valid_and_identical(smollm2, smollm2_path):
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    prompts = extraction_prompts(smollm2, 2)
    greedy = SamplingParams(n=3, max_tokens=80, temperature=0, structured_outputs=spec)
    sampled = SamplingParams(n=3, max_tokens=80, temperature=0.8, seed=11, structured_outputs=spec)

    def texts(llm, sp):
        return [[c.text for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)]

    want_greedy, want_sampled = texts(smollm2, greedy), texts(smollm2, sampled)
    assert all(valid_json(t, PERSON) for row in want_greedy + want_sampled for t in row)
    assert all(len(set(row)) == 1 for row in want_greedy)  # greedy samples agree
    assert any(len(set(row)) > 1 for row in want_sampled)  # each sample has its own matcher and stream
    for mode in ("swap", "recompute"):
        # 6 sequences of ~110 tokens, their prompts shared, need ~30 blocks of 16: 12 force preemption
        llm = LLM(str(smollm2_path), dtype="float32", device="cpu", num_kv_blocks=12, max_num_seqs=6,
                  preemption_mode=mode, swap_space="32MiB")
        assert texts(llm, greedy) == want_greedy
        if mode == "swap":
            assert all(valid_json(t, PERSON) for row in texts(llm, sampled) for t in row)
        assert llm.metrics()[f"num_preemptions_{mode}"] > 0
        llm.engine.check_idle()
