"""Stop strings across token boundaries, stop tokens, min_tokens, max_tokens, include_stop_str_in_output."""

import pytest

from batchrun import LLM, SamplingParams

PROMPT = "the river and the mountain are"


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), num_kv_blocks=200)


@pytest.fixture(scope="module")
def free_run(llm):
    """The unconstrained greedy continuation: tokens and the text of each token."""
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    pieces = [llm.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    return ids, out[0].outputs[0].text, pieces


def _spanning_stop(pieces, text):
    """A 2+ character substring that starts inside one token's text and ends inside a later one."""
    for i in range(1, len(pieces) - 1):
        a, b = len(pieces[i - 1]), len(pieces[i])
        if b - a >= 2 and len(pieces[i + 1]) > b:
            stop = text[b - 1 : b + 1]  # last char of token i, first char of token i+1
            if text.find(stop) == b - 1:
                return stop, b - 1
    pytest.fail("no token boundary to span in the sample text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, free_run, include):
    ids, text, pieces = free_run
    stop, at = _spanning_stop(pieces, text)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00never"],
                                                include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: at + (len(stop) if include else 0)]
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < len(ids)


def test_max_tokens(llm, free_run):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == free_run[0][:7]
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm, free_run):
    ids = free_run[0]
    stop_tok = ids[1]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    held = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, min_tokens=6,
                                                 stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6
    assert stop_tok not in held.token_ids[:5]  # banned until min_tokens are out
    assert held.finish_reason == "length" or held.token_ids[-1] == stop_tok


def test_eos_stops_unless_ignored(llm, free_run, monkeypatch):
    ids = free_run[0]
    monkeypatch.setattr(llm.engine, "eos_token_ids", (ids[2],))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: ids.index(ids[2]) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[:10]
