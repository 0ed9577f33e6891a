"""The two threads behind the API: one checks new batches' input, the other runs batches one at a time, in
order of creation, each as `batchrun.job.run_job` on its own job folder and the server's one engine.

Each status change is written to batch.json before the next step, so a restarted server carries on. A cancel,
the window's end or shutdown sets the job's `stop`; after a kill -9 the job resumes after its committed lines."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from batchrun.config import EngineSettings, JobError, validate_raw
from batchrun.job import EXIT_OK, EXIT_STOPPED, plan_job, run_job
from batchrun.pipeline.engine_api import JobEngine
from batchrun.serve import shapes
from batchrun.serve.checks import Checked, check_input
from batchrun.serve.finish import finish, progress
from batchrun.serve.options import ServeOptions
from batchrun.serve.source import CheckedBatchSource
from batchrun.serve.store import StateStore

log = logging.getLogger(__name__)

# A batch request's sampling defaults are OpenAI's (temperature 1, no length limit but the model's), with a
# seed per line (the job's seed + the line's index) so that a restarted batch draws the same tokens.
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": None, "seed": 0}
RUNNABLE = ("in_progress", "finalizing", "cancelling")


class CancelError(Exception):
    """The batch cannot be cancelled in its status (400)."""


class LoadedEngine:
    """A batch job's engine factory: the engine the server loaded at start (the job loads no model)."""

    loads_model = False  # batchrun.pipeline.local.LocalExecutor logs "loading model" only for a factory that does

    def __init__(self, engine: JobEngine) -> None:
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> JobEngine:
        return self.engine


