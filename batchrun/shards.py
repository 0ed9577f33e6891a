"""`--shard I/N` and `--shard auto`: which slice of the input this task of a job array processes. `auto` reads the
index and size from the scheduler's variables (docs/cluster.md has the table); PBS and Kubernetes give no size, so
the job sets BATCHRUN_SHARD_COUNT, and their indices must start at 0."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from batchrun.config import JobError

log = logging.getLogger(__name__)

COUNT_ENV = "BATCHRUN_SHARD_COUNT"


@dataclass(frozen=True)
class ShardSpec:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str | None, env: Mapping[str, str] | None = None) -> ShardSpec | None:
        if text is None:
            return None
        env = os.environ if env is None else env
        if text == "auto":
            index, count, source = from_scheduler(env)
            spec = cls._checked(index, count, f"auto ({source})")
            log.info("shard %s from %s", spec, source)
            return spec
        i, sep, n = text.partition("/")
        try:
            return cls._checked(int(i), int(n), text) if sep else cls._checked(-1, 0, text)
        except ValueError:
            raise JobError(f"--shard {text}: expected I/N (0 <= I < N) or auto") from None

    @classmethod
    def _checked(cls, index: int, count: int, text: str) -> ShardSpec:
        if count < 1 or not 0 <= index < count:
            if text.startswith("auto"):
                raise JobError(f"--shard {text}: task index {index} of {count} tasks is not in 0..{count - 1} "
                               "(arrays of PBS and Kubernetes must start at 0)")
            raise JobError(f"--shard {text}: expected I/N with 0 <= I < N, or auto")
        return cls(index, count)

    @property
    def dirname(self) -> str:
        width = len(str(self.count - 1))
        return f"shard-{self.index:0{width}d}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def from_scheduler(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(index, count, where they came from) of the job array this process is a task of; JobError if none."""

    def number(name: str, default: int | None = None) -> int:
        value = env.get(name)
        if value is None and default is not None:
            return default
        try:
            return int(value)
        except (TypeError, ValueError):
            raise JobError(f"--shard auto: {name}={value!r} is not an integer") from None

    def count_for(index_name: str) -> int:
        if COUNT_ENV not in env:
            raise JobError(f"--shard auto: {index_name} is set but not the number of tasks: set {COUNT_ENV} "
                           "(for a Kubernetes Indexed Job, to its completions)")
        return number(COUNT_ENV)

    if "SLURM_ARRAY_TASK_ID" in env:
        if "SLURM_ARRAY_TASK_COUNT" not in env:
            raise JobError("--shard auto: SLURM_ARRAY_TASK_ID is set but not SLURM_ARRAY_TASK_COUNT")
        step = number("SLURM_ARRAY_TASK_STEP", 1)
        offset = number("SLURM_ARRAY_TASK_ID") - number("SLURM_ARRAY_TASK_MIN", 0)
        return offset // max(step, 1), number("SLURM_ARRAY_TASK_COUNT"), "SLURM_ARRAY_TASK_ID"
    if env.get("SGE_TASK_ID", "undefined") != "undefined":  # SGE sets "undefined" outside arrays
        first, last = number("SGE_TASK_FIRST", 1), number("SGE_TASK_LAST", number("SGE_TASK_ID"))
        step = max(number("SGE_TASK_STEPSIZE", 1), 1)
        return (number("SGE_TASK_ID") - first) // step, (last - first) // step + 1, "SGE_TASK_ID"
    for name in ("PBS_ARRAY_INDEX", "PBS_ARRAYID", "JOB_COMPLETION_INDEX"):
        if name in env:
            return number(name), count_for(name), name
    if "AWS_BATCH_JOB_ARRAY_INDEX" in env:
        size = "AWS_BATCH_JOB_ARRAY_SIZE" if "AWS_BATCH_JOB_ARRAY_SIZE" in env else COUNT_ENV
        if size not in env:
            count_for("AWS_BATCH_JOB_ARRAY_INDEX")
        return number("AWS_BATCH_JOB_ARRAY_INDEX"), number(size), "AWS_BATCH_JOB_ARRAY_INDEX"
    if "BATCHRUN_SHARD_INDEX" in env:
        return number("BATCHRUN_SHARD_INDEX"), count_for("BATCHRUN_SHARD_INDEX"), "BATCHRUN_SHARD_INDEX"
    raise JobError("--shard auto: not inside a job array (none of SLURM_ARRAY_TASK_ID, SGE_TASK_ID, "
                   "PBS_ARRAY_INDEX, PBS_ARRAYID, JOB_COMPLETION_INDEX, AWS_BATCH_JOB_ARRAY_INDEX, "
                   "BATCHRUN_SHARD_INDEX is set); use --shard I/N")
