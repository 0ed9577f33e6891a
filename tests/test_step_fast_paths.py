"""The per-step fast paths give what the general paths give: persistent block-table rows, deferred
detokenization, the chunked CPU argmax, the plain sampling plan, the runner's attention query rows, and the
engine's plain-row fast path (against the general path, which a request with logprobs takes)."""

import dataclasses
import random

import pytest
import torch
from tokenizers.decoders import DecodeStream

from batchrun import LLM, SamplingParams
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.contract import SamplingRequest, ScheduledSeq, SchedulerOutput
from batchrun.engine.detokenizer import Detokenizer
from batchrun.model.runner.block_tables import BlockTableRows
from batchrun.model.sampling.sampler import argmax_rows
from batchrun.model.sampling.step import plan_sampling


def _padded(tables: list[list[int]], width: int) -> list[list[int]]:
    return [t[:width] + [0] * (width - min(len(t), width)) for t in tables]


def test_block_table_rows_follow_every_change():
    rng = random.Random(0)
    rows = BlockTableRows(width=2, rows=2)  # small, so rows and columns both grow
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not live:  # a sequence joins
            live[next_id] = [rng.randrange(100) for _ in range(rng.randint(1, 4))]
            next_id += 1
        elif op < 0.25:  # one leaves
            del live[rng.choice(list(live))]
        for table in live.values():
            r = rng.random()
            if r < 0.3:
                table.append(rng.randrange(100))  # a new block
            elif r < 0.35:
                table[-1] = rng.randrange(100)  # copy-on-write: in place
            elif r < 0.4:
                table[:] = [rng.randrange(100) for _ in range(rng.randint(1, 3))]  # recompute: shorter
        for k in list(live):
            if rng.random() < 0.1:
                live[k] = list(live[k])  # swap in: a new list
        ids = [k for k in live if rng.random() < 0.9]  # some are not scheduled this step
        rng.shuffle(ids)
        seqs = [ScheduledSeq(i, [1], 0, live[i], True) for i in ids]
        if not seqs:
            continue
        width = rng.randint(1, max(len(live[i]) for i in ids))
        assert rows.gather(seqs, width).tolist() == _padded([live[i] for i in ids], width)


def test_decode_slot_matches_allocate():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    assert bm.allocate(0, 4, 0) == []  # one full block
    assert bm.decode_slot(0, 4) == bm.block_table(0) and len(bm.block_table(0)) == 2  # took a new block
    assert bm.decode_slot(0, 5) == bm.block_table(0) and len(bm.block_table(0)) == 2  # room left
    bm.fork(0, 1)
    assert bm.decode_slot(1, 6) is None  # shared last block: copy-on-write is allocate's
    assert bm.decode_slot(7, 0) is None  # not resident
    bm.check()


@pytest.mark.parametrize("skip_special", [True, False])
def test_deferred_text_equals_incremental(tokenizer, skip_special):
    rng = random.Random(1)
    vocab = len(tokenizer)
    natural = tokenizer.encode("Hello wörld, ünïcode ✓ 日本語 🚀 the river and the mountain 12 34")
    for trial in range(300):
        if trial % 2:
            cut = rng.randrange(1, len(natural))
            prompt, out = natural[:cut], natural[cut:] + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            out = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        out += [vocab + 5] if trial % 7 == 0 else []  # a padded-vocabulary id: no text
        deferred = Detokenizer(tokenizer, prompt, skip_special, [], False)
        assert deferred.deferred
        for t in out:
            assert deferred.add(t) is None
        deferred.finish(out)
        stream = DecodeStream(ids=prompt[-8:], skip_special_tokens=skip_special)
        expected = "".join(c for c in (stream.step(tokenizer._tokenizer, t) for t in out if t < vocab) if c)
        assert deferred.text == expected


def test_argmax_rows_is_argmax():
    g = torch.Generator().manual_seed(0)
    for width in (64, 100, 2048, 32000):
        for rows in (1, 5, 300):
            x = torch.randn(rows, width, generator=g)
            assert torch.equal(argmax_rows(x), x.argmax(-1))
            ties = torch.randint(0, 3, (rows, width), generator=g).float()
            ties[0, width // 2] = float("nan")
            ties[-1] = float("-inf")
            if rows > 2:
                ties[1, 3] = ties[1, width - 1] = float("nan")
                ties[2] = float("nan")
            assert torch.equal(argmax_rows(ties), ties.argmax(-1))
            assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(-1))


