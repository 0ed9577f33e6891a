"""The CUDA path end to end: Triton backend, CUDA graphs, pinned swaps, memory profiling. Needs a GPU."""

import pytest
import torch

from batchrun import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    return [{"prompt_token_ids": torch.randint(3, 2000, (n,), generator=g).tolist()} for n in [3, 17, 40, 64, 100, 33]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_match_eager_and_cpu(tiny_llama_path, prompts):
    cpu = _ids(LLM(str(tiny_llama_path), device="cpu", num_kv_blocks=200).generate(prompts, GREEDY, use_tqdm=False))
    eager = LLM(str(tiny_llama_path), device="cuda", dtype="float32", num_kv_blocks=200, enforce_eager=True)
    graphs = LLM(str(tiny_llama_path), device="cuda", dtype="float32", num_kv_blocks=200, max_num_seqs=16)
    assert graphs.engine.runner.graphs is not None
    assert _ids(eager.generate(prompts, GREEDY, use_tqdm=False)) == cpu
    assert _ids(graphs.generate(prompts, GREEDY, use_tqdm=False)) == cpu


def test_swap_on_cuda(tiny_llama_path, prompts):
    ref = _ids(LLM(str(tiny_llama_path), device="cuda", dtype="float32", num_kv_blocks=200).generate(
        prompts, GREEDY, use_tqdm=False))
    llm = LLM(str(tiny_llama_path), device="cuda", dtype="float32", num_kv_blocks=8, swap_space="64MiB",
              preemption_mode="swap")
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert llm.metrics()["num_preemptions_swap"] > 0
    llm.engine.check_idle()


def test_gpu_memory_utilization_sizes_the_pool(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), device="cuda", gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    pool = llm.engine.runner.kv_cache
    assert pool.numel() * pool.element_size() <= 0.3 * total
    assert llm.metrics()["kv_blocks_total"] > 1000
