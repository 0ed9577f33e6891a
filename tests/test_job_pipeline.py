"""The pipeline's pieces on their own: RowSlice (one answer to "which rows are this run's" for the local reader
and the Ray Indexer), the OrderedWriter, the JobEngine protocol that LLM and the fakes implement, and the
job layer's import direction."""

import inspect
import subprocess
import sys

import pyarrow as pa
import pytest
from test_job_fakes import FakeLLM, PacedLLM, real_engine_available

from batchrun.distributed.workers import INDEX, POS, Indexer
from batchrun.io.rows import RowTask
from batchrun.io.slicing import RowSlice
from batchrun.io.sources import Source
from batchrun.llm import LLM
from batchrun.output.writer import OrderedWriter, RowFailure
from batchrun.pipeline.engine_api import JobEngine
from batchrun.pipeline.executor import EngineLoop
from batchrun.sampling_params import SamplingParams


class ListSource(Source):
    """Rows {"i": index}, read in batches of 7 (so batches and shards do not line up)."""

    def __init__(self, n):
        super().__init__("list")
        self.n = n

    def iter_rows(self, start=0, columns=None, batch_size=7):
        for lo in range(start, self.n, batch_size):
            yield [{"i": i} for i in range(lo, min(lo + batch_size, self.n))]


SLICES = [RowSlice(), RowSlice(start=5), RowSlice(base=10, length=20, start=3, limit=12),
          RowSlice(base=10, length=20, limit=40), RowSlice(base=2, stride=3), RowSlice(base=1, stride=4, start=2, limit=6),
          RowSlice(base=0, length=10, start=10)]


@pytest.mark.parametrize("rows", SLICES, ids=str)
def test_the_reader_and_the_indexer_pick_the_same_rows(rows):
    n = 50
    read = [item for batch in rows.read(ListSource(n), None) for item in batch]
    assert all(row["i"] == index for _, index, row in read)
    picked = [(pos, index) for pos, index, _ in read]
    indexer = Indexer(start=0, rows=rows)  # the Ray executor's first stage, fed the whole input in blocks
    stamped = [indexer(pa.table({"i": list(range(lo, min(lo + 9, n)))})) for lo in range(0, n, 9)]
    by_indexer = [(p, i) for t in stamped for p, i in zip(t.column(POS).to_pylist(), t.column(INDEX).to_pylist())]
    assert picked == by_indexer  # one answer to "which rows are this run's", locally and on Ray
    assert [pos for pos, _ in picked] == list(range(rows.start, rows.start + len(picked)))
    assert all(rows.index_of(pos) == index for pos, index in picked)
    first, stop = rows.index_range()
    assert all(first <= index and (stop is None or index < stop) for _, index in picked)


def test_slice_ends():
    shard = RowSlice(base=10, length=20)
    assert shard.end == 20 and shard.complete_at(20) and not shard.short_at(20) and shard.short_at(19)
    limited = RowSlice(base=10, length=20, limit=5)
    assert limited.end == 5 and not limited.complete_at(5)  # stopped at --limit: a rerun continues
    assert RowSlice(length=20, limit=25).complete_at(20)  # a limit past the end completes the job
    assert RowSlice(limit=5).complete_at(3) and not RowSlice(limit=5).complete_at(5)  # unknown length
    assert RowSlice(length=8, start=8).empty and not RowSlice(start=8).empty


class ListSink:
    """The Sink methods the writer uses: rows in, commits counted."""

    rows_per_part = 3
    repairs = ()  # no damaged part to compute again

    def __init__(self):
        self.pending, self.parts = [], []
        self.kept_aside = []  # what save_ahead was given last

    def load_ahead(self):
        return []

    def save_ahead(self, rows):
        self.kept_aside = [r.pos for r in rows]

    def stored(self, task, outputs):
        from batchrun.output.sink import Counts, StoredRow

        return StoredRow(task.pos, task.index, repr(task.id), task.error, Counts(), [])

    def add_stored(self, row, *, write=True, earlier=False):
        if write:
            self.pending.append(row.pos)

    def open(self):
        from batchrun.output.sink import Counts

        return Counts(end=0)

    @property
    def pending_rows(self):
        return len(self.pending)

    def add(self, task, outputs, *, write=True):
        if write:
            self.pending.append(task.pos)

    def commit(self):
        if self.pending:
            self.parts.append(self.pending)
            self.pending = []


def task(pos, error=None):
    return RowTask(pos=pos, index=pos, id=pos, error=error)


