"""The runner's loop on the fake engine: a strictly bounded reorder buffer (input held back while the engine
steps), parts committed on time as well as on size, progress lines and engine gauges while no row
finishes."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
from test_job_fakes import FakeLLM, read_rows

from batchrun.config import parse_job
from batchrun.engine.metrics import EngineMetrics
from batchrun.job import plan_job, run_job
from batchrun.pipeline.local import LocalExecutor
from batchrun.progress import engine_gauges


def write_input(d, n):
    pq.write_table(pa.table({"id": list(range(n)), "prompt": [f"row {i} says hello" for i in range(n)]}),
                   d / "in.parquet", row_group_size=50)


def cfg_for(d, output="", engine="max_num_seqs: 4"):
    return parse_job(f"model: {{path: builtin:tiny-llama}}\ninput: {{path: {d / 'in.parquet'}}}\n"
                     f"output: {{path: {d / 'out'}{', ' + output if output else ''}}}\n"
                     f"sampling: {{max_tokens: 6}}\nengine: {{{engine}}}\n")


class SlowHeadLLM(FakeLLM):
    """Row 0 takes 300 steps, every other row 2: without a bound, all of them would wait behind row 0."""

    def request_steps(self, ids, params):
        return 300 if self.tokenizer.decode(ids).startswith("<s>row 0 ") else 2


def test_reorder_buffer_is_strictly_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalExecutor, "REORDER_FACTOR", 1)  # bound = max_in_flight = 64 rows
    write_input(tmp_path, 400)
    engines = []

    def factory(model, **kw):
        engines.append(SlowHeadLLM(model, **kw))
        return engines[-1]

    res = run_job(plan_job(cfg_for(tmp_path)), quiet=True, llm_factory=factory)
    assert res.exit_code == 0, res.message
    assert [r["id"] for r in read_rows(tmp_path / "out")] == list(range(400))
    peak = json.loads((tmp_path / "out" / "_metrics.json").read_text())["this_run"]["reorder_buffer_peak"]
    assert 32 <= peak <= 64  # it filled up behind row 0, and no further
    assert engines[0].max_seen_in_flight <= 64


def test_parts_are_committed_on_time_before_rows_per_part(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_FAKE_DELAY", "0.02")  # seconds per engine step
    write_input(tmp_path, 60)
    cfg = cfg_for(tmp_path, output="rows_per_part: 100000, commit_interval_s: 0.25")
    assert run_job(plan_job(cfg), quiet=True, llm_factory=FakeLLM).exit_code == 0
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    sizes = [pq.read_metadata(p).num_rows for p in parts]
    assert len(parts) >= 3 and sum(sizes) == 60  # ~1 s of work, a part every 0.25 s
    assert [r["id"] for r in read_rows(tmp_path / "out")] == list(range(60))


class AllSlowLLM(FakeLLM):
    def request_steps(self, ids, params):
        return 60


def test_progress_lines_keep_coming_while_no_row_finishes(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHRUN_FAKE_DELAY", "0.02")  # 60 steps: ~1.2 s before the first row finishes
    write_input(tmp_path, 3)
    with caplog.at_level(logging.INFO, logger="batchrun"):
        res = run_job(plan_job(cfg_for(tmp_path)), quiet=False, llm_factory=AllSlowLLM, progress_interval=0.2)
    assert res.exit_code == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    idle = [x for x in lines if x.startswith("progress: 0/3 rows")]
    assert len(idle) >= 3, lines  # a line every 0.2 s before any row is done
    assert "running 3, waiting 0, swapped 0" in idle[-1] and "KV" in idle[-1]


def test_the_engines_gauges_reach_the_progress_line():
    m = EngineMetrics(kv_blocks_total=100, kv_blocks_in_use=25, num_running=7, num_waiting=2, num_swapped=1)
    assert engine_gauges(m.as_dict()) == {"kv": 25.0, "running": 7, "waiting": 2, "swapped": 1}