class BatchRunner:
    def __init__(self, store: StateStore, settings: EngineSettings, engine: JobEngine,
                 options: ServeOptions) -> None:
        self.store, self.settings, self.engine, self.options = store, settings, engine, options
        self._checker_wake = threading.Event()
        self._runner_wake = threading.Event()
        self._stopping = False
        self._running: tuple[str, threading.Event] | None = None  # the batch the engine is on, its stop
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ the API's side

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._loop, args=(self._checker_wake, self._check_next),
                                          name="batchrun-checks", daemon=True),
                         threading.Thread(target=self._loop, args=(self._runner_wake, self._run_next),
                                          name="batchrun-runner", daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after committing the running batch's finished lines; it stays in_progress for the next start."""
        self._stopping = True
        with self.store.lock:
            if self._running is not None:
                self._running[1].set()
        self.notify()
        for t in self._threads:
            t.join(timeout)

    def notify(self) -> None:
        self._checker_wake.set()
        self._runner_wake.set()

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """validating / in_progress -> cancelling. The running batch stops within an engine step and the
        runner ends it; one still waiting for its turn is ended here and now (cancelled)."""
        with self.store.lock:  # the runner takes a batch under this lock: it is running, or it will see this
            status = self.store.batch(batch_id)["status"]
            if status in ("validating", "in_progress"):
                def change(record: dict[str, Any]) -> None:
                    record.update(status="cancelling", cancelling_at=shapes.now())

                record = self.store.update_batch(batch_id, change)
                log.info("batch %s: cancelling", batch_id)
                if self._running is not None and self._running[0] == batch_id:
                    self._running[1].set()
                else:
                    self._end(batch_id, "cancelled")
                    record = self.store.batch(batch_id)
            elif status in ("cancelling", "cancelled"):
                record = self.store.batch(batch_id)
            else:
                raise CancelError(f"cannot cancel a batch that is {status}")
        self.notify()
        return record

    # ------------------------------------------------------------ the threads

    def _loop(self, wake: threading.Event, work: Callable[[], bool]) -> None:
        while not self._stopping:
            wake.clear()
            try:
                busy = work()
            except Exception:  # noqa: BLE001 - a thread that dies would stall every batch after this one
                log.exception("internal error in %s", threading.current_thread().name)
                busy = False
                time.sleep(1.0)
            if not busy:
                wake.wait(1.0)

    def _oldest(self, statuses: tuple[str, ...]) -> dict[str, Any] | None:
        return next((b for b in self.store.batches() if b["status"] in statuses), None)

    def _check_next(self) -> bool:
        record = self._oldest(("validating",))
        if record is None:
            return False
        batch_id = record["id"]
        try:
            checked = check_input(self.store.input_path(batch_id), record["endpoint"])
            checked.save(self.store.checks_path(batch_id))
        except OSError as e:
            self._fail(batch_id, f"cannot read the input file: {e.strerror or e}")
            return True

        def change(r: dict[str, Any]) -> None:
            if r["status"] != "validating":  # cancelled meanwhile
                return
            r["request_counts"] = shapes.request_counts(checked.requests)
            if checked.requests == 0:
                r.update(status="failed", failed_at=shapes.now(), errors=shapes.batch_errors([
                    {"code": "empty_file", "message": "The input file has no requests.", "param": "input_file_id",
                     "line": None}]))
            else:
                r.update(status="in_progress", in_progress_at=shapes.now())

        record = self.store.update_batch(batch_id, change)
        log.info("batch %s: %d requests, %d with problems; %s", batch_id, checked.requests,
                 len(checked.problems), record["status"])
        self._runner_wake.set()
        return True

    def _run_next(self) -> bool:
        record = self._oldest(("validating", *RUNNABLE))
        if record is None or record["status"] == "validating":  # a batch runs only after those before it
            return False
        batch_id, status = record["id"], record["status"]
        try:
            if status == "cancelling":
                self._end(batch_id, "cancelled")
            elif status == "finalizing":
                self._end(batch_id, "completed")
            elif time.time() >= record["expires_at"]:
                self._end(batch_id, "expired")
            else:
                self._run(record)
        except Exception as e:  # noqa: BLE001 - a bug must not stall the batches behind this one
            log.exception("batch %s: internal error", batch_id)
            self._fail(batch_id, f"internal error: {type(e).__name__}: {e}")
        return True

    def _run(self, record: dict[str, Any]) -> None:
        batch_id = record["id"]
        stop = threading.Event()
        with self.store.lock:
            if self.store.batch(batch_id)["status"] != "in_progress":
                return  # cancelled since it was picked: the next turn ends it
            self._running = (batch_id, stop)
        expiry = threading.Timer(max(0.0, record["expires_at"] - time.time()), stop.set)
        expiry.daemon = True
        expiry.start()
        total, done = record["request_counts"]["total"], (progress(self.store.job_dir(batch_id)) or {}).get("end", 0)
        log.info("batch %s: running %d requests on the loaded model %s%s", batch_id, total - done,
                 self.settings.model["path"], f" ({done} of {total} done before)" if done else "")
        try:
            code, message = self._run_job(batch_id, stop)
        finally:
            expiry.cancel()
            with self.store.lock:
                self._running = None
        if self._stopping and code == EXIT_STOPPED:
            log.info("batch %s: stopped with the server; it resumes at the next start", batch_id)
            return
        if code == EXIT_OK:
            def change(r: dict[str, Any]) -> None:
                if r["status"] == "in_progress":
                    r.update(status="finalizing", finalizing_at=shapes.now())

            status = self.store.update_batch(batch_id, change)["status"]
            self._end(batch_id, "completed" if status == "finalizing" else "cancelled")
        elif code == EXIT_STOPPED:
            status = self.store.batch(batch_id)["status"]
            if status == "cancelling":
                self._end(batch_id, "cancelled")
            elif time.time() >= record["expires_at"]:
                self._end(batch_id, "expired")
        else:
            self._end(batch_id, "failed", message)

    def _run_job(self, batch_id: str, stop: threading.Event) -> tuple[int, str]:
        """The batch's job on the loaded engine: (exit code, message) as batchrun.job gives them."""
        store = self.store
        raw = {"model": dict(self.settings.model), "engine": dict(self.settings.engine),
               "input": {"path": str(store.input_path(batch_id)), "format": "openai-batch"},
               "output": {"path": str(store.job_dir(batch_id)), "rows_per_part": 1000,
                          "commit_interval_s": self.options.commit_interval_s},
               "sampling": dict(OPENAI_SAMPLING)}
        try:
            cfg = validate_raw(raw, source=f"batch {batch_id}")
            source = CheckedBatchSource(store.input_path(batch_id), Checked.load(store.checks_path(batch_id)))
            plan = plan_job(cfg, source=source)
            result = run_job(plan, quiet=True, llm_factory=LoadedEngine(self.engine), stop=stop)
        except JobError as e:
            return 1, str(e)
        return result.exit_code, result.message

    def _end(self, batch_id: str, outcome: str, message: str | None = None) -> None:
        """Write the result files and the batch's final status (again, after a crash: the same files)."""
        changes = finish(self.store, batch_id, outcome)

        def change(r: dict[str, Any]) -> None:
            r.update(changes, status=outcome, **{f"{outcome}_at": shapes.now()})
            if message is not None:
                r["errors"] = shapes.batch_errors([{"code": "batch_failed", "message": message, "param": None,
                                                    "line": None}])

        record = self.store.update_batch(batch_id, change)
        counts = record["request_counts"]
        log.info("batch %s: %s (%d completed, %d failed of %d)%s", batch_id, outcome, counts["completed"],
                 counts["failed"], counts["total"], f": {message}" if message else "")

    def _fail(self, batch_id: str, message: str) -> None:
        """Failed without result files: what could not even be read or finished."""
        def change(r: dict[str, Any]) -> None:
            r.update(status="failed", failed_at=shapes.now(), errors=shapes.batch_errors([
                {"code": "batch_failed", "message": message, "param": None, "line": None}]))

        self.store.update_batch(batch_id, change)
        log.error("batch %s: failed: %s", batch_id, message)
