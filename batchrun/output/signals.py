"""SIGINT / SIGTERM as an exception the run can catch, held off while rows are being committed."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class JobInterrupted(BaseException):
    """SIGINT / SIGTERM arrived (exit 128 + signal number). A BaseException, so that no `except Exception`
    on the way (a library's, or the run's own failure handling) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobStopped(BaseException):
    """run_job's `stop` event was set (batchrun serve cancelling a batch, or shutting down): as SIGTERM."""


class Interrupts:
    """SIGINT / SIGTERM raise JobInterrupted, except in `deferred()` sections (commits: raised at their end) and
    `held()` ones (clean-up after a failure: only remembered, so a second Ctrl-C cannot cut it short)."""

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

    def reinstall(self) -> None:  # after a library replaced the handlers (ray.init does)
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

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
