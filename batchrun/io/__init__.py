"""Job input and output: streaming sources, row -> request preparation, ordered resumable sinks."""

from batchrun.io.openai_sink import OpenAIBatchSink
from batchrun.io.sinks import OutputSpec, ParquetSink
from batchrun.io.sources import Source, infer_format, open_source

__all__ = ["Source", "open_source", "infer_format", "ParquetSink", "OpenAIBatchSink", "OutputSpec"]
