"""Job input and output: streaming sources, row -> request preparation, ordered resumable sinks."""

from batchrun.io.sinks import OpenAIBatchSink, OutputSpec, ParquetSink
from batchrun.io.sources import Source, infer_format, open_source

__all__ = ["Source", "open_source", "infer_format", "ParquetSink", "OpenAIBatchSink", "OutputSpec"]
