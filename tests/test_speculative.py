"""Speculative decoding by prompt lookup (engine/ngram.py): the drafter, and that drafts change no output where
rows are batch invariant, through stops, admissions, preemption and the prefix cache."""

import random

import pytest
import torch
from draft_helpers import FreeRows
from transformers import AutoModelForCausalLM

from batchrun import LLM, SamplingParams
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.draft_policy import KeepRate, StepCosts, choose_drafts
from batchrun.engine.ngram import MAX_N, NgramDrafter
from batchrun.engine.request import SeqStatus, Sequence, SequenceGroup
from batchrun.engine.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _brute_force(ids: list[int], k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix (n = MAX_N..1) and what followed it, continued as
    the loop it closes (period len(ids) - end) where that runs into the end."""
    for n in range(min(MAX_N, len(ids)), 0, -1):
        for end in range(len(ids) - 1, n - 1, -1):
            if ids[end - n : end] == ids[len(ids) - n :]:
                return [ids[end + j % (len(ids) - end)] for j in range(k)]
    return []


def test_the_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(0, 100)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]  # the later of two 3-gram matches
    assert NgramDrafter(0, 100).propose([4, 5, 6, 4, 9, 9, 5, 6], 2) == [4, 9]  # 2-gram when no 3-gram matches
    assert NgramDrafter(0, 100).propose([1, 2, 3, 4], 4) == []  # nothing occurred before
    assert NgramDrafter(0, 100).propose([7, 7, 7], 4) == [7, 7, 7, 7]  # a loop of period 1, continued
    assert NgramDrafter(0, 100).propose([5, 1, 2, 3, 1, 2, 3, 1], 5) == [2, 3, 1, 2, 3]  # period 3
    assert NgramDrafter(0, 9).propose([1, 2, 1, 2, 1, 2, 1], 8) == [2]  # length 9 reached: one token then the end
    assert NgramDrafter(0, 8).propose([1, 2, 1, 2, 1, 2, 1], 8) == []  # the step's own token is the last
    assert NgramDrafter(10, 100).propose([1, 2, 1, 2, 1], 3) == []  # before min_len (min_tokens bans ids)


def test_the_incremental_index_finds_what_a_full_search_finds():
    rng = random.Random(0)
    for _ in range(50):
        d = NgramDrafter(0, 10_000)
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        for _ in range(40):
            assert d.propose(ids, 5) == _brute_force(ids, 5), ids
            ids += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # a step appends 1 to 1 + k tokens


def _costs(points: list[tuple[int, float]]) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in points:
        costs.observe(rows, seconds)
    return costs


def test_step_costs_are_learned_by_rows_and_interpolated():
    costs = _costs([(8, 0.010), (64, 0.050), (64, 0.060), (4096, 2.0), (300, 0.3)])
    curve = costs.curve()
    assert [r for r, _ in curve] == [8, 64, 300, 4096]
    assert curve[1][1] == pytest.approx(0.0525)  # the running mean of the two 64-row steps
    assert StepCosts.at(curve, 36) == pytest.approx(0.010 + (0.0525 - 0.010) * 28 / 56)
    assert StepCosts.at(curve, 4) == 0.010  # below the first point: its time
    assert StepCosts.at(curve, 5000) > 2.0  # past the last: the last slope
    # a point slower than one with more rows (noise) is dropped from the curve
    assert [r for r, _ in _costs([(8, 0.05), (64, 0.02), (256, 0.1)]).curve()] == [64, 256]


def test_a_keep_rate_counts_the_drafts_up_to_the_first_miss():
    keep = KeepRate()
    assert keep.rate == 0.5  # the prior
    keep.record(4, 4)  # all kept: 4 trials, 4 kept
    keep.record(5, 1)  # one kept, then a miss: 2 trials
    assert (keep.kept, keep.trials) == (5, 6)
    assert keep.rate == pytest.approx((5 + 2) / (6 + 4))


def test_a_new_sequence_starts_from_what_every_sequence_s_drafts_did():
    job = KeepRate()
    first, second = KeepRate(prior=job), KeepRate(prior=job)
    for _ in range(10):
        first.record(4, 0)  # a miss at the first draft, ten times
    assert (job.kept, job.trials) == (0, 10)  # the job's record counts every sequence's
    assert job.rate == pytest.approx(2 / 14)
    assert second.rate == pytest.approx(job.rate)  # nothing of its own yet: the job's rate, not 0.5
    second.record(2, 2)
    assert second.rate == pytest.approx((2 + job.rate * 4) / (2 + 4))


def test_drafts_are_checked_only_where_they_pay_for_their_rows():
    proposals = [(1, [7, 7, 7, 7], 0.9), (2, [5, 5, 5, 5], 0.25), (3, [4, 4], 0.6)]
    # rows nearly free (a forward that reads the weights): every draft
    flat = _costs([(8, 0.100), (128, 0.101)])
    assert {i: len(d) for i, d in choose_drafts(proposals, 8, 100, flat).items()} == {1: 4, 2: 4, 3: 2}
    # ... within the spare rows, the likeliest first
    assert {i: len(d) for i, d in choose_drafts(proposals, 8, 5, flat).items()} == {1: 4, 3: 1}
    # every row costs what a decode row costs (compute-bound, no fixed part): no draft can pay
    linear = _costs([(1, 0.001), (8, 0.008), (128, 0.128)])
    assert choose_drafts(proposals, 8, 100, linear) == {}
    # 8 ms fixed + 1 ms a row, 8 rows: a step returns 0.5 token a ms, and a draft pays only if it is kept more
    # than half the time (the 0.9 sequence's four, 0.9^4 = 0.66; the 0.6 sequence's first; none of the 0.25's)
    half = _costs([(8, 0.016), (64, 0.072)])
    assert {i: len(d) for i, d in choose_drafts(proposals, 8, 100, half).items()} == {1: 4, 3: 1}
    assert choose_drafts(proposals, 8, 100, StepCosts()) == {}  # nothing learned yet: no drafts


def _drafting_scheduler(spare_rows: int, remaining: list[int]) -> Scheduler:
    """A scheduler running one decoding sequence per entry, each in a loop of period 2 (so each proposes k
    drafts), `remaining` tokens short of its max length; rows cost nothing (FreeRows)."""
    cfg = SchedulerConfig(num_speculative_tokens=4, speculative_max_rows=spare_rows + len(remaining))
    sched = Scheduler(cfg, BlockManager(64, 4))
    sched.step_costs = FreeRows()
    for i, left in enumerate(remaining):
        ids = [1, 2] * 5
        seq = Sequence(i, ids, 4, 0, status=SeqStatus.RUNNING, num_computed=len(ids) - 1)
        seq.drafter = NgramDrafter(0, len(ids) + left, 4)
        sched.running.append(SequenceGroup(str(i), i, None, ids[:4], GREEDY, [seq]))
    return sched


def test_the_scheduler_plans_the_policys_drafts_within_the_spare_rows():
    sched = _drafting_scheduler(12, remaining=[20, 50, 30])
    assert {i: len(d) for i, d in sched._plan_drafts(12).items()} == {0: 4, 1: 4, 2: 4}
    sched = _drafting_scheduler(5, remaining=[20, 50, 30])
    assert sum(map(len, sched._plan_drafts(5).values())) == 5
    # a sequence near its max length proposes only what fits before it
    sched = _drafting_scheduler(12, remaining=[3, 50])
    assert {i: len(d) for i, d in sched._plan_drafts(12).items()} == {0: 2, 1: 4}

@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    # a repeated pattern in some prompts, so that drafts match from the first steps, not only after loops
    plain = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 63, 24)]
    return plain + [p[:6] * 4 for p in plain[1:4]]


def _generate(path, prompts, params=GREEDY, **kw):
    llm = LLM(str(path), **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 400, "num_speculative_tokens": 8, **kw})
    llm.engine.scheduler.step_costs = FreeRows()  # every proposed draft is checked, whatever this machine's timings
    execute, llm.computed_tokens = llm.engine.runner.execute, 0

    def counting(out):  # the tokens each step puts into the cache as the sequence's own (drafts are not)
        llm.computed_tokens += sum(len(s.token_ids) - s.num_draft for s in out.seqs)
        return execute(out)

    llm.engine.runner.execute = counting
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_idle()
    return llm, outs


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_drafts_change_no_token_in_the_batch_invariant_mode(tiny_llama_path, prompts):
    """fp32 on a CPU is batch invariant by default: a draft's row gives the bits a decode row would, so every
    token is the one plain decoding gives, and transformers' (greedy, fp32)."""
    plain_llm, plain = _generate(tiny_llama_path, prompts, num_speculative_tokens=0)
    llm, drafted = _generate(tiny_llama_path, prompts)  # 8 drafts per step at most
    assert llm.engine.scheduler.config.num_speculative_tokens > 0 and llm.batch_invariant
    assert _tokens(drafted) == _tokens(plain)
    m = llm.engine.metrics
    assert 0 < m.accepted_draft_tokens < m.draft_tokens  # drafts were kept, and some were rejected
    assert m.num_steps < plain_llm.engine.metrics.num_steps
    # every token's K/V computed once: a kept draft's is the one its checking step stored, not computed again
    assert plain_llm.computed_tokens == sum(map(len, prompts)) + (48 - 1) * len(prompts)
    assert llm.computed_tokens + m.accepted_draft_tokens == plain_llm.computed_tokens
    assert m.generation_tokens == plain_llm.engine.metrics.generation_tokens == 48 * len(prompts)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    for p, out in list(zip(prompts, drafted))[-4:]:
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, min_new_tokens=48,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref


def test_a_stop_inside_the_drafts_ends_the_sequence_where_decoding_would(tiny_llama_path, tokenizer, prompts):
    _, plain = _generate(tiny_llama_path, prompts, num_speculative_tokens=0)
    params = []
    for i, out in enumerate(plain):  # stop on a token, or a string, that greedy decoding reaches mid-way
        ids = out.outputs[0].token_ids
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[ids[20]]))
        elif i % 3 == 1:
            text = out.outputs[0].text
            params.append(SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                         stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
        else:
            params.append(SamplingParams(max_tokens=7 + i, temperature=0.0, ignore_eos=True, min_tokens=5,
                                         stop_token_ids=[ids[2]]))
    _, want = _generate(tiny_llama_path, prompts, params, num_speculative_tokens=0)
    llm, got = _generate(tiny_llama_path, prompts, params, num_speculative_tokens=6)
    assert llm.engine.metrics.accepted_draft_tokens > 0
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
               (w.token_ids, w.text, w.finish_reason, w.stop_reason)
    assert any(w.outputs[0].finish_reason == "stop" for w in want)


def test_penalized_logprob_and_n_rows_do_not_draft(tiny_llama_path, prompts):
    """Penalized and logprob rows, and n > 1, decode one token a step: their outputs are unchanged."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, n=2, ignore_eos=True)]
    rows = prompts[-3:]
    _, want = _generate(tiny_llama_path, rows, params, num_speculative_tokens=0)
    llm, got = _generate(tiny_llama_path, rows, params)
    assert llm.engine.metrics.draft_tokens == 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs


def test_sampled_rows_draw_the_same_tokens_with_and_without_drafts(tiny_llama_path, prompts):
    """A seeded row's token at output position i is drawn from (seed, i) alone (model/sampling/sampler.py), and a draft's row
    has the bits its decode row would have (fp32 is batch invariant): checking a draft is drawing that position's
    token, so drafts change no token of a sampled row, whatever its filters."""
    filters = [dict(temperature=0.8), dict(temperature=0.6, top_p=0.9), dict(temperature=1.0, top_k=5),
               dict(temperature=0.7, min_p=0.1), dict(temperature=0.5, top_k=20, top_p=0.95)]
    params = [SamplingParams(max_tokens=40, seed=100 + i, ignore_eos=True, **filters[i % len(filters)])
              for i in range(len(prompts))]
    _, want = _generate(tiny_llama_path, prompts, params, num_speculative_tokens=0)
    llm, got = _generate(tiny_llama_path, prompts, params, num_speculative_tokens=6)
    m = llm.engine.metrics
    assert 0 < m.accepted_draft_tokens < m.draft_tokens  # drafts were checked, some kept, some not
    assert _tokens(got) == _tokens(want)


def test_drafts_next_to_admissions_preemption_and_the_prefix_cache(tiny_llama_path, prompts):
    """Few sequences at a time (prompts are admitted while others check drafts, in one step), a pool small
    enough to preempt, and prompts sharing a prefix: the same tokens as plain decoding, and every block back."""
    shared = [prompts[4][:32] + p for p in prompts[:6]]
    rows = prompts + shared
    kw = dict(max_num_seqs=4, num_kv_blocks=32, block_size=8, max_num_batched_tokens=64)
    plain_llm, plain = _generate(tiny_llama_path, rows, num_speculative_tokens=0, **kw)
    llm = LLM(str(tiny_llama_path), dtype="float32", device="cpu", num_speculative_tokens=8, **kw)
    llm.engine.scheduler.step_costs = FreeRows()  # every proposed draft is checked, whatever this machine's timings
    eng, step, longest = llm.engine, llm.engine.step, []

    def checked_step():  # after every step only a sequence's last block is partly filled: rejected drafts' go back
        finished = step()
        bm = eng.block_manager
        longest.append(max((len(t) - bm.blocks_for(len(eng.seqs[i].token_ids)) for i, t in bm.tables.items()
                            if i in eng.seqs), default=0))
        return finished

    eng.step = checked_step
    drafted = llm.generate([{"prompt_token_ids": p} for p in rows], GREEDY, use_tqdm=False)
    eng.step = step
    assert max(longest) <= 0
    assert _tokens(drafted) == _tokens(plain)
    m = llm.engine.metrics
    assert m.accepted_draft_tokens > 0 and m.prefix_cache_hit_tokens > 0
    assert plain_llm.engine.metrics.num_preemptions_recompute + plain_llm.engine.metrics.num_preemptions_swap > 0
    assert m.num_preemptions_recompute + m.num_preemptions_swap > 0  # the drafted run preempted too
    again = llm.generate([{"prompt_token_ids": p} for p in rows], GREEDY, use_tqdm=False)  # blocks cached by drafts
    assert _tokens(again) == _tokens(plain)
    llm.engine.check_idle()


def test_bf16_drafts_change_no_token_when_run_batch_invariant(tiny_llama_path, prompts):
    from batchrun.kernels import cpu as cpu_kernels
    from batchrun.kernels.cpu import linears as cpu_linears

    if not cpu_kernels.available() or not (torch.ops.mkldnn._is_mkldnn_bf16_supported()
                                           or cpu_linears.has_panel_linears()):
        pytest.skip("needs the C kernels and batch-invariant bf16 linears (oneDNN's, or batchrun's panels)")
    kw = dict(dtype="bfloat16", batch_invariant=True)
    params = [GREEDY if i % 2 else SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    _, plain = _generate(tiny_llama_path, prompts, params, num_speculative_tokens=0, **kw)
    llm, drafted = _generate(tiny_llama_path, prompts, params, **kw)
    assert llm.engine.metrics.accepted_draft_tokens > 0
    assert _tokens(drafted) == _tokens(plain)
