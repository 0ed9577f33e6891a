"""OutputRun: one run's rows into its folder, under its lock with the status read again there: the folder prepared,
the writer opened, rows driven (drive.py), `_metrics.json` at the end of every run, `_SUCCESS` last when whole.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.io.slicing import RowSlice
from batchrun.output.drive import EXIT_FAILED, EXIT_OK, RowProducer, drive
from batchrun.output.files import SinkError, WriteFailure, write_bytes_atomic, write_json_atomic
from batchrun.output.folder import METRICS, SUCCESS, prepare_folder
from batchrun.output.metrics import engine_metrics, run_metrics
from batchrun.output.state import OutputStatus, OutputTarget, held, make_sink
from batchrun.output.writer import OrderedWriter
from batchrun.progress import Progress
from batchrun.timeseries import TimeSeries

log = logging.getLogger(__name__)


@dataclass
class RunSettings:
    on_error: str  # input.on_error: record | skip | fail
    commit_interval_s: float
    total: int | None  # rows the shard covers (after --limit), when known
    limit: int | None  # --limit
    job_record: dict[str, Any]  # `_job.json`
    about: dict[str, Any]  # what `_metrics.json` says of the job (model, executor, shard)
    quiet: bool = False
    progress_interval: float | None = None
    stop: threading.Event | None = None


@dataclass
class RunResult:
    exit_code: int
    out_dir: Path
    message: str
    counts: dict[str, int] = field(default_factory=dict)


class OutputRun:
    def __init__(self, target: OutputTarget, status: OutputStatus, *, resume: bool, retry_errors: bool) -> None:
        self.target, self.status = target, status
        self.resume, self.retry_errors = resume, retry_errors
        self.out_dir = target.out_dir

    def already_complete(self) -> RunResult:
        return RunResult(EXIT_OK, self.out_dir, f"{self.out_dir} is already complete ({self.status.committed} input "
                         "rows); nothing to do (--no-resume starts it afresh)")

    def run(self, producer: RowProducer, rows: RowSlice, settings: RunSettings) -> RunResult:
        """Raises JobError for a bad job that only shows once the model is there, and for a folder another run
        holds; every other failure is the result's exit code and message."""
        if self.status.state == "complete" and not self.status.unrecorded:
            return self.already_complete()
        out = self.out_dir
        try:
            with held(self.target, self.status, resume=self.resume, retry_errors=self.retry_errors) as status:
                self.status = status
                if status.state == "complete":
                    if status.unrecorded:  # a lost manifest: record the parts' checksums as they are now
                        try:
                            make_sink(self.target, status).open()
                        except WriteFailure as e:
                            return RunResult(EXIT_FAILED, out, str(e))
                    return self.already_complete()
                for note in status.notes:
                    log.warning("%s", note)
                prepare_folder(out, status.state, bool(status.damaged), settings.job_record)
                return self._run(producer, rows, settings)
        except WriteFailure as e:
            return RunResult(EXIT_FAILED, out, f"{e}; nothing was run")

    def _run(self, producer: RowProducer, rows: RowSlice, settings: RunSettings) -> RunResult:
        out = self.out_dir
        t0 = time.monotonic()
        retry = self.status.state == "retry"
        series = TimeSeries(start=t0)

        def make_progress(initial: int) -> Progress:
            total = len(redo) if retry else settings.total
            return Progress(total=total, initial=0 if retry else initial - len(redo) + len(writer.ahead),
                            quiet=settings.quiet, metrics=producer.progress_metrics,
                            interval=settings.progress_interval)

        def sample_series(now: float) -> None:
            series.maybe_sample(now, writer.done_rows, producer.progress_metrics, writer.generated_tokens)

        sink = make_sink(self.target, self.status)
        writer = OrderedWriter(sink, on_error=settings.on_error, commit_interval_s=settings.commit_interval_s,
                               make_progress=make_progress, on_tick=sample_series, stop=settings.stop)
        try:
            start = writer.open(retry_errors=retry)
        except SinkError as e:
            return RunResult(EXIT_FAILED, out, f"{e}; nothing was run")
        redo = writer.redo  # positions of committed parts computed again (it empties as they come back)
        if retry:
            sink.check_columns()
            log.info("retrying %d rows with an error in %s", len(redo), out)
        elif start:
            log.info("resuming %s after %d committed input rows", out, start)
        rows = rows.resumed(start, redo=redo, ahead=writer.ahead, new_rows=not retry)
        errors_before = sink.committed.errors
        code, message = drive(producer, rows, writer)
        complete = code == EXIT_OK and (retry or rows.complete_at(writer.next_pos))
        engine = engine_metrics(producer)
        try:
            write_json_atomic(out / METRICS, run_metrics(
                writer, engine, settings.about, wall_s=time.monotonic() - t0, complete=complete,
                series=series.finish(writer.done_rows, engine, writer.generated_tokens)))
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
                message = (f"wrote {counts['output_rows']} rows to {out} (stopped at --limit {settings.limit}; a "
                           "rerun without it continues)")
        else:
            aside = f" and {len(writer.buffer)} finished after them kept aside" if writer.buffer else ""
            message = f"{message}; {counts['input_rows']} input rows committed in {out}{aside} (a rerun resumes)"
        return RunResult(code, out, message, counts)
