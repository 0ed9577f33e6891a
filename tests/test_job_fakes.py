"""A fake engine implementing batchrun.pipeline.engine_api.JobEngine (the stepping interface the job layer
drives), for job-runner tests that need no model.

Used in-process (`FakeLLM` as the llm_factory) and in subprocesses through the BATCHRUN_LLM_FACTORY hook
("test_job_fakes:FakeLLM" with tests/ on PYTHONPATH). Completions are a deterministic function of the prompt
token ids, the sample index and (when temperature > 0) the seed, and requests finish out of input order,
so the runner's reordering is exercised. Environment knobs for subprocess tests:
BATCHRUN_FAKE_DELAY (seconds per engine step), BATCHRUN_FAKE_FAIL_AFTER (raise after that many outputs).
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from batchrun.outputs import CompletionOutput, RequestOutput
from batchrun.sampling_params import SamplingParams

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.cache
def make_tokenizer(chat_template: bool = True):
    """A byte-level fast tokenizer (one token per byte, <s> prepended), built offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE if chat_template else None)


def natural_length(ids: list[int]) -> int:
    return 4 + zlib.crc32(bytes(str(ids), "ascii")) % 12


def fake_text(ids: list[int], params: SamplingParams, j: int) -> str:
    h = zlib.crc32(bytes(str(ids), "ascii")) % 1000
    s = f" r{h}"
    if params.temperature > 0:
        s += f" s{params.seed}"
    return (s + f" j{j}") * 8


class FakeLLM:
    """A JobEngine. Takes LLM's keyword arguments (only max_model_len and max_num_seqs mean anything here)."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.model = model
        self.tokenizer = make_tokenizer(os.environ.get("BATCHRUN_FAKE_NO_TEMPLATE") is None)
        self.max_model_len = engine_args.get("max_model_len") or 256
        self.max_num_seqs = engine_args.get("max_num_seqs", 256)
        self.delay = float(os.environ.get("BATCHRUN_FAKE_DELAY", "0"))
        self.fail_after = int(os.environ.get("BATCHRUN_FAKE_FAIL_AFTER", "-1"))
        self.steps = self.outputs = self.running = self.waiting = 0
        self.max_seen_in_flight = 0
        self.requests: dict[str, list] = {}  # request id -> [prompt ids, params, steps left], in arrival order

    def check_prompt(self, prompt_token_ids: list[int], scored: bool = False) -> str | None:
        if not prompt_token_ids:
            return "empty prompt"
        if len(prompt_token_ids) > self.max_model_len - (0 if scored else 1):
            return f"prompt too long: {len(prompt_token_ids)} tokens, max_model_len is {self.max_model_len}"
        return None

    def _complete(self, ids: list[int], params: SamplingParams) -> list[CompletionOutput]:
        outs = []
        for j in range(params.n):
            full = self.tokenizer(fake_text(ids, params, j), add_special_tokens=False)["input_ids"]
            length = natural_length(ids)
            limit = min(length, params.max_tokens or length, self.max_model_len - len(ids))
            toks = full[:limit]
            reason = "stop" if limit == length else "length"
            text = self.tokenizer.decode(toks)
            for s in params.stop:
                if s in text:
                    text, reason = text[:text.index(s)], "stop"
            lps = [{t: -0.5} for t in toks] if params.logprobs is not None else None
            outs.append(CompletionOutput(index=j, text=text, token_ids=toks, cumulative_logprob=None,
                                         logprobs=lps, finish_reason=reason))
        return outs

    def request_steps(self, ids: list[int], params: SamplingParams) -> int:
        """Engine steps a request takes (subclasses make some rows slow)."""
        return min(natural_length(ids), params.max_tokens or 10**9)

    # ---- JobEngine

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    score_from: int = 1) -> None:
        ids = list(prompt_token_ids)
        why = self.check_prompt(ids)
        if why:
            raise ValueError(why)
        assert request_id not in self.requests, request_id
        self.requests[request_id] = [ids, params, self.request_steps(ids, params)]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """The first max_num_seqs requests advance one token; those done come back, latest arrival first
        (so rows finish out of input order)."""
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(self.requests))
        self.steps += 1
        self.running = min(len(self.requests), self.max_num_seqs)
        self.waiting = len(self.requests) - self.running
        if self.delay:
            time.sleep(self.delay)
        done = []
        for request_id, entry in list(self.requests.items())[:self.max_num_seqs]:
            entry[2] -= 1
            if entry[2] <= 0:
                done.append(request_id)
        outs = []
        for request_id in reversed(done):
            ids, params, _ = self.requests.pop(request_id)
            if self.fail_after >= 0 and self.outputs >= self.fail_after:
                raise RuntimeError("fake engine failure")
            self.outputs += 1
            outs.append(RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=ids,
                                      outputs=self._complete(ids, params), finished=True))
        return outs

    def abort_all(self) -> None:
        self.requests.clear()

    def metrics(self) -> dict[str, float | int]:
        return {"num_running": self.running, "num_waiting": self.waiting, "num_swapped": 0,
                "kv_blocks_in_use": self.running, "kv_blocks_total": max(self.max_num_seqs, 1),
                "num_steps": self.steps, "num_requests_finished": self.outputs}

    # ---- LLM's conveniences, over the stepping methods

    def stream(self, items: Iterable[tuple[Any, Any, SamplingParams]], *,
               max_in_flight: int = 1024) -> Iterator[tuple[Any, RequestOutput]]:
        keys: dict[str, Any] = {}
        for n, (key, prompt, params) in enumerate(items):
            assert isinstance(prompt, dict) and "prompt_token_ids" in prompt, prompt
            while len(keys) >= max_in_flight:
                yield from ((keys.pop(out.request_id), out) for out in self.step())
            keys[str(n)] = key
            self.add_request(str(n), prompt["prompt_token_ids"], params)
        while keys:
            yield from ((keys.pop(out.request_id), out) for out in self.step())

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = sampling_params or SamplingParams()
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                p = {"prompt_token_ids": self.tokenizer(p)["input_ids"]}
            elif "prompt" in p:
                p = {"prompt_token_ids": self.tokenizer(p["prompt"])["input_ids"]}
            items.append((i, p, params[i] if isinstance(params, list) else params))
        got = dict(self.stream(items))
        return [got[i] for i in range(len(items))]


# ---------------------------------------------------------------- the fake's own contract


def test_fake_stream_reorders_and_honours_params():
    llm = FakeLLM("fake")
    p = SamplingParams(max_tokens=3, n=2)
    items = [(i, {"prompt_token_ids": [0, 70 + i]}, p) for i in range(20)]
    got = list(llm.stream(items, max_in_flight=8))
    keys = [k for k, _ in got]
    assert sorted(keys) == list(range(20)) and keys != sorted(keys)
    for _, out in got:
        assert len(out.outputs) == 2 and all(len(o.token_ids) <= 3 for o in out.outputs)
    assert llm.max_seen_in_flight <= 8


def test_fake_generate_in_order():
    llm = FakeLLM("fake")
    outs = llm.generate(["hello", "world"], SamplingParams(max_tokens=5))
    assert [o.request_id for o in outs] == ["0", "1"]


# ---------------------------------------------------------------- helpers shared by the job / cli tests


class ExplodingLLM(FakeLLM):
    """Records that a model was constructed (BATCHRUN_FAKE_MARKER) and fails: for "before the model" tests."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        marker = os.environ.get("BATCHRUN_FAKE_MARKER")
        if marker:
            with open(marker, "w") as f:
                f.write(model)
        raise RuntimeError("a model was constructed")


