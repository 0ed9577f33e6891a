"""run_job(): one planned job (or one shard of it) through the pipeline: RowSlice -> Executor -> OrderedWriter.

plan_job() (batchrun.plan) does every check that needs no model (input readable, columns present, model path,
output writable, resume state) and raises JobError (exit 2) on the first problem. run_job() then picks the
executor (local, or Ray for `executor.kind: ray`), which generates this run's rows and pushes them, finished,
to the OrderedWriter, which writes them in input order and commits them in parts. SIGINT / SIGTERM stop the
run after committing every row that is finished and in order (exit 130 / 143); any other failure commits the
same and exits 1. `_metrics.json` is written at the end of every run, by `write_metrics`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.config import JobError
from batchrun.output.files import SinkError, WriteFailure, remove_file, write_bytes_atomic, write_json_atomic
from batchrun.output.lock import OutputBusy, OutputLock
from batchrun.output.sinks import JOB_FILE, METRICS, SUCCESS, Sink, clear_output
from batchrun.model.errors import InsufficientMemoryError, ModelLoadError
from batchrun.pipeline.engine_api import LLM_FACTORY_ENV, engine_factory
from batchrun.pipeline.executor import Executor
from batchrun.pipeline.local import LocalExecutor
from batchrun.output.signals import JobInterrupted, JobStopped
from batchrun.io.slicing import RowSlice
from batchrun.output.writer import OrderedWriter, RowFailure
from batchrun.plan import (
    JobPlan,
    ShardSpec,
    describe_plan,
    make_sink,
    plan_job,
    plan_resume,
    probe_output_dir,
)
from batchrun.progress import Progress
from batchrun.timeseries import TimeSeries

__all__ = ["run_job", "plan_job", "describe_plan", "ShardSpec", "JobPlan", "RunResult", "JobInterrupted",
           "RowFailure", "LLM_FACTORY_ENV"]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_JOB = 0, 1, 2
EXIT_STOPPED = 128 + signal.SIGTERM  # run_job(stop=...) was set: what SIGTERM gives (committed, a rerun resumes)


@dataclass
class RunResult:
    exit_code: int
    out_dir: Path
    message: str
    counts: dict[str, int] = field(default_factory=dict)


def make_executor(plan: JobPlan, llm_factory: Callable[..., Any] | None) -> Executor:
    """The executor the job asks for. llm_factory: what builds an engine (default: $BATCHRUN_LLM_FACTORY, else
    batchrun.llm.LLM); the Ray executor sends it to its replicas (None: they resolve the default there)."""
    if plan.cfg.executor["kind"] == "ray":
        from batchrun.distributed.ray_executor import RayExecutor

        return RayExecutor(plan, llm_factory)
    return LocalExecutor(plan, llm_factory or engine_factory())


def run_job(plan: JobPlan, *, quiet: bool = False, llm_factory: Callable[..., Any] | None = None,
            progress_interval: float | None = None, stop: threading.Event | None = None) -> RunResult:
    """Run a planned job. Returns the exit code and a one-line summary; raises JobError for a bad job
    that only shows once the model is there (e.g. messages with a tokenizer lacking a chat template), and for
    an output folder another run holds.

    stop: set from another thread, it ends the run within an engine step as SIGTERM would (EXIT_STOPPED,
    the finished rows committed). batchrun serve cancels batches with it, and runs them all on one loaded
    engine through `llm_factory`."""
    if plan.state == "complete" and not plan.unrecorded:
        return _already_complete(plan)
    probe_output_dir(plan.out_dir)
    try:
        lock = OutputLock(plan.out_dir, "run")
        lock.acquire()
    except OutputBusy as e:
        raise JobError(f"output.path: {e}") from None
    except WriteFailure as e:
        return RunResult(EXIT_FAILED, plan.out_dir, f"{e}; nothing was run")
    try:
        plan_resume(plan)  # again, now that no other run writes the folder: it may have moved on since the plan
        if plan.state == "complete":
            if plan.unrecorded:  # a lost manifest: record the parts' checksums as they are now
                try:
                    make_sink(plan).open()
                except WriteFailure as e:
                    return RunResult(EXIT_FAILED, plan.out_dir, str(e))
            return _already_complete(plan)
        return _run_locked(plan, quiet=quiet, llm_factory=llm_factory, progress_interval=progress_interval,
                           stop=stop)
    finally:
        lock.release()


def _already_complete(plan: JobPlan) -> RunResult:
    return RunResult(EXIT_OK, plan.out_dir, f"{plan.out_dir} is already complete ({plan.committed} input rows); "
                     "nothing to do (--no-resume starts it afresh)")


def _run_locked(plan: JobPlan, *, quiet: bool, llm_factory: Callable[..., Any] | None,
                progress_interval: float | None, stop: threading.Event | None) -> RunResult:
    out = plan.out_dir
    for note in plan.notes:
        log.warning("%s", note)
    try:
        if plan.state == "fresh":
            clear_output(out)
        if plan.damaged:  # not complete until the damaged parts are computed again
            remove_file(out / SUCCESS)
        write_json_atomic(out / JOB_FILE, _job_record(plan))
    except WriteFailure as e:
        return RunResult(EXIT_FAILED, out, f"{e}; nothing was run")
    t0 = time.monotonic()
    executor = make_executor(plan, llm_factory)
    retry = plan.state == "retry"

    def make_progress(initial: int) -> Progress:
        total = len(redo) if retry else plan.total
        return Progress(total=total, initial=0 if retry else initial - len(redo) + len(writer.ahead), quiet=quiet,
                        metrics=executor.progress_metrics, interval=progress_interval)

    series = TimeSeries(start=t0)

    def sample_series(now: float) -> None:
        series.maybe_sample(now, writer.done_rows, executor.progress_metrics, writer.generated_tokens)

    sink = make_sink(plan)
    writer = OrderedWriter(sink, on_error=plan.cfg.input["on_error"],
                           commit_interval_s=float(plan.cfg.output["commit_interval_s"]), make_progress=make_progress,
                           on_tick=sample_series, stop=stop)
    try:
        start = writer.open(retry_errors=retry)
    except SinkError as e:
        return RunResult(EXIT_FAILED, out, f"{e}; nothing was run")
    redo = writer.redo
    if retry:
        _check_retry_columns(sink)
        log.info("retrying %d rows with an error in %s", len(redo), out)
    elif start:
        log.info("resuming %s after %d committed input rows", out, start)
    rows = RowSlice.of_plan(plan, start, redo=redo, ahead=writer.ahead, new_rows=not retry)
    errors_before = sink.committed.errors
    code, message = _execute(executor, rows, writer)
    complete = code == EXIT_OK and (retry or rows.complete_at(writer.next_pos))
    engine = _quiet_metrics(executor)
    try:
        write_metrics(plan, writer, engine, wall_s=time.monotonic() - t0, complete=complete,
                      series=series.finish(writer.done_rows, engine, writer.generated_tokens))
        if complete:
            write_bytes_atomic(out / SUCCESS, b"")  # last: only a complete output with its metrics has it
    except WriteFailure as e:
        if code == EXIT_OK:
            code, message = EXIT_FAILED, str(e)
        else:
            log.error("%s", e)  # the run's own failure is what gets reported
    counts = sink.committed.as_dict()
    if code == EXIT_OK and retry:
        fixed = errors_before - sink.committed.errors
        message = (f"retried {len(redo)} rows with an error in {out}: {fixed} now without, "
                   f"{counts['row_errors']} row errors left")
    elif code == EXIT_OK:
        if complete:
            message = f"wrote {counts['output_rows']} rows ({counts['row_errors']} row errors) to {out}"
        else:
            message = (f"wrote {counts['output_rows']} rows to {out} (stopped at --limit {plan.limit}; a rerun "
                       "without it continues)")
    else:
        aside = f" and {len(writer.buffer)} finished after them kept aside" if writer.buffer else ""
        message = f"{message}; {counts['input_rows']} input rows committed in {out}{aside} (a rerun resumes)"
    return RunResult(code, out, message, counts)


def _job_record(plan: JobPlan) -> dict[str, Any]:
    """`_job.json`: what the committed rows were made with (a rerun compares), and how to read the input
    again (`batchrun verify` checks the ids against it)."""
    inp = dict(plan.cfg.input)
    if os.path.exists(inp["path"]):
        inp["path"] = os.path.abspath(inp["path"])  # verify may run from another folder
    return {"fingerprint": plan.fingerprint, "fingerprint_hash": plan.fp_hash, "job": plan.cfg.source,
            "executor": plan.cfg.executor["kind"], "input": inp, "id_column": plan.id_column,
            "slice": {"lo": plan.lo, "hi": plan.hi, "strided": plan.strided,
                      "index": plan.shard.index if plan.shard else 0, "count": plan.shard.count if plan.shard else 1},
            "earlier_fingerprints": sorted(plan.accepted)}


def _check_retry_columns(sink: Sink) -> None:
    """A job fixed before --retry-errors may ask for other output columns: the output keeps its own."""
    schema = getattr(sink, "schema", None)
    if schema is None:
        return
    wanted, have = sink.column_names(), schema.names
    added = [c for c in wanted if c not in have]
    if added:
        log.warning("--retry-errors: the output has no column %s (written before the job asked for it); the "
                    "retried rows keep the output's columns", ", ".join(added))


def _execute(executor: Executor, rows: RowSlice, writer: OrderedWriter) -> tuple[int, str]:
    """Run the executor into the writer. Whatever happens, every finished in-order row is committed."""
    code, message = EXIT_OK, ""
    with writer.signals():
        try:
            executor.run(rows, writer)
            writer.finish()
        except JobInterrupted as e:
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            code, message = 128 + e.signum, f"interrupted by {signal.Signals(e.signum).name}"
        except JobStopped:
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            code, message = EXIT_STOPPED, "stopped"
        except RowFailure as e:
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            code, message = EXIT_FAILED, str(e)
        except JobError:
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            raise
        except ModelLoadError as e:  # found only when it loads (e.g. a .gguf of an unsupported architecture)
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            # a model that does not fit the memory: the line names the model and the settings itself
            raise JobError(str(e) if isinstance(e, InsufficientMemoryError) else f"model.path: {e}") from None
        except SinkError as e:  # a write failed, or the output cannot take a row: one line, no traceback
            if not isinstance(e, WriteFailure):  # after a failed write, writing again would only fail again
                _quietly(writer, writer.commit_finished, "commit the finished rows")
            code, message = EXIT_FAILED, str(e)
        except Exception as e:  # noqa: BLE001 - any failure: keep what is done, report, exit 1
            _quietly(writer, writer.commit_finished, "commit the finished rows")
            code, message = EXIT_FAILED, _one_line(e)
            if not isinstance(e, NotImplementedError):
                log.error("the run failed", exc_info=True)
        finally:
            _quietly(writer, executor.close, "shut the executor down")
            writer.close()
    return code, message


def _quietly(writer: OrderedWriter, fn: Callable[[], None], what: str) -> None:
    """fn() with signals held off (a second Ctrl-C must not cut it short); a failure is logged, since
    the run's first failure is what gets reported."""
    with writer.held():
        try:
            fn()
        except JobInterrupted:
            pass
        except WriteFailure as e:
            log.error("could not %s: %s", what, e)
        except Exception:  # noqa: BLE001
            log.error("could not %s", what, exc_info=True)