def test_plain_plan_and_general_plan_ban_the_same():
    greedy = SamplingParams(temperature=0)
    plain = [SamplingRequest(greedy, [i], 0, [1, 2], 2, [5, 6] if i % 2 else []) for i in range(4)]
    plan = plan_sampling(plain, 16, torch.device("cpu"))
    assert plan.rows is None and plan.num_drawn == 4
    assert [t.tolist() for t in plan.batch.banned] == [[1, 1, 3, 3], [5, 6, 5, 6]]
    # a two-sample first draw and a plain row: the general plan, each drawn row banned its own ids
    mixed = [SamplingRequest(greedy, [0, 1], 0, [1], 1, [7]), SamplingRequest(greedy, [2], 0, [1], 1, [])]
    plan = plan_sampling(mixed, 16, torch.device("cpu"))
    assert plan.rows.tolist() == [0, 0, 1] and [t.tolist() for t in plan.batch.banned] == [[0, 1], [7, 7]]


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), num_kv_blocks=300, block_size=4)


def test_fast_path_outputs_equal_the_general_path(llm):
    """logprobs=0 sends every row through the general path (stop_decision, per-token detokenization
    where stop strings exist); without it plain rows take the fast path. Same tokens, text, reasons."""
    prompts = ["the river and the mountain are", "a small cat", "one two three four five six"]
    free = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    tok1, tok2 = free[0].outputs[0].token_ids[3], free[1].outputs[0].token_ids[5]
    variants = [
        dict(max_tokens=30, ignore_eos=True),
        dict(max_tokens=30, stop_token_ids=[tok1, tok2], ignore_eos=True),
        dict(max_tokens=30, stop_token_ids=[tok1, tok2], min_tokens=8, ignore_eos=True),
        dict(max_tokens=25, stop=[free[2].outputs[0].text[10:13], "\x00never"]),
        dict(max_tokens=12, stop=["\x00never"], include_stop_str_in_output=True),
        dict(max_tokens=20, n=2, temperature=0.8, seed=3),
        dict(max_tokens=20, temperature=0.9, top_p=0.9, seed=5, min_tokens=4),
    ]
    for v in variants:
        fast = llm.generate(prompts, SamplingParams(**v), use_tqdm=False)
        general = llm.generate(prompts, SamplingParams(**v, logprobs=0), use_tqdm=False)
        for a, b in zip(fast, general):
            for x, y in zip(a.outputs, b.outputs):
                assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                    (y.token_ids, y.text, y.finish_reason, y.stop_reason), v
    llm.engine.check_idle()


def test_runner_query_rows_equal_the_ones_from_the_host_lists(llm):
    """ModelRunner.prepare gives AttentionMetadata the CPU kernel's rows from its own tensors; they equal what
    query_rows derives from the host lists when a constructor gives none."""
    runner = llm.engine.runner  # block size 4; sequence ids far from the engine's own
    decodes = [ScheduledSeq(1000, [5], 6, [1, 2], True), ScheduledSeq(1001, [7], 3, [3], True)]
    steps = [
        (decodes, 2),
        # decodes, a fresh prompt, a chunk after 9 cached tokens, a one-token chunk that is not a decode
        (decodes + [ScheduledSeq(1002, [1, 2, 3, 4, 5], 0, [4, 5], True),
                    ScheduledSeq(1003, [6, 7, 8], 9, [6, 7, 8], False), ScheduledSeq(1004, [9], 2, [9], True)], 2),
        ([ScheduledSeq(1002, [1, 2, 3, 4, 5], 0, [4, 5], True)], 0),
    ]
    for seqs, num_decodes in steps:
        meta = runner.prepare(SchedulerOutput(seqs=seqs, num_decodes=num_decodes))[1].attn
        assert meta.row_seq is not None and meta.row_len is not None
        derived = dataclasses.replace(meta, row_seq=None, row_len=None).query_rows
        for given, expected in zip(meta.query_rows, derived):
            assert given.dtype == torch.int32 and given.device.type == "cpu"
            assert given.tolist() == expected.tolist()