def real_engine_available() -> bool:
    """True once batchrun.llm.LLM is implemented (and BATCHRUN_TEST_ENGINE is not 'fake')."""
    import inspect

    from batchrun.llm import LLM

    mode = os.environ.get("BATCHRUN_TEST_ENGINE", "auto")
    if mode in ("fake", "real"):
        return mode == "real"
    try:
        return "raise NotImplementedError" not in inspect.getsource(LLM.__init__)
    except (OSError, TypeError):
        return True


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def batchrun_cmd() -> list[str]:
    """The console script when installed next to this Python, else `python -m batchrun.cli`."""
    import sys

    script = os.path.join(os.path.dirname(sys.executable), "batchrun")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "batchrun.cli"]


def cli_env(*, fake: bool | None = None, **extra: str) -> dict[str, str]:
    """Environment for a batchrun subprocess: the fake engine unless the real one works (or fake=True)."""
    env = dict(os.environ)
    env.pop("BATCHRUN_LLM_FACTORY", None)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    use_fake = (not real_engine_available()) if fake is None else fake
    if use_fake:
        env["BATCHRUN_LLM_FACTORY"] = "test_job_fakes:FakeLLM"
    env.update(extra)
    return env


def run_cli(args: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float = 180):
    import subprocess

    return subprocess.run(batchrun_cmd() + [str(a) for a in args], capture_output=True, text=True,
                          env=env or cli_env(), cwd=cwd, timeout=timeout)


def write_job(path, **sections) -> str:
    """Write a job YAML; model defaults to builtin:tiny-llama with small engine limits."""
    import yaml

    job = {"model": {"path": "builtin:tiny-llama"},
           "sampling": {"max_tokens": 8, "temperature": 0.0},
           "engine": {"max_num_seqs": 8}}
    for name, value in sections.items():
        if value is None:
            job.pop(name, None)
        elif isinstance(value, dict) and isinstance(job.get(name), dict):
            job[name] = {**job[name], **value}
        else:
            job[name] = value
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return str(path)


def read_rows(out_dir) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(str(out_dir)).to_pylist()


class PacedLLM:
    """The engine the tests run (real when it works, else FakeLLM), handing out one finished request per
    BATCHRUN_FAKE_DELAY seconds: lets a test kill a run half way, deterministically."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        if real_engine_available():
            from batchrun.llm import LLM

            self.inner = LLM(model, **kwargs)
            self.delay = float(os.environ.get("BATCHRUN_FAKE_DELAY", "0"))
        else:
            self.inner = FakeLLM(model, **kwargs)
            self.delay = 0.0  # FakeLLM sleeps per step itself
        self.tokenizer = self.inner.tokenizer
        self.max_model_len = self.inner.max_model_len
        self.ready: list[RequestOutput] = []  # finished in the inner engine, not yet handed out

    def check_prompt(self, ids, scored=False):
        return self.inner.check_prompt(ids, scored)

    def metrics(self):
        return self.inner.metrics()

    def add_request(self, request_id, prompt_token_ids, params, **kwargs):
        self.inner.add_request(request_id, prompt_token_ids, params, **kwargs)

    def has_unfinished(self):
        return bool(self.ready) or self.inner.has_unfinished()

    def step(self):
        if not self.ready:
            self.ready = list(self.inner.step())
            if not self.delay:
                self.ready, done = [], self.ready
                return done
        if not self.ready:
            return []
        time.sleep(self.delay)
        return [self.ready.pop(0)]

    def abort_all(self):
        self.ready.clear()
        self.inner.abort_all()