def test_writer_puts_rows_back_in_order_and_commits_on_size_and_on_time():
    sink = ListSink()
    writer = OrderedWriter(sink, on_error="record", commit_interval_s=3600)
    assert writer.open() == 0
    writer.start()
    for pos in (2, 1, 4):
        writer.put(task(pos), [])
    assert writer.buffered == 3 and sink.parts == [] and sink.pending == []
    writer.put(task(0), [])
    assert sink.parts == [[0, 1, 2]] and sink.pending == [] and writer.buffered == 1  # 3 waits for row 3
    writer.put(task(3, error="bad"), None)
    assert sink.pending == [3, 4] and writer.next_pos == 5 and writer.errors == 1 and writer.peak_buffered == 4
    writer.tick()
    assert sink.pending == [3, 4]  # not yet due
    writer.commit_interval_s = 0
    writer.tick()
    assert sink.parts == [[0, 1, 2], [3, 4]]
    writer.finish()


def test_writer_stops_at_a_failing_row_keeping_the_rows_before_it():
    sink = ListSink()
    writer = OrderedWriter(sink, on_error="fail", commit_interval_s=3600)
    writer.put(task(1, error="bad"), None)
    writer.put(task(2), [])
    with pytest.raises(RowFailure, match="row 1 .*input.on_error: fail"):
        writer.put(task(0), [])
    writer.commit_finished()
    assert sink.parts == [[0]] and writer.next_pos == 1
    assert sink.kept_aside == [1, 2]  # the failing row and the one after it are kept for the rerun
    with pytest.raises(RowFailure, match="row 1"):  # the executor ending does not get past it
        writer.finish()


# ---------------------------------------------------------------- the engine protocol


def test_the_fakes_are_job_engines(monkeypatch):
    monkeypatch.setenv("BATCHRUN_TEST_ENGINE", "fake")  # PacedLLM over FakeLLM
    fake = FakeLLM("fake", max_num_seqs=2)
    assert isinstance(fake, JobEngine) and isinstance(PacedLLM("fake"), JobEngine)
    loop = EngineLoop(fake)
    p = SamplingParams(max_tokens=3)
    for pos in range(5):
        t = task(pos)
        t.prompt_ids, t.params = [0, 70 + pos], p
        loop.add(t)
        assert t.prompt_ids is None
    done = []
    while len(loop):
        done += loop.step()
    assert sorted(t.pos for t, _ in done) == list(range(5)) and not fake.has_unfinished()
    with pytest.raises(RuntimeError, match="engine is idle"):
        loop.in_flight["9"] = task(9)
        loop.step()


def _protocol_methods():
    return [name for name, member in vars(JobEngine).items()
            if callable(member) and not name.startswith("_")]


@pytest.mark.parametrize("name", _protocol_methods())
def test_llm_has_the_protocols_methods(name):
    want = inspect.signature(getattr(JobEngine, name))
    got = inspect.signature(getattr(LLM, name))
    required = [p.name for p in got.parameters.values() if p.default is p.empty]
    assert required == [p.name for p in want.parameters.values() if p.default is p.empty], (name, got)
    assert set(want.parameters) <= set(got.parameters), (name, got)  # the protocol's optional ones too


@pytest.mark.skipif(not real_engine_available(), reason="needs the real engine")
def test_llm_is_a_job_engine_and_steps_like_generate():
    llm = LLM("builtin:tiny-llama", num_kv_blocks=64, max_model_len=128)
    assert isinstance(llm, JobEngine)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [llm.tokenizer(f"the river number {i}").input_ids for i in range(4)]
    assert llm.check_prompt([]) == "empty prompt" and llm.check_prompt(prompts[0]) is None
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    for i, ids in enumerate(prompts):
        llm.add_request(f"row-{i}", ids, params)
    got = {}
    while llm.has_unfinished():
        got.update({out.request_id: out.outputs[0].token_ids for out in llm.step()})
    assert got == {f"row-{i}": ids for i, ids in enumerate(want)}


# ---------------------------------------------------------------- layers


def test_the_job_layer_imports_one_way():
    code = ("import sys\n"
            "import batchrun.pipeline, batchrun.pipeline.local\n"
            "assert not [m for m in sys.modules if m in ('batchrun.job', 'torch') or m.startswith('batchrun.distributed')]"
            ", sorted(m for m in sys.modules if m.startswith('batchrun'))\n"
            "import batchrun.distributed.ray_executor\n"
            "assert 'batchrun.job' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
