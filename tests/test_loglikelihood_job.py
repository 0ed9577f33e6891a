"""`task: loglikelihood` jobs and the `prompt_logprobs` column of generation jobs, end to end on a tiny checkpoint.

Each (context, continuation) row is scored as the harness does (context tokenized as a prompt, continuation without
special tokens) and held to transformers' log_softmax in fp32: the summed log-probability within 1e-4, `is_greedy`
exactly. Row errors (empty or null cells, a row too long) and input.on_too_long's cut of the context; a run killed
after its first part resumes to the uninterrupted run's rows; two shards merged are the unsharded output; a bad key
exits 2 before a model is made."""

import json
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from click.testing import CliRunner
from test_job_fakes import batchrun_cmd, cli_env, read_rows, write_job
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrun.cli import main

TOL = 1e-4
MAX_LEN = 96
CONTEXTS = ["The cat sat on the", "Once upon a time", "", "Paris is the capital of", "Question: 2 + 2 =",
            "the old farmer reads a long letter near the river", "hello", "a b c d e f"]
CONTINUATIONS = [" mat", " there was a king", "Hello world", " France", " 4", " while the cat sleeps", " there",
                 " g"]


def run(args, **env):
    """`batchrun ARGS` in this process, on the real engine."""
    return CliRunner().invoke(main, [str(a) for a in args], env={"BATCHRUN_LLM_FACTORY": None, **env})


