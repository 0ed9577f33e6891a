"""Timing of a benchmark's timed part, and memory figures: standard library only, so the workers of systems that
live in other virtualenvs (vLLM's) measure exactly as batchrun's and transformers' do."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def rss_mb() -> float:
    """Resident set size now (VmRSS), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), in MiB.

    Not ru_maxrss: Linux keeps it across execve, so a worker started by the orchestrator would report at least the
    orchestrator's own peak (its tokenizers, a checkpoint it made). ru_maxrss (KiB) only where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall time of a timed part, and how busy the rest of the machine was meanwhile.

    other_load = CPU seconds that other processes used during the part (the machine's busy time from
    /proc/stat less this process's own) / (wall seconds x cores). Near 0 on a quiet machine; on a shared one
    OpenMP threads that lose their core stall each other, and a run can be several times slower than alone, so a
    high figure flags a noisy row. cpu_share (this process's CPU seconds / (wall x threads)) is kept too; it is
    low also for systems whose serial Python leaves a thread idle, so it does not flag noise by itself.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.wall_s = self.cpu_s = 0.0
        self.machine_busy_s: float | None = None

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    @staticmethod
    def _machine_busy() -> float | None:
        """Seconds of CPU time all processes have used since boot (every core), or None off Linux."""
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Clock:
        self.loadavg = os.getloadavg()[0]
        self._m, self._c, self._t = self._machine_busy(), self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t
        self.cpu_s = self._cpu() - self._c
        m = self._machine_busy()
        self.machine_busy_s = m - self._m if m is not None and self._m is not None else None

    def as_dict(self) -> dict[str, float | None]:
        cores = os.cpu_count() or 1
        other = None
        if self.machine_busy_s is not None and self.wall_s:
            # /proc/stat counts in clock ticks (10 ms): clamp what rounding does to a short part
            other = min(1.0, max(0.0, self.machine_busy_s - self.cpu_s) / (self.wall_s * cores))
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "loadavg_1m_before": self.loadavg, "other_load": other,
                "cpu_share": self.cpu_s / (self.wall_s * self.threads) if self.wall_s else float("nan")}


def best_of(runs: list[Result], walls_key: str = "repeat_walls_s") -> Result:
    """The fastest of repeated runs (other load only ever slows a run down), with every run's wall time under
    walls_key."""
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    best[walls_key] = [r["wall_s"] for r in runs]
    return best
