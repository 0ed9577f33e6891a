"""run_job(): source -> engine -> sink, for one validated job (or one shard of it).

plan_job() (batchrun.plan) does every check that needs no model (input readable, columns present, model path, output
writable, resume state) and raises JobError (exit 2) on the first problem. run_job() then loads the model,
streams the input through `LLM.stream` with a bounded number of requests in flight, puts the finished rows
back in input order, and commits them in parts. SIGINT / SIGTERM stop the run after committing every row
that is finished and in order (exit 130 / 143); any other failure commits the same and exits 1.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.config import JobError
from batchrun.io.rows import RequestBuilder, RowTask
from batchrun.io.sinks import JOB_FILE, METRICS, SUCCESS, SinkError, clear_output, write_json_atomic
from batchrun.model.errors import ModelLoadError
from batchrun.plan import JobPlan, ShardSpec, describe_plan, make_sink, plan_job, probe_output_dir
from batchrun.progress import Progress
from batchrun.timeseries import TimeSeries

__all__ = ["run_job", "plan_job", "describe_plan", "ShardSpec", "JobPlan", "RunResult", "JobInterrupted",
           "RowFailure"]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_JOB = 0, 1, 2
# Dev / test hook: "module:callable" used instead of batchrun.llm.LLM to build the engine.
LLM_FACTORY_ENV = "BATCHRUN_LLM_FACTORY"


class RowFailure(RuntimeError):
    """A row error under on_error: fail (exit 1, rows before it committed)."""


class JobInterrupted(BaseException):
    """SIGINT / SIGTERM arrived (exit 128 + signal number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ---------------------------------------------------------------- signals


class Interrupts:
    """SIGINT / SIGTERM raise JobInterrupted, except inside `deferred()` sections (commits), where they
    are remembered and raised when the section ends."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.depth = 0
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.depth == 0:
            raise JobInterrupted(self.signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        except ValueError:  # not the main thread: leave signals alone
            self._old.clear()
        try:
            yield
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old.clear()

    def reinstall(self) -> None:
        """Take SIGINT / SIGTERM back after a library replaced the handlers (ray.init does)."""
        for sig in self._old:
            signal.signal(sig, self._handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.signum is not None:
            raise JobInterrupted(self.signum)


# ---------------------------------------------------------------- the run


@dataclass
class RunResult:
    exit_code: int
    out_dir: Path
    message: str
    counts: dict[str, int] = field(default_factory=dict)


def default_llm_factory() -> Callable[..., Any]:
    spec = os.environ.get(LLM_FACTORY_ENV)
    if spec:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr or "LLM")
    from batchrun.llm import LLM

    return LLM


def run_job(plan: JobPlan, *, quiet: bool = False, llm_factory: Callable[..., Any] | None = None,
            progress_interval: float | None = None) -> RunResult:
    """Run a planned job. Returns the exit code and a one-line summary; raises JobError for a bad job
    that only shows once the model is there (e.g. messages with a tokenizer lacking a chat template)."""
    out = plan.out_dir
    if plan.state == "complete":
        return RunResult(EXIT_OK, out, f"{out} is already complete ({plan.committed} input rows); nothing to do "
                         "(--no-resume starts it afresh)")
    probe_output_dir(out)
    if plan.state == "fresh":
        clear_output(out)
    write_json_atomic(out / JOB_FILE, {"fingerprint": plan.fingerprint, "fingerprint_hash": plan.fp_hash,
                                       "job": plan.cfg.source, "executor": plan.cfg.executor["kind"],
                                       "slice": {"lo": plan.lo, "hi": plan.hi, "strided": plan.strided}})
    if plan.cfg.executor["kind"] == "ray":
        from batchrun.distributed.ray_executor import RayRun

        return RayRun(plan, llm_factory, quiet=quiet, progress_interval=progress_interval).run()
    factory = llm_factory or default_llm_factory()
    return _Run(plan, factory, quiet=quiet, progress_interval=progress_interval).run()


class _Run:
    """One run of a planned job on the local engine. The Ray executor (batchrun.distributed) subclasses it
    and replaces only `_execute`, so both share the reorder buffer, the sink, commits, signals and metrics."""

    REORDER_FACTOR = 4  # rows finished or in flight but not yet committable: at most this x max_in_flight

    def __init__(self, plan: JobPlan, factory: Callable[..., Any] | None, *, quiet: bool,
                 progress_interval: float | None) -> None:
        self.plan, self.cfg = plan, plan.cfg
        self.factory = factory
        self.quiet = quiet
        self.progress_interval = progress_interval
        self.sink = make_sink(plan)
        self.interrupts = Interrupts()
        self.on_error = self.cfg.input["on_error"]
        self.buffer: dict[int, tuple[RowTask, list[Any] | None]] = {}  # reorder buffer: pos -> result
        self.inflight: dict[int, RowTask] = {}
        self.max_in_flight = max(2 * self.cfg.engine["max_num_seqs"], 64)
        self.reorder_limit = self.REORDER_FACTOR * self.max_in_flight
        self.peak_buffered = 0
        self.commit_interval = float(self.cfg.output["commit_interval_s"])
        self.last_commit = time.monotonic()
        self.next_pos = 0
        self.exhausted = False  # the input (or this shard of it) has been read to its end
        self.done_rows = self.errors = self.gen_tokens = 0
        self.llm: Any = None
        self.progress: Progress | None = None
        self.t0 = time.monotonic()
        self.series = TimeSeries(start=self.t0)

    # -------------------------------------------------------- input side

    def _end_pos(self) -> int | None:
        """One past the last position this run may reach (--limit, or the shard's length); None: the end."""
        plan = self.plan
        end_pos = plan.limit
        if plan.hi is not None and not plan.strided:
            shard_len = plan.hi - plan.lo
            end_pos = shard_len if end_pos is None else min(end_pos, shard_len)
        return end_pos

    def _reached_end(self, pos: int) -> bool:
        """After stopping at position `pos` == _end_pos(): is that the end of the input (or shard)?"""
        plan = self.plan
        return plan.limit is None or (plan.hi is not None and not plan.strided and pos >= plan.hi - plan.lo)

    def _positions(self) -> Iterator[list[tuple[int, int, dict]]]:
        """Batches of (pos, global index, row) from the first uncommitted position on."""
        plan = self.plan
        start_pos = self.next_pos
        end_pos = self._end_pos()
        if end_pos is not None and start_pos >= end_pos:
            self.exhausted = self._reached_end(start_pos)
            return
        columns = self.builder.columns()
        pos = start_pos
        if plan.strided:
            shard = plan.shard
            first = shard.index + start_pos * shard.count
            index = first
            for rows in plan.source.iter_rows(first, columns):
                batch = []
                for row in rows:
                    if (index - shard.index) % shard.count == 0:
                        batch.append((pos, index, row))
                        pos += 1
                        if end_pos is not None and pos >= end_pos:
                            break
                    index += 1
                if batch:
                    yield batch
                if end_pos is not None and pos >= end_pos:
                    return
            self.exhausted = True
            return
        index = plan.lo + start_pos
        for rows in plan.source.iter_rows(index, columns):
            if end_pos is not None:
                rows = rows[:end_pos - pos]
            batch = [(pos + i, index + i, row) for i, row in enumerate(rows)]
            pos += len(rows)
            index += len(rows)
            if batch:
                yield batch
            if end_pos is not None and pos >= end_pos:
                self.exhausted = self._reached_end(pos)
                return
        self.exhausted = True

    def _items(self) -> Iterator[tuple[int, dict, Any] | None]:
        """What the engine pulls, once per engine step: (pos, {"prompt_token_ids"}, SamplingParams), or
        None ("nothing now, keep stepping") while max_in_flight rows are in the engine or the reorder
        buffer is full. Being asked every step is also the loop's clock: timed commits and progress lines
        happen here even while no row finishes. Error rows go straight to the reorder buffer."""
        for batch in self._positions():
            for task in self.builder.build(batch):
                self.tick()
                # In flight rows can all finish behind a slow one: they count against the buffer's bound.
                while (len(self.inflight) >= self.max_in_flight
                       or len(self.buffer) + len(self.inflight) >= self.reorder_limit):
                    yield None  # the oldest row is in flight (else the buffer would drain): stepping frees room
                    self.tick()
                if task.error is not None:
                    self._finished(task, None)
                    continue
                ids = task.prompt_ids
                task.prompt_ids = None
                self.inflight[task.pos] = task
                yield task.pos, {"prompt_token_ids": ids}, task.params
        while self.inflight:  # the input is read: keep the clock running until the last row is back
            yield None
            self.tick()

    # -------------------------------------------------------- output side

    def _finished(self, task: RowTask, outputs: list[Any] | None) -> None:
        self.done_rows += 1
        if outputs is None:
            self.errors += 1
        else:
            self.gen_tokens += sum(len(o.token_ids) for o in outputs)
        if self.progress is not None:
            self.progress.update(self.done_rows, self.gen_tokens, self.errors)
        with self.interrupts.deferred():
            self.buffer[task.pos] = (task, outputs)
            self.peak_buffered = max(self.peak_buffered, len(self.buffer))
            self._drain()

    def _drain(self) -> None:
        while self.next_pos in self.buffer:
            task, outputs = self.buffer.pop(self.next_pos)
            if task.error is not None and self.on_error == "fail":
                self.buffer[self.next_pos] = (task, outputs)
                raise RowFailure(f"row {task.index} (id {task.id!r}): {task.error} (input.on_error: fail)")
            self.sink.add(task, outputs, write=task.error is None or self.on_error == "record")
            self.next_pos += 1
            if self.sink.pending_rows >= self.sink.rows_per_part:
                self._commit()
        if self.sink.pending_rows and time.monotonic() - self.last_commit >= self.commit_interval:
            self._commit()

    def _commit(self) -> None:
        self.sink.commit()
        self.last_commit = time.monotonic()

    def tick(self) -> None:
        """Called often (every engine step): commits finished rows after commit_interval_s even when
        rows_per_part is far off, so a SIGKILL loses at most that much work; and keeps progress alive."""
        now = time.monotonic()
        if self.sink.pending_rows and now - self.last_commit >= self.commit_interval:
            with self.interrupts.deferred():
                self._commit()
        if self.progress is not None:
            self.progress.tick(now)
        self.series.maybe_sample(now, self.done_rows, self._engine_metrics, self.gen_tokens)

    def _commit_all(self) -> None:
        with self.interrupts.deferred():
            try:
                self._drain()
            except RowFailure:
                pass
            self._commit()

    # -------------------------------------------------------- main

    def _start_progress(self, metrics: Callable[[], dict[str, Any]]) -> None:
        self.progress = Progress(total=self.plan.total, initial=self.next_pos, quiet=self.quiet, metrics=metrics,
                                 interval=self.progress_interval)
        self.last_commit = time.monotonic()  # the commit clock starts when rows can start to finish

    def _execute(self) -> None:
        """Load the engine and stream every row of this run through it (the local executor)."""
        cfg, plan = self.cfg, self.plan
        log.info("loading model %s", cfg.model["path"])
        try:
            self.llm = self.factory(cfg.model["path"], **cfg.llm_kwargs())
        except ModelLoadError as e:  # e.g. a .gguf of an unsupported architecture: a bad job, exit 2
            raise JobError(f"model.path: {e}") from None
        self.builder = RequestBuilder(cfg, source_format=plan.source.format, tokenizer=self.llm.tokenizer,
                                      check_prompt=self.llm.check_prompt, id_column=plan.id_column)
        self._start_progress(self.llm.metrics)
        # One more than our own bound: the engine keeps asking every step, and _items answers None when full.
        for key, out in self.llm.stream(self._items(), max_in_flight=self.max_in_flight + 1):
            task = self.inflight.pop(key)
            self._finished(task, list(out.outputs))

    def _engine_metrics(self) -> dict[str, Any]:
        return dict(self.llm.metrics()) if self.llm is not None else {}

    def _shutdown(self) -> None:
        """Release what _execute started (the Ray executor stops its cluster work here)."""

    def run(self) -> RunResult:
        plan = self.plan
        committed = self.sink.open()
        self.next_pos = committed.end
        if committed.end:
            log.info("resuming %s after %d committed input rows", plan.out_dir, committed.end)
        code, message = EXIT_OK, ""
        with self.interrupts.installed():
            try:
                self._execute()
                self._commit_all()
                if self.buffer or self.inflight:
                    raise RuntimeError(f"internal error: {len(self.buffer)} rows unwritten and {len(self.inflight)} "
                                       "unanswered after the engine finished")
            except JobInterrupted as e:
                self._safe_commit()
                code = 128 + e.signum
                message = f"interrupted by {signal.Signals(e.signum).name}"
            except RowFailure as e:
                self._safe_commit()
                code, message = EXIT_FAILED, str(e)
            except JobError:
                self._safe_commit()
                raise
            except Exception as e:  # noqa: BLE001 - any failure: keep what is done, report, exit 1
                self._safe_commit()
                code = EXIT_FAILED
                message = _one_line(e)
                if not isinstance(e, (SinkError, NotImplementedError)):
                    log.error("the run failed", exc_info=True)
            finally:
                self._quietly(self._shutdown, "shut the executor down")
                if self.progress is not None:
                    self.progress.close()
        complete = code == EXIT_OK and self.exhausted
        self._write_metrics(complete)
        counts = self.sink.committed.as_dict()
        if code == EXIT_OK:
            if complete:
                (plan.out_dir / SUCCESS).write_text("")
                message = (f"wrote {counts['output_rows']} rows ({counts['row_errors']} row errors) "
                           f"to {plan.out_dir}")
            else:
                message = (f"wrote {counts['output_rows']} rows to {plan.out_dir} (stopped at --limit "
                           f"{plan.limit}; a rerun without it continues)")
        else:
            message = f"{message}; {counts['input_rows']} input rows committed in {plan.out_dir} (a rerun resumes)"
        return RunResult(code, plan.out_dir, message, counts)

    def _safe_commit(self) -> None:
        self._quietly(self._commit_all, "commit the finished rows")

    def _quietly(self, fn: Callable[[], None], what: str) -> None:
        """fn() with signals held off (a second Ctrl-C must not cut it short); a failure is logged, since
        the run's first failure is what gets reported."""
        self.interrupts.depth += 1
        try:
            fn()
        except JobInterrupted:
            pass
        except Exception:  # noqa: BLE001
            log.error("could not %s", what, exc_info=True)
        finally:
            self.interrupts.depth -= 1

    def _write_metrics(self, complete: bool) -> None:
        wall = time.monotonic() - self.t0
        run, ex = self.sink.this_run, self.cfg.executor

        def rate(n: int) -> float | None:
            return round(n / wall, 2) if wall > 0 else None

        try:
            engine = self._engine_metrics()
        except Exception:  # noqa: BLE001
            engine = {}
            log.warning("the engine metrics are unavailable", exc_info=True)
        metrics = {
            **self.sink.committed.as_dict(), "complete": complete, "wall_time_s": round(wall, 3),
            "generated_tokens_per_s": rate(run.completion_tokens),
            "this_run": {**run.as_dict(), "input_rows": self.sink.committed.end - self.plan.committed,
                         "wall_time_s": round(wall, 3), "generated_tokens_per_s": rate(run.completion_tokens),
                         "prompt_tokens_per_s": rate(run.prompt_tokens), "reorder_buffer_peak": self.peak_buffered},
            "engine": engine, "model": self.cfg.model["path"],
            "executor": {"kind": ex["kind"], **({"replicas": ex["replicas"]} if ex["kind"] == "ray" else {})},
            "shard": str(self.plan.shard) if self.plan.shard else None,
            "series": self.series.finish(self.done_rows, engine, self.gen_tokens),
        }
        try:
            write_json_atomic(self.plan.out_dir / METRICS, metrics)
        except OSError:
            log.error("could not write %s", self.plan.out_dir / METRICS, exc_info=True)


def _one_line(e: BaseException) -> str:
    """A failure as one short line (Ray's errors carry whole remote tracebacks)."""
    first = (str(e).strip().splitlines() or [""])[0][:500]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
