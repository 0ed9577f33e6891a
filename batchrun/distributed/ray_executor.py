"""The Ray executor (`executor: {kind: ray}`): the job's engines spread over a Ray cluster by Ray Data.

Ray Data reads the input -> the ordered Indexer (row indices, this run's slice) -> `map_batches(EngineReplica)`
on `replicas` actors -> the driver takes the results in input order (`preserve_order`) and puts them to the
job's OrderedWriter: the same parts and resume as locally (why not `write_parquet`: docs/cluster.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any

from batchrun.config import JobError
from batchrun.distributed.workers import CALLS, GEN, METRICS, POS, REPLICA, RESULT, EngineReplica, Indexer
from batchrun.io.rows import input_columns
from batchrun.io.slicing import RowSlice
from batchrun.pipeline.engine_api import LLM_FACTORY_ENV
from batchrun.pipeline.executor import Executor, RowReceiver

if TYPE_CHECKING:
    from batchrun.plan import JobPlan

log = logging.getLogger(__name__)

# Gauges a replica reports at the end of a batch, when its engine is idle: meaningless summed over time.
_SNAPSHOT_GAUGES = ("num_running", "num_waiting", "num_swapped", "kv_blocks_in_use")


class RayExecutor(Executor):
    def __init__(self, plan: JobPlan, factory: Any = None) -> None:
        """factory: a picklable callable that builds each replica's engine (None: $BATCHRUN_LLM_FACTORY, else LLM)."""
        self.plan, self.cfg, self.ex = plan, plan.cfg, plan.cfg.executor
        self.factory = factory
        self.replica_metrics: dict[str, dict[str, Any]] = {}
        self.owns_ray = False
        self.ray: Any = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.generation: str | None = None

    # -------------------------------------------------------- cluster

    def _connect(self, receiver: RowReceiver) -> None:
        import ray

        self.ray = ray
        if ray.is_initialized():  # a Python caller brought its own Ray: use it, leave it running
            return
        address = self.ex["address"]
        common = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        try:
            if address is None:
                # logical CPUs are tokens: one per replica plus one for Ray Data's reads, else it can deadlock
                need = math.ceil(self.ex["replicas"] * self.ex["num_cpus_per_replica"]) + 1
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), **common)
            else:
                ray.init(address=address, **common)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise JobError(f"executor.address: cannot start or join Ray at {address or 'a local instance'}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        self.owns_ray = True
        receiver.reclaim_signals()  # ray.init installs its own SIGTERM handler; ours commits first
        self._check_resources()

    def _check_resources(self) -> None:
        res = self.ray.cluster_resources()
        cpus = self.ex["replicas"] * self.ex["num_cpus_per_replica"]
        gpus = self.ex["replicas"] * self.ex["num_gpus_per_replica"]
        if gpus > res.get("GPU", 0):
            log.warning("the Ray cluster has %g GPUs, the job asks for %g (%d replicas x %g): replicas wait "
                        "until the cluster grows", res.get("GPU", 0), gpus, self.ex["replicas"],
                        self.ex["num_gpus_per_replica"])
        if cpus >= res.get("CPU", 0):
            log.warning("the Ray cluster has %g CPUs and the replicas take %g: Ray Data needs some left "
                        "for reading (lower executor.num_cpus_per_replica)", res.get("CPU", 0), cpus)
        log.info("Ray cluster: %g CPUs, %g GPUs; %d replicas", res.get("CPU", 0), res.get("GPU", 0),
                 self.ex["replicas"])

    # -------------------------------------------------------- pipeline

    def _read(self, rows: RowSlice, columns: list[str] | None) -> tuple[Any, int, bool]:
        """(Ray dataset of the input, global index of its first row, whether rows are JSONL lines)."""
        import ray.data

        src = self.plan.source
        if src.format == "parquet":
            files, start = self._parquet_files(rows)
            ds = ray.data.read_parquet(files, file_extensions=None, partitioning=None)
            return (ds if columns is None else ds.select_columns(columns)), start, False
        if src.format in ("jsonl", "openai-batch"):
            files = [os.path.abspath(f) for f in src.files]
            return ray.data.read_binary_files(files, include_paths=True, file_extensions=None), 0, True
        return self._from_huggingface(rows, src.ds.select_columns(columns) if columns is not None else src.ds)

    def _from_huggingface(self, rows: RowSlice, hf: Any) -> tuple[Any, int, bool]:
        """`ray.data.from_huggingface` without its Hub lookup, which needs the network and may swap in the Hub's
        Parquet export, whose rows need not be the ones the local executor reads."""
        import datasets
        import ray.data

        if isinstance(hf, datasets.IterableDataset):  # a streamed load_dataset: read as a stream
            try:
                from ray.data._internal.datasource.huggingface_datasource import HuggingFaceDatasource
            except ImportError:
                return ray.data.from_huggingface(hf), 0, False
            return ray.data.read_datasource(HuggingFaceDatasource(dataset=hf)), 0, False
        # A saved dataset: only this run's rows (resume, shard, --limit) go into Ray's object store.
        first, stop = rows.index_range()
        return ray.data.from_arrow(hf.with_format("arrow")[first:stop]), first, False

    def _parquet_files(self, rows: RowSlice) -> tuple[list[str], int]:
        """The files holding this run's rows (no others are read), and the global index of the first one's start."""
        src = self.plan.source
        first, last = rows.index_range()
        files, start, offset = [], None, 0
        for f, groups in zip(src.files, src._row_groups):
            n = sum(groups)
            if offset + n > first and (last is None or offset < last):
                if start is None:
                    start = offset
                files.append(os.path.abspath(f))
            offset += n
        return files, start or 0

    def _dataset(self, rows: RowSlice) -> Any:
        import ray.data

        plan, cfg, ex = self.plan, self.cfg, self.ex
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # results reach the driver in input order
        ctx.enable_progress_bars = False  # batchrun's own progress line covers the job ...
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # ... say so only once
        columns = input_columns(cfg, plan.source.format, plan.id_column)
        ds, start, text = self._read(rows, columns)
        # One actor, one call at a time, never restarted: it sees the blocks in order, so its counter is
        # the row index. Reading is fused into it; it needs no CPU of its own.
        ds = _map_indexer(ds, dict(start=start, rows=rows, text=text))
        ds = ds.repartition(target_num_rows_per_block=ex["batch_size"])  # so blocks spread over replicas
        model = dict(cfg.model)
        if not model["path"].startswith("builtin:") and os.path.exists(model["path"]):
            model["path"] = os.path.abspath(model["path"])  # replicas may start in another directory
        replica = dict(cfg=dataclasses.replace(cfg, model=model), source_format=plan.source.format,
                       id_column=plan.id_column, factory=self.factory or os.environ.get(LLM_FACTORY_ENV),
                       data_columns=columns,
                       parser=plan.source if text else None)
        # The job's own settings travel with it to every node (model cache, test hooks, HF offline mode).
        env = {k: v for k, v in os.environ.items() if k.startswith(("BATCHRUN_", "HF_"))}
        return ds.map_batches(EngineReplica, fn_constructor_kwargs=replica, batch_format="pyarrow",
                              batch_size=ex["batch_size"], compute=ray.data.ActorPoolStrategy(size=ex["replicas"]),
                              num_cpus=ex["num_cpus_per_replica"], num_gpus=ex["num_gpus_per_replica"] or None,
                              runtime_env={"env_vars": env} if env else None, zero_copy_batch=True)

    def _tick_progress(self, receiver: RowReceiver) -> None:
        """In a thread: progress while a batch generates (commits happen as blocks arrive, on the main thread)."""
        while not self.stop.wait(0.5):
            receiver.tick_progress()

    # -------------------------------------------------------- run

    def run(self, rows: RowSlice, receiver: RowReceiver) -> None:
        if rows.empty:
            return
        self._connect(receiver)
        ds = self._dataset(rows)
        log.info("running on Ray: %d replicas x (%g CPU, %g GPU), batch_size %d", self.ex["replicas"],
                 self.ex["num_cpus_per_replica"], self.ex["num_gpus_per_replica"], self.ex["batch_size"])
        receiver.start()
        self.thread = threading.Thread(target=self._tick_progress, args=(receiver,), name="batchrun-progress",
                                       daemon=True)
        self.thread.start()
        # Iterated on the main thread: SIGTERM / SIGINT interrupt it there, which unwinds Ray Data's
        # iterator and stops the pipeline before Ray itself is shut down.
        blocks = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1)
        pos = rows.next_wanted(rows.first)  # the next position due back (None: none left)
        try:
            for block in blocks:
                pos = self._take(block, pos, rows, receiver)
                receiver.tick()
                if pos is None:
                    return
            if rows.short_at(pos):
                raise RuntimeError(f"Ray returned rows up to input position {pos} of {rows.end}; what came back "
                                   "is committed, and a rerun resumes")
        except Exception as e:  # noqa: BLE001 - re-raised, unwrapped from Ray's remote traceback
            cause = _remote_failure(e)
            if cause is e:
                raise
            raise cause from e
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()

    def _take(self, block: Any, pos: int | None, rows: RowSlice, receiver: RowReceiver) -> int | None:
        """One block of results, in input order, to the receiver; returns the next position due."""
        for got, gen, payload in zip(block.column(POS).to_pylist(), block.column(GEN).to_pylist(),
                                     block.column(RESULT).to_pylist()):
            if self.generation is None:
                self.generation = gen
            if gen != self.generation:
                raise RuntimeError("the Ray actor numbering the rows restarted (its node failed?); every row "
                                   "before it is committed and a rerun resumes")
            if got != pos:
                raise RuntimeError(f"internal error: Ray returned input position {got} where {pos} was due; "
                                   "nothing after the last committed row was written")
            task, outputs = pickle.loads(payload)
            receiver.put(task, outputs)
            pos = rows.next_wanted(got + 1)
        for name, text in zip(block.column(REPLICA).to_pylist(), block.column(METRICS).to_pylist()):
            if text is not None:
                m = json.loads(text)
                if m[CALLS] > self.replica_metrics.get(name, {}).get(CALLS, 0):
                    self.replica_metrics[name] = m
        return pos

    def metrics(self) -> dict[str, Any]:
        """The replicas' engine metrics: counters summed, fractions averaged, peaks the largest one's."""
        per = list(self.replica_metrics.values())
        out: dict[str, Any] = {"replicas_used": len(per)}
        for key in sorted({k for m in per for k in m if k != CALLS}):
            values = [m[key] for m in per if isinstance(m.get(key), (int, float))]
            if not values:
                continue
            if "fraction" in key or "utilization" in key:
                out[key] = sum(values) / len(values)
            elif key.startswith("peak_") or key.endswith("per_token"):
                out[key] = max(values)  # a peak of one replica; a property of the model
            else:
                out[key] = sum(values)
        return out

    def progress_metrics(self) -> dict[str, Any]:
        return {k: v for k, v in self.metrics().items() if k not in _SNAPSHOT_GAUGES}

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        if self.owns_ray and self.ray is not None:
            self.ray.shutdown()  # every replica and actor this run started goes with it


def _map_indexer(ds: Any, kwargs: dict[str, Any]) -> Any:
    """The Indexer stage, never restarted (it would count from the start again): max_restarts=0 where Ray Data still
    takes it, else RayExecutor._take's generation check catches a restart."""
    import ray.data

    args = dict(fn_constructor_kwargs=kwargs, batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return ds.map_batches(Indexer, max_restarts=0, **args)
    except TypeError:
        return ds.map_batches(Indexer, **args)


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")


def _remote_failure(e: BaseException) -> BaseException:
    """Ray wraps a worker's exception (RayTaskError, UserCodeException) around the remote traceback text,
    where the original is the first exception line that is not Ray's own: report that one."""
    if not type(e).__module__.startswith("ray."):
        return e
    for line in str(e).splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and not m.group(1).startswith("ray.") and m.group(1) not in ("UserCodeException", "RayTaskError"):
            return RuntimeError(f"a Ray worker failed: {m.group(1)}: {m.group(2)}")
    return e
