"""drive(): a producer's rows into the writer. Whatever happens, every finished in-order row is committed: SIGINT /
SIGTERM end the run with 130 / 143, `stop` with 143, a row under `on_error: fail` or any other failure with 1."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol

from batchrun.config import JobError
from batchrun.io.slicing import RowSlice
from batchrun.model.errors import InsufficientMemoryError, ModelLoadError
from batchrun.output.files import SinkError, WriteFailure
from batchrun.output.signals import JobInterrupted, JobStopped
from batchrun.output.writer import OrderedWriter, RowFailure

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_JOB = 0, 1, 2
EXIT_STOPPED = 128 + signal.SIGTERM  # a run's `stop` was set: what SIGTERM gives (committed, a rerun resumes)


class RowProducer(Protocol):
    """What a run needs of an executor (batchrun.pipeline.executor.Executor)."""

    def run(self, rows: RowSlice, receiver: OrderedWriter) -> None: ...
    def close(self) -> None: ...
    def metrics(self) -> dict[str, Any]: ...
    def progress_metrics(self) -> dict[str, Any]: ...


def drive(producer: RowProducer, rows: RowSlice, writer: OrderedWriter) -> tuple[int, str]:
    """(exit code, message): EXIT_OK and "" when every row is written."""
    code, message = EXIT_OK, ""
    with writer.signals():
        try:
            producer.run(rows, writer)
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
            _quietly(writer, producer.close, "shut the executor down")
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


def _one_line(e: BaseException) -> str:
    """A failure as one short line (Ray's errors carry whole remote tracebacks)."""
    first = (str(e).strip().splitlines() or [""])[0][:500]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
