"""Jobs as a push pipeline: RowSlice -> Executor (local | Ray) -> finished rows, any order -> OrderedWriter -> Sink.

- `RowSlice` (slicing.py): which input rows are this run's (shard, --limit, resume).
- `Executor` (executor.py): runs a slice's rows through engines and pushes each finished row to a
  `RowReceiver`; `EngineLoop` drives one engine under an in-flight bound. `LocalExecutor` (local.py) is one
  engine in this process; the Ray one lives in batchrun.distributed.ray_executor.
- `OrderedWriter` (writer.py): reorder buffer (kept aside at commits and stops), sink, commit clock, signals.
- `PartPatcher` (patches.py): rows of committed parts computed again, rewritten into their parts in place.
- `JobEngine` (engine_api.py): what the pipeline needs from an engine; batchrun.llm.LLM satisfies it.

Nothing here imports batchrun.job, which picks the executor and runs the pieces.
"""

from batchrun.io.slicing import RowSlice
from batchrun.output.patches import PartPatcher
from batchrun.output.signals import Interrupts, JobInterrupted, JobStopped
from batchrun.output.writer import OrderedWriter, RowFailure
from batchrun.pipeline.engine_api import JobEngine
from batchrun.pipeline.executor import EngineLoop, Executor, RowReceiver, max_in_flight

__all__ = ["EngineLoop", "Executor", "Interrupts", "JobEngine", "JobInterrupted", "JobStopped", "OrderedWriter",
           "PartPatcher", "RowFailure", "RowReceiver", "RowSlice", "max_in_flight"]