@pytest.fixture(scope="module")
def model(make_ckpt):
    path = make_ckpt("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, AutoTokenizer.from_pretrained(path), hf


def log_softmax(hf, ids):
    """[len(ids) - 1, vocab]: the log-probabilities of each next token, in fp32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def encode(tok, context, continuation):
    """The harness's tokenization: the context as a prompt (an empty one: BOS, else EOS), the continuation bare."""
    ctx = tok(context)["input_ids"] or [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
    return ctx, tok(continuation, add_special_tokens=False)["input_ids"]


def reference(hf, ids, n):
    """(summed log-probability of the last n of ids, is each of them its position's argmax)."""
    rows = log_softmax(hf, ids)[-n:]
    target = torch.tensor(ids[-n:])
    return rows.gather(1, target[:, None]).double().sum().item(), bool((rows.argmax(-1) == target).all())


def greedy_rows(tok, hf):
    """Continuations that are the model's own greedy tokens after their context (and text that tokenizes back to
    them), so that some rows are greedy; each beside a copy with its last token replaced, which is not."""
    rows = []
    for context in ("The cat sat on the", "Once upon a time", "a b c"):
        ctx = tok(context)["input_ids"]
        ids = list(ctx)
        for _ in range(3):
            ids.append(int(log_softmax(hf, ids + [0])[-1].argmax()))
        text = tok.decode(ids[len(ctx):])
        if tok(text, add_special_tokens=False)["input_ids"] == ids[len(ctx):]:
            rows.append((context, text))
            rows.append((context, tok.decode(ids[len(ctx):-1] + [(ids[-1] + 1) % 200 + 3])))
    return rows


@pytest.fixture(scope="module")
def job(tmp_path_factory, model):
    """The scored job's input, job file and uninterrupted output."""
    path, tok, hf = model
    d = tmp_path_factory.mktemp("loglikelihood")
    greedy = greedy_rows(tok, hf)
    contexts = CONTEXTS + [c for c, _ in greedy]
    continuations = CONTINUATIONS + [c for _, c in greedy]
    n = len(contexts)
    pq.write_table(pa.table({"id": [f"q{i:02d}" for i in range(n)], "context": contexts,
                             "continuation": continuations, "topic": [f"t{i % 3}" for i in range(n)]}),
                   d / "in.parquet", row_group_size=4)
    job_path = write_job(d / "job.yaml", task="loglikelihood", sampling=None,
                         model={"path": str(path), "dtype": "float32", "device": "cpu", "max_model_len": MAX_LEN},
                         input={"path": str(d / "in.parquet"), "keep_columns": ["topic"]},
                         engine={"max_num_seqs": 4, "num_kv_blocks": 64},
                         output={"path": str(d / "ref"), "rows_per_part": 4, "include_token_ids": True})
    result = run(["run", job_path, "--quiet"])
    assert result.exit_code == 0, result.output
    return d, job_path, read_rows(d / "ref"), len(greedy)


def test_scores_equal_transformers(job, model):
    d, _, rows, n_greedy = job
    _, tok, hf = model
    contexts = pq.read_table(d / "in.parquet").to_pylist()
    assert [r["id"] for r in rows] == [c["id"] for c in contexts]
    assert list(rows[0]) == ["id", "topic", "logprob", "is_greedy", "num_tokens", "prompt_tokens", "token_ids",
                             "error"]
    greedy = []
    for row, given in zip(rows, contexts):
        ctx, cont = encode(tok, given["context"], given["continuation"])
        logprob, is_greedy = reference(hf, ctx + cont, len(cont))
        assert row["error"] is None and row["topic"] == given["topic"]
        assert abs(row["logprob"] - logprob) <= TOL, (given, row["logprob"], logprob)
        assert row["is_greedy"] == is_greedy, given
        assert row["num_tokens"] == len(cont) and row["token_ids"] == cont
        assert row["prompt_tokens"] == len(ctx) + len(cont)
        greedy.append(is_greedy)
    assert n_greedy >= 2 and True in greedy and False in greedy
    shown = run(["show", d / "ref", "-n", "3"])
    assert shown.exit_code == 0 and shown.output.splitlines()[0].split(" | ")[1:4] == ["logprob", "is_greedy",
                                                                                        "num_tokens"]


def test_row_errors_and_cutting_the_context(tmp_path, model):
    """An empty or null continuation, a row too long: row errors. truncate_left cuts the context from the left and
    scores the continuation whole; skip writes the row unscored; a continuation too long alone stays an error."""
    path, tok, hf = model
    long_context = " ".join(["stone river letter"] * 40)
    table = {"context": ["The cat sat on the", "hello", None, long_context, "x", "The cat"],
             "continuation": ["", None, " there", " near the farm", " y" * MAX_LEN, " sat"]}
    pq.write_table(pa.table(table), tmp_path / "in.parquet")
    base = dict(task="loglikelihood", sampling=None,
                model={"path": str(path), "dtype": "float32", "device": "cpu", "max_model_len": MAX_LEN},
                input={"path": str(tmp_path / "in.parquet")}, engine={"max_num_seqs": 4, "num_kv_blocks": 64})
    outputs = {}
    for mode in ("error", "truncate_left", "skip"):
        job_path = write_job(tmp_path / f"{mode}.yaml", **{**base, "input": {**base["input"], "on_too_long": mode}},
                             output={"path": str(tmp_path / mode)})
        result = run(["run", job_path, "--quiet"])
        assert result.exit_code == 0, result.output
        outputs[mode] = read_rows(tmp_path / mode)
    errors = [r["error"] for r in outputs["error"]]
    assert errors[:3] == ["continuation is empty", "continuation is null", "context is null"]
    assert "max_model_len=96" in errors[3] and "max_model_len=96" in errors[4] and errors[5] is None
    assert all(r["logprob"] is None for r in outputs["error"][:5])

    cut = outputs["truncate_left"][3]
    ctx, cont = encode(tok, long_context, " near the farm")
    kept = ctx[len(ctx) - (MAX_LEN - len(cont)):]  # this tokenizer adds no BOS to keep; a scored row fills the context
    assert cut["error"] is None and cut["truncated_tokens"] == len(ctx) - len(kept) > 0
    assert cut["prompt_tokens"] == MAX_LEN and cut["num_tokens"] == len(cont)
    assert abs(cut["logprob"] - reference(hf, kept + cont, len(cont))[0]) <= TOL
    assert "leaving no room for a context" in outputs["truncate_left"][4]["error"]
    assert [r["truncated_tokens"] for r in outputs["truncate_left"]] == [None, None, None, cut["truncated_tokens"],
                                                                         None, 0]

    skipped = outputs["skip"][3]
    assert skipped["error"] is None and skipped["logprob"] is None and skipped["is_greedy"] is None
    for mode in outputs:  # the rows that ran score the same whatever the mode
        assert outputs[mode][5]["logprob"] == outputs["error"][5]["logprob"] is not None


def test_requests_as_the_harness_makes_them():
    """With a tokenizer that adds BOS: the context gets it, the continuation does not, an empty context is BOS alone;
    truncate_left keeps the BOS and the continuation whole; the score sums the continuation's entries."""
    from test_job_fakes import make_tokenizer

    from batchrun.config import parse_job
    from batchrun.io.rows import RequestBuilder
    from batchrun.outputs import Logprob

    tok = make_tokenizer()
    cfg = parse_job("task: loglikelihood\nmodel: {path: m}\ninput: {path: i, on_too_long: truncate_left}\n"
                    "output: {path: o}\n")
    builder = RequestBuilder(cfg, source_format="parquet", tokenizer=tok, id_column=None, max_model_len=10,
                             check_prompt=lambda ids, scored=False: None if len(ids) <= 10 - (not scored) else "too long")
    rows = [{"context": "ab", "continuation": "cd"}, {"context": "", "continuation": "xyz"},
            {"context": "abcdefghijkl", "continuation": "xy"}]
    plain, empty, cut = builder.build([(i, i, row) for i, row in enumerate(rows)])
    bos = tok.bos_token_id
    assert plain.prompt_ids == tok("ab")["input_ids"] + tok("cd", add_special_tokens=False)["input_ids"]
    assert plain.prompt_ids.count(bos) == 1 and plain.prompt_ids[0] == bos and plain.continuation_tokens == 2
    assert empty.prompt_ids == [bos] + tok("xyz", add_special_tokens=False)["input_ids"]
    assert cut.error is None and cut.prompt_ids[0] == bos and len(cut.prompt_ids) == 10
    assert cut.prompt_ids[-2:] == tok("xy", add_special_tokens=False)["input_ids"]
    assert cut.prompt_ids[1:-2] == tok("abcdefghijkl", add_special_tokens=False)["input_ids"][-7:]
    assert cut.truncated == 13 - 8
    params = plain.params
    assert (params.max_tokens, params.prompt_logprobs, params.detokenize) == (0, 0, False)

    ids = plain.prompt_ids
    plain.prompt_logprobs = [None] + [{t: Logprob(-0.5 * i, rank=1)} for i, t in enumerate(ids[1:], start=1)]
    assert plain.score() == (-0.5 * (len(ids) - 2) - 0.5 * (len(ids) - 1), True)
    plain.prompt_logprobs[-1] = {ids[-1]: Logprob(-3.0, rank=2), 7: Logprob(-0.1, rank=1)}
    assert plain.score() == (-0.5 * (len(ids) - 2) - 3.0, False)
    plain.prompt_logprobs = None  # an engine that gave none: no score (the row is written as an error)
    assert plain.score() is None


def start_paced(job_path, out, delay):
    env = cli_env(fake=False, BATCHRUN_FAKE_DELAY=str(delay), BATCHRUN_LLM_FACTORY="test_job_fakes:PacedLLM")
    return subprocess.Popen(batchrun_cmd() + ["run", job_path, "--set", f"output.path={out}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_resume_after_a_kill_gives_the_uninterrupted_rows(job):
    d, job_path, ref, _ = job
    out = d / "killed"
    proc = start_paced(job_path, out, delay=0.4)
    deadline = time.monotonic() + 180
    while not (out / "part-00000.parquet").exists():
        assert proc.poll() is None, f"the run ended before committing a part: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "no part committed in time"
        time.sleep(0.01)
    proc.kill()
    proc.wait(timeout=30)
    assert not (out / "_SUCCESS").exists()
    committed = read_rows(out)
    assert 4 <= len(committed) < len(ref) and committed == ref[:len(committed)]
    result = run(["run", job_path, "--set", f"output.path={out}", "--quiet"])
    assert result.exit_code == 0, result.output
    assert read_rows(out) == ref and (out / "_SUCCESS").exists()
    metrics = json.loads((out / "_metrics.json").read_text())
    assert metrics["input_rows"] == len(ref) and metrics["this_run"]["input_rows"] == len(ref) - len(committed)


def test_two_shards_merged_equal_the_unsharded_output(job):
    d, job_path, ref, _ = job
    out = d / "array"
    for shard in ("0/2", "1/2"):
        result = run(["run", job_path, "--set", f"output.path={out}", "--shard", shard, "--quiet"])
        assert result.exit_code == 0, result.output
    assert 0 < len(read_rows(out / "shard-0-of-2")) < len(ref)
    merged = run(["merge", out])
    assert merged.exit_code == 0, merged.output
    assert read_rows(d / "array-merged") == ref


def test_another_job_on_the_output_is_refused(job):
    """The fingerprint holds the task and the columns it reads: a generation job, or other columns, do not resume
    a loglikelihood output."""
    d, job_path, _, _ = job
    other = run(["validate", job_path, "--set", "input.continuation_column=topic"])
    assert other.exit_code == 2 and "input.continuation_column: 'continuation' -> 'topic'" in other.output
    generate = run(["validate", job_path, "--set", "task=generate", "--set", "input.prompt_column=context"])
    assert generate.exit_code == 2 and "holds rows of a different job" in generate.output, generate.output


def bad(d, **sections):
    job = {"task": "loglikelihood", "model": {"path": "builtin:tiny-llama"}, "input": {"path": str(d / "in.parquet")},
           "output": {"path": str(d / "out")}}
    for k, v in sections.items():
        job[k] = {**job[k], **v} if isinstance(v, dict) and isinstance(job.get(k), dict) else v
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    return str(d / "job.yaml")


BAD_JOBS = {
    "unknown task": (lambda d: bad(d, task="embedd"), "task: must be one of generate, loglikelihood, embed, classify, score, got 'embedd'"),
    "missing context column": (lambda d: bad(d, input={"context_column": "ctx"}),
                               "input.context_column: column 'ctx' not found in"),
    "missing continuation column": (lambda d: bad(d, input={"path": str(d / "contexts.parquet")}),
                                    "input.continuation_column: column 'continuation' not found in"),
    "a sampling key": (lambda d: bad(d, sampling={"temperature": 0.7}),
                       "sampling.temperature: not used with task: loglikelihood"),
    "per-row sampling": (lambda d: bad(d, input={"sampling_columns": {"max_tokens": "context"}}),
                         "input.sampling_columns: used with task: generate only"),
    "a prompt column": (lambda d: bad(d, input={"prompt_column": "context"}),
                        "input.prompt_column: used with task: generate / embed / classify only"),
    "truncate_right": (lambda d: bad(d, input={"on_too_long": "truncate_right"}),
                       "input.on_too_long: truncate_right would cut the continuation"),
    "context column on a generation job": (lambda d: bad(d, task="generate", input={
        "path": str(d / "prompts.parquet"), "context_column": "prompt"}),
        "input.context_column: used with task: loglikelihood only"),
    "openai-batch input": (lambda d: bad(d, input={"path": str(d / "batch.jsonl")}),
                           "task: loglikelihood reads rows of texts; openai-batch input"),
    "a column clash": (lambda d: bad(d, input={"keep_columns": ["logprob"]}),
                       "input.keep_columns: 'logprob' clashes with an output column"),
}


@pytest.mark.parametrize("name", list(BAD_JOBS))
def test_bad_keys_exit_2_before_a_model_is_made(name, tmp_path):
    pq.write_table(pa.table({"context": ["a"], "continuation": [" b"], "logprob": [1.0]}), tmp_path / "in.parquet")
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "prompts.parquet")
    pq.write_table(pa.table({"context": ["a"]}), tmp_path / "contexts.parquet")
    (tmp_path / "batch.jsonl").write_text('{"custom_id": "a", "body": {"prompt": "hi"}}\n')
    make, expect = BAD_JOBS[name]
    marker = tmp_path / "constructed"
    env = {"BATCHRUN_LLM_FACTORY": "test_job_fakes:ExplodingLLM", "BATCHRUN_FAKE_MARKER": str(marker)}
    job_path = make(tmp_path)
    for command in ("validate", "run"):
        result = run([command, job_path], **env)
        assert result.exit_code == 2, result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and expect in lines[0], result.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_set_task_is_a_key():
    from batchrun.config import JobError, parse_job

    text = "model: {path: m}\ninput: {path: i}\noutput: {path: o}\n"
    assert parse_job(text, overrides=["task=loglikelihood"]).task == "loglikelihood"
    assert parse_job(text).task == "generate"
    with pytest.raises(JobError, match="--set task.kind=x: task has no sub-keys"):
        parse_job(text, overrides=["task.kind=x"])


# ---------------------------------------------------------------- prompt_logprobs on a generation job


def test_prompt_logprobs_column(tmp_path, model):
    """sampling.prompt_logprobs: k gives each row its prompt's log-probabilities (null for the first token, then the
    token's own and the k most likely), equal to transformers'; a `sampling_columns` value overrides k per row."""
    path, tok, hf = model
    prompts = ["The cat sat on the mat", "Once upon a time there was", "hello there"]
    pq.write_table(pa.table({"prompt": prompts, "k": [None, 0, 3]}), tmp_path / "in.parquet")
    common = dict(model={"path": str(path), "dtype": "float32", "device": "cpu"},
                  engine={"max_num_seqs": 4, "num_kv_blocks": 64}, sampling={"max_tokens": 2, "temperature": 0.0})
    job_path = write_job(tmp_path / "job.yaml", **common,
                         input={"path": str(tmp_path / "in.parquet"), "sampling_columns": {"prompt_logprobs": "k"}},
                         output={"path": str(tmp_path / "out")})
    result = run(["run", job_path, "--quiet", "--set", "sampling.prompt_logprobs=2"])
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    for row, prompt, k in zip(rows, prompts, (2, 0, 3)):
        ids = tok(prompt)["input_ids"]
        ref = log_softmax(hf, ids)
        entries = row["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for pos, entry in enumerate(entries[1:], start=1):
            entry = dict(entry)
            assert abs(entry[ids[pos]] - ref[pos - 1, ids[pos]].item()) <= TOL
            top = ref[pos - 1].topk(k) if k else None
            assert len(entry) <= k + 1
            if top is not None:
                assert all(t in entry and abs(entry[t] - lp) <= TOL
                           for lp, t in zip(top.values.tolist(), top.indices.tolist()))
        assert row["completion_tokens"] == 2
    plain = write_job(tmp_path / "plain.yaml", **common, input={"path": str(tmp_path / "in.parquet")},
                      output={"path": str(tmp_path / "plain")})
    assert run(["run", plain, "--quiet"]).exit_code == 0
    plain_rows = read_rows(tmp_path / "plain")
    assert "prompt_logprobs" not in plain_rows[0]
    assert [r["completion"] for r in plain_rows] == [r["completion"] for r in rows]

