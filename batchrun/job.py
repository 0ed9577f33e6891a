"""run_job(): one planned job (or one shard of it): the executor the job asks for, its rows into the output.

plan_job() (batchrun.plan) does every check that needs no model and raises JobError (exit 2) on the first problem.
run_job() picks the executor (local, or Ray for `executor.kind: ray`) and hands it to the output's run
(batchrun.output.run), which pushes the finished rows, in any order, into ordered parts of atomic files."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from batchrun.output.drive import EXIT_BAD_JOB, EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from batchrun.output.run import OutputRun, RunResult, RunSettings
from batchrun.output.writer import RowFailure
from batchrun.pipeline.engine_api import LLM_FACTORY_ENV, engine_factory
from batchrun.pipeline.executor import Executor
from batchrun.pipeline.local import LocalExecutor
from batchrun.plan import JobPlan, ShardSpec, describe_plan, plan_job

__all__ = ["run_job", "plan_job", "describe_plan", "ShardSpec", "JobPlan", "RunResult", "RowFailure",
           "LLM_FACTORY_ENV", "EXIT_OK", "EXIT_FAILED", "EXIT_BAD_JOB", "EXIT_STOPPED"]


def run_job(plan: JobPlan, *, quiet: bool = False, llm_factory: Callable[..., Any] | None = None,
            progress_interval: float | None = None, stop: threading.Event | None = None) -> RunResult:
    """Run a planned job. Returns the exit code and a one-line summary; raises JobError for a bad job that only
    shows once the model is there (e.g. messages with a tokenizer lacking a chat template), and for an output
    folder another run holds.

    stop: set from another thread, it ends the run within an engine step as SIGTERM would (EXIT_STOPPED, the
    finished rows committed). batchrun serve cancels batches with it, and runs them all on one loaded engine
    through `llm_factory`."""
    settings = _settings(plan, quiet=quiet, progress_interval=progress_interval, stop=stop)
    executor = make_executor(plan, llm_factory)
    rows = plan.row_slice(0)
    output = OutputRun(plan.output, plan.status, resume=plan.resume, retry_errors=plan.retry_errors)
    result = output.run(executor, rows, settings)
    plan.status = output.status
    return result


def make_executor(plan: JobPlan, llm_factory: Callable[..., Any] | None) -> Executor:
    """The executor the job asks for. llm_factory: what builds an engine (default: $BATCHRUN_LLM_FACTORY, else
    batchrun.llm.LLM); the Ray executor sends it to its replicas (None: they resolve the default there)."""
    if plan.cfg.executor["kind"] == "ray":
        from batchrun.distributed.ray_executor import RayExecutor

        return RayExecutor(plan, llm_factory)
    return LocalExecutor(plan, llm_factory or engine_factory())


def _settings(plan: JobPlan, **run: Any) -> RunSettings:
    cfg = plan.cfg
    inp = dict(cfg.input)
    if os.path.exists(inp["path"]):
        inp["path"] = os.path.abspath(inp["path"])  # verify may run from another folder
    shard = plan.shard
    # `_job.json`: what the committed rows were made with (a rerun compares), and how to read the input again
    # (`batchrun verify` checks the ids against it)
    record = {"fingerprint": plan.output.fingerprint, "fingerprint_hash": plan.output.fp_hash, "job": cfg.source,
              "executor": cfg.executor["kind"], "input": inp, "id_column": plan.id_column,
              "slice": {"lo": plan.lo, "hi": plan.hi, "strided": plan.strided,
                        "index": shard.index if shard else 0, "count": shard.count if shard else 1},
              "earlier_fingerprints": sorted(plan.status.accepted)}
    ex = cfg.executor
    about = {"model": cfg.model["path"],
             "executor": {"kind": ex["kind"], **({"replicas": ex["replicas"]} if ex["kind"] == "ray" else {})},
             "shard": str(shard) if shard else None}
    return RunSettings(on_error=cfg.input["on_error"], commit_interval_s=float(cfg.output["commit_interval_s"]),
                       total=plan.total, limit=plan.limit, job_record=record, about=about, **run)