def _quiet_metrics(executor: Executor) -> dict[str, Any]:
    try:
        return executor.metrics()
    except Exception:  # noqa: BLE001 - the metrics file is written whatever the engine's state
        log.warning("the engine metrics are unavailable", exc_info=True)
        return {}


def write_metrics(plan: JobPlan, writer: OrderedWriter, engine: dict[str, Any], *, wall_s: float,
                  complete: bool, series: dict[str, Any] | None = None) -> None:
    """`_metrics.json`: what is committed (all runs), what this run did, the engine's own metrics, and the
    run's time series (batchrun.timeseries, drawn by `batchrun report`)."""
    sink, ex = writer.sink, plan.cfg.executor
    run = sink.this_run

    def rate(n: int) -> float | None:
        return round(n / wall_s, 2) if wall_s > 0 else None

    metrics = {
        **sink.committed.as_dict(), "complete": complete, "wall_time_s": round(wall_s, 3),
        "generated_tokens_per_s": rate(run.completion_tokens),
        "this_run": {**run.as_dict(), "input_rows": run.inputs,
                     "wall_time_s": round(wall_s, 3), "generated_tokens_per_s": rate(run.completion_tokens),
                     "prompt_tokens_per_s": rate(run.prompt_tokens), "reorder_buffer_peak": writer.peak_buffered},
        "engine": engine, "model": plan.cfg.model["path"],
        "executor": {"kind": ex["kind"], **({"replicas": ex["replicas"]} if ex["kind"] == "ray" else {})},
        "shard": str(plan.shard) if plan.shard else None,
        "series": series,
    }
    write_json_atomic(plan.out_dir / METRICS, metrics)


def _one_line(e: BaseException) -> str:
    """A failure as one short line (Ray's errors carry whole remote tracebacks)."""
    first = (str(e).strip().splitlines() or [""])[0][:500]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
