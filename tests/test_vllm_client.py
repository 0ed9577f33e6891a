"""A client of vLLM's offline API, run on batchrun: the functions below use vLLM's names only, the way an evaluation
harness's vLLM backend and a data-generation library drive vLLM (construct with vLLM's usual arguments, generate from
TokensPrompts, score multiple-choice continuations from prompt_logprobs, read Logprobs, free the model). The one line
a client adds is `batchrun.vllm_compat.install()` before it imports vllm (the fixture; it is taken out again after).
Held against transformers on the same tiny checkpoint, and on the real built-in model where meaning matters."""

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

import batchrun.vllm_compat


@pytest.fixture(scope="module", autouse=True)
def vllm_is_batchrun():
    batchrun.vllm_compat.install()  # the line a client adds
    yield
    batchrun.vllm_compat.uninstall()


# ---- the client: vLLM's names only -------------------------------------------------------------------------------

def load(model: str):
    from vllm import LLM

    return LLM(model=model, tokenizer=None, tokenizer_mode="auto", revision=None, tokenizer_revision=None,
               trust_remote_code=False, tensor_parallel_size=1, dtype="float32", max_model_len=512, seed=1234,
               gpu_memory_utilization=0.9, swap_space=1, quantization=None, max_num_seqs=None, enable_lora=False,
               max_lora_rank=16, skip_tokenizer_init=False, device="cpu", kv_cache_memory_bytes=64 * 2**20)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                        lora_request=None)
    return [list(o.outputs[0].token_ids) for o in outs]


def loglikelihoods(llm, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(summed log-probability, is_greedy) of each continuation after its context, as an evaluation harness's vLLM
    backend computes them: one request of the whole sequence, nothing generated but one token."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    inputs = [context + continuation for context, continuation in pairs]
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in inputs], sampling_params=params, use_tqdm=False)
    results = []
    for (context, _), tokens, out in zip(pairs, inputs, outs):
        entries = [None if e is None else {t: getattr(lp, "logprob", lp) for t, lp in e.items()}
                   for e in out.prompt_logprobs]
        ctxlen = len(context)
        total = sum(e.get(t) for t, e in zip(tokens[ctxlen:], entries[ctxlen:]))
        is_greedy = all(max(e, key=e.get) == t for t, e in zip(tokens[ctxlen:], entries[ctxlen:]) if e)
        results.append((total, is_greedy))
    return results


def sampled_logprobs(llm, prompt: list[int]):
    from vllm import SamplingParams, TokensPrompt

    out = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                                                                            ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0]


def free(llm) -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    del llm
    gc.collect()


# ---- what it gets, held to transformers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny_llama_path):
    return load(str(tiny_llama_path))


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenize(tiny_llama_path):
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(str(tiny_llama_path), tokenizer_mode="auto", trust_remote_code=False, revision=None)
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def test_client_construction_reads_what_clients_read(client):
    config = client.llm_engine.model_config
    assert config.max_model_len == 512 and config.dtype == torch.float32
    assert client.get_tokenizer().chat_template == client.llm_engine.tokenizer.chat_template is not None


def test_tokens_prompts_give_transformers_greedy_tokens(client, hf, tokenize):
    prompts = [tokenize(t) for t in ("The river", "Once upon a time there was", "A")]
    got = greedy(client, prompts, max_tokens=12)
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


def test_multiple_choice_scores_equal_transformers(client, hf, tokenize):
    question = tokenize("Question: which of these flows to the sea? Answer:")
    choices = [tokenize(c) for c in (" a river", " a mountain", " the sky above us")]
    scored = loglikelihoods(client, [(question, c) for c in choices])
    for choice, (total, is_greedy) in zip(choices, scored):
        with torch.no_grad():
            logits = hf(torch.tensor([question + choice])).logits[0].float().log_softmax(-1)
        rows = logits[len(question) - 1 : -1]
        assert abs(total - rows[torch.arange(len(choice)), choice].sum().item()) <= 1e-4
        assert is_greedy == (rows.argmax(-1).tolist() == choice)
    # a continuation that is the model's own greedy tokens is greedy
    own = greedy(client, [question], max_tokens=3)[0]
    assert loglikelihoods(client, [(question, own)])[0][1] is True


def test_logprobs_are_vllm_logprobs(client, tokenize):
    out = sampled_logprobs(client, tokenize("The river"))
    tokenizer = client.get_tokenizer()
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        lp = entry[token]
        assert lp.rank == 1 and lp.logprob <= 0 and lp.decoded_token == tokenizer.decode([token])
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) <= 1e-4


def test_the_client_frees_the_model(tiny_llama_path):
    llm = load(str(tiny_llama_path))
    gone = weakref.ref(llm)
    free(llm)
    del llm
    gc.collect()
    assert gone() is None


def test_a_real_model_scores_the_right_answer(smollm2, smollm2_path):
    """SmolLM2 (fp32): the answer a harness scores highest is the right one, and greedy."""
    from vllm import LLM
    from vllm.transformers_utils.tokenizer import get_tokenizer

    assert isinstance(smollm2, LLM)
    tokenizer = get_tokenizer(str(smollm2_path))
    context = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    choices = [tokenizer(c, add_special_tokens=False).input_ids for c in (" Paris", " London", " Berlin")]
    scored = loglikelihoods(smollm2, [(context, c) for c in choices])
    assert max(range(3), key=lambda i: scored[i][0]) == 0 and scored[0][1] is True
